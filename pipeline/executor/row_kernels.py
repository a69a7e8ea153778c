"""C++ operators for the few rows of a decode or verify forward on x86-64 CPUs with AVX-512 or AVX2, built on first
use: a matrix product, attention over the paged KV pools, and the small per-token operations of a Llama-family
layer.

A decode step multiplies one row (a verify K + 1 rows) by every weight matrix: the time is the weights' bytes
streamed from memory (float32, bfloat16, or int8 with a scale per row: quantize.py's weight-only layers). aten's
products are not written for that shape on every CPU: on one AMD EPYC, MKL's float32 matrix-vector product streamed
16 GB/s at any thread count and oneDNN's bfloat16 one about 21 GB/s, where reading each weight row once and
multiplying it into every input row (``csrc/rows_mm.cpp``) streamed 29-40 with AVX-512 on one thread; on a Zen 3
EPYC with AVX2, 25 GB/s on two threads against 17 on one. Each output is one thread's float32 dot product, added
up in the same order whatever the number of rows, so a token's result does not depend on its neighbours in the
forward (tested).

The product is one of the kinds matmul_choice times per width: it is used only where it measured faster on the
machine; so is the library's attention over the paged KV pools (``csrc/paged_attention.cpp``, attention_choice's
``paged``). The library's loops run on torch's OpenMP threads (built with -fopenmp: ``threads`` says how many a loop
got). The per-token operations (``csrc/layer_ops.cpp``: RMSNorm, RoPE in place, SiLU(gate) * up) replace about
twenty small torch operators a layer in the lean decoder's eager forwards. A machine without AVX2 and FMA, a C++
compiler or ninja (torch's extension builder runs both) runs aten's operators as before (``unavailable`` says why).
The build targets one instruction set: AVX-512 where the CPU has it (16 lanes), else AVX2 (8 lanes). It takes under
a minute on 2 cores and is kept under cache_root()/extensions, one folder per source, torch version and flags, so
later starts load it in well under a second.
"""

from __future__ import annotations

import hashlib
import os
import platform
import time
import weakref
from pathlib import Path

import torch
from torch import Tensor

from ..artifacts import cache_root
from ..dtypes import cpu_flags
from ..quantize import Int8WeightOnlyLinear

CSRC = Path(__file__).with_name("csrc")
# one library
SOURCES = (CSRC / "rows_mm.cpp", CSRC / "layer_ops.cpp", CSRC / "paged_attention.cpp", CSRC / "decoder_layer.cpp")
HEADERS = (CSRC / "lanes.h", CSRC / "vector_math.h", CSRC / "rope.h", CSRC / "kernels.h")
MAX_ROWS = 16  # the widest forward the kernel takes (its register tile)
DTYPES = (torch.float32, torch.bfloat16)
# The kernel's instruction sets, the first the CPU has wins: (name, the CPU flags it needs, compiler flags). The
# build targets them, not the build machine (a cache folder may move between CPUs of one kind, and the flags are
# part of the folder's name).
INSTRUCTION_SETS = (
    # -mavx512f does not imply -mfma, and the kernels' 8-lane code (vector_math.h) multiplies-adds with AVX2 + FMA
    ("avx512", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"}),
     ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]),
    ("avx2", frozenset({"avx2", "fma"}), ["-mavx2", "-mfma"]),
)
# No multiply and add fused unless written so: layer_ops.cpp rounds as the torch expressions it replaces. OpenMP:
# at::parallel_for is inline in ATen's headers, so without it the library's loops run on one thread (the process
# has loaded torch's libgomp already, and the library links that same one by its soname).
COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
# Where the CPU also has AVX512_BF16, bfloat16 rows multiply in pairs (one instruction for two products)
BF16_FLAGS = ["-mavx512bf16", "-DSPECPIPE_DPBF16"]
# A build takes well under a minute: a lock file this old was left by a process that died while building.
STALE_LOCK_S = 600
OFF_SWITCH = "SPECPIPE_NO_ROW_KERNEL"  # set (to anything) to keep aten's products: a debugging aid

# "reason": why the kernel is unavailable (None: loaded), once per process; "build": the loaded build's digest;
# "isa": the instruction set it was built for
_state: dict[str, str | None] = {}


def unavailable() -> str | None:
    """Why the kernel cannot run in this process (a sentence), or None once it is loaded; the first call builds
    or loads it."""
    if "reason" not in _state:
        _state["reason"] = _load()
    return _state["reason"]


# The float32 lanes of each instruction set: the paged attention kernel steps through a head that many at a time.
LANES = {"avx512": 16, "avx2": 8}


def head_multiple() -> int:
    """What the loaded kernels take a head size as a multiple of (their lanes: 8 on AVX2); 16, which every build
    takes, while the library is not loaded."""
    return LANES.get(_state.get("isa"), 16) if _state.get("reason", "") is None else 16


def state() -> str:
    """What this process knows of the kernel without trying it: "loaded (ISA)", why it is unavailable, or "not tried"
    (no engine has opened a model on a CPU in this process yet)."""
    if "reason" not in _state:
        return "not tried"
    if _state["reason"]:
        return _state["reason"]
    return f"loaded ({_state.get('isa', '?')}, {threads()} of {torch.get_num_threads()} threads)"


def build() -> str | None:
    """The loaded kernel's build (a digest of its source, torch version and flags), or None: what a measured plan
    that timed it is kept under, so a changed kernel is timed anew."""
    return _state.get("build") if unavailable() is None else None


def supports(x_dtype: torch.dtype, weight: Tensor | Int8WeightOnlyLinear) -> bool:
    """Whether rows_mm takes this weight, or rows_mm_int8 this int8 layer (and inputs of ``x_dtype``); the caller
    checks the row count."""
    if isinstance(weight, Int8WeightOnlyLinear):
        return x_dtype in DTYPES and _takes(weight.qweight)
    return isinstance(weight, Tensor) and weight.dtype in DTYPES and x_dtype == weight.dtype and _takes(weight)


def _takes(weight: Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.shape[1] % 16 == 0
            and weight.is_contiguous())


def rows_mm(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [M, K] (1 <= M <= MAX_ROWS) times weight [N, K] (+ bias) -> [M, N] in x's dtype."""
    return torch.ops.specpipe_rows.rows_mm(x, weight, bias)


def rows_mm_int8(x: Tensor, layer: Int8WeightOnlyLinear) -> Tensor:
    """The int8 layer's product for x [M, K] (1 <= M <= MAX_ROWS, float32 or bfloat16) -> [M, N] in x's dtype:
    each output the float32 sum of x times the int8 row, times the row's scale, plus the bias, rounded once (the
    layer's own forward rounds the product before adding its bias)."""
    return torch.ops.specpipe_rows.rows_mm_int8(x, layer.qweight, *_float_scales(layer))


def _load() -> str | None:
    if os.environ.get(OFF_SWITCH):
        return f"turned off by {OFF_SWITCH}"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"needs an x86-64 CPU with AVX2 or AVX-512 (this is {platform.machine()})"
    chosen = instruction_set(cpu_flags())
    if isinstance(chosen, str):
        return chosen
    name, flags = chosen
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    digest = hashlib.sha256(source + f"{torch.__version__} {flags}".encode()).hexdigest()[:16]
    folder = cache_root() / "extensions" / f"rows_mm-{digest}"
    try:
        from torch.utils import cpp_extension

        folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # code this process will load: the owner's alone
        if (problem := _not_private(folder)) is not None:
            return problem
        _clear_stale_lock(folder / "lock")
        # The builder locks the folder while it builds: a second process waits, then loads the same library.
        cpp_extension.load(name=f"specpipe_rows_mm_{digest}", sources=[str(path) for path in SOURCES],
                           build_directory=str(folder), extra_cflags=flags, extra_ldflags=["-fopenmp"],
                           extra_include_paths=[str(CSRC)],
                           is_python_module=False, verbose=False)
    except Exception as error:  # noqa: BLE001 - no compiler, no ninja, a failed build: aten's products still run
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return f"its C++ build failed ({type(error).__name__}: {first[:200]})"
    torch.library.register_fake("specpipe_rows::rows_mm")(_shape)
    torch.library.register_fake("specpipe_rows::rows_mm_int8")(lambda x, q, scale, bias: _shape(x, q, bias))
    torch.library.register_fake("specpipe_rows::paged_attention")(
        lambda query, key, value, blocks, mask, scale: torch.empty_like(query))
    torch.library.register_fake("specpipe_rows::rope_write_attend")(
        lambda qkv, cos, sin, key, value, slots, blocks, mask, heads, scale: qkv.new_empty(
            qkv.shape[0], heads * cos.shape[-1]))
    torch.library.register_fake("specpipe_rows::decoder_layer")(lambda x, *rest: torch.empty_like(x))
    torch.library.register_fake("specpipe_rows::rms_norm")(lambda x, weight, eps: torch.empty_like(x))
    torch.library.register_fake("specpipe_rows::silu_mul")(lambda h: h.new_empty(h.shape[0], h.shape[1] // 2))
    _state["build"] = digest
    _state["isa"] = name
    return None


def instruction_set(cpu: frozenset[str]) -> tuple[str, list[str]] | str:
    """(the instruction set's name, compiler flags) the kernel is built for on a CPU with these flags, or why none
    fits."""
    for name, needs, flags in INSTRUCTION_SETS:
        if needs <= cpu:
            if name == "avx512" and "avx512_bf16" in cpu:
                return "avx512+bf16", COMMON_FLAGS + flags + BF16_FLAGS
            return name, COMMON_FLAGS + flags
    missing = sorted(INSTRUCTION_SETS[-1][1] - cpu)
    return f"needs AVX2 and FMA, or AVX-512 ({', '.join(missing)} missing on this CPU)"


def _not_private(folder: Path) -> str | None:
    """Why the library in ``folder`` could be someone else's code (another owner, or the folder or its parent
    writable by others), or None. The process loads what it finds there."""
    for path in (folder, folder.parent):
        info = path.stat()
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            return (f"its build folder {path} is not private (owner uid {info.st_uid}, mode "
                    f"{oct(info.st_mode & 0o777)}): make it yours and not writable by others, or point "
                    f"SPECPIPE_CACHE elsewhere")
    return None


def _clear_stale_lock(lock: Path, now: float | None = None) -> bool:
    """Remove the builder's lock file when it is older than any build takes (STALE_LOCK_S): a process killed while
    building leaves it behind, and the builder would otherwise wait on it forever. Returns whether it removed it."""
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= STALE_LOCK_S:
        return False
    lock.unlink(missing_ok=True)
    return True


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """layer_math.rms_norm of x [T, d] (float32 or bfloat16, weight of its dtype) as one operator."""
    return torch.ops.specpipe_rows.rms_norm(x, weight, eps)


def rope_(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int) -> None:
    """layer_math.rotate, in place, of the first ``heads`` heads of cos's width in every row of qkv [T, C] (a fused
    QKV output: its query and key heads); cos/sin [T, d] of qkv's dtype."""
    torch.ops.specpipe_rows.rope_(qkv, cos, sin, heads)


def silu_mul(h: Tensor) -> Tensor:
    """silu(gate) * up of h [T, 2 I] = [gate | up] -> [T, I], rounded as the torch expression."""
    return torch.ops.specpipe_rows.silu_mul(h)


def paged_attention(query: Tensor, key: Tensor, value: Tensor, blocks: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention of query [n, W, heads, d] over one layer's block pools key/value [blocks, block_size, kv_heads, d]
    (contiguous), row i reading the blocks ``blocks[i]`` ([n, B] long) where they lie; mask [n, 1, W, B *
    block_size] float32, additive (its lowest value: never). -> [n, W, heads, d], float32 inside, in query's
    dtype; a query that may attend to nothing gets zeros."""
    return torch.ops.specpipe_rows.paged_attention(query, key, value, blocks, mask, scale)


def rope_write_attend(qkv: Tensor, cos: Tensor, sin: Tensor, key: Tensor, value: Tensor, slots: Tensor,
                      blocks: Tensor, mask: Tensor, heads: int, scale: float) -> Tensor:
    """A layer's attention in one call: rope_ over the query and key heads of qkv [n W, C] (the fused QKV product
    of n rows of W tokens, row after row), each token's key and value heads written into the pools key/value at
    ``slots`` [n W] (flat positions, block * block_size + offset), then paged_attention of its query heads over
    blocks/mask. -> [n W, heads * d]."""
    return torch.ops.specpipe_rows.rope_write_attend(qkv, cos, sin, key, value, slots, blocks, mask, heads, scale)


def decoder_layer(x: Tensor, weights: tuple, cos: Tensor, sin: Tensor, key: Tensor, value: Tensor, slots: Tensor,
                  blocks: Tensor, mask: Tensor, heads: int, scale: float) -> Tensor:
    """A Llama-family layer in one call, for x [n W, d] (n rows of W tokens): RMSNorm, the fused QKV product,
    rope_write_attend, the output product and the residual, RMSNorm, the gate/up product, silu_mul, the down product
    and the residual, each as its own operator computes it. ``weights``: layer_weights' tuple."""
    return torch.ops.specpipe_rows.decoder_layer(x, *weights, cos, sin, key, value, slots, blocks, mask, heads, scale)


def layer_weights(norm1: Tensor, eps1: float, matrices: list[tuple], norm2: Tensor, eps2: float) -> tuple:
    """decoder_layer's weight arguments from the layer's norms and its four matrices (qkv, o, gate_up, down), each
    (weight, bias) with the weight a tensor or an int8 layer (its own bias then)."""
    qkv, o, gate_up, down = ((weight.qweight, *_float_scales(weight)) if isinstance(weight, Int8WeightOnlyLinear)
                             else (weight, None, _float(bias)) for weight, bias in matrices)
    return (norm1, eps1, *qkv, *o, norm2, eps2, *gate_up, *down)


def _float(tensor: Tensor | None) -> Tensor | None:
    """A scale or bias as the kernels add it: float32 and contiguous (a 16-bit one widens exactly), so a call does
    not convert it again."""
    return None if tensor is None else tensor.detach().float().contiguous()


# int8 layer -> (its scale, its bias, their float32 copies): what rows_mm_int8 passes, made once per layer
_FLOAT_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _float_scales(layer: Int8WeightOnlyLinear) -> tuple[Tensor, Tensor | None]:
    """The int8 layer's scale and bias in float32 (see _float), made again only when the layer's own change."""
    copies = _FLOAT_COPIES.get(layer)
    if copies is None or copies[0] is not layer.scale or copies[1] is not layer.bias:
        copies = (layer.scale, layer.bias, _float(layer.scale), _float(layer.bias))
        _FLOAT_COPIES[layer] = copies
    return copies[2], copies[3]


def threads(rows: int = 1024) -> int:
    """How many threads the library's loop over ``rows`` weight rows runs on (at most torch.get_num_threads())."""
    return torch.ops.specpipe_rows.threads(rows)


def _shape(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """What export and the compiler see of rows_mm: the output's shape and dtype."""
    return x.new_empty(x.shape[0], weight.shape[0])
