"""treadle.runtime.importcache: the answers transformers works out at import are read back from the
store when their files are unchanged, worked out again when one changed, and equal either way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from treadle.runtime import cache, importcache


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV, str(tmp_path / "store"))
    monkeypatch.setattr(cache, "SETTLE_S", 0.0)  # files written by the test count as settled
    importcache._model_files.cache_clear()
    yield tmp_path / "store" / "imports"
    importcache._model_files.cache_clear()


def test_distributions_are_read_back_until_a_folder_on_sys_path_changes(
    store, tmp_path, monkeypatch
):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setattr(sys, "path", [str(site)])
    calls = []

    def compute():
        calls.append(1)
        return {"yaml": ["PyYAML"], "_yaml": ["PyYAML"]}

    cached = importcache._cached_distributions(compute)
    assert cached() == cached() == {"yaml": ["PyYAML"], "_yaml": ["PyYAML"]}
    assert len(calls) == 1 and len(list(store.iterdir())) == 1
    first = cached()
    first["yaml"].append("changed")  # the caller's copy: the next answer is the stored one
    assert cached()["yaml"] == ["PyYAML"] and len(calls) == 1
    (site / "new-1.0.dist-info").mkdir()  # an install: the folder's times move
    assert cached() == {"yaml": ["PyYAML"], "_yaml": ["PyYAML"]} and len(calls) == 2
    assert cached() and len(calls) == 2 and len(list(store.iterdir())) == 1  # replaced


def _fake_import_utils(calls: list) -> types.ModuleType:
    def define_import_structure(module_path, prefix=None):
        calls.append((module_path, prefix))
        names = sorted(p.stem for p in Path(module_path).parent.glob("*.py"))
        return {frozenset({"torch"}): {f"{prefix}.{n}": {"A", "B"} for n in names}, frozenset(): {}}

    return types.SimpleNamespace(define_import_structure=define_import_structure)


def test_the_import_structure_is_read_back_until_a_model_file_changes(store, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / "__init__.py").write_text("")
    (models / "modeling_a.py").write_text("__all__ = ['A', 'B']\n")
    init = str(models / "__init__.py")

    def new_process(calls: list):  # a fresh module, and no fingerprints remembered
        importcache._model_files.cache_clear()
        module = _fake_import_utils(calls)
        importcache._patch_import_utils(module)
        return module.define_import_structure

    calls: list = []
    first = new_process(calls)(init, "models")
    assert first == {
        frozenset({"torch"}): {"models.__init__": {"A", "B"}, "models.modeling_a": {"A", "B"}},
        frozenset(): {},
    }
    assert new_process(calls)(init, "models") == first and len(calls) == 1
    assert new_process(calls)(init, None) != first and len(calls) == 2  # its own key
    (models / "modeling_b.py").write_text("__all__ = ['A', 'B']\n")
    assert "models.modeling_b" in new_process(calls)(init, "models")[frozenset({"torch"})]
    assert len(calls) == 3


@pytest.mark.parametrize("where", ["off", "a file"])
def test_a_turned_off_or_unwritable_store_works_everything_out(tmp_path, monkeypatch, where):
    if where == "a file":  # the store's folder cannot be made
        (tmp_path / "file").write_text("")
        where = str(tmp_path / "file" / "store")
    monkeypatch.setenv(cache.ENV, where)
    calls: list = []
    cached = importcache._cached_distributions(lambda: calls.append(1) or {"a": ["b"]})
    assert cached() == cached() == {"a": ["b"]} and len(calls) == 2


@pytest.mark.slow
def test_transformers_reads_its_answers_back_in_the_next_process(tmp_path):
    """Two real processes: the first stores both answers, the second reads them (a marker put
    into the stored distributions shows), and both equal what transformers works out itself."""
    env = os.environ | {cache.ENV: str(tmp_path / "store")}
    probe = (
        "import json, importlib.metadata as md, treadle, transformers\n"
        "import transformers.utils.import_utils as iu\n"
        "define = iu.define_import_structure\n"
        "raw = define.__wrapped__.__wrapped__\n"  # beneath ours and transformers' lru_cache
        "folder = transformers.__path__[0] + '/models'\n"
        "mine, theirs = define(folder, 'models'), raw(folder, 'models')\n"
        "pd = md.packages_distributions()\n"
        "same = pd == md.packages_distributions.__wrapped__()\n"
        "print(json.dumps([mine == theirs, len(mine), same, pd.get('treadle-marker')]))\n"
    )
    run = lambda: subprocess.run(  # noqa: E731
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True, cwd="/"
    )
    same, kinds, same_pd, marker = json.loads(run().stdout)
    assert same and kinds > 1 and same_pd and marker is None
    stored = list((tmp_path / "store" / "imports").iterdir())
    for path in stored:  # mark the stored distributions: the next process must show the mark
        entry = json.loads(path.read_text())
        if entry["key"][0] == "packages_distributions":
            entry["value"]["answer"]["treadle-marker"] = ["x"]
            path.write_text(json.dumps(entry))
    assert json.loads(run().stdout) == [True, kinds, False, ["x"]]
