"""Paged KV memory for the batching engine: per layer a pool of fixed-size blocks, per sequence a block table.

The blocks' bookkeeping (tables, reference counts, prefix hashes, eviction) is the BlockPool's; this class owns the
tensors: each layer keeps keys and values as ``[blocks, block_size, kv_heads, head_dim]``, grown with the pool. A
forward appends ``counts[i]`` tokens to sequence ``seqs[i]``; :meth:`prepare` reserves their blocks and lays out
the packed forward (positions, where each new token's KV goes, the attention groups). Rolling back rejected draft
tokens lowers a sequence's length and trims the blocks past it; a sequence that leaves releases its blocks, with no
copies: nobody's KV moves when a neighbour finishes.

A proposer that keeps KV of its own (the draft model) keeps it in a companion cache (:meth:`PagedKVCache.companion`):
its own layers' pools and its own lengths, but the target's block pool and block tables, so position p of a request
is in the same block for both and one memory limit (and one admission decision) covers both. The target's cache
owns the tables: it opens, trims, keys and releases the blocks, and the companion only follows. A reused prompt
prefix has the target's KV; the companion's KV in those blocks is valid only where the companion itself wrote it
since the block was last handed out (it records the block's generation when it commits), so a companion reuses the
leading blocks it filled and computes the rest.

It plugs into any Hugging Face model through the ``Cache.update`` call of every attention layer, together with
the attention implementation in paged_attention.py that reads the pools through the plan.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import Cache

from .attention_choice import AttentionPlan, mask_dtype
from .block_pool import BlockPool
from .paged_attention import AttentionGroup, ForwardPlan

SHORT_ROW = 16  # rows with at most this many new tokens attend as one padded group; longer ones (chunks) alone


class _PagedLayer:
    """One attention layer's block pools; made on first use (head count, dim and dtype come from the model)."""

    def __init__(self, owner: PagedKVCache):
        self.owner = owner
        self.keys: Tensor | None = None  # [blocks, block_size, kv_heads, head_dim]
        self.values: Tensor | None = None

    def update(self, key_states: Tensor, value_states: Tensor) -> tuple[Tensor, Tensor]:
        """key_states/value_states: [1, kv_heads, T, head_dim], the packed forward's new tokens."""
        owner = self.owner
        self.ready(key_states.shape[1], key_states.shape[3], key_states.dtype, key_states.device)
        slots = owner.write_slots  # [T] flat position of each new token in the pool
        # index_copy_ rather than item assignment: the same write, without indexing's argument parsing (it runs
        # twice per layer per step)
        self.keys.view(-1, *self.keys.shape[2:]).index_copy_(0, slots, key_states[0].transpose(0, 1))
        self.values.view(-1, *self.values.shape[2:]).index_copy_(0, slots, value_states[0].transpose(0, 1))
        return self.keys, self.values

    def ready(self, kv_heads: int, dim: int, dtype: torch.dtype, device) -> tuple[Tensor, Tensor]:
        """The pools [blocks, block_size, kv_heads, dim], grown to hold every block the pool has handed out."""
        if self.keys is None or self.keys.shape[0] < self.owner.pool.capacity:
            self._grow(kv_heads, dim, dtype, device)
        return self.keys, self.values

    def _grow(self, kv_heads: int, dim: int, dtype: torch.dtype, device) -> None:
        pool = self.owner.pool
        old = 0 if self.keys is None else self.keys.shape[0]
        # Doubling keeps growth copies rare; the pool's limit bounds the memory. Preallocated, the pools never move
        # (what a captured graph needs), at the price of holding the whole limit from the first forward.
        blocks = pool.max_blocks if self.owner.preallocate else min(pool.max_blocks, max(pool.capacity, 2 * old, 8))
        shape = (blocks, pool.block_size, kv_heads, dim)
        keys = torch.zeros(shape, dtype=dtype, device=device)
        values = torch.zeros(shape, dtype=dtype, device=device)
        if old:
            keys[:old], values[:old] = self.keys, self.values
        self.keys, self.values = keys, values

    def copy(self, src: Tensor, dst: Tensor) -> None:
        """Pool positions ``src`` [n] to ``dst`` [n] (gathered first: the ranges may overlap)."""
        if self.keys is not None:
            for pool in (self.keys, self.values):
                flat = pool.view(-1, *pool.shape[2:])
                flat[dst] = flat[src]


class PagedKVCache(Cache):
    """KV for the sequences the engine runs, in ``block_size``-token blocks, at most ``max_blocks`` of them."""

    def __init__(self, block_size: int, max_blocks: int, max_len: int, reuse: bool = True,
                 preallocate: bool = False, pool: BlockPool | None = None):
        """``preallocate``: each layer's pools hold ``max_blocks`` from the first forward on (else they grow);
        ``pool``: another cache's block pool to follow (see companion; block_size, max_blocks and reuse are then
        the pool's)."""
        super().__init__(layers=[])
        self.preallocate = preallocate
        self.owns_tables = pool is None
        self.pool = pool if pool is not None else BlockPool(block_size, max_blocks, reuse)
        self.max_len = max_len  # positions one sequence may hold
        self.lengths: dict[object, int] = {}  # sequence -> tokens whose KV is in its blocks
        self.write_slots: Tensor | None = None  # set by prepare() for the forward about to run: [T]
        self.filled: dict[int, int] = {}  # companion: block -> its generation when this cache's KV in it was final
        # The attention kernel per query width (set by the runner from attention_choice for its model's heads)
        self.attention = AttentionPlan()

    def companion(self, preallocate: bool = False) -> PagedKVCache:
        """A cache for another model's KV (a draft's, with its own layer shapes) in this cache's blocks: it opens a
        sequence only after this one has, and leaves the blocks to this cache."""
        return PagedKVCache(self.pool.block_size, self.pool.max_blocks, self.max_len, preallocate=preallocate,
                            pool=self.pool)

    # ---- the Hugging Face Cache surface models use -----------------------------------------------------------

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        return self._layer(layer_idx).update(key_states, value_states)

    def pools(self, layer_idx: int, kv_heads: int, dim: int, dtype: torch.dtype, device) -> tuple[Tensor, Tensor]:
        """Layer ``layer_idx``'s key and value pools, ready for this forward's writes, for a kernel that writes
        them itself at ``write_slots`` (row_kernels.rope_write_attend)."""
        return self._layer(layer_idx).ready(kv_heads, dim, dtype, device)

    def _layer(self, layer_idx: int) -> _PagedLayer:
        while len(self.layers) <= layer_idx:
            self.layers.append(_PagedLayer(self))
        return self.layers[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths.values(), default=0)

    # ---- sequences ----------------------------------------------------------------------------------------------

    def open(self, seq, prompt: list[int], cache_salt: str | None = None) -> int:
        """Start a sequence that will hold ``prompt``; returns how many of its leading tokens already have KV (from
        blocks cached under the same ``cache_salt``)."""
        if not self.owns_tables:
            return self._open_companion(seq)
        reused = self.pool.open(seq, prompt, cache_salt)
        self.lengths[seq] = reused
        return reused

    def _open_companion(self, seq) -> int:
        """The leading blocks of the (already opened) sequence whose KV this cache wrote and that no one has been
        handed since; their positions need no forward."""
        if seq not in self.pool.tables:
            raise ValueError(f"KV cache: sequence {seq!r} is not open in the cache this one follows; open it there "
                             f"first")
        reusable = 0
        for block in self.pool.tables[seq][:self.pool.committed_blocks(seq)]:  # the blocks its prompt found keyed
            if self.filled.get(block) != self.pool.generation[block]:
                break
            reusable += 1
        self.lengths[seq] = reusable * self.pool.block_size
        return self.lengths[seq]

    def length(self, seq) -> int:
        return self.lengths[seq]

    def truncate(self, seq, length: int) -> None:
        """Forget positions from ``length`` on (rejected draft tokens); blocks wholly past it are released."""
        self.lengths[seq] = min(self.lengths[seq], length)
        if self.owns_tables:
            self.pool.trim(seq, self.lengths[seq])

    def commit(self, seq, tokens: list[int]) -> None:
        """``tokens`` are final at positions [0, len(tokens)): their full blocks become reusable prefixes."""
        if self.owns_tables:
            self.pool.commit(seq, tokens[:self.lengths[seq]])
            return
        table, pool = self.pool.tables[seq], self.pool
        for block in table[:min(len(tokens), self.lengths[seq]) // pool.block_size]:
            self.filled[block] = pool.generation[block]

    def close(self, seq) -> None:
        if self.owns_tables:
            self.pool.close(seq)
        del self.lengths[seq]

    @torch.inference_mode()  # the pools were made in inference mode; only there may they be modified
    def keep_path(self, seq, root: int, nodes: list[int]) -> None:
        """After a tree verify: the KV of tree nodes ``nodes`` (an accepted path, node indices from the root at
        position ``root``) moves to the positions right after the root, where the path's tokens now belong; the
        caller then truncates the rest."""
        if nodes:
            src = self._slots(seq, [root + node for node in nodes])
            dst = self._slots(seq, list(range(root + 1, root + 1 + len(nodes))))
            for layer in self.layers:
                layer.copy(src, dst)

    def _slots(self, seq, positions: list[int]) -> Tensor:
        table, size = self.pool.tables[seq], self.pool.block_size
        return torch.tensor([table[p // size] * size + p % size for p in positions], dtype=torch.long)

    # ---- one forward --------------------------------------------------------------------------------------------

    def prepare(self, seqs: list, counts: list[int], device, dtype, trees: list | None = None
                ) -> tuple[Tensor, ForwardPlan]:
        """Get ``seqs[i]`` ready to take ``counts[i]`` new tokens each, packed in that order. ``trees[i]`` (a
        speculative.tree.TokenTree, or None for a chain): row i's last ``tree.size`` tokens are that tree's nodes,
        root first; node j then sits at position root + depth(j) and attends to what precedes the root and to its
        own ancestors (the tree mask), so each candidate sees exactly its own path.

        Returns (position_ids [1, T], the attention plan); sets the pool slots the new tokens' KV goes to.
        """
        trees = trees or [None] * len(seqs)
        size = self.pool.block_size
        starts = [self.lengths[seq] for seq in seqs]
        for seq, start, count in zip(seqs, starts, counts):
            if start + count > self.max_len:
                raise ValueError(f"KV cache: a sequence would exceed its {self.max_len} positions")
            self.pool.reserve(seq, start + count)
        if len(seqs) == 1 and trees[0] is None and 0 < counts[0] <= SHORT_ROW:
            return self._one_short_row(seqs[0], starts[0], counts[0], device, dtype)
        # The step's metadata as tensors, per packed token without a loop over tokens: its row, its cache position
        # (where its KV goes), its slot in the pool through the row's block table.
        lists = [self.pool.tables[seq] for seq in seqs]
        width = max(map(len, lists), default=0)
        tables = torch.tensor([table + [0] * (width - len(table)) for table in lists],
                              dtype=torch.long).view(len(lists), width)  # [n, B]
        counts_t, starts_t = torch.tensor(counts, dtype=torch.long), torch.tensor(starts, dtype=torch.long)
        firsts = torch.cumsum(counts_t, 0) - counts_t  # [n] packed index of each row's first new token
        row = torch.repeat_interleave(torch.arange(len(seqs)), counts_t)  # [T]
        cache_pos = starts_t[row] + torch.arange(row.shape[0]) - firsts[row]  # [T]
        self.write_slots = (tables[row, cache_pos // size] * size + cache_pos % size).to(device)
        positions = cache_pos.clone()  # the rotary position: a tree node's is root + its depth, not its slot
        for n, (start, count, tree) in enumerate(zip(starts, counts, trees)):
            if tree is not None:
                root = count - tree.size
                node = int(firsts[n]) + root
                positions[node:node + tree.size] = start + root + tree.depth
        groups, short = [], [n for n, count in enumerate(counts) if 0 < count <= SHORT_ROW]
        for n, count in enumerate(counts):
            if count > SHORT_ROW:
                groups.append(self._group(tables, starts_t, counts_t, firsts, trees, [n], device, dtype))
        if short:
            groups.insert(0, self._group(tables, starts_t, counts_t, firsts, trees, short, device, dtype))
        return positions[None].to(device), ForwardPlan(groups, int(row.shape[0]))

    def _one_short_row(self, seq, start: int, count: int, device, dtype) -> tuple[Tensor, ForwardPlan]:
        """prepare for the commonest step, one row of at most SHORT_ROW new tokens and no tree (every decode and
        verify at batch 1): the same tensors as the general path (a test compares them) from the row's numbers,
        with a handful of tensor operations where the general path takes about forty (0.3 ms, an eighth of a small
        model's step)."""
        size, table = self.pool.block_size, self.pool.tables[seq]
        self.write_slots = torch.tensor([table[p // size] * size + p % size for p in range(start, start + count)],
                                        dtype=torch.long).to(device)
        blocks = -(-(start + count) // size)
        kernel = self.attention.kind(count)
        masking = mask_dtype(kernel, dtype)
        # query i sees the cached positions up to its own, start + i; "never" above that diagonal
        mask = torch.full((count, blocks * size), torch.finfo(masking).min, dtype=masking).triu_(start + 1)
        index = torch.arange(count).to(device)
        group = AttentionGroup(index[None], index, index, torch.tensor([table[:blocks]], dtype=torch.long).to(device),
                               mask[None, None].to(device), True, kernel)
        return torch.arange(start, start + count)[None].to(device), ForwardPlan([group], count)

    def _group(self, tables: Tensor, starts: Tensor, counts: Tensor, firsts: Tensor, trees: list,
               members: list[int], device, dtype) -> AttentionGroup:
        """The attention inputs of the rows ``members`` (indices into the step's rows); ``tables`` [rows, B] their
        block tables padded with block 0, ``starts``/``counts``/``firsts`` [rows] their cached lengths, new tokens
        and packed offsets."""
        size = self.pool.block_size
        index = torch.tensor(members, dtype=torch.long)
        counts_m, starts_m, offsets = counts[index], starts[index], firsts[index]  # [n]
        width = int(counts_m.max())
        blocks = -(-int((starts_m + counts_m).max()) // size)  # what the longest member attends over
        table = tables[index, :blocks]  # [n, blocks]: past a row's own blocks, block 0, which the mask hides
        slot = torch.arange(width)  # [W]
        valid = slot[None, :] < counts_m[:, None]  # [n, W]
        last = torch.minimum(slot[None, :], counts_m[:, None] - 1)  # a padding slot repeats the row's last token
        query_index = offsets[:, None] + last  # [n, W]
        keys = torch.arange(blocks * size)  # [L]
        # Query slot i of a row sits at cache index start + i and sees every cached position up to its own; a
        # padding slot sees what the row's last token sees (never an empty row, which would give NaN).
        allowed = keys[None, None, :] <= (starts_m[:, None] + last)[:, :, None]  # [n, W, L]
        for n, row in enumerate(members):
            tree = trees[row]
            if tree is not None:
                root = int(counts[row]) - tree.size
                start = int(starts[row]) + root
                allowed[n, root:root + tree.size, start:start + tree.size] = tree.mask
        kernel = self.attention.kind(width)
        dtype = mask_dtype(kernel, dtype)  # made once per step here, not cast per layer
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        slots = valid.flatten().nonzero().flatten()  # [R]
        dense = bool(valid.all()) and len(members) == counts.shape[0] and \
            bool((offsets == torch.arange(len(members)) * width).all())
        return AttentionGroup(query_index.to(device), slots.to(device), query_index.flatten()[slots].to(device),
                              table.to(device), mask[:, None].to(device), dense, kernel)

    def advance(self, seq, count: int) -> None:
        self.lengths[seq] += count
