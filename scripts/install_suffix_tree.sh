#!/usr/bin/env bash
# Builds and installs the suffix tree that `speculative.method: suffix` drafts from: Arctic Inference's
# SuffixDecodingCache (Snowflake, Apache-2.0; the implementation vLLM's `suffix` method imports). PyPI carries it only
# as a source archive whose build wants torch, cmake, nanobind and grpc tools; an isolated pip build would fetch a
# CUDA torch, so the build runs in the venv's interpreter with its build tools kept apart in build/suffix-tree/tools.
# Only its C++ suffix tree (a nanobind module) and the Python cache around it are used: no vLLM, no GPU.
#
# usage: scripts/install_suffix_tree.sh PYTHON      (PYTHON: the venv's interpreter; a no-op when already installed)
set -euo pipefail

PY=${1:?usage: $0 PYTHON}
VERSION=0.3.0
SHA256=7f22e3e1b1071c6061c0d6951be17c0fb50b08d06d6e543144c8f52faba60a36  # arctic_inference-0.3.0.tar.gz on PyPI
WORK=build/suffix-tree

if "$PY" -c "import importlib.metadata as m, arctic_inference.suffix_decoding as s; \
             raise SystemExit(m.version('arctic_inference') != '$VERSION')" 2>/dev/null; then
    exit 0
fi

rm -rf "$WORK"
mkdir -p "$WORK"
# The build's tools, pinned as its pyproject asks (nanobind, protobuf) and kept out of the venv: protobuf 5.29 there
# would replace the serving clients' newer one.
"$PY" -m pip install --quiet --target "$WORK/tools" setuptools wheel ninja cmake nanobind==2.9.2 \
    protobuf==5.29.6 grpcio-tools==1.71.2
TOOLS=$(cd "$WORK/tools" && pwd)
(
    export PYTHONPATH="$TOOLS" PATH="$TOOLS/bin:$PATH"
    # Without build isolation here too: pip reads the archive's metadata by running its setup.py.
    "$PY" -m pip download --quiet --no-deps --no-build-isolation --no-binary :all: "arctic-inference==$VERSION" \
        -d "$WORK"
    ARCHIVE="$WORK/arctic_inference-$VERSION.tar.gz"
    echo "$SHA256  $ARCHIVE" | sha256sum --check --quiet
    tar -xzf "$ARCHIVE" -C "$WORK"
    # CMake finds nanobind's package through its own folder (the build's Python lookup may pick another interpreter).
    CMAKE_PREFIX_PATH=$("$PY" -m nanobind --cmake_dir)
    export CMAKE_PREFIX_PATH
    if ! "$PY" -m pip wheel --no-deps --no-build-isolation -w "$WORK/wheel" "$WORK/arctic_inference-$VERSION" \
            >"$WORK/build.log" 2>&1; then
        tail -40 "$WORK/build.log"
        echo "building arctic-inference $VERSION failed: its log is $WORK/build.log" >&2
        exit 1
    fi
)
"$PY" -m pip install --quiet --no-deps "$WORK"/wheel/arctic_inference-"$VERSION"-*.whl
"$PY" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; SuffixDecodingCache(8, 1)"
echo "installed arctic-inference $VERSION (its suffix tree) into $("$PY" -c 'import sys; print(sys.prefix)')"
