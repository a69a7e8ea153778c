"""Open built engines as an executor: how `run`, `bench` and the Triton model load one.

Everything comes from what the build wrote beside the engines (manifests, engine.json), never from the models'
sources: opening engines does not run the check stage again.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..built_config import check_built_from
from ..config import PipelineConfig
from ..engine_info import read_engine
from ..errors import EngineError
from ..kv_settings import KVSettings
from ..methods import NgramSettings, SuffixSettings

if TYPE_CHECKING:
    from .base import ExecutorBase


def open_executor(root: str | Path, config: PipelineConfig | None = None, *, device: str | None = None,
                  compile: bool | str | None = None, adaptive_draft_len: bool = False, method: str | None = None,
                  ngram: NgramSettings | None = None, kv: KVSettings | None = None,
                  compile_max_width: int | None = None, suffix: SuffixSettings | None = None) -> ExecutorBase:
    """The executor on the engines under ``root`` (engines/<name>), of the backend that built them: a
    SpeculativeExecutor for torch engines, a TrtllmSpeculativeExecutor for TensorRT-LLM ones.

    The backend, K (engine_draft_len), the limits and the acceptance rule are engine.json's. Without ``config`` the
    drafting method and its settings (n-gram, suffix) are the ones the engines were built with. With ``config``, the engines must
    have been built from it (each build manifest's recorded config against this one, the models left unread; see
    built_config), and its run-time choices apply: speculative.method, speculative.ngram and speculative.suffix (a
    method swap rebuilds nothing), runtime.device, runtime.torch_compile and runtime.compile_max_width. Keyword arguments override both. ``device``, ``compile``,
    ``adaptive_draft_len``, ``kv`` and ``compile_max_width`` are the torch runtime's; TensorRT-LLM engines refuse
    them."""
    root = Path(root)
    if config is not None:
        check_built_from(config, root)
        method = method or config.speculative.method
        ngram = ngram or config.speculative.ngram.settings()
        suffix = suffix or config.speculative.suffix.settings()
    if read_engine(root, "target").backend == "trtllm":
        from .trtllm_executor import TrtllmSpeculativeExecutor

        refused = [name for name, value in (("device", device), ("compile", compile),
                                            ("adaptive_draft_len", adaptive_draft_len), ("kv", kv),
                                            ("compile_max_width", compile_max_width)) if value]
        if refused:
            raise EngineError(f"{', '.join(refused)}: torch-runtime options, but {root} holds TensorRT-LLM engines "
                              f"(they run on the GPUs recorded at build time and choose K per request); leave them "
                              f"out")
        return TrtllmSpeculativeExecutor.from_engines(root, method=method, ngram=ngram, suffix=suffix)
    from .batching_engine import DEFAULT_COMPILE_MAX_WIDTH
    from .speculative_executor import SpeculativeExecutor  # torch and transformers: after the checks above

    if config is not None:
        device = device or (None if config.runtime.device == "auto" else config.runtime.device)
        compile = config.runtime.torch_compile if compile is None else compile
    width = compile_max_width or (config.runtime.compile_max_width if config is not None else
                                  DEFAULT_COMPILE_MAX_WIDTH)
    return SpeculativeExecutor.from_engines(root, device=device, compile=compile or False, compile_max_width=width,
                                            adaptive_draft_len=adaptive_draft_len, method=method, ngram=ngram, kv=kv,
                                            suffix=suffix)
