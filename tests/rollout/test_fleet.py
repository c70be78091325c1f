"""Rollout replicas in both placements, after weight syncs, against the actor's own model.

After an RL step (an update, then a sync as version 1) the replicas' greedy responses must be
what transformers generates from the actor's weights, and their log-probs what the actor's
model computes for those tokens (float32, within 1e-4): colocated (the replica in each of two
actor ranks' processes, weights copied in memory; three steps, each sampling with the actor's
log-probs) and split (two replicas in a pool of their own, weights over a gloo group), both
with vLLM under Ray (one vLLM engine per process: not in this test process, whose engine
belongs to engines/test_vllm.py). The tiny model has tied embeddings, the case vLLM gets wrong
unless re-tied.
Without restarts (rollout.max_restarts=0), a replica killed mid-rollout or before a weight sync
stops the run with one line naming it; what was written stays.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time

import pytest
import ray
import tiny_runs
import torch

from treadle.cli import main
from treadle.config import load_config
from treadle.engines.inference import SamplingParams
from treadle.models.loading import load_causal_lm
from treadle.serving.client import RolloutError
from treadle.trainers.rl import RLTrainer

pytestmark = pytest.mark.slow


def _overrides(task, out, reward, *extra: str) -> list[str]:
    return tiny_runs.overrides(
        task,
        out,
        f"reward.function={reward}",
        f"data.val_files=[{task['test']}]",
        "data.max_prompt_length=64",
        "rollout.max_new_tokens=16",
        "rollout.engine=vllm",
        "actor.lr=5e-3",
        "actor.micro_batch_size=8",
        *extra,
        prompts=4,
        samples=4,
    )


def _check_against_actor(t: RLTrainer, task, tmp_path, steps: int = 1) -> list[dict]:
    """``steps`` steps, then greedy rollouts at that version equal the actor's transformers
    model; the steps' metrics."""
    metrics = [t.step(step) for step in range(1, steps + 1)]
    prompts = t.val_sets["val"].ds
    from treadle.data import prompt_batch

    batch = prompt_batch(prompts, list(range(8)), prompts.pad_id)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    out = t.rollout.generate(batch, greedy)
    assert out["weight_version"].tolist() == [steps] * 8
    t.group.save_checkpoint(str(tmp_path / "actor"))
    model = load_causal_lm(str(tmp_path / "actor" / "model"), torch.float32).eval()
    start = load_causal_lm(str(task["model"]), torch.float32)
    assert not torch.equal(model.lm_head.weight, start.lm_head.weight)  # it trained
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    for i in range(8):
        prompt = out["prompts"][i][out["prompt_mask"][i].bool()]
        length = int(out["response_mask"][i].sum())
        response = out["responses"][i][:length]
        with torch.no_grad():
            expected = model.generate(
                prompt[None], max_new_tokens=12, do_sample=False, pad_token_id=prompts.pad_id
            )[0, len(prompt) :]
            eos = model.generation_config.eos_token_id
            if eos is not None and eos in expected.tolist():
                expected = expected[: expected.tolist().index(eos) + 1]
            assert response.tolist() == expected.tolist(), i
            logits = model(torch.cat([prompt, response])[None]).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
        logp = logp.gather(-1, response[:, None])[:, 0]
        torch.testing.assert_close(out["rollout_log_probs"][i][:length], logp, atol=1e-4, rtol=0)
    return metrics


def test_colocated_replicas_after_syncs_match_the_actor(
    tiny_task, length_reward, tmp_path, ray_session
):
    """vLLM in each of 2 FSDP ranks: at every step (steps 2 and 3 sample from weights synced
    after an update) its log-probs match the actor's; after step 3, greedy responses and
    log-probs are the actor's model's."""
    cfg = load_config(
        None,
        _overrides(
            tiny_task,
            tmp_path / "run",
            length_reward,
            "actor.world_size=2",
            "actor.ppo_mini_batch_size=8",
            "actor.micro_batch_size=4",
        ),
    )
    t = RLTrainer(cfg)
    try:
        metrics = _check_against_actor(t, tiny_task, tmp_path, steps=3)
    finally:
        t.close()
    for m in metrics:
        assert m["rollout/logprob_diff_max"] < 1e-3, m["rollout/logprob_diff_max"]
        assert m["rollout/is_ratio_mean"] == pytest.approx(1.0, abs=1e-3)


def test_split_replicas_after_a_sync_match_the_actor(
    tiny_task, length_reward, tmp_path, ray_session
):
    cfg = load_config(
        None,
        _overrides(
            tiny_task,
            tmp_path / "run",
            length_reward,
            "rollout.placement=split",
            "rollout.replicas=2",
            "trainer.num_cpus=2",
            "rollout.max_restarts=0",  # no restarts: a dead replica stops the run, as before
        ),
    )
    t = RLTrainer(cfg)
    try:
        names = [r.name for r in t.rollout.client.replicas]
        assert names == ["rollout replica 0", "rollout replica 1"]
        _check_against_actor(t, tiny_task, tmp_path)
        assert set(t.source.sample(2, {})["weight_version"].tolist()) == {1}  # both replicas
        # a replica that dies before a sync breaks the actor's broadcast: the error names it
        ray.kill(t.rollout.replicas[1])
        with pytest.raises(
            RolloutError, match=r"^rollout replica 1 \(pid \d+\) died during a weight sync"
        ):
            t.rollout.sync_weights(version=2)
    finally:
        t.close()


def _replica_pids(driver: int) -> list[int]:
    """The rollout replicas' processes of the run whose driver is ``driver`` (Ray's workers
    are children of the raylet the driver started: here the session's), not another run's on
    the machine."""
    import psutil

    found = []
    for p in psutil.Process(driver).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "ray::RolloutReplica" in " ".join(p.cmdline()):
                found.append(p.pid)
    assert found, "no rollout replica among the run's processes"
    return found


def test_a_replica_killed_mid_rollout_stops_the_run_naming_it(
    tiny_task, length_reward, tmp_path, ray_session, capsys
):
    """The command line (run here, in this process, on the session's Ray), split placement,
    long rollouts; one replica's process is killed with SIGKILL during step 2's rollout: exit
    2, one `treadle: error:` line naming the replica, and the metrics and checkpoint of step 1
    intact."""
    out = tmp_path / "run"
    args = _overrides(
        tiny_task,
        out,
        length_reward,
        "rollout.placement=split",
        "rollout.replicas=2",
        "rollout.engine=hf",
        "rollout.max_new_tokens=100",
        "rollout.ignore_eos=true",
        "data.batch_size=16",
        "data.max_prompt_length=24",
        "actor.ppo_mini_batch_size=64",
        "actor.micro_batch_size=32",
        "trainer.total_steps=5",
        "trainer.save_every=1",
        "trainer.num_cpus=2",
        "rollout.max_restarts=0",  # (tests/rollout/test_restarts.py: with restarts)
    )
    metrics = out / "metrics.jsonl"
    killed: list[int] = []

    def kill_in_step_2() -> None:
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            if time.monotonic() > deadline:
                return  # (the assertion on `killed` says so)
            time.sleep(0.2)
        time.sleep(1.0)  # into step 2's rollout (it takes several seconds)
        killed.append(_replica_pids(os.getpid())[0])
        os.kill(killed[0], signal.SIGKILL)

    killer = threading.Thread(target=kill_in_step_2, daemon=True)
    killer.start()
    capsys.readouterr()
    code = main(["train", "examples/arithmetic/grpo.yaml", *args])
    killer.join(timeout=60)
    stderr = capsys.readouterr().err
    assert killed, "step 1 did not finish, or no replica was found"
    assert code == 2, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"treadle: error: step \d+: rollout replica [01] \(pid \d+\) died during a "
        r"(rollout|weight sync) "
        r"\(its process ended without a Python error: killed \(SIGKILL, the kernel's "
        r"out-of-memory killer\) or crashed\); the last checkpoint is .*/step_\d+: the same "
        r"command resumes from it",
        last,
    ), stderr[-3000:]
    # the kill lands in step 2 or, on a fast machine, a later step; whatever finished is intact:
    # every finished step's metrics once, and the newest checkpoint is the last finished step
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [line["step"] for line in lines]
    assert steps == list(range(1, len(steps) + 1)) and 1 <= len(steps) < 5
    assert lines[0]["rollout/weight_version"] == 0
    newest = out / "checkpoints" / f"step_{steps[-1]}"
    assert (newest / "manifest.json").is_file()
    assert (newest / "model" / "model.safetensors").is_file()
