"""The decoder stack in one C call (runtime/models/cpu_stack.py, kernels/csrc/decoder_cpu.c), the
compiled forward the runner picks, against the model's own forward: same kernels, same order, so the
same hidden states bit for bit, on the real SmolLM2 with int4 weights."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch

from kvpilot.kernels import cpu_attention, cpu_decoder, cpu_ops, isa, qlinear, quant, switches
from kvpilot.kernels.attention import KVCacheLayer, TorchReferenceBackend
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


def _caches(loaded: Any, dtype: torch.dtype, kv: str = "auto") -> list[KVCacheLayer]:
    return _caches_for(loaded.arch, quant.storage_dtype(kv, dtype, "cpu"))


def _caches_for(arch: Any, dtype: torch.dtype) -> list[KVCacheLayer]:
    geo = KVGeometry(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, 16, dtype)
    return allocate_kv_cache(geo, 64, torch.device("cpu"), tiled=True)


def _run(
    model: Any,
    loaded: Any,
    dtype: torch.dtype,
    stack: bool,
    kv_dtype: str = "auto",
    ids: list[int] | None = None,
) -> list[torch.Tensor]:
    """Hidden states of three steps (two prompts' prefill, then mixed prefill + decode, then decodes),
    by the compiled stack or by the model's own forward, over a KV cache of --kv-cache-dtype kv_dtype."""
    kv = PagedKV(loaded.arch)
    kv.caches = _caches(loaded, dtype, kv_dtype)
    backend = cpu_attention.CPUPagedAttentionBackend()
    forward = model
    if stack:
        forward, why = cpu_stack.compile_stack(model, kv.caches, backend, enabled=True)
        assert isinstance(forward, cpu_stack.CompiledStack), why
    if ids is None:
        ids = loaded.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    outs = []
    with torch.inference_mode():
        for batch in ([(0, ids[:9]), (1, ids[:5])], [(0, ids[9:12]), (1, [ids[5]])], [(0, [7]), (1, [11])]):
            tokens, positions, meta = kv.step(batch)
            assert not isinstance(forward, cpu_stack.CompiledStack) or forward.fits(tokens.shape[0])
            outs.append(forward(tokens, positions, kv.caches, meta, backend))
    return outs


@pytest.mark.parametrize(
    ("activations", "kv_dtype", "dtype"),
    [
        (act, kv, dtype)
        for (act, kv), dtype in itertools.product(
            [("int8", "auto"), ("float", "auto"), ("bf16", "auto"), ("int8", "int8"), ("int8", "fp8")],
            [torch.float32, torch.bfloat16],
        )
    ]
    + [("float", "float32", torch.float32)],  # auto is a bfloat16 cache under float32 activations
)
def test_stack_gives_the_python_layers_hidden_states(
    int4_model: Any, dtype: torch.dtype, activations: str, kv_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under each qmatmul_activations mode (the stack calls that mode's tiled kernel), and over an
    int8 or float8 KV cache (quantized by the C write, read by the kernel with its scales)."""
    switches.use(switches.changed(qmatmul_activations=activations))  # restored by the conftest fixture
    model = copy.deepcopy(int4_model.model).to(dtype)
    model.model.embed_tokens.dtype = dtype  # the dtype of the rows the quantized table hands out
    assert cpu_stack.unsupported(model.model) is None
    calls: list[int] = []
    real = cpu_decoder.run
    monkeypatch.setattr(cpu_decoder, "run", lambda *a: calls.append(1) or real(*a))
    got = _run(model, int4_model, dtype, stack=True, kv_dtype=kv_dtype)
    assert len(calls) == 3  # every step took the stack
    want = _run(model, int4_model, dtype, stack=False, kv_dtype=kv_dtype)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype and g.shape == w.shape
        # bit for bit: any difference would grow layer by layer through the int8 activation rounding
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("activations", ["float", "bf16", "int8"])
def test_a_step_past_the_small_kernel_rows_takes_the_stack_with_the_same_hidden_states(
    int4_model: Any, activations: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode batch of more sequences than qlinear.SMALL_M (and a prefill chunk beside them) takes the
    stack wherever the layers' matmuls give those rows the tiled kernel, with the same hidden states."""
    switches.use(switches.changed(qmatmul_activations=activations))  # restored by the conftest fixture
    model = int4_model.model
    kv = PagedKV(int4_model.arch)
    kv.caches = _caches(int4_model, torch.float32)
    backend = cpu_attention.CPUPagedAttentionBackend()
    stack, why = cpu_stack.compile_stack(model, kv.caches, backend, enabled=True)
    assert isinstance(stack, cpu_stack.CompiledStack), why
    seqs = qlinear.SMALL_M + 8
    if not stack.fits(seqs + 16):  # int8 activations without AVX512-VNNI: the GEMM past SMALL_M rows
        assert activations == "int8" and stack.max_tokens() == qlinear.SMALL_M
        return  # such a step runs the layers (the runner asks fits); the steps that fit: the test above
    ids = int4_model.tokenizer.encode("The capital of France is Paris, and the capital of Italy is") * 3
    prefill = [(s, ids[: 3 + s % 5]) for s in range(seqs)]
    mixed = [(s, [ids[(s + 3) % len(ids)]]) for s in range(seqs - 1)] + [(seqs - 1, ids[8:24])]
    calls: list[int] = []
    real = cpu_decoder.run
    monkeypatch.setattr(cpu_decoder, "run", lambda *a: calls.append(1) or real(*a))
    got, want = [], []
    with torch.inference_mode():
        tokens, positions, meta = kv.step(prefill)  # written by the layers, read by both below
        model(tokens, positions, kv.caches, meta, backend)
        tokens, positions, meta = kv.step(mixed)
        assert tokens.shape[0] == seqs - 1 + 16 and stack.fits(tokens.shape[0])
        saved = [(c.k.clone(), c.v.clone()) for c in kv.caches]
        got.append(stack(tokens, positions, kv.caches, meta, backend))
        for c, (k, v) in zip(kv.caches, saved, strict=True):
            c.k.copy_(k), c.v.copy_(v)
        want.append(model(tokens, positions, kv.caches, meta, backend))
    assert len(calls) == 1
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)


@pytest.mark.parametrize("kv_dtype", ["auto", "float32", "int8"])
def test_stack_runs_in_the_engine_with_the_same_greedy_tokens(
    kv_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpilot.runtime.engine.sampling_params import SamplingParams

    _require_stack()
    cfg = EngineConfig(
        model=DEFAULT_MODEL,
        quantization="int4",
        kv_cache_memory=2**26,
        max_num_seqs=4,
        kv_cache_dtype=kv_dtype,
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 2683, 9139]]
    calls: list[int] = []
    real = cpu_decoder.run
    monkeypatch.setattr(cpu_decoder, "run", lambda *a: calls.append(1) or real(*a))
    engine = build_engine(cfg)
    assert engine.runner.compiled is not None  # the runner picked it
    on = [o.token_ids for o in engine.generate(prompts, params)]
    assert len(calls) >= 24  # every decode step took the stack
    engine = build_engine(cfg.model_copy(update={"cpu_decoder_stack": False}))
    assert engine.runner.compiled is None
    off = [o.token_ids for o in engine.generate(prompts, params)]
    assert len(calls) < 24 + 24
    assert on == off


def test_what_does_not_take_the_stack_says_why(int4_model: Any) -> None:
    caches = _caches(int4_model, torch.float32, "float32")
    backend = cpu_attention.CPUPagedAttentionBackend()
    model = copy.deepcopy(int4_model.model)
    layer = model.model.layers[3]
    layer.mlp.down_proj.qweight = qlinear.untile(layer.mlp.down_proj.qweight)
    untiled = "a linear weight not quantized in the tiled layout"
    assert cpu_stack.unsupported(model.model) == untiled
    assert cpu_stack.compile_stack(model, caches, backend, enabled=True) == (None, untiled)
    assert cpu_stack.compile_stack(int4_model.model, caches, backend, enabled=False) == (None, cpu_stack.OFF)
    reference = TorchReferenceBackend()
    assert cpu_stack.compile_stack(int4_model.model, caches, reference, True) == (
        None,
        "attention backend torch",
    )
    cpu = torch.device("cpu")
    assert cpu_stack.unsupported_step(torch.float32, cpu, caches, backend) is None
    assert cpu_stack.unsupported_step(torch.bfloat16, cpu, caches, backend) == (
        "a torch.float32 KV cache for torch.bfloat16 activations"
    )
    bf16_cache = _caches(int4_model, torch.float32, "bfloat16")  # rounded by the C write
    assert cpu_stack.unsupported_step(torch.float32, cpu, bf16_cache, backend) is None
    for kv in ("int8", "fp8"):  # quantized caches take the stack with either activation dtype
        for dtype in (torch.float32, torch.bfloat16):
            assert cpu_stack.unsupported_step(dtype, cpu, _caches(int4_model, dtype, kv), backend) is None
    scaleless = [KVCacheLayer(c.k, c.v) for c in _caches(int4_model, torch.float32, "int8")]
    assert cpu_stack.unsupported_step(torch.float32, cpu, scaleless, backend) == (
        "a torch.int8 KV cache for torch.float32 activations"
    )
    stack, _ = cpu_stack.compile_stack(int4_model.model, caches, backend, enabled=True)
    assert isinstance(stack, cpu_stack.CompiledStack)
    for activations in ("int8", "float", "bf16"):  # as many rows as the layers' matmuls give the tiled kernel
        switches.use(switches.changed(qmatmul_activations=activations))  # restored by the conftest fixture
        most = qlinear.max_kernel_rows(int4_model.model.model.layers[0].mlp.down_proj.qweight)
        assert most >= qlinear.SMALL_M and stack.max_tokens() == most
        assert stack.fits(1) and stack.fits(most) and not stack.fits(most + 1) and not stack.fits(0)


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
    caches = _caches_for(model.config, torch.float32)
    assert cpu_stack.compile_stack(model, caches, cpu_attention.CPUPagedAttentionBackend(), True) == (
        None,
        reason,
    )


@pytest.fixture(scope="module")
def qwen3_int4(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny random-weight Qwen3 (q/k RMSNorm per head, head_dim wider than hidden / heads), int4-tiled."""
    from tests.runtime.test_model_parity import make_tiny_hf_dir

    _require_stack()
    directory = tmp_path_factory.mktemp("qwen3")
    make_tiny_hf_dir("qwen3", directory)
    cfg = EngineConfig(model=str(directory), quantization="int4", quantization_group_size=32)
    return load_model(cfg, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stack_norms_each_q_k_head_as_the_python_layers_do(
    qwen3_int4: Any, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3's per-head q/k RMSNorm in the stack (the same kernel, row by row, in place in the QKV
    output before rotary): its hidden states equal the Python layers' bit for bit."""
    model = copy.deepcopy(qwen3_int4.model).to(dtype)
    model.model.embed_tokens.dtype = dtype
    assert type(model.model.layers[0].self_attn).__name__ == "QKNormAttention"
    assert cpu_stack.unsupported(model.model) is None
    calls: list[int] = []
    real = cpu_decoder.run
    monkeypatch.setattr(cpu_decoder, "run", lambda *a: calls.append(1) or real(*a))
    ids = list(range(3, 40, 2))
    got = _run(model, qwen3_int4, dtype, stack=True, ids=ids)
    assert len(calls) == 3
    want = _run(model, qwen3_int4, dtype, stack=False, ids=ids)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    # and the norms matter: without them the stack's answer is another one
    for layer in model.model.layers:
        layer.self_attn.q_norm.weight.data.fill_(1.0)
    assert not torch.equal(_run(model, qwen3_int4, dtype, stack=True, ids=ids)[-1], got[-1])
