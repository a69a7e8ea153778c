"""The accept rules as pure tensor functions: exact stub cases, statistics, determinism, edge cases."""

import pytest
import torch

from pipeline.speculative import accept_greedy, accept_matching, accept_rejection


def one_hot_logits(tokens, vocab=6):
    """[B, K+1] token ids -> logits whose argmax is those tokens."""
    t = torch.tensor(tokens)
    return torch.nn.functional.one_hot(t, vocab).float() * 5.0


# ---- greedy: never / always / partial -------------------------------------------------------------------------------

def test_greedy_always_accepts_and_adds_bonus():
    out, n = accept_greedy(torch.tensor([[1, 2, 3]]), one_hot_logits([[1, 2, 3, 4]]))
    assert n.tolist() == [3]
    assert out.tolist() == [[1, 2, 3, 4]]


def test_greedy_never_accepts_emits_target_token():
    out, n = accept_greedy(torch.tensor([[1, 2, 3]]), one_hot_logits([[5, 2, 3, 4]]))
    assert n.tolist() == [0]
    assert out.tolist() == [[5, -1, -1, -1]]


def test_greedy_partial_batch():
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [0, 0, 0]])
    logits = one_hot_logits([[1, 2, 5, 4], [1, 0, 3, 4], [0, 0, 0, 1]])
    out, n = accept_greedy(drafts, logits)
    assert n.tolist() == [2, 1, 3]
    assert out.tolist() == [[1, 2, 5, -1], [1, 0, -1, -1], [0, 0, 0, 1]]


def test_greedy_later_match_after_mismatch_is_not_accepted():
    out, n = accept_greedy(torch.tensor([[1, 9 % 6, 3]]), one_hot_logits([[2, 3, 3, 0]]))
    assert n.tolist() == [0] and out.tolist() == [[2, -1, -1, -1]]


def test_zero_draft_tokens_is_plain_decoding():
    out, n = accept_greedy(torch.zeros(2, 0, dtype=torch.long), one_hot_logits([[4], [1]]))
    assert n.tolist() == [0, 0] and out.tolist() == [[4], [1]]


# ---- rejection: exact stub cases -------------------------------------------------------------------------------------

def dist(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_rejection_always_accepts_when_target_covers_draft():
    # target puts at least as much mass on each draft token as the draft did: min(1, p/q) = 1
    draft_probs = dist([0, 1, 0, 0], [0, 0, 1, 0])[None]  # [1, 2, 4]
    target_probs = dist([0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1])[None]  # [1, 3, 4]
    out, n = accept_rejection(torch.tensor([[1, 2]]), draft_probs, target_probs,
                              generator=torch.Generator().manual_seed(0))
    assert n.tolist() == [2] and out.tolist() == [[1, 2, 3]]  # bonus from the last target row


def test_rejection_never_accepts_token_target_rules_out():
    draft_probs = dist([0, 1, 0, 0], [0, 0, 1, 0])[None]
    target_probs = dist([0, 0, 0, 1], [1, 0, 0, 0], [1, 0, 0, 0])[None]
    out, n = accept_rejection(torch.tensor([[1, 2]]), draft_probs, target_probs,
                              generator=torch.Generator().manual_seed(0))
    # recovered token from normalize(max(0, p - q)) = token 3 with certainty
    assert n.tolist() == [0] and out.tolist() == [[3, -1, -1]]


def test_rejection_partial_acceptance_exact():
    draft_probs = dist([1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0])[None]
    target_probs = dist([1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0])[None]
    out, n = accept_rejection(torch.tensor([[0, 1, 2]]), draft_probs, target_probs,
                              generator=torch.Generator().manual_seed(3))
    assert n.tolist() == [2] and out.tolist() == [[0, 1, 3, -1]]


def test_zero_draft_probability_counts_as_rejection():
    # the draft "proposed" a token it gave probability 0: it must be rejected even though target likes it
    draft_probs = dist([1, 0, 0, 0])[None]
    target_probs = dist([0, 1, 0, 0], [0, 0, 1, 0])[None]
    out, n = accept_rejection(torch.tensor([[1]]), draft_probs, target_probs,
                              generator=torch.Generator().manual_seed(0))
    assert n.tolist() == [0] and out.tolist() == [[1, -1]]  # recovered from residual max(0, p - q) = token 1


def test_draft_equal_to_target_accepts_all():
    # target/draft == 1 exactly: kept whatever the uniform (u < 1), with no 0/0 on the way
    probs = torch.softmax(torch.randn(4, 3, 7, generator=torch.Generator().manual_seed(1)), -1)
    drafts = torch.multinomial(probs.reshape(-1, 7), 1, generator=torch.Generator().manual_seed(2)).reshape(4, 3)
    bonus_rows = dist(*[[0.0] * i + [1.0] + [0.0] * (6 - i) for i in (5, 0, 6, 2)])  # [4, 7] one-hot
    target = torch.cat([probs, bonus_rows[:, None]], dim=1)  # [4, 4, 7]
    out, n = accept_rejection(drafts, probs, target, generator=torch.Generator().manual_seed(0))
    assert n.tolist() == [3, 3, 3, 3]
    assert out[:, :3].tolist() == drafts.tolist()  # every draft token kept, in order
    assert out[:, 3].tolist() == [5, 0, 6, 2]  # the bonus comes from the target's last row


def test_residual_all_zero_falls_back_to_target():
    # rejected token had q = 0 and p == q elsewhere: residual is 0 everywhere; must not produce NaN
    q = dist([0.5, 0.5, 0.0])[None]
    p = dist([0.5, 0.5, 0.0], [0, 0, 1])[None]
    out, n = accept_rejection(torch.tensor([[2]]), q, p, generator=torch.Generator().manual_seed(0))
    assert n.tolist() == [0] and out[0, 0].item() in (0, 1)


def test_output_shapes_and_padding():
    gen = torch.Generator().manual_seed(0)
    b, k, v = 16, 5, 11
    q = torch.softmax(torch.randn(b, k, v, generator=gen), -1)
    p = torch.softmax(torch.randn(b, k + 1, v, generator=gen), -1)
    drafts = torch.multinomial(q.reshape(-1, v), 1, generator=gen).reshape(b, k)
    out, n = accept_rejection(drafts, q, p, generator=gen)
    assert out.shape == (b, k + 1) and n.shape == (b,)
    for row, accepted in zip(out.tolist(), n.tolist()):
        assert all(t >= 0 for t in row[:accepted + 1]) and all(t == -1 for t in row[accepted + 1:])
    # accepted prefix equals the draft tokens
    for i in range(b):
        m = n[i].item()
        assert out[i, :m].tolist() == drafts[i, :m].tolist()


# ---- rejection: statistics -----------------------------------------------------------------------------------------

def _tv(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).float()
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


def _run_stub(n_samples: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = dist([0.5, 0.2, 0.1, 0.1, 0.1], [0.1, 0.1, 0.6, 0.1, 0.1])  # draft per position [2, 5]
    p = dist([0.1, 0.3, 0.3, 0.2, 0.1], [0.25, 0.25, 0.1, 0.2, 0.2], [0.0, 0.1, 0.2, 0.3, 0.4])  # target [3, 5]
    drafts = torch.stack([torch.multinomial(q[i], n_samples, replacement=True, generator=gen) for i in range(2)], 1)
    out, n = accept_rejection(drafts, q.expand(n_samples, 2, 5), p.expand(n_samples, 3, 5), generator=gen)
    return out, n, p


def test_rejection_output_follows_target_distribution():
    out, n, p = _run_stub(200_000, seed=0)
    # position 0 is always emitted; it must follow target row 0 exactly, not the draft
    assert _tv(out[:, 0], p[0]) < 0.005
    # position 1 is emitted when the first draft token was accepted; the target rows do not depend on the
    # prefix here, so its marginal must be target row 1
    assert _tv(out[n >= 1, 1], p[1]) < 0.01
    assert _tv(out[n == 2, 2], p[2]) < 0.02  # bonus token


def test_rejection_distribution_converges_as_samples_grow():
    errors = [_tv(_run_stub(size, seed=1)[0][:, 0], _run_stub(size, seed=1)[2][0]) for size in (500, 5_000, 100_000)]
    assert errors[2] < errors[0]
    assert errors[2] < 0.01


def test_acceptance_rate_matches_theory():
    # expected acceptance at position 0 is sum_x min(p(x), q(x))
    out, n, p = _run_stub(200_000, seed=2)
    q0 = dist([0.5, 0.2, 0.1, 0.1, 0.1])
    expected = torch.minimum(p[0], q0).sum().item()
    assert abs((n >= 1).float().mean().item() - expected) < 0.005


def test_rejection_is_deterministic_with_seed():
    a = _run_stub(1000, seed=7)
    b = _run_stub(1000, seed=7)
    c = _run_stub(1000, seed=8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_matching_rule_with_sampled_target_tokens():
    out, n = accept_matching(torch.tensor([[3, 1]]), torch.tensor([[3, 2, 0]]))
    assert n.tolist() == [1] and out.tolist() == [[3, 2, -1]]


# ---- batched rows with their own draft counts and draws -------------------------------------------------------------

def test_batched_rows_equal_each_row_alone_whatever_the_padding_holds():
    """The engine accepts all sampled rows in one call, each with its own K and its own uniforms: a row's outcome must
    be what it gets alone, whatever its padding holds (draft probabilities past num_draft are not read)."""
    gen = torch.Generator().manual_seed(3)
    vocab, k = 7, 4
    counts = [4, 2, 0, 3, 1]
    rows = len(counts)
    draft_probs = torch.rand(rows, k, vocab, generator=gen).softmax(-1)  # padding too: garbage that sums to 1
    target_probs = torch.rand(rows, k + 1, vocab, generator=gen).softmax(-1)
    draft_tokens = torch.multinomial(draft_probs.flatten(0, 1), 1, generator=gen).view(rows, k)
    for row, n in enumerate(counts):
        draft_tokens[row, n:] = -1
    for _ in range(50):  # fresh uniforms: every path (accept all, reject at each position) gets exercised
        uniforms = torch.rand(rows, k + 1, generator=gen)
        batched, accepted = accept_rejection(draft_tokens, draft_probs, target_probs, num_draft=torch.tensor(counts),
                                             uniforms=uniforms)
        for row, n in enumerate(counts):
            own = torch.cat([uniforms[row, :n], uniforms[row, n:n + 1]])[None]  # its n judging draws, then its extra
            alone, alone_accepted = accept_rejection(draft_tokens[row:row + 1, :n], draft_probs[row:row + 1, :n],
                                                     target_probs[row:row + 1, :n + 1], uniforms=own)
            assert accepted[row] == alone_accepted[0]
            assert batched[row, :n + 1].tolist() == alone[0].tolist()
            assert (batched[row, n + 1:] == -1).all()


# ---- the draft-token contract: ids in [0, V), PAD only after a row's real drafts ------------------------------------


def _uniform(batch, positions, vocab=4):
    return torch.full((batch, positions, vocab), 1.0 / vocab)


@pytest.mark.parametrize("drafts, num_draft, where", [
    ([[1, -5]], None, "draft_tokens\\[0, 1\\]: -5"),  # a negative id was emitted as is
    ([[1, 2], [2, -1]], torch.tensor([2, 2]), "draft_tokens\\[1, 1\\]: -1"),  # PAD inside the row's num_draft
    ([[-1, 2]], None, "draft_tokens\\[0, 0\\]: -1"),  # PAD before a real token breaks the left-aligned output
    ([[1, 4]], None, "draft_tokens\\[0, 1\\]: 4"),  # V = 4
])
def test_rejection_refuses_draft_ids_outside_the_vocabulary(drafts, num_draft, where):
    drafts = torch.tensor(drafts)
    batch, k = drafts.shape
    with pytest.raises(ValueError, match=where + " is not a token id in \\[0, 4\\)"):
        accept_rejection(drafts, _uniform(batch, k), _uniform(batch, k + 1), num_draft=num_draft,
                         uniforms=torch.zeros(batch, k + 1))


@pytest.mark.parametrize("drafts, where", [
    ([[3, -5, 1]], "draft_tokens\\[0, 1\\]: -5"),
    ([[3, -1, 1]], "draft_tokens\\[0, 1\\]: -1"),
    ([[0, 1, 2], [6, 1, 2]], "draft_tokens\\[1, 0\\]: 6"),
])
def test_greedy_refuses_draft_ids_outside_the_vocabulary(drafts, where):
    drafts = torch.tensor(drafts)
    targets = one_hot_logits([[3, 1, 1, 0]] * drafts.shape[0])
    with pytest.raises(ValueError, match=where + " is not a token id in \\[0, 6\\)"):
        accept_greedy(drafts, targets)
    if "6" not in where:  # accept_matching has no vocabulary: only negatives and PAD before a real token
        with pytest.raises(ValueError, match=where + " is not a token id >= 0"):
            accept_matching(drafts, targets.argmax(-1))


def test_trailing_pad_and_padding_past_num_draft_are_accepted():
    out, n = accept_greedy(torch.tensor([[3, 1, -1], [3, -1, -1]]), one_hot_logits([[3, 1, 4, 0], [3, 2, 2, 2]]))
    assert out.tolist() == [[3, 1, 4, -1], [3, 2, -1, -1]] and n.tolist() == [2, 1]
    # Past num_draft anything is padding: never read, never emitted.
    out, n = accept_rejection(torch.tensor([[1, 99, -7]]), dist([0, 1, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0])[None],
                              dist([0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1], [1, 0, 0, 0])[None],
                              num_draft=torch.tensor([1]), uniforms=torch.zeros(1, 4))
    assert out.tolist() == [[1, 2, -1, -1]] and n.tolist() == [1]


def test_rejection_without_num_draft_reads_trailing_pad_as_padding():
    """A trailing PAD is not a token: the row has one draft token, so its bonus comes from target row 1 (token 0).
    Read as token 0, which both distributions favour at position 1, the PAD would be kept and emitted."""
    draft_probs = dist([0, 1, 0, 0], [1, 0, 0, 0])[None]
    target_probs = dist([0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1])[None]
    out, n = accept_rejection(torch.tensor([[1, -1]]), draft_probs, target_probs,
                              generator=torch.Generator().manual_seed(0))
    assert n.tolist() == [1] and out.tolist() == [[1, 0, -1]]
