"""Paged attention against a dense, unpaged softmax(QK^T)V written out by hand."""

from __future__ import annotations

import math
import os

import pytest
import torch

from kvpilot.kernels import cpu_attention, isa, quant, triton_attention
from kvpilot.kernels.attention import (
    CPU_KERNEL_MAX_GROUP,
    CPU_KERNEL_MAX_HEAD_DIM,
    AttentionBackend,
    AttentionMetadata,
    Heads,
    KVCacheLayer,
    TorchReferenceBackend,
    cpu_kernel_takes,
)
from tests.needs import missing

HQ, HKV, D, BS = 6, 2, 16, 4

BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchReferenceBackend,
    "cpu-paged": cpu_attention.CPUPagedAttentionBackend,
}
# the Triton kernel runs on these CPU tensors under the interpreter (tests/conftest.py sets it without
# a GPU; tests/kernels/test_triton_attention.py covers it on CUDA tensors)
if triton_attention.available() and os.environ.get("TRITON_INTERPRET") == "1":
    BACKENDS["triton"] = triton_attention.TritonPagedAttentionBackend


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> AttentionBackend:
    if request.param == "cpu-paged" and not cpu_attention.available():
        missing("a C compiler for the CPU attention kernel", "install gcc or clang")
    return BACKENDS[request.param]()


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int) -> torch.Tensor:
    """q [n, HQ, D] at positions q_offset.., k/v [L, HKV, D]; causal."""
    rep = HQ // HKV
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(D)
    qpos = torch.arange(q_offset, q_offset + q.shape[0])[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def make_cache(num_blocks: int, dtype: torch.dtype = torch.float32, tiled: bool = False) -> KVCacheLayer:
    shape = (num_blocks, BS, HKV, D)
    k, v = (
        (
            cpu_attention.transposed_k_cache(*shape, dtype=dtype),
            cpu_attention.head_major_v_cache(*shape, dtype=dtype),
        )
        if tiled
        else (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    )
    if quant.is_quantized(dtype):
        return KVCacheLayer(
            k,
            v,
            torch.zeros(shape[:-1], dtype=quant.SCALE_DTYPE),
            torch.zeros(shape[:-1], dtype=quant.SCALE_DTYPE),
        )
    return KVCacheLayer(k, v)


def scattered_tables(ctx: list[int], new: list[int], bs: int, spare: int) -> tuple[list[list[int]], int]:
    """Block tables for sequences of ctx + new tokens over randomly permuted blocks (with `spare`
    unused ones), and the cache's block count."""
    nb = [(c + n + bs - 1) // bs for c, n in zip(ctx, new, strict=True)]
    perm = torch.randperm(sum(nb) + spare).tolist()
    tables, at = [], 0
    for n in nb:
        tables.append(perm[at : at + n])
        at += n
    return tables, len(perm)


def run_step(
    backend: AttentionBackend,
    cache: KVCacheLayer,
    tables: list[list[int]],
    starts: list[int],
    qlens: list[int],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    slots: list[int] = []
    for table, start, n in zip(tables, starts, qlens, strict=True):
        slots += [table[p // BS] * BS + p % BS for p in range(start, start + n)]
    seq_lens = [s + n for s, n in zip(starts, qlens, strict=True)]
    return backend.forward(q, k, v, cache, step_metadata(slots, qlens, seq_lens, tables), 1 / math.sqrt(D))


def step_metadata(
    slots: list[int], qlens: list[int], seq_lens: list[int], tables: list[list[int]]
) -> AttentionMetadata:
    """One step's metadata: these slots written, these query and sequence lengths, block tables
    padded to the widest."""
    width = max(len(t) for t in tables)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_lens_cpu=qlens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(qlens),
        max_seq_len=max(seq_lens),
    )


@pytest.mark.parametrize(
    "kv_dtype,tol", [(torch.float32, 1e-5), (torch.int8, 3e-2), (torch.float8_e4m3fn, 8e-2)]
)
def test_chunked_prefill_then_batched_decode_matches_dense(
    backend: AttentionBackend, kv_dtype: torch.dtype, tol: float
) -> None:
    torch.manual_seed(0)
    lens = [11, 5, 17]
    # scattered, non-contiguous block tables
    tables = [[7, 2, 9, 0, 12], [3, 1], [4, 8, 10, 5, 11, 6]]
    qs = [torch.randn(n + 3, HQ, D) for n in lens]
    ks = [torch.randn(n + 3, HKV, D) for n in lens]
    vs = [torch.randn(n + 3, HKV, D) for n in lens]
    cache = make_cache(16, kv_dtype, tiled=getattr(backend, "tiled_kv", False))

    # step 1: first chunk of every prompt (at most 6 tokens each)
    chunk = [min(6, n) for n in lens]
    out1 = run_step(
        backend,
        cache,
        tables,
        [0, 0, 0],
        chunk,
        torch.cat([q[:c] for q, c in zip(qs, chunk, strict=True)]),
        torch.cat([k[:c] for k, c in zip(ks, chunk, strict=True)]),
        torch.cat([v[:c] for v, c in zip(vs, chunk, strict=True)]),
    )
    # step 2: the rest of the prompts, attending to the cached first chunk
    rest = [n - c for n, c in zip(lens, chunk, strict=True)]
    live = [i for i, r in enumerate(rest) if r > 0]
    out2 = run_step(
        backend,
        cache,
        [tables[i] for i in live],
        [chunk[i] for i in live],
        [rest[i] for i in live],
        torch.cat([qs[i][chunk[i] : lens[i]] for i in live]),
        torch.cat([ks[i][chunk[i] : lens[i]] for i in live]),
        torch.cat([vs[i][chunk[i] : lens[i]] for i in live]),
    )
    # steps 3..5: batched decode of one token per sequence
    decodes = []
    for j in range(3):
        decodes.append(
            run_step(
                backend,
                cache,
                tables,
                [n + j for n in lens],
                [1, 1, 1],
                torch.stack([q[n + j] for q, n in zip(qs, lens, strict=True)]),
                torch.stack([k[n + j] for k, n in zip(ks, lens, strict=True)]),
                torch.stack([v[n + j] for v, n in zip(vs, lens, strict=True)]),
            )
        )

    for i, n in enumerate(lens):
        want = dense_attention(qs[i], ks[i], vs[i], 0)
        got_prefix = out1[sum(chunk[:i]) : sum(chunk[: i + 1])]
        torch.testing.assert_close(got_prefix, want[: chunk[i]], atol=tol, rtol=tol)
        if i in live:
            off = sum(rest[j] for j in live if j < i)
            torch.testing.assert_close(out2[off : off + rest[i]], want[chunk[i] : n], atol=tol, rtol=tol)
        for j in range(3):
            torch.testing.assert_close(decodes[j][i], want[n + j], atol=tol, rtol=tol)


def test_padding_slots_are_not_written() -> None:
    cache = make_cache(2)
    k = torch.ones(2, HKV, D)
    from kvpilot.kernels.attention import write_kv

    write_kv(k, k, cache, torch.tensor([3, -1]))
    assert cache.k.view(-1, HKV, D)[3].eq(1).all()
    assert cache.k.view(-1, HKV, D).sum() == HKV * D


# Every ISA level this CPU runs (kernels/isa.py) is built and tested. The vectorized path (AVX-512 or
# AVX2, by level) needs K transposed (any cache dtype); every other combination has only
# the portable loop, so it is not generated for the fast path (not skipped: it cannot apply), and the
# generic build has no fast path at all.
KERNEL_CASES = [
    pytest.param(
        dtype, layout, generic, level, id=f"{str(dtype).removeprefix('torch.')}-{layout}-{path}-{level}"
    )
    for level in isa.runnable()
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn)
    for layout in ("rows", "k-transposed", "tiled")
    for generic, path in ((False, "fast-path"), (True, "generic-loop"))
    if generic or (layout != "rows" and level != "generic")
]


@pytest.mark.parametrize(("dtype", "layout", "generic", "level"), KERNEL_CASES)
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (4, 4)], ids=["gqa3", "mqa8", "mha"])
def test_cpu_kernel_matches_reference_on_a_mixed_batch(
    dtype: torch.dtype, layout: str, generic: bool, level: str, heads: tuple[int, int]
) -> None:
    """Decodes and prefill chunks in one step, realistic head sizes, every cache dtype, both kernel paths.

    Unused slots of the sequences' last blocks hold NaN (stale data of a reused block can be
    anything): the kernel must mask them, never multiply them in.
    """
    if not cpu_attention.available(level):
        missing("a C compiler for the CPU attention kernel", "install gcc or clang")
    torch.manual_seed(1)
    (hq, hkv), d, bs = heads, 64, 16
    ctx = [40, 1, 77, 16, 130]  # tokens already cached
    new = [1, 1, 23, 5, 1]
    tables, num_blocks = scattered_tables(ctx, new, bs, spare=4)
    shape = (num_blocks, bs, hkv, d)
    k = (
        cpu_attention.transposed_k_cache(*shape, dtype=dtype)
        if layout != "rows"
        else torch.zeros(shape, dtype=dtype)
    )
    v = (
        cpu_attention.head_major_v_cache(*shape, dtype=dtype)
        if layout == "tiled"
        else torch.zeros(shape, dtype=dtype)
    )
    scales = (
        torch.zeros(shape[:-1], dtype=quant.SCALE_DTYPE),
        torch.zeros(shape[:-1], dtype=quant.SCALE_DTYPE),
    )
    if dtype.is_floating_point and dtype.itemsize > 1:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    cache = KVCacheLayer(k, v, *(scales if quant.is_quantized(dtype) else (None, None)))
    act = torch.bfloat16 if quant.is_quantized(dtype) else dtype
    # fill the cached context through the same write path
    from kvpilot.kernels.attention import write_kv

    for table, c in zip(tables, ctx, strict=True):
        slots_ctx = torch.tensor([table[p // bs] * bs + p % bs for p in range(c)])
        write_kv(torch.randn(c, hkv, d).to(act), torch.randn(c, hkv, d).to(act), cache, slots_ctx)
    t = sum(new)
    q = torch.randn(t, hq, d).to(act)
    kn = torch.randn(t, hkv, d).to(act)
    vn = torch.randn(t, hkv, d).to(act)
    slots: list[int] = []
    for table, c, n in zip(tables, ctx, new, strict=True):
        slots += [table[p // bs] * bs + p % bs for p in range(c, c + n)]
    width = max(len(t) for t in tables)
    lens = [c + n for c, n in zip(ctx, new, strict=True)]
    qsl = [0]
    for n in new:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([x + [0] * (width - len(x)) for x in tables], dtype=torch.int32),
        query_lens_cpu=new,
        seq_lens_cpu=lens,
        max_query_len=max(new),
        max_seq_len=max(lens),
    )
    write_kv(kn, vn, cache, meta.slot_mapping)
    assert cpu_attention.built_isa(level) == level
    # the vectorized path exists at every level but generic, for every case generated for it
    assert cpu_attention.fast_path(hq, cache, level) == (level != "generic" and layout != "rows")
    got = cpu_attention.paged_attention(q, cache, meta, d**-0.5, generic=generic, level=level)
    # the reference reads the very cache the kernel read (same quantized values), NaN slots zeroed:
    # it multiplies whole gathered blocks by masked probabilities, and 0 * NaN is NaN
    if dtype.itemsize > 1:
        cache = KVCacheLayer(torch.nan_to_num(cache.k), torch.nan_to_num(cache.v), None, None)
    want = TorchReferenceBackend().forward(q, kn, vn, cache, meta, d**-0.5)
    assert torch.isfinite(got).all()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("level", [lv for lv in isa.runnable() if lv != "generic"])
def test_bf16_cache_fast_path_is_float32_exact_past_the_cache(level: str) -> None:
    """A bf16 K/V cache read by the vectorized path with float32 queries (what a float32-activation
    model with a bf16 cache sends) gives the float32 answer on the cached values: no rounding of the
    queries or of the probabilities to bf16 on the way. Before the fix, the AVX-512 BF16 build rounded
    both (scores and P.V in vdpbf16ps) and missed by ~1e-3; the others were exact."""
    if not cpu_attention.available(level):
        missing("a C compiler for the CPU attention kernel", "install gcc or clang")
    torch.manual_seed(3)
    hq, hkv, d, bs, ctx = 8, 2, 64, 16, 97
    nblocks = (ctx + bs - 1) // bs
    shape = (nblocks, bs, hkv, d)
    cache = KVCacheLayer(
        cpu_attention.transposed_k_cache(*shape, dtype=torch.bfloat16),
        cpu_attention.head_major_v_cache(*shape, dtype=torch.bfloat16),
        None,
        None,
    )
    from kvpilot.kernels.attention import write_kv

    k = torch.randn(ctx, hkv, d).bfloat16()
    v = torch.randn(ctx, hkv, d).bfloat16()
    write_kv(k, v, cache, torch.arange(ctx))
    q = torch.randn(1, hq, d)  # float32: not exactly a bf16 vector
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([ctx - 1]),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([ctx], dtype=torch.int32),
        block_tables=torch.arange(nblocks, dtype=torch.int32)[None],
        query_lens_cpu=[1],
        seq_lens_cpu=[ctx],
        max_query_len=1,
        max_seq_len=ctx,
    )
    assert cpu_attention.fast_path(hq, cache, level)
    got = cpu_attention.paged_attention(q, cache, meta, d**-0.5, level=level)
    kk = k.double().repeat_interleave(hq // hkv, dim=1)  # [ctx, hq, d]
    vv = v.double().repeat_interleave(hq // hkv, dim=1)
    p = torch.softmax(torch.einsum("hd,chd->hc", q[0].double() * d**-0.5, kk), dim=-1)
    want = torch.einsum("hc,chd->hd", p, vv)[None]
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)


def _paged_step(
    hq: int, hkv: int, ctx: list[int], new: list[int], dtype: torch.dtype, seed: int, d: int = 64
) -> tuple[torch.Tensor, torch.Tensor, KVCacheLayer, AttentionMetadata]:
    """A step over sequences with `ctx` cached and `new` new tokens (head_dim d, block 16, the
    kernel's tiled K/V layout), blocks shuffled in the pool, unused slots NaN; returns (out of the
    reference, q, cache, meta)."""
    from kvpilot.kernels.attention import write_kv

    torch.manual_seed(seed)
    bs = 16
    tables, num_blocks = scattered_tables(ctx, new, bs, spare=3)
    shape = (num_blocks, bs, hkv, d)
    k = cpu_attention.transposed_k_cache(*shape, dtype=dtype)
    v = cpu_attention.head_major_v_cache(*shape, dtype=dtype)
    if dtype.is_floating_point and dtype.itemsize > 1:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    scales = (
        torch.zeros(shape[:-1], dtype=quant.SCALE_DTYPE),
        torch.zeros(shape[:-1], dtype=quant.SCALE_DTYPE),
    )
    cache = KVCacheLayer(k, v, *(scales if quant.is_quantized(dtype) else (None, None)))
    act = torch.bfloat16 if quant.is_quantized(dtype) else dtype
    lens = [c + n for c, n in zip(ctx, new, strict=True)]
    for table, n in zip(tables, lens, strict=True):  # the whole context, this step's tokens too
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        write_kv(torch.randn(n, hkv, d).to(act), torch.randn(n, hkv, d).to(act), cache, slots)
    q = torch.randn(sum(new), hq, d).to(act)
    step_slots = [
        t[p // bs] * bs + p % bs for t, c, n in zip(tables, ctx, new, strict=True) for p in range(c, c + n)
    ]
    meta = step_metadata(step_slots, new, lens, tables)
    if not quant.is_quantized(dtype):
        clean = KVCacheLayer(torch.nan_to_num(cache.k), torch.nan_to_num(cache.v), None, None)
    else:  # the reference reads the dequantized values the kernel reads
        clean = KVCacheLayer(
            cache.k.float() * cache.k_scale.float()[..., None],
            cache.v.float() * cache.v_scale.float()[..., None],
            None,
            None,
        )
    want = TorchReferenceBackend()._varlen(q.float(), clean, meta, d**-0.5)  # the cache is written already
    return want, q, cache, meta


FAST_LEVELS = [lv for lv in isa.runnable() if lv != "generic"]


@pytest.mark.parametrize("level", FAST_LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize(
    "heads", [(9, 3), (8, 1), (4, 4), (10, 2), (14, 2)], ids=["g3", "g8", "g1", "g5", "g7"]
)
def test_prefill_tiles_match_reference(level: str, dtype: torch.dtype, heads: tuple[int, int]) -> None:
    """Prefill chunks long enough for the tiled path (more than 32 new tokens: tiles of 24 / G tokens,
    one ragged; G = 5 and 7 leave pad rows) beside a decode and a 32-token chunk (the one-token
    path), over NaN stale slots, against the reference."""
    if not cpu_attention.available(level):
        missing("a C compiler for the CPU attention kernel", "install gcc or clang")
    hq, hkv = heads
    want, q, cache, meta = _paged_step(hq, hkv, [37, 50, 0, 10, 70], [100, 1, 33, 32, 45], dtype, seed=5)
    got = cpu_attention.paged_attention(q, cache, meta, 64**-0.5, level=level)
    assert torch.isfinite(got).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


# (head_dim, (q heads, kv heads)) of real model families: Llama-3.1-8B / Mistral-7B (128, G 4), Qwen2.5-7B
# (128, G 7), Phi-3-mini (96, MHA: the 512-bit build's last column pass is two vectors wide), an 80-wide
# head (one vector), Gemma (256), and groups past 8 query heads a KV head (G 12, 16, 24: tiles of one or
# two tokens)
REAL_HEADS = [
    (128, (32, 8)),
    (128, (28, 4)),
    (96, (32, 32)),
    (80, (8, 2)),
    (256, (8, 4)),
    (64, (24, 2)),
    (128, (16, 1)),
    (112, (24, 1)),
]
REAL_HEAD_IDS = ["d128-g4", "d128-g7", "d96-mha", "d80-g4", "d256-g2", "d64-g12", "d128-g16", "d112-g24"]


@pytest.mark.parametrize("level", FAST_LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize(("d", "heads"), REAL_HEADS, ids=REAL_HEAD_IDS)
def test_real_model_head_sizes_take_the_tiles(
    level: str, dtype: torch.dtype, d: int, heads: tuple[int, int]
) -> None:
    """Every head_dim that is a multiple of 16 up to 256 and every group of up to 24 query heads a KV
    head takes the vectorized path (before: head_dim 64 and G <= 8 only, so a Llama-3.1-8B or Qwen2.5-7B
    prefill read its whole context once per token in the portable loop), and matches the reference on
    prefill tiles beside decodes over NaN stale slots."""
    if not cpu_attention.available(level):
        missing("a C compiler for the CPU attention kernel", "install gcc or clang")
    hq, hkv = heads
    want, q, cache, meta = _paged_step(hq, hkv, [37, 0, 70], [60, 33, 1], dtype, seed=11, d=d)
    assert cpu_attention.fast_path(hq, cache, level)
    got = cpu_attention.paged_attention(q, cache, meta, d**-0.5, level=level)
    assert torch.isfinite(got).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("level", FAST_LEVELS)
@pytest.mark.parametrize(("d", "heads"), REAL_HEADS[:5], ids=REAL_HEAD_IDS[:5])
def test_real_model_head_sizes_attend_alike_in_chunks_and_segments(
    level: str, d: int, heads: tuple[int, int]
) -> None:
    """The chunk invariance at the wider heads: a 700-token prompt (two segments of keys for its last
    tiles) in one step and in chunks down to single tokens gives the same outputs bit for bit."""
    if not cpu_attention.available(level):
        missing("a C compiler for the CPU attention kernel", "install gcc or clang")
    n = 700
    _, q, cache, meta = _paged_step(*heads, [0], [n], torch.bfloat16, seed=13, d=d)
    whole = cpu_attention.paged_attention(q, cache, meta, d**-0.5, level=level)
    parts, start = [], 0
    for size in (1, 2, 97, 1, 1, 598):
        chunk = _chunk_of(meta, start, size)
        parts.append(
            cpu_attention.paged_attention(q[start : start + size], cache, chunk, d**-0.5, level=level)
        )
        start += size
    assert torch.equal(torch.cat(parts), whole)


@pytest.mark.parametrize("level", FAST_LEVELS)
@pytest.mark.parametrize("d", [72, 120])
def test_head_sizes_off_the_tiles_take_the_portable_loop(level: str, d: int) -> None:
    """A head_dim that is not a multiple of 16 is not the vectorized path's: the portable loop
    answers it, as exactly (wider than 256: test_the_kernels_limits_are_the_backend_choices)."""
    if not cpu_attention.available(level):
        missing("a C compiler for the CPU attention kernel", "install gcc or clang")
    want, q, cache, meta = _paged_step(4, 2, [20, 0], [9, 40], torch.float32, seed=17, d=d)
    assert not cpu_attention.fast_path(4, cache, level)
    got = cpu_attention.paged_attention(q, cache, meta, d**-0.5, level=level)
    torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("level", [*FAST_LEVELS, "generic"])
def test_the_kernels_limits_are_the_backend_choices(level: str) -> None:
    """The C kernel takes exactly the heads kernels/attention.py chooses it for (CPU_KERNEL_MAX_GROUP
    query heads a KV head, CPU_KERNEL_MAX_HEAD_DIM wide) and refuses one past either."""
    if not cpu_attention.available(level):
        missing("a C compiler for the CPU attention kernel", "install gcc or clang")
    g, d = CPU_KERNEL_MAX_GROUP, CPU_KERNEL_MAX_HEAD_DIM
    for hq, hkv, dim, takes in (
        (g, 1, 64, True),
        (g + 1, 1, 64, False),
        (2, 1, d, True),
        (2, 1, d + 16, False),
    ):
        want, q, cache, meta = _paged_step(hq, hkv, [6], [3], torch.float32, seed=3, d=dim)
        assert cpu_kernel_takes(Heads(hq // hkv, dim)) == takes
        if takes:
            got = cpu_attention.paged_attention(q, cache, meta, dim**-0.5, level=level)
            torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=1e-5)
        else:
            with pytest.raises(ValueError, match="rejected its arguments"):
                cpu_attention.paged_attention(q, cache, meta, dim**-0.5, level=level)


def test_the_backend_says_once_which_path_its_heads_take(caplog: pytest.LogCaptureFixture) -> None:
    """At its first call the backend logs the path these heads and this cache take: a head size off
    the vectorized path is a warning that names it and what the fast path needs; later calls say
    nothing more."""
    if not cpu_attention.available():
        missing("a C compiler for the CPU attention kernel", "install gcc or clang")
    vectorized = cpu_attention.built_isa() != "generic"
    for d, fast in ((128, vectorized), (72, False)):
        _, q, cache, meta = _paged_step(8, 2, [5], [3], torch.float32, seed=1, d=d)
        backend = cpu_attention.CPUPagedAttentionBackend()
        caplog.clear()
        with caplog.at_level("INFO", logger="kvpilot.kernels.cpu_attention"):
            for _ in range(2):
                backend.forward(q, torch.randn(3, 2, d), torch.randn(3, 2, d), cache, meta, d**-0.5)
        lines = [r for r in caplog.records if "CPU attention" in r.getMessage()]
        assert len(lines) == 1
        assert f"head_dim {d}" in lines[0].getMessage()
        assert (lines[0].levelname == "INFO") == fast
        if not fast:
            assert "portable loop" in lines[0].getMessage()


def _chunk_of(meta: AttentionMetadata, start: int, n: int) -> AttentionMetadata:
    """One sequence's tokens start..start + n of a whole-prompt step `meta`, as a step of their own."""
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[start : start + n],
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([start + n], dtype=torch.int32),
        block_tables=meta.block_tables,
        query_lens_cpu=[n],
        seq_lens_cpu=[start + n],
        max_query_len=n,
        max_seq_len=start + n,
    )


@pytest.mark.parametrize("level", FAST_LEVELS)
@pytest.mark.parametrize(
    "dtype,heads,chunks",
    [
        (torch.float32, (9, 3), (40, 97, 163)),
        (torch.float32, (9, 3), (1, 2, 7, 1, 30, 259)),  # decodes (tiles of one: the 4-row groups) first
        (torch.bfloat16, (10, 2), (5, 61, 1, 233)),  # G = 5: tiles of 4 tokens, pad rows
        (torch.int8, (14, 2), (3, 3, 100, 194)),  # G = 7: tiles of 3 tokens
        (torch.int8, (9, 3), (1, 1, 17, 1, 280)),  # int8 decodes: 2 blocks a pass, scales folded into P
        (torch.float8_e4m3fn, (9, 3), (2, 1, 1, 296)),  # float8 through float16, decodes
        (torch.bfloat16, (4, 2), (1, 3, 1, 295)),  # G = 2: a decode of 2 rows
        (torch.float16, (8, 1), (13, 287)),  # G = 8
    ],
    ids=[
        "f32-g3",
        "f32-g3-decodes",
        "bf16-g5",
        "int8-g7",
        "int8-g3-decodes",
        "fp8-g3-decodes",
        "bf16-g2-decodes",
        "f16-g8",
    ],
)
def test_a_prompt_in_chunks_attends_exactly_as_in_one_step(
    level: str, dtype: torch.dtype, heads: tuple[int, int], chunks: tuple[int, ...]
) -> None:
    """A row's attention depends only on its query and its keys, never on the tile, the row group or
    the chunk it ran in: a 300-token prompt in one step and in chunks (down to single tokens, which
    take a decode's row groups) give the same outputs, bit for bit, at every vectorized level (the
    premise of chunked prefill at any --max-num-batched-tokens)."""
    if not cpu_attention.available(level):
        missing("a C compiler for the CPU attention kernel", "install gcc or clang")
    assert sum(chunks) == 300
    _, q, cache, meta = _paged_step(*heads, [0], [300], dtype, seed=7)
    whole = cpu_attention.paged_attention(q, cache, meta, 0.125, level=level)
    parts, start = [], 0
    for n in chunks:
        chunk = _chunk_of(meta, start, n)
        parts.append(cpu_attention.paged_attention(q[start : start + n], cache, chunk, 0.125, level=level))
        start += n
    assert torch.equal(torch.cat(parts), whole)


@pytest.mark.parametrize("level", FAST_LEVELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_a_long_context_in_segments_attends_alike_on_any_schedule(level: str, dtype: torch.dtype) -> None:
    """Keys are taken in segments of 512 folded in key order: a 2,600-token prompt's last tokens
    attend bit for bit alike in one step (many tiles: each tile's segments in turn on one thread) and
    as decodes and a short chunk (three items for two threads: the segments split across threads and
    folded after), at any thread count, and as the reference does."""
    if not cpu_attention.available(level):
        missing("a C compiler for the CPU attention kernel", "install gcc or clang")
    n = 2600
    want, q, cache, meta = _paged_step(9, 3, [0], [n], dtype, seed=9)
    whole = cpu_attention.paged_attention(q, cache, meta, 64**-0.5, level=level)
    torch.testing.assert_close(whole.float(), want, atol=2e-2, rtol=2e-2)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            parts, start = [], n - 11
            for size in (1, 1, 8, 1):
                chunk = _chunk_of(meta, start, size)
                got = cpu_attention.paged_attention(
                    q[start : start + size], cache, chunk, 64**-0.5, level=level
                )
                parts.append(got)
                start += size
            assert torch.equal(torch.cat(parts), whole[n - 11 :]), threads
    finally:
        torch.set_num_threads(before)
