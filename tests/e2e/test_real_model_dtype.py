"""The dtype promise on a real pretrained model (SmolLM2-135M-Instruct): greedy speculative output is token-identical
to target-only output in float32 (the default on this CPU), and in bfloat16 differs at most at near ties (the
margin rule of pipeline/parity.py)."""

from __future__ import annotations

import pytest
import torch

from pipeline.executor import SpeculativeExecutor
from pipeline.parity import divergence

PROMPTS = [
    [{"role": "user", "content": "Rename the variable `total` to `count` in this function:\n\ndef add_all(items):\n"
                                 "    total = 0\n    for item in items:\n        total += item\n    return total\n"}],
    [{"role": "user", "content": "Write a short paragraph about why lighthouses were built on rocky coasts."}],
]
TOKENS = 96


def _chat_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def _greedy_pairs(ex: SpeculativeExecutor, prompts: list[list[int]], k: int):
    plain = ex.generate(prompts, TOKENS, temperature=0.0, max_draft_len=0)
    spec = ex.generate(prompts, TOKENS, temperature=0.0, max_draft_len=k)
    return plain, spec


def _next_logits(ex: SpeculativeExecutor):
    @torch.inference_mode()
    def next_logits(ids: list[int]) -> torch.Tensor:
        return ex.target.model(input_ids=torch.tensor([ids], device=ex.device)).logits[0, -1]  # [vocab]
    return next_logits


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_ngram_matches_target_only_up_to_near_ties(real_model_dir, dtype):
    ex = SpeculativeExecutor.from_pretrained(real_model_dir, None, method="ngram", max_draft_len=4, dtype=dtype)
    prompts = [_chat_ids(ex.tokenizer, messages) for messages in PROMPTS]
    plain, spec = _greedy_pairs(ex, prompts, k=4)
    assert sum(r.stats.draft_tokens for r in spec) > 0  # lookups really proposed (the code prompt repeats itself)
    for ids, a, b in zip(prompts, plain, spec):
        found = divergence(ids, a.token_ids, b.token_ids, _next_logits(ex))
        if dtype == "float32":
            assert found is None, found.describe()  # the promise: float32 is token-identical
        else:
            assert found is None or found.near_tie, found.describe()
