"""One causal LM plus its KV cache: feed tokens, get logits, roll the cache back after a rejection.

Two cache modes:
  dynamic  transformers' DynamicCache, grown by concatenation (any length; the fallback);
  static   a StaticCache preallocated once for the engine's max_seq_len + K + 1 and reused across requests, so
           decoding allocates no KV memory and the shapes stay fixed, which is what torch.compile needs.
Rollback is a length change in both modes: rejected positions are overwritten later and masked until then.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

# Inputs up to this many tokens (decode, verify) go through the compiled graph; longer prefills run eagerly,
# because a compiled prefill would recompile for new prompt lengths and gains little (it is compute bound).
COMPILED_MAX_TOKENS = 17


class CausalLMRunner:
    """Wraps any Hugging Face causal LM. The cache always holds the KV of ``tokens[:cached_len]`` of one sequence."""

    def __init__(self, model, device: str | torch.device, static_len: int | None = None, compile: bool = False):
        self.model = model
        self.device = torch.device(device)
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values to cache; remote-code models may still use the old name.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._trim_logits = "logits_to_keep" in params
        self.static_len = static_len
        self.cache = None
        self._len = 0  # tracked here: asking the cache costs a device sync per step on a GPU
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self._compiled = torch.compile(self._call, dynamic=True) if compile else None

    @property
    def cached_len(self) -> int:
        return self._len

    @torch.inference_mode()  # the cache tensors were made in inference mode; only there may they be modified
    def reset(self) -> None:
        from transformers import DynamicCache, StaticCache

        if self.static_len is None:
            self.cache = DynamicCache(config=self.model.config)
        elif self.cache is None:
            self.cache = StaticCache(config=self.model.config, max_cache_len=self.static_len)
        else:
            self.cache.reset()  # keeps the preallocated tensors (and the compiled graph's addresses)
        self._len = 0

    def _call(self, input_ids: Tensor, keep_last: int) -> Tensor:
        # Positions come from the cache's own length (a tensor in StaticCache), so rollback needs no bookkeeping
        # beyond crop().
        kwargs = {self._cache_kwarg: self.cache, "use_cache": True}
        if self._trim_logits:
            kwargs["logits_to_keep"] = keep_last  # skips the LM head on prompt positions nobody reads
        return self.model(input_ids=input_ids, **kwargs).logits

    @torch.inference_mode()
    def forward(self, tokens: list[int], keep_last: int) -> Tensor:
        """Append ``tokens`` to the sequence; logits of the last ``keep_last`` positions: [keep_last, V] float32."""
        count = len(tokens)
        if self.static_len is not None and self._len + count > self.static_len:
            raise ValueError(f"sequence of {self._len + count} tokens exceeds the static cache ({self.static_len})")
        input_ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, T]
        if self._compiled is not None and count <= COMPILED_MAX_TOKENS:
            # Every position's logits, so the graph varies only in the token count (one graph for 1 token, one
            # dynamic graph for the rest): varying keep_last too multiplied the graphs until dynamo's recompile
            # limit sent calls back to the slow eager path.
            logits = self._compiled(input_ids, count)
        else:
            logits = self._call(input_ids, keep_last)
        self._len += count
        return logits[0, -keep_last:].float()

    @torch.inference_mode()
    def rollback(self, length: int) -> None:
        """Forget every cached position from ``length`` on (rejected draft tokens)."""
        extra = self._len - length
        if extra > 0:
            self.cache.crop(-extra)
            self._len = length
