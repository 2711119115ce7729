"""Prefill/decode disaggregation, the router's decisions (docs/disaggregation.md, "Router"). Pure: no I/O,
so the autoscaler's simulator can ask the same questions (`should_disaggregate`, `plan`).

A disaggregated model's request runs in two legs: its prompt on a prefill pod (`prefill_body`: the
client's body answered with one token and `kv_transfer_params.do_remote_decode`), then the whole
request on a decode pod with the `kv_transfer_params` the prefill pod answered (`decode_body`), whose
stream is the client's answer. `plan` decides whether a request takes the two legs or goes straight
to a decode pod:

- prompts shorter than the model's `min_prompt_tokens` go straight to a decode pod: their prefill
  costs less than the transfer's round trips. The router has no tokenizer: a prompt of token ids is
  counted exactly, a text prompt is estimated at 4 characters a token (`measure.estimate_tokens` of
  `keys.prompt_text`: the chat messages' text with a role marker each, or the completion prompt);
- so does every request whose prompt the two legs cannot carry as one transfer, or whose answer needs
  the prompt's logits (`direct_reason`): several prompts in one completion request, `echo`,
  `prompt_logprobs`, and a client that sends `kv_transfer_params` itself (it orchestrates on its own);
- and a long prompt of a model with no routable prefill pod (none Ready, or all ejected) goes to a
  decode pod too, counted apart (`no_prefill`): the prefill role's wake-up from zero.

While the router holds a request in the model's central queue (in front of the decode pool) it
counts it by the pool it will need (`held_path`, kvpilot_router_pd_queued): `prefill` when its
prompt takes the prefill pool (`needs_prefill`, whatever the prefill pods are now), `direct` when a
decode pod alone will run it (a short prompt, a `direct_reason`, or a request whose prefill leg has
already run: a retry of the decode leg). The autoscaler counts only the first toward the prefill
role's backlog, both toward the decode role's.

The prefill leg's deadlines (`PrefillSpeed`): waiting for a prefill pod with room is bounded by the
model's transfer timeout; the prompt's run on the pod by the same timeout plus PREFILL_SLACK times the
time the pool's measured speed (seconds per prompt token, its last legs) gives the prompt. A prompt's
prefill takes what it takes (a 4k-token prompt on one CPU thread: ~20 s), and abandoning a prefill
that is progressing makes the decode pod compute the prompt again: the leg is given up only when it
runs far slower than the pool does. Until the pool's first leg answers there is no such bound; the
router's per-pod deadlines (an answer, or a health probe, within the first-byte timeout) still hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kvpilot.api.models import DEFAULT_KV_TRANSFER_TIMEOUT_S, DEFAULT_PD_MIN_PROMPT_TOKENS
from kvpilot.router.keys import prompt_text
from kvpilot.router.measure import estimate_tokens
from kvpilot.router.migrate import GUIDED_FIELDS

PdPath = Literal["disaggregated", "direct", "no_prefill", "prefill_failed"]
PD_PATHS: tuple[PdPath, ...] = ("disaggregated", "direct", "no_prefill", "prefill_failed")
HeldPath = Literal["prefill", "direct"]  # what a request held in the central queue will need
HELD_PATHS: tuple[HeldPath, ...] = ("prefill", "direct")
KV_TRANSFER_PARAMS = "kv_transfer_params"
# The decode pool's policy: the lowest load per slot times the pod's measured slowness, the scraped
# KV use breaking ties (policy.py), which is what a decode pod is short of: slots and KV memory.
DECODE_POLICY = "least-loaded"

# The prefill leg's run may take this many times what the pool's measured speed gives its prompt
# (plus the transfer timeout): a margin for a longer prompt's attention and the pod's own queue.
PREFILL_SLACK = 4.0
# The weight of a new leg in the pool's speed average (the rest is its history).
PREFILL_SPEED_WEIGHT = 0.3

# Fields that only shape the generated output, left out of the prefill request: its one token is
# thrown away, and some would refuse `max_tokens: 1` (min_tokens) or `stream: false` (stream_options),
# or cost the prefill pod work for nothing (a grammar compiled for one token). Everything else goes as
# the client sent it: what renders the prompt (messages, tools, tool_choice, chat_template_kwargs,
# add_generation_prompt, continue_final_message, cache_salt) and the model or LoRA adapter name.
GENERATION_ONLY_FIELDS = (
    "max_completion_tokens",
    "min_tokens",
    "n",
    "best_of",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "response_format",
    *GUIDED_FIELDS,
    "guided_whitespace_pattern",
    "guided_decoding_backend",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
)


@dataclass(frozen=True)
class PdSettings:
    """A disaggregated model's settings (spec.disaggregation, or the router's --pd-* flags)."""

    min_prompt_tokens: int = DEFAULT_PD_MIN_PROMPT_TOKENS
    transfer_timeout_s: float = DEFAULT_KV_TRANSFER_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.min_prompt_tokens < 0:
            raise ValueError(f"the minimum prompt tokens must be >= 0, got {self.min_prompt_tokens}")
        if not 0 < self.transfer_timeout_s < float("inf"):
            raise ValueError(f"the transfer timeout must be > 0 seconds, got {self.transfer_timeout_s}")


@dataclass(frozen=True)
class PdPlan:
    """How one request runs: `path` disaggregated (prefill then decode), direct (a decode pod alone:
    the request skips the prefill pool) or no_prefill (a decode pod alone: the prompt needed the
    prefill pool, which had no routable pod), why, and the prompt's size in tokens as the router
    estimates it."""

    path: PdPath
    reason: str
    prompt_tokens: int


def prefill_budget_s(
    prompt_tokens: int, seconds_per_token: float | None, transfer_timeout_s: float
) -> float | None:
    """The most a prefill leg's run on its pod may take: the transfer timeout plus PREFILL_SLACK times
    the time the pool's measured speed gives `prompt_tokens`; None (no bound of its own) before the
    pool has answered a leg."""
    if seconds_per_token is None:
        return None
    return transfer_timeout_s + PREFILL_SLACK * max(1, prompt_tokens) * seconds_per_token


@dataclass
class PrefillSpeed:
    """A prefill pool's measured speed: seconds per prompt token of the legs it answered (from
    sending the prompt to the answer, the wait in the pod's own queue included), an exponentially
    weighted average; None until a leg has answered."""

    seconds_per_token: float | None = field(default=None)

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        if prompt_tokens < 1:  # an empty prompt says nothing about the speed
            return
        sample = max(0.0, seconds) / prompt_tokens
        old = self.seconds_per_token
        self.seconds_per_token = (
            sample if old is None else (1 - PREFILL_SPEED_WEIGHT) * old + PREFILL_SPEED_WEIGHT * sample
        )

    def budget_s(self, prompt_tokens: int, transfer_timeout_s: float) -> float | None:
        return prefill_budget_s(prompt_tokens, self.seconds_per_token, transfer_timeout_s)


def should_disaggregate(prompt_tokens: int, min_prompt_tokens: int) -> bool:
    """A prompt of this many tokens takes the prefill pool (shorter ones skip it)."""
    return prompt_tokens >= min_prompt_tokens


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) for t in value)


def prompt_tokens(body: Mapping[str, Any], chat: bool) -> int:
    """The prompt's tokens: counted for a prompt of token ids, else estimated from its text."""
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list):
        if _is_token_ids(prompt):
            return len(prompt)
        if len(prompt) == 1 and _is_token_ids(prompt[0]):
            return len(prompt[0])
    return estimate_tokens(len(prompt_text(body, chat)))


def direct_reason(body: Mapping[str, Any], chat: bool) -> str | None:
    """Why this request cannot take the two legs whatever its size (None: it can)."""
    if body.get(KV_TRANSFER_PARAMS) is not None:
        return "the client sent kv_transfer_params"
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs (the decode pod does not compute the transferred prompt's logits)"
    if body.get("echo"):
        return "echo"
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) > 1 and not _is_token_ids(prompt):
            return "several prompts in one request"
    return None


def plan(body: Mapping[str, Any], chat: bool, settings: PdSettings, prefill_pods: int) -> PdPlan:
    """Disaggregated, direct or no_prefill for one request of a disaggregated model with
    `prefill_pods` routable prefill pods (see the module docstring)."""
    tokens = prompt_tokens(body, chat)
    why = direct_reason(body, chat)
    if why is not None:
        return PdPlan("direct", why, tokens)
    if not should_disaggregate(tokens, settings.min_prompt_tokens):
        return PdPlan("direct", f"a short prompt (~{tokens} < {settings.min_prompt_tokens} tokens)", tokens)
    if prefill_pods < 1:
        return PdPlan("no_prefill", "no routable prefill pod", tokens)
    return PdPlan("disaggregated", f"a prompt of ~{tokens} tokens", tokens)


def needs_prefill(body: Mapping[str, Any], chat: bool, settings: PdSettings) -> bool:
    """The request's prompt takes the prefill pool when one is routable (`plan` disaggregated or
    no_prefill), decided from the request alone."""
    return direct_reason(body, chat) is None and should_disaggregate(
        prompt_tokens(body, chat), settings.min_prompt_tokens
    )


def held_path(body: Mapping[str, Any], chat: bool, settings: PdSettings, prefilled: bool) -> HeldPath:
    """What a request held in the central queue will need: `prefill` when its prompt takes the
    prefill pool and its prefill leg has not run yet (`prefilled`: a retry of the decode leg), else
    `direct` (a decode pod alone)."""
    return "prefill" if not prefilled and needs_prefill(body, chat, settings) else "direct"


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: the client's, answered whole with one token, asking the pod to keep
    the prompt's KV for a decode pod (`do_remote_decode`), without the fields that only shape the
    output (GENERATION_ONLY_FIELDS)."""
    out = {k: v for k, v in body.items() if k not in GENERATION_ONLY_FIELDS}
    out.update({"max_tokens": 1, "stream": False, KV_TRANSFER_PARAMS: {"do_remote_decode": True}})
    return out


def transfer_params(answer: Any, prefill_url: str) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a prefill pod's answer (a parsed JSON body) for the decode leg,
    its `remote_url` filled with the prefill pod's base URL when the pod left it out; None when the
    answer carries none (a pod that does not run the prefill role)."""
    if not isinstance(answer, dict):
        return None
    params = answer.get(KV_TRANSFER_PARAMS)
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        return None
    if not params.get("remote_url"):
        params = {**params, "remote_url": prefill_url}
    return params


def decode_body(body: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The decode leg's body: the client's request as it was, with the prefill's transfer params."""
    return {**body, KV_TRANSFER_PARAMS: dict(params)}
