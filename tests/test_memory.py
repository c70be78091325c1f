"""trim_heap: freed heap memory goes back to the system (glibc's malloc_trim)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from treadle.runtime.memory import trim_heap


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


HEAP = """
import json, sys, torch
from treadle.runtime.memory import _libc, free_heap_bytes, keep_heap, release_heap

kept = sys.argv[1] == "keep" and keep_heap()
mapped = _libc().mallinfo2().hblks  # blocks of their own (mmap)
block = torch.ones(2**22)  # 16 MiB, as an update's activations
mapped = _libc().mallinfo2().hblks - mapped
del block
free = free_heap_bytes()
print(json.dumps({
    "kept": kept,
    "mapped": mapped,
    "free": free,
    "released_past_huge_keep": release_heap(keep=2**40),
    "released_past_no_keep": release_heap(keep=0),
}))
"""


def _heap(mode: str) -> dict:
    cmd = [sys.executable, "-c", HEAP, mode]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.slow
def test_keep_heap_serves_the_next_update_from_the_same_pages():
    """In a fresh process glibc maps a 16 MiB block on its own and unmaps it when freed (the
    next update faults all its pages again); after keep_heap it comes from the heap and stays
    there when freed. release_heap gives the free memory back only past its ``keep``."""
    default = _heap("default")
    assert default["kept"] is False and default["mapped"] == 1, default
    kept = _heap("keep")
    assert kept["kept"] is True and kept["mapped"] == 0, kept
    assert kept["free"] >= 16 * 2**20, kept
    assert kept["released_past_huge_keep"] is False and kept["released_past_no_keep"] is True
