"""The learning-rate schedule (``actor.lr_schedule``, ``actor.min_lr_ratio``): the lr of every
optimizer step of tiny local SFT and RL runs against hand-computed warm-up + decay values, and
a resumed run's lr against an uninterrupted one's."""

from __future__ import annotations

import math

import pytest
from test_rl_e2e import grpo_config

from treadle.cli import main
from treadle.engines.fsdp import TrainEngine
from treadle.engines.schedule import LrSchedule
from treadle.tracking.tracker import read_metrics
from treadle.trainers.rl import train

LR = 1e-3


def expected(steps: int, warmup: int, name: str, floor: float) -> list[float]:
    """Each step's lr by hand: k / W in the warm-up, then the decay to LR x floor at step T."""
    out = []
    for k in range(1, steps + 1):
        if k <= warmup:
            out.append(LR * k / warmup)
            continue
        p = (k - warmup) / (steps - warmup)
        decay = (1 + math.cos(math.pi * p)) / 2 if name == "cosine" else 1 - p
        out.append(LR * (floor + (1 - floor) * decay))
    return out


def test_schedule_factors() -> None:
    cos = LrSchedule(2, "cosine", 0.1, 6)
    # warm-up 1/2, 1; then p = 1/4, 2/4, 3/4, 1
    r = math.sqrt(0.5)
    floor = [0.1, 0.1]  # from the last step on
    want = [0.5, 1.0, 0.1 + 0.9 * (1 + r) / 2, 0.55, 0.1 + 0.9 * (1 - r) / 2, *floor]
    assert [cos(k) for k in range(1, 8)] == pytest.approx(want)
    lin = LrSchedule(0, "linear", 0.0, 4)
    assert [lin(k) for k in range(1, 6)] == pytest.approx([0.75, 0.5, 0.25, 0.0, 0.0])
    assert [LrSchedule(3)(k) for k in range(1, 6)] == pytest.approx([1 / 3, 2 / 3, 1, 1, 1])


@pytest.fixture
def lrs(monkeypatch) -> list[float]:
    """The lr of every optimizer step of a local run (its workers are in this process)."""
    seen: list[float] = []
    step = TrainEngine.step

    def recording(self: TrainEngine) -> dict[str, float]:
        out = step(self)
        seen.append(out["lr"])
        return out

    monkeypatch.setattr(TrainEngine, "step", recording)
    return seen


def sft(task, out, *extra: str, code: int = 0) -> None:
    assert (
        main(
            [
                "sft",
                "examples/arithmetic/sft.yaml",
                f"model.path={task['model']}",
                f"data.train_files=[{task['train']}]",
                "data.val_files=[]",
                "data.batch_size=2",
                "actor.micro_batch_size=2",
                "actor.ppo_mini_batch_size=2",
                f"actor.lr={LR}",
                "actor.warmup_steps=2",
                "actor.min_lr_ratio=0.1",
                "rollout.engine=hf",
                "trainer.backend=local",
                "trainer.total_steps=6",
                "trainer.save_every=1",
                "trainer.progress=false",
                f"trainer.output_dir={out}",
                *extra,
            ]
        )
        == code
    )


@pytest.mark.parametrize("name", ["cosine", "linear"])
def test_sft_lr_of_every_step(tiny_task, tmp_path, lrs, name) -> None:
    sft(tiny_task, tmp_path / "sft", f"actor.lr_schedule={name}")
    want = expected(6, 2, name, 0.1)
    assert lrs == pytest.approx(want, rel=1e-12)
    assert [m["sft/lr"] for m in read_metrics(tmp_path / "sft")] == pytest.approx(want, rel=1e-12)


def test_a_warm_up_longer_than_the_run_is_said(tiny_task, tmp_path, lrs, caplog) -> None:
    """actor.warmup_steps=1000 over 2 steps kept the lr near 0 without a word; a short try of
    a config made for a long run is fine, so it is a warning, with the lr it reaches."""
    sft(
        tiny_task,
        tmp_path / "sft",
        "actor.warmup_steps=1000",
        "actor.lr_schedule=cosine",
        "trainer.total_steps=2",
    )
    assert lrs == pytest.approx([LR / 1000, 2 * LR / 1000], rel=1e-12)
    assert (
        "actor.warmup_steps=1000 is longer than the run's 2 optimizer steps: the lr stays "
        f"below actor.lr={LR:g} (it reaches {2 * LR / 1000:g})"
    ) in caplog.messages


@pytest.mark.slow
def test_sft_resumed_continues_the_schedule(tiny_task, tmp_path, lrs) -> None:
    """Stopped after step 3 (a shorter run), resumed to step 6: the lr of steps 4-6 is the
    uninterrupted run's, the schedule of the run's 6 steps (not of the first run's 3)."""
    sft(tiny_task, tmp_path / "straight", "actor.lr_schedule=cosine")
    straight = list(lrs)
    lrs.clear()
    sft(tiny_task, tmp_path / "resumed", "actor.lr_schedule=cosine", "trainer.total_steps=3")
    lrs.clear()
    sft(tiny_task, tmp_path / "resumed", "actor.lr_schedule=cosine")
    assert lrs == straight[3:]  # bit-identical
    logged = [m["sft/lr"] for m in read_metrics(tmp_path / "resumed")]
    assert logged[-3:] == straight[3:]


@pytest.mark.slow
def test_sft_crashed_and_resumed_continues_the_schedule(
    tiny_task, tmp_path, lrs, monkeypatch, capsys
):
    """The same run, crashed in step 4 and started again: steps 4-6 at the straight run's lr."""
    sft(tiny_task, tmp_path / "straight", "actor.lr_schedule=linear")
    straight = list(lrs)
    lrs.clear()
    recording = TrainEngine.step

    def crash(self: TrainEngine) -> dict[str, float]:
        if len(lrs) == 3:
            raise RuntimeError("crash in step 4")
        return recording(self)

    monkeypatch.setattr(TrainEngine, "step", crash)
    sft(tiny_task, tmp_path / "resumed", "actor.lr_schedule=linear", code=1)
    assert "treadle: error: RuntimeError: crash in step 4\n" in capsys.readouterr().err
    monkeypatch.setattr(TrainEngine, "step", recording)
    lrs.clear()
    sft(tiny_task, tmp_path / "resumed", "actor.lr_schedule=linear")
    assert lrs == straight[3:]


def test_rl_lr_of_every_optimizer_step(tiny_task, tmp_path, lrs) -> None:
    """2 RL steps of 2 epochs x (2 prompts x 2 samples / mini-batches of 2): 8 optimizer steps;
    ``actor/lr`` is the mean over each step's four."""
    out = tmp_path / "rl"
    cfg = grpo_config(
        tiny_task,
        out,
        "data.batch_size=2",
        "rollout.n=2",
        "rollout.engine=hf",
        "data.val_files=[]",
        "actor.ppo_mini_batch_size=2",
        "actor.micro_batch_size=2",
        "actor.ppo_epochs=2",
        "actor.warmup_steps=3",
        "actor.lr_schedule=cosine",
        "actor.min_lr_ratio=0.2",
        "trainer.backend=local",
    )
    train(cfg)
    want = expected(8, 3, "cosine", 0.2)
    assert lrs == pytest.approx(want, rel=1e-12)
    logged = [m["actor/lr"] for m in read_metrics(out)]
    assert logged == pytest.approx([sum(want[:4]) / 4, sum(want[4:]) / 4], rel=1e-12)


def test_ppo_critic_and_actor_schedules(tiny_task, tmp_path, lrs) -> None:
    """PPO, 2 steps of 2 mini-batches, the critic warming up in step 1: the critic's 4 steps
    decay over its 4, the actor's 2 (step 2 only) over its 2."""
    cfg = grpo_config(
        tiny_task,
        tmp_path / "ppo",
        "algorithm.adv_estimator=gae",
        "data.batch_size=2",
        "rollout.n=2",
        "rollout.engine=hf",
        "data.val_files=[]",
        "actor.ppo_mini_batch_size=2",
        "actor.micro_batch_size=2",
        "actor.lr_schedule=linear",
        "critic.lr=1e-2",
        "critic.lr_schedule=linear",
        "critic.min_lr_ratio=0.2",
        "critic.warmup_steps=1",
        "trainer.backend=local",
    )
    train(cfg)
    critic = [1e-2 * (0.2 + 0.8 * (1 - k / 4)) for k in range(1, 5)]
    assert lrs == pytest.approx([*critic, LR * 0.5, 0.0], rel=1e-12)
