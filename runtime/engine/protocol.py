"""The contract between the engine and everything that drives it: the HTTP front end
(runtime/serving/), `kvpilot bench`, tests. Torch-free, so the front end never imports the model stack.

- `Engine`: what a front end may call. `AsyncEngine` (runtime/engine/async_engine.py) implements it
  over `LLMEngine`'s step loop; the test double in tests/runtime/fake_engine.py implements it too, and
  a type check holds both to it.
- What comes back: `RequestOutput` per step and request (new tokens since the last one), `EngineStats`
  for metrics, `EngineHealth` for the probes.
- What can go wrong: `QueueFullError` (a 429), `EngineDeadError` (a 503); a request the engine can
  never run fails its stream with ValueError (a 400).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvpilot.runtime.engine.kv_transfer.wire import BlockRun, KVLayout

if TYPE_CHECKING:
    from kvpilot.runtime.engine.sampling_params import SamplingParams
    from kvpilot.runtime.grammar.structured_output import CompiledGuided, GuidedSpec
    from kvpilot.runtime.lora.request import LoadedAdapter


class QueueFullError(Exception):
    """More requests are waiting than `max_queue_len` allows; the server answers 429."""


class EngineDeadError(Exception):
    """The engine loop stopped on an unexpected error; the server answers 503."""


@dataclass
class TokenLogprob:
    """Logprob of one token (generated, or of the prompt), with the top alternatives when asked for."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # best first
    rank: int | None = None  # 1 + how many tokens the model ranked above it (prompt logprobs only)


@dataclass
class RequestMetrics:
    """Engine-side timing the server turns into the queue-time metric (the rest it measures itself)."""

    arrival_time: float
    first_scheduled_time: float | None


@dataclass
class CompletionOutput:
    """What one request (one sequence: one choice) produced since its previous RequestOutput."""

    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # for the new tokens only
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output: CompletionOutput
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # precedes it); sent once, on the request's first output with a token (or its last)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # disaggregation (docs/disaggregation.md): a KVExport request's response params, on its last
    # output (None when its blocks could not be pinned); a KVImport request whose pulled blocks the
    # engine could not use says why (`evicted`, `no_blocks`) on its first output
    kv_transfer_params: dict[str, Any] | None = None
    kv_fallback: str | None = None


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one (a consumer that fell behind gets them together)."""
    ca, cb = a.output, b.output
    lps = None
    if ca.logprobs is not None or cb.logprobs is not None:
        lps = (ca.logprobs or []) + (cb.logprobs or [])
    merged = CompletionOutput(ca.new_token_ids + cb.new_token_ids, lps, cb.finish_reason, cb.stop_reason)
    plps = a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs
    return RequestOutput(
        b.request_id,
        b.prompt_token_ids,
        merged,
        b.finished,
        b.num_cached_tokens,
        b.metrics,
        plps,
        b.kv_transfer_params or a.kv_transfer_params,
        a.kv_fallback or b.kv_fallback,
    )


# -- prefill/decode disaggregation (docs/disaggregation.md) ---------------------------------------


@dataclass(frozen=True)
class KVExport:
    """add_request's `kv` for a `do_remote_decode` request: when it finishes, pin its full prompt
    blocks under a transfer id (its last RequestOutput carries the response's kv_transfer_params)."""


@dataclass
class KVImport:
    """add_request's `kv` for a `do_remote_prefill` request: prompt blocks first_block ..
    first_block + num_blocks - 1 pulled from a prefill pod, as the wire's block runs (wire.py,
    layer-major, each layer covered once), one stream per tensor-parallel rank. The engine uses them when its prefix cache still holds
    blocks 0..first_block-1 and it has room; else it computes the prompt itself. `on_done` runs once
    the engine has copied (or dropped) them."""

    first_block: int
    num_blocks: int
    shards: list[list[BlockRun]]  # [tensor-parallel rank]: that rank's runs (one rank: [runs])
    on_done: Callable[[], None] | None = None


class TransferReader(Protocol):
    """A lease on one pinned transfer while it is streamed: its blocks stay as they are until closed."""

    num_tokens: int
    num_blocks: int  # the prompt's full blocks before its last token

    def export_run(self, layer: int, first_block: int, num_blocks: int, rank: int = 0) -> memoryview:
        """A BLOCKS frame's data: blocks first_block .. + num_blocks - 1 of one layer, of
        tensor-parallel rank `rank`'s pool (blocking: call it off the event loop)."""
        ...


class KVTransferPort(Protocol):
    """What the front end uses of an engine's KV transfer (AsyncEngine's; None where unsupported)."""

    role: str  # prefill | decode | both
    layout: KVLayout
    timeout: float  # the decode side's pull deadline (--kv-transfer-timeout)

    def cached_prefix_blocks(
        self, prompt_token_ids: list[int], cache_salt: str | None, lora: str | None
    ) -> int:
        """Leading full prompt blocks this pod's prefix cache holds now (a hint: admission re-checks)."""
        ...

    def open_transfer(self, transfer_id: str) -> AbstractContextManager[TransferReader | None]: ...

    def release_transfer(self, transfer_id: str) -> bool: ...


@dataclass(frozen=True)
class LoRAActivity:
    """The adapter slots and the adapters requests use (the Model Server Protocol's lora_requests_info)."""

    max_loras: int  # adapters the running batch may use at once (--max-loras, the device slots)
    running: tuple[str, ...]  # adapters of the running batch's requests, sorted
    waiting: tuple[str, ...]  # adapters of the scheduler's queued requests, sorted


@dataclass
class EngineStats:
    model_name: str
    kv_cache_usage: float
    num_running: int
    num_waiting: int
    num_blocks: int
    block_size: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    oom_recoveries: int
    prompt_tokens: int
    generation_tokens: int
    num_steps: int
    # speculative decoding (None while it is off, so the metrics are absent rather than zero)
    spec_num_drafts: int | None = None
    spec_num_draft_tokens: int | None = None
    spec_num_accepted_tokens: int | None = None
    spec_num_emitted_tokens: int | None = None
    # the engine loop's watchdog (AsyncEngine only: None offline, so the metrics are absent)
    engine_stalled: int | None = None  # 1 while /health fails (the loop is stuck or stopped)
    engine_heartbeat_age_seconds: float | None = None  # since the loop last made progress
    lora: LoRAActivity | None = None  # None while LoRA serving is off
    kv_role: str = "both"  # --kv-role
    kv_transfers_pending: int | None = None  # prefill side: pinned transfers (None: no KV transfer)

    @property
    def spec_acceptance_rate(self) -> float | None:
        if self.spec_num_draft_tokens is None or self.spec_num_accepted_tokens is None:
            return None
        return (
            self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0
        )


@dataclass(frozen=True)
class EngineHealth:
    """The engine's verdict on itself, what /health and /ready report (runtime/engine/health.py)."""

    healthy: bool
    status: str  # the probe body's "status": "ok", "engine stalled", "engine stopped"
    reason: str | None = None  # why not healthy, in words (the probe body's "reason")

    def body(self) -> dict[str, str]:
        out = {"status": self.status}
        if self.reason is not None:
            out["reason"] = self.reason
        return out


HEALTHY = EngineHealth(True, "ok")


class Engine(Protocol):
    """Everything a front end may use of an engine. Each member does what its name says on every
    implementation; an engine without LoRA serving has `lora_enabled` False and no `loras`."""

    tokenizer: Any  # runtime/load/tokenizer.py's Tokenizer: encode, decode, chat template, ids
    model_name: str
    max_model_len: int
    max_queue_len: int  # a request with more choices than this could never be admitted
    kv_capacity_tokens: int  # the whole KV pool: the longest sequence that can ever run
    kv_transfer: KVTransferPort | None  # prefill/decode disaggregation (None: not on this engine)

    def start(self) -> None: ...

    async def shutdown(self, timeout: float = 30.0) -> None: ...

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        lora: str | None = None,
        kv: KVExport | KVImport | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def compile_grammar(self, spec: GuidedSpec) -> CompiledGuided: ...

    def num_unfinished(self) -> int: ...

    def stats(self) -> EngineStats: ...

    def health(self) -> EngineHealth: ...

    @property
    def loras(self) -> Sequence[LoadedAdapter]: ...

    @property
    def lora_enabled(self) -> bool: ...

    async def add_lora(self, name: str, path: str) -> None: ...

    async def remove_lora(self, name: str) -> None: ...
