"""The engine on a CUDA GPU, and the CPU siblings that check the same decisions without one.

GPU tests skip cleanly without CUDA. Their CPU siblings: the KV budget arithmetic below (pure), the
engine's HF parity, preemption and injected-OOM tests in test_engine.py, and the flash-attn packing
tests in tests/kernels/test_flash_attention.py. On a GPU: `pytest tests/runtime/test_cuda.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import torch

from kvpilot.kernels.attention import FLASH_PAGE_MULTIPLE, cuda_backend_name
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.build import build_engine
from kvpilot.runtime.engine.core import LLMEngine
from kvpilot.runtime.engine.plan import DEFAULT_BLOCK_SIZE, kv_budget_bytes, resolve_block_size
from kvpilot.runtime.engine.runner import (
    CPU_DEFAULT_KV_BYTES,
    MemoryProfile,
    kv_budget_from_profile,
    kv_geometry,
    warmup_batch,
    warmup_forward,
)
from kvpilot.runtime.engine.sampling_params import SamplingParams
from tests.runtime.greedy_reference import Reference, assert_matches_reference, hf_greedy

GIB = 2**30
MAX_NEW = 16
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Q: What is 12 times 7?\nA:",
]


# -- CPU: the KV budget decision --------------------------------------------------------------


def test_kv_budget_takes_the_explicit_size_first() -> None:
    cfg = EngineConfig(kv_cache_memory=3 * GIB, gpu_memory_utilization=0.5)
    assert kv_budget_bytes(cfg, (10 * GIB, 80 * GIB)) == 3 * GIB
    assert kv_budget_bytes(cfg, None) == 3 * GIB


def test_kv_budget_on_cpu_is_the_default() -> None:
    assert kv_budget_bytes(EngineConfig(), None) == CPU_DEFAULT_KV_BYTES


def test_kv_budget_on_a_gpu_is_the_utilization_share_minus_use_and_step_reserve() -> None:
    cfg = EngineConfig(gpu_memory_utilization=0.9, max_num_batched_tokens=2048)
    total, weights = 80 * GIB, 16 * GIB
    budget = kv_budget_bytes(cfg, (total - weights, total))
    reserve = 512 * 2**20 + 2048 * 256 * 1024
    assert budget == int(0.9 * total) - weights - reserve
    # a lower share, or a bigger step, leaves less for the pool
    assert kv_budget_bytes(EngineConfig(gpu_memory_utilization=0.5), (total - weights, total)) < budget
    assert kv_budget_bytes(EngineConfig(max_num_batched_tokens=8192), (total - weights, total)) < budget


def test_kv_budget_can_come_out_negative_and_the_engine_says_which_flag_to_raise() -> None:
    cfg = EngineConfig(gpu_memory_utilization=0.1)
    assert kv_budget_bytes(cfg, (2 * GIB, 80 * GIB)) < 0


# -- CPU: the measured KV budget (warm-up at the largest step, peak, what is left) ---------------


def test_kv_budget_from_a_profile_is_the_share_minus_own_weights_and_measured_peak() -> None:
    p = MemoryProfile(total=141 * GIB, free=120 * GIB, own=17 * GIB, activation_peak=3 * GIB)
    assert kv_budget_from_profile(p, 0.9) == int(0.9 * 141 * GIB) - 17 * GIB - 3 * GIB
    # a bigger measured peak or bigger weights leave exactly that much less
    bigger = MemoryProfile(total=141 * GIB, free=120 * GIB, own=17 * GIB, activation_peak=5 * GIB)
    assert kv_budget_from_profile(p, 0.9) - kv_budget_from_profile(bigger, 0.9) == 2 * GIB
    heavier = MemoryProfile(total=141 * GIB, free=120 * GIB, own=19 * GIB, activation_peak=3 * GIB)
    assert kv_budget_from_profile(p, 0.9) - kv_budget_from_profile(heavier, 0.9) == 2 * GIB
    assert kv_budget_from_profile(MemoryProfile(80 * GIB, 70 * GIB, 70 * GIB, GIB), 0.5) < 0


def test_kv_budget_share_is_per_engine_and_capped_by_what_is_free() -> None:
    alone = MemoryProfile(total=100 * GIB, free=98 * GIB, own=2 * GIB, activation_peak=GIB)
    # a second engine on the same GPU (40 GiB held by the first) gets its own share, not the share less
    # what the first holds: the vLLM rule, so that two engines at 0.45 each get equal pools
    beside = MemoryProfile(total=100 * GIB, free=58 * GIB, own=2 * GIB, activation_peak=GIB)
    assert kv_budget_from_profile(beside, 0.45) == kv_budget_from_profile(alone, 0.45) == 42 * GIB
    # a share that does not fit in what is free gets what is free, less the step's activations
    crowded = MemoryProfile(total=100 * GIB, free=30 * GIB, own=2 * GIB, activation_peak=GIB)
    assert kv_budget_from_profile(crowded, 0.9) == 29 * GIB
    assert crowded.free_budget() < crowded.share_budget(0.9)


@pytest.mark.parametrize(("tokens", "seqs", "bs"), [(2048, 256, 16), (100, 7, 16), (5, 64, 4), (300, 1, 256)])
def test_warmup_batch_is_the_largest_step_in_disjoint_blocks(tokens: int, seqs: int, bs: int) -> None:
    ids, pos, meta, rows, nblocks = warmup_batch(tokens, seqs, bs, torch.device("cpu"))
    n = min(seqs, tokens)
    assert ids.shape == pos.shape == meta.slot_mapping.shape == (tokens,)
    assert meta.num_seqs == n and rows.shape == (n,)  # every sequence's logits, as a full decode step
    assert max(meta.query_lens_cpu) - min(meta.query_lens_cpu) <= 1
    assert meta.slot_mapping.unique().numel() == tokens  # no two tokens share a slot
    assert int(meta.slot_mapping.max()) < nblocks * bs
    assert meta.seq_lens_cpu == meta.query_lens_cpu  # a prefill from position 0
    assert rows.tolist() == [q - 1 for q in meta.query_start_loc.tolist()[1:]]


def test_warmup_forward_runs_the_real_model_at_the_largest_step(smollm2_fp32: Any) -> None:
    from kvpilot.kernels.attention import TorchReferenceBackend

    geo = kv_geometry(smollm2_fp32.arch, 16, torch.float32)
    pool = warmup_forward(smollm2_fp32.model, geo, torch.device("cpu"), 96, 12, TorchReferenceBackend())
    assert pool == 12 * geo.bytes_per_block  # 12 sequences of 8 tokens: one block each


# -- CUDA --------------------------------------------------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])


def cuda(fn: F) -> F:
    """A test that needs a CUDA GPU: marked `gpu` (scripts/gpu_check.sh runs `pytest -m gpu`)."""
    skip = pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU siblings: see module doc)"
    )
    return pytest.mark.gpu(skip(fn))


@pytest.fixture(scope="module")
def make_cuda_engine(smollm2_gguf_path: Any) -> Iterator[Callable[..., LLMEngine]]:
    engines: list[LLMEngine] = []

    def make(**overrides: Any) -> LLMEngine:
        settings: dict[str, Any] = {"model": str(smollm2_gguf_path), "device": "cuda", **overrides}
        engine = build_engine(EngineConfig(**settings))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def prompts_and_refs(
    hf_smollm2: Any, make_cuda_engine: Callable[..., LLMEngine]
) -> tuple[list[list[int]], list[Reference]]:
    engine = make_cuda_engine(dtype="float32", kv_cache_memory=GIB)
    tok = engine.tokenizer
    prompts = [tok.encode(t) for t in TEXTS]
    eos = set(engine.eos_token_ids)
    return prompts, [hf_greedy(hf_smollm2, p, MAX_NEW, eos) for p in prompts]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


@cuda
def test_float32_on_cuda_matches_hf_one_batch(
    make_cuda_engine: Callable[..., LLMEngine], prompts_and_refs: tuple[list[list[int]], list[Reference]]
) -> None:
    prompts, refs = prompts_and_refs
    engine = make_cuda_engine(dtype="float32", kv_cache_memory=GIB)
    assert engine.runner.device.type == "cuda"
    for i, (seq, ref) in enumerate(zip(engine.generate(prompts, greedy()), refs, strict=True)):
        assert_matches_reference(seq.output_token_ids, ref, f"cuda fp32 prompt {i}")
    assert engine.block_manager.usage == 0.0


@cuda
def test_kv_pool_on_cuda_follows_gpu_memory_utilization(make_cuda_engine: Callable[..., LLMEngine]) -> None:
    small = make_cuda_engine(dtype="bfloat16", gpu_memory_utilization=0.3)
    large = make_cuda_engine(dtype="bfloat16", gpu_memory_utilization=0.5)
    total = torch.cuda.mem_get_info()[1]
    small_bytes = small.block_manager.num_blocks * small.runner.geometry.bytes_per_block
    assert 0 < small_bytes <= 0.3 * total
    assert large.block_manager.num_blocks > small.block_manager.num_blocks


@cuda
def test_kv_pressure_on_cuda_preempts_and_still_matches_hf(
    make_cuda_engine: Callable[..., LLMEngine], prompts_and_refs: tuple[list[list[int]], list[Reference]]
) -> None:
    prompts, refs = prompts_and_refs
    probe = make_cuda_engine(dtype="float32", kv_cache_memory=GIB)
    need = max(len(p) for p in prompts) + MAX_NEW
    blocks = -(-need // probe.block_manager.block_size) + 1  # one long sequence fits, not all at once
    engine = make_cuda_engine(
        dtype="float32",
        kv_cache_memory=blocks * probe.runner.geometry.bytes_per_block,
        enable_prefix_caching=False,
    )
    for i, (seq, ref) in enumerate(zip(engine.generate(prompts, greedy()), refs, strict=True)):
        assert_matches_reference(seq.output_token_ids, ref, f"cuda pressure prompt {i}")
    assert engine.stats().num_preemptions > 0


@cuda
def test_a_real_cuda_out_of_memory_is_recovered(
    make_cuda_engine: Callable[..., LLMEngine], prompts_and_refs: tuple[list[list[int]], list[Reference]]
) -> None:
    """Not an injected exception: the first step asks the allocator for more than the card has."""
    prompts, refs = prompts_and_refs
    engine = make_cuda_engine(dtype="float32", kv_cache_memory=GIB)
    calls = {"n": 0}

    def allocate_too_much(_: object) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            torch.empty(torch.cuda.mem_get_info()[1] * 2, dtype=torch.uint8, device="cuda")

    engine.before_execute = allocate_too_much
    for i, (seq, ref) in enumerate(zip(engine.generate(prompts, greedy()), refs, strict=True)):
        assert_matches_reference(seq.output_token_ids, ref, f"cuda oom prompt {i}")
    assert engine.stats().oom_recoveries == 1


@cuda
def test_bfloat16_on_cuda_serves_a_batch_to_completion(make_cuda_engine: Callable[..., LLMEngine]) -> None:
    engine = make_cuda_engine(dtype="auto", kv_cache_memory=GIB)
    assert engine.runner.geometry.dtype in (torch.bfloat16, torch.float16)
    prompts = [engine.tokenizer.encode(t) for t in TEXTS] * 8
    seqs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert [len(s.output_token_ids) for s in seqs] == [32] * len(prompts)
    assert engine.block_manager.usage == 0.0


# -- CPU: which CUDA attention backend and block size --------------------------------------------


def test_block_size_is_256_on_cuda_with_flash_attn_else_16() -> None:
    cuda_dev, cpu_dev = torch.device("cuda"), torch.device("cpu")
    bf16, fp32 = torch.bfloat16, torch.float32
    assert resolve_block_size(EngineConfig(), cuda_dev, True, bf16) == FLASH_PAGE_MULTIPLE
    assert resolve_block_size(EngineConfig(), cuda_dev, True, torch.float16) == FLASH_PAGE_MULTIPLE
    assert resolve_block_size(EngineConfig(), cuda_dev, False, bf16) == DEFAULT_BLOCK_SIZE
    assert resolve_block_size(EngineConfig(), cpu_dev, True, bf16) == DEFAULT_BLOCK_SIZE
    # pools flash-attn cannot read (int8/fp8, float32) go to the Triton kernel, which pages any size
    assert resolve_block_size(EngineConfig(kv_cache_dtype="int8"), cuda_dev, True, bf16) == DEFAULT_BLOCK_SIZE
    assert resolve_block_size(EngineConfig(), cuda_dev, True, fp32) == DEFAULT_BLOCK_SIZE
    # an explicit --block-size always wins
    assert resolve_block_size(EngineConfig(block_size=32), cuda_dev, True, bf16) == 32


def test_cuda_backend_choice() -> None:
    bf16, fp16, i8, fp8, fp32 = torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn, torch.float32
    # flash-attn only where it pages the pool in place, and only 16-bit pools
    assert cuda_backend_name(bf16, 256, have_flash=True, have_triton=True) == "flash-attn"
    assert cuda_backend_name(fp16, 512, have_flash=True, have_triton=True) == "flash-attn"
    assert cuda_backend_name(bf16, 16, have_flash=True, have_triton=True) == "triton"
    for dt in (i8, fp8, fp32):
        assert cuda_backend_name(dt, 256, have_flash=True, have_triton=True) == "triton"
    assert cuda_backend_name(bf16, 256, have_flash=False, have_triton=True) == "triton"
    # without Triton: flash-attn's packed path for 16-bit pools, the reference otherwise
    assert cuda_backend_name(bf16, 16, have_flash=True, have_triton=False) == "flash-attn"
    assert cuda_backend_name(i8, 16, have_flash=True, have_triton=False) == "torch"
    assert cuda_backend_name(fp32, 256, have_flash=True, have_triton=False) == "torch"
    assert cuda_backend_name(bf16, 16, have_flash=False, have_triton=False) == "torch"


@cuda
def test_cuda_graphs_match_eager_decode(make_cuda_engine: Callable[..., LLMEngine]) -> None:
    """Decode through captured graphs (the default) gives the tokens --enforce-eager gives."""
    graphs = make_cuda_engine(dtype="float32", kv_cache_memory=GIB, max_num_seqs=8)
    eager = make_cuda_engine(dtype="float32", kv_cache_memory=GIB, max_num_seqs=8, enforce_eager=True)
    assert graphs.runner.graphs is not None and eager.runner.graphs is None
    assert graphs.runner.graphs.sizes == [1, 2, 4, 8]
    prompts = [graphs.tokenizer.encode(t) for t in TEXTS[:3]]  # 3 rows: padded to the bucket of 4
    want = [s.output_token_ids for s in eager.generate(prompts, greedy())]
    got = [s.output_token_ids for s in graphs.generate(prompts, greedy())]
    assert got == want


@cuda
def test_triton_backend_is_chosen_for_quantized_pools_on_cuda(
    make_cuda_engine: Callable[..., LLMEngine],
) -> None:
    engine = make_cuda_engine(dtype="bfloat16", kv_cache_memory=GIB, kv_cache_dtype="int8")
    assert engine.runner.backend.name == "triton"
    out = engine.generate([engine.tokenizer.encode(TEXTS[0])], greedy())
    assert len(out[0].output_token_ids) > 0


@cuda
def test_int4_on_cuda_takes_the_triton_kernel_and_matches_hf(
    make_cuda_engine: Callable[..., LLMEngine], prompts_and_refs: tuple[list[list[int]], list[Reference]]
) -> None:
    """SmolLM2's GGUF stores Q4_1 weights, so int4 group 32 holds exactly the weights HF dequantizes:
    float32 greedy decoding through the quantized Triton matmul (kernels/triton_qlinear.py, prefill
    and decode rows, CUDA graphs) gives HF's tokens. bfloat16 int8 serves a batch to completion."""
    from kvpilot.kernels import triton_qlinear
    from kvpilot.runtime.load.quantization import linear_layers

    prompts, refs = prompts_and_refs
    engine = make_cuda_engine(dtype="float32", kv_cache_memory=GIB, quantization="int4")
    layers = [m for _, m in linear_layers(engine.runner.model)]
    assert layers and all(m.qweight is not None and m.qweight.bits == 4 for m in layers)
    qw = layers[0].qweight
    assert qw is not None and triton_qlinear.applies(torch.zeros(1, qw.in_features, device="cuda"), qw)
    for i, (seq, ref) in enumerate(zip(engine.generate(prompts, greedy()), refs, strict=True)):
        assert_matches_reference(seq.output_token_ids, ref, f"cuda int4 prompt {i}")
    int8 = make_cuda_engine(dtype="bfloat16", kv_cache_memory=GIB, quantization="int8")
    seqs = int8.generate(prompts * 8, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert [len(s.output_token_ids) for s in seqs] == [32] * len(prompts) * 8  # 32 rows: decode tiles
    assert int8.block_manager.usage == 0.0


@cuda
def test_measured_profile_on_cuda_sees_the_weights_and_a_step_peak(smollm2_gguf_path: Any) -> None:
    from kvpilot.runtime.engine.runner import profile_memory
    from kvpilot.runtime.load.loader import load_model

    loaded = load_model(EngineConfig(model=str(smollm2_gguf_path)), torch.device("cuda"), torch.bfloat16)
    geo = kv_geometry(loaded.arch, 16, torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    small = profile_memory(loaded.model, geo, loaded.device, 64, 4)
    big = profile_memory(loaded.model, geo, loaded.device, 2048, 64)
    assert small.own >= weights and small.total == torch.cuda.mem_get_info()[1] >= small.free
    assert 0 < small.activation_peak < big.activation_peak  # a bigger step needs more
    del loaded
    torch.cuda.empty_cache()
