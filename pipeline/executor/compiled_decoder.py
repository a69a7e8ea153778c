"""The lean decoder compiled by torch.compile's inductor, one graph per forward width bucket.

A step's packed width T (a decode's one token per row, a verify's K + 1, a prompt chunk's many) is padded up to a
bucket, a power of two, and each bucket runs its own static graph: the matrix products specialise to their width
and nothing in the graph depends on the rows, their lengths or their trees. Those vary every step and live in the
attention plan, which the graph never sees: attention is the opaque ``specpipe::paged_attention`` operator (see
paged_attention.py), and padding writes no KV. The final norm and the LM head, which run only on the positions
whose logits are read, are a second graph per bucket of that count.

With ``freeze`` the weights are folded in as constants (inductor's freezing) and packed for the CPU's matrix
kernels, which is where the gain over eager comes from; each bucket's graph holds its own packed copy, so the
compiled widths stop at the widest verify. ``autotune`` (max-autotune) also times candidate kernels per shape, tens
of seconds per bucket. Every bucket is compiled by ``warm_up`` at engine start, again at every start (frozen
weights keep inductor's cache from sparing it); after it, a step never recompiles (``compiled_graphs`` does not
move, which the tests hold).
"""

from __future__ import annotations

import time

import torch
import torch._dynamo
import torch._inductor.config
from torch import Tensor

from . import paged_attention
from .llama_decoder import LlamaDecoder, rms_norm
from .matmul_choice import KernelPlan


RECOMPILE_LIMIT = 4096


def buckets(max_width: int) -> list[int]:
    """Powers of two from 1 to the first one holding ``max_width``."""
    out = [1]
    while out[-1] < max_width:
        out.append(out[-1] * 2)
    return out


def bucket(width: int, sizes: list[int]) -> int:
    for size in sizes:
        if size >= width:
            return size
    raise ValueError(f"a forward of {width} tokens is wider than the widest compiled bucket ({sizes[-1]})")


class CompiledDecoder:
    """LlamaDecoder.step through the bucket graphs: the inputs padded up to a bucket, the outputs cut back."""

    def __init__(self, decoder: LlamaDecoder, max_width: int, freeze: bool = True, autotune: bool = False):
        self.decoder = decoder
        decoder.kernels = KernelPlan()  # inductor picks the kernels of its own graph
        self.sizes = buckets(max_width)
        # Each bucket, of every decoder in the process (a target and its draft), is one cache entry of the same
        # code: the default limit (8) would send the widest buckets back to eager.
        for name in ("recompile_limit", "accumulated_recompile_limit"):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), RECOMPILE_LIMIT))
        # Read when dynamo traces (freezing decides whether the weights are guarded as constants), so they are set
        # around the warm-up, which compiles every graph there is.
        self._settings = {"freezing": freeze, "max_autotune": autotune}
        self._body = torch.compile(decoder.body, dynamic=False, fullgraph=True)
        self._final = torch.compile(self._final_head, dynamic=False, fullgraph=True)
        self.warm_up_s: float | None = None
        self.eager_calls = 0  # forwards wider than the widest bucket, run uncompiled

    def _final_head(self, kept: Tensor) -> tuple[Tensor, Tensor]:
        final = rms_norm(kept, self.decoder.norm, self.decoder.eps)
        return self.decoder.head(final), final

    def warm_up(self) -> float:
        """Compile every bucket of both graphs (attention runs on an empty plan: nothing is written or read);
        returns the seconds it took."""
        start = time.perf_counter()
        device = self.decoder.embed.device
        with torch._inductor.config.patch(self._settings), \
                paged_attention.active(paged_attention.ForwardPlan([], 0), None):
            for size in self.sizes:
                ids, positions = (torch.zeros(size, dtype=torch.long, device=device) for _ in range(2))
                self._final(self._body(ids, positions)[0][positions])  # two tensors: dynamo guards on aliasing
        self.warm_up_s = time.perf_counter() - start
        return self.warm_up_s

    def step(self, input_ids: Tensor, positions: Tensor, keep: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """As LlamaDecoder.step, through the bucket graphs."""
        tokens, kept = input_ids.shape[0], keep.shape[0]
        if tokens > self.sizes[-1]:  # a prompt chunk wider than every row's verify
            self.eager_calls += 1
            return self.decoder.step(input_ids, positions, keep)
        width, kept_width = bucket(tokens, self.sizes), bucket(max(kept, 1), self.sizes)
        if width > tokens:
            pad = input_ids.new_zeros(width - tokens)
            input_ids, positions = torch.cat([input_ids, pad]), torch.cat([positions, pad])
        if kept_width > kept:
            keep = torch.cat([keep, keep.new_zeros(kept_width - kept)])
        x, aux = self._body(input_ids, positions)
        logits, final = self._final(x[keep])
        return logits[:kept], final[:kept], None if aux is None else aux[:tokens]


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (every bucket's first compile included): a count that does not
    move after warm-up means no recompile."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
