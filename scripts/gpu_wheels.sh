#!/usr/bin/env bash
# Download, here (with PyPI reachable), the wheels scripts/gpu_torch_check.sh installs OFFLINE on a GPU box that has
# torch but may lack transformers 5.24.0 and the other packages `import pipeline.executor` needs.
#
#   bash scripts/gpu_wheels.sh            -> .gpu_wheels/ (ignored by git; carry it to the GPU box), about 45 MiB
#
# The list and pins live in scripts/gpu_torch_check.py (WHEELS; the versions this repository is tested with):
# pure-Python wheels once, compiled ones per Python version (abi3 wheels come out once), manylinux x86_64. Torch is
# never downloaded (the box has it). Wheels over 2 MiB (transformers, numpy, tokenizers, pydantic-core) are stored
# as <wheel>.xz (re-zipped uncompressed, then xz: numpy 18 -> 9 MiB); gpu_torch_check.sh unpacks them with Python's
# lzma module.
#
# Python versions: 3.11 3.12 3.13 by default. NOT 3.10: transformers 5.24.0 requires Python >= 3.11. numpy 1.26.4
# (the project pins numpy<2) has no 3.13 wheel, so on 3.13 the box's own numpy is used (torch installs nearly
# always have one).
#
# Knobs: GPU_WHEELS_DIR (default .gpu_wheels), GPU_WHEELS_PYTHONS ("3.11 3.12 3.13"), PYTHON (the interpreter whose
# pip downloads and packs; default .venv/bin/python), GPU_WHEELS_NUMPY (1 = include numpy, the default; 0 = rely on
# the box's numpy, saving 18 MiB).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${GPU_WHEELS_DIR:-$REPO/.gpu_wheels}"
PY="${PYTHON:-$REPO/.venv/bin/python}"
PYTHONS="${GPU_WHEELS_PYTHONS:-3.11 3.12 3.13}"
cd "$REPO"
mkdir -p "$DEST"

mapfile -t PURE < <("$PY" scripts/gpu_torch_check.py --wheel-list pure)
mapfile -t COMPILED < <("$PY" scripts/gpu_torch_check.py --wheel-list compiled | grep -v '^numpy==')
NUMPY="$("$PY" scripts/gpu_torch_check.py --wheel-list compiled | grep '^numpy==')"
# manylinux2014 (= glibc 2.17) first; 2_28 as well, since newer releases ship only that (torch >= 2.6 needs 2.28).
PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
download() { "$PY" -m pip download -q --no-deps --only-binary=:all: "${PLATFORMS[@]}" -d "$DEST" "$@" 2>&1 \
  | grep -v "^WARNING: Location .* is ignored" || true; }

echo "== pure-Python wheels (${#PURE[@]})"
download --python-version 3.11 "${PURE[@]}"
for v in $PYTHONS; do
  echo "== compiled wheels for Python $v (${#COMPILED[@]} + numpy)"
  download --python-version "$v" --implementation cp "${COMPILED[@]}"
  if [ "${GPU_WHEELS_NUMPY:-1}" != 0 ]; then
    "$PY" -m pip download -q --no-deps --only-binary=:all: "${PLATFORMS[@]}" -d "$DEST" --python-version "$v" \
      --implementation cp "$NUMPY" >/dev/null 2>&1 || echo "   no $NUMPY wheel for Python $v: the box's numpy is used"
  fi
done
"$PY" scripts/gpu_torch_check.py --pack-wheels "$DEST"
# Every listed distribution must be there for the first version at least (pip download errors are shown above).
missing=0
for req in "${PURE[@]}" "${COMPILED[@]}"; do
  stem="$(echo "${req%%==*}" | tr 'A-Z-' 'a-z_')-${req##*==}-"
  ls "$DEST" | tr 'A-Z' 'a-z' | grep -q "^$stem" || { echo "MISSING: $req"; missing=1; }
done
ls -1 "$DEST"
du -sh "$DEST"
exit $missing
