"""Draft-and-verify decoding on two TensorRT-LLM engines, behind the same contract as the torch executor.

Per target step (one request):
  1. Draft: the proposer that proposers.choose_drafter picks proposes up to K tokens: the draft engine generates them
     (and, for rejection sampling, their generation logits), or an n-gram lookup finds them in the sequence, or the
     suffix trees (the request's and recent outputs', proposers.suffix.SuffixTrees) continue it.
  2. Verify: the target engine gets the sequence plus the draft tokens as an ExternalDraftTokensConfig
     (via ModelRunnerCpp.generate(draft_tokens_list=..., draft_logits_list=...)) and, inside its compiled graph,
     keeps the accepted prefix and adds one recovered or bonus token: output = accepted + 1 token.
  3. Both engines see the grown sequence as a new request next step; KV-cache block reuse makes the shared
     prefix free, which is why the pinned release requires paged context FMHA and block reuse for this method.
Prompt handling, K (fixed or "auto"), request checks, stops, UTF-8 deltas and statistics come from ExecutorBase and
SpecRequest, and the choice of proposer from proposers.choose_drafter, all shared with the torch executor. The
engine boundary is pipeline.backends.trtllm_runner.TrtllmRunner; the real one is ModelRunnerEngine there, tests
substitute a fake (named as such).

A Medusa target (speculative.method: medusa) has no draft engine: its heads propose a tree and the engine verifies
it inside, step after step, so one engine call decodes a whole request. TensorRT-LLM 1.1.0 verifies that tree by
token match against the target's top-1 token only, so such an engine serves greedy requests (temperature 0, or
top_k 1) and refuses sampled ones rather than return tokens that do not follow the target's distribution.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from ..backends.trtllm_runner import EngineLimits, Sampling, TrtllmRunner
from ..errors import EngineError, short_repr
from ..methods import Method, NgramSettings, SuffixSettings, parse_method
from ..speculative.ngram import propose_ngram
from .base import ExecutorBase, checked_acceptance
from .proposers import CostRatio, choose_drafter
from .proposers.suffix import SuffixTrees
from .request import SpecRequest
from .request_values import DraftLen, OutputControls, validate_controls
from .results import RequestError, StreamEvent

# What this loop knows how to run (see _step and _run); any other method is refused by name when the engines are
# opened and on every request, never run as if it were the draft model.
IMPLEMENTED = (Method.DRAFT_MODEL, Method.NGRAM, Method.NGRAM_DRAFT, Method.MEDUSA, Method.SUFFIX)

SEED_STRIDE = 0x9E3779B97F4A7C15  # odd 64-bit constant (golden ratio): step seeds of nearby request seeds differ


def step_seed(seed: int, step: int, role: int) -> int:
    """A distinct 64-bit seed for each engine call of a request.

    The C++ runtime restarts its random stream from ``random_seed`` on every request it is given, and this loop
    gives it a new request every step: one seed for all of them would replay the same uniforms each step.
    """
    return (seed + (2 * step + role + 1) * SEED_STRIDE) % (1 << 64)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check_implemented(method: Method, error) -> None:
    """Raise ``error`` naming ``method`` when this executor has no loop for it."""
    if method not in IMPLEMENTED:
        raise error(f"method: {method.value!r} is not implemented by the TensorRT-LLM executor (it runs "
                    f"{', '.join(repr(m.value) for m in IMPLEMENTED)}); use one of those, or the torch backend")


def engine_method(method: str, has_draft_model: bool, medusa_engine: bool, error) -> Method:
    """The method engines built this way can serve: a Medusa engine (built with speculative_decoding_mode medusa)
    verifies its own heads' tree only, and the other engines take external draft tokens only."""
    chosen = parse_method(method, has_draft_model, error=error, has_medusa_heads=medusa_engine)
    check_implemented(chosen, error)
    if medusa_engine and chosen != Method.MEDUSA:
        raise error(f"method: {chosen.value!r} feeds the target external draft tokens, but these TensorRT-LLM "
                    f"engines were built for Medusa (speculative_decoding_mode medusa), which drafts with its heads "
                    f"only; use method 'medusa', or build with speculative.method: {chosen.value}")
    return chosen


def check_medusa_request(request: SpecRequest, tree_depth: int | None) -> None:
    """What a TensorRT-LLM 1.1.0 Medusa engine cannot do for a request; raises RequestError naming the value."""
    if request.method != Method.MEDUSA:
        raise RequestError(f"method: {request.method.value!r} needs external draft tokens, but this TensorRT-LLM "
                           f"engine was built for Medusa; use method 'medusa' (or leave it unset)")
    params = request.params
    if not params.greedy and params.top_k != 1:
        raise RequestError(f"temperature: {params.temperature} with top_k {params.top_k} samples, but TensorRT-LLM "
                           f"1.1.0's Medusa verifies greedily only (it keeps draft tokens equal to the target's top-1 "
                           f"token), so sampled output would not follow the target's distribution; use temperature 0 "
                           f"(or top_k 1), or the torch backend, which samples losslessly over the tree")
    plan = request.plan
    if plan.dynamic or plan.explicit and plan.max_draft_len != tree_depth:
        asked = "'auto'" if plan.dynamic else plan.max_draft_len
        raise RequestError(f"max_draft_len: {asked}, but a TensorRT-LLM Medusa engine verifies its whole tree "
                           f"(depth {tree_depth}, fixed when the engine is opened) every step; leave max_draft_len "
                           f"unset, or use the torch backend, which cuts the tree per request")


class TrtllmSpeculativeExecutor(ExecutorBase):
    """generate()/generate_stream()/run() of ExecutorBase over two TensorRT-LLM engines."""

    def __init__(self, target: TrtllmRunner, draft: TrtllmRunner | None, tokenizer, limits: EngineLimits,
                 max_draft_len: int, acceptance: str = "rejection", eos_token_ids: Sequence[int] = (),
                 method: str = Method.DRAFT_MODEL, ngram: NgramSettings | None = None,
                 medusa_choices: list[list[int]] | None = None, suffix: SuffixSettings | None = None):
        """``method``: "draft_model", "ngram" (lookups fed to the target as external draft tokens, as TensorRT-LLM's
        examples/ngram does; ``draft`` may be None), "ngram+draft" (per step, the better of the two), "suffix" (the
        suffix trees' drafts as external draft tokens, ``suffix`` their settings; ``draft`` may be None) or "medusa"
        (``target`` is a Medusa engine opened with ``medusa_choices``, its tree; ``draft`` is None)."""
        self.acceptance = checked_acceptance(acceptance)
        self.medusa_choices = medusa_choices
        self.has_medusa_heads = medusa_choices is not None
        self.method = engine_method(method, draft is not None, medusa_choices is not None, ValueError)
        self.ngram = ngram or NgramSettings()
        self.suffix = SuffixTrees(suffix or SuffixSettings())
        self.costs = CostRatio()  # a draft token's seconds over a verify call's
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.limits = limits
        self.max_draft_len = max_draft_len
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.max_input_len = limits.max_input_len
        self.max_seq_len = limits.max_seq_len
        self.engine_draft_len = limits.engine_draft_len

    @property
    def has_draft_model(self) -> bool:
        return self.draft is not None

    def _timed(self, role: str, per: int, call):
        start = time.perf_counter()
        out = call()
        self.costs.record(role, (time.perf_counter() - start) / max(per, 1))
        return out

    @classmethod
    def from_engines(cls, root, target_device_ids: list[int] | None = None,
                     draft_device_ids: list[int] | None = None, method: str | None = None,
                     ngram: NgramSettings | None = None, suffix: SuffixSettings | None = None
                     ) -> TrtllmSpeculativeExecutor:
        """Load engines/<name> built by the trtllm backend (target/build, and draft/build unless the method is ngram
        or medusa).

        ``method``, ``ngram`` and ``suffix`` default to what the engines were built for (engine.json). GPUs default to
        runtime.target_device_ids / runtime.draft_device_ids as recorded there at build time; pass them to override
        (runtime settings do not invalidate a build).
        """
        from pathlib import Path

        from ..backends import trtllm_loading
        from ..engine_info import read_engine
        from ..layout import Layout

        trtllm_loading.import_tensorrt_llm("running TensorRT-LLM engines")  # first: without it nothing runs
        layout = Layout(Path(root))
        info = read_engine(layout.root, "target")
        if info.backend != "trtllm":
            raise EngineError(f"{layout.root}: engines built by the {info.backend} backend, and "
                              f"TrtllmSpeculativeExecutor runs TensorRT-LLM's; open them with "
                              f"pipeline.executor.open_executor(path), which returns the executor for the backend "
                              f"that built them")
        method = engine_method(method or info.built_method(layout.engine_dir("draft").exists()), True,
                               bool(info.medusa_choices), EngineError)
        opened = trtllm_loading.open_engines(layout.root, method, target_device_ids, draft_device_ids)
        return cls(opened.target, opened.draft, opened.tokenizer, opened.limits, opened.limits.engine_draft_len,
                   opened.acceptance, eos_token_ids=opened.eos_token_ids, method=method,
                   ngram=ngram or info.ngram_settings(), medusa_choices=opened.medusa_choices,
                   suffix=suffix or info.suffix_settings())

    def new_request(self, prompt, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    seed: int | None = None, max_draft_len: DraftLen = None,
                    stop_token_ids: Sequence[int] | None = None, with_text: bool = True,
                    method: str | None = None, fit_max_tokens: bool = False,
                    cache_salt: str | None = None, **controls) -> SpecRequest:
        if validate_controls(**controls, vocab_size=self.vocab_size) != OutputControls():
            raise RequestError(f"{', '.join(sorted(controls))}: penalties, logit_bias, min_tokens, ignore_eos, logprobs "
                               f"and response_format are not applied by the trtllm backend yet (its executor runs "
                               f"TensorRT-LLM's own sampling per step); leave them out, or serve with the torch "
                               f"backend")
        if cache_salt is not None:
            raise RequestError(f"cache_salt: {short_repr(cache_salt)}, but TensorRT-LLM's KV block reuse here is "
                               f"shared by every request and cannot be kept apart per salt; leave cache_salt unset, or "
                               f"use the torch backend")
        request = super().new_request(prompt, max_new_tokens, temperature, top_k, top_p, seed, max_draft_len,
                                      stop_token_ids, with_text, method, fit_max_tokens)
        check_implemented(request.method, RequestError)
        if self.has_medusa_heads:
            check_medusa_request(request, self.engine_draft_len)
        return request

    # ---- the contract's backend part ------------------------------------------------------------------------------

    def _run(self, requests: list[SpecRequest]) -> Iterator[tuple[SpecRequest, StreamEvent]]:
        """One request after another; each engine call is itself in-flight batched by TensorRT-LLM's executor."""
        for request in requests:
            seed = request.seed if request.seed is not None else int(
                torch.randint(0, 2 ** 62, (1,), generator=request.generator))
            try:
                while not request.finished:
                    k = request.step_draft_len()
                    step = request.stats.target_steps
                    if (k == 0 and request.plan.max_draft_len == 0) or request.method == Method.MEDUSA:
                        yield request, self._target_only(request, seed)
                        continue
                    tokens, drafted, accepted, proposer = self._step(request, k, seed, step)
                    yield request, request.advance(tokens, drafted, accepted, proposer=proposer)
            finally:  # its output joins the suffix trees' past outputs (a no-op for the other methods)
                self.suffix.release(request.id)

    def _sampling(self, request: SpecRequest, seed: int, step: int, role: int) -> Sampling:
        p = request.params
        return Sampling(p.temperature, p.top_k, p.top_p, step_seed(seed, step, role))

    def _step(self, request: SpecRequest, k: int, seed: int, step: int
              ) -> tuple[list[int], int, int, Method | None]:
        """One draft-and-verify step; returns (tokens to append, draft tokens proposed, draft tokens accepted,
        the proposer)."""
        seq = request.sequence
        use_logits = self.acceptance == "rejection" and request.params.temperature > 0
        found: dict[int, list[int]] = {}

        def lookup(n: int) -> list[int]:  # one lookup per step, for the choice and the proposal alike
            if n not in found:
                found[n] = propose_ngram(seq, n, self.ngram.min_match, self.ngram.max_match)
            return found[n]

        proposer = choose_drafter(request, k, lookup, self.costs.value) if k > 0 else None
        draft_tokens = lookup(k) if proposer == Method.NGRAM else \
            self.suffix.draft(request, k) if proposer == Method.SUFFIX else []
        draft_logits = None
        if proposer == Method.DRAFT_MODEL:
            # Step 1: the draft proposes k tokens (it may stop early on EOS).
            out = self._timed("draft", k, lambda: self.draft.generate(
                seq, k, self._sampling(request, seed, step, 0), want_logits=use_logits))
            draft_tokens = out.token_ids[:k]
            if use_logits and draft_tokens:
                draft_logits = self._fit_logits(out.logits[:len(draft_tokens)])
        # (A lookup has no logits: the target then verifies it by token comparison, which is lossless too.)
        # Step 2: the target verifies all draft tokens in one pass and adds one token of its own.
        verified = self._timed("target", 1, lambda: self.target.generate(
            seq, len(draft_tokens) + 1, self._sampling(request, seed, step, 1),
            draft_tokens=draft_tokens or None, draft_logits=draft_logits))
        new_tokens = verified.token_ids[:len(draft_tokens) + 1]
        # A recovered token never equals the rejected draft token, so the matching prefix is the accepted count.
        accepted = min(common_prefix(new_tokens, draft_tokens), len(draft_tokens))
        return new_tokens, len(draft_tokens), accepted, proposer if draft_tokens else None

    def _target_only(self, request: SpecRequest, seed: int) -> StreamEvent:
        """K = 0 for the whole request, or a Medusa engine (it drafts and verifies inside): one engine call
        generates everything, decoding in-flight. ModelRunnerCpp reports no per-step counts, so the statistics count
        one step per token (Triton's return_perf_metrics has a Medusa engine's acceptance)."""
        step = request.stats.target_steps
        out = self.target.generate(request.sequence, request.remaining, self._sampling(request, seed, step, 1))
        event = request.advance(out.token_ids, 0, 0, plain_run=True)
        if not event.finished:  # the engine stopped early (its end id): nothing more will come
            request.finish_reason = event.finish_reason = "length"
            event.finished = True
        return event

    def _fit_logits(self, logits):
        """Draft logits padded/trimmed to the target's width; extra rows are padding, never real tokens."""
        width = self.target.vocab_size
        have = logits.shape[-1]
        if have == width:
            return logits
        if have > width:
            return logits[..., :width]
        pad = torch.full((*logits.shape[:-1], width - have), float("-inf"), dtype=logits.dtype,
                         device=logits.device)
        return torch.cat([logits, pad], dim=-1)
