"""In-flight batching: every request's tokens depend only on its own prompt, parameters and seed.

Requests of different lengths, K (0, fixed, dynamic), sampling parameters, seeds, stop tokens and max_new_tokens
share every draft and verify forward, join while others run and leave when done; each must get exactly what it gets
alone (and, greedy, what Hugging Face generate gives), and sampled tokens must follow the target's distribution.
"""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import load_tiny_models, tiny_vocab_model

from pipeline.executor import SpeculativeExecutor
from pipeline.executor.draft_policy import DraftPolicy
from pipeline.executor.scheduler import Scheduler
from pipeline.executor.serving_loop import ServingLoop

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
    assert ex.engine.running == 0 and ex.target.cache.lengths == [0] * max_batch


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


def test_engine_loop_serves_concurrent_clients_and_cancels(pair):
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=4, max_batch_size=4, adaptive_draft_len=True)
    expected = {p: r.token_ids for p, r in zip(PROMPTS, ex.generate(PROMPTS, 24))}
    loop = ServingLoop(ex.engine)
    got: dict[int, list[int]] = {}
    done = threading.Event()
    lock = threading.Lock()
    gone = threading.Event()

    def client(i: int):
        prompt = PROMPTS[i % len(PROMPTS)]
        finished = threading.Event()
        tokens: list[int] = []

        def on_event(event):
            tokens.extend(event.token_ids)
            if event.finished:
                finished.set()

        cancelled = (lambda: gone.is_set()) if i == 0 else None
        loop.submit(ex.new_request(prompt, 200 if i == 0 else 24), on_event, is_cancelled=cancelled)
        finished.wait(120)
        with lock:
            got[i] = tokens
            if len(got) == 12:
                done.set()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    gone.set()  # client 0 disconnects; its long request must stop early
    assert done.wait(180)
    loop.stop()
    for i in range(1, 12):
        assert got[i] == expected[PROMPTS[i % len(PROMPTS)]], i
    assert len(got[0]) < 200


def test_scheduler_keeps_running_rows_contiguous():
    class Req:
        def __init__(self, name):
            self.name, self.finished = name, False

    scheduler = Scheduler(max_batch=4)
    reqs = [Req(c) for c in "abcdef"]
    for r in reqs:
        scheduler.add(r)
    assert [s for s, _ in scheduler.admit()] == [0, 1, 2, 3]
    reqs[0].finished = reqs[2].finished = reqs[3].finished = True
    moves, freed = scheduler.retire()
    assert moves == [(1, 0)] and freed == [1, 2, 3]
    assert [r.name for r in scheduler.running] == ["b"]
    assert [(s, r.name) for s, r in scheduler.admit()] == [(1, "e"), (2, "f")]
    reqs[1].finished = True
    moves, freed = scheduler.retire()
    assert moves == [(2, 0)] and freed == [2] and [r.name for r in scheduler.running] == ["f", "e"]


def test_draft_policy_stops_drafting_when_it_does_not_pay():
    policy = DraftPolicy(k_max=6)
    for tokens in (1, 8, 64, 256):
        policy.target.record(tokens, 0.010 + 0.0001 * tokens)  # flat, then compute-bound
        policy.draft.record(tokens, 0.001 + 0.00001 * tokens)
    assert policy.choose([0.8], [6]) >= 3  # batch 1, a good cheap draft: draft a lot
    assert policy.choose([0.05] * 4, [6] * 4) == 0  # a draft the target rejects never pays
    expensive = DraftPolicy(k_max=6)
    for tokens in (1, 8, 64, 256):
        expensive.target.record(tokens, 0.0004 * tokens)  # every verified token costs as much as one step
        expensive.draft.record(tokens, 0.0003 * tokens)
    assert expensive.choose([0.6] * 32, [6] * 32) == 0
    assert policy.choose([0.8] * 4, [2] * 4) >= 1 and policy.choose([], []) == 0
    # A draft model as slow as the target never pays at this rate; n-gram lookups (no draft forward) do.
    slow_draft = DraftPolicy(k_max=6)
    for tokens in (1, 8, 64, 256):
        slow_draft.target.record(tokens, 0.010 + 0.0001 * tokens)
        slow_draft.draft.record(tokens, 0.010)
    assert slow_draft.choose([0.5], [6]) == 0
    assert slow_draft.choose([0.5], [6], uses_model=[False]) >= 1
    lookups = DraftPolicy(k_max=8)
    for tokens, seconds in ((1, 0.010), (2, 0.0101), (9, 0.011)):
        lookups.target.record(tokens, seconds)
    assert lookups.choose([0.5], [8], uses_model=[False]) >= 1
    assert lookups.choose([0.17], [0], uses_model=[False]) == 0  # no match found: nothing to verify
    # Rows are padded to the widest in the verify: one row's long lookup widens every row's, and at batch 8 with
    # a compute-bound target that costs more than the one row gains.
    padded = DraftPolicy(k_max=8)
    for tokens, seconds in ((8, 0.008), (16, 0.0085), (72, 0.072)):  # cheap to 16 tokens, compute-bound to 72
        padded.target.record(tokens, seconds)
    assert padded.choose([0.5] + [0.5] * 7, [8] + [0] * 7, uses_model=[False] * 8) == 0


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
