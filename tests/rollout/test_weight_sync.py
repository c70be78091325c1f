"""The weight-sync group on its own (treadle.serving.weight_sync): rank 0 and a replica, two
threads of this process over gloo; an NCCL group's options with a stand-in for its class."""

from __future__ import annotations

import datetime
import threading

import torch.distributed as dist

from treadle.controller import free_port
from treadle.serving.weight_sync import WeightSyncGroup


def test_the_payloads_arrive_whole_and_in_order():
    port = free_port()
    payloads = [b"abc", bytes(range(256)) * 5, b"x"]
    got: list[bytes] = []

    def replica() -> None:
        got.extend(WeightSyncGroup("127.0.0.1", port, 1, 2, timeout_s=60).receive())

    thread = threading.Thread(target=replica)
    thread.start()
    sent = WeightSyncGroup("127.0.0.1", port, 0, 2, timeout_s=60).send(iter(payloads))
    thread.join(60)
    assert sent == sum(map(len, payloads)) and got == payloads


def test_an_nccl_group_takes_the_syncs_timeout(monkeypatch):
    """A plain ProcessGroupNCCL.Options() has torch's 10 minutes, not ``timeout_s``."""
    made: dict[str, object] = {}

    class NCCL:  # torch's ProcessGroupNCCL, which a CPU build lacks
        class Options:
            _timeout = datetime.timedelta(minutes=10)

        def __init__(self, store, rank, size, options) -> None:
            made.update(rank=rank, size=size, timeout=options._timeout)

    monkeypatch.setattr(dist, "ProcessGroupNCCL", NCCL, raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    group = WeightSyncGroup("127.0.0.1", free_port(), 0, 1, timeout_s=42)
    assert isinstance(group.group, NCCL)
    assert made == {"rank": 0, "size": 1, "timeout": datetime.timedelta(seconds=42)}
