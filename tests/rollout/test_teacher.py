"""The teacher of ``treadle distill`` in the local backend (colocated: a second server in the
actor's process), on the tiny task with a teacher of its own (same tokenizer, other weights).

- ``Teacher.score`` of a real RL batch (the student's samples through the run's rollout)
  equals a hand forward pass of the teacher in float32: the log-softmax gathered at every
  response token, and ``torch.topk`` of it; 0 (ids 0) where ``response_mask`` is 0 or beyond
  the response. Tool tokens (mask 0, still attended) are scored as context: the tokens after
  them keep the full-sequence values.
- ``Teacher.rollout.generate`` samples from the teacher (its greedy tokens are the teacher
  model's), version 0.
- A teacher whose vocabulary (config.json or tokenizer) is not the student's, a missing
  folder, and the placements the local backend cannot run are ConfigErrors naming the key.
- The rollout server scores between the steps of generation in flight (transformers engine).
"""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from treadle.config import load_config
from treadle.data import collate_prompts
from treadle.engines.inference import HFRolloutEngine, SamplingParams
from treadle.models.loading import load_causal_lm, load_tokenizer
from treadle.protocol import Batch
from treadle.rollout.fleet import start_rollout
from treadle.rollout.teacher import start_teacher
from treadle.runtime.errors import ConfigError
from treadle.serving.server import Request, RolloutServer, ScoreRequest
from treadle.trainers.roles import build_actors

TOP_K = 4


def _config(task, teacher, out, *extra: str):
    return load_config(
        None,
        [
            f"model.path={task['model']}",
            f"data.train_files=[{task['train']}]",
            "data.max_prompt_length=64",
            "rollout.max_new_tokens=12",
            "rollout.engine=hf",
            "trainer.backend=local",
            "trainer.progress=false",
            f"trainer.output_dir={out}",
            f"teacher.model_path={teacher}",
            "teacher.micro_batch_size=3",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def local_run(tiny_task, teacher_model, tmp_path_factory):
    cfg = _config(tiny_task, teacher_model, tmp_path_factory.mktemp("run"))
    actors = build_actors(cfg, str(tiny_task["model"]), with_ref=False)
    tok = load_tokenizer(tiny_task["model"])
    rollout = start_rollout(cfg, actors.group, str(tiny_task["model"]), 0)
    teacher = start_teacher(cfg, actors.group, tok)
    yield cfg, rollout, teacher, tok
    teacher.close()
    rollout.close()
    actors.close()


def _prompts(tok, n: int) -> Batch:
    texts = [f"What is {i} + {2 * i + 1}?" for i in range(n)]
    ids, mask = collate_prompts([tok(t)["input_ids"] for t in texts], tok.pad_token_id)
    return Batch.from_dict(
        tensors={"prompts": ids, "prompt_mask": mask},
        objects={"uid": [str(i) for i in range(n)], "prompt_text": texts, "ground_truth": texts},
    )


@torch.no_grad()
def _by_hand(model, batch: Batch, i: int, length: int) -> tuple[torch.Tensor, ...]:
    """Log-probs, top-k ids and log-probs of row i's first ``length`` response tokens."""
    prompt = batch["prompts"][i][batch["prompt_mask"][i].bool()]
    seq = torch.cat([prompt, batch["responses"][i, :length]])
    logits = model(seq[None]).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : len(seq) - 1]
    values, ids = lp.topk(TOP_K, -1)
    return lp.gather(-1, seq[len(prompt) :, None]).squeeze(-1), ids, values


def _check(batch: Batch, out: Batch, model) -> None:
    mask = batch["response_mask"].bool()
    attended = batch.tensors.get("response_attention_mask", batch["response_mask"]).bool()
    b, width = batch["responses"].shape
    assert out["teacher_log_probs"].shape == (b, width)
    assert out["teacher_log_probs"].dtype == torch.float32
    assert out["teacher_topk_ids"].shape == (b, width, TOP_K)
    assert out["teacher_topk_ids"].dtype == torch.long
    assert out["teacher_topk_log_probs"].dtype == torch.float32
    for i in range(b):
        length = int(attended[i].nonzero().max()) + 1 if attended[i].any() else 0
        m = mask[i, :length]
        if length:
            lp, ids, values = _by_hand(model, batch, i, length)
            torch.testing.assert_close(
                out["teacher_log_probs"][i, :length], lp * m, atol=1e-5, rtol=0
            )
            assert torch.equal(out["teacher_topk_ids"][i, :length][m], ids[m])
            torch.testing.assert_close(
                out["teacher_topk_log_probs"][i, :length][m], values[m], atol=1e-5, rtol=0
            )
        off = ~mask[i]  # not counted (tool tokens, padding): zeros
        assert not out["teacher_log_probs"][i][off].any()
        assert not out["teacher_topk_ids"][i][off].any()
        assert not out["teacher_topk_log_probs"][i][off].any()


def test_local_teacher_scores_a_real_batch_as_its_forward_pass(local_run, teacher_model):
    _, rollout, teacher, tok = local_run
    batch = rollout.generate(_prompts(tok, 5), SamplingParams(n=2, max_new_tokens=12, seed=3))
    assert int(batch["response_mask"].sum()) > 10
    model = load_causal_lm(teacher_model, torch.float32).eval()
    out = teacher.score(batch, TOP_K)
    _check(batch, out, model)
    assert set(teacher.score(batch, 0).keys()) == {"teacher_log_probs"}

    # A multi-turn layout: tokens 2..4 of row 0 are tool output (attended, not counted), and
    # row 1 has no response at all.
    batch["response_attention_mask"] = batch["response_mask"].clone()
    batch["response_mask"][0, 2:5] = 0
    batch["response_mask"][1] = 0
    batch["response_attention_mask"][1] = 0
    multi = teacher.score(batch, TOP_K)
    _check(batch, multi, model)
    after = batch["response_mask"][0].bool()
    after[:5] = False  # the tokens after the tool output: the same values as unmasked
    assert torch.equal(multi["teacher_log_probs"][0][after], out["teacher_log_probs"][0][after])


def test_local_teacher_generates_from_the_teacher(local_run, teacher_model):
    _, _, teacher, tok = local_run
    prompts = _prompts(tok, 3)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    out = teacher.rollout.generate(prompts, greedy)
    assert out["weight_version"].tolist() == [0, 0, 0]
    model = load_causal_lm(teacher_model, torch.float32).eval()
    engine = HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id)
    ids = [
        p[m.bool()].tolist()
        for p, m in zip(prompts["prompts"], prompts["prompt_mask"], strict=True)
    ]
    want = engine.generate(ids, greedy)
    for i in range(3):
        n = int(out["response_mask"][i].sum())
        assert out["responses"][i, :n].tolist() == want.token_ids[i]


def test_a_teacher_of_another_vocabulary_is_refused(tiny_task, teacher_model, tmp_path):
    tok = load_tokenizer(tiny_task["model"])
    bigger = tmp_path / "bigger"
    shutil.copytree(teacher_model, bigger)
    config = json.loads((bigger / "config.json").read_text())
    config["vocab_size"] += 64
    (bigger / "config.json").write_text(json.dumps(config))
    cfg = _config(tiny_task, bigger, tmp_path / "run")
    with pytest.raises(ConfigError) as e:
        start_teacher(cfg, None, tok)
    assert "teacher.model_path" in str(e.value)
    assert f"{len(tok) + 64} tokens" in str(e.value) and f"(model.path) {len(tok)}" in str(e.value)

    other_tok = tmp_path / "other_tokenizer"
    shutil.copytree(teacher_model, other_tok)
    theirs = load_tokenizer(other_tok)
    theirs.add_tokens(["<tool_call_x>"])
    theirs.save_pretrained(other_tok)
    cfg = _config(tiny_task, other_tok, tmp_path / "run")
    with pytest.raises(
        ConfigError,
        match=rf"teacher.model_path: the tokenizer of .* \({len(tok) + 1} tokens\) "
        rf"is not the student's \({len(tok)} tokens",
    ):
        start_teacher(cfg, None, tok)


def test_teacher_settings_the_local_backend_cannot_run(tiny_task, teacher_model, tmp_path):
    tok = load_tokenizer(tiny_task["model"])
    with pytest.raises(ConfigError, match=r"teacher.model_path: .* does not exist"):
        start_teacher(_config(tiny_task, tmp_path / "missing", tmp_path), None, tok)
    split = _config(tiny_task, teacher_model, tmp_path, "teacher.placement=split")
    with pytest.raises(ConfigError, match=r"set teacher\.placement=colocated"):
        start_teacher(split, None, tok)
    vllm = _config(tiny_task, teacher_model, tmp_path, "teacher.engine=vllm")
    with pytest.raises(ConfigError, match=r"teacher\.engine=vllm needs teacher\.placement=split"):
        start_teacher(vllm, None, tok)


def test_the_server_scores_between_the_steps_of_generation_in_flight(teacher_model):
    tok = load_tokenizer(teacher_model)
    model = load_causal_lm(teacher_model, torch.float32).eval()
    server = RolloutServer(HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id), "t 0")
    seqs = [tuple(tok(f"{i} + {i} = {2 * i}")["input_ids"]) for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)

    async def both():
        generating = asyncio.ensure_future(
            server.generate([Request(f"g{i}", s, greedy) for i, s in enumerate(seqs)])
        )
        await asyncio.sleep(0)  # the pump starts
        scored = await server.score([ScoreRequest(f"s{i}", s, 2, 3) for i, s in enumerate(seqs)])
        return await generating, scored

    generated, scored = asyncio.run(both())
    assert [r.request_id for r in scored] == ["s0", "s1", "s2", "s3"]
    assert all(r.replica == "t 0" and r.weight_version == 0 for r in scored)
    direct = server.engine.score([list(s) for s in seqs], [2] * 4, 3)
    assert [r.log_probs for r in scored] == [d.log_probs for d in direct]
    assert [r.topk_ids for r in scored] == [d.topk_ids for d in direct]
    alone = server.engine.generate([list(s) for s in seqs], greedy)
    assert [r.token_ids for r in generated] == alone.token_ids


@pytest.mark.parametrize(
    ("extra", "refused"),
    [
        ((), True),  # reverse_kl alone: every advantage 0
        (("distill.loss=gkd",), True),
        (("distill.task_reward=true",), False),  # the task reward still trains
        (("distill.loss=seq_kd",), False),  # its own samples: self-distillation
    ],
)
def test_the_student_as_its_own_teacher_is_refused_where_it_teaches_nothing(
    tiny_task, tmp_path, extra, refused
):
    """`treadle distill` with teacher.model_path = model.path passed the check and trained
    nothing: the per-token gap to the teacher (the student's own start) is 0."""
    from treadle.check.run import check

    cfg = _config(tiny_task, tiny_task["model"], tmp_path / "run", *extra)
    if not refused:
        check(cfg, "distill")
        return
    with pytest.raises(ConfigError) as e:
        check(cfg, "distill")
    loss = cfg.distill.loss
    assert str(e.value) == (
        f"teacher.model_path is model.path ('{tiny_task['model']}'): with distill.loss={loss} "
        "the student learns the gap to its own start, which is 0: nothing is learned; give "
        f"another teacher{', or set distill.task_reward=true' if loss == 'reverse_kl' else ''}"
    )
