"""`run` with bad options or prompt files (issue 12, items h and m): one `error:` line, refused the way the server
refuses the same values, before any model is loaded."""

from __future__ import annotations

import pytest

from conftest import run_cli


def _one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return lines[0]


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
    line = _one_error_line(result)
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
    line = _one_error_line(run_cli("run", "configs/tiny.yaml", "--engines-dir", str(tmp_path / "none"),
                                   "--prompts-file", str(prompts)))
    assert f"--prompts-file: {prompts}" in line and expected in line, line


def test_prompts_file_that_is_a_folder(tmp_path):
    line = _one_error_line(run_cli("run", "configs/tiny.yaml", "--engines-dir", str(tmp_path / "none"),
                                   "--prompts-file", str(tmp_path)))
    assert "is a folder" in line, line
