"""The decoder stack in one C call (runtime/models/cpu_stack.py, kernels/csrc/decoder_cpu.c) against
the Python layers it replaces: same kernels, same order, so the same hidden states bit for bit, on
the real SmolLM2 with int4 weights."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from kvpilot.kernels import cpu_attention, cpu_decoder, cpu_ops, isa, qlinear
from kvpilot.kernels.attention import KVCacheLayer
from kvpilot.runtime.config import DEFAULT_MODEL, EngineConfig
from kvpilot.runtime.engine.build import build_engine
from kvpilot.runtime.engine.runner import KVGeometry, allocate_kv_cache
from kvpilot.runtime.load.loader import load_model
from kvpilot.runtime.models import cpu_stack
from tests.needs import missing
from tests.runtime.test_model_parity import PagedKV


def _require_stack() -> None:
    """A missing C compiler fails under CI (tests/needs.py); a CPU without AVX2 has no tiled kernel."""
    extensions = (cpu_ops, cpu_attention, qlinear, cpu_decoder.EXTENSION)
    if not all(ext.available() for ext in extensions):
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    if not cpu_decoder.available():
        pytest.skip(
            "the decoder stack needs the avx512 or avx2 kernels: test_generic_level_refuses_the_stack"
        )


@pytest.fixture(scope="module")
def int4_model() -> Any:
    _require_stack()
    cfg = EngineConfig(model=DEFAULT_MODEL, quantization="int4", quantization_group_size=32)
    return load_model(cfg, torch.device("cpu"), torch.float32)


def _caches(loaded: Any, dtype: torch.dtype) -> list[KVCacheLayer]:
    arch = loaded.arch
    geo = KVGeometry(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, 16, dtype)
    return allocate_kv_cache(geo, 64, torch.device("cpu"), tiled=True)


def _run(model: Any, loaded: Any, dtype: torch.dtype, stack: bool) -> list[torch.Tensor]:
    """Hidden states of three steps (two prompts' prefill, then mixed prefill + decode, then decodes)."""
    model.model.__dict__["_cpu_stack"] = cpu_stack.CpuDecoderStack(model.model) if stack else None
    kv = PagedKV(loaded.arch)
    kv.caches = _caches(loaded, dtype)
    backend = cpu_attention.CPUPagedAttentionBackend()
    ids = loaded.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    outs = []
    with torch.inference_mode():
        for batch in ([(0, ids[:9]), (1, ids[:5])], [(0, ids[9:12]), (1, [ids[5]])], [(0, [7]), (1, [11])]):
            tokens, positions, meta = kv.step(batch)
            outs.append(model(tokens, positions, kv.caches, meta, backend))
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stack_gives_the_python_layers_hidden_states(
    int4_model: Any, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = copy.deepcopy(int4_model.model).to(dtype)
    model.model.embed_tokens.dtype = dtype  # the dtype of the rows the quantized table hands out
    assert cpu_stack.unsupported(model.model) is None
    calls: list[int] = []
    real = cpu_decoder.run
    monkeypatch.setattr(cpu_decoder, "run", lambda *a: calls.append(1) or real(*a))
    got = _run(model, int4_model, dtype, stack=True)
    assert len(calls) == 3  # every step took the stack
    want = _run(model, int4_model, dtype, stack=False)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype and g.shape == w.shape
        # bit for bit: any difference would grow layer by layer through the int8 activation rounding
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_stack_runs_in_the_engine_with_the_same_greedy_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpilot.runtime.engine.sampling_params import SamplingParams

    _require_stack()
    cfg = EngineConfig(model=DEFAULT_MODEL, quantization="int4", kv_cache_memory=2**26, max_num_seqs=4)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 2683, 9139]]
    calls: list[int] = []
    real = cpu_decoder.run
    monkeypatch.setattr(cpu_decoder, "run", lambda *a: calls.append(1) or real(*a))
    on = [o.token_ids for o in build_engine(cfg).generate(prompts, params)]
    assert len(calls) >= 24  # every decode step took the stack
    monkeypatch.setattr(cpu_stack, "ENABLED", False)
    off = [o.token_ids for o in build_engine(cfg).generate(prompts, params)]
    assert len(calls) < 24 + 24
    assert on == off


def test_what_does_not_take_the_stack_says_why(int4_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model = copy.deepcopy(int4_model.model)
    layer = model.model.layers[3]
    layer.mlp.down_proj.qweight = qlinear.untile(layer.mlp.down_proj.qweight)
    assert cpu_stack.unsupported(model.model) == "a linear weight not quantized in the tiled layout"
    assert cpu_stack.CpuDecoderStack.for_model(model.model) is None
    monkeypatch.setattr(cpu_stack, "ENABLED", False)
    assert cpu_stack.unsupported(int4_model.model.model) == "KVPILOT_CPU_DECODER_STACK=0"
    with pytest.raises(ValueError, match="KVPILOT_CPU_DECODER_STACK='yes': expected 0 or 1"):
        cpu_stack.enabled("yes")
    stack = cpu_stack.CpuDecoderStack(int4_model.model.model)
    caches = _caches(int4_model, torch.float32)
    backend = cpu_attention.CPUPagedAttentionBackend()
    assert stack.applies(torch.zeros(4, 576), caches, backend)
    assert not stack.applies(torch.zeros(qlinear.SMALL_M + 1, 576), caches, backend)  # prefill: the layers
    assert not stack.applies(torch.zeros(4, 576, dtype=torch.bfloat16), caches, backend)  # cache dtype


def test_generic_level_refuses_the_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sibling of the skips above for a CPU without AVX2 (the level forced here): no tiled kernel,
    so the model's layers run from Python and the stack says why."""
    if not cpu_decoder.EXTENSION.available("generic") or not qlinear.available("generic"):
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    monkeypatch.setattr(isa, "selected", lambda: "generic")
    assert not cpu_decoder.available()
    cfg = EngineConfig(model=DEFAULT_MODEL, quantization="int4", quantization_group_size=32)
    model = load_model(cfg, torch.device("cpu"), torch.float32).model
    reason = cpu_stack.unsupported(model.model)
    assert reason == "the CPU kernels are unavailable or have no tiled quantized path here"
    assert cpu_stack.CpuDecoderStack.for_model(model.model) is None
