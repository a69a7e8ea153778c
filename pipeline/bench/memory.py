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

    def achieved_gbs(self, tokens_per_s: float, tokens_per_step: float | None) -> float:
        """Weight bandwidth a run achieved: weight bytes x target forwards per second (tokens / tokens per step)."""
        return self.weight_bytes * tokens_per_s / (tokens_per_step or 1.0) / 1e9

    def to_dict(self) -> dict:
        return {"memory_bandwidth_gbs": round(self.bandwidth_gbs, 2), "target_weight_bytes": self.weight_bytes,
                "memory_bound_tok_s": round(self.tok_s, 2)}


def weight_bytes(model) -> int:
    """Bytes of a model's weights as stored (int8 layers at their real size; a tied embedding once). An input
    embedding the LM head does not share is counted too although a step gathers only its rows, so for such models
    (and int8 ones, whose head is a separate int8 copy) the limit is a little low (conservative)."""
    from ..quantize import weight_bytes as stored_bytes

    return stored_bytes(model)


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


def precision(model) -> str:
    """The target's weight type as the table's `weights` column shows it: f32, bf16, f16, or int8/bf16 (int8
    weights, bfloat16 activations)."""
    from ..quantize import Int8WeightOnlyLinear

    short = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
    dtype = next((t.dtype for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()), torch.float32)
    label = short.get(dtype, str(dtype).removeprefix("torch."))
    return f"int8/{label}" if any(isinstance(m, Int8WeightOnlyLinear) for m in model.modules()) else label
