"""The paged attention kernel written in C++ (native_attention.cpp), compiled on first use.

The torch kernels attend over a gathered copy of each row's keys and values, and each of their several operators
costs a few microseconds of dispatch: at one query per row that is most of the time of a layer's attention. The C++
kernel reads the block pools through the block tables and does the whole attention in one call. It is compiled
with the machine's compiler by torch's extension builder (about 40 s on 2 cores, once per machine: the build is
kept under cache_root()/native, in a folder named for the source, the CPU, torch's version and the flags, since
``-march=native`` code may not run on another CPU). Without a working compiler it is simply absent: ``available()``
says False and attention_choice keeps the torch kernels.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from torch import Tensor

from ..artifacts import cache_root
from .matmul_choice import cpu_model

SOURCE = Path(__file__).with_name("native_attention.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp-simd"]
log = logging.getLogger(__name__)
_loaded: bool | None = None


def available() -> bool:
    """Whether the kernel is built and loaded in this process (building it the first time on this machine)."""
    global _loaded
    if _loaded is None:
        _loaded = _load()
    return _loaded


def _load() -> bool:
    from torch.utils import cpp_extension

    digest = hashlib.blake2b(digest_size=8)
    for part in (SOURCE.read_bytes(), cpu_model().encode(), torch.__version__.encode(), " ".join(FLAGS).encode()):
        digest.update(part)
    name = f"specpipe_attention_{digest.hexdigest()}"
    folder = cache_root() / "native" / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=FLAGS, build_directory=str(folder),
                           is_python_module=False, verbose=False)
    except Exception as error:  # noqa: BLE001 - no compiler, no ninja, a read-only cache: the torch kernels remain
        log.warning("the C++ attention kernel could not be built (%s); attention uses the torch kernels",
                    str(error).splitlines()[0] if str(error) else type(error).__name__)
        return False
    return True


def paged_attend(query: Tensor, key_pool: Tensor, value_pool: Tensor, blocks: Tensor, mask: Tensor,
                 scale: float | None) -> Tensor:
    """query [n, heads, W, d] over the rows' blocks of the pools [blocks, block_size, kv_heads, d]; ``mask``
    [n, 1, W, B * block_size] additive (cast to float32 if it is not). Returns [n, heads, W, d]."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.specpipe_native.paged_attend(query, key_pool, value_pool, blocks, mask.float(), scale)
