"""The import paths that treadle's second floor plan moved, kept working.

``treadle.errors`` is now ``treadle.runtime.errors``, ``treadle.rollout.client`` is
``treadle.serving.client``, and so on (:data:`MOVED`). A user's reward file, plugin or script
written against the old path still imports it: :func:`install` puts a finder on
``sys.meta_path`` that answers an old name with the very module of the new one (the same
object, so ``except treadle.errors.ConfigError`` catches what treadle raises) and warns once
with the new path (a ``DeprecationWarning``). Modules that became packages (``treadle.models``,
``treadle.rewards``, ``treadle.tracking``, ``treadle.protocol``, ``treadle.check``,
``treadle.cli``) need no entry: their package hands on the names the module had.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

MOVED = {
    "treadle.errors": "treadle.runtime.errors",
    "treadle.omp": "treadle.runtime.omp",
    "treadle.memory": "treadle.runtime.memory",
    "treadle.reaper": "treadle.runtime.reaper",
    "treadle.faults": "treadle.runtime.faults",
    "treadle.startup": "treadle.runtime.startup",
    "treadle.cache": "treadle.runtime.cache",
    "treadle.importcache": "treadle.runtime.importcache",
    "treadle.plugins": "treadle.runtime.plugins",
    "treadle.model_folders": "treadle.models.folders",
    "treadle.hub": "treadle.models.hub",
    "treadle.hf_facts": "treadle.models.hf_facts",
    "treadle.checkpoint": "treadle.models.checkpoint",
    "treadle.trackers": "treadle.tracking.sinks",
    "treadle.report": "treadle.tracking.report",
    "treadle.cluster": "treadle.controller.cluster",
    "treadle.demo": "treadle.cli.demo",
    "treadle.docs": "treadle.cli.docs",
    "treadle.rollout.server": "treadle.serving.server",
    "treadle.rollout.client": "treadle.serving.client",
    "treadle.rollout.replica": "treadle.serving.replica",
    "treadle.rollout.weight_sync": "treadle.serving.weight_sync",
    "treadle.rollout.endpoint": "treadle.serving.endpoint",
    "treadle.rollout.openai_api": "treadle.serving.openai_api",
    "treadle.rollout.parsers": "treadle.serving.parsers",
    "treadle.rollout.completions": "treadle.serving.completions",
    "treadle.rollout.serving": "treadle.serving.serve",
    "treadle.engines.vllm_pictures": "treadle.engines.vllm.pictures",
}
"""Old module path -> where the module is now."""


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at its new one."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}: import that", DeprecationWarning, 2)
        module = importlib.import_module(new)
        # the import system keeps the module's name and file but sets its __spec__ to the old
        # path's, which exec_module gives back
        self._specs[new] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The new module ran when it was imported: only its own spec is put back."""
        module.__spec__ = self._specs[module.__name__]


def install() -> None:
    """The finder, once per process (``import treadle`` runs it), ahead of the others: an old
    path is answered here even where a stale file of that name is left on the path."""
    if not any(isinstance(f, _Moved) for f in sys.meta_path):
        sys.meta_path.insert(0, _Moved())
