"""The engine: a synchronous step loop (`LLMEngine`) and a thread that runs it beside asyncio
(`AsyncEngine`), so the HTTP server never blocks on the model.

One engine request is one sequence; the server submits each of a request's n choices separately
(prefix caching makes the shared prompt cheap).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvpilot.runtime.config import ConfigError, EngineConfig
from kvpilot.runtime.engine.block_manager import BlockManager
from kvpilot.runtime.engine.health import EngineHealth, engine_stopped, judge_progress
from kvpilot.runtime.engine.plan import (
    blocks_for_budget,
    cuda_graph_sizes,
    pool_blocks,
    with_block_size,
)
from kvpilot.runtime.engine.runner import KVGeometry, ModelRunner, apply_kernel_switches, kv_geometry
from kvpilot.runtime.engine.sampler import Sampler, SamplingRow
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from kvpilot.runtime.engine.sequence import Sequence, TokenLogprob
from kvpilot.runtime.engine.spec.speculative import Speculator, make_speculator
from kvpilot.runtime.engine.tp.runner import start_tensor_parallel
from kvpilot.runtime.grammar.service import GrammarLimits, GrammarService
from kvpilot.runtime.grammar.structured_output import (
    CompiledGuided,
    GrammarCompiler,
    GuidedSpec,
    LazyGrammarCompiler,
)
from kvpilot.runtime.lora.adapter import LoRAError
from kvpilot.runtime.lora.registry import AdapterRegistry
from kvpilot.runtime.lora.request import LoadedAdapter, LoRARequest

if TYPE_CHECKING:
    from kvpilot.runtime.engine.spec.draft import DraftProposer
    from kvpilot.runtime.load.loader import LoadedModel

log = logging.getLogger(__name__)


class QueueFullError(Exception):
    """More requests are waiting than `max_queue_len` allows; the server answers 429."""


class EngineDeadError(Exception):
    """The engine loop stopped on an unexpected error; the server answers 503."""


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

    @property
    def spec_acceptance_rate(self) -> float | None:
        if self.spec_num_draft_tokens is None or self.spec_num_accepted_tokens is None:
            return None
        return (
            self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0
        )


@dataclass
class _Tracked:
    seq: Sequence
    emitted: int = 0  # output tokens already reported
    emitted_logprobs: int = 0


@dataclass
class OOMPolicy:
    """How a step that ran out of device memory is retried."""

    min_token_budget: int = 64
    recover_after_steps: int = 64  # successful steps before the budget grows back
    max_consecutive: int = 8


def _draft_proposer(
    cfg: EngineConfig, target: LoadedModel, draft: LoadedModel | None, num_blocks: int
) -> DraftProposer:
    """Load (unless given) and check the draft model; its KV pool mirrors the target's blocks."""
    from kvpilot.runtime.engine.spec.draft import DraftProposer, check_draft_compatible
    from kvpilot.runtime.load.loader import load_model

    assert cfg.speculative_model is not None  # EngineConfig checks it
    if draft is None:
        try:
            draft_cfg = EngineConfig.model_validate({"model": cfg.speculative_model, "dtype": cfg.dtype})
            draft = load_model(draft_cfg, target.device, target.dtype)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--speculative-model {cfg.speculative_model}: {exc}") from exc
    check_draft_compatible(target, draft, target.max_model_len)
    assert cfg.block_size is not None  # with_block_size() ran before the pool was sized
    return DraftProposer(draft, target, num_blocks, cfg.block_size)


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
    ) -> None:

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
        self.oom_recoveries = 0
        self._steps_since_oom = 0
        self._consecutive_ooms = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_steps = 0
        # Test hook: called with the scheduled batch right before the model runs (fault injection).
        self.before_execute: Callable[[SchedulerOutput], None] | None = None
        self.adapters = AdapterRegistry(runner, model_name, self._lora_users)
        for lora_name, lora_path in cfg.lora_modules.items():
            try:
                self.adapters.add(lora_name, lora_path)
            except LoRAError as exc:
                raise ConfigError(f"--lora-modules {lora_name}={lora_path}: {exc}") from None

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: EngineConfig) -> LLMEngine:
        from kvpilot.runtime.load.loader import load_model, resolve_device

        apply_kernel_switches(cfg)  # before anything is loaded: the weights' layout follows them
        cfg = with_block_size(cfg, resolve_device(cfg.device))
        if cfg.tensor_parallel_size > 1:
            runner = start_tensor_parallel(cfg)  # checks the size, spawns ranks 1.., loads rank 0's shard
            loaded = runner.loaded
            if loaded.lora is not None:
                runner.enable_lora(loaded.lora)
            name = cfg.served_model_name or loaded.model_name
            eos = frozenset(loaded.tokenizer.eos_token_ids)
            spec = make_speculator(cfg, loaded.max_model_len, runner.device.type)
            return cls(runner, loaded.tokenizer, cfg, name, loaded.max_model_len, eos, spec)
        device = resolve_device(cfg.device)
        if device.type == "cpu":
            torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
        torch.manual_seed(cfg.seed)
        return cls.from_loaded(
            load_model(cfg, device), cfg
        )  # cfg.dtype: `auto` picks weights and activations

    @classmethod
    def from_loaded(
        cls, loaded: LoadedModel, cfg: EngineConfig, draft: LoadedModel | None = None
    ) -> LLMEngine:
        """An engine around an already-loaded, unsharded model (tests share one model between engines).
        `draft`: the loaded --speculative-model (loaded here from cfg when not given)."""
        from kvpilot.kernels import quant
        from kvpilot.runtime.load.loader import resolve_max_model_len

        if cfg.tensor_parallel_size != 1:
            raise ValueError(
                "from_loaded() takes a whole model; use from_config() for --tensor-parallel-size > 1"
            )
        cfg = with_block_size(cfg, loaded.device)
        assert cfg.block_size is not None
        if cfg.enable_lora and loaded.lora is None:  # before the KV pool is sized: the slots take memory
            from kvpilot.runtime.load.loader import attach_lora

            attach_lora(loaded, cfg)
        kv_dtype = quant.storage_dtype(cfg.kv_cache_dtype, loaded.dtype)
        geo = kv_geometry(loaded.arch, cfg.block_size, kv_dtype)
        if loaded.device.type == "cuda" and cfg.kv_cache_memory is None:
            num_blocks = cls._num_blocks_measured(cfg, geo, loaded)
        else:
            num_blocks = pool_blocks(cfg, geo, loaded.device)
        runner = ModelRunner(
            loaded.model,
            geo,
            num_blocks,
            loaded.device,
            cuda_graph_sizes=cuda_graph_sizes(cfg, loaded.device),
            max_model_len=loaded.max_model_len,
        )
        if cfg.enable_lora:
            assert loaded.lora is not None
            runner.enable_lora(loaded.lora)
        eos = frozenset(loaded.tokenizer.eos_token_ids)
        name = cfg.served_model_name or loaded.model_name
        # this cfg's --max-model-len, which may differ from the one the model was loaded with
        max_model_len = (
            loaded.max_model_len
            if cfg.max_model_len is None
            else resolve_max_model_len(cfg.max_model_len, loaded.arch)
        )
        proposer = None
        if cfg.speculative_method == "draft":
            proposer = _draft_proposer(cfg, loaded, draft, num_blocks)
        spec = make_speculator(cfg, max_model_len, loaded.device.type, proposer)
        return cls(runner, loaded.tokenizer, cfg, name, max_model_len, eos, spec)

    @staticmethod
    def _num_blocks_measured(cfg: EngineConfig, geo: KVGeometry, loaded: LoadedModel) -> int:
        """One GPU: a warm-up forward at the largest step, its measured peak, and the pool from what is
        left under --gpu-memory-utilization."""
        from kvpilot.runtime.engine.runner import kv_budget_from_profile, profile_memory

        tokens = cfg.max_num_batched_tokens
        profile = profile_memory(loaded.model, geo, loaded.device, tokens, cfg.max_num_seqs)
        budget = kv_budget_from_profile(profile, cfg.gpu_memory_utilization)
        return blocks_for_budget(budget, geo, cfg, loaded.device.type)

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
    ) -> None:
        """`lora`: the adapter to run with (None: the base model)."""
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
    def step(self) -> list[RequestOutput]:
        spec = self.speculator
        if spec is not None:
            spec.plan(self.scheduler.running)
        sched = self.scheduler.schedule(self.token_budget)
        if sched.empty:
            return []
        try:
            if spec is not None and spec.draft is not None:
                spec.draft.propose([s for s in sched.scheduled if s.num_spec_tokens])
            if self.before_execute is not None:
                self.before_execute(sched)
            logits, sampled = self.runner.execute(sched.scheduled)
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            self._drop_speculation(sched)
            return self._recover_from_oom(sched)
        self._consecutive_ooms = 0
        self._steps_since_oom += 1
        if self.token_budget < self.cfg.max_num_batched_tokens and (
            self._steps_since_oom >= self.oom_policy.recover_after_steps
        ):
            self.token_budget = min(self.cfg.max_num_batched_tokens, self.token_budget * 2)
            self._steps_since_oom = 0
        self.num_steps += 1
        for s in sched.scheduled:
            if s.seq.num_computed_tokens < s.seq.num_prompt_tokens:
                self.prompt_tokens += min(
                    s.num_new_tokens, s.seq.num_prompt_tokens - s.seq.num_computed_tokens
                )
        self.scheduler.on_step_done(sched)

        outputs: list[RequestOutput] = []
        if sampled:
            seqs = [s.seq for s in sampled]
            new_tokens = self._sample(logits, sampled)
            now = time.monotonic()
            for s, (token_ids, lps, accepted) in zip(sampled, new_tokens, strict=True):
                seq = s.seq
                # K/V of the accepted proposals was computed this step; the rest of the proposals'
                # slots are released below (or with the sequence if it finishes)
                seq.num_computed_tokens += accepted
                finished = False
                for token_id, lp in zip(token_ids, lps, strict=True):
                    seq.append_token(token_id, lp)
                    self.generation_tokens += 1
                    if seq.grammar is not None and not seq.grammar.accept(token_id):
                        # the mask allowed only tokens the grammar accepts: a bug, not the client's
                        log.error("request %s: token %d violates its grammar", seq.seq_id, token_id)
                        seq.finish_reason, seq.stop_reason = "abort", None
                        finished = True
                        break
                    if seq.check_stop():
                        finished = True
                        break
                if seq.first_token_time is None:
                    seq.first_token_time = now
                if finished:
                    self.scheduler.finish(seq)
                elif s.num_spec_tokens:
                    self._commit_speculation(seq)
                outputs.append(self._output(self.requests[seq.seq_id]))
            for seq in seqs:
                seq.spec_token_ids = []
                seq.spec_draft_probs = None
        return outputs

    def _sample(
        self, logits: torch.Tensor, sampled: list[ScheduledSeq]
    ) -> list[tuple[list[int], list[TokenLogprob | None], int]]:
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
        out: list[tuple[list[int], list[TokenLogprob | None], int]] = [([], [], 0)] * len(sampled)
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

    def _commit_speculation(self, seq: Sequence) -> None:
        """After verification: release the slots past the sequence's tokens and publish blocks the
        accepted tokens completed; the draft model's cache keeps only what is still valid."""
        self.block_manager.trim(seq)
        self.block_manager.cache_full_blocks(seq)
        seq.draft_num_computed = min(seq.draft_num_computed, seq.num_computed_tokens)

    def _drop_speculation(self, sched: SchedulerOutput) -> None:
        """A failed step: forget its proposals and their slots (nothing was committed)."""
        for s in sched.scheduled:
            if s.num_spec_tokens:
                s.seq.spec_token_ids = []
                s.seq.spec_draft_probs = None
                self.block_manager.trim(s.seq)
                s.seq.draft_num_computed = min(s.seq.draft_num_computed, s.seq.num_computed_tokens)

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
        if finished:
            del self.requests[seq.seq_id]
        return RequestOutput(
            request_id=seq.seq_id,
            prompt_token_ids=seq.prompt_token_ids,
            output=CompletionOutput(new, lps, seq.finish_reason, seq.stop_reason),
            finished=finished,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=RequestMetrics(seq.arrival_time, seq.first_scheduled_time),
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


@dataclass
class _Pending:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float
    queue: asyncio.Queue[RequestOutput | BaseException]
    lora: str | None = None


@dataclass
class _LoRAOp:
    """An adapter load or unload, run by the engine thread between steps (tensor-parallel workers
    take their part of it through the same pipe as the steps)."""

    name: str
    path: str | None  # None: unload
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]


@dataclass
class _Inbox:
    lock: threading.Lock = field(default_factory=threading.Lock)
    new: list[_Pending] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    lora_ops: list[_LoRAOp] = field(default_factory=list)


class AsyncEngine:
    """Runs `LLMEngine` in a background thread and streams each request's outputs to asyncio.

    Watchdog: the thread records a monotonic heartbeat at every turn of its loop (each step, each
    idle wait of at most 0.5 s); `health()` judges it (runtime/engine/health.py): no progress for
    `stall_timeout` s while there is work means the loop is stuck, and /health and /ready say so."""

    def __init__(
        self,
        engine: LLMEngine,
        max_queue_len: int = 1024,
        stall_timeout: float | None = None,
        grammar_limits: GrammarLimits | None = None,
    ) -> None:
        self.engine = engine
        # compiles requests' grammars before they are submitted (the server awaits compile_grammar)
        self.grammar = GrammarService(lambda: engine.grammar_compiler, grammar_limits)
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.max_queue_len = max_queue_len
        self.kv_capacity_tokens = engine.kv_capacity_tokens
        self._inbox = _Inbox()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._queues: dict[
            str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]
        ] = {}
        self._stats = engine.stats()
        self._num_unfinished = 0
        self._num_queued = 0  # waiting in the scheduler plus not yet picked up
        self.dead: BaseException | None = None
        # the watchdog: the heartbeat and the turn flag are written by the engine thread only
        self.stall_timeout = engine.cfg.engine_stall_timeout if stall_timeout is None else stall_timeout
        self._heartbeat = time.monotonic()
        self._in_turn = False  # the loop is doing something other than waiting for work
        self._reported_healthy = True

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> AsyncEngine:
        return cls(
            LLMEngine.from_config(cfg), cfg.max_queue_len, grammar_limits=GrammarLimits.from_config(cfg)
        )

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            # the grammar compiler's vocabulary table takes about a second and the grammar workers
            # start in a few: off both the event loop and the engine loop, before the first
            # guided request needs them
            threading.Thread(target=self.grammar.warm_up, name="kvpilot-grammar-init", daemon=True).start()
            self._thread = threading.Thread(target=self._run, name="kvpilot-engine", daemon=True)
            self._thread.start()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread, waiting up to `timeout` s for its step to end, and release the
        runner. A thread stuck in a step cannot be interrupted: it is left behind (a daemon thread,
        which the process exit ends; `kvpilot serve` bounds that exit, runtime/serving/lifecycle.py)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
            if self._thread.is_alive():
                log.error(
                    "the engine thread did not stop within %.0fs (stuck in a step); leaving it behind",
                    timeout,
                )
            self._thread = None
        self.grammar.close()
        self.engine.close()

    def num_unfinished(self) -> int:
        return self._num_unfinished

    def stats(self) -> EngineStats:
        """The engine thread's last snapshot, completed with what it cannot publish while a step
        runs (or is stuck): the running batch, read live (a length: safe from another thread), and
        as waiting every other admitted, unfinished request (the inbox and requests being prepared
        as well as the scheduler's queue); and the watchdog's reading."""
        with self._inbox.lock:
            snapshot, unfinished = self._stats, self._num_unfinished
        running = len(self.engine.scheduler.running)
        return dataclasses.replace(
            snapshot,
            num_running=running,
            num_waiting=max(0, unfinished - running),
            engine_stalled=int(not self.health().healthy),
            engine_heartbeat_age_seconds=self.heartbeat_age(),
        )

    # -- the watchdog --------------------------------------------------------------------------
    def heartbeat_age(self) -> float:
        """Seconds since the engine loop last made progress (finished a step or an idle wait)."""
        return max(0.0, time.monotonic() - self._heartbeat)

    def has_work(self) -> bool:
        """A turn is under way, or admitted requests are unfinished."""
        return self._in_turn or self._num_unfinished > 0

    def health(self) -> EngineHealth:
        """What /health and /ready report about the engine (runtime/engine/health.py); logs each change."""
        if self.dead is not None:
            return engine_stopped(self.dead)
        verdict = judge_progress(self.heartbeat_age(), self.has_work(), self.stall_timeout)
        if verdict.healthy != self._reported_healthy:
            self._reported_healthy = verdict.healthy
            if verdict.healthy:
                log.warning("the engine loop is making progress again")
            else:
                log.error("engine stalled: %s; /health and /ready answer 503", verdict.reason)
        return verdict

    # -- requests ------------------------------------------------------------------------------
    async def compile_grammar(self, spec: GuidedSpec) -> CompiledGuided:
        """Compile a request's constraint before `add_request` (GrammarService.compile); attach the
        result to the spec (`GuidedSpec.with_compiled`) so the engine loop never compiles."""
        return await self.grammar.compile(spec)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Enqueue; raises QueueFullError or EngineDeadError. A request the engine can never run
        (`LLMEngine.validate_request`, an adapter that is not loaded) fails its stream with
        ValueError; the server checks the same limits before it submits (api_request.py), so its
        clients get the 400 up front. `lora`: the adapter to run with (None: the base model)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        if self._num_queued >= self.max_queue_len:
            raise QueueFullError(f"{self._num_queued} requests are already waiting (max_queue_len)")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        pending = _Pending(request_id, prompt_token_ids, params, cache_salt, time.monotonic(), queue, lora)
        self._queues[request_id] = (loop, queue)
        with self._inbox.lock:
            self._inbox.new.append(pending)
            self._num_queued += 1
            self._num_unfinished += 1
        self._wake.set()
        return self._stream(request_id, queue)

    async def _stream(
        self, request_id: str, queue: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                # coalesce what piled up while the consumer was busy
                while not item.finished and not queue.empty():
                    nxt = queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        raise nxt
                    item = _merge(item, nxt)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # consumer went away (client disconnected, stop string hit)
                self.abort_nowait(request_id)

    # -- LoRA adapters -------------------------------------------------------------------------
    @property
    def loras(self) -> list[LoadedAdapter]:
        """The loaded adapters, in load order."""
        return self.engine.adapters.loaded()

    @property
    def lora_enabled(self) -> bool:
        return self.engine.adapters.enabled

    async def add_lora(self, name: str, path: str) -> None:
        """Load (or replace) an adapter between steps; raises LoRAError naming the problem."""
        await self._lora_op(name, path)

    async def remove_lora(self, name: str) -> None:
        await self._lora_op(name, None)

    async def _lora_op(self, name: str, path: str | None) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        loop = asyncio.get_running_loop()
        op = _LoRAOp(name, path, loop, loop.create_future())
        with self._inbox.lock:
            self._inbox.lora_ops.append(op)
        self._wake.set()
        await op.future

    def _run_lora_ops(self, ops: list[_LoRAOp]) -> None:
        for op in ops:
            error = self.engine.adapters.apply(op.name, op.path)
            with contextlib.suppress(RuntimeError):  # the loop is closed
                op.loop.call_soon_threadsafe(_settle, op.future, error)

    def abort_nowait(self, request_id: str) -> None:
        with self._inbox.lock:
            self._inbox.aborts.append(request_id)
        self._wake.set()

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    # -- the engine thread ---------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        with self._inbox.lock:
            new, self._inbox.new = self._inbox.new, []
            aborts, self._inbox.aborts = self._inbox.aborts, []
            lora_ops, self._inbox.lora_ops = self._inbox.lora_ops, []
        self._run_lora_ops(lora_ops)
        for p in new:
            try:
                self.engine.add_request(
                    p.request_id, p.prompt_token_ids, p.params, p.cache_salt, p.arrival_time, p.lora
                )
            except ValueError as exc:
                self._deliver(p.request_id, exc)
                with self._inbox.lock:
                    self._num_unfinished -= 1
        for rid in aborts:
            out = self.engine.abort(rid)
            if out is not None:
                self._deliver(rid, out)
                with self._inbox.lock:
                    self._num_unfinished -= 1

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        entry = self._queues.get(request_id)
        if entry is None:
            return
        loop, queue = entry
        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _refresh_counts(self) -> None:
        self._stats = self.engine.stats()
        with self._inbox.lock:
            self._num_queued = len(self.engine.scheduler.waiting) + len(self._inbox.new)

    def _beat(self, in_turn: bool) -> None:
        self._heartbeat = time.monotonic()
        self._in_turn = in_turn

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._beat(in_turn=True)
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._refresh_counts()
                    self._beat(in_turn=False)
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                for out in outputs:
                    self._deliver(out.request_id, out)
                    if out.finished:
                        with self._inbox.lock:
                            self._num_unfinished -= 1
                self._refresh_counts()
        except BaseException as exc:  # a bug, not a bad request: fail everyone loudly, keep the server up
            log.exception("engine loop died")
            self.dead = exc
            for rid in list(self._queues):
                self._deliver(rid, EngineDeadError(f"the engine stopped: {exc}"))
        finally:
            self._in_turn = False


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # the caller went away
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    ca, cb = a.output, b.output
    lps = None
    if ca.logprobs is not None or cb.logprobs is not None:
        lps = (ca.logprobs or []) + (cb.logprobs or [])
    merged = CompletionOutput(ca.new_token_ids + cb.new_token_ids, lps, cb.finish_reason, cb.stop_reason)
    return RequestOutput(b.request_id, b.prompt_token_ids, merged, b.finished, b.num_cached_tokens, b.metrics)
