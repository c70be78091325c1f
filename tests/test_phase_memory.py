"""Peak device memory per phase (``perf/max_memory_*_gib``, as verl logs it), on a stand-in for
``torch.cuda`` that counts as CUDA's caching allocator does; on this CPU, none at all."""

from __future__ import annotations

import pytest

from treadle.tracking import tracker
from treadle.tracking.tracker import device_memory, timed

GIB = 1 << 30


class FakeCuda:
    """``max_memory_*`` since the last reset; a reset starts the peaks at what is held now."""

    def __init__(self) -> None:
        self.allocated = self.reserved = 0
        self.peaks = [0, 0]

    def hold(self, allocated: float, reserved: float) -> None:
        self.allocated, self.reserved = int(allocated * GIB), int(reserved * GIB)
        self.peaks = [max(self.peaks[0], self.allocated), max(self.peaks[1], self.reserved)]

    def reset_peak_memory_stats(self) -> None:
        self.peaks = [self.allocated, self.reserved]

    def max_memory_allocated(self) -> int:
        return self.peaks[0]

    def max_memory_reserved(self) -> int:
        return self.peaks[1]


def test_each_phase_and_the_step_have_their_peaks(monkeypatch):
    cuda = FakeCuda()
    monkeypatch.setattr(tracker, "device_memory", lambda: cuda)
    cuda.hold(2, 3)  # the weights, before the step
    m: dict[str, float] = {}
    with timed(m, "generate"):
        cuda.hold(6, 8)  # the KV cache
        cuda.hold(2, 8)
    with timed(m, "update_actor"):
        cuda.hold(5, 8)
        with timed(m, "inner"):  # resets the counters: update_actor keeps its 5 all the same
            cuda.hold(4, 8)  # (its own peak: the 5 held as it began, as CUDA counts it)
        cuda.hold(2, 8)
    with timed(m, "generate"):  # a second round: the phase's peak is the higher
        cuda.hold(7, 9)
        cuda.hold(2, 9)
    peaks = {k: v for k, v in m.items() if k.startswith("perf/")}
    assert peaks == {
        "perf/max_memory_allocated_gib/generate": 7.0,
        "perf/max_memory_reserved_gib/generate": 9.0,
        "perf/max_memory_allocated_gib/update_actor": 5.0,
        "perf/max_memory_reserved_gib/update_actor": 8.0,
        "perf/max_memory_allocated_gib/inner": 5.0,
        "perf/max_memory_reserved_gib/inner": 8.0,
        "perf/max_memory_allocated_gib": 7.0,
        "perf/max_memory_reserved_gib": 9.0,
    }
    assert m["timing/generate"] > 0


def test_a_phase_on_this_cpu_logs_its_time_only():
    assert device_memory() is None  # no GPU here: nothing to read
    m: dict[str, float] = {}
    with timed(m, "generate"):
        pass
    assert list(m) == ["timing/generate"]


@pytest.mark.parametrize("phase", ["generate"])
def test_a_phase_that_fails_still_logs_its_peak(monkeypatch, phase):
    cuda = FakeCuda()
    monkeypatch.setattr(tracker, "device_memory", lambda: cuda)
    m: dict[str, float] = {}
    with pytest.raises(RuntimeError), timed(m, phase):
        cuda.hold(3, 4)
        raise RuntimeError("out of memory")
    assert m["perf/max_memory_allocated_gib/generate"] == 3.0
    assert tracker._PEAKS.stack == []  # the next phase starts clean


def test_a_ray_workers_update_reports_its_own_peak(monkeypatch):
    """A Ray worker's methods that return metrics (``Collect.MEAN``: the updates) add their
    peak, named by the method, since the driver's phase timers cannot see a worker's device;
    other methods, and any method without a GPU, return what they return."""
    from treadle.controller.groups.dispatch import Collect, Dispatch, method_spec, register
    from treadle.controller.groups.worker import Worker, guarded

    cuda = FakeCuda()

    class Toy(Worker):
        def __init__(self) -> None:  # (no process group: the wrapper is what is tested)
            pass

        @register(Dispatch.DP, Collect.MEAN)
        def update_actor(self, peak: float) -> dict[str, float]:
            cuda.hold(peak, peak + 1)
            cuda.hold(1, peak + 1)
            return {"actor/loss": 0.5}

        @register(Dispatch.ALL, Collect.RANK0)
        def settings(self) -> dict[str, float]:
            cuda.hold(9, 9)
            return {"lr": 1e-6}

    worker = guarded(Toy)()
    assert worker.update_actor(6) == {"actor/loss": 0.5}  # this CPU: no GPU, no peaks
    monkeypatch.setattr(tracker, "device_memory", lambda: cuda)
    cuda.hold(2, 3)  # the weights
    assert worker.update_actor(6) == {
        "actor/loss": 0.5,
        "perf/max_memory_allocated_gib/update_actor": 6.0,
        "perf/max_memory_reserved_gib/update_actor": 7.0,
    }
    assert worker.settings() == {"lr": 1e-6}
    assert method_spec(type(worker).update_actor) == method_spec(Toy.update_actor)
