"""pipeline/executor/trtllm_executor.py without TensorRT-LLM: the draft-and-verify loop's bookkeeping against
FakeTrtllmRuntime (a fake at the TensorRT-LLM boundary only), per-step seeds, and one clear line when TensorRT-LLM is
missing."""

from __future__ import annotations

import sys
from enum import StrEnum

import pytest
import torch

from pipeline.backends.trtllm_runner import EngineLimits, RunnerOutput
from pipeline.errors import BackendUnavailable
from pipeline.executor import RequestError
from pipeline.executor.trtllm_executor import TrtllmSpeculativeExecutor, step_seed
from pipeline.methods import parse_method
from tests.conftest import load_tiny_models
from tests.fake_trtllm import FakeTrtllmEngine


PROMPTS = ["def main(", "import os\nimport sys\n", "class Parser:\n    def __init__(self"]


@pytest.fixture(scope="module")
def models(tiny_pair):
    return load_tiny_models(tiny_pair)


def test_trtllm_engine_calls_get_a_distinct_seed_each_step(models):
    target, draft, tok = models
    t, d = FakeTrtllmEngine(target), FakeTrtllmEngine(draft)
    ex = TrtllmSpeculativeExecutor(t, d, tok, EngineLimits(64, 128, 4), 4, "greedy")
    ex.generate([PROMPTS[0]], 12, temperature=0.8, seed=5)
    seeds = [c["seed"] for c in t.calls + d.calls]
    assert len(set(seeds)) == len(seeds)
    assert step_seed(5, 0, 1) == t.calls[0]["seed"] and step_seed(5, 0, 0) == d.calls[0]["seed"]


@pytest.fixture
def no_trtllm(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # `import tensorrt_llm` raises ImportError
    monkeypatch.setenv("PATH", str(tmp_path))  # and no trtllm-build on PATH


def _one_line(exc: BaseException) -> str:
    message = str(exc)
    assert "\n" not in message and message
    return message


def test_from_engines_without_trtllm_is_one_clear_line(no_trtllm, tmp_path):
    with pytest.raises(BackendUnavailable) as err:
        TrtllmSpeculativeExecutor.from_engines(tmp_path)
    assert "import tensorrt_llm" in _one_line(err.value)


VOCAB = 50


EOS = 49


def target_next(seq: list[int]) -> int:
    return (sum(seq) * 7 + len(seq)) % 40


def draft_next(seq: list[int]) -> int:
    # Agrees with the target except when the sequence length is a multiple of 3.
    return target_next(seq) if len(seq) % 3 else (target_next(seq) + 1) % 40


class FakeTrtllmRuntime:
    """A FAKE engine at the TensorRT-LLM boundary: greedy next-token rules instead of a compiled engine.

    As the target it verifies draft tokens the way TensorRT-LLM's greedy acceptance does: keep the prefix equal
    to its own tokens, then add one of its own. It records every call for the bookkeeping checks.
    """

    def __init__(self, rule, vocab_size=VOCAB, eos_at: int | None = None):
        self.rule, self.vocab_size, self.eos_at, self.calls = rule, vocab_size, eos_at, []

    def _next(self, seq):
        return EOS if self.eos_at is not None and len(seq) == self.eos_at else self.rule(seq)

    def generate(self, prompt, max_new_tokens, sampling, *, draft_tokens=None, draft_logits=None,
                 want_logits=False):
        self.calls.append({"prompt_len": len(prompt), "max_new_tokens": max_new_tokens,
                           "draft_tokens": draft_tokens, "want_logits": want_logits})
        seq, out = list(prompt), []
        for i in range(max_new_tokens):
            token = self._next(seq)
            out.append(token)
            seq.append(token)
            if token == EOS or (draft_tokens is not None and (i >= len(draft_tokens) or token != draft_tokens[i])):
                break
        logits = torch.zeros(len(out), self.vocab_size - 2) if want_logits else None
        return RunnerOutput(out, logits)


def make_executor(k=4, eos_at=None, acceptance="greedy"):
    target = FakeTrtllmRuntime(target_next, eos_at=eos_at)
    draft = FakeTrtllmRuntime(draft_next, vocab_size=VOCAB - 2, eos_at=eos_at)
    ex = TrtllmSpeculativeExecutor(target, draft, None, EngineLimits(64, 256, k), k, acceptance, [EOS])
    return ex, target, draft


def reference(prompt, n):
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(target_next(seq))
        seq.append(out[-1])
    return out


def test_speculative_output_equals_target_only_and_stats_add_up():
    ex, target, draft = make_executor(k=4)
    prompt = [1, 2, 3]
    (spec,) = ex.generate([prompt], 30)
    (plain,) = ex.generate([prompt], 30, max_draft_len=0)
    assert spec.token_ids == plain.token_ids == reference(prompt, 30)
    s = spec.stats
    assert s.generated_tokens == 30 and spec.finish_reason == "length"
    assert s.target_steps == len(target.calls) - 1  # the last call is the target-only run
    assert s.draft_tokens == sum(len(c["draft_tokens"] or []) for c in target.calls[:-1])
    assert 0 < s.accepted_tokens < s.draft_tokens  # the draft disagrees every third position
    assert s.generated_tokens == s.accepted_tokens + s.target_steps  # each step: accepted + 1
    assert sum(s.drafted_at) == s.draft_tokens and sum(s.accepted_at) == s.accepted_tokens
    assert plain.stats.draft_tokens == 0 and plain.stats.target_steps == 30


def test_never_drafts_past_max_new_tokens():
    ex, target, draft = make_executor(k=4)
    (result,) = ex.generate([[5]], 6)
    assert len(result.token_ids) == 6
    assert all(c["max_new_tokens"] <= 6 for c in draft.calls)
    assert result.stats.generated_tokens == 6


def test_eos_stops_and_is_emitted():
    ex, *_ = make_executor(k=3, eos_at=7)
    (result,) = ex.generate([[1, 2]], 20)
    assert result.finish_reason == "eos" and result.token_ids[-1] == EOS and len(result.token_ids) == 6


def test_rejection_sampling_passes_logits_padded_to_target_width():
    ex, target, draft = make_executor(k=2, acceptance="rejection")
    ex.generate([[3]], 4, temperature=0.8, seed=1)
    assert draft.calls[0]["want_logits"] is True
    padded = ex._fit_logits(torch.zeros(2, VOCAB - 2))
    assert padded.shape == (2, VOCAB) and torch.isinf(padded[:, -2:]).all()
    greedy_ex, _, greedy_draft = make_executor(k=2, acceptance="rejection")
    greedy_ex.generate([[3]], 4)  # temperature 0: token comparison is exact, no logits needed
    assert greedy_draft.calls[0]["want_logits"] is False


def test_request_errors_name_the_field():
    ex, *_ = make_executor(k=4)
    with pytest.raises(RequestError, match="max_draft_len: 5 is larger than the 4"):
        ex.generate([[1]], 3, max_draft_len=5)
    with pytest.raises(RequestError, match="max_new_tokens: 1 prompt \\+ 300"):
        ex.generate([[1]], 300)
    with pytest.raises(RequestError, match="temperature"):
        ex.generate([[1]], 3, temperature=-1)


def test_stream_yields_one_event_per_target_step():
    ex, target, _ = make_executor(k=4)
    events = list(ex.generate_stream([1, 2, 3], 12))
    assert len(events) == events[-1].stats.target_steps and events[-1].finished
    assert [t for e in events for t in e.token_ids] == reference([1, 2, 3], 12)


def test_suffix_drafts_go_to_the_target_as_external_draft_tokens():
    """No draft engine: the suffix trees' drafts are verified like lookups, and a request's output, once it has
    ended, is drafted from by the next request that reaches the same text."""
    target = FakeTrtllmRuntime(target_next)
    ex = TrtllmSpeculativeExecutor(target, None, None, EngineLimits(64, 256, 6), 6, "rejection", [EOS],
                                   method="suffix")
    prompt = [1, 2, 3]
    (first,) = ex.generate([prompt], 30)
    calls_before = len(target.calls)
    (again,) = ex.generate([prompt], 30)
    assert first.token_ids == again.token_ids == reference(prompt, 30)
    drafted = [c["draft_tokens"] for c in target.calls[calls_before:] if c["draft_tokens"]]
    assert drafted and again.stats.accepted_tokens > first.stats.accepted_tokens
    assert again.stats.by_proposer["suffix"][1] == again.stats.accepted_tokens
    assert ex.suffix.running == 0


# ---- a Medusa engine: no draft engine, greedy only ---------------------------------------------------------------

MEDUSA_TREE = [[0], [1], [0, 0], [0, 0, 0]]  # depth 3


def make_medusa_executor():
    target = FakeTrtllmRuntime(target_next)  # a FAKE Medusa engine: decodes the target's greedy tokens
    ex = TrtllmSpeculativeExecutor(target, None, None, EngineLimits(64, 256, 3), 3, "rejection", [EOS],
                                   method="medusa", medusa_choices=MEDUSA_TREE)
    return ex, target


def test_medusa_greedy_request_is_one_engine_call():
    ex, target = make_medusa_executor()
    (result,) = ex.generate([[1, 2, 3]], 20)
    assert result.token_ids == reference([1, 2, 3], 20) and result.finish_reason == "length"
    # The engine drafts and verifies its tree itself: no external draft tokens, the whole request in one call.
    assert target.calls == [{"prompt_len": 3, "max_new_tokens": 20, "draft_tokens": None, "want_logits": False}]
    (top1,) = ex.generate([[1, 2, 3]], 5, temperature=0.7, top_k=1, seed=3)  # top-1 sampling is greedy
    assert top1.token_ids == reference([1, 2, 3], 5)


def test_medusa_refuses_sampled_requests_and_draft_settings():
    ex, target = make_medusa_executor()
    for kwargs in ({"temperature": 0.8}, {"temperature": 1.0, "top_k": 50, "top_p": 0.9}):
        with pytest.raises(RequestError, match="TensorRT-LLM 1.1.0's Medusa verifies greedily only") as err:
            ex.generate([[1]], 4, **kwargs)
        assert "torch backend" in str(err.value) and "temperature 0" in str(err.value)
    with pytest.raises(RequestError, match="method: 'ngram' needs external draft tokens"):
        ex.generate([[1]], 4, method="ngram")
    with pytest.raises(RequestError, match="method: 'draft_model' needs a draft model"):
        ex.generate([[1]], 4, method="draft_model")
    for k in (0, 1, "auto"):  # the tree is fixed when the engine is opened
        with pytest.raises(RequestError, match="max_draft_len: .*verifies its whole tree \\(depth 3"):
            ex.generate([[1]], 4, max_draft_len=k)
    assert target.calls == []  # refused before the engine is asked for anything
    (same,) = ex.generate([[1]], 4, max_draft_len=3, method="medusa")
    assert same.token_ids == reference([1], 4)


def test_medusa_and_external_draft_engines_do_not_mix():
    target = FakeTrtllmRuntime(target_next)
    with pytest.raises(ValueError, match="built for Medusa"):
        TrtllmSpeculativeExecutor(target, None, None, EngineLimits(64, 256, 3), 3, method="ngram",
                                  medusa_choices=MEDUSA_TREE)
    with pytest.raises(ValueError, match="needs Medusa heads"):
        TrtllmSpeculativeExecutor(target, None, None, EngineLimits(64, 256, 3), 3, method="medusa")
    ex, *_ = make_executor(k=4)
    with pytest.raises(RequestError, match="needs Medusa heads"):
        ex.generate([[1]], 4, method="medusa")


class _FutureMethod(StrEnum):
    """A method this loop has no code for (a stand-in for one added to Method later)."""

    EAGLE = "eagle"

    @property
    def needs_draft_model(self) -> bool:
        return False

    @property
    def needs_medusa_heads(self) -> bool:
        return False


def _parse_with_eagle(value, *args, **kwargs):
    return _FutureMethod.EAGLE if value == "eagle" else parse_method(value, *args, **kwargs)


def test_a_method_the_loop_does_not_implement_is_refused_by_name(monkeypatch):
    """Not run as the draft model: refused when the executor is made and on a request, listing what it runs."""
    import pipeline.executor.base as base
    import pipeline.executor.trtllm_executor as trtllm_executor

    monkeypatch.setattr(trtllm_executor, "parse_method", _parse_with_eagle)
    monkeypatch.setattr(base, "parse_method", _parse_with_eagle)
    listed = "\\(it runs 'draft_model', 'ngram', 'ngram\\+draft', 'medusa', 'suffix'\\)"
    with pytest.raises(ValueError, match=f"method: 'eagle' is not implemented by the TensorRT-LLM executor {listed}"):
        TrtllmSpeculativeExecutor(FakeTrtllmRuntime(target_next), FakeTrtllmRuntime(draft_next),
                                  None, EngineLimits(64, 256, 4), 4, method="eagle")
    ex, target, draft = make_executor(k=4)
    with pytest.raises(RequestError, match=f"method: 'eagle' is not implemented .*{listed}"):
        ex.generate([[1, 2, 3]], 6, method="eagle")
    assert target.calls == [] and draft.calls == []


def test_cache_salt_is_refused_rather_than_ignored():
    ex, target, _ = make_executor(k=4)
    with pytest.raises(RequestError, match="cache_salt: 'tenant-a', but TensorRT-LLM's KV block reuse"):
        ex.new_request([1, 2, 3], 6, cache_salt="tenant-a")
    assert ex.new_request([1, 2, 3], 6, cache_salt=None).cache_salt is None
