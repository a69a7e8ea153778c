"""Stage outputs that describe themselves: atomic folders, manifests, "up to date" checks and a build lock.

A stage writes into ``<out>.tmp-<pid>`` and renames it to ``<out>`` only after ``manifest.json`` (written last) is
in place, so a killed build never leaves a folder that looks complete. The manifest records a key over the
stage's inputs (content hashes, resolved config, versions); the next run compares keys and skips the stage.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

from .errors import EngineError

MANIFEST = "manifest.json"
SCHEMA_VERSION = 1


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def content_hashes(folder: Path, skip: tuple[str, ...] = (MANIFEST,)) -> dict[str, str]:
    """sha256 of every file under ``folder`` (relative path -> hex digest).

    Hub snapshots are symlinks into ``blobs/<sha256>`` for large files; that name already is the content hash,
    so multi-GB weights are not read again.
    """
    hashes = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel in skip or "/." in f"/{rel}":
            continue
        target = Path(os.path.realpath(path))
        blob = target.name
        if path.is_symlink() and target.parent.name == "blobs" and len(blob) == 64:
            hashes[rel] = blob
        else:
            hashes[rel] = sha256_file(path)
    return hashes


def canonical_hash(data: object) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def tool_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    found = {"pipeline": __version__, "python": platform.python_version()}
    for pkg in ("torch", "transformers", "safetensors", "tokenizers", "tensorrt_llm", "tensorrt"):
        with contextlib.suppress(PackageNotFoundError):
            found[pkg] = version(pkg)
    return found


def read_manifest(folder: Path) -> dict | None:
    """The manifest of a completed stage, or None when the folder is absent or incomplete.

    Raises EngineError when the manifest exists but was edited by hand (its checksum no longer matches).
    """
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise EngineError(f"{path}: manifest is not valid JSON; delete {folder} and rebuild "
                          f"(or rerun with --force)") from None
    claimed = data.pop("manifest_sha256", None)
    if claimed != canonical_hash(data):
        raise EngineError(f"{path}: manifest was modified after it was written (checksum mismatch); delete "
                          f"{folder} or rerun with --force to rebuild it")
    return data


def write_manifest(folder: Path, data: dict) -> None:
    data = dict(data)
    data["manifest_sha256"] = canonical_hash(data)
    tmp = folder / (MANIFEST + ".partial")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, folder / MANIFEST)


@dataclass
class StageResult:
    stage: str
    role: str
    path: Path
    status: str  # "built" or "up to date"
    seconds: float
    manifest: dict


def run_stage(stage: str, role: str, out_dir: Path, inputs: dict, config: dict,
              produce: Callable[[Path], dict | None], force: bool = False) -> StageResult:
    """Run ``produce(tmp_dir)`` unless ``out_dir`` already holds a manifest for the same inputs.

    ``inputs`` must capture everything the output depends on (hashes, resolved config, versions); ``produce``
    may return extra facts (argv, timings) to store in the manifest.
    """
    start = time.perf_counter()
    key = canonical_hash({"stage": stage, "role": role, "inputs": inputs, "config": config})
    existing = read_manifest(out_dir) if out_dir.exists() else None
    if existing and existing.get("input_key") == key and not force:
        return StageResult(stage, role, out_dir, "up to date", time.perf_counter() - start, existing)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        extra = produce(tmp) or {}
        # Fault-injection hook for the kill test: widens the window in which outputs exist but no manifest does.
        time.sleep(float(os.environ.get("PIPELINE_STAGE_DELAY_S") or 0))
        manifest = {
            "schema": SCHEMA_VERSION, "stage": stage, "role": role, "input_key": key, "inputs": inputs,
            "config": config, "versions": tool_versions(), "created": datetime.now(timezone.utc).isoformat(),
            "timings": {"seconds": round(time.perf_counter() - start, 3)},
            "outputs": content_hashes(tmp), **extra,
        }
        write_manifest(tmp, manifest)
        _swap_in(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return StageResult(stage, role, out_dir, "built", time.perf_counter() - start, manifest)


def _swap_in(tmp: Path, out_dir: Path) -> None:
    # rename() cannot replace a non-empty folder, so the old output moves aside first; between the two renames
    # no folder named out_dir exists, which readers treat as "not built", never as complete.
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _remove_stale_temps(out_dir: Path) -> None:
    """Delete temp folders left by killed runs (their pid is gone)."""
    for leftover in out_dir.parent.glob(f".{out_dir.name}.*-*"):
        pid = leftover.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def build_lock(root: Path, wait: bool = True) -> Iterator[None]:
    """One build per engines/<name> at a time; a second waits (or stops with a message when wait=False)."""
    root.mkdir(parents=True, exist_ok=True)
    lock_path = root / ".lock"
    with open(lock_path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            if not wait:
                raise EngineError(f"{root}: another build holds the lock (pid {holder}); wait for it to finish "
                                  f"or stop it") from None
            print(f"waiting for another build of {root.name} (pid {holder}) to finish...", file=sys.stderr,
                  flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
