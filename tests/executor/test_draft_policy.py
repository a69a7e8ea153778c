"""The adaptive-K policy against a deterministic cost model: it must find out when drafting pays (explore), keep
drafting while it pays, and stop when it does not.

The simulated engine: a lookup (n-gram) row finds a match with a given chance and then drafts up to K tokens for
free; each is accepted with probability alpha until the first rejection (seeded); a step emits accepted + 1 tokens
and costs one target forward over rows x (K + 1) tokens. As in the engine, the policy is calibrated with bare
forwards (the true cost less a fixed overhead) and then told what every step it ran cost.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from pipeline.executor.draft_policy import COLD_START_TOKENS, PLAIN_EVERY, DraftPolicy, ForwardCost

ENGINE_DRAFT_LEN = 8
OVERHEAD = 0.2  # of a step's cost, spent outside the forward (sampling, accept rule, bookkeeping)


def memory_bound(tokens: int) -> float:
    """Batch 1 on a CPU: verifying K+1 tokens costs 1 + 0.06 K steps (5 tokens: 1.24, as measured on SmolLM2-135M)."""
    return 1.0 + 0.06 * (tokens - 1)


def compute_bound(tokens: int) -> float:
    """32 rows on a CPU: a forward costs in proportion to its tokens, so K+1 tokens per row cost K+1 steps."""
    return tokens / 32


def calibrated(cost: Callable[[int], float], rows: int = 1) -> DraftPolicy:
    """A policy calibrated as the engine calibrates it: bare forwards at the widths it will use."""
    policy = DraftPolicy(ENGINE_DRAFT_LEN)
    widths = range(1, ENGINE_DRAFT_LEN + 2) if rows == 1 else (1, ENGINE_DRAFT_LEN // 2 + 1, ENGINE_DRAFT_LEN + 1)
    for width in widths:
        policy.target.record(rows * width, cost(rows * width) - OVERHEAD)
    return policy


def _accepted(rng: random.Random, alpha: float, k: int) -> int:
    n = 0
    while n < k and rng.random() < alpha:
        n += 1
    return n


def serve(cost: Callable[[int], float], requests: list[list[float]], fixed_k: int | None = None, rows: int = 1,
          match: float = 1.0, seed: int = 0) -> list[tuple[float, float]]:
    """Requests one after another on one policy (a server), each ``rows`` rows with one alpha per step; per request
    (tokens per unit of time, mean K drafted per row and step), with the policy (``fixed_k`` None) or a fixed K."""
    rng = random.Random(seed)
    policy = calibrated(cost, rows)
    results = []
    for index, alphas in enumerate(requests):
        ids = [index * rows + row for row in range(rows)]
        tokens = seconds = drafted = 0.0
        for alpha in alphas:
            # a lookup finds a match, or nothing
            limits = [ENGINE_DRAFT_LEN if rng.random() < match else 0 for _ in ids]
            planned = policy.plan(ids, limits, [False] * rows) if fixed_k is None else [fixed_k] * rows
            ks = [min(k, limit) for k, limit in zip(planned, limits)]
            for row, k_row in zip(ids, ks):
                accepted = _accepted(rng, alpha, k_row)
                tokens += accepted + 1
                policy.observe(row, k_row, accepted)
            verified = sum(k + 1 for k in ks)  # the verify packs each row's own tokens
            step = cost(verified)
            policy.target.record(verified, step, measured=True)
            seconds += step
            drafted += sum(ks) / rows
        results.append((tokens / seconds, drafted / len(alphas)))
    return results


def run(cost: Callable[[int], float], alphas: list[float], **kwargs) -> tuple[float, float]:
    """One request: (tokens per unit of time, mean K drafted per row and step)."""
    return serve(cost, [alphas], **kwargs)[0]


def max_k(policy: DraftPolicy, *args, **kwargs) -> int:
    """The deepest K the policy gives any row."""
    return max(policy.choose(*args, **kwargs), default=0)


def best_fixed(cost, alphas: list[float], **kwargs) -> float:
    return max(run(cost, alphas, fixed_k=k, **kwargs)[0] for k in range(ENGINE_DRAFT_LEN + 1))


@pytest.mark.parametrize("alpha", [0.7, 0.85])
@pytest.mark.parametrize("match", [1.0, 0.6])
def test_reaches_nine_tenths_of_the_best_fixed_k_when_lookups_pay(alpha, match):
    """A code-edit answer: a short preamble in prose ("Here is the function with the variable renamed:"), where
    lookups fail, then code copied from the prompt. (The policy before exploration, a row's whole history shrunk to
    the engine-wide rate, reached 0.83 of the best fixed K at alpha 0.85.)"""
    alphas = [0.05] * 8 + [alpha] * 300
    rate, mean_k = run(memory_bound, alphas, match=match)
    assert rate >= 0.9 * best_fixed(memory_bound, alphas, match=match)
    assert mean_k >= 0.5 * ENGINE_DRAFT_LEN * match


@pytest.mark.parametrize("alpha", [0.03, 0.05])
def test_stops_drafting_when_it_does_not_pay(alpha):
    """Prose: lookups are almost never right. The policy must cost at most 3% against plain decoding."""
    alphas = [alpha] * 400
    rate, mean_k = run(memory_bound, alphas)
    assert rate >= 0.97 * run(memory_bound, alphas, fixed_k=0)[0]
    assert mean_k < 1.0


def test_finds_out_when_the_text_turns_predictable():
    """An answer that starts with prose and then copies code from its prompt: 40 steps where lookups fail, then 200
    where they succeed. A row that stopped drafting must try again and find out (the old estimator, a row's whole
    history shrunk to the engine-wide rate, stayed near K=0 here: 0.32 of the best fixed K)."""
    alphas = [0.03] * 40 + [0.85] * 200
    rate, mean_k = run(memory_bound, alphas)
    assert rate >= 0.9 * best_fixed(memory_bound, alphas)
    assert mean_k > 4  # drafts deep once lookups pay


def test_a_server_learns_each_request_on_its_own():
    """Requests share the engine-wide rate, a prior a request's own evidence must soon outweigh: prose after code
    must stop drafting (the policy that re-explored by decaying towards that prior kept drafting: 0.96x plain), and
    code after prose must find out that lookups pay."""
    code, prose = [0.05] * 8 + [0.8] * 300, [0.03] * 300
    requests = [code, prose, prose, code]
    rates = [rate for rate, _ in serve(memory_bound, requests)]
    plain = [rate for rate, _ in serve(memory_bound, requests, fixed_k=0)]
    best = [max(rates) for rates in zip(*(
        [rate for rate, _ in serve(memory_bound, requests, fixed_k=k)] for k in range(ENGINE_DRAFT_LEN + 1)))]
    assert rates[1] >= 0.97 * plain[1] and rates[2] >= 0.97 * plain[2]
    assert rates[0] >= 0.9 * best[0] and rates[3] >= 0.9 * best[3]


def test_drafts_little_when_the_batch_is_compute_bound():
    """Drafting cannot pay at 32 rows on a CPU even at alpha 0.6."""
    alphas = [0.6] * 200
    rate, mean_k = run(compute_bound, alphas, rows=32)
    assert mean_k < 0.5
    assert rate >= 0.97 * run(compute_bound, alphas, fixed_k=0, rows=32)[0]


def test_new_rows_draft_before_any_evidence():
    policy = calibrated(memory_bound)
    assert policy.plan([7], [ENGINE_DRAFT_LEN], [False])[0] > 0  # optimism: find out first


def _dear_draft_policy() -> DraftPolicy:
    """A draft model step costing 0.55 of a target step (the tiny pair on its runners): no K pays at the prior."""
    policy = DraftPolicy(ENGINE_DRAFT_LEN)
    for tokens in range(1, ENGINE_DRAFT_LEN + 2):
        policy.target.record(tokens, 0.5 + 0.01 * tokens)
    policy.draft.record(1, 0.28)
    return policy


def test_a_cold_engine_drafts_to_find_out_when_the_price_says_no():
    policy = _dear_draft_policy()
    assert policy.choose([policy.prior_rate], [ENGINE_DRAFT_LEN])[0] == 0  # priced out at the prior
    assert policy.plan([1], [ENGINE_DRAFT_LEN])[0] == 1  # yet a cold engine's new row drafts one token
    assert policy.plan([2], [0])[0] == 0  # never above a row's own limit
    for _ in range(COLD_START_TOKENS):
        policy.observe(1, 1, 1)  # the pair agrees
    assert policy.drafted >= COLD_START_TOKENS and policy.plan([1], [ENGINE_DRAFT_LEN])[0] >= 1  # and it pays
    cold = _dear_draft_policy()
    for _ in range(COLD_START_TOKENS):
        cold.plan([3], [ENGINE_DRAFT_LEN])
        cold.observe(3, 1, 0)  # every probe rejected
    steps = [cold.plan([4], [ENGINE_DRAFT_LEN])[0] for _ in range(20)]
    assert steps == [0] * 20  # warm now: the price alone decides, and a rejected pair does not pay


def test_a_cold_engine_drafts_only_for_rows_due_for_a_probe():
    """Cold, a row whose probe the target rejected waits for its next probe like any other: the cold start adds a
    token to probes, not to every step."""
    policy = _dear_draft_policy()
    assert policy.plan([5], [ENGINE_DRAFT_LEN])[0] == 1
    policy.observe(5, 1, 0)  # rejected outright
    assert policy.drafted < COLD_START_TOKENS  # still cold
    assert policy.plan([5], [ENGINE_DRAFT_LEN])[0] == 0  # waits


def test_a_plain_step_now_and_then():
    """Every PLAIN_EVERY-th step runs without drafting, so the plain step's cost is measured while drafting wins."""
    policy = calibrated(memory_bound)
    caps = [policy.plan([1], [ENGINE_DRAFT_LEN], [False])[0] for _ in range(2 * PLAIN_EVERY)]
    assert [i for i, cap in enumerate(caps) if cap == 0] == [PLAIN_EVERY - 1, 2 * PLAIN_EVERY - 1]


def test_rows_that_left_are_forgotten():
    policy = calibrated(memory_bound)
    for _ in range(10):
        policy.observe(1, 4, 0)
        policy.observe(2, 4, 0)
    policy.keep_only({2})
    assert policy.row_rate(1) == policy.row_rate(99)  # back to the prior: no evidence
    assert policy.row_rate(2) < policy.row_rate(1)  # still rejected recently


def test_rate_counts_only_judged_tokens():
    """Drafting 8 and having 4 accepted judged 5 tokens (4 accepted, 1 rejected): the per-token rate is 0.8, not 0.5."""
    policy = calibrated(memory_bound)
    for _ in range(200):
        policy.observe(3, 8, 4)
    assert policy.row_rate(3) == pytest.approx(0.8, abs=0.02)


def test_cost_model_plans_with_what_the_engine_measured():
    """A width the engine ran costs what it measured; one it has not run costs its bare forward plus the overhead
    the engine measured on top of bare forwards elsewhere."""
    cost = ForwardCost()
    for tokens in range(1, 10):
        cost.record(tokens, memory_bound(tokens) - OVERHEAD)
    assert cost(5) == pytest.approx(1.24 - OVERHEAD)  # calibration only: bare forwards
    cost.record(1, 1.0 + 0.3, measured=True)  # this engine spends 0.3 beside each forward
    assert cost(1) == pytest.approx(1.3)
    assert cost(5) == pytest.approx(1.24 - OVERHEAD + 0.3 + OVERHEAD)  # bare + the measured overhead
    for _ in range(3):
        cost.record(5, 2.0, measured=True)
    assert cost(5) == pytest.approx(2.0)  # measured again and again: the engine's own number wins


def test_one_slow_step_does_not_price_a_width_out():
    """A burst from another process made one verify 40x slower: the policy must not stop using that width for good
    (it would never measure it again). A lasting slowdown wins after a few steps."""
    cost = ForwardCost()
    for tokens in range(1, 10):
        cost.record(tokens, memory_bound(tokens) - OVERHEAD)
    for _ in range(5):
        cost.record(1, 1.0, measured=True)
    cost.record(5, 50.0, measured=True)
    assert cost(5) == pytest.approx(1.24)
    for _ in range(3):
        cost.record(5, 3.0, measured=True)
    assert cost(5) == pytest.approx(3.0)


def test_calibration_asks_for_every_verify_width_at_batch_one():
    widths = DraftPolicy(ENGINE_DRAFT_LEN).calibration_widths(max_rows=4)
    assert list(widths) == [1, 2, 4]
    assert widths[1] == list(range(1, ENGINE_DRAFT_LEN + 2))  # K+1 for every K at batch 1
    assert widths[4] == [1, ENGINE_DRAFT_LEN // 2 + 1, ENGINE_DRAFT_LEN + 1]
    assert list(DraftPolicy(ENGINE_DRAFT_LEN).calibration_widths(max_rows=48)) == [1, 2, 4, 8, 16, 32, 48]


def test_draft_policy_stops_drafting_when_it_does_not_pay():
    policy = DraftPolicy(engine_draft_len=6)
    for tokens in (1, 8, 64, 256):
        policy.target.record(tokens, 0.010 + 0.0001 * tokens)  # flat, then compute-bound
        policy.draft.record(tokens, 0.001 + 0.00001 * tokens)
    assert max_k(policy, [0.8], [6]) >= 3  # batch 1, a good cheap draft: draft a lot
    assert max_k(policy, [0.05] * 4, [6] * 4) == 0  # a draft the target rejects never pays
    expensive = DraftPolicy(engine_draft_len=6)
    for tokens in (1, 8, 64, 256):
        expensive.target.record(tokens, 0.0004 * tokens)  # every verified token costs as much as one step
        expensive.draft.record(tokens, 0.0003 * tokens)
    assert max_k(expensive, [0.6] * 32, [6] * 32) == 0
    assert max_k(policy, [0.8] * 4, [2] * 4) >= 1 and max_k(policy, [], []) == 0
    # A draft model as slow as the target never pays at this rate; n-gram lookups (no draft forward) do.
    slow_draft = DraftPolicy(engine_draft_len=6)
    for tokens in (1, 8, 64, 256):
        slow_draft.target.record(tokens, 0.010 + 0.0001 * tokens)
        slow_draft.draft.record(tokens, 0.010)
    assert max_k(slow_draft, [0.5], [6]) == 0
    assert max_k(slow_draft, [0.5], [6], uses_model=[False]) >= 1
    lookups = DraftPolicy(engine_draft_len=8)
    for tokens, seconds in ((1, 0.010), (2, 0.0101), (9, 0.011)):
        lookups.target.record(tokens, seconds)
    assert max_k(lookups, [0.5], [8], uses_model=[False]) >= 1
    assert max_k(lookups, [0.17], [0], uses_model=[False]) == 0  # no match found: nothing to verify
    # The verify packs the rows' tokens: one row's long lookup adds only its own tokens (8 + K), which stays
    # cheap; had every row been padded to its width (72 tokens, compute-bound) it would not pay.
    packed = DraftPolicy(engine_draft_len=8)
    for tokens, seconds in ((8, 0.008), (16, 0.0085), (72, 0.072)):  # cheap to 16 tokens, compute-bound to 72
        packed.target.record(tokens, seconds)
    assert max_k(packed, [0.5] + [0.5] * 7, [8] + [0] * 7, uses_model=[False] * 8) >= 1
    assert max_k(packed, [0.5] * 8, [8] * 8, uses_model=[False] * 8) <= 1  # all eight drafting: compute-bound


def test_a_tree_row_is_priced_at_its_trees_width():
    """A Medusa row verifies its tree cut to depth K, not K + 1 tokens: a wide tree makes drafting cost more, and
    the policy drafts less (or not at all) where a chain of the same depth would pay."""
    policy = calibrated(memory_bound)
    chain = max_k(policy, [0.5], [4], [False])
    tree = max_k(policy, [0.5], [4], [False], [lambda k: {0: 1, 1: 11, 2: 21, 3: 41, 4: 64}[k]])
    assert chain >= 2 and tree < chain
    assert max_k(policy, [0.5], [4], [False], [lambda k: k + 1]) == chain  # a chain-shaped tree: the same K


def roofline(tokens: int, knee: int = 12) -> float:
    """A forward streams the weights (1 unit) until ``knee`` tokens' compute takes longer."""
    return max(1.0, tokens / knee)


def serve_batch(row_alphas: list[float], fixed_k: int | None = None, steps: int = 300, seed: int = 0) -> float:
    """A full batch of lookup rows, each with its own acceptance (code rows beside prose rows): tokens per unit of
    time under the policy (``fixed_k`` None) or one K for every row (0: speculation off). Calibrated at every token
    count the batch can verify, as the engine calibrates batch 1."""
    rng = random.Random(seed)
    rows = len(row_alphas)
    policy = DraftPolicy(ENGINE_DRAFT_LEN)
    for tokens in range(rows, rows * (ENGINE_DRAFT_LEN + 1) + 1):
        policy.target.record(tokens, roofline(tokens) - OVERHEAD)
    tokens = seconds = 0.0
    for _ in range(steps):
        limits = [ENGINE_DRAFT_LEN] * rows
        ks = policy.plan(list(range(rows)), limits, [False] * rows) if fixed_k is None else [fixed_k] * rows
        for row, (alpha, k) in enumerate(zip(row_alphas, ks)):
            accepted = _accepted(rng, alpha, k)
            tokens += accepted + 1
            policy.observe(row, k, accepted)
        verified = sum(k + 1 for k in ks)
        policy.target.record(verified, roofline(verified), measured=True)
        seconds += roofline(verified)
    return tokens / seconds


def test_each_row_gets_its_own_k():
    """Code rows beside prose rows in one batch: the code rows draft deep, the prose rows not at all (one cap for
    the batch would draft both or neither)."""
    policy = DraftPolicy(ENGINE_DRAFT_LEN)
    for tokens in range(8, 8 * (ENGINE_DRAFT_LEN + 1) + 1):
        policy.target.record(tokens, roofline(tokens, knee=24))
    ks = policy.choose([0.9] * 4 + [0.03] * 4, [ENGINE_DRAFT_LEN] * 8, [False] * 8)
    assert min(ks[:4]) >= 2 and ks[4:] == [0] * 4
    assert policy.choose([0.9, 0.6], [ENGINE_DRAFT_LEN, 2], [False] * 2)[1] <= 2  # never above a row's limit


@pytest.mark.parametrize("rows", [1, 2, 4, 8, 16, 32])
def test_never_slower_than_speculation_off_or_the_best_fixed_k_at_any_batch(rows):
    """The serving goal in simulation: at every batch size, mixed traffic (a quarter code at 0.85, the rest prose and
    chat at 0.05-0.4) under the policy runs at least 0.95x the faster of no speculation and the best single K."""
    alphas = [0.85 if row % 4 == 0 else (0.05, 0.2, 0.4)[row % 3] for row in range(rows)]
    policy = serve_batch(alphas)
    fixed = [serve_batch(alphas, fixed_k=k) for k in range(ENGINE_DRAFT_LEN + 1)]
    assert policy >= 0.95 * max(fixed), (policy, fixed)
