"""The fused CPU RMSNorm and rotary (kernels/csrc/cpu_ops.c) against the torch code they replace."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvpilot.kernels import cpu_ops
from kvpilot.runtime.models.layers import RMSNorm, RotaryEmbedding
from tests.needs import missing

if not cpu_ops.available():
    missing("a C compiler for the fused CPU ops", "install gcc or clang")


def torch_reference(
    fn: Callable[[], tuple[torch.Tensor, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """fn() with the fused ops switched off: the torch code they replace."""
    with monkeypatch.context() as m:
        m.setattr(cpu_ops, "supports", lambda *_: False)
        m.setattr(cpu_ops, "rotary_supports", lambda *_: False)
        return fn()


def ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place (same-sign values)."""
    return (a.view(torch.int16).to(torch.int32) - b.view(torch.int16).to(torch.int32)).abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("tokens", [1, 7, 300])  # 300 x 576 crosses the kernel's threading threshold
def test_rms_norm_matches_the_torch_code(
    dtype: torch.dtype, with_residual: bool, tokens: int, monkeypatch: pytest.MonkeyPatch, cpu_isa: str
) -> None:
    assert cpu_ops.built_isa() == cpu_isa  # the build for this level is the one in use
    torch.manual_seed(0)
    norm = RMSNorm(576, eps=1e-5)
    norm.weight.data = (torch.rand(576) + 0.5).to(dtype)
    x = (torch.randn(tokens, 576) * 3).to(dtype)
    residual = torch.randn(tokens, 576).to(dtype) if with_residual else None
    assert cpu_ops.supports(x, norm.weight)
    out, total = norm(x, residual)
    want_out, want_total = torch_reference(lambda: norm(x, residual), monkeypatch)
    assert torch.equal(total, want_total)  # the residual add rounds exactly as torch's
    if dtype == torch.float32:
        torch.testing.assert_close(out, want_out, rtol=2e-6, atol=1e-6)
    else:
        # only the mean's summation order differs: at most one bf16 ulp, and rarely
        assert int(ulps_bf16(out, want_out).max()) <= 1
        assert (out != want_out).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [64, 32])  # full and partial rotary
def test_rotary_is_bitwise_the_torch_code_on_fused_qkv_views(
    dtype: torch.dtype, rotary_dim: int, monkeypatch: pytest.MonkeyPatch, cpu_isa: str
) -> None:
    assert cpu_ops.built_isa() == cpu_isa
    torch.manual_seed(1)
    hq, hk, d, t = 9, 3, 64, 37
    rope = RotaryEmbedding(head_dim=d, max_position=4096, base=10000.0, rotary_dim=rotary_dim)
    qkv = torch.randn(t, (hq + 2 * hk) * d).to(dtype)
    positions = torch.randint(0, 4096, (t,))

    def views(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = buf.split([hq * d, hk * d, hk * d], dim=-1)  # non-contiguous, as the model has them
        return q.reshape(t, hq, d), k.reshape(t, hk, d)

    q_ref, k_ref = views(qkv.clone())
    want_q, want_k = torch_reference(lambda: rope(positions, q_ref, k_ref), monkeypatch)
    buf = qkv.clone()
    q, k = views(buf)
    assert cpu_ops.rotary_supports(q, k)
    got_q, got_k = rope(positions, q, k)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    # in place, and v (the last third of the buffer) untouched
    assert got_q.data_ptr() == q.data_ptr()
    assert torch.equal(buf[:, (hq + hk) * d :], qkv[:, (hq + hk) * d :])


def test_rotary_rejects_a_position_past_its_table() -> None:
    rope = RotaryEmbedding(head_dim=64, max_position=128, base=10000.0)
    q, k = torch.randn(2, 9, 64), torch.randn(2, 3, 64)
    with pytest.raises(ValueError, match="position out of range"):
        rope(torch.tensor([5, 128]), q, k)


def test_other_dtypes_and_layouts_take_the_torch_path() -> None:
    assert not cpu_ops.supports(torch.randn(4, 8).half(), torch.ones(8).half())
    assert not cpu_ops.supports(torch.randn(8, 4).t(), torch.ones(8))  # not contiguous
    assert not cpu_ops.supports(torch.randn(4, 8), torch.ones(8, dtype=torch.bfloat16))  # mixed dtypes
    q = torch.randn(2, 9, 64).transpose(0, 1)  # heads not adjacent within a token
    assert not cpu_ops.rotary_supports(q, torch.randn(9, 2, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiled", [False, True])
def test_write_kv_equals_the_torch_scatter(dtype: torch.dtype, tiled: bool, cpu_isa: str) -> None:
    """cpu_ops.write_kv_ writes what attention.write_kv writes: contiguous and the CPU kernel's tiled
    caches (K^T per block and head, head-major V), fused-QKV views, padding slots skipped."""
    from kvpilot.kernels.attention import KVCacheLayer, write_kv
    from kvpilot.kernels.cpu_attention import head_major_v_cache, transposed_k_cache

    assert cpu_ops.built_isa() == cpu_isa
    torch.manual_seed(2)
    nb, bs, hk, d, t = 5, 16, 3, 64, 7

    def caches() -> KVCacheLayer:
        if tiled:
            return KVCacheLayer(
                transposed_k_cache(nb, bs, hk, d, dtype=dtype), head_major_v_cache(nb, bs, hk, d, dtype=dtype)
            )
        return KVCacheLayer(torch.zeros(nb, bs, hk, d, dtype=dtype), torch.zeros(nb, bs, hk, d, dtype=dtype))

    qkv = torch.randn(t, (4 + 2 * hk) * d).to(dtype)
    _, k, v = qkv.split([4 * d, hk * d, hk * d], dim=-1)
    k, v = k.reshape(t, hk, d), v.reshape(t, hk, d)
    slots = torch.tensor([0, 17, 79, -1, 33, 5, -1])
    want, got = caches(), caches()
    write_kv(k, v, want, slots)
    assert cpu_ops.write_kv_supports(k, v, got.k, got.v)
    cpu_ops.write_kv_(k, v, got.k, got.v, slots)
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
    assert int((got.k != 0).sum()) == 5 * hk * d  # the five real slots, nothing else
    with pytest.raises(ValueError, match="slot out of range"):
        cpu_ops.write_kv_(k, v, got.k, got.v, torch.full((t,), nb * bs))
    assert not cpu_ops.write_kv_supports(k, v, got.k.to(torch.float16), got.v.to(torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("tiled", [False, True])
def test_quantized_write_kv_is_bitwise_the_torch_quantizer(
    dtype: torch.dtype, cache_dtype: torch.dtype, tiled: bool, cpu_isa: str
) -> None:
    """Into an int8 / float8 cache, cpu_ops.write_kv_ writes the values and float16 scales that
    attention.write_kv (quant.quantize, index_copy_) writes, bit for bit: magnitudes over 12 decades
    (float8 subnormals, exact halves, all-zero heads clamped to the minimum scale), padding skipped."""
    from kvpilot.kernels import quant
    from kvpilot.kernels.attention import KVCacheLayer, write_kv
    from kvpilot.kernels.cpu_attention import head_major_v_cache, transposed_k_cache

    assert cpu_ops.built_isa() == cpu_isa
    torch.manual_seed(3)
    nb, bs, hk, d, t = 6, 16, 3, 64, 40

    def caches() -> KVCacheLayer:
        def z(*shape: int, dt: torch.dtype = cache_dtype) -> torch.Tensor:
            return (
                torch.zeros(*shape, dtype=torch.uint8).view(dt)
                if dt.itemsize == 1
                else torch.zeros(*shape, dtype=dt)
            )

        ks, vs = z(nb, bs, hk, dt=quant.SCALE_DTYPE), z(nb, bs, hk, dt=quant.SCALE_DTYPE)
        if tiled:
            k = transposed_k_cache(nb, bs, hk, d, dtype=torch.uint8).view(cache_dtype)
            v = head_major_v_cache(nb, bs, hk, d, dtype=torch.uint8).view(cache_dtype)
            return KVCacheLayer(k, v, ks, vs)
        return KVCacheLayer(z(nb, bs, hk, d), z(nb, bs, hk, d), ks, vs)

    qkv = torch.randn(t, (4 + 2 * hk) * d) * torch.pow(10.0, torch.empty(t, (4 + 2 * hk) * d).uniform_(-6, 6))
    qkv[1, 4 * d : 4 * d + d] = 0.0  # a head of zeros: the minimum scale
    qkv[2, 4 * d : 4 * d + 8] = torch.tensor([127.0, 0.5, 1.5, -2.5, 63.5, 1e-9, -127.0, 3.25])  # halves
    qkv = qkv.to(dtype)
    _, k, v = qkv.split([4 * d, hk * d, hk * d], dim=-1)
    k, v = k.reshape(t, hk, d), v.reshape(t, hk, d)
    slots = torch.randperm(nb * bs)[:t]
    slots[[5, 17]] = -1
    want, got = caches(), caches()
    write_kv(k, v, want, slots)
    assert cpu_ops.write_kv_supports(k, v, got.k, got.v, got.k_scale, got.v_scale)
    cpu_ops.write_kv_(k, v, got.k, got.v, slots, got.k_scale, got.v_scale)
    for a, b in ((got.k, want.k), (got.v, want.v)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for a, b in ((got.k_scale, want.k_scale), (got.v_scale, want.v_scale)):
        assert a is not None and b is not None and torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert int((got.k_scale != 0).sum()) == (t - 2) * hk  # the real slots' scales, nothing else
    assert not cpu_ops.write_kv_supports(k, v, got.k, got.v)  # a quantized cache needs its scales
    assert not cpu_ops.write_kv_supports(k, v, got.k, got.v, got.k_scale.float(), got.v_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 40])  # 40 x 1536 crosses the kernel's threading threshold
def test_silu_mul_matches_torch_to_the_last_bits(dtype: torch.dtype, tokens: int, cpu_isa: str) -> None:
    """silu(gate) * up with the vectorizable exp: float32 within a few ulp of F.silu(g) * u (exp to
    ~2 ulp), bfloat16 within one bf16 ulp (the same roundings, silu before the product); extremes
    included (exp clamped: silu(-100) is ~0, silu(100) is 100)."""
    from kvpilot.runtime.models.layers import SiluAndMul

    assert cpu_ops.built_isa() == cpu_isa
    torch.manual_seed(tokens)
    gu = (torch.randn(tokens, 2 * 1536) * 4).to(dtype)
    gu[0, :6] = torch.tensor([0.0, -100.0, 100.0, -87.0, 88.5, 1e-8]).to(dtype)
    got = cpu_ops.silu_mul(gu)
    g, u = gu.chunk(2, dim=-1)
    want = torch.nn.functional.silu(g) * u
    assert got.dtype == dtype and got.shape == (tokens, 1536)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=3e-6, atol=1e-30)
    else:
        close = ulps_bf16(got, want) <= 1
        assert bool((close | (got == want)).all())
    assert torch.equal(SiluAndMul()(gu), got)  # the layer takes the fused op on CPU
