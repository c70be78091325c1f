"""GRPO on the image task end to end: two steps of a vision-language model, pictures in the
rollout and the update, every weight (vision tower included) trained and synced."""

from __future__ import annotations

import pytest
import torch
from test_rl_e2e import weights

from treadle.config import load_config
from treadle.engines import inference
from treadle.tracking.tracker import read_metrics
from treadle.trainers.rl import train


@pytest.mark.slow
def test_grpo_two_steps_of_a_vision_language_model(
    shapes_task, length_reward, tmp_path, monkeypatch
):
    pictures: list[int] = []  # rollout requests that came with their pictures, per generate
    generate = inference.HFRolloutEngine.generate

    def counting(self, prompts, params, pixel_values=None):  # type: ignore[no-untyped-def]
        pictures.append(
            sum(x is not None and x.shape == (1, 3, 64, 64) for x in pixel_values or [])
        )
        return generate(self, prompts, params, pixel_values)

    monkeypatch.setattr(inference.HFRolloutEngine, "generate", counting)
    out = tmp_path / "run"
    cfg = load_config(
        "examples/shapes/grpo.yaml",  # the example's recipe, at test size
        [
            f"model.path={shapes_task['model']}",
            f"data.train_files=[{shapes_task['train']}]",
            f"data.val_files=[{shapes_task['test']}]",
            "data.batch_size=2",
            "data.val_size=4",
            "rollout.n=4",
            "actor.ppo_mini_batch_size=8",
            "actor.micro_batch_size=8",
            "actor.lr=1e-3",
            "actor.remove_padding=true",
            f"reward.function={length_reward}",
            "trainer.total_steps=2",
            "trainer.eval_every=2",
            "trainer.progress=false",
            f"trainer.output_dir={out}",
        ],
    )
    train(cfg)
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["actor/grad_norm"] > 0 for m in metrics)
    assert pictures and all(n > 0 for n in pictures)
    assert sum(pictures) >= 2 * 2 * 4 + 4  # 2 steps of 2 prompts x 4 samples, 4 evaluated
    before, after = weights(shapes_task["model"]), weights(out / "final_model")
    assert before.keys() == after.keys()
    unchanged = {k for k in before if torch.equal(before[k], after[k])}
    assert not unchanged, unchanged
    assert any(k.startswith("model.vision_model.") for k in before)
    assert (out / "final_model" / "processor_config.json").is_file()  # loads with its processor
