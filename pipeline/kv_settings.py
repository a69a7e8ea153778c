"""How the torch engine keeps KV memory and feeds prompts: the settings of its paged cache and of a step."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_BLOCK_SIZE = 64
DEFAULT_STEP_TOKENS = 256


@dataclass(frozen=True)
class KVSettings:
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per KV block
    max_tokens: int | None = None  # KV positions each model's pool may hold; None: every running request at its longest
    prefix_reuse: bool = True  # prompts that start with cached blocks reuse them instead of recomputing
    # Tokens one engine step computes at most: the running rows' verify tokens first, then prompt chunks, so a long
    # prompt is prefilled over several steps while the others keep decoding.
    step_tokens: int = DEFAULT_STEP_TOKENS  # (a prompt still advances at least one block per step)

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: {self.block_size} must be a power of two such as 16, 32 or 64")
        if self.step_tokens < 1:
            raise ValueError(f"step_tokens: {self.step_tokens} must be >= 1")
        if self.max_tokens is not None and self.max_tokens < self.block_size:
            raise ValueError(f"max_tokens: {self.max_tokens} must hold at least one block ({self.block_size})")

    def max_blocks(self, max_batch: int, max_len: int, spare: int) -> int:
        """The pool's limit in blocks: ``max_tokens`` when set, else every running row at ``max_len`` positions
        plus ``spare`` (draft or tree tokens past the end before the verify trims them)."""
        if self.max_tokens is None:
            return max_batch * -(-(max_len + spare) // self.block_size)
        return self.max_tokens // self.block_size
