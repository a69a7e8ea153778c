"""Draft-and-verify decoding on the torch backend.

Per target step (one sequence):
  1. Draft: feed the draft the tokens it has not seen, then propose K tokens one forward at a time.
  2. Verify: one target forward over [unseen tokens + K draft tokens] gives K+1 distributions.
  3. Accept: the pure accept rule keeps a prefix of the draft tokens and adds one recovered/bonus token.
  4. Roll back: both KV caches drop the rejected positions; the accepted prefix is never recomputed.
The extra token is fed to both models at the start of the next step, so when all K are accepted the draft
catches up by feeding [last draft token, bonus] in one forward.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from ..errors import EngineError
from ..speculative import SamplingParams, accept_matching, accept_rejection, logits_to_probs, sample
from .results import GenerationResult, GenerationStats, RequestError, StreamEvent, checked_sampling, collect_result
from .limits import check_request
from .loading import load_engine_model, read_engine_info
from .runner import CausalLMRunner
from .text import Prompt, TokenizerIO



class SpeculativeExecutor(TokenizerIO):
    def __init__(self, target_model, draft_model, tokenizer, max_draft_len: int = 4, device: str = "cpu",
                 acceptance: str = "rejection", max_seq_len: int | None = None, max_input_len: int | None = None,
                 draft_len_limit: int | None = None, static_cache: bool | None = None, compile: bool = False):
        """``static_cache``: preallocate KV caches for max_seq_len (None = only when compiling: eager attention
        over a mostly empty static cache measured 5x slower per token on a CPU than the growing cache);
        ``compile``: torch.compile the decode and verify forwards (needs the static cache; first calls are slow)."""
        if acceptance not in ("rejection", "greedy"):
            raise ValueError(f"acceptance: {acceptance!r} must be 'rejection' or 'greedy'")
        self.device = torch.device(device)
        if static_cache is None:
            static_cache = compile
        if compile and not (static_cache and max_seq_len):
            raise ValueError("compile: needs a static cache, i.e. a known max_seq_len (pass max_seq_len=...)")
        # Enough: a step drafts at most (tokens still allowed - 1), so verify never writes past max_seq_len.
        static_len = max_seq_len if static_cache else None
        self.target = CausalLMRunner(target_model, self.device, static_len, compile)
        self.draft = CausalLMRunner(draft_model, self.device, static_len, compile) if draft_model is not None \
            else None
        self.tokenizer = tokenizer
        self.max_draft_len = max_draft_len
        self.acceptance = acceptance
        self.max_seq_len = max_seq_len
        self.max_input_len = max_input_len if max_input_len is not None else (
            max_seq_len - 1 if max_seq_len else None)
        self.draft_len_limit = draft_len_limit  # K the engine was built for; None = no limit
        # Padded embedding rows (e.g. Qwen 7B vs 0.5B) are not tokens: compare only ids both models have.
        self.vocab_size = min(self.target.vocab_size, self.draft.vocab_size) if self.draft else \
            self.target.vocab_size
        self.eos_token_ids = _eos_ids(target_model, tokenizer)

    # ---- construction ---------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, target, draft, max_draft_len: int = 4, device: str = "cpu", dtype: str = "float32",
                        acceptance: str = "rejection", trust_remote_code: bool = False, tokenizer=None,
                        max_seq_len: int | None = None, compile: bool = False) -> SpeculativeExecutor:
        """Load a pair of HF causal LMs (folders or hub ids, or already-loaded models) on the torch backend."""
        from ..checks import compare_tokenizers, max_positions

        target_model, target_tok = _load(target, "target", dtype, trust_remote_code)
        draft_model, draft_tok = _load(draft, "draft", dtype, trust_remote_code)
        tokenizer = tokenizer or target_tok or draft_tok
        if target_tok is not None and draft_tok is not None:
            problems = compare_tokenizers(target_tok, draft_tok)
            if problems:
                raise RequestError("draft: tokenizer differs from target (" + "; ".join(problems) +
                                   "); pick a draft from the same model family")
        limits = [max_positions(m.config.to_dict()) for m in (target_model, draft_model)]
        limits = [x for x in limits if x]
        if max_seq_len is None and limits:
            max_seq_len = min(limits)
        return cls(target_model.to(device), draft_model.to(device), tokenizer, max_draft_len=max_draft_len,
                   device=device, acceptance=acceptance, max_seq_len=max_seq_len, compile=compile)

    @classmethod
    def from_engines(cls, path: str | Path, device: str | None = None, compile: bool = False):
        """Load the engines built for one config: ``engines/<name>`` (holding target/build and draft/build)."""
        root = Path(path)
        engines = {role: read_engine_info(root, role) for role in ("target", "draft")}
        if {e["backend"] for e in engines.values()} == {"trtllm"}:
            from ..backends.trtllm import TrtllmSpeculativeExecutor

            return TrtllmSpeculativeExecutor.from_engines(root)
        target_info, draft_info = engines["target"], engines["draft"]
        if target_info["config_name"] != draft_info["config_name"]:
            raise EngineError(f"{root}: target engine was built for config {target_info['config_name']!r} but the "
                              f"draft for {draft_info['config_name']!r}; rebuild both with one config")
        from ..models import load_tokenizer
        
        device = device or _auto_device()
        target_model, target_spec = load_engine_model(root / "target" / "build", target_info)
        draft_model, _ = load_engine_model(root / "draft" / "build", draft_info)
        return cls(target_model.to(device), draft_model.to(device), load_tokenizer(target_spec),
                   max_draft_len=target_info["max_draft_len"], device=device,
                   acceptance=target_info.get("acceptance", "rejection"), max_seq_len=target_info["max_seq_len"],
                   max_input_len=target_info["max_input_len"], draft_len_limit=target_info["max_draft_len"],
                   compile=compile)

    # ---- public API -----------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, max_draft_len: int | str | None = None,
                 stop_token_ids: Sequence[int] | None = None) -> list[GenerationResult]:
        """Generate for each prompt (a string or a list of token ids); one result per prompt, in order.

        ``max_draft_len``: K for this call (0 = target-only decoding on the same runtime, "auto" = dynamic K
        that follows the observed acceptance, up to the executor's K); None uses the executor's K.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise RequestError("prompts: pass a list of prompts (strings or token-id lists), not a single prompt")
        generator = self._generator(seed)
        results = []
        for prompt in prompts:
            ids = self.encode(prompt)  # once: _stream takes the ids as they are
            events = self._stream(ids, max_new_tokens, temperature, top_k, top_p, generator, max_draft_len,
                                  stop_token_ids, with_text=False)
            results.append(collect_result(events, self.decode, len(ids)))
        return results

    def generate_stream(self, prompt: Prompt, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                        top_p: float = 1.0, seed: int | None = None, max_draft_len: int | str | None = None,
                        stop_token_ids: Sequence[int] | None = None) -> Iterator[StreamEvent]:
        """Yield tokens as each target step accepts them (one event per step)."""
        yield from self._stream(prompt, max_new_tokens, temperature, top_k, top_p, self._generator(seed),
                                max_draft_len, stop_token_ids)

    # ---- the loop -------------------------------------------------------------------------------------------------

    def _generator(self, seed: int | None) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(int(seed))
        return generator

    def _validate(self, prompt_ids: list[int], max_new_tokens: int, k: int) -> None:
        check_request(prompt_ids, max_new_tokens, k, has_draft=self.draft is not None,
                      draft_len_limit=self.draft_len_limit, max_input_len=self.max_input_len,
                      max_seq_len=self.max_seq_len, vocab_size=self.vocab_size)

    def _stream(self, prompt: Prompt, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator, max_draft_len: int | str | None, stop_token_ids,
                with_text: bool = True) -> Iterator[StreamEvent]:
        params = checked_sampling(temperature, top_k, top_p)
        dynamic = max_draft_len == "auto"
        if not (max_draft_len is None or dynamic or isinstance(max_draft_len, int)):
            raise RequestError(f"max_draft_len: {max_draft_len!r} must be an int >= 0, None or 'auto'")
        k_max = self.max_draft_len if max_draft_len is None or dynamic else max_draft_len
        seq = self.encode(prompt)
        self._validate(seq, int(max_new_tokens), k_max)
        k_now = k_max
        stops = set(self.eos_token_ids) | set(stop_token_ids or ())
        stats = GenerationStats()
        self.target.reset()
        if self.draft is not None:
            self.draft.reset()
        generated: list[int] = []
        text_sent = ""
        while len(generated) < max_new_tokens:
            # Never draft more than can be emitted: a step emits up to k + 1 tokens.
            k = min(k_now, max_new_tokens - len(generated) - 1)
            new_tokens, accepted = self._step(seq, k, params, generator)
            stats.record_step(k, accepted)
            if dynamic and k > 0:
                k_now = next_draft_len(k_now, k, accepted, k_max)
            reason = None
            for i, token in enumerate(new_tokens):
                if token in stops:
                    new_tokens = new_tokens[:i + 1]  # the stop token is emitted; nothing after it
                    reason = "eos" if token in self.eos_token_ids else "stop"
                    break
            seq.extend(new_tokens)
            generated.extend(new_tokens)
            stats.generated_tokens = len(generated)
            if reason is None and len(generated) >= max_new_tokens:
                reason = "length"
            delta = ""
            if with_text:  # decoding the whole text each step is O(n^2): only streams need it
                text = self.decode(generated)
                # Hold back a trailing partial UTF-8 character until the next step completes it.
                stable = text if reason or not text.endswith("\ufffd") else text[:len(text_sent)]
                delta, text_sent = stable[len(text_sent):], stable
            yield StreamEvent(new_tokens, delta, reason is not None, reason, stats)
            if reason:
                return

    def _step(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator
              ) -> tuple[list[int], int]:
        """One draft-and-verify step for ``seq``; returns (tokens to append, number of draft tokens accepted)."""
        vocab = self.vocab_size
        base = len(seq)
        draft_tokens: list[int] = []
        draft_probs = []
        if k > 0:
            # Step 1: the draft proposes k tokens; its first forward also catches up on unseen tokens.
            pending = seq[self.draft.cached_len:]
            for _ in range(k):
                logits = self.draft.forward(pending, keep_last=1)[:, :vocab]  # [1, V]
                if params.greedy:
                    token = int(logits.argmax(-1))
                else:
                    probs = logits_to_probs(logits, params)  # [1, V]
                    token = int(sample(probs, generator))
                    draft_probs.append(probs)
                draft_tokens.append(token)
                pending = [token]

        # Step 2: one target forward verifies all k draft tokens (and prefills on the first step).
        target_logits = self.target.forward(seq[self.target.cached_len:] + draft_tokens, keep_last=k + 1)
        target_logits = target_logits[:, :vocab]  # [k+1, V]

        # Step 3: accept.
        drafted = torch.tensor([draft_tokens], dtype=torch.long, device=self.device)  # [1, k]
        if params.greedy:
            output, num_accepted = accept_matching(drafted, target_logits.argmax(-1)[None])
        else:
            target_probs = logits_to_probs(target_logits, params)  # [k+1, V]
            if self.acceptance == "rejection" and k > 0:
                output, num_accepted = accept_rejection(drafted, torch.cat(draft_probs)[None], target_probs[None],
                                                        generator=generator)
            else:
                output, num_accepted = accept_matching(drafted, sample(target_probs, generator)[None])
        accepted = int(num_accepted[0])

        # Step 4: drop the KV of rejected draft tokens; the extra token is fed next step.
        self.target.rollback(base + accepted)
        if self.draft is not None:
            self.draft.rollback(base + accepted)
        return output[0, :accepted + 1].tolist(), accepted


def next_draft_len(current: int, drafted: int, accepted: int, limit: int) -> int:
    """Dynamic K: lengthen after a fully accepted step, shorten after a rejection (within 1..limit).

    Drafting past the first rejection is wasted draft time, and a run of full acceptances means the draft is
    tracking the target well; the additive rule follows acceptance within a few steps without overshooting.
    """
    if accepted == drafted:
        return min(limit, current + 1)
    return max(1, current - 1)


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


def _load(source, role: str, dtype: str, trust_remote_code: bool):
    """A model argument may be a loaded model, a folder or a hub id; returns (model, tokenizer or None)."""
    if not isinstance(source, (str, Path)):
        return source.eval(), None
    from ..config import ModelSpec
    from ..models import load_causal_lm, load_tokenizer, resolve_model

    spec = ModelSpec(model=str(source), dtype=dtype, trust_remote_code=trust_remote_code)
    resolved = resolve_model(spec, role, Path.cwd())
    return load_causal_lm(resolved, dtype), load_tokenizer(resolved)
