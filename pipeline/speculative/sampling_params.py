"""The sampling controls of one request, without torch: request validation and configs import them cheaply."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax); no randomness at all
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0  # 1 = no nucleus cut

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature: {self.temperature} must be finite and >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k: {self.top_k} must be >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: {self.top_p} must be in (0, 1] (1 disables it)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# response_format's JSON laid out as json.dumps writes it (llguidance's JSON options): one space after "," and ":",
# none elsewhere. llguidance's default allows any whitespace anywhere, and a model can then pad spaces until its token
# limit (small models do); fixed separators also make more of the answer forced, so free drafts. A schema's own
# "x-guidance" options override these. Here, without torch, so the OpenAI proxy's forced tool calls share it.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
PENALTY_LIMIT = 2.0  # OpenAI's range for presence and frequency penalties: [-2, 2]
# repetition_penalty's range: a logit divided by 1e-39 is +inf, and the distribution NaN; 100 already pins a repeat.
REPETITION_RANGE = (0.01, 100.0)


@dataclass(frozen=True)
class LogitsAdjust:
    """What a request changes in the target's logits before temperature, top-k and top-p: OpenAI's penalties and
    bias, vLLM's repetition penalty and min_tokens. Every one depends on the tokens generated before a position, so
    under speculation each verified position sees the state advanced along the draft tokens before it.

    presence_penalty / frequency_penalty: subtracted once per token that was generated / per time it was generated
    (OpenAI: counts over the generated tokens, not the prompt); repetition_penalty: a logit of a token seen in the
    prompt or the output is divided by it when positive and multiplied when negative (the CTRL rule, as Hugging
    Face and vLLM apply it); logit_bias: (token id, bias) pairs added to the logits; min_tokens: the stop and EOS
    ids are masked until this many tokens have been generated."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0

    def __post_init__(self):
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise ValueError(f"{name}: {value} must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}] (0 disables it)")
        low, high = REPETITION_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty: {self.repetition_penalty} must be in [{low:g}, {high:g}] (1 "
                             f"disables it)")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens: {self.min_tokens} must be >= 0 (0 disables it)")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")

    @property
    def neutral(self) -> bool:
        """Nothing to apply: the logits pass through unchanged."""
        return (self.presence_penalty == 0 and self.frequency_penalty == 0 and self.repetition_penalty == 1
                and not self.logit_bias and self.min_tokens == 0)
