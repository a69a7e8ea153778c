"""pipeline/prompt_files.py: text lines, JSON lists and JSONL with text or messages and set labels; errors that name
the file, the line or item, and the fix; chats encoded through the chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.chat import encode_chat
from pipeline.errors import PipelineError
from pipeline.prompt_files import PromptItem, encode_items, group_by_set, read_conversations, read_prompt_file

REPO = Path(__file__).resolve().parents[1]
HELLO = [{"role": "user", "content": "Hello"}]


def _write(folder: Path, name: str, content: str | bytes) -> Path:
    path = folder / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def test_text_lines_unescape_newlines_skip_blanks_and_take_the_file_stem_as_set(tmp_path):
    path = _write(tmp_path, "mine.txt", "def f(x):\\n    return\n\n   \nclass A:\n")
    items = read_prompt_file(path)
    assert [i.text for i in items] == ["def f(x):\n    return", "class A:"]
    assert {i.set for i in items} == {"mine"} and not any(i.is_chat for i in items)
    assert items[1].where == f"--prompts: {path} line 4"


def test_a_json_list_mixes_strings_objects_and_bare_chats(tmp_path):
    path = _write(tmp_path, "p.json", json.dumps(
        ["plain", {"text": "labelled", "set": "code"}, {"messages": HELLO, "set": "chat", "id": 7}, HELLO]))
    items = read_prompt_file(path, default_set="default")
    assert items == [PromptItem("plain", None, "default", f"--prompts: {path} item 0"),
                     PromptItem("labelled", None, "code", f"--prompts: {path} item 1"),
                     PromptItem(None, HELLO, "chat", f"--prompts: {path} item 2"),
                     PromptItem(None, HELLO, "default", f"--prompts: {path} item 3")]


def test_jsonl_by_suffix_or_by_its_first_line(tmp_path):
    lines = [{"text": "a", "set": "x"}, {"messages": HELLO, "set": "y"}, {"text": "b"}]
    body = "\n".join(json.dumps(line) for line in lines[:2]) + "\n\n" + json.dumps(lines[2]) + "\n"
    for name in ("p.jsonl", "p.txt"):
        items = read_prompt_file(_write(tmp_path, name, body))
        assert [(i.text, i.messages, i.set) for i in items] == [("a", None, "x"), (None, HELLO, "y"), ("b", None, "p")]
        assert items[2].where.endswith(f"{name} line 4")


def test_a_text_file_whose_first_line_is_json_but_not_a_prompt_object_stays_text(tmp_path):
    # JSON-completion prompts: each line is a JSON record to continue, not a prompt object
    path = _write(tmp_path, "records.txt", '{"id": 1, "name": "Ada"}\n{"id": 2, "name": "\n')
    assert [i.text for i in read_prompt_file(path)] == ['{"id": 1, "name": "Ada"}', '{"id": 2, "name": "']


def test_group_by_set_keeps_first_appearance_order(tmp_path):
    path = _write(tmp_path, "p.jsonl", "\n".join(json.dumps({"text": t, "set": s}) for t, s in
                                                 [("1", "b"), ("2", "a"), ("3", "b")]))
    groups = group_by_set(read_prompt_file(path))
    assert list(groups) == ["b", "a"] and [i.text for i in groups["b"]] == ["1", "3"]


@pytest.mark.parametrize("name, content, expected", [
    ("p.jsonl", '{"text": "a"}\n{"text": "b"\n', "line 2: not valid JSON"),
    ("p.jsonl", '{"text": "a", "messages": []}\n', 'line 1: give exactly one of "text"'),
    ("p.jsonl", '{"set": "x"}\n', "line 1: give exactly one of \"text\" (a raw prompt) or \"messages\" (a chat), "
                                  "not neither"),
    ("p.jsonl", '{"text": "a", "label": "x"}\n', "line 1: unknown key 'label'; a prompt object holds text, "
                                                  "messages, set, id"),
    ("p.jsonl", '{"text": "a", "set": ""}\n', "line 1: set '' must be a non-empty one-line string"),
    ("p.jsonl", '{"text": "a", "set": 3}\n', "line 1: set 3 must be"),
    ("p.jsonl", '{"text": ""}\n', "line 1: text '' must be a non-empty string"),
    ("p.jsonl", '{"messages": [{"role": "boss", "content": "x"}]}\n', "line 1: message 0 role 'boss' is not one of"),
    ("p.jsonl", '{"messages": [{"role": "user", "content": 5}]}\n', "line 1: message 0 content is int 5"),
    ("p.jsonl", "17\n", "line 1 is int, not a string or an object"),
    ("p.json", '["a", 1]', "item 1 is int, not a string"),
    ("p.json", '["a", "  "]', "item 1: the prompt is empty"),
    ("p.json", "[]", "holds no prompts"),
    ("p.json", '["a",', "starts with '[' but is not a valid JSON list"),
    ("p.txt", b"\xff\xfeab", "is not UTF-8 text (byte 0)"),
    ("p.txt", "\n  \n", "holds no prompts"),
])
def test_errors_name_the_file_the_line_or_item_and_the_fix(tmp_path, name, content, expected):
    path = _write(tmp_path, name, content)
    with pytest.raises(PipelineError) as caught:
        read_prompt_file(path, flag="--prompts")
    message = str(caught.value)
    assert message.startswith(f"--prompts: {path}"), message
    assert expected in message, message


def test_a_folder_or_a_missing_file_is_named(tmp_path):
    with pytest.raises(PipelineError, match="is a folder"):
        read_prompt_file(tmp_path)
    with pytest.raises(PipelineError, match="not found"):
        read_prompt_file(tmp_path / "none.txt")


@pytest.mark.parametrize("name, content, count", [
    ("one.json", json.dumps(HELLO), 1),
    ("many.json", json.dumps([HELLO, {"messages": HELLO + [{"role": "assistant", "content": "Hi"}]}]), 2),
    ("whole.json", json.dumps({"messages": HELLO}, indent=2), 1),
    ("many.jsonl", json.dumps({"messages": HELLO}) + "\n" + json.dumps(HELLO) + "\n", 2),
])
def test_conversations_files(tmp_path, name, content, count):
    items = read_conversations(_write(tmp_path, name, content))
    assert len(items) == count and all(i.is_chat and i.messages[0] == HELLO[0] for i in items)


@pytest.mark.parametrize("content, expected", [
    ("Hello there", "is not JSON; write a JSON list of messages"),
    (json.dumps(["raw text"]), "item 0 is raw text, not a chat; --messages takes messages"),
    (json.dumps([{"role": "user", "content": "a"}, {"role": "user"}]), "message 1 content is missing"),
    ("[]", "holds no conversations"),
])
def test_conversation_file_errors(tmp_path, content, expected):
    path = _write(tmp_path, "chat.json", content)
    with pytest.raises(PipelineError) as caught:
        read_conversations(path)
    assert str(caught.value).startswith(f"--messages: {path}") and expected in str(caught.value), str(caught.value)


def test_encode_items_keeps_text_and_encodes_chats_with_the_template(tmp_path, real_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    path = _write(tmp_path, "p.jsonl", json.dumps({"text": "raw"}) + "\n" + json.dumps({"messages": HELLO}) + "\n")
    assert encode_items(read_prompt_file(path), tokenizer) == ["raw", encode_chat(tokenizer, HELLO)]


def test_a_chat_for_a_model_without_template_names_the_item(tmp_path, tiny_pair):
    from transformers import AutoTokenizer

    from pipeline.executor import RequestError

    path = _write(tmp_path, "p.jsonl", json.dumps({"text": "raw"}) + "\n" + json.dumps({"messages": HELLO}) + "\n")
    with pytest.raises(RequestError) as caught:
        encode_items(read_prompt_file(path), AutoTokenizer.from_pretrained(tiny_pair / "target"), source="tiny")
    assert str(caught.value).startswith(f"--prompts: {path} line 2: messages: the tokenizer in tiny has no chat "
                                        f"template")


def test_the_shipped_task_prompts(real_model_dir):
    """prompts/tasks.jsonl: chats in four labelled sets, each well under the 350-token budget."""
    from transformers import AutoTokenizer

    items = read_prompt_file(REPO / "prompts" / "tasks.jsonl")
    groups = group_by_set(items)
    assert list(groups) == ["code", "json", "summarize", "prose"]
    assert 16 <= len(items) <= 24 and all(len(group) >= 4 for group in groups.values())
    assert all(item.is_chat and item.messages[-1]["role"] == "user" for item in items)
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    lengths = [len(ids) for ids in encode_items(items, tokenizer)]
    assert max(lengths) <= 350, lengths
    # code prompts carry the code they ask about, so the reply can copy from the prompt (n-gram lookups pay)
    assert all("def " in i.messages[-1]["content"] or "function " in i.messages[-1]["content"]
               for i in groups["code"])


def test_a_shipped_set_by_name(tmp_path, monkeypatch):
    """`--prompts categories` reads the shipped prompts/categories.jsonl; a file of that name here wins."""
    items = read_prompt_file(Path("categories"))
    assert len({item.set for item in items}) == 9 and all(item.is_chat for item in items)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "categories").write_text("my own prompt\n")
    assert [item.text for item in read_prompt_file(Path("categories"))] == ["my own prompt"]
    with pytest.raises(PipelineError, match="categories"):  # the error lists the shipped names
        read_prompt_file(Path("no-such-set"))
