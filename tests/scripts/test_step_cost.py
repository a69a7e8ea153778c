"""scripts/step_cost.py: the forward cost per width on both runners, as a table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline.executor import attention_choice, row_kernels
from tests.conftest import REPO


@pytest.mark.slow  # three model loads in subprocesses and a compile: about 40 s on 2 cores
def test_the_table_has_both_runners_at_every_width(tiny_pair, tmp_path):
    out = tmp_path / "cost.json"
    result = subprocess.run([sys.executable, "scripts/step_cost.py", str(tiny_pair / "target"), "--widths", "1", "3",
                             "--rounds", "1", "--context", "20", "--threads", "1", "--compile", "--json", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("CPU: ") and "lean decoder: lean" in result.stdout
    assert "compiled: buckets [1, 2, 4], warm-up" in result.stdout
    table = json.loads(out.read_text())
    assert [(row["runner"], row["width"]) for row in table["rows"]] == [
        ("hf-modules", 1), ("hf-modules", 3), ("lean", 1), ("lean", 3), ("compiled", 1), ("compiled", 3)]
    assert all(row["ms"] > 0 for row in table["rows"]) and table["rows"][0]["vs_one_token"] == 1.0
    int8 = subprocess.run([sys.executable, "scripts/step_cost.py", str(tiny_pair / "target"), "--int8", "--dtype",
                           "bfloat16", "--widths", "2", "--rounds", "1", "--context", "20", "--threads", "1",
                           "--sdpa-twins", "--torch-ops-twins", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert int8.returncode == 0, int8.stderr
    assert "bfloat16 int8 weights" in int8.stdout and "lean decoder: lean; product by width: {'1': " in int8.stdout
    assert "attention kernel by width: {'1': " in int8.stdout  # measured for the bfloat16 heads
    twins = json.loads(out.read_text())
    assert [row["runner"] for row in twins["rows"]] == ["hf-modules", "lean", "lean-sdpa", "lean-torch-ops"]
    operators = "torch" if row_kernels.unavailable() else "the row kernels' C++ operators"  # however small the model
    assert f"per-token operations: {operators}" in int8.stdout
    assert set(twins["attention"]["by_width"]) == {str(w) for w in attention_choice.WIDTHS}
    bad = subprocess.run([sys.executable, "scripts/step_cost.py", str(tiny_pair / "target"), "--widths", "0"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "positive integers" in bad.stderr
