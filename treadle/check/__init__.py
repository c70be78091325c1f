"""``treadle check``: everything about a run that can be checked without training, in seconds.

``check`` (:mod:`treadle.check.run`) is the entry and the order of the checks; each area is a
module of its own: ``machine``, ``models`` (model folders, the tokenizer, LoRA's targets),
``user_code`` (reward functions, agent loops, tools, parsers; the import time limit), ``data``
(files, rows, validation sets, reasoning-gym, ground truths, a reward's columns) and ``output``
(the run directory, resuming); ``kind`` works out the command a config is for when
``treadle check`` is not told.
"""

from treadle.check.output import lock_holder
from treadle.check.run import check
from treadle.check.user_code import IMPORT_TIMEOUT_S
from treadle.config.rules import KINDS, Kind, check_algorithm
from treadle.config.timeout import time_limit

__all__ = [
    "IMPORT_TIMEOUT_S",
    "KINDS",
    "Kind",
    "check",
    "check_algorithm",
    "lock_holder",
    "time_limit",
]
