"""The memory-bound limit of decoding on this machine: how fast one-token steps could be if every step only read
the target's weights once at the machine's memory bandwidth.

A decode step of a model too big for the caches streams every weight from memory, so tokens per second can not
exceed bandwidth / weight bytes. Speculative decoding exists to beat that bound per token: K+1 tokens share one
pass over the weights. The benchmark measures the bandwidth itself (the machine's, at the thread count it runs
with) and reports the achieved rate beside the limit.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

PROBE_BYTES = 512 << 20  # far larger than any CPU cache: the read streams from memory


@dataclass(frozen=True)
class MemoryBound:
    bandwidth_gbs: float  # measured read bandwidth, 1e9 bytes per second
    weight_bytes: int  # the target's parameters as stored on the device (shared tensors counted once)
    tok_s: float  # bandwidth / weight bytes: one-token steps per second if each only read the weights

    def to_dict(self) -> dict:
        return {"memory_bandwidth_gbs": round(self.bandwidth_gbs, 2), "target_weight_bytes": self.weight_bytes,
                "memory_bound_tok_s": round(self.tok_s, 2)}


def weight_bytes(model) -> int:
    """Bytes of a model's parameters as stored (their dtype on their device); parameters() yields a tied embedding
    once. An untied input embedding is counted too although a step gathers only its rows, so for such models the
    limit is a little low (conservative)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def read_bandwidth(device: torch.device | str = "cpu", probe_bytes: int = PROBE_BYTES, repeats: int = 5) -> float:
    """Best-of-``repeats`` bandwidth (GB/s) of summing a ``probe_bytes`` float32 tensor: a streaming read, the
    access pattern of a decode step's matrix-vector products."""
    device = torch.device(device)
    data = torch.ones(probe_bytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass faults the pages in
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        data.sum()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return probe_bytes / best / 1e9


def memory_bound(model, device: torch.device | str = "cpu") -> MemoryBound:
    nbytes = weight_bytes(model)
    bandwidth = read_bandwidth(device)
    return MemoryBound(bandwidth, nbytes, bandwidth * 1e9 / nbytes)
