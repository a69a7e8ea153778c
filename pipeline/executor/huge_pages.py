"""One block of memory for a model's weight matrices, in transparent huge pages where Linux gives them.

A decode step streams every weight matrix from memory once. In 4 KiB pages that is a new page, and a TLB miss, every
4 KiB of weights; in 2 MiB pages one every 2 MiB. torch allocates in whatever pages the system gives, and under the
kernel's usual setting (``madvise`` in /sys/kernel/mm/transparent_hugepage/enabled) huge pages go only to memory that
asks for them. An Arena is one private anonymous mapping that asks (``madvise(MADV_HUGEPAGE)``) and hands out
copies of tensors inside it; the lean decoder keeps its matrices there. On an AMD EPYC (Zen 3, 2 threads) a float32
step of SmolLM2-135M ran 8-10% faster with them (interleaved in one process; docs/cpu-speed.md).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch
from torch import Tensor

SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ALIGN = 64  # bytes: every tensor starts on a cache line
OFF_SWITCH = "SPECPIPE_NO_HUGE_PAGES"  # set (to anything) to leave the matrices where torch put them
# A model's matrices under this many bytes stay where torch put them: they fit in a few dozen 2 MiB pages' reach of
# the TLB either way, and an arena per small model (the tests open hundreds) would only round each up to whole pages.
MIN_BYTES = 64 << 20


def unavailable(setting: Path = SETTING) -> str | None:
    """Why an Arena cannot ask for huge pages here (a sentence), or None."""
    if os.environ.get(OFF_SWITCH):
        return f"turned off by {OFF_SWITCH}"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "this system has no madvise(MADV_HUGEPAGE)"
    try:
        mode = setting.read_text()
    except OSError:
        return f"{setting} cannot be read (not Linux, or no transparent huge pages)"
    if "[never]" in mode:
        return f"transparent huge pages are off ({setting}: never)"
    return None


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Arena:
    """``capacity`` bytes of private anonymous memory advised for huge pages; ``copy`` places tensors in it. The
    mapping lives as long as any tensor made from it."""

    def __init__(self, capacity: int):
        self._map = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._map.madvise(mmap.MADV_HUGEPAGE)  # before anything touches it: pages are made huge as they are touched
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.used = 0

    def copy(self, tensor: Tensor) -> Tensor:
        """A contiguous copy of the CPU tensor ``tensor`` inside the arena."""
        size = tensor.numel() * tensor.element_size()
        if self.used + size > len(self._bytes):
            raise ValueError(f"the arena holds {len(self._bytes)} bytes, {self.used} used: {size} more do not fit")
        out = self._bytes[self.used:self.used + size].view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        self.used = padded(self.used + size)
        return out
