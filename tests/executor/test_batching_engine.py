"""pipeline/executor/batching_engine.py: in-flight batching: every request's tokens depend only on its own prompt, parameters and seed.

Requests of different lengths, K (0, fixed, dynamic), sampling parameters, seeds, stop tokens and max_new_tokens
share every draft and verify forward, join while others run and leave when done; each must get exactly what it gets
alone (and, greedy, what Hugging Face generate gives), and sampled tokens must follow the target's distribution.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.executor import RequestError, SpeculativeExecutor
from pipeline.kv_settings import KVSettings
from tests.conftest import load_tiny_models, tiny_vocab_model

PROMPTS = ["def main(", "import os\nimport sys\n", "class Parser:\n    def __init__(self", "x = [1, 2",
           "for i in range(10):\n    ", "return", "if __name__ == '__main__':\n    main()\n"]


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return load_tiny_models(tiny_pair)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


# (prompt index, K, max_new_tokens, extra) per request: K 0 = target only, "auto" = dynamic.
MIXED = [(0, 4, 40, {}), (1, 0, 17, {}), (2, 2, 33, {}), (3, "auto", 40, {}), (4, 8, 5, {}), (5, 1, 1, {}),
         (6, 3, 25, {"stop": True})]


def _mixed_requests(ex, tok, stop_token):
    requests = []
    for index, k, n, extra in MIXED:
        stops = [stop_token] if extra.get("stop") else None
        requests.append(ex.new_request(PROMPTS[index], n, max_draft_len=k, stop_token_ids=stops, with_text=False))
    return requests


@pytest.mark.parametrize("max_batch", [1, 3, 8])
def test_mixed_batch_greedy_equals_each_request_alone_and_hf(pair, max_batch):
    """Rows of every kind in one batch; with 3 slots for 7 requests, requests join as others finish."""
    target, draft, tok = pair
    stop_token = hf_greedy(target, tok(PROMPTS[6])["input_ids"], 25)[7]
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=8, max_batch_size=max_batch)
    batched = ex.run(_mixed_requests(ex, tok, stop_token))
    alone_ex = SpeculativeExecutor(target, draft, tok, max_draft_len=8, max_batch_size=1)
    for (index, k, n, extra), result, request in zip(MIXED, batched, _mixed_requests(alone_ex, tok, stop_token)):
        (alone,) = alone_ex.run([request])
        assert result.token_ids == alone.token_ids, (index, k)
        assert result.stats.to_dict() == alone.stats.to_dict(), (index, k)  # same steps, same acceptance
        reference = hf_greedy(target, tok(PROMPTS[index])["input_ids"], n)
        if extra.get("stop"):
            reference = reference[:reference.index(stop_token) + 1]
            assert result.finish_reason == "stop"
        assert result.token_ids == reference, (index, k)
        if k == 0:
            assert result.stats.draft_tokens == 0
    assert ex.engine.running == 0 and ex.target.cache.lengths == {} and ex.target.cache.pool.held == 0


def test_seeded_sampling_does_not_depend_on_neighbours(pair):
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=4, max_batch_size=8, adaptive_draft_len=True)
    probe = dict(max_new_tokens=30, temperature=0.8, top_k=40, top_p=0.9, seed=7, max_draft_len=3)
    (alone,) = ex.run([ex.new_request(PROMPTS[0], **probe)])
    neighbours = [ex.new_request(PROMPTS[i], 20 + i, temperature=1.3, seed=i) for i in range(1, 5)]
    neighbours += [ex.new_request(PROMPTS[5], 12), ex.new_request(PROMPTS[6], 9, temperature=0.5)]  # greedy, unseeded
    results = ex.run(neighbours[:3] + [ex.new_request(PROMPTS[0], **probe)] + neighbours[3:])
    assert results[3].token_ids == alone.token_ids
    assert results[3].stats.to_dict() == alone.stats.to_dict()
    other = ex.run([ex.new_request(PROMPTS[0], **{**probe, "seed": 8})])[0]
    assert other.token_ids != alone.token_ids  # the seed matters


@torch.no_grad()
def _exact_joint(model, prompt: list[int], temperature: float) -> torch.Tensor:
    def probs(ids):
        return torch.softmax(model(torch.tensor([ids])).logits[0, -1].float() / temperature, -1)

    first = probs(prompt)
    return torch.stack([first[a] * probs(prompt + [a]) for a in range(6)]).flatten()  # [36]


def test_sampling_under_batching_follows_the_target_distribution():
    """Probe requests sampled among neighbours with other temperatures, K and prompts: their first two tokens
    follow the target's exact joint at the probe temperature (TV bound 0.07 at 3000 samples; the draft's own joint
    is > 0.3 away, so the test can tell them apart)."""
    target, draft = tiny_vocab_model(1), tiny_vocab_model(2)
    prompt, temperature = [1, 4, 2], 0.7
    exact = _exact_joint(target, prompt, temperature)
    assert 0.5 * (exact - _exact_joint(draft, prompt, temperature)).abs().sum() > 0.3
    ex = SpeculativeExecutor(target, draft, tokenizer=None, max_draft_len=3, max_batch_size=16)
    n, probes = 3000, []
    for start in range(0, n, 100):
        batch = []
        for i in range(start, start + 100):
            batch.append(ex.new_request(prompt, 2, temperature=temperature, seed=i, max_draft_len=3))
            if i % 4 == 0:  # a neighbour with other parameters in the same forwards
                batch.append(ex.new_request([3, 3, 5, 0], 5, temperature=1.6, seed=10_000 + i, max_draft_len=1))
        results = ex.run(batch)
        probes += [r for r, q in zip(results, batch) if q.prompt_ids == prompt]
    pairs = torch.tensor([r.token_ids[0] * 6 + r.token_ids[1] for r in probes])
    empirical = torch.bincount(pairs, minlength=36).float() / len(probes)
    tv = 0.5 * (empirical - exact).abs().sum().item()
    assert tv < 0.07, tv
    drafted = sum(r.stats.draft_tokens for r in probes)
    assert 0 < sum(r.stats.accepted_tokens for r in probes) < drafted


def test_cancel_frees_the_slot_and_spares_the_others(pair):
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=4, max_batch_size=2)
    requests = [ex.new_request(p, 30, with_text=False) for p in PROMPTS[:3]]
    for request in requests:
        ex.engine.add(request)
    ex.engine.step()
    assert ex.engine.running == 2 and ex.engine.waiting == 1
    event = ex.engine.cancel(requests[0])
    assert event.finished and event.finish_reason == "cancelled"
    ex.engine.step()  # the cancelled row leaves; the waiting request takes its slot
    assert requests[2] in ex.engine.scheduler.running and requests[0] not in ex.engine.scheduler.running
    while ex.engine.has_work():
        ex.engine.step()
    alone = SpeculativeExecutor(target, draft, tok, max_draft_len=4, max_batch_size=1)
    for request, prompt in zip(requests[1:], PROMPTS[1:3]):
        assert request.generated == alone.generate([prompt], 30)[0].token_ids
    assert len(requests[0].generated) < 30


def test_closed_stream_frees_its_row(pair):
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=4, max_batch_size=2)
    stream = ex.generate_stream(PROMPTS[0], 40)
    next(stream)
    stream.close()
    ex.engine.step()
    assert ex.engine.running == 0 and not ex.engine.has_work()


ARCHITECTURES = {
    "gpt2": lambda: __import__("transformers").GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2,
                                                           n_positions=128),
    "qwen2": lambda: __import__("transformers").Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                             num_hidden_layers=2, num_attention_heads=4,
                                                             num_key_value_heads=2, max_position_embeddings=128),
    "mistral": lambda: __import__("transformers").MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                                 num_hidden_layers=2, num_attention_heads=4,
                                                                 num_key_value_heads=2,
                                                                 max_position_embeddings=128),
    "gpt_neox": lambda: __import__("transformers").GPTNeoXConfig(vocab_size=64, hidden_size=32,
                                                                  intermediate_size=64, num_hidden_layers=2,
                                                                  num_attention_heads=4,
                                                                  max_position_embeddings=128),
    "phi3": lambda: __import__("transformers").Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                           num_hidden_layers=2, num_attention_heads=4,
                                                           num_key_value_heads=2, max_position_embeddings=128,
                                                           pad_token_id=0),
}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_other_architectures_batched_greedy_equals_hf(arch):
    from transformers import AutoModelForCausalLM as Auto

    config = ARCHITECTURES[arch]()
    config.eos_token_id = None
    torch.manual_seed(0)
    target = Auto.from_config(config).eval()
    torch.manual_seed(1)
    draft = Auto.from_config(config).eval()
    prompts = [[5, 9, 13, 2], [7] * 11, [1, 2, 3, 4, 5, 6, 7, 8, 9], [40]]
    for the_draft in (target, draft):  # accepts everything / accepts little
        ex = SpeculativeExecutor(target, the_draft, tokenizer=None, max_draft_len=3, max_batch_size=4)
        results = ex.generate(prompts, max_new_tokens=12)
        for prompt, result in zip(prompts, results):
            assert result.token_ids == hf_greedy(target, prompt, 12), (arch, prompt)


SYSTEM = "You are a careful assistant. Answer in code only, with no prose before or after it.\n"


def _chat_requests(ex, n=6):
    """Prompts sharing a long system prefix, greedy and seeded-sampled, different K."""
    requests = []
    for i in range(n):
        sampled = dict(temperature=0.9, top_k=30, seed=100 + i) if i % 2 else {}
        requests.append(ex.new_request(SYSTEM + PROMPTS[i], 12 + i, max_draft_len=[0, 2, 4][i % 3],
                                       with_text=False, **sampled))
    return requests


def test_chunked_prefill_and_prefix_reuse_change_no_result(pair):
    """A small step budget (prompts prefilled over several steps, chunk ends anywhere in a block) and prefix reuse
    (the shared system prompt computed once) give exactly the tokens of whole-prompt prefill with no reuse."""
    target, draft, tok = pair
    plain = SpeculativeExecutor(target, draft, tok, max_draft_len=4, max_batch_size=3,
                                kv=KVSettings(block_size=64, prefix_reuse=False, step_tokens=4096))
    expected = plain.run(_chat_requests(plain))
    assert plain.engine.prefix_stats.hit_tokens == 0
    for block_size, step_tokens in ((4, 7), (8, 40)):
        ex = SpeculativeExecutor(target, draft, tok, max_draft_len=4, max_batch_size=3,
                                 kv=KVSettings(block_size=block_size, step_tokens=step_tokens))
        results = ex.run(_chat_requests(ex))
        for got, want in zip(results, expected):
            assert got.token_ids == want.token_ids and got.stats.to_dict() == want.stats.to_dict()
        prefix = len(tok(SYSTEM)["input_ids"]) // block_size * block_size
        assert ex.engine.prefix_stats.hit_tokens >= 3 * prefix  # later requests reused the system prompt's blocks
        # Chunks within what the verifies (3 rows of up to 5 tokens) left of the budget, or one block when they left
        # less: a prompt always advances.
        assert max(ex.engine.step_tokens) <= max(step_tokens, 3 * 5 + block_size)
        assert ex.draft.cache.pool is ex.target.cache.pool and ex.target.cache.pool.held == 0  # the draft follows


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_keep_decoding(pair):
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=2, max_batch_size=4,
                             kv=KVSettings(block_size=4, step_tokens=10))
    engine = ex.engine
    runner = ex.new_request(PROMPTS[0], 300, with_text=False)
    engine.add(runner)
    while not runner.generated:
        engine.step()
    long = ex.new_request(" ".join(PROMPTS) * 2, 5, with_text=False)
    engine.add(long)
    steps = 0
    while not long.generated:
        before = len(runner.generated)
        events = engine.step()
        if not long.generated:
            assert [request for request, _ in events] == [runner]  # the prefilling request emits nothing yet
        assert len(runner.generated) > before  # the decoding row advanced in every step
        assert engine.step_tokens[-1] <= 10
        steps += 1
    assert steps > (len(long.prompt_ids) - 1) // 10  # over several steps, at most 10 tokens each
    assert not runner.finished
    engine.cancel(runner)
    while engine.has_work():
        engine.step()
    assert long.generated == hf_greedy(target, long.prompt_ids, 5)


def test_a_request_joining_beside_one_prefilling_the_same_prefix_reuses_it(pair):
    """Both join in the same step; the second looks the prefix cache up only when its own prefill starts, after the
    first has computed (and hashed) the shared system prompt in chunks."""
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=2, max_batch_size=4,
                             kv=KVSettings(block_size=4, step_tokens=8))
    first, second = (ex.new_request(SYSTEM + PROMPTS[i], 3, with_text=False) for i in (0, 1))
    shared = len(tok(SYSTEM)["input_ids"]) // 4 * 4 - 4  # whole blocks surely inside the common prefix
    results = ex.run([first, second])
    assert ex.engine.prefix_stats.hit_tokens >= shared
    assert [r.token_ids for r in results] == [hf_greedy(target, r.prompt_ids, 3) for r in (first, second)]


def test_requests_wait_for_kv_memory_and_never_run_out(pair):
    """A pool that holds one request at its longest: the second waits in the queue instead of failing mid-step."""
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=3, max_batch_size=4,
                             kv=KVSettings(block_size=4, max_tokens=64))
    requests = [ex.new_request(PROMPTS[i], 30, with_text=False) for i in (0, 3)]  # ~40 positions each at most
    for request in requests:
        ex.engine.add(request)
    most = 0
    while ex.engine.has_work():
        ex.engine.step()
        most = max(most, ex.engine.running)
    assert most == 1
    assert [r.generated for r in requests] == [hf_greedy(target, r.prompt_ids, 30) for r in requests]
    with pytest.raises(RequestError, match=r"needs \d+ KV positions, but the KV cache holds 64 "
                                           r"\(build.kv_cache.max_tokens\)"):
        ex.new_request(PROMPTS[0], 200)


def test_a_prompt_whose_context_is_all_cached_needs_no_prefill_forward(pair):
    """9 tokens with blocks of 4: the second time, the 8 context tokens are two cached blocks and the prefill step
    has nothing to compute (a forward of no tokens is skipped, not run)."""
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=2, max_batch_size=2, kv=KVSettings(block_size=4))
    prompt = list(range(5, 14))
    first = ex.generate([prompt], max_new_tokens=6)[0]
    second = ex.generate([prompt], max_new_tokens=6)[0]
    assert first.token_ids == second.token_ids == hf_greedy(target, prompt, 6)
    assert ex.engine.prefix_stats.hit_tokens == 8


@pytest.mark.parametrize("k", [0, 3])
def test_a_tiny_temperature_samples_the_greedy_tokens(pair, k):
    """1e-44 passes validation (finite, > 0); dividing float32 logits by it overflowed to NaN probabilities, which
    made the draft's sampling raise inside the step (K > 0) or emitted arbitrary ids (K = 0). Its limit is greedy."""
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=3, max_batch_size=4)
    greedy = ex.generate(PROMPTS[:3], 16, max_draft_len=k)
    for seed in (None, 1):
        tiny = ex.generate(PROMPTS[:3], 16, temperature=1e-44, seed=seed, max_draft_len=k)
        assert [r.token_ids for r in tiny] == [r.token_ids for r in greedy], seed


def test_fit_max_tokens_fits_the_kv_pool_instead_of_refusing(pair):
    """A pool of 64 positions, K = 3 (a verify writes 4 past the end): a prompt of p tokens has room for 60 - p new
    ones. Fitted, the request runs to exactly that length; a prompt that leaves no room for one is refused."""
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=3, max_batch_size=4,
                             kv=KVSettings(block_size=4, max_tokens=64))
    ex.eos_token_ids = []
    prompt = tok(PROMPTS[2])["input_ids"]
    with pytest.raises(RequestError, match="needs \\d+ KV positions, but the KV cache holds 64"):
        ex.new_request(prompt, 1000)
    fitted = ex.new_request(prompt, 1000, fit_max_tokens=True, with_text=False)
    assert fitted.max_new_tokens == 60 - len(prompt)
    (result,) = ex.run([fitted])
    assert result.token_ids == hf_greedy(target, prompt, 60 - len(prompt))
    assert ex.new_request(prompt, 5, fit_max_tokens=True).max_new_tokens == 5
    with pytest.raises(RequestError, match="prompt \\(60 tokens\\) \\+ max_tokens \\(1\\) needs 68 KV positions, but "
                                           "the KV cache holds 64 \\(build.kv_cache.max_tokens\\)"):
        ex.new_request(list(range(5, 65)), 1000, fit_max_tokens=True)


def test_cache_salts_keep_prefix_reuse_apart(pair):
    """Requests share cached prompt blocks only with requests of the same salt (or, unsalted, with unsalted ones);
    the tokens never depend on it."""
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=2, max_batch_size=2, kv=KVSettings(block_size=4))
    prompt = tok(SYSTEM + PROMPTS[0])["input_ids"]
    expected = hf_greedy(target, prompt, 6)
    hits, draft_hits = [], []
    draft_open = ex.draft.open
    ex.draft.open = lambda *args: draft_hits.append(draft_open(*args)) or draft_hits[-1]
    for salt in ("tenant-a", "tenant-b", None, "tenant-a", None, "tenant-b"):
        (result,) = ex.run([ex.new_request(prompt, 6, cache_salt=salt, with_text=False)])
        assert result.token_ids == expected
        hits.append(ex.engine.prefix_stats.hit_tokens - sum(hits))
    reusable = (len(prompt) - 1) // 4 * 4
    assert hits == [0, 0, 0, reusable, reusable, reusable]
    assert draft_hits == hits  # the draft reuses what it filled in the blocks the target's salted lookup found
    with pytest.raises(RequestError, match="cache_salt: 7 must be a string"):
        ex.new_request(prompt, 6, cache_salt=7)


def test_colliding_block_keys_never_change_a_result(monkeypatch):
    """Every block key the same: a prompt must never take the KV of another prompt's blocks (each hit is checked
    against the block's place, parent and tokens), so every result is Hugging Face's. Random models: their outputs
    depend on the whole context, so KV from the wrong positions shows."""
    from pipeline.executor import block_pool
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(block_pool, "digest", lambda parent, tokens: bytes(32))
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    torch.manual_seed(1)
    draft = LlamaForCausalLM(config).eval()
    ex = SpeculativeExecutor(target, draft, tokenizer=None, max_draft_len=2, max_batch_size=2,
                             kv=KVSettings(block_size=4))
    head, other = [5, 9, 13, 2], [7, 7, 30, 1]
    prompts = [head + other + [11, 3, 8, 8, 40], head * 3 + [6], other + head + [20, 21], head + other + [4, 4, 4]]
    for prompt in prompts + prompts[::-1]:
        (result,) = ex.generate([prompt], 8)
        assert result.token_ids == hf_greedy(target, prompt, 8), prompt
    assert ex.engine.prefix_stats.hit_tokens > 0  # a first block equal to the one keyed block is still reused


def test_calibration_prices_the_engines_own_runners_at_every_shape_the_policy_asks(pair):
    """The adaptive K's first prices: the target runner timed at rows x width tokens for each shape the policy asks
    for, the draft model's runner at one token per row, and no scratch row left open or counted in the prefix cache."""
    from pipeline.executor.draft_policy import DraftPolicy

    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=4, max_batch_size=4, adaptive_draft_len=True)
    policy = DraftPolicy(4)
    ex.engine.calibrate(policy, 4)
    shapes = policy.calibration_widths(4)
    assert set(policy.target.calibrated) == {rows * width for rows, widths in shapes.items() for width in widths}
    assert set(policy.draft.calibrated) == set(shapes)  # one draft token per row
    assert all(seconds > 0 for seconds in [*policy.target.calibrated.values(), *policy.draft.calibrated.values()])
    cache = ex.target.cache
    assert cache.lengths == {} and cache.pool.held == 0 and cache.pool.stats.queried_tokens == 0
