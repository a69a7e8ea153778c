"""KV memory for a batch of sequences of different lengths: one row (slot) per running request.

Each layer keeps keys and values as ``[slots, kv_heads, capacity, head_dim]``; row ``s`` holds the KV of the first
``lengths[s]`` tokens of the sequence in slot ``s``. A forward covers contiguous rows ``[first, first + rows)`` and writes
each row's new tokens at that row's own positions, so rows advance by different amounts and a rejection is rolled
back by lowering one row's length (stale entries past it are masked, then overwritten). Capacity grows by doubling
up to a limit, so a short request never pays for the longest one the engine allows.

The class plugs into any Hugging Face model through the ``Cache.update`` call every attention layer makes; the
caller passes explicit position ids and a 4D attention mask built by :meth:`attention_mask`.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import Cache


class _SlotLayer:
    """One attention layer's KV buffers; allocated on first use (head count and dim come from the model)."""

    def __init__(self, owner: SlotKVCache):
        self.owner = owner
        self.keys: Tensor | None = None  # [slots, kv_heads, capacity, head_dim]
        self.values: Tensor | None = None

    def update(self, key_states: Tensor, value_states: Tensor) -> tuple[Tensor, Tensor]:
        """key_states/value_states: [rows, kv_heads, T, head_dim] for rows [0, rows) of the current forward."""
        owner = self.owner
        rows, heads, _, dim = key_states.shape
        if self.keys is None or self.keys.shape[2] < owner.capacity:
            self._grow(heads, dim, key_states.dtype, key_states.device)
        lo = owner.first_row
        keys, values = self.keys[lo:lo + rows], self.values[lo:lo + rows]  # views: writes land in the buffers
        if owner.write_index is None:  # every row writes the same positions: one slice copy
            start, end = owner.write_span
            keys[:, :, start:end] = key_states
            values[:, :, start:end] = value_states
        else:
            index = owner.write_index[:, None, :, None].expand(rows, heads, -1, dim)  # [rows, heads, T, dim]
            keys.scatter_(2, index, key_states)
            values.scatter_(2, index, value_states)
        return keys[:, :, :owner.kv_len], values[:, :, :owner.kv_len]

    def _grow(self, heads: int, dim: int, dtype, device) -> None:
        shape = (self.owner.slots, heads, self.owner.capacity, dim)
        keys, values = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
        if self.keys is not None:
            old = self.keys.shape[2]
            keys[:, :, :old] = self.keys
            values[:, :, :old] = self.values
        self.keys, self.values = keys, values

    def keep(self, row: int, dst: int, src: Tensor) -> None:
        """Copy positions ``src`` [n] of ``row`` to ``dst .. dst + n - 1`` (a gather first: the ranges may overlap)."""
        if self.keys is not None:
            index = src.to(self.keys.device)
            self.keys[row, :, dst:dst + len(src)] = self.keys[row, :, index]
            self.values[row, :, dst:dst + len(src)] = self.values[row, :, index]

    def move(self, src: int, dst: int, length: int) -> None:
        if self.keys is not None:
            self.keys[dst, :, :length] = self.keys[src, :, :length]
            self.values[dst, :, :length] = self.values[src, :, :length]


class SlotKVCache(Cache):
    """Per-row KV cache for ``slots`` sequences of up to ``max_tokens`` tokens each."""

    def __init__(self, slots: int, max_tokens: int, initial: int = 256):
        super().__init__(layers=[])
        self.slots = slots
        self.max_len = max_tokens + 1  # + one scratch position for padding
        self.capacity = min(self.max_len, initial)
        self.lengths = [0] * slots  # tokens cached per row (Python ints: no device sync to read them)
        # Set by prepare() for the forward about to run:
        self.first_row = 0  # the forward covers rows [first_row, first_row + rows)
        self.write_index: Tensor | None = None  # [rows, T] cache position of each new token, or None when
        self.write_span = (0, 0)  # every row writes the same positions [start, end)
        self.kv_len = 0  # key/value positions the forward attends over

    # ---- the Hugging Face Cache surface models use -----------------------------------------------------------

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(_SlotLayer(self))
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths) if self.lengths else 0

    # ---- bookkeeping ----------------------------------------------------------------------------------------

    def prepare(self, counts: list[int], width: int, device, dtype, first_row: int = 0,
                trees: list | None = None) -> tuple[Tensor, Tensor]:
        """Get rows [first_row, first_row + len(counts)) ready to take ``counts[i]`` new tokens each, padded to
        ``width``. ``trees[i]`` (a speculative.tree.TokenTree, or None for a chain): row i's last ``tree.size``
        tokens are that tree's nodes, root first; node j then sits at position root + depth(j) and attends to what
        precedes the root and to its own ancestors (the tree mask), so each candidate sees exactly its own path.

        Returns (position_ids [rows, width], additive attention mask [rows, 1, width, kv_len] in ``dtype``: 0 where
        a token may attend, the dtype's minimum elsewhere; additive works with eager and SDPA attention alike).
        Padding tokens are written past their row's length (harmless: never attended, later overwritten) and get
        the row's last real position, so learned position embeddings never see an out-of-range index.
        """
        rows = len(counts)
        lengths = self.lengths[first_row:first_row + rows]
        if any(start + count >= self.max_len for start, count in zip(lengths, counts)):
            raise ValueError(f"KV cache: a row would exceed its {self.max_len - 1} positions")
        need = min(max(lengths) + width, self.max_len)
        while self.capacity < need:
            self.capacity = min(self.max_len, self.capacity * 2)
        self.first_row = first_row
        self.kv_len = need
        blocked = torch.finfo(dtype).min
        trees = trees or [None] * rows
        if len(set(lengths)) == 1 and all(count == width for count in counts) and not any(trees):
            # The common shapes (one request; a prefill) need no per-row indexing: a few ops instead of a dozen.
            start = lengths[0]
            self.write_index, self.write_span = None, (start, start + width)
            positions = torch.tensor([list(range(start, start + width))] * rows, device=device)
            mask = torch.zeros((rows, 1, width, need), dtype=dtype, device=device)
            if width > 1:  # causal among the new tokens; everything cached before them is visible
                mask[:, :, :, start:] = torch.full((width, need - start), blocked, dtype=dtype,
                                                   device=device).triu(1)
            return positions, mask
        starts = torch.tensor(lengths, dtype=torch.long)  # [rows]
        offsets = torch.arange(width)  # [width]
        # The last position is scratch space: padding past a full row lands there, never on a real token.
        self.write_index = (starts[:, None] + offsets[None, :]).clamp_max(self.max_len - 1).to(device)
        last = torch.tensor([max(c - 1, 0) for c in counts])  # [rows]
        positions = starts[:, None] + torch.minimum(offsets[None, :], last[:, None])  # [rows, width]
        keys = torch.arange(need)  # [kv_len]
        # Token i of row r sits at starts[r] + i and sees every cached position up to and including its own.
        allowed = keys[None, None, :] <= (starts[:, None, None] + offsets[None, :, None])  # [rows, width, kv_len]
        for row, tree in enumerate(trees):
            if tree is not None:
                root = counts[row] - tree.size  # the root's offset in the row's new tokens
                start = lengths[row] + root
                positions[row, root:root + tree.size] = start + tree.depth
                allowed[row, root:root + tree.size, start:start + tree.size] = tree.mask
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, blocked)
        return positions.to(device), mask[:, None].to(device)

    @torch.inference_mode()
    def keep_path(self, row: int, root: int, nodes: list[int]) -> None:
        """After a tree verify: the KV of tree nodes ``nodes`` (an accepted path, node indices from the root at cache
        position ``root``) moves to the positions right after the root, where the path's tokens now belong; the
        caller then truncates the rest."""
        if nodes:
            src = torch.tensor(nodes, dtype=torch.long) + root
            for layer in self.layers:
                layer.keep(row, root + 1, src)

    def advance(self, row: int, count: int) -> None:
        self.lengths[row] += count

    def truncate(self, row: int, length: int) -> None:
        """Forget positions from ``length`` on in one row (rejected draft tokens)."""
        self.lengths[row] = min(self.lengths[row], length)

    @torch.inference_mode()  # the buffers were made in inference mode; only there may they be modified
    def move(self, src: int, dst: int) -> None:
        """Copy row ``src`` into row ``dst`` (keeps the running rows contiguous when one leaves)."""
        for layer in self.layers:
            layer.move(src, dst, self.lengths[src])
        self.lengths[dst] = self.lengths[src]
        self.lengths[src] = 0

    def clear(self, row: int) -> None:
        self.lengths[row] = 0
