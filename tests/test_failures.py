"""Failure behaviour: each bad input gives a non-zero exit, one line naming the field or file and the fix, no
traceback, and leaves engines/ exactly as it was. Interrupted builds are never taken as complete."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import PY, REPO, run_cli, tiny_config_dict, write_config
from pipeline.artifacts import build_lock, read_manifest
from pipeline.config import parse_config
from pipeline.errors import ConfigError


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


def _start_build(config: Path, engines: Path, delay: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PIPELINE_STAGE_DELAY_S": str(delay)}
    return subprocess.Popen([PY, "-m", "pipeline", "build", str(config), "--engines-dir", str(engines)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("stage", ["convert", "build"])
def test_sigkill_mid_stage_is_never_taken_as_complete(tiny_pair, tmp_path, stage):
    config = write_config(tmp_path, tiny_config_dict(tiny_pair, name="killed"))
    engines = tmp_path / "engines"
    if stage == "build":  # get convert done first, so the kill lands in build
        assert run_cli("convert", str(config), "--engines-dir", str(engines)).returncode == 0
    proc = _start_build(config, engines, delay=20)
    role_dir = engines / "killed" / "target"
    assert _wait_for(lambda: any(role_dir.glob(f".{stage}.tmp-*/model.safetensors"))), proc.stderr
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (role_dir / stage).exists()  # outputs were there, the manifest was not: not complete
    assert read_manifest(role_dir / stage) is None
    finished = run_cli("build", str(config), "--engines-dir", str(engines))
    assert finished.returncode == 0, finished.stderr
    assert read_manifest(role_dir / "build")["stage"] == "build"
    assert not list(role_dir.glob(".*tmp-*"))  # the killed run's leftovers were cleaned up
    run = run_cli("run", str(config), "--engines-dir", str(engines), "--prompt", "def", "--max-new-tokens", "3")
    assert run.returncode == 0, run.stderr


def test_second_build_waits_for_the_lock(tiny_pair, tmp_path):
    config = write_config(tmp_path, tiny_config_dict(tiny_pair, name="locked"))
    engines = tmp_path / "engines"
    with build_lock(engines / "locked"):
        proc = _start_build(config, engines, delay=0)
        first_line = proc.stderr.readline()  # blocks until the second build reports
        assert "waiting for another build of locked" in first_line
        time.sleep(1)
        assert proc.poll() is None  # still waiting, nothing written
        assert not (engines / "locked" / "target" / "convert").exists()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert read_manifest(engines / "locked" / "draft" / "build") is not None


def test_no_secret_in_manifests_or_logs(tiny_pair, tmp_path):
    secret = "hf_SECRETtokenVALUE123456"
    config = write_config(tmp_path, tiny_config_dict(tiny_pair, name="secret"))
    engines = tmp_path / "engines"
    result = run_cli("build", str(config), "--engines-dir", str(engines), env={"HF_TOKEN": secret})
    assert result.returncode == 0
    assert secret not in result.stdout + result.stderr
    for path in engines.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_nothing_written_outside_engines(tiny_pair, tmp_path):
    work = tmp_path / "cwd"
    work.mkdir()
    config = write_config(tmp_path, tiny_config_dict(tiny_pair, name="contained"))
    pair_before = snapshot(tiny_pair)
    result = run_cli("build", str(config), "--engines-dir", str(tmp_path / "engines"), cwd=work)
    assert result.returncode == 0, result.stderr
    assert list(work.iterdir()) == []
    assert snapshot(tiny_pair) == pair_before


def test_trust_remote_code_warns(tiny_pair, tmp_path):
    config = write_config(tmp_path, tiny_config_dict(tiny_pair, name="remote", target={"trust_remote_code": True}))
    result = run_cli("check", str(config))
    assert result.returncode == 0
    assert "target.trust_remote_code is true" in result.stderr


# ---- property tests: any input gives a valid config or a ConfigError, never a crash -----------------------------

yaml_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                         st.text(max_size=20))
yaml_values = st.recursive(yaml_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)), max_leaves=12)
section_keys = st.sampled_from(["name", "backend", "target", "draft", "speculative", "build", "serve", "runtime",
                                "model", "max_draft_len", "acceptance", "dtype", "parallel", "tp", "bogus"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(yaml_values, st.dictionaries(section_keys, yaml_values, max_size=8)))
def test_config_loader_never_crashes(data):
    try:
        config = parse_config(data)
    except ConfigError as exc:
        assert str(exc) and "\n" not in str(exc)
    else:
        assert config.speculative.max_draft_len >= 1


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=200))
def test_yaml_text_never_crashes(text, tmp_path_factory):
    from pipeline.config import load_config

    path = tmp_path_factory.mktemp("y") / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError):
        load_config(path)  # no arbitrary text is a complete valid config (target and draft are required)


@settings(max_examples=150, deadline=None)
@given(st.fixed_dictionaries({}, optional={
    "speculative": st.fixed_dictionaries({}, optional={"max_draft_len": st.integers(-5, 40),
                                                       "acceptance": st.sampled_from(["greedy", "rejection", "x"])}),
    "build": st.fixed_dictionaries({}, optional={"max_input_len": st.integers(-5, 5000),
                                                 "max_seq_len": st.integers(-5, 5000),
                                                 "parallel": st.fixed_dictionaries({}, optional={
                                                     "tp": st.integers(-1, 9), "pp": st.integers(-1, 9)})}),
}))
def test_valid_looking_configs_validate_or_explain(overrides):
    data = {"name": "p", "target": {"model": "a/b"}, "draft": {"model": "a/c"}, **overrides}
    try:
        config = parse_config(data)
    except ConfigError as exc:
        assert any(f in str(exc) for f in ("speculative", "build", "serve")), str(exc)
    else:
        assert 1 <= config.speculative.max_draft_len <= 16
        build = config.build  # a limit left out is derived from the models by `check`
        assert None in (build.max_input_len, build.max_seq_len) or build.max_input_len < build.max_seq_len
        assert yaml.safe_load(yaml.safe_dump(config.resolved()))  # round-trips as plain data
