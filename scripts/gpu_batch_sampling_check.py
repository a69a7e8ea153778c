"""The batching engine's sampled path on a device (CUDA by default): rows of every kind in one batch.

One engine batch mixes greedy and sampled rows, seeded and unseeded, K fixed, "auto" and 0, draft-model, n-gram and
ngram+draft proposers (random-init tiny Llama models, so it needs no download). Checks, on the device:
  - every greedy row equals target-only greedy decoding of its prompt;
  - a seeded sampled row gives the same tokens alone and among the others (its draws come from its own generator);
  - every sampled row has the length it asked for and only ids the models know.
Prints one JSON line; exit 0 when all hold, 1 otherwise, 2 when the device is missing.

    python scripts/gpu_batch_sampling_check.py [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def tiny_llama(seed: int, layers: int, vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)  # no EOS: exact lengths
    return LlamaForCausalLM(config).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    import torch

    from pipeline.executor import SpeculativeExecutor

    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device"}))
        return 2
    vocab = 96
    target, draft = tiny_llama(1, 2, vocab).to(args.device), tiny_llama(2, 1, vocab).to(args.device)
    ex = SpeculativeExecutor(target, draft, tokenizer=None, max_draft_len=4, device=args.device, max_batch_size=8,
                             adaptive_draft_len=True)
    prompts = [[(7 * i + j) % vocab for j in range(5 + i)] + [3, 4, 5, 3, 4] for i in range(8)]
    rows = [  # (prompt index, keyword arguments)
        (0, dict(max_new_tokens=24)),
        (1, dict(max_new_tokens=20, max_draft_len=0)),
        (2, dict(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=5)),
        (3, dict(max_new_tokens=18, temperature=1.2, top_k=20, seed=6, method="ngram")),
        (4, dict(max_new_tokens=22, temperature=0.7, max_draft_len="auto")),
        (5, dict(max_new_tokens=24, method="ngram+draft")),
        (6, dict(max_new_tokens=16, temperature=0.9, seed=7, method="ngram+draft", max_draft_len=3)),
        (7, dict(max_new_tokens=24, method="ngram")),
    ]
    results = ex.run([ex.new_request(prompts[i], **kw) for i, kw in rows])
    problems = []
    for (i, kw), result in zip(rows, results):
        if kw.get("temperature", 0) == 0:
            (plain,) = ex.generate([prompts[i]], kw["max_new_tokens"], max_draft_len=0)
            if result.token_ids != plain.token_ids:
                problems.append(f"row {i}: greedy tokens differ from target-only decoding")
        elif "seed" in kw:
            (alone,) = ex.run([ex.new_request(prompts[i], **kw)])
            if result.token_ids != alone.token_ids:
                problems.append(f"row {i}: seeded sampled tokens differ alone and in the batch")
        if len(result.token_ids) != kw["max_new_tokens"] or not all(0 <= t < vocab for t in result.token_ids):
            problems.append(f"row {i}: {len(result.token_ids)} tokens or an id out of range")
    drafted = sum(r.stats.draft_tokens for r in results)
    report = {"ok": not problems and drafted > 0, "device": torch.cuda.get_device_name() if args.device == "cuda"
              else args.device, "torch": torch.__version__, "rows": len(rows), "drafted": drafted,
              "accepted": sum(r.stats.accepted_tokens for r in results), "problems": problems}
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
