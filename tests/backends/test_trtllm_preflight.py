"""pipeline/backends/trtllm_preflight.py: pre-flight checks on FAKE engine config.json files (tests/fake_trtllm.py),
before any GPU memory is touched."""

from __future__ import annotations

from pipeline.backends.trtllm_api import PINNED_VERSION
from pipeline.backends.trtllm_preflight import preflight, read_engine_config
from tests.fake_trtllm import fake_engine_config


def _pair(tmp_path, target=None, draft=None):
    t = read_engine_config(fake_engine_config(tmp_path / "t", **(target or {})))
    d = read_engine_config(fake_engine_config(tmp_path / "d", **{"spec_mode": 1, "max_draft_len": 0,
                                                                 **(draft or {})}))
    return t, d


def _run(t, d, **kw):
    args = {"max_draft_len": 4, "acceptance": "rejection", "installed_version": PINNED_VERSION, **kw}
    return preflight(t, d, **args)


def test_preflight_accepts_a_good_pair(tmp_path):
    assert _run(*_pair(tmp_path)) == []


def test_target_without_spec_mode(tmp_path):
    (problem,) = _run(*_pair(tmp_path, target={"spec_mode": 1, "max_draft_len": 0}))
    assert "t/config.json" in problem and "build_config.speculative_decoding_mode is 1" in problem
    assert "--speculative_decoding_mode draft_tokens_external --max_draft_len 4" in problem


def test_target_with_smaller_max_draft_len(tmp_path):
    (problem,) = _run(*_pair(tmp_path, target={"max_draft_len": 3}))
    assert "build_config.max_draft_len is 3" in problem and "K = 4" in problem and "speculative.max_draft_len" in problem


def test_vocab_mismatch(tmp_path):
    t, d = _pair(tmp_path, target={"vocab": 152064}, draft={"vocab": 151936})
    (problem,) = _run(t, d)
    assert "vocab_size is 151936" in problem and "152064" in problem and "acceptance: greedy" in problem
    assert _run(t, d, acceptance="greedy") == []  # token ids only: padding rows never matter
    assert _run(t, d, tokenizer_len=151665) == []  # both cover every real token; the executor pads logits
    (short,) = _run(t, d, tokenizer_len=152000)
    assert "d/config.json" in short and "fewer rows than the tokenizer's 152000" in short


def test_engine_built_by_other_version(tmp_path):
    problems = _run(*_pair(tmp_path, target={"version": "1.2.1"}))  # a pip release no 25.12 container ships
    assert len(problems) == 1 and "version is '1.2.1'" in problems[0] and PINNED_VERSION in problems[0]
    assert "rebuild" in problems[0]


def test_gather_context_logits_with_draft_len(tmp_path):
    (problem,) = _run(*_pair(tmp_path, target={"gather_context": True}))
    assert "gather_context_logits is true with max_draft_len 4" in problem


def test_rejection_needs_generation_logits(tmp_path):
    problems = _run(*_pair(tmp_path, draft={"gather_generation": False}))
    assert len(problems) == 1 and "d/config.json" in problems[0] and "--gather_generation_logits" in problems[0]
    assert _run(*_pair(tmp_path, draft={"gather_generation": False}), acceptance="greedy") == []


def test_world_size_vs_device_ids(tmp_path):
    (problem,) = _run(*_pair(tmp_path, target={"tp": 4}), target_device_ids=[0])
    assert problem.startswith("runtime.target_device_ids: [0]") and "world_size 4" in problem
