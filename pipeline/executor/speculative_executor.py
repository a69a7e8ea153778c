"""The speculative executor on the torch backend: the public API over the batching engine (batching_engine.py).

``generate(prompts)`` runs its prompts as one batch (up to max_batch_size at once, the rest queued and joining as
rows finish); ``generate_stream`` runs one request. Servers drive the engine itself (add, step, cancel) through
pipeline.executor.serving_loop.ServingLoop.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from ..draft_vocab import logit_width, reduce_head
from ..engine_info import EngineInfo, read_draft_engine, read_engine
from ..errors import EngineError
from ..kv_settings import KVSettings
from ..layout import Layout
from ..eagle3_heads import ENGINE_SUBDIR as EAGLE3_SUBDIR
from ..medusa_heads import ENGINE_SUBDIR
from ..methods import Method, NgramSettings, SuffixSettings, parse_method
from ..quantize import quantize_model
from ..speculative.tree import TokenTree
from ..speculative.tree_choices import DEFAULT_TREE, tree_paths
from .base import ExecutorBase, checked_acceptance
from .batching_engine import DEFAULT_COMPILE_MAX_WIDTH, BatchingEngine
from .request import SpecRequest
from .results import RequestError, StreamEvent

DEFAULT_MAX_BATCH = 8
UNBOUNDED_TOKENS = 1 << 20  # KV blocks are made on demand; this only bounds a pair with no position limit


class SpeculativeExecutor(ExecutorBase):
    def __init__(self, target_model, draft_model, tokenizer, max_draft_len: int = 4, device: str = "cpu",
                 acceptance: str = "rejection", max_seq_len: int | None = None, max_input_len: int | None = None,
                 engine_draft_len: int | None = None, max_batch_size: int = DEFAULT_MAX_BATCH,
                 adaptive_draft_len: bool = False, compile: bool | str = False, method: str = Method.DRAFT_MODEL,
                 ngram: NgramSettings | None = None, medusa=None, medusa_choices=DEFAULT_TREE,
                 kv: KVSettings | None = None, compile_max_width: int = DEFAULT_COMPILE_MAX_WIDTH,
                 suffix: SuffixSettings | None = None, eagle3=None, eagle3_tree: bool = False):
        """``max_draft_len``: the K of a request that names none; ``max_seq_len``: the longest prompt + output a request
        may reach (None: the fewer positions either model was made for); ``engine_draft_len``: the K the engine was
        built for, which no request may exceed (None: no limit); ``max_batch_size``: requests that run at once (the rest
        wait); ``adaptive_draft_len``: let the engine lower K per step when the batch makes drafting unprofitable
        (serving; results never depend on it); ``compile``: torch.compile the forwards (True or "max-autotune", as
        runtime.torch_compile; ``compile_max_width``: runtime.compile_max_width); ``method``: who proposes draft tokens,
        "draft_model", "ngram" (lookup in the prompt and generated text; ``draft_model`` may be None) or "ngram+draft"
        (per step, whichever promises more tokens per unit of cost) or "medusa" (``medusa``: a MedusaHeads on this
        target; ``medusa_choices``: the candidate tree, a named tree or a list of paths) or "suffix" (suffix trees over
        the prompt, the output and recent outputs, ``suffix`` their settings; ``draft_model`` may be None) or "eagle3"
        (``eagle3``: EAGLE-3 heads for this target, a folder or Eagle3Heads; ``eagle3_tree``: they draft a tree of K
        candidates instead of a chain); ``kv``: the paged KV cache's block size, memory limit and prefix reuse, and the
        engine step's token budget (chunked prefill)."""
        self.acceptance = checked_acceptance(acceptance)
        self.method = parse_method(method, draft_model is not None, has_medusa_heads=medusa is not None,
                                   has_eagle3_heads=eagle3 is not None)
        if self.method in (Method.NGRAM, Method.SUFFIX, Method.EAGLE3):
            draft_model = None  # never run: lookups need no model
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.max_draft_len = max_draft_len
        if max_seq_len is None:
            # The models' own position limit: the lean decoder's RoPE tables and a preallocated KV pool are sized by
            # it, so an unbounded default would cost seconds and hundreds of MB at every start.
            max_seq_len = _position_limit(target_model, draft_model)
        self.max_seq_len = max_seq_len
        self.max_input_len = max_input_len if max_input_len is not None else (
            max_seq_len - 1 if max_seq_len else None)
        self.engine_draft_len = engine_draft_len  # None: no engine limits K (from_pretrained)
        self.max_batch_size = max_batch_size
        if draft_model is not None:
            reduce_head(draft_model)  # a train-draft --vocab draft computes only its own tokens' logits
        target_vocab = logit_width(target_model)
        # Padded embedding rows (e.g. Qwen 7B vs 0.5B) are not tokens: compare only ids both models have.
        self.vocab_size = target_vocab if draft_model is None else min(target_vocab, logit_width(draft_model))
        self.eos_token_ids = _eos_ids(target_model, tokenizer)
        tree = None
        if medusa is not None:
            tree = TokenTree.from_choices(tree_paths(medusa_choices))
            medusa = _fit_heads(medusa, target_model, tree)
            if self.method == Method.MEDUSA:  # K is the tree's depth (a smaller K cuts the tree)
                self.max_draft_len = max_draft_len = tree.max_depth
        self.engine = BatchingEngine(
            target_model, draft_model, device=self.device, max_batch=max_batch_size,
            max_tokens=max_seq_len or UNBOUNDED_TOKENS, vocab_size=self.vocab_size,
            engine_draft_len=max(max_draft_len, engine_draft_len or 0), acceptance=acceptance,
            adaptive_draft_len=adaptive_draft_len, compile=compile, compile_max_width=compile_max_width, ngram=ngram,
            medusa=(medusa, tree) if medusa is not None else None, kv=kv, suffix=suffix,
            eagle3=_fit_eagle3(eagle3, target_model) if eagle3 is not None else None, eagle3_tree=eagle3_tree)

    @property
    def has_medusa_heads(self) -> bool:
        return self.engine.proposers.get(Method.MEDUSA) is not None

    @property
    def has_eagle3_heads(self) -> bool:
        return self.engine.proposers.get(Method.EAGLE3) is not None

    @property
    def has_draft_model(self) -> bool:
        return self.engine.draft is not None

    @property
    def target(self):
        return self.engine.target

    @property
    def draft(self):
        return self.engine.draft

    # ---- construction ---------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, target, draft, max_draft_len: int = 4, device: str = "cpu", dtype: str = "float32",
                        acceptance: str = "rejection", trust_remote_code: bool = False, tokenizer=None,
                        max_seq_len: int | None = None, max_batch_size: int = DEFAULT_MAX_BATCH,
                        compile: bool | str = False, method: str = Method.DRAFT_MODEL,
                        ngram: NgramSettings | None = None, draft_dtype: str | None = None, medusa=None,
                        medusa_choices=DEFAULT_TREE, kv: KVSettings | None = None, quantization: str = "none",
                        draft_quantization: str = "none",
                        compile_max_width: int = DEFAULT_COMPILE_MAX_WIDTH,
                        suffix: SuffixSettings | None = None, eagle3=None,
                        eagle3_tree: bool = False) -> SpeculativeExecutor:
        """Load a pair of HF causal LMs (folders or hub ids, or already-loaded models) on the torch backend;
        ``draft`` may be None with ``method="ngram"``, ``"suffix"`` or ``"medusa"``; ``draft_dtype`` (default ``dtype``): the
        draft's own; ``medusa``: a Medusa heads folder (or MedusaHeads) for method medusa, with its tree
        ``medusa_choices``; ``eagle3``: an EAGLE-3 heads folder for method eagle3 (``eagle3_tree``: drafting trees); ``quantization`` / ``draft_quantization``: "int8_weight_only" quantizes that model's
        linear layers (pipeline/quantize.py; pass dtype bfloat16 for the fast CPU kernel)."""
        from ..models import compare_tokenizers

        target_model, target_tok = _load(target, "target", dtype, trust_remote_code, quantization)
        draft_model, draft_tok = _load(draft, "draft", draft_dtype or dtype, trust_remote_code, draft_quantization) \
            if draft is not None else (None, None)
        tokenizer = tokenizer or target_tok or draft_tok
        if target_tok is not None and draft_tok is not None:
            problems = compare_tokenizers(target_tok, draft_tok)
            if problems:
                raise RequestError("draft: tokenizer differs from target (" + "; ".join(problems) +
                                   "); pick a draft from the same model family")
        return cls(target_model.to(device), draft_model.to(device) if draft_model is not None else None, tokenizer,
                   max_draft_len=max_draft_len, device=device, acceptance=acceptance, max_seq_len=max_seq_len,
                   max_batch_size=max_batch_size, compile=compile, method=method, ngram=ngram, medusa=medusa,
                   medusa_choices=medusa_choices, kv=kv, compile_max_width=compile_max_width, suffix=suffix,
                   eagle3=eagle3, eagle3_tree=eagle3_tree)

    @classmethod
    def from_engines(cls, path: str | Path, device: str | None = None, compile: bool | str = False,
                     adaptive_draft_len: bool = False, method: str | None = None,
                     ngram: NgramSettings | None = None, kv: KVSettings | None = None,
                     compile_max_width: int = DEFAULT_COMPILE_MAX_WIDTH,
                     suffix: SuffixSettings | None = None) -> SpeculativeExecutor:
        """Load the torch engines built for one config: ``engines/<name>`` (target/build, and draft/build when the
        method drafts with a model). K, the limits and the acceptance rule are the build's (engine.json);
        ``method``, ``ngram``, ``suffix`` and ``kv`` default to what the engines were built for.

        This returns a SpeculativeExecutor or raises: engines built by the trtllm backend are refused with the way to
        open them (:func:`pipeline.executor.open_executor`, which returns the executor of the backend that built a
        folder), rather than answered with an instance of another class."""
        layout = Layout(Path(path))
        target_info = read_engine(layout.root, "target")
        if target_info.backend != "torch":
            raise EngineError(f"{layout.root}: engines built by the {target_info.backend} backend, and "
                              f"SpeculativeExecutor runs the torch backend's; open them with "
                              f"pipeline.executor.open_executor(path), which returns the executor for the backend "
                              f"that built them")
        heads_dir = layout.engine_dir("target") / ENGINE_SUBDIR
        medusa = heads_dir if target_info.medusa_choices and heads_dir.is_dir() else None
        eagle3_dir = layout.engine_dir("target") / EAGLE3_SUBDIR
        eagle3 = eagle3_dir if target_info.eagle3 is not None and eagle3_dir.is_dir() else None
        method = parse_method(method or target_info.built_method(layout.engine_dir("draft").exists()),
                              has_draft_model=True, error=EngineError, has_medusa_heads=medusa is not None,
                              has_eagle3_heads=eagle3 is not None)
        draft_model = _load_draft_engine(layout, target_info, method)
        from ..models import load_tokenizer

        device = device or _auto_device()
        target_model, target_spec = _load_engine_model(layout.engine_dir("target"), target_info)
        return cls(target_model.to(device), draft_model.to(device) if draft_model is not None else None,
                   load_tokenizer(target_spec), max_draft_len=target_info.max_draft_len, device=device,
                   acceptance=target_info.acceptance, max_seq_len=target_info.max_seq_len,
                   max_input_len=target_info.max_input_len, engine_draft_len=target_info.max_draft_len,
                   max_batch_size=target_info.max_batch_size, adaptive_draft_len=adaptive_draft_len,
                   compile=compile, method=method, ngram=ngram or target_info.ngram_settings(), medusa=medusa,
                   medusa_choices=target_info.medusa_choices or DEFAULT_TREE, kv=kv or target_info.kv_settings(),
                   compile_max_width=compile_max_width, suffix=suffix or target_info.suffix_settings(),
                   eagle3=eagle3, eagle3_tree=bool((target_info.eagle3 or {}).get("tree")))

    def new_request(self, *args, **kwargs) -> SpecRequest:
        request = super().new_request(*args, **kwargs)
        if problem := self.engine.kv_problem(request):
            raise RequestError(problem)
        return request

    def token_room(self, prompt_len: int) -> int | None:
        """Within max_seq_len and within what the engine's KV pool holds for one request."""
        room = super().token_room(prompt_len)
        kv = self.engine.kv_room(prompt_len)
        return kv if room is None else min(room, kv)

    # ---- the contract's backend part ------------------------------------------------------------------------------

    def _run(self, requests: list[SpecRequest]) -> Iterator[tuple[SpecRequest, StreamEvent]]:
        """Run ``requests`` through the engine as one batch until each has finished."""
        mine = {request.id for request in requests}
        for request in requests:
            self.engine.add(request)
        try:
            while any(not request.finished for request in requests):
                for request, event in self.engine.step():
                    if request.id in mine:
                        yield request, event
        finally:  # a consumer that stops early (a closed stream) frees its rows at the engine's next step
            for request in requests:
                self.engine.cancel(request)


def _position_limit(target_model, draft_model) -> int:
    """The fewest positions either model was made for (config.max_position_embeddings or its kin); UNBOUNDED_TOKENS
    for models that name none."""
    from ..models import max_positions

    limits = [max_positions(m.config.to_dict()) for m in (target_model, draft_model) if m is not None]
    return min((x for x in limits if x), default=UNBOUNDED_TOKENS)


def _fit_heads(heads, target_model, tree):
    """The heads on the target's device and dtype, checked against the target and the tree."""
    from ..medusa_heads import MedusaHeads

    if isinstance(heads, (str, Path)):
        heads = MedusaHeads.load(Path(heads))
    out = target_model.get_output_embeddings().weight
    if heads.hidden_size != out.shape[1] or heads.vocab_size != out.shape[0]:
        raise RequestError(f"medusa: heads for hidden size {heads.hidden_size} and vocabulary {heads.vocab_size}, "
                           f"the target has {out.shape[1]} and {out.shape[0]}; train heads for this target")
    if tree.max_depth > heads.num_heads:
        raise RequestError(f"medusa_choices: the tree is {tree.max_depth} deep but there are {heads.num_heads} heads; "
                           f"drop the deeper paths")
    return heads.to(device=out.device, dtype=out.dtype).restrict().eval()


def _fit_eagle3(heads, target_model):
    """The EAGLE-3 heads on the target's device and dtype, reading the target's token embeddings."""
    from ..eagle3_heads import Eagle3Heads

    if isinstance(heads, (str, Path)):
        heads = Eagle3Heads.load(Path(heads))
    if problem := heads.fits(target_model):
        raise RequestError(f"eagle3: {problem}")
    weight = target_model.get_output_embeddings().weight
    return heads.to(device=weight.device, dtype=weight.dtype).attach(target_model).eval()


def _auto_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _eos_ids(model, tokenizer) -> list[int]:
    found: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            found.add(source)
        elif isinstance(source, (list, tuple)):
            found.update(int(x) for x in source)
    return sorted(found)


def _load_draft_engine(layout: Layout, target_info: EngineInfo, method: Method):
    """The draft engine's model when ``method`` drafts with one, else None."""
    if not method.needs_draft_model:
        return None
    if not layout.engine_dir("draft").exists():
        raise EngineError(f"{layout.engine_dir('draft')}: no draft engine, and method {method.value!r} needs one; "
                          f"build it (speculative.method: draft_model or ngram+draft) or use method 'ngram'")
    draft_info = read_draft_engine(layout.root, target_info)
    return _load_engine_model(layout.engine_dir("draft"), draft_info)[0]


def _load_engine_model(folder: Path, info: EngineInfo):
    """Returns (model, ResolvedModel of the folder). A torch engine folder holds safetensors weights."""
    from ..config import ModelSpec
    from ..models import ResolvedModel, load_causal_lm

    spec = ModelSpec(model=str(folder), dtype=info.dtype)
    resolved = ResolvedModel(info.role, spec, folder, "local", None)
    model = load_causal_lm(resolved, info.dtype)
    quantize_model(model, info.quantization or "none")  # the engine keeps full weights; int8 is made on load
    return model, resolved


def _load(source, role: str, dtype: str, trust_remote_code: bool, quantization: str = "none"):
    """A model argument may be a loaded model, a folder or a hub id; returns (model, tokenizer or None). A loaded
    model is quantized in place."""
    if not isinstance(source, (str, Path)):
        quantize_model(source, quantization)
        return source.eval(), None
    from ..config import ModelSpec
    from ..models import load_causal_lm, load_tokenizer, resolve_model

    spec = ModelSpec(model=str(source), dtype=dtype, trust_remote_code=trust_remote_code)
    resolved = resolve_model(spec, role, Path.cwd())
    model = load_causal_lm(resolved, dtype)
    quantize_model(model, quantization)
    return model, load_tokenizer(resolved)
