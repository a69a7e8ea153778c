"""The batched speculative engine (torch backend): every running request advances in each step together.

Per step, for the running requests (rows) at once:
  1. Admit: waiting requests take free slots; each new one's prompt is prefilled into both KV caches alone.
  2. Draft: one batched draft forward per draft position; row r drafts its own k_r tokens (0 for target-only
     rows), and its first forward also catches up on tokens the draft has not seen.
  3. Verify: one batched target forward over every row's unseen tokens + its k_r draft tokens.
  4. Accept: the pure accept rule per row, with the row's own sampling parameters and random generator.
  5. Roll back: each row's KV caches drop that row's rejected positions; finished rows leave their slots.
Rows differ in length, K, sampling parameters, seed, stop tokens and max_new_tokens; a row's tokens depend only on
its own request (each has its own generator, and the mask keeps rows from seeing each other).
"""

from __future__ import annotations

import time

import torch

from ..speculative import accept_matching, accept_rejection, logits_to_probs, sample
from ..speculative.ngram import one_hot_probs, propose_ngram
from .draft_policy import DraftPolicy
from .model_runner import BatchModelRunner
from .proposers import DRAFT, NGRAM, NgramSettings, choose_proposal
from .request import SpecRequest
from .results import StreamEvent
from .scheduler import Scheduler


class SpeculativeEngine:
    def __init__(self, target_model, draft_model, *, device, max_batch: int, max_tokens: int, vocab_size: int,
                 k_max: int, acceptance: str = "rejection", adaptive_k: bool = False, compile: bool = False,
                 ngram: NgramSettings | None = None):
        """``max_tokens``: longest sequence (prompt + generated) a row holds; ``adaptive_k``: cap K per step
        from measured costs and acceptance (for serving; a result never depends on it, see SpecRequest);
        ``ngram``: lookup settings for requests whose method uses n-gram proposals."""
        self.device = torch.device(device)
        self.target = BatchModelRunner(target_model, self.device, max_batch, max_tokens, compile)
        self.draft = BatchModelRunner(draft_model, self.device, max_batch, max_tokens, compile) \
            if draft_model is not None else None
        self.vocab_size = vocab_size  # ids both models have (padded embedding rows are not tokens)
        self.acceptance = acceptance
        self.scheduler = Scheduler(max_batch)
        self.ngram = ngram or NgramSettings()
        self._seconds = {"draft": 0.0, "target": 0.0}  # running means of one forward's time (cost ratio c)
        # N-gram rows need the policy as much as draft-model rows: their proposals are free, the wider verify is not.
        self.policy = DraftPolicy(k_max) if adaptive_k and k_max > 0 else None
        if self.policy is not None:
            self.policy.calibrate(target_model, draft_model, max_batch, self.device, vocab_size)

    # ---- the server-facing API ------------------------------------------------------------------------------------

    def add(self, request: SpecRequest) -> None:
        self.scheduler.add(request)

    def cancel(self, request: SpecRequest) -> StreamEvent | None:
        """Stop a request; its slot is freed at the next step. None when it had already finished."""
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

    def step(self) -> list[tuple[SpecRequest, StreamEvent]]:
        """Advance every running request by one target step; returns each one's event."""
        self._retire()
        for slot, request in self.scheduler.admit():
            self._prefill(slot, request)
        rows = self.scheduler.running
        if not rows:
            return []
        drafts, draft_probs, kinds = self._propose(rows, self._draft_lens(rows))
        events = self._verify(rows, drafts, draft_probs, kinds)
        self._retire()
        return events

    # ---- the step's parts -----------------------------------------------------------------------------------------

    def _prefill(self, slot: int, request: SpecRequest) -> None:
        # The last prompt token stays unseen: it is the first input of the request's first step.
        context = request.sequence[:-1]
        self.target.prefill(slot, context)
        if self.draft is not None and request.plan.k_max > 0 and request.method != NGRAM:
            self.draft.prefill(slot, context)

    @property
    def cost_ratio(self) -> float:
        """c: one draft forward over one target forward, as measured on this engine (0.25 until both ran)."""
        draft, target = self._seconds["draft"], self._seconds["target"]
        return draft / target if draft > 0 and target > 0 else 0.25

    def _draft_lens(self, rows: list[SpecRequest]) -> list[int]:
        cap = None
        if self.policy is not None:
            # ngram+draft rows count as model rows: the draft's cost bounds what their step can cost.
            uses_model = [self.draft is not None and r.method != NGRAM for r in rows]
            cap = self.policy.plan([r.id for r in rows], [self._proposal_limit(r) for r in rows], uses_model)
        return [r.draft_len(cap) for r in rows]

    def _proposal_limit(self, request: SpecRequest) -> int:
        """The most tokens a row can propose this step: a lookup-only row proposes what its lookup finds (often
        nothing), and verifying costs only that."""
        k = request.draft_len()
        if request.method != NGRAM or k == 0:
            return k
        return len(propose_ngram(request.sequence, k, self.ngram.min_match, self.ngram.max_match))

    def _propose(self, rows: list[SpecRequest], ks: list[int]
                 ) -> tuple[list[list[int]], list[list[torch.Tensor]], list[str | None]]:
        """Step 2: draft tokens per row (up to k_r), for sampled rows the distributions they came from, and which
        proposer made them. N-gram proposals need no forward; the draft model runs for the rows that chose it."""
        drafts: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        kinds: list[str | None] = [None] * len(rows)
        model_ks = [0] * len(rows)
        for row, request in enumerate(rows):
            kinds[row], lookup = choose_proposal(request, ks[row], self.ngram, self.cost_ratio)
            if kinds[row] == DRAFT and self.draft is not None:
                model_ks[row] = ks[row]
            elif lookup:
                drafts[row] = lookup
                if not request.params.greedy:  # a lookup is a deterministic proposal: one-hot distributions
                    probs[row] = list(one_hot_probs(lookup, self.vocab_size, self.device).split(1))
        self._propose_with_model(rows, model_ks, drafts, probs)
        return drafts, probs, kinds

    def _propose_with_model(self, rows: list[SpecRequest], ks: list[int], drafts: list[list[int]],
                            probs: list[list[torch.Tensor]]) -> None:
        for position in range(max(ks, default=0)):
            start = time.perf_counter()
            inputs = []
            for row, request in enumerate(rows):
                if position >= ks[row]:
                    inputs.append([])
                elif position == 0:  # catch up on every token the draft has not seen
                    inputs.append(request.sequence[self.draft.length(row):])
                else:
                    inputs.append([drafts[row][-1]])
            used = max(row for row, tokens in enumerate(inputs) if tokens) + 1
            logits = self.draft.forward(inputs[:used])[..., :self.vocab_size]  # [used, width, V]
            greedy = logits.argmax(-1)  # [used, width]
            for row in range(used):
                if not inputs[row]:
                    continue
                request, last = rows[row], len(inputs[row]) - 1
                if request.params.greedy:
                    drafts[row].append(int(greedy[row, last]))
                else:
                    row_probs = logits_to_probs(logits[row, last][None], request.params)  # [1, V]
                    drafts[row].append(int(sample(row_probs, request.generator)))
                    probs[row].append(row_probs)
            # One draft position costs its forward plus the per-row sampling around it: record both.
            self._record("draft", used, time.perf_counter() - start)

    def _verify(self, rows: list[SpecRequest], drafts: list[list[int]], draft_probs: list[list[torch.Tensor]],
                kinds: list[str | None]) -> list[tuple[SpecRequest, StreamEvent]]:
        """Steps 3-5: one target forward for all rows, then accept and roll back per row."""
        start = time.perf_counter()
        ks = [len(tokens) for tokens in drafts]
        inputs = [request.sequence[self.target.length(row):] + drafts[row] for row, request in enumerate(rows)]
        logits = self.target.forward(inputs)[..., :self.vocab_size]  # [rows, width, V]
        # Row r's logits at padded position firsts[r] + j predict its draft token j (j = k_r: the bonus token).
        firsts = [len(inputs[row]) - ks[row] - 1 for row in range(len(rows))]
        outcome = self._accept_greedy(rows, ks, drafts, firsts, logits)
        for row, request in enumerate(rows):
            if not request.params.greedy:
                k, first = ks[row], firsts[row]
                outcome[row] = self._accept_sampled(request, drafts[row], draft_probs[row],
                                                    logits[row, first:first + k + 1])
        events = []
        for row, request in enumerate(rows):
            tokens, accepted = outcome[row]
            base = len(request.prompt_ids) + len(request.generated)
            # Step 5: drop the KV of rejected draft tokens; the emitted extra token is fed next step.
            self.target.truncate(row, base + accepted)
            if self.draft is not None:
                self.draft.truncate(row, base + accepted)
            if self.policy is not None:
                self.policy.observe(request.id, ks[row], accepted)
            events.append((request, request.advance(tokens, ks[row], accepted, proposer=kinds[row])))
        self._record("target", logits.shape[0] * logits.shape[1], time.perf_counter() - start)
        return events

    def _accept_greedy(self, rows: list[SpecRequest], ks: list[int], drafts: list[list[int]], firsts: list[int],
                       logits: torch.Tensor) -> dict[int, tuple[list[int], int]]:
        """All greedy rows through one accept_matching call; drafts padded with -1, which never matches."""
        chosen = [row for row, request in enumerate(rows) if request.params.greedy]
        if not chosen:
            return {}
        k = max(ks[row] for row in chosen)
        width = logits.shape[1]
        argmax = logits.argmax(-1).cpu()  # [rows, width]; one small transfer instead of the logits
        if k == 0:  # plain decoding: the accept rule reduces to "emit the target's token"
            return {row: ([int(argmax[row, firsts[row]])], 0) for row in chosen}
        drafted = torch.full((len(chosen), k), -1, dtype=torch.long)  # [g, k]
        for i, row in enumerate(chosen):
            drafted[i, :ks[row]] = torch.tensor(drafts[row], dtype=torch.long)
        positions = (torch.tensor([firsts[row] for row in chosen])[:, None] + torch.arange(k + 1)[None, :])
        target_tokens = argmax[chosen].gather(1, positions.clamp_max(width - 1))  # [g, k+1]
        output, num_accepted = accept_matching(drafted, target_tokens)
        output, num_accepted = output.tolist(), num_accepted.tolist()
        return {row: (output[i][:num_accepted[i] + 1], num_accepted[i]) for i, row in enumerate(chosen)}

    def _accept_sampled(self, request: SpecRequest, draft_tokens: list[int], draft_probs: list[torch.Tensor],
                        target_logits: torch.Tensor) -> tuple[list[int], int]:
        """target_logits: [k+1, V]. The row's own generator, so its draws never depend on its neighbours."""
        drafted = torch.tensor([draft_tokens], dtype=torch.long, device=target_logits.device)  # [1, k]
        target_probs = logits_to_probs(target_logits, request.params)  # [k+1, V]
        if self.acceptance == "rejection" and draft_tokens:
            output, num_accepted = accept_rejection(drafted, torch.cat(draft_probs)[None], target_probs[None],
                                                    generator=request.generator)
        else:
            output, num_accepted = accept_matching(drafted, sample(target_probs, request.generator)[None])
        accepted = int(num_accepted[0])
        return output[0, :accepted + 1].tolist(), accepted

    def _record(self, role: str, tokens: int, seconds: float) -> None:
        """One step phase's cost: a draft position (``tokens`` = rows) or the verify (rows x width tokens)."""
        mean = self._seconds[role]
        self._seconds[role] = seconds if mean == 0 else 0.9 * mean + 0.1 * seconds
        if self.policy is not None:
            getattr(self.policy, role).record(tokens, seconds, measured=True)

    def _retire(self) -> None:
        moves, freed = self.scheduler.retire()
        for runner in (self.target, self.draft):
            if runner is None:
                continue
            for src, dst in moves:
                runner.move(src, dst)
            for slot in freed:
                runner.clear(slot)
