"""treadle: reinforcement-learning post-training of language models.

One driver (:mod:`treadle.trainers`) runs the RL dataflow over SPMD worker groups
(:mod:`treadle.controller`, :mod:`treadle.workers`) built on the engines
(:mod:`treadle.engines`); algorithms are pure functions chosen by name
(:mod:`treadle.algorithms`); the run is one typed config (:mod:`treadle.config`).

From Python: ``treadle.train(config, reward=fn, train_dataset=ds)``, ``treadle.distill``,
``treadle.sft``, ``treadle.dpo``, ``treadle.kto`` and ``treadle.rm`` (:mod:`treadle.api`).
They are imported on first use, so ``import treadle`` stays cheap (the command line imports
this package too).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from treadle.runtime import importcache, moved

__version__ = "0.1.0"

importcache.install()
moved.install()  # the import paths of modules that moved (treadle.errors, ...) keep working

if TYPE_CHECKING:
    from treadle.api import RunResult, distill, dpo, kto, rm, sft, train
    from treadle.config import Config, load_config

_LAZY = {
    "train": "treadle.api",
    "sft": "treadle.api",
    "distill": "treadle.api",
    "dpo": "treadle.api",
    "kto": "treadle.api",
    "rm": "treadle.api",
    "RunResult": "treadle.api",
    "Config": "treadle.config",
    "load_config": "treadle.config",
}
__all__ = ["Config", "RunResult", "distill", "dpo", "kto", "load_config", "rm", "sft", "train"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'treadle' has no attribute {name!r}")
