"""Decisions about an engine's shape that both the engine and its workers need: the KV
block size, the KV pool's byte budget and block count, CUDA graph sizes, and `RankPlan`, what each
tensor-parallel rank is handed to build its part of the engine.

Everything here is a pure function of the configuration and of facts passed in (device memory, CPU
count), except `with_block_size` (asks whether flash-attn is installed) and `pool_blocks` (reads the
GPU's free memory). The engine (engine.py) and the workers (tp_runner.py, tp_worker.py) import this
module; the workers never import the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.runtime.config import ConfigError, EngineConfig
from kvpilot.runtime.engine.runner import CPU_DEFAULT_KV_BYTES, KVGeometry

DEFAULT_BLOCK_SIZE = 16


def resolve_block_size(
    cfg: EngineConfig, device: torch.device, have_flash_attn: bool, model_dtype: torch.dtype
) -> int:
    """`--block-size` when set; else 256 on CUDA with flash-attn when flash-attn will read the pool (a
    float16/bfloat16 model with a 16-bit KV cache: its paged kernel reads pages of a multiple of 256),
    else 16 (the Triton kernel pages any size)."""
    from kvpilot.kernels.attention import FLASH_DTYPES, FLASH_PAGE_MULTIPLE

    if cfg.block_size is not None:
        return cfg.block_size
    flash_reads = have_flash_attn and cfg.kv_cache_dtype == "auto" and model_dtype in FLASH_DTYPES
    if device.type == "cuda" and flash_reads:
        return FLASH_PAGE_MULTIPLE
    return DEFAULT_BLOCK_SIZE


def with_block_size(cfg: EngineConfig, device: torch.device) -> EngineConfig:
    """A copy of cfg with the block size decided (see resolve_block_size)."""
    from kvpilot.kernels.attention import flash_attn_available
    from kvpilot.runtime.load.loader import resolve_dtype

    if cfg.block_size is not None:
        return cfg
    have_flash = device.type == "cuda" and flash_attn_available()
    size = resolve_block_size(cfg, device, have_flash, resolve_dtype(cfg.dtype, device))
    return cfg.model_copy(update={"block_size": size})


def cuda_graph_sizes(cfg: EngineConfig, device: torch.device) -> list[int] | None:
    """Decode batch sizes to capture CUDA graphs for: none with --enforce-eager, off CUDA, or with LoRA
    serving on (a step's adapter grouping is data-dependent, so LoRA decode runs eagerly)."""
    from kvpilot.runtime.engine.cuda_graphs import graph_batch_sizes

    if cfg.enforce_eager or device.type != "cuda" or cfg.enable_lora:
        return None
    return graph_batch_sizes(min(cfg.max_num_seqs, cfg.max_num_batched_tokens))


def kv_budget_bytes(cfg: EngineConfig, device_memory: tuple[int, int] | None) -> int:
    """Bytes for the KV pool without a warm-up (tensor-parallel ranks; see
    model_runner.kv_budget_from_profile for the measured rule one GPU uses): `--kv-cache-memory` when
    set; on a GPU (device_memory = (free, total) after the weights are loaded) the
    `--gpu-memory-utilization` share of the card minus what is in use and a conservative reserve for
    the largest step's activations; on a CPU a fixed default."""
    if cfg.kv_cache_memory is not None:
        return cfg.kv_cache_memory
    if device_memory is None:
        return CPU_DEFAULT_KV_BYTES
    free, total = device_memory
    used = total - free
    # leave room for activations of the largest step: a rough, conservative reserve
    reserve = 512 * 2**20 + cfg.max_num_batched_tokens * 256 * 1024
    return int(total * cfg.gpu_memory_utilization) - used - reserve


def blocks_for_budget(budget: int, geo: KVGeometry, cfg: EngineConfig, device_type: str) -> int:
    """The KV blocks `budget` bytes hold; ConfigError naming the flag to raise when none fits."""
    n = geo.num_blocks_for(budget)
    if n < 1:
        gpu_share = device_type == "cuda" and cfg.kv_cache_memory is None
        flag = "--gpu-memory-utilization" if gpu_share else "--kv-cache-memory"
        raise ConfigError(
            f"{flag}: the KV cache budget ({budget} bytes) holds no block of {geo.bytes_per_block} "
            f"bytes (--block-size {cfg.block_size}); raise {flag}"
        )
    return n


def pool_blocks(cfg: EngineConfig, geo: KVGeometry, device: torch.device, budget: int | None = None) -> int:
    """The KV pool's block count without a warm-up: from `budget` bytes when given, else from
    kv_budget_bytes (on a GPU, the card's memory as it is now, after the weights are loaded)."""
    if budget is None:
        mem = (
            torch.cuda.mem_get_info(device) if device.type == "cuda" and cfg.kv_cache_memory is None else None
        )
        budget = kv_budget_bytes(cfg, mem)
    return blocks_for_budget(budget, geo, cfg, device.type)


@dataclass(frozen=True)
class RankPlan:
    """What every rank of a tensor-parallel group is handed to build its part of the engine, decided
    once by rank 0 (`plan_ranks`), so that all ranks agree without consulting the engine."""

    cfg: EngineConfig  # the block size is decided
    device_type: str
    dtype: torch.dtype
    world_size: int
    threads: int  # torch threads per rank
    kv_budget: int | None  # KV pool bytes per rank; None: from the GPU's free memory after loading

    def pool_blocks(self, geo: KVGeometry, device: torch.device) -> int:
        """How many KV blocks fit on this rank's device (rank 0 takes the smallest count of all)."""
        return pool_blocks(self.cfg, geo, device, self.kv_budget)


def plan_ranks(cfg: EngineConfig, device_type: str, dtype: torch.dtype, cpu_count: int) -> RankPlan:
    """The plan for `cfg.tensor_parallel_size` ranks. `--kv-cache-memory` and
    `--gpu-memory-utilization` are per rank (per GPU), as in vLLM; on the CPU the ranks share the
    host, so the default 1 GiB budget and the cores are split between them."""
    if cfg.block_size is None:
        raise ValueError("plan_ranks needs the block size decided (with_block_size)")
    tp = cfg.tensor_parallel_size
    budget = cfg.kv_cache_memory
    if budget is None and device_type == "cpu":
        budget = CPU_DEFAULT_KV_BYTES // tp
    threads = cfg.threads or max(1, cpu_count // tp)
    return RankPlan(cfg, device_type, dtype, tp, threads, budget)
