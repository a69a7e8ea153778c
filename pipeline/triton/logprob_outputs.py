"""The ``logprobs`` output: a step's TokenLogprobs as JSON text, with each token's text for OpenAI's shapes.

One entry per emitted token: ``[id, text, logprob, [[id, text, logprob], ...]]``, the alternatives best first. A
token's text is its own decoding (``tokenizer.decode([id])``), which for a byte-level vocabulary may be part of a
character; clients that need exact bytes read the ids.
"""

from __future__ import annotations

import json


def logprobs_json(entries, tokenizer) -> bytes:
    """TokenLogprobs (or None: not asked for) -> the output's UTF-8 JSON text (b"" when not asked for)."""
    if entries is None:
        return b""
    ids = sorted({entry.token for entry in entries} | {t for entry in entries for t, _ in entry.top})
    # One batched decode per step: this runs on the engine's thread, and a step may carry 5 tokens x 21 ids.
    texts = dict(zip(ids, tokenizer.batch_decode([[t] for t in ids]))) if tokenizer is not None and ids else {}
    rows = [[entry.token, texts.get(entry.token, ""), entry.logprob,
             [[t, texts.get(t, ""), value] for t, value in entry.top]] for entry in entries]
    return json.dumps(rows, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
