"""The Triton paged-attention kernel against the torch reference backend (the specification).

Without a GPU the kernel runs on CPU tensors under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before any kernel is imported); on a GPU the same tests run on CUDA tensors.
Shapes stay small so the interpreter is quick, but cover what the runtime uses: every block size the
config allows from 1 to 256, GQA (including a group that is not a power of two), MQA and MHA, head
dims 64/96/128, model dtypes float32/bfloat16/float16 and the int8/fp8 KV pools, prefill chunks,
decodes and mixed batches, and padding rows (slot -1).
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import quant, triton_attention
from kvpilot.kernels.attention import AttentionMetadata, KVCacheLayer, TorchReferenceBackend

# on a GPU these run on CUDA tensors (scripts/gpu_check.sh selects them with -m gpu); on the CPU under
# the interpreter, in the default run
pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def make_cache(num_blocks: int, bs: int, hkv: int, d: int, kv_dtype: torch.dtype) -> KVCacheLayer:
    shape = (num_blocks, bs, hkv, d)
    # stale contents of reused blocks: finite garbage (see poison_unused for NaN)
    k = (torch.randn(shape) * 50).clamp(-127, 127).to(kv_dtype).to(DEVICE)
    v = (torch.randn(shape) * 50).clamp(-127, 127).to(kv_dtype).to(DEVICE)
    if quant.is_quantized(kv_dtype):
        scales = torch.rand(shape[:-1], device=DEVICE).to(quant.SCALE_DTYPE)
        return KVCacheLayer(k, v, scales, scales.clone())
    return KVCacheLayer(k, v)


def poison_unused(c: KVCacheLayer, used: torch.Tensor) -> None:
    """NaN in every slot outside `used`: the kernel must mask them, never multiply them in."""
    hkv, d = c.k.shape[2], c.k.shape[3]
    free = torch.ones(c.k.shape[0] * c.k.shape[1], dtype=torch.bool, device=DEVICE)
    free[used] = False
    if c.k_scale is not None and c.v_scale is not None:
        for s in (c.k_scale, c.v_scale):
            s.view(-1, hkv)[free] = float("nan")
    elif c.k.dtype.is_floating_point:
        for x in (c.k, c.v):
            x.view(-1, hkv, d)[free] = float("nan")


def clone(c: KVCacheLayer) -> KVCacheLayer:
    return KVCacheLayer(
        c.k.clone(),
        c.v.clone(),
        None if c.k_scale is None else c.k_scale.clone(),
        None if c.v_scale is None else c.v_scale.clone(),
    )


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def metadata(
    tables: list[list[int]], starts: list[int], qlens: list[int], bs: int, pad_rows: int = 0
) -> AttentionMetadata:
    slots: list[int] = []
    for table, start, n in zip(tables, starts, qlens, strict=True):
        slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
    slots += [-1] * pad_rows
    seq_lens = [s + n for s, n in zip(starts, qlens, strict=True)]
    width = max(len(t) for t in tables)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)

    def t(x: list[int] | list[list[int]], dt: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dt, device=DEVICE)

    return AttentionMetadata(
        slot_mapping=t(slots, torch.int64),
        query_start_loc=t(qsl, torch.int32),
        seq_lens=t(seq_lens, torch.int32),
        block_tables=t([tb + [0] * (width - len(tb)) for tb in tables], torch.int32),
        query_lens_cpu=qlens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(qlens),
        max_seq_len=max(seq_lens),
    )


def scattered_tables(lens: list[int], bs: int, seed: int) -> tuple[list[list[int]], int]:
    """Non-contiguous block tables for sequences of these lengths, and the pool size they need."""
    nb = [(n + bs - 1) // bs for n in lens]
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(sum(nb) + 2, generator=gen).tolist()
    tables, at = [], 0
    for n in nb:
        tables.append(perm[at : at + n])
        at += n
    return tables, len(perm)


def check_step(
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    ctx: list[int],
    new: list[int],
    seed: int = 0,
    split_keys: int = triton_attention.SPLIT_KEYS,
) -> None:
    """Cache `ctx` tokens per sequence, then one step of `new` tokens each: the Triton backend's
    output and the pool it leaves equal the reference backend's."""
    torch.manual_seed(seed)
    total = [c + n for c, n in zip(ctx, new, strict=True)]
    tables, num_blocks = scattered_tables(total, bs, seed)
    ref_cache = make_cache(num_blocks, bs, hkv, d, kv_dtype)
    ref = TorchReferenceBackend()
    scale = d**-0.5
    live = [i for i, c in enumerate(ctx) if c > 0]
    if live:  # the cached context, written by the reference
        m = metadata([tables[i] for i in live], [0] * len(live), [ctx[i] for i in live], bs)
        n = sum(ctx)
        kv = [torch.randn(n, hkv, d, device=DEVICE).to(dtype) for _ in range(2)]
        ref.forward(torch.randn(n, hq, d, device=DEVICE).to(dtype), kv[0], kv[1], ref_cache, m, scale)
    tri_cache = clone(ref_cache)
    meta = metadata(tables, ctx, new, bs)
    used = metadata(tables, [0] * len(total), total, bs).slot_mapping
    poison_unused(tri_cache, used)
    t = sum(new)
    q = torch.randn(t, hq, d, device=DEVICE).to(dtype)
    k = torch.randn(t, hkv, d, device=DEVICE).to(dtype)
    v = torch.randn(t, hkv, d, device=DEVICE).to(dtype)
    want = ref.forward(q, k, v, ref_cache, meta, scale)
    triton_attention.store_kv(k, v, tri_cache, meta.slot_mapping)
    got = triton_attention.paged_attention(q, tri_cache, meta, scale, split_keys)
    assert got.dtype == dtype and got.shape == q.shape
    assert not got.isnan().any()
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # the new tokens land in the same slots with the same bytes (quantized: same codes and scales)
    written = meta.slot_mapping
    for a, b in ((ref_cache.k, tri_cache.k), (ref_cache.v, tri_cache.v)):
        assert same_bytes(a.reshape(-1, hkv, d)[written], b.reshape(-1, hkv, d)[written])
    if ref_cache.k_scale is not None:
        assert tri_cache.k_scale is not None
        assert same_bytes(
            ref_cache.k_scale.reshape(-1, hkv)[written], tri_cache.k_scale.reshape(-1, hkv)[written]
        )


# a mixed batch: decodes over long and short contexts, a prefill chunk after a cached prefix, a
# whole prompt from position 0
CTX, NEW = [40, 1, 27, 0, 9], [1, 1, 13, 7, 1]

KV_CASES = [
    pytest.param(torch.float32, torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, torch.float16, id="fp16"),
    pytest.param(torch.float32, torch.int8, id="fp32-int8kv"),
    pytest.param(torch.bfloat16, torch.int8, id="bf16-int8kv"),
    pytest.param(torch.float32, torch.float8_e4m3fn, id="fp32-fp8kv"),
    pytest.param(torch.bfloat16, torch.float8_e4m3fn, id="bf16-fp8kv"),
]
HEADS = [
    pytest.param(8, 2, id="gqa4"),
    pytest.param(9, 3, id="gqa3"),
    pytest.param(8, 1, id="mqa"),
    pytest.param(4, 4, id="mha"),
]


@pytest.mark.parametrize(("dtype", "kv_dtype"), KV_CASES)
@pytest.mark.parametrize(("hq", "hkv"), HEADS)
def test_mixed_batch_matches_reference(hq: int, hkv: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    check_step(hq, hkv, 64, 16, dtype, kv_dtype, CTX, NEW)


@pytest.mark.parametrize("bs", [1, 8, 16, 32, 64, 128, 256])
def test_every_block_size_the_config_allows(bs: int) -> None:
    # contexts long enough to span several blocks of 8..32, and to cross one block of 128/256 partially
    check_step(8, 2, 64, bs, torch.float32, torch.float32, [70, 3, 0], [1, 20, 9], seed=bs)


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize(("dtype", "kv_dtype"), [KV_CASES[1], KV_CASES[4], KV_CASES[6]])
def test_head_dims_the_runtime_uses(d: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    check_step(8, 2, d, 16, dtype, kv_dtype, [33, 5], [1, 6], seed=d)


@pytest.mark.parametrize(("dtype", "kv_dtype"), [KV_CASES[0], KV_CASES[3]])
def test_decode_only_batch_matches_reference(dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    check_step(8, 2, 64, 16, dtype, kv_dtype, [5, 47, 16, 1], [1, 1, 1, 1])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8, torch.float8_e4m3fn])
def test_padding_rows_write_nothing(kv_dtype: torch.dtype) -> None:
    """Rows with slot -1 (a CUDA graph's padding) leave the pool untouched, with no host-side filter."""
    bs, hkv, d = 4, 2, 16
    cache = make_cache(3, bs, hkv, d, kv_dtype)
    before = clone(cache)
    k = torch.randn(3, hkv, d, device=DEVICE)
    slots = torch.tensor([5, -1, -1], device=DEVICE)
    triton_attention.store_kv(k, k, cache, slots)
    rows = cache.k.reshape(-1, hkv, d)
    others = [i for i in range(12) if i != 5]
    assert same_bytes(rows[others], before.k.reshape(-1, hkv, d)[others])
    want = (
        k[0]
        if kv_dtype == torch.float32
        else quant.dequantize(*quant.quantize(k[:1], kv_dtype), torch.float32)[0]
    )
    got = rows[5].float()
    if cache.k_scale is not None:
        got = got * cache.k_scale.reshape(-1, hkv)[5].float()[:, None]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(("dtype", "kv_dtype"), [KV_CASES[0], KV_CASES[1], KV_CASES[3], KV_CASES[6]])
def test_split_context_decode_matches_reference(dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    """Decode with the context split in parts of 64 keys (flash-decoding): a context of many parts,
    one ending mid-part, one shorter than a part (its other parts are empty), one of exactly two parts."""
    check_step(8, 2, 64, 16, dtype, kv_dtype, [300, 70, 3, 127], [1, 1, 1, 1], split_keys=64)


def test_split_plan() -> None:
    plan = triton_attention.split_plan

    def meta(batch: int, max_seq_len: int, max_query_len: int = 1) -> AttentionMetadata:
        m = metadata([[0]] * batch, [0] * batch, [1] * batch, 16)
        m.max_seq_len, m.max_query_len = max_seq_len, max_query_len
        return m

    assert plan(meta(1, 512), 8) == (1, 0)  # one part's worth: no split
    assert plan(meta(1, 602), 8) == (2, 320)  # parts of equal size, multiples of BLOCK_N
    assert plan(meta(1, 8192), 8) == (16, 512)
    assert plan(meta(1, 131072), 8) == (32, 4096)  # at most MAX_SPLITS parts: bounded partials
    assert plan(meta(64, 8192), 8) == (2, 4096)  # 512 programs already: split only to reach 1024
    assert plan(meta(128, 8192), 8) == (1, 0)  # the batch fills the GPU
    assert plan(meta(1, 8192, max_query_len=2), 8) == (1, 0)  # prefill never splits
    for batch, length in [(1, 700), (3, 5000), (2, 100000)]:
        parts, keys = plan(meta(batch, length), 2)
        assert parts * keys >= length > (parts - 1) * keys and keys % triton_attention.BLOCK_N == 0


def test_prefill_over_a_long_context_is_never_cut_short() -> None:
    # a chunk after 600 cached tokens, and a whole 530-token prompt: longer than a split part
    check_step(4, 2, 64, 64, torch.float32, torch.float32, [600, 0], [5, 530])


def test_long_decode_takes_the_split_path_by_default() -> None:
    ctx = triton_attention.SPLIT_KEYS + 90
    check_step(4, 1, 64, 32, torch.float32, torch.float32, [ctx, 5], [1, 1])


def test_tile_shape_packs_the_gqa_group_into_rows() -> None:
    # decode: one token, the group's heads fill a 16-row tile
    assert triton_attention.tile_shape(4, 1) == (4, 4, 16)
    assert triton_attention.tile_shape(3, 1) == (4, 4, 16)  # group 3 padded to 4, pad rows masked
    assert triton_attention.tile_shape(1, 1) == (16, 1, 16)
    assert triton_attention.tile_shape(32, 1) == (1, 32, 32)
    # prefill: 64 rows of (token, head)
    assert triton_attention.tile_shape(4, 100) == (16, 4, 64)
    assert triton_attention.tile_shape(1, 100) == (64, 1, 64)
