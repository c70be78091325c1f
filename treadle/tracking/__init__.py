"""What a run leaves for a person to read: metrics, samples, logs and the report.

- :mod:`.tracker`: the run's :class:`~.tracker.Tracker` (phase timers, the loggers of
  ``trainer.loggers``) and where the libraries' log lines go;
- :mod:`.sinks`: one small class per destination (console, ``metrics.jsonl``, TensorBoard,
  Weights & Biases, MLflow, ...);
- :mod:`.report`: ``treadle report``'s HTML page.
"""

from treadle.tracking.tracker import Tracker, read_metrics, timed

__all__ = ["Tracker", "read_metrics", "timed"]
