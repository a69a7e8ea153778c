#!/usr/bin/env bash
# The torch backend on a CUDA GPU, with no network: verify cost per K, target-only vs speculative tok/s, and greedy
# parity with the margin rule, on random-init Llama models (~0.85B target, self-draft of its first 2 layers).
#
#   bash scripts/gpu_torch_check.sh [gpu_torch_check.py options]      (from anywhere; ~2-3 minutes on one H200)
#
# Needs: a Python with torch (CUDA build) and a visible GPU. Everything else `import pipeline.executor` needs
# (transformers 5.24.0, pydantic, PyYAML, ...) is installed here, offline, from .gpu_wheels/ when this Python lacks it
# (make that folder with `bash scripts/gpu_wheels.sh` on a machine with PyPI, and carry it along): into
# $GPU_DEPS (default /tmp/gpudeps), put first on PYTHONPATH; nothing is installed into the system. With pip
# (`pip install --no-index --no-deps --target`), or, for a Python without pip, by unzipping the wheels.
# Exit status (from scripts/gpu_torch_check.py): 0 pass, 1 parity failure, 2 environment problem.
# Writes $OUT/gpu_torch_check.json when OUT is set. Knobs: PYTHON (interpreter), GPU_DEPS, GPU_WHEELS.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="${GPU_WHEELS:-$REPO/.gpu_wheels}"
DEPS="${GPU_DEPS:-/tmp/gpudeps}"
cd "$REPO"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

# The interpreter: $PYTHON, else the first of python / python3 that imports torch.
PY=""
for candidate in ${PYTHON:-} python python3; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" >/dev/null 2>&1; then
    PY="$candidate"; break
  fi
done
if [ -z "$PY" ]; then
  echo "ENV: no python with torch found (tried ${PYTHON:-} python python3); set PYTHON=/path/to/python"; exit 2
fi
echo "== python: $(command -v "$PY") ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"

mapfile -t MISSING < <("$PY" scripts/gpu_torch_check.py --missing-deps | grep -v '^$')
if [ "${#MISSING[@]}" -gt 0 ]; then
  echo "== installing from $WHEELS into $DEPS (offline): ${MISSING[*]}"
  if [ ! -d "$WHEELS" ]; then
    echo "ENV: $WHEELS is missing; run scripts/gpu_wheels.sh where PyPI is reachable and carry .gpu_wheels"; exit 2
  fi
  LINKS="$(mktemp -d /tmp/gpuwheels.XXXXXX)"
  "$PY" scripts/gpu_torch_check.py --unpack-wheels "$WHEELS" "$LINKS" || exit 2
  rm -rf "$DEPS"
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --find-links "$LINKS" --no-deps --target "$DEPS" \
      --disable-pip-version-check --no-warn-script-location "${MISSING[@]}" || {
      echo "ENV: offline install failed: no wheel for this Python? .gpu_wheels covers CPython 3.11-3.13 on"
      echo "     x86_64 (numpy for 3.11/3.12 only); transformers 5.24.0 needs Python >= 3.11"; exit 2; }
  else
    echo "   (this python has no pip: unzipping the wheels instead)"
    mkdir -p "$DEPS"
    "$PY" scripts/gpu_torch_check.py --install-wheels "$LINKS" "$DEPS" "${MISSING[@]}" || exit 2
  fi
  export PYTHONPATH="$REPO:$DEPS${PYTHONPATH#$REPO}"
  export GPU_TORCH_CHECK_INSTALLED="${MISSING[*]}"
fi
"$PY" -c "import pipeline.executor" || { echo "ENV: import pipeline.executor fails (see above)"; exit 2; }

exec "$PY" scripts/gpu_torch_check.py "$@"
