"""The model's per-token log-probabilities in OpenAI's two shapes.

Entries arrive from the Triton model as ``[id, text, logprob, [[id, text, logprob], ...]]`` (pipeline/triton/
logprob_outputs.py): the target's raw log-softmax at each emitted token's position, alternatives best first.
"""

from __future__ import annotations


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", "surrogatepass"))


def chat_logprobs(entries: list) -> dict:
    """Chat's ``logprobs``: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": None}."""
    return {"content": [{"token": text, "logprob": value, "bytes": _bytes(text),
                         "top_logprobs": [{"token": alt, "logprob": alt_value, "bytes": _bytes(alt)}
                                          for _, alt, alt_value in top]}
                        for _, text, value, top in entries],
            "refusal": None}


def completion_logprobs(entries: list, offset: int = 0) -> dict:
    """/v1/completions' ``logprobs``: parallel lists, ``text_offset`` counting characters from ``offset`` (the
    length of the text already sent in earlier chunks)."""
    offsets = []
    for _, text, _, _ in entries:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": [text for _, text, _, _ in entries], "token_logprobs": [value for _, _, value, _ in entries],
            "top_logprobs": [{alt: alt_value for _, alt, alt_value in top} for _, _, _, top in entries],
            "text_offset": offsets}
