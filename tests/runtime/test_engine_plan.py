"""The plan rank 0 hands to tensor-parallel workers, and the KV pool sizing both sides share."""

from __future__ import annotations

import pytest
import torch

from kvpilot.runtime.config import ConfigError, EngineConfig
from kvpilot.runtime.engine.plan import blocks_for_budget, plan_ranks, pool_blocks
from kvpilot.runtime.engine.runner import CPU_DEFAULT_KV_BYTES, KVGeometry

GEO = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, dtype=torch.float32)
CPU = torch.device("cpu")


def test_cpu_ranks_split_the_default_budget_and_the_cores() -> None:
    plan = plan_ranks(EngineConfig(tensor_parallel_size=4, block_size=16), "cpu", torch.float32, cpu_count=16)
    assert (plan.world_size, plan.threads, plan.kv_budget) == (4, 4, CPU_DEFAULT_KV_BYTES // 4)
    assert plan.pool_blocks(GEO, CPU) == CPU_DEFAULT_KV_BYTES // 4 // GEO.bytes_per_block
    one = plan_ranks(EngineConfig(tensor_parallel_size=3, block_size=16), "cpu", torch.float32, cpu_count=2)
    assert one.threads == 1  # never zero threads


def test_explicit_budget_and_threads_are_per_rank() -> None:
    cfg = EngineConfig(tensor_parallel_size=2, block_size=16, kv_cache_memory=1 << 20, threads=3)
    for device_type in ("cpu", "cuda"):
        plan = plan_ranks(cfg, device_type, torch.bfloat16, cpu_count=64)
        assert (plan.kv_budget, plan.threads, plan.dtype) == (1 << 20, 3, torch.bfloat16)
    assert plan_ranks(cfg, "cpu", torch.float32, 64).pool_blocks(GEO, CPU) == (1 << 20) // GEO.bytes_per_block


def test_gpu_ranks_measure_their_own_memory() -> None:
    plan = plan_ranks(
        EngineConfig(tensor_parallel_size=2, block_size=256), "cuda", torch.bfloat16, cpu_count=8
    )
    assert plan.kv_budget is None and plan.cfg.block_size == 256 and plan.device_type == "cuda"


def test_plan_needs_the_block_size_decided() -> None:
    with pytest.raises(ValueError, match="block size"):
        plan_ranks(EngineConfig(tensor_parallel_size=2), "cpu", torch.float32, cpu_count=8)


def test_a_budget_without_one_block_names_the_flag() -> None:
    big = KVGeometry(num_layers=64, num_kv_heads=1, head_dim=128, block_size=16, dtype=torch.float32)
    cfg = EngineConfig(block_size=16, kv_cache_memory=1 << 16)  # 64 KiB, a block is 1 MiB
    with pytest.raises(ConfigError, match="--kv-cache-memory"):
        pool_blocks(cfg, big, CPU)
    with pytest.raises(ConfigError, match="--gpu-memory-utilization"):
        blocks_for_budget(100, GEO, EngineConfig(block_size=16), "cuda")
    with pytest.raises(ConfigError, match="--kv-cache-memory"):  # on the CPU that is the flag to raise
        blocks_for_budget(100, GEO, EngineConfig(block_size=16), "cpu")
