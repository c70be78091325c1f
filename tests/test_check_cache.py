"""`treadle check` keeps what passed by file fingerprint (treadle.runtime.cache): a second check
of the same files loads no tokenizer and reads no rows, and a changed file is read again."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from treadle.cli import main
from treadle.models import folders as model_folders
from treadle.runtime import cache


@pytest.fixture
def kept(monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    """A cache of this test's own that trusts files however young (no 2 s wait)."""
    monkeypatch.setenv(cache.ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "SETTLE_S", 0.0)


def check(capsys, env, *overrides: str) -> tuple[int, str, str]:  # type: ignore[no-untyped-def]
    code = main(["check", env["config"], *overrides])
    out, err = capsys.readouterr()
    return code, out, err


def no_tokenizer(*args, **kwargs):  # type: ignore[no-untyped-def]
    raise AssertionError("the tokenizer was loaded")


def test_a_second_check_loads_no_tokenizer_and_says_the_same(env, capsys, kept, monkeypatch):  # type: ignore[no-untyped-def]
    first = check(capsys, env)
    assert first[0] == 0, first[2]
    monkeypatch.setattr(model_folders, "load_tokenizer", no_tokenizer)
    assert check(capsys, env) == first


def test_a_changed_data_file_is_read_again(env, capsys, kept, monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    train = tmp_path / "train.jsonl"
    shutil.copy(env["train"], train)
    assert check(capsys, env, f"data.train_files=[{train}]")[0] == 0
    # the same size, row 2 no longer JSON (datasets' own cache of the file, by path and
    # mtime, would not see it if its mtime were put back: see the fingerprint's test below)
    text = train.read_text()
    size = train.stat().st_size
    train.write_text("{" + text[1:].replace("{", "[", 1))
    assert train.stat().st_size == size
    code, _, err = check(capsys, env, f"data.train_files=[{train}]")
    assert code == 2 and "treadle: error: data.train_files: cannot read" in err, err
    # a changed tokenizer folder misses too: the tokenizer is loaded again
    model = tmp_path / "model"
    shutil.copytree(env["model"], model)
    assert check(capsys, env, f"model.path={model}")[0] == 0
    (model / "tokenizer_config.json").write_text((model / "tokenizer_config.json").read_text())
    monkeypatch.setattr(model_folders, "load_tokenizer", no_tokenizer)
    code, _, err = check(capsys, env, f"model.path={model}")
    assert code == 2 and "the tokenizer was loaded" in err, err


def test_young_files_are_not_trusted(env, capsys, monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    """A file written within SETTLE_S seconds could change again within one clock tick."""
    monkeypatch.setenv(cache.ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "SETTLE_S", 3600.0)  # (however long the check takes here)
    train = tmp_path / "train.jsonl"
    shutil.copy(env["train"], train)
    assert check(capsys, env, f"data.train_files=[{train}]")[0] == 0
    rows = Path(tmp_path / "cache" / "rows")
    kept = [p.read_text() for p in rows.iterdir()] if rows.is_dir() else []
    assert not any(str(train) in text for text in kept)


def test_a_file_written_with_its_old_mtime_put_back_has_another_fingerprint(tmp_path):  # type: ignore[no-untyped-def]
    """``cp -p``, ``rsync -t``, ``touch -d``: the change time moves all the same."""
    file = tmp_path / "rows.jsonl"
    file.write_text('{"a": 1}\n')
    before, stat = cache.fingerprint(file), file.stat()
    time.sleep(0.05)
    file.write_text('{"a": 2}\n')
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = cache.fingerprint(file)
    assert after[3:5] == before[3:5]  # size and mtime
    assert after != before


def test_rows_kept_for_one_reward_are_checked_again_for_another(env, capsys, kept, tmp_path):  # type: ignore[no-untyped-def]
    """The prompts' ground truths are held to reward.function's rule (arithmetic: integers):
    rows that passed with a reward without a rule are not taken as passing for arithmetic."""
    train = tmp_path / "words.jsonl"
    train.write_text('{"prompt": "Say a word.", "answer": "abc"}\n' * 8)
    reward = tmp_path / "any.py"
    reward.write_text("def score(prompt, response, ground_truth):\n    return 0.0\n")
    rows = [f"data.train_files=[{train}]", "data.val_files=[]"]
    code, _, err = check(capsys, env, *rows, f"reward.function={reward}:score")
    assert code == 0, err
    code, _, err = check(capsys, env, *rows)
    assert code == 2 and "words.jsonl row 1: answer 'abc' is not an integer" in err, err
