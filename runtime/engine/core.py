"""The engine core: `LLMEngine`, a synchronous step loop. Each step is

    scheduler.schedule() -> runner.execute() -> sample (sampler or speculator) -> scheduler.update()

and the scheduler is the one writer of a sequence's state (tokens, stop, grammar, speculation).
Building one is runtime/engine/build.py's job; running it beside asyncio is async_engine.py's;
what it returns is described in protocol.py.

One engine request is one sequence; the server submits each of a request's n choices separately
(prefix caching makes the shared prompt cheap).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvpilot.runtime.config import ConfigError, EngineConfig
from kvpilot.runtime.engine.block_manager import BlockManager
from kvpilot.runtime.engine.health import StepPace
from kvpilot.runtime.engine.kv_transfer.engine_side import KVTransfers
from kvpilot.runtime.engine.protocol import (
    CompletionOutput,
    EngineStats,
    KVExport,
    KVImport,
    LoRAActivity,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from kvpilot.runtime.engine.runner import ModelRunner
from kvpilot.runtime.engine.sampler import Sampler, SamplingRow
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.engine.scheduler import SampledTokens, ScheduledSeq, Scheduler, SchedulerOutput
from kvpilot.runtime.engine.sequence import Sequence
from kvpilot.runtime.engine.spec.speculative import Speculator
from kvpilot.runtime.grammar.structured_output import GrammarCompiler, LazyGrammarCompiler
from kvpilot.runtime.lora.adapter import LoRAError
from kvpilot.runtime.lora.registry import AdapterRegistry
from kvpilot.runtime.lora.request import LoRARequest

log = logging.getLogger(__name__)


@dataclass
class _Tracked:
    seq: Sequence
    emitted: int = 0  # output tokens already reported
    emitted_logprobs: int = 0
    emitted_prompt_logprobs: bool = False


@dataclass
class OOMPolicy:
    """How a step that ran out of device memory is retried."""

    min_token_budget: int = 64
    recover_after_steps: int = 64  # successful steps before the budget grows back
    max_consecutive: int = 8


def is_oom_error(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class LLMEngine:
    """Synchronous engine: add requests, call `step()` until they finish."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Any,
        cfg: EngineConfig,
        model_name: str,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        speculator: Speculator | None = None,
        model_fingerprint: str | None = None,
    ) -> None:
        """`model_fingerprint` (kv_transfer/blocks.model_fingerprint): given, the engine can send and
        receive KV blocks (prefill/decode disaggregation, `self.kv`)."""
        self.cfg = cfg
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_manager = BlockManager(
            runner.num_blocks, runner.geometry.block_size, cfg.enable_prefix_caching
        )
        if self.kv_capacity_tokens < max_model_len:
            log.warning(
                "the KV pool holds %d tokens, fewer than --max-model-len %d: no request can be longer "
                "than %d tokens, and requests without max_tokens default to what fits in the pool; "
                "raise --kv-cache-memory or lower --max-model-len",
                self.kv_capacity_tokens,
                max_model_len,
                self.kv_capacity_tokens,
            )
        self.scheduler = Scheduler(
            self.block_manager,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            cfg.max_loras if runner.lora is not None else None,
        )
        self.sampler = Sampler()
        self.speculator = speculator
        self.requests: dict[str, _Tracked] = {}
        self._grammar = LazyGrammarCompiler(tokenizer)
        self.oom_policy = OOMPolicy()
        self.token_budget = cfg.max_num_batched_tokens
        self.pace = StepPace()  # seconds per scheduled token of the recent steps (the watchdog's)
        self.step_tokens = 0  # the tokens of the step under way (0: none)
        self.oom_recoveries = 0
        self._steps_since_oom = 0
        self._consecutive_ooms = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_steps = 0
        # Test hook: called with the scheduled batch right before the model runs (fault injection).
        self.before_execute: Callable[[SchedulerOutput], None] | None = None
        self.adapters = AdapterRegistry(runner, model_name, self._lora_users)
        self.kv: KVTransfers | None = None
        if model_fingerprint is not None:
            from kvpilot.runtime.engine.kv_transfer.blocks import layout_of
            from kvpilot.runtime.engine.tp.runner import TPModelRunner

            tp = runner.tp_size if isinstance(runner, TPModelRunner) else 1
            self.kv = KVTransfers(
                cfg.kv_role,
                self.block_manager,
                runner.kv_caches,
                layout_of(runner.geometry, model_fingerprint, 0, tp),
                cfg.kv_transfer_pin_fraction,
                cfg.kv_transfer_ttl,
                cfg.kv_transfer_timeout,
                lambda name: None if (r := self.adapters.request(name)) is None else r.key,
                runner if isinstance(runner, TPModelRunner) else None,
            )
            self.scheduler.before_free = self._pin_finished
        for lora_name, lora_path in cfg.lora_modules.items():
            try:
                self.adapters.add(lora_name, lora_path)
            except LoRAError as exc:
                raise ConfigError(f"--lora-modules {lora_name}={lora_path}: {exc}") from None

    # -- requests ------------------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Built on first use: the first guided request, or `AsyncEngine.start` warming it up."""
        return self._grammar.get()

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (a 400 for the client) for requests that can never run. (A guided
        request's grammar was checked by the API layer and is compiled in `add_request`.)"""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request "
                f"needs {total} ({len(prompt_token_ids)} in the prompt + {params.max_tokens} max_tokens); "
                "shorten the prompt or lower max_tokens"
            )
        if not self.block_manager.can_ever_fit(total):
            raise ValueError(
                f"the request needs {total} tokens of KV cache ({len(prompt_token_ids)} prompt + "
                f"{params.max_tokens} max_tokens) but the whole KV pool holds {self.kv_capacity_tokens}; "
                "lower max_tokens or shorten the prompt"
            )

    # -- LoRA adapters (runtime/lora/registry.py) ----------------------------------------------
    def add_lora(self, name: str, path: str) -> LoRARequest:
        return self.adapters.add(name, path)

    def remove_lora(self, name: str) -> None:
        self.adapters.remove(name)

    def _lora_users(self, name: str) -> int:
        return sum(1 for t in self.requests.values() if t.seq.lora is not None and t.seq.lora.name == name)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora: str | None = None,
        kv: KVExport | KVImport | None = None,
    ) -> None:
        """`lora`: the adapter to run with (None: the base model). `kv`: pin the prompt's blocks when it
        finishes (KVExport), or start from pulled blocks (KVImport); needs `self.kv`."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.validate_request(prompt_token_ids, params)
        lora_request = self.adapters.request(lora)
        seq = Sequence(
            request_id, prompt_token_ids, params, self.eos_token_ids, cache_salt, arrival_time, lora_request
        )
        if params.guided is not None:
            # the server compiled it off this thread (grammar_service.py); offline use compiles it
            # here, once per distinct spec (cached); GuidedSpecError is a 400
            guided = params.guided
            seq.grammar = (
                guided.compiled.new_state() if guided.compiled else self.grammar_compiler.new_state(guided)
            )
        if kv is not None:
            if self.kv is None:
                raise ValueError("this engine does not transfer KV blocks")
            if isinstance(kv, KVExport):
                seq.kv_export = True
            else:
                seq.kv_fallback = self.kv.import_into(seq, kv)
        self.requests[request_id] = _Tracked(seq)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        tracked = self.requests.get(request_id)
        if tracked is None or tracked.seq.is_finished:
            return None
        self.scheduler.finish(tracked.seq, "abort")
        return self._output(tracked)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ------------------------------------------------------------------------------
    def _pin_finished(self, seq: Sequence) -> None:
        if seq.kv_export and seq.finish_reason != "abort" and self.kv is not None:
            seq.kv_transfer_params = self.kv.pin_finished(seq)

    def step(self) -> list[RequestOutput]:
        if self.kv is not None:
            self.kv.release_due()
        spec = self.speculator
        if spec is not None:
            spec.plan(self.scheduler.running)
        started = time.monotonic()
        sched = self.scheduler.schedule(self.token_budget)
        if sched.empty:
            return []
        self.step_tokens = sched.num_tokens
        try:
            if spec is not None and spec.draft is not None:
                spec.draft.propose([s for s in sched.scheduled if s.num_spec_tokens])
            if self.before_execute is not None:
                self.before_execute(sched)
            step = self.runner.execute(sched.scheduled)
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            self.scheduler.drop_speculation(sched)
            self.step_tokens = 0
            return self._recover_from_oom(sched)
        self._consecutive_ooms = 0
        self._steps_since_oom += 1
        if self.token_budget < self.cfg.max_num_batched_tokens and (
            self._steps_since_oom >= self.oom_policy.recover_after_steps
        ):
            self.token_budget = min(self.cfg.max_num_batched_tokens, self.token_budget * 2)
            self._steps_since_oom = 0
        self.num_steps += 1
        logits, sampled = step.logits, step.sampled
        self.scheduler.add_prompt_logprobs(step.prompt_logprobs)
        self.prompt_tokens += self.scheduler.on_step_done(sched)
        sampled_tokens = self._sample(logits, sampled) if sampled else []
        update = self.scheduler.update(sampled, sampled_tokens, time.monotonic())
        self.generation_tokens += update.num_generated
        self.pace.observe(self.step_tokens, time.monotonic() - started)
        self.step_tokens = 0
        return [self._output(self.requests[seq.seq_id]) for seq in update.touched]

    def expected_step_s(self) -> float | None:
        """What the step under way should take at the measured pace (None: none under way, or no
        pace yet); the watchdog's allowance (runtime/engine/health.py). Read from other threads."""
        return self.pace.expected_s(self.step_tokens)

    def _sample(self, logits: torch.Tensor, sampled: list[ScheduledSeq]) -> list[SampledTokens]:
        """Per sampled sequence: the tokens to append, their logprobs, and how many of them are
        accepted proposals. Sequences without proposals go through the sampler together."""
        starts: list[int] = []
        row = 0
        for s in sampled:
            starts.append(row)
            row += 1 + s.num_spec_tokens
        if row == len(sampled):  # no speculation this step
            seqs = [s.seq for s in sampled]
            result = self.sampler.sample(logits, [SamplingRow.from_sequence(q) for q in seqs])
            return [([t], [lp], 0) for t, lp in zip(result.token_ids, result.logprobs, strict=True)]
        out: list[SampledTokens] = [([], [], 0)] * len(sampled)
        plain = [i for i, s in enumerate(sampled) if not s.num_spec_tokens]
        if plain:
            rows = torch.tensor([starts[i] for i in plain], device=logits.device)
            result = self.sampler.sample(
                logits.index_select(0, rows), [SamplingRow.from_sequence(sampled[i].seq) for i in plain]
            )
            for i, t, lp in zip(plain, result.token_ids, result.logprobs, strict=True):
                out[i] = ([t], [lp], 0)
        assert self.speculator is not None
        for i, s in enumerate(sampled):
            if s.num_spec_tokens:
                v = self.speculator.verify(logits[starts[i] : starts[i] + 1 + s.num_spec_tokens], s.seq)
                out[i] = (v.token_ids, v.logprobs, v.num_accepted)
        return out

    def _recover_from_oom(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Out of device memory mid-step: free caches, shrink the step, push big requests back."""
        self.oom_recoveries += 1
        self._consecutive_ooms += 1
        self._steps_since_oom = 0
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.token_budget = max(self.oom_policy.min_token_budget, self.token_budget // 2)
        log.warning(
            "out of memory in a step of %d tokens; retrying with a budget of %d (recovery #%d)",
            sched.num_tokens,
            self.token_budget,
            self.oom_recoveries,
        )
        # nothing of the failed step was committed: computed-token counts never advanced
        if len(self.scheduler.running) > 1:
            self.scheduler.preempt_largest(max(1, len(self.scheduler.running) // 4))
        elif self._consecutive_ooms > self.oom_policy.max_consecutive and self.scheduler.running:
            # a single request that cannot run even at the smallest step: fail it, not the server
            seq = self.scheduler.running[0]
            log.error("request %s does not fit in device memory even alone; aborting it", seq.seq_id)
            self.scheduler.finish(seq, "abort")
            return [self._output(self.requests[seq.seq_id])]
        return []

    def _output(self, tracked: _Tracked) -> RequestOutput:
        seq = tracked.seq
        out_ids = seq.output_token_ids
        new = out_ids[tracked.emitted :]
        tracked.emitted = len(out_ids)
        lps: list[TokenLogprob] | None = None
        if seq.params.logprobs is not None:
            lps = seq.logprobs[tracked.emitted_logprobs :]
            tracked.emitted_logprobs = len(seq.logprobs)
        finished = seq.is_finished
        plps: list[TokenLogprob | None] | None = None
        want_prompt = seq.params.prompt_logprobs is not None and not tracked.emitted_prompt_logprobs
        if want_prompt and not seq.needs_prompt_logprobs:  # all of them, once
            plps = [None, *seq.prompt_logprobs]
            tracked.emitted_prompt_logprobs = True
        if finished:
            del self.requests[seq.seq_id]
        fallback, seq.kv_fallback = seq.kv_fallback, None  # reported once
        return RequestOutput(
            request_id=seq.seq_id,
            prompt_token_ids=seq.prompt_token_ids,
            output=CompletionOutput(new, lps, seq.finish_reason, seq.stop_reason),
            finished=finished,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=RequestMetrics(seq.arrival_time, seq.first_scheduled_time),
            prompt_logprobs=plps,
            kv_transfer_params=seq.kv_transfer_params if finished else None,
            kv_fallback=fallback,
        )

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            model_name=self.model_name,
            kv_cache_usage=bm.usage,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks=bm.num_blocks,
            block_size=bm.block_size,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=bm.stats.queries,
            prefix_cache_hits=bm.stats.hits,
            oom_recoveries=self.oom_recoveries,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_steps=self.num_steps,
            lora=lora_activity(self.scheduler),
            kv_role=self.cfg.kv_role,
            kv_transfers_pending=None if self.kv is None else self.kv.pins.pending,
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, int]:
        if self.speculator is None:
            return {}
        st = self.speculator.stats
        return {
            "spec_num_drafts": st.num_drafts,
            "spec_num_draft_tokens": st.num_draft_tokens,
            "spec_num_accepted_tokens": st.num_accepted_tokens,
            "spec_num_emitted_tokens": st.num_emitted_tokens,
        }

    def close(self) -> None:
        """Release the model runner (stops tensor-parallel worker processes)."""
        if self.kv is not None:
            self.kv.close()
        self.runner.close()

    # -- offline use ---------------------------------------------------------------------------
    @torch.inference_mode()
    def score(self, token_ids: list[int], chunk_size: int = 256) -> torch.Tensor:
        """Log-probability of each token given the ones before it ([len - 1] float32), computed in
        chunks through the paged KV cache, so it measures what the cache stores (quantization included).
        Call it only while no request is running."""
        out: list[torch.Tensor] = []
        for start, logits in self._teacher_forced_logits(token_ids, chunk_size):
            logp = torch.log_softmax(logits, dim=-1)
            targets = torch.tensor(token_ids[start + 1 : start + logits.shape[0] + 1], device=logp.device)
            out.append(logp.gather(1, targets[:, None]).squeeze(1).cpu())
        return torch.cat(out)

    def next_token_choices(self, token_ids: list[int], chunk_size: int = 256) -> list[int]:
        """The token the model ranks first after each prefix of `token_ids` (teacher forcing:
        [len - 1] ids), through the same paged path as `score`; for quality measurements."""
        out: list[int] = []
        for _, logits in self._teacher_forced_logits(token_ids, chunk_size):
            out.extend(logits.argmax(dim=-1).tolist())
        return out

    def _teacher_forced_logits(
        self, token_ids: list[int], chunk_size: int
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """(first position, float32 logits [n, vocab]) of each prefill chunk of `token_ids[:-1]`."""
        from kvpilot.runtime.engine.scheduler import ScheduledSeq

        if self.has_unfinished():
            raise RuntimeError("scoring needs an idle engine")
        seq = Sequence(f"score-{time.monotonic_ns()}", token_ids, SamplingParams(max_tokens=1))
        try:
            while seq.num_computed_tokens < len(token_ids) - 1:
                n = min(chunk_size, len(token_ids) - 1 - seq.num_computed_tokens)
                if not self.block_manager.allocate(seq, n):
                    raise ValueError(f"{len(token_ids)} tokens do not fit in the KV pool")
                hidden = self.runner.hidden_states([ScheduledSeq.of(seq, n)])
                yield seq.num_computed_tokens, self.runner.model.compute_logits(hidden).float()
                seq.num_computed_tokens += n
        finally:
            self.block_manager.free_seq(seq)
            self.block_manager.forget(seq)

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        loras: list[str | None] | None = None,
    ) -> list[Sequence]:
        """Run prompts to completion (tests and benchmarks); returns the finished sequences in order.
        `loras`: each prompt's adapter (None: the base model)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        adapters = loras if loras is not None else [None] * len(prompts)
        ids = [f"offline-{self.num_steps}-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        seqs: dict[str, Sequence] = {}
        for rid, prompt, p, lora in zip(ids, prompts, plist, adapters, strict=True):
            self.add_request(rid, prompt, p, lora=lora)
            seqs[rid] = self.requests[rid].seq
        while self.has_unfinished():
            self.step()
        return [seqs[rid] for rid in ids]


def lora_activity(scheduler: Scheduler) -> LoRAActivity | None:
    """Which adapters the running batch and the queue use; None while LoRA serving is off. Safe to call
    from another thread than the engine loop's: a copy of a list or deque is taken under the GIL in one
    go (a deque changed while it is copied raises RuntimeError, which the caller handles)."""
    if scheduler.max_loras is None:
        return None
    running, waiting = tuple(scheduler.running), tuple(scheduler.waiting)

    def names(seqs: tuple[Sequence, ...]) -> tuple[str, ...]:
        return tuple(sorted({s.lora.name for s in seqs if s.lora is not None}))

    return LoRAActivity(scheduler.max_loras, names(running), names(waiting))
