"""pipeline/yaml_loader.py: hostile config files (issue 12, items h, i, m) are refused quickly with one bounded `error:`
line that names the problem and the fix, never a traceback, a hang or minutes of work."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import given, settings, strategies as st

from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.yaml_loader import MAX_ALIAS_NODES, MAX_DEPTH, MAX_YAML_BYTES
from tests.conftest import one_error_line, run_cli

VALID = """\
name: ok
target: {model: a/b}
draft: {model: a/c}
"""


def _alias_bomb(levels: int = 8) -> str:
    # Each level lists the previous one ten times: 10**8 values once expanded from a few hundred bytes of text,
    # which the old loader accepted and the error message then printed in full (~500 MB in one line).
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]")
    return "\n".join(lines) + f"\nname: ok\ntarget: {{model: a/b}}\ndraft: {{model: a/c}}\nserve: *a{levels - 1}\n"


CASES = {
    # id: (file bytes, expected text in the error line)
    "utf16": (VALID.encode("utf-16"), "UTF-16"),
    "latin1": (VALID.replace("ok", "caf\xe9").encode("latin-1"), "not UTF-8"),
    "nested-3000": (("a: " + "[" * 3000 + "]" * 3000 + "\n").encode(), f"nested deeper than {MAX_DEPTH}"),
    "alias-bomb": (_alias_bomb().encode(), f"more than {MAX_ALIAS_NODES} values"),
    "recursive-alias": (b"name: &a [*a]\n", "refers to itself"),
    "duplicate-key": (VALID.encode() + b"name: again\n", "duplicate key 'name' at line 4"),
    "duplicate-nested-key": (VALID.replace("a/b}", "a/b, model: x/y}").encode(), "duplicate key 'model' at line 2"),
    "long-name": (VALID.replace("ok", "n" * 300).encode(), "name: 'nnnn"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_yaml_is_one_clear_line(tmp_path, case):
    data, expected = CASES[case]
    path = tmp_path / "c.yaml"
    path.write_bytes(data)
    start = time.perf_counter()
    line = one_error_line(run_cli("check", str(path)))
    assert time.perf_counter() - start < 20  # seconds, subprocess start included (the bomb took minutes)
    assert expected in line, line
    assert len(line) < 600, len(line)


def test_oversized_yaml_is_refused_fast_by_its_size(tmp_path):
    path = tmp_path / "big.yaml"
    with open(path, "w") as fh:  # 50 MB of plausible YAML (the probe's file took 44 s to load)
        fh.write(VALID)
        line = "# " + "padding " * 127 + "\n"
        fh.write(line * (50_000_000 // len(line)))
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=f"larger than {MAX_YAML_BYTES // 1024} KiB"):
        load_config(path)
    assert time.perf_counter() - start < 1.0


def test_config_path_that_is_not_a_regular_file(tmp_path):
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    assert "is a folder, not a file" in one_error_line(run_cli("check", str(folder)))
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    start = time.perf_counter()
    line = one_error_line(run_cli("check", str(fifo), timeout=30))  # never opened: reading a FIFO would block
    assert "is not a regular file (a FIFO" in line, line
    assert time.perf_counter() - start < 20
    assert "not found" in one_error_line(run_cli("check", str(tmp_path / "missing.yaml")))


def test_anchors_and_aliases_within_limits_still_work(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: ok\ntarget: &t {model: a/b, dtype: float32}\ndraft: {<<: *t, model: a/c}\n")
    config = load_config(path)
    assert config.draft.model == "a/c" and config.draft.dtype == "float32"
    utf8_bom = tmp_path / "bom.yaml"
    utf8_bom.write_bytes(b"\xef\xbb\xbf" + VALID.encode())
    assert load_config(utf8_bom).name == "ok"


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=200))
def test_yaml_text_never_crashes(text, tmp_path_factory):
    from pipeline.config import load_config

    path = tmp_path_factory.mktemp("y") / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError):
        load_config(path)  # no arbitrary text is a complete valid config (target and draft are required)
