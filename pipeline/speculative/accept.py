"""Accept rules: which of the draft's K proposed tokens the target keeps, and which token it adds.

Terms, used throughout:
  draft tokens   the K tokens the draft proposed for one sequence, in order;
  accepted       the longest prefix of draft tokens the target keeps (``num_accepted`` of them, 0..K);
  recovered      the token the target emits in place of the first rejected draft token;
  bonus          the token the target emits after all K were accepted (from its distribution at position K+1).
  output = accepted + one recovered or bonus token, so every target step emits num_accepted + 1 tokens.

Output layout (all functions): ``output_tokens [B, K+1]`` holds the emitted tokens left-aligned and -1 after the
recovered/bonus token; ``num_accepted [B]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .sampling import sample_inverse_cdf

PAD = -1


def _assemble(draft_tokens: Tensor, num_accepted: Tensor, extra: Tensor) -> Tensor:
    """Accepted draft prefix, then ``extra`` at position num_accepted, then PAD."""
    batch, k = draft_tokens.shape
    positions = torch.arange(k + 1, device=draft_tokens.device)  # [K+1]
    padded = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), PAD)], dim=1)  # [B, K+1]
    output = torch.where(positions[None, :] < num_accepted[:, None], padded, PAD)
    return output.scatter(1, num_accepted[:, None], extra[:, None])


def _check_draft_tokens(draft_tokens: Tensor, vocab: int | None, num_draft: Tensor | None = None) -> Tensor:
    """Refuse a draft id outside [0, vocab) (only negatives when ``vocab`` is None) that is not padding; returns
    the padding mask [B, K]. draft_tokens: [B, K] long; num_draft: [B] long or None.

    Padding is what follows a row's real draft tokens: with ``num_draft``, positions >= num_draft[r], whatever they
    hold; without it, the PAD run that ends the row (a PAD with a real token after it would break the
    left-aligned output). One check over the batch, so a caller's bug surfaces here instead of as emitted ids."""
    k = draft_tokens.shape[1]
    if num_draft is None:
        padding = (draft_tokens == PAD).flip(1).long().cumprod(1).flip(1).bool()  # [B, K] trailing PAD run
    else:
        padding = torch.arange(k, device=draft_tokens.device)[None, :] >= num_draft.to(draft_tokens.device)[:, None]
    valid = draft_tokens >= 0 if vocab is None else (draft_tokens >= 0) & (draft_tokens < vocab)  # [B, K]
    bad = ~(valid | padding)  # [B, K]
    if bool(bad.any()):
        row, position = (int(i) for i in bad.nonzero()[0])
        allowed = "a token id >= 0" if vocab is None else f"a token id in [0, {vocab})"
        raise ValueError(f"draft_tokens[{row}, {position}]: {int(draft_tokens[row, position])} is not {allowed} "
                         f"nor padding ({PAD} only after the row's real draft tokens); pass the row's draft tokens "
                         f"left-aligned, {PAD} after them")
    return padding


def _prefix_length(keep: Tensor) -> Tensor:
    """Length of the leading run of True per row. keep: [B, K] bool -> [B] long."""
    return keep.long().cumprod(dim=1).sum(dim=1)


def accept_matching(draft_tokens: Tensor, target_tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Keep draft tokens while they equal the target's own tokens; then emit the target's token.

    draft_tokens: [B, K] long; target_tokens: [B, K+1] long, the target's choice at each position given the
    draft prefix before it (argmax for greedy, a sample from the target distribution otherwise: both lossless).
    """
    _check_draft_tokens(draft_tokens, None)
    k = draft_tokens.shape[1]
    num_accepted = _prefix_length(draft_tokens == target_tokens[:, :k])  # [B]
    extra = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)  # [B]
    return _assemble(draft_tokens, num_accepted, extra), num_accepted


def accept_greedy(draft_tokens: Tensor, target_logits: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy verification: output is exactly what target-only greedy decoding would produce.

    draft_tokens: [B, K] long; target_logits: [B, K+1, V].
    """
    _check_draft_tokens(draft_tokens, target_logits.shape[-1])
    return accept_matching(draft_tokens, target_logits.argmax(dim=-1))


def accept_rejection(draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor,
                     generator: torch.Generator | None = None, *, num_draft: Tensor | None = None,
                     uniforms: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Modified rejection sampling (Leviathan et al. 2023; Chen et al. 2023): emitted tokens follow the target.

    draft_tokens: [B, K] long, sampled from draft_probs (PAD after a row's ``num_draft``);
    draft_probs:  [B, K, V], the draft distribution each draft token was sampled from;
    target_probs: [B, K+1, V], the target distribution at each draft position plus one (for the bonus token);
    num_draft:    [B] long, draft tokens per row (default: each row's tokens before its trailing PAD);
    uniforms:     [B, K+1] in [0, 1): row r's randomness, drawn by the caller from the row's own stream: columns
                  0..num_draft[r]-1 judge its draft tokens, column num_draft[r] draws its recovered or bonus token
                  (default: drawn here from ``generator``). Rows of one batch never share a draw.

    Draft token x at position i is kept with probability min(1, target(x) / draft(x)); a draft probability of 0
    counts as a rejection. At the first rejection the recovered token is drawn from
    normalize(max(0, target - draft)); when all of a row's draft tokens are kept its bonus token is drawn from
    the target at the next position.
    """
    batch, k = draft_tokens.shape
    device = draft_probs.device
    draft_tokens = draft_tokens.to(device)
    num_draft = num_draft.to(device) if num_draft is not None else None
    drafted = ~_check_draft_tokens(draft_tokens, target_probs.shape[-1], num_draft)  # [B, K]
    if num_draft is None:
        num_draft = drafted.long().sum(dim=1)  # [B]: the draft tokens before each row's trailing PAD
    if uniforms is None:
        uniforms = torch.rand(batch, k + 1, generator=generator, device=device, dtype=draft_probs.dtype)
    uniforms = uniforms.to(device)
    index = draft_tokens.masked_fill(~drafted, 0).unsqueeze(-1)  # [B, K, 1]; padding columns are masked by drafted
    draft_p = draft_probs.gather(-1, index).squeeze(-1)  # [B, K]
    target_p = target_probs[:, :k].gather(-1, index).squeeze(-1)  # [B, K]
    # u < target/draft written without the division, so draft_p == 0 (rejected) and draft == target never NaN.
    keep = drafted & (draft_p > 0) & (uniforms[:, :k] * draft_p < target_p)  # [B, K]
    num_accepted = _prefix_length(keep)  # [B]

    rows = torch.arange(batch, device=device)
    target_at = target_probs[rows, num_accepted]  # [B, V]
    # At a rejection the draft's distribution there is subtracted; a bonus position (all of the row's draft tokens
    # kept) has none, so its residual is the target itself.
    rejected = (num_accepted < num_draft)[:, None]  # [B, 1]
    draft_at = draft_probs[rows, num_accepted.clamp_max(k - 1)] * rejected if k else torch.zeros_like(target_at)
    residual = (target_at - draft_at).clamp_min(0)  # [B, V]
    mass = residual.sum(dim=-1, keepdim=True)  # [B, 1]
    # A zero residual only arises when the rejected token had draft probability 0 and the rest matched: the target
    # distribution is then the right one to draw from.
    final = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(residual.dtype).tiny), target_at)
    extra = sample_inverse_cdf(final, uniforms[rows, num_draft])  # [B]
    return _assemble(draft_tokens, num_accepted, extra), num_accepted
