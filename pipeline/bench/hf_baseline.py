"""bench-serve's baseline at batch 1: our target-only decoding against Hugging Face ``generate`` greedy."""

from __future__ import annotations

from .measure import hf_sample, stream_sample


def batch1_target_vs_hf(executor, prompts: list[list[int]], max_tokens: int, rounds: int) -> dict:
    """Our target-only (max_draft_len=0) vs HF generate greedy at batch 1 on the same prompts, rounds interleaved,
    best round of each. Runs on ``executor``'s engine directly: call it while no ServingLoop drives that engine."""
    target = executor.target.model
    pad = getattr(executor.tokenizer, "pad_token_id", None)
    methods = {"target": lambda ids: stream_sample(executor, ids, max_tokens, 0),
               "hf_target": lambda ids: hf_sample(target, None, ids, max_tokens, 0, pad)}
    for run in methods.values():  # warm-up
        run(prompts[0])
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, run in methods.items():
            samples = [run(ids) for ids in prompts]
            rate = sum(s.tokens for s in samples) / sum(s.seconds for s in samples)
            best[name] = max(best.get(name, 0.0), rate)
    return {"prompts": len(prompts), "max_tokens": max_tokens, "rounds": rounds,
            "target_tokens_per_s": round(best["target"], 2), "hf_target_tokens_per_s": round(best["hf_target"], 2),
            "target_vs_hf": round(best["target"] / best["hf_target"], 3)}
