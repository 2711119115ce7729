"""Tensor parallelism, rank 0's side: check the size against the model, start the workers, and a
model runner that takes them along on every step.

Rank 0 lives in the engine process and is a normal `ModelRunner` over its own shard and KV pool
shard; before each step it sends the step's flat inputs to ranks 1..N-1 (runtime/engine/tp/worker.py),
which run the same forward on theirs. Row-parallel all-reduces and the logits all-gather inside the
model keep the ranks in lockstep; only rank 0 samples. The scheduler and block manager are rank 0's
alone: every rank's pool has the same number of blocks, so one block table serves them all.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from kvpilot.kernels.attention import AttentionMetadata
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.plan import RankPlan, plan_ranks, with_block_size
from kvpilot.runtime.engine.runner import (
    KVGeometry,
    ModelRunner,
    PreparedBatch,
    StepLogits,
    kv_geometry,
    prepare_batch,
)
from kvpilot.runtime.engine.scheduler import ScheduledSeq
from kvpilot.runtime.engine.tp.distributed import (
    GroupSpec,
    TensorParallelError,
    Workers,
    join_group,
    leave_group,
)
from kvpilot.runtime.models import CausalLM, ModelArchConfig

if TYPE_CHECKING:
    from kvpilot.runtime.load.loader import LoadedModel

log = logging.getLogger(__name__)

__all__ = ["TPModelRunner", "TensorParallelError", "check_tensor_parallel", "start_tensor_parallel"]


# ---------------------------------------------------------------------------------------------
# Which sizes a model supports


def _problems(arch: ModelArchConfig, tp: int, expert_parallel: bool = False) -> list[str]:
    kv = arch.num_key_value_heads
    problems = []
    if arch.num_attention_heads % tp:
        problems.append(f"{arch.num_attention_heads} attention heads")
    if (kv % tp) if tp <= kv else (tp % kv):  # more ranks than KV heads: each head is replicated
        problems.append(f"{kv} KV heads (nor is it a multiple of them)")
    if (not arch.is_moe or arch.dense_mlp_layers) and arch.intermediate_size % tp:
        problems.append(f"MLP width of {arch.intermediate_size}")
    if arch.is_moe:
        if expert_parallel and arch.num_experts % tp:
            problems.append(f"{arch.num_experts} experts")
        if not expert_parallel and arch.moe_intermediate_size % tp:
            problems.append(f"expert width of {arch.moe_intermediate_size}")
        if arch.shared_expert_intermediate_size % tp:  # the shared expert is split even under EP
            problems.append(f"shared-expert width of {arch.shared_expert_intermediate_size}")
    return problems


def check_tensor_parallel(arch: ModelArchConfig, tp: int, expert_parallel: bool = False) -> None:
    """Raise ValueError unless `tp` ranks can split this model's heads, MLP and experts evenly
    (with `expert_parallel`: hold an equal number of whole experts each)."""
    if expert_parallel and not arch.is_moe:
        raise ValueError(
            f"--enable-expert-parallel needs a Mixture-of-Experts model; {arch.architecture} is dense"
        )
    problems = _problems(arch, tp, expert_parallel)
    if problems:
        valid = [n for n in range(1, arch.num_attention_heads + 1) if not _problems(arch, n, expert_parallel)]
        flag = f"--tensor-parallel-size {tp}" + (" with --enable-expert-parallel" if expert_parallel else "")
        raise ValueError(
            f"{flag} does not divide the model's {' or its '.join(problems)}; "
            f"sizes this model supports: {', '.join(map(str, valid))}"
        )


def read_arch(path: Path) -> ModelArchConfig:
    """The architecture of a resolved model path, without loading weights."""
    from kvpilot.runtime.load.gguf_checkpoint import gguf_arch_config
    from kvpilot.runtime.load.gguf_reader import GGUFFile
    from kvpilot.runtime.load.hf_checkpoint import hf_arch_config

    if path.is_file():
        with GGUFFile(path) as f:
            return gguf_arch_config(f)
    return hf_arch_config(path)


# ---------------------------------------------------------------------------------------------
# What every rank does to start


def bind_rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r uses GPU r (of those visible); on the CPU all ranks share the host."""
    if device.type != "cuda":
        return device
    bound = torch.device("cuda", rank)
    torch.cuda.set_device(bound)
    return bound


def load_shard(plan: RankPlan, device: torch.device) -> tuple[LoadedModel, KVGeometry, int]:
    """Load this rank's shard; return it, its KV geometry and how many KV blocks fit on its device."""
    from kvpilot.kernels import quant
    from kvpilot.runtime.load.loader import load_model
    from kvpilot.runtime.models.parallel import set_expert_parallel

    cfg = plan.cfg
    assert cfg.block_size is not None  # plan_ranks() checks it
    set_expert_parallel(cfg.enable_expert_parallel)  # MoE layers read it as they are built
    loaded = load_model(cfg, device)  # layers read this rank's place in the group as they are built
    assert loaded.dtype == plan.dtype
    kv_dtype = quant.storage_dtype(cfg.kv_cache_dtype, loaded.dtype, device.type)
    geometry = kv_geometry(loaded.arch, cfg.block_size, kv_dtype, plan.world_size)
    return loaded, geometry, plan.pool_blocks(geometry, device)


# ---------------------------------------------------------------------------------------------
# A step's inputs, shipped from rank 0 to the workers


@dataclass(frozen=True)
class StepInputs:
    """One step's flat batch as host arrays. Rank 0 sends it to every worker and every rank, rank 0
    included, builds its device tensors from it, so all ranks run on identical inputs."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    sample_indices: np.ndarray
    query_lens: list[int]
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    # LoRA: slot loads to do before the forward, and each token's slot (None: no adapter this step)
    lora_loads: tuple[tuple[int, str | None], ...] = ()
    lora_token_slots: list[int] | None = None

    @classmethod
    def from_batch(
        cls,
        batch: PreparedBatch,
        lora: tuple[list[tuple[int, str | None]], list[int] | None] = ([], None),
    ) -> StepInputs:
        """From a batch prepared on the CPU (and rank 0's LoRA plan for it)."""
        meta = batch.meta
        return cls(
            input_ids=batch.input_ids.numpy(),
            positions=batch.positions.numpy(),
            slot_mapping=meta.slot_mapping.numpy(),
            query_start_loc=meta.query_start_loc.numpy(),
            seq_lens=meta.seq_lens.numpy(),
            block_tables=meta.block_tables.numpy(),
            sample_indices=batch.sample_indices.numpy(),
            query_lens=list(meta.query_lens_cpu),
            seq_lens_list=list(meta.seq_lens_cpu),
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            lora_loads=tuple(lora[0]),
            lora_token_slots=lora[1],
        )

    def to_device(
        self, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids, positions, attention metadata, sample rows) on `device`."""

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=t(self.slot_mapping),
            query_start_loc=t(self.query_start_loc),
            seq_lens=t(self.seq_lens),
            block_tables=t(self.block_tables),
            query_lens_cpu=self.query_lens,
            seq_lens_cpu=self.seq_lens_list,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
        )
        return t(self.input_ids), t(self.positions), meta, t(self.sample_indices)


# ---------------------------------------------------------------------------------------------
# Rank 0's runner


class ShardedModel:
    """`runner.model` under tensor parallelism: rank 0's shard (attributes, parameters), whose
    `compute_logits` brings the workers along, since the vocabulary all-gather is collective."""

    def __init__(self, shard: CausalLM, workers: Workers) -> None:
        self._shard = shard
        self._workers = workers

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.contiguous()
        with self._workers.step():
            self._workers.send("logits", (tuple(hidden.shape), hidden.dtype))
            dist.broadcast(hidden, src=0)
            return self._shard.compute_logits(hidden)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise TypeError("a tensor-parallel model runs through its runner (execute, hidden_states)")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shard, name)


def _shutdown(workers: Workers) -> None:
    workers.close()
    leave_group()


class TPModelRunner(ModelRunner):
    """A `ModelRunner` for rank 0 of a tensor-parallel group (same interface; the engine cannot tell).

    `close()` stops the workers; so does garbage collection of the runner and interpreter exit.
    """

    def __init__(self, loaded: LoadedModel, geometry: KVGeometry, num_blocks: int, workers: Workers) -> None:
        super().__init__(ShardedModel(loaded.model, workers), geometry, num_blocks, loaded.device)
        self.loaded = loaded
        self.shard = loaded.model
        self.workers = workers
        self._finalizer = weakref.finalize(self, _shutdown, workers)

    @property
    def tp_size(self) -> int:
        return self.workers.spec.world_size

    def close(self) -> None:
        self._finalizer()

    def add_lora(self, name: str, path: str) -> int:
        rank = super().add_lora(name, path)  # rank 0 checks the adapter before the workers read it
        with self.workers.step():
            self.workers.exchange("lora_add", (name, path), "lora_added")
        return rank

    def remove_lora(self, name: str) -> None:
        super().remove_lora(name)
        with self.workers.step():
            self.workers.exchange("lora_remove", name, "lora_removed")

    def export_kv_shard(self, rank: int, layer: int, block_ids: list[int]) -> bytes:
        """A KV transfer's BLOCKS data of worker `rank`'s pool (kv_transfer/blocks.export_run). Any
        thread: the worker answers between steps."""
        data: bytes = self.workers.request(rank, "kv_export", (layer, block_ids), "kv_exported")
        return data

    def import_kv_shard(self, rank: int, layer: int, block_ids: list[int], data: memoryview) -> None:
        """Engine thread: pulled blocks into worker `rank`'s pool (it copies them before the next step)."""
        self.workers.send_to(rank, "kv_import", (layer, block_ids, bytes(data)))

    def _inputs(
        self, scheduled: list[ScheduledSeq], reorder: bool = True
    ) -> tuple[StepInputs, PreparedBatch]:
        scheduled, loads, token_slots = self.lora_plan(scheduled, reorder)
        batch = prepare_batch(scheduled, self.geometry.block_size, torch.device("cpu"))
        return StepInputs.from_batch(batch, (loads, token_slots)), batch

    def _forward(self, inputs: StepInputs, logits: bool) -> torch.Tensor:
        """Every row's final hidden state, or with `logits` the sample rows' (as tp_worker's)."""
        ids, positions, meta, sample_rows = inputs.to_device(self.device)
        if self.lora is None:
            rows = sample_rows if logits else None
            return self.shard(ids, positions, self.kv_caches, meta, self.backend, rows)
        self.lora.apply(list(inputs.lora_loads), inputs.lora_token_slots)
        try:
            hidden = self.shard(ids, positions, self.kv_caches, meta, self.backend)
        finally:
            self.lora.clear()
        return hidden.index_select(0, sample_rows) if logits else hidden

    @torch.inference_mode()
    def hidden_states(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        inputs, _ = self._inputs(scheduled, reorder=False)
        with self.workers.step():
            self.workers.send("hidden", inputs)
            return self._forward(inputs, logits=False)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> StepLogits:
        inputs, batch = self._inputs(scheduled)
        if len(batch.prompt):
            # prompt logprobs: every row's hidden state, then the logits slice by slice through
            # ShardedModel.compute_logits (each slice's vocabulary all-gather brings the workers along)
            with self.workers.step():
                self.workers.send("hidden", inputs)
                hidden = self._forward(inputs, logits=False)
            return self.step_logits(hidden.index_select(0, batch.logit_rows.to(self.device)), batch)
        with self.workers.step():
            self.workers.send("execute", inputs)
            hidden = self._forward(inputs, logits=True)
            if not batch.sampled:
                return StepLogits(torch.empty(0, 0), [])
            logits = self.shard.compute_logits(hidden)
        return StepLogits(logits.float(), batch.sampled)


# ---------------------------------------------------------------------------------------------
# Starting the group


def start_tensor_parallel(cfg: EngineConfig) -> TPModelRunner:
    """Check the size, spawn ranks 1..N-1, load rank 0's shard here and size the KV pools (the
    smallest count any rank fits). The runner's `loaded` has the tokenizer and limits."""
    from kvpilot.runtime.engine.tp.worker import worker_main
    from kvpilot.runtime.load.loader import resolve_device, resolve_dtype, resolve_model_path

    tp = cfg.tensor_parallel_size
    check_tensor_parallel(read_arch(resolve_model_path(cfg.model)), tp, cfg.enable_expert_parallel)
    device = resolve_device(cfg.device)
    if device.type == "cuda" and torch.cuda.device_count() < tp:
        raise ValueError(f"--tensor-parallel-size {tp} needs {tp} GPUs; {torch.cuda.device_count()} visible")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized: one tensor-parallel engine per process")
    plan = plan_ranks(
        with_block_size(cfg, device), device.type, resolve_dtype(cfg.dtype, device), os.cpu_count() or 1
    )
    spec = GroupSpec.local(tp, device)
    # one progress bar while loading (rank 0's) is enough
    workers = Workers.spawn(spec, worker_main, lambda rank: (spec, plan), env={"TQDM_DISABLE": "1"})
    try:
        workers.gather("joining")
        if device.type == "cpu":
            torch.set_num_threads(plan.threads)
        torch.manual_seed(cfg.seed)
        device = bind_rank_device(device, 0)
        join_group(spec, 0)
        loaded, geometry, fits = load_shard(plan, device)
        num_blocks = min([fits, *workers.gather("loaded")])
        workers.send("kv_blocks", num_blocks)
        runner = TPModelRunner(loaded, geometry, num_blocks, workers)
        workers.gather("ready")
    except BaseException:
        _shutdown(workers)
        raise
    log.info(
        "tensor parallel: %d ranks (%s), worker pids %s, %d KV blocks per rank",
        tp,
        spec.backend,
        workers.pids,
        num_blocks,
    )
    return runner
