"""Pre-flight checks on built TensorRT-LLM engines, before any GPU memory is touched.

Pure functions over the `config.json` that trtllm-build writes next to the rank*.engine files
(tensorrt_llm/builder.py EngineConfig.to_dict: top-level "version", "pretrained_config", "build_config").
Each problem names the file and field, the value found, and the fix; the failures they prevent otherwise surface
deep inside the C++ runtime ("Number of draft tokens (N) is larger than maximum number of draft tokens (0)",
"Incompatible buffer sizes", "Serialization assertion stdVersionRead == kSERIALIZATION_VERSION failed").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import EngineError
from .trtllm_api import SPEC_MODE_DRAFT_TOKENS_EXTERNAL, SPEC_MODE_MEDUSA

REBUILD = "rebuild with `python -m pipeline build CONFIG --force`"


@dataclass(frozen=True)
class TrtllmEngineConfig:
    """The fields of an engine's config.json that the draft-target path depends on."""

    path: Path  # the config.json
    version: str | None  # TensorRT-LLM version that built the engine
    architecture: str | None
    vocab_size: int | None
    spec_mode: int | str | None  # build_config.speculative_decoding_mode (an int in the pinned release)
    max_draft_len: int
    gather_context_logits: bool
    gather_generation_logits: bool
    world_size: int

    def has_spec_mode(self, name: str, flag: int) -> bool:
        mode = self.spec_mode
        if isinstance(mode, str):  # tolerate a name, in case a release serialises the enum by name
            return mode.strip().lower().removeprefix("speculativedecodingmode.") == name
        return isinstance(mode, int) and bool(mode & flag)

    @property
    def has_draft_tokens_external(self) -> bool:
        return self.has_spec_mode("draft_tokens_external", SPEC_MODE_DRAFT_TOKENS_EXTERNAL)

    @property
    def has_medusa(self) -> bool:
        return self.has_spec_mode("medusa", SPEC_MODE_MEDUSA)


def read_engine_config(path: Path) -> TrtllmEngineConfig:
    """Parse a trtllm engine config.json (a file, or the folder that holds it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise EngineError(f"{path}: missing; this is not a TensorRT-LLM engine folder, {REBUILD}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise EngineError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); {REBUILD}") from None
    pretrained = data.get("pretrained_config") or {}
    build = data.get("build_config") or {}
    mapping = pretrained.get("mapping") or {}
    world = mapping.get("world_size") or (mapping.get("tp_size", 1) * mapping.get("pp_size", 1))
    return TrtllmEngineConfig(
        path=path, version=data.get("version"), architecture=pretrained.get("architecture"),
        vocab_size=pretrained.get("vocab_size"), spec_mode=build.get("speculative_decoding_mode"),
        max_draft_len=int(build.get("max_draft_len") or 0),
        gather_context_logits=bool(build.get("gather_context_logits")),
        gather_generation_logits=bool(build.get("gather_generation_logits")), world_size=int(world))


def check_target_spec_mode(target: TrtllmEngineConfig, max_draft_len: int) -> list[str]:
    if max_draft_len <= 0:
        return []
    problems = []
    if not target.has_draft_tokens_external:
        problems.append(f"{target.path}: build_config.speculative_decoding_mode is {target.spec_mode!r}, not "
                        f"draft_tokens_external ({SPEC_MODE_DRAFT_TOKENS_EXTERNAL}), so the target cannot verify "
                        f"draft tokens; rebuild it with `--speculative_decoding_mode draft_tokens_external "
                        f"--max_draft_len {max_draft_len}` ({REBUILD})")
    elif target.max_draft_len < max_draft_len:
        problems.append(f"{target.path}: build_config.max_draft_len is {target.max_draft_len}, smaller than the "
                        f"requested K = {max_draft_len}; ask for max_draft_len <= {target.max_draft_len} or rebuild "
                        f"with speculative.max_draft_len: {max_draft_len} ({REBUILD})")
    return problems


def check_medusa_mode(target: TrtllmEngineConfig, nodes: int) -> list[str]:
    """A Medusa target: built in the medusa mode, with room for every node of the tree it is asked to verify."""
    if not target.has_medusa:
        return [f"{target.path}: build_config.speculative_decoding_mode is {target.spec_mode!r}, not medusa "
                f"({SPEC_MODE_MEDUSA}), so the engine has no Medusa heads to draft with; rebuild it from a config with "
                f"speculative.method: medusa ({REBUILD})"]
    if target.max_draft_len < nodes:
        return [f"{target.path}: build_config.max_draft_len is {target.max_draft_len}, fewer than the {nodes} nodes "
                f"of the Medusa tree (speculative.medusa.choices); rebuild with this config ({REBUILD})"]
    return []


def check_context_logits(engine: TrtllmEngineConfig) -> list[str]:
    if engine.gather_context_logits and engine.max_draft_len > 0:
        return [f"{engine.path}: build_config.gather_context_logits is true with max_draft_len "
                f"{engine.max_draft_len}; TensorRT-LLM does not support the two together, rebuild without "
                f"--gather_context_logits ({REBUILD})"]
    return []


def check_vocab(target: TrtllmEngineConfig, draft: TrtllmEngineConfig, tokenizer_len: int | None,
                uses_logits: bool) -> list[str]:
    """Token ids are only meaningful across engines when both cover the same tokenizer.

    Rows past the tokenizer's length are padding (Qwen2.5 7B has 152064 rows, 0.5B 151936, one tokenizer of
    151665 tokens); the executor pads draft logits to the target's width, so only real tokens must be covered.
    """
    t, d = target.vocab_size, draft.vocab_size
    if t is None or d is None or t == d:
        return []
    if tokenizer_len is not None:
        if min(t, d) >= tokenizer_len:
            return []
        short = target if t < d else draft
        return [f"{short.path}: pretrained_config.vocab_size is {short.vocab_size}, fewer rows than the "
                f"tokenizer's {tokenizer_len} tokens; the draft and target come from different tokenizers, pick a "
                f"draft from the target's model family"]
    if not uses_logits:
        return []
    return [f"{draft.path}: pretrained_config.vocab_size is {d} but the target's ({target.path}) is {t}; draft "
            f"logits cannot be compared with the target's (\"Incompatible buffer sizes\"); pick a draft with the "
            f"target's vocabulary or set speculative.acceptance: greedy"]


def check_generation_logits(engine: TrtllmEngineConfig, role: str) -> list[str]:
    if engine.gather_generation_logits:
        return []
    return [f"{engine.path}: build_config.gather_generation_logits is false but speculative.acceptance is "
            f"'rejection', which hands the {role}'s generation logits over; rebuild with --gather_generation_logits "
            f"({REBUILD}) or set speculative.acceptance: greedy"]


def check_version(engine: TrtllmEngineConfig, installed: str | None) -> list[str]:
    if installed is None or engine.version == installed:
        return []
    return [f"{engine.path}: version is {engine.version!r} but the installed TensorRT-LLM is {installed}; engines "
            f"only load in the release that built them, {REBUILD} (or run in the {engine.version} container)"]


def check_world_size(engine: TrtllmEngineConfig, device_ids: list[int], field: str) -> list[str]:
    if engine.world_size == len(device_ids):
        return []
    return [f"{field}: {device_ids} lists {len(device_ids)} GPUs but {engine.path} was built for "
            f"pretrained_config.mapping world_size {engine.world_size}; list exactly {engine.world_size} device ids"]


def preflight(target: TrtllmEngineConfig, draft: TrtllmEngineConfig, *, max_draft_len: int, acceptance: str,
              installed_version: str | None, tokenizer_len: int | None = None,
              target_device_ids: list[int] | None = None, draft_device_ids: list[int] | None = None) -> list[str]:
    """Every problem found (empty when the pair can run); the caller raises one EngineError with all of them."""
    uses_logits = acceptance == "rejection" and max_draft_len > 0
    problems = check_target_spec_mode(target, max_draft_len)
    problems += check_context_logits(target) + check_context_logits(draft)
    problems += check_vocab(target, draft, tokenizer_len, uses_logits)
    if uses_logits:
        problems += check_generation_logits(draft, "draft") + check_generation_logits(target, "target")
    problems += check_version(target, installed_version) + check_version(draft, installed_version)
    if target_device_ids is not None:
        problems += check_world_size(target, target_device_ids, "runtime.target_device_ids")
    if draft_device_ids is not None:
        problems += check_world_size(draft, draft_device_ids, "runtime.draft_device_ids")
    return problems


def raise_if_problems(problems: list[str]) -> None:
    if problems:
        raise EngineError("; ".join(problems))
