"""The batching engine (torch backend): every running request advances in each step together.

Per step, for the running requests (rows) at once:
  1. Admit: waiting requests take free slots; each new one's prompt is prefilled into both KV caches alone.
  2. Propose: each row's proposer (proposers/, by the request's method) drafts up to the row's own K into a
     StepBatch; the draft model runs one batched forward per draft position for all the rows it drafts, its first
     forward also catching up on tokens the draft has not seen.
  3. Verify: one batched target forward over every row's unseen tokens + its draft tokens (a Medusa row's: its
     candidate tree, each node at root + depth under the tree mask).
  4. Accept: the pure accept rule, one call for the greedy rows and one for the sampled rows, each row with its
     own sampling parameters and randomness drawn from its own generator; tree rows by the tree rules.
  5. Roll back: each row's KV caches drop that row's rejected positions (a tree row first moves its accepted
     path's KV next to the root); finished rows leave their slots. Proposers that draft from the target's hidden
     state get it, at each of their rows' last accepted position.
Rows differ in length, K, sampling parameters, seed, stop tokens and max_new_tokens; a row's tokens depend only on
its own request (each has its own generator, and the mask keeps rows from seeing each other).
"""

from __future__ import annotations

import time

import torch

from ..methods import NgramSettings
from ..speculative import accept_matching, accept_rejection, logits_to_probs, sample_inverse_cdf
from ..speculative.tree import greedy_tree_accept, sampled_tree_accept, uniforms_needed
from .draft_policy import DraftPolicy
from .model_runner import BatchModelRunner
from .proposers import CostRatio, Proposer, ProposerContext, build_proposers
from .request import SpecRequest
from .results import StreamEvent
from .scheduler import Scheduler
from .step_batch import StepBatch


class BatchingEngine:
    def __init__(self, target_model, draft_model, *, device, max_batch: int, max_tokens: int, vocab_size: int,
                 k_max: int, acceptance: str = "rejection", adaptive_k: bool = False, compile: bool = False,
                 ngram: NgramSettings | None = None, medusa: tuple | None = None):
        """``max_tokens``: longest sequence (prompt + generated) a row holds; ``adaptive_k``: cap K per step
        from measured costs and acceptance (for serving; a result never depends on it, see SpecRequest);
        ``ngram``: lookup settings for requests whose method uses n-gram proposals; ``medusa``: (MedusaHeads,
        TokenTree) for requests whose method is medusa."""
        self.device = torch.device(device)
        self.target = BatchModelRunner(target_model, self.device, max_batch, max_tokens, compile)
        self.draft = BatchModelRunner(draft_model, self.device, max_batch, max_tokens, compile) \
            if draft_model is not None else None
        self.vocab_size = vocab_size  # ids both models have (padded embedding rows are not tokens)
        self.acceptance = acceptance
        self.scheduler = Scheduler(max_batch)
        self.costs = CostRatio()
        self.proposers: dict[str, Proposer] = build_proposers(ProposerContext(
            self.draft, vocab_size, self.device, ngram or NgramSettings(), lambda: self.costs.value,
            lambda rows, seconds: self._record("draft", rows, seconds), medusa))
        self._hidden_users = {method for method, proposer in self.proposers.items() if proposer.wants_hidden}
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
        events = self._verify(self._propose(rows))
        self._retire()
        return events

    # ---- the step's parts -----------------------------------------------------------------------------------------

    def _prefill(self, slot: int, request: SpecRequest) -> None:
        # The last prompt token stays unseen: it is the first input of the request's first step.
        context = request.sequence[:-1]
        self.target.prefill(slot, context)
        if self.draft is not None and request.plan.k_max > 0 and request.method.needs_draft_model:
            self.draft.prefill(slot, context)

    def _propose(self, rows: list[SpecRequest]) -> StepBatch:
        """Step 2: each row's K (its own, within the batch's cap), then its proposer's tokens."""
        batch = StepBatch(rows)
        proposers = [self.proposers[request.method] for request in rows]
        cap = None
        if self.policy is not None:
            own = [request.draft_len() for request in rows]
            limits = [proposer.limit(batch, row, own[row]) if own[row] else 0
                      for row, proposer in enumerate(proposers)]
            cap = self.policy.plan([r.id for r in rows], limits, [p.uses_model for p in proposers],
                                   [p.verify_width for p in proposers])
        batch.k = [request.draft_len(cap) for request in rows]
        routed: dict[Proposer, list[int]] = {}
        for row, proposer in enumerate(proposers):
            chosen = proposer.route(batch, row) if batch.k[row] > 0 else None
            if chosen is not None:
                routed.setdefault(chosen, []).append(row)
        for proposer, chosen_rows in routed.items():
            proposer.propose(batch, chosen_rows)
        batch.seal(self.vocab_size, self.device)
        return batch

    def _verify(self, batch: StepBatch) -> list[tuple[SpecRequest, StreamEvent]]:
        """Steps 3-5: one target forward for all rows, one accept call per mode, then roll back per row."""
        start = time.perf_counter()
        rows = batch.requests
        inputs = [request.sequence[self.target.length(row):] + batch.proposals[row]
                  for row, request in enumerate(rows)]
        # Rows whose method drafts from the target's hidden state (Medusa) need it after every step, drafted or not.
        hidden_rows = [row for row, request in enumerate(rows) if request.method in self._hidden_users]
        out = self.target.forward(inputs, trees=batch.trees if any(batch.trees) else None, hidden=bool(hidden_rows))
        logits, hidden = out if hidden_rows else (out, None)
        logits = logits[..., :self.vocab_size]  # [rows, width, V]
        # Row r's logits at padded position first_logit[r] + j judge its draft token j (j = num_draft: the bonus);
        # for a tree row, first_logit[r] + j is node j's (the root's at j = 0).
        batch.first_logit = torch.tensor([len(ids) for ids in inputs]) - batch.num_draft - 1
        outcome = self._accept_greedy(batch, logits) | self._accept_sampled(batch, logits) | \
            self._accept_trees(batch, logits)
        events, last_position = [], []
        for row, request in enumerate(rows):
            tokens, accepted, path = outcome[row]
            tree = batch.trees[row]
            drafted = tree.max_depth if tree is not None else len(batch.proposals[row])
            base = len(request.prompt_ids) + len(request.generated)
            if tree is not None:  # the accepted path's KV moves next to the root; the other branches are dropped
                self.target.keep_path(row, base - 1, path)
            # Step 5: drop the KV of rejected draft tokens; the emitted extra token is fed next step.
            self.target.truncate(row, base + accepted)
            if self.draft is not None:
                self.draft.truncate(row, base + accepted)
            if self.policy is not None:
                self.policy.observe(request.id, drafted, accepted)
            last_position.append(int(batch.first_logit[row]) + (path[-1] if path else accepted))
            events.append((request, request.advance(tokens, drafted, accepted, proposer=batch.proposer[row])))
        if hidden_rows:
            index = torch.tensor([last_position[row] for row in hidden_rows], device=hidden.device)
            states = hidden[torch.tensor(hidden_rows, device=hidden.device), index]  # [R, d]
            for method, proposer in self.proposers.items():
                if proposer.wants_hidden:
                    mine = [i for i, row in enumerate(hidden_rows) if rows[row].method == method]
                    proposer.verified([rows[hidden_rows[i]] for i in mine], states[mine])
        self._record("target", logits.shape[0] * logits.shape[1], time.perf_counter() - start)
        return events

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
                last, final = sampled_tree_accept(tree, tokens, logits_to_probs(judged, request.params)[None],
                                                  uniforms[None])
            path = tree.path_to(int(last))
            outcome[row] = ([int(tokens[0, node]) for node in path] + [int(final)], len(path), path)
        return outcome

    def _judged_positions(self, batch: StepBatch, chosen: list[int], width: int) -> torch.Tensor:
        """[len(chosen), K+1]: where each chosen row's draft tokens and its extra token are judged in the logits."""
        k = batch.draft_tokens.shape[1]
        positions = batch.first_logit[chosen][:, None] + torch.arange(k + 1)[None, :]
        return positions.clamp_max(width - 1)  # past a row's own drafts: padding, never read as its output

    def _accept_greedy(self, batch: StepBatch, logits: torch.Tensor) -> dict[int, tuple[list[int], int, list]]:
        """All greedy rows through one accept_matching call; drafts padded with -1, which never matches."""
        chosen = [row for row, request in enumerate(batch.requests)
                  if request.params.greedy and batch.trees[row] is None]
        if not chosen:
            return {}
        argmax = logits.argmax(-1).cpu()  # [rows, width]; one small transfer instead of the logits
        positions = self._judged_positions(batch, chosen, logits.shape[1])
        target_tokens = argmax[chosen].gather(1, positions)  # [g, K+1]
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
        target_probs = torch.stack([logits_to_probs(judged[i], batch.requests[row].params)
                                    for i, row in enumerate(chosen)])  # [s, K+1, V]
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
        """One step phase's cost: a draft position (``tokens`` = rows) or the verify (rows x width tokens)."""
        self.costs.record(role, seconds)
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


def _per_row(chosen: list[int], output: torch.Tensor,
             num_accepted: torch.Tensor) -> dict[int, tuple[list[int], int, list]]:
    """row -> (emitted tokens, accepted draft tokens, no tree path) from an accept rule's [n, K+1] output."""
    output, num_accepted = output.tolist(), num_accepted.tolist()
    return {row: (output[i][:num_accepted[i] + 1], num_accepted[i], []) for i, row in enumerate(chosen)}
