"""Step 3 of scripts/gpu_smoke.sh: greedy target-only vs greedy speculative decoding on the built engines.

Where outputs diverge this reports the first differing position and the target's top-2 logit margin there and
fails only when the margin is clear (the rule and its threshold: pipeline/parity.py).

    python scripts/gpu_smoke_check.py ENGINES_DIR --tokens N
Exit status 0 when outputs are identical or every divergence is a near tie, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from types import SimpleNamespace

from pipeline.parity import MARGIN_THRESHOLD, divergence

PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List five capital cities in Europe and one fact about each.",
    "Summarise the plot of Romeo and Juliet.",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engines", help="engines/<name> folder built by the trtllm backend")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    args = parser.parse_args(argv)
    from pipeline.executor import open_executor

    ex = open_executor(args.engines)
    greedy = SimpleNamespace(temperature=0.0, top_k=0, top_p=1.0, seed=0)  # what ModelRunnerEngine reads

    def next_logits(ids: list[int]):
        return ex.target.generate(ids, 1, greedy, want_logits=True).logits[0]  # [vocab]

    ex.generate(PROMPTS[:1], 8)  # warm-up: first requests pay for CUDA graph and allocator set-up
    ex.generate(PROMPTS[:1], 8, max_draft_len=0)

    def timed(**kw):
        start = time.perf_counter()
        results = ex.generate(PROMPTS, args.tokens, temperature=0.0, **kw)
        return results, time.perf_counter() - start

    plain, t_plain = timed(max_draft_len=0)
    spec, t_spec = timed()
    clear = 0
    for prompt, a, b in zip(PROMPTS, plain, spec):
        found = divergence(ex.encode(prompt), a.token_ids, b.token_ids, next_logits)
        print(f"[{'ok' if found is None else 'DIFF'}] {prompt[:40]!r}: {b.stats.summary()}")
        if found is not None:
            print(f"    {found.describe()}")
            clear += not found.near_tie
    n_plain = sum(len(r.token_ids) for r in plain)
    n_spec = sum(len(r.token_ids) for r in spec)
    stats = spec[0].stats
    for r in spec[1:]:
        stats = stats.merge(r.stats)
    print(f"target-only: {n_plain / t_plain:.1f} tok/s; speculative K={ex.max_draft_len}: {n_spec / t_spec:.1f} "
          f"tok/s; speedup {t_plain / t_spec * n_spec / n_plain:.2f}x")
    print(f"acceptance {stats.acceptance_rate:.2f}, {stats.mean_accepted_len:.2f} tokens per target step")
    if clear:
        print(f"FAIL: {clear} prompt(s) diverge where the target's top-2 margin exceeds {MARGIN_THRESHOLD}")
        return 1
    same = all(a.token_ids == b.token_ids for a, b in zip(plain, spec))
    print("PASS: outputs token-identical" if same else
          f"PASS: outputs differ only at near ties (top-2 margin <= {MARGIN_THRESHOLD} logits, bf16 rounding)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
