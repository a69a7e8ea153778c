"""Which matrix product a decoder forward of T tokens uses, measured on this machine when the model loads.

The same weights cost very different times per width depending on the call: on one Xeon, bfloat16 ``F.linear`` takes
26-27 ms over SmolLM2-135M's matrices at every width from 1 to 16 while ``W @ x.T`` takes 21-22 ms from width 2; in
float32 ``F.linear`` wins. Which wins depends on the CPU, the dtype and the width (oneDNN, MKL and the generic
kernels each pick their own paths), so nothing is hard-coded: the decoder times both forms over its own weights
at the widths a decode or verify step has, and uses ``W @ x.T`` where it is clearly faster. Prompt chunks (wider than any measured
width) use ``F.linear``. Both forms compute the same product; they may round differently.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

KINDS = ("linear", "w_xt")
WIDTHS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
# Below this many weight bytes a step is overhead, not products, and timing them would only slow every start.
MIN_BYTES = 64 << 20
ROUNDS = 2
# F.linear stays unless the other form is clearly faster: two forms within the timing noise of a shared machine
# would otherwise be picked by chance, and a whole forward then runs slower than its matrices timed apart.
MARGIN = 0.9


def product(kind: str, x: Tensor, weight, bias: Tensor | None) -> Tensor:
    """x [T, in] times weight [out, in] (+ bias) -> [T, out], computed as ``kind`` says; a weight that is a module
    (an int8 layer, which holds its bias) is called."""
    if not isinstance(weight, Tensor):
        return weight(x)
    if kind == "linear":
        return F.linear(x, weight, bias)
    out = (weight @ x.T).T
    return out if bias is None else out + bias


@dataclass(frozen=True)
class KernelPlan:
    """The product per forward width; ``times_ms`` what was measured ((kind, width) -> ms over every matrix)."""

    by_width: dict[int, str] = field(default_factory=dict)
    times_ms: dict[tuple[str, int], float] = field(default_factory=dict)

    def kind(self, width: int) -> str:
        return self.by_width.get(width, "linear")

    def to_dict(self) -> dict:
        return {"by_width": {str(w): k for w, k in self.by_width.items()},
                "ms": {f"{k}@{w}": round(ms, 2) for (k, w), ms in self.times_ms.items()}}


def weight_bytes(weights: list[Tensor]) -> int:
    return sum(w.numel() * w.element_size() for w in weights)


@torch.inference_mode()
def measure(weights: list[Tensor], widths: tuple[int, ...] = WIDTHS, rounds: int = ROUNDS) -> KernelPlan:
    """Time every kind over ``weights`` (each [out, in]) at each width, interleaved over ``rounds``, keeping each
    one's best; returns the plan that picks the fastest kind per width."""
    inputs = {(w, n): torch.randn(w, n, dtype=weights[0].dtype, device=weights[0].device)
              for w in widths for n in {m.shape[1] for m in weights}}
    best: dict[tuple[str, int], float] = {}
    for kind in KINDS:  # warm-up: first calls allocate and pick their kernels
        _pass(kind, weights, inputs, widths[0])
    for _ in range(rounds):
        for width in widths:
            for kind in KINDS:
                elapsed = _pass(kind, weights, inputs, width)
                best[kind, width] = min(best.get((kind, width), float("inf")), elapsed * 1e3)
    by_width = {w: "w_xt" if best["w_xt", w] < MARGIN * best["linear", w] else "linear" for w in widths}
    return KernelPlan(by_width, best)


_PLANS: dict[tuple, KernelPlan] = {}


def measured_once(weights: list[Tensor]) -> KernelPlan:
    """measure(weights), once per process for matrices of the same shapes, dtype and device: a second engine of the
    same model (a reload, a bench beside a server) reuses the plan instead of timing again."""
    key = (weights[0].dtype, str(weights[0].device), tuple(tuple(w.shape) for w in weights))
    if key not in _PLANS:
        _PLANS[key] = measure(weights)
    return _PLANS[key]


def _pass(kind: str, weights: list[Tensor], inputs: dict, width: int) -> float:
    start = time.perf_counter()
    for weight in weights:
        product(kind, inputs[width, weight.shape[1]], weight, None)
    return time.perf_counter() - start
