/*
 * Paged attention for CPUs: every new token attends, through its sequence's block table, to the
 * keys at or before its position, reading K/V straight out of the block pool (no gather copy).
 *
 * Layouts (the same as the torch reference and flash-attn):
 *   q, out:          [T, Hq, D]            T = new tokens of all sequences, flat
 *   k_cache/v_cache: [NB, BS, Hkv, D]      element type kv_dtype
 *   k_cache when k_transposed: [NB, Hkv, D, BS] storage: each block holds K^T per head, so the
 *                    scores of a whole block are D vector FMAs across its keys, no horizontal sums
 *   v_cache when v_head_major: [NB, Hkv, BS, D] storage, so with K^T a (block, head) pair's keys and
 *                    values are two contiguous tiles (streamed, not strided across the heads)
 *   k/v_scale:       [NB, BS, Hkv] float16 (only for int8 / fp8 storage; x = q * scale)
 *   block_tables:    [B, max_blocks] int32
 *   query_start_loc: [B + 1] int32;  seq_lens: [B] int32 (context length after this step)
 *
 * One work item of the portable loop is (token, kv head): the G = Hq / Hkv query heads of a group
 * share every K/V row they load. Softmax is computed online, one block of keys at a time. Parallel
 * with OpenMP (the process's libgomp, the one torch already loaded). With block size 16, K transposed
 * and a head_dim that is a multiple of 16 up to 256, a vectorized path runs instead unless allow_fast is 0: one work
 * item is a tile of consecutive tokens x kv head (tile_item), the same code in a build for avx512
 * (AVX-512 registers) and in one for avx2 (AVX2+FMA+F16C); isa.h, kernels/isa.py picks the build
 * from the CPU's features. The generic build has only the portable loop.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "isa.h"
#include "kvpilot_kernels.h"

#define MAX_G 32
#define MAX_D 256
#define MAX_BS 256

static float fp8_table[256];
static int fp8_ready = 0;

static void init_fp8_table(void) {
    /* float8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; 0x7f/0xff NaN */
    for (int i = 0; i < 256; i++) {
        int sign = i >> 7, e = (i >> 3) & 15, m = i & 7;
        float v;
        if (e == 15 && m == 7) v = NAN;
        else if (e == 0) v = ldexpf((float)m / 8.0f, -6);
        else v = ldexpf(1.0f + (float)m / 8.0f, e - 7);
        fp8_table[i] = sign ? -v : v;
    }
    fp8_ready = 1;
}

static inline size_t elem_size(int dt) {
    switch (dt) {
        case DT_F32: return 4;
        case DT_BF16: case DT_F16: return 2;
        default: return 1;
    }
}

/* Load n values of type dt starting at p (element offset off) into dst as float, times scale. */
static inline void load_row(const void *base, int dt, size_t off, int n, float scale, float *dst) {
    switch (dt) {
        case DT_F32: {
            const float *p = (const float *)base + off;
            for (int i = 0; i < n; i++) dst[i] = p[i];
            break;
        }
        case DT_BF16: {
            const uint16_t *p = (const uint16_t *)base + off;
            for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(p[i]);
            break;
        }
        case DT_F16: {
            const uint16_t *p = (const uint16_t *)base + off;
            for (int i = 0; i < n; i++) dst[i] = f16_to_f32(p[i]);
            break;
        }
        case DT_I8: {
            const int8_t *p = (const int8_t *)base + off;
            for (int i = 0; i < n; i++) dst[i] = (float)p[i] * scale;
            break;
        }
        case DT_FP8: {
            const uint8_t *p = (const uint8_t *)base + off;
            for (int i = 0; i < n; i++) dst[i] = fp8_table[p[i]] * scale;
            break;
        }
    }
}

static inline void store_row(void *base, int dt, size_t off, int n, const float *src) {
    switch (dt) {
        case DT_F32: memcpy((float *)base + off, src, (size_t)n * 4); break;
        case DT_BF16: {
            uint16_t *p = (uint16_t *)base + off;
            for (int i = 0; i < n; i++) p[i] = f32_to_bf16(src[i]);
            break;
        }
        case DT_F16: {
            uint16_t *p = (uint16_t *)base + off;
            for (int i = 0; i < n; i++) p[i] = f32_to_f16(src[i]);
            break;
        }
    }
}

#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
/*
 * Vectorized path: head_dim D a multiple of 16 up to MAX_FD (256: 64, 96, 128 and 256 are what models use; 64
 * and 128 are constants in their own instantiations, others a runtime bound), block size 16, K transposed,
 * 1 <= G <= 24 (a tile holds one token's query rows at least), K/V in
 * float32, bfloat16, float16, int8 or float8 e4m3fn (widened to float32 in registers: every product
 * is a float32 one; no bf16 dot product, see docs/runtime.md "Precision"; a quantized cache's scales
 * multiply the scores and P, once per key). Every token takes the tiles below (tile_item); other
 * shapes take the generic loop. float8 is widened through float16: its byte b, as the float16 bits
 * (b & 0x80) << 8 | (b & 0x7f) << 7, is exactly value / 256 (subnormals too; the NaN codes 0x7f / 0xff,
 * which the C write produces only from a NaN or an overflow, read as +-480 here, NaN in the generic loop).
 *
 * One tile code for both levels: it is written over v16, a vector of a block's 16 keys (or 16 output
 * columns), and a handful of primitives defined once per level just below: one __m512 at avx512,
 * two __m256 at avx2 (AVX2 + FMA + F16C). Only the register blocking differs (32 zmm registers
 * against 16 ymm): QK_ROWS query rows per S group (8 at avx512: 8 accumulators; 6 at avx2: 12 ymm),
 * and P.V over PV_ROWS rows x PV_COLS x 16 output columns per pass (4 x 64 at avx512: 16 zmm
 * accumulators, a narrower last pass where D is not a multiple of 64; 6 x 16 at avx2: 12 ymm, D / 16
 * passes over the chunk's V rows, in L1 by then).
 */
#include <immintrin.h>

#define KVPILOT_FAST 1
#define MAX_FD 256 /* head_dim of the vectorized path: a multiple of 16 up to this */
#define quantized(dt) ((dt) == DT_I8 || (dt) == DT_FP8) /* scales per (token, head) */
#define FBS 16
#define MAX_FG 24 /* = TROWS: a tile holds one token's G query rows at least */
#define NEG_BIG (-1e30f) /* stands in for -inf: -ffast-math assumes there are no infinities */
#define VI static inline __attribute__((always_inline))

#if defined(KVPILOT_ISA_AVX512)
#define QK_ROWS 8
#define QK_BLOCKS 4 /* a decode's blocks per S pass: up to 4 x 4 accumulators, 4 K^T rows */
#define PV_ROWS 4
#define PV_COLS 4
typedef __m512 v16;
typedef __mmask16 m16; /* the live lanes of a v16 */

VI v16 vzero(void) { return _mm512_setzero_ps(); }
VI v16 vset1(float x) { return _mm512_set1_ps(x); }
VI v16 vload(const float *p) { return _mm512_load_ps(p); } /* p 64-byte aligned */
VI v16 vloadu(const float *p) { return _mm512_loadu_ps(p); }
VI void vstore(float *p, v16 x) { _mm512_store_ps(p, x); }
VI v16 vadd(v16 a, v16 b) { return _mm512_add_ps(a, b); }
VI v16 vsub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
VI v16 vmul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
VI v16 vfmadd(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
VI m16 vlive(int n) { /* lanes 0 .. n-1 */
    return n >= FBS ? (__mmask16)0xFFFFu : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}
VI v16 vmax_live(v16 mx, m16 live, v16 x) { return _mm512_mask_max_ps(mx, live, mx, x); }
VI v16 vkeep(m16 live, v16 x) { return _mm512_maskz_mov_ps(live, x); } /* dead lanes 0 (NaN too) */
VI float vreduce_max(v16 x) { return _mm512_reduce_max_ps(x); }
VI float vreduce_add(v16 x) { return _mm512_reduce_add_ps(x); }

/* 16 values of type dt at element offset off, as float32 */
VI v16 ld16(const void *base, int dt, size_t off) {
    switch (dt) {
        case DT_F32: return _mm512_loadu_ps((const float *)base + off);
        case DT_BF16:
            return _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off))),
                16));
        case DT_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off)));
        case DT_FP8: { /* fp8_as_f16: the float16 of value / 256 */
            const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)base + off)));
            return _mm512_cvtph_ps(
                _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(x, 8), _mm256_set1_epi16((short)0x8000)),
                                _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(0x3f80))));
        }
        default: /* DT_I8 */
            return _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)base + off))));
    }
}

/* exp(x) for x <= 0 (Cephes expf's polynomial, relative error ~2e-7; exp(x < -87) ~ 0) */
VI v16 vexp(v16 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, k);
}
#else /* KVPILOT_ISA_AVX2 */
#define QK_ROWS 6
#define QK_BLOCKS 2 /* 4 x 2 x 2 ymm accumulators and 2 x 2 K^T rows of 16 ymm */
#define PV_ROWS 6
#define PV_COLS 1
typedef struct {
    __m256 lo, hi; /* lanes 0-7, 8-15 */
} v16;
typedef v16 m16; /* all-ones lanes where live */

VI v16 v16of(__m256 lo, __m256 hi) {
    v16 r = {lo, hi};
    return r;
}
VI v16 vzero(void) { return v16of(_mm256_setzero_ps(), _mm256_setzero_ps()); }
VI v16 vset1(float x) {
    const __m256 b = _mm256_set1_ps(x);
    return v16of(b, b);
}
VI v16 vload(const float *p) { return v16of(_mm256_load_ps(p), _mm256_load_ps(p + 8)); } /* 32-byte aligned */
VI v16 vloadu(const float *p) { return v16of(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
VI void vstore(float *p, v16 x) {
    _mm256_store_ps(p, x.lo);
    _mm256_store_ps(p + 8, x.hi);
}
VI v16 vadd(v16 a, v16 b) { return v16of(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
VI v16 vsub(v16 a, v16 b) { return v16of(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
VI v16 vmul(v16 a, v16 b) { return v16of(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
VI v16 vfmadd(v16 a, v16 b, v16 c) {
    return v16of(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
VI m16 vlive(int n) { /* lanes 0 .. n-1 */
    const __m256 nv = _mm256_set1_ps((float)n);
    return v16of(_mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), nv, _CMP_LT_OQ),
                 _mm256_cmp_ps(_mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15), nv, _CMP_LT_OQ));
}
VI v16 vmax_live(v16 mx, m16 live, v16 x) { /* a dead lane keeps mx whatever x holds (NaN too) */
    return v16of(_mm256_blendv_ps(mx.lo, _mm256_max_ps(mx.lo, x.lo), live.lo),
                 _mm256_blendv_ps(mx.hi, _mm256_max_ps(mx.hi, x.hi), live.hi));
}
VI v16 vkeep(m16 live, v16 x) { return v16of(_mm256_and_ps(live.lo, x.lo), _mm256_and_ps(live.hi, x.hi)); }
VI float vreduce_max(v16 v) {
    __m256 y = _mm256_max_ps(v.lo, v.hi);
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
VI float vreduce_add(v16 v) {
    __m256 y = _mm256_add_ps(v.lo, v.hi);
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* 8 values of type dt at element offset off, as float32 */
VI __m256 ld8(const void *base, int dt, size_t off) {
    switch (dt) {
        case DT_F32: return _mm256_loadu_ps((const float *)base + off);
        case DT_BF16:
            return _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + off))), 16));
        case DT_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + off)));
        case DT_FP8: { /* fp8_as_f16: the float16 of value / 256 */
            const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)((const uint8_t *)base + off)));
            return _mm256_cvtph_ps(_mm_or_si128(_mm_and_si128(_mm_slli_epi16(x, 8), _mm_set1_epi16((short)0x8000)),
                                                _mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16(0x3f80))));
        }
        default: /* DT_I8 */
            return _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + off))));
    }
}
VI v16 ld16(const void *base, int dt, size_t off) { return v16of(ld8(base, dt, off), ld8(base, dt, off + 8)); }

/* exp(x) for x <= 0 (the avx512 polynomial; 2^k built in the exponent bits, k >= -126) */
VI __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
VI v16 vexp(v16 x) { return v16of(exp8(x.lo), exp8(x.hi)); }
#endif

/*
 * Tiles: a sequence's new tokens are split into tiles of TQ(G) = 24 / G consecutive tokens (a decode
 * step: one token), and one work item is (tile, kv head): its R = tokens x G query rows share every
 * K/V block they load, where one item per token read the whole context once per token (a 4,096-token
 * prefill spent 24 of 40 s there). Per chunk of TKC keys (4 blocks): S = Q K^T for QK_ROWS rows at a
 * time (a decode of R <= 4 rows: its R rows and QK_BLOCKS blocks a pass), one K^T row load per row's
 * broadcast-FMA; the causal mask; one online-softmax update per row for the whole chunk (the
 * horizontal max and sum once per 64 keys, not per 16); then O += P V for PV_ROWS rows (R for such a
 * decode) and PV_COLS x 16 columns at a time, one V load per PV_ROWS broadcast-FMAs. A row's result depends only on its own query and keys (chunks
 * start at absolute key positions; masked keys add exact zeros), never on the other rows of its tile:
 * a prompt computed in chunks of any size, a decode and a speculative verification of the same token
 * attend bit for bit alike (at one level: the levels round differently).
 */
#define TROWS 24 /* query rows of a tile: tokens x G (at most; a multiple of QK_ROWS, PV_ROWS and 4) */
#define TKC 64   /* keys per softmax update */
#define PF_CHUNKS 2 /* software prefetch distance in chunks of TKC keys */

static inline int tile_tokens(int G) { return TROWS / G; }

/* S rows [NR][NB x 16] (row stride TKC) = NR query rows . NB blocks' K^T tiles (times the keys' int8
 * scales): NR x NB accumulators, each key's dot product summed over d in order whatever NR and NB are
 * (a decode of few rows takes QK_BLOCKS blocks at once so that enough FMA chains are in flight, and drops the
 * pad rows; its results equal a prefill's bit for bit). Meanwhile the K (and head-major V) tiles at
 * pk / pv, PF_CHUNKS chunks ahead, are fetched into L2 a line at a time (one burst of 512 prefetches
 * per chunk, or the hardware prefetcher alone, left a decode at 16k keys 1.25x slower at avx512: a
 * block's tiles are 4 KiB apart in the pool; with nothing left to fetch, pk / pv name the current
 * tile, so that the loop has no branch) */
VI void qk_rows(const int NR, const int NB, const int PF, const int dt, const int D, const float *qr, const void *k_cache,
                const size_t *tile, const v16 *ks, float *sp, const char *const *pk, const char *const *pv) {
    const int PSTEP = (int)(64 / (FBS * elem_size(dt))); /* K^T rows per 64-byte line: 1 (f32), 2, 4 (int8) */
    v16 s[QK_ROWS][QK_BLOCKS];
    for (int j = 0; j < NR; j++)
        for (int b = 0; b < NB; b++) s[j][b] = vzero();
    for (int d = 0; d < D; d++) {
        if (PF && d % PSTEP == 0) /* one line of a later block's K and V tiles per PSTEP rows */
            for (int b = 0; b < NB; b++) {
                _mm_prefetch(pk[b] + (d / PSTEP) * 64, _MM_HINT_T1);
                _mm_prefetch(pv[b] + (d / PSTEP) * 64, _MM_HINT_T1);
            }
        v16 k[QK_BLOCKS];
        for (int b = 0; b < NB; b++) k[b] = ld16(k_cache, dt, tile[b] + (size_t)d * FBS);
        for (int j = 0; j < NR; j++) {
            const v16 q = vset1(qr[j * D + d]);
            for (int b = 0; b < NB; b++) s[j][b] = vfmadd(q, k[b], s[j][b]);
        }
    }
    for (int j = 0; j < NR; j++)
        for (int b = 0; b < NB; b++) vstore(sp + j * TKC + b * FBS, quantized(dt) ? vmul(s[j][b], ks[b]) : s[j][b]);
}

/* O rows [NR][D] = corr O + P V over the chunk's nk keys from key c0 (P rows [NR][TKC] in sp, for int8
 * already times the values' scales), columns [col, col + 16 NC): NR x NC accumulators, one V load per NR
 * broadcast-FMAs */
VI void pv_cols(const int NR, const int NC, const int dt, const int D, int col, float *o, const float *sp,
                const float *corr, int c0, int nk, const void *v_cache, const int32_t *table, int Hkv, int h,
                int vhm) {
    v16 acc[PV_ROWS][PV_COLS];
    for (int j = 0; j < NR; j++) {
        const v16 cv = vset1(corr[j]);
        for (int c = 0; c < NC; c++) acc[j][c] = vmul(vload(o + j * D + col + c * 16), cv);
    }
    for (int bb = 0; bb * FBS < nk; bb++) {
        const size_t blk = (size_t)table[c0 / FBS + bb];
        const int n = nk - bb * FBS < FBS ? nk - bb * FBS : FBS;
        for (int kr = 0; kr < n; kr++) {
            const size_t off = (vhm ? (blk * Hkv + h) * FBS + kr : (blk * FBS + kr) * Hkv + h) * (size_t)D;
            v16 v[PV_COLS];
            for (int c = 0; c < NC; c++) v[c] = ld16(v_cache, dt, off + (size_t)(col + c * 16));
            for (int j = 0; j < NR; j++) {
                const v16 p = vset1(sp[j * TKC + bb * FBS + kr]);
                for (int c = 0; c < NC; c++) acc[j][c] = vfmadd(p, v[c], acc[j][c]);
            }
        }
    }
    for (int j = 0; j < NR; j++)
        for (int c = 0; c < NC; c++) vstore(o + j * D + col + c * 16, acc[j][c]);
}

/* pv_cols over all D columns, PV_COLS x 16 a pass (the last pass narrower where D is not a multiple of that) */
VI void pv_rows(const int NR, const int dt, const int D, float *o, const float *sp, const float *corr, int c0, int nk,
                const void *v_cache, const int32_t *table, int Hkv, int h, int vhm) {
    for (int col = 0; col < D; col += PV_COLS * 16) {
        const int left = (D - col) / 16;
#define PV_COLS_N(NC) pv_cols(NR, NC, dt, D, col, o, sp, corr, c0, nk, v_cache, table, Hkv, h, vhm)
        if (left >= PV_COLS) PV_COLS_N(PV_COLS);
#if PV_COLS == 4
        else if (left == 3) PV_COLS_N(3);
        else if (left == 2) PV_COLS_N(2);
        else PV_COLS_N(1);
#endif
#undef PV_COLS_N
    }
}

/* 16 float16 scales of one block's keys (or values) for kv head h, as float32 (times 256 for float8,
 * which ld16 reads as value / 256: exact, a power of two); 0 past the n live keys */
VI v16 block_scales(const int dt, const uint16_t *scale, size_t blk, int Hkv, int h, int n) {
    const float unit = dt == DT_FP8 ? 256.0f : 1.0f;
    float f[FBS];
    for (int j = 0; j < FBS; j++) f[j] = j < n ? f16_to_f32(scale[(blk * FBS + j) * Hkv + h]) * unit : 0.0f;
    return vloadu(f);
}

/* a decode's rows (R <= SMALL_R, no pad rows) with NR a constant in each instantiation */
#define SMALL_R 4
#define BY_ROWS(R, CALL)                                                                                       \
    switch (R) {                                                                                               \
        case 1: CALL(1); break;                                                                                \
        case 2: CALL(2); break;                                                                                \
        case 3: CALL(3); break;                                                                                \
        default: CALL(4); break;                                                                               \
    }

/* One segment's keys [s0, s1) (SEG-aligned) of a tile's rows: o the unnormalized P V (online softmax from a
 * fresh state), mo / lo each row's running max and sum (seg_fold merges the segments) */
VI void tile_item(const int dt, const int D, const int R, const float *qs /* [TROWS][D], scaled, pad rows 0 */,
                  float *o /* [TROWS][D], 64-byte aligned */, const int *rctx /* [TROWS] keys each row may see */,
                  const void *k_cache, const void *v_cache, const uint16_t *k_scale, const uint16_t *v_scale,
                  const int32_t *table, int Hkv, int h, int vhm, int s0, int s1, float *mo, float *lo) {
    float sb[TROWS][TKC] __attribute__((aligned(64)));
    float m[TROWS], l[TROWS], corr[TROWS];
    const int small = R <= SMALL_R; /* a decode of G <= 4 query heads: its rows alone, QK_BLOCKS blocks a pass */
    const int qrows = small ? R : QK_ROWS, prows = small ? R : PV_ROWS;
    const int Rq = (R + qrows - 1) / qrows * qrows, Rp = (R + prows - 1) / prows * prows;
    const size_t tile_bytes = (size_t)D * FBS * elem_size(dt);
    int ctx_max = 0;
    for (int r = 0; r < R; r++) ctx_max = rctx[r] > ctx_max ? rctx[r] : ctx_max;
    const int ctx_blocks = (ctx_max + FBS - 1) / FBS;
    for (int r = 0; r < Rp; r++) {
        m[r] = NEG_BIG;
        l[r] = 0.0f;
        for (int c = 0; c < D; c += 16) vstore(o + r * D + c, vzero());
    }
    const int cend = ctx_max < s1 ? ctx_max : s1;
    for (int c0 = s0; c0 < cend; c0 += TKC) {
        const int nk = ctx_max - c0 < TKC ? ctx_max - c0 : TKC; /* keys of this chunk any row sees */
        const int nbk = (nk + FBS - 1) / FBS;
        /* S = Q K^T: qrows rows and 1 block of 16 keys at a time (up to QK_BLOCKS for a decode) */
        for (int bb = 0; bb < nbk;) {
            const int nb = small ? (nbk - bb < QK_BLOCKS ? nbk - bb : QK_BLOCKS) : 1;
            size_t tile[QK_BLOCKS];
            v16 ks[QK_BLOCKS];
            const char *pk[QK_BLOCKS], *pv[QK_BLOCKS];
            for (int b = 0; b < nb; b++) {
                const size_t blk = (size_t)table[c0 / FBS + bb + b];
                tile[b] = (blk * Hkv + h) * (size_t)D * FBS;
                const int ahead = (c0 + PF_CHUNKS * TKC) / FBS + bb + b;
                const size_t nbl = ahead < ctx_blocks ? (size_t)table[ahead] : blk;
                pk[b] = (const char *)k_cache + (nbl * Hkv + h) * tile_bytes;
                pv[b] = vhm ? (const char *)v_cache + (nbl * Hkv + h) * tile_bytes : pk[b];
                ks[b] = quantized(dt) ? block_scales(dt, k_scale, blk, Hkv, h, nk - (bb + b) * FBS) : vset1(1.0f);
            }
            if (small) {
#define QK_NB(NR, NB) qk_rows(NR, NB, 1, dt, D, qs, k_cache, tile, ks, &sb[0][bb * FBS], pk, pv)
#if QK_BLOCKS == 4
#define QK_SMALL(NR)                                                                                           \
    switch (nb) {                                                                                              \
        case 4: QK_NB(NR, 4); break;                                                                           \
        case 3: QK_NB(NR, 3); break;                                                                           \
        case 2: QK_NB(NR, 2); break;                                                                           \
        default: QK_NB(NR, 1); break;                                                                          \
    }
#else
#define QK_SMALL(NR)                                                                                           \
    switch (nb) {                                                                                              \
        case 2: QK_NB(NR, 2); break;                                                                           \
        default: QK_NB(NR, 1); break;                                                                          \
    }
#endif
                BY_ROWS(R, QK_SMALL)
#undef QK_SMALL
#undef QK_NB
            } else {
                qk_rows(QK_ROWS, 1, 1, dt, D, qs, k_cache, tile, ks, &sb[0][bb * FBS], pk, pv); /* prefetches */
                for (int r0 = QK_ROWS; r0 < Rq; r0 += QK_ROWS)
                    qk_rows(QK_ROWS, 1, 0, dt, D, qs + r0 * D, k_cache, tile, ks, &sb[r0][bb * FBS], pk, pv);
            }
            bb += nb;
        }
        /* mask, one online-softmax update per row, P in place of S */
        for (int r = 0; r < Rp; r++) {
            const int vis = r < R ? (rctx[r] - c0 < nk ? rctx[r] - c0 : nk) : 0;
            if (vis <= 0) { /* nothing of this chunk is visible to the row (or a pad row) */
                corr[r] = 1.0f;
                for (int bb = 0; bb < nbk; bb++) vstore(&sb[r][bb * FBS], vzero());
                continue;
            }
            v16 mx = vset1(NEG_BIG);
            m16 live[TKC / FBS];
            for (int bb = 0; bb < nbk; bb++) {
                live[bb] = vlive(vis - bb * FBS);
                mx = vmax_live(mx, live[bb], vload(&sb[r][bb * FBS]));
            }
            const float bmax = vreduce_max(mx);
            const float m_new = bmax > m[r] ? bmax : m[r];
            corr[r] = m[r] == NEG_BIG ? 0.0f : expf(m[r] - m_new);
            const v16 mv = vset1(m_new);
            v16 sum = vzero();
            for (int bb = 0; bb < nbk; bb++) {
                const v16 p = vkeep(live[bb], vexp(vsub(vload(&sb[r][bb * FBS]), mv)));
                sum = vadd(sum, p);
                vstore(&sb[r][bb * FBS], p);
            }
            l[r] = l[r] * corr[r] + vreduce_add(sum);
            m[r] = m_new;
        }
        if (quantized(dt)) { /* P times the values' scales: one multiply per key and row, not per value */
            for (int bb = 0; bb < nbk; bb++) {
                const v16 vs = block_scales(dt, v_scale, (size_t)table[c0 / FBS + bb], Hkv, h, nk - bb * FBS);
                for (int r = 0; r < Rp; r++) vstore(&sb[r][bb * FBS], vmul(vload(&sb[r][bb * FBS]), vs));
            }
        }
        /* O = corr O + P V, prows rows at a time */
        if (small) {
#define PV_SMALL(NR) pv_rows(NR, dt, D, o, &sb[0][0], corr, c0, nk, v_cache, table, Hkv, h, vhm)
            BY_ROWS(R, PV_SMALL)
#undef PV_SMALL
        } else {
            for (int r0 = 0; r0 < Rp; r0 += PV_ROWS)
                pv_rows(PV_ROWS, dt, D, o + r0 * D, &sb[r0][0], corr + r0, c0, nk, v_cache, table, Hkv, h, vhm);
        }
    }
    for (int r = 0; r < R; r++) mo[r] = m[r], lo[r] = l[r];
}

/* (M, L, O) of R rows, folded with one segment's (m, l, o): a row's segments in key order, by the same
 * arithmetic whichever thread computed each; folded into the empty state (M = NEG_BIG, L = 0, O = 0) a
 * segment passes through exactly, so a context of one segment is what the unsegmented loop gave */
static inline void seg_fold(int R, int D, float *M, float *L, float *O, const float *m, const float *l, const float *o) {
    for (int r = 0; r < R; r++) {
        const float mx = m[r] > M[r] ? m[r] : M[r];
        const float a = M[r] == mx ? 1.0f : (M[r] == NEG_BIG ? 0.0f : expf(M[r] - mx));
        const float b = m[r] == mx ? 1.0f : (m[r] == NEG_BIG ? 0.0f : expf(m[r] - mx));
        const v16 va = vset1(a), vb = vset1(b);
        for (int c = 0; c < D; c += 16)
            vstore(O + r * D + c, vfmadd(vload(O + r * D + c), va, vmul(vload(o + r * D + c), vb)));
        L[r] = L[r] * a + l[r] * b;
        M[r] = mx;
    }
}

static inline void seg_empty(int R, int D, float *M, float *L, float *O) {
    for (int r = 0; r < R; r++) {
        M[r] = NEG_BIG, L[r] = 0.0f;
        for (int c = 0; c < D; c += 16) vstore(O + r * D + c, vzero());
    }
}

/* o = O / L, row by row (0 where a row saw no key) */
static inline void seg_normalize(int R, int D, const float *L, float *O) {
    for (int r = 0; r < R; r++) {
        const v16 inv = vset1(L[r] > 0.0f ? 1.0f / L[r] : 0.0f);
        for (int c = 0; c < D; c += 16) vstore(O + r * D + c, vmul(vload(O + r * D + c), inv));
    }
}

static int fast_path_applies(int G, int D, int BS, int kv_dtype, int k_transposed) {
    return G >= 1 && G <= MAX_FG && D >= 16 && D <= MAX_FD && D % 16 == 0 && BS == FBS && k_transposed &&
           (kv_dtype == DT_F32 || kv_dtype == DT_BF16 || kv_dtype == DT_F16 || kv_dtype == DT_I8 ||
            kv_dtype == DT_FP8);
}

/* tile_item for a cache dtype and head_dim, each a constant in its instantiation where common (64, 128) */
#define TILE_DT(dt, DC) \
    tile_item(dt, DC, R, qs, o, rctx, k_cache, v_cache, k_scale, v_scale, table, Hkv, h, vhm, s0, s1, m, l)
#define TILE_D(dt)                                                                                             \
    switch (D) {                                                                                               \
        case 64: TILE_DT(dt, 64); break;                                                                       \
        case 128: TILE_DT(dt, 128); break;                                                                     \
        default: TILE_DT(dt, D); break;                                                                        \
    }
static void tile_dispatch(int kv_dtype, int D, int R, const float *qs, float *o, const int *rctx, const void *k_cache,
                          const void *v_cache, const uint16_t *k_scale, const uint16_t *v_scale,
                          const int32_t *table, int Hkv, int h, int vhm, int s0, int s1, float *m, float *l) {
    switch (kv_dtype) {
        case DT_F32: TILE_D(DT_F32); break;
        case DT_BF16: TILE_D(DT_BF16); break;
        case DT_F16: TILE_D(DT_F16); break;
        case DT_FP8: TILE_D(DT_FP8); break;
        default: TILE_D(DT_I8); break;
    }
}
#undef TILE_D
#undef TILE_DT

/* A row's keys are taken in segments of SEG (a multiple of TKC) at absolute positions, each from a fresh
 * online softmax, and the segments folded in key order (seg_fold): the same sums whether one thread
 * runs a tile's segments in turn (tile_whole) or, when a call has few tiles for its threads (a decode of
 * one or a few long sequences: 3 items for SmolLM2's 3 KV heads, whatever the cores), the segments are
 * items of their own and folded after (tiles_split). A context of one segment is the unsegmented loop's
 * result bit for bit. */
#define SEG 512
#define SPLIT_ITEMS 4 /* (tile, head) items per thread under which the segments are split */
#define SPLIT_SEGS 4  /* ... when a tile has this many segments: below, the split's cost (~5 us) outweighs it */

typedef struct { /* the arguments of one kvpilot_paged_attention call the tiles read */
    const void *q, *k_cache, *v_cache;
    void *out;
    const uint16_t *k_scale, *v_scale;
    const int32_t *block_tables, *query_start_loc, *seq_lens;
    int q_dtype, kv_dtype, vhm, max_blocks, G, Hq, Hkv, D;
    float sm_scale;
} att_call;

/* unit u's query rows for kv head h as tile_item takes them (scaled; pad rows 0) and the keys each row
 * may see (rising: the last row's is the tile's most); returns the rows R */
static int tile_load(const att_call *c, const int32_t *u, int h, float *qs, int *rctx) {
    const int b = u[0], t = u[1], R = u[2] * c->G;
    const int qlen = c->query_start_loc[b + 1] - c->query_start_loc[b];
    const int ctx = c->seq_lens[b] - qlen + (t - c->query_start_loc[b]) + 1; /* keys the first token may see */
    const int D = c->D;
    memset(qs, 0, sizeof(float) * TROWS * D);
    for (int r = 0; r < R; r++) {
        const int i = r / c->G, g = r % c->G;
        load_row(c->q, c->q_dtype, ((size_t)(t + i) * c->Hq + (size_t)h * c->G + g) * D, D, 1.0f, qs + r * D);
        for (int d = 0; d < D; d++) qs[r * D + d] *= c->sm_scale;
        rctx[r] = ctx + i;
    }
    return R;
}

static void tile_store(const att_call *c, const int32_t *u, int h, int R, const float *o) {
    for (int r = 0; r < R; r++)
        store_row(c->out, c->q_dtype, ((size_t)(u[1] + r / c->G) * c->Hq + (size_t)h * c->G + r % c->G) * c->D,
                  c->D, o + r * c->D);
}

static void tile_seg(const att_call *c, const int32_t *u, int h, int R, const float *qs, const int *rctx, int s0,
                     float *o, float *m, float *l) {
    tile_dispatch(c->kv_dtype, c->D, R, qs, o, rctx, c->k_cache, c->v_cache, c->k_scale, c->v_scale,
                  c->block_tables + (size_t)u[0] * c->max_blocks, c->Hkv, h, c->vhm, s0, s0 + SEG, m, l);
}

static inline int tile_segs(const att_call *c, const int32_t *u) {
    const int b = u[0], last = u[1] + u[2] - 1;
    const int ctx = c->seq_lens[b] - (c->query_start_loc[b + 1] - c->query_start_loc[b]) +
                    (last - c->query_start_loc[b]) + 1;
    return (ctx + SEG - 1) / SEG;
}

/* unit u's attention for kv head h, its segments in turn on this thread */
static void tile_whole(const att_call *c, const int32_t *u, int h) {
    float qs[TROWS * MAX_FD] __attribute__((aligned(64))), o[TROWS * MAX_FD] __attribute__((aligned(64)));
    float os[TROWS * MAX_FD] __attribute__((aligned(64)));
    float M[TROWS], L[TROWS], ms[TROWS], ls[TROWS];
    int rctx[TROWS];
    const int R = tile_load(c, u, h, qs, rctx);
    if (rctx[R - 1] <= SEG) { /* one segment: what folding it into the empty state gives, without the copy */
        tile_seg(c, u, h, R, qs, rctx, 0, o, M, L);
        seg_normalize(R, c->D, L, o);
        tile_store(c, u, h, R, o);
        return;
    }
    seg_empty(R, c->D, M, L, o);
    for (int s0 = 0; s0 < rctx[R - 1]; s0 += SEG) {
        tile_seg(c, u, h, R, qs, rctx, s0, os, ms, ls);
        seg_fold(R, c->D, M, L, o, ms, ls, os);
    }
    seg_normalize(R, c->D, L, o);
    tile_store(c, u, h, R, o);
}

/* One segment's partial result in the split's scratch: o [rows_o][D] (the rows tile_item writes: R up
 * to its last row group), then m [R], then l [R]; `rec` floats a record, a multiple of 16 (64-byte
 * aligned records) */
typedef struct {
    long rows_o, rmax, rec;
} seg_layout;

static seg_layout seg_layout_for(int rmax, int D) {
    const int groups = QK_ROWS > PV_ROWS ? QK_ROWS : PV_ROWS; /* tile_item's row groups pad R up to these */
    long rows_o = (rmax + groups - 1) / groups * groups;
    rows_o = rows_o < TROWS ? rows_o : TROWS;
    if (rmax <= SMALL_R) rows_o = rmax; /* a decode's rows alone */
    const seg_layout lay = {rows_o, rmax, (rows_o * D + 2 * rmax + 15) / 16 * 16};
    return lay;
}

/* the split's partial results: a buffer per calling thread that grows and is kept, so that a decode's
 * calls (one a layer) neither allocate nor touch fresh pages */
static float *split_scratch(size_t floats) {
    static __thread float *buf = NULL;
    static __thread size_t cap = 0;
    if (floats > cap) {
        free(buf);
        const size_t bytes = (floats * sizeof(float) + 63) / 64 * 64;
        buf = (float *)aligned_alloc(64, bytes);
        cap = buf ? floats : 0;
    }
    return buf;
}

/* (unit, head)'s segments folded in key order, normalized and stored */
static void tile_fold(const att_call *c, const int32_t *u, int h, const float *recs /* its first segment's */,
                      int nseg, seg_layout lay) {
    const int R = u[2] * c->G;
    float o[TROWS * MAX_FD] __attribute__((aligned(64)));
    float M[TROWS], L[TROWS];
    seg_empty(R, c->D, M, L, o);
    for (int e = 0; e < nseg; e++) {
        const float *rec = recs + (size_t)e * c->Hkv * lay.rec;
        seg_fold(R, c->D, M, L, o, rec + lay.rows_o * c->D, rec + lay.rows_o * c->D + lay.rmax, rec);
    }
    seg_normalize(R, c->D, L, o);
    tile_store(c, u, h, R, o);
}

/* every (unit, head, segment) an item of its own, in one parallel region: the thread that finishes a
 * (unit, head)'s last segment folds them (no barrier: a pause of OpenMP's passive wait costs more than
 * a short decode's attention) */
static int tiles_split(const att_call *c, const int32_t *units, long nunits, int num_threads) {
    const int Hkv = c->Hkv;
    long *first = (long *)malloc(sizeof(long) * (size_t)(nunits + 1));
    if (!first) return -3;
    first[0] = 0;
    for (long n = 0; n < nunits; n++) first[n + 1] = first[n] + tile_segs(c, units + 4 * n);
    const long E = first[nunits];
    int rmax = 1;
    for (long n = 0; n < nunits; n++) rmax = units[4 * n + 2] * c->G > rmax ? units[4 * n + 2] * c->G : rmax;
    const seg_layout lay = seg_layout_for(rmax, c->D);
    int32_t *unit_of = (int32_t *)malloc(sizeof(int32_t) * (size_t)(E > 0 ? E : 1));
    int *done = (int *)calloc((size_t)(nunits * Hkv > 0 ? nunits * Hkv : 1), sizeof(int));
    float *part = split_scratch((size_t)(lay.rec * (E * Hkv > 0 ? E * Hkv : 1)));
    if (!unit_of || !done || !part) {
        free(first), free(unit_of), free(done);
        return -3;
    }
    for (long n = 0; n < nunits; n++)
        for (long e = first[n]; e < first[n + 1]; e++) unit_of[e] = (int32_t)n;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (long it = 0; it < E * Hkv; it++) {
        const long e = it / Hkv, n = unit_of[e];
        const int h = (int)(it % Hkv), nseg = (int)(first[n + 1] - first[n]);
        const int32_t *u = units + 4 * n;
        float qs[TROWS * MAX_FD] __attribute__((aligned(64)));
        int rctx[TROWS];
        const int R = tile_load(c, u, h, qs, rctx);
        float *rec = part + it * lay.rec;
        tile_seg(c, u, h, R, qs, rctx, (int)(e - first[n]) * SEG, rec, rec + lay.rows_o * c->D,
                 rec + lay.rows_o * c->D + lay.rmax);
        /* acquire-release: the last to finish sees every other segment's writes */
        if (__atomic_add_fetch(&done[n * Hkv + h], 1, __ATOMIC_ACQ_REL) == nseg)
            tile_fold(c, u, h, part + (first[n] * Hkv + h) * lay.rec, nseg, lay);
    }
    free(first), free(unit_of), free(done);
    return 0;
}
#else
static int fast_path_applies(int G, int D, int BS, int kv_dtype, int k_transposed) {
    (void)G, (void)D, (void)BS, (void)kv_dtype, (void)k_transposed;
    return 0;
}
#endif

/* 1 when this build and these arguments take the vectorized path (for tests and benchmarks). */
int kvpilot_fast_path(int num_q_heads, int num_kv_heads, int head_dim, int block_size, int kv_dtype,
                      int k_transposed) {
    if (num_kv_heads <= 0 || num_q_heads % num_kv_heads) return 0;
    return fast_path_applies(num_q_heads / num_kv_heads, head_dim, block_size, kv_dtype, k_transposed);
}

int kvpilot_paged_attention(
    const void *q, int q_dtype, void *out,
    const void *k_cache, const void *v_cache, int kv_dtype, int k_transposed, int v_head_major,
    const uint16_t *k_scale, const uint16_t *v_scale,
    const int32_t *block_tables, int max_blocks,
    const int32_t *query_start_loc, const int32_t *seq_lens, int num_seqs,
    int num_q_heads, int num_kv_heads, int head_dim, int block_size, float sm_scale,
    int num_threads, int allow_fast) {
    const int G = num_q_heads / num_kv_heads;
    const int D = head_dim, BS = block_size, Hkv = num_kv_heads, Hq = num_q_heads;
    if (G > MAX_G || D > MAX_D || BS > MAX_BS || G * Hkv != Hq) return -1;
    if ((kv_dtype == DT_I8 || kv_dtype == DT_FP8) && (!k_scale || !v_scale)) return -2;
    if (kv_dtype == DT_FP8 && !fp8_ready) init_fp8_table();
    const int T = query_start_loc[num_seqs];
    const int fast = fast_path_applies(G, D, BS, kv_dtype, k_transposed) && allow_fast;
    /* work units: one token, or a tile of consecutive tokens of one sequence (the tiled path) */
    int32_t *units = (int32_t *)malloc(sizeof(int32_t) * 4 * (size_t)(T > 0 ? T : 1));
    if (!units) return -3;
    long nunits = 0;
    for (int b = 0; b < num_seqs; b++) {
        const int lo = query_start_loc[b], hi = query_start_loc[b + 1];
        int tq = 1, tiled = 0;
#if defined(KVPILOT_FAST)
        if (fast) tq = tile_tokens(G), tiled = 1;
#endif
        for (int t = lo; t < hi; t += tq) {
            int32_t *u = units + 4 * nunits++;
            u[0] = b, u[1] = t, u[2] = hi - t < tq ? hi - t : tq, u[3] = tiled;
        }
    }
    const long items = nunits * Hkv;
#if defined(KVPILOT_FAST)
    const att_call call = {q,        k_cache,         v_cache,  out, k_scale,  v_scale, block_tables, query_start_loc,
                           seq_lens, q_dtype,         kv_dtype, v_head_major, max_blocks, G, Hq, Hkv, D, sm_scale};
    int segs = 1; /* the most segments of any tile */
    for (long n = 0; fast && items < SPLIT_ITEMS * (long)num_threads && n < nunits; n++) {
        const int sn = tile_segs(&call, units + 4 * n);
        segs = sn > segs ? sn : segs;
    }
    if (segs >= SPLIT_SEGS) { /* few items for the threads, and enough keys to split them */
        const int rc = tiles_split(&call, units, nunits, num_threads);
        free(units);
        return rc;
    }
#endif

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (long it = 0; it < items; it++) {
        const long item = items - 1 - it; /* a prefill's last tiles (the most keys) first */
        const int32_t *u = units + 4 * (item / Hkv);
        const int h = (int)(item % Hkv), b = u[0], t = u[1];
        const int qlen = query_start_loc[b + 1] - query_start_loc[b];
        const int j = t - query_start_loc[b];
        const int ctx = seq_lens[b] - qlen + j + 1; /* keys this token may see */
        const int32_t *table = block_tables + (size_t)b * max_blocks;
#if defined(KVPILOT_FAST)
        if (u[3]) {
            tile_whole(&call, u, h);
            continue;
        }
#endif
        float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], m[MAX_G], l[MAX_G];
        float sg[MAX_G][MAX_BS]; /* scores, then probabilities, of the current block */
        float row[MAX_D];
        for (int g = 0; g < G; g++) {
            load_row(q, q_dtype, ((size_t)t * Hq + (size_t)h * G + g) * D, D, 1.0f, qf[g]);
            for (int d = 0; d < D; d++) qf[g][d] *= sm_scale;
            memset(acc[g], 0, sizeof(float) * D);
            m[g] = -INFINITY;
            l[g] = 0.0f;
        }
        const int nblocks = (ctx + BS - 1) / BS;
        for (int i = 0; i < nblocks; i++) {
            const size_t blk = (size_t)table[i];
            const int n = (i + 1) * BS <= ctx ? BS : ctx - i * BS;
            float bmax[MAX_G];
            for (int g = 0; g < G; g++) bmax[g] = -INFINITY;
            if (k_transposed) {
                /* scores of the block's keys, vectorized across keys */
                for (int g = 0; g < G; g++)
                    for (int r = 0; r < BS; r++) sg[g][r] = 0.0f;
                const size_t tile = (blk * Hkv + h) * (size_t)D * BS;
                for (int d = 0; d < D; d++) {
                    float kr[MAX_BS];
                    load_row(k_cache, kv_dtype, tile + (size_t)d * BS, BS, 1.0f, kr);
                    for (int g = 0; g < G; g++) {
                        const float qd = qf[g][d];
                        for (int r = 0; r < BS; r++) sg[g][r] += qd * kr[r];
                    }
                }
                if (k_scale) {
                    for (int r = 0; r < n; r++) {
                        const float ks = f16_to_f32(k_scale[(blk * BS + r) * Hkv + h]);
                        for (int g = 0; g < G; g++) sg[g][r] *= ks;
                    }
                }
                for (int g = 0; g < G; g++)
                    for (int r = 0; r < n; r++) bmax[g] = sg[g][r] > bmax[g] ? sg[g][r] : bmax[g];
            } else {
                for (int r = 0; r < n; r++) {
                    const size_t slot = (blk * BS + r) * Hkv + h;
                    const float ks = k_scale ? f16_to_f32(k_scale[slot]) : 1.0f;
                    load_row(k_cache, kv_dtype, slot * D, D, ks, row);
                    for (int g = 0; g < G; g++) {
                        float dot = 0.0f;
                        for (int d = 0; d < D; d++) dot += qf[g][d] * row[d];
                        sg[g][r] = dot;
                        if (dot > bmax[g]) bmax[g] = dot;
                    }
                }
            }
            for (int g = 0; g < G; g++) {
                const float m_new = bmax[g] > m[g] ? bmax[g] : m[g];
                const float corr = expf(m[g] - m_new); /* exp(-inf) = 0 on the first block */
                l[g] *= corr;
                for (int d = 0; d < D; d++) acc[g][d] *= corr;
                m[g] = m_new;
                float sum = 0.0f;
                for (int r = 0; r < n; r++) {
                    sg[g][r] = expf(sg[g][r] - m_new);
                    sum += sg[g][r];
                }
                l[g] += sum;
            }
            for (int r = 0; r < n; r++) {
                const size_t slot = (blk * BS + r) * Hkv + h;
                const size_t vrow = v_head_major ? (blk * Hkv + h) * BS + r : slot;
                const float vs = v_scale ? f16_to_f32(v_scale[slot]) : 1.0f;
                load_row(v_cache, kv_dtype, vrow * D, D, vs, row);
                for (int g = 0; g < G; g++) {
                    const float p = sg[g][r];
                    for (int d = 0; d < D; d++) acc[g][d] += p * row[d];
                }
            }
        }
        for (int g = 0; g < G; g++) {
            const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
            for (int d = 0; d < D; d++) acc[g][d] *= inv;
            store_row(out, q_dtype, ((size_t)t * Hq + (size_t)h * G + g) * D, D, acc[g]);
        }
    }
    free(units);
    return 0;
}
