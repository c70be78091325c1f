"""Names a package hands on without importing the module that defines them until one is used.

A package's ``__init__`` says ``__getattr__ = lazy(__name__, {"Name": "module", ...})``: the
first ``package.Name`` (or ``from package import Name``) imports ``package.module`` and returns
its ``Name``. Faces stay cheap this way: ``treadle check`` reads the agents' registry or a
model folder's config without importing the rollout client, torch or transformers.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: each of ``names`` from its module of
    ``package``, imported on first use; any other name is an AttributeError."""

    def get(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(f"{package}.{names[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return get
