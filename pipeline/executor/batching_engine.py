"""The batching engine (torch backend): every running request advances in each step together.

Per step, for the running requests (rows) at once:
  1. Admit: waiting requests join while the batch and the KV pool have room; each is prefilling until its prompt
     has KV. When its prefill starts it opens its sequence in the target's KV cache, and in the draft's when its
     method drafts with the model, taking the cached blocks its prompt starts with (prefix reuse).
  2. Propose: each decoding row gets its step_draft_len (its own K, within what the K policy chose for it), and the
     proposer that proposers.choose_drafter picks for it drafts up to that many tokens into a StepBatch; the draft
     model runs one batched forward per draft position for all the rows it drafts, its first forward also catching
     up on tokens the draft has not seen.
  3. Verify: one packed target forward over every decoding row's unseen tokens + its draft tokens (a Medusa row's:
     its candidate tree, each node at root + depth under the tree mask), and in the same forward the next chunk of
     each prefilling row's prompt, within the step's token budget (chunked prefill: a long prompt never stalls the
     decoding rows).
  4. Accept: the pure accept rule, one call for the greedy rows and one for the sampled rows, each row with its
     own sampling parameters and randomness drawn from its own generator; tree rows by the tree rules.
  5. Roll back: each row's KV caches (the target's, and the draft's where it has one) drop its rejected positions
     (a tree row first moves its accepted path's KV next to the root) and hash their newly full blocks for reuse;
     finished rows release their blocks.
     Proposers that draft from the target's hidden state get it, at each of their rows' last accepted position.
Rows differ in length, K, sampling parameters, seed, stop tokens and max_new_tokens; a row's tokens depend only on
its own request (each has its own generator, and attention runs per row over its own blocks).

A failure is a row's, never the batch's: steps 2-4 change nothing but the rows' KV lengths and random streams, which
are saved when the step starts; when the batched compute raises they are restored and the rows run one at a time, so
a row that fails alone finishes with finish_reason "error" (its event carries the exception, its blocks are released)
and every other row gets exactly the tokens the batched step would have given it. Step 5 runs per row: a row whose
own bookkeeping raises fails alone too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..methods import GRAMMAR_PROPOSER, NgramSettings, SuffixSettings
from ..speculative import accept_matching, accept_rejection, logits_to_probs, sample_inverse_cdf
from ..speculative.tree import greedy_tree_accept, sampled_tree_accept, uniforms_needed
from .block_pool import PrefixStats
from .draft_policy import DraftPolicy
from ..kv_settings import KVSettings
from .compiled_decoder import capped_width
from .model_runner import BatchModelRunner, time_forwards
from .proposers import CostRatio, Proposer, ProposerContext, build_proposers, choose_drafter
from .proposers.grammar import GrammarProposer
from .proposers.ngram import row_lookup
from .row_logits import adjust_verify, token_logprobs
from .request import SpecRequest
from .results import RequestError, RequestFailed, StreamEvent
from .scheduler import Scheduler
from .step_batch import StepBatch


DEFAULT_COMPILE_MAX_WIDTH = 16  # runtime.compile_max_width's default


@dataclass
class EngineCounters:
    """Running totals since the engine started (metrics: mean occupancy = rows / steps / max_batch)."""

    steps: int = 0  # engine steps that ran a forward
    rows: int = 0  # running requests summed over those steps
    tokens: int = 0  # packed target tokens computed
    prefill_tokens: int = 0  # of those, prompt-chunk tokens


def _aux_layers(asked: tuple[int, ...], eagle3) -> tuple[int, ...]:
    """The target layers whose outputs each forward keeps: EAGLE-3 heads' fused layers, when the engine has some."""
    if eagle3 is None:
        return tuple(asked)
    if asked and tuple(asked) != eagle3.config.target_layers:
        raise ValueError(f"aux_layers: {list(asked)}, but the EAGLE-3 heads read layers "
                         f"{list(eagle3.config.target_layers)}; leave aux_layers out")
    return eagle3.config.target_layers


@dataclass
class _Saved:
    """What steps 2-4 change, as the step found it: per runner and row the KV length (None: not open yet), and each
    sampled row's random stream."""

    lengths: list[tuple[BatchModelRunner, int, int | None]]
    generators: list[tuple[torch.Generator, torch.Tensor]]


@dataclass
class _Computed:
    """Steps 2-4 for some rows, waiting for step 5."""

    batch: StepBatch  # the decoding rows and their proposals
    prefilling: list[SpecRequest]  # the rows that prefilled a prompt chunk
    start: float  # when the verify started (its cost is recorded after step 5)
    packed: int  # target tokens in the forward
    # row -> (emitted tokens, accepted draft tokens, accepted tree path)
    outcome: dict[int, tuple[list[int], int, list[int]]] = field(default_factory=dict)
    hidden_rows: list[int] = field(default_factory=list)  # rows whose proposer reads the target's hidden states
    hidden: torch.Tensor | None = None  # [rows, width, d] the target's final hidden states, for hidden_rows
    logprobs: dict = field(default_factory=dict)  # row -> its emitted tokens' TokenLogprobs, for rows that asked
    # per forward row (decoding rows, then prefilling ones): the aux layers' outputs of its tokens [count, n, d]
    aux: list | None = None


class BatchingEngine:
    def __init__(self, target_model, draft_model, *, device, max_batch: int, max_tokens: int, vocab_size: int,
                 engine_draft_len: int, acceptance: str = "rejection", adaptive_draft_len: bool = False,
                 compile: bool | str = False, ngram: NgramSettings | None = None, medusa: tuple | None = None,
                 kv: KVSettings | None = None, compile_max_width: int = DEFAULT_COMPILE_MAX_WIDTH,
                 suffix: SuffixSettings | None = None, aux_layers: tuple[int, ...] = (), eagle3=None,
                 eagle3_tree: bool = False):
        """``max_tokens``: longest sequence (prompt + generated) a row holds; ``engine_draft_len``: the most any row
        drafts in one step; ``adaptive_draft_len``: cap K per step from measured costs and acceptance (for
        serving; a result never depends on it, see SpecRequest);
        ``ngram``: lookup settings for requests whose method uses n-gram proposals; ``suffix``: the suffix trees'
        settings for method suffix; ``aux_layers``: target layers whose outputs the proposers that read them get for
        every token the target keeps (Proposer.target_states); ``eagle3``: Eagle3Heads for requests whose method is
        eagle3 (their target_layers are then the aux layers; ``eagle3_tree``: they draft a tree of K candidates,
        not a chain); ``medusa``: (MedusaHeads,
        TokenTree) for requests whose method is medusa; ``kv``: block size, pool limit, prefix reuse and the
        step's token budget; ``compile_max_width``: with ``compile``, the widest forward that runs compiled."""
        self.device = torch.device(device)
        self.kv = kv or KVSettings()
        tree = medusa[1] if medusa is not None else None
        # Tokens a verify writes past the end: a chain's draft tokens and bonus, or a whole tree.
        self.spare = max(engine_draft_len, tree.size if tree is not None else 0) + 1
        self.max_len = max_tokens
        max_blocks = self.kv.max_blocks(max_batch, max_tokens, self.spare)

        # Compiled widths: up to every row's verify at once, no bucket past the cap. Each compiled width holds its
        # own packed copy of the weights; a wider forward (a prompt chunk, a full batch's verify) runs eager.
        max_width = capped_width(max_batch * self.spare, compile_max_width)

        def runner(model, follow=None, aux=(), extra=()):
            return BatchModelRunner(model, self.device, max_tokens + self.spare, self.kv.block_size, max_blocks,
                                    self.kv.prefix_reuse, bool(compile), max_width=max_width,
                                    autotune=compile == "max-autotune", aux_layers=aux, follow=follow, extra_widths=extra)

        # A request's full verify gets a graph of its own width (padded to a power of two, 5 tokens cost 8).
        self.target = runner(target_model, aux=_aux_layers(aux_layers, eagle3), extra=(self.spare,))
        # The draft's KV lives in the target's blocks: one pool, one limit, one admission decision.
        self.draft = runner(draft_model, follow=self.target) if draft_model is not None else None
        self.max_blocks = max_blocks
        self.vocab_size = vocab_size  # ids both models have (padded embedding rows are not tokens)
        self.acceptance = acceptance
        self.scheduler = Scheduler(max_batch)
        self.costs = CostRatio()
        self.ngram = ngram or NgramSettings()
        self.proposers: dict[str, Proposer] = build_proposers(ProposerContext(
            self.draft, vocab_size, self.device, self.ngram,
            lambda rows, seconds: self._record("draft", rows, seconds), medusa, self.target,
            suffix or SuffixSettings(), (eagle3, eagle3_tree) if eagle3 is not None else None))
        self.grammar_proposer = GrammarProposer(vocab_size, self.device, engine_draft_len)
        # Every runner holding KV per request: the target's, then each proposer's own (once however many share it).
        self.runners = [self.target, *dict.fromkeys(p.kv_runner for p in self.proposers.values()
                                                    if p.kv_runner is not None)]
        self._hidden_users = {method for method, proposer in self.proposers.items() if proposer.wants_hidden}
        self._state_users = {method for method, proposer in self.proposers.items() if proposer.wants_states} \
            if self.target.aux_layers else set()
        # N-gram rows need the policy as much as draft-model rows: their proposals are free, the wider verify is not.
        self.policy = DraftPolicy(engine_draft_len) if adaptive_draft_len and engine_draft_len > 0 else None
        if self.policy is not None:
            self.calibrate(self.policy, max_batch)
        self.step_tokens: list[int] = []  # recent steps' packed target tokens
        self.counters = EngineCounters()

    def calibrate(self, policy: DraftPolicy, max_rows: int) -> None:
        """Time this engine's own forwards for ``policy`` at the shapes it asks for (calibration_widths): the
        target runner's, the draft model's one token per row, and the step of each drafter without a draft model
        (EAGLE-3 heads), so it can price drafting before anything drafted. Batch sizes the KV pool cannot hold
        beside nothing else are left to the policy's extrapolation."""
        for rows, widths in policy.calibration_widths(max_rows).items():
            timed = time_forwards(self.target, rows, widths)
            if not timed:
                break
            for width, seconds in timed.items():
                policy.target.record(rows * width, seconds)
            if self.draft is not None:
                for seconds in time_forwards(self.draft, rows, [1], leader=self.target).values():
                    policy.draft.record(rows, seconds)
        for proposer in self.proposers.values():
            proposer.calibrate(policy.draft.record, max_rows)

    # ---- the server-facing API ------------------------------------------------------------------------------------

    def add(self, request: SpecRequest) -> None:
        if problem := self.kv_problem(request):
            raise RequestError(problem)
        self.scheduler.add(request)

    def kv_room(self, prompt_len: int) -> int:
        """The most new tokens a prompt of ``prompt_len`` tokens can have in this engine's KV pool (running alone);
        below 1 when not even one fits."""
        return self.max_blocks * self.kv.block_size - self.spare - prompt_len

    def kv_problem(self, request: SpecRequest) -> str | None:
        """Why ``request`` could never run in this engine's KV pool (None: it fits, alone at worst)."""
        need = self._worst_blocks(request)
        if need <= self.max_blocks:
            return None
        size = self.kv.block_size
        return (f"max_tokens: prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.max_new_tokens}) needs "
                f"{need * size} KV positions, but the KV cache holds {self.max_blocks * size} "
                f"(build.kv_cache.max_tokens); shorten the request or raise that limit")

    def cancel(self, request: SpecRequest) -> StreamEvent | None:
        """Stop a request; its blocks are released at the next step. None when it had already finished."""
        if request.finished:
            return None
        self.scheduler.drop_waiting(request)
        return request.cancel()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def prefix_stats(self) -> PrefixStats:
        """Prompt tokens looked up in the target's prefix cache, and how many of them were reused."""
        return self.target.cache.pool.stats

    def step(self) -> list[tuple[SpecRequest, StreamEvent]]:
        """Advance every running request by one target step; returns each decoding one's event, and the last event
        (finish_reason "error", with its exception) of each request the step failed."""
        self._retire()
        for request in self.scheduler.admit(self._fits):
            if len(request.prompt_ids) <= 1:  # nothing to prefill or look up: decoding from this step on
                self._open(request)
        rows = list(self.scheduler.running)
        if not rows:
            return []
        self.counters.steps += 1
        self.counters.rows += len(rows)
        saved, plan = self._save(rows), {}
        try:
            computed, failed = [self._compute(rows, plan)], []
        except Exception:  # noqa: BLE001 - whose failure it was shows when each row runs alone
            self._restore(saved)
            computed, failed = self._compute_each(rows, plan)
        events = failed + [event for part in computed if part is not None for event in self._apply(part)]
        self._retire()
        return events

    # ---- the step's parts -----------------------------------------------------------------------------------------

    def _kv_proposer(self, request: SpecRequest) -> Proposer | None:
        """The proposer of ``request``'s method when it keeps KV of its own per request (the draft model) and the
        request may draft at all; None otherwise."""
        proposer = self.proposers.get(request.method)
        if proposer is None or proposer.kv_runner is None or request.plan.max_draft_len == 0:
            return None
        return proposer

    def _fits(self, request: SpecRequest, running: list[SpecRequest]) -> bool:
        """Admit only while every running request can still reach its longest (shared prefixes counted once per
        request: conservative), so a step never runs out of blocks."""
        return sum(self._worst_blocks(r) for r in [*running, request]) <= self.max_blocks

    def _worst_blocks(self, request: SpecRequest) -> int:
        longest = min(len(request.prompt_ids) + request.max_new_tokens, self.max_len) + self.spare
        return -(-longest // self.kv.block_size)

    def _open(self, request: SpecRequest) -> None:
        """Look the prompt up in the prefix cache when its prefill starts, not when it joins the batch: a request
        that joined beside another still prefilling the same system prompt then finds that prompt's blocks."""
        # The last prompt token stays unseen: it is the first input of the request's first decoding step.
        self.target.open(request.id, request.prompt_ids, request.cache_salt)
        if (proposer := self._kv_proposer(request)) is not None:  # in the target's blocks: opened after it
            proposer.kv_runner.open(request.id, request.prompt_ids, request.cache_salt)

    def _prefilling(self, request: SpecRequest) -> bool:
        opened = request.id in self.target.cache.lengths
        return not opened or self.target.length(request.id) < len(request.sequence) - 1

    def _chunks(self, prefilling: list[SpecRequest], used: int) -> tuple[list[SpecRequest], list[list[int]]]:
        """Step 3's prompt chunks, first come first served within what the verify left of the token budget (at
        least one block's worth every step, so prompts advance even when the verifies fill the budget); returns the
        requests that prefill this step and their chunks."""
        left = max(self.kv.step_tokens - used, min(self.kv.block_size, self.kv.step_tokens))
        chosen, chunks = [], []
        for request in prefilling:
            if left <= 0:
                break
            if request.id not in self.target.cache.lengths:
                self._open(request)
            have = self.target.length(request.id)
            chunk = request.sequence[have:min(have + left, len(request.sequence) - 1)]
            left -= len(chunk)
            chosen.append(request)
            chunks.append(chunk)
        return chosen, chunks

    def _catch_up(self, prefilling: list[SpecRequest]) -> None:
        """Each proposer keeping its own KV brings it as far as the target's for the prefilling rows (its reused
        prefix may be shorter), one call per runner for all the rows in it."""
        by_runner: dict[BatchModelRunner, tuple[Proposer, list[SpecRequest]]] = {}
        for request in prefilling:
            if (proposer := self._kv_proposer(request)) is not None:
                by_runner.setdefault(proposer.kv_runner, (proposer, []))[1].append(request)
        for proposer, requests in by_runner.values():
            proposer.catch_up(requests)

    def _propose(self, rows: list[SpecRequest], plan: dict[int, int], alone: bool = False) -> StepBatch:
        """Step 2: each row's step_draft_len (``plan``: request id -> K, decided once per step, so a row run alone
        after a failed batch drafts what it would have drafted in the batch), then the chosen proposer's tokens."""
        batch = StepBatch(rows)
        proposers = [self.proposers[request.method] for request in rows]
        if any(request.id not in plan for request in rows):
            caps: list[int | None] = [None] * len(rows)
            if self.policy is not None and not alone:  # priced for the batch: one row alone keeps its own K
                own = [request.step_draft_len() for request in rows]
                limits = [proposer.limit(batch, row, own[row]) if own[row] else 0
                          for row, proposer in enumerate(proposers)]
                caps = self.policy.plan([r.id for r in rows], limits, [p.uses_model for p in proposers],
                                        [p.verify_width for p in proposers])
            for request, cap in zip(rows, caps):
                plan.setdefault(request.id, request.step_draft_len(cap))
        batch.k = [plan[request.id] for request in rows]
        routed: dict[Proposer, list[int]] = {}
        for row in range(len(rows)):
            chosen = self._drafter(batch, row)
            if chosen is not None:
                routed.setdefault(chosen, []).append(row)
        for proposer, chosen_rows in routed.items():
            proposer.propose(batch, chosen_rows)
        for row, request in enumerate(rows):  # a draft token the grammar forbids would be rejected: not verified
            if request.grammar is not None and batch.trees[row] is None and batch.proposals[row]:
                batch.cut(row, request.grammar.allowed_prefix(batch.proposals[row]))
        batch.seal(self.vocab_size, self.device)
        return batch

    def _drafter(self, batch: StepBatch, row: int) -> Proposer | None:
        """The proposer that drafts ``row`` this step (choose_drafter's pick, when it can propose anything for the
        row: a Medusa row has no hidden state before its first verify), or None for a plain step."""
        forced = self.grammar_proposer.limit(batch, row, batch.k[row])
        if forced:  # tokens the request's grammar forces go first, whatever its method
            batch.k[row] = forced
            return self.grammar_proposer
        k = batch.k[row]
        if k == 0:
            return None
        method = choose_drafter(batch.requests[row], k, lambda n: row_lookup(batch, row, n, self.ngram),
                                self.costs.value)
        proposer = self.proposers.get(method) if method is not None else None
        return proposer if proposer is not None and proposer.limit(batch, row, k) > 0 else None

    def _compute(self, rows: list[SpecRequest], plan: dict[int, int], alone: bool = False) -> _Computed | None:
        """Steps 2-4: proposals, one target forward for all rows (prompt chunks included), one accept call per mode.
        Changes only the rows' KV lengths and random streams (see _save); None when there was nothing to compute."""
        prefilling = [request for request in rows if self._prefilling(request)]
        batch = self._propose([request for request in rows if request not in prefilling], plan, alone)
        start = time.perf_counter()
        decoding = batch.requests
        inputs = [request.sequence[self.target.length(request.id):] + batch.proposals[row]
                  for row, request in enumerate(decoding)]
        prefilling, chunks = self._chunks(prefilling, sum(len(ids) for ids in inputs))
        if not decoding and not any(chunks):  # prompts whose context was all cached: nothing to compute this step
            return None
        # Rows whose method drafts from the target's hidden state (Medusa) need it after every step, drafted or not.
        hidden_rows = [row for row, request in enumerate(decoding) if request.method in self._hidden_users]
        out = self.target.forward([r.id for r in decoding] + [r.id for r in prefilling], inputs + chunks,
                                  logits_for=[len(ids) for ids in inputs] + [0] * len(chunks),
                                  trees=batch.trees + [None] * len(chunks) if any(batch.trees) else None,
                                  hidden=bool(hidden_rows))
        packed = sum(map(len, inputs + chunks))
        self.counters.tokens += packed
        self.counters.prefill_tokens += sum(map(len, chunks))
        self.step_tokens = (self.step_tokens + [packed])[-64:]
        self._catch_up(prefilling)
        computed = _Computed(batch, prefilling, start, packed, aux=self.target.aux_hidden)
        if not decoding:
            return computed
        logits, computed.hidden = out if hidden_rows else (out, None)
        raw = logits[:len(decoding), :, :self.vocab_size]  # [rows, width, V]
        # Row r's logits at padded position first_logit[r] + j judge its draft token j (j = num_draft: the bonus);
        # for a tree row, first_logit[r] + j is node j's (the root's at j = 0).
        batch.first_logit = torch.tensor([len(ids) for ids in inputs]) - batch.num_draft - 1
        logits = adjust_verify(batch, raw)  # each row's penalties, bias and grammar, position by position
        best = logits.max(-1)  # [rows, width]: the greedy tokens, and NaN wherever a row's logits hold one
        broken = torch.isnan(best.values).any(-1).nonzero().flatten().tolist()
        if broken:
            raise FloatingPointError(f"target logits: NaN for request {decoding[broken[0]].id} (the model's output "
                                     f"for its tokens is not finite)")
        computed.outcome = self._accept_greedy(batch, best.indices) | self._accept_sampled(batch, logits) | \
            self._accept_trees(batch, logits)
        computed.logprobs = token_logprobs(batch, raw, computed.outcome)
        computed.hidden_rows = hidden_rows
        return computed

    def _compute_each(self, rows: list[SpecRequest], plan: dict[int, int]
                      ) -> tuple[list[_Computed | None], list[tuple[SpecRequest, StreamEvent]]]:
        """After the batched compute raised (and the step's state was restored): each row alone, so only a row
        that fails by itself is failed; returns the others' computes and the failed rows' events."""
        computed, failed = [], []
        for request in rows:
            try:
                computed.append(self._compute([request], plan, alone=True))
            except Exception as exc:  # noqa: BLE001 - this row's own failure: it fails, its neighbours run on
                failed.append((request, self._fail(request, exc)))
        return computed, failed

    def _apply(self, computed: _Computed) -> list[tuple[SpecRequest, StreamEvent]]:
        """Step 5, row by row: roll back, emit, commit the final KV for reuse; a row whose own step 5 raises fails
        alone. Then the hidden states go to the proposers that read them."""
        batch, events, last_position, kept = computed.batch, [], {}, []
        for request in computed.prefilling:
            try:
                self._commit(request)
            except Exception as exc:  # noqa: BLE001 - this row's own failure
                events.append((request, self._fail(request, exc)))
        for row, request in enumerate(batch.requests):
            try:
                tokens, accepted, path = computed.outcome[row]
                tree = batch.trees[row]
                drafted = tree.max_depth if tree is not None else len(batch.proposals[row])
                base = len(request.prompt_ids) + len(request.generated)
                if tree is not None:  # the accepted path's KV moves next to the root; the other branches are dropped
                    self.target.keep_path(request.id, base - 1, path)
                # Drop the KV of rejected draft tokens; the emitted extra token is fed next step.
                self._roll_back(request, base + accepted)
                if self.policy is not None and batch.proposer[row] != GRAMMAR_PROPOSER:  # forced tokens: not the method's
                    self.policy.observe(request.id, drafted, accepted)
                last_position[row] = int(batch.first_logit[row]) + (path[-1] if path else accepted)
                events.append((request, request.advance(tokens, drafted, accepted, proposer=batch.proposer[row],
                                                        logprobs=computed.logprobs.get(row))))
                self._commit(request)
                kept.append(row)
            except Exception as exc:  # noqa: BLE001 - this row's own failure
                events.append((request, self._fail(request, exc)))
        self._hand_states(computed, kept)
        hidden_rows = [row for row in computed.hidden_rows if row in kept]
        if hidden_rows:
            hidden = computed.hidden
            index = torch.tensor([last_position[row] for row in hidden_rows], device=hidden.device)
            states = hidden[torch.tensor(hidden_rows, device=hidden.device), index]  # [R, d]
            for method, proposer in self.proposers.items():
                if proposer.wants_hidden:
                    mine = [i for i, row in enumerate(hidden_rows) if batch.requests[row].method == method]
                    proposer.verified([batch.requests[hidden_rows[i]] for i in mine], states[mine])
        if batch.requests:
            self._record("target", computed.packed, time.perf_counter() - computed.start)
        return events

    def _hand_states(self, computed: _Computed, kept: list[int]) -> None:
        """The aux layers' outputs of the tokens each row keeps, to its proposer if it reads them (target_states):
        a chunk's every token; a verify's input before its drafts, then its accepted drafts or tree path."""
        if not self._state_users or computed.aux is None:
            return
        batch = computed.batch
        for row in kept:
            request, states = batch.requests[row], computed.aux[row]
            if self._reads_states(request):
                positions = torch.tensor(self._kept_positions(computed, row), device=states.device)
                self.proposers[request.method].target_states(request, states[positions])
        for request, states in zip(computed.prefilling, computed.aux[len(batch.requests):]):  # chunks: every token
            if self._reads_states(request) and not request.finished:
                self.proposers[request.method].target_states(request, states)

    def _reads_states(self, request: SpecRequest) -> bool:
        """Whether ``request``'s proposer gets the target's states: not for a request that never drafts (K = 0)."""
        return request.method in self._state_users and request.plan.max_draft_len > 0

    @staticmethod
    def _kept_positions(computed: _Computed, row: int) -> list[int]:
        """Indices into row ``row``'s verify input of the tokens it keeps."""
        batch = computed.batch
        _, accepted, path = computed.outcome[row]
        before = int(batch.first_logit[row]) + 1  # the input before its drafts (the root last)
        if batch.trees[row] is not None:
            return list(range(before)) + [before - 1 + node for node in path]
        return list(range(before + accepted))

    def _commit(self, request: SpecRequest) -> None:
        """The KV up to each runner's length is final: its full blocks become reusable."""
        for runner in self._runners_of(request):
            runner.commit(request.id, request.sequence)

    def _fail(self, request: SpecRequest, exc: Exception) -> StreamEvent:
        """Finish ``request`` alone for ``exc``; its blocks are released when the step retires it."""
        return request.fail(RequestFailed(f"request {request.id}: the engine failed it ({type(exc).__name__}: {exc}); "
                                          f"the requests beside it were not affected", exc))

    def _save(self, rows: list[SpecRequest]) -> _Saved:
        lengths = [(runner, request.id, runner.cache.lengths.get(request.id)) for runner in self.runners
                   for request in rows]
        return _Saved(lengths, [(request.generator, request.generator.get_state()) for request in rows
                                if not request.params.greedy])

    def _restore(self, saved: _Saved) -> None:
        """Undo steps 2-4 (nothing there commits a block, so every length can go back)."""
        for runner, seq, length in saved.lengths:
            if length is None:
                if seq in runner.cache.lengths:  # opened by this step's prefill
                    runner.close(seq)
            else:
                runner.truncate(seq, length)
        for generator, state in saved.generators:
            generator.set_state(state)

    def _roll_back(self, request: SpecRequest, length: int) -> None:
        for runner in self._runners_of(request):
            runner.truncate(request.id, length)

    def _runners_of(self, request: SpecRequest) -> list[BatchModelRunner]:
        """The runners holding a sequence for ``request``, the target's first (a proposer's runner only when the
        request drafts with it)."""
        return [r for r in self.runners if request.id in r.cache.lengths]

    def _accept_trees(self, batch: StepBatch, logits: torch.Tensor) -> dict[int, tuple[list[int], int, list[int]]]:
        """Tree rows one by one (trees differ in shape per row): the greedy longest path, or the lossless walk over
        siblings with uniforms from the row's own generator (a fixed number per step, whatever the walk uses)."""
        outcome = {}
        for row, tree in enumerate(batch.trees):
            if tree is None:
                continue
            request = batch.requests[row]
            first = int(batch.first_logit[row])
            judged = logits[row, first:first + tree.size]  # [N, V]: after the root and after each candidate
            tokens = torch.tensor([[request.sequence[-1]] + batch.proposals[row]], device=logits.device)  # [1, N]
            if request.params.greedy:
                last, final = greedy_tree_accept(tree, tokens, judged.argmax(-1)[None])
            else:
                uniforms = torch.rand(uniforms_needed(tree), generator=request.generator,
                                      device=request.generator.device).to(logits.device)
                probs = _checked_probs([request], logits_to_probs(judged, request.params)[None])  # [1, N, V]
                last, final = sampled_tree_accept(tree, tokens, probs, uniforms[None])
            path = tree.path_to(int(last))
            outcome[row] = ([int(tokens[0, node]) for node in path] + [int(final)], len(path), path)
        return outcome

    def _judged_positions(self, batch: StepBatch, chosen: list[int], width: int) -> torch.Tensor:
        """[len(chosen), K+1]: where each chosen row's draft tokens and its extra token are judged in the logits."""
        k = batch.draft_tokens.shape[1]
        positions = batch.first_logit[chosen][:, None] + torch.arange(k + 1)[None, :]
        return positions.clamp_max(width - 1)  # past a row's own drafts: padding, never read as its output

    def _accept_greedy(self, batch: StepBatch, argmax: torch.Tensor) -> dict[int, tuple[list[int], int, list]]:
        """All greedy rows through one accept_matching call; drafts padded with -1, which never matches.
        argmax: [rows, width] the target's greedy token at each position."""
        chosen = [row for row, request in enumerate(batch.requests)
                  if request.params.greedy and batch.trees[row] is None]
        if not chosen:
            return {}
        width = argmax.shape[1]
        argmax = argmax.cpu()  # one small transfer instead of the logits
        positions = self._judged_positions(batch, chosen, width)
        target_tokens = argmax[chosen].gather(1, positions)  # [g, K+1]
        if batch.draft_tokens.shape[1] == 0:  # nothing drafted (target-only): nothing to match, the target's token
            return {row: ([token], 0, []) for row, token in zip(chosen, target_tokens[:, 0].tolist())}
        output, num_accepted = accept_matching(batch.draft_tokens[chosen], target_tokens)
        return _per_row(chosen, output, num_accepted)

    def _accept_sampled(self, batch: StepBatch, logits: torch.Tensor) -> dict[int, tuple[list[int], int, list]]:
        """All sampled rows through one accept call. Each row's randomness comes from its own generator, drawn
        before the call (num_draft + 1 uniforms), so its tokens never depend on its neighbours."""
        chosen = [row for row, request in enumerate(batch.requests)
                  if not request.params.greedy and batch.trees[row] is None]
        if not chosen:
            return {}
        k = batch.draft_tokens.shape[1]
        positions = self._judged_positions(batch, chosen, logits.shape[1]).to(logits.device)
        judged = logits[chosen].gather(1, positions[..., None].expand(-1, -1, logits.shape[-1]))  # [s, K+1, V]
        target_probs = _checked_probs([batch.requests[row] for row in chosen], torch.stack(
            [logits_to_probs(judged[i], batch.requests[row].params) for i, row in enumerate(chosen)]))  # [s, K+1, V]
        uniforms = torch.zeros(len(chosen), k + 1, device=logits.device)  # [s, K+1]
        for i, row in enumerate(chosen):
            request = batch.requests[row]
            drawn = len(batch.proposals[row]) + 1
            uniforms[i, :drawn] = torch.rand(drawn, generator=request.generator,
                                             device=request.generator.device).to(logits.device)
        num_draft = batch.num_draft[chosen].to(logits.device)
        draft_tokens = batch.draft_tokens[chosen].to(logits.device)
        if self.acceptance == "rejection":
            output, num_accepted = accept_rejection(draft_tokens, batch.draft_probs[chosen], target_probs,
                                                    num_draft=num_draft, uniforms=uniforms)
        else:  # draft tokens kept while they equal the target's own samples: lossless too
            flat = sample_inverse_cdf(target_probs.flatten(0, 1), uniforms.flatten())  # [s * (K+1)]
            output, num_accepted = accept_matching(draft_tokens, flat.view(len(chosen), k + 1))
        return _per_row(chosen, output, num_accepted)

    def _record(self, role: str, tokens: int, seconds: float) -> None:
        """One step phase's cost: a draft position (``tokens`` = rows) or the verify (its packed tokens)."""
        self.costs.record(role, seconds)
        if self.policy is not None:
            getattr(self.policy, role).record(tokens, seconds, measured=True)

    def _retire(self) -> None:
        for request in self.scheduler.retire():
            for runner in self._runners_of(request):
                runner.close(request.id)
            for proposer in self.proposers.values():
                proposer.release(request.id)


def _checked_probs(requests: list[SpecRequest], probs: torch.Tensor) -> torch.Tensor:
    """probs: [n, X, V], request i's distributions in probs[i]; raises naming the first request whose
    distributions are not all finite with positive mass (sampling from them would emit garbage ids)."""
    mass = probs.sum(-1)  # [n, X]
    broken = (~(torch.isfinite(mass) & (mass > 0))).any(-1).nonzero().flatten().tolist()
    if broken:
        request = requests[broken[0]]
        raise FloatingPointError(f"sampling: request {request.id}'s target distribution is not finite (temperature "
                                 f"{request.params.temperature}, top_k {request.params.top_k}, top_p "
                                 f"{request.params.top_p})")
    return probs


def _per_row(chosen: list[int], output: torch.Tensor,
             num_accepted: torch.Tensor) -> dict[int, tuple[list[int], int, list]]:
    """row -> (emitted tokens, accepted draft tokens, no tree path) from an accept rule's [n, K+1] output."""
    output, num_accepted = output.tolist(), num_accepted.tolist()
    return {row: (output[i][:num_accepted[i] + 1], num_accepted[i], []) for i, row in enumerate(chosen)}
