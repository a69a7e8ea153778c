"""How many tokens to draft per step when the batch grows: K chosen from measured costs and acceptance.

At batch 1 verifying K+1 tokens costs about as much as one, so drafting pays whenever the draft is cheap and
accepted. As the batch grows the target forward becomes compute-bound: K+1 tokens per row cost up to K+1 times
one, and drafting stops paying (vLLM turns speculation off above a batch size; TensorRT-LLM tunes K per batch).
The policy picks the K that maximises expected emitted tokens per second for the batch at hand:

    tokens(K) = sum over rows of (1 - a_r^(K+1)) / (1 - a_r)          (Leviathan et al., i.i.d. acceptance a_r)
    time(K)   = K * draft_forward(rows tokens) + target_forward(rows * (K+1) tokens, padded to the widest row)

with forward times measured on this machine (ForwardCost: the engine's own runners timed when it starts, at every
verify width batch 1 can use, then every phase the engine runs) and each row's acceptance estimated from its own
recent history.

A row must be able to find out what drafting gives it. A row that stops drafting never measures its acceptance
again, so a request whose text turns predictable (an answer that starts copying code from its prompt) would stay
at K=0 for good; measured on SmolLM2-135M with n-gram lookups, the policy that planned with a row's whole history
drafted 0-14 tokens in 64 steps of a code edit where K=6 drafted 80 and ran 1.7x faster. So:

  exploit  a row's rate is what its recent drafting steps showed (an AcceptanceEstimate, pipeline.executor.
           acceptance: decaying counts seeded at the engine-wide rate, a prior that fades as the row's own evidence
           comes in; one that never faded kept prose rows drafting in a server whose other requests were code);
  probe    a row that has not drafted for ``patience`` steps (a new row at once) is planned at PROBE_RATE or its
           own rate if higher: it drafts wherever a text accepted that often would pay. A probe the target rejects
           outright doubles the wait plus a step (up to MAX_PATIENCE); an accepted token, or drafting on its own
           rate, resets it. Prose pays a few percent for probes that fail; code is found within a few steps.
  cold     until the engine has judged COLD_START_TOKENS draft tokens, a row due for a probe drafts at least one,
           whatever the price says: with an expensive draft step (a draft model as overhead-bound as its target,
           c = 0.55 on the tiny pair) no K pays at the prior or the probe rate, and an engine that never drafts
           never learns that its pair agrees 0.8 of the time.

A lookup that finds a match is free to propose, so for n-gram rows the only question is whether the wider verify
pays, and the verify's cost is what this engine measured at that width. The estimate is per row, not per
proposer: a request has one method, and an ``ngram+draft`` row pools what its two proposers drafted (which of them
drafts a step is decided per request, with the same estimate per proposer, in proposers/ngram_or_draft.py).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from ..speculative.analytic import expected_tokens_per_step
from .acceptance import PRIOR_WEIGHT, AcceptanceEstimate

PROBE_RATE = 0.4  # the rate a row due for a probe is planned with: it drafts where such a text would pay
COLD_START_TOKENS = 16  # draft tokens the engine judges before probes follow the price alone (see "cold")
PATIENCE_GROWTH = 2.0  # a failed probe makes the next one wait this many times longer (plus a step)
MAX_PATIENCE = 16  # the longest a row that stopped drafting waits before it probes again (steps)
# One step in this many runs without drafting (rows that named their K, and seeded sampling rows, still draft): a
# batch that always drafts would otherwise never re-measure what a plain step costs, and K competes with that.
PLAIN_EVERY = 64


class ForwardCost:
    """Seconds one step phase takes as a function of the tokens it processes (all rows together).

    Two sources, kept apart: calibration times bare forwards (the engine's runner alone, the minimum of a few) at
    the token counts the engine will use, and the engine then reports each phase it runs (the forward plus the
    sampling, accept rule and bookkeeping around it, which a small model on a CPU is dominated by). A token count
    the engine has run costs the lower median of its recent measurements together with the calibrated estimate, so
    one slow step (another process's burst, a page fault) does not price a width out for good and a lasting change
    wins after a few steps; a count it has not run costs its bare forward plus the engine's overhead, the lower
    median of its recent measured-minus-bare gaps, so widths the engine has not tried are neither flattered by a bare
    forward nor guessed.
    """

    WINDOW = 5  # recent measurements kept per token count

    def __init__(self):
        self.calibrated: dict[int, float] = {}  # tokens -> seconds of a bare forward
        self.measured: dict[int, deque[float]] = {}  # tokens -> the engine's recent phase times
        self._gaps: deque[float] = deque(maxlen=2 * self.WINDOW - 1)  # measured minus bare, any token count
        self._points: dict[int, float] | None = None
        self._priced: dict[int, float] = {}  # tokens -> __call__'s answer until the next record (the policy asks
        # for the same few counts many times a step)

    def record(self, tokens: int, seconds: float, measured: bool = False) -> None:
        """A bare forward's time (calibration), or with ``measured`` one the engine's phase took."""
        if tokens <= 0 or seconds <= 0:
            return
        self._points = None
        self._priced.clear()
        if not measured:
            old = self.calibrated.get(tokens)
            self.calibrated[tokens] = seconds if old is None else min(seconds, old)
            return
        if self.calibrated:
            self._gaps.append(seconds - _interpolate(self.calibrated, tokens))
        self.measured.setdefault(tokens, deque(maxlen=self.WINDOW)).append(seconds)

    @property
    def overhead(self) -> float:
        """Seconds the engine's phase adds to a bare forward, as recently measured (0 until it ran)."""
        return _lower_median(self._gaps) if self._gaps else 0.0

    @property
    def points(self) -> dict[int, float]:
        """Seconds per token count as the policy plans with them."""
        if self._points is None:
            overhead = self.overhead
            points = {tokens: seconds + overhead for tokens, seconds in self.calibrated.items()}
            for tokens, recent in self.measured.items():
                prior = [_interpolate(self.calibrated, tokens) + overhead] if self.calibrated else []
                points[tokens] = _lower_median(prior + list(recent))
            self._points = points
        return self._points

    def __call__(self, tokens: int) -> float:
        if (priced := self._priced.get(tokens)) is None:
            points = self.points
            # uncalibrated: proportional to work
            priced = self._priced[tokens] = max(_interpolate(points, tokens), 1e-9) if points else float(tokens)
        return priced


def _lower_median(values) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def _interpolate(points: dict[int, float], tokens: int) -> float:
    """Piecewise linear through ``points``; flat below the first, the last segment's slope beyond the last."""
    xs = sorted(points)
    if tokens <= xs[0]:
        return points[xs[0]]
    if tokens >= xs[-1]:
        if len(xs) == 1:
            return points[xs[0]] * tokens / xs[0]
        x0, x1 = xs[-2], xs[-1]
        slope = max((points[x1] - points[x0]) / (x1 - x0), 0.0)
        return points[x1] + slope * (tokens - x1)
    i = bisect.bisect_left(xs, tokens)
    x0, x1 = xs[i - 1], xs[i]
    w = (tokens - x0) / (x1 - x0)
    return points[x0] * (1 - w) + points[x1] * w


@dataclass
class _Row:
    """What the policy knows about one request."""

    acceptance: AcceptanceEstimate  # its recent acceptance, starting at the engine-wide rate
    idle: int = 1  # steps since it last drafted (a new row starts due for a probe)
    patience: int = 1  # idle steps before its next probe
    probing: bool = False  # this step's plan gave it the probe rate


class DraftPolicy:
    """Chooses each row's K every step (never above the row's own)."""

    def __init__(self, engine_draft_len: int):
        self.engine_draft_len = engine_draft_len  # the largest cap it may choose
        self.target = ForwardCost()
        self.draft = ForwardCost()
        self.drafted = 0  # engine-wide totals of judged draft tokens, the prior for rows with little history
        self.accepted = 0
        self._rows: dict[int, _Row] = {}  # request id -> its state
        self._steps = 0

    @property
    def prior_rate(self) -> float:
        return (self.accepted + 0.5 * PRIOR_WEIGHT) / (self.drafted + PRIOR_WEIGHT)

    def _row(self, row: int) -> _Row:
        if row not in self._rows:
            self._rows[row] = _Row(AcceptanceEstimate.starting_at(self.prior_rate))
        return self._rows[row]

    def row_rate(self, row: int) -> float:
        """The per-token acceptance rate request ``row`` has shown in its recent drafting steps, shrunk towards the
        engine-wide rate while it has little evidence (what the policy exploits; probes are planned in ``plan``)."""
        state = self._rows.get(row)
        return (state.acceptance if state is not None else AcceptanceEstimate.starting_at(self.prior_rate)).rate

    def observe(self, row: int, drafted: int, accepted: int) -> None:
        """One verify's outcome for request ``row`` (drafted 0: a plain step, which only counts as idle)."""
        state = self._row(row)
        if drafted <= 0:
            state.idle += 1
            return
        judged = state.acceptance.observe(drafted, accepted)
        # A probe the target rejected outright makes the next one wait longer; a probe with an accepted token, or
        # drafting on the row's own estimate, resets the wait.
        failed = state.probing and accepted == 0
        state.patience = min(int(PATIENCE_GROWTH * state.patience) + 1, MAX_PATIENCE) if failed else 1
        state.idle = 0
        self.drafted += judged
        self.accepted += accepted

    def keep_only(self, rows: set[int]) -> None:
        """Forget requests that left the batch (finished or cancelled)."""
        for row in [r for r in self._rows if r not in rows]:
            del self._rows[row]

    def plan(self, rows: Sequence[int], row_limits: Sequence[int], uses_model: Sequence[bool] | None = None,
             widths: Sequence | None = None) -> list[int]:
        """Each row's K for one engine step over requests ``rows`` (their ids), each able to propose at most
        ``row_limits[r]`` tokens: ``choose`` with each row's rate, a row due for a probe planned at PROBE_RATE or
        more (and drafting at least one token while the engine is cold); all 0 on every PLAIN_EVERY-th step."""
        self.keep_only(set(rows))
        self._steps += 1
        if self._steps % PLAIN_EVERY == 0:
            for row in rows:
                self._row(row).probing = False
            return [0] * len(rows)
        rates = []
        for row in rows:
            state = self._row(row)
            state.probing = state.idle >= state.patience
            rate = self.row_rate(row)
            rates.append(max(rate, PROBE_RATE) if state.probing else rate)
        ks = self.choose(rates, row_limits, uses_model, widths)
        if self.drafted < COLD_START_TOKENS:  # the engine has not seen its pair draft yet: find out
            ks = [max(k, 1) if self._rows[row].probing and limit > 0 else k
                  for row, k, limit in zip(rows, ks, row_limits)]
        return ks

    def choose(self, row_rates: Sequence[float], row_limits: Sequence[int],
               uses_model: Sequence[bool] | None = None, widths: Sequence | None = None) -> list[int]:
        """Each row's K (0 included) maximising expected tokens per second for rows with these acceptance estimates
        and K limits.

        ``uses_model[r]``: row r drafts with a model (K draft forwards, all drafting rows together); False for
        lookup rows, whose proposals cost nothing but the wider verify (default: every row uses a model).
        ``widths[r]``: for a row that verifies a tree, tokens verified at a given K (default K + 1).

        A row's j-th draft token adds a_r^j expected tokens (the i.i.d. sum) and widens the verify by its own tokens,
        so for any number of verified tokens the best split is the one that takes the largest gains per token
        first: the candidates are the prefixes of that order, each priced whole (the target forward over every
        row's tokens, plus the draft forwards, as many as the deepest model row drafts). A prose row then stays at
        0 beside a code row at 6, where one cap for the batch drafts both or neither; the best single cap is
        priced too, and kept when it does better (the order ignores what depth costs in draft forwards). Lookup
        rows keep the i.i.d. sum although lookups tend to be right or wrong as a run: counting them as 1 + a*K
        tokens made bench-serve on the code pair draft at 16-32 clients and fall to 0.87x target-only (0.93-1.02x
        with the sum), so the sum's caution is the better trade where serving must never be slower."""
        rows = len(row_rates)
        if rows == 0:
            return []
        uses_model = [True] * rows if uses_model is None else list(uses_model)
        width = [(lambda k: k + 1) if widths is None or widths[r] is None else widths[r] for r in range(rows)]
        plans = [self._by_gain(row_rates, row_limits, uses_model, width)]
        plans += [[min(k, limit) for limit in row_limits] for k in range(1, self.engine_draft_len + 1)]
        best_ks = [0] * rows
        best = self._tokens_per_second(row_rates, best_ks, uses_model, width)
        for ks in plans:
            rate = self._tokens_per_second(row_rates, ks, uses_model, width)
            if rate > best:
                best_ks, best = ks, rate
        return list(best_ks)

    def _tokens_per_second(self, rates, ks, uses_model, width) -> float:
        tokens = sum(expected_tokens_per_step(a, k) for a, k in zip(rates, ks))
        model_ks = [k for k, model in zip(ks, uses_model) if k > 0 and model]
        draft_seconds = max(model_ks) * self.draft(len(model_ks)) if model_ks else 0.0
        return tokens / (draft_seconds + self.target(sum(width[r](k) for r, k in enumerate(ks))))

    def _by_gain(self, rates, limits, uses_model, width) -> list[int]:
        """The best per-row split along the order of gain per verified token (see ``choose``), priced incrementally:
        one pass over rows x K candidates, each priced in constant time."""
        items = []  # (minus gain per verified token, row, j, gain, tokens added to the verify)
        for r, (a, limit) in enumerate(zip(rates, limits)):
            ratio = float("inf")
            for j in range(1, min(limit, self.engine_draft_len) + 1):
                added = max(width[r](j) - width[r](j - 1), 1)
                ratio = min(ratio, a ** j / added)  # never above the row's previous token: taken in order
                items.append((-ratio, r, j, a ** j, added))
        items.sort()
        rows = len(rates)
        verified = sum(width[r](0) for r in range(rows))
        tokens, model_rows, deepest = float(rows), 0, 0
        best, taken = rows / self.target(verified), 0
        for index, (_, r, j, gain, added) in enumerate(items):
            tokens += gain
            verified += added
            if uses_model[r]:
                model_rows += j == 1
                deepest = max(deepest, j)
            draft_seconds = deepest * self.draft(model_rows) if model_rows else 0.0
            rate = tokens / (draft_seconds + self.target(verified))
            if rate > best:
                best, taken = rate, index + 1
        ks = [0] * rows
        for _, r, j, _, _ in items[:taken]:
            ks[r] = max(ks[r], j)
        return ks

    def calibration_widths(self, max_rows: int) -> dict[int, list[int]]:
        """What to time before anything drafted, as {rows: tokens per row}: at batch 1 every verify width
        1..engine_draft_len+1 (where the verify cost curve decides K), at larger batches plain, middle and widest.
        The engine times its own runners at these shapes (BatchingEngine.calibrate) and records them in ``target``
        (rows x width tokens) and ``draft`` (one token per row)."""
        rows = sorted({1, 2, 4, 8, 16, 32, max_rows} & set(range(1, max_rows + 1)))
        return {b: list(range(1, self.engine_draft_len + 2)) if b == 1 else
                sorted({1, self.engine_draft_len // 2 + 1, self.engine_draft_len + 1}) for b in rows}
