"""Building an engine, top-down, in one place: `build_engine(cfg)` decides the device and dtype, the
KV block size, loads the model (or starts the tensor-parallel group, which loads its shards), sizes
the KV pool, sets up CUDA graphs, LoRA slots, the draft model and the speculator, and hands the
pieces to `LLMEngine`. `engine_from_loaded` is the same path for a model already in memory (tests
share one model between engines); `build_async_engine` wraps the result for a server.

How the KV pool is sized (runtime/engine/plan.py has the rules):
- one GPU, no --kv-cache-memory: a warm-up forward at the largest step, its measured peak, and the
  pool from what is left under --gpu-memory-utilization (runner.profile_memory);
- otherwise (CPU, --kv-cache-memory, tensor-parallel ranks): from the byte budget without a warm-up.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from kvpilot.kernels import isa
from kvpilot.runtime.config import ConfigError, EngineConfig
from kvpilot.runtime.engine.async_engine import AsyncEngine
from kvpilot.runtime.engine.core import LLMEngine
from kvpilot.runtime.engine.plan import blocks_for_budget, cuda_graph_sizes, pool_blocks, with_block_size
from kvpilot.runtime.engine.runner import KVGeometry, ModelRunner, apply_kernel_switches, kv_geometry
from kvpilot.runtime.engine.spec.speculative import make_speculator
from kvpilot.runtime.grammar.service import GrammarLimits
from kvpilot.runtime.load.defaults import describe, resolve_default

if TYPE_CHECKING:
    from kvpilot.runtime.engine.spec.draft import DraftProposer
    from kvpilot.runtime.load.loader import LoadedModel

log = logging.getLogger(__name__)


def build_engine(cfg: EngineConfig) -> LLMEngine:
    """The engine `cfg` describes, on one device or on a tensor-parallel group."""
    from kvpilot.runtime.engine.kv_transfer.blocks import model_fingerprint
    from kvpilot.runtime.engine.tp.runner import start_tensor_parallel
    from kvpilot.runtime.load.loader import load_model, resolve_device

    # the kernel switches (ISA, C kernels, int8 activations, C decoder stack) are in force before the
    # weights load; the default path (no --quantization: runtime/load/defaults.py) reads the ISA level
    # they select, then sets the activations switch
    switched = apply_kernel_switches(cfg)
    device = resolve_device(cfg.device)
    cfg, default = resolve_default(cfg, device, kernel_level=isa.selected(), cpu_kernels=switched.cpu_kernels)
    switched = apply_kernel_switches(cfg)
    if default is not None:
        log.info(describe(default, switched.qmatmul_activations))
    cfg = with_block_size(cfg, device)
    if cfg.tensor_parallel_size > 1:
        # checks the size, spawns ranks 1.., loads rank 0's shard and sizes every rank's pool
        runner = start_tensor_parallel(cfg)
        loaded = runner.loaded
        if loaded.lora is not None:
            runner.enable_lora(loaded.lora)
        spec = make_speculator(cfg, loaded.max_model_len, runner.device.type)
        name = cfg.served_model_name or loaded.model_name
        eos = frozenset(loaded.tokenizer.eos_token_ids)
        # the KV transfer: each rank's shard travels in its own stream (rank 0's shard is hashed:
        # the tp size in the wire layout covers the rest)
        fingerprint = model_fingerprint(loaded.arch, loaded.model, loaded.dtype, cfg.quantization)
        return LLMEngine(runner, loaded.tokenizer, cfg, name, loaded.max_model_len, eos, spec, fingerprint)
    if device.type == "cpu":
        torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    torch.manual_seed(cfg.seed)
    # cfg.dtype `auto` picks the weights' and the activations' dtypes (runtime/load/loader.py)
    return engine_from_loaded(load_model(cfg, device), cfg)


def engine_from_loaded(loaded: LoadedModel, cfg: EngineConfig, draft: LoadedModel | None = None) -> LLMEngine:
    """An engine around an already-loaded, unsharded model. `draft`: the loaded --speculative-model
    (loaded here from cfg when not given)."""
    from kvpilot.kernels import quant
    from kvpilot.runtime.engine.kv_transfer.blocks import model_fingerprint
    from kvpilot.runtime.load.loader import attach_lora, resolve_max_model_len

    if cfg.tensor_parallel_size != 1:
        raise ValueError(
            "engine_from_loaded() takes a whole model; use build_engine() for --tensor-parallel-size > 1"
        )
    cfg = with_block_size(cfg, loaded.device)
    assert cfg.block_size is not None
    if cfg.enable_lora and loaded.lora is None:  # before the KV pool is sized: the slots take memory
        attach_lora(loaded, cfg)
    try:
        kv_dtype = quant.storage_dtype(cfg.kv_cache_dtype, loaded.dtype, loaded.device.type)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.kv_cache_dtype == "auto" and kv_dtype != loaded.dtype:
        log.info(
            "KV cache in %s under %s activations (--kv-cache-dtype auto; float32 keeps it unrounded)",
            str(kv_dtype).removeprefix("torch."),
            str(loaded.dtype).removeprefix("torch."),
        )
    geo = kv_geometry(loaded.arch, cfg.block_size, kv_dtype)
    if loaded.device.type == "cuda" and cfg.kv_cache_memory is None:
        num_blocks = _num_blocks_measured(cfg, geo, loaded)
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
    # this cfg's --max-model-len, which may differ from the one the model was loaded with
    max_model_len = (
        loaded.max_model_len
        if cfg.max_model_len is None
        else resolve_max_model_len(cfg.max_model_len, loaded.arch)
    )
    proposer = _draft_proposer(cfg, loaded, draft, num_blocks) if cfg.speculative_method == "draft" else None
    spec = make_speculator(cfg, max_model_len, loaded.device.type, proposer)
    name = cfg.served_model_name or loaded.model_name
    eos = frozenset(loaded.tokenizer.eos_token_ids)
    # the KV transfer (docs/disaggregation.md) on every single-device engine: a `both` pod accepts it too
    fingerprint = model_fingerprint(loaded.arch, loaded.model, loaded.dtype, cfg.quantization)
    return LLMEngine(runner, loaded.tokenizer, cfg, name, max_model_len, eos, spec, fingerprint)


def build_async_engine(cfg: EngineConfig) -> AsyncEngine:
    """`build_engine` run beside asyncio, for the HTTP server."""
    return AsyncEngine(build_engine(cfg), cfg.max_queue_len, grammar_limits=GrammarLimits.from_config(cfg))


def _num_blocks_measured(cfg: EngineConfig, geo: KVGeometry, loaded: LoadedModel) -> int:
    """One GPU: a warm-up forward at the largest step, its measured peak, and the pool from what is
    left under --gpu-memory-utilization."""
    from kvpilot.runtime.engine.runner import kv_budget_from_profile, profile_memory

    tokens = cfg.max_num_batched_tokens
    profile = profile_memory(loaded.model, geo, loaded.device, tokens, cfg.max_num_seqs)
    budget = kv_budget_from_profile(profile, cfg.gpu_memory_utilization)
    if profile.free_budget() < profile.share_budget(cfg.gpu_memory_utilization):
        log.warning(
            "--gpu-memory-utilization %.2f: the share does not fit in what is free (%.2f GiB; other "
            "engines or processes hold %.2f GiB): the KV pool gets %.2f GiB",
            cfg.gpu_memory_utilization,
            profile.free / 2**30,
            (profile.total - profile.free - profile.own) / 2**30,
            budget / 2**30,
        )
    return blocks_for_budget(budget, geo, cfg, loaded.device.type)


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
