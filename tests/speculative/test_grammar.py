"""Grammar masks on the tiny pair's real tokenizer: exact walks of a valid answer, masks along a draft equal to the
masks of plain decoding, rollback, forced tokens, stop ids, padding of the vocabulary, and request errors."""

from __future__ import annotations

import ctypes
import sys

import pytest
import torch

pytest.importorskip("llguidance")

from pipeline.executor.results import RequestError  # noqa: E402
from pipeline.speculative.grammar import (  # noqa: E402
    MAX_FORMAT_BYTES, GrammarCompiler, GrammarMatcher, grammar_from_response_format)

VOCAB = 530  # the engine's logits width: the tiny tokenizer has 512 tokens, and 530 is not a multiple of 32
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ANSWER = '{"name": "Bob", "age": 42}'


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair / "target")


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def schema_matcher(compiler, schema=SCHEMA):
    return compiler.matcher(grammar_from_response_format(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}))


def mask_now(matcher) -> torch.Tensor:
    return matcher.allowed_along([])[0]


def test_json_schema_masks_accept_exactly_a_valid_answer(compiler, tokenizer):
    matcher, ids, eos = schema_matcher(compiler), encode(tokenizer, ANSWER), tokenizer.eos_token_id
    quote, digit = encode(tokenizer, '"')[0], encode(tokenizer, "7")[0]
    assert tokenizer.decode(ids) == ANSWER
    for i, token in enumerate(ids):
        mask = mask_now(matcher)
        assert mask.shape == (VOCAB,) and mask.dtype == torch.bool
        assert mask[token], (i, tokenizer.decode(ids[:i]), tokenizer.decode([token]))
        assert not mask[eos], f"stop id allowed before the answer is complete: {tokenizer.decode(ids[:i])!r}"
        if tokenizer.decode(ids[:i]).endswith('"age": '):  # an integer: a digit, never a string
            assert mask[digit] and not mask[quote]
        matcher.consume([token])
    assert mask_now(matcher).nonzero().flatten().tolist() == [eos] and matcher.done
    first = mask_now(schema_matcher(compiler))
    assert first.nonzero().flatten().tolist() == encode(tokenizer, "{"), "an object starts with { and nothing else"


def test_allowed_along_rows_equal_the_masks_of_plain_decoding(compiler, tokenizer):
    ids = encode(tokenizer, ANSWER)
    matcher = schema_matcher(compiler)
    matcher.consume(ids[:3])
    before, forced_before = mask_now(matcher), matcher.forced()
    draft = ids[3:9]
    rows = matcher.allowed_along(draft)
    assert rows.shape == (len(draft) + 1, VOCAB)
    for j in range(len(draft) + 1):
        plain = schema_matcher(compiler)
        plain.consume(ids[:3] + draft[:j])
        assert torch.equal(rows[j], mask_now(plain)), f"row {j} is not the mask after draft[:{j}]"
    assert len({tuple(row.nonzero().flatten().tolist()) for row in rows}) > 2, "rows must differ along the draft"
    assert torch.equal(mask_now(matcher), before) and matcher.forced() == forced_before, "state not rolled back"
    matcher.consume(draft)  # still at ids[:3]: the draft goes on where it began
    assert torch.equal(mask_now(matcher), rows[-1])


def test_allowed_along_is_all_true_after_a_disallowed_draft_token(compiler, tokenizer):
    ids = encode(tokenizer, ANSWER)
    bad = encode(tokenizer, "]")[0]
    matcher = schema_matcher(compiler)
    rows = matcher.allowed_along([ids[0], bad, ids[1], ids[2]])
    assert torch.equal(rows[0], mask_now(schema_matcher(compiler)))
    assert rows[1][ids[1]] and not rows[1][bad], "row 1 is the mask after the valid first token"
    assert rows[2:].all(), "rows after the disallowed token are never used, and all True"
    matcher.consume(ids[:3])  # the refused token left the matcher usable, at its old state
    assert matcher.allowed_along(ids[3:4])[0][ids[3]]


def test_forced_tokens_are_the_fixed_key_and_leave_the_state_unchanged(compiler, tokenizer):
    matcher = schema_matcher(compiler)
    before = mask_now(matcher)
    forced = matcher.forced()
    # JSON laid out as json.dumps writes it: the brace, the first key and its colon are fixed
    assert tokenizer.decode(forced) == '{"name":', "the schema fixes the first key"
    assert matcher.forced() == forced and torch.equal(mask_now(matcher), before)
    matcher.consume(forced)
    assert matcher.forced() == [] and mask_now(matcher).sum() > 1, "the value's first token is the model's choice"
    matcher.consume(encode(tokenizer, ' "Al"'))
    assert tokenizer.decode(matcher.forced()) == ', "age":'


def test_stop_ids_are_allowed_only_where_the_grammar_is_complete(compiler, tokenizer):
    eos, a, b = tokenizer.eos_token_id, encode(tokenizer, "a")[0], encode(tokenizer, "b")[0]
    matcher = compiler.matcher(grammar_from_response_format({"type": "regex", "regex": "(ab)+"}))
    rows = matcher.allowed_along([a, b, eos, eos, a])
    assert [bool(row[eos]) for row in rows[:3]] == [False, False, True]
    assert rows[2][a] and not matcher.done, "after ab: more ab or the end"
    assert rows[3].nonzero().flatten().tolist() == [eos] and rows[4].nonzero().flatten().tolist() == [eos]
    assert rows[5].all(), "a text token after the end is refused: the row after it is unused"
    with pytest.raises(ValueError, match=rf"token {eos} \(at 1 of .*not allowed"):
        matcher.consume([a, eos])
    with pytest.raises(ValueError, match=rf"token {a} \(at 3 of .*not allowed"):
        matcher.consume([a, b, eos, a])
    assert torch.equal(mask_now(matcher), rows[0]), "a refused consume leaves the state as it was"
    matcher.consume([a, b, eos])
    assert matcher.done and matcher.forced() == [] and mask_now(matcher).nonzero().flatten().tolist() == [eos]


@pytest.mark.parametrize("value, field", [
    ([{"type": "json_object"}], "response_format: expected an object"),
    ({"type": "xml"}, "response_format.type: got 'xml'"),
    ({"type": "json_object", "schema": {}}, "response_format: unknown key 'schema'"),
    ({"type": "json_schema"}, "response_format.json_schema: expected an object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema: expected"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "objet"}}},
     "response_format.json_schema.schema: does not compile"),
    ({"type": "json_schema", "json_schema": {"schema": {"enum": ["x" * 1000] * 70}}},
     f"response_format.json_schema.schema: .* over the limit of {MAX_FORMAT_BYTES}"),
    ({"type": "regex", "regex": "a("}, "response_format.regex: does not compile"),
    ({"type": "regex", "regex": 5}, "response_format.regex: expected a regular expression"),
    ({"type": "grammar", "grammar": "start: missing_rule"}, "response_format.grammar: does not compile"),
])
def test_bad_response_formats_raise_request_error_naming_the_field(value, field):
    with pytest.raises(RequestError, match=field) as caught:
        grammar_from_response_format(value)
    assert "\n" not in str(caught.value)


def test_free_text_has_no_grammar_and_json_object_takes_any_object(compiler, tokenizer, monkeypatch):
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "llguidance", None)  # as if not installed: free text must not need it
        assert grammar_from_response_format(None) is None
        assert grammar_from_response_format({"type": "text"}) is None
        with pytest.raises(RequestError, match="response_format: .*install llguidance"):
            grammar_from_response_format({"type": "json_object"})
    matcher = compiler.matcher(grammar_from_response_format({"type": "json_object"}))
    matcher.consume(encode(tokenizer, '{"any": [1, {"nested": true}]}'))
    assert matcher.done


def test_regex_and_lark_grammars(compiler, tokenizer):
    digits = compiler.matcher(grammar_from_response_format({"type": "regex", "regex": "[0-9]{3}"}))
    ids = encode(tokenizer, "123")
    rows = digits.allowed_along(ids)
    assert all(rows[j][token] for j, token in enumerate(ids)) and not rows[0][encode(tokenizer, "a")[0]]
    digits.consume(ids)
    assert digits.done
    lark = compiler.matcher(grammar_from_response_format({"type": "grammar", "grammar": 'start: "yes" | "no"'}))
    prefixes = {token for token in range(len(tokenizer))
                if (text := tokenizer.decode([token])) and ("yes".startswith(text) or "no".startswith(text))}
    assert set(mask_now(lark).nonzero().flatten().tolist()) == prefixes
    lark.consume(encode(tokenizer, "yes"))
    assert lark.done


def test_ids_past_the_tokenizer_are_never_allowed(compiler, tokenizer):
    assert len(tokenizer) < VOCAB
    anything = compiler.matcher(grammar_from_response_format({"type": "regex", "regex": "(?s:.*)"}))
    rows = anything.allowed_along(encode(tokenizer, "def f():"))
    assert rows[:, :len(tokenizer)].sum() > 100 * rows.shape[0], "most of the vocabulary is allowed"
    assert not rows[:, len(tokenizer):].any()
    with pytest.raises(ValueError, match="not allowed"):
        anything.consume([len(tokenizer) + 3])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        anything.consume([VOCAB])
    with pytest.raises(ValueError, match="vocab_size 100"):
        GrammarCompiler(tokenizer, 100, [tokenizer.eos_token_id])


class DeadEnd:
    """An llguidance matcher stand-in whose masks allow nothing (llguidance itself allows its EOS ids there)."""

    def validate_tokens(self, tokens):
        return 0

    def unsafe_compute_mask_ptr(self, pointer, size):
        ctypes.memset(pointer, 0, size)


def test_a_row_is_never_all_false():
    rows = GrammarMatcher(DeadEnd(), VOCAB, (0, 7)).allowed_along([5])
    assert rows[0].nonzero().flatten().tolist() == [0, 7] and rows[1].all()


@pytest.mark.parametrize("depth", [300, 3000])
def test_a_schema_nested_too_deep_is_refused_by_its_field(depth):
    schema = {"type": "string"}
    for _ in range(depth):  # llguidance's own limit at 300, json.dumps' recursion at 3000
        schema = {"type": "array", "items": schema}
    with pytest.raises(RequestError, match=r"^response_format\.json_schema\.schema: cannot be compiled"):
        grammar_from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
