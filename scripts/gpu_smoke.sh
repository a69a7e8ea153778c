#!/usr/bin/env bash
# GPU smoke test of the trtllm backend, end to end, on the smallest real pair we ship a recipe for:
#   target Qwen/Qwen2.5-1.5B-Instruct, draft Qwen/Qwen2.5-0.5B-Instruct (one tokenizer, both 151936 rows,
#   ungated on the Hugging Face hub; about 4 GB of downloads).
#
# Where:  a machine with one NVIDIA GPU (Ampere or newer, >= 24 GB), inside the Triton TRT-LLM container of the
#         pinned release, with this repository mounted:
#           docker run --rm -it --gpus all --ipc=host -v "$PWD":/work -w /work \
#             -e HF_TOKEN nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3 bash scripts/gpu_smoke.sh
# What:   1. fails unless the installed TensorRT-LLM is the pinned release (pipeline/backends/trtllm_api.py) and a
#            GPU is visible; then runs the tests marked gpu: every generated trtllm-build argv parsed by the
#            installed tensorrt_llm.commands.build.parse_arguments(), the recorded option list and
#            ModelRunnerCpp.from_dir/generate signatures (tests/data/trtllm_<release>_api.json) against the installed
#            ones, and the recorded Triton templates against the container's /app/all_models;
#         2. `python -m pipeline check` and `python -m pipeline build` (converter API + trtllm-build) for the pair;
#         3. greedy decoding of a few prompts target-only (K=0) and speculative (K=4) on the same engines
#            (scripts/gpu_smoke_check.py): where the two differ it prints the first differing token and the
#            target's top-2 logit margin there, and fails only when that margin is clear (> 0.5 logits; a flip
#            across a near tie is bf16 rounding); prints speedup and acceptance.
# Knobs:  SMOKE_DIR (work folder, default /tmp/specpipe-smoke), SMOKE_TOKENS (new tokens per prompt, default 128),
#         SMOKE_K (draft length, default 4), SMOKE_MARGIN (logit threshold, default 0.5). Needs network for the
#         model download on the first run, and pytest and tritonclient (`pip install pytest 'tritonclient[grpc]'`
#         in the container; the tests and `deploy` build config.pbtxt files with tritonclient's protobuf classes).
# Status: written against TensorRT-LLM 1.1.0's API; NOT yet run by us on any GPU (see docs/gpu.md).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SMOKE_DIR="${SMOKE_DIR:-/tmp/specpipe-smoke}"
SMOKE_TOKENS="${SMOKE_TOKENS:-128}"
SMOKE_K="${SMOKE_K:-4}"
NAME="smoke-qwen2.5-1.5b_qwen2.5-0.5b"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # the container's torch stays; we do not pip install ours
mkdir -p "$SMOKE_DIR"
cd "$REPO"

echo "== 1. environment and contract"
python3 - <<'EOF'
import sys

import torch

from pipeline.backends.trtllm_api import PINNED_VERSION, TRITON_CONTAINER

try:
    import tensorrt_llm
except ImportError as exc:
    sys.exit(f"FAIL: TensorRT-LLM is not importable ({exc}); run inside {TRITON_CONTAINER}")
if tensorrt_llm.__version__ != PINNED_VERSION:
    sys.exit(f"FAIL: installed TensorRT-LLM is {tensorrt_llm.__version__} but this pipeline is pinned to "
             f"{PINNED_VERSION} (engines only load in the release that built them); run inside {TRITON_CONTAINER}")
if not torch.cuda.is_available():
    sys.exit("FAIL: no CUDA GPU visible; start the container with --gpus all")
print(f"tensorrt_llm {tensorrt_llm.__version__} (pinned {PINNED_VERSION}), torch {torch.__version__}, "
      f"GPU {torch.cuda.get_device_name(0)}")
EOF
command -v trtllm-build >/dev/null || { echo "FAIL: trtllm-build not on PATH"; exit 1; }
python3 -c "import pytest, tritonclient.grpc" 2>/dev/null || {
  echo "FAIL: pytest or tritonclient is missing; pip install pytest 'tritonclient[grpc]', then rerun"; exit 1; }
# -m gpu selects only the checks against the installed release; a skip there means a missing piece, so fail on it.
python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/backends/test_trtllm_api.py tests/triton/test_trtllm_repo.py \
  | tee "$SMOKE_DIR/contract.log"
if grep -q "SKIPPED" "$SMOKE_DIR/contract.log"; then
  echo "FAIL: some GPU contract checks were skipped (see above); run inside the container"; exit 1
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
python3 scripts/gpu_smoke_check.py "$SMOKE_DIR/engines/$NAME" --tokens "$SMOKE_TOKENS"
