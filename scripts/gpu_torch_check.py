"""The torch backend on a GPU: verify cost per K, target-only vs speculative tok/s, greedy parity with the margin rule.

Runs on random-init Llama models (no hub, no network): a ~0.85B target (hidden 2048, 16 layers, 32 heads, 8 KV heads,
intermediate 5632, vocab 32000) and a "self-draft" made of the target's first 2 layers, its final norm and LM head
(weights copied), so the draft shares the target's behaviour; the target as its own draft (acceptance 1.0) is the
upper bound of the loop. Prompts are token-id lists, so no tokenizer is needed.

    python scripts/gpu_torch_check.py [--device cuda] [--dtype bfloat16] [--tiny]
    (on a GPU box use scripts/gpu_torch_check.sh: it installs missing packages from the carried .gpu_wheels/)

1. environment; 2. `import pipeline.executor`; 3. the models; 4. one target forward over K+1 new tokens after a
~128-token context vs over 1 token, K = 0..8 (the executor's own runner and KV cache, CUDA-synchronised, median);
5. batch-1 greedy tok/s via SpeculativeExecutor.generate for K in {0, 2, 4, 6} (self-draft) and K=4 (target as
draft), interleaved over rounds, best round kept; 6. greedy parity: every speculative output vs target-only, and
target-only vs Hugging Face generate(do_sample=False); at the first divergence the target's top-2 logit margin
(pipeline/parity.py: rule and threshold, shared with scripts/gpu_smoke_check.py) tells a bf16 near-tie flip from a bug.

Exit status: 0 pass, 1 parity failure (or a crash inside a measurement: result "ERROR", the figures gathered so far
are kept), 2 environment problem (no torch, no CUDA, pipeline.executor not importable, models not buildable).
Writes $OUT/gpu_torch_check.json when $OUT is set (or --json PATH); it holds every figure and the summary block.
``--missing-deps``, ``--wheel-list``, ``--pack-wheels``, ``--unpack-wheels``, ``--install-wheels`` serve gpu_torch_check.sh and
gpu_wheels.sh (standard library only).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

EXIT_PASS, EXIT_PARITY, EXIT_ENV = 0, 1, 2
REPO = Path(__file__).resolve().parents[1]

# What `import pipeline.executor` (and this script: LlamaForCausalLM, safetensors) loads beyond torch and the
# standard library, found with `python -X importtime -c "import pipeline.executor"` + sys.modules after a tiny run.
# (distribution, version we test with, kind, python versions it is needed on). kind: "pure" (one py3 wheel for all),
# "compiled" (one wheel per Python version; abi3 wheels come out once). Torch's own requirements (filelock,
# typing-extensions, sympy, networkx, jinja2, fsspec) come with torch; filelock and typing-extensions are listed
# because huggingface-hub and pydantic need newer ones than old torch installs may have.
WHEELS = [
    ("transformers", "5.24.0", "pure", None),
    ("huggingface_hub", "2.4.0", "pure", None),
    ("tokenizers", "0.23.3", "compiled", None),
    ("safetensors", "0.8.0", "compiled", None),
    ("regex", "2026.11.19", "compiled", None),
    ("PyYAML", "6.0.4", "compiled", None),
    ("packaging", "26.4", "pure", None),
    ("tqdm", "4.70.1", "pure", None),
    ("filelock", "4.3.2", "pure", None),
    ("fsspec", "2026.9.0", "pure", None),
    ("typing_extensions", "4.16.0", "pure", None),
    ("httpx2", "2.16.2", "pure", None),
    ("httpcore2", "2.16.2", "pure", None),
    ("anyio", "4.16.0", "pure", None),
    ("idna", "3.20", "pure", None),
    ("h11", "0.16.0", "pure", None),
    ("truststore", "0.10.5", "pure", None),
    ("pydantic", "2.14.4", "pure", None),
    ("pydantic_core", "2.50.5", "compiled", None),
    ("annotated_types", "0.8.0", "pure", None),
    ("typing_inspection", "0.4.5", "pure", None),
    ("numpy", "1.26.4", "compiled", None),  # transformers imports it; torch does not require it
    ("llguidance", "1.9.1", "compiled", None),
]
TRANSFORMERS_PIN = "5.24.0"
PROBE_MODULES = ["transformers", "pydantic", "yaml", "safetensors", "tokenizers", "huggingface_hub", "numpy", "tqdm"]


# ---- stdlib-only helpers for the shell scripts ---------------------------------------------------------------------

def wheel_list(kind: str) -> list[str]:
    return [f"{dist}=={version}" for dist, version, k, _ in WHEELS if kind in ("all", k)]


def missing_deps() -> list[str]:
    """dist==version lines to install from the carried wheels: none when this Python already has the pinned
    transformers and pipeline.executor's imports resolve; else the whole tested set (so versions stay consistent),
    except numpy when one is importable (torch was built against that one)."""
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    need = version("transformers") != TRANSFORMERS_PIN
    for module in ("pydantic", "yaml", "tqdm", "numpy", "safetensors", "huggingface_hub"):
        need = need or importlib.util.find_spec(module) is None
    if not need:
        return []
    here = sys.version_info[:2]
    have_numpy = importlib.util.find_spec("numpy") is not None
    return [f"{dist}=={v}" for dist, v, _, only in WHEELS
            if (only is None or only == here) and not (dist == "numpy" and have_numpy)]


PACK_ABOVE = 2 << 20  # wheels larger than this travel as <wheel>.xz: stored zip + xz, about half the deflated size


def pack_wheels(folder: Path) -> None:
    """Replace every wheel over PACK_ABOVE bytes in ``folder`` by ``<name>.whl.xz``: the same wheel re-zipped without
    compression (member bytes unchanged, so RECORD still holds), then xz. numpy shrinks from ~18 to ~9 MiB."""
    import lzma
    import zipfile

    for wheel in sorted(folder.glob("*.whl")):
        if wheel.stat().st_size <= PACK_ABOVE:
            continue
        packed = wheel.with_name(wheel.name + ".xz")
        stored = wheel.with_name(wheel.name + ".stored")
        with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(stored, "w", zipfile.ZIP_STORED) as dst:
            for info in src.infolist():
                data = src.read(info)  # read with the member's own compression, then store it plain
                info.compress_type = zipfile.ZIP_STORED
                dst.writestr(info, data)
        with open(stored, "rb") as fin, lzma.open(packed, "wb", preset=9 | lzma.PRESET_EXTREME) as fout:
            while chunk := fin.read(1 << 20):
                fout.write(chunk)
        stored.unlink()
        print(f"packed {wheel.name}: {wheel.stat().st_size >> 10} KiB -> {packed.stat().st_size >> 10} KiB")
        wheel.unlink()


def unpack_wheels(src: Path, dst: Path) -> None:
    """Make ``dst`` a pip --find-links folder: links to src's wheels plus its .whl.xz files decompressed (lzma is in
    the standard library: no xz binary needed on the GPU box)."""
    import lzma
    import shutil

    dst.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.iterdir()):
        if path.name.endswith(".whl"):
            target = dst / path.name
            if not target.exists():
                target.symlink_to(path.resolve())
        elif path.name.endswith(".whl.xz"):
            target = dst / path.name[:-3]
            if not target.exists():
                with lzma.open(path, "rb") as fin, open(target, "wb") as fout:
                    shutil.copyfileobj(fin, fout, 1 << 20)


def install_wheels(links: Path, target: Path, requirements: list[str]) -> None:
    """What ``pip install --no-deps --target`` does with plain wheels, for a Python without pip: pick the wheel of
    each dist==version that fits this interpreter (py3, its own cpXY, or abi3 at or below it; x86_64 Linux) and
    unzip it into ``target`` (.data/purelib and platlib merged in)."""
    import shutil
    import zipfile

    here = sys.version_info[:2]
    files = sorted(p.name for p in links.iterdir() if p.name.endswith(".whl"))
    for requirement in requirements:
        dist, version = requirement.split("==")
        stem = f"{dist.lower().replace('-', '_')}-{version}-"
        chosen = None
        for name in files:
            if not name.lower().startswith(stem):
                continue
            py, abi, plat = name[:-4].split("-")[-3:]
            pys = py.split(".")
            fits = ("py3" in pys or f"cp{here[0]}{here[1]}" in pys or
                    (abi == "abi3" and any(p.startswith("cp3") and int(p[3:]) <= here[1] for p in pys)))
            if fits and (plat == "any" or "x86_64" in plat):
                chosen = name
                break
        if chosen is None:
            raise SystemExit(f"no wheel for {requirement} and Python {here[0]}.{here[1]} in {links}")
        with zipfile.ZipFile(links / chosen) as wheel:
            wheel.extractall(target)
        for data in target.glob("*.data"):
            for sub in ("purelib", "platlib"):
                if (data / sub).is_dir():
                    for item in (data / sub).iterdir():
                        shutil.move(str(item), str(target / item.name))
            shutil.rmtree(data)
        print(f"  unzipped {chosen}")


def environment() -> dict:
    importable = {}
    for name in PROBE_MODULES:
        try:
            module = importlib.import_module(name)
            where = str(Path(getattr(module, "__file__", "") or "?").parent.parent)
            importable[name] = f"{getattr(module, '__version__', 'yes')} ({where})"
        except Exception as exc:  # noqa: BLE001 - any failure means "not usable here"
            importable[name] = f"no ({type(exc).__name__}: {exc})"[:120]
    installed = os.environ.get("GPU_TORCH_CHECK_INSTALLED", "").split()  # set by gpu_torch_check.sh
    return {"python": platform.python_version(), "executable": sys.executable, "importable": importable,
            "installed_from_wheels": installed}


# ---- models --------------------------------------------------------------------------------------------------------

FULL = dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
            intermediate_size=5632)
TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128)
DRAFT_LAYERS = 2


def llama_config(shape: dict, layers: int | None = None):
    from transformers import LlamaConfig

    config = LlamaConfig(**{**shape, **({"num_hidden_layers": layers} if layers else {})},
                         max_position_embeddings=2048, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)  # no EOS: every run is full length
    config._attn_implementation = "sdpa"
    return config


def build_models(shape: dict, device, dtype, seed: int, deep_scale: float):
    """(target, self-draft): random-init target; the draft holds copies of its first DRAFT_LAYERS layers, embedding,
    final norm and LM head.

    In a random-init Llama every layer adds about as much to the residual stream as the embedding, so a truncated
    copy agrees with the full model on ~0% of argmaxes (16 layers) and acceptance is 0. ``deep_scale`` multiplies the
    output projections (o_proj, down_proj) of the target's layers past the draft's, so those layers perturb rather
    than replace what the first layers computed: the target then behaves like a model with a well-matched draft.
    The FLOPs, shapes and kernels are unchanged, so every timing is that of the full-size model. Teacher-forced
    top-1 agreement on random tokens (float32, measured on a CPU): 0.79 at 0.03, 0.71 at 0.05, 0.44 at 0.1, 0.00
    at 1 (no scaling) for the full size (0.77 at 0.05 in bfloat16); 0.8-0.9 at 0.1 for --tiny."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        target = LlamaForCausalLM(llama_config(shape)).to(dtype).eval()
        draft = LlamaForCausalLM(llama_config(shape, DRAFT_LAYERS)).to(dtype).eval()
    with torch.no_grad():
        for layer in target.model.layers[DRAFT_LAYERS:]:
            layer.self_attn.o_proj.weight.mul_(deep_scale)
            layer.mlp.down_proj.weight.mul_(deep_scale)
    state = target.state_dict()
    keep = {k: v for k, v in state.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < DRAFT_LAYERS}
    missing, unexpected = draft.load_state_dict(keep, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise RuntimeError(f"self-draft weights: missing {missing}, unexpected {unexpected}")
    for model in (target, draft):
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
    return target, draft


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def draft_agreement(target, draft, vocab: int, device, seed: int, length: int = 64) -> float:
    """Teacher-forced top-1 agreement of draft and target on random tokens (an acceptance estimate)."""
    import torch

    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed + 2)).to(device)
    with torch.inference_mode():
        t = target(input_ids=ids).logits[0].float().argmax(-1)
        d = draft(input_ids=ids).logits[0].float().argmax(-1)
    return float((t == d).float().mean())


# ---- measurements --------------------------------------------------------------------------------------------------

class Clock:
    def __init__(self, device):
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self.torch = torch

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def __call__(self, fn, *args, **kw):
        self.sync()
        start = time.perf_counter()
        out = fn(*args, **kw)
        self.sync()
        return out, time.perf_counter() - start


def verify_cost(target, device, context: int, k_max: int, reps: int, warmup: int, seed: int) -> list[dict]:
    """One target forward over K+1 new tokens after ``context`` cached tokens, with the executor's runner."""
    import torch
    from pipeline.executor.model_runner import BatchModelRunner

    clock = Clock(device)
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (context + k_max + 1,), generator=gen).tolist()
    runner = BatchModelRunner(target, device, max_tokens=context + k_max + 8, block_size=16,
                              max_blocks=(context + k_max + 8) // 16 + 2)
    runner.open("verify", [])
    runner.forward(["verify"], [ids[:context]], logits_for=[0])
    rows = []
    for k in range(k_max + 1):
        new = [ids[context:context + k + 1]]
        times = []
        for i in range(warmup + reps):
            _, seconds = clock(runner.forward, ["verify"], new)
            runner.truncate("verify", context)
            if i >= warmup:
                times.append(seconds * 1000)
        rows.append({"k": k, "new_tokens": k + 1, "ms": statistics.median(times), "ms_min": min(times)})
    for row in rows:
        row["ratio"] = row["ms"] / rows[0]["ms"]
    return rows


def make_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def run_generation(executors: dict, plans: list[tuple[str, str, int]], prompts, tokens: int, rounds: int,
                   device, deadline: float, report: dict) -> tuple[list[dict], dict]:
    """Batch 1 (one generate call per prompt), greedy; plans interleaved per round, best round kept.
    Returns (records, outputs[name] = token lists of the first round)."""
    clock = Clock(device)
    for name, ex_name, k in plans:  # warm-up: allocator, cuBLAS handles, KV buffers of every shape in use
        executors[ex_name].generate([prompts[0]], max_new_tokens=min(tokens, 16), temperature=0.0, max_draft_len=k)
    best: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    for rnd in range(rounds):
        if rnd > 0 and time.monotonic() > deadline:
            print(f"  (time budget reached: {rnd} of {rounds} rounds run)")
            report.setdefault("notes", []).append(f"time budget: {rnd} of {rounds} rounds run")
            break
        for name, ex_name, k in plans:
            ex = executors[ex_name]
            results, seconds = [], 0.0
            for prompt in prompts:
                out, dt = clock(ex.generate, [prompt], max_new_tokens=tokens, temperature=0.0, max_draft_len=k)
                results.append(out[0])
                seconds += dt
            generated = sum(len(r.token_ids) for r in results)
            stats = results[0].stats
            for r in results[1:]:
                stats = stats.merge(r.stats)
            record = {"name": name, "draft": ex_name, "k": k, "tokens": generated, "seconds": seconds,
                      "tok_s": generated / seconds, "acceptance_rate": stats.acceptance_rate,
                      "mean_accepted_len": stats.mean_accepted_len, "target_steps": stats.target_steps,
                      "acceptance_by_position": stats.acceptance_by_position}
            if name not in best or record["tok_s"] > best[name]["tok_s"]:
                best[name] = record
            outputs.setdefault(name, [list(r.token_ids) for r in results])
            if outputs[name] != [list(r.token_ids) for r in results]:  # nondeterministic kernels: worth knowing
                report.setdefault("notes", []).append(f"{name}: greedy output changed between rounds")
                print(f"  note: {name}: greedy output changed between rounds (parity uses round 1)")
    records = [best[name] for name, _, _ in plans if name in best]
    base = best[plans[0][0]]["tok_s"]
    for record in records:
        record["speedup"] = record["tok_s"] / base
    return records, outputs


def parity_check(target, prompts, reference: list[list[int]], other: list[list[int]], label: str, device) -> dict:
    """Compare two greedy outputs per prompt with pipeline.parity's margin rule.

    Near tie (tolerated) per pipeline/parity.py: the two tokens are the target's top two and top1 - top2 <= the
    threshold. A random-init model's logits are nearly flat, so a third token can sit inside rounding noise too;
    the check also records ``gap`` = top1 - min(logit[plain], logit[spec]) (float32 of the model-dtype logits) and
    tolerates a divergence when gap <= threshold (for a two-way tie gap == margin)."""
    import torch
    from pipeline.parity import MARGIN_THRESHOLD, divergence

    cache: dict[tuple, torch.Tensor] = {}

    @torch.inference_mode()
    def next_logits(ids: list[int]):
        key = tuple(ids)
        if key not in cache:
            x = torch.tensor([ids], dtype=torch.long, device=device)
            cache[key] = target(input_ids=x, logits_to_keep=1).logits[0, -1].float().cpu()
        return cache[key]

    rows, clear = [], 0
    for i, (prompt, a, b) in enumerate(zip(prompts, reference, other)):
        found = divergence(prompt, a, b, next_logits)
        row = {"prompt": i, "identical": found is None, "common_prefix": len(a) if found is None else found.position}
        if found is not None:
            logits = next_logits(prompt + a[:found.position])
            top = float(logits.max())
            picks = [t for t in (found.plain, found.spec) if t is not None]
            gap = max(top - float(logits[t]) for t in picks) if picks else float("inf")
            tolerated = found.near_tie or gap <= MARGIN_THRESHOLD
            clear += not tolerated
            row.update(position=found.position, plain=found.plain, spec=found.spec, best=found.best,
                       second=found.second, margin=found.margin, gap=gap, near_tie=found.near_tie,
                       tolerated=tolerated, describe=found.describe())
        rows.append(row)
    identical = sum(r["identical"] for r in rows)
    status = "FAIL" if clear else "PASS"
    print(f"  [{status}] {label}: {identical}/{len(rows)} identical" +
          "".join(f"\n      prompt {r['prompt']}: {r['describe']}; gap {r['gap']:.4f}"
                  f"{'' if r['tolerated'] else '  <-- CLEAR'}" for r in rows if not r["identical"]))
    return {"label": label, "status": status, "identical": identical, "prompts": len(rows), "clear": clear,
            "threshold": MARGIN_THRESHOLD, "rows": rows}


def hf_generate(target, prompts, tokens: int, device) -> list[list[int]]:
    import torch

    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            x = torch.tensor([prompt], dtype=torch.long, device=device)
            y = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, min_new_tokens=tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(y[0, len(prompt):].tolist())
    return outs


# ---- main ----------------------------------------------------------------------------------------------------------

def summary_block(report: dict) -> str:
    """One block with every figure, to paste into a README."""
    env = report["env"]
    lines = [f"torch backend check on {report['device_name']}: {report['dtype']}, torch {report['torch']} (CUDA "
             f"{report.get('cuda')}), transformers {(env['importable'].get('transformers') or '?').split()[0]}, "
             f"Python {env['python']}"]
    m = report["models"]
    lines.append(f"models: random-init Llama target {m['target_params'] / 1e6:.1f}M params ({m['target_layers']} "
                 f"layers, hidden {m['hidden']}, vocab {m['vocab']}; output projections of layers {m['draft_layers']}+"
                 f" x{m['deep_scale']}); self-draft {m['draft_params'] / 1e6:.1f}M = its first {m['draft_layers']} "
                 f"layers + final norm + LM head; teacher-forced top-1 agreement {m['draft_agreement']:.2f}")
    if report["verify_cost"]:
        lines.append(f"verify cost: one target forward over K+1 new tokens after {report['context']} cached tokens "
                     f"(median of {report['verify_reps']}):")
        lines.append("   K | ms      | x K=0")
        lines += [f"  {r['k']:2d} | {r['ms']:7.3f} | {r['ratio']:.2f}" for r in report["verify_cost"]]
    if report["generation"]:
        lines.append(f"batch 1, greedy, {report['new_tokens']} new tokens x {report['n_prompts']} prompts (best of "
                     f"{report['rounds']} rounds):")
        lines.append("  method               | tok/s    | speedup | acceptance | tokens/step")
        lines += [f"  {g['name']:<20} | {g['tok_s']:8.1f} | {g['speedup']:6.2f}x | {g['acceptance_rate']:10.2f} | "
                  f"{g['mean_accepted_len']:.2f}" for g in report["generation"]]
    for p in report["parity"]:
        lines.append(f"parity {p['label']}: {p['status']} ({p['identical']}/{p['prompts']} identical, "
                     f"{p['clear']} clear; threshold {p['threshold']} logits)")
        lines += [f"    prompt {r['prompt']}: first difference at token {r['position']}, top-2 margin "
                  f"{r['margin']:.4f}, gap {r['gap']:.4f} ({'near tie' if r['tolerated'] else 'CLEAR'})"
                  for r in p["rows"] if not r["identical"]]
    lines += [f"note: {n}" for n in report.get("notes", [])]
    lines += [f"error: {e}" for e in report.get("errors", [])]
    lines.append(f"result: {report['result']} (exit {report['exit_code']}); {report['seconds']:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tiny", action="store_true", help="tiny models and short runs (a CPU test)")
    parser.add_argument("--new-tokens", type=int, default=None, help="per prompt (default 128; tiny 24)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=None, help="timed forwards per K (default 20; tiny 5)")
    parser.add_argument("--context", type=int, default=None, help="cached tokens before the verify forward")
    parser.add_argument("--time-budget", type=float, default=150.0,
                        help="seconds after which later rounds are skipped (first round always runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deep-scale", type=float, default=None,
                        help="scale of the target's layers past the draft's (default 0.05; tiny 0.1; 1 = plain "
                             "random init, acceptance ~0); see build_models")
    parser.add_argument("--json", default=None, help="default: $OUT/gpu_torch_check.json when OUT is set")
    parser.add_argument("--missing-deps", action="store_true", help="print dist==version lines to install; exit")
    parser.add_argument("--wheel-list", choices=["pure", "compiled", "all"], help="print the wheel list; exit")
    parser.add_argument("--pack-wheels", metavar="DIR", help="xz the large wheels in DIR (gpu_wheels.sh); exit")
    parser.add_argument("--unpack-wheels", nargs=2, metavar=("SRC", "DST"),
                        help="SRC's wheels, unpacked, into DST (gpu_torch_check.sh); exit")
    parser.add_argument("--install-wheels", nargs="+", metavar="ARG",
                        help="LINKS TARGET DIST==VERSION...: install without pip (gpu_torch_check.sh); exit")
    args = parser.parse_args(argv)
    if args.wheel_list:
        print("\n".join(wheel_list(args.wheel_list)))
        return 0
    if args.pack_wheels:
        pack_wheels(Path(args.pack_wheels))
        return 0
    if args.unpack_wheels:
        unpack_wheels(Path(args.unpack_wheels[0]), Path(args.unpack_wheels[1]))
        return 0
    if args.install_wheels:
        install_wheels(Path(args.install_wheels[0]), Path(args.install_wheels[1]), args.install_wheels[2:])
        return 0
    if args.missing_deps:
        for requirement in missing_deps():
            print(requirement)
        return 0

    started = time.monotonic()
    report: dict = {"args": vars(args), "result": "ENV", "exit_code": EXIT_ENV}
    out = os.environ.get("OUT")
    json_path = args.json or (os.path.join(out, "gpu_torch_check.json") if out else None)

    def finish(code: int, result: str) -> int:
        report.update(exit_code=code, result=result, seconds=time.monotonic() - started)
        if "parity" in report:
            report["summary"] = summary_block(report)
        if json_path:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(json_path).write_text(json.dumps(report, indent=2, default=str))
            print(f"wrote {json_path}")
        return code

    print("== 1. environment")
    env = environment()
    report["env"] = env
    print(f"  python {env['python']} ({env['executable']})")
    print(f"  installed from .gpu_wheels by gpu_torch_check.sh: {' '.join(env['installed_from_wheels']) or 'nothing'}")
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        print(f"  ENV: torch is not importable: {exc}")
        return finish(EXIT_ENV, "ENV: no torch")
    report["torch"] = torch.__version__
    report["cuda"] = torch.version.cuda
    print(f"  torch {torch.__version__} (CUDA {torch.version.cuda}), cuda available: {torch.cuda.is_available()}")
    for name, state in env["importable"].items():
        print(f"  {name}: {state}")
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("  ENV: --device cuda but no CUDA device is visible")
            return finish(EXIT_ENV, "ENV: no CUDA")
        report["device_name"] = torch.cuda.get_device_name(device)
        props = torch.cuda.get_device_properties(device)
        report["device_props"] = {"memory_gib": round(props.total_memory / 2**30, 1),
                                  "capability": f"{props.major}.{props.minor}", "count": torch.cuda.device_count()}
        print(f"  {report['device_props']}")
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 runs stay exact; bf16 is unaffected
    else:
        report["device_name"] = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    print(f"  device: {report['device_name']}")

    print("== 2. pipeline.executor")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # the repository's pipeline package, installed or not
    try:
        from pipeline.executor import SpeculativeExecutor
        import pipeline.parity  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        print(f"  ENV: import pipeline.executor failed: {type(exc).__name__}: {exc}")
        return finish(EXIT_ENV, "ENV: pipeline.executor not importable")
    print("  import pipeline.executor: ok")

    dtype = getattr(torch, args.dtype)
    report["dtype"] = args.dtype
    shape = TINY if args.tiny else FULL
    tokens = args.new_tokens or (24 if args.tiny else 128)
    context = args.context or (32 if args.tiny else 128)
    prompt_lengths = [12, 20] if args.tiny else [32, 64, 96]
    reps = args.reps or (5 if args.tiny else 20)
    warmup = max(1, reps // 4)
    deep_scale = args.deep_scale if args.deep_scale is not None else (0.1 if args.tiny else 0.05)
    report.update(new_tokens=tokens, context=context, rounds=args.rounds, n_prompts=len(prompt_lengths),
                  verify_reps=reps)

    print("== 3. models")
    try:
        (target, draft), seconds = Clock(device)(build_models, shape, device, dtype, args.seed, deep_scale)
    except Exception as exc:  # noqa: BLE001 - out of memory, a transformers API change: the box, not the loop
        print(f"  ENV: building the models failed: {type(exc).__name__}: {exc}")
        return finish(EXIT_ENV, "ENV: model build failed")
    report["models"] = {"target_params": n_params(target), "draft_params": n_params(draft),
                        "target_layers": shape["num_hidden_layers"], "draft_layers": DRAFT_LAYERS,
                        "hidden": shape["hidden_size"], "vocab": shape["vocab_size"], "build_s": seconds,
                        "deep_scale": deep_scale,
                        "draft_agreement": draft_agreement(target, draft, shape["vocab_size"], device, args.seed)}
    print(f"  target {n_params(target) / 1e6:.1f}M params, self-draft {n_params(draft) / 1e6:.1f}M params, "
          f"{args.dtype} on {device} ({seconds:.1f} s); layers {DRAFT_LAYERS}+ output projections x{deep_scale}; "
          f"teacher-forced draft/target top-1 agreement {report['models']['draft_agreement']:.2f}")
    prompts = make_prompts(shape["vocab_size"], prompt_lengths, args.seed)

    errors: list[str] = []
    report["errors"] = errors

    def stage(name: str, fn, *a, **kw):
        """Run one measurement; a crash is recorded (traceback printed) and the check goes on where it can."""
        try:
            return fn(*a, **kw)
        except Exception as exc:  # noqa: BLE001 - keep the figures gathered so far; the run is ERROR
            traceback.print_exc()
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            print(f"  ERROR in {name}: {type(exc).__name__}: {exc}")
            return None

    print(f"== 4. verify cost: one target forward over K+1 new tokens after {context} cached tokens")
    vc = stage("verify cost", verify_cost, target, device, context, 8, reps, warmup, args.seed)
    report["verify_cost"] = vc or []
    print("   K  new   ms (median)   ratio to K=0")
    for row in vc or []:
        print(f"  {row['k']:2d}  {row['new_tokens']:3d}   {row['ms']:10.3f}   {row['ratio']:6.2f}")

    print(f"== 5. batch-1 greedy, {tokens} new tokens x {len(prompts)} prompts")
    executors = {
        "self-draft": SpeculativeExecutor(target, draft, None, max_draft_len=6, device=str(device),
                                          max_batch_size=1, max_seq_len=2048),
        "target-as-draft": SpeculativeExecutor(target, target, None, max_draft_len=4, device=str(device),
                                               max_batch_size=1, max_seq_len=2048),
    }
    plans = [("target-only K=0", "self-draft", 0)] + [(f"self-draft K={k}", "self-draft", k) for k in (2, 4, 6)] + \
        [("target-as-draft K=4", "target-as-draft", 4)]
    records, outputs = stage("generation", run_generation, executors, plans, prompts, tokens, args.rounds, device,
                             started + args.time_budget, report) or ([], {})
    report["generation"] = records
    for g in records:
        print(f"  {g['name']:<22} {g['tok_s']:8.1f} tok/s  speedup {g['speedup']:.2f}x  acceptance "
              f"{g['acceptance_rate']:.2f}  tokens/step {g['mean_accepted_len']:.2f}")

    print("== 6. greedy parity (margin rule: pipeline/parity.py)")
    report["parity"] = []
    plain = outputs.get(plans[0][0])
    if plain is not None:
        for name, _, _ in plans[1:]:
            if name in outputs:
                found = stage(f"parity {name}", parity_check, target, prompts, plain, outputs[name],
                              f"{name} vs target-only", device)
                if found:
                    report["parity"].append(found)
        hf = stage("HF generate", hf_generate, target, prompts, tokens, device)
        if hf is not None:
            found = stage("parity HF", parity_check, target, prompts, hf, plain, "target-only vs HF generate", device)
            if found:
                report["parity"].append(found)

    failed = any(p["status"] == "FAIL" for p in report["parity"])
    if failed:
        code = finish(EXIT_PARITY, "FAIL" + (f" (and {len(errors)} errors)" if errors else ""))
    elif errors:
        code = finish(EXIT_PARITY, f"ERROR ({len(errors)}): " + "; ".join(errors))
    else:
        code = finish(EXIT_PASS, "PASS")
    print("== summary")
    print(report["summary"])
    return code


if __name__ == "__main__":
    sys.exit(main())
