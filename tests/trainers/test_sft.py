"""Multi-turn SFT through `treadle sft`: the loss is on assistant turns only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from treadle.cli import main
from treadle.models.loading import load_causal_lm, load_tokenizer
from treadle.tracking.tracker import read_metrics


def conversations(train_file, n: int) -> list[list[dict[str, str]]]:
    rows = [json.loads(x) for x in train_file.read_text().splitlines()[: 2 * n]]
    return [
        [
            {"role": "system", "content": "Be exact."},
            {"role": "user", "content": first["prompt"]},
            {"role": "assistant", "content": first["solution"]},
            {"role": "user", "content": second["prompt"]},
            {"role": "assistant", "content": second["solution"]},
        ]
        for first, second in zip(rows[::2], rows[1::2], strict=True)
    ]


def plain_losses(model, tok, chats) -> tuple[float, float]:
    """Token-mean NLL over assistant turns (content + <|im_end|>), and over every token.

    Computed on the whole conversation rendered by the chat template and tokenized at once;
    the assistant spans are found in the tokens: after `<|im_start|>assistant\\n`, up to and
    including the next `<|im_end|>`.
    """
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    nll_sum, count, all_sum, all_count = 0.0, 0, 0.0, 0
    for chat in chats:
        text = tok.apply_chat_template(chat, tokenize=False).removesuffix("\n")
        ids = tok.encode(text, add_special_tokens=False)
        mask = [0] * len(ids)
        for i in range(len(ids)):
            if ids[i] == start and ids[i : i + len(header)] == header:
                j = i + len(header)
                while ids[j] != end:
                    mask[j] = 1
                    j += 1
                mask[j] = 1
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        nll = -F.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        target = torch.tensor(mask[1:], dtype=torch.bool)
        nll_sum += float(nll[target].sum())
        count += int(target.sum())
        all_sum += float(nll.sum())
        all_count += len(nll)
    return nll_sum / count, all_sum / all_count


@pytest.mark.slow
def test_multi_turn_sft_loss_is_on_assistant_turns_only(tiny_task, tmp_path):
    chats = conversations(tiny_task["train"], 12)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    out = tmp_path / "sft"
    code = main(
        [
            "sft",
            "examples/arithmetic/sft.yaml",
            f"model.path={tiny_task['model']}",
            f"data.train_files=[{data}]",
            "data.val_files=[]",
            "data.max_prompt_length=80",  # + rollout.max_new_tokens=48: the 128 positions
            "data.batch_size=12",  # the whole file: step 1's loss is the loss over all chats
            "actor.micro_batch_size=5",
            "actor.ppo_mini_batch_size=12",
            "rollout.engine=hf",
            "trainer.backend=local",
            "trainer.total_steps=2",
            "trainer.progress=false",
            f"trainer.output_dir={out}",
        ]
    )
    assert code == 0
    metrics = read_metrics(out)
    assistant, everything = plain_losses(
        load_causal_lm(tiny_task["model"]), load_tokenizer(tiny_task["model"]), chats
    )
    assert metrics[0]["sft/loss"] == pytest.approx(assistant, rel=1e-5)
    assert everything != pytest.approx(assistant, rel=1e-3)  # the check tells the two apart
    assert metrics[1]["sft/loss"] < metrics[0]["sft/loss"]


def test_an_sft_run_directory_is_not_resumed_by_treadle_train(tiny_task, tmp_path, capsys):
    """`treadle train` in a directory of SFT checkpoints resumed the SFT run's step 2 as its
    own (one GRPO step ran, metrics.jsonl mixed both): every checkpoint now says which command
    wrote it, and the check refuses another command's."""
    out = tmp_path / "run"
    common = [f"model.path={tiny_task['model']}", f"data.train_files=[{tiny_task['train']}]"]
    common += ["data.val_files=[]", "trainer.backend=local", f"trainer.output_dir={out}"]
    sft = ["data.batch_size=2", "actor.micro_batch_size=2", "actor.ppo_mini_batch_size=2"]
    sft += ["rollout.engine=hf", "actor.warmup_steps=1", "trainer.total_steps=2"]
    sft += ["trainer.progress=false"]
    assert main(["sft", "examples/arithmetic/sft.yaml", *common, *sft]) == 0
    assert json.loads((out / "checkpoints/step_2/state.json").read_text())["command"] == "sft"
    capsys.readouterr()
    assert main(["train", "examples/arithmetic/grpo.yaml", *common]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"treadle: error: trainer.output_dir: '{out}' holds a `treadle sft` run (checkpoints up "
        "to step_2), which `treadle train` would resume as its own: set trainer.output_dir to "
        "another directory"
    ]
    assert [m["step"] for m in read_metrics(out)] == [1, 2]  # nothing written by the refusal


def test_a_resumed_run_refuses_another_model_and_names_the_settings_it_changed(
    tiny_task, tmp_path, capsys, monkeypatch
):
    """A run resumed with another model.path trained the checkpoint's weights against the new
    model (the reference, LoRA's base) without a word: every checkpoint records its run's
    settings, the check refuses a change of what it was trained from and names the others; a
    model folder moved elsewhere, or a path written relative to another directory, is the same."""
    moved = tmp_path / "models"
    shutil.copytree(tiny_task["model"], moved / "before")
    out = tmp_path / "run"
    common = [f"data.train_files=[{tiny_task['train']}]", "data.val_files=[]"]
    common += ["trainer.backend=local", f"trainer.output_dir={out}", "trainer.progress=false"]
    common += ["data.batch_size=2", "actor.micro_batch_size=2", "actor.ppo_mini_batch_size=2"]
    common += ["rollout.engine=hf", "actor.warmup_steps=1"]
    config = str(Path("examples/arithmetic/sft.yaml").resolve())
    sft = ["sft", config, *common]
    assert main([*sft, f"model.path={moved / 'before'}", "trainer.total_steps=2"]) == 0
    settings = json.loads((out / "checkpoints/step_2/state.json").read_text())["settings"]
    assert settings["model.path"]["path"] == str((moved / "before").resolve())
    assert settings["trainer.total_steps"] == 2
    capsys.readouterr()

    assert main([*sft, f"model.path={tiny_task['model']}", "trainer.total_steps=3"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"treadle: error: model.path: the run in '{out}' (step_2) was trained with model.path="
        f"{(moved / 'before').resolve()}, this config has {tiny_task['model'].resolve()}: the "
        "actor resumes from the checkpoint's weights, while the reference model (and LoRA's "
        "base) would be the new one; set model.path back, or set trainer.output_dir to another "
        "directory"
    ]
    assert [m["step"] for m in read_metrics(out)] == [1, 2]  # nothing written by the refusal

    (moved / "before").rename(moved / "after")  # the same folder, moved
    monkeypatch.chdir(tiny_task["train"].parent)  # the same data file, relative to here
    common[0] = f"data.train_files=[{tiny_task['train'].name}]"
    resume = [*common, f"model.path={moved / 'after'}", "trainer.total_steps=3", "actor.lr=0.001"]
    assert main(["check", config, *resume, "--kind", "sft"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"trainer.output_dir: {out} (exists; resumes from step_2 with 2 settings " in (
        "\n".join(lines)
    )
    changed = next(line for line in lines if line.startswith("trainer.output_dir"))
    assert changed.endswith("changed: actor.lr 0.002 -> 0.001, trainer.total_steps 2 -> 3)")
    assert main(["sft", config, *resume]) == 0
    printed = capsys.readouterr().out
    assert "settings changed since: actor.lr 0.002 -> 0.001, trainer.total_steps 2 -> 3" in printed
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]
