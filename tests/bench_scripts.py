"""A script under bench/ loaded as a module, for its tests (bench/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


@contextmanager
def bench_script(name: str) -> Iterator[ModuleType]:
    """``bench/<name>.py`` as the module ``bench_<name>``, in ``sys.modules`` while it is used
    (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]
