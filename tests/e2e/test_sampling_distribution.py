"""End to end: speculatively sampled tokens follow the target's exact sampling distribution.

A tiny model pair over an 8-token vocabulary makes the target's joint distribution of the first three generated
tokens cheap to compute exactly: one plain Hugging Face forward over all 8 * 8 continuations of the prompt, through
Hugging Face's own temperature / top-k / top-p warpers (the oracle never goes through the executor or
``pipeline.speculative``). The executor's empirical joint, sampled through the public ``generate()`` API with one
seed per request (independent samples), must lie within a total-variation bound of it, at the first token, the
first two and all three. How often the first step keeps all K draft tokens is likewise fixed by the two models and
checked.

Bounds: for M samples, mean + 4.5 standard deviations of the null distribution (the total variation between M
exact draws and the exact joint, simulated with a fixed seed; the binomial standard deviation for the acceptance
frequency). Seeds are fixed, so the outcome is deterministic; scripts/mutants.py plants each known sampling bug
and shows these tests fail on it.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper)

from pipeline.executor import SpeculativeExecutor

VOCAB = 8
PROMPTS = [[1, 4, 2], [5, 0], [3, 3, 7, 1], [6]]  # token ids; each is checked on its own samples
SAMPLES = 1000  # per prompt, each with its own seed
SIGMAS = 4.5


def tiny_lm(seed: int, logit_scale: float) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)  # peaked distributions: fewer likely outcomes, tighter bounds
    return model


def perturbed(model: LlamaForCausalLM, seed: int, noise: float, sharpen: float) -> LlamaForCausalLM:
    """A draft that agrees with the target often but not always, and is over-confident (``sharpen`` > 1): its
    favourite tokens then get draft/target ratios below 1, so rejections at several positions of one step are
    common and bugs in how positions are judged together show."""
    draft = LlamaForCausalLM(copy.deepcopy(model.config)).eval()  # its own config: a test may mark the draft's
    draft.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in draft.parameters():
            weight.add_(noise * weight.std() * torch.randn(weight.shape, generator=generator))
        draft.lm_head.weight.mul_(sharpen)
    return draft


@pytest.fixture(scope="module")
def target():
    return tiny_lm(1, logit_scale=8.0)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed(target, seed=2, noise=0.2, sharpen=2.5)


def executor_for(target, draft, k: int, acceptance: str = "rejection") -> SpeculativeExecutor:
    return SpeculativeExecutor(target, draft, tokenizer=None, max_draft_len=k, acceptance=acceptance,
                               max_batch_size=64)


# ---- the oracle: plain Hugging Face forwards ------------------------------------------------------------------------

def warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] through Hugging Face's warpers, in generate()'s order."""
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return torch.softmax(LogitsProcessorList(warpers)(None, logits), dim=-1)


@torch.no_grad()
def exact_conditionals(model, prompt: list[int], temperature: float, top_k: int, top_p: float):
    """The first three next-token distributions after ``prompt``: P(x1) [V], P(x2 | x1) [V, V] and
    P(x3 | x1, x2) [V, V, V], from one forward over every two-token continuation."""
    n = len(prompt)
    first, second = torch.meshgrid(torch.arange(VOCAB), torch.arange(VOCAB), indexing="ij")
    seqs = torch.cat([torch.tensor(prompt).expand(VOCAB * VOCAB, n), first.reshape(-1, 1),
                      second.reshape(-1, 1)], dim=1)  # [V*V, n+2]
    logits = model(seqs).logits[:, n - 1:].float()  # [V*V, 3, V]: next-token logits after prompt, +x1, +x2
    probs = warp(logits.reshape(-1, VOCAB), temperature, top_k, top_p).view(VOCAB, VOCAB, 3, VOCAB)
    return probs[0, 0, 0], probs[:, 0, 1], probs[:, :, 2]


def joint_of(conditionals) -> torch.Tensor:
    """P(x1, x2, x3) [V, V, V] from the three conditionals."""
    p1, p2, p3 = conditionals
    return p1[:, None, None] * p2[:, :, None] * p3


def all_kept_probability(target_conds, draft_conds, k: int, acceptance: str) -> float:
    """P(the first step keeps all k <= 3 draft tokens), summed over every draft path.

    Rejection sampling keeps draft token x with probability min(1, p(x)/q(x)), so a path contributes
    prod_i min(p_i, q_i); 'greedy' acceptance keeps it when the target's own sample equals it: prod_i p_i q_i.
    """
    keep = torch.minimum if acceptance == "rejection" else torch.mul
    levels = [keep(p, q) for p, q in zip(target_conds, draft_conds)]  # [V], [V, V], [V, V, V]
    paths = levels[0]
    for level in levels[1:k]:
        paths = paths[..., None] * level  # [V] -> [V, V] -> [V, V, V]
    return paths.sum().item()


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def tv_bound(probs: torch.Tensor, samples: int) -> float:
    """mean + SIGMAS sd of the total variation between ``samples`` exact draws from ``probs`` and ``probs``."""
    exact = probs.flatten().double().numpy()
    exact = exact / exact.sum()
    draws = np.random.default_rng(0).multinomial(samples, exact, size=400) / samples  # [400, outcomes]
    tvs = 0.5 * np.abs(draws - exact).sum(axis=1)
    return float(tvs.mean() + SIGMAS * tvs.std())


# ---- sampling through the public API ---------------------------------------------------------------------------------

def sample(executor, k: int, **sampling):  # sampling: generate()'s keywords (output controls included)
    """Per prompt: the empirical joint of the first three tokens [len(PROMPTS), V, V, V] and the share of requests
    whose first step kept all K draft tokens [len(PROMPTS)]; plus every result's stats.

    max_new_tokens = K + 1, so only the first step drafts K tokens: draft position K-1 is that step's alone.
    """
    joints = torch.zeros(len(PROMPTS), VOCAB, VOCAB, VOCAB)
    all_kept = torch.zeros(len(PROMPTS))
    stats = []
    for row, prompt in enumerate(PROMPTS):
        seeds = [row * SAMPLES + i for i in range(SAMPLES)]  # one random stream per request
        for result in executor.generate([prompt] * SAMPLES, max_new_tokens=k + 1, seed=seeds, max_draft_len=k,
                                        **sampling):
            x1, x2, x3 = result.token_ids[:3]
            joints[row, x1, x2, x3] += 1
            all_kept[row] += result.stats.accepted_at[k - 1]
            stats.append(result.stats)
    return joints / SAMPLES, all_kept / SAMPLES, stats


CASES = {
    # name: (acceptance, K, sampling). With K = 2 the bonus token (all K accepted) is the third, checked token;
    # with K = 3 all three checked tokens are drafted in one step.
    "cold": ("rejection", 2, dict(temperature=0.6)),
    "hot_top_k": ("rejection", 3, dict(temperature=1.5, top_k=4)),
    "top_p": ("rejection", 2, dict(temperature=0.9, top_p=0.8)),
    "greedy_acceptance": ("greedy", 2, dict(temperature=0.8, top_k=6)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_first_tokens_follow_the_targets_joint(target, draft, case):
    acceptance, k, sampling = CASES[case]
    check_first_tokens(target, draft, case, acceptance, k, {"top_k": 0, "top_p": 1.0, **sampling})


def test_a_reduced_vocabulary_draft_keeps_the_targets_joint(target):
    """A train-draft --vocab draft (pipeline/draft_vocab.py) proposes only its own tokens; the target's joint holds
    and how often all K are kept follows the reduced draft's distributions, not the full head's."""
    from pipeline.draft_vocab import CONFIG_KEY, reduce_head

    draft = perturbed(target, seed=2, noise=0.2, sharpen=2.5)
    setattr(draft.config, CONFIG_KEY, [0, 2, 3, 5, 6])
    reduce_head(draft)
    assert torch.isinf(draft(torch.tensor([PROMPTS[0]])).logits[0, -1, [1, 4, 7]]).all()
    check_first_tokens(target, draft, "reduced_vocab", "rejection", 2, dict(temperature=0.9, top_k=0, top_p=1.0))


def check_first_tokens(target, draft, case, acceptance, k, sampling):
    empirical, all_kept, stats = sample(executor_for(target, draft, k, acceptance), k, **sampling)

    # K was really in play: every request drafted K tokens in its first step, and both outcomes occurred.
    assert all(len(s.drafted_at) == k and s.drafted_at[k - 1] == 1 for s in stats)
    assert 0 < all_kept.mean() < 1

    for row, prompt in enumerate(PROMPTS):
        target_conds = exact_conditionals(target, prompt, **sampling)
        draft_conds = exact_conditionals(draft, prompt, **sampling)
        exact = joint_of(target_conds)  # [V, V, V]
        # The check can tell the target's joint from the draft's.
        assert total_variation(joint_of(draft_conds), exact) > 2 * tv_bound(exact, SAMPLES)
        # The first token, the first two and all three: a bug at one position shows most clearly at its level.
        got = empirical[row]
        for level, (got_level, exact_level) in enumerate([(got.sum((1, 2)), exact.sum((1, 2))),
                                                         (got.sum(2), exact.sum(2)), (got, exact)], 1):
            tv, bound = total_variation(got_level, exact_level), tv_bound(exact_level, SAMPLES)
            assert tv < bound, (f"{case}, prompt {prompt}: tokens 1..{level} are {tv:.3f} from the target's "
                                f"joint in total variation (bound {bound:.3f} at {SAMPLES} samples)")
        # How often the first step keeps all K draft tokens is fixed by the two models.
        want = all_kept_probability(target_conds, draft_conds, k, acceptance)
        bound = SIGMAS * (want * (1 - want) / SAMPLES) ** 0.5
        assert abs(all_kept[row].item() - want) < bound, \
            (f"{case}, prompt {prompt}: the first step kept all {k} draft tokens in {all_kept[row].item():.3f} of "
             f"requests; the models give {want:.3f} (bound {bound:.3f})")


PENALTIES = dict(presence_penalty=0.6, frequency_penalty=1.2, logit_bias={"3": 1.5})


@torch.no_grad()
def penalized_conditionals(model, prompt: list[int], temperature: float, top_k: int, top_p: float):
    """exact_conditionals with OpenAI's penalties over the generated tokens before each position (none before x1,
    x1 before x2, x1 and x2 before x3) and PENALTIES' bias, then the warpers."""
    n = len(prompt)
    first, second = torch.meshgrid(torch.arange(VOCAB), torch.arange(VOCAB), indexing="ij")
    x1, x2 = first.reshape(-1), second.reshape(-1)
    seqs = torch.cat([torch.tensor(prompt).expand(VOCAB * VOCAB, n), x1[:, None], x2[:, None]], dim=1)
    logits = model(seqs).logits[:, n - 1:].float()  # [V*V, 3, V]
    one_hot = torch.nn.functional.one_hot
    counts = torch.stack([torch.zeros(VOCAB * VOCAB, VOCAB), one_hot(x1, VOCAB).float(),
                          (one_hot(x1, VOCAB) + one_hot(x2, VOCAB)).float()], dim=1)  # [V*V, 3, V]
    logits = logits - PENALTIES["frequency_penalty"] * counts - PENALTIES["presence_penalty"] * (counts > 0).float()
    for token, bias in PENALTIES["logit_bias"].items():
        logits[..., int(token)] += bias
    probs = warp(logits.reshape(-1, VOCAB), temperature, top_k, top_p).view(VOCAB, VOCAB, 3, VOCAB)
    return probs[0, 0, 0], probs[:, 0, 1], probs[:, :, 2]


def test_penalized_tokens_follow_the_penalized_joint(target, draft):
    """With penalties and bias, position j of a step is judged after the draft tokens before it: the joint of the
    first three tokens is plain decoding's under the same settings (the draft's proposals adjusted alike)."""
    sampling = dict(temperature=0.9, top_k=0, top_p=1.0)
    empirical, _, stats = sample(executor_for(target, draft, 2), 2, **sampling, **PENALTIES)
    assert all(len(s.drafted_at) == 2 and s.drafted_at[1] == 1 for s in stats)
    for row, prompt in enumerate(PROMPTS):
        exact = joint_of(penalized_conditionals(target, prompt, **sampling))
        # The check tells the penalized joint from the unpenalized one.
        assert total_variation(joint_of(exact_conditionals(target, prompt, **sampling)), exact) > \
            2 * tv_bound(exact, SAMPLES)
        for level, dims in enumerate([(1, 2), (2,), ()], 1):
            got_level = empirical[row].sum(dims) if dims else empirical[row]
            exact_level = exact.sum(dims) if dims else exact
            tv, bound = total_variation(got_level, exact_level), tv_bound(exact_level, SAMPLES)
            assert tv < bound, f"prompt {prompt}: tokens 1..{level} are {tv:.3f} from the joint (bound {bound:.3f})"


@pytest.mark.parametrize("sampling", [dict(temperature=0.5), dict(temperature=1.7, top_k=5, top_p=0.9)])
def test_self_draft_accepts_every_token(target, sampling):
    """A draft identical to the target is always accepted under rejection sampling, at any temperature, top-k or
    top-p: the sampling transforms must reach the draft's and the target's distributions alike."""
    requests = 100
    results = executor_for(target, target, 3).generate([PROMPTS[0]] * requests, max_new_tokens=8,
                                                       seed=list(range(requests)), **sampling)
    drafted = sum(r.stats.draft_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert drafted >= 3 * requests and all(len(r.stats.drafted_at) == 3 for r in results)
    # Float differences between the draft's one-token and the target's K+1-token forwards may reject a token
    # with probability ~1e-6; the sampling transforms applied to one side only reject most of them.
    assert accepted >= drafted - 1, (accepted, drafted)


# ---- Medusa: candidate trees verified in one pass ------------------------------------------------------------------

MEDUSA_TREE = [[0], [1], [2], [0, 0], [1, 0], [0, 1], [2, 0]]


def medusa_heads():
    from pipeline.medusa_heads import MedusaHeads

    torch.manual_seed(4)
    heads = MedusaHeads(2, 1, 16, VOCAB).eval()
    with torch.no_grad():
        for head in heads:
            head[0].linear.weight.normal_(0, 0.5)
    return heads


@torch.no_grad()
def tree_keep_probabilities(target, heads, prompt, joint) -> tuple[float, float]:
    """P(the tree step keeps a depth-1 node) and P(it keeps a depth-2 node), exactly.

    A Medusa request's first step is plain; its second verifies the tree whose candidates the heads read off the
    hidden state at the prompt's last token, so they are the same whatever x1 is. The walk keeps a child exactly
    when the emitted token equals the child's token (a rejected candidate leaves the residual), so the kept depth
    follows from (x1, x2, x3)."""
    from pipeline.speculative.tree import TokenTree, candidate_tokens

    tree = TokenTree.from_choices(MEDUSA_TREE)
    hidden = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][:, -1]  # [1, d]
    tokens = candidate_tokens(tree, torch.tensor([0]), heads.top_tokens(hidden, tree.top_k()))[0].tolist()
    depth1 = {tokens[n]: n for n in tree.children[0]}
    keep1 = keep2 = 0.0
    for x1, x2, x3 in np.ndindex(VOCAB, VOCAB, VOCAB):
        p = float(joint[x1, x2, x3])
        if x2 in depth1:
            keep1 += p
            keep2 += p * any(tokens[c] == x3 for c in tree.children[depth1[x2]])
    return keep1, keep2


@pytest.mark.parametrize("sampling", [dict(temperature=0.9, top_k=0, top_p=1.0),
                                      dict(temperature=1.4, top_k=5, top_p=0.85)])
def test_medusa_trees_keep_the_targets_joint(target, sampling):
    """Medusa rows sample losslessly over the tree: the first three tokens follow the target's joint (tokens 2 and
    3 come from the tree step), and how often the tree step keeps a node at depth 1 and 2 is what the walk over
    siblings gives."""
    heads = medusa_heads()
    ex = SpeculativeExecutor(target, None, tokenizer=None, method="medusa", medusa=heads,
                             medusa_choices=MEDUSA_TREE, max_batch_size=64)
    for row, prompt in enumerate(PROMPTS):
        counts = torch.zeros(VOCAB, VOCAB, VOCAB)
        kept = np.zeros(2)
        requests = [ex.new_request(prompt, 4, seed=row * SAMPLES + i, **sampling) for i in range(SAMPLES)]
        steps = {}
        for request, event in ex._run(requests):  # each step's event: the tree step's tokens show what it kept
            steps.setdefault(request.id, []).append(len(event.token_ids))
        for request in requests:
            x1, x2, x3 = request.generated[:3]
            counts[x1, x2, x3] += 1
            plain, tree_step = steps[request.id][:2]
            assert plain == 1  # the first step is plain: no hidden state yet
            kept[:tree_step - 1] += 1  # a step that keeps the node at depth d emits d + 1 tokens
        exact = joint_of(exact_conditionals(target, prompt, **sampling))
        for level, (got, want) in enumerate([(counts.sum((1, 2)), exact.sum((1, 2))), (counts.sum(2), exact.sum(2)),
                                            (counts, exact)], 1):
            tv, bound = total_variation(got / SAMPLES, want), tv_bound(want, SAMPLES)
            assert tv < bound, f"medusa, prompt {prompt}: tokens 1..{level} are {tv:.3f} from the target (>{bound:.3f})"
        for depth, want in enumerate(tree_keep_probabilities(target, heads, prompt, exact)):
            got = kept[depth] / SAMPLES
            bound = SIGMAS * (want * (1 - want) / SAMPLES) ** 0.5 + 1e-9
            assert 0 < want < 1 and abs(got - want) < bound, \
                f"medusa, prompt {prompt}: depth {depth + 1} kept in {got:.3f} of requests, the walk gives {want:.3f}"
