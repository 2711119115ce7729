"""Turns a scheduled batch into flat tensors, runs the model, returns the logits to sample from.

The runner, not the model, chooses how a step executes: the model's own forward, a decode CUDA
graph (runtime/engine/cuda_graphs.py) on a GPU, or on a CPU the decoder stack in one C call
(runtime/models/cpu_stack.py), each picked once at construction from the attention backend (one
choice: kernels/attention.choose_backend) and the kernel switches (kernels/switches.py), and used for
the steps it fits.

Flat batch layout (one row per new token across all scheduled sequences):
input ids, positions, slot mapping; per sequence: query start offsets, context lengths and the
block table. Only the last token of a sequence that reaches its end this step is turned into logits
(plus one row per speculative token of a sequence whose proposals are verified in this step, and
the prompt rows of a sequence that asked for prompt logprobs: runtime/engine/prompt_logprobs.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch

from kvpilot.kernels import isa, quant, switches
from kvpilot.kernels.attention import (
    AttentionBackend,
    AttentionMetadata,
    KVCacheLayer,
    model_heads,
    select_backend,
)
from kvpilot.kernels.switches import KernelSwitches
from kvpilot.runtime.config import ConfigError, EngineConfig
from kvpilot.runtime.engine.cuda_graphs import DecodeGraphRunner
from kvpilot.runtime.engine.prompt_logprobs import PromptRows, split, token_logprobs
from kvpilot.runtime.engine.protocol import TokenLogprob
from kvpilot.runtime.engine.scheduler import ScheduledSeq
from kvpilot.runtime.engine.sequence import Sequence
from kvpilot.runtime.lora.manager import LoRAState, SlotTable
from kvpilot.runtime.models.layers import resident_bytes

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30


def kernel_switches(cfg: EngineConfig) -> KernelSwitches:
    """The kernel switches `cfg` sets, with the environment's overrides (kernels/switches.py).
    Raises ConfigError naming the flag for an ISA level this CPU cannot run."""
    configured = KernelSwitches(
        cpu_isa=None if cfg.cpu_isa == "auto" else cfg.cpu_isa,
        cpu_kernels=cfg.cpu_kernels,
        qmatmul_activations=cfg.qmatmul_activations or "int8",
        cpu_decoder_stack=cfg.cpu_decoder_stack,
        kernel_cache=cfg.kernel_cache_dir,
    )
    try:
        resolved = switches.resolve(configured)
    except ValueError as e:  # names the environment variable
        raise ConfigError(str(e)) from None
    if resolved.cpu_isa is not None:
        try:
            isa.choose(isa.cpu_features(), resolved.cpu_isa, isa.is_x86())
        except ValueError as e:
            raise ConfigError(f"--cpu-isa {resolved.cpu_isa}: {e}") from None
    return resolved


def apply_kernel_switches(cfg: EngineConfig) -> KernelSwitches:
    """Put `cfg`'s kernel switches in force for this process (before the model is loaded: the
    weights' layout follows them); returns them."""
    resolved = kernel_switches(cfg)
    switches.use(resolved)
    return resolved


class Forward(Protocol):
    """A step's forward: the model's own, or one the runner compiled (runtime/models/cpu_stack.py)."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCacheLayer],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class CausalLM(Protocol):
    """What the runner needs from a model (see runtime/models/llama.py)."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCacheLayer],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int  # per tensor-parallel rank
    head_dim: int
    block_size: int
    dtype: torch.dtype  # storage dtype

    @property
    def bytes_per_block(self) -> int:
        elems = 2 * self.num_layers * self.block_size * self.num_kv_heads
        size = elems * self.head_dim * torch.empty((), dtype=self.dtype).element_size()
        if quant.is_quantized(self.dtype):
            size += elems * quant.SCALE_DTYPE.itemsize  # one scale per (token, head)
        return size

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    def num_blocks_for(self, budget_bytes: int) -> int:
        return max(0, budget_bytes // self.bytes_per_block)


def kv_geometry(arch: Any, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> KVGeometry:
    num_kv_heads = int(arch.num_key_value_heads)
    return KVGeometry(
        num_layers=int(arch.num_hidden_layers),
        num_kv_heads=max(1, num_kv_heads // tp_size),
        head_dim=int(arch.head_dim),
        block_size=block_size,
        dtype=dtype,
    )


def allocate_kv_cache(
    geo: KVGeometry, num_blocks: int, device: torch.device, tiled: bool = False
) -> list[KVCacheLayer]:
    """One [num_blocks, block_size, kv_heads, head_dim] K and V per layer. `tiled`: the CPU kernel's
    storage (K^T and V tiles per block and head, see kernels/cpu_attention.py), seen through the
    same logical shape."""
    from kvpilot.kernels.cpu_attention import head_major_v_cache, transposed_k_cache

    shape = (num_blocks, geo.block_size, geo.num_kv_heads, geo.head_dim)
    layers = []
    for _ in range(geo.num_layers):
        if tiled:
            k = transposed_k_cache(*shape, dtype=geo.dtype, device=device)
            v = head_major_v_cache(*shape, dtype=geo.dtype, device=device)
        else:
            k = torch.zeros(shape, dtype=geo.dtype, device=device)
            v = torch.zeros(shape, dtype=geo.dtype, device=device)
        ks = vs = None
        if quant.is_quantized(geo.dtype):
            ks = torch.zeros(shape[:-1], dtype=quant.SCALE_DTYPE, device=device)
            vs = torch.zeros(shape[:-1], dtype=quant.SCALE_DTYPE, device=device)
        layers.append(KVCacheLayer(k, v, ks, vs))
    return layers


def warmup_batch(
    num_tokens: int, num_seqs: int, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, int]:
    """Pure: the largest step the scheduler can send, as a synthetic prefill of `num_tokens` tokens
    spread over min(num_seqs, num_tokens) sequences, each in its own consecutive blocks.
    Returns (input_ids, positions, meta, sample_rows, blocks needed)."""
    seqs = max(1, min(num_seqs, num_tokens))
    lens = [num_tokens // seqs + (1 if i < num_tokens % seqs else 0) for i in range(seqs)]
    nblocks = [(n + block_size - 1) // block_size for n in lens]
    width = max(nblocks)
    tables: list[list[int]] = []
    slots: list[int] = []
    positions: list[int] = []
    qsl = [0]
    first = 0
    for n, nb in zip(lens, nblocks, strict=True):
        table = list(range(first, first + nb))
        tables.append(table + [0] * (width - nb))
        slots.extend(first * block_size + p for p in range(n))
        positions.extend(range(n))
        qsl.append(qsl[-1] + n)
        first += nb
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        query_lens_cpu=lens,
        seq_lens_cpu=list(lens),
        max_query_len=max(lens),
        max_seq_len=max(lens),
    )
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    pos = torch.tensor(positions, dtype=torch.int64, device=device)
    sample_rows = torch.tensor([q - 1 for q in qsl[1:]], dtype=torch.int64, device=device)
    return ids, pos, meta, sample_rows, first


@torch.inference_mode()
def warmup_forward(
    model: CausalLM,
    geometry: KVGeometry,
    device: torch.device,
    num_tokens: int,
    num_seqs: int,
    backend: AttentionBackend,
) -> int:
    """Run the largest step once (all layers, attention, logits of every sequence) on a throw-away KV
    pool just big enough for it; returns that pool's size in bytes (the caller subtracts it from the
    measured peak: the real pool is sized separately)."""
    ids, pos, meta, rows, nblocks = warmup_batch(num_tokens, num_seqs, geometry.block_size, device)
    caches = allocate_kv_cache(geometry, nblocks, device, bool(getattr(backend, "tiled_kv", False)))
    hidden = model(ids, pos, caches, meta, backend)
    model.compute_logits(hidden.index_select(0, rows)).float()
    return nblocks * geometry.bytes_per_block


@dataclass(frozen=True)
class MemoryProfile:
    """What a warm-up measured on a GPU (bytes)."""

    total: int  # device memory
    free: int  # free after the warm-up, allocator cache emptied (the rest: this engine, other engines/processes)
    own: int  # this engine's model on the device (parameters, buffers, quantized weights)
    activation_peak: int  # the largest step's transient tensors beyond the weights

    def share_budget(self, gpu_memory_utilization: float) -> int:
        """The engine's share of the device, less its own weights and largest step."""
        return int(self.total * gpu_memory_utilization) - self.own - self.activation_peak

    def free_budget(self) -> int:
        """What can be allocated now, less the largest step's activations."""
        return self.free - self.activation_peak


def kv_budget_from_profile(profile: MemoryProfile, gpu_memory_utilization: float) -> int:
    """Pure: the KV pool is what is left of this engine's `--gpu-memory-utilization` share of the device
    after its own weights and the largest step's activations, and never more than is free. The share is
    per engine (vLLM's rule): two engines on one GPU at 0.45 each get the same pool, whichever started
    first; memory that others hold only caps the pool when the share would not fit in what is free."""
    return min(profile.share_budget(gpu_memory_utilization), profile.free_budget())


def profile_memory(
    model: CausalLM,
    geometry: KVGeometry,
    device: torch.device,
    num_tokens: int,
    num_seqs: int,
    backend: AttentionBackend | None = None,
) -> MemoryProfile:
    """CUDA only: warm up at the largest step and measure its peak (torch.cuda.max_memory_allocated)."""
    backend = backend or select_backend(
        device, quant.is_quantized(geometry.dtype), geometry.block_size, geometry.dtype
    )
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    pool_bytes = warmup_forward(model, geometry, device, num_tokens, num_seqs, backend)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    profile = MemoryProfile(
        total=total,
        free=free,
        own=resident_bytes(cast(torch.nn.Module, model)),
        activation_peak=max(0, peak - before - pool_bytes),
    )
    log.info(
        "memory profile: %.2f GiB of weights, %.2f GiB free of %.2f GiB after warm-up, %.2f GiB peak "
        "activations (%d tokens, %d seqs)",
        profile.own / 2**30,
        profile.free / 2**30,
        profile.total / 2**30,
        profile.activation_peak / 2**30,
        num_tokens,
        num_seqs,
    )
    return profile


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # rows of the flat batch whose logits are sampled from
    sampled: list[ScheduledSeq]  # a sequence with K speculative tokens owns K + 1 consecutive rows
    prompt: PromptRows = field(default_factory=PromptRows)  # rows that give prompt logprobs

    @property
    def logit_rows(self) -> torch.Tensor:
        """Every row whose final hidden state is needed: the prompt rows, then the sample rows."""
        if not self.prompt.rows:
            return self.sample_indices
        prompt = torch.tensor(self.prompt.rows, dtype=torch.int64, device=self.sample_indices.device)
        return torch.cat([prompt, self.sample_indices])


@dataclass
class StepLogits:
    """What a step's model run gives the engine."""

    logits: torch.Tensor  # float32 [rows, vocab] of `sampled`
    sampled: list[ScheduledSeq]
    prompt_logprobs: list[tuple[Sequence, list[TokenLogprob]]] = field(default_factory=list)


def prepare_batch(scheduled: list[ScheduledSeq], block_size: int, device: torch.device) -> PreparedBatch:
    """Pure: the scheduled chunks -> the flat tensors the model and attention read."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    sample_rows: list[int] = []
    sampled: list[ScheduledSeq] = []
    prompt = PromptRows()
    max_blocks = 0
    for s in scheduled:
        seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
        end = start + n
        lp_positions = s.prompt_logprob_positions
        if lp_positions:
            prompt.add(seq, len(input_ids) + lp_positions.start - start, lp_positions)
        input_ids.extend(seq.token_ids[start:end])
        if s.num_spec_tokens:  # the proposals follow the sequence's own tokens
            input_ids.extend(seq.spec_token_ids[: s.num_spec_tokens])
        positions.extend(range(start, end))
        table = seq.block_table
        for pos in range(start, end):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        query_lens.append(n)
        seq_lens.append(end)
        max_blocks = max(max_blocks, len(table))
        if s.samples:
            # one row per proposal plus the bonus row: rows i..K score the proposal after row i
            sample_rows.extend(range(len(input_ids) - 1 - s.num_spec_tokens, len(input_ids)))
            sampled.append(s)
    tables = [s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table)) for s in scheduled]
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)

    def t(x: list[Any], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, device=device)

    meta = AttentionMetadata(
        slot_mapping=t(slots, torch.int64),
        query_start_loc=t(qsl, torch.int32),
        seq_lens=t(seq_lens, torch.int32),
        block_tables=t(tables, torch.int32),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return PreparedBatch(
        input_ids=t(input_ids, torch.int64),
        positions=t(positions, torch.int64),
        meta=meta,
        sample_indices=t(sample_rows, torch.int64),
        sampled=sampled,
        prompt=prompt,
    )


class ModelRunner:
    """Owns the model, the KV pool and the attention backend on one device."""

    def __init__(
        self,
        model: CausalLM,
        geometry: KVGeometry,
        num_blocks: int,
        device: torch.device,
        backend: AttentionBackend | None = None,
        cuda_graph_sizes: list[int] | None = None,
        max_model_len: int | None = None,
        kernels: KernelSwitches | None = None,
    ) -> None:
        """`cuda_graph_sizes`: capture decode CUDA graphs for these batch sizes (None: eager, as with
        --enforce-eager); needs a CUDA device, a capture-safe backend and `max_model_len`.
        `kernels`: the kernel switches (default: those in force, kernels/switches.current())."""
        from kvpilot.runtime.models.cpu_stack import CompiledStack, compile_stack

        self.model = model
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.device = device
        self.backend = backend or select_backend(
            device,
            quant.is_quantized(geometry.dtype),
            geometry.block_size,
            geometry.dtype,
            model_heads(model),
        )
        tiled = bool(getattr(self.backend, "tiled_kv", False))
        self.kv_caches = allocate_kv_cache(geometry, num_blocks, device, tiled)
        log.info(
            "KV pool: %d blocks x %d tokens (%.0f MiB, %s, attention backend %s)",
            num_blocks,
            geometry.block_size,
            num_blocks * geometry.bytes_per_block / 2**20,
            geometry.dtype,
            self.backend.name,
        )
        self.graphs: DecodeGraphRunner | None = None
        if cuda_graph_sizes:
            if device.type != "cuda" or max_model_len is None:
                raise ValueError("CUDA graphs need a CUDA device and max_model_len")
            if not getattr(self.backend, "graph_safe", False):
                log.warning(
                    "attention backend %s is not CUDA-graph safe: decode runs eagerly", self.backend.name
                )
            else:
                max_blocks = -(-max_model_len // geometry.block_size)
                self.graphs = DecodeGraphRunner(
                    model, self.kv_caches, self.backend, cuda_graph_sizes, max_blocks, device
                )
        # the decoder stack in one C call: CPU steps of few tokens (runtime/models/cpu_stack.py)
        self.compiled: CompiledStack | None = None
        if device.type == "cpu":
            enabled = (kernels or switches.current()).cpu_decoder_stack
            self.compiled, why = compile_stack(model, self.kv_caches, self.backend, enabled)
            log.info("decoder stack in one C call: %s", "yes, " + why if self.compiled else "no, " + why)

    # -- LoRA ----------------------------------------------------------------------------------
    lora: LoRAState | None = None
    lora_slots: SlotTable | None = None

    def enable_lora(self, state: LoRAState) -> None:
        """Serve adapters through `state` (attached to this runner's model before the KV pool was sized)."""
        if self.graphs is not None:
            raise ValueError("LoRA serving runs eagerly: build the runner without CUDA graphs")
        self.compiled = None  # the C stack has no LoRA path
        self.lora = state
        self.lora_slots = SlotTable(state.num_slots)

    def add_lora(self, name: str, path: str) -> int:
        """Load an adapter into host memory (replacing one of the same name); returns its rank.
        Raises LoRAError (bad adapter) before anything changes."""
        assert self.lora is not None and self.lora_slots is not None
        adapter = self.lora.read(name, path)
        self.lora_slots.drop(name)
        self.lora.add(adapter)
        return adapter.rank

    def remove_lora(self, name: str) -> None:
        assert self.lora is not None and self.lora_slots is not None
        self.lora_slots.drop(name)
        self.lora.remove(name)

    def lora_plan(
        self, scheduled: list[ScheduledSeq], reorder: bool = True
    ) -> tuple[list[ScheduledSeq], list[tuple[int, str | None]], list[int] | None]:
        """Rank 0: the step's sequences (with `reorder`: base-model ones first, then by slot, so each
        adapter's rows are consecutive), the slot loads it needs and every token's slot (-1: the base
        model); (scheduled, no loads, None) when no sequence uses an adapter."""
        if self.lora_slots is None or all(s.seq.lora is None for s in scheduled):
            return scheduled, [], None
        names = [s.seq.lora.name for s in scheduled if s.seq.lora is not None]
        slot_of, loads = self.lora_slots.plan(names)

        def slot(s: ScheduledSeq) -> int:
            return slot_of[s.seq.lora.name] if s.seq.lora is not None else -1

        if reorder:
            scheduled = sorted(scheduled, key=slot)  # stable
        token_slots: list[int] = []
        for s in scheduled:
            token_slots.extend([slot(s)] * s.num_new_tokens)
        return scheduled, loads, token_slots

    def _apply_lora(self, scheduled: list[ScheduledSeq], reorder: bool) -> list[ScheduledSeq]:
        if self.lora is None:
            return scheduled
        scheduled, loads, token_slots = self.lora_plan(scheduled, reorder)
        self.lora.apply(loads, token_slots)
        return scheduled

    def _run_model(self, batch: PreparedBatch, logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states of every row, or of `logit_rows` only (CausalLM.forward): a CUDA
        graph or the compiled C stack for the steps they fit, else the model's own forward."""
        if self.graphs is not None and self.graphs.fits(batch.meta):
            hidden = self.graphs.run(batch.input_ids, batch.positions, batch.meta)
            return hidden if logit_rows is None else hidden.index_select(0, logit_rows)
        forward: Forward = self.model
        if self.compiled is not None and self.compiled.fits(batch.input_ids.shape[0]):
            forward = self.compiled
        return forward(batch.input_ids, batch.positions, self.kv_caches, batch.meta, self.backend, logit_rows)

    def close(self) -> None:
        """Release what the runner holds besides memory: nothing here; the tensor-parallel runner
        (runtime/engine/tp/runner.py) stops its worker processes."""

    @torch.inference_mode()
    def hidden_states(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run one step and return the hidden state of every new token (scoring, prompt logprobs)."""
        scheduled = self._apply_lora(scheduled, reorder=False)  # rows come back in the caller's order
        batch = prepare_batch(scheduled, self.geometry.block_size, self.device)
        try:
            return self._run_model(batch)
        finally:
            if self.lora is not None:
                self.lora.clear()

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> StepLogits:
        """Run one step; returns float32 logits [rows, vocab] and the sequences they belong to (one row
        each, 1 + num_spec_tokens for a sequence with speculative tokens), and the prompt logprobs
        the step's prefill chunks gave."""
        scheduled = self._apply_lora(scheduled, reorder=True)  # `sampled` says the order
        batch = prepare_batch(scheduled, self.geometry.block_size, self.device)
        rows = batch.logit_rows
        try:
            if self.lora is None:
                hidden = self._run_model(batch, rows)  # the last layer runs these rows only
            else:  # LoRA's per-token adapter slots cover every row of every layer
                hidden = self._run_model(batch).index_select(0, rows)
        finally:
            if self.lora is not None:
                self.lora.clear()
        return self.step_logits(hidden, batch)

    def step_logits(self, hidden: torch.Tensor, batch: PreparedBatch) -> StepLogits:
        """`hidden`: the final hidden states of `batch.logit_rows` -> the step's logits and prompt
        logprobs (through `self.model.compute_logits`, which a tensor-parallel group runs together)."""
        n = len(batch.prompt)
        prompt: list[tuple[Sequence, list[TokenLogprob]]] = []
        if n:
            p = batch.prompt
            prompt = split(p, token_logprobs(hidden[:n], p.targets, p.top_k, self.model.compute_logits))
        if not batch.sampled:
            return StepLogits(torch.empty(0, 0), [], prompt)
        return StepLogits(self.model.compute_logits(hidden[n:]).float(), batch.sampled, prompt)
