"""treadle: reinforcement-learning post-training of language models.

One driver (:mod:`treadle.trainers`) runs the RL dataflow over SPMD worker groups
(:mod:`treadle.controller`, :mod:`treadle.workers`) built on the engines
(:mod:`treadle.engines`); algorithms are pure functions chosen by name
(:mod:`treadle.algorithms`); the run is one typed config (:mod:`treadle.config`).
"""

__version__ = "0.1.0"
