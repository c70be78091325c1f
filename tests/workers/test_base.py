"""What every role's worker does with the models it loads, beyond a CPU's sight: where they are
when FSDP2 takes them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from treadle.config import load_config
from treadle.workers import base, common


def test_models_reach_fsdp2_on_the_host_not_the_device(tiny_task, monkeypatch):
    """Moved whole to the device first, a model sat whole on every rank's GPU before
    fully_shard cut it (float32 by default: 28 GB of a 7B model, at any rank count); on the
    host, each fully_shard moves one unit's tensors. "meta" stands in for the GPU here."""
    cfg = load_config(None, [f"model.path={tiny_task['model']}"])
    worker = SimpleNamespace(cfg=cfg, device=torch.device("meta"))
    given: list[torch.nn.Module] = []
    monkeypatch.setattr(common, "train_engine", lambda model, **_: given.append(model))
    given.append(base.RoleWorker.load_lm(worker, tiny_task["model"]))  # type: ignore[arg-type]
    common.value_engine(cfg, tiny_task["model"], "critic.model_path", trainable=False)
    assert len(given) == 2
    assert {p.device.type for m in given for p in m.parameters()} == {"cpu"}
