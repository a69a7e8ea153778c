"""The command line: help, exit codes, one-line errors, the run stage's output."""

import json

import pytest

from conftest import run_cli


@pytest.mark.parametrize("stage", ["check", "convert", "build", "run", "schema"])
def test_help_for_each_stage(stage):
    result = run_cli(stage, "--help")
    assert result.returncode == 0 and "usage:" in result.stdout


def test_top_level_help_lists_stages():
    result = run_cli("--help")
    assert result.returncode == 0
    for stage in ("check", "convert", "build", "run", "deploy", "serve", "bench", "profile"):
        assert stage in result.stdout


def test_unknown_stage_is_usage_error():
    assert run_cli("frobnicate", "x.yaml").returncode == 2


def test_schema_prints_json():
    result = run_cli("schema")
    assert result.returncode == 0 and json.loads(result.stdout)["title"] == "PipelineConfig"


def test_bad_config_exits_nonzero_with_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: t\ntarget: {model: a/b}\ndraft: {model: a/c}\nspeculative: {max_draft_len: 0}\n")
    result = run_cli("check", str(path))
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "speculative.max_draft_len" in lines[0] and "Traceback" not in result.stderr
    debug = run_cli("check", str(path), "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


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


def test_run_without_engines_says_what_to_do(tiny_config, tmp_path):
    result = run_cli("run", str(tiny_config), "--engines-dir", str(tmp_path / "none"), "--prompt", "x")
    assert result.returncode == 2 and "no completed build output" in result.stderr and "pipeline build" in result.stderr
