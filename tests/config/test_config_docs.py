"""docs/config.md is the config classes' reference, and current."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from treadle.cli.docs import DOC, main, render
from treadle.config import Config, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_docs_config_md_is_current():
    assert DOC.read_text() == render(), (
        "docs/config.md is out of date with treadle/config/: run `python -m treadle.cli.docs` "
        "and commit the result"
    )


def _fields(model: type[BaseModel], path: str):
    for name, field in model.model_fields.items():
        key = field.alias or name
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            yield from _fields(sub, f"{path}.{key}" if path else key)
        else:
            yield path, key, field


def test_every_key_has_a_row_with_its_description_under_its_section():
    text = render()
    sections = {}
    for part in text.split("\n## ")[1:]:
        for chunk in ("## " + part).split("\n### "):
            title, _, body = chunk.partition("\n")
            sections[title.strip("# `")] = body
    keys = list(_fields(Config, ""))
    assert len(keys) > 100  # every section, not a few
    for path, key, field in keys:
        assert field.description, f"{path}.{key} has no description"
        rows = [r for r in sections[path].splitlines() if r.startswith(f"| `{key}` |")]
        assert len(rows) == 1, f"{path}.{key}: {len(rows)} rows"
        assert field.description.replace("|", "\\|") in rows[0]
    assert "| `batch_size` | int (> 0) | `16` |" in sections["data"]
    assert "| `tokenizer_path` | str \\| null | `null` |" in sections["model"]
    assert '| `engine` | "hf" \\| "vllm" | `hf` |' in sections["rollout"]


def test_check_fails_on_a_stale_file_naming_the_command(tmp_path, capsys):
    assert main(["--dir", str(tmp_path)]) == 0  # writes config.md and algorithms.md
    assert main(["--check", "--dir", str(tmp_path)]) == 0
    stale = tmp_path / "config.md"
    stale.write_text(render().replace("| `batch_size` |", "| `batch` |"))
    assert main(["--check", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err == f"{stale} is out of date: run `python -m treadle.cli.docs`\n"
    assert main(["--dir", str(tmp_path)]) == 0 and main(["--check", "--dir", str(tmp_path)]) == 0


def test_command_help_lists_the_sections_and_an_example(capsys):
    import pytest

    from treadle.cli import main as cli

    for command in ("train", "sft", "dpo", "kto", "rm", "eval", "check"):
        with pytest.raises(SystemExit) as done:
            cli([command, "--help"])
        assert done.value.code == 0
        out = capsys.readouterr().out
        for section in ("model", "data", "rollout", "reward", "algorithm", "actor", "trainer"):
            assert f"\n  {section} " in out, (command, section)
        assert "  algorithm  adv_estimator, norm_adv_by_std," in out
        assert "docs/config.md" in out
        example = out.split("example:\n", 1)[1].strip()
        assert example.startswith(f"treadle {command} examples/")
        _, _, config, *rest = example.split()
        overrides = [a for a in rest if "=" in a]  # not --kind dpo
        load_config(ROOT / config, overrides)  # the example's file and keys are valid
