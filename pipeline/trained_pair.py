"""A code TARGET/DRAFT pair big enough to measure speculative decoding on: trained once, cached, held-out scored.

The tiny pair (pipeline/tinymodels.py) is sized for tests and is too weak to say anything about speedup. This pair
reuses the same recipe (stdlib sources split by file, shared BPE tokenizer, target trained on next tokens, draft
distilled from the target) at a size that trains in about 10-20 minutes on 2 CPU cores, and scores the target and
the draft on the held-out files, so the loss written to pair.json is what the models do on code they never saw.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

from .tinymodels import (TinyModelShape, TinyPairSpec, make_tiny_pair, read_text, split_files, stdlib_files,
                         token_stream)

# The held-out loss a useful pair must beat (nats/token); a unigram model of this vocabulary sits near it.
HELD_OUT_LOSS_GOAL = 4.5


def code_pair_spec(seed: int = 0) -> TinyPairSpec:
    """The shipped code pair: a 6-layer ~5.5M target and a 1-layer ~0.7M draft over a 2048-token vocabulary.

    Six target layers against one draft layer keep the draft/target step cost ratio c low even on a CPU, where a
    forward of a model this small costs mostly per-layer overhead rather than arithmetic.
    """
    return TinyPairSpec(
        vocab_size=2048,
        max_position_embeddings=2048,
        target=TinyModelShape(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=704),
        draft=TinyModelShape(hidden_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             intermediate_size=352),
        target_steps=800,
        draft_steps=300,
        seq_len=256,  # long enough that bench prompts plus generated tokens stay inside trained positions
        batch_size=8,
        lr=2e-3,
        text_bytes=6_000_000,
        seed=seed,
    )


def held_out_loss(model, stream, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token loss (nats/token) over consecutive non-overlapping windows of a held-out token stream."""
    import torch

    windows = min(max_windows, (len(stream) - 1) // seq_len)
    if windows < 1:
        raise ValueError(f"held-out stream: {len(stream)} tokens is shorter than one window of {seq_len}; "
                         f"read more held-out text")
    total = 0.0
    model.eval()
    with torch.inference_mode():
        for i in range(windows):
            batch = stream[i * seq_len:(i + 1) * seq_len][None]  # [1, seq_len]
            total += float(model(input_ids=batch, labels=batch).loss)
    return total / windows


def train_code_pair(out_dir: Path, spec: TinyPairSpec | None = None, force: bool = False,
                    held_out_chars: int = 400_000) -> dict:
    """Make ``out_dir/{target,draft}`` and ``out_dir/pair.json`` unless they exist; returns pair.json's content.

    Work happens in a sibling temporary folder renamed on success, so a killed run never looks finished.
    """
    from transformers import AutoTokenizer, LlamaForCausalLM

    out_dir = Path(out_dir)
    info_file = out_dir / "pair.json"
    if info_file.is_file() and not force:
        return {**json.loads(info_file.read_text()), "cached": True}
    spec = spec or code_pair_spec()
    start = time.perf_counter()
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    info = make_tiny_pair(tmp, spec)

    tokenizer = AutoTokenizer.from_pretrained(tmp / "target")
    _, held_files = split_files(stdlib_files(), spec.seed)
    held_stream = token_stream(read_text(held_files, held_out_chars), tokenizer)
    scores = {}
    for role in ("target", "draft"):
        model = LlamaForCausalLM.from_pretrained(tmp / role)
        scores[role] = {"held_out_loss": held_out_loss(model, held_stream, spec.seq_len),
                        "params": sum(p.numel() for p in model.parameters())}
    info.update(
        target_params=scores["target"]["params"], draft_params=scores["draft"]["params"],
        target_held_out_loss=scores["target"]["held_out_loss"],
        draft_held_out_loss=scores["draft"]["held_out_loss"],
        held_out_tokens=len(held_stream), held_out_loss_goal=HELD_OUT_LOSS_GOAL,
        unigram_uniform_loss=math.log(len(tokenizer)),
        seconds=round(time.perf_counter() - start, 1))
    (tmp / "pair.json").write_text(json.dumps(info, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return info
