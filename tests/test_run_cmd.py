"""pipeline/run_cmd.py: `python -m pipeline run`.

Bad options or prompt files (issue 12, items h and m) are one `error:` line, refused the way the server refuses the same
values, before any model is loaded. Chats (`--chat / --messages / --system`) on a tiny pair whose tokenizer has a chat
template (tests/chat_helpers.py) reply exactly what the executor's own generate gives on the encoded chat. Every run
reports its speed: tokens/s and time to first token, per prompt and for the batch (and in --json).
"""

from __future__ import annotations

import json
import re

import pytest

from pipeline.chat import encode_chat, end_of_turn_ids
from pipeline.cli import main
from tests.conftest import one_error_line, run_cli


@pytest.mark.parametrize("option, value, expected", [
    ("--temperature", "inf", "--temperature: inf must be a finite number >= 0"),
    ("--temperature", "nan", "--temperature: nan must be a finite number >= 0"),
    ("--temperature", "-1", "--temperature: -1.0 must be a finite number >= 0"),
    ("--top-p", "0", "--top-p: 0.0 must be in (0, 1]"),
    ("--top-k", "-2", "--top-k: -2 must be an integer >= 0"),
    ("--seed", str(2 ** 64), f"--seed: {2 ** 64} must be an integer in [0, 2**64)"),
    ("--max-new-tokens", "-1", "--max-new-tokens: -1 must be an integer >= 0"),
])
def test_run_refuses_what_the_server_refuses(tmp_path, option, value, expected):
    # the engines folder does not even exist: the values are refused before anything is loaded
    result = run_cli("run", "configs/tiny.yaml", "--engines-dir", str(tmp_path / "none"), "--prompt", "x",
                     option, value)
    line = one_error_line(result)
    assert expected in line, line


@pytest.mark.parametrize("content, expected", [
    (b"\xff\xfe\x00bad", "not UTF-8"),
    (b'["unterminated', "not a valid JSON list"),
    (b'[1, {"a": 2}]', "item 0 is int, not a string"),
    (b"   \n\n", "holds no prompts"),
], ids=["binary", "bad-json", "not-strings", "empty"])
def test_bad_prompts_file(tmp_path, content, expected):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(content)
    line = one_error_line(run_cli("run", "configs/tiny.yaml", "--engines-dir", str(tmp_path / "none"),
                                   "--prompts-file", str(prompts)))
    assert f"--prompts-file: {prompts}" in line and expected in line, line


def test_prompts_file_that_is_a_folder(tmp_path):
    line = one_error_line(run_cli("run", "configs/tiny.yaml", "--engines-dir", str(tmp_path / "none"),
                                   "--prompts-file", str(tmp_path)))
    assert "is a folder" in line, line


SYSTEM = "You complete Python code."


USER = "def add(a, b):"


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


def test_run_without_engines_says_what_to_do(tiny_config, tmp_path):
    result = run_cli("run", str(tiny_config), "--engines-dir", str(tmp_path / "none"), "--prompt", "x")
    assert result.returncode == 2 and "no completed build output" in result.stderr and "pipeline build" in result.stderr


def test_run_reports_speed_per_prompt_and_for_the_batch(chat_engines, capsys):
    """tokens/s and time to first token: in --json as fields of each result, in text on each prompt's line and
    for the batch."""
    config, engines = chat_engines
    assert main(["run", str(config), "--engines-dir", str(engines), "--prompt", "def f(x):", "--prompt", "import os",
                 "--max-new-tokens", "8", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    for record in records:
        tokens = len(record["token_ids"])
        assert 0 < record["ttft_ms"] <= record["seconds"] * 1000
        assert record["tokens_per_s"] == pytest.approx(tokens / record["seconds"], rel=0.01)
    assert main(["run", str(config), "--engines-dir", str(engines), "--prompt", "def f(x):", "--prompt", "import os",
                 "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^\[(length|eos), \d+ tokens, [\d.]+ tok/s, TTFT \d+ ms\] drafted", out, re.M)) == 2
    assert re.search(r"^=== total: \d+ tokens in [\d.]+ s, [\d.]+ tok/s \(2 prompts in one batch\), TTFT median \d+ "
                     r"ms; drafted", out, re.M)
    assert main(["run", str(config), "--engines-dir", str(engines), "--prompt", "def f(x):", "--max-new-tokens", "8",
                 "--stream"]) == 0
    assert re.search(r"^\[(length|eos), \d+ tokens, [\d.]+ tok/s, TTFT \d+ ms\] drafted", capsys.readouterr().out,
                     re.M)


def test_run_timing_starts_at_the_first_token_not_the_first_step():
    from pipeline.run_cmd import RunTiming

    timing = RunTiming()
    timing.arrived(0, 0.1)  # a step that emitted nothing
    assert timing.first_s is None and timing.tokens_per_s is None and timing.summary() == "- tok/s, TTFT -"
    timing.arrived(2, 0.25)
    timing.arrived(3, 0.5)
    assert (timing.first_s, timing.last_s, timing.tokens) == (0.25, 0.5, 5)
    assert timing.to_dict() == {"ttft_ms": 250.0, "seconds": 0.5, "tokens_per_s": 10.0}
    assert timing.summary() == "10.0 tok/s, TTFT 250 ms"


def test_run_applies_output_controls(chat_engines, executor, capsys, tmp_path):
    config, engines = chat_engines
    fmt = tmp_path / "format.json"
    fmt.write_text(json.dumps({"type": "regex", "regex": "(yes|no), [0-9]{2}"}))
    assert main(["run", str(config), "--engines-dir", str(engines), "--prompt", "x = 1", "--max-new-tokens", "16",
                 "--response-format", f"@{fmt}", "--frequency-penalty", "0.5", "--logprobs", "1", "--json"]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert re.fullmatch("(yes|no), [0-9]{2}", record["text"]) and record["finish_reason"] == "eos"
    assert len(record["logprobs"]) == len(record["token_ids"]) and len(record["logprobs"][0]["top"]) == 1
    assert record["stats"]["by_proposer"]["grammar"][0] > 0  # the format's fixed ", " was drafted for free


@pytest.mark.parametrize("args, expected", [
    (["--presence-penalty", "3"], "--presence-penalty: 3.0 must be a number in [-2, 2]"),
    (["--logprobs", "21"], "--logprobs: 21 must be an integer in [0, 20]"),
    (["--response-format", "{json"], "--response-format: not valid JSON"),
    (["--response-format", '{"type": "xml"}'], "response_format.type: got 'xml'"),
])
def test_run_refuses_bad_controls_before_loading(tmp_path, args, expected):
    line = one_error_line(run_cli("run", "configs/tiny.yaml", "--engines-dir", str(tmp_path / "none"), "--prompt", "x",
                                  *args))
    assert expected in line, line
