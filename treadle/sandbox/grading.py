"""Grade a solution against a tests file in the sandbox, and run plain programs there.

The trusted side of grading, outside the sandbox:

1. `plan_tests` parses the tests file with `ast`. Every top-level statement is a step: a
   top-level `assert` is one test (the total is counted here, never reported by the program),
   an `import` is run before the solution, anything else (helpers, setup) runs in order. Each
   assert becomes the source of `lambda __treadle_c: <expression>`, its comparisons, `not`,
   `and`/`or` and conditional tests rewritten into calls of the harness's strict operators
   (not inside a nested `lambda`, whose closure would hand those operators to the program).
2. `grade` sends the solution, the steps and a fresh random key to `harness.py` inside the
   sandbox (`launch.py`), and reads the harness's reports from a side channel: a line counts
   only with a valid MAC under that key. The status:

   - `timeout`: the wall clock or the CPU-seconds limit ran out;
   - `killed`: a signal, the memory limit (`MemoryError` included), or output over its cap;
   - `error`: the solution or a test raised (`SyntaxError` included; `SystemExit(0)` from the
     solution is a normal end), or the program ended before the tests were done;
   - `failed`: every test ran, some assert was false; `ok`: every assert was true.

   The reward is `passed / total` whatever the status: an assert counts only when the harness
   reported it passed.

Problems that are not the solution's (bubblewrap cannot start, the tests do not parse or have
no top-level assert, the harness fails before the solution runs) raise SandboxError.

Measured on the development machine (2 shared cores, Python 3.11): a grade of a small solution
against five asserts takes ~0.1 s, most of it the sandbox's and Python's start.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import hmac
import json
import secrets
import signal
from dataclasses import dataclass, replace
from pathlib import Path

from treadle.sandbox.errors import SandboxError
from treadle.sandbox.launch import Completed, Limits, launch

STATUSES = ("ok", "failed", "timeout", "error", "killed")
_OPERATORS = "__treadle_c"  # the lambda parameter that holds the harness's strict operators
_ERRORS = ("solution_error", "test_error", "setup_error")


@dataclass(frozen=True)
class Verdict:
    """The outcome of one grade; `as_dict` is the command line's JSON contract."""

    reward: float
    passed: int
    total: int
    status: str
    seconds: float
    detail: str = ""  # one line on why, for people; not part of the JSON contract

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "reward": self.reward,
            "passed": self.passed,
            "total": self.total,
            "status": self.status,
            "seconds": self.seconds,
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict())


@dataclass(frozen=True)
class TestPlan:
    """A tests file as the harness runs it."""

    steps: list[tuple[str, str]]  # (kind, source): "import", "stmt" or "assert" (a lambda)
    lines: list[int]  # each step's line in the tests file
    owned: list[str]  # every name the tests bind: the solution's names never replace them
    asserts: frozenset[int]  # indices of the assert steps

    @property
    def total(self) -> int:
        return len(self.asserts)


class _StrictOperators(ast.NodeTransformer):
    """Route comparisons, `not`, `and`/`or` and `if` tests through the harness's operators."""

    def visit_Lambda(self, node: ast.Lambda) -> ast.AST:
        return node  # a nested lambda may reach the program: it keeps Python's operators

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        ops = ast.Constant(tuple(type(op).__name__ for op in node.ops))  # type: ignore[arg-type]
        return _call("cmp", ops, node.left, ast.Tuple(node.comparators, ast.Load()))

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        self.generic_visit(node)
        return _call("not", node.operand) if isinstance(node.op, ast.Not) else node

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.AST:
        self.generic_visit(node)
        thunks: list[ast.expr] = [ast.Lambda(_no_arguments(), v) for v in node.values]
        return _call("and" if isinstance(node.op, ast.And) else "or", ast.Tuple(thunks, ast.Load()))

    def visit_IfExp(self, node: ast.IfExp) -> ast.AST:
        self.generic_visit(node)
        node.test = _call("bool", node.test)
        return node


def _no_arguments(*names: str) -> ast.arguments:
    return ast.arguments(
        posonlyargs=[],
        args=[ast.arg(name) for name in names],
        vararg=None,
        kwonlyargs=[],
        kw_defaults=[],
        kwarg=None,
        defaults=[],
    )


def _call(kind: str, *args: ast.expr) -> ast.Call:
    return ast.Call(ast.Name(_OPERATORS, ast.Load()), [ast.Constant(kind), *args], [])


def _bound_names(node: ast.stmt) -> set[str]:
    """Every name a statement may bind, nested scopes included (an over-estimate is safe)."""
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and not isinstance(sub.ctx, ast.Load):
            names.add(sub.id)
        elif isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(sub.name)
        elif isinstance(sub, ast.alias):
            names.add((sub.asname or sub.name).partition(".")[0])
    return names


def plan_tests(tests: str) -> TestPlan:
    """The steps of a tests file; a SandboxError if it does not parse or has no assert."""
    try:
        tree = ast.parse(tests, "tests.py")
    except SyntaxError as e:
        raise SandboxError(f"the tests do not parse: {e.msg} (line {e.lineno})") from e
    steps: list[tuple[str, str]] = []
    owned: set[str] = set()
    for node in tree.body:
        owned |= _bound_names(node)
        if isinstance(node, ast.Assert):
            body = _StrictOperators().visit(node.test)
            steps.append(("assert", ast.unparse(ast.Lambda(_no_arguments(_OPERATORS), body))))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            steps.append(("import", ast.unparse(node)))
        else:
            steps.append(("stmt", ast.unparse(node)))
    asserts = frozenset(i for i, (kind, _) in enumerate(steps) if kind == "assert")
    if not asserts:
        raise SandboxError("the tests have no top-level assert statement: nothing to count")
    return TestPlan(steps, [node.lineno for node in tree.body], sorted(owned), asserts)


@functools.cache
def _harness_args() -> tuple[str, ...]:
    source = Path(__file__).with_name("harness.py").read_text()
    boot = (
        "import builtins as b\n"
        f"exec(compile({source!r}, '<treadle-harness>', 'exec'), "
        "{'__name__': '__treadle_harness__', '__builtins__': dict(vars(b))})"
    )
    return ("-c", boot)


def _limits(limits: Limits | None, timeout_s: float | None) -> Limits:
    limits = limits or Limits()
    return limits if timeout_s is None else replace(limits, timeout_s=timeout_s)


def run(program: str, *, limits: Limits | None = None, timeout_s: float | None = None) -> Completed:
    """Run `program` as `__main__` in the sandbox (stdin empty); its exit and capped output."""
    limits = _limits(limits, timeout_s)
    payload = {"mode": "run", "limits": limits.rlimits(), "program": program}
    return launch(_harness_args(), json.dumps(payload).encode(), limits)


def grade(
    solution: str, tests: str, *, timeout_s: float | None = None, limits: Limits | None = None
) -> Verdict:
    """Run `solution`, then the tests file's steps, in a sandbox; count the top-level asserts.

    `timeout_s` (default `limits.timeout_s`, 10 s) bounds the whole run's wall clock and each
    process's CPU seconds.
    """
    limits = _limits(limits, timeout_s)
    plan = plan_tests(tests)
    key = secrets.token_bytes(16)
    payload = {
        "mode": "grade",
        "key": key.hex(),
        "limits": limits.rlimits(),
        "solution": solution,
        "steps": plan.steps,
        "owned": plan.owned,
    }
    done = launch(_harness_args(), json.dumps(payload).encode(), limits, channel=True)
    return _verdict(plan, done, _reports(done.channel, key), limits)


def _reports(channel: bytes, key: bytes) -> list[list[str]]:
    """The channel's lines that carry a valid MAC, as words; everything else is dropped."""
    reports = []
    for line in channel.split(b"\n"):
        mac, _, message = line.partition(b" ")
        expected = hashlib.blake2b(message, key=key, digest_size=16).hexdigest().encode()
        if mac and hmac.compare_digest(mac, expected):
            reports.append(message.decode(errors="replace").split())
    return reports


def _verdict(plan: TestPlan, done: Completed, reports: list[list[str]], limits: Limits) -> Verdict:
    passed_steps = {int(r[1]) for r in reports if r[0] == "pass" and r[1:] and r[1].isdigit()}
    passed = len(passed_steps & plan.asserts)
    status, detail = _status(plan, done, reports, passed == plan.total, limits)
    return Verdict(
        reward=passed / plan.total,
        passed=passed,
        total=plan.total,
        status=status,
        seconds=round(done.seconds, 3),
        detail=detail,
    )


def _status(
    plan: TestPlan, done: Completed, reports: list[list[str]], all_passed: bool, limits: Limits
) -> tuple[str, str]:
    kinds = {r[0] for r in reports}
    if "end" not in kinds:
        return _ended_early(done, kinds, limits)
    if "memory" in kinds:
        return "killed", "the memory limit was reached (MemoryError)"
    errors = [r for r in reports if r[0] in _ERRORS]
    if errors:
        return "error", _describe(plan, errors[0])
    return ("ok", "") if all_passed else ("failed", "an assert was false")


def _describe(plan: TestPlan, report: list[str]) -> str:
    kind, words = report[0], report[1:]
    error = words[-1] if words else "?"
    if kind == "solution_error":
        return f"the solution raised {error}"
    step = int(words[0]) if words[0].isdigit() and int(words[0]) < len(plan.lines) else -1
    what = "the assert" if kind == "test_error" else "the statement"
    return f"{what} on line {plan.lines[step] if step >= 0 else '?'} of the tests raised {error}"


def _ended_early(done: Completed, kinds: set[str], limits: Limits) -> tuple[str, str]:
    if done.timed_out:
        return "timeout", f"still running after {limits.timeout_s:g} s"
    if done.output_exceeded:
        return "killed", f"more than {limits.output_kb} KiB of output"
    if "memory" in kinds:
        return "killed", "the memory limit was reached (MemoryError)"
    if done.signal == signal.SIGXCPU:
        return "timeout", f"used {limits.timeout_s:g} CPU seconds"
    if done.signal is not None:
        return "killed", f"killed by signal {done.signal}"
    if "start" not in kinds:
        tail = done.stderr.decode(errors="replace").strip().splitlines()
        raise SandboxError(
            f"the sandbox failed before the solution ran: {tail[-1] if tail else ''}"
        )
    return "error", f"the program ended (exit code {done.returncode}) before the tests were done"
