"""EAGLE-3 heads as a proposer: a chain drafted by one layer reading the target's own hidden states.

The engine hands over, after every target forward, the fused layers' outputs of each token the target kept
(``target_states``, the engine being made with the heads' ``target_layers`` as its aux layers). The state after
token i pairs with token i + 1 at position i; when the row drafts, the pairs not yet seen run through the layer
(their keys and values kept: the heads' KV of the request), and the last one's output ranks the first draft
token. Each later draft token is one more step of the layer on its own output (see pipeline/eagle3_heads.py), its
keys kept only until the chain is drafted: after the verify, the accepted tokens come back as target states and
their pairs replace what the chain guessed. A sampled row draws each token from the heads' distribution under its
own sampling parameters (zero outside the draft vocabulary), which the rejection rule needs to stay exact.

With ``tree`` the K draft tokens form the likeliest tree the heads find instead of a chain (EAGLE-2's expansion):
each depth runs the TREE_WIDTH likeliest candidates of the last one in one batched step (each attending to the
request's KV and its own ancestors), their top TREE_WIDTH children become the next depth's candidates, and the K
candidates with the highest path probability (a child's never exceeds its parent's, so they form a tree) are
verified by the tree rules, each a point mass (lossless for sampled rows as well).

The heads' KV is the proposer's (one small layer: 2 x kv_heads x head_dim values per position), not the target's
block pool. A prompt whose prefix the target reused from its cache brings no states for that prefix; the KV of a
finished request's pairs is kept for the next prompt that starts the same way under the same cache salt (the last
MAX_KEPT), and otherwise the chain attends from where the states begin (the drafts get worse, the output does not
change).
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch
from torch import Tensor, nn

from ...methods import Method
from ...speculative import logits_to_probs, sample
from .. import matmul_choice
from ..row_logits import adjusted, adjusts
from ...eagle3_heads import Eagle3Heads, attend
from ...speculative.tree import TokenTree
from ..step_batch import StepBatch
from .base import Proposer, ProposerContext

MAX_KEPT = 8  # finished requests whose KV a later prompt with the same prefix may take
TREE_WIDTH = 4  # candidates expanded per depth in tree mode, and children kept per candidate


class _Row:
    """One request's heads KV: positions [start, length) hold the pairs seen; ``pending`` the fused states of the
    next ones; ``last`` the output of the pair at length - 1 (prenorm, logits)."""

    def __init__(self, heads: Eagle3Heads, request, start: int):
        c = heads.config
        shape = (max(64, 2 * start), c.num_key_value_heads, c.head_dim)
        self.k = heads.fc.weight.new_empty(shape)
        self.v = heads.fc.weight.new_empty(shape)
        self.request = request
        self.start = self.length = start
        self.pending: list[Tensor] = []
        self.last: tuple[Tensor, Tensor] | None = None

    def room(self, end: int) -> None:
        if end > self.k.shape[0]:
            grown = max(end, 2 * self.k.shape[0])
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty((grown, *old.shape[1:]))
                new[:old.shape[0]] = old
                setattr(self, name, new)

    def waiting(self) -> int:
        return sum(x.shape[0] for x in self.pending)


def measured_product(heads: Eagle3Heads):
    """The heads' products as the lean decoder's are made on a CPU: the kind measured fastest per width over their
    matrices (matmul_choice; a draft step multiplies one row per chain, where aten's float32 product reads about half
    as fast as the rows kernel). None elsewhere: each layer's own forward."""
    weights = {m: m.weight.detach() for m in heads.modules() if type(m) is nn.Linear}  # detached once, not per step
    if next(iter(weights.values())).device.type != "cpu" or len({w.dtype for w in weights.values()}) > 1:
        return None
    plan = matmul_choice.measured_once(list(weights.values()))

    def product(x: Tensor, layer: nn.Linear) -> Tensor:
        weight = weights[layer]
        if x.dtype != weight.dtype:
            return layer(x)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = matmul_choice.product(plan.kind(rows.shape[0]), rows, weight, layer.bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return product


class Eagle3Proposer(Proposer):
    method = Method.EAGLE3
    uses_model = True
    wants_states = True

    def __init__(self, context: ProposerContext):
        self.heads: Eagle3Heads = context.eagle3[0]
        self.tree = context.eagle3[1]  # draft a tree of K candidates instead of a chain
        self.target = context.target_runner
        self.vocab_size = context.vocab_size
        self.record = context.record_draft
        self._rows: dict[int, _Row] = {}
        self._kept: OrderedDict[tuple, tuple[Tensor, Tensor]] = OrderedDict()  # (salt, tokens) -> its pairs' k, v
        c = self.heads.config
        self._ids = self.heads.target_ids(torch.arange(c.draft_vocab_size, device=self.heads.d2t.device))
        self.heads.product = measured_product(self.heads)

    # ---- states in ----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def target_states(self, request, states: Tensor) -> None:
        row = self._rows.get(request.id)
        if row is None:
            start = self.target.length(request.id) - states.shape[0]
            row = self._rows[request.id] = _Row(self.heads, request, start)
            if start > 0:
                self._reuse(row)
        row.pending.append(self.heads.fuse(states))

    def _reuse(self, row: _Row) -> None:
        """The KV of the reused prefix from a finished request whose tokens start the same way (same salt)."""
        prefix = tuple(row.request.sequence[:row.start + 1])  # a pair's KV depends on the token after it
        for key, (k, v) in reversed(self._kept.items()):
            salt, tokens = key
            if salt == row.request.cache_salt and k.shape[0] >= row.start and tokens[:row.start + 1] == prefix:
                row.room(row.start)
                row.k[:row.start], row.v[:row.start] = k[:row.start], v[:row.start]
                row.start = 0
                self._kept.move_to_end(key)
                return

    # ---- drafting -----------------------------------------------------------------------------------------------

    def limit(self, batch: StepBatch, row: int, k: int) -> int:
        """Drafts only where the states reach the last token emitted (a row's first step after a prompt fully
        reused from the cache runs plain and brings them)."""
        request = batch.requests[row]
        state = self._rows.get(request.id)
        if state is None:
            return 0
        seen = state.length + state.waiting()
        return k if state.start < seen == len(request.sequence) - 1 else 0

    @torch.inference_mode()
    def propose(self, batch: StepBatch, rows: list[int]) -> None:
        if self.tree:
            for row in rows:
                start = time.perf_counter()
                tokens, tree = self._tree_draft(self._rows[batch.requests[row].id], batch.k[row])
                batch.put(row, tokens, None, self.method, tree)
                self.record(1, (time.perf_counter() - start) / max(batch.k[row], 1))
            return
        tokens: dict[int, list[int]] = {row: [] for row in rows}
        probs: dict[int, list[Tensor]] = {row: [] for row in rows}
        hidden: dict[int, Tensor] = {}
        for position in range(max(batch.k[row] for row in rows)):
            start = time.perf_counter()
            active = [row for row in rows if position < batch.k[row]]
            for row in active:
                request = batch.requests[row]
                state = self._rows[request.id]
                if position == 0:
                    prenorm, logits = self._catch_up(state)
                else:
                    prenorm, logits = self._chain_step(state, position, tokens[row][-1], hidden[row])
                hidden[row] = prenorm
                token, dist = self._pick(request, logits, tokens[row])
                tokens[row].append(token)
                if dist is not None:
                    probs[row].append(dist)
            self.record(len(active), time.perf_counter() - start)
        for row in rows:
            batch.put(row, tokens[row], torch.cat(probs[row]) if probs[row] else None, self.method)

    def _catch_up(self, row: _Row) -> tuple[Tensor, Tensor]:
        """Run the pairs not yet seen; returns the last pair's (prenorm, logits)."""
        if row.pending:
            hidden = torch.cat(row.pending)
            count = hidden.shape[0]
            end = row.length + count
            sequence = row.request.sequence
            tokens = torch.tensor(sequence[row.length + 1:end + 1], device=hidden.device)
            positions = torch.arange(row.length, end, device=hidden.device)
            projected = self.heads.project(tokens, hidden, positions)
            row.room(end)
            row.k[row.length:end], row.v[row.length:end] = projected.k, projected.v
            span = torch.arange(row.start, end, device=hidden.device)
            mask = span[None, :] <= positions[:, None]
            out = attend(projected.q, row.k[row.start:end], row.v[row.start:end], mask, self.heads.scaling)
            normed, prenorm = self.heads.finish(out, projected.residual)
            row.last = (prenorm[-1], self.heads.logits(normed[-1]))
            row.length, row.pending = end, []
        return row.last

    def _chain_step(self, row: _Row, step: int, token: int, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Draft step ``step`` (>= 1) after the last pair: its keys sit past ``length`` until the next catch-up
        overwrites them."""
        at = row.length - 1 + step
        projected = self.heads.project(torch.tensor([token], device=hidden.device), hidden[None],
                                       torch.tensor([at], device=hidden.device))
        row.room(at + 1)
        row.k[row.length + step - 1], row.v[row.length + step - 1] = projected.k[0], projected.v[0]
        end = row.length + step
        out = attend(projected.q, row.k[row.start:end], row.v[row.start:end], None, self.heads.scaling)
        normed, prenorm = self.heads.finish(out, projected.residual)
        return prenorm[0], self.heads.logits(normed[0])

    def _tree_draft(self, row: _Row, k: int) -> tuple[list[int], TokenTree | None]:
        """The K likeliest candidates of a depth-wise expansion (module docstring) as (tokens in node order, tree);
        a chain of one token when k is 1."""
        prenorm, logits = self._catch_up(row)
        width = min(k, TREE_WIDTH)
        tokens, parents, scores = [], [], []
        hidden = {-1: prenorm}  # candidate -> its output (the root's: the last pair's)
        keys, values, ancestry = [], [], {}  # the run candidates' KV; candidate -> the KV slots it attends to
        frontier = self._children(-1, logits[None], width, tokens, parents, scores)
        cached = row.k[row.start:row.length], row.v[row.start:row.length]
        device = prenorm.device
        for depth in range(1, k):
            projected = self.heads.project(torch.tensor([tokens[c] for c in frontier], device=device),
                                           torch.stack([hidden[parents[c]] for c in frontier]),
                                           torch.full((len(frontier),), row.length - 1 + depth, device=device))
            for i, c in enumerate(frontier):
                ancestry[c] = ancestry.get(parents[c], []) + [len(keys) + i]
            keys.extend(projected.k)
            values.extend(projected.v)
            mask = torch.zeros(len(frontier), cached[0].shape[0] + len(keys), dtype=torch.bool, device=device)
            mask[:, :cached[0].shape[0]] = True
            for i, c in enumerate(frontier):
                mask[i, [cached[0].shape[0] + slot for slot in ancestry[c]]] = True
            out = attend(projected.q, torch.cat([cached[0], torch.stack(keys)]),
                         torch.cat([cached[1], torch.stack(values)]), mask, self.heads.scaling)
            normed, outputs = self.heads.finish(out, projected.residual)
            hidden.update(zip(frontier, outputs))
            step_logits = self.heads.logits(normed)
            grown = [child for i, c in enumerate(frontier)
                     for child in self._children(c, step_logits[i:i + 1], width, tokens, parents, scores)]
            frontier = sorted(grown, key=lambda c: -scores[c])[:width]
        depth_of = [0] * len(tokens)
        for c, parent in enumerate(parents):
            depth_of[c] = depth_of[parent] + 1 if parent >= 0 else 1
        # Parents before children (a child's score never exceeds its parent's; ties go to the shallower one).
        chosen = sorted(sorted(range(len(tokens)), key=lambda c: (-scores[c], depth_of[c]))[:k],
                        key=lambda c: (depth_of[c], -scores[c]))
        index = {c: i for i, c in enumerate(chosen)}
        tree, order = TokenTree.from_parents([index[parents[c]] if parents[c] >= 0 else -1 for c in chosen])
        return [tokens[chosen[i]] for i in order], tree

    def _children(self, parent: int, logits: Tensor, width: int, tokens: list, parents: list, scores: list) -> list:
        """Add ``parent``'s ``width`` likeliest children to the candidates; returns their indices."""
        top = torch.log_softmax(logits[0].float(), -1).topk(width)
        base = scores[parent] if parent >= 0 else 0.0
        first = len(tokens)
        for value, index in zip(top.values.tolist(), top.indices.tolist()):
            tokens.append(int(self._ids[index]))
            parents.append(parent)
            scores.append(base + value)
        return list(range(first, len(tokens)))

    def _pick(self, request, logits: Tensor, chain: list[int] | None = None) -> tuple[int, Tensor | None]:
        """The draft token (a target id) and, for a sampled row, the [1, V] distribution it was drawn from. In a
        chain (``chain``: the tokens drafted before it this step) the request's penalties, bias and grammar apply
        as the verify applies them; a tree's candidates are ranked unadjusted (the verify still adjusts)."""
        adjusting = chain is not None and adjusts(request)
        if request.params.greedy and not adjusting:
            return int(self._ids[int(logits.argmax())]), None
        full = logits.new_full((self.heads.config.vocab_size,), float("-inf"))
        full[self._ids] = logits
        full = full[None, :self.vocab_size]  # [1, V]
        if adjusting:
            candidate = adjusted(request, full, [chain])
            # The heads' vocabulary may hold no token the grammar allows here: then draft unadjusted (the verify
            # rejects it), still from the distribution reported.
            full = candidate if bool(torch.isfinite(candidate).any()) else full
            if request.params.greedy:
                return int(full.argmax()), None
        dist = logits_to_probs(full, request.params)
        return int(sample(dist, request.generator)), dist

    @torch.inference_mode()
    def calibrate(self, record, max_rows: int, context: int = 64, repeats: int = 3) -> None:
        """One chained step over a ``context``-position KV, timed (best of ``repeats``); rows draft one after
        another, so b rows cost b steps."""
        c = self.heads.config
        row = _Row(self.heads, None, 0)
        row.room(context + 1)
        row.k[:context], row.v[:context] = torch.zeros_like(row.k[:context]), torch.zeros_like(row.v[:context])
        row.length = context
        hidden = self.heads.fc.weight.new_zeros(c.hidden_size)
        best = float("inf")
        for _ in range(repeats + 1):  # the first warms up
            start = time.perf_counter()
            self._chain_step(row, 1, 0, hidden)
            best = min(best, time.perf_counter() - start)
        for rows in sorted({1, 2, 4, 8, 16, 32, max_rows} & set(range(1, max_rows + 1))):
            record(rows, rows * best)

    def release(self, request_id: int) -> None:
        row = self._rows.pop(request_id, None)
        if row is None or row.start != 0 or row.length == 0:
            return
        key = (row.request.cache_salt, tuple(row.request.sequence[:row.length + 1]))
        self._kept[key] = (row.k[:row.length].clone(), row.v[:row.length].clone())
        self._kept.move_to_end(key)
        while len(self._kept) > MAX_KEPT:
            self._kept.popitem(last=False)
