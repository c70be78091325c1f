"""trim_heap: freed heap memory goes back to the system (glibc's malloc_trim)."""

from __future__ import annotations

import os

import torch

from treadle.memory import trim_heap


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_trim_heap_gives_freed_memory_back():
    # many small blocks (below the mmap threshold: from the heap), every other one freed, so
    # the heap's top stays in use and only malloc_trim can return the holes (whole pages)
    blocks = [torch.empty(20_000 + i % 64, dtype=torch.uint8).fill_(1) for i in range(6_000)]
    del blocks[::2]
    before = _rss_mib()
    assert trim_heap() is True  # glibc on Linux
    after = _rss_mib()
    assert after < before - 20, (before, after)  # ~60 MiB freed in holes
    del blocks
