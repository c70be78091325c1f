"""The import paths the second floor plan moved still import, as the very module of the new
path, with a warning that names it (treadle.runtime.moved)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import treadle
from treadle.runtime.moved import MOVED

# In a fresh process (nothing of treadle imported yet but the package): each old path, what it
# gave and what it warned.
_IMPORT_ALL = """
import importlib, json, sys, warnings
import treadle
out = {}
for old, new in json.loads(sys.argv[1]).items():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    out[old] = [
        module is importlib.import_module(new), module.__name__, module.__spec__.name,
        [str(w.message) for w in seen if w.category is DeprecationWarning],
    ]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_an_old_path_is_the_new_module_and_says_where_it_went():
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, json.dumps(MOVED)],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    got = json.loads(proc.stdout)
    for old, new in MOVED.items():
        assert got[old] == [True, new, new, [f"{old} moved to {new}: import that"]], old


def test_no_old_path_is_left_as_a_file():
    root = Path(treadle.__file__).parent.parent
    for old in MOVED:
        assert not (root / (old.replace(".", "/") + ".py")).exists(), old


def test_a_name_from_an_old_path_is_the_same_object():
    from treadle.errors import ConfigError as old  # the old path, on purpose

    from treadle.runtime.errors import ConfigError

    assert old is ConfigError
