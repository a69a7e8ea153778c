"""Which attention kernel a group of rows of a given query width uses, measured on this machine once per head shape.

A decode or verify step asks attention for a few queries per row against every key the row holds. On a CPU,
``F.scaled_dot_product_attention`` runs its flash kernel for that, which is built for many queries: in bfloat16 on
an AMD EPYC (2 threads, 9 query and 3 KV heads of 64) one query against 400 keys took 180-200 us and against 1024
keys 490-540 us, where the same attention written as two grouped matrix products and a float32 softmax took 60-80
us, and SDPA on float32 copies of the inputs 83 us; in float32 the flash kernel was the faster one at one query.
Across a model's layers that is milliseconds of a step, so nothing is hard-coded: the kernels (KERNELS) are timed
per query width over the head shape and dtype the engine runs, and one other than SDPA is used where it is clearly
faster. Prompt chunks (wider than any measured width) and CUDA keep SDPA. All compute the same attention and round
differently (the grouped one as Hugging Face's eager attention does: products in the model's dtype, softmax in
float32).

Each torch kernel reads copies of a row's keys and values gathered from the paged pools through its block table,
and is timed with the gather, over keys scattered in pools as the engine's. ``paged``, the row kernels' C++
attention (csrc/paged_attention.cpp), reads them where they lie: on the AMD EPYC (Zen 3, 2 threads) one query
against 400 keys took 32-35 us in float32 and bfloat16, against 134-366 for the torch kernels with their gather.
An engine's plan offers it on every CPU where that library loads (built once per machine, on first use).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from . import row_kernels
from .matmul_choice import MARGIN, remembered

KINDS = ("sdpa", "grouped", "sdpa_f32", "paged")
# kernels that attend in float32 take their mask in float32 (made once per step)
FLOAT32_MASK = {"sdpa_f32", "paged"}
WIDTHS = (1, 2, 3, 4, 5, 6, 8, 12, 16)  # each verify width of K = 1..5 on its own: kernels cross over there
LENGTHS = (128, 512)  # keys a row attends over, timed at each (a chat's context is mostly in this range)
BLOCK_SIZE = 16  # of the pools the kernels are timed over
ROUNDS = 5
CALLS = 4  # per timing: one call is tens of microseconds, close to the timer's own noise on a shared machine


def grouped_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float | None) -> Tensor:
    """query [n, heads, W, d], key/value [n, kv_heads, L, d], mask [n, 1, W, L] additive -> [n, heads, W, d].
    Query head h reads KV head h // (heads / kv_heads), as SDPA's ``enable_gqa``: the query heads of one KV head
    are stacked into one matrix, so each KV head is read once and never copied per query head."""
    n, heads, width, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scale = dim ** -0.5 if scale is None else scale
    scores = torch.matmul(query.reshape(n, kv_heads, group * width, dim), key.transpose(-1, -2))
    # float32 from here: the 16-bit mask is promoted by the sum, not copied first
    scores = scores.view(n, kv_heads, group, width, length).float() * scale + mask[:, :, None]
    weights = torch.softmax(scores, dim=-1).to(value.dtype).view(n, kv_heads, group * width, length)
    return torch.matmul(weights, value).view(n, heads, width, dim)


def sdpa(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float | None) -> Tensor:
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                          enable_gqa=key.shape[1] != query.shape[1])


def sdpa_f32(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float | None) -> Tensor:
    """SDPA on float32 copies (for 16-bit inputs): the float32 kernel for few queries can beat the 16-bit one by
    more than the copies cost."""
    out = sdpa(query.float(), key.float(), value.float(), mask.float(), scale)
    return out.to(query.dtype)


KERNELS = {"sdpa": sdpa, "grouped": grouped_attention, "sdpa_f32": sdpa_f32}  # and "paged": see attend_rows


def kinds_for(dtype: torch.dtype, device: torch.device, dim: int, library: bool) -> tuple[str, ...]:
    """The kernels worth timing: sdpa_f32 only for 16-bit models (in float32 it is SDPA itself); ``paged`` (the
    row kernels' C++ attention, which reads the block pools in place) where ``library`` (the caller lets the row
    kernels' library be built: an engine does) and it loads on this CPU, for a float32 or bfloat16 model whose head
    size is a multiple of the kernel's lanes (row_kernels.head_multiple: 8 on AVX2, 16 on AVX-512)."""
    paged = (library and device.type == "cpu" and dtype in row_kernels.DTYPES and row_kernels.unavailable() is None
             and dim % row_kernels.head_multiple() == 0)
    return tuple(kind for kind in KINDS if not (kind == "sdpa_f32" and dtype == torch.float32)
                 and (kind != "paged" or paged))


def attend_rows(kind: str, query: Tensor, key: Tensor, value: Tensor, blocks: Tensor, mask: Tensor,
                scale: float | None) -> Tensor:
    """Kernel ``kind``'s attention of query [n, W, heads, d] over one layer's block pools key/value [blocks,
    block_size, kv_heads, d], row i reading the blocks ``blocks[i]`` ([n, B]); mask [n, 1, W, B * block_size]
    additive, in mask_dtype(kind). -> [n, W, heads, d]."""
    n, width, heads, dim = query.shape
    if kind == "paged":  # reads the pools where they lie: no gather
        return row_kernels.paged_attention(query, key, value, blocks, mask, dim ** -0.5 if scale is None else scale)
    kv_heads, length = key.shape[2], blocks.shape[1] * key.shape[1]
    # index_select copies whole blocks row by row; advanced indexing (key[blocks]) goes through the generic
    # index kernel, 4x slower for the same bytes on a CPU, and it runs twice per layer per step.
    flat = blocks.reshape(-1)
    k = key.index_select(0, flat).view(n, length, kv_heads, dim).transpose(1, 2)  # [n, kv_heads, L, d]
    v = value.index_select(0, flat).view(n, length, kv_heads, dim).transpose(1, 2)
    # The kernels attend grouped-query without copying each KV head for its query heads (4x the attention).
    return KERNELS[kind](query.transpose(1, 2), k, v, mask, scale).transpose(1, 2)


def mask_dtype(kind: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype kernel ``kind`` takes its mask in, for a model of ``dtype``."""
    return torch.float32 if kind in FLOAT32_MASK else dtype


@dataclass(frozen=True)
class AttentionPlan:
    """The kernel per query width (a width runs as the narrowest measured width at least as wide; wider than
    every one: SDPA); ``times_us`` what was measured ((kind, width) -> microseconds over LENGTHS)."""

    by_width: dict[int, str] = field(default_factory=dict)
    times_us: dict[tuple[str, int], float] = field(default_factory=dict)

    def kind(self, width: int) -> str:
        for measured in sorted(self.by_width):
            if measured >= width:
                return self.by_width[measured]
        return "sdpa"

    def to_dict(self) -> dict:
        return {"by_width": {str(w): k for w, k in self.by_width.items()},
                "us": {f"{k}@{w}": round(us, 1) for (k, w), us in self.times_us.items()}}


def choose(times_us: dict[tuple[str, int], float]) -> dict[int, str]:
    """Per width, SDPA unless another kernel takes under MARGIN of its time (then the fastest such): two kernels
    within the noise of a shared machine would otherwise be picked by chance."""
    chosen = {}
    for width in sorted({w for _, w in times_us}):
        other = min((kind for kind in KINDS[1:] if (kind, width) in times_us), key=lambda k: times_us[k, width])
        chosen[width] = other if times_us[other, width] < MARGIN * times_us["sdpa", width] else "sdpa"
    return chosen


@torch.inference_mode()
def measure(dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, dim: int,
            widths: tuple[int, ...] = WIDTHS, lengths: tuple[int, ...] = LENGTHS, rounds: int = ROUNDS,
            kinds: tuple[str, ...] | None = None) -> AttentionPlan:
    """Time ``kinds`` (default: kinds_for without the library) on one row at each width, its keys in scattered
    blocks of pools as the engine's (gathered as a step gathers them, but for ``paged``), summed over ``lengths``
    keys, interleaved over ``rounds``, keeping each one's best."""
    kinds = kinds_for(dtype, device, dim, library=False) if kinds is None else kinds
    cases = {}
    for width in widths:
        for length in lengths:
            blocks = length // BLOCK_SIZE
            pools = [torch.randn(2 * blocks, BLOCK_SIZE, kv_heads, dim, dtype=dtype, device=device) for _ in "kv"]
            table = torch.randperm(2 * blocks, device=device)[:blocks][None]
            query = torch.randn(1, width, heads, dim, dtype=dtype, device=device)
            for kind in kinds:  # each with its mask in the dtype the engine gives it (mask_dtype)
                masking = mask_dtype(kind, dtype)
                mask = torch.zeros(1, 1, width, length, dtype=masking, device=device)
                mask[..., length - width + 1:] = torch.finfo(masking).min  # causal over the last keys, as a verify
                cases[kind, width, length] = (query, *pools, table, mask)
    best: dict[tuple[str, int], float] = {}
    for kind in kinds:  # warm-up: first calls allocate and pick their paths
        attend_rows(kind, *cases[kind, widths[0], lengths[0]], None)
    for _ in range(rounds):
        for width in widths:
            for kind in kinds:
                start = time.perf_counter()
                for length in lengths:
                    for _ in range(CALLS):
                        attend_rows(kind, *cases[kind, width, length], None)
                elapsed = (time.perf_counter() - start) / CALLS * 1e6
                best[kind, width] = min(best.get((kind, width), float("inf")), elapsed)
    return AttentionPlan(choose(best), best)


_PLANS: dict[tuple, AttentionPlan] = {}


def for_model(model, device: torch.device | str) -> AttentionPlan:
    """measured_once for a loaded Hugging Face causal LM's attention heads (SDPA throughout when its config does
    not say them)."""
    config = model.config.get_text_config()
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None)
    dim = getattr(config, "head_dim", None) or (hidden // heads if hidden and heads else None)
    if not (heads and kv_heads and dim):
        return AttentionPlan()
    return measured_once(next(model.parameters()).dtype, device, heads, kv_heads, dim, library=True)


def measured_once(dtype: torch.dtype, device: torch.device | str, heads: int, kv_heads: int, dim: int,
                  library: bool = False) -> AttentionPlan:
    """The plan for this head shape: SDPA throughout on CUDA (its fused kernels are the fast path there); on a CPU
    measure(...) over kinds_for(..., library), once per machine: kept for this process and on disk beside the
    matrix-kernel plans (delete the file to measure again)."""
    device = torch.device(device)
    if device.type == "cuda" or heads % kv_heads:
        return AttentionPlan()
    kinds = kinds_for(dtype, device, dim, library)
    build = row_kernels.build() if "paged" in kinds else None
    # another kernel set, another build of the C++ one, or a new way of timing them measures anew
    key = ("attention", kinds, build, "gathered", WIDTHS, str(dtype), str(device), heads, kv_heads, dim)
    return remembered(_PLANS, key, AttentionPlan, "times_us", kinds,
                      lambda: measure(dtype, device, heads, kv_heads, dim, kinds=kinds))
