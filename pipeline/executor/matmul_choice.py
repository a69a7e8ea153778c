"""Which matrix product a decoder forward of T tokens uses, measured on this machine when the model loads.

The same weights cost very different times per width depending on the call: on one Xeon, bfloat16 ``F.linear`` takes
26-27 ms over SmolLM2-135M's matrices at every width from 1 to 16 while ``W @ x.T`` takes 21-22 ms from width 2; in
float32 ``F.linear`` wins. Which wins depends on the CPU, the dtype and the width (oneDNN, MKL and the generic
kernels each pick their own paths), so nothing is hard-coded: the decoder times the forms over its own weights at
the widths a decode or verify step has, and uses another one than ``F.linear`` where it is clearly faster: ``W @ x.T``,
or, on a CPU with AVX2 or AVX-512 where it builds, ``rows`` (row_kernels.py: each weight row read once for every
input row; it also takes int8 weight-only layers, against their own forward). A forward of T tokens runs as the
narrowest measured width at least T; prompt chunks, past 16, as width 64. There 16-bit weights have a fourth form,
``widened``: the matrix copied to float32 per call and multiplied by aten's float32 product. On an AMD EPYC without
native bfloat16 a bfloat16 ``F.linear`` of 64 rows by a 3072 x 576 matrix took 22.6 ms and the widened one 2.6 ms
(80.5 against 11.7 at 256 rows), a prompt's prefill 7-8x the time it needs. The forms compute the same product; they
may round differently.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..artifacts import cache_root
from ..dtypes import cpu_flags
from . import row_kernels

KINDS = ("linear", "w_xt", "rows", "widened")
# The decode and verify widths, and one prompt chunk's (a forward wider than 16 runs as the width-64 measurement)
WIDTHS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 64)
SIXTEEN_BIT = (torch.bfloat16, torch.float16)  # weights ``widened`` multiplies as float32 copies
ROUNDS = 2
# F.linear stays unless the other form is clearly faster: two forms within the timing noise of a shared machine
# would otherwise be picked by chance, and a whole forward then runs slower than its matrices timed apart.
MARGIN = 0.9


def product(kind: str, x: Tensor, weight, bias: Tensor | None) -> Tensor:
    """x [T, in] times weight [out, in] (+ bias) -> [T, out], computed as ``kind`` says; a weight that is a module
    (an int8 layer, which holds its bias) is called, or multiplied in the rows kernel. ``rows`` is asked only for
    weights it takes (see kinds_for); a forward wider than its widest, or of no rows, runs aten's product."""
    rows = kind == "rows" and 0 < x.shape[0] <= row_kernels.MAX_ROWS  # no rows: an LM head whose logits nobody reads
    if not isinstance(weight, Tensor):
        return row_kernels.rows_mm_int8(x, weight) if rows else weight(x)
    if kind == "linear":
        return F.linear(x, weight, bias)
    if rows:
        return row_kernels.rows_mm(x, weight, bias)
    if kind == "widened":  # the matrix copied to float32 for this call: aten's float32 product, rounded once
        out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(x.dtype)
    # Contiguous again: a transposed output would carry its column stride into every op after it, and SDPA's
    # flash kernel takes only rows of stride 1 (a strided query falls back to its 4-6x slower math path).
    out = (weight @ x.T).T.contiguous()
    return out if bias is None else out + bias


@dataclass(frozen=True)
class KernelPlan:
    """The product per forward width; ``times_ms`` what was measured ((kind, width) -> ms over every matrix)."""

    by_width: dict[int, str] = field(default_factory=dict)
    times_ms: dict[tuple[str, int], float] = field(default_factory=dict)

    def kind(self, width: int) -> str:
        """The kind measured at the narrowest width at least ``width`` (past them all: at the widest); F.linear
        where nothing was measured."""
        measured = sorted(self.by_width)
        if not measured:
            return "linear"
        return self.by_width[next((w for w in measured if w >= width), measured[-1])]

    def to_dict(self) -> dict:
        return {"by_width": {str(w): k for w, k in self.by_width.items()},
                "ms": {f"{k}@{w}": round(ms, 2) for (k, w), ms in self.times_ms.items()}}


def weight_bytes(weights: list) -> int:
    return sum(t.numel() * t.element_size() for w in weights for t in _tensors(w))


def _tensors(weight) -> list[Tensor]:
    """A weight matrix's tensors: itself, or an int8 layer's matrix and scales."""
    return [weight] if isinstance(weight, Tensor) else [weight.qweight, weight.scale]


def _inputs(weight) -> tuple[int, torch.dtype]:
    """(the input width, the input dtype) of a weight [out, in] or an int8 layer (inputs of its scales' dtype)."""
    if isinstance(weight, Tensor):
        return weight.shape[1], weight.dtype
    return weight.in_features, weight.scale.dtype


def kinds_for(weights: list) -> tuple[str, ...]:
    """The kinds that can multiply every one of ``weights``: ``rows`` where its kernel loads here and takes them
    all (one plan covers every matrix of a forward). An int8 layer has its own forward (``linear``) and ``rows``."""
    float_kinds = all(isinstance(w, Tensor) for w in weights)
    kinds = KINDS if float_kinds else ("linear", "rows")
    if not (float_kinds and all(w.dtype in SIXTEEN_BIT for w in weights)):
        kinds = tuple(kind for kind in kinds if kind != "widened")
    if all(row_kernels.supports(_inputs(w)[1], w) for w in weights) and row_kernels.unavailable() is None:
        return kinds
    return tuple(kind for kind in kinds if kind != "rows")


@torch.inference_mode()
def measure(weights: list[Tensor], widths: tuple[int, ...] = WIDTHS, rounds: int = ROUNDS,
            kinds: tuple[str, ...] | None = None) -> KernelPlan:
    """Time each of ``kinds`` (default: kinds_for(weights)) over ``weights`` (each [out, in]) at each width,
    interleaved over ``rounds``, keeping each one's best; returns the plan that picks the fastest kind per width
    (``rows`` only up to its widest forward)."""
    kinds = kinds_for(weights) if kinds is None else kinds
    dtype, device = _inputs(weights[0])[1], _tensors(weights[0])[0].device
    inputs = {(w, n): torch.randn(w, n, dtype=dtype, device=device)
              for w in widths for n in {_inputs(m)[0] for m in weights}}
    best: dict[tuple[str, int], float] = {}
    for kind in kinds:  # warm-up: first calls allocate and pick their kernels
        _pass(kind, weights, inputs, widths[0])
    for _ in range(rounds):
        for width in widths:
            for kind in kinds:
                if kind == "rows" and width > row_kernels.MAX_ROWS:
                    continue
                elapsed = _pass(kind, weights, inputs, width)
                best[kind, width] = min(best.get((kind, width), float("inf")), elapsed * 1e3)
    return KernelPlan({width: _fastest(best, width) for width in widths}, best)


def _fastest(best: dict[tuple[str, int], float], width: int) -> str:
    """F.linear, unless another kind takes under MARGIN of its time (then the fastest of those)."""
    others = [(ms, kind) for (kind, w), ms in best.items() if w == width and kind != "linear"]
    ms, kind = min(others, default=(float("inf"), "linear"))
    return kind if ms < MARGIN * best["linear", width] else "linear"


_PLANS: dict[tuple, KernelPlan] = {}


def measured_once(weights: list[Tensor]) -> KernelPlan:
    """measure(weights), once per machine for matrices of the same shapes, dtype and device: kept for this process
    and on disk (plan_file), so a second engine of the same model, or the next start, reuses the plan instead of
    timing again. Delete the file to measure again (say, after measuring on a busy machine)."""
    kinds = kinds_for(weights)
    kernel = row_kernels.build() if "rows" in kinds else None  # another build of the kernel is timed anew
    key = (_inputs(weights[0])[1], str(_tensors(weights[0])[0].device),
           tuple((*_inputs(w), *_tensors(w)[0].shape) for w in weights), kinds, kernel)
    return remembered(_PLANS, key, KernelPlan, "times_ms", kinds, lambda: measure(weights, kinds=kinds))


def remembered(plans: dict, key: tuple, plan_type, times_field: str, kinds: tuple, measure_plan):
    """The plan for ``key`` (a plan_type: ``by_width`` and the measured times in ``times_field``) from ``plans``
    (this process), else from its file (plan_file), else ``measure_plan()``, then kept in both."""
    if key not in plans:
        path = plan_file(key)
        plan = _read_plan(path, plan_type, times_field, kinds)
        if plan is None:
            plan = measure_plan()
            _save(path, {"by_width": {str(w): kind for w, kind in plan.by_width.items()},
                         times_field: [[kind, w, t] for (kind, w), t in getattr(plan, times_field).items()]})
        plans[key] = plan
    return plans[key]


def plan_file(key: tuple) -> Path:
    """Where the plan for ``key`` is kept: one file per CPU model and instruction-set flags, thread count, torch
    version and weight shapes under cache_root()/kernel-plans (a plan measured on another CPU or thread count says
    nothing here; two CPU kinds can share a model name, as "AMD EPYC" does with and without AVX-512)."""
    machine = {"cpu": cpu_model(), "flags": sorted(cpu_flags()), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "key": repr(key)}
    digest = hashlib.sha256(json.dumps(machine, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / "kernel-plans" / f"{digest}.json"


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (the machine name where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _read_plan(path: Path, plan_type, times_field: str, kinds: tuple):
    try:
        data = json.loads(path.read_text())
        by_width = {int(w): kind for w, kind in data["by_width"].items()}
        times = {(kind, int(w)): float(t) for kind, w, t in data[times_field]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # absent or unreadable: measure again
    if not set(by_width.values()) <= set(kinds):
        return None
    return plan_type(by_width, times)


def _save(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data) + "\n")
        os.replace(tmp, path)  # a reader sees the whole file or none
    except OSError:
        pass  # a read-only home: the plan still holds for this process


def _pass(kind: str, weights: list, inputs: dict, width: int) -> float:
    start = time.perf_counter()
    for weight in weights:
        product(kind, inputs[width, _inputs(weight)[0]], weight, None)
    return time.perf_counter() - start
