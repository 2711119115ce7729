"""Per-request sampling settings, as the engine sees them (already validated by the API layer)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.runtime.structured_output import GuidedSpec


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token plus k alternatives
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided: GuidedSpec | None = None  # structured output: the grammar the output must follow

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the parameter; the API layer turns it into a 400."""
        if self.n < 1 or self.n > 128:
            raise ValueError("n must be between 1 and 128")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be between 0 and max_tokens")
        # written as `not lo <= x <= hi` so that NaN (false in every comparison) is refused too
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError("temperature must be between 0 and 100")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError("presence_penalty must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError("frequency_penalty must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError("repetition_penalty must be in (0, 10]")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:  # torch.Generator's range
            raise ValueError("seed must be between -2**63 and 2**64 - 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be between 0 and 20")
        if self.guided is not None and self.min_tokens > 0:
            # min_tokens bans EOS where the grammar may allow nothing else
            raise ValueError("min_tokens cannot be combined with guided decoding (structured output)")
