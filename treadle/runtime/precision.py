"""Whether bfloat16 is native here, for ``actor.mixed_precision: auto``, ``rollout.dtype: auto``
and ``treadle check``.

bfloat16 matrix products are native on a CUDA GPU that has them and on x86 CPUs with AVX-512
BF16 or AMX (or an Arm CPU with its BF16 extension). Elsewhere torch emulates them: on a 2-core
AMD EPYC with AVX2 only (2026-11-29) a SmolLM2-135M SFT step took 240 s in bf16 against 9 s in
float32; on an AVX-512 BF16 CPU bf16 was 2.2-2.8x faster than float32 (docs/findings.md).
"""

from __future__ import annotations

import functools
from pathlib import Path

CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # x86 (Linux names), Arm
FIXES = {"actor.mixed_precision": "auto (bf16 where native) or none"}  # else float32


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of ``/proc/cpuinfo``'s text (x86 ``flags``, Arm ``Features``)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


@functools.cache
def cpu_native_bf16() -> bool:
    """This CPU multiplies bfloat16 natively (read from /proc/cpuinfo: unknown counts as no)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(cpu_flags(text) & CPU_BF16_FLAGS)


def native_bf16() -> bool:
    """bfloat16 products run natively on this process's device: a CUDA GPU when there is one,
    else the CPU."""
    import torch

    if torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    return cpu_native_bf16()


def emulated_bf16(settings: dict[str, str]) -> str | None:
    """A warning when the settings (config key: value) compute in bfloat16 on a machine that
    emulates it: a CPU without native bfloat16 and no NVIDIA driver (the check does not import
    torch); None otherwise."""
    bf16 = {key: value for key, value in settings.items() if value in ("bf16", "bfloat16")}
    if not bf16 or cpu_native_bf16() or Path("/proc/driver/nvidia/version").exists():
        return None
    asked = " and ".join(f"{key}={value}" for key, value in bf16.items())
    fixes = ", ".join(f"{key}={FIXES.get(key, 'float32')}" for key in bf16)
    return (
        f"{asked}: this CPU has no native bfloat16 (AVX-512 BF16 or AMX), so torch emulates "
        f"it, about 25x slower than float32: set {fixes}"
    )


def compute_bf16(mixed_precision: str) -> bool:
    """Whether ``actor.mixed_precision`` computes in bfloat16 here (``auto``: where native)."""
    return mixed_precision == "bf16" or (mixed_precision == "auto" and native_bf16())


def rollout_dtype(asked: str | None, model_dtype: str) -> str:
    """The rollout engine's weight dtype: ``rollout.dtype``, or ``model.dtype`` when it is null;
    ``auto`` is bfloat16 where it is native here, else ``model.dtype``."""
    if asked == "auto":
        return "bfloat16" if native_bf16() else model_dtype
    return asked or model_dtype
