"""``treadle distill``: the rules of its config, and local runs of its three losses whose
batches and first-step losses are checked against an independent forward of the models."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from treadle.algorithms.distill import generalized_jsd
from treadle.cli import main
from treadle.config import load_config
from treadle.config.rules import check_algorithm
from treadle.models.loading import load_causal_lm, load_tokenizer
from treadle.rollout.teacher import Teacher
from treadle.runtime.errors import ConfigError
from treadle.tracking.tracker import read_metrics
from treadle.trainers.distill import DistillTrainer, distill
from treadle.workers.actor import ActorRolloutRefWorker


def distill_overrides(task, teacher, out, loss: str, *extra: str) -> list[str]:
    return [
        f"model.path={task['model']}",
        f"teacher.model_path={teacher}",
        f"distill.loss={loss}",
        f"data.train_files=[{task['train']}]",
        f"data.val_files=[{task['test']}]",
        "data.val_size=4",
        "data.batch_size=4",
        "data.max_prompt_length=64",
        "rollout.n=2",
        "rollout.max_new_tokens=48",
        "actor.lr=1e-3",
        "actor.ppo_mini_batch_size=8",
        "actor.micro_batch_size=8",
        "trainer.backend=local",
        "trainer.total_steps=2",
        "trainer.save_every=1",
        "trainer.eval_every=2",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
        *extra,
    ]


# --------------------------------------------------------------------------- config rules


def problems(*overrides: str, kind: str = "distill") -> str:
    cfg = load_config(None, ["model.path=m", *overrides])
    with pytest.raises(ConfigError) as e:
        check_algorithm(cfg, kind)  # type: ignore[arg-type]
    return str(e.value)


def test_distill_needs_a_teacher() -> None:
    assert "set teacher.model_path" in problems()


def test_vllm_teacher_cannot_share_the_actors_processes() -> None:
    text = problems("teacher.model_path=t", "teacher.engine=vllm")
    assert "teacher.engine=vllm cannot share the actor's processes" in text
    assert "teacher.placement=split" in text


def test_split_teacher_needs_ray() -> None:
    text = problems("teacher.model_path=t", "teacher.placement=split", "trainer.backend=local")
    assert "set teacher.placement=colocated or use trainer.backend=ray" in text


def test_gkd_reads_no_algorithm_setting_and_runs_in_sync_mode() -> None:
    text = problems(
        "teacher.model_path=t",
        "distill.loss=gkd",
        "algorithm.kl_coef=0.1",
        "trainer.mode=one_step_off",
        "rollout.placement=split",
        "trainer.backend=ray",
    )
    assert "distill.loss=gkd trains without the policy loss" in text
    assert "remove algorithm.kl_coef" in text
    assert "set trainer.mode=sync" in text


def test_distill_has_no_critic() -> None:
    text = problems("teacher.model_path=t", "algorithm.adv_estimator=gae")
    assert "needs a critic, which treadle distill does not train" in text


def test_train_refuses_a_teacher() -> None:
    assert "run `treadle distill`" in problems("teacher.model_path=t", kind="train")
    assert "run `treadle distill`" in problems("distill.coef=0.5", kind="train")


def test_unknown_distill_loss_is_named() -> None:
    with pytest.raises(ConfigError, match=r"distill\.loss"):
        load_config(None, ["distill.loss=jsd"])


def test_check_names_the_teacher_and_its_vocabulary(tiny_task, teacher_model, tmp_path, capsys):
    args = distill_overrides(tiny_task, teacher_model, tmp_path / "run", "reverse_kl")
    assert main(["check", "--kind", "distill", "examples/distill/on_policy.yaml", *args]) == 0
    assert f"teacher: {teacher_model}" in capsys.readouterr().out
    other = tmp_path / "other"
    model = load_causal_lm(tiny_task["model"], torch.float32)
    model.resize_token_embeddings(model.config.vocab_size + 8)
    model.save_pretrained(other)
    bad = [*args, f"teacher.model_path={other}"]
    assert main(["check", "--kind", "distill", "examples/distill/on_policy.yaml", *bad]) == 2
    err = capsys.readouterr().err
    assert "teacher.model_path:" in err and "vocabulary of" in err


# --------------------------------------------------------------------------- local runs


@pytest.fixture
def seen(monkeypatch) -> dict[str, list]:
    """What a local run's step made: its sequences (``distill_batch``), the batch the teacher
    scored with the teacher's fields, and what the actor was updated with (the fields its
    method reads); the workers of a local run are in this process."""
    out: dict[str, list] = {"sequences": [], "scored": [], "updates": []}

    def record(cls, name, key, union=False):
        method = getattr(cls, name)

        @functools.wraps(method)  # (keeps a worker method's dispatch registration)
        def recording(self, batch, *args, _method=method):
            result = _method(self, batch, *args)
            out[key].append(batch.union(result) if union else batch)
            return result

        monkeypatch.setattr(cls, name, recording)

    record(ActorRolloutRefWorker, "update_actor", "updates")
    record(ActorRolloutRefWorker, "train_distill", "updates")
    record(Teacher, "score", "scored", union=True)
    monkeypatch.setattr(
        DistillTrainer,
        "distill_batch",
        lambda self, step, m, _f=DistillTrainer.distill_batch: (
            out["sequences"].append(_f(self, step, m)) or out["sequences"][-1]
        ),
    )
    return out


def forward_log_probs(model_dir, batch) -> torch.Tensor:
    """log-softmax [B, R, V] of ``model_dir`` at every response position of ``batch``, each
    row run alone without its prompt's padding."""
    model = load_causal_lm(model_dir, torch.float32).eval()
    r = batch["responses"].shape[1]
    rows = []
    with torch.no_grad():
        for prompt, pmask, response in zip(
            batch["prompts"], batch["prompt_mask"], batch["responses"], strict=True
        ):
            ids = torch.cat([prompt[pmask.bool()], response])[None]
            logits = model(input_ids=ids).logits.float()[0]
            rows.append(torch.log_softmax(logits[-r - 1 : -1], -1))
    return torch.stack(rows)


def gathered(full: torch.Tensor, batch) -> torch.Tensor:
    return full.gather(-1, batch["responses"][..., None])[..., 0] * batch["response_mask"]


def test_on_policy_distillation_advantage_is_the_reverse_kl(
    tiny_task, teacher_model, tmp_path, seen
):
    out = tmp_path / "run"
    args = distill_overrides(tiny_task, teacher_model, out, "reverse_kl", "distill.coef=0.5")
    metrics = distill(load_config(None, args))
    scored, update = seen["scored"][0], seen["updates"][0]
    teacher_lp = gathered(forward_log_probs(teacher_model, scored), scored)
    torch.testing.assert_close(scored["teacher_log_probs"], teacher_lp, atol=2e-5, rtol=0)
    mask = scored["response_mask"].float()
    # one optimizer step a batch: the student's log-probs are the rollout's
    want = 0.5 * (teacher_lp - scored["rollout_log_probs"]) * mask
    torch.testing.assert_close(update["advantages"], want, atol=2e-5, rtol=0)
    rows = read_metrics(out)
    kl = float(((scored["rollout_log_probs"] - teacher_lp) * mask).sum() / mask.sum())
    assert rows[0]["distill/reverse_kl"] == pytest.approx(kl, abs=1e-4)
    assert {"eval/val/accuracy", "actor/pg_loss"} <= set(metrics)
    assert [r["step"] for r in rows] == [1, 2]


def test_gkd_mixes_student_samples_and_dataset_answers(tiny_task, teacher_model, tmp_path, seen):
    out = tmp_path / "run"
    args = distill_overrides(
        tiny_task,
        teacher_model,
        out,
        "gkd",
        "distill.lmbda=0.5",
        "distill.top_k=7",
        "rollout.n=1",
        "actor.ppo_mini_batch_size=4",
        "distill.beta=0.3",
        "distill.temperature=0.8",
    )
    distill(load_config(None, args))
    first = seen["scored"][0]
    assert sorted(first["origin"]) == ["dataset", "dataset", "student", "student"]
    tok = load_tokenizer(tiny_task["model"])
    lines = Path(tiny_task["train"]).read_text().splitlines()
    rows = {json.loads(line)["prompt"]: json.loads(line) for line in lines}
    for i in range(len(first)):
        if first["origin"][i] != "dataset":
            continue
        n = int(first["response_mask"][i].sum())
        text = tok.decode(first["responses"][i, :n].tolist(), skip_special_tokens=True)
        assert text == rows[first["prompt_text"][i]]["solution"]
    # the teacher's top-k of each position, and the first step's loss against the start model
    teacher_full = forward_log_probs(teacher_model, first)
    top = teacher_full.topk(7, -1)
    mask = first["response_mask"].bool()
    torch.testing.assert_close(first["teacher_topk_ids"][mask], top.indices[mask])
    torch.testing.assert_close(
        first["teacher_topk_log_probs"][mask], top.values[mask], atol=2e-5, rtol=0
    )
    student_full = forward_log_probs(tiny_task["model"], first)
    per_token = generalized_jsd(
        student_full.gather(-1, top.indices)[mask], top.values[mask], 0.3, 0.8
    )
    step1 = read_metrics(out)[0]
    assert step1["distill/jsd"] == pytest.approx(float(per_token.mean()), rel=1e-4)


@pytest.mark.slow
def test_seq_kd_learns_the_teachers_samples_and_resumes(tiny_task, teacher_model, tmp_path, seen):
    out = tmp_path / "run"
    args = distill_overrides(
        tiny_task, teacher_model, out, "seq_kd", "rollout.n=1", "actor.ppo_mini_batch_size=4"
    )
    distill(load_config(None, args))
    first = seen["sequences"][0]
    assert set(first["origin"]) == {"teacher"}
    # the samples are the teacher's: their log-probs are the teacher's own
    torch.testing.assert_close(
        first["rollout_log_probs"],
        gathered(forward_log_probs(teacher_model, first), first),
        atol=2e-5,
        rtol=0,
    )
    mask = first["response_mask"].float()
    nll = -(gathered(forward_log_probs(tiny_task["model"], first), first) * mask).sum() / mask.sum()
    rows = read_metrics(out)
    assert rows[0]["distill/nll"] == pytest.approx(float(nll), rel=1e-4)
    # a third step resumes from the second's checkpoint
    distill(load_config(None, [*args, "trainer.total_steps=3"]))
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert (out / "final_model" / "config.json").is_file()


def test_distill_on_ray_split_and_colocated_teachers(
    tiny_task, teacher_model, ray_session, tmp_path
):
    """Under Ray: on-policy distillation from a split teacher replica (its own pool; the
    student's rollout on transformers), then GKD from teachers colocated in the actor's two
    ranks, beside the ranks' vLLM rollout engines."""
    ray_args = ["trainer.backend=ray", "trainer.save_every=0"]
    ray_args += ["trainer.total_steps=1", "trainer.eval_every=1"]
    split = tmp_path / "split"
    args = distill_overrides(tiny_task, teacher_model, split, "reverse_kl", *ray_args)
    split_teacher = ["teacher.placement=split", "teacher.cpus_per_replica=0.5"]
    distill(load_config(None, [*args, "rollout.engine=hf", *split_teacher]))
    (row,) = read_metrics(split)
    assert abs(row["distill/reverse_kl"]) < 5 and row["timing/teacher"] > 0
    assert "eval/val/accuracy" in row
    colocated = tmp_path / "colocated"
    args = distill_overrides(
        tiny_task,
        teacher_model,
        colocated,
        "gkd",
        *ray_args,
        "rollout.engine=vllm",
        "actor.world_size=2",
        "rollout.n=1",
        "actor.ppo_mini_batch_size=4",
        "actor.micro_batch_size=2",
    )
    metrics = distill(load_config(None, args))
    assert metrics["distill/jsd"] > 0 and "eval/val/accuracy" in metrics
    assert (colocated / "final_model" / "config.json").is_file()


def test_the_estimators_rules_hold_only_when_it_runs() -> None:
    one = ["teacher.model_path=t", "rollout.n=1", "actor.ppo_mini_batch_size=16"]
    check_algorithm(load_config(None, ["model.path=m", *one]), "distill")  # no groups needed
    text = problems(*one, "distill.task_reward=true")
    assert "rollout.n=1 makes groups of one" in text


def test_check_wants_the_dataset_responses_gkd_trains_on(
    tiny_task, teacher_model, tmp_path, capsys
):
    rows = tmp_path / "no_solutions.jsonl"
    rows.write_text('{"prompt": "What is 1+2?", "answer": "3"}\n' * 4)
    args = distill_overrides(tiny_task, teacher_model, tmp_path / "run", "gkd", "distill.lmbda=0.5")
    bad = [*args, f"data.train_files=[{rows}]", "rollout.n=1", "actor.ppo_mini_batch_size=4"]
    assert main(["check", "--kind", "distill", "examples/distill/gkd.yaml", *bad]) == 2
    err = capsys.readouterr().err
    assert f"{rows}" in err and "solution" in err
    # every sample the student's own: no dataset response is read
    ok = [*bad, "distill.lmbda=1"]
    assert main(["check", "--kind", "distill", "examples/distill/gkd.yaml", *ok]) == 0
