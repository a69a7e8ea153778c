"""End to end on the tiny pair through the command line: `check`, `build` (then up to date), `run` (text and JSON)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli


@pytest.mark.slow
def test_check_build_run_end_to_end(tiny_config, tmp_path):
    engines = tmp_path / "engines"
    assert run_cli("check", str(tiny_config)).returncode == 0
    built = run_cli("build", str(tiny_config), "--engines-dir", str(engines))
    assert built.returncode == 0, built.stderr
    assert "built" in built.stdout
    again = run_cli("build", str(tiny_config), "--engines-dir", str(engines))
    assert again.returncode == 0 and again.stdout.count("up to date") == 4
    run = run_cli("run", str(tiny_config), "--engines-dir", str(engines), "--prompt", "def f(x):",
                  "--max-new-tokens", "12")
    assert run.returncode == 0, run.stderr
    assert "def f(x):" in run.stdout and "acceptance" in run.stdout and "tokens/step" in run.stdout
    as_json = run_cli("run", str(tiny_config), "--engines-dir", str(engines), "--prompt", "x = 1",
                      "--max-new-tokens", "5", "--json")
    (record,) = json.loads(as_json.stdout)
    assert len(record["token_ids"]) == 5 and "acceptance_rate" in record["stats"]
