"""Two answers every process of a run works out when it imports transformers, kept on disk.

A run's driver, each training rank, each vLLM replica and each reward worker imports
transformers, and each of them works out the same two answers from the same files:

- ``importlib.metadata.packages_distributions()``, called at the import of
  ``transformers.utils.import_utils``: the RECORD and METADATA of every installed distribution
  without a ``top_level.txt``, read and parsed (~0.7 CPU-s with vLLM's ~240 distributions);
- the lazy import structure of ``transformers.models`` (``define_import_structure``, twice: for
  ``transformers`` and for ``transformers.models``): every one of its ~2,400 model files read
  and scanned for ``__all__`` (~0.4 CPU-s each time).

:func:`install` (run by ``import treadle``) makes both read their answer back from
:mod:`treadle.runtime.cache`'s store when the files they come from are unchanged: the folders on
``sys.path`` (a distribution installed or removed changes its folder) for the first, the
fingerprint of every model file for the second. What is read back is what would have been
worked out; a changed file or a turned-off store (``TREADLE_CHECK_CACHE=off``) works it out.
Installing imports nothing: the work happens only where transformers is imported.
"""

from __future__ import annotations

import functools
import importlib.machinery
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from treadle.runtime import cache


def install() -> None:
    """Both caches, from the import of ``transformers.utils.import_utils`` on; once per
    process, and nothing if transformers came first (its answers are worked out by then)."""
    if "transformers.utils.import_utils" in sys.modules:
        return
    if not any(isinstance(finder, _Around) for finder in sys.meta_path):
        sys.meta_path.insert(
            0, _Around("transformers.utils.import_utils", _patch_distributions, _patch_import_utils)
        )


def _patch_distributions() -> None:  # once: the finder leaves sys.meta_path before it runs this
    import importlib.metadata

    compute = importlib.metadata.packages_distributions
    importlib.metadata.packages_distributions = _cached_distributions(compute)


def _cached_distributions(compute: Callable[[], Mapping[str, list[str]]]) -> Any:
    @functools.wraps(compute)
    def packages_distributions() -> dict[str, list[str]]:
        entries = dict.fromkeys(os.path.abspath(p or ".") for p in sys.path)
        try:
            folders = [cache.fingerprint(p) for p in entries if os.path.exists(p)]
        except OSError:  # one cannot be read: work it out, as Python would
            return dict(compute())
        found = _remembered(["packages_distributions", list(entries)], folders, compute)
        return {name: list(dists) for name, dists in found.items()}

    return packages_distributions


def _remembered(name: list[Any], files: list[cache.Fingerprint], compute: Callable[[], Any]) -> Any:
    """``compute()`` (JSON-able), or the answer stored under ``name`` when ``files`` are as they
    were when it was worked out. One entry per name: a changed file's answer replaces it."""
    stamp = cache.digest([fp[:-1] for fp in files])  # without `settled`, which changes alone
    found = cache.lookup("imports", name)
    if isinstance(found, dict) and found.get("files") == stamp:
        return found["answer"]
    answer = compute()
    cache.store("imports", name, {"files": stamp, "answer": answer}, files)
    return answer


class _Around:
    """A finder (``sys.meta_path``) of one module: runs ``before()``, finds the module as Python
    would, and runs ``after(module)`` right after the module executes, before whoever imported
    it binds any of its names; then steps out of ``sys.meta_path``."""

    def __init__(
        self, name: str, before: Callable[[], None], after: Callable[[ModuleType], None]
    ) -> None:
        self.name, self.before, self.after = name, before, after

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        self.before()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            self.after(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this module's own loader
        return spec


def _patch_import_utils(module: ModuleType) -> None:
    define = getattr(module, "define_import_structure", None)
    if define is None:  # another transformers: leave it as it is
        return

    @functools.wraps(define)
    def define_import_structure(module_path: Any, prefix: str | None = None) -> Any:
        folder = os.path.realpath(module_path)
        if os.path.isfile(folder):
            folder = os.path.dirname(folder)
        try:
            files = _model_files(folder)
        except OSError:
            return define(module_path, prefix)

        def compute() -> list[Any]:  # JSON: frozensets and sets as sorted lists
            value = define(module_path, prefix)
            return [
                [sorted(b), {m: sorted(o) for m, o in mods.items()}] for b, mods in value.items()
            ]

        found = _remembered(["define_import_structure", folder, prefix], files, compute)
        return {frozenset(b): {m: set(o) for m, o in mods.items()} for b, mods in found}

    module.define_import_structure = define_import_structure  # type: ignore[attr-defined]


@functools.cache
def _model_files(folder: str) -> list[cache.Fingerprint]:
    """The fingerprints of the ``.py`` files under ``folder`` (what the structure is read from),
    from one ``scandir`` per folder."""
    out, stack = [], [folder]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    if entry.name != "__pycache__":
                        stack.append(entry.path)
                elif entry.name.endswith(".py"):
                    out.append(cache.stat_fingerprint(entry.path, entry.stat()))
    return sorted(out)
