"""Every command of treadle as a short run on the tiny task: the local backend, the hf engine.

One table (:data:`CASES`) that two suites read: the CPU's device guard
(``tests/test_devices.py``: each case under a second device that CPU torch can tell apart) and
the GPU's (``tests/gpu/``: each case on one CUDA GPU). A case is the command, its example
config and what it changes; :func:`argv` makes its command line at test size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# A reward whose scores vary within a group even for an untrained model (GRPO's advantages are
# then not all zero, and DAPO's dynamic sampling keeps groups).
LENGTH_REWARD = "def score(prompt, response, ground_truth):\n    return (len(response) % 7) / 6\n"


@dataclass(frozen=True)
class Case:
    """A command with its example config; ``keys``: what the case changes in it; ``pairs``: it
    reads preference pairs; ``teacher``: it needs the teacher model."""

    command: str
    config: str
    keys: tuple[str, ...] = ()
    pairs: bool = False
    teacher: bool = False
    rl: bool = field(default=False)  # samples with a reward (the length reward above)


CASES: dict[str, Case] = {
    # GRPO with a KL loss to the reference, an entropy bonus and rollout correction: every
    # input of the policy loss
    "grpo": Case(
        "train",
        "examples/arithmetic/grpo.yaml",
        (
            "algorithm.kl_coef=0.01",
            "algorithm.entropy_coef=0.001",
            "algorithm.rollout_correction=tis",
        ),
        rl=True,
    ),
    # the exact KL over the whole vocabulary (the reference's full distribution)
    "grpo_full_kl": Case(
        "train", "examples/arithmetic/grpo.yaml", ("algorithm.kl_estimator=full",), rl=True
    ),
    # a critic, GAE (and the actor from step 1: the example warms the critic up first)
    "ppo": Case("train", "examples/arithmetic/ppo.yaml", ("critic.warmup_steps=0",), rl=True),
    # dynamic sampling (8-token responses are all cut: the example's mask_truncated would
    # leave no token to learn from)
    "dapo": Case(
        "train",
        "examples/arithmetic/dapo.yaml",
        ("reward.overlong_buffer_len=4", "algorithm.mask_truncated=false"),
        rl=True,
    ),
    # actor, reference and critic wait in host memory (weights and moments), back for each use
    "offload": Case(
        "train",
        "examples/arithmetic/ppo.yaml",
        (
            "critic.warmup_steps=0",
            "algorithm.kl_coef=0.01",
            "actor.offload_params=true",
            "actor.offload_optimizer=true",
        ),
        rl=True,
    ),
    "lora": Case("train", "examples/lora/grpo_lora.yaml", ("actor.lora.rank=4",), rl=True),
    "prime": Case("train", "examples/prime/prime.yaml", rl=True),  # the implicit PRM
    "sft": Case("sft", "examples/arithmetic/sft.yaml"),
    "dpo": Case("dpo", "examples/arithmetic/dpo.yaml", pairs=True),
    "kto": Case("kto", "examples/preference/kto.yaml", pairs=True),
    "rm": Case("rm", "examples/arithmetic/rm.yaml", pairs=True),
    "gkd": Case(  # (its dataset answers are up to 31 tokens)
        "distill",
        "examples/distill/gkd.yaml",
        ("distill.top_k=5", "rollout.max_new_tokens=40"),
        teacher=True,
    ),
    "seq_kd": Case("distill", "examples/distill/seq_kd.yaml", teacher=True),
    "reverse_kl": Case("distill", "examples/distill/on_policy.yaml", teacher=True),
    "eval": Case("eval", "examples/arithmetic/grpo.yaml", ("eval.n=2", "eval.temperature=1.0")),
}


def argv(
    name: str,
    task: dict,
    out: Path,
    *extra: str,
    teacher: Path | None = None,
    steps: int = 1,
) -> list[str]:
    """The command line of case ``name`` on ``task`` (tests/conftest.py's ``tiny_task``) into
    ``out``: 4 prompts (x 2 samples of 8 new tokens for RL, 1 sample for distillation; up to
    24 tokens a response for SFT and pairs), ``steps`` steps, a checkpoint at the end;
    ``extra`` comes last (a key given again there wins)."""
    case = CASES[name]
    train, val = ("pairs_train", "pairs_test") if case.pairs else ("train", "test")
    keys = [
        f"model.path={task['model']}",
        f"data.train_files=[{task[train]}]",
        f"data.val_files=[{task[val]}]",
        "data.val_size=4",
        "data.max_prompt_length=64",
        "data.batch_size=4",
        "rollout.engine=hf",
        "actor.world_size=1",
        "actor.micro_batch_size=4",
        "trainer.backend=local",
        f"trainer.total_steps={steps}",
        f"trainer.eval_every={steps}",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
    ]
    if case.rl:
        reward = out.parent / f"{out.name}_reward.py"
        reward.write_text(LENGTH_REWARD)
        keys += [f"reward.function={reward}:score", "reward.num_workers=0"]
        keys += ["rollout.n=2", "rollout.max_new_tokens=8", "actor.ppo_mini_batch_size=8"]
    elif case.teacher:
        assert teacher is not None, f"case {name} needs a teacher model"
        keys += [f"teacher.model_path={teacher}", "teacher.engine=hf", "rollout.n=1"]
        keys += ["rollout.max_new_tokens=8", "actor.ppo_mini_batch_size=4"]
    else:  # SFT, pairs, evaluation: the data's responses are up to 24 tokens
        keys += ["rollout.max_new_tokens=24", "actor.ppo_mini_batch_size=4"]
    return [case.command, case.config, *keys, *case.keys, *extra]
