"""prompts/categories.jsonl: the per-category chat set (SPEED-Bench's categories) that bench groups acceptance by;
read through the project's own reader, with the shape, sizes and coverage that make the categories comparable."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

from pipeline.prompt_files import read_prompt_file

PATH = Path(__file__).resolve().parents[1] / "prompts" / "categories.jsonl"
CATEGORIES = ("coding", "math", "qa", "writing", "summarization", "roleplay", "rag", "multilingual", "reasoning")
MAX_CHAT_CHARS = 3500  # the smallest shipped engine takes 1024 input tokens
LANGUAGES = {  # a script of its own, or letters and words that give a Latin-script language away
    "chinese": r"[\u4e00-\u9fff]", "japanese": r"[\u3040-\u30ff]", "korean": r"[\uac00-\ud7af]",
    "russian": r"[\u0400-\u04ff]", "greek": r"[\u0370-\u03ff]", "arabic": r"[\u0600-\u06ff]",
    "hindi": r"[\u0900-\u097f]", "vietnamese": r"[\u1ea0-\u1ef9]", "polish": r"[łąęśźż]", "turkish": r"[ğı]",
    "spanish": r"[¿ñ]", "portuguese": r"\b(você|não|juros)\b", "german": r"\b(und|nicht|für)\b",
    "french": r"\b(les|des|avec)\b", "dutch": r"\b(een|het|ik)\b", "italian": r"\b(gli|della|piacciono)\b",
    "swedish": r"\b(och|är|inte)\b"}


@cache
def _items():
    return read_prompt_file(PATH)


@cache
def _raw():
    return [json.loads(line) for line in PATH.read_text(encoding="utf-8").splitlines()]


def _by_set(name):
    return [item for item in _items() if item.set == name]


def test_every_category_in_order_with_enough_chats_and_nothing_else():
    sets = [item.set for item in _items()]
    assert tuple(dict.fromkeys(sets)) == CATEGORIES
    assert all(sets.count(name) >= 24 for name in CATEGORIES)
    assert len(_raw()) == len(_items())  # one chat a line, no blank lines


def test_lines_have_set_id_messages_with_unique_ids_named_after_their_set():
    ids = [value["id"] for value in _raw()]
    assert len(set(ids)) == len(ids)
    for value in _raw():
        assert list(value) == ["set", "id", "messages"]
        assert re.fullmatch(rf"{re.escape(value['set'])}-\d\d", value["id"]), value["id"]


def test_every_item_is_a_chat_ending_with_a_distinct_user_turn_under_the_size_limit():
    users = []
    for item in _items():
        assert item.is_chat, item.where
        roles = [message["role"] for message in item.messages]
        assert roles in (["user"], ["system", "user"]), item.where
        assert sum(len(message["content"]) for message in item.messages) < MAX_CHAT_CHARS, item.where
        users.append(item.messages[-1]["content"])
    assert len(set(users)) == len(users)


def test_rag_and_summarization_carry_their_long_context():
    for item in _by_set("rag"):
        documents = item.messages[-1]["content"].rpartition("\n\nQuestion:")[0]
        assert len(documents) >= 1800 and 3 <= documents.count("[Document ") <= 5, item.where
        assert item.messages[0]["role"] == "system" and "only" in item.messages[0]["content"], item.where
    for item in _by_set("summarization"):
        assert len(item.messages[-1]["content"].rpartition("\n\n")[0]) >= 700, item.where
    assert all(item.messages[0]["role"] == "system" for item in _by_set("roleplay"))


def test_multilingual_covers_ten_languages_and_some_translation():
    texts = [" ".join(message["content"] for message in item.messages) for item in _by_set("multilingual")]
    found = {name for name, pattern in LANGUAGES.items() if any(re.search(pattern, text) for text in texts)}
    assert len(found) >= 10, sorted(found)
    assert sum(bool(re.search(r"(?i)translat|übersetz|tradu|翻|번역", text)) for text in texts) >= 3
