"""Prompts in, text out: the tokenizer side shared by both executors."""

from __future__ import annotations

from collections.abc import Sequence

from .results import RequestError

Prompt = str | Sequence[int]


class TokenizerIO:
    """Mixin: ``self.tokenizer`` (HF tokenizer or None) turns prompts into ids and ids into text."""

    tokenizer = None

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt: text given but the executor has no tokenizer; pass token ids")
            return list(self.tokenizer(prompt)["input_ids"])
        return [int(t) for t in prompt]

    def decode(self, tokens: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)
