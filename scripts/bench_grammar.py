"""What structured output costs on this CPU: llguidance (pipeline.speculative.grammar's library), outlines-core and,
where it is installed, xgrammar, on one tokenizer and one JSON schema.

    python scripts/bench_grammar.py [--tokenizer FOLDER] [--items 10] [--json FILE]

For each library: the tokenizer setup (once per model), the schema's compile time (building the matcher) and its
first mask (llguidance and xgrammar finish compiling lazily there), then the time to compute one next-token mask
at every position of a valid JSON answer of a few hundred tokens (mean and median over the positions). Each mask is
timed once, when decoding first meets its state: the libraries cache a state's mask, so a repeat measures the cache.
For llguidance also GrammarMatcher.allowed_along (the bool masks the engine uses) with no draft, and with 5 draft
tokens (the masks of one verify of K = 5, the draft then accepted whole with one more token). The tokenizer is the real
model's (models/smollm2-135m-instruct, `make real-model`) where it exists, else the tiny pair's. Prints one JSON
record, with the CPU model and each library's version or the reason it was left out.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.draft_cost import cpu_model  # noqa: E402

DEFAULT_TOKENIZERS = (ROOT / "models/smollm2-135m-instruct", ROOT / "models/tiny/target")
DRAFT = 5
SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer"},
        "customer": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                     "required": ["name", "email"], "additionalProperties": False},
        "items": {"type": "array", "items": {
            "type": "object",
            "properties": {"sku": {"type": "string"}, "title": {"type": "string"},
                           "quantity": {"type": "integer"}, "price": {"type": "number"}},
            "required": ["sku", "title", "quantity", "price"], "additionalProperties": False}},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "gift": {"type": "boolean"},
    },
    "required": ["order_id", "customer", "items", "status", "gift"],
    "additionalProperties": False,
}


def answer(items: int) -> str:
    """A valid answer to SCHEMA, written as models usually write JSON (", " and ": ")."""
    lines = [{"sku": f"SKU-{1000 + 37 * i}", "title": f"Notebook, ruled, pack of {i + 2}", "quantity": i % 4 + 1,
              "price": round(2.5 + 1.75 * i, 2)} for i in range(items)]
    return json.dumps({"order_id": 48213, "customer": {"name": "Ada Lovelace", "email": "ada@example.org"},
                       "items": lines, "status": "shipped", "gift": False})


def timed(fn) -> float:
    """Seconds one call of ``fn()`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def summary(seconds: list[float]) -> dict:
    """Mean, median and max in microseconds of per-position times."""
    return {"mean_us": round(1e6 * statistics.fmean(seconds), 1),
            "median_us": round(1e6 * statistics.median(seconds), 1), "max_us": round(1e6 * max(seconds), 1),
            "positions": len(seconds)}


def bench_llguidance(tokenizer, vocab: int, stops: list[int], ids: list[int]) -> dict:
    import llguidance

    from pipeline.speculative.grammar import GrammarCompiler, grammar_from_response_format

    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab, stops)
    setup = time.perf_counter() - start
    grammar = grammar_from_response_format({"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}})
    start = time.perf_counter()
    matcher = compiler.matcher(grammar)
    compiled = time.perf_counter() - start
    first = timed(lambda: matcher.allowed_along([]))
    bitmask = torch.empty((1, (vocab + 31) // 32), dtype=torch.int32)
    raw, one, along = [], [], []
    fresh = compiler.matcher(grammar)
    inner = fresh._matcher  # the llguidance.LLMatcher: its fill alone, without the unpack to bool
    for token in ids:
        raw.append(timed(lambda: inner.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)))
        fresh.consume([token])
    fresh = compiler.matcher(grammar)
    for token in ids:
        one.append(timed(lambda: fresh.allowed_along([])))
        fresh.consume([token])
    fresh = compiler.matcher(grammar)
    for i in range(0, len(ids) - DRAFT, DRAFT + 1):  # each verify accepts the whole draft and adds one token
        along.append(timed(lambda: fresh.allowed_along(ids[i:i + DRAFT])))
        fresh.consume(ids[i:i + DRAFT + 1])
    return {"version": llguidance.__version__, "tokenizer_setup_s": round(setup, 3), "compile_s": round(compiled, 5),
            "first_mask_s": round(first, 5), "mask_fill": summary(raw), "allowed_along_no_draft": summary(one),
            f"allowed_along_{DRAFT}_draft_tokens": summary(along)}


def byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: each byte's printable stand-in (printable bytes stand for themselves, the
    others are shifted past 255), as its tokenizers write their vocabularies."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    shifted = [byte for byte in range(256) if byte not in kept]
    return {**{byte: chr(byte) for byte in kept}, **{byte: chr(256 + n) for n, byte in enumerate(shifted)}}


def outlines_vocabulary(tokenizer, stops: list[int]):
    """outlines-core's Vocabulary of ``tokenizer``: each token's bytes (byte-level BPE's characters mapped back)."""
    from outlines_core import Vocabulary

    byte_of = {char: byte for byte, char in byte_level_chars().items()}
    special = set(tokenizer.all_special_ids) | set(stops)
    tokens: dict[bytes, list[int]] = {}
    for text, token in tokenizer.get_vocab().items():
        if token in special:
            continue
        raw = bytes(byte_of[c] for c in text) if all(c in byte_of for c in text) else text.encode()
        tokens.setdefault(raw, []).append(token)
    return Vocabulary(stops[0], tokens)


def bench_outlines(tokenizer, vocab: int, stops: list[int], ids: list[int]) -> dict:
    from outlines_core import Guide, Index
    from outlines_core.json_schema import build_regex_from_schema

    start = time.perf_counter()
    vocabulary = outlines_vocabulary(tokenizer, stops)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    guide = Guide(Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary))
    compiled = time.perf_counter() - start
    bitmask = torch.empty((1, (vocab + 31) // 32), dtype=torch.int32)

    def fill():
        guide.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4)

    first = timed(fill)
    times = []
    for token in ids:
        times.append(timed(fill))
        guide.advance(token, return_tokens=False)
    assert guide.is_finished()
    return {"version": importlib.metadata.version("outlines-core"), "tokenizer_setup_s": round(setup, 3),
            "compile_s": round(compiled, 5), "first_mask_s": round(first, 5), "mask_fill": summary(times),
            "note": "compile is the regex-to-token index, built eagerly for the whole vocabulary"}


def bench_xgrammar(tokenizer, vocab: int, stops: list[int], ids: list[int]) -> dict:
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=stops)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    compiled = time.perf_counter() - start
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    first = timed(lambda: matcher.fill_next_token_bitmask(bitmask))
    times = []
    for token in ids:
        times.append(timed(lambda: matcher.fill_next_token_bitmask(bitmask)))
        assert matcher.accept_token(token)
    return {"version": importlib.metadata.version("xgrammar"), "tokenizer_setup_s": round(setup, 3),
            "compile_s": round(compiled, 5), "first_mask_s": round(first, 5), "mask_fill": summary(times)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, help="a Hugging Face model or tokenizer folder (default: the real "
                        "model's where it exists, else the tiny pair's)")
    parser.add_argument("--items", type=int, default=10, help="order lines in the JSON answer (its length)")
    parser.add_argument("--json", type=Path, help="also write the record here")
    args = parser.parse_args(argv)
    folder = args.tokenizer or next((path for path in DEFAULT_TOKENIZERS if path.is_dir()), None)
    if folder is None:
        parser.error("no tokenizer: pass --tokenizer, or run `make real-model` (or `make` for the tiny pair)")
    from transformers import AutoConfig, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    has_config = (folder / "config.json").is_file()  # a model folder: its logits may be wider than the tokenizer
    vocab = max(AutoConfig.from_pretrained(folder).vocab_size if has_config else 0, len(tokenizer))
    stops = sorted({tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids([t for t in ("<|im_end|>",)
                                                                               if t in tokenizer.get_vocab()])})
    text = answer(args.items)
    ids = tokenizer.encode(text, add_special_tokens=False)
    record = {"cpu": cpu_model(), "torch_threads": 1, "tokenizer": str(folder), "vocab_size": vocab,
              "stop_ids": stops, "answer_tokens": len(ids), "answer_chars": len(text), "libraries": {}}
    for name, bench in (("llguidance", bench_llguidance), ("outlines-core", bench_outlines),
                        ("xgrammar", bench_xgrammar)):
        try:
            __import__(name.replace("-", "_"))
        except ImportError as exc:  # optional libraries: the record says why one is missing
            record["libraries"][name] = {"skipped": f"not importable: {exc}"}
            continue
        record["libraries"][name] = bench(tokenizer, vocab, stops, ids)
    print(json.dumps(record, indent=2))
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
