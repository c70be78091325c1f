"""Names a package hands on lazily (treadle.runtime.lazy): the defining module is imported on
first use only, and an unknown name is the AttributeError Python gives."""

from __future__ import annotations

import sys
import types

import pytest

from treadle.runtime.lazy import lazy


def test_a_name_comes_from_its_module_on_first_use(monkeypatch):
    module = types.ModuleType("treadle_lazy_probe.parts")
    module.Part = object()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "treadle_lazy_probe", types.ModuleType("treadle_lazy_probe"))
    get = lazy("treadle_lazy_probe", {"Part": "parts"})
    monkeypatch.setitem(sys.modules, "treadle_lazy_probe.parts", module)
    assert get("Part") is module.Part
    with pytest.raises(AttributeError, match="module 'treadle_lazy_probe' has no attribute 'Nope'"):
        get("Nope")


def test_the_faces_hand_on_their_modules_names():
    import treadle.agents
    import treadle.models
    import treadle.rollout
    import treadle.serving
    from treadle.agents.tools import Toolbox
    from treadle.models.folders import load_tokenizer
    from treadle.serving.client import RolloutClient

    assert treadle.agents.Toolbox is Toolbox
    assert treadle.models.load_tokenizer is load_tokenizer
    assert treadle.serving.RolloutClient is RolloutClient
    assert treadle.rollout.RolloutClient is RolloutClient  # where it was before serving/
    for face in (treadle.agents, treadle.models, treadle.serving):
        assert all(hasattr(face, name) for name in face.__all__), face.__name__
    for name in treadle.serving.__all__:  # the service's old home hands on each of them
        assert getattr(treadle.rollout, name) is getattr(treadle.serving, name), name
