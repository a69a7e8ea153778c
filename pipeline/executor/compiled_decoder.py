"""The lean decoder compiled ahead of time by inductor (AOTInductor), one graph per forward width bucket, kept on
disk so the next start loads them in seconds.

A step's packed width T (a decode's one token per row, a verify's K + 1, a prompt chunk's many) is padded up to a
bucket, a power of two or the engine's own verify width, and each bucket runs its own static graph: the matrix
products specialise to their width and nothing in the graph depends on the rows, their lengths or their trees.
Those vary every step and live in the attention plan, which the graph never sees: attention is the opaque
``specpipe::paged_attention`` operator (see paged_attention.py), which the compiled code calls back into, and
padding writes no KV. The final norm and the LM head run over as many positions as the bucket is wide (the ones
whose logits are read, then repeats): at these widths the LM head streams its weights once whatever the count, and
one graph per bucket holds one copy of them.

With ``freeze`` the weights are folded in as constants (inductor's freezing) and packed for the CPU's matrix
kernels, which is where the gain over eager comes from; each bucket's graph holds its own packed copy (in memory
and on disk), so the compiled widths stop at a cap and wider forwards run eager. ``autotune`` (max-autotune) also
times candidate kernels per shape. Compiling a bucket of a real model takes tens of seconds, so every graph is
exported and compiled once into a package (``.pt2``) under a folder named for everything the code depends on: the
weights' bytes, the decoder's shapes, the compile settings, torch's version, the CPU and the thread count. The next
start with the same key loads the packages instead (a damaged one is compiled again). The packages hold the weights,
so they are private to their owner (folders 0700, files 0600), and the store keeps the KEPT_KEYS most recently used
keys' folders and any used within MAX_IDLE_DAYS: a model or torch update makes a new key, and each key costs a copy
of the weights per bucket on disk. Then every bucket is timed
and each width is sent to the cheapest bucket at least as wide (inductor's kernel for one row can be slower than
its kernel for two), so no width costs more than a wider one. Compiled code has no guards and never recompiles: a
step runs the graph its width is routed to or, wider than every bucket, the eager decoder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch._inductor
from torch import Tensor, nn
from tqdm import tqdm

from ..artifacts import cache_root
from . import paged_attention
from .llama_decoder import LlamaDecoder
from .matmul_choice import KernelPlan, cpu_model

TIMING_ROUNDS = 5
KEPT_KEYS = 4  # package folders kept in a store whatever their age (the most recently used)
MAX_IDLE_DAYS = 30  # beyond KEPT_KEYS, a folder unused this long is removed when another key warms up
# The code a package is traced from: the key covers its text, so a changed layer or operator compiles anew.
CODE = [Path(__file__), *(Path(__file__).with_name(name) for name in ("llama_decoder.py", "paged_attention.py",
                                                                       "matmul_choice.py")),
        *(Path(__file__).parent.parent / name for name in ("quantize.py", "layer_math.py"))]
# The frozen weights go into the package as one blob beside the compiled code, not into the shared library: loaded,
# they are then held once (inside the library they were held twice, the mapped library and the tensors made from it).
PACKAGE_SETTINGS = {"aot_inductor.package_constants_in_so": False,
                    "aot_inductor.package_constants_on_disk_format": "binary_blob"}


def buckets(max_width: int, extra: tuple[int, ...] = ()) -> list[int]:
    """Powers of two from 1 to the first one holding ``max_width``, with the ``extra`` widths below that."""
    out = [1]
    while out[-1] < max_width:
        out.append(out[-1] * 2)
    return sorted(set(out) | {width for width in extra if 0 < width < out[-1]})


def capped_width(widest: int, cap: int) -> int:
    """The max_width to compile for forwards of up to ``widest`` tokens when no bucket may be wider than ``cap``."""
    return widest if buckets(widest)[-1] <= cap else 1 << (cap.bit_length() - 1)


def bucket(width: int, sizes: list[int]) -> int:
    for size in sizes:
        if size >= width:
            return size
    raise ValueError(f"a forward of {width} tokens is wider than the widest compiled bucket ({sizes[-1]})")


def cheapest_routes(ms: dict[int, float]) -> dict[int, int]:
    """For each bucket width, the bucket that runs it: the cheapest of itself and the wider ones (``ms``: measured
    milliseconds per bucket), so no width costs more than a wider one."""
    return {size: min((other for other in ms if other >= size), key=lambda other: (ms[other], other)) for size in ms}


def _gpu(device: torch.device) -> list | None:
    """What a CUDA package depends on beyond the device index: the GPU and the CUDA version."""
    if device.type != "cuda":
        return None
    return [torch.cuda.get_device_name(device), list(torch.cuda.get_device_capability(device)), torch.version.cuda]


def default_store() -> Path:
    """Where compiled packages are kept unless told otherwise: cache_root()/compiled."""
    return cache_root() / "compiled"


def prune_store(store: Path, keep: Path, now: float | None = None) -> list[Path]:
    """Remove the key folders of ``store`` that are neither ``keep``, nor among the KEPT_KEYS most recently used
    (a folder's mtime, set at every warm-up that uses it), nor used within MAX_IDLE_DAYS; returns them."""
    now = time.time() if now is None else now
    used = []
    for path in store.iterdir():
        try:
            if path.is_dir() and path != keep:
                used.append((path.stat().st_mtime, path))
        except FileNotFoundError:  # another process removed it meanwhile
            continue
    used.sort(reverse=True)
    stale = [path for mtime, path in used[KEPT_KEYS - 1:] if now - mtime > MAX_IDLE_DAYS * 86400]
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)  # another process may be removing it too
    return stale


class _Step(nn.Module):
    """LlamaDecoder.step as a module (what export traces)."""

    def __init__(self, decoder: LlamaDecoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids: Tensor, positions: Tensor, keep: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        return self.decoder.step(input_ids, positions, keep)


class CompiledDecoder:
    """LlamaDecoder.step through the bucket graphs: the inputs padded up to a bucket, the outputs cut back."""

    def __init__(self, decoder: LlamaDecoder, max_width: int, freeze: bool = True, autotune: bool = False,
                 store: Path | None = None, extra_widths: tuple[int, ...] = ()):
        """``store``: the folder the packages are kept under (default_store() when None); ``extra_widths``: widths
        compiled as buckets of their own besides the powers of two (a verify's K + 1, which would otherwise pay
        for the next power of two: 5 tokens as 8)."""
        self.decoder = decoder
        decoder.kernels = KernelPlan()  # inductor picks the kernels of its own graph
        self.sizes = buckets(max_width, extra_widths)
        self.settings = {"freezing": freeze, "max_autotune": autotune}
        self.store = Path(store) if store is not None else default_store()
        self.folder: Path | None = None  # the packages of this decoder and settings (set by warm_up)
        self._graphs: dict[int, object] = {}  # bucket width -> its loaded package
        self.warm_up_s: float | None = None
        self.bucket_ms: dict[int, float] = {}  # each bucket's measured step at warm-up (ms, best of TIMING_ROUNDS)
        self.route: dict[int, int] = {}  # bucket width -> the bucket whose graph runs it (see cheapest_routes)
        self.built = 0  # buckets compiled by warm_up (the rest were loaded from the store)
        self.eager_calls = 0  # forwards wider than the widest bucket, run uncompiled

    def key(self) -> str:
        """A digest of everything the compiled code depends on (the weights' bytes included: they are frozen in)."""
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        decoder = self.decoder
        device = decoder.embed.device
        digest = hashlib.blake2b(digest_size=20)
        digest.update(json.dumps({
            "torch": torch.__version__, "cpu": cpu_model(), "isa": str(pick_vec_isa()),
            "threads": torch.get_num_threads(), "settings": self.settings, "aux_layers": list(decoder.aux_layers),
            "heads": [decoder.heads, decoder.kv_heads, decoder.head_dim], "eps": decoder.eps,
            "device": str(device), "gpu": _gpu(device),
        }, sort_keys=True).encode())
        for source in CODE:  # what the graph traces: a change to it is a change to the package
            digest.update(Path(source).read_bytes())
        for name, tensor in decoder.state_dict().items():
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().data)
        return digest.hexdigest()

    def warm_up(self) -> float:
        """Load or compile every bucket's graph; returns the seconds it took."""
        start = time.perf_counter()
        self.folder = self.store / self.key()
        device = self.decoder.embed.device
        # silent when stderr is not a terminal (tests, logs)
        examples = {size: tuple(torch.zeros(size, dtype=torch.long, device=device) for _ in range(3))
                    for size in self.sizes}  # ids, positions, keep: what export traces and the timing runs
        for size in tqdm(self.sizes, desc="compiled decoder buckets", unit="graph", leave=False, disable=None):
            self._graphs[size] = self._load_or_build(size, examples[size])
        os.utime(self.folder)  # used now: what prune_store keeps
        prune_store(self.store, self.folder)
        self._route(examples)
        self.warm_up_s = time.perf_counter() - start
        return self.warm_up_s

    def _route(self, inputs: dict[int, tuple]) -> None:
        """Time every bucket's graph (on an empty plan: attention does nothing, the weights stream as in a step) and
        send each width to the cheapest bucket at least as wide; a graph no width is sent to is dropped (its copy of
        the weights with it). A kernel can be slower at one row than at two (inductor picks per shape)."""
        device = self.decoder.embed.device
        best = dict.fromkeys(self.sizes, float("inf"))
        with paged_attention.active(paged_attention.ForwardPlan([], 0), None):
            for _ in range(TIMING_ROUNDS):  # interleaved: a busy moment slows one round of every bucket alike
                for size in self.sizes:
                    start = time.perf_counter()
                    self._graphs[size](*inputs[size])
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)  # time the kernels, not their launch
                    best[size] = min(best[size], (time.perf_counter() - start) * 1e3)
        self.bucket_ms = {size: round(ms, 2) for size, ms in best.items()}
        self.route = cheapest_routes(best)
        for size in set(self.sizes) - set(self.route.values()):
            del self._graphs[size]

    def _load_or_build(self, size: int, example: tuple) -> object:
        path = self.folder / f"step-{size}.pt2"
        if path.exists():
            try:
                return torch._inductor.aoti_load_package(str(path))
            except Exception:  # noqa: BLE001 - a truncated or foreign file: compile it again below
                pass
        # Tracing runs the attention operator's fake kernel only; an empty plan keeps a real call harmless.
        with paged_attention.active(paged_attention.ForwardPlan([], 0), None), torch.inference_mode(False):
            program = torch.export.export(_Step(self.decoder), example, strict=False)
        self.store.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.folder.mkdir(mode=0o700, exist_ok=True)
        partial = path.with_name(f".{path.stem}-{os.getpid()}.pt2")
        try:
            torch._inductor.aoti_compile_and_package(program, package_path=str(partial),
                                                     inductor_configs={**self.settings, **PACKAGE_SETTINGS})
            partial.chmod(0o600)  # the weights, frozen in
            os.replace(partial, path)  # a reader sees the whole package or none
        finally:
            partial.unlink(missing_ok=True)  # a failed compile leaves no half-written package behind
        self.built += 1
        return torch._inductor.aoti_load_package(str(path))

    def step(self, input_ids: Tensor, positions: Tensor, keep: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """As LlamaDecoder.step, through the bucket graphs."""
        tokens, kept = input_ids.shape[0], keep.shape[0]
        if max(tokens, kept) > self.sizes[-1]:  # a prompt chunk wider than every compiled bucket
            self.eager_calls += 1
            return self.decoder.step(input_ids, positions, keep)
        width = self.route[bucket(max(tokens, kept), self.sizes)]
        if width > tokens:
            pad = input_ids.new_zeros(width - tokens)
            input_ids, positions = torch.cat([input_ids, pad]), torch.cat([positions, pad])
        if width > kept:
            keep = torch.cat([keep, keep.new_zeros(width - kept)])
        logits, final, aux = self._graphs[width](input_ids, positions, keep)
        return logits[:kept], final[:kept], None if aux is None else aux[:tokens]
