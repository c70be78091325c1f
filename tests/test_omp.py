"""OpenMP's waiting in treadle's processes (treadle.runtime.omp): the driver from the command
line and every Ray worker spin 10,000 rounds unless GOMP_SPINCOUNT says otherwise."""

from __future__ import annotations

import os

import pytest

from treadle.cli import main
from treadle.controller.placement import ray_env
from treadle.runtime.omp import openmp_env


def test_ten_thousand_rounds_unless_the_process_says_otherwise(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert openmp_env() == {"GOMP_SPINCOUNT": "10000"}
    env = ray_env(2, 0.0)
    assert env["GOMP_SPINCOUNT"] == "10000" and env["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")  # a user's own setting is kept
    assert openmp_env() == {"GOMP_SPINCOUNT": "300000"}
    assert ray_env(1, 1.0)["GOMP_SPINCOUNT"] == "300000"


def test_the_command_line_sets_it_before_anything_else(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert main(["check", str(tmp_path / "missing.yaml")]) != 0
    assert os.environ["GOMP_SPINCOUNT"] == "10000"
    assert "missing.yaml" in capsys.readouterr().err
