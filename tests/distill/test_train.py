"""pipeline/distill/dataset.py and train.py on the tiny pair: the target's own generations, distillation, resume."""

from __future__ import annotations

import pytest
import torch

from pipeline.distill.dataset import DistillSet, generate_dataset, text_prompts
from pipeline.distill.draft_init import draft_from_target
from pipeline.distill.train import TrainOptions, evaluate, split, train_draft
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
