"""What one draft token costs, in target steps, for a draft's head over fewer tokens and in 16 bits: the numbers to
pick `train-draft --vocab` and `--dtype` by, before training.

    python scripts/draft_cost.py TARGET_FOLDER DRAFT_FOLDER [--vocab 0 16384 8192 4096] [--dtypes float32 bfloat16]

One token over a --context-token cache, plain HF forwards, best of --rounds interleaved rounds (the machine is
shared: every variant is timed in every round); --vocab 0 is the draft's whole head. The head's rows here are the
first N ids (the cost does not depend on which). Prints a table and, with --json FILE, writes it; record the CPU
model with any figure (printed first).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.draft_vocab import CONFIG_KEY, reduce_head  # noqa: E402


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "unknown"


def step_seconds(model, ids: torch.Tensor, repeats: int = 6) -> float:
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
            best = min(best, time.perf_counter() - start)
            cache.crop(-1)
    return best


def variant(draft, vocab: int, dtype: str):
    model = copy.deepcopy(draft).to(getattr(torch, dtype))
    # 0: the whole head, even for a draft whose config already names a reduced vocabulary.
    setattr(model.config, CONFIG_KEY, list(range(vocab)) if vocab else None)
    reduce_head(model)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", type=Path)
    parser.add_argument("draft", type=Path)
    parser.add_argument("--vocab", type=int, nargs="+", default=[0, 16384, 8192, 4096])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    vocab = draft.get_output_embeddings().weight.shape[0]
    if any(not 0 <= n <= vocab for n in args.vocab):
        parser.error(f"--vocab: every value must be between 0 (whole head) and the draft's {vocab} tokens")
    models = {"target float32": target}
    for dtype in args.dtypes:
        for n in args.vocab:
            models[f"draft {n or vocab} tokens {dtype}"] = variant(draft, n, dtype)
    ids = torch.randint(0, vocab, (1, args.context), generator=torch.Generator().manual_seed(0))
    best = dict.fromkeys(models, float("inf"))
    for _ in range(args.rounds):
        for name, model in models.items():
            best[name] = min(best[name], step_seconds(model, ids))
    rows = [{"model": name, "ms": round(seconds * 1000, 2), "c": round(seconds / best["target float32"], 3)}
            for name, seconds in best.items()]
    print(f"CPU: {cpu_model()}, {args.threads} threads, torch {torch.__version__}")
    for row in rows:
        print(f"{row['model']:36s} {row['ms']:8.2f} ms   c = {row['c']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_model(), "threads": args.threads, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
