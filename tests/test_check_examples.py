"""`treadle check CONFIG` works out the command from the config (treadle.check.kind): every
config under examples/ passes with no --kind, in a directory laid out as `make demo` and the
examples' READMEs leave it (data/, runs/, the fetched SmolLM2), with the tests' tiny models
and data in place of the real ones. A config it cannot tell asks for --kind."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import tiny_model

from treadle.cli import main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("examples/*/*.yaml"))
# The command each example is for, as its README runs it.
KINDS = {
    "examples/arithmetic/dpo.yaml": "dpo",
    "examples/arithmetic/rm.yaml": "rm",
    "examples/arithmetic/sft.yaml": "sft",
    "examples/distill/gkd.yaml": "distill",
    "examples/distill/on_policy.yaml": "distill",
    "examples/distill/seq_kd.yaml": "distill",
    "examples/preference/kto.yaml": "kto",
    "examples/preference/orpo.yaml": "dpo",
    "examples/preference/simpo.yaml": "dpo",
    "examples/reasoning_gym/sft.yaml": "sft",
    "examples/reasoning_gym/sft_steps.yaml": "sft",
    "examples/shapes/sft.yaml": "sft",
    "examples/smollm2/sft_arithmetic.yaml": "sft",
}

# What the stand-ins cannot meet as the examples are written: the tiny tokenizer spells English
# nearly letter by letter (reasoning-gym's and the tools' prompts), the tiny image task has 48
# training rows. (And reasoning-gym draws 64 rows, not 4,000: the same checks, 3 s less.)
GYM = ["data.max_prompt_length=512", "data.reasoning_gym.size=64", "data.reasoning_gym.val_size=8"]
OVERRIDES = {
    "examples/reasoning_gym/grpo.yaml": GYM,
    "examples/reasoning_gym/grpo_base.yaml": GYM,
    "examples/reasoning_gym/grpo_steps.yaml": GYM,
    "examples/reasoning_gym/sft.yaml": GYM,
    "examples/reasoning_gym/sft_steps.yaml": GYM,
    "examples/shapes/sft.yaml": ["data.batch_size=16"],
    "examples/tools/grpo_calculator.yaml": ["data.max_prompt_length=1536"],
}


def _link(path: Path, target: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


@pytest.fixture(scope="module")
def demo_root(tiny_task, teacher_model, shapes_task, tmp_path_factory):  # type: ignore[no-untyped-def]
    """A working directory as the examples expect it: the prepared tasks' data, the models of
    earlier runs, and a fetched SmolLM2 (a tiny model with its chat template and room for
    the chat prompts)."""
    from treadle.tasks.calculator import prepare as prepare_calculator
    from treadle.tasks.chat_arithmetic import prepare_chat

    root = tmp_path_factory.mktemp("demo_root")
    _link(root / "data" / "arithmetic", tiny_task["model"].parent)
    _link(root / "data" / "shapes", shapes_task["model"].parent)
    prepare_chat(root / "data" / "chat_arithmetic", n_train=64, n_test=8)
    prepare_calculator(root / "data" / "calculator", n_train=16, n_test=8)
    chat = tiny_model(root / "smollm2", tiny_task["model"], max_positions=2048)
    models = {
        "runs/arithmetic/sft/final_model": tiny_task["model"],
        "runs/arithmetic/grpo/final_model": teacher_model,
        "runs/reasoning_gym/sft/final_model": chat,
        "runs/reasoning_gym/sft_steps/final_model": chat,
        "runs/shapes/sft/final_model": shapes_task["model"],
        "runs/smollm2/sft/final_model": chat,
        ".cache/treadle/models/smollm2-135m-instruct": chat,
    }
    for name, target in models.items():
        _link(root / name, target)
    (root / "examples").symlink_to(ROOT / "examples")
    return root


def test_every_example_passes_with_no_kind(demo_root, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(demo_root)
    monkeypatch.setenv("HOME", str(demo_root))  # ~/.cache/treadle/models/...
    monkeypatch.syspath_prepend(str(demo_root))
    failed = {}
    for config in EXAMPLES:
        code = main(["check", config, *OVERRIDES.get(config, [])])
        out, err = capsys.readouterr()
        kind = KINDS.get(config, "train")
        first = out.splitlines()[0] if out else ""
        if code != 0 or not first.startswith(f"checking for `treadle {kind}`: "):
            failed[config] = (code, first, err)
        else:
            assert out.strip().endswith(f"ok: ready for `treadle {kind}`"), out
    assert not failed, "\n".join(f"{c}: {v}" for c, v in failed.items())
    assert not list(demo_root.glob("runs/*/*/config.yaml"))  # a check writes nothing


def test_kind_still_overrides(demo_root, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(demo_root)
    assert main(["check", "examples/arithmetic/rm.yaml", "--kind", "dpo"]) == 0
    out = capsys.readouterr().out
    assert not out.startswith("checking for") and out.endswith("ok: ready for `treadle dpo`\n")


def test_a_config_of_two_commands_asks_for_kind(capsys) -> None:  # type: ignore[no-untyped-def]
    """Settings only `treadle dpo` reads and settings only `treadle kto` reads: which command
    the check should be for is the user's to say (before any file is read)."""
    code = main(["check", "examples/arithmetic/dpo.yaml", "kto.desirable_weight=1.5"])
    assert code == 2
    assert capsys.readouterr().err == (
        "treadle: error: cannot tell which command the config is for: it sets dpo.nll_coef=1.0 "
        "(`treadle dpo`) and kto.desirable_weight=1.5 (`treadle kto`): give --kind dpo or "
        "--kind kto\n"
    )


def test_a_judge_or_a_curriculum_says_train() -> None:
    """An LLM judge and the curriculum are RL's alone: a config with either is for `treadle
    train` whatever its rows hold, and the line names the judge's own keys, not its section."""
    from treadle.check.kind import infer_kind
    from treadle.config import load_config

    judged = ["reward.judge.model_path=/judge", 'reward.judge.template="{answer}"']
    cfg = load_config("examples/arithmetic/sft.yaml", judged)
    assert infer_kind(cfg) == ("train", "it sets reward.judge.model_path=/judge and 1 more")
    cfg = load_config("examples/arithmetic/sft.yaml", ["data.sampler=pass_rate"])
    assert infer_kind(cfg) == ("train", "it sets data.sampler=pass_rate")


def test_train_on_a_config_for_another_command_says_so() -> None:
    """`treadle train` on an SFT config runs RL (the config has every setting RL needs), so its
    first line says which command the config looks like it is for; an RL config gets none."""
    from treadle.cli.commands import another_command
    from treadle.config import load_config

    sft = load_config("examples/reasoning_gym/sft.yaml", [])
    assert another_command(sft, "train") == (
        "treadle: note: this config looks like one for `treadle sft` (no RL setting, and "
        "reasoning-gym's rows, with their answers to learn); `treadle train` runs it as asked"
    )
    assert another_command(load_config("examples/reasoning_gym/grpo.yaml", []), "train") is None
