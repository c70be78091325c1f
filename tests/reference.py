"""Reference implementations the parity tests compare treadle's algorithms against.

``make install`` puts verl 0.9.1 and TRL 1.16.0 into the environment without their
dependencies (``pip install --no-deps``): only their pure loss and estimator functions are
called, on tensors. verl's package imports Ray, tensordict, omegaconf, codetiming, orjson and
hydra at module level, though ``verl.trainer.ppo.core_algos`` computes nothing with them; those
modules are replaced by empty stand-ins *only while verl is imported*, so the rest of the test
session sees the real Ray.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

import pytest

# verl imports these at package level; core_algos' functions never touch them
_STUBBED = ("tensordict", "omegaconf", "ray", "codetiming", "orjson", "hydra")


class _Stub(types.ModuleType):
    """A module whose every attribute is a class accepting anything (``X[...]`` too)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__init__": _anything, "__class_getitem__": classmethod(_same)})


def _anything(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


def _same(cls: type, item: Any) -> type:
    return cls


def _top(module: str) -> str:
    return module.split(".", maxsplit=1)[0]


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if _top(name) in _STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return _Stub(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def verl_core_algos() -> types.ModuleType:
    """``verl.trainer.ppo.core_algos`` of verl 0.9.1 (the test fails if verl is missing)."""
    return verl_module("verl.trainer.ppo.core_algos")


def verl_module(name: str) -> types.ModuleType:
    """A module of verl 0.9.1 (``verl.trainer.ppo.metric_utils``, ...), imported with the
    stand-ins above (the test fails if verl is missing)."""
    if name in sys.modules:
        return sys.modules[name]
    saved = {n: mod for n, mod in sys.modules.items() if _top(n) in _STUBBED}
    for n in saved:
        del sys.modules[n]
    finder = _StubFinder()
    sys.meta_path.insert(0, finder)
    try:
        module = importlib.import_module(name)
    finally:
        sys.meta_path.remove(finder)
        for n in [n for n in sys.modules if _top(n) in _STUBBED]:
            del sys.modules[n]
        sys.modules.update(saved)
    import verl

    assert verl.__version__ == "0.9.1", f"the parity tests pin verl 0.9.1, got {verl.__version__}"
    return module


def trl_module(name: str) -> types.ModuleType:
    """A module of TRL 1.16 (``trl.trainer.dpo_trainer``, ...)."""
    import trl

    if not trl.__version__.startswith("1.16"):
        pytest.fail(f"the parity tests pin TRL 1.16, got {trl.__version__}")
    return importlib.import_module(name)
