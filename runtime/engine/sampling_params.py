"""Per-sequence sampling settings, as the engine sees them.

The API layer (api_request.py) validates every value and builds these in
`to_sampling_params`; the engine trusts them. A request feature that changes how tokens are chosen
adds a field here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.runtime.grammar.structured_output import GuidedSpec


@dataclass
class SamplingParams:
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
    # None: none; k >= 0: each prompt token's logprob (from the second on) plus k alternatives. Such a
    # request does not read the prefix cache (a cached position has no logits)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided: GuidedSpec | None = None  # structured output: the grammar the output must follow
