"""Run untrusted Python in a sandbox, and grade solutions against tests there.

- `grade(solution, tests, timeout_s=...) -> Verdict`: run a solution, then a tests file whose
  top-level `assert` statements are each one test; the verdict (reward = passed / total, a
  status) comes from an authenticated channel the program cannot forge (`grading.py`,
  `harness.py`).
- `run(program, limits=...) -> Completed`: run a program, nothing more.
- `Limits`: wall clock and CPU seconds, memory, processes, file size, disk, open files, output.

The isolation (namespaces through bubblewrap, a read-only filesystem with a private /tmp, no
network, rlimits, nothing left running) is described in `launch.py`; what it protects against
and what it does not, in docs/sandbox.md. `treadle sandbox grade` is the command-line form.
"""

from treadle.sandbox.errors import SandboxError
from treadle.sandbox.grading import Verdict, grade, plan_tests, run
from treadle.sandbox.launch import Completed, Limits, bwrap_path

__all__ = [
    "Completed",
    "Limits",
    "SandboxError",
    "Verdict",
    "bwrap_path",
    "grade",
    "plan_tests",
    "run",
]
