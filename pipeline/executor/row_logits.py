"""A request's own changes to the logits (penalties, bias, min_tokens, a grammar's mask), and the log-probabilities
it asked for, at the positions one engine step computes for it.

The verify judges a row at several positions at once: a chain's position j follows its draft tokens before j, a
tree's node n follows the candidates on its path. Each position is adjusted with the state those tokens lead to
(pipeline.speculative.penalties; the grammar matcher advanced along them), so the accept rule compares the draft
with exactly the distribution plain decoding would sample from. A proposer that samples its drafts from logits
adjusts them the same way along its own chain, which keeps its proposals likely under the target's adjusted
distribution. Log-probabilities are the target's raw log-softmax (before temperature, penalties and masks, as
vLLM returns them by default) at the positions whose tokens the step emits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..speculative.penalties import adjust_logits
from .results import TokenLogprob
from .step_batch import StepBatch


def adjusts(request) -> bool:
    """Whether ``request`` changes its logits at all."""
    return request.grammar is not None or not request.adjust.neutral


def adjusted(request, logits: Tensor, paths: list[list[int]]) -> Tensor:
    """logits: [P, V], position p's after the request's tokens + ``paths[p]`` -> the request's adjusted logits."""
    out = adjust_logits(logits, request.adjust, request.generated, request.prompt_ids, paths,
                        sorted(request.stop_ids)) if not request.adjust.neutral else logits.float()
    if request.grammar is None:
        return out
    vocab = out.shape[-1]
    if all(len(path) == p and path == paths[-1][:p] for p, path in enumerate(paths)):  # a chain: one walk
        allowed = request.grammar.allowed_along(paths[-1])[:, :vocab]
    else:
        allowed = torch.stack([request.grammar.allowed_along(path)[-1, :vocab] for path in paths])
    allowed = allowed.to(out.device)
    out = out.masked_fill(~allowed, float("-inf"))
    # Where the grammar allows only what min_tokens holds back (the format is complete: only a stop token may
    # follow), the grammar wins: the answer ends instead of the request failing on a distribution with no mass.
    dead = ~torch.isfinite(out).any(-1)  # [P]
    if bool(dead.any()):
        out[dead] = logits.float()[dead].masked_fill(~allowed[dead], float("-inf"))
    return out


def judged(batch: StepBatch, row: int) -> tuple[list[int], list[list[int]]]:
    """Row ``row``'s judged positions in the verify's logits and the tokens each follows (beyond the request's)."""
    first, proposal, tree = int(batch.first_logit[row]), batch.proposals[row], batch.trees[row]
    if tree is None:
        return [first + j for j in range(len(proposal) + 1)], [proposal[:j] for j in range(len(proposal) + 1)]
    return ([first + node for node in range(tree.size)],
            [[proposal[m - 1] for m in tree.path_to(node)] for node in range(tree.size)])


def adjust_verify(batch: StepBatch, logits: Tensor) -> Tensor:
    """logits: [rows, width, V] the verify's -> the same with every adjusting row's judged positions adjusted (a
    new tensor when any row adjusts)."""
    rows = [row for row, request in enumerate(batch.requests) if adjusts(request)]
    if not rows:
        return logits
    logits = logits.float().clone()
    for row in rows:
        positions, paths = judged(batch, row)
        index = torch.tensor(positions, device=logits.device)
        logits[row, index] = adjusted(batch.requests[row], logits[row, index], paths).to(logits.dtype)
    return logits


def emitted_positions(batch: StepBatch, row: int, accepted: int, path: list[int]) -> list[int]:
    """Where in the verify's logits each token the row emits this step was judged: a chain's accepted drafts and
    its extra token; a tree's path nodes (each judged after its parent) and the token after the last."""
    first = int(batch.first_logit[row])
    if batch.trees[row] is None:
        return [first + j for j in range(accepted + 1)]
    return [first + node for node in [0, *path]]


def token_logprobs(batch: StepBatch, raw: Tensor, outcome: dict) -> dict[int, list[TokenLogprob]]:
    """row -> the log-probability (and the ``request.logprobs`` most likely alternatives) of each token it emits,
    for the rows that asked. raw: [rows, width, V] the verify's unadjusted logits."""
    found = {}
    for row, request in enumerate(batch.requests):
        if request.logprobs is None or row not in outcome:
            continue
        tokens, accepted, path = outcome[row]
        positions = torch.tensor(emitted_positions(batch, row, accepted, path), device=raw.device)
        logp = torch.log_softmax(raw[row, positions].float(), dim=-1)  # [T, V]
        chosen = logp.gather(1, torch.tensor(tokens, device=raw.device)[:, None]).squeeze(1).tolist()
        top = logp.topk(request.logprobs, dim=-1) if request.logprobs else None
        found[row] = [TokenLogprob(token, value, list(zip(top.indices[i].tolist(), top.values[i].tolist()))
                                   if top is not None else [])
                      for i, (token, value) in enumerate(zip(tokens, chosen))]
    return found
