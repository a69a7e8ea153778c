"""How many tokens to draft per step when the batch grows: K chosen from measured costs and acceptance.

At batch 1 verifying K+1 tokens costs about as much as one, so drafting pays whenever the draft is cheap and
accepted. As the batch grows the target forward becomes compute-bound: K+1 tokens per row cost up to K+1 times
one, and drafting stops paying (vLLM turns speculation off above a batch size; TensorRT-LLM tunes K per batch).
The policy picks the K that maximises expected emitted tokens per second for the batch at hand:

    tokens(K) = sum over rows of (1 - a_r^(K+1)) / (1 - a_r)          (Leviathan et al., i.i.d. acceptance a_r)
    time(K)   = K * draft_forward(rows tokens) + target_forward(rows * (K+1) tokens, padded to the widest row)

with forward times measured on this machine (a short calibration when the engine starts, then every forward the
engine runs) and each row's acceptance estimated from its own recent history.

A row's estimate must let it find out what drafting gives it. A row that stops drafting never measures its
acceptance again, so a request whose text turns predictable (an answer that starts copying code from its prompt)
would stay at K=0 for good. So each row's counts decay every step (they describe its recent text, not its whole
history), and the estimate the policy acts on is optimistic by one standard error: a row with little recent
evidence (a new one, or one that has not drafted for a while) gets a rate high enough to draft and see, and a row
that keeps being rejected gets a rate that only a cheap draft (a lookup checked in a memory-bound verify) can pay.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence

import torch

from ..bench.analytic import expected_tokens_per_step

PRIOR_WEIGHT = 2.0  # draft tokens' worth of weight on the engine-wide rate in a row's acceptance estimate
ROW_DECAY = 0.9  # per step: a row's acceptance counts describe about its last ten steps
OPTIMISM = 1.0  # standard errors added to a row's estimate, so rows with little recent evidence draft and see


class ForwardCost:
    """Seconds one step phase takes as a function of the tokens it processes (all rows together).

    Calibration seeds each token count with the minimum of a few plain forwards; the engine's own phases (the
    forward plus the sampling and bookkeeping around it, which a small model on a CPU is dominated by) then move
    it by an exponential moving average, so the model follows what a step really costs on this machine.
    """

    SMOOTHING = 0.2  # weight of the newest measurement

    def __init__(self):
        self.points: dict[int, float] = {}

    def record(self, tokens: int, seconds: float, measured: bool = False) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        old = self.points.get(tokens)
        if old is None:
            self.points[tokens] = seconds
        elif measured:
            self.points[tokens] = (1 - self.SMOOTHING) * old + self.SMOOTHING * seconds
        else:
            self.points[tokens] = min(seconds, old)

    def __call__(self, tokens: int) -> float:
        if not self.points:
            return float(tokens)  # uncalibrated: proportional to work
        xs = sorted(self.points)
        if tokens <= xs[0]:
            return self.points[xs[0]]
        if tokens >= xs[-1]:
            if len(xs) == 1:
                return self.points[xs[0]] * tokens / xs[0]
            x0, x1 = xs[-2], xs[-1]  # extrapolate the last segment's slope
            slope = max((self.points[x1] - self.points[x0]) / (x1 - x0), 0.0)
            return self.points[x1] + slope * (tokens - x1)
        i = bisect.bisect_left(xs, tokens)
        x0, x1 = xs[i - 1], xs[i]
        w = (tokens - x0) / (x1 - x0)
        return self.points[x0] * (1 - w) + self.points[x1] * w


class DraftPolicy:
    """Chooses the batch's K cap each step; rows keep their own K below it."""

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.target = ForwardCost()
        self.draft = ForwardCost()
        self.drafted = 0  # engine-wide totals of judged draft tokens, the prior for rows with little history
        self.accepted = 0
        self._rows: dict[int, tuple[float, float]] = {}  # request id -> decayed (drafted, accepted)

    @property
    def prior_rate(self) -> float:
        return (self.accepted + 0.5 * PRIOR_WEIGHT) / (self.drafted + PRIOR_WEIGHT)

    def row_rate(self, row: int) -> float:
        """The per-token acceptance rate the policy plans with for request ``row``: its recent rate (shrunk towards the
        engine-wide one) plus OPTIMISM standard errors of that estimate."""
        drafted, accepted = self._rows.get(row, (0.0, 0.0))
        evidence = drafted + PRIOR_WEIGHT
        rate = (accepted + self.prior_rate * PRIOR_WEIGHT) / evidence
        rate += OPTIMISM * (rate * (1 - rate) / evidence) ** 0.5
        return min(max(rate, 0.0), 0.999)

    def observe(self, row: int, drafted: int, accepted: int) -> None:
        """One verify's outcome for request ``row`` (drafted 0 on a plain step: its evidence only ages).

        The rate planned with is the chance that one more draft token is accepted given the ones before it were
        (the alpha of the formula), so the tokens after the first rejection, never judged, do not count: a step
        judged ``accepted`` tokens and at most one rejection. (accepted / drafted would read 0.5 for alpha 0.85 at
        K = 8, and the policy would then draft too little.)"""
        judged = accepted + (1 if accepted < drafted else 0)
        old_judged, old_accepted = self._rows.get(row, (0.0, 0.0))
        self._rows[row] = (ROW_DECAY * old_judged + judged, ROW_DECAY * old_accepted + accepted)
        self.drafted += judged
        self.accepted += accepted

    def keep_only(self, rows: set[int]) -> None:
        """Forget requests that left the batch (finished or cancelled)."""
        for row in [r for r in self._rows if r not in rows]:
            del self._rows[row]

    def choose(self, row_rates: Sequence[float], row_limits: Sequence[int],
               uses_model: Sequence[bool] | None = None) -> int:
        """The K cap maximising expected tokens per second for rows with these acceptance estimates and K limits.

        ``uses_model[r]``: row r drafts with the draft model (K draft forwards); False for n-gram lookup rows,
        whose proposals cost nothing but the wider verify (default: every row uses the model). Lookup rows keep
        the i.i.d. sum although lookups tend to be right or wrong as a run: counting them as 1 + a*K tokens made
        bench-serve on the code pair draft at 16-32 clients and fall to 0.87x target-only (0.93-1.02x with the
        sum), so the sum's caution is the better trade where serving must never be slower."""
        rows = len(row_rates)
        if rows == 0:
            return 0
        uses_model = [True] * rows if uses_model is None else list(uses_model)
        best_k, best = 0, rows / self.target(rows)
        for k in range(1, self.k_max + 1):
            ks = [min(k, limit) for limit in row_limits]
            tokens = sum(expected_tokens_per_step(a, kr) for a, kr in zip(row_rates, ks))
            drafting = sum(1 for kr, model in zip(ks, uses_model) if kr > 0 and model)
            draft_seconds = k * self.draft(drafting) if drafting else 0.0
            # The verify pads every row to the widest one: rows x (widest K + 1) tokens, whatever the others draft.
            seconds = draft_seconds + self.target(rows * (max(ks) + 1))
            if tokens / seconds > best:
                best_k, best = k, tokens / seconds
        return best_k

    @torch.inference_mode()
    def calibrate(self, target_model, draft_model, max_rows: int, device, vocab: int, repeats: int = 3) -> None:
        """Time plain forwards (no cache, a short context) at the token counts the engine will use."""
        widths = sorted({1, self.k_max + 1})
        rows = sorted({1, 2, 4, 8, 16, 32, max_rows} & set(range(1, max_rows + 1)))
        generator = torch.Generator().manual_seed(0)
        for model, cost, model_widths in ((target_model, self.target, widths), (draft_model, self.draft, [1])):
            if model is None:
                continue
            for b in rows:
                for t in model_widths:
                    ids = torch.randint(0, vocab, (b, t), generator=generator).to(device)
                    model(input_ids=ids)  # warm-up (allocator, kernels)
                    for _ in range(repeats):
                        start = time.perf_counter()
                        model(input_ids=ids)
                        if torch.device(device).type == "cuda":
                            torch.cuda.synchronize()
                        cost.record(b * t, time.perf_counter() - start)
