"""The program that runs inside the sandbox: sets the limits, then runs a program or grades one.

This file is not imported by treadle: its source is sent to `python -I -S -c` inside the
sandbox and executed in a private globals dict (with a private copy of the builtins), so it
must stay standard-library only and run on any Python 3.9 or later. The payload (JSON) comes on
stdin, which is then replaced by /dev/null.

`run` mode sets the rlimits and executes the program as `__main__`, nothing more.

`grade` mode runs a solution and then the steps of a tests file (prepared outside by
`treadle.sandbox.grading`) and reports every top-level `assert` on a side channel. The verdict
must not be forgeable by the program it grades, which runs in this same process, so:

- **Authenticated reports.** Every report line carries a keyed BLAKE2b MAC of its text; the key
  comes in the payload and is never written anywhere. Printing "passed", writing fake lines to
  any file descriptor, or redirecting the channel to read what the harness writes (a MAC binds
  one message) gives the program nothing that the supervisor will accept.
- **No report is implied.** A test passes only when its own "pass" line arrives; the total is
  counted outside from the tests file. `sys.exit(0)`, `os._exit(0)`, killing itself, a
  `SystemExit` from `__del__`: the missing lines count as failures.
- **Asserts are never executed as `assert`.** Each is a lambda over the assert's expression,
  compiled before the solution runs; redefining `AssertionError`, `__debug__` or running with
  `-O` changes nothing. The lambda's comparisons (`==`, `<`, `in`, ... anywhere in the
  expression except inside a nested `lambda`), `not`, `and`/`or` and `if`-`else` go through
  the harness's strict operators: built-in values (numbers, strings, bytes, None, and lists,
  tuples, dicts, sets of those) are compared without calling any method the program could have
  defined; values of different types are unequal (numbers aside); two objects of one other type
  compare with their own `__eq__`, which must return True itself. Only built-in values have a
  truth value (`not`, `and`, `or`, `if` on another object raise), and the assert's value must be
  a built-in value that is true. An object whose `__eq__` or `__bool__` always says yes does not
  pass.
- **A namespace of the tests' own.** Tests run in their own globals dict, with a snapshot of
  the builtins taken before the solution ran (a program that patches `builtins.sorted` does not
  patch the tests' `sorted`); their top-level imports run before the solution and are bound to
  copies of the modules' namespaces. Before each step the builtins and imports are restored and
  the solution's top-level names are copied in (never over a name the tests bind, a builtin or a
  dunder).
- **The harness is out of reach.** The solution and the tests run on a thread of their own,
  whose outer frames are the harness's. An audit hook (which Python code cannot remove),
  installed before the solution runs, refuses every way to reach a frame
  (`sys._getframe`, `sys._current_frames`, `tb_frame`, `gi_frame`, `cr_frame`, `ag_frame`),
  trace and profile hooks, `gc.get_objects/referrers/referents`, `ctypes`, more audit hooks,
  setting a function's `__code__`. The sandbox has no `/proc`, and the process is made
  non-dumpable, so neither it nor its children can read its memory. The
  harness defines no classes (they would be reachable from `object.__subclasses__()`) and calls
  only functions it captured before the solution ran.

What this does not cover (see docs/sandbox.md): a hole in CPython's introspection surface that
the hook does not know; a test that hands one of its own functions or lambdas to the program,
which exposes that function's globals (the tests' namespace, restored only between steps);
arithmetic or other operators on the program's objects before a comparison
(`abs(f(x) - y) < 1e-9`), truthiness inside calls such as `all(...)`; and classes of other
modules that the program patches before a same-type comparison.
"""

from __future__ import annotations

import builtins
import json
import os
import sys
from hashlib import blake2b
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    Report = Callable[..., None]
    Step = tuple[str, int, Any]  # (kind, index, a compiled lambda or code object)

# Captured before any untrusted code runs: the harness calls only these after that.
_write = os.write
_exit = os._exit
_name_of = type.__dict__["__name__"].__get__
_exit_code = SystemExit.__dict__["code"].__get__
_PRISTINE = dict(vars(builtins))

_NUM, _ATOM, _SEQ, _SET, _DICT = "num", "atom", "seq", "set", "dict"
# Exact built-in types, by id: looking a type up by identity runs no code a metaclass defines.
_KIND = {
    **{id(t): _NUM for t in (bool, int, float, complex)},
    **{id(t): _ATOM for t in (str, bytes, type(None), range)},
    **{id(t): _SEQ for t in (list, tuple)},
    **{id(t): _SET for t in (set, frozenset)},
    id(dict): _DICT,
}
_NODE_BUDGET = 10_000_000  # values visited by one comparison at most

_DENIED_EVENTS = frozenset(
    {
        "sys._getframe",
        "sys._current_frames",
        "sys._current_exceptions",
        "sys.settrace",
        "sys.setprofile",
        "sys.addaudithook",
        "sys.monitoring.register_callback",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
    }
)
_FRAME_ATTRIBUTES = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
_DENIED_MODULES = frozenset(
    {"ctypes", "_ctypes", "_testcapi", "_testinternalcapi", "_xxsubinterpreters"}
)


def apply_limits(limits: dict[str, int]) -> None:
    """Set the rlimits (name -> soft limit; the CPU's hard limit is one second more)."""
    import resource

    for name, soft in limits.items():
        hard = soft + 1 if name == "RLIMIT_CPU" else soft
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _read_payload() -> dict[str, Any]:
    payload = json.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return payload  # type: ignore[no-any-return]


# --- the strict operators -----------------------------------------------------------------


def _kind(value: Any) -> str | None:
    return _KIND.get(id(type(value)))


def _plain(value: Any) -> bool:
    """Whether `value` is built-in data all the way down (comparing it runs no user code)."""
    stack, seen = [value], 0
    while stack:
        item = stack.pop()
        kind = _kind(item)
        if kind is None or seen > _NODE_BUDGET:
            return False
        seen += 1
        if kind in (_SEQ, _SET):
            stack.extend(item)
        elif kind == _DICT:
            stack.extend(item.keys())
            stack.extend(item.values())
    return True


def _equal(left: Any, right: Any) -> bool:
    """`left == right` for built-in data without calling the program's methods (see above)."""
    pairs, seen = [(left, right)], 0
    while pairs:
        a, b = pairs.pop()
        seen += 1
        if seen > _NODE_BUDGET or not (a is b or _equal_step(a, b, pairs)):
            return False
    return True


def _equal_step(a: Any, b: Any, pairs: list[tuple[Any, Any]]) -> bool:
    """Whether `a` may equal `b`; their elements still to compare go on `pairs`."""
    ka, kb = _kind(a), _kind(b)
    if type(a) is not type(b) and not ka == kb == _NUM:
        return False
    if ka is None or ka in (_NUM, _ATOM):  # not built-in: the one type's own __eq__ decides
        return (a == b) is True
    if ka == _SET:
        return _plain(a) and _plain(b) and a == b
    if ka == _SEQ:
        pairs.extend(zip(a, b))  # noqa: B905 (zip(strict=) needs Python 3.10)
        return len(a) == len(b)
    keys_a, keys_b = list(a.keys()), list(b.keys())
    if not (_plain(keys_a) and _plain(keys_b) and a.keys() == b.keys()):
        return False
    pairs.extend((a[k], b[k]) for k in keys_a)
    return True


_ORDERS = {
    "Lt": lambda a, b: a < b,
    "LtE": lambda a, b: a <= b,
    "Gt": lambda a, b: a > b,
    "GtE": lambda a, b: a >= b,
}


def _order(op: str, a: Any, b: Any) -> bool:
    if _plain(a) and _plain(b):
        return _ORDERS[op](a, b) is True
    return type(a) is type(b) and _kind(a) is None and _ORDERS[op](a, b) is True


def _contains(item: Any, container: Any) -> bool:
    if _plain(item) and _plain(container):
        return (item in container) is True
    if _kind(container) in (_SEQ, _SET, _DICT):
        return any(_equal(item, element) for element in container)
    return False


def _compare(op: str, a: Any, b: Any) -> bool:
    if op in ("Eq", "NotEq"):
        return _equal(a, b) is (op == "Eq")
    if op in ("Is", "IsNot"):
        return (a is b) is (op == "Is")
    if op in ("In", "NotIn"):
        return _contains(a, b) is (op == "In")
    return _order(op, a, b)


def _truth(value: Any) -> bool:
    """A built-in value's truth; any other object is not true (its `__bool__` is not asked)."""
    return _kind(value) is not None and bool(value)


def _decided(value: Any) -> bool:
    """The truth of a value inside an expression: an object that is not built-in has none."""
    if _kind(value) is None:
        raise TypeError(f"a test needs a built-in value here, not a {_name_of(type(value))}")
    return bool(value)


def _strict(kind: str, *args: Any) -> Any:
    """The operators the rewritten assert calls: cmp, not, and, or, bool (see grading.py)."""
    if kind == "cmp":
        ops, left, rights = args
        for op, right in zip(ops, rights):  # noqa: B905
            if not _compare(op, left, right):
                return False
            left = right
        return True
    if kind == "not":
        return not _decided(args[0])
    if kind == "bool":
        return _decided(args[0])
    value = None
    for thunk in args[0]:  # and / or: the values as thunks, for short-circuiting
        value = thunk()
        if _decided(value) is (kind == "or"):
            return value
    return value


# --- sealing the process ------------------------------------------------------------------


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in _DENIED_EVENTS or event.startswith("ctypes."):
        raise (ValueError if event == "sys._getframe" else RuntimeError)(
            f"{event} is not allowed while grading"
        )
    if event == "object.__getattr__" and args[1] in _FRAME_ATTRIBUTES:
        raise RuntimeError(f"{args[1]} is not allowed while grading")
    if event == "object.__setattr__" and args[1] == "__code__":
        raise RuntimeError("setting __code__ is not allowed while grading")
    if event == "import" and args[0] in _DENIED_MODULES:
        raise ImportError(f"{args[0]} is not allowed while grading")


def _seal() -> None:
    """Non-dumpable (no reading this process's memory from outside), then the audit hook."""
    import ctypes

    if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 4
        raise OSError("prctl(PR_SET_DUMPABLE, 0) failed")
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]
    sys.addaudithook(_audit)


# --- grading ------------------------------------------------------------------------------


def _reporter(fd: int, key: bytes) -> Report:
    def report(*words: str) -> None:
        message = " ".join(words).encode()
        mac = blake2b(message, key=key, digest_size=16).hexdigest().encode()
        try:
            _write(fd, b"\n" + mac + b" " + message + b"\n")
        except OSError:  # the program closed the channel: its tests simply do not pass
            return

    return report


def _error_name(error: BaseException) -> str:
    try:
        name = _name_of(type(error))
    except Exception:
        return "?"
    return "".join(c for c in name[:60] if c.isalnum() or c == "_") or "?"


def _failed(report: Report, where: list[str], error: BaseException) -> None:
    if issubclass(type(error), MemoryError):
        report("memory")
    report(*where, _error_name(error))


def _prepare(payload: dict[str, Any], tests_ns: dict[str, Any], report: Report) -> list[Step]:
    """Compile every step; run the imports now and bind copies of the modules' namespaces."""
    steps: list[Step] = []
    for index, (kind, source) in enumerate(payload["steps"]):
        try:
            code = compile(source, "tests.py", "eval" if kind == "assert" else "exec")
            if kind == "import":
                exec(code, tests_ns)
            steps.append((kind, index, eval(code, tests_ns) if kind == "assert" else code))
        except Exception as e:
            _failed(report, ["setup_error", str(index)], e)
            steps.append(("broken", index, None))
    for name, value in list(tests_ns.items()):
        if type(value) is type(sys):
            copy = type(sys)(value.__name__)
            copy.__dict__.update(value.__dict__)
            tests_ns[name] = copy
    return steps


def _restore(
    tests_ns: dict[str, Any],
    imports: dict[str, Any],
    solution_ns: dict[str, Any],
    protected: frozenset[str],
) -> None:
    tests_builtins = tests_ns["__builtins__"]
    tests_builtins.clear()
    tests_builtins.update(_PRISTINE)
    tests_ns.update(imports)
    for name, value in list(solution_ns.items()):
        if type(name) is str and name not in protected and name[:2] != "__":
            tests_ns[name] = value


def _run_solution(payload: dict[str, Any], solution_ns: dict[str, Any], report: Report) -> None:
    try:
        exec(compile(payload["solution"], "solution.py", "exec"), solution_ns)
    except SystemExit as e:
        code = _exit_code(e)
        if not (code is None or (type(code) is int and code == 0)):
            report("solution_error", "SystemExit")
    except BaseException as e:
        _failed(report, ["solution_error"], e)


def _run_steps(
    steps: list[Step],
    payload: dict[str, Any],
    solution_ns: dict[str, Any],
    tests_ns: dict[str, Any],
    report: Report,
) -> None:
    imports = {k: v for k, v in tests_ns.items() if k not in ("__name__", "__builtins__")}
    protected = frozenset(payload["owned"]) | frozenset(_PRISTINE) | frozenset(imports)
    for kind, index, obj in steps:
        if kind in ("import", "broken"):
            continue
        _restore(tests_ns, imports, solution_ns, protected)
        try:
            if kind == "assert":
                passed = _truth(obj(_strict))
                report("pass" if passed else "fail", str(index))
            else:
                exec(obj, tests_ns)
        except BaseException as e:
            _failed(report, ["test_error" if kind == "assert" else "setup_error", str(index)], e)


def _grade(payload: dict[str, Any], done: Any) -> None:
    """The grading thread: prepare, seal, run the solution, run the steps, report, exit."""
    try:
        report = _reporter(int(sys.argv[-1]), bytes.fromhex(payload.pop("key")))
        tests_ns = {"__name__": "__main__", "__builtins__": dict(_PRISTINE)}
        steps = _prepare(payload, tests_ns, report)
        solution_ns = {"__name__": "__main__", "__builtins__": builtins}
        _seal()
        report("start")
        _run_solution(payload, solution_ns, report)
        _run_steps(steps, payload, solution_ns, tests_ns, report)
        report("end")
        _exit(0)  # now: threads the program left behind must not delay the verdict
    finally:
        done.release()


def main() -> None:
    payload = _read_payload()
    limits = payload.pop("limits")
    apply_limits(limits)
    if payload["mode"] == "run":
        sys.argv = ["program.py"]
        program = compile(payload["program"], "program.py", "exec")
        exec(program, {"__name__": "__main__", "__builtins__": builtins})
        return
    import _thread

    # Deep recursion through C calls needs more than the default 8 MiB; the stack counts
    # against the address-space limit, so it takes an eighth of it at most.
    _thread.stack_size(min(64 << 20, limits["RLIMIT_AS"] // 8 >> 20 << 20))
    for stream in (sys.stdout, sys.stderr):  # the program's output comes back even on _exit
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    done = _thread.allocate_lock()
    done.acquire()
    _thread.start_new_thread(_grade, (payload, done))
    del payload
    done.acquire()  # released only if the grading thread failed before its own exit
    _exit(70)


if __name__ == "__treadle_harness__":
    main()
