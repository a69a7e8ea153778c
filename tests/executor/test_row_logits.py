"""Penalties, bias, min_tokens and log-probabilities under speculation, on the tiny pair: greedy output equals plain
decoding with the same settings, computed by Hugging Face's own logits processors where it has them
(repetition_penalty, sequence_bias, min_new_tokens) and by a plain forward-per-token loop with OpenAI's formula
where it does not (presence and frequency penalties)."""

from __future__ import annotations

import re

import pytest
import torch

from pipeline.executor import SpeculativeExecutor
from tests.conftest import load_tiny_models

PROMPTS = ["def main(", "import os\nimport sys\n", "x = [1, 2"]
NEW = 24


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return load_tiny_models(tiny_pair)


def hf_generate(model, tokenizer, prompt: str, **settings) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id, **settings)
    return out[0, ids.shape[1]:].tolist()


@torch.no_grad()
def openai_penalty_loop(model, tokenizer, prompt: str, presence: float, frequency: float) -> list[int]:
    """Greedy decoding, one full forward per token, logits - frequency * count - presence * (count > 0) over the
    tokens generated so far (OpenAI's definition)."""
    ids = tokenizer(prompt)["input_ids"]
    out = []
    for _ in range(NEW):
        logits = model(torch.tensor([ids + out])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
        token = int((logits - frequency * counts - presence * (counts > 0).float()).argmax())
        out.append(token)
        if token == tokenizer.eos_token_id:
            break
    return out


def executors(pair):
    target, draft, tok = pair
    return {"draft_model": SpeculativeExecutor(target, draft, tok, max_draft_len=4),
            "self_draft": SpeculativeExecutor(target, target, tok, max_draft_len=4),
            "ngram": SpeculativeExecutor(target, None, tok, max_draft_len=4, method="ngram")}


def check_every_runtime(pair, expected: dict, **controls):
    for name, executor in executors(pair).items():
        for k in (4, 0):
            results = executor.generate(PROMPTS, max_new_tokens=NEW, max_draft_len=k, **controls)
            for prompt, result in zip(PROMPTS, results):
                assert result.token_ids == expected[prompt], (name, k, prompt)
        if name == "self_draft":  # the drafts themselves were adjusted: the target drafting for itself is always right
            assert all(r.stats.acceptance_rate == 1.0 for r in results if r.stats.draft_tokens) or k == 0


def test_presence_and_frequency_penalties_match_plain_decoding(pair):
    target, _, tok = pair
    expected = {p: openai_penalty_loop(target, tok, p, presence=0.8, frequency=1.1) for p in PROMPTS}
    assert expected != {p: openai_penalty_loop(target, tok, p, 0.0, 0.0) for p in PROMPTS}  # they change the output
    check_every_runtime(pair, expected, presence_penalty=0.8, frequency_penalty=1.1)


def test_self_draft_with_penalties_is_always_accepted(pair):
    target, _, tok = pair
    executor = SpeculativeExecutor(target, target, tok, max_draft_len=4)
    results = executor.generate(PROMPTS, max_new_tokens=NEW, frequency_penalty=1.5, repetition_penalty=1.3)
    # A draft left unadjusted proposes tokens the adjusted target would not choose.
    assert sum(r.stats.accepted_tokens for r in results) == sum(r.stats.draft_tokens for r in results) > 0


@pytest.mark.parametrize("ours, theirs", [
    (dict(repetition_penalty=1.6), dict(repetition_penalty=1.6)),
    (dict(logit_bias={"17": 4.0, "5": -100}), dict(sequence_bias={(17,): 4.0, (5,): -100.0})),
], ids=["repetition", "bias"])
def test_hugging_face_processors_match(pair, ours, theirs):
    target, _, tok = pair
    expected = {p: hf_generate(target, tok, p, **theirs) for p in PROMPTS}
    assert expected != {p: hf_generate(target, tok, p) for p in PROMPTS}
    check_every_runtime(pair, expected, **ours)


def test_min_tokens_holds_eos_back_and_ignore_eos_runs_past_it(pair):
    target, _, tok = pair
    eos = tok.eos_token_id
    eager = {"logit_bias": {str(eos): 30.0}}  # EOS first without min_tokens
    executor = executors(pair)["draft_model"]
    assert all(r.token_ids == [eos] for r in executor.generate(PROMPTS, max_new_tokens=NEW, **eager))
    expected = {p: hf_generate(target, tok, p, min_new_tokens=6, sequence_bias={(eos,): 30.0}) for p in PROMPTS}
    assert all(len(ids) == 7 and ids[-1] == eos for ids in expected.values())
    check_every_runtime(pair, expected, min_tokens=6, **eager)
    (result,) = executor.generate(PROMPTS[:1], max_new_tokens=5, ignore_eos=True, **eager)
    assert result.token_ids == [eos] * 5 and result.finish_reason == "length"


@torch.no_grad()
def test_logprobs_are_the_targets_raw_distribution(pair):
    target, _, tok = pair
    for name, executor in executors(pair).items():
        spec = executor.generate(PROMPTS, max_new_tokens=NEW, logprobs=3, frequency_penalty=0.5)
        plain = executor.generate(PROMPTS, max_new_tokens=NEW, logprobs=3, frequency_penalty=0.5, max_draft_len=0)
        for prompt, result, base in zip(PROMPTS, spec, plain):
            assert result.token_ids == base.token_ids
            assert [e.token for e in result.logprobs] == result.token_ids
            ids = tok(prompt)["input_ids"] + result.token_ids
            raw = torch.log_softmax(target(torch.tensor([ids])).logits[0].float(), -1)
            start = len(ids) - len(result.token_ids) - 1
            for i, (entry, other) in enumerate(zip(result.logprobs, base.logprobs)):
                want = raw[start + i]
                assert abs(entry.logprob - float(want[entry.token])) < 1e-4, (name, prompt, i)
                assert abs(entry.logprob - other.logprob) < 1e-4
                assert [t for t, _ in entry.top] == want.topk(3).indices.tolist()
                assert all(abs(v - float(want[t])) < 1e-4 for t, v in entry.top)
    (none,) = executors(pair)["draft_model"].generate(PROMPTS[:1], max_new_tokens=4)
    assert none.logprobs is None and "logprobs" not in none.to_dict()


@pytest.mark.parametrize("kwargs, field", [
    (dict(presence_penalty=3), "presence_penalty"), (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={"3": 101}), r"logit_bias\[3\]"), (dict(logit_bias={"99999999": 1}), "logit_bias"),
    (dict(min_tokens=-1), "min_tokens"), (dict(logprobs=21), "logprobs"), (dict(ignore_eos=1), "ignore_eos"),
])
def test_bad_controls_are_refused_by_name(pair, kwargs, field):
    from pipeline.executor import RequestError

    with pytest.raises(RequestError, match=rf"^{field}: "):
        executors(pair)["ngram"].generate(PROMPTS[:1], max_new_tokens=2, **kwargs)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "enum": ["ada", "grace"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


def test_a_json_schema_holds_under_speculation_and_forced_tokens_save_steps(pair):
    jsonschema = pytest.importorskip("jsonschema")
    import json

    for name, executor in executors(pair).items():
        spec = executor.generate(PROMPTS, max_new_tokens=40, response_format=JSON_FORMAT)
        plain = executor.generate(PROMPTS, max_new_tokens=40, response_format=JSON_FORMAT, max_draft_len=0)
        for result, base in zip(spec, plain):
            assert result.token_ids == base.token_ids and result.finish_reason == "eos", name
            jsonschema.validate(json.loads(result.text), PERSON)
            # the keys and separators the schema fixes are drafted by the grammar and always accepted
            drafted, accepted, _ = result.stats.by_proposer["grammar"]
            assert accepted == drafted >= 6 and result.stats.target_steps <= base.stats.target_steps / 2
        sampled = executor.generate(PROMPTS * 2, max_new_tokens=40, temperature=1.0, seed=list(range(6)),
                                    response_format=JSON_FORMAT)
        for result in sampled:
            jsonschema.validate(json.loads(result.text), PERSON)


def test_a_regex_format_and_bad_formats(pair):
    from pipeline.executor import RequestError

    executor = executors(pair)["draft_model"]
    (result,) = executor.generate(PROMPTS[:1], max_new_tokens=20, temperature=0.7, seed=3,
                                  response_format={"type": "regex", "regex": "(yes|no)[0-9]{3}"})
    assert result.finish_reason == "eos" and re.fullmatch("(yes|no)[0-9]{3}", result.text)
    with pytest.raises(RequestError, match=r"^response_format.json_schema.schema: "):
        executor.generate(PROMPTS[:1], max_new_tokens=4, response_format={"type": "json_schema",
                                                                          "json_schema": {"name": "x"}})
    with pytest.raises(RequestError, match=r"^response_format: with ignore_eos"):
        executor.generate(PROMPTS[:1], max_new_tokens=4, response_format=JSON_FORMAT, ignore_eos=True)


def test_min_tokens_yields_to_a_complete_format(pair):
    """A regex complete after 4 tokens and min_tokens 10: only a stop token may follow the format, and min_tokens
    holds stop tokens back; the format wins and the answer ends, greedy and sampled."""
    executor = executors(pair)["draft_model"]
    for sampling in (dict(), dict(temperature=1.0, seed=4)):
        (result,) = executor.generate(PROMPTS[:1], max_new_tokens=20, min_tokens=10,
                                      response_format={"type": "regex", "regex": "[0-9]{4}"}, **sampling)
        assert result.finish_reason == "eos" and re.fullmatch("[0-9]{4}", result.text), result.text


def test_draft_tokens_the_format_forbids_are_cut_before_the_verify(pair, monkeypatch):
    """n-gram proposals copied from a prompt of letters, under a digits-only format: a draft token the format forbids
    would be rejected, so it is cut before the verify (which stays narrower); the output is plain decoding's."""
    from pipeline.executor.step_batch import StepBatch

    _, _, tok = pair
    verified = []  # every draft token that reached a verify
    seal = StepBatch.seal
    monkeypatch.setattr(StepBatch, "seal", lambda self, *args: (
        verified.extend(t for tokens in self.proposals for t in tokens), seal(self, *args)))
    executor = executors(pair)["ngram"]
    prompt = "abc abc abc abc abc abc"
    fmt = {"type": "regex", "regex": "[0-9]{6}"}
    (spec,) = executor.generate([prompt], max_new_tokens=10, response_format=fmt)
    (plain,) = executor.generate([prompt], max_new_tokens=10, response_format=fmt, max_draft_len=0)
    assert spec.token_ids == plain.token_ids and re.fullmatch("[0-9]{6}", spec.text)
    assert all(tok.decode([t]).isdigit() for t in verified), [tok.decode([t]) for t in verified]
    sampled = executor.generate([prompt] * 3, max_new_tokens=10, response_format=fmt, temperature=1.0, seed=[1, 2, 3])
    assert all(re.fullmatch("[0-9]{6}", r.text) for r in sampled)
    assert all(tok.decode([t]).isdigit() for t in verified)
    verified.clear()
    executor.generate([prompt], max_new_tokens=10)  # without the format the lookup drafts letters
    assert any(not tok.decode([t]).isdigit() for t in verified)
