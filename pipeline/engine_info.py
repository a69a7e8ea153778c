"""engine.json, the description every backend's build writes beside its engine files, read and written here only.

It holds what the executor, `deploy` and `bench` need to know about a built engine without loading it: the backend,
the limits it was built for (``max_draft_len`` is the engine_draft_len, see executor/request_values.py), its dtype,
and the drafting method and lookup settings of the config it was built from (a method swap rebuilds nothing, so this
is the method at build time; ``from_engines`` and ``open_executor`` without a config follow it unless told
otherwise).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from .artifacts import read_manifest, verify_outputs
from .config import PipelineConfig
from .errors import EngineError
from .layout import Layout
from .kv_settings import KVSettings
from .methods import Method, NgramSettings, SuffixSettings

ENGINE_FILE = "engine.json"  # written by every backend's build beside its engine files


@dataclass(frozen=True)
class EngineInfo:
    """engine.json: what the executor, `deploy` and `bench` need to know about a built engine (either backend)."""

    backend: str  # "torch" | "trtllm"
    role: str  # "target" | "draft"
    config_name: str
    dtype: str
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_draft_len: int  # engine_draft_len: the K the engine verifies (0 for a draft; a Medusa tree's depth)
    acceptance: str = "rejection"
    method: str | None = None  # speculative.method at build time (None: built before engine.json recorded it)
    ngram: dict | None = None  # speculative.ngram at build time
    suffix: dict | None = None  # speculative.suffix at build time
    medusa_choices: list | None = None  # the tree a medusa target verifies (None: another method)
    eagle3: dict | None = None  # the target's engine carries EAGLE-3 heads (folder eagle3/): {"tree": drafting trees}
    kv: dict | None = None  # the torch engine's KVSettings fields at build time (None: built before they existed)
    # torch: the weight quantization applied when the engine loads (pipeline/quantize.py), None or "none": none.
    quantization: str | None = None
    architecture: str | None = None
    vocab_size: int | None = None
    # torch: the model runner the engine loads on, "lean" or "hf-modules" (pipeline/decoder_support.py).
    runner: str | None = None
    # Backend-specific facts (trtllm: tp, pp, trtllm_version, gather_generation_logits, KV-cache settings,
    # device ids, tokenizer_len), kept as written.
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: object, source: Path) -> EngineInfo:
        if not isinstance(data, dict):
            raise EngineError(f"{source}: expected a JSON object, got {type(data).__name__}; rebuild with --force")
        known = {f.name for f in fields(cls)} - {"extra"}
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise EngineError(f"{source}: missing {', '.join(missing)}; the engine folder is incomplete or from "
                              f"another version, rebuild it with --force")
        for name in ("max_batch_size", "max_input_len", "max_seq_len", "max_draft_len"):
            if isinstance(data[name], bool) or not isinstance(data[name], int) or data[name] < 0:
                raise EngineError(f"{source}: {name}: {data[name]!r} is not a count; rebuild with --force")
        return cls(**{k: v for k, v in data.items() if k in known},
                   extra={k: v for k, v in data.items() if k not in known})

    def get(self, key: str, default=None):
        """A backend-specific fact (``extra``) or a field, by name."""
        if key in self.extra:
            return self.extra[key]
        return getattr(self, key, default)


    def built_method(self, has_draft_engine: bool) -> Method:
        """The drafting method the engines were built for (older folders: a draft engine means draft_model)."""
        if self.method is not None:
            return Method(self.method)
        return Method.DRAFT_MODEL if has_draft_engine else Method.NGRAM

    def ngram_settings(self) -> NgramSettings:
        return NgramSettings(**self.ngram) if self.ngram else NgramSettings()

    def suffix_settings(self) -> SuffixSettings:
        return SuffixSettings(**self.suffix) if self.suffix else SuffixSettings()

    def kv_settings(self) -> KVSettings:
        return KVSettings(**self.kv) if self.kv else KVSettings()


def engine_fields(config: PipelineConfig, role: str, backend: str) -> dict:
    """The engine.json fields every backend writes (backends add their own facts)."""
    build, speculative = config.build, config.speculative
    return {
        "backend": backend, "role": role, "config_name": config.name, "dtype": getattr(config, role).dtype,
        "max_batch_size": build.max_batch_size, "max_input_len": build.max_input_len,
        "max_seq_len": build.max_seq_len,
        # Only the target verifies; the draft needs no spec mode, like TensorRT-LLM's draft engine.
        # A Medusa target verifies its tree: K is the tree's depth.
        "max_draft_len": 0 if role != "target" else speculative.medusa.tree().max_depth
        if speculative.method.needs_medusa_heads else speculative.max_draft_len,
        "acceptance": speculative.acceptance,
        "method": speculative.method.value, "ngram": speculative.ngram.model_dump(),
        "suffix": speculative.suffix.model_dump(),
        # The tree a Medusa engine verifies (TensorRT-LLM's medusa_choices); None for the other methods.
        "medusa_choices": speculative.medusa.paths()
        if role == "target" and config.has_medusa_heads else None,
        "eagle3": {"tree": speculative.eagle3.tree} if role == "target" and config.has_eagle3_heads else None,
        # The torch engine's paged cache and step budget (TensorRT-LLM keeps its KV settings among its own facts).
        **({"kv": kv_settings(config).__dict__, "quantization": config.build.quantization.of(role)}
           if backend == "torch" else {}),
    }


def kv_settings(config: PipelineConfig) -> KVSettings:
    """The torch engine's paged-cache and step settings from a config."""
    kv = config.build.kv_cache
    return KVSettings(block_size=kv.tokens_per_block, max_tokens=kv.max_tokens, prefix_reuse=kv.enable_block_reuse,
                      step_tokens=config.build.max_num_tokens)


def write_engine_info(out_dir: Path, info: dict) -> None:
    (Path(out_dir) / ENGINE_FILE).write_text(json.dumps(info, indent=2) + "\n")


def read_engine(root: Path, role: str) -> EngineInfo:
    """engine.json of engines/<name>/<role>/build, which must be a completed stage (either backend)."""
    folder = Layout(Path(root)).engine_dir(role)
    manifest = read_manifest(folder) if folder.exists() else None
    if manifest is None:
        raise EngineError(f"{folder}: no completed engine; run `python -m pipeline build CONFIG` (or `make "
                          f"build-engines`) first")
    verify_outputs(folder, manifest)  # a deleted, truncated or hand-edited engine file is refused by name
    engine_file = folder / ENGINE_FILE
    if not engine_file.is_file():
        raise EngineError(f"{engine_file}: missing; the engine folder is incomplete, rebuild it with --force")
    try:
        data = json.loads(engine_file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise EngineError(f"{engine_file}: not valid JSON ({exc}); rebuild with --force") from None
    return EngineInfo.from_dict(data, engine_file)


def read_draft_engine(root: Path, target: EngineInfo) -> EngineInfo:
    """engine.json of the draft beside ``target`` (read_engine's checks), refused when it was built for another
    config."""
    draft = read_engine(root, "draft")
    if target.config_name != draft.config_name:
        raise EngineError(f"{root}: target engine was built for config {target.config_name!r} but the draft for "
                          f"{draft.config_name!r}; rebuild both with one config")
    return draft
