"""One causal LM plus its KV cache: feed tokens, get logits, roll the cache back after a rejection."""

from __future__ import annotations

import inspect

import torch
from torch import Tensor


class CausalLMRunner:
    """Wraps any Hugging Face causal LM. The cache always holds the KV of ``tokens[:cached_len]`` of one sequence."""

    def __init__(self, model, device: str | torch.device):
        self.model = model
        self.device = torch.device(device)
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values to cache; remote-code models may still use the old name.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._trim_logits = "logits_to_keep" in params
        self.cache = None
        self.vocab_size = model.get_output_embeddings().weight.shape[0]

    @property
    def cached_len(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, tokens: list[int], keep_last: int) -> Tensor:
        """Append ``tokens`` to the sequence; logits of the last ``keep_last`` positions: [keep_last, V] float32."""
        input_ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, T]
        kwargs = {self._cache_kwarg: self.cache, "use_cache": True}
        if self._trim_logits:
            kwargs["logits_to_keep"] = keep_last  # skips the LM head on prompt positions nobody reads
        out = self.model(input_ids=input_ids, **kwargs)
        return out.logits[0, -keep_last:].float()

    def rollback(self, length: int) -> None:
        """Forget every cached position from ``length`` on (rejected draft tokens)."""
        extra = self.cached_len - length
        if extra > 0:
            self.cache.crop(-extra)
