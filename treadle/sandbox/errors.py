"""The sandbox's one error: it cannot run here, or was asked for something it cannot do."""

from __future__ import annotations

from treadle.runtime.errors import TreadleError


class SandboxError(TreadleError):
    """bubblewrap is missing or cannot start, a limit is invalid, or a tests file is unusable."""
