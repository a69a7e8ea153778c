"""pipeline/artifacts.py: stage outputs that describe themselves (atomic folders, manifests, "up to date", the lock).

Damaged, hostile or interrupted engine folders (issue 12, items d, g, h, l): `build` never calls damaged outputs "up to
date", `run` names the damaged engine file (not the source model), leftovers of killed builds are swept, and a hostile
lock or manifest is one `error:` line. A failed, killed or concurrent stage never leaves anything that looks complete.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.artifacts import build_lock, read_manifest, run_stage
from pipeline.errors import EngineError
from tests.conftest import PY, REPO, run_cli, tiny_config_dict, write_config


@pytest.fixture(scope="module")
def built(tiny_pair, tmp_path_factory):
    base = tmp_path_factory.mktemp("reliability-artifacts")
    config = write_config(base, tiny_config_dict(tiny_pair, name="rel"))
    result = run_cli("build", str(config), "--engines-dir", str(base / "engines"))
    assert result.returncode == 0, result.stderr
    return config, base / "engines"


@pytest.fixture
def engines(built, tmp_path):
    config, source = built
    shutil.copytree(source, tmp_path / "engines", symlinks=True)
    return config, tmp_path / "engines"


def _one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr[-3000:]
    return errors[0]


def _run(config, engines):
    return run_cli("run", str(config), "--engines-dir", str(engines), "--prompt", "def", "--max-new-tokens", "2")


def _weights(engines: Path) -> Path:
    return engines / "rel" / "target" / "build" / "model.safetensors"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_build_rebuilds_damaged_outputs_instead_of_calling_them_up_to_date(engines, damage):
    config, engines = engines
    weights = _weights(engines)
    original = read_manifest(weights.parent)["outputs"]["model.safetensors"]
    weights.unlink() if damage == "delete" else _truncate(weights)
    result = run_cli("build", str(config), "--engines-dir", str(engines))
    assert result.returncode == 0, result.stderr
    assert "model.safetensors" in result.stderr and "rebuilding" in result.stderr, result.stderr
    assert "build    target  built" in result.stdout, result.stdout
    assert read_manifest(weights.parent)["outputs"]["model.safetensors"] == original  # rebuilt the same bytes
    assert not list(weights.parent.parent.glob(".build.*"))


def test_same_size_overwrite_is_found_by_verify(engines):
    config, engines = engines
    weights = _weights(engines)
    info = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-8:] = b"\xff" * 8  # the last weight values change, size and header stay
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(info.st_atime_ns, info.st_mtime_ns))  # what a careful tamperer (or a backup tool) does
    quick = run_cli("build", str(config), "--engines-dir", str(engines))
    assert quick.returncode == 0 and "build    target  up to date" in quick.stdout  # sizes and mtimes match
    verified = run_cli("build", str(config), "--engines-dir", str(engines), "--verify")
    assert verified.returncode == 0, verified.stderr
    assert "content differs" in verified.stderr and "build    target  built" in verified.stdout, verified.stderr


def test_run_names_the_damaged_engine_file_not_the_source_model(engines):
    config, engines = engines
    _truncate(_weights(engines))
    line = _one_error_line(_run(config, engines))
    assert str(_weights(engines)) in line and "target.model" not in line, line
    assert "python -m pipeline build" in line, line


def test_hand_edited_engine_json_is_refused(engines):
    config, engines = engines
    engine_json = engines / "rel" / "target" / "build" / "engine.json"
    data = json.loads(engine_json.read_text())
    data["max_input_len"] = 100000  # the probe's edit: prompts beyond what the engine was built for
    engine_json.write_text(json.dumps(data, indent=2) + "\n")
    line = _one_error_line(_run(config, engines))
    assert "engine.json" in line and "modified" in line, line
    rebuilt = run_cli("build", str(config), "--engines-dir", str(engines))
    assert rebuilt.returncode == 0 and "engine.json" in rebuilt.stderr
    assert json.loads(engine_json.read_text())["max_input_len"] == 256


@pytest.mark.parametrize("content", ["[]", '"a string"', "\xff\xfe garbage"], ids=["list", "string", "binary"])
def test_manifest_that_is_not_an_object(engines, content):
    config, engines = engines
    manifest = engines / "rel" / "target" / "build" / "manifest.json"
    manifest.write_bytes(content.encode("latin-1"))
    line = _one_error_line(_run(config, engines))
    assert "manifest.json" in line and "--force" in line, line


@pytest.mark.parametrize("garbage", ["bytes", "types"])
def test_garbage_engine_json(engines, garbage):
    config, engines = engines
    engine_json = engines / "rel" / "draft" / "build" / "engine.json"
    if garbage == "bytes":
        engine_json.write_bytes(b"\x00\x01{not json")
    else:  # valid JSON, wrong types: nothing read it as typed data before loading the weights
        engine_json.write_text(json.dumps({**json.loads(engine_json.read_text()), "dtype": {"x": [1]}}))
    line = _one_error_line(_run(config, engines))
    assert "draft/build/engine.json" in line, line


def test_killed_force_build_leftovers_are_swept_by_an_up_to_date_build(engines):
    config, engines = engines
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs: what a killed `build --force` leaves in its temp folder's name
    leftovers = [engines / "rel" / "target" / f".convert.tmp-{dead.pid}",
                 engines / "rel" / "draft" / f".build.old-{dead.pid}"]
    for folder in leftovers:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 100_000)
    result = run_cli("build", str(config), "--engines-dir", str(engines))
    assert result.returncode == 0 and "built" not in result.stdout.split("path", 1)[1], result.stdout
    assert not any(folder.exists() for folder in leftovers)


def test_lock_that_is_a_folder(engines):
    config, engines = engines
    lock = engines / "rel" / ".lock"
    lock.unlink()
    lock.mkdir()
    line = _one_error_line(run_cli("build", str(config), "--engines-dir", str(engines)))
    assert ".lock" in line and "folder" in line, line


def test_symlinked_lock_is_not_followed(engines, tmp_path):
    config, engines = engines
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    lock = engines / "rel" / ".lock"
    lock.unlink()
    lock.symlink_to(victim)
    line = _one_error_line(run_cli("build", str(config), "--engines-dir", str(engines)))
    assert ".lock" in line and "symlink" in line, line
    assert victim.read_text() == "precious\n"


def test_write_failure_mid_stage_is_one_line_and_leaves_nothing(tiny_pair, tmp_path):
    # RLIMIT_FSIZE makes writes past 1 MB fail with EFBIG the way a full disk fails them with ENOSPC (Python
    # ignores SIGXFSZ), inside safetensors' Rust writer: the probe's "disk full" traceback.
    config = write_config(tmp_path, tiny_config_dict(tiny_pair, name="full"))
    engines = tmp_path / "engines"

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([PY, "-m", "pipeline", "convert", str(config), "--engines-dir", str(engines)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                            preexec_fn=limit_file_size)
    line = _one_error_line(result)
    assert "File too large" in line and "target" in line and "free space" in line, line
    role = engines / "full" / "target"
    assert not (role / "convert").exists() and not list(role.glob(".convert.*"))


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


@pytest.mark.slow
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


def test_failed_stage_leaves_nothing_that_looks_complete(tmp_path):
    out = tmp_path / "engines" / "x" / "target" / "build"

    def explode(tmp):
        (tmp / "half-written.bin").write_bytes(b"\0" * 10)
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        run_stage("build", "target", out, {"a": 1}, {}, explode)
    assert not out.exists()
    assert list(out.parent.iterdir()) == []  # the temp folder is gone too


def test_failed_rebuild_keeps_previous_output(tmp_path):
    out = tmp_path / "stage"
    run_stage("build", "target", out, {"a": 1}, {}, lambda tmp: (tmp / "w").write_text("v1") and None)

    def explode(tmp):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        run_stage("build", "target", out, {"a": 2}, {}, explode)
    assert (out / "w").read_text() == "v1" and read_manifest(out)["inputs"] == {"a": 1}


def test_hand_edited_manifest_is_refused(tmp_path):
    out = tmp_path / "stage"
    run_stage("build", "target", out, {"a": 1}, {}, lambda tmp: None)
    data = json.loads((out / "manifest.json").read_text())
    data["inputs"]["a"] = 2
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(EngineError, match="modified after it was written"):
        read_manifest(out)
