"""pipeline/executor/proposers/eagle3.py with pipeline/eagle3_heads.py: the proposer drafts the chain training taught,
greedy output is the target's, sampled output follows the target's distribution, the heads' KV of a reused prompt
prefix is taken back, and the heads survive their files."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.distill.train_eagle3 import target_states, ttt_steps
from pipeline.eagle3_heads import Eagle3Heads, default_layers
from pipeline.executor import SpeculativeExecutor
from pipeline.executor.proposers.eagle3 import Eagle3Proposer, _Row
from pipeline.executor.step_batch import StepBatch
from tests.conftest import load_tiny_models


def small_llama(vocab: int = 50, layers: int = 6, seed: int = 0, scale: float = 1.0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      eos_token_id=None, bos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def shaken_heads(target, vocab_ids=None, seed: int = 1, noise: float = 0.1) -> Eagle3Heads:
    """Heads for ``target`` with every weight moved off its start (nothing left zero or the identity)."""
    heads = Eagle3Heads.for_target(target, default_layers(target.config.num_hidden_layers), vocab_ids)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * noise)
    return heads.eval()


class _Request:
    def __init__(self, sequence):
        self.sequence, self.cache_salt = sequence, None


@torch.no_grad()
def test_training_steps_are_the_chain_the_proposer_drafts():
    """Training-time test's step j at position i must compute what the proposer computes drafting j tokens past
    position i (same tokens fed): a shifted token, position or key set on either side breaks this."""
    target = small_llama()
    heads = shaken_heads(target, list(range(0, 50, 2)))
    seq = torch.randint(0, 50, (1, 20), generator=torch.Generator().manual_seed(3))
    states = target_states(target, heads.config.target_layers, seq, torch.ones_like(seq))
    steps = 4
    trained = [heads.logits(normed)[0] for normed in ttt_steps(heads, seq, states, steps)]
    proposer = Eagle3Proposer.__new__(Eagle3Proposer)
    proposer.heads = heads
    proposer._ids = heads.target_ids(torch.arange(heads.config.draft_vocab_size))
    for i in (3, 10):
        row = _Row(heads, _Request(seq[0, :i + 2].tolist()), 0)
        row.pending.append(heads.fuse(states[0, :i + 1]))
        prenorm, logits = proposer._catch_up(row)
        torch.testing.assert_close(logits, trained[0][i])
        for j in range(1, steps):
            prenorm, logits = proposer._chain_step(row, j, int(seq[0, i + 1 + j]), prenorm)
            torch.testing.assert_close(logits, trained[j][i])


# Longer than a KV block, so a second run finds their prefixes in the target's cache.
PROMPTS = [text * 4 for text in ("def add(a, b):\n    return a + b\n\n", "import os\nimport sys\n",
                                 "class Point:\n    def __init__(self, x, y):\n")]


def test_tree_drafts_keep_greedy_output_and_hold_the_likeliest_candidates(deep_pair):
    """Tree mode: greedy output unchanged; each step's tree holds K candidates, and a chain of K would keep no more
    tokens per step than the tree at the same K on the same prompts (the tree's first path is the greedy chain's
    best guess at every depth it reaches)."""
    target, _, tok = load_tiny_models(deep_pair)
    heads = shaken_heads(target, noise=0.3)
    plain = SpeculativeExecutor(target, None, tok, max_draft_len=0, method="ngram").generate(PROMPTS, 24)
    chain = SpeculativeExecutor(target, None, tok, max_draft_len=3, method="eagle3", eagle3=heads).generate(PROMPTS, 24)
    tree = SpeculativeExecutor(target, None, tok, max_draft_len=3, method="eagle3", eagle3=heads,
                               eagle3_tree=True).generate(PROMPTS, 24)
    for expected, a, b in zip(plain, chain, tree):
        assert a.token_ids == b.token_ids == expected.token_ids
    accepted = [sum(r.stats.by_proposer["eagle3"][1] for r in results) for results in (chain, tree)]
    assert accepted[1] >= accepted[0]


def test_greedy_output_is_the_target_greedy_output_and_a_reused_prefix_drafts_alike(deep_pair, monkeypatch):
    target, _, tok = load_tiny_models(deep_pair)
    heads = shaken_heads(target, noise=0.5)  # drafts that vary with the context
    drafts = []  # (the row's sequence, its draft) of every eagle3 proposal
    put = StepBatch.put
    monkeypatch.setattr(StepBatch, "put", lambda self, row, tokens, *args, **kwargs: (
        drafts.append((tuple(self.requests[row].sequence), tuple(tokens))), put(self, row, tokens, *args, **kwargs)))
    plain = SpeculativeExecutor(target, None, tok, max_draft_len=0, method="ngram").generate(PROMPTS, 24)
    ex = SpeculativeExecutor(target, None, tok, max_draft_len=3, method="eagle3", eagle3=heads)
    first = ex.generate(PROMPTS, 24)
    drafted_first, drafts[:] = sorted(drafts), []
    again = ex.generate(PROMPTS, 24)  # every prompt's prefix now comes from the target's cache
    assert ex.engine.prefix_stats.hit_tokens > 0
    for expected, one, two in zip(plain, first, again):
        assert one.token_ids == expected.token_ids == two.token_ids
        assert one.stats.by_proposer["eagle3"][0] > 0
    # The heads' KV of the reused prefix was taken back: the same drafts at every step.
    assert sorted(drafts) == drafted_first


@pytest.mark.parametrize("vocab_ids, tree", [(None, False), ([0, 2, 3, 5], False), (None, True)],
                         ids=["whole-vocabulary", "draft-vocabulary", "tree"])
def test_sampled_output_follows_the_target_distribution(vocab_ids, tree, monkeypatch):
    """The heads' drafts are sampled from their own distribution (zero outside the draft vocabulary); the first two
    sampled tokens must follow the target's exact joint (TV < 0.07 at 3000 samples), with drafts both accepted
    and rejected."""
    target = small_llama(vocab=6, layers=4, seed=5, scale=6.0)
    heads = shaken_heads(target, vocab_ids, noise=0.5)
    if tree:  # flatter heads, so that siblings compete with children
        with torch.no_grad():
            heads.lm_head.weight.mul_(0.05)
    prompt, temperature = [1, 2, 3, 1, 2], 0.9

    def probs(ids):
        return torch.softmax(target(torch.tensor([ids])).logits[0, -1].float() / temperature, -1)

    with torch.no_grad():
        first = probs(prompt)
        exact = torch.stack([first[a] * probs(prompt + [a]) for a in range(6)]).flatten()
    trees = []
    put = StepBatch.put
    monkeypatch.setattr(StepBatch, "put", lambda self, row, tokens, probs, method, tree=None: (
        trees.append(tree is not None and tree.size - 1 > tree.max_depth), put(self, row, tokens, probs, method, tree)))
    ex = SpeculativeExecutor(target, None, None, max_draft_len=3, method="eagle3", eagle3=heads, max_batch_size=32,
                             eagle3_tree=tree)
    n = 3000
    # A step drafts at most one token fewer than are left: a tree needs a third token to have two candidates.
    results = ex.generate([prompt] * n, 3 if tree else 2, temperature=temperature, seed=list(range(n)))
    pairs = torch.tensor([r.token_ids[0] * 6 + r.token_ids[1] for r in results])
    tv = 0.5 * (torch.bincount(pairs, minlength=36).float() / n - exact).abs().sum().item()
    assert tv < 0.07, tv
    drafted = sum(r.stats.by_proposer.get("eagle3", [0, 0, 0])[0] for r in results)
    kept = sum(r.stats.by_proposer.get("eagle3", [0, 0, 0])[1] for r in results)
    assert 0 < kept < drafted
    assert any(trees) == tree  # tree mode really branched


def test_heads_survive_their_files_in_vllm_indexing(tmp_path):
    target = small_llama()
    heads = shaken_heads(target, list(range(10, 40)))
    heads.save(tmp_path / "heads")
    loaded = Eagle3Heads.load(tmp_path / "heads").attach(target).eval()
    assert loaded.config == heads.config
    written = loaded.config.to_json()
    assert written["eagle_aux_hidden_state_layer_ids"] == [layer + 1 for layer in heads.config.target_layers]
    assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(heads.config.target_layers)
    assert loaded.target_ids(torch.arange(30)).tolist() == list(range(10, 40))
    assert loaded.t2d.nonzero().flatten().tolist() == list(range(10, 40))
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        for a, b in ((heads, loaded),):
            pa = a.project(torch.tensor([[1, 2, 3, 4, 5]] * 2), x, torch.arange(5))
            pb = b.project(torch.tensor([[1, 2, 3, 4, 5]] * 2), x, torch.arange(5))
            torch.testing.assert_close(pa.q, pb.q)
            torch.testing.assert_close(a.logits(a.norm(x)), b.logits(b.norm(x)))


def test_a_target_too_shallow_for_three_fused_layers_is_refused(tiny_pair, tmp_path):
    from tests.conftest import run_cli, tiny_config_dict, write_config

    config = write_config(tmp_path, tiny_config_dict(tiny_pair, name="shallow"))
    result = run_cli("train-draft", str(config), "--engines-dir", str(tmp_path / "e"), "--kind", "eagle3")
    assert result.returncode != 0
    assert "EAGLE-3 heads fuse 3 target layers below the last, and the target has 3 layers" in result.stderr


def test_heads_for_another_target_are_refused(deep_pair):
    target, _, tok = load_tiny_models(deep_pair)
    other = small_llama()
    heads = Eagle3Heads.for_target(other, default_layers(6), None)
    with pytest.raises(Exception, match="eagle3: heads for hidden size 32"):
        SpeculativeExecutor(target, None, tok, method="eagle3", eagle3=heads)
    with pytest.raises(Exception, match="needs EAGLE-3 heads"):
        SpeculativeExecutor(target, None, tok, method="eagle3")


def other_architecture(arch: str):
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if arch == "qwen2":  # QKV bias, on the lean decoder
        return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=128)).eval()
    # GPT-2: learned positions, no RMSNorm, on the Hugging Face modules (its aux states from output_hidden_states)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=5, n_head=4, n_positions=128)).eval()


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_heads_train_and_draft_for_other_architectures(arch):
    """Heads for a Qwen2 or a GPT-2 target: they train (training-time test reads the target's hidden states through
    Hugging Face's output_hidden_states), they draft, and greedy output stays the target's."""
    from pipeline.distill.dataset import DistillSet
    from pipeline.distill.train_eagle3 import Eagle3Options, train_eagle3

    target = other_architecture(arch)
    layers = default_layers(target.config.num_hidden_layers)
    heads = Eagle3Heads.for_target(target, layers, None)
    rows = torch.Generator().manual_seed(4)
    sequences = [torch.randint(0, 64, (24,), generator=rows) for _ in range(6)]
    with torch.no_grad():
        topk = [torch.log_softmax(target(s[None]).logits[0, 11:23].float(), -1).topk(8) for s in sequences]
    data = DistillSet(torch.cat(sequences), torch.arange(0, 24 * 7, 24), torch.full((6,), 12),
                      torch.cat([t.indices for t in topk]), torch.cat([t.values for t in topk]),
                      torch.arange(0, 12 * 7, 12))
    history = train_eagle3(heads, target, data, Eagle3Options(tokens=200, ttt_steps=2, batch_size=2, evals=1))
    # (Learning is the Llama tests' subject: a random target teaches little in a few steps.)
    assert history["finished"] and all(math.isfinite(e["loss"]) for e in history["evals"])
    prompts = [s[:12].tolist() for s in sequences[:3]]
    plain = SpeculativeExecutor(target, None, None, max_draft_len=0, method="ngram").generate(prompts, 16)
    ex = SpeculativeExecutor(target, None, None, max_draft_len=3, method="eagle3", eagle3=heads.eval())
    results = ex.generate(prompts, 16)
    assert ex.target.runner == ("lean" if arch == "qwen2" else "hf-modules")
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    assert all(r.stats.by_proposer["eagle3"][0] > 0 for r in results)


def test_the_adaptive_k_policy_prices_the_heads_before_they_draft(deep_pair):
    """Serving's K policy times a bare heads step when the engine starts: unpriced, drafting would look dearer than
    any gain and the heads would never draft (nor ever be measured)."""
    target, _, tok = load_tiny_models(deep_pair)
    heads = shaken_heads(target, noise=0.05)
    ex = SpeculativeExecutor(target, None, tok, max_draft_len=3, method="eagle3", eagle3=heads,
                             adaptive_draft_len=True)
    priced = ex.engine.policy.draft.calibrated  # seconds per row, from the heads' own step
    # Unpriced, one draft position would cost a second. Whether drafting then pays is the policy's comparison with
    # the target's step: on this 5-layer toy, whose layers run in one C++ call each, the heads' Python step can cost
    # more than the target's, so the choice itself is not asserted here.
    assert 0 < priced[1] < 0.5 and priced[8] == pytest.approx(8 * priced[1])  # rows draft one after another


def test_a_request_that_never_drafts_gives_the_heads_nothing_to_fuse(deep_pair):
    """Speculation off for one request (K = 0) on an EAGLE-3 engine: its tokens are the target's, and the heads fuse
    no states for it (work for a row that will never draft); the request beside it still drafts."""
    target, _, tok = load_tiny_models(deep_pair)
    heads = shaken_heads(target, noise=0.05)
    ex = SpeculativeExecutor(target, None, tok, max_draft_len=3, method="eagle3", eagle3=heads)
    proposer = ex.engine.proposers["eagle3"]
    fused = []
    original = proposer.target_states
    proposer.target_states = lambda request, states: (fused.append(request.id), original(request, states))
    plain, drafting = ex.new_request("def f(x):", 12, max_draft_len=0), ex.new_request("def g(y):", 12)
    ex.engine.add(plain)
    ex.engine.add(drafting)
    while not (plain.finished and drafting.finished):
        ex.engine.step()
    assert plain.id not in fused and drafting.id in fused
    assert plain.generated == ex.generate(["def f(x):"], 12, max_draft_len=0)[0].token_ids
    assert drafting.stats.draft_tokens > 0


def test_penalties_and_a_grammar_hold_with_eagle3_drafts(deep_pair):
    """Greedy EAGLE-3 drafting under penalties, bias and a regex format (whose forced tokens interleave with the
    heads' drafts, which then catch up on tokens they did not draft) equals target-only decoding with them."""
    target, _, tok = load_tiny_models(deep_pair)
    heads = shaken_heads(target, noise=0.5)
    controls = dict(frequency_penalty=0.8, presence_penalty=0.4, logit_bias={"7": 2.0},
                    response_format={"type": "regex", "regex": "[a-z ]{4,30}"})
    plain = SpeculativeExecutor(target, None, tok, max_draft_len=0, method="ngram").generate(PROMPTS, 24, **controls)
    spec = SpeculativeExecutor(target, None, tok, max_draft_len=3, method="eagle3", eagle3=heads).generate(
        PROMPTS, 24, **controls)
    for expected, result in zip(plain, spec):
        assert result.token_ids == expected.token_ids and result.stats.by_proposer["eagle3"][0] > 0


def test_the_heads_multiply_with_the_products_measured_on_the_machine(deep_pair):
    """On a CPU the proposer gives the heads the product measured fastest per width over their matrices (as the lean
    decoder's): the same numbers as each layer's own forward within float32 rounding, used at every draft step."""
    target, _, tok = load_tiny_models(deep_pair)
    heads = shaken_heads(target, noise=0.05)
    ex = SpeculativeExecutor(target, None, tok, max_draft_len=3, method="eagle3", eagle3=heads)
    measured = ex.engine.proposers["eagle3"].heads.product
    assert measured is not None and ex.engine.proposers["eagle3"].heads is heads
    c = heads.config
    gen = torch.Generator().manual_seed(5)
    states = torch.randn(3, len(c.target_layers), c.target_hidden_size, generator=gen)
    attended = torch.randn(3, c.num_attention_heads, c.head_dim, generator=gen)
    with torch.inference_mode():
        results = []
        for product in (None, measured):
            heads.product = product
            hidden = heads.fuse(states)
            projected = heads.project(torch.tensor([3, 1, 4]), hidden, torch.tensor([7, 8, 9]))
            normed, prenorm = heads.finish(attended, projected.residual)
            results.append([hidden, projected.q, projected.k, projected.v, prenorm, heads.logits(normed)])
    for own, fast in zip(*results):
        assert torch.allclose(own, fast, atol=1e-4, rtol=1e-4)
    calls = []
    heads.product = lambda x, layer: calls.append(layer) or measured(x, layer)
    ex.generate(["def f(x):"], max_new_tokens=8)
    assert heads.lm_head in calls and heads.midlayer.mlp.down_proj in calls
