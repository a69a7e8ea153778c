"""What a generation returns: tokens, text and acceptance statistics (first-class, on every result)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import PipelineError, RequestError  # noqa: F401 - RequestError: re-exported, the executor API names it


class RequestFailed(RuntimeError):
    """The engine failed this request alone: its own proposal, verify or sampling raised ``cause``. The requests
    that ran beside it got exactly the tokens they get without it."""

    def __init__(self, message: str, cause: BaseException):
        super().__init__(message)
        self.cause = cause


class _ItemAccess:
    """Results read as attributes (result.text) or as mapping keys (result["text"])."""

    def __getitem__(self, key: str):
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def get(self, key: str, default=None):
        return getattr(self, key) if key in self.keys() else default

    def keys(self) -> list[str]:
        return list(self.to_dict())


@dataclass
class GenerationStats(_ItemAccess):
    """Acceptance statistics of one request, or of many added together."""

    draft_tokens: int = 0  # tokens the draft proposed
    accepted_tokens: int = 0  # proposed tokens the target kept
    target_steps: int = 0  # target forward passes (each emits accepted + 1 tokens)
    generated_tokens: int = 0  # tokens emitted (after EOS/length truncation)
    drafted_at: list[int] = field(default_factory=list)  # [K] proposals per draft position
    accepted_at: list[int] = field(default_factory=list)  # [K] acceptances per draft position
    # proposer ("draft_model" | "ngram" | "medusa") -> [tokens proposed, tokens accepted, steps it proposed in]
    by_proposer: dict[str, list[int]] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens emitted per target forward pass; 1.0 is plain decoding."""
        return self.generated_tokens / self.target_steps if self.target_steps else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def record_step(self, drafted: int, accepted: int, proposer: str | None = None) -> None:
        if proposer is not None and drafted > 0:
            counts = self.by_proposer.setdefault(proposer, [0, 0, 0])
            counts[0] += drafted
            counts[1] += accepted
            counts[2] += 1
        grow = drafted - len(self.drafted_at)
        if grow > 0:
            self.drafted_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.target_steps += 1

    def merge(self, other: GenerationStats) -> GenerationStats:
        total = GenerationStats(self.draft_tokens + other.draft_tokens,
                                self.accepted_tokens + other.accepted_tokens,
                                self.target_steps + other.target_steps,
                                self.generated_tokens + other.generated_tokens)
        width = max(len(self.drafted_at), len(other.drafted_at))
        pad = lambda xs: xs + [0] * (width - len(xs))  # noqa: E731
        total.drafted_at = [a + b for a, b in zip(pad(self.drafted_at), pad(other.drafted_at))]
        total.accepted_at = [a + b for a, b in zip(pad(self.accepted_at), pad(other.accepted_at))]
        for stats in (self, other):
            for name, counts in stats.by_proposer.items():
                mine = total.by_proposer.setdefault(name, [0, 0, 0])
                total.by_proposer[name] = [a + b for a, b in zip(mine, counts)]
        return total

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(acceptance_rate=self.acceptance_rate, mean_accepted_len=self.mean_accepted_len,
                    acceptance_by_position=self.acceptance_by_position)
        return data

    def summary(self) -> str:
        by_pos = " ".join(f"{r:.2f}" for r in self.acceptance_by_position)
        proposers = "".join(f", {name} {a}/{d} accepted in {n} steps"
                            for name, (d, a, n) in sorted(self.by_proposer.items()) if len(self.by_proposer) > 1)
        return (f"drafted {self.draft_tokens}, accepted {self.accepted_tokens} "
                f"(acceptance {self.acceptance_rate:.2f}), {self.target_steps} target steps, "
                f"{self.mean_accepted_len:.2f} tokens/step" + (f", by position [{by_pos}]" if by_pos else "")
                + proposers)


@dataclass
class GenerationResult(_ItemAccess):
    token_ids: list[int]  # generated tokens only (no prompt)
    text: str
    stats: GenerationStats
    finish_reason: str  # "eos" | "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when the request asked for them

    def to_dict(self) -> dict:
        data = {"token_ids": self.token_ids, "text": self.text, "stats": self.stats.to_dict(),
                "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens}
        if self.logprobs is not None:
            data["logprobs"] = [asdict(entry) for entry in self.logprobs]
        return data


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target (its raw log-softmax at the token's position), with the
    most likely tokens there, best first, when the request asked for alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # [(token id, logprob)] the request's top_logprobs alternatives; [] when none


@dataclass
class StreamEvent:
    """One target step's worth of output, yielded as soon as it is accepted."""

    token_ids: list[int]  # tokens added by this step
    text: str  # text added by this step (may lag a step behind on a split multi-byte character)
    finished: bool
    finish_reason: str | None
    stats: GenerationStats  # running totals for this request
    error: RequestFailed | None = None  # set on the last event of a request the engine failed (finish_reason "error")
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when the request asked for them
