#!/usr/bin/env bash
# GPU smoke test of the trtllm backend, end to end, on the smallest real pair we ship a recipe for:
#   target Qwen/Qwen2.5-1.5B-Instruct, draft Qwen/Qwen2.5-0.5B-Instruct (one tokenizer, both 151936 rows,
#   ungated on the Hugging Face hub; about 4 GB of downloads).
#
# Where:  a machine with one NVIDIA GPU (Ampere or newer, >= 24 GB), inside the Triton TRT-LLM container of the
#         pinned release, with this repository mounted:
#           docker run --rm -it --gpus all --ipc=host -v "$PWD":/work -w /work \
#             -e HF_TOKEN nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3 bash scripts/gpu_smoke.sh
# What:   1. checks that TensorRT-LLM 1.2.1 and a GPU are present and that the recorded trtllm-build contract
#            (tests/data/trtllm_1.2.1_api.json) matches the installed release;
#         2. `python -m pipeline check` and `python -m pipeline build` (converter API + trtllm-build) for the pair;
#         3. greedy decoding of a few prompts target-only (K=0) and speculative (K=4) on the same engines;
#         4. fails unless the two outputs are token-identical; prints speedup and acceptance.
# Knobs:  SMOKE_DIR (work folder, default /tmp/specpipe-smoke), SMOKE_TOKENS (new tokens per prompt, default 128),
#         SMOKE_K (draft length, default 4). Needs network for the model download on the first run.
# Status: written against TensorRT-LLM 1.2.1's API; NOT yet run by us on any GPU (see docs/gpu.md).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SMOKE_DIR="${SMOKE_DIR:-/tmp/specpipe-smoke}"
SMOKE_TOKENS="${SMOKE_TOKENS:-128}"
SMOKE_K="${SMOKE_K:-4}"
NAME="smoke-qwen2.5-1.5b_qwen2.5-0.5b"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # the container's torch stays; we do not pip install ours
mkdir -p "$SMOKE_DIR"
cd "$REPO"

echo "== 1. environment"
python3 - <<'EOF'
import sys
import torch
try:
    import tensorrt_llm
except ImportError as exc:
    sys.exit(f"TensorRT-LLM is not importable ({exc}); run inside nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3")
if not torch.cuda.is_available():
    sys.exit("no CUDA GPU visible; start the container with --gpus all")
print(f"tensorrt_llm {tensorrt_llm.__version__}, torch {torch.__version__}, GPU {torch.cuda.get_device_name(0)}")
if tensorrt_llm.__version__ != "1.2.1":
    print(f"WARNING: pinned release is 1.2.1, found {tensorrt_llm.__version__}")
EOF
command -v trtllm-build >/dev/null || { echo "trtllm-build not on PATH"; exit 1; }
if python3 -c "import pytest" 2>/dev/null; then
  python3 -m pytest -q -p no:cacheprovider "tests/test_trtllm_contract.py::test_contract_matches_installed_trtllm"
else
  echo "pytest not installed: skipping the contract-vs-installed check (pip install pytest to run it)"
fi

echo "== 2. config, check, build"
CONFIG="$SMOKE_DIR/$NAME.yaml"
cat > "$CONFIG" <<EOF
name: $NAME
backend: trtllm
target: {model: Qwen/Qwen2.5-1.5B-Instruct, dtype: bfloat16}
draft: {model: Qwen/Qwen2.5-0.5B-Instruct, dtype: bfloat16}
speculative: {max_draft_len: $SMOKE_K, acceptance: rejection}
build:
  max_batch_size: 4
  max_input_len: 1024
  max_seq_len: 2048
  parallel: {tp: 1, pp: 1}
  kv_cache: {paged: true, tokens_per_block: 64, free_gpu_mem_fraction: 0.5, enable_block_reuse: true}
runtime: {target_device_ids: [0], draft_device_ids: [0]}
EOF
python3 -m pipeline check "$CONFIG"
python3 -m pipeline build "$CONFIG" --dry-run --engines-dir "$SMOKE_DIR/engines"
python3 -m pipeline build "$CONFIG" --engines-dir "$SMOKE_DIR/engines"

echo "== 3. target-only vs speculative, greedy"
ENGINES="$SMOKE_DIR/engines/$NAME" TOKENS="$SMOKE_TOKENS" python3 - <<'EOF'
import os
import sys
import time

from pipeline.executor import SpeculativeExecutor

prompts = [
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List five capital cities in Europe and one fact about each.",
    "Summarise the plot of Romeo and Juliet.",
]
tokens = int(os.environ["TOKENS"])
ex = SpeculativeExecutor.from_engines(os.environ["ENGINES"])
ex.generate(prompts[:1], 8)  # warm-up: first requests pay for CUDA graph and allocator set-up
ex.generate(prompts[:1], 8, max_draft_len=0)

def timed(**kw):
    start = time.perf_counter()
    results = ex.generate(prompts, tokens, temperature=0.0, **kw)
    return results, time.perf_counter() - start

plain, t_plain = timed(max_draft_len=0)
spec, t_spec = timed()
failed = False
for prompt, a, b in zip(prompts, plain, spec):
    same = a.token_ids == b.token_ids
    failed |= not same
    where = "" if same else next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                                 min(len(a.token_ids), len(b.token_ids)))
    print(f"[{'ok' if same else 'DIFF at token ' + str(where)}] {prompt[:40]!r}: {b.stats.summary()}")
n_plain = sum(len(r.token_ids) for r in plain)
n_spec = sum(len(r.token_ids) for r in spec)
stats = spec[0].stats
for r in spec[1:]:
    stats = stats.merge(r.stats)
print(f"target-only: {n_plain / t_plain:.1f} tok/s; speculative K={ex.max_draft_len}: {n_spec / t_spec:.1f} tok/s; "
      f"speedup {t_plain / t_spec * n_spec / n_plain:.2f}x")
print(f"acceptance {stats.acceptance_rate:.2f}, {stats.mean_accepted_len:.2f} tokens per target step")
if failed:
    sys.exit("FAIL: speculative greedy output differs from target-only greedy output")
print("PASS: outputs token-identical")
EOF
