"""Typed pipeline configuration, loaded from one YAML file and validated before any work starts.

Every section is a pydantic model with ``extra="forbid"``, so a misspelt key is an error (naming the closest valid
key) rather than a silently ignored setting. Validation errors are rewritten by :func:`load_config` into one line
per problem that names the field, the bad value and the fix.
"""

from __future__ import annotations

import difflib
import json
import os
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError, short_repr
from .methods import Method, NgramSettings, SuffixSettings
from .speculative.tree_choices import DEFAULT_TREE, NAMED_TREES, tree_paths

if TYPE_CHECKING:
    from .speculative.tree import TokenTree

# K beyond this gives no measurable benefit (acceptance decays geometrically with position) and TensorRT-LLM's
# draft_tokens_external path sizes per-request buffers by it, so a typo such as 40 would waste GPU memory.
MAX_DRAFT_LEN_LIMIT = 16

# Without build.max_seq_len the engines are sized for the models' own position limit, as trtllm-build does, but
# never beyond this: KV-cache and engine buffers grow with it, and a 128k-position model (Llama 3.1) would
# otherwise reserve them for 128k-token sequences on every build. 8192 covers typical prompts plus completions.
DEFAULT_MAX_SEQ_LEN_CAP = 8192

# TensorRT-LLM sizes a Medusa engine's draft buffers by the tree's node count (--max_medusa_token_len, default 63).
MAX_MEDUSA_NODES = 63

# The one-line error lists this many problems at most (a hostile file can hold thousands).
MAX_LISTED_ERRORS = 8

Dtype = Literal["auto", "float32", "float16", "bfloat16"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSpec(_Section):
    """One model of the pair: a Hugging Face id or a local folder."""

    model: str = Field(description="Hugging Face repo id (org/name) or a local folder; relative paths are "
                                   "resolved against the folder that holds the config file.")
    revision: str | None = Field(None, description="Hub branch, tag or commit; ignored for local folders.")
    dtype: Dtype = Field(
        "auto", description="Weight and activation dtype of the built engine. 'auto': the checkpoint's own dtype where "
                            "the device runs it natively, float32 on a CPU without native 16-bit matmul, 16-bit on "
                            "trtllm (see pipeline/dtypes.py); `check` prints the choice and why. Greedy speculative "
                            "output equals target-only token for token in float32; in 16 bits a near tie can flip.")
    trust_remote_code: bool = Field(False, description="Run modelling code shipped with the checkpoint. Off by "
                                                       "default: it executes code from the model repository.")
    allow_pickle: bool = Field(False, description="Allow loading *.bin/*.pt pickle weights when no safetensors "
                                                  "exist. Off by default: unpickling can execute code.")

    @field_validator("model")
    @classmethod
    def _model_not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must name a Hugging Face id (org/name) or a local folder")
        return value


class NgramSpec(_Section):
    """N-gram (prompt-lookup) proposals: the tokens that followed the latest earlier occurrence of the sequence's
    longest recurring suffix."""

    min_match: int = Field(NgramSettings.min_match, ge=1, description="Shortest suffix (tokens) that may be looked up.")
    max_match: int = Field(NgramSettings.max_match, ge=1,
                           description="Longest suffix tried first (a longer match predicts better).")

    @model_validator(mode="after")
    def _ordered(self) -> NgramSpec:
        if self.min_match > self.max_match:
            raise ValueError(f"speculative.ngram.min_match: {self.min_match} is above max_match "
                             f"({self.max_match}); lower min_match or raise max_match")
        return self

    def settings(self) -> NgramSettings:
        return NgramSettings(self.min_match, self.max_match)


class SuffixSpec(_Section):
    """Suffix decoding (``speculative.method: suffix``): the most frequent continuation of the latest tokens in suffix
    trees over the request's prompt and output and over recent requests' outputs (Arctic Inference's trees; the
    settings and defaults of vLLM's suffix_decoding_*, except max_cached_requests)."""

    max_tree_depth: int = Field(SuffixSettings.max_tree_depth, ge=2,
                                description="Longest match plus draft, in tokens (the trees' depth).")
    max_cached_requests: int = Field(
        SuffixSettings.max_cached_requests, ge=0,
        description="Past requests' outputs every request may draft from (oldest dropped first; 0: none, only the "
                    "request's own prompt and output). Kept per cache_salt: requests with different salts never "
                    "draft from each other's outputs. About 220 bytes of memory per cached output token.")
    max_spec_factor: float = Field(SuffixSettings.max_spec_factor, gt=0.0,
                                   description="A draft is at most this times its match's length (and at most K).")
    min_token_prob: float = Field(SuffixSettings.min_token_prob, ge=0.0, le=1.0,
                                  description="Draft only tokens whose probability estimated from the trees' counts "
                                              "is at least this.")

    tree: bool = Field(SuffixSettings.tree,
                       description="Draft a tree: the likeliest continuations where the counts branch (up to K "
                                   "tokens in all), verified in one target forward by the tree rules (torch "
                                   "backend; the TensorRT-LLM executor drafts the chain).")

    def settings(self) -> SuffixSettings:
        return SuffixSettings(self.max_tree_depth, self.max_cached_requests, self.max_spec_factor,
                              self.min_token_prob, self.tree)


def _token_tree(paths) -> TokenTree:
    """The tree of ``paths`` (torch-backed: imported here, so loading a config does not import torch)."""
    from .speculative.tree import TokenTree

    return TokenTree.from_choices(paths)


class MedusaSpec(_Section):
    """Medusa heads on the target (``speculative.method: medusa``): a tree of candidates from the heads' top-k per
    depth, verified in one target forward."""

    model: str = Field(description="Folder of the heads in FasterDecoding/Medusa's layout (medusa_lm_head.safetensors "
                                   "and config.json), as `python -m pipeline train-draft CONFIG --kind medusa` "
                                   "writes it; a relative path resolves against the config file's folder.")
    heads: int = Field(4, ge=1, description="Heads in the folder; head h predicts the token h + 2 places ahead.")
    layers: int = Field(1, ge=0, description="Residual blocks per head.")
    choices: str | list[list[int]] = Field(
        DEFAULT_TREE, description="The candidate tree: paths of ranks from the root ([[0], [0, 0], [1]]: head 0's "
                                  "best and second-best token, and head 1's best after the first), or a named tree: "
                                  + ", ".join(NAMED_TREES) + ". Its depth is at most `heads`; left out, the default "
                                  "tree is cut to the heads there are.")

    @field_validator("choices")
    @classmethod
    def _known_tree(cls, value):
        if isinstance(value, str):
            if value not in NAMED_TREES:
                raise ValueError(f"is not a named tree; use one of {', '.join(NAMED_TREES)} or a list of paths "
                                 f"such as [[0], [0, 0], [1]]")
        else:
            _token_tree(value)  # raises naming the bad path
        return value

    @model_validator(mode="after")
    def _depth_fits(self) -> MedusaSpec:
        depth = self.tree().max_depth
        if depth > self.heads:
            raise ValueError(f"speculative.medusa.choices: the tree is {depth} deep but there are {self.heads} heads "
                             f"(depth d uses head d); drop the deeper paths, train more heads, or leave choices out (the default "
                             f"tree is then cut to the heads)")
        if self.tree().size - 1 > MAX_MEDUSA_NODES:
            raise ValueError(f"speculative.medusa.choices: {self.tree().size - 1} nodes, above {MAX_MEDUSA_NODES} "
                             f"(TensorRT-LLM's --max_medusa_token_len default); use a smaller tree")
        return self

    @property
    def default_cut(self) -> bool:
        """The tree is the default one, cut to fewer heads than it is deep (choices not written)."""
        return "choices" not in self.model_fields_set and _token_tree(tree_paths(DEFAULT_TREE)).max_depth \
            > self.heads

    def paths(self) -> list[list[int]]:
        paths = tree_paths(self.choices)
        if "choices" not in self.model_fields_set:
            # Dropping every path deeper than the heads keeps the tree whole: a kept path's prefixes are shorter.
            paths = [path for path in paths if len(path) <= self.heads]
        return paths

    def tree(self) -> TokenTree:
        return _token_tree(self.paths())


class Eagle3Spec(_Section):
    """EAGLE-3 heads on the target (``speculative.method: eagle3``): one layer over three of the target's layers'
    hidden states drafts a chain with its own KV."""

    model: str = Field(description="Folder of the heads in vLLM's Eagle3 layout (config.json and model.safetensors), "
                                   "as `python -m pipeline train-draft CONFIG --kind eagle3` writes it; a relative "
                                   "path resolves against the config file's folder.")
    tree: bool = Field(False, description="Draft the K likeliest candidates of a depth-wise expansion (4 per depth) "
                                          "as a tree, verified in one forward, instead of a chain of K.")


class SpeculativeSpec(_Section):
    method: Method = Field(
        Method.DRAFT_MODEL,
        description="Who proposes draft tokens: 'draft_model' (the draft engine), 'ngram' (lookups in the prompt "
                    "and generated text; no draft model needed), 'ngram+draft' (per step and request, whichever "
                    "promises more tokens per unit of cost; lookups only where a match exists), 'medusa' (heads on "
                    "the target), 'eagle3' (EAGLE-3 heads reading the target's hidden states), 'suffix' (suffix trees over the prompt, the output and recent outputs; no draft "
                    "model needed). Changing it rebuilds nothing: it is a runtime choice.")
    ngram: NgramSpec = Field(default_factory=NgramSpec)
    suffix: SuffixSpec = Field(default_factory=SuffixSpec)
    medusa: MedusaSpec | None = Field(None, description="Required when method is 'medusa'.")
    eagle3: Eagle3Spec | None = Field(None, description="Required when method is 'eagle3'.")
    max_draft_len: int = Field(4, description="K: draft tokens proposed per target step (medusa: the tree's depth "
                                              "decides, this is not read).")
    acceptance: Literal["greedy", "rejection"] = Field(
        "rejection",
        description="How the target checks draft tokens under sampling: 'rejection' compares probabilities "
                    "(needs draft logits), 'greedy' keeps the prefix equal to the target's own tokens. Both keep "
                    "the target's distribution; at temperature 0 both are exact greedy decoding.")

    @model_validator(mode="after")
    def _medusa_heads(self) -> SpeculativeSpec:
        if self.method.needs_medusa_heads and self.medusa is None:
            raise ValueError("speculative.medusa: required for speculative.method 'medusa'; add medusa: {model: "
                             "<heads folder>} (train them with `python -m pipeline train-draft CONFIG --kind medusa`)")
        if self.method.needs_eagle3_heads and self.eagle3 is None:
            raise ValueError("speculative.eagle3: required for speculative.method 'eagle3'; add eagle3: {model: "
                             "<heads folder>} (train them with `python -m pipeline train-draft CONFIG --kind eagle3`)")
        return self

    @field_validator("max_draft_len")
    @classmethod
    def _k_in_range(cls, value: int) -> int:
        if not 1 <= value <= MAX_DRAFT_LEN_LIMIT:
            raise ValueError(f"must be between 1 and {MAX_DRAFT_LEN_LIMIT}; 3 to 6 is typical")
        return value


class ParallelSpec(_Section):
    tp: int = Field(1, ge=1, description="Tensor-parallel ranks of the target.")
    pp: int = Field(1, ge=1, description="Pipeline-parallel ranks of the target.")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp


class KVCacheSpec(_Section):
    """The KV cache manager: TensorRT-LLM's on trtllm; on torch the engine's own paged cache (blocks per request,
    prefix reuse across requests), which reads tokens_per_block, enable_block_reuse and max_tokens."""

    paged: bool = Field(True, description="trtllm: paged KV cache (required by draft_tokens_external).")
    tokens_per_block: int = Field(64, description="Tokens per KV block (power of two); prefixes are reused in whole "
                                                  "blocks.")
    free_gpu_mem_fraction: float = Field(0.9, gt=0.0, le=1.0,
                                         description="trtllm: share of free GPU memory the KV cache may take.")
    enable_block_reuse: bool = Field(True, description="Reuse the KV blocks of prompt prefixes across requests (a "
                                                       "shared system prompt is computed once).")
    max_tokens: int | None = Field(None, ge=1, description="torch: KV positions each model's block pool may hold "
                                                           "(the memory limit; requests wait for room). Default: "
                                                           "every running request at max_seq_len.")

    @field_validator("tokens_per_block")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value < 1 or value & (value - 1):
            raise ValueError("must be a power of two such as 32, 64 or 128")
        return value


TORCH_QUANT_MODES = ("none", "int8_weight_only")  # what pipeline/quantize.py implements


class QuantizationSpec(_Section):
    """Weight quantization. torch implements int8_weight_only (int8 weights, per-channel scales, 16-bit
    activations; pipeline/quantize.py) for the target and the draft; trtllm every mode, for the target only."""

    mode: Literal["none", "fp8", "int8_weight_only", "int4_awq"] = Field(
        "none", description="Weight quantization of the target. Speculative greedy output equals the QUANTIZED "
                            "target's own target-only output, not the unquantized model's.")
    draft_mode: Literal["none", "int8_weight_only"] = Field(
        "none", description="torch: weight quantization of the draft model (a cheaper draft; the output stays "
                            "the target's, only the acceptance rate can change).")
    kv_cache: Literal["none", "fp8", "int8"] = Field("none", description="KV-cache quantization.")

    def of(self, role: str) -> str:
        return self.mode if role == "target" else self.draft_mode


class BuildSpec(_Section):
    max_batch_size: int = Field(8, ge=1)
    max_input_len: int | None = Field(
        None, ge=1, description="Longest prompt in tokens. Default: half of max_seq_len (prompts and completions "
                                "get equal room); `check` prints the value chosen.")
    max_seq_len: int | None = Field(
        None, ge=2, description="Prompt plus generated tokens. Default: the smaller of the two models' "
                                "max_position_embeddings, at most "
                                f"{DEFAULT_MAX_SEQ_LEN_CAP} (KV cache and engine buffers grow with it); `check` "
                                "prints the value chosen. A value you set is checked against both models.")
    max_num_tokens: int = Field(256, ge=1, description="torch: tokens one engine step computes (the running "
                                                       "requests' verify tokens, then prompt chunks; at least one KV "
                                                       "block of prompt per step): a long prompt is prefilled over "
                                                       "several steps while the others keep decoding.")
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    kv_cache: KVCacheSpec = Field(default_factory=KVCacheSpec)
    quantization: QuantizationSpec = Field(default_factory=QuantizationSpec)

    @model_validator(mode="after")
    def _input_fits(self) -> BuildSpec:
        # A limit left out is derived from the models by `check` (checks.resolve_build_limits), which checks it.
        if self.max_input_len is not None and self.max_seq_len is not None and \
                self.max_input_len >= self.max_seq_len:
            raise ValueError(
                f"build.max_input_len: {self.max_input_len} must be below build.max_seq_len "
                f"({self.max_seq_len}); raise max_seq_len or lower max_input_len")
        return self


class RuntimeSpec(_Section):
    device: Literal["cpu", "cuda", "auto"] = Field("auto", description="torch backend device; auto = cuda if "
                                                                       "available.")
    target_device_ids: list[int] = Field(default_factory=lambda: [0], description="GPUs of the target (trtllm).")
    draft_device_ids: list[int] = Field(default_factory=lambda: [0], description="GPUs of the draft (trtllm).")
    torch_compile: bool | Literal["max-autotune"] = Field(
        False, description="torch backend: compile the draft and target forwards at engine start. A Llama-family "
                           "model (the lean decoder) gets one graph per power-of-two width up to "
                           "compile_max_width (and one for a request's full verify, K + 1), its weights frozen in, "
                           "compiled ahead of time by inductor before the first request (tens of seconds per graph; "
                           "'max-autotune' also times candidate kernels) "
                           "and kept in ~/.cache/specpipe/compiled, so the next start with the same weights loads "
                           "them in seconds; any other model is compiled with dynamic shapes as its first requests "
                           "arrive.")
    compile_max_width: int = Field(
        16, ge=1, description="torch_compile on the lean decoder: the widest forward (tokens) that runs compiled; "
                              "the buckets are the powers of two up to it (and never past every running row's "
                              "verify), with K + 1 when it is below the widest. Each bucket holds its own copy of "
                              "the weights in memory and in the compiled package on disk, so the cap trades memory "
                              "for the widths a batch's verify reaches; wider forwards (prompt chunks, large "
                              "batches) run eager.")


class ServeSpec(_Section):
    bind_address: str = Field("127.0.0.1", description="Address tritonserver listens on. Loopback by default; "
                                                       "set 0.0.0.0 deliberately to expose it.")
    http_port: int = Field(8000, ge=1, le=65535)
    grpc_port: int = Field(8001, ge=1, le=65535)
    metrics_port: int = Field(8002, ge=1, le=65535)
    openai_port: int = Field(8080, ge=1, le=65535, description="`serve --openai`: port of the OpenAI-compatible "
                                                              "HTTP endpoint (on bind_address).")
    instances: int = Field(1, ge=1, description="Model instances (Python backend) per model.")
    max_queue_delay_us: int = Field(0, ge=0, description="Dynamic batching delay.")
    api_key_env: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Name of an environment variable holding an API key: when set, the HTTP, gRPC and OpenAI "
                    "endpoints need `Authorization: Bearer <key>` (health checks excepted). The key itself never "
                    "goes in the config, on a command line or into tritonserver's environment.")
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host header values accepted besides the bind address (and localhost names on loopback), e.g. "
                    "the DNS name clients use; anything else is refused (DNS rebinding).")
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="Browser origins (scheme://host[:port]) allowed to call the HTTP endpoints cross-site (CORS); "
                    "none by default.")
    max_connections: int = Field(256, ge=1, description="Concurrent connections per HTTP endpoint; over it, 503.")
    read_timeout_s: float = Field(30.0, gt=0, description="A connection must deliver a whole request within this "
                                                          "time, or it is closed.")
    request_timeout_s: float = Field(600.0, gt=0, description="Server-side deadline of one request (OpenAI and "
                                                              "the Triton request/response model).")
    drain_timeout_s: int = Field(15, ge=0, le=600, description="On SIGTERM, how long in-flight requests get to "
                                                               "finish before they are ended with an error.")
    prefix_cache_metrics: bool = Field(
        False, description="Export the prefix-cache counters on the metrics port. Off by default: that port has "
                           "no authentication, and the counters' growth tells a client whether someone else sent a "
                           "prompt it guesses.")

    @model_validator(mode="after")
    def _distinct_ports(self) -> ServeSpec:
        ports = [self.http_port, self.grpc_port, self.metrics_port, self.openai_port]
        if len(set(ports)) != 4:
            raise ValueError(f"serve ports must differ, got http {ports[0]}, grpc {ports[1]}, metrics {ports[2]}, "
                             f"openai {ports[3]}")
        return self


class PipelineConfig(_Section):
    # At most 100 characters: it names a folder, and file systems refuse names over 255 bytes (with the
    # suffixes stages add) only when `build` gets there.
    name: str = Field(description="Names the output folder engines/<name>/.", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                      max_length=100)
    backend: Literal["torch", "trtllm"] = "torch"
    target: ModelSpec
    draft: ModelSpec | None = Field(None, description="Required for speculative.method 'draft_model' and "
                                                      "'ngram+draft'.")
    speculative: SpeculativeSpec = Field(default_factory=SpeculativeSpec)
    build: BuildSpec = Field(default_factory=BuildSpec)
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    serve: ServeSpec = Field(default_factory=ServeSpec)

    # Set by load_config, not by the YAML: where relative model paths are resolved from.
    _base_dir: Path = Path(".")

    @property
    def base_dir(self) -> Path:
        return self._base_dir

    @model_validator(mode="after")
    def _eagle3_on_torch(self) -> PipelineConfig:
        # TensorRT-LLM runs EAGLE-3 only in its PyTorch backend (the LLM API's speculative_config), not in the engine
        # flow this backend drives, and no source of the pinned release could be recorded to test generated LLM-API
        # settings against: refuse rather than emit untested ones.
        if self.backend == "trtllm" and self.speculative.method.needs_eagle3_heads:
            raise ValueError("speculative.method: 'eagle3' is not built for backend trtllm: TensorRT-LLM 1.1.0's engine "
                             "flow (trtllm-build) has no EAGLE-3, only its PyTorch backend does, which this pipeline "
                             "does not generate; use backend: torch with the same heads, or serve the heads folder with "
                             "trtllm-serve (--extra_llm_api_options with speculative_config: {decoding_type: Eagle, "
                             "speculative_model_dir: HEADS}) or vLLM (--speculative-config with method eagle3)")
        return self

    @model_validator(mode="after")
    def _draft_for_method(self) -> PipelineConfig:
        if self.draft is None and self.speculative.method.needs_draft_model:
            raise ValueError(f"draft: required for speculative.method {self.speculative.method.value!r}; add a draft "
                             f"model (draft: {{model: ...}}) or set speculative.method: ngram")
        return self

    @model_validator(mode="after")
    def _quantization_on_backend(self) -> PipelineConfig:
        quant = self.build.quantization
        if self.backend == "torch" and quant.mode not in TORCH_QUANT_MODES:
            raise ValueError(f"build.quantization.mode: {quant.mode!r} needs backend trtllm (TensorRT-LLM's "
                             f"kernels); the torch backend implements {' and '.join(TORCH_QUANT_MODES)}")
        if self.backend == "torch" and quant.kv_cache != "none":
            raise ValueError(f"build.quantization.kv_cache: {quant.kv_cache!r} needs backend trtllm; the torch "
                             f"backend keeps its KV cache in the model dtype, set kv_cache: none")
        if self.backend == "trtllm" and quant.draft_mode != "none":
            raise ValueError(f"build.quantization.draft_mode: {quant.draft_mode!r} is torch-only here (the trtllm "
                             f"draft engine is built in its dtype); set draft_mode: none or use backend: torch")
        return self

    @property
    def has_medusa_heads(self) -> bool:
        """The target's engine carries Medusa heads: method medusa, or on torch any config with a medusa section
        (its requests may then pick method medusa per request, beside the configured method)."""
        medusa = self.speculative.medusa is not None
        return medusa and (self.speculative.method.needs_medusa_heads or self.backend == "torch")

    def medusa_dir(self) -> Path:
        """The heads folder of speculative.medusa, resolved against the config's folder."""
        folder = Path(self.speculative.medusa.model).expanduser()
        return Path(os.path.normpath(folder if folder.is_absolute() else self.base_dir / folder))

    @property
    def has_eagle3_heads(self) -> bool:
        """The target's engine carries EAGLE-3 heads: method eagle3, or on torch any config with an eagle3 section
        (its requests may then pick method eagle3)."""
        eagle3 = self.speculative.eagle3 is not None
        return eagle3 and (self.speculative.method.needs_eagle3_heads or self.backend == "torch")

    def eagle3_dir(self) -> Path:
        """The heads folder of speculative.eagle3, resolved against the config's folder."""
        folder = Path(self.speculative.eagle3.model).expanduser()
        return Path(os.path.normpath(folder if folder.is_absolute() else self.base_dir / folder))

    @property
    def roles(self) -> tuple[str, ...]:
        """The models this config converts and builds: the draft only when its method uses a draft model."""
        return ("target",) if not self.speculative.method.needs_draft_model else ("target", "draft")

    def resolved(self) -> dict:
        """The config as plain data, the form stored in manifests (no secrets live in the config)."""
        return json.loads(self.model_dump_json())


def _loc_part(part: object) -> str:
    # A key from the YAML can hold any character (newlines included): quote odd ones so the message stays one line.
    if isinstance(part, str) and part.isidentifier() and len(part) <= 60 or type(part) is int:
        return str(part)
    return short_repr(part)


def _section_at(path: tuple) -> type[BaseModel] | None:
    """The config section (pydantic model) that the keys at ``path`` belong to; None past the sections."""
    section: type[BaseModel] = PipelineConfig
    for part in path:
        info = section.model_fields.get(part) if isinstance(part, str) else None
        if info is None:
            return None
        annotation = info.annotation
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # ModelSpec | None
            annotation = next((a for a in typing.get_args(annotation) if isinstance(a, type)
                               and issubclass(a, BaseModel)), None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        section = annotation
    return section


def _unknown_key(loc: str, path: tuple) -> str:
    """The message for a key no section has: the closest valid key (a typo), else the keys that section takes."""
    section = _section_at(path[:-1])
    keys = list(section.model_fields) if section is not None else []
    close = difflib.get_close_matches(str(path[-1]), keys, n=1, cutoff=0.6) if path else []
    if close:
        return f"{loc}: unknown key; did you mean {close[0]!r}?"
    where = ".".join(str(part) for part in path[:-1]) or "the top level"
    if keys:
        return f"{loc}: unknown key; remove it (the keys of {where}: {', '.join(keys)})"
    return f"{loc}: unknown key; remove it (see `python -m pipeline schema`)"


def _format_error(err: dict) -> str:
    loc = ".".join(_loc_part(part) for part in err["loc"]) or "<config>"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        return _unknown_key(loc, tuple(err["loc"]))
    if err["type"] == "missing":
        return f"{loc}: required but missing; add it to the config"
    value = err.get("input")
    msg = msg.replace("\n", " ")[:300]
    if msg.startswith(loc.split(".")[0] + ".") or not err["loc"]:  # a model-level validator named the field
        return msg
    return f"{loc}: {short_repr(value)} is invalid: {msg}"


def parse_config(data: object, source: str = "<config>", base_dir: Path | None = None) -> PipelineConfig:
    """Validate already-parsed YAML data; errors become one ConfigError listing every problem."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections (name, backend, target, draft, ...), "
                          f"got {type(data).__name__}")
    try:
        config = PipelineConfig.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        lines = [_format_error(e) for e in errors[:MAX_LISTED_ERRORS]]
        if len(errors) > MAX_LISTED_ERRORS:
            lines.append(f"and {len(errors) - MAX_LISTED_ERRORS} more problems")
        raise ConfigError(f"{source}: " + "; ".join(lines)) from None
    config._base_dir = (base_dir or Path(".")).resolve()
    return config


def load_config(path: str | Path) -> PipelineConfig:
    """Read and validate a YAML config; relative model paths resolve against the file's folder.

    The file is read by pipeline.yaml_loader: size, nesting, alias, duplicate-key and encoding limits, so a
    hostile file is one ConfigError.
    """
    from .yaml_loader import load_yaml_file

    path = Path(path)
    return parse_config(load_yaml_file(path), source=str(path), base_dir=path.parent)


def json_schema() -> dict:
    return PipelineConfig.model_json_schema()
