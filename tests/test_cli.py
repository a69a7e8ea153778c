"""pipeline/cli.py: help, exit codes, and user errors as one line without a traceback.

Each bad input (config, model folder, tokenizer, engines) gives a non-zero exit, one line naming the field or file and
the fix, and leaves engines/ exactly as it was.
"""

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import one_error_line, run_cli, tiny_config_dict, write_config


@pytest.mark.parametrize("stage", ["check", "convert", "build", "run", "schema"])
def test_help_for_each_stage(stage):
    result = run_cli(stage, "--help")
    assert result.returncode == 0 and "usage:" in result.stdout


def test_top_level_help_lists_every_subcommand_with_its_help():
    """`--help` lists each subcommand the parser has, on its own line with its one-line help, and they are the
    documented stages: a subcommand dropped from build_parser or added without help fails here (the check this
    replaces looked for the words anywhere in the help text, where "run" and "check" always appear)."""
    import argparse

    from pipeline.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {action.dest: action.help for action in sub._choices_actions}
    assert set(helps) == {"schema", "check", "convert", "build", "run", "deploy", "serve", "bench", "profile",
                          "bench-serve", "train-draft"}
    result = run_cli("--help")
    assert result.returncode == 0
    for name, text in helps.items():
        assert text, f"{name} has no help line"
        assert re.search(rf"^\s+{re.escape(name)}\s+{re.escape(text.split()[0])}", result.stdout, re.M), name


def test_unknown_stage_is_usage_error():
    assert run_cli("frobnicate", "x.yaml").returncode == 2


def test_schema_prints_json():
    result = run_cli("schema")
    assert result.returncode == 0 and json.loads(result.stdout)["title"] == "PipelineConfig"


def _run_into_closed_pipe(*args: str):
    """Run `python -m pipeline ARGS` with stdout a pipe whose reader is already gone (`... | head` after head has
    quit): every write to it fails with EPIPE."""
    import os
    import subprocess

    from tests.conftest import PY, REPO

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([PY, "-m", "pipeline", *args], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args, code", [(("schema",), 141), (("--help",), 0), (("check", "--help"), 0)],
                         ids=lambda v: " ".join(v) if isinstance(v, tuple) else str(v))
def test_output_into_a_closed_pipe_is_no_traceback(args, code):
    """`python -m pipeline schema | head`: the reader going away ends the command quietly, with nothing on stderr
    (a BrokenPipeError traceback, or "Exception ignored" at exit, fails here); a command's output cut this way exits
    141 as a shell reports SIGPIPE, while argparse's help ignores the failed write and exits 0."""
    result = _run_into_closed_pipe(*args)
    assert result.stderr == "" and result.returncode == code, (result.returncode, result.stderr[-2000:])


def test_bad_config_exits_nonzero_with_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: t\ntarget: {model: a/b}\ndraft: {model: a/c}\nspeculative: {max_draft_len: 0}\n")
    result = run_cli("check", str(path))
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "speculative.max_draft_len" in lines[0] and "Traceback" not in result.stderr
    debug = run_cli("check", str(path), "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def snapshot(folder: Path) -> dict[str, float]:
    if not folder.exists():
        return {}
    return {p.relative_to(folder).as_posix(): p.stat().st_mtime for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def built_base(tiny_pair, tmp_path_factory):
    """A copy of the pair plus an engines folder with a finished build of it; models named relatively."""
    base = tmp_path_factory.mktemp("failures")
    shutil.copytree(tiny_pair, base / "pair")
    good = write_config(base, _relative_config("good"))
    assert run_cli("build", str(good), "--engines-dir", str(base / "engines")).returncode == 0
    return base


def _relative_config(name: str, **overrides) -> dict:
    data = tiny_config_dict(Path("."), name=name, **overrides)
    for role in ("target", "draft"):
        if data[role]["model"] == role:
            data[role]["model"] = f"./pair/{role}"  # resolved against the config file's folder
    return data


@pytest.fixture
def workspace(built_base, tmp_path):
    """A private copy of the built base: cases damage the pair or the engines."""
    ws = tmp_path / "ws"
    shutil.copytree(built_base, ws)
    return ws / "pair", ws / "engines", ws


def _write_yaml(tmp: Path, text: str) -> Path:
    path = tmp / "case.yaml"
    path.write_text(text)
    return path


def _case_config(pair: Path, tmp: Path, name: str = "case", **overrides) -> Path:
    return write_config(tmp, _relative_config(name, **overrides))


def _corrupt_weights(pair: Path, tmp: Path) -> Path:
    weights = pair / "target" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return _case_config(pair, tmp)


def _missing_tokenizer(pair: Path, tmp: Path) -> Path:
    (pair / "draft" / "tokenizer.json").unlink()
    return _case_config(pair, tmp)


def _truncated_tokenizer(pair: Path, tmp: Path) -> Path:
    tok = pair / "draft" / "tokenizer.json"
    tok.write_text(tok.read_text()[:500])
    return _case_config(pair, tmp)


def _other_tokenizer(pair: Path, tmp: Path) -> Path:
    from pipeline.tinymodels import train_tokenizer

    train_tokenizer(["entirely different corpus " * 300, "xyz " * 100], 300).save_pretrained(pair / "draft")
    return _case_config(pair, tmp)


def _engine_from_other_config(pair: Path, tmp: Path) -> Path:
    # same name as the finished build, but K changed and nothing rebuilt
    return _case_config(pair, tmp, name="good", speculative={"max_draft_len": 6})


def _edited_manifest(pair: Path, tmp: Path) -> Path:
    manifest = tmp / "engines" / "good" / "target" / "build" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["config"]["build"]["max_seq_len"] = 99999
    manifest.write_text(json.dumps(data))
    return _case_config(pair, tmp, name="good")


CASES = {
    # id: (stage, make config, expected text in the one error line)
    "malformed-yaml": ("check", lambda p, t: _write_yaml(t, "name: x\ntarget: {model: a\n"), "malformed YAML at line"),
    "unknown-key": ("build", lambda p, t: _case_config(p, t, colour="red"), "colour: unknown key"),
    "wrong-type": ("build", lambda p, t: _case_config(p, t, build={"max_batch_size": "lots"}),
                   "build.max_batch_size: 'lots' is invalid"),
    "k-zero": ("build", lambda p, t: _case_config(p, t, speculative={"max_draft_len": 0}),
               "speculative.max_draft_len: 0 is invalid"),
    "k-too-large": ("build", lambda p, t: _case_config(p, t, speculative={"max_draft_len": 64}),
                    "speculative.max_draft_len: 64 is invalid"),
    "missing-model-folder": ("build", lambda p, t: _case_config(p, t, target={"model": "./gone"}),
                             "target.model: folder"),
    "offline-uncached-hub-id": ("build", lambda p, t: _case_config(p, t, draft={"model": "org/never-downloaded"}),
                                "not in the local Hugging Face cache"),
    "corrupt-safetensors": ("build", _corrupt_weights, "is corrupt or truncated"),
    "missing-tokenizer": ("check", _missing_tokenizer, "draft.model: the tokenizer"),
    "truncated-tokenizer": ("build", _truncated_tokenizer, "draft.model: the tokenizer"),
    "different-tokenizers": ("build", _other_tokenizer, "draft.model: tokenizer differs from target"),
    "max-seq-len-too-long": ("build", lambda p, t: _case_config(p, t, build={"max_input_len": 10,
                                                                             "max_seq_len": 100000}),
                             "build.max_seq_len: 100000 exceeds"),
    "engine-from-other-config": ("run", _engine_from_other_config, "built from a different config"),
    "manifest-edited-by-hand": ("run", _edited_manifest, "modified after it was written"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_matrix(workspace, case):
    pair, engines, tmp = workspace
    stage, make, expected = CASES[case]
    config = make(pair, tmp)
    before = snapshot(engines)
    extra = ["--prompt", "x", "--max-new-tokens", "2"] if stage == "run" else []
    hub_env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "hf-empty")}
    result = run_cli(stage, str(config), "--engines-dir", str(engines), *extra, env=hub_env)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0], lines[0]
    assert snapshot(engines) == before  # nothing added, removed or rewritten


def test_engines_dir_naming_a_file(tiny_pair, tmp_path):
    config = write_config(tmp_path, tiny_config_dict(tiny_pair, name="f"))
    not_a_dir = tmp_path / "engines"
    not_a_dir.write_text("x")
    line = one_error_line(run_cli("build", str(config), "--engines-dir", str(not_a_dir)))
    assert f"--engines-dir: {not_a_dir} is a file" in line, line
    assert not_a_dir.read_text() == "x"
