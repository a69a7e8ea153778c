"""Turn one Triton request's input tensors into executor arguments, rejecting bad values with a clear message.

Used by the Python model (``python_model/model.py``) inside tritonserver, and importable without Triton so the
rules can be unit-tested. Triton itself already rejects wrong dtypes and shapes against config.pbtxt; the checks
here cover values (negative max_tokens, top_p out of range, K above the engine's limit, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..executor.results import RequestError

GetInput = Callable[[str], "np.ndarray | None"]  # name -> the request's tensor, or None when absent


@dataclass(frozen=True)
class GenerateArgs:
    prompt: str | list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_draft_len: int | None = None  # None = the engine's K

    def executor_kwargs(self) -> dict:
        return dict(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                    top_p=self.top_p, seed=self.seed, max_draft_len=self.max_draft_len)


def _one(get: GetInput, name: str, kind: str, required: bool = False):
    """The single value of a [batch=1, 1] tensor, or None when the optional input is absent."""
    value = get(name)
    if value is None:
        if required:
            raise RequestError(f"{name}: required input missing; send it as a [1, 1] tensor")
        return None
    value = np.asarray(value)
    if value.size != 1:
        raise RequestError(f"{name}: expected one value per request, got shape {list(value.shape)}; Triton "
                           f"batches concurrent requests itself, send one prompt per request")
    if value.dtype.kind not in kind:
        raise RequestError(f"{name}: dtype {value.dtype} is not accepted; see the model's config.pbtxt")
    return value.reshape(-1)[0].item()


def _prompt(get: GetInput) -> str | list[int]:
    text, ids = get("text_input"), get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("text_input / input_ids: send exactly one of them (a string, or token ids)")
    if text is not None:
        text = np.asarray(text)
        if text.size != 1:
            raise RequestError(f"text_input: expected one string per request, got shape {list(text.shape)}")
        raw = text.reshape(-1)[0]
        try:
            return raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
        except UnicodeDecodeError as exc:
            raise RequestError(f"text_input: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    ids = np.asarray(ids)
    if ids.ndim > 1 and ids.shape[0] != 1:
        raise RequestError(f"input_ids: expected one sequence per request, got shape {list(ids.shape)}")
    if ids.dtype.kind not in "iu":
        raise RequestError(f"input_ids: dtype {ids.dtype} is not an integer type; send INT32 token ids")
    return [int(t) for t in ids.reshape(-1)]


def parse_request(get: GetInput, max_draft_len_limit: int) -> GenerateArgs:
    """Validate one request; raises RequestError naming the input, the bad value and the fix."""
    prompt = _prompt(get)
    max_tokens = _one(get, "max_tokens", "iu", required=True)
    if max_tokens < 1:
        raise RequestError(f"max_tokens: {max_tokens} must be >= 1 (the number of tokens to generate)")
    temperature = _one(get, "temperature", "f")
    temperature = 0.0 if temperature is None else float(temperature)
    if not np.isfinite(temperature) or temperature < 0:
        raise RequestError(f"temperature: {temperature} must be a finite number >= 0 (0 = greedy)")
    top_k = _one(get, "top_k", "iu")
    top_k = 0 if top_k is None else int(top_k)
    if top_k < 0:
        raise RequestError(f"top_k: {top_k} must be >= 0 (0 disables it)")
    top_p = _one(get, "top_p", "f")
    top_p = 1.0 if top_p is None else float(top_p)
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p: {top_p} must be in (0, 1] (1 disables it)")
    seed = _one(get, "seed", "iu")
    k = _one(get, "num_draft_tokens", "iu")
    if k is not None and not 0 <= k <= max_draft_len_limit:
        raise RequestError(f"num_draft_tokens: {k} must be between 0 (target only) and {max_draft_len_limit}, "
                           f"the K the target engine was built for")
    return GenerateArgs(prompt, int(max_tokens), temperature, top_k, top_p,
                        None if seed is None else int(seed), None if k is None else int(k))
