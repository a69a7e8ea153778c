"""pipeline/executor/model_runner.py + paged_kv_cache.py + paged_attention.py: packed forwards over paged KV give
Hugging Face's logits, whatever the chunking, the neighbours in the forward and the blocks a prompt reused; a runner
following another (a draft's) keeps its KV in the other's blocks and reuses only what it wrote there."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from pipeline.executor import attention_choice, row_kernels
from pipeline.executor.attention_choice import KERNELS, AttentionPlan
from pipeline.executor.model_runner import SCRATCH_CONTEXT, BatchModelRunner, time_forwards


def _llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=256)).eval()


@torch.no_grad()
def _reference(model, ids):
    return model(torch.tensor([ids])).logits[0]  # [len, V]


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama-gqa", "gpt2"])
def test_chunks_of_any_size_beside_other_rows_match_hf(make, kernel):
    model = make()
    gen = torch.Generator().manual_seed(1)
    long, short, other = (torch.randint(0, 100, (n,), generator=gen).tolist() for n in (45, 9, 30))
    expected = {name: _reference(model, ids) for name, ids in (("long", long), ("short", short), ("other", other))}
    runner = BatchModelRunner(model, "cpu", max_tokens=200, block_size=8, max_blocks=64)
    runner.cache.attention = AttentionPlan({16: kernel})  # the short rows' group; chunks past 16 keep SDPA
    got = {name: [] for name in expected}
    for name, ids in (("long", long), ("short", short), ("other", other)):
        runner.open(name, ids)
    # Per forward: each row's next piece: long chunks (an attention group of their own), short ones grouped and
    # padded, a row with nothing to do; chunk ends fall inside and on block boundaries.
    plan = [{"long": 20, "short": 3, "other": 16}, {"long": 4, "short": 0, "other": 1}, {"long": 21, "short": 6,
                                                                                          "other": 13}]
    done = dict.fromkeys(expected, 0)
    for pieces in plan:
        names = list(pieces)
        rows = [{"long": long, "short": short, "other": other}[n][done[n]:done[n] + pieces[n]] for n in names]
        logits = runner.forward(names, rows)
        for i, name in enumerate(names):
            got[name].append(logits[i, :pieces[name]])
            done[name] += pieces[name]
    for name in expected:
        assert torch.allclose(torch.cat(got[name]), expected[name], atol=1e-4), name
    assert runner.cache.lengths == {"long": 45, "short": 9, "other": 30}


def test_the_runner_measures_the_attention_kernels_for_its_heads():
    runner = BatchModelRunner(_llama(), "cpu", max_tokens=64, block_size=8, max_blocks=16)
    assert set(runner.cache.attention.by_width) == set(attention_choice.WIDTHS)
    runner.open("a", [1, 2, 3])
    _, plan = runner.cache.prepare(["a"], [3], torch.device("cpu"), torch.float32)
    assert plan.groups[0].kernel == runner.cache.attention.kind(3)


def test_a_reused_prefix_gives_the_same_logits_as_computing_it():
    model = _llama()
    system = torch.randint(0, 100, (37,), generator=torch.Generator().manual_seed(2)).tolist()
    first, second = system + [5, 6, 7], system + [9, 9]
    runner = BatchModelRunner(model, "cpu", max_tokens=200, block_size=8, max_blocks=64)
    assert runner.open("first", first) == 0
    runner.forward(["first"], [first[:-1]], logits_for=[0])
    runner.commit("first", first)
    runner.close("first")  # its blocks stay cached
    assert runner.open("second", second) == 32  # four whole blocks of the shared prefix
    logits = runner.forward(["second"], [second[32:]])
    assert torch.allclose(logits[0, :len(second) - 32], _reference(model, second)[32:], atol=1e-4)
    assert runner.cache.pool.stats.hit_tokens == 32


def test_logits_for_returns_only_the_last_tokens_of_each_row():
    model = _llama()
    a, b = list(range(1, 12)), list(range(20, 25))
    runner = BatchModelRunner(model, "cpu", max_tokens=64, block_size=4, max_blocks=16)
    runner.open("a", a)
    runner.open("b", b)
    logits = runner.forward(["a", "b"], [a, b], logits_for=[2, 0])
    assert logits.shape == (2, 2, 100)
    assert torch.allclose(logits[0], _reference(model, a)[-2:], atol=1e-4)
    assert not logits[1].any()  # nothing asked for row b


def test_the_model_still_generates_outside_the_engine():
    """The paged attention implementation is plain SDPA when no engine forward is running."""
    model = _llama()
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    before = model.generate(prompt, max_new_tokens=6, do_sample=False)
    BatchModelRunner(model, "cpu", max_tokens=64, block_size=4, max_blocks=16)
    assert model.config._attn_implementation == "specpipe_paged"
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), before)


def test_only_blocks_whose_kv_is_computed_become_reusable():
    model = _llama()
    ids = list(range(1, 12))
    runner = BatchModelRunner(model, "cpu", max_tokens=64, block_size=4, max_blocks=16)
    runner.open("a", ids)
    runner.forward(["a"], [ids[:9]], logits_for=[0])  # KV for 9 positions: blocks 0-1 full, block 2 partial
    runner.commit("a", ids + [0])  # the caller knows more tokens than the cache holds KV for
    later = ids + [0, 7]
    reused = runner.open("b", later)
    assert reused == 8  # block 2 (positions 8-11) was not final
    logits = runner.forward(["b"], [later[reused:]])
    assert torch.allclose(logits[0, :len(later) - reused], _reference(model, later)[reused:], atol=1e-4)


def test_rows_of_equal_width_take_the_dense_path_and_match_the_gathered_one():
    """Equal-width rows in packed order need no query gather; the result is the same as through the gather."""
    model = _llama()
    a, b = list(range(1, 9)), list(range(30, 38))
    runner = BatchModelRunner(model, "cpu", max_tokens=64, block_size=4, max_blocks=16)
    for name, ids in (("a", a), ("b", b)):
        runner.open(name, ids)
    positions, plan = runner.cache.prepare(["a", "b"], [4, 4], "cpu", torch.float32)
    assert [group.dense for group in plan.groups] == [True]
    _, plan = runner.cache.prepare(["a", "b"], [4, 3], "cpu", torch.float32)
    assert [group.dense for group in plan.groups] == [False]
    runner.cache.write_slots = None
    dense = runner.forward(["a", "b"], [a[:4], b[:4]])
    gathered = runner.forward(["a", "b"], [a[4:], b[4:7]])
    assert torch.allclose(dense[0], _reference(model, a)[:4], atol=1e-4)
    assert torch.allclose(gathered[1, :3], _reference(model, b)[4:7], atol=1e-4)


def _follower_pair(max_blocks: int = 64):
    """A Llama target and a GPT-2 "draft" (other layers, heads and KV shapes) whose KV follows the target's blocks."""
    leader = BatchModelRunner(_llama(), "cpu", max_tokens=200, block_size=8, max_blocks=max_blocks)
    follower = BatchModelRunner(_gpt2(), "cpu", max_tokens=200, block_size=8, max_blocks=max_blocks, follow=leader)
    return leader, follower


def test_a_follower_keeps_its_kv_in_the_leaders_blocks():
    leader, follower = _follower_pair()
    pool = leader.cache.pool
    assert follower.cache.pool is pool
    system = torch.randint(0, 100, (37,), generator=torch.Generator().manual_seed(2)).tolist()
    first = system + [5, 6, 7]
    with pytest.raises(ValueError, match="not open in the cache this one follows"):
        follower.open("first", first)
    assert leader.open("first", first) == 0 and follower.open("first", first) == 0
    leader.forward(["first"], [first[:-1]], logits_for=[0])
    logits = follower.forward(["first"], [first[:-1]])
    assert torch.allclose(logits[0, :len(first) - 1], _reference(follower.model, first[:-1]), atol=1e-4)
    held = pool.held
    # A draft runs ahead of the target (its K tokens), in the same table; rolling back is the target's business.
    follower.forward(["first"], [[first[-1], 1, 2, 3, 4, 5, 6, 7, 8]], logits_for=[0])
    assert pool.held == held + 1 and len(pool.tables["first"]) == held + 1
    follower.truncate("first", len(first))
    assert pool.held == held + 1  # the follower releases nothing
    leader.truncate("first", len(first) - 1)
    assert pool.held == held and follower.length("first") == len(first)  # its extra block went with the target's
    follower.truncate("first", len(first) - 1)
    for runner in (leader, follower):
        runner.commit("first", first)
    follower.close("first")
    leader.close("first")
    assert pool.held == 0 and "first" not in pool.tables
    # The next prompt with the same system prompt: both reuse the blocks both filled; the follower computes the rest.
    second = system + [9, 9]
    assert leader.open("second", second) == 32 and follower.open("second", second) == 32
    logits = follower.forward(["second"], [second[32:]])
    assert torch.allclose(logits[0, :len(second) - 32], _reference(follower.model, second)[32:], atol=1e-4)


def test_a_follower_reuses_only_blocks_it_filled_since_they_were_handed_out():
    """Blocks the target computed alone (no draft ran there), and blocks the follower once filled that were evicted
    and handed to another prompt, are computed again by the follower, not read stale."""
    leader, follower = _follower_pair(max_blocks=4)
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randint(0, 100, (33,), generator=gen).tolist() for _ in range(2))
    # Prompt a on both (its 4 full blocks filled by both), then released (cached).
    for runner in (leader, follower):
        runner.open("a", a)
        runner.forward(["a"], [a[:-1]], logits_for=[0])
        runner.commit("a", a)
    follower.close("a")
    leader.close("a")
    # Prompt b on the target alone: its 4 blocks are a's, evicted from the cache and handed out again.
    leader.open("b", b)
    leader.forward(["b"], [b[:-1]], logits_for=[0])
    leader.commit("b", b)
    leader.close("b")
    for name, prompt in (("b2", b), ("a2", a)):
        reused = leader.open(name, prompt)
        assert follower.open(name, prompt) == 0  # nothing the follower wrote is in these blocks any more
        assert reused == (32 if prompt is b else 0)
        logits = follower.forward([name], [prompt[:-1]])
        assert torch.allclose(logits[0, :len(prompt) - 1], _reference(follower.model, prompt[:-1]), atol=1e-4)
        follower.close(name)
        leader.close(name)


def test_time_forwards_times_the_runner_on_scratch_rows_and_leaves_nothing_behind(monkeypatch):
    """The policy's calibration runs the engine's own runner at each width, rows x width tokens per forward, on
    sequences it opens and closes, in the leader's blocks for a companion; a pool without room gives nothing."""
    target, draft = _follower_pair(max_blocks=64)
    target.open("live", [1, 2, 3])
    target.forward(["live"], [[1, 2, 3]])
    packed = []
    forward = BatchModelRunner.forward

    def counting(self, seqs, rows, *args, **kwargs):
        packed.append((self is target, sum(map(len, rows))))
        return forward(self, seqs, rows, *args, **kwargs)

    monkeypatch.setattr(BatchModelRunner, "forward", counting)
    before = (dict(target.cache.pool.tables), dict(target.cache.lengths), target.cache.pool.stats.queried_tokens)
    timed = time_forwards(target, 3, [1, 4], repeats=2)
    assert set(timed) == {1, 4} and all(seconds > 0 for seconds in timed.values())
    # three prefills of one row each, then per width a warm-up and two timed forwards of 3 rows
    assert [tokens for _, tokens in packed] == [SCRATCH_CONTEXT] * 3 + [3] * 3 + [12] * 3
    assert (dict(target.cache.pool.tables), dict(target.cache.lengths),
            target.cache.pool.stats.queried_tokens) == before
    packed.clear()
    assert set(time_forwards(draft, 2, [1], repeats=1, leader=target)) == {1}
    assert packed and not any(is_target for is_target, _ in packed)  # the draft's forwards, the target's blocks
    assert set(target.cache.lengths) == {"live"} and draft.cache.lengths == {}
    small, _ = _follower_pair(max_blocks=4)
    assert time_forwards(small, 8, [1]) == {}  # 8 rows of KV do not fit in 4 blocks
    assert small.cache.pool.tables == {} and small.cache.lengths == {}


@pytest.mark.skipif(row_kernels.unavailable() is not None, reason="needs the row kernels' library (its one-call layer)")
def test_the_rows_kernel_is_kept_where_whole_layers_in_one_call_run_faster(monkeypatch):
    """The product plan is timed matrix by matrix; where it picked another kind at a width the one-call layer takes,
    whole forwards are timed both ways and the rows kernel kept where they ran faster. Past the one-call layer's
    widest forward the plan stands as measured."""
    from pipeline.executor import matmul_choice, model_runner

    measured = matmul_choice.KernelPlan({1: "linear", 2: "rows", 4: "w_xt", 64: "linear"},
                                        {(kind, w): 1.0 for kind in ("linear", "rows") for w in (1, 2, 4, 64)})
    monkeypatch.setattr(matmul_choice, "measured_once", lambda weights: measured)
    # whole forwards: with rows at width 1, 1 ms against the plan's 2; at width 4, 3 ms against the plan's 2
    cost = {(1, True): 1e-3, (1, False): 2e-3, (4, True): 3e-3, (4, False): 2e-3}
    timed = []

    def fake_time_forwards(runner, rows, widths, repeats=3, leader=None):
        timed.append((rows, tuple(widths)))
        return {w: cost[w, runner._decoder.kernels.kind(w) == "rows"] for w in widths}

    monkeypatch.setattr(model_runner, "time_forwards", fake_time_forwards)
    runner = BatchModelRunner(_llama(), "cpu", max_tokens=128, block_size=4, max_blocks=64)
    assert runner._decoder.layer_weights is not None
    assert runner.kernels.by_width == {1: "rows", 2: "rows", 4: "w_xt", 64: "linear"}
    assert runner.kernels is runner._decoder.kernels and measured.by_width[1] == "linear"  # a new plan, not edited
    assert timed == [(1, (1, 4))] * 2 * model_runner.WHOLE_LAYER_ROUNDS  # each round: the plan, then rows
    assert runner.kernels.times_ms[("whole-rows", 1)] == 1.0 and runner.kernels.times_ms[("whole-plan", 4)] == 2.0
    timed.clear()
    modules = BatchModelRunner(_llama(), "cpu", max_tokens=128, block_size=4, max_blocks=64, lean=False)
    assert timed == [] and modules.kernels is None  # the modules' path has no plan to check
