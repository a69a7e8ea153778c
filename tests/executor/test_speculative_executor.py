"""The speculative executor on the torch backend: losslessness against Hugging Face, statistics, edge cases."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from pipeline.executor import RequestError, SpeculativeExecutor
from pipeline.kv_settings import KVSettings
from tests.conftest import load_tiny_models

PROMPTS = ["def main(", "import os\nimport sys\n", "class Parser:\n    def __init__(self", "x = [1, 2"]


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return load_tiny_models(tiny_pair)


@pytest.fixture(scope="module")
def random_draft(pair):
    target, _, _ = pair
    cfg = LlamaConfig(vocab_size=target.config.vocab_size, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=2048, eos_token_id=target.config.eos_token_id)
    torch.manual_seed(123)
    return LlamaForCausalLM(cfg).eval()


def hf_greedy(model, tokenizer, prompt: str, n: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def reference(pair):
    target, _, tok = pair
    return {p: hf_greedy(target, tok, p, 40) for p in PROMPTS}


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("draft_kind", ["self", "random", "tiny"])
def test_greedy_matches_hf_generate(pair, random_draft, reference, k, draft_kind):
    target, draft, tok = pair
    drafts = {"self": target, "random": random_draft, "tiny": draft}
    ex = SpeculativeExecutor(target, drafts[draft_kind], tok, max_draft_len=k)
    results = ex.generate(PROMPTS, max_new_tokens=40)
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == reference[prompt], (draft_kind, k, prompt)
        assert result.text == tok.decode(reference[prompt], skip_special_tokens=True)
    total_drafted = sum(r.stats.draft_tokens for r in results)
    rate = sum(r.stats.accepted_tokens for r in results) / total_drafted
    if draft_kind == "self":
        assert rate == 1.0  # the target drafting for itself is always right
        assert all(r.stats.mean_accepted_len > 1 for r in results)
    if draft_kind == "random":
        assert rate < 0.2


@pytest.mark.parametrize("k", [1, 3, 8])
def test_kv_blocks_released_reused_and_bounded(pair, reference, k):
    """Blocks come back when requests finish; a second round of the same prompts reuses their prefixes (same
    tokens); the pool never grows past its limit (2 rows at max_seq_len + the verify's spare tokens)."""
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=k, max_seq_len=128, max_batch_size=2,
                             kv=KVSettings(block_size=4))
    for round_ in range(2):  # 4 prompts through 2 rows: requests queue and join as rows finish
        results = ex.generate(PROMPTS, max_new_tokens=40)
        assert [r.token_ids for r in results] == [reference[p] for p in PROMPTS]
        if round_ == 0:
            first = ex.engine.prefix_stats.hit_tokens
    assert ex.engine.prefix_stats.hit_tokens > first  # the second round found the first one's prompt blocks
    for runner in (ex.target, ex.draft):
        pool = runner.cache.pool
        assert runner.cache.lengths == {} and pool.held == 0
        assert pool.capacity <= pool.max_blocks == 2 * -(-(128 + k + 1) // 4)


@pytest.mark.slow  # the compiled decoders' warm-ups compile four graphs (about a minute on 2 cores)
def test_compiled_executor_matches_eager(pair, reference, tmp_path, monkeypatch):
    target, draft, tok = pair
    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path))
    # one row at a time, K = 1: every verify (2 tokens) fits the buckets the width cap leaves, 1 and 2 (what each
    # width computes is the compiled decoder test's; here, that the executor runs both models compiled)
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=1, max_seq_len=128, compile=True, max_batch_size=1,
                             compile_max_width=2)
    results = ex.generate(PROMPTS[:2], max_new_tokens=40)
    assert [r.token_ids for r in results] == [reference[p] for p in PROMPTS[:2]]
    assert sum(r.stats.accepted_tokens for r in results) > 0  # verifies of 2 tokens ran, and kept drafts
    for runner in (ex.target, ex.draft):
        assert runner.compiled is not None and runner.compiled.sizes == [1, 2]
    # only a prompt's prefill chunk is wider than the widest bucket (eager)
    assert ex.target.compiled.eager_calls <= 2


def test_the_targets_verify_width_is_compiled_as_its_own_bucket(pair, monkeypatch):
    from pipeline.executor.compiled_decoder import CompiledDecoder

    monkeypatch.setattr(CompiledDecoder, "warm_up", lambda self: 0.0)  # the bucket set, not the compiling
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=4, max_seq_len=64, compile=True, max_batch_size=2,
                             compile_max_width=8)
    assert ex.target.compiled.sizes == [1, 2, 4, 5, 8]  # a 5-token verify does not pay for 8
    assert ex.draft.compiled.sizes == [1, 2, 4, 8]


def test_target_only_is_plain_decoding(pair, reference):
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=4)
    results = ex.generate(PROMPTS, max_new_tokens=40, max_draft_len=0)
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == reference[prompt]
        assert result.stats.draft_tokens == 0 and result.stats.target_steps == len(result.token_ids)
        assert result.stats.mean_accepted_len == 1.0


def test_statistics_are_consistent(pair):
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=4)
    (result,) = ex.generate([PROMPTS[0]], max_new_tokens=30)
    s = result.stats
    assert s.generated_tokens == len(result.token_ids) == 30
    assert s.accepted_tokens <= s.draft_tokens
    # each step emits accepted + 1 tokens (no EOS here: finish_reason is length)
    assert result.finish_reason == "length"
    assert s.accepted_tokens + s.target_steps == 30
    assert s.acceptance_rate == pytest.approx(s.accepted_tokens / s.draft_tokens)
    assert s.mean_accepted_len == pytest.approx(30 / s.target_steps)
    assert sum(s.drafted_at) == s.draft_tokens and sum(s.accepted_at) == s.accepted_tokens
    # later positions can only be accepted if earlier ones were
    assert all(a >= b for a, b in zip(s.accepted_at, s.accepted_at[1:]))
    assert result["stats"]["acceptance_rate"] == s.acceptance_rate  # mapping-style access works too


def test_k_larger_than_tokens_left(pair, reference):
    target, _, tok = pair
    ex = SpeculativeExecutor(target, target, tok, max_draft_len=8)
    for n in (1, 2, 3, 5):
        (result,) = ex.generate([PROMPTS[1]], max_new_tokens=n)
        assert result.token_ids == reference[PROMPTS[1]][:n]
        assert result.stats.draft_tokens <= max(n - 1, 0)  # never drafts what cannot be emitted


def test_max_new_tokens_zero(pair):
    target, draft, tok = pair
    (result,) = SpeculativeExecutor(target, draft, tok).generate(["abc"], max_new_tokens=0)
    assert result.token_ids == [] and result.stats.target_steps == 0


def test_eos_inside_accepted_draft_ends_sequence(pair, reference):
    target, _, tok = pair
    ids = reference[PROMPTS[2]]
    stop_at = 6
    stop_token = ids[stop_at]
    first = ids.index(stop_token)
    # the target drafting for itself accepts everything, so the stop token lands inside an accepted run
    ex = SpeculativeExecutor(target, target, tok, max_draft_len=8)
    (result,) = ex.generate([PROMPTS[2]], max_new_tokens=40, stop_token_ids=[stop_token])
    assert result.token_ids == ids[:first + 1]
    assert result.finish_reason == "stop"
    ex.eos_token_ids = [stop_token]
    (result,) = ex.generate([PROMPTS[2]], max_new_tokens=40)
    assert result.token_ids == ids[:first + 1] and result.finish_reason == "eos"


def test_streaming_yields_incrementally(pair):
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=4)
    events = list(ex.generate_stream(PROMPTS[0], max_new_tokens=24))
    assert len(events) > 1 and events[-1].finished and not any(e.finished for e in events[:-1])
    tokens = [t for e in events for t in e.token_ids]
    (result,) = ex.generate([PROMPTS[0]], max_new_tokens=24)
    assert tokens == result.token_ids
    assert "".join(e.text for e in events) == result.text
    assert all(1 <= len(e.token_ids) <= 5 for e in events)


def test_token_id_prompts_and_batch_of_different_lengths(pair, reference):
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=3)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    results = ex.generate(ids, max_new_tokens=40)
    assert [r.token_ids for r in results] == [reference[p] for p in PROMPTS]


def test_dynamic_k_is_lossless_and_adapts(pair, random_draft, reference):
    target, draft, tok = pair
    good = SpeculativeExecutor(target, target, tok, max_draft_len=6)
    bad = SpeculativeExecutor(target, random_draft, tok, max_draft_len=6)
    (g,) = good.generate([PROMPTS[0]], max_new_tokens=40, max_draft_len="auto")
    (b,) = bad.generate([PROMPTS[0]], max_new_tokens=40, max_draft_len="auto")
    assert g.token_ids == reference[PROMPTS[0]] == b.token_ids
    # a perfect draft keeps K at its maximum; a useless one is driven down to 1
    assert g.stats.draft_tokens / g.stats.target_steps > 4
    assert b.stats.draft_tokens / b.stats.target_steps < 2


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=4, temperature=-0.5), "temperature"),
    (dict(max_new_tokens=4, top_p=0.0), "top_p"),
    (dict(max_new_tokens=4, max_draft_len=-2), "max_draft_len"),
    (dict(max_new_tokens=4, max_draft_len="fast"), "max_draft_len"),
])
def test_bad_requests_raise_clear_errors(pair, kwargs, field):
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok)
    with pytest.raises(RequestError, match=field):
        ex.generate(["hi"], **kwargs)
    assert ex.generate(["hi"], max_new_tokens=2)[0].token_ids  # still usable


def test_prompt_longer_than_engine_limit(pair):
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_seq_len=64, max_input_len=32)
    with pytest.raises(RequestError, match="max_input_len 32"):
        ex.generate([list(range(10, 50))], max_new_tokens=4)
    with pytest.raises(RequestError, match="max_seq_len 64"):
        ex.generate([list(range(10, 40))], max_new_tokens=40)


def test_loaded_models_bound_the_sequence_by_their_own_positions(pair, random_draft):
    """Without max_seq_len the pair's fewer positions bound a request; the lean decoder's RoPE tables are sized by
    that bound, not by an unbounded default (which cost seconds and hundreds of MB per executor)."""
    target, draft, tok = pair
    short = LlamaForCausalLM(LlamaConfig(**{**random_draft.config.to_dict(), "max_position_embeddings": 96})).eval()
    ex = SpeculativeExecutor(target, short, tok)
    assert ex.max_seq_len == 96 and ex.max_input_len == 95
    assert ex.engine.target._decoder.cos.shape[0] <= 96 + ex.engine.spare
    with pytest.raises(RequestError, match="max_seq_len 96"):
        ex.generate([list(range(10, 50))], max_new_tokens=60)
    assert SpeculativeExecutor(target, short, tok, method="ngram").max_seq_len == \
        target.config.max_position_embeddings  # a draft that never runs sets no limit
    from pipeline.executor.speculative_executor import UNBOUNDED_TOKENS, _position_limit

    no_limit = SimpleNamespace(config=SimpleNamespace(to_dict=dict))  # a config that names no position limit
    assert _position_limit(no_limit, None) == UNBOUNDED_TOKENS and _position_limit(no_limit, short) == 96


def test_from_engines_and_from_pretrained(built_engines, tiny_pair):
    config_path, engines = built_engines
    ex = SpeculativeExecutor.from_engines(engines / "tiny-built", device="cpu")
    assert ex.max_draft_len == 4 and ex.max_seq_len == 512 and ex.max_input_len == 256
    with pytest.raises(RequestError, match="larger than the 4"):
        ex.generate(["x"], max_new_tokens=4, max_draft_len=6)
    ref = SpeculativeExecutor.from_pretrained(str(tiny_pair / "target"), str(tiny_pair / "draft"), max_draft_len=4)
    a = ex.generate(PROMPTS[:2], max_new_tokens=16)
    b = ref.generate(PROMPTS[:2], max_new_tokens=16)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert a[0].text == b[0].text


def test_from_pretrained_refuses_different_tokenizer(tiny_pair, tmp_path):
    from pipeline.tinymodels import train_tokenizer

    other = tmp_path / "other"
    draft = AutoModelForCausalLM.from_pretrained(tiny_pair / "draft")
    draft.save_pretrained(other)
    train_tokenizer(["completely different text " * 50, "zzz yyy xxx"], 300).save_pretrained(other)
    with pytest.raises(RequestError, match="tokenizer differs"):
        SpeculativeExecutor.from_pretrained(str(tiny_pair / "target"), str(other))
