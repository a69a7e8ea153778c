"""The `check` stage: refuse a config or a pair that cannot work, before any expensive conversion or build."""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field

from .config import DEFAULT_MAX_SEQ_LEN_CAP, MAX_DRAFT_LEN_LIMIT, BuildSpec, PipelineConfig
from .decoder_support import LEAN, runner_for
from .dtypes import DtypeChoice, checkpoint_dtype, resolve_dtype, torch_device
from .errors import CompatibilityError, short_repr
from .methods import Method
from .models import (ResolvedModel, compare_tokenizers, load_tokenizer, max_positions, read_hf_config, resolve_model,
                     validate_weights, weights_nonfinite)

# Architectures TensorRT-LLM 1.1's checkpoint converters handle for the draft-target path: the decoder-only
# causal-LM keys of tensorrt_llm/models/__init__.py MODEL_MAP (encoders, vision and Medusa/EAGLE/ReDrafter heads
# left out); tests/data/trtllm_1.1.0_api.json records the map. The torch backend accepts any causal LM.
TRTLLM_ARCHITECTURES = {
    "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "InternLM2ForCausalLM", "GraniteForCausalLM",
    "ExaoneForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "GemmaForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "PhiForCausalLM", "FalconForCausalLM",
    "GPTNeoXForCausalLM", "GPTJForCausalLM", "GPT2LMHeadModel", "GPTBigCodeForCausalLM", "Starcoder2ForCausalLM",
    "NemotronForCausalLM", "BloomForCausalLM", "OPTForCausalLM", "BaichuanForCausalLM", "DeciLMForCausalLM",
    "DeepseekForCausalLM", "CohereForCausalLM", "DbrxForCausalLM", "MPTForCausalLM",
}


@dataclass
class CheckReport:
    ok: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    defaults: list[str] = field(default_factory=list)  # build limits and dtypes the config left out, as derived
    build: BuildSpec | None = None  # config.build with those limits filled in
    dtypes: dict[str, DtypeChoice] = field(default_factory=dict)  # per role, as resolved

    def raise_if_failed(self) -> None:
        if self.errors:
            raise CompatibilityError("; ".join(self.errors))

    def resolved(self, config: PipelineConfig) -> PipelineConfig:
        """``config`` with the derived limits and dtypes filled in: what the stages and manifests use."""
        return _with_resolved(config, self.build or config.build, self.dtypes)


def resolve_build_limits(build: BuildSpec, model_limits: dict[str, int | None]) -> tuple[BuildSpec, list[str]]:
    """``build`` with the limits it leaves out derived from the models, and one line per derived value.

    max_seq_len: the smallest position limit of the models (what trtllm-build derives when it is not given),
    at most DEFAULT_MAX_SEQ_LEN_CAP; max_input_len: half of max_seq_len, so prompts and completions get equal
    room and any K fits in the rest. Values the config sets are kept as written (check_pair checks them).
    """
    notes = []
    seq_len = build.max_seq_len
    if seq_len is None:
        known = {role: limit for role, limit in model_limits.items() if limit}
        seq_len = min([*known.values(), DEFAULT_MAX_SEQ_LEN_CAP])
        stated = ", ".join(f"{role} {limit}" for role, limit in known.items()) or "neither model states one"
        notes.append(f"build.max_seq_len: {seq_len} (not set: the models' position limit ({stated}), at most "
                     f"{DEFAULT_MAX_SEQ_LEN_CAP})")
    input_len = build.max_input_len
    if input_len is None:
        input_len = max(1, seq_len // 2)
        notes.append(f"build.max_input_len: {input_len} (not set: half of max_seq_len)")
    return build.model_copy(update={"max_seq_len": seq_len, "max_input_len": input_len}), notes


def resolve_dtypes(config: PipelineConfig, hf_configs: dict[str, dict]) -> dict[str, DtypeChoice]:
    """The concrete dtype of each role (see pipeline/dtypes.py); ``hf_configs``: each role's config.json."""
    device = "cuda" if config.backend == "trtllm" else torch_device(config.runtime.device)
    return {role: resolve_dtype(getattr(config, role).dtype, checkpoint_dtype(hf_configs[role]), config.backend,
                                device, int8_weights=config.build.quantization.of(role) == "int8_weight_only")
            for role in hf_configs}


def _with_resolved(config: PipelineConfig, build: BuildSpec, dtypes: dict[str, DtypeChoice]) -> PipelineConfig:
    """A copy of ``config`` with ``build`` and the roles' dtypes (the private base_dir comes along)."""
    update: dict = {"build": build}
    for role, choice in dtypes.items():
        update[role] = getattr(config, role).model_copy(update={"dtype": choice.dtype})
    return config.model_copy(update=update)


def with_resolved_defaults(config: PipelineConfig) -> PipelineConfig:
    """``config`` with concrete build limits and dtypes, what every stage and manifest uses: as written where the
    config sets them, else derived from the models' config files (resolve_build_limits, resolve_dtypes)."""
    auto_roles = [role for role in config.roles if getattr(config, role).dtype == "auto"]
    if config.build.max_seq_len is not None and config.build.max_input_len is not None and not auto_roles:
        return config
    hf_configs = {}
    for role in config.roles:
        model = resolve_model(getattr(config, role), role, config.base_dir, with_weights=False)
        hf_configs[role] = read_hf_config(model)
    limits = {role: max_positions(hf) for role, hf in hf_configs.items()}
    build = resolve_build_limits(config.build, limits)[0]
    return _with_resolved(config, build, resolve_dtypes(config, {r: hf_configs[r] for r in auto_roles}))


def architecture(hf_config: dict) -> str:
    archs = hf_config.get("architectures") or []
    return archs[0] if archs else f"<{hf_config.get('model_type', 'unknown')}>"


def _check_draft_vocab(hf_config: dict, vocab_size, backend: str, report: CheckReport) -> None:
    """A train-draft --vocab draft: its recorded token ids are valid, and what each backend does with them."""
    from .draft_vocab import CONFIG_KEY, check_ids

    ids = hf_config.get(CONFIG_KEY)
    if ids is None:
        return
    problem = check_ids(ids, vocab_size if isinstance(vocab_size, int) else 0)
    if problem:
        report.errors.append(f"draft.model: {CONFIG_KEY} in its config.json {problem}; retrain the draft with "
                             f"train-draft --vocab, or delete the key to draft over the whole vocabulary")
    elif backend == "torch":
        report.ok.append(f"draft.model: LM head over {len(ids)} of {vocab_size} tokens ({CONFIG_KEY}): the draft "
                         f"computes only those logits and never proposes other tokens (lossless)")
    else:
        report.warnings.append(f"draft.model: {CONFIG_KEY} ({len(ids)} of {vocab_size} tokens) is not used by the "
                               f"trtllm backend: the draft engine is built with the checkpoint's whole LM head, whose "
                               f"rows outside those tokens were not trained (still lossless: the target verifies "
                               f"its tokens as any draft's; acceptance may be lower than on the torch backend)")


def _check_architecture(model: ResolvedModel, hf_config: dict, backend: str, report: CheckReport) -> None:
    arch = architecture(hf_config)
    if backend == "trtllm":
        if arch not in TRTLLM_ARCHITECTURES:
            report.errors.append(f"{model.field}: architecture {arch} has no TensorRT-LLM converter in the pinned "
                                 f"release; use backend: torch or a model of a supported family "
                                 f"({', '.join(sorted(TRTLLM_ARCHITECTURES)[:5])}, ...)")
            return
    else:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        remote = "AutoModelForCausalLM" in (hf_config.get("auto_map") or {})
        if hf_config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not remote:
            report.errors.append(f"{model.field}: model_type {hf_config.get('model_type')!r} ({arch}) is not a "
                                 f"causal LM that transformers can load; pick a decoder-only model")
            return
        if remote and not model.spec.trust_remote_code:
            report.errors.append(f"{model.field}: {arch} needs its own modelling code; set "
                                 f"{model.role}.trust_remote_code: true if you trust {model.spec.model}")
            return
    report.ok.append(f"{model.role}: {arch}")


def check_pair(config: PipelineConfig, with_weights: bool = False) -> CheckReport:
    """Validate the pair; returns the report (caller raises).

    Reads config and tokenizer files, plus the weights' headers when ``with_weights`` (before convert/build).
    """
    report = CheckReport()
    models, hf_configs = _check_models(config, with_weights, report)
    if config.speculative.medusa is not None:
        _check_medusa(config, hf_configs["target"], report)
    if config.speculative.eagle3 is not None and config.has_eagle3_heads:
        _check_eagle3(config, hf_configs["target"], report)
    if "draft" not in models and config.speculative.method in (Method.NGRAM, Method.SUFFIX):
        report.ok.append(f"speculative.method: {config.speculative.method.value} (lookups in the prompt and output"
                         f"{' and recent outputs' if config.speculative.method == Method.SUFFIX else ''}; no draft "
                         f"model)")
    if "draft" in models:
        _check_tokenizers(models, hf_configs, config.backend, report)
    _check_limits(config, hf_configs, report)
    _check_backend_settings(config, hf_configs["target"], report)
    if config.backend == "torch":
        _say_runners(config, hf_configs, report)
    if problem := bind_address_problem(config.serve.bind_address):
        report.errors.append(problem)
    report.warnings.extend(serve_exposure_warnings(config))
    return report


def _check_models(config: PipelineConfig, with_weights: bool, report: CheckReport
                  ) -> tuple[dict[str, ResolvedModel], dict[str, dict]]:
    """Each role's model found, its weights sane where they are read, its architecture supported; returns the
    models and their config.json (the draft only when the method uses a draft model)."""
    models, hf_configs = {}, {}
    for role in config.roles:
        models[role] = resolve_model(getattr(config, role), role, config.base_dir, with_weights=with_weights)
        hf_configs[role] = read_hf_config(models[role])
        if with_weights or models[role].source in ("local", "gguf"):  # local weights: check them in `check` too
            validate_weights(models[role])
            nonfinite = weights_nonfinite(models[role])  # a sample of every tensor (see models.SCAN_ROWS)
            if nonfinite:
                report.errors.append(f"{role}.model: {nonfinite} (found in a sample of each tensor); the weights "
                                     f"are broken, re-download or re-convert the model")
        _check_architecture(models[role], hf_configs[role], config.backend, report)
    return models, hf_configs


def _check_tokenizers(models: dict[str, ResolvedModel], hf_configs: dict[str, dict], backend: str,
                      report: CheckReport) -> None:
    """Draft token ids mean the same to the target: identical tokenizers, embeddings that cover them, and a draft
    trained over part of the vocabulary that names valid ids."""
    tokenizers = {role: load_tokenizer(models[role]) for role in models}
    tokenizer_problems = compare_tokenizers(tokenizers["target"], tokenizers["draft"])
    if tokenizer_problems:
        report.errors.append("draft.model: tokenizer differs from target (" + "; ".join(tokenizer_problems)
                             + "); pick a draft from the same model family")
    else:
        report.ok.append("tokenizers identical")
    t_vocab = (hf_configs["target"].get("text_config") or hf_configs["target"]).get("vocab_size")
    d_vocab = (hf_configs["draft"].get("text_config") or hf_configs["draft"]).get("vocab_size")
    # Fewer embedding rows than the (shared) tokenizer has tokens: every prompt holding a higher id fails.
    tokens = len(tokenizers["target"])
    short = [(role, rows) for role, rows in (("target", t_vocab), ("draft", d_vocab))
             if isinstance(rows, int) and rows < tokens]
    for role, rows in short:
        report.errors.append(f"{role}.model: {rows} embedding rows (vocab_size) but the tokenizer has {tokens} "
                             f"tokens, so ids {rows} and up would fail every request; pick a {role} whose "
                             f"embeddings cover the tokenizer")
    if t_vocab != d_vocab and not tokenizer_problems and not short:
        report.warnings.append(f"embedding rows differ (target {t_vocab}, draft {d_vocab}) although the tokenizers "
                               f"match; only the shared ids are compared")
    _check_draft_vocab(hf_configs["draft"], d_vocab, backend, report)


def _check_limits(config: PipelineConfig, hf_configs: dict[str, dict], report: CheckReport) -> None:
    """The build limits and dtypes the config leaves out, derived into the report; the lengths within both models'
    position limits; and room for K draft tokens after the longest prompt."""
    limits = {role: max_positions(hf_configs[role]) for role in config.roles}
    build, report.defaults = resolve_build_limits(config.build, limits)
    report.build = build
    report.dtypes = resolve_dtypes(config, hf_configs)
    for role, choice in report.dtypes.items():
        if getattr(config, role).dtype == "auto":
            report.defaults.append(f"{role}.dtype: {choice.dtype} ({choice.reason})")
    for role, limit in limits.items():
        # A derived max_seq_len never exceeds a limit: only a value the config sets can get here.
        if limit is not None and build.max_seq_len > limit:
            report.errors.append(f"build.max_seq_len: {build.max_seq_len} exceeds {role} "
                                 f"max_position_embeddings ({limit}); set build.max_seq_len <= {limit}")
    k = config.speculative.max_draft_len
    if build.max_input_len >= build.max_seq_len:  # one of the two derived (the config validates a set pair)
        report.errors.append(f"build.max_input_len: {build.max_input_len} must be below build.max_seq_len "
                             f"({build.max_seq_len}, derived from the models); lower it or set "
                             f"build.max_seq_len")
    elif k + 1 > build.max_seq_len - build.max_input_len:
        report.errors.append(f"speculative.max_draft_len: {k} leaves no room for generation (max_seq_len "
                             f"{build.max_seq_len} - max_input_len {build.max_input_len}); lower K or raise "
                             f"build.max_seq_len")
    elif k <= MAX_DRAFT_LEN_LIMIT:
        report.ok.append(f"K = {k}, max_seq_len {build.max_seq_len}, max_input_len {build.max_input_len}")


def _check_backend_settings(config: PipelineConfig, target_cfg: dict, report: CheckReport) -> None:
    """What only one backend can do: parallelism on trtllm, int8 weights on torch, and settings the other backend
    would silently ignore."""
    if config.backend == "trtllm":
        _check_parallel(config, target_cfg, report)
        torch_only = [name for name, section in (("build.max_num_tokens", config.build),
                                                  ("build.kv_cache.max_tokens", config.build.kv_cache))
                      if name.rsplit(".", 1)[1] in section.model_fields_set]
        if torch_only:
            report.warnings.append(f"{', '.join(torch_only)}: set, but only the torch backend uses it (TensorRT-LLM "
                                   f"sizes its KV cache by build.kv_cache.free_gpu_mem_fraction)")
        return
    _check_torch_quantization(config, report)
    trtllm_only = sorted(TRTLLM_ONLY_KV & config.build.kv_cache.model_fields_set)
    if trtllm_only:
        report.warnings.append(f"build.kv_cache.{', '.join(trtllm_only)}: set, but only backend trtllm uses it "
                               f"(the torch backend's paged cache reads tokens_per_block, enable_block_reuse and "
                               f"max_tokens)")


def _say_runners(config: PipelineConfig, hf_configs: dict[str, dict], report: CheckReport) -> None:
    """Which model runner each role's engine will use (pipeline/decoder_support.py)."""
    max_seq_len = (report.build or config.build).max_seq_len or 0
    for role in config.roles:
        runner, reason = runner_for(hf_configs[role], max_seq_len, config.build.quantization.of(role))
        report.ok.append(f"{role}: runs on the lean Llama-family decoder" if runner == LEAN else
                         f"{role}: runs through the Hugging Face modules ({reason})")
        if reason and "sliding" in reason:
            report.warnings.append(f"{role}.model: {reason}, but the paged attention attends over the whole "
                                   f"sequence: past the window the output differs from the model's; set "
                                   f"build.max_seq_len to the window or less")


def serve_exposure_warnings(config: PipelineConfig) -> list[str]:
    """What `serve` on a non-loopback address means for who can call it (the torch backend's fronts)."""
    s = config.serve
    if config.backend != "torch" or s.bind_address in ("127.0.0.1", "localhost") or s.bind_address.startswith("127."):
        return []
    warnings = []
    if s.api_key_env is None:
        warnings.append(f"serve.bind_address: {s.bind_address} without serve.api_key_env: anyone who reaches this "
                        f"machine can use the models; set serve.api_key_env (a variable holding a key) or bind "
                        f"127.0.0.1 behind an authenticating proxy")
    if not s.allowed_hosts:
        warnings.append(f"serve.bind_address: {s.bind_address} without serve.allowed_hosts: a remote client's "
                        f"request is refused unless its Host header (the name or address it connects to) is "
                        f"listed; add the names and addresses clients use to serve.allowed_hosts")
    return warnings


TRTLLM_ONLY_KV = {"paged", "free_gpu_mem_fraction"}


def _check_torch_quantization(config: PipelineConfig, report: CheckReport) -> None:
    """What int8 weights cost in exactness, said before anything is built (pipeline/quantize.py)."""
    for role in config.roles:
        mode = config.build.quantization.of(role)
        if mode == "none":
            continue
        dtype = report.dtypes[role].dtype
        what = (f"{role} weights int8 (per-channel scales; {dtype} activations): speculative greedy output equals "
                f"this quantized target's own target-only output, not the unquantized model's; the build records "
                f"the logit error against float32 in engine.json") if role == "target" else \
            (f"draft weights int8 (per-channel scales; {dtype} activations): the output stays the target's, only "
             f"the acceptance rate can change")
        report.ok.append(what)
        if dtype == "float32":
            report.warnings.append(f"{role}.dtype: float32 with int8 weights multiplies by the dequantized matrix "
                                   f"(correct, but slower than float32 weights); set {role}.dtype: bfloat16 or "
                                   f"auto for the int8 kernel")


def _check_medusa(config: PipelineConfig, target_cfg: dict, report: CheckReport) -> None:
    """The heads folder fits the target and the configured counts; what each backend does with the tree."""
    from .medusa_heads import heads_problems

    method = config.speculative.method
    if not config.has_medusa_heads:
        report.warnings.append(f"speculative.medusa: set, but speculative.method is {method.value!r} on backend "
                               f"trtllm, whose engines verify one kind of draft: the heads are not built in; set "
                               f"method: medusa to use them")
        return
    medusa = config.speculative.medusa
    text = target_cfg.get("text_config") or target_cfg
    problems = heads_problems(config.medusa_dir(), medusa.heads, medusa.layers, text.get("hidden_size"),
                              text.get("vocab_size"))
    report.errors.extend(problems)
    tree = medusa.tree()
    name = medusa.choices if isinstance(medusa.choices, str) else "from the config"
    if medusa.default_cut:
        name = f"{name} cut to the {medusa.heads} heads (choices not set; its deeper nodes dropped)"
    role = "speculative.method: medusa" if method.needs_medusa_heads else \
        f"speculative.medusa: heads built in beside method {method.value!r} (requests may pick method medusa)"
    if not problems:
        report.ok.append(f"{role} ({medusa.heads} heads of {medusa.layers} layer(s); tree {name}: {tree.size - 1} "
                         f"nodes, depth {tree.max_depth}, top-k per depth {tree.top_k()})")
    if config.backend == "trtllm":
        report.warnings.append("speculative.method: medusa on trtllm verifies greedily only (TensorRT-LLM 1.1.0 "
                               "Medusa); sampled requests are refused there, the torch backend samples losslessly")


def _check_eagle3(config: PipelineConfig, target_cfg: dict, report: CheckReport) -> None:
    """The EAGLE-3 heads folder reads and fits the target (hidden size, vocabulary, the layers it fuses)."""
    from .eagle3_heads import CONFIG_FILE, Eagle3Config

    folder = config.eagle3_dir()
    text = target_cfg.get("text_config") or target_cfg
    try:
        heads = Eagle3Config.from_json(json.loads((folder / CONFIG_FILE).read_text()))
    except (OSError, ValueError) as exc:
        report.errors.append(f"speculative.eagle3.model: {folder}: {exc}; train heads with `python -m pipeline "
                             f"train-draft CONFIG --kind eagle3`")
        return
    layers = text.get("num_hidden_layers")
    for key, theirs, ours in (("hidden_size", heads.target_hidden_size, text.get("hidden_size")),
                              ("vocab_size", heads.vocab_size, text.get("vocab_size"))):
        if ours is not None and theirs != ours:
            report.errors.append(f"speculative.eagle3.model: {folder} was trained for {key} {theirs}, the target has "
                                 f"{ours}; train heads for this target")
            return
    if layers is not None and max(heads.target_layers) >= layers - 1:
        report.errors.append(f"speculative.eagle3.model: {folder} fuses target layers {list(heads.target_layers)}, "
                             f"the target has {layers}; train heads for this target")
        return
    beside = "" if config.speculative.method.needs_eagle3_heads else \
        f" (built in beside method {config.speculative.method.value!r}; requests may pick method eagle3)"
    report.ok.append(f"speculative.eagle3: heads over target layers {list(heads.target_layers)}, "
                     f"{heads.draft_vocab_size} draft tokens{beside}")


def _check_parallel(config: PipelineConfig, target_cfg: dict, report: CheckReport) -> None:
    par = config.build.parallel
    devices = config.runtime.target_device_ids
    if par.world_size != len(devices):
        report.errors.append(f"runtime.target_device_ids: {devices} has {len(devices)} GPUs but build.parallel "
                             f"needs tp*pp = {par.world_size}; list exactly {par.world_size} device ids")
    text = target_cfg.get("text_config") or target_cfg
    heads = text.get("num_attention_heads")
    if heads and heads % par.tp:
        report.errors.append(f"build.parallel.tp: {par.tp} does not divide the target's {heads} attention heads; "
                             f"use a divisor of {heads}")
    layers = text.get("num_hidden_layers")
    if layers and par.pp > layers:
        report.errors.append(f"build.parallel.pp: {par.pp} exceeds the target's {layers} layers")
    if config.build.quantization.mode == "fp8":
        report.warnings.append("quantization fp8 needs Hopper or Ada GPUs (sm89+)")


def bind_address_problem(address: str) -> str | None:
    """Why tritonserver cannot listen on ``address`` as configured, or None.

    Triton 2.51 joins address and port as "host:port": for an IPv6 literal its gRPC service then fails ("'::1:8001'
    already in use"), and the bracketed form binds HTTP to every address instead of the one named. So IPv6 is
    refused here, by `check` and `serve`, rather than half-working or exposing the server.
    """
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        if ":" in address or not address.strip():
            return (f"serve.bind_address: {short_repr(address)} is not an IPv4 address or host name; use "
                    f"127.0.0.1 (loopback, the default) or 0.0.0.0 to listen on every interface")
        return None  # a host name: Triton resolves it
    if parsed.version == 6:
        return (f"serve.bind_address: {short_repr(address)} is IPv6, which tritonserver 2.51 cannot bind all "
                f"three services to; use 127.0.0.1 (loopback, the default) or 0.0.0.0 and reach it over IPv4")
    return None
