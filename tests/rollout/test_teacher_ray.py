"""The teacher under Ray, one Ray start: two split teacher replicas (Ray actors in a placement
group of their own) and a colocated teacher in an actor rank's process (``teacher_score``),
each scoring a batch as the transformers engine does in this process; a split replica killed
is started again and its requests sent again (rollout.max_restarts), and once no restart is
left, a dead one is named ("teacher replica i").
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from treadle.config import load_config
from treadle.data import collate_prompts
from treadle.engines.inference import HFRolloutEngine, SamplingParams
from treadle.models.loading import load_causal_lm, load_tokenizer
from treadle.protocol import Batch
from treadle.rollout.teacher import start_teacher
from treadle.serving.client import RolloutError
from treadle.trainers.roles import build_actors

pytestmark = pytest.mark.slow

TOP_K = 3


def _config(task, teacher, out, *extra: str):
    return load_config(
        None,
        [
            f"model.path={task['model']}",
            f"data.train_files=[{task['train']}]",
            "data.max_prompt_length=64",
            "rollout.max_new_tokens=12",
            "rollout.engine=hf",
            "trainer.backend=ray",
            "trainer.num_cpus=1",
            "trainer.progress=false",
            f"trainer.output_dir={out}",
            f"teacher.model_path={teacher}",
            *extra,
        ],
    )


def _batch(tok) -> Batch:
    """Six samples: prompts of different lengths, responses of 0..7 tokens (right-padded)."""
    g = torch.Generator().manual_seed(0)
    prompts = [tok(f"What is {i} + {3 * i}?" + " Think." * (i % 3))["input_ids"] for i in range(6)]
    ids, mask = collate_prompts(prompts, tok.pad_token_id)
    responses = torch.randint(3, len(tok), (6, 8), generator=g)
    lengths = torch.tensor([5, 0, 8, 3, 7, 1])
    rmask = (torch.arange(8)[None] < lengths[:, None]).long()
    responses[rmask == 0] = tok.pad_token_id
    return Batch.from_dict(
        tensors={
            "prompts": ids,
            "prompt_mask": mask,
            "responses": responses,
            "response_mask": rmask,
        }
    )


def _expected(model_path, tok, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """teacher_log_probs and teacher_topk_ids from the transformers engine in this process."""
    engine = HFRolloutEngine(
        load_causal_lm(model_path, torch.float32), [tok.eos_token_id], tok.pad_token_id
    )
    log_probs = torch.zeros(batch["responses"].shape)
    ids = torch.zeros(*batch["responses"].shape, TOP_K, dtype=torch.long)
    for i in range(len(batch)):
        n = int(batch["response_mask"][i].sum())
        if n:
            prompt = batch["prompts"][i][batch["prompt_mask"][i].bool()].tolist()
            (s,) = engine.score([prompt + batch["responses"][i, :n].tolist()], [len(prompt)], TOP_K)
            log_probs[i, :n] = torch.tensor(s.log_probs)
            ids[i, :n] = torch.tensor(s.topk_ids)
    return log_probs, ids


def _check(out: Batch, expected: tuple[torch.Tensor, torch.Tensor]) -> None:
    torch.testing.assert_close(out["teacher_log_probs"], expected[0], atol=1e-5, rtol=0)
    assert torch.equal(out["teacher_topk_ids"], expected[1])


def _check_generate(teacher, batch: Batch, tok, model_path) -> None:
    """The teacher's greedy samples (through its Rollout) are its model's."""
    prompts = batch.only(["prompts", "prompt_mask"])
    prompts.update(objects={k: [str(i) for i in range(len(batch))] for k in OBJECTS})
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    out = teacher.rollout.generate(prompts, greedy)
    assert out["weight_version"].tolist() == [0] * len(batch)
    engine = HFRolloutEngine(
        load_causal_lm(model_path, torch.float32), [tok.eos_token_id], tok.pad_token_id
    )
    ids = [
        p[m.bool()].tolist() for p, m in zip(batch["prompts"], batch["prompt_mask"], strict=True)
    ]
    want = engine.generate(ids, greedy).token_ids
    got = [
        out["responses"][i, : int(out["response_mask"][i].sum())].tolist()
        for i in range(len(batch))
    ]
    assert got == want


OBJECTS = ("uid", "prompt_text", "ground_truth")


def test_split_and_colocated_teachers_under_ray(ray_session, tiny_task, teacher_model, tmp_path):
    tok = load_tokenizer(tiny_task["model"])
    # The colocated teacher's actor (1 CPU) starts now, its process beside the split replicas'
    # (their pool: 1 CPU; the session's Ray has 2), and is used once they are done with.
    colocated = _config(tiny_task, teacher_model, tmp_path / "colocated")
    actors = build_actors(colocated, str(tiny_task["model"]), with_ref=False, wait=False)
    try:
        _split_then_colocated(tiny_task, teacher_model, tmp_path, tok, colocated, actors)
    finally:
        actors.close()


def _split_then_colocated(tiny_task, teacher_model, tmp_path, tok, colocated, actors) -> None:
    batch = _batch(tok)
    expected = _expected(teacher_model, tok, batch)

    split = _config(
        tiny_task,
        teacher_model,
        tmp_path,
        "teacher.placement=split",
        "teacher.replicas=2",
        "teacher.cpus_per_replica=0.5",
        "rollout.max_restarts=1",
    )
    teacher = start_teacher(split, None, tok)  # split: the actor's group is not used
    try:
        assert [r.name for r in teacher.client.replicas] == [
            "teacher replica 0",
            "teacher replica 1",
        ]
        _check(teacher.score(batch, TOP_K), expected)
        assert teacher.client.outstanding == [0, 0]
        _check_generate(teacher, batch, tok, teacher_model)
        import ray

        pid = ray.get(teacher.rollout.replicas[0].describe.remote())["pid"]
        os.kill(pid, signal.SIGKILL)  # the next scoring finds it dead: restarted, sent again
        _check(teacher.score(batch, TOP_K), expected)
        assert teacher.rollout.take_counters()["rollout/replica_restarts"] == 1.0
        assert teacher.client.down == set() and teacher.client.outstanding == [0, 0]
        assert ray.get(teacher.rollout.replicas[0].describe.remote())["pid"] != pid
        ray.kill(teacher.rollout.replicas[0])  # no restart left
        with pytest.raises(
            RolloutError,
            match=r"teacher replica 0 .*died during scoring .*; rollout.max_restarts=1 restarts",
        ):
            teacher.score(batch, TOP_K)
    finally:
        teacher.close()

    teacher = start_teacher(colocated, actors.ready().group, tok)
    assert [r.name for r in teacher.client.replicas] == ["teacher replica 0 (actor rank 0)"]
    _check(teacher.score(batch, TOP_K), expected)
    _check_generate(teacher, batch, tok, teacher_model)
    teacher.close()
