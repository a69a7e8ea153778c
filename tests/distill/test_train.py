"""pipeline/distill/dataset.py and train.py on the tiny pair: the target's own generations, distillation, resume."""

from __future__ import annotations

import pytest
import torch

from pipeline.distill.dataset import DistillSet, generate_dataset, text_prompts
from pipeline.distill.draft_init import draft_from_target
from pipeline.distill.train import StateCache, TrainOptions, evaluate, split, train_draft
from pipeline.tinymodels import read_text, split_files, stdlib_files
from tests.conftest import load_tiny_models


@pytest.fixture(scope="module")
def setup(tiny_pair, tmp_path_factory):
    target, _, tokenizer = load_tiny_models(tiny_pair)
    _, held = split_files(stdlib_files(), 0)
    prompts = text_prompts(tokenizer, read_text(held, 100_000), 32, 24, seed=0)
    data = generate_dataset(target, tokenizer, prompts, 32, top_k=16, seed=0)
    folder = tmp_path_factory.mktemp("distill-data")
    data.save(folder)
    return target, tokenizer, prompts, DistillSet.load(folder)


def test_the_dataset_is_the_targets_own_output(setup):
    target, tokenizer, prompts, data = setup
    assert data.sequences == len(prompts)
    ids, start, topk_ids, topk_logprobs = data.sequence(0)  # prompt 0 is answered greedily
    assert ids[:start].tolist() == prompts[0]
    with torch.no_grad():
        logits = target(ids[None]).logits[0]
    # The recorded top-1 is the target's argmax at every position that predicts a response token, and the greedy
    # response is exactly that argmax chain.
    assert topk_ids[:, 0].tolist() == logits[start - 1:len(ids) - 1].argmax(-1).tolist()
    assert ids[start:].tolist() == topk_ids[:, 0].tolist()
    assert torch.all(topk_logprobs[:, :-1] >= topk_logprobs[:, 1:] - 1e-3)  # sorted, stored as float16


def test_training_raises_held_out_acceptance(setup):
    target, _, _, data = setup
    draft = draft_from_target(target, [0])
    _, held = split(data, 0.1, seed=0)
    before = evaluate(draft, data, held)
    history = train_draft(draft, data, TrainOptions(tokens=6000, batch_size=8, lr=1e-3))
    after = evaluate(draft, data, held)
    assert after.acceptance > before.acceptance + 0.03 and after.loss < before.loss
    assert history["evals"][0]["acceptance"] == pytest.approx(before.acceptance)
    assert history["finished"] and history["evals"][-1]["acceptance"] == pytest.approx(after.acceptance)


def test_resume_continues_exactly(setup, tmp_path):
    target, _, _, data = setup
    options = TrainOptions(tokens=3000, batch_size=4, lr=1e-3, checkpoint_every=1)
    whole = draft_from_target(target, [0])
    train_draft(whole, data, options)
    interrupted = draft_from_target(target, [0])
    first = train_draft(interrupted, data, options, state_dir=tmp_path, stop_after=3)
    assert not first["finished"]
    resumed = draft_from_target(target, [0])  # a fresh process: the weights come from the checkpoint
    second = train_draft(resumed, data, options, state_dir=tmp_path, resume=True)
    assert second["finished"]
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="other training options"):
        train_draft(draft_from_target(target, [0]), data, TrainOptions(tokens=10), state_dir=tmp_path, resume=True)


def test_chat_prompts_ask_the_target_through_its_template(tiny_pair, tmp_path):
    from transformers import AutoTokenizer

    from pipeline.distill.dataset import CHAT_TASKS, chat_prompts
    from tests.chat_helpers import make_chat_pair

    tokenizer = AutoTokenizer.from_pretrained(make_chat_pair(tiny_pair, tmp_path / "pair") / "target")
    texts = ["\n".join(f"line_{i} = {i}" for i in range(40))]
    prompts = chat_prompts(tokenizer, texts, len(CHAT_TASKS), seed=1)
    decoded = [tokenizer.decode(p) for p in prompts]
    assert all(text.startswith("user\n") and text.endswith("assistant\n") for text in decoded)
    assert all("line_" in text for text in decoded) and len(set(decoded)) == len(CHAT_TASKS)
    assert "JSON object" in decoded[3] and chat_prompts(tokenizer, texts, 6, seed=1) == prompts  # seeded


def test_frequent_ids_are_the_tokens_with_the_most_target_probability(setup):
    from pipeline.distill.train import frequent_ids

    _, _, _, data = setup
    sequences = list(range(data.sequences))
    mass = torch.zeros(512, dtype=torch.float64)
    for s in sequences:
        _, _, ids_k, logp_k = data.sequence(s)
        for i, p in zip(ids_k.flatten().tolist(), logp_k.exp().flatten().tolist()):
            mass[i] += p
    chosen = frequent_ids(data, sequences, 40, 512)
    assert chosen == sorted(chosen) and len(chosen) == 40
    assert float(mass[chosen].min()) >= float(mass[[i for i in range(512) if i not in chosen]].max())


def test_a_reduced_vocabulary_draft_learns_and_serves_what_it_learnt(setup):
    """Trained over its most frequent tokens only: the loss falls, the acceptance reaches what the vocabulary allows,
    the config records the ids, the served head (pipeline/draft_vocab.py) gives exactly the logits training saw, and
    speculative greedy output stays the target's."""
    from pipeline.distill.train import HeadRows, frequent_ids
    from pipeline.draft_vocab import CONFIG_KEY, reduce_head
    from pipeline.executor import SpeculativeExecutor

    target, tokenizer, prompts, data = setup
    draft = draft_from_target(target, [2])  # the tiny target's last layer alone: a start with something to learn
    train_set, held = split(data, 0.1, seed=0)
    history = train_draft(draft, data, TrainOptions(tokens=6000, batch_size=8, lr=1e-3, vocab=VOCAB))
    ids = getattr(draft.config, CONFIG_KEY)
    assert ids == frequent_ids(data, train_set, VOCAB, 512)
    first, last = history["evals"][0], history["evals"][-1]
    assert last["loss"] < first["loss"] / 2 and 0.5 < last["coverage"] < 1.0 and last["agreement"] > 0.5
    # Acceptance counts the target's top-k mass the draft matches: at most the mass on the draft's own tokens.
    inside = torch.isin(torch.cat([data.sequence(s)[2] for s in held]), torch.tensor(ids))
    reachable = float(torch.cat([data.sequence(s)[3] for s in held]).exp().masked_fill(~inside, 0).sum(-1).mean())
    assert 0.95 * reachable < last["acceptance"] <= reachable + 1e-4

    sequence = data.sequence(held[0])[0][None]
    with torch.no_grad():
        trained_on = HeadRows(ids, 512).logits(draft, sequence, torch.ones_like(sequence))  # [1, L, VOCAB]
        reduce_head(draft)
        served = draft(sequence).logits  # [1, L, 512]
    assert torch.allclose(served[..., ids], trained_on, atol=1e-5)

    executor = SpeculativeExecutor(target, draft, tokenizer, max_draft_len=3)
    speculative = executor.generate(prompts[:4], 24)
    plain = executor.generate(prompts[:4], 24, max_draft_len=0)
    assert [r.token_ids for r in speculative] == [r.token_ids for r in plain]
    assert sum(r.stats.accepted_tokens for r in speculative) > 0


VOCAB = 12  # of the tiny target's 512: fewer than its top-k (16), so some target mass lies outside


def test_the_state_cache_computes_each_sequence_alone_and_keeps_what_fits(setup):
    """The frozen target's states are computed once per sequence, for it alone (so a batch's companions cannot
    change them), and past the budget computed again rather than kept."""
    target, _, _, data = setup
    computed = []

    def compute(ids):
        computed.append(ids.shape)
        return target.base_model(input_ids=ids).last_hidden_state[0]

    one, two = (len(data.sequence(s)[0]) for s in (1, 2))
    size = one * target.config.hidden_size * 4  # float32
    cache = StateCache(compute, data, budget=size)
    batch = cache.batch([1, 2], 80)
    assert computed == [torch.Size([1, one]), torch.Size([1, two])]  # each alone, unpadded
    alone = target.base_model(input_ids=data.sequence(1)[0][None]).last_hidden_state[0]
    torch.testing.assert_close(batch[0, :one], alone, rtol=0, atol=0)
    assert batch.shape[:2] == (2, 80) and not batch[0, one:].any()  # right-padded with zeros
    assert list(cache.kept) == [1] and cache.bytes == size  # sequence 2 no longer fits
    cache.batch([1, 2], 80)
    assert len(computed) == 3 and computed[-1] == torch.Size([1, two])  # 1 kept, 2 computed again

