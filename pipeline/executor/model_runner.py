"""One causal LM and its slot KV cache: turns one scheduled batch into one forward pass.

Rows are the running requests' slots ``[0, rows)``; each row appends its own number of tokens (padded to the
widest row). The runner builds per-row position ids and a 4D mask, so any Hugging Face causal LM that takes
``position_ids`` and a prepared 4D ``attention_mask`` runs ragged batches without knowing about them.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from .kv_cache import SlotKVCache


class BatchModelRunner:
    def __init__(self, model, device: str | torch.device, slots: int, max_tokens: int, compile: bool = False):
        self.model = model
        self.device = torch.device(device)
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values to cache; remote-code models may still use the old name.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._trim_logits = "logits_to_keep" in params
        self.dtype = next(model.parameters()).dtype
        self.cache = SlotKVCache(slots, max_tokens)
        self._forward = torch.compile(self._call, dynamic=True) if compile else self._call

    def length(self, row: int) -> int:
        return self.cache.lengths[row]

    def _call(self, input_ids: Tensor, position_ids: Tensor, mask: Tensor, keep: int,
              hidden: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        kwargs = {self._cache_kwarg: self.cache, "use_cache": True}
        if self._trim_logits:
            kwargs["logits_to_keep"] = keep  # skips the LM head on positions nobody reads (prefill)
        if hidden:
            kwargs["output_hidden_states"] = True
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, **kwargs)
        # hidden_states[-1] is the final hidden state after the last norm, the one the LM head (and Medusa heads) read.
        return (out.logits, out.hidden_states[-1]) if hidden else out.logits

    @torch.inference_mode()
    def forward(self, rows: list[list[int]], keep: int | None = None, first_row: int = 0, trees: list | None = None,
                hidden: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Append ``rows[i]`` to the sequence in slot first_row + i; an empty row appends nothing. ``trees[i]``: row
        i ends in a candidate tree (see SlotKVCache.prepare).

        Returns logits [len(rows), keep, V] (float32) of the last ``keep`` padded positions (default: all), where
        row r's real tokens occupy positions [0, len(rows[r])) of the padded width; with ``hidden`` also the final
        hidden states [len(rows), width, d] (the model's dtype) of every position.
        """
        counts = [len(tokens) for tokens in rows]
        width = max(max(counts), 1)
        padded = [tokens + [0] * (width - len(tokens)) for tokens in rows]
        input_ids = torch.tensor(padded, dtype=torch.long, device=self.device)  # [rows, width]
        positions, mask = self.cache.prepare(counts, width, self.device, self.dtype, first_row, trees)
        out = self._forward(input_ids, positions, mask, width if keep is None else keep, hidden)
        for row, count in enumerate(counts):
            self.cache.advance(first_row + row, count)
        return (out[0].float(), out[1]) if hidden else out.float()

    def prefill(self, row: int, tokens: list[int]) -> None:
        """Fill one slot with a prompt's KV, alone: padding a long prompt to the batch would waste compute."""
        if tokens:
            self.forward([list(tokens)], keep=1, first_row=row)

    def truncate(self, row: int, length: int) -> None:
        self.cache.truncate(row, length)

    def keep_path(self, row: int, root: int, nodes: list[int]) -> None:
        self.cache.keep_path(row, root, nodes)

    def move(self, src: int, dst: int) -> None:
        self.cache.move(src, dst)

    def clear(self, row: int) -> None:
        self.cache.clear(row)
