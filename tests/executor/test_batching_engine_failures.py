"""pipeline/executor/batching_engine.py: a failure in one row's proposal, verify or sampling fails that request
alone; the rows beside it get exactly the tokens of a fault-free run, and later requests still run.

Each fault is injected for one chosen request (the victim) after it has emitted a few tokens, so it fails mid-run
among rows that are mid-run too; greedy and seeded sampled rows must not notice.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.executor import SpeculativeExecutor
from pipeline.executor import batching_engine
from pipeline.executor.results import RequestFailed
from pipeline.methods import Method
from tests.conftest import load_tiny_models

PROMPTS = ["def main(", "import os\nimport sys\n", "class Parser:\n    def __init__(self", "x = [1, 2",
           "for i in range(10):\n    "]
VICTIM = 2  # index of the request a fault hits
VICTIM_TEMPERATURE = 0.77  # no other request samples at it: the sampling fault finds the victim's rows by it


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return load_tiny_models(tiny_pair)


def _requests(ex):
    """Greedy and seeded sampled rows with different K; the victim samples."""
    kinds = [dict(), dict(temperature=0.9, seed=11), dict(temperature=VICTIM_TEMPERATURE, seed=5, top_k=20),
             dict(max_draft_len=0, temperature=1.2, seed=3), dict(max_draft_len=2)]
    return [ex.new_request(prompt, 24, with_text=False, **kind) for prompt, kind in zip(PROMPTS, kinds)]


def _executor(pair):
    target, draft, tok = pair
    return SpeculativeExecutor(target, draft, tok, max_draft_len=3, max_batch_size=4)  # 5 requests: one waits


def _drive(engine, requests):
    """Step until done; returns each request's events."""
    for request in requests:
        engine.add(request)
    events = {request.id: [] for request in requests}
    while engine.has_work():
        for request, event in engine.step():
            events[request.id].append(event)
    return events


@pytest.fixture(scope="module")
def fault_free(pair):
    ex = _executor(pair)
    return [(r.token_ids, r.stats.to_dict()) for r in ex.run(_requests(ex))]


def _check_isolated(pair, ex, requests, events, fault_free, cause="injected"):
    victim = requests[VICTIM]
    last = events[victim.id][-1]
    assert last.finished and last.finish_reason == "error" and victim.finish_reason == "error"
    assert isinstance(last.error, RequestFailed) and cause in str(last.error.cause)
    assert f"request {victim.id}" in str(last.error)
    assert 0 < len(victim.generated) < 24  # it failed mid-run, after the fault started
    for i, request in enumerate(requests):
        if i != VICTIM:
            assert all(event.error is None for event in events[request.id]), i
            assert (request.generated, request.stats.to_dict()) == fault_free[i], i
    assert ex.engine.running == 0 and ex.target.cache.pool.held == 0 and ex.draft.cache.pool.held == 0
    # The engine keeps serving: a later request runs, exactly as in a fresh engine.
    later = ex.new_request(PROMPTS[0], 10, temperature=0.9, seed=11, with_text=False)
    _drive(ex.engine, [later])
    fresh = _executor(pair)
    assert later.generated == fresh.run([fresh.new_request(PROMPTS[0], 10, temperature=0.9, seed=11)])[0].token_ids


def _armed(victim) -> bool:
    return len(victim.generated) >= 4


def fail_verify_of(engine, victim, after: int = 4):
    """Make ``engine``'s target forward raise whenever ``victim`` is in it with ``after`` tokens generated; returns
    the original forward (assign it back to heal the engine)."""
    forward = engine.target.forward

    def faulty(seqs, rows, *args, **kwargs):
        if victim.id in seqs and len(victim.generated) >= after:
            raise RuntimeError("injected: the verify failed")
        return forward(seqs, rows, *args, **kwargs)

    engine.target.forward = faulty
    return forward


def test_a_failing_proposal_fails_only_its_request(pair, fault_free):
    ex = _executor(pair)
    requests = _requests(ex)
    victim = requests[VICTIM]
    proposer = ex.engine.proposers[Method.DRAFT_MODEL]
    propose = proposer.propose

    def faulty(batch, rows):  # fails after drafting: the rows' draft KV and random streams have moved on
        propose(batch, rows)
        if _armed(victim) and any(batch.requests[row] is victim for row in rows):
            raise RuntimeError("injected: the draft failed")

    proposer.propose = faulty
    events = _drive(ex.engine, requests)
    proposer.propose = propose
    _check_isolated(pair, ex, requests, events, fault_free)


def test_a_failing_target_forward_fails_only_its_request(pair, fault_free):
    ex = _executor(pair)
    requests = _requests(ex)
    forward = fail_verify_of(ex.engine, requests[VICTIM])
    events = _drive(ex.engine, requests)
    ex.engine.target.forward = forward
    _check_isolated(pair, ex, requests, events, fault_free)


def test_a_nan_sampling_distribution_fails_only_its_request(pair, fault_free, monkeypatch):
    """NaN probabilities raise nothing by themselves: sampled from, they emit arbitrary ids. The engine refuses
    them for the row that has them."""
    ex = _executor(pair)
    requests = _requests(ex)
    victim = requests[VICTIM]
    to_probs = batching_engine.logits_to_probs

    def faulty(logits, params):
        probs = to_probs(logits, params)
        if _armed(victim) and params.temperature == VICTIM_TEMPERATURE:
            return torch.full_like(probs, float("nan"))
        return probs

    monkeypatch.setattr(batching_engine, "logits_to_probs", faulty)
    events = _drive(ex.engine, requests)
    _check_isolated(pair, ex, requests, events, fault_free, cause="target distribution is not finite")


def test_nan_target_logits_fail_only_their_request(pair):
    """Greedy rows read the argmax, which a NaN would silently pick: a row whose logits hold a NaN fails."""
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=2, max_batch_size=3)
    requests = [ex.new_request(prompt, 12, with_text=False) for prompt in PROMPTS[:3]]
    victim = requests[1]
    forward = ex.engine.target.forward

    def poisoned(seqs, rows, *args, **kwargs):
        logits = forward(seqs, rows, *args, **kwargs)
        if len(victim.generated) >= 3 and victim.id in seqs:
            with torch.inference_mode():  # the runner's logits are inference tensors
                logits[seqs.index(victim.id), 0, 5] = float("nan")
        return logits

    ex.engine.target.forward = poisoned
    events = _drive(ex.engine, requests)
    assert events[victim.id][-1].finish_reason == "error"
    assert "target logits: NaN for request" in str(events[victim.id][-1].error)
    alone = SpeculativeExecutor(target, draft, tok, max_draft_len=2, max_batch_size=1)
    for request, prompt in zip(requests, PROMPTS[:3]):
        if request is not victim:
            assert request.generated == alone.generate([prompt], 12)[0].token_ids


def test_generate_raises_the_failed_requests_error_and_the_executor_keeps_working(pair, fault_free):
    """In the executor's own loop the failed request is the caller's: generate() raises RequestFailed (the cause
    chained); the engine is clean afterwards."""
    ex = _executor(pair)
    forward = ex.engine.target.forward
    victim_prompt = ex.encode(PROMPTS[VICTIM])

    def faulty(seqs, rows, *args, **kwargs):
        running = {request.id: request for request in ex.engine.scheduler.running}
        victim = [running[seq] for seq in seqs if seq in running and running[seq].prompt_ids == victim_prompt]
        if victim and _armed(victim[0]):
            raise RuntimeError("injected: the verify failed")
        return forward(seqs, rows, *args, **kwargs)

    ex.engine.target.forward = faulty
    with pytest.raises(RequestFailed, match="the engine failed it \\(RuntimeError: injected") as err:
        ex.run(_requests(ex))
    assert isinstance(err.value.__cause__, RuntimeError)
    with pytest.raises(RequestFailed):
        list(ex.generate_stream(PROMPTS[VICTIM], 24, temperature=VICTIM_TEMPERATURE, seed=5, top_k=20))
    ex.engine.target.forward = forward
    ex.engine.step()  # the rows the raise left behind are cancelled and released
    assert ex.engine.running == 0 and ex.target.cache.pool.held == 0
    assert [(r.token_ids, r.stats.to_dict()) for r in ex.run(_requests(ex))] == fault_free
