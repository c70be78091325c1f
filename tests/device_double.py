"""A second device on a CPU: the guard that catches "cuda:0 and cpu" bugs in CI.

On a GPU the driver's batch lives on the host and a worker's model on the device; an op that
mixes the two fails ("Expected all tensors to be on the same device, but found at least two
devices, cuda:0 and cpu"). On a CPU both are the same memory and every such op runs. Under
:class:`TwoDevices` (a ``TorchFunctionMode``) every tensor carries a place, and an op that
mixes the places fails here as it would there:

- **host**: what code makes without a device (``torch.zeros(n)``, ``torch.tensor(xs)``: on a
  GPU machine, CPU tensors), what ``.cpu()`` returns, and what follows a host tensor;
- **device**: every ``nn.Parameter`` (a worker's model sits on its device), what a factory makes
  with an explicit ``device="cpu"`` (the worker's device here: ``torch.device("cpu")``, the
  value :func:`treadle.controller.groups.device_type` gives a worker on this machine), what
  ``.to(device)`` returns, and what follows a device tensor;
- a tensor made before the mode began has no place and mixes with either.

An op's result takes its operands' place (``x.new_zeros``, ``torch.zeros_like(x)``, ``x + y``);
a host tensor reports its device as ``cpu:0`` (a device that is not the worker's ``cpu``), so
``torch.arange(n, device=x.device)`` follows ``x`` here as on a GPU. As CUDA does, a 0-dim
host tensor may take part in a device op (a CPU scalar), an op indexing a device tensor may take
host indices, and ``.to``/``copy_``/``.data =`` move between the places; ``.numpy()`` of a
device tensor fails (as on CUDA). Spell a move to the host ``.cpu()``: ``.to("cpu")`` names the
worker's device here.

What it cannot see: ops run inside a library call it let through (their operands were checked
at the call), autograd's backward (it runs the forward's ops again on the same places), and
collectives (``torch.distributed`` is no torch function; on a GPU, CPU tensors take gloo).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

HOST, DEVICE = "host", "device"
HOST_DEVICE = torch.device("cpu", 0)  # what a host tensor reports (the worker's is "cpu")
_ATTR = "_treadle_place"


class DeviceMixError(RuntimeError):
    """An op that mixed host and device tensors: on a GPU, "cuda:0 and cpu"."""


def place(t: torch.Tensor) -> str | None:
    """``host``, ``device`` or None (made before the mode: either)."""
    if isinstance(t, nn.Parameter):
        return DEVICE
    return getattr(t, _ATTR, None)


def _mark(t: Any, where: str | None) -> None:
    if where is not None and isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
        with contextlib.suppress(AttributeError, RuntimeError):  # one that takes no attributes
            setattr(t, _ATTR, where)


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _place_of_device(device: Any) -> str | None:
    """The place a ``device=`` argument names: ``cpu:0`` the host, ``cpu`` the device."""
    if device is None:
        return HOST  # made without a device: a CPU tensor on a GPU machine
    d = torch.device(device) if not isinstance(device, torch.device) else device
    if d.type == "meta":
        return None
    return HOST if d == HOST_DEVICE else DEVICE


def _to_target(args: tuple, kwargs: dict) -> tuple[bool, str | None]:
    """Whether ``Tensor.to(*args, **kwargs)`` names a place, and which."""
    for a in (*args[1:], kwargs.get("device"), kwargs.get("other")):
        if isinstance(a, torch.Tensor):
            return True, place(a)
        if isinstance(a, (str, torch.device)):
            return True, _place_of_device(a)
    return False, None


# the calls that move a tensor between the places or read across them (CUDA allows these)
_MOVES = {torch.Tensor.copy_, torch.Tensor.new_tensor, torch.tensor, torch.as_tensor}
_FACTORIES_NAMED = {
    "arange",
    "empty",
    "eye",
    "full",
    "linspace",
    "logspace",
    "ones",
    "rand",
    "randint",
    "randn",
    "randperm",
    "scalar_tensor",
    "tensor",
    "as_tensor",
    "zeros",
    "empty_strided",
    "from_numpy",
    "frombuffer",
}


def _name(func: Callable) -> str:
    return getattr(func, "__name__", "") or str(func)


class TwoDevices(TorchFunctionMode):
    """Fails an op that mixes host and device tensors (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0  # ops checked: a guard that saw nothing proves nothing
        self.errors: list[str] = []  # what it failed (a command may catch and print it)

    def _fail(self, message: str) -> DeviceMixError:
        self.errors.append(message)
        return DeviceMixError(message)

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        if func == torch.Tensor.device.__get__:
            return HOST_DEVICE if place(args[0]) == HOST else func(*args, **kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda):
            return self._move(func, args, kwargs)
        if func in (torch.Tensor.numpy, torch.Tensor.__array__) and place(args[0]) == DEVICE:
            raise self._fail(f"{_name(func)}() of a device tensor (on CUDA: a TypeError)")
        if func in _MOVES:
            return self._copy(func, args, kwargs)
        if func == torch.Tensor.data.__set__:  # t.data = u: t is now where u is (FSDP2 moves so)
            func(*args, **kwargs)
            _mark(args[0], place(args[1]))
            return None
        operands = [*_tensors(args), *_tensors(kwargs)]
        where = self._result_place(func, args, kwargs, operands)
        out = func(*args, **kwargs)
        if not (operands and out is operands[0] and place(operands[0]) is not None):  # in place
            for t in _tensors(out):
                _mark(t, where)
        return out

    def _result_place(
        self, func: Callable, args: tuple, kwargs: dict, operands: list[torch.Tensor]
    ) -> str | None:
        """Where ``func``'s result is, once its operands are found not to mix."""
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            where = self._index(func, args)
        elif operands:
            where = self._check(func, operands)
        elif _name(func) in _FACTORIES_NAMED:
            return _place_of_device(kwargs.get("device"))
        else:
            return None
        if "device" in kwargs:  # zeros_like(x, device=...), x.new_zeros(..., device=...)
            return _place_of_device(kwargs["device"])
        return where

    def _copy(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """``copy_`` (across the places, as CUDA allows), ``new_tensor`` (at its tensor's
        place), ``torch.tensor`` / ``as_tensor`` (where ``device=`` says)."""
        own = func in (torch.Tensor.copy_, torch.Tensor.new_tensor)
        where = place(args[0]) if own else None
        if where is None:
            where = _place_of_device(kwargs.get("device"))
        out = func(*args, **kwargs)
        if func is not torch.Tensor.copy_:
            _mark(out, where)
        return out

    def _move(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """``.to`` / ``.cpu()``: the result is at the place named (``.to(dtype)``: where it was),
        a new tensor object whenever the place changes (the memory is the same here)."""
        src = args[0]
        if func is torch.Tensor.cpu:
            named, where = True, HOST
        elif func is torch.Tensor.cuda:
            named, where = True, DEVICE
        else:
            named, where = _to_target(args, kwargs)
        if func is torch.Tensor.cuda:  # no CUDA here: the device is this CPU
            out = src
        elif func is torch.Tensor.cpu:
            out = func(*args, **kwargs)
        else:
            real = dict(kwargs)
            if isinstance(real.get("device"), (str, torch.device)):
                real["device"] = "cpu"
            out = func(*args, **real)
        if not named:
            where = place(src)
        if isinstance(src, nn.Parameter):
            return out
        if out is src and where != place(src):
            out = src.view_as(src)  # not src: a host tensor must stay on the host
        _mark(out, where)
        return out

    def _index(self, func: Callable, args: tuple) -> str | None:
        """``x[i]`` / ``x[i] = v``: device indices into a host tensor fail (host indices into a
        device tensor are allowed, as on CUDA); the result is at ``x``'s place."""
        x, index = args[0], args[1]
        if place(x) == HOST and any(place(i) == DEVICE and i.dim() for i in _tensors(index)):
            raise self._fail(f"{_name(func)}: a host tensor indexed by a device tensor")
        if func is torch.Tensor.__setitem__ and place(x) == DEVICE:
            value = args[2]
            if isinstance(value, torch.Tensor) and place(value) == HOST and value.dim():
                index_tensors = list(_tensors(index))
                if index_tensors:  # advanced indexing (index_put_) takes the values' device
                    raise self._fail(f"{_name(func)}: host values put into a device tensor")
        return place(x)

    def _check(self, func: Callable, operands: list[torch.Tensor]) -> str | None:
        places = [(place(t), t.dim() == 0) for t in operands]
        on_device = any(p == DEVICE for p, _ in places)
        on_host = [scalar for p, scalar in places if p == HOST]
        if on_device and on_host and not all(on_host):
            raise self._fail(
                f"{_name(func)} mixes host and device tensors (on a GPU: 'Expected all tensors "
                f"to be on the same device ... cuda:0 and cpu'); their shapes and places: "
                + ", ".join(f"{list(t.shape)} {place(t)}" for t in operands)
            )
        return DEVICE if on_device else HOST if on_host else None
