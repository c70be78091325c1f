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
