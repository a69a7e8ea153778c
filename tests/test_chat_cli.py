"""`run --chat / --messages / --system`, `bench --prompts` and `profile --prompts` with chats, on a tiny pair whose
tokenizer has a chat template (tests/chat_helpers.py). The reply and its ids are checked against the executor's
own generate on the encoded chat."""

from __future__ import annotations

import json

import pytest
from chat_helpers import build_chat_engines

from pipeline.chat import encode_chat, end_of_turn_ids
from pipeline.cli import main

SYSTEM = "You complete Python code."
USER = "def add(a, b):"


@pytest.fixture(scope="module")
def chat_engines(tiny_pair, tmp_path_factory):
    return build_chat_engines(tiny_pair, tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def executor(chat_engines):
    from pipeline.executor import SpeculativeExecutor

    _, engines = chat_engines
    return SpeculativeExecutor.from_engines(engines / "tiny-chat", device="cpu")


def _expected(executor, conversations, tokens):
    ids = [encode_chat(executor.tokenizer, messages) for messages in conversations]
    return ids, executor.generate(ids, tokens, stop_token_ids=end_of_turn_ids(executor.tokenizer))


def test_run_chat_replies_like_the_executor_on_the_encoded_chat(chat_engines, executor, capsys):
    config, engines = chat_engines
    assert main(["run", str(config), "--engines-dir", str(engines), "--chat", USER, "--chat", "import os",
                 "--system", SYSTEM, "--max-new-tokens", "10", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    ids, expected = _expected(executor, [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
                                         for text in (USER, "import os")], 10)
    assert [r["token_ids"] for r in records] == [e.token_ids for e in expected]
    assert [r["prompt_tokens"] for r in records] == [len(i) for i in ids]


def test_run_prints_the_reply_not_the_rendered_template(chat_engines, executor, capsys):
    config, engines = chat_engines
    assert main(["run", str(config), "--engines-dir", str(engines), "--chat", USER, "--prompt", "x = 1",
                 "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    _, (expected,) = _expected(executor, [[{"role": "user", "content": USER}]], 8)
    chat_part = out[out.index("--- chat 1"):]
    assert f"--- chat 1 ({len(encode_chat(executor.tokenizer, [{'role': 'user', 'content': USER}]))} prompt " \
           f"tokens) ---\n{expected.text}\n[" in chat_part
    assert USER not in chat_part and "assistant\n" not in chat_part  # the template stays out of the output
    assert "--- prompt 0" in out and "x = 1" in out and "=== total:" in out


def test_run_messages_file_holds_conversations(chat_engines, executor, tmp_path, capsys):
    config, engines = chat_engines
    conversations = [[{"role": "user", "content": USER}],
                     [{"role": "user", "content": "class A:"}, {"role": "assistant", "content": "pass"},
                      {"role": "user", "content": "class B(A):"}]]
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    assert main(["run", str(config), "--engines-dir", str(engines), "--messages", str(chats),
                 "--max-new-tokens", "6", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    _, expected = _expected(executor, conversations, 6)
    assert [r["token_ids"] for r in records] == [e.token_ids for e in expected]


def test_run_chat_stream_prints_only_the_reply(chat_engines, executor, capsys):
    config, engines = chat_engines
    assert main(["run", str(config), "--engines-dir", str(engines), "--chat", USER, "--max-new-tokens", "6",
                 "--stream"]) == 0
    out = capsys.readouterr().out
    _, (expected,) = _expected(executor, [[{"role": "user", "content": USER}]], 6)
    assert out.startswith(expected.text + "\n[")


@pytest.mark.parametrize("args, expected", [
    (["--system", "be brief", "--prompt", "x"], "--system: applies to chats"),
    (["--messages", "MISSING"], "--messages: MISSING not found"),
    (["--chat", "x", "--messages", "BAD"], "line 1: message 0 role 'robot' is not one of"),
])
def test_run_chat_errors_come_before_anything_loads(tmp_path, capsys, args, expected):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    args = [str(bad) if a == "BAD" else str(tmp_path / "missing.json") if a == "MISSING" else a for a in args]
    expected = expected.replace("MISSING", str(tmp_path / "missing.json"))
    # the engines folder does not exist: every error here is found first
    assert main(["run", "configs/tiny.yaml", "--engines-dir", str(tmp_path / "none"), *args]) == 2
    assert expected in capsys.readouterr().err


QUICK = ["--max-new-tokens", "4", "--repeats", "1", "--k-max", "2", "--skip-hf"]


def test_bench_prompts_file_sets_come_from_labels(chat_engines, tmp_path, capsys):
    config, engines = chat_engines
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in [
        {"text": "def f(x):", "set": "code"}, {"text": "import sys", "set": "code"},
        {"messages": [{"role": "user", "content": USER}], "set": "chat"}, {"text": "class A:", "set": "code"}]))
    out = tmp_path / "bench"
    assert main(["bench", str(config), "--engines-dir", str(engines), "--prompts", str(prompts), "--out", str(out),
                 "--num-prompts", "2", *QUICK]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["options"]["prompt_sets"] == ["code", "chat"] and data["options"]["prompts_file"] == str(prompts)
    assert data["options"]["num_prompts"] == 2
    assert {r["set"] for r in data["records"]} == {"code", "chat"}
    assert all(r["set"] == r["prompt_set"] for r in data["records"])
    assert {r["prompts"] for r in data["records"] if r["set"] == "code"} == {2}  # --num-prompts caps each set
    assert {r["prompts"] for r in data["records"] if r["set"] == "chat"} == {1}


def test_bench_prompts_errors(chat_engines, tiny_config, tmp_path, capsys):
    config, engines = chat_engines
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert main(["bench", str(config), "--prompts", str(prompts), "--prompt-set", "code", *QUICK]) == 2
    assert "--prompt-set and --prompts: pass one of them" in capsys.readouterr().err
    # the plain tiny pair has no chat template: the chat item is named, with the fix
    assert main(["bench", str(tiny_config), "--engines-dir", str(tmp_path / "none"), "--prompts", str(prompts),
                 *QUICK]) == 2
    err = capsys.readouterr().err
    assert f"--prompts: {prompts} line 1: messages: the tokenizer in " in err and "has no chat template" in err


def test_profile_reads_chats(chat_engines, tmp_path, capsys):
    config, _ = chat_engines
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": USER}]}) + "\n"
                       + json.dumps({"text": "import os\nimport sys\n"}) + "\n")
    assert main(["profile", str(config), "--prompts", str(prompts), "--k-max", "2", "--max-new-tokens", "6",
                 "--no-ngram"]) == 0
    assert "recommend:" in capsys.readouterr().out
