"""One contract (pipeline/executor/base.py), two executors: the torch executor and the TensorRT-LLM executor (over a FAKE engine boundary,
tests/fake_trtllm.py) must behave the same wherever the behaviour is not backend-specific."""

from __future__ import annotations

import pytest
import torch

from pipeline.backends.trtllm_runner import EngineLimits
from pipeline.executor import RequestError, SpeculativeExecutor, batching_engine, trtllm_executor
from pipeline.executor.trtllm_executor import TrtllmSpeculativeExecutor
from pipeline.methods import Method
from tests.conftest import load_tiny_models
from tests.fake_trtllm import FakeTrtllmEngine

PROMPTS = ["def main(", "import os\nimport sys\n", "class Parser:\n    def __init__(self"]
N = 20


@pytest.fixture(scope="module")
def models(tiny_pair):
    return load_tiny_models(tiny_pair)


@pytest.fixture(scope="module")
def reference(models):
    target, _, tok = models
    out = {}
    for prompt in PROMPTS:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        gen = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False,
                              pad_token_id=0)
        out[prompt] = gen[0, ids.shape[1]:].tolist()
    return out


@pytest.fixture(params=[(backend, method) for backend in ("torch", "trtllm-fake")
                        for method in ("draft_model", "ngram", "ngram+draft")], ids=lambda p: "-".join(p))
def executor(request, models):
    return make_executor(models, *request.param)


def make_executor(models, backend: str, method: str):
    target, draft, tok = models
    if backend == "torch":
        return SpeculativeExecutor(target, None if method == "ngram" else draft, tok, max_draft_len=4,
                                   max_seq_len=128, max_input_len=64, engine_draft_len=4, method=method)
    return TrtllmSpeculativeExecutor(FakeTrtllmEngine(target), None if method == "ngram" else FakeTrtllmEngine(draft),
                                     tok, EngineLimits(max_input_len=64, max_seq_len=128, engine_draft_len=4),
                                     max_draft_len=4, acceptance="greedy",
                                     eos_token_ids=[tok.eos_token_id] if tok.eos_token_id is not None else [],
                                     method=method)


@pytest.mark.parametrize("k", [0, 1, 4, "auto", None])
def test_greedy_equals_target_greedy(executor, reference, k):
    results = executor.generate(PROMPTS, N, max_draft_len=k)
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == reference[prompt]
        assert result.finish_reason == "length" and result.prompt_tokens > 0
        s = result.stats
        assert s.generated_tokens == N == s.accepted_tokens + s.target_steps
        assert sum(s.drafted_at) == s.draft_tokens and sum(s.accepted_at) == s.accepted_tokens
        if k == 0:
            assert s.draft_tokens == 0 and s.target_steps == N
        assert sum(d for d, _, _ in s.by_proposer.values()) == s.draft_tokens
    if k != 0:
        assert sum(r.stats.draft_tokens for r in results) > 0


@pytest.mark.parametrize("backend", ["torch", "trtllm-fake"])
@pytest.mark.parametrize("picked", [Method.NGRAM, Method.DRAFT_MODEL, None], ids=str)
def test_each_step_drafts_with_the_proposer_the_shared_dispatch_picks(models, reference, monkeypatch, backend,
                                                                       picked):
    """One dispatch for both executors: every drafting step asks proposers.choose_drafter who drafts and follows the
    answer (the lookup, the draft model, or nobody: a plain step)."""
    asked = []

    def pick(request, step_draft_len, lookup, cost_ratio):
        asked.append((request.method, step_draft_len))
        return picked

    monkeypatch.setattr(batching_engine, "choose_drafter", pick)
    monkeypatch.setattr(trtllm_executor, "choose_drafter", pick)
    results = make_executor(models, backend, "ngram+draft").generate(PROMPTS, N)
    assert asked and all(method == Method.NGRAM_DRAFT and 0 < k <= 4 for method, k in asked)
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == reference[prompt]
        assert {name for name, (drafted, _, _) in result.stats.by_proposer.items() if drafted} <= {picked}
    assert (sum(r.stats.draft_tokens for r in results) > 0) == (picked is not None)


def test_stop_tokens_and_exact_lengths(executor, reference):
    ids = reference[PROMPTS[0]]
    stop = ids[5]
    (result,) = executor.generate([PROMPTS[0]], N, stop_token_ids=[stop])
    assert result.token_ids == ids[:ids.index(stop) + 1] and result.finish_reason == "stop"
    for n in (0, 1, 2, 7):
        (result,) = executor.generate([PROMPTS[1]], n)
        assert result.token_ids == reference[PROMPTS[1]][:n]


def test_stream_concatenates_to_the_result(executor):
    events = list(executor.generate_stream(PROMPTS[2], N))
    (result,) = executor.generate([PROMPTS[2]], N)
    assert [t for e in events for t in e.token_ids] == result.token_ids
    assert "".join(e.text for e in events) == result.text
    assert events[-1].finished and not any(e.finished for e in events[:-1])


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=4, temperature=-0.5), "temperature"),
    (dict(max_new_tokens=4, top_p=0.0), "top_p"),
    (dict(max_new_tokens=4, max_draft_len=-2), "max_draft_len"),
    (dict(max_new_tokens=4, max_draft_len="fast"), "max_draft_len"),
    (dict(max_new_tokens=4, max_draft_len=5), "larger than the 4"),
    (dict(max_new_tokens=4, seed=[1, 2]), "seed"),
    (dict(max_new_tokens=4, seed=-1), "seed"),
    (dict(max_new_tokens=200), "max_seq_len 128"),
])
def test_request_errors_are_request_errors(executor, kwargs, match):
    with pytest.raises(RequestError, match=match):
        executor.generate(["hi"], **kwargs)
    with pytest.raises(RequestError, match="max_input_len 64"):
        executor.generate([list(range(10, 90))], 4)
    assert executor.generate(["hi"], 2)[0].token_ids  # still usable


def test_limits_hold_exactly_at_their_boundaries(executor):
    """The limits callers read are the ones enforced, to the token: a prompt of exactly max_input_len tokens that
    generates up to exactly max_seq_len is served (drafting stays inside the KV capacity at the end), and one token
    more of either, or K above engine_draft_len, is refused."""
    assert (executor.max_input_len, executor.max_seq_len, executor.engine_draft_len) == (64, 128, 4)
    executor.eos_token_ids = []  # run to the limit: no early end of sequence
    prompt = list(range(10, 10 + 64))
    (result,) = executor.generate([prompt], 128 - 64, max_draft_len=4)
    assert len(result.token_ids) == 64 and result.finish_reason == "length" and result.prompt_tokens == 64
    with pytest.raises(RequestError, match="max_input_len 64"):
        executor.generate([prompt + [10]], 1)
    with pytest.raises(RequestError, match="max_seq_len 128"):
        executor.generate([prompt], 128 - 64 + 1)
    with pytest.raises(RequestError, match="larger than the 4"):
        executor.generate([prompt[:8]], 2, max_draft_len=5)


def test_seeded_sampling_is_reproducible_per_prompt(executor):
    kw = dict(temperature=0.9, top_k=50, top_p=0.95)
    a = executor.generate(PROMPTS[:2], 12, seed=11, **kw)
    b = executor.generate(PROMPTS[1:2], 12, seed=11, **kw)  # the same prompt alone, same seed
    assert a[1].token_ids == b[0].token_ids
    c = executor.generate(PROMPTS[:2], 12, seed=[12, 13], **kw)
    assert [r.token_ids for r in c] != [r.token_ids for r in a]


def test_fit_max_tokens_lowers_a_default_to_what_max_seq_len_leaves(executor):
    """A caller's default cap (a chat without max_tokens) is fitted to the room after the prompt instead of being
    refused; a value within the room is kept."""
    executor.eos_token_ids = []
    prompt = list(range(10, 10 + 50))
    with pytest.raises(RequestError, match="max_seq_len 128"):
        executor.new_request(prompt, 4096)
    fitted = executor.new_request(prompt, 4096, fit_max_tokens=True, with_text=False)
    assert fitted.max_new_tokens == 128 - 50
    assert len(executor.run([fitted])[0].token_ids) == 128 - 50
    assert executor.new_request(prompt, 7, fit_max_tokens=True).max_new_tokens == 7
