"""``treadle check``: everything about a run that can be checked without training, in seconds."""

from treadle.check.run import (
    IMPORT_TIMEOUT_S,
    KINDS,
    Kind,
    check,
    check_algorithm,
    lock_holder,
    time_limit,
)

__all__ = [
    "IMPORT_TIMEOUT_S",
    "KINDS",
    "Kind",
    "check",
    "check_algorithm",
    "lock_holder",
    "time_limit",
]
