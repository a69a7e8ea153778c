"""Attention over paged KV for packed batches, plugged into Hugging Face models as an attention implementation.

The engine packs every row's new tokens into one sequence ``[1, T]`` (no padding in the linear layers, so a
prompt chunk and a few verify tokens share a forward at the cost of their tokens alone). The KV cache writes the
new keys and values into the block pool before attention runs (PagedKVCache.update), so each row can then read its
whole history, this forward's tokens included, through its block table. Attention runs per group of rows:
the short rows (decode and verify) together, padded to the widest of them, and each long row (a prompt chunk) on
its own, so nobody pays for a neighbour's width.

Registered under ATTENTION_NAME; while no plan is active (the same model used outside the engine, e.g. by
``model.generate``) it is plain SDPA.

The lean decoder calls the same attention as one opaque operator, ``torch.ops.specpipe.paged_attention``, that
writes a layer's new KV and attends: a compiler sees a tensor in and a tensor out and never traces the plan (rows,
block tables, masks vary every step; the compiled graph around them need not). The operator reads the step's
cache and plan from ``active``, as vLLM's attention operator reads its forward context. Its inputs may carry
padding past the plan's tokens (a compiled forward runs at a fixed bucket width): the padding writes no KV and its
outputs are zeros.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .attention_choice import attend_rows

ATTENTION_NAME = "specpipe_paged"


@dataclass
class AttentionGroup:
    """Rows that attend together: query slot i of row n is packed token ``query_index[n, i]``."""

    query_index: Tensor  # [n, W] long, packed token of each query slot (padding repeats the row's last token)
    slots: Tensor  # [R] long, flat index (n * W + i) of each real query slot (padding outputs are dropped)
    tokens: Tensor  # [R] long, the packed token each real slot's output belongs to
    blocks: Tensor  # [n, B] long, each row's block table (padded with block 0; masked)
    # [n, 1, W, B * block_size] additive, 0 where the query may attend, the dtype's minimum elsewhere (in
    # attention_choice.mask_dtype: the model's dtype, or float32 for a kernel that attends in float32)
    mask: Tensor
    # The group is the whole forward, rows of equal width in packed order: queries and outputs are views, no copies
    dense: bool = False
    kernel: str = "sdpa"  # an attention_choice.KERNELS name: what computes this group's attention


@dataclass
class ForwardPlan:
    groups: list[AttentionGroup]
    tokens: int  # T, packed tokens in the forward


_active = threading.local()


@contextmanager
def active(plan: ForwardPlan, cache=None):
    """Route attention through ``plan`` for the forwards in this block (this thread only); ``cache`` (a
    PagedKVCache prepared for the plan) is the one the ``specpipe::paged_attention`` operator writes and reads."""
    _active.plan, _active.cache = plan, cache
    try:
        yield
    finally:
        _active.plan = _active.cache = None


@torch.library.custom_op("specpipe::paged_attention", mutates_args=())
def paged_attention_op(query: Tensor, key: Tensor, value: Tensor, layer: int, scaling: float) -> Tensor:
    """query [W, heads, d], key/value [W, kv_heads, d] for the active plan's T <= W packed tokens (the rest is
    padding): writes the T tokens' KV into ``layer``'s pools, attends, and returns [W, heads, d]."""
    plan, cache = getattr(_active, "plan", None), getattr(_active, "cache", None)
    if plan is None or (cache is None and plan.tokens):
        raise RuntimeError("specpipe::paged_attention runs only inside paged_attention.active(plan, cache)")
    tokens, width = plan.tokens, query.shape[0]
    if tokens == 0:  # a compile warm-up: nothing to write or read
        return query.new_zeros(query.shape)
    keys, values = cache.update(key[:tokens].transpose(0, 1)[None], value[:tokens].transpose(0, 1)[None], layer)
    out = attend(plan, query[:tokens].transpose(0, 1)[None], keys, values, scaling)[0]  # [T, heads, d]
    if tokens == width:
        return out  # attend's result is new memory: an operator's output may not alias its inputs
    return torch.cat([out, out.new_zeros(width - tokens, *out.shape[1:])])


@paged_attention_op.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, layer: int, scaling: float) -> Tensor:
    return torch.empty_like(query)


def one_paged_group(tokens: int):
    """(the cache, the group) when the active plan lays out ``tokens`` tokens as one dense group on the ``paged``
    kernel (a decode or verify step whose rows have one width: every step at batch 1), else None: what the eager
    lean decoder's one-call paths (row_kernels.rope_write_attend, row_kernels.decoder_layer) take; they write the
    cache's pools themselves (PagedKVCache.pools)."""
    plan, cache = getattr(_active, "plan", None), getattr(_active, "cache", None)
    if plan is None or cache is None or len(plan.groups) != 1 or tokens != plan.tokens:
        return None
    group = plan.groups[0]
    return (cache, group) if group.dense and group.kernel == "paged" else None


def paged_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None, dropout=0.0,
                    **kwargs) -> tuple[Tensor, None]:
    """query [1, heads, T, d]; key/value: the layer's block pools [blocks, block_size, kv_heads, d] (what
    PagedKVCache.update returns). Returns ([1, T, heads, d], None) as every Hugging Face attention function does."""
    plan: ForwardPlan | None = getattr(_active, "plan", None)
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("paged attention: logit soft-capping and attention sinks are not supported")
    return attend(plan, query, key, value, scaling), None


def attend(plan: ForwardPlan, query: Tensor, key: Tensor, value: Tensor, scaling: float | None) -> Tensor:
    """Attention of the packed forward ``plan`` lays out. query [1, heads, T, d]; key/value: one layer's block
    pools [blocks, block_size, kv_heads, d], this forward's keys and values already written. Returns
    [1, T, heads, d]."""
    heads, dim = query.shape[1], query.shape[3]
    out = None if plan.groups[0].dense else query.new_empty(plan.tokens, heads, dim)
    packed = query[0].transpose(0, 1)  # [T, heads, d]
    for group in plan.groups:
        n, width = group.query_index.shape
        q = packed.reshape(n, width, heads, dim) if group.dense else packed[group.query_index]  # [n, W, heads, d]
        result = attend_rows(group.kernel, q, key, value, group.blocks, group.mask, scaling)  # [n, W, heads, d]
        if group.dense:
            return result.reshape(1, n * width, heads, dim)
        out[group.tokens] = result.reshape(n * width, heads, dim)[group.slots]
    return out[None]


def register() -> str:
    """Make ATTENTION_NAME known to transformers (idempotent); returns it."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    # Outside a plan the model builds the same masks it would for SDPA; inside one the engine passes its own.
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME
