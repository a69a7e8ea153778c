"""Suffix decoding as a proposer: the most frequent continuation of the sequence's latest tokens, looked up in a suffix
tree over the request's own prompt and output and in one over the outputs of recent requests (no model).

The trees are Arctic Inference's (``arctic_inference.suffix_decoding``, the implementation vLLM's ``suffix`` method
runs; built by scripts/install_suffix_tree.sh). Per step and row the tree matches the context's suffixes, follows the
most frequent child from the best match while the product of the count ratios (the draft token's estimated
probability) stays at or above ``min_token_prob``, and drafts at most ``max_spec_factor`` times the match's length:
a long, frequent match drafts far, a weak one little or nothing, which is how it picks its own draft length.

Past outputs are shared only among requests with the same ``cache_salt`` (each salt has its own tree of past
outputs, as prefix reuse is shared only within a salt): drafting is lossless whoever's text a draft comes from, but
a draft's acceptance changes how fast a request finishes, and that must not tell one tenant what another was answered.
A seeded sampled request drafts from its own prompt and output only: which tokens it is offered decides how its
random draws are used, so drafts from other requests' outputs would make its tokens depend on what ran before it,
and a seed must reproduce them. Its output still joins the past outputs when it ends.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ...methods import Method, SuffixSettings
from ...speculative.ngram import one_hot_probs
from ...speculative.tree import TokenTree
from ..request import SpecRequest
from ..step_batch import StepBatch
from .base import Proposer, ProposerContext

# Trees of past outputs kept for different salts: beyond it the least recently used salt without a running request
# loses its tree (a client naming a new salt per request cannot grow memory without bound).
MAX_SALTS = 64

@dataclass
class _Active:
    request: SpecRequest
    cache: object  # the SuffixDecodingCache it drafts from: its salt's, or the one without past outputs
    fed: int  # output tokens the trees have seen


class SuffixTrees:
    """The trees of every running request and of each salt's past outputs; used per request by both executors (the
    torch engine through :class:`SuffixProposer`, the TensorRT-LLM executor as external draft tokens)."""

    def __init__(self, settings: SuffixSettings):
        self.settings = settings
        self._caches: OrderedDict[str | None, object] = OrderedDict()  # salt -> SuffixDecodingCache, LRU first
        self._own_only = None  # the cache of seeded sampled requests: their own trees, no past outputs
        self._active: dict[int, _Active] = {}

    def draft(self, request: SpecRequest, k: int) -> list[int]:
        """Up to ``k`` tokens continuing ``request``'s sequence (possibly none): the likeliest chain."""
        return self.speculate(request, k, tree=False)[0]

    def speculate(self, request: SpecRequest, k: int, tree: bool) -> tuple[list[int], list[int]]:
        """Up to ``k`` candidate tokens and, for each, the candidate before it that it follows (-1: it follows the
        sequence): a chain, or with ``tree`` the likeliest continuations in order of their estimated probability.
        The first call opens the request's tree on its prompt; each call first adds the tokens it emitted since the
        last."""
        active = self._active.get(request.id)
        if active is None:
            cache = self._own_trees() if _reproducible(request) else self._cache(request.cache_salt)
            cache.start_request(request.id, request.prompt_ids)
            active = self._active[request.id] = _Active(request, cache, 0)
        self._feed(active)
        settings = self.settings
        found = active.cache.speculate(request.id, _tail(request, settings.max_tree_depth), max_spec_tokens=k,
                                       max_spec_factor=settings.max_spec_factor,
                                       min_token_prob=settings.min_token_prob, use_tree_spec=tree)
        return [int(token) for token in found.token_ids], [int(parent) for parent in found.parents]

    def release(self, request_id: int) -> None:
        """The request's whole output joins its salt's past outputs; its own tree is dropped."""
        active = self._active.pop(request_id, None)
        if active is None:
            return
        self._feed(active)
        active.cache.stop_request(request_id)
        request = active.request
        if active.cache is self._own_only and self.settings.max_cached_requests:
            past = self._cache(request.cache_salt)
            past.start_request(request_id, request.prompt_ids)
            past.add_active_response(request_id, request.generated)
            past.stop_request(request_id)

    @property
    def running(self) -> int:
        return len(self._active)

    def forget_past_outputs(self) -> None:
        """Drop every salt's past outputs (a running request keeps its own tree and its salt's)."""
        self._drop_idle(0)

    def _feed(self, active: _Active) -> None:
        new = active.request.generated[active.fed:]
        if new:
            active.cache.add_active_response(active.request.id, new)
            active.fed += len(new)

    def _cache(self, salt: str | None):
        cache = self._caches.get(salt)
        if cache is None:
            cache = self._caches[salt] = self._new_cache(self.settings.max_cached_requests)
            self._drop_idle(MAX_SALTS)
        self._caches.move_to_end(salt)
        return cache

    def _own_trees(self):
        if self._own_only is None:
            self._own_only = self._new_cache(0)
        return self._own_only

    def _new_cache(self, cached_requests: int):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        return SuffixDecodingCache(self.settings.max_tree_depth, cached_requests)

    def _drop_idle(self, limit: int) -> None:
        """Drop the least recently used salts' trees that no running request drafts from, down to ``limit``."""
        running = {id(active.cache) for active in self._active.values()}
        for salt in [salt for salt, cache in self._caches.items() if id(cache) not in running]:
            if len(self._caches) <= limit:
                break
            del self._caches[salt]


def _tail(request: SpecRequest, n: int) -> list[int]:
    """The last ``n`` tokens of the request's sequence, without building the whole sequence every step."""
    tail = request.generated[-n:]
    return tail if len(tail) == n else request.prompt_ids[-(n - len(tail)):] + tail


def _reproducible(request: SpecRequest) -> bool:
    """A seeded sampled request: its tokens must depend on nothing but its own prompt, settings and seed."""
    return request.seeded and not request.params.greedy


class SuffixProposer(Proposer):
    method = Method.SUFFIX

    def __init__(self, context: ProposerContext):
        self.trees = SuffixTrees(context.suffix)
        self.vocab_size = context.vocab_size
        self.device = context.device
        self._parents: dict[int, list[int]] = {}  # request id -> its candidates' parents this step (tree mode)

    def limit(self, batch: StepBatch, row: int, k: int) -> int:
        return len(self._draft(batch, row, k))

    def propose(self, batch: StepBatch, rows: list[int]) -> None:
        for row in rows:
            request = batch.requests[row]
            tokens = self._draft(batch, row, batch.k[row])
            parents = self._parents.pop(request.id, None)
            if parents is not None and any(p != i - 1 for i, p in enumerate(parents[:len(tokens)])):
                # A branching draft: its first K candidates (parents come first) as a tree, each a point mass,
                # which the tree rules accept losslessly.
                tree, order = TokenTree.from_parents(parents[:len(tokens)])
                batch.put(row, [tokens[i] for i in order], None, self.method, tree)
                continue
            # Like a lookup, a chain is deterministic: one-hot as a distribution, so rejection sampling keeps the
            # target's distribution exactly.
            probs = None if request.params.greedy else one_hot_probs(tokens, self.vocab_size, self.device)
            batch.put(row, tokens, probs, self.method)

    def release(self, request_id: int) -> None:
        self.trees.release(request_id)
        self._parents.pop(request_id, None)

    def _draft(self, batch: StepBatch, row: int, k: int) -> list[int]:
        """One speculation per row per step, at the first K asked for (the row's own, the largest); later calls take
        its first candidates (a chain's prefix; a tree's likeliest nodes, each after its parent)."""
        found = batch.lookups.get(row)
        if found is None:
            request = batch.requests[row]
            tree = self.trees.settings.tree
            found, parents = self.trees.speculate(request, k, tree)
            batch.lookups[row] = found
            if tree:
                self._parents[request.id] = parents
        return found[:k]
