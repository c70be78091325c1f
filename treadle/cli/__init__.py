"""The ``treadle`` command line (``treadle.cli:main``, ``python -m treadle``).

- :mod:`.app`: the command's process: environment, logging, one command run, its exit code;
- :mod:`.parser`: the subcommands and their options; :mod:`.commands`: one function each;
- :mod:`.signals`: Ctrl-C and SIGTERM, and the clean-up's time limit after one;
- :mod:`.demo`: ``treadle demo``; :mod:`.docs`: the references in ``docs/`` generated from
  the code.
"""

from treadle.cli.app import main
from treadle.cli.parser import build_parser, parse
from treadle.cli.signals import STOP_GRACE_S

__all__ = ["STOP_GRACE_S", "build_parser", "main", "parse"]
