"""Every pair loss and KTO through the real worker on the tiny model; ORPO, SimPO and KTO
through their commands and examples.

One local actor group (with its reference) serves every loss name: the worker's config is
swapped between names (it reads ``cfg.dpo``/``cfg.kto`` at each call), so each name costs one
optimizer step on 4 pairs, not a model build. A step's ``dpo/loss`` must equal the registered
function applied to the log-probs the worker returns just before it, and the step must move
the policy (the next name's log-probs differ).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from algorithm_calls import pair_loss, unpaired_loss

from treadle.algorithms import PREFERENCE_LOSSES, UNPAIRED_LOSSES, kto_kl
from treadle.api import kto as kto_api
from treadle.cli import main
from treadle.config import Config, load_config
from treadle.data import collate_unpaired
from treadle.tracking.tracker import read_metrics
from treadle.trainers import launch
from treadle.trainers.pairs import load_pairs, load_unpaired, pair_batch, unpaired_batch
from treadle.trainers.roles import build_actors
from treadle.workers.objectives import Unpaired, UnpairedCounts

KNOBS: dict[str, list[str]] = {  # settings the loss reads, set away from their defaults
    "sigmoid": ["dpo.label_smoothing=0.1"],
    "robust": ["dpo.label_smoothing=0.1"],
    "exo_pair": ["dpo.label_smoothing=0.01"],
    "aot": ["dpo.label_smoothing=0.1"],
    "discopop": ["dpo.discopop_tau=0.3", "dpo.f_divergence=js_divergence"],
    "hinge": ["dpo.f_divergence=alpha_divergence", "dpo.f_alpha=0.3"],
    "simpo": ["dpo.simpo_gamma=0.3", "dpo.beta=2.0"],
}


def base_overrides(task: dict, out: Path | None = None) -> list[str]:
    return [
        f"model.path={task['model']}",
        f"data.train_files=[{task['pairs_train']}]",
        f"data.val_files=[{task['pairs_test']}]",
        "data.batch_size=8",
        "data.val_size=4",
        "rollout.engine=hf",
        "rollout.max_new_tokens=24",
        "actor.ppo_mini_batch_size=8",
        "actor.micro_batch_size=8",
        "actor.lr=1e-3",
        "trainer.backend=local",
        "trainer.progress=false",
        *([f"trainer.output_dir={out}"] if out else []),
    ]


@pytest.fixture(scope="module")
def shared(tiny_task):
    cfg = load_config("examples/arithmetic/dpo.yaml", base_overrides(tiny_task))
    pairs = pair_batch(load_pairs(cfg, cfg.data.train_files, "data.train_files"), range(4))
    actors = build_actors(cfg, cfg.model.path, with_ref=True)
    ref = actors.group.compute_ref_pair_log_probs(pairs)  # the reference never moves
    # the policy's log-probs before the last step: each step must have moved them
    last: dict[str, torch.Tensor] = {}
    yield {
        "task": tiny_task,
        "actors": actors,
        "pairs": pairs,
        "ref": ref,
        "base": cfg,
        "last": last,
    }
    actors.close()


def use_config(shared: dict, *overrides: str) -> Config:
    cfg = load_config("examples/arithmetic/dpo.yaml", [*base_overrides(shared["task"]), *overrides])
    shared["actors"].group.workers[0].cfg = cfg  # local backend: the worker is in-process
    return cfg


@pytest.mark.parametrize("name", PREFERENCE_LOSSES.names())
def test_one_step_of_every_pair_loss(shared, name: str) -> None:  # type: ignore[no-untyped-def]
    cfg = use_config(shared, f"dpo.loss_type={name}", *KNOBS.get(name, []))
    group, pairs, ref = shared["actors"].group, shared["pairs"], shared["ref"]
    info = PREFERENCE_LOSSES.info(name)
    before = group.compute_pair_log_probs(pairs)
    lengths = {f"{k}_lengths": pairs[f"{k}_mask"].sum(1).double() for k in ("chosen", "rejected")}
    reference = info.get("reference", True)
    expected = pair_loss(
        name,
        before["chosen_logps"].double(),
        before["rejected_logps"].double(),
        ref["ref_chosen_logps"].double() if reference else None,
        ref["ref_rejected_logps"].double() if reference else None,
        beta=cfg.dpo.beta,
        **lengths,
        **{k: getattr(cfg.dpo, k) for k in PREFERENCE_LOSSES.knobs(name)},
    ).mean()
    # a reference-free loss gets no reference log-probs: the worker must not need them
    metrics = group.train_dpo(pairs.union(ref) if reference else pairs)
    assert metrics["dpo/loss"] == pytest.approx(float(expected), rel=1e-5, abs=1e-6)
    tokens = pairs["chosen_mask"].sum()
    nll = float(-before["chosen_logps"].sum() / tokens)
    assert metrics["dpo/nll"] == pytest.approx(nll, rel=1e-5)
    assert 0 < metrics["dpo/grad_norm"] < float("inf")
    if "chosen" in shared["last"]:  # the previous name's step moved the policy
        assert not torch.equal(shared["last"]["chosen"], before["chosen_logps"])
    shared["last"]["chosen"] = before["chosen_logps"]


def test_one_step_of_every_unpaired_loss(shared, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """KTO on a file in TRL's unpaired format: the worker's reference point is the clamped
    mean log-ratio of the batch's mismatched pairs, its loss the registered function's."""
    text = Path(shared["task"]["pairs_train"]).read_text()
    rows = [json.loads(line) for line in text.splitlines()[:60]]
    unpaired = tmp_path / "unpaired.jsonl"
    with unpaired.open("w") as f:
        for i, row in enumerate(rows):  # two desirable, then one undesirable
            good = i % 3 != 2
            completion = row["chosen"] if good else row["rejected"]
            f.write(json.dumps({"prompt": row["prompt"], "completion": completion, "label": good}))
            f.write("\n")
    for name in UNPAIRED_LOSSES.names():
        cfg = use_config(
            shared,
            f"kto.loss_type={name}",
            "kto.desirable_weight=1.2",
            "kto.undesirable_weight=0.8",
            "kto.nll_coef=0.5",
            f"data.train_files=[{unpaired}]",
        )
        ds = load_unpaired(cfg, cfg.data.train_files, "data.train_files")
        batch = unpaired_batch(ds, range(8))
        assert batch["labels"].tolist() == [int(ds[i]["label"]) for i in range(8)]
        assert 0 < int(batch["labels"].sum()) < 8  # both kinds (the long ones were filtered)
        group = shared["actors"].group
        ref = group.compute_ref_unpaired_log_probs(batch)
        policy = group.compute_unpaired_log_probs(batch)
        uses_kl = UNPAIRED_LOSSES.info(name).get("kl", False)
        kl = kto_kl(policy["kl_logps"], ref["ref_kl_logps"]) if uses_kl else 0.0
        expected = unpaired_loss(
            name,
            policy["logps"],
            ref["ref_logps"],
            batch["labels"],
            kl,
            beta=cfg.kto.beta,
            desirable_weight=1.2,
            undesirable_weight=0.8,
        ).mean()
        # the worker's loss is the KTO loss plus nll_coef times the desirable token-mean NLL
        labels = batch["labels"].bool()
        tokens = float(batch["completion_mask"][labels].sum())
        nll = float(-policy["logps"][labels].sum() / tokens)
        worker = group.workers[0]
        counts = [8.0, float(labels.sum()), float((~labels).sum()), tokens]
        with torch.no_grad():
            step = UnpairedCounts(float(kl), counts)
            loss = Unpaired(worker.policy()).loss(batch.union(ref), step).loss
        assert float(loss) == pytest.approx(float(expected) + 0.5 * nll, rel=1e-5)
        metrics = group.train_kto(batch.union(ref))
        assert metrics["kto/nll"] == pytest.approx(nll, rel=1e-5)
        assert metrics["kto/kl"] == pytest.approx(float(kl), rel=1e-5, abs=1e-6)
        assert metrics["kto/loss"] == pytest.approx(float(expected), rel=1e-5)
        good = float(policy["logps"][labels].mean())
        assert metrics["kto/chosen_logp"] == pytest.approx(good, rel=1e-5)
        assert 0 < metrics["kto/grad_norm"] < float("inf")
        if uses_kl:  # the policy moved away from the reference: the estimate is positive
            moved = group.compute_unpaired_log_probs(batch)
            assert float(kto_kl(moved["kl_logps"], ref["ref_kl_logps"])) > 0


def test_unpaired_rows_and_the_kl_rotation(shared) -> None:  # type: ignore[no-untyped-def]
    """A pair file reads as two examples per pair; KL completion i is completion i - 1."""
    cfg = load_config(  # long enough for every response: nothing is filtered
        "examples/arithmetic/dpo.yaml",
        [*base_overrides(shared["task"]), "rollout.max_new_tokens=60"],
    )
    ds = load_unpaired(cfg, cfg.data.train_files, "data.train_files")
    pairs = load_pairs(cfg, cfg.data.train_files, "data.train_files")
    assert len(ds) == 2 * len(pairs)
    assert ds[0]["completion_ids"] == pairs[0]["chosen_ids"] and ds[0]["label"] is True
    assert ds[1]["completion_ids"] == pairs[0]["rejected_ids"] and ds[1]["label"] is False
    out = collate_unpaired([ds[i] for i in (0, 1, 2)], ds.pad_id)
    for i, j in ((0, 2), (1, 0), (2, 1)):
        assert torch.equal(out["kl_completions"][i], out["completions"][j])
        assert torch.equal(out["kl_completion_mask"][i], out["completion_mask"][j])


# ----------------------------------------------------------------------------- examples


def record_with_ref(monkeypatch) -> list[bool]:  # type: ignore[no-untyped-def]
    built: list[bool] = []
    real = launch.build_actors

    def spy(cfg: Any, path: str, with_ref: bool, *args: Any) -> Any:
        built.append(with_ref)
        return real(cfg, path, with_ref, *args)

    monkeypatch.setattr(launch, "build_actors", spy)
    return built


@pytest.mark.parametrize("name", ["orpo", "simpo"])
def test_reference_free_examples_run_without_a_reference(tiny_task, tmp_path, monkeypatch, name):  # type: ignore[no-untyped-def]
    built = record_with_ref(monkeypatch)
    out = tmp_path / name
    args = [name, f"examples/preference/{name}.yaml", *base_overrides(tiny_task, out)]
    assert main(["dpo", *args[1:], "trainer.total_steps=2"]) == 0
    assert built == [False]  # no reference model was built
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    assert metrics[0]["dpo/loss"] != metrics[1]["dpo/loss"]
    assert {"eval/pair_accuracy", "eval/margin"} <= metrics[1].keys()
    assert "timing/ref_log_probs" not in metrics[0]
    assert (out / "final_model" / "model.safetensors").is_file()


@pytest.mark.slow
def test_kto_example_runs_from_python_and_the_command_line(
    tiny_task, tmp_path, monkeypatch, capsys
):  # type: ignore[no-untyped-def]
    built = record_with_ref(monkeypatch)
    out = tmp_path / "kto"
    overrides = [*base_overrides(tiny_task, out), "trainer.total_steps=1"]
    result = kto_api("examples/preference/kto.yaml", overrides=overrides)
    assert built == [True]
    assert result.metrics["kto/loss"] == pytest.approx(0.5, abs=1e-6)  # π = π_ref: 1 - σ(0)
    assert {"eval/chosen_reward", "eval/rejected_reward", "eval/margin"} <= result.metrics.keys()
    assert result.final_model.is_dir()
    # the command resumes the run for one more step, with the task's held-out accuracy
    more = ["trainer.total_steps=2", "kto.eval_task=true"]
    assert main(["kto", "examples/preference/kto.yaml", *overrides, *more]) == 0
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    assert metrics[1]["kto/loss"] != pytest.approx(0.5, abs=1e-6)
    assert "eval/val/accuracy" in metrics[1] and "eval/val/accuracy" not in metrics[0]
    assert "held-out accuracy:" in capsys.readouterr().out


def _two_kto_steps(cfg, actors):  # type: ignore[no-untyped-def]
    """Two KTO steps of ``actors`` on eight rows (the first moves the policy off the
    reference): the batch and the second step's metrics."""
    ds = load_unpaired(cfg, cfg.data.train_files, "data.train_files")
    batch = unpaired_batch(ds, [0, 2, 4, 5, 6, 8, 9, 11])
    batch = batch.union(actors.group.compute_ref_unpaired_log_probs(batch))
    actors.group.train_kto(batch)
    return batch, actors.group.train_kto(batch)


@pytest.mark.slow
def test_kto_two_ranks_match_one(tiny_task, ray_session) -> None:  # type: ignore[no-untyped-def]
    """Over 2 ranks with unevenly split labels, the reference point (a mean over the whole
    batch), the class means and the gradient are those of one rank. The first step moves the
    policy (z0 = 0 at π = π_ref), the second is compared."""
    overrides = [*base_overrides(tiny_task), "actor.micro_batch_size=3", "actor.lr=1e-2"]
    one_cfg, two_cfg = (
        load_config("examples/preference/kto.yaml", [*overrides, *extra])
        for extra in (
            ["trainer.backend=local"],
            ["trainer.backend=ray", "actor.world_size=2", "trainer.num_cpus=2"],
        )
    )
    # the two ranks' processes start while the one-rank run goes on here
    ranks = build_actors(two_cfg, two_cfg.model.path, with_ref=True, wait=False)
    try:
        local = build_actors(one_cfg, one_cfg.model.path, with_ref=True)
        try:
            _, one = _two_kto_steps(one_cfg, local)
        finally:
            local.close()
        batch, two = _two_kto_steps(two_cfg, ranks.ready())
    finally:
        ranks.close()
    assert batch["labels"].tolist() == [1, 1, 1, 0, 1, 1, 0, 0]  # ranks get 3:1 and 2:2
    assert one["kto/kl"] > 0.1  # the moved policy: a real reference point
    for key, value in one.items():
        if not key.startswith("perf/"):  # (rates: timed)
            assert two[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_kto_from_python_takes_a_dataset_in_trls_unpaired_format(tiny_task, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from datasets import Dataset

    import treadle

    text = Path(tiny_task["pairs_train"]).read_text()
    rows = [json.loads(line) for line in text.splitlines()[:40]]
    ds = Dataset.from_list(
        [
            {"prompt": r["prompt"], "completion": r[key], "label": key == "chosen"}
            for r in rows
            for key in ("chosen", "rejected")
        ]
    )
    overrides = [*base_overrides(tiny_task, tmp_path / "kto"), "trainer.total_steps=1"]
    overrides.remove(f"data.val_files=[{tiny_task['pairs_test']}]")
    result = treadle.kto(
        "examples/preference/kto.yaml",
        train_dataset=ds,
        overrides=[*overrides, "data.val_files=[]", "trainer.eval_every=0"],
    )
    assert result.metrics["kto/loss"] == pytest.approx(0.5, abs=1e-6)
    # the policy is the reference at step 1; their passes pack the rows that share a prompt
    # differently (actor.share_prompts), which changes the float rounding only
    assert result.metrics["kto/kl"] == pytest.approx(0.0, abs=1e-5)
    assert "kto/chosen_logp" in result.metrics
    assert (result.output_dir / "datasets" / "train").is_dir()
