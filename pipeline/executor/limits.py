"""The checks every request passes before any forward pass, shared by both executors."""

from __future__ import annotations

from .results import RequestError


def check_request(prompt_ids: list[int], max_new_tokens: int, k: int, *, has_draft: bool,
                  draft_len_limit: int | None, max_input_len: int | None, max_seq_len: int | None,
                  vocab_size: int | None = None) -> None:
    """Raise RequestError naming the value and the fix when a request cannot be served by these engines."""
    if not prompt_ids:
        raise RequestError("prompt: empty; give at least one token")
    if max_new_tokens < 0:
        raise RequestError(f"max_new_tokens: {max_new_tokens} must be >= 0")
    if k < 0:
        raise RequestError(f"max_draft_len: {k} must be >= 0 (0 = target-only decoding)")
    if k > 0 and not has_draft:
        raise RequestError("max_draft_len: this executor has no draft model; use 0")
    if draft_len_limit is not None and k > draft_len_limit:
        raise RequestError(f"max_draft_len: {k} is larger than the {draft_len_limit} the target engine was "
                           f"built for; lower it or rebuild with speculative.max_draft_len: {k}")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt_ids):
        raise RequestError(f"prompt: token ids must be in [0, {vocab_size})")
    if max_input_len is not None and len(prompt_ids) > max_input_len:
        raise RequestError(f"prompt: {len(prompt_ids)} tokens exceeds max_input_len {max_input_len}; "
                           f"shorten it or rebuild with a larger build.max_input_len")
    if max_seq_len is not None and len(prompt_ids) + max_new_tokens > max_seq_len:
        raise RequestError(f"max_new_tokens: {len(prompt_ids)} prompt + {max_new_tokens} new tokens exceeds "
                           f"max_seq_len {max_seq_len}; ask for at most "
                           f"{max(max_seq_len - len(prompt_ids), 0)} new tokens")
