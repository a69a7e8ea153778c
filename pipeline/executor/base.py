"""The executor contract both backends implement, and everything in it that is not backend-specific.

A backend provides ``_run(requests)``: advance the given requests (one batch) until each finishes, yielding
``(request, StreamEvent)`` after every target step; an event with ``error`` set (a request the engine failed alone)
raises that error from generate(), run() and generate_stream(), the caller's own calls. Prompt encoding, request
checks, K parsing, the accept rules' names, seeds, stop and length handling, statistics and results are shared here,
so the torch and the TensorRT-LLM executors cannot drift (who drafts each step is proposers.choose_drafter, shared
the same way).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..errors import short_repr
from ..methods import Method, parse_method
from .request import SpecRequest, make_generator
from .request_values import DraftLen, OutputControls, check_prompt, validate_controls, validate_request
from .results import GenerationResult, RequestError, StreamEvent
from .text import Prompt, TokenizerIO


ACCEPTANCE_RULES = ("rejection", "greedy")  # how a sampled row keeps draft tokens (build's speculative.acceptance)


def checked_acceptance(acceptance: str) -> str:
    """``acceptance`` when both executors run it; raises ValueError naming the value otherwise."""
    if acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"acceptance: {acceptance!r} must be one of {', '.join(map(repr, ACCEPTANCE_RULES))}")
    return acceptance


class ExecutorBase(TokenizerIO):
    """generate() / generate_stream() over ``_run``; subclasses set the attributes below."""

    max_draft_len: int = 0  # the max_draft_len of a request that names none
    engine_draft_len: int | None = None  # K the target engine was built for (None = no limit)
    max_input_len: int | None = None
    max_seq_len: int | None = None
    vocab_size: int | None = None  # ids a prompt may hold (None = unchecked)
    eos_token_ids: list[int] = []
    device = "cpu"  # where request generators live
    method = Method.DRAFT_MODEL  # who proposes by default
    has_medusa_heads = False  # the runtime holds Medusa heads, so requests may use method medusa
    has_eagle3_heads = False  # the runtime holds EAGLE-3 heads, so requests may use method eagle3

    @property
    def has_draft_model(self) -> bool:
        raise NotImplementedError

    def _run(self, requests: list[SpecRequest]) -> Iterator[tuple[SpecRequest, StreamEvent]]:
        raise NotImplementedError

    def token_room(self, prompt_len: int) -> int | None:
        """The most new tokens a prompt of ``prompt_len`` tokens can have here (None: no limit)."""
        return self.max_seq_len - prompt_len if self.max_seq_len is not None else None

    def _events(self, requests: list[SpecRequest]) -> Iterator[tuple[SpecRequest, StreamEvent]]:
        """``_run``'s events; a failed request's error is raised (RequestFailed, its cause chained)."""
        for request, event in self._run(requests):
            if event.error is not None:
                raise event.error from event.error.cause
            yield request, event

    def _grammar(self, controls: OutputControls, stop_ids: frozenset[int]):
        """A matcher for the request's response_format (None for free text); raises RequestError for a format that
        is malformed or that this executor cannot apply."""
        from ..speculative.grammar import grammar_from_response_format

        grammar = grammar_from_response_format(controls.response_format)
        if grammar is None:
            return None
        if self.tokenizer is None or self.vocab_size is None:
            raise RequestError("response_format: this executor has no tokenizer, so a grammar cannot be matched to "
                               "tokens; leave response_format out")
        if not stop_ids:
            raise RequestError("response_format: with ignore_eos and no stop tokens nothing could end the answer once "
                               "the format is complete; drop ignore_eos or add a stop token")
        compilers = self.__dict__.setdefault("_grammar_compilers", {})
        if stop_ids not in compilers:  # built once per set of ids that may end an answer
            from ..speculative.grammar import GrammarCompiler

            compilers[stop_ids] = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(stop_ids))
        return compilers[stop_ids].matcher(grammar)

    # ---- public API -----------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | Sequence[int] | None = None, max_draft_len: DraftLen = None,
                 stop_token_ids: Sequence[int] | None = None, method: str | None = None,
                 **controls) -> list[GenerationResult]:
        """Generate for each prompt (a string or a list of token ids) as one batch; one result per prompt, in order.

        ``max_draft_len``: K for this call (0 = target-only decoding on the same runtime, "auto" = dynamic K that
        follows the observed acceptance, up to the executor's K); None uses the executor's K. ``seed`` seeds each
        prompt's own random stream (one int for every prompt, or one per prompt; None = fresh randomness), so a
        result depends only on its own prompt, parameters and seed: the same prompt and seed give the same tokens
        whatever else runs in the batch. ``method`` overrides the executor's proposer for this call (a
        ``Method`` value; "draft_model" and "ngram+draft" need a draft model, "medusa" Medusa heads).

        ``controls`` (keywords, each prompt alike): ``presence_penalty``, ``frequency_penalty`` (OpenAI's, over the
        generated tokens), ``repetition_penalty`` (over prompt and output), ``logit_bias`` ({token id: bias}),
        ``min_tokens``, ``ignore_eos``, ``logprobs`` (None, or n: each result's ``logprobs`` holds every token's
        log-probability and its n likeliest alternatives) and ``response_format`` (OpenAI's: json_object,
        json_schema, or the regex / grammar extensions). All apply under speculation, position by position.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise RequestError("prompts: pass a list of prompts (strings or token-id lists), not a single prompt")
        seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(prompts)
        if len(seeds) != len(prompts):
            raise RequestError(f"seed: {len(seeds)} seeds for {len(prompts)} prompts; give one per prompt or one int")
        return self.run([self.new_request(prompt, max_new_tokens, temperature, top_k, top_p, one_seed, max_draft_len,
                                          stop_token_ids, with_text=False, method=method, **controls)
                         for prompt, one_seed in zip(prompts, seeds)])

    def run(self, requests: Sequence[SpecRequest]) -> list[GenerationResult]:
        """Run requests made by :meth:`new_request` (each with its own parameters, K, seed and stops) as one batch."""
        requests = list(requests)
        for _ in self._events(requests):
            pass
        return [request.result(self.decode) for request in requests]

    def generate_stream(self, prompt: Prompt, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                        top_p: float = 1.0, seed: int | None = None, max_draft_len: DraftLen = None,
                        stop_token_ids: Sequence[int] | None = None, method: str | None = None, **controls
                        ) -> Iterator[StreamEvent]:
        """Yield tokens as each target step accepts them (one event per step); ``controls`` as in generate()."""
        request = self.new_request(prompt, max_new_tokens, temperature, top_k, top_p, seed, max_draft_len,
                                   stop_token_ids, method=method, **controls)
        for _, event in self._events([request]):
            yield event

    def new_request(self, prompt: Prompt, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, seed: int | None = None, max_draft_len: DraftLen = None,
                    stop_token_ids: Sequence[int] | None = None, with_text: bool = True,
                    method: str | None = None, fit_max_tokens: bool = False,
                    cache_salt: str | None = None, **controls) -> SpecRequest:
        """A checked request; raises RequestError naming the value and the fix.

        ``fit_max_tokens``: lower ``max_new_tokens`` to what fits after this prompt (:meth:`token_room`) instead of
        refusing it, for callers whose value is a default rather than the user's (a chat sent without max_tokens);
        a prompt that leaves room for no new token is still refused. ``cache_salt``: share cached prompt prefixes
        only with requests of the same salt (None: with every request that has none); ``controls`` as in
        generate() (or one ``controls=OutputControls(...)``, already checked)."""
        method = parse_method(method or self.method, self.has_draft_model, error=RequestError,
                              has_medusa_heads=self.has_medusa_heads, has_eagle3_heads=self.has_eagle3_heads)
        values = validate_request(max_new_tokens, temperature, top_k, top_p, seed, max_draft_len,
                                  default_max_draft_len=self.max_draft_len, engine_draft_len=self.engine_draft_len)
        checked = controls.pop("controls", None) or validate_controls(**controls, vocab_size=self.vocab_size)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestError(f"cache_salt: {short_repr(cache_salt)} must be a string (or None for no salt)")
        ids = self.encode(prompt)
        if fit_max_tokens and max_new_tokens > 0:
            room = self.token_room(len(ids))
            # At least 1: where not even one token fits, the checks below refuse the request and say why.
            max_new_tokens = max(1, min(max_new_tokens, room)) if room is not None else max_new_tokens
        check_prompt(ids, max_new_tokens, max_input_len=self.max_input_len, max_seq_len=self.max_seq_len,
                     vocab_size=self.vocab_size)
        eos = frozenset(self.eos_token_ids)
        stops = (frozenset() if checked.ignore_eos else eos) | frozenset(int(t) for t in stop_token_ids or ())
        request = SpecRequest(ids, max_new_tokens, values.sampling, values.draft, make_generator(seed, self.device),
                              seeded=seed is not None, stop_ids=stops, eos_ids=eos,
                              decode=self.decode if with_text else None, seed=seed, method=method,
                              cache_salt=cache_salt, adjust=checked.adjust, logprobs=checked.logprobs,
                              grammar=self._grammar(checked, stops))
        if max_new_tokens == 0:
            request.finish_reason = "length"
        return request
