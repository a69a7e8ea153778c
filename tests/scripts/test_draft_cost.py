"""scripts/draft_cost.py: one table of what a draft token costs per head size and dtype, before training."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_the_table_has_every_variant_and_the_cpu(tiny_pair, tmp_path):
    out = tmp_path / "cost.json"
    result = subprocess.run([sys.executable, "scripts/draft_cost.py", str(tiny_pair / "target"),
                             str(tiny_pair / "draft"), "--vocab", "0", "64", "--dtypes", "float32", "--rounds", "1",
                             "--threads", "1", "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    table = json.loads(out.read_text())
    assert [row["model"] for row in table["rows"]] == ["target float32", "draft 512 tokens float32",
                                                       "draft 64 tokens float32"]
    assert table["rows"][0]["c"] == 1.0 and all(row["ms"] > 0 for row in table["rows"])
    assert result.stdout.startswith("CPU: ")
    bad = subprocess.run([sys.executable, "scripts/draft_cost.py", str(tiny_pair / "target"),
                          str(tiny_pair / "draft"), "--vocab", "513"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "between 0 (whole head) and the draft's 512 tokens" in bad.stderr
