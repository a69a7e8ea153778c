"""The rules every request meets, in one place: ``validate_request`` for its values and ``check_prompt`` for its
prompt against the engines' limits. The Python API, `run`'s flags and the Triton inputs all pass through them;
callers with other spellings (``--max-new-tokens``, ``max_tokens``) pass ``names`` so an error names what the user
typed.

K, the number of tokens drafted in one step, has one name per scope, used across the runtime:
  step_draft_len    one step's K for one row: what it drafts now (dynamic K, the K the engine's policy chose for
                    it and the tokens left to generate can lower it below the request's max_draft_len);
  max_draft_len     one request's K: the most it drafts per step (the fixed K, or the ceiling of "auto"). The public
                    name: ``generate(max_draft_len=...)``, `run --max-draft-len`, Triton's ``num_draft_tokens``; an
                    executor's ``max_draft_len`` is the value of a request that names none (config
                    ``speculative.max_draft_len``);
  engine_draft_len  an engine's K: what the target engine was built to verify (engine.json's ``max_draft_len``,
                    trtllm-build's ``--max_draft_len``); no request's max_draft_len may exceed it.
``MAX_DRAFT_LEN_LIMIT`` (pipeline/config.py) bounds the K a config may build with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import short_repr
from ..speculative.sampling_params import MAX_LOGIT_BIAS, PENALTY_LIMIT, REPETITION_RANGE, LogitsAdjust, SamplingParams
from .results import RequestError

MAX_NEW_TOKENS = 2**31 - 1  # what an INT32 tensor (Triton's max_tokens) can carry
DraftLen = int | str | None  # a max_draft_len as asked: an int >= 0, "auto" (dynamic K) or None (the executor's)


@dataclass(frozen=True)
class DraftPlan:
    """How many tokens a request drafts per step."""

    max_draft_len: int  # the request's K: every step_draft_len is at most this (and equals it when not dynamic)
    dynamic: bool = False  # follow the observed acceptance (next_draft_len) within 1..max_draft_len
    explicit: bool = False  # the caller named K: the engine drafts exactly that, never the policy's lower K


@dataclass(frozen=True)
class RequestValues:
    max_new_tokens: int
    sampling: SamplingParams
    seed: int | None
    draft: DraftPlan


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_request(max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, seed=None,
                     max_draft_len: DraftLen = None, *, default_max_draft_len: int = 0,
                     engine_draft_len: int | None = None,
                     names: Mapping[str, str] | None = None) -> RequestValues:
    """Check a request's values; raises RequestError naming the value (as the caller spells it) and the fix.

    ``max_draft_len``: this request's K (an int >= 0, "auto" for dynamic K up to ``default_max_draft_len``, None
    for ``default_max_draft_len``), at most ``engine_draft_len`` (the K the target engine was built for)."""
    def name(key: str) -> str:
        return (names or {}).get(key, key)

    if not _int(max_new_tokens) or not 0 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise RequestError(f"{name('max_new_tokens')}: {short_repr(max_new_tokens)} must be an integer >= 0 and at "
                           f"most {MAX_NEW_TOKENS} (the number of tokens to generate)")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise RequestError(f"{name('temperature')}: {short_repr(temperature)} must be a finite number >= 0 "
                           f"(0 = greedy)")
    if not _int(top_k) or top_k < 0:
        raise RequestError(f"{name('top_k')}: {short_repr(top_k)} must be an integer >= 0 (0 disables it)")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise RequestError(f"{name('top_p')}: {short_repr(top_p)} must be in (0, 1] (1 disables it)")
    if seed is not None and (not _int(seed) or not 0 <= seed < 2**64):
        raise RequestError(f"{name('seed')}: {short_repr(seed)} must be an integer in [0, 2**64)")
    plan = _draft_plan(max_draft_len, default_max_draft_len, name("max_draft_len"))
    if engine_draft_len is not None and plan.explicit and plan.max_draft_len > engine_draft_len:
        raise RequestError(f"{name('max_draft_len')}: {plan.max_draft_len} is larger than the {engine_draft_len} the "
                           f"target engine was built for; lower it or rebuild with speculative.max_draft_len: "
                           f"{plan.max_draft_len}")
    return RequestValues(max_new_tokens, SamplingParams(float(temperature), top_k, float(top_p)), seed, plan)


def _draft_plan(max_draft_len: DraftLen, default: int, name: str) -> DraftPlan:
    if max_draft_len is None:
        return DraftPlan(default)
    if max_draft_len == "auto":
        return DraftPlan(default, dynamic=default > 0)
    if not _int(max_draft_len) or max_draft_len < 0:
        raise RequestError(f"{name}: {short_repr(max_draft_len)} must be an integer >= 0 (0 = target-only "
                           f"decoding), None or 'auto'")
    return DraftPlan(max_draft_len, explicit=True)


def check_prompt(prompt_ids: list[int], max_new_tokens: int, *, max_input_len: int | None,
                 max_seq_len: int | None, vocab_size: int | None = None) -> None:
    """Raise RequestError naming the value and the fix when a prompt does not fit these engines."""
    if not prompt_ids:
        raise RequestError("prompt: empty; give at least one token")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt_ids):
        raise RequestError(f"prompt: token ids must be in [0, {vocab_size})")
    if max_input_len is not None and len(prompt_ids) > max_input_len:
        raise RequestError(f"prompt: {len(prompt_ids)} tokens exceeds max_input_len {max_input_len}; "
                           f"shorten it or rebuild with a larger build.max_input_len")
    if max_seq_len is not None and len(prompt_ids) + max_new_tokens > max_seq_len:
        raise RequestError(f"max_new_tokens: {len(prompt_ids)} prompt + {max_new_tokens} new tokens exceeds "
                           f"max_seq_len {max_seq_len}; ask for at most "
                           f"{max(max_seq_len - len(prompt_ids), 0)} new tokens")


MAX_TOP_LOGPROBS = 20  # OpenAI's limit on alternatives per token
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's range: [-100, 100]


@dataclass(frozen=True)
class OutputControls:
    """What a request asks of its output beyond sampling: the logit adjustments, log-probabilities, a response
    format (checked and compiled where the tokenizer is) and whether EOS ends it."""

    adjust: LogitsAdjust = LogitsAdjust()
    logprobs: int | None = None  # None: none; n: each token's log-probability with the n likeliest beside it
    response_format: object = None  # OpenAI's response_format, as given (None: free text)
    ignore_eos: bool = False  # keep generating past EOS (stop tokens still end the request)


def _float(value, name: str, low: float, high: float, rule: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"{name}: {short_repr(value)} must be a number in [{low:g}, {high:g}] ({rule})")
    return float(value)


def _logit_bias(value, name: str, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (keys as strings, as JSON has them; ints taken too) -> sorted pairs."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise RequestError(f"{name}: {short_repr(value)} must be an object of token id -> bias, such as "
                           f'{{"50256": -100}}')
    if len(value) > MAX_LOGIT_BIAS:
        raise RequestError(f"{name}: {len(value)} entries; send at most {MAX_LOGIT_BIAS}")
    pairs = []
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if not _int(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
            where = f" in [0, {vocab_size})" if vocab_size is not None else " >= 0"
            raise RequestError(f"{name}: key {short_repr(key)} is not a token id{where}; key the object by token "
                               f"ids written as strings")
        pairs.append((token, _float(bias, f"{name}[{key}]", -MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE,
                                    "added to the token's logit; -100 bans it")))
    return tuple(sorted(pairs))


def validate_controls(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=None,
                      min_tokens=0, ignore_eos=False, logprobs=None, response_format=None, *,
                      vocab_size: int | None = None, names: Mapping[str, str] | None = None) -> OutputControls:
    """Check a request's output controls; raises RequestError naming the value (as ``names`` spells it) and the fix.

    ``logprobs``: None (none), or how many likeliest alternatives to return beside each token (0..20)."""
    def name(key: str) -> str:
        return (names or {}).get(key, key)

    presence = _float(presence_penalty, name("presence_penalty"), -PENALTY_LIMIT, PENALTY_LIMIT, "0 disables it")
    frequency = _float(frequency_penalty, name("frequency_penalty"), -PENALTY_LIMIT, PENALTY_LIMIT, "0 disables it")
    repetition = _float(repetition_penalty, name("repetition_penalty"), *REPETITION_RANGE,
                        "1 disables it; above 1 discourages repeats")
    if not _int(min_tokens) or not 0 <= min_tokens <= MAX_NEW_TOKENS:
        raise RequestError(f"{name('min_tokens')}: {short_repr(min_tokens)} must be an integer >= 0 (0 disables "
                           f"it)")
    if not isinstance(ignore_eos, bool):
        raise RequestError(f"{name('ignore_eos')}: {short_repr(ignore_eos)} must be true or false")
    if logprobs is not None and (not _int(logprobs) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise RequestError(f"{name('logprobs')}: {short_repr(logprobs)} must be an integer in [0, "
                           f"{MAX_TOP_LOGPROBS}] (the likeliest tokens returned beside each token), or None")
    adjust = LogitsAdjust(presence, frequency, repetition,
                          _logit_bias(logit_bias, name("logit_bias"), vocab_size), min_tokens)
    return OutputControls(adjust, logprobs, response_format, ignore_eos)
