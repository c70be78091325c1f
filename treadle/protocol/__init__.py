"""The record that crosses every seam of an RL step: :class:`~.batch.Batch`, and the standard
fields of one step (:mod:`.fields`: their names, shapes and who adds them)."""

from treadle.protocol.batch import Batch, response_attention
from treadle.protocol.fields import STANDARD_SHAPES

__all__ = ["STANDARD_SHAPES", "Batch", "response_attention"]
