"""Structured output: OpenAI's ``response_format`` as a grammar, and per-request token masks along a draft.

Speculation stays lossless under a constraint when the verify masks every position it judges with the grammar state
that position follows: position j of a chain is masked as if the draft tokens before it had been emitted, so the
accept rule compares the draft with exactly the masked distribution plain constrained decoding samples from
(``GrammarMatcher.allowed_along``). Where the grammar leaves one way on (a key the schema fixes, the punctuation
between fields), its forced tokens are drafts the grammar guarantees (``GrammarMatcher.forced``, jump-forward
decoding): the masked target puts all its mass on them, so they are accepted without the target choosing them.

The grammar library is llguidance (imported on first use, so this module loads without it). Terms: a *stop id* is a
token that ends the answer (EOS, end of turn); the grammar is *accepting* where the text so far is a complete match
(stop ids are allowed there and only there) and *done* where nothing but a stop id can follow.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor

from ..errors import RequestError, short_repr
from .sampling_params import JSON_LAYOUT

MAX_FORMAT_BYTES = 64 * 1024  # a schema's JSON text, a regex or a grammar: bounds the compile time a request can cost
FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")
ANY_JSON_OBJECT = '{"type": "object"}'


def grammar_from_response_format(value: object) -> str | None:
    """OpenAI's ``response_format`` -> an llguidance grammar (None for free text: absent or ``{"type": "text"}``).

    Accepted: ``{"type": "json_object"}`` (any JSON object), ``{"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...}, "strict": ...}}`` (the schema is enforced whatever ``strict`` says), and the extensions
    ``{"type": "regex", "regex": "..."}`` and ``{"type": "grammar", "grammar": "<Lark text>"}``. The grammar is
    checked to compile; a bad shape, a bad schema or one over MAX_FORMAT_BYTES raises RequestError naming the field,
    the bad value and the fix.
    """
    if value is None:
        return None
    example = '{"type": "json_object"}'
    if not isinstance(value, dict):
        raise RequestError(f"response_format: expected an object such as {example}, got {type(value).__name__} "
                           f"{short_repr(value, 60)}")
    kind = value.get("type")
    if kind not in FORMAT_TYPES:
        raise RequestError(f"response_format.type: got {short_repr(kind, 60)}; use one of {', '.join(FORMAT_TYPES)}")
    allowed_keys = {"type"} if kind in ("text", "json_object") else {"type", kind}
    extra = sorted(set(value) - allowed_keys, key=str)
    if extra:
        raise RequestError(f"response_format: unknown key {short_repr(extra[0], 60)} for type {kind!r}; "
                           f"use only {', '.join(sorted(allowed_keys))}")
    if kind == "text":
        return None
    try:
        return _grammar_of(kind, value)
    except (ValueError, RecursionError) as exc:  # llguidance's own limits (nesting), json.dumps' recursion
        if isinstance(exc, RequestError):
            raise
        where = {"json_schema": "response_format.json_schema.schema"}.get(kind, f"response_format.{kind}")
        raise RequestError(f"{where}: cannot be compiled ({_one_line(str(exc) or type(exc).__name__)}); simplify it "
                           f"(less nesting) or leave response_format out") from None


def _grammar_of(kind: str, value: dict) -> str:
    """The grammar of a checked response_format of ``kind`` (not text)."""
    LLMatcher = _matcher_class()
    if kind == "json_object":
        return _checked(LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, JSON_LAYOUT), "response_format")
    if kind == "json_schema":
        schema = _json_schema(value.get("json_schema"))
        return _checked(LLMatcher.grammar_from_json_schema(schema, JSON_LAYOUT), "response_format.json_schema.schema")
    text = _sized_text(value.get(kind), f"response_format.{kind}",
                       "a regular expression" if kind == "regex" else "a Lark grammar")
    grammar = LLMatcher.grammar_from_regex(text) if kind == "regex" else LLMatcher.grammar_from_lark(text)
    return _checked(grammar, f"response_format.{kind}")


def _json_schema(spec: object) -> str:
    """``response_format.json_schema`` -> its schema as JSON text, after checking the object's shape and size."""
    where = "response_format.json_schema"
    example = '{"name": "answer", "schema": {"type": "object", ...}}'
    if not isinstance(spec, dict):
        raise RequestError(f"{where}: expected an object such as {example}, got {type(spec).__name__} "
                           f"{short_repr(spec, 60)}")
    extra = sorted(set(spec) - set(JSON_SCHEMA_KEYS), key=str)
    if extra:
        raise RequestError(f"{where}: unknown key {short_repr(extra[0], 60)}; use only {', '.join(JSON_SCHEMA_KEYS)}")
    for key, kind, fix in (("name", str, "a string"), ("description", str, "a string"),
                           ("strict", bool, "true or false")):
        if key in spec and not isinstance(spec[key], kind):
            raise RequestError(f"{where}.{key}: got {short_repr(spec[key], 60)}; use {fix}")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise RequestError(f"{where}.schema: expected a JSON Schema object such as {{\"type\": \"object\"}}, got "
                           f"{type(schema).__name__} {short_repr(schema, 60)}")
    text = json.dumps(schema)
    if len(text.encode()) > MAX_FORMAT_BYTES:
        raise RequestError(f"{where}.schema: {len(text.encode())} bytes as JSON, over the limit of "
                           f"{MAX_FORMAT_BYTES}; send a smaller schema")
    return text


def _sized_text(text: object, where: str, what: str) -> str:
    if not isinstance(text, str) or not text:
        raise RequestError(f"{where}: expected {what} as a non-empty string, got {type(text).__name__} "
                           f"{short_repr(text, 60)}")
    if len(text.encode()) > MAX_FORMAT_BYTES:
        raise RequestError(f"{where}: {len(text.encode())} bytes, over the limit of {MAX_FORMAT_BYTES}; "
                           f"send a shorter one")
    return text


def _matcher_class():
    """llguidance.LLMatcher; RequestError where llguidance is not installed (free text works without it)."""
    try:
        from llguidance import LLMatcher
    except ImportError as exc:
        raise RequestError(f"response_format: this server cannot apply formats ({exc}); install llguidance==1.9.1 "
                           f"on it, or leave response_format out") from exc
    return LLMatcher


def _checked(grammar: str, where: str) -> str:
    """``grammar`` if llguidance compiles it, else RequestError with its message on one line."""
    failed, messages = _matcher_class().validate_grammar_with_warnings(grammar)
    if failed:
        raise RequestError(f"{where}: does not compile: {_one_line(messages[0])}; fix it or leave "
                           f"response_format out")
    return grammar


class GrammarCompiler:
    """Grammars -> matchers for one tokenizer; building it costs about a second (llguidance's token trie), so build
    it once per tokenizer and set of stop ids.

    ``vocab_size`` is the engine's logits width; ids at or past ``len(hf_tokenizer)`` (padding of the embedding)
    decode to nothing and are never allowed. ``stop_ids`` end the answer and are allowed exactly where the grammar
    is accepting.
    """

    def __init__(self, hf_tokenizer, vocab_size: int, stop_ids: Iterable[int]):
        from llguidance.hf import from_tokenizer

        stops = sorted({int(token) for token in stop_ids})
        if len(hf_tokenizer) > vocab_size:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(hf_tokenizer)} tokens; "
                             f"pass the logits width")
        if not stops or not all(0 <= token < vocab_size for token in stops):
            raise ValueError(f"stop_ids {short_repr(stops)}: need at least one, each in [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.stop_ids = tuple(stops)
        # n_vocab pads llguidance's vocabulary to the logits width (the extra ids have no bytes, so never match);
        # its "EOS" tokens are what it allows where the grammar is accepting: our stop ids.
        self.tokenizer = from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(stops))

    def matcher(self, grammar: str) -> GrammarMatcher:
        """A fresh matcher (no tokens consumed) for ``grammar`` (from grammar_from_response_format); RequestError
        if it does not compile against this tokenizer."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"response_format: does not compile for this model's tokenizer: "
                               f"{_one_line(matcher.get_error())}; fix it or leave response_format out")
        return GrammarMatcher(matcher, self.vocab_size, self.stop_ids)


class GrammarMatcher:
    """One request's grammar state: the tokens it has consumed (emitted) so far.

    Masks come from llguidance's mask fill (one bit per token, 32 to an int32 word, into a buffer kept across
    steps) and are unpacked with numpy's unpackbits, about ten times faster than shifting in torch on a CPU.
    """

    def __init__(self, matcher, vocab_size: int, stop_ids: tuple[int, ...]):
        self._matcher = matcher  # llguidance.LLMatcher
        self.vocab_size = vocab_size
        self._stop_ids = list(stop_ids)
        self._stop_set = frozenset(stop_ids)
        self._bitmask = torch.full((8, (vocab_size + 31) // 32), -1, dtype=torch.int32)  # [rows, words], grows

    def allowed_along(self, tokens: list[int]) -> Tensor:
        """bool [len(tokens) + 1, vocab_size]: row 0 the tokens allowed now, row j those allowed after also
        consuming ``tokens[:j]``. The state is unchanged afterwards.

        Where ``tokens[j - 1]`` is not allowed (by row j - 1), rows j and after are all True: no output is ever
        taken from them, since the verify rejects that draft token at position j - 1 and samples there. Rows after
        an allowed stop id allow the stop ids only (the answer has ended). A row is never all False: where the
        grammar is done it allows the stop ids (as llguidance does when its matcher hits an error).
        """
        self._check_ids(tokens)
        valid, first_stop = self._valid_prefix(tokens)
        bitmask = self._rows(len(tokens) + 1)
        self._fill_along(tokens[:valid], bitmask)
        dead = np.flatnonzero(~bitmask.numpy().any(axis=1))  # on the words: torch's any() over bools is slow
        allowed = _unpack(bitmask, self.vocab_size)
        if dead.size:  # llguidance allows its EOS ids on errors; keep the promise if a release does not
            allowed[torch.from_numpy(dead)[:, None], torch.tensor(self._stop_ids)] = True
        if valid == first_stop < len(tokens) and allowed[valid, tokens[valid]]:  # an allowed stop id: it ended
            end = valid + 1
            while end < len(tokens) and tokens[end] in self._stop_set:
                end += 1
            allowed[valid + 1:end + 1] = False
            allowed[valid + 1:end + 1, self._stop_ids] = True
        return allowed

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar allows from here, without computing a mask (state unchanged); a
        stop id ends the count (it may be allowed, where the text before it is complete: counted as not)."""
        return self._valid_prefix(tokens)[0]

    def _valid_prefix(self, tokens: list[int]) -> tuple[int, int]:
        """(how many leading ``tokens`` the grammar allows before the first stop id, that stop id's index).

        Stop ids are judged apart: llguidance's validate_tokens refuses its EOS ids once the grammar is done
        (where consume_token takes them), and records them for rollback only where it was not yet done.
        """
        first_stop = next((j for j, token in enumerate(tokens) if token in self._stop_set), len(tokens))
        return (self._matcher.validate_tokens(tokens[:first_stop]) if first_stop else 0), first_stop

    def _rows(self, rows: int) -> Tensor:
        """The first ``rows`` rows of the bitmask buffer, all bits set (grown when a longer draft comes)."""
        if rows > self._bitmask.shape[0]:
            self._bitmask = torch.empty((max(rows, 2 * self._bitmask.shape[0]), self._bitmask.shape[1]),
                                        dtype=torch.int32)
        return self._bitmask[:rows].fill_(-1)

    def _fill_along(self, tokens: list[int], bitmask: Tensor) -> None:
        """Row j of ``bitmask`` = the mask after ``tokens[:j]`` (all valid, no stop id) for j <= len(tokens); the
        matcher is rolled back to where it was."""
        matcher = self._matcher
        row_bytes, first_row = bitmask.shape[1] * bitmask.element_size(), bitmask.data_ptr()
        consumed = 0
        try:
            for j in range(len(tokens) + 1):
                # llguidance.torch.fill_next_token_bitmask does this, but importing that module imports
                # torch._dynamo (half a second) for a helper we do not use. The buffer is ours and contiguous.
                matcher.unsafe_compute_mask_ptr(first_row + j * row_bytes, row_bytes)
                if j < len(tokens):
                    if not matcher.consume_token(tokens[j]):
                        raise RuntimeError(f"llguidance refused token {tokens[j]} it had validated: "
                                           f"{matcher.get_error()}")
                    consumed += 1
        finally:  # the state the walk started from, whatever happened on the way
            if consumed and not matcher.rollback(consumed):
                raise RuntimeError(f"llguidance could not roll back {consumed} tokens: {matcher.get_error()}")

    def consume(self, tokens: list[int]) -> None:
        """Advance by emitted ``tokens``; ValueError (state unchanged) if one is not allowed where it stands. A stop
        id is allowed where the text before it is complete, and then only stop ids may follow it."""
        self._check_ids(tokens)
        matcher = self._matcher
        valid, first_stop = self._valid_prefix(tokens)
        if valid < first_stop:
            raise _not_allowed(tokens, valid)
        if not matcher.consume_tokens(tokens[:first_stop]):
            raise RuntimeError(f"llguidance refused tokens it had validated: {matcher.get_error()}")
        if first_stop == len(tokens):
            return
        after = next((j for j in range(first_stop + 1, len(tokens)) if tokens[j] not in self._stop_set), None)
        accepting = matcher.is_accepting()
        if not accepting or after is not None:
            matcher.rollback(first_stop)
            raise _not_allowed(tokens, first_stop if not accepting else after)
        # Only the first stop id goes to llguidance: it makes the grammar done (a no-op where it already was).
        if not matcher.consume_token(tokens[first_stop]):
            raise RuntimeError(f"llguidance refused a stop id where it was accepting: {matcher.get_error()}")

    def forced(self) -> list[int]:
        """The tokens the grammar forces next ([] when none): llguidance's fast-forward tokens, its tokenization of
        the forced bytes, held back where a longer token could still span the boundary; [] once done. The state is
        unchanged."""
        return list(self._matcher.compute_ff_tokens())

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing else can follow: only stop ids are allowed."""
        return self._matcher.is_stopped()

    def _check_ids(self, tokens: list[int]) -> None:
        bad = [token for token in tokens if not 0 <= token < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {short_repr(bad)} are outside the vocabulary [0, {self.vocab_size})")


def _one_line(message: str, limit: int = 200) -> str:
    """llguidance's multi-line message (position, text, caret) as one line of at most about ``limit`` characters."""
    text = " ".join(message.split()) or "invalid"
    return text if len(text) <= limit else text[:limit] + "..."


def _not_allowed(tokens: list[int], index: int) -> ValueError:
    return ValueError(f"token {tokens[index]} (at {index} of {short_repr(tokens)}) is not allowed by the request's "
                      f"grammar there; only tokens allowed by allowed_along's masks may be emitted")


def _unpack(bitmask: Tensor, vocab_size: int) -> Tensor:
    """int32 [rows, words], bit b of word w = token 32 w + b -> bool [rows, vocab_size] (a new tensor)."""
    words = bitmask.numpy().view(np.uint8)  # little-endian bytes: bit order within each byte is "little" as well
    bits = np.unpackbits(words, axis=-1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))
