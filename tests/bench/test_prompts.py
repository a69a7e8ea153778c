"""pipeline/bench/prompts.py: the built-in prompt sets are deterministic and non-empty; the chat set shares one token
prefix, which fitting keeps."""

from __future__ import annotations

import pytest


def test_prompt_sets_are_deterministic_and_nonempty():
    from pipeline.bench.prompts import PROMPT_SETS, load_prompt_set

    for name in PROMPT_SETS:
        first, again = load_prompt_set(name, 3), load_prompt_set(name, 3)
        assert first == again and len(first) == 3 and all(p.strip() for p in first)
    assert load_prompt_set("code", 2)[0].rstrip().endswith(":")  # ends on a def line
    assert load_prompt_set("json", 1)[0].endswith('"name": "')
    assert load_prompt_set("agentic", 1)[0].endswith('"args": {"')  # cut inside the next tool call


def test_agentic_transcripts_repeat_their_calls_within_and_across_transcripts():
    """What suffix decoding is for: a transcript's calls share their text with each other, and with other
    transcripts' calls of the same tool."""
    from pipeline.bench.prompts import agentic_turns

    task, turns, tool = agentic_turns(0)
    calls = [call for call, _ in turns]
    assert len(set(calls)) == len(calls) and all(call.startswith(f'{{"tool": "{tool}", "args": {{') for call in calls)
    _, later, same_tool = agentic_turns(4)  # the same task template, other hosts and results
    assert same_tool == tool and later != turns and later[0][1].split(",")[1] == turns[0][1].split(",")[1]


def test_the_shipped_agentic_chats_are_the_generated_ones(real_model_dir):
    """prompts/agentic.jsonl is what scripts/make_agentic_prompts.py writes (agentic_chats(16, seed=1)), under 450
    tokens each."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    from pipeline.bench.prompts import agentic_chats
    from pipeline.prompt_files import encode_items, read_prompt_file

    path = Path(__file__).resolve().parents[2] / "prompts" / "agentic.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"set": "agentic", "messages": chat} for chat in agentic_chats(16, seed=1)]
    lengths = [len(ids) for ids in encode_items(read_prompt_file(path), AutoTokenizer.from_pretrained(real_model_dir))]
    assert max(lengths) <= 450, lengths


def _common_prefix(prompts: list[list[int]]) -> int:
    n = 0
    while all(len(p) > n and p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n


@pytest.mark.parametrize("template", [False, True], ids=["no-template", "chat-template"])
def test_chat_prompts_share_the_system_prompts_tokens(tiny_pair, template):
    from transformers import AutoTokenizer

    from pipeline.bench.prompts import CHAT_QUESTIONS, CHAT_SYSTEM_PROMPT, chat_prompt_ids
    from tests.chat_helpers import TINY_CHAT_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair / "target")
    if template:
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
    prompts, shared = chat_prompt_ids(tokenizer, 5)
    assert len(prompts) == 5 and chat_prompt_ids(tokenizer, 5) == (prompts, shared)
    assert _common_prefix(prompts) == shared  # exactly the shared part, even over only 5 of the questions
    system = tokenizer.decode(prompts[0][:shared])
    assert CHAT_SYSTEM_PROMPT[-40:] in system and not any(q[:20] in system for q in CHAT_QUESTIONS)
    texts = [tokenizer.decode(p[shared:]) for p in prompts]
    assert all(any(q in text for q in CHAT_QUESTIONS) for text in texts)
    assert texts[0].endswith("assistant\n") == template  # the template opens the assistant's turn
    # a single prompt still reports the system part, not its whole length
    (one,), alone = chat_prompt_ids(tokenizer, 1)
    assert alone == shared and len(one) > shared


def test_fit_shared_prefix_cuts_the_shared_part_not_the_questions():
    from pipeline.bench.prompts import fit_shared_prefix

    shared = list(range(100, 110))
    prompts = [shared + [1, 2, 3], shared + [4], shared + [5, 6]]
    keep_end = lambda ids: ids[-8:]  # noqa: E731 - the usual fit: at most 8 tokens, keeping the end
    fitted, now_shared = fit_shared_prefix(prompts, 10, keep_end)
    assert now_shared == 5 and fitted == [shared[:5] + [1, 2, 3], shared[:5] + [4], shared[:5] + [5, 6]]
    assert fit_shared_prefix(prompts, 10, lambda ids: ids) == (prompts, 10)  # fits: unchanged
    with pytest.raises(ValueError, match="lower --max-tokens"):
        fit_shared_prefix(prompts, 10, lambda ids: ids[-3:])
