"""bfloat16 where it is native: ``actor.mixed_precision: auto`` and the check's warning."""

from __future__ import annotations

import pytest
import torch

from treadle.config import load_config
from treadle.runtime import precision
from treadle.workers.common import engine_options

XEON_AMX = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
EPYC_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\nprocessor\t: 1\nflags\t\t: fpu avx2\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"


def test_cpu_flags_read_x86_and_arm_cpuinfo():
    assert precision.cpu_flags(EPYC_AVX2) == {"fpu", "sse2", "avx2", "fma"}
    assert precision.CPU_BF16_FLAGS & precision.cpu_flags(XEON_AMX) == {"avx512_bf16", "amx_bf16"}
    assert precision.CPU_BF16_FLAGS & precision.cpu_flags(ARM) == {"bf16"}
    assert not precision.CPU_BF16_FLAGS & precision.cpu_flags(EPYC_AVX2)


@pytest.mark.parametrize("native", [True, False])
def test_auto_computes_in_bf16_only_where_native(monkeypatch, native):
    monkeypatch.setattr(precision, "native_bf16", lambda: native)
    dtypes = {
        mode: engine_options(load_config(None, [f"actor.mixed_precision={mode}"]))["compute_dtype"]
        for mode in ("none", "bf16", "auto")
    }
    assert dtypes == {
        "none": None,
        "bf16": torch.bfloat16,
        "auto": torch.bfloat16 if native else None,
    }


@pytest.mark.parametrize("native", [True, False])
def test_rollout_dtype_auto_is_bfloat16_only_where_native(monkeypatch, native):
    from treadle.serving.replica import role_engine

    monkeypatch.setattr(precision, "native_bf16", lambda: native)
    got = {
        (asked, model): role_engine(
            load_config(None, [f"rollout.dtype={asked}", f"model.dtype={model}"]), "rollout", "m"
        ).dtype
        for asked in ("null", "float32", "bfloat16", "auto")
        for model in ("float32", "bfloat16")
    }
    auto = "bfloat16" if native else "float32"
    assert got == {
        ("null", "float32"): "float32",
        ("null", "bfloat16"): "bfloat16",
        ("float32", "float32"): "float32",
        ("float32", "bfloat16"): "float32",
        ("bfloat16", "float32"): "bfloat16",
        ("bfloat16", "bfloat16"): "bfloat16",
        ("auto", "float32"): auto,
        ("auto", "bfloat16"): "bfloat16",
    }


def test_warning_names_each_bf16_setting_and_its_fix(monkeypatch):
    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: False)
    monkeypatch.setattr(precision, "Path", _NoDriver)
    warning = precision.emulated_bf16(
        {"model.dtype": "float32", "actor.mixed_precision": "bf16", "rollout.dtype": "bfloat16"}
    )
    assert warning == (
        "actor.mixed_precision=bf16 and rollout.dtype=bfloat16: this CPU has no native bfloat16 "
        "(AVX-512 BF16 or AMX), so torch emulates it, about 25x slower than float32: set "
        "actor.mixed_precision=auto (bf16 where native) or none, rollout.dtype=float32"
    )
    assert precision.emulated_bf16({"actor.mixed_precision": "auto"}) is None
    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: True)
    assert precision.emulated_bf16({"actor.mixed_precision": "bf16"}) is None


class _NoDriver:  # a machine without an NVIDIA driver
    def __init__(self, path: str) -> None:
        self.path = path

    def exists(self) -> bool:
        return False


def test_check_warns_of_what_the_command_uses(monkeypatch):
    from treadle.check.machine import precision_warning

    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: False)
    monkeypatch.setattr(precision, "Path", _NoDriver)
    cfg = load_config(None, ["actor.mixed_precision=bf16", "rollout.dtype=bfloat16"])
    assert precision_warning(cfg, "sft").startswith("actor.mixed_precision=bf16: ")  # type: ignore[union-attr]
    assert precision_warning(cfg, "eval").startswith("rollout.dtype=bfloat16: ")  # type: ignore[union-attr]
    assert precision_warning(cfg, "train").startswith(  # type: ignore[union-attr]
        "actor.mixed_precision=bf16 and rollout.dtype=bfloat16: "
    )
    joined = load_config(None, ["actor.mixed_precision=bf16", "trainer.backend=ray",
                                "trainer.ray_address=10.0.0.1:6379"])  # fmt: skip
    assert precision_warning(joined, "sft") is None  # another machine's CPUs
