"""One causal LM and its paged KV cache: turns one scheduled batch into one packed forward.

Each row names a sequence and the tokens it appends (a verify's few, a prompt chunk's many, or none). The runner
packs them into one ``[1, T]`` input with per-token position ids and runs the model with the paged attention
implementation (paged_attention.py), so rows of any lengths share the forward without padding each other. A
Llama-family model runs on the lean decoder (llama_decoder.py); any other Hugging Face causal LM whose attention
layers go through transformers' attention interface runs through its own modules. ``runner`` says which.
"""

from __future__ import annotations

import dataclasses
import inspect
import time

import torch
from torch import Tensor

from ..decoder_support import LEAN, MODULES
from . import attention_choice, llama_decoder, paged_attention, row_kernels
from .block_pool import OutOfBlocks
from .compiled_decoder import CompiledDecoder
from .matmul_choice import KernelPlan
from .paged_kv_cache import PagedKVCache


def use_paged_attention(model) -> None:
    """Switch ``model`` (and its sub-configs) to the paged attention implementation; outside the engine's
    forwards it behaves as SDPA, so the same model object still serves ``generate``."""
    name = paged_attention.register()
    if getattr(model.config, "_attn_implementation", None) != name:
        model.set_attn_implementation(name)


class BatchModelRunner:
    def __init__(self, model, device: str | torch.device, max_tokens: int, block_size: int, max_blocks: int,
                 reuse: bool = True, compile: bool = False, lean: bool = True, max_width: int = 256,
                 autotune: bool = False, aux_layers: tuple[int, ...] = (), follow: BatchModelRunner | None = None,
                 extra_widths: tuple[int, ...] = ()):
        """``max_tokens``: positions one sequence may hold; ``max_blocks`` blocks of ``block_size`` tokens: the
        KV memory limit; ``reuse``: share the KV of prompts' common prefixes across requests; ``lean``: run a
        Llama-family model on the lean decoder (False: always through the Hugging Face modules); ``compile``:
        the lean decoder compiled per width bucket up to ``max_width`` tokens, every bucket at construction
        (compiled_decoder.py; ``autotune``: max-autotune), the Hugging Face modules compiled with dynamic shapes.
        ``aux_layers``: decoder layers (0-based, each below the last) whose outputs every forward also keeps for
        every token it computes, prompt chunks included, in ``aux_hidden`` (what an EAGLE-style drafter reads).
        ``follow``: the runner of the model this one drafts for; this one's KV then lives in that runner's blocks
        (PagedKVCache.companion), a sequence is opened there first, and ``max_blocks``/``reuse`` are that
        runner's. ``extra_widths``: compiled widths besides the powers of two (CompiledDecoder)."""
        self.model = model
        self.device = torch.device(device)
        use_paged_attention(model)
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values to cache; remote-code models may still use the old name.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._trim_logits = "logits_to_keep" in params
        self.dtype = next(model.parameters()).dtype
        self.cache = follow.cache.companion(preallocate=compile) if follow is not None else \
            PagedKVCache(block_size, max_blocks, max_tokens, reuse, preallocate=compile)
        self.cache.attention = attention_choice.for_model(model, self.device)
        # A prepared 4D mask makes transformers skip its own mask building; the plan carries the real masks.
        self._no_mask = torch.zeros(1, 1, 1, 1, dtype=self.dtype, device=self.device)
        self.aux_layers = _checked_aux_layers(aux_layers, model.config.get_text_config().num_hidden_layers)
        # Per row of the last forward: the aux_layers' outputs of its tokens [count, len(aux_layers), d]
        self.aux_hidden: list[Tensor] | None = None
        self.why_modules = llama_decoder.unsupported(model, max_tokens) if lean else "the lean decoder is off"
        self._decoder = llama_decoder.LlamaDecoder(model, max_tokens, aux_layers=self.aux_layers) \
            if self.why_modules is None else None
        self.runner = LEAN if self._decoder is not None else MODULES
        # The matrix product per forward width (lean decoder only; see matmul_choice), for bench and tests.
        self.kernels = self._decoder.kernels if self._decoder is not None else None
        self.compiled: CompiledDecoder | None = None
        if self._decoder is not None and compile:
            with torch.inference_mode():
                self.compiled = CompiledDecoder(self._decoder, max_width, autotune=autotune,
                                                extra_widths=extra_widths)
                self.compiled.warm_up()
        if self._decoder is None:
            self._forward = torch.compile(self._call, dynamic=True) if compile else self._call
        else:
            self._forward = self._call_lean
            if self.compiled is None:
                self._prefer_whole_layers(follow)

    def _prefer_whole_layers(self, leader: BatchModelRunner | None) -> None:
        """The product plan is timed matrix by matrix, so it cannot see what the rows kernel is worth beyond its
        products: with every product the rows kernel's, a decode or verify forward runs each layer in one C++ call
        (LlamaDecoder._whole_layers), without a dozen operator calls from Python. At each width the plan gives
        another kind where that call is possible, whole forwards are timed both ways (interleaved, best of
        WHOLE_LAYER_ROUNDS) and the rows kernel kept where it was faster."""
        decoder = self._decoder
        plan = decoder.kernels
        if decoder.layer_weights is None or not any(kind == "rows" for kind, _ in plan.times_ms):
            return  # no one-call layer, or no rows kernel among the kinds measured
        widths = [w for w, kind in sorted(plan.by_width.items()) if kind != "rows" and w <= row_kernels.MAX_ROWS]
        if not widths:
            return
        rows = KernelPlan({**plan.by_width, **dict.fromkeys(widths, "rows")}, dict(plan.times_ms))
        best = {(name, w): float("inf") for name in ("plan", "rows") for w in widths}
        for _ in range(WHOLE_LAYER_ROUNDS):
            for name, candidate in (("plan", plan), ("rows", rows)):
                decoder.kernels = candidate
                for width, seconds in time_forwards(self, 1, widths, repeats=1, leader=leader).items():
                    best[name, width] = min(best[name, width], seconds)
        faster = [w for w in widths if best["rows", w] < best["plan", w]]
        decoder.kernels = KernelPlan({**plan.by_width, **dict.fromkeys(faster, "rows")}, {
            **plan.times_ms, **{(f"whole-{name}", w): seconds * 1e3 for (name, w), seconds in best.items()
                                if seconds < float("inf")}})
        self.kernels = decoder.kernels

    def length(self, seq) -> int:
        return self.cache.length(seq)

    def _call(self, input_ids: Tensor, position_ids: Tensor, keep: Tensor,
              hidden: bool = False) -> tuple[Tensor, Tensor | None, Tensor | None]:
        kwargs = {self._cache_kwarg: self.cache, "use_cache": True}
        if self._trim_logits:
            kwargs["logits_to_keep"] = keep  # the LM head runs only where someone reads the logits
        if hidden or self.aux_layers:
            kwargs["output_hidden_states"] = True
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=self._no_mask, **kwargs)
        logits = out.logits[0] if self._trim_logits else out.logits[0, keep]  # [kept, V]
        # hidden_states[i + 1] is layer i's output, but the last entry is the final hidden state after the last
        # norm, the one the LM head (and Medusa heads) read.
        states = out.hidden_states
        aux = torch.stack([states[i + 1][0] for i in self.aux_layers], dim=1) if self.aux_layers else None
        return logits, states[-1][0, keep] if hidden else None, aux

    def _call_lean(self, input_ids: Tensor, position_ids: Tensor, keep: Tensor,
                   hidden: bool = False) -> tuple[Tensor, Tensor | None, Tensor | None]:
        decoder = self.compiled if self.compiled is not None else self._decoder
        return decoder.step(input_ids[0], position_ids[0], keep)

    @torch.inference_mode()
    def forward(self, seqs: list, rows: list[list[int]], logits_for: list[int] | None = None,
                trees: list | None = None, hidden: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Append ``rows[i]`` to sequence ``seqs[i]``; an empty row appends nothing. ``trees[i]``: row i ends in a
        candidate tree (see PagedKVCache.prepare). ``logits_for``: how many of each row's last tokens need logits
        (default: all of them; 0 for a prompt chunk nobody samples from).

        Returns logits [rows, width, V] (float32) where row r's logits are at [0, logits_for[r]) for its last
        tokens in order and width is the largest logits_for; with ``hidden`` also the final hidden states
        [rows, width, d] (the model's dtype) of the same positions.
        """
        counts = [len(tokens) for tokens in rows]
        logits_for = counts if logits_for is None else logits_for
        width = max(max(logits_for, default=0), 1)
        input_ids = torch.tensor([[t for tokens in rows for t in tokens]], dtype=torch.long, device=self.device)
        position_ids, plan = self.cache.prepare(seqs, counts, self.device, self.dtype, trees)
        ends, end = [], 0
        for count in counts:
            end += count
            ends.append(end)
        # Packed index of every position whose logits come back, and where each lands in the [rows, width] layout.
        keep = [end - want + i for end, want in zip(ends, logits_for) for i in range(want)]
        keep_t = torch.tensor(keep, dtype=torch.long, device=self.device)
        with paged_attention.active(plan, self.cache):
            logits, final, aux = self._forward(input_ids, position_ids, keep_t, hidden)
        for seq, count in zip(seqs, counts):
            self.cache.advance(seq, count)
        self.aux_hidden = list(aux.split(counts)) if aux is not None else None
        if hidden:
            return self._unpack(logits, logits_for, width).float(), self._unpack(final, logits_for, width)
        return self._unpack(logits, logits_for, width).float()

    @staticmethod
    def _unpack(kept: Tensor, logits_for: list[int], width: int) -> Tensor:
        """[kept, X] in packed order -> [rows, width, X], row r's values first."""
        out = kept.new_zeros(len(logits_for), width, kept.shape[-1])
        rows = [row for row, want in enumerate(logits_for) for _ in range(want)]
        columns = [i for want in logits_for for i in range(want)]
        out[rows, columns] = kept
        return out

    # ---- per sequence ---------------------------------------------------------------------------------------------

    def open(self, seq, prompt: list[int], cache_salt: str | None = None) -> int:
        return self.cache.open(seq, prompt, cache_salt)

    def truncate(self, seq, length: int) -> None:
        self.cache.truncate(seq, length)

    def commit(self, seq, tokens: list[int]) -> None:
        self.cache.commit(seq, tokens)

    def keep_path(self, seq, root: int, nodes: list[int]) -> None:
        self.cache.keep_path(seq, root, nodes)

    def close(self, seq) -> None:
        self.cache.close(seq)


SCRATCH_CONTEXT = 8  # tokens of KV each timing row holds (prefilled row by row: within any compiled bucket)
WHOLE_LAYER_ROUNDS = 5  # interleaved rounds of whole forwards when the plan is checked against whole layers


@torch.inference_mode()
def time_forwards(runner: BatchModelRunner, rows: int, widths: list[int], repeats: int = 3,
                  leader: BatchModelRunner | None = None) -> dict[int, float]:
    """Seconds the runner's forward of ``rows`` rows x ``width`` new tokens takes, for each of ``widths`` (the best
    of ``repeats`` after a warm-up): what the engine's steps cost on this runner, compiled buckets and chosen
    kernels included. Runs on scratch sequences of SCRATCH_CONTEXT tokens opened here (first in ``leader``, whose
    blocks a companion runner's KV follows) and closed after, the prefix-cache statistics as they were; {} when the
    KV pool has no room for them."""
    seqs = [("calibration", row) for row in range(rows)]
    owners = [runner] if leader is None else [leader, runner]
    stats = owners[0].cache.pool.stats
    counted = dataclasses.asdict(stats)
    opened: list[tuple[BatchModelRunner, object]] = []
    best: dict[int, float] = {}
    try:
        for seq in seqs:
            for owner in owners:
                owner.open(seq, [0] * SCRATCH_CONTEXT)
                opened.append((owner, seq))
            runner.forward([seq], [[0] * SCRATCH_CONTEXT], logits_for=[1])
        for width in widths:
            for attempt in range(repeats + 1):  # the first warms up
                start = time.perf_counter()
                runner.forward(seqs, [[0] * width] * rows)
                if runner.device.type == "cuda":
                    torch.cuda.synchronize(runner.device)
                if attempt:
                    best[width] = min(best.get(width, float("inf")), time.perf_counter() - start)
                for seq in seqs:
                    runner.truncate(seq, SCRATCH_CONTEXT)
    except OutOfBlocks:
        return {}
    finally:
        for owner, seq in reversed(opened):
            owner.close(seq)
        for name, value in counted.items():  # in place: whoever reads the statistics holds this object
            setattr(stats, name, value)
    return best


def _checked_aux_layers(layers, count: int) -> tuple[int, ...]:
    layers = tuple(layers)
    wrong = [layer for layer in layers if not isinstance(layer, int) or not 0 <= layer < count - 1]
    if wrong or len(set(layers)) != len(layers):
        raise ValueError(f"aux_layers: {list(layers)} must be distinct decoder layers from 0 to {count - 2} (the "
                         f"model has {count}; the last layer's output is the final hidden state: ask for hidden)")
    return layers
