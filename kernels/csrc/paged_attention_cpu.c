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
 * One work item is (token, kv head): the G = Hq / Hkv query heads of a group share every K/V row
 * they load. Softmax is computed online, one block of keys at a time. Parallel with OpenMP (the
 * process's libgomp, the one torch already loaded). With the common shape (head_dim 64, block size
 * 16, K transposed) an item takes a vectorized fast path unless allow_fast is 0: the AVX-512 one in a
 * build for that level, the AVX2+FMA+F16C one in a build for avx2 (isa.h; kernels/isa.py picks the
 * build from the CPU's features). The generic build has only the portable loop.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "isa.h"
#include "kvpilot_kernels.h"

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_I8 = 3, DT_FP8 = 4 };

#define MAX_G 32
#define MAX_D 256
#define MAX_BS 256

static inline float f16_to_f32(uint16_t h) {
    _Float16 x;
    memcpy(&x, &h, 2);
    return (float)x;
}

static inline uint16_t f32_to_f16(float f) {
    _Float16 x = (_Float16)f;
    uint16_t h;
    memcpy(&h, &x, 2);
    return h;
}

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

#if defined(KVPILOT_ISA_AVX512)
/*
 * AVX-512 fast path for the common shape: head_dim 64, block size 16, K transposed, 1 <= G <= 8,
 * K/V in float32, bfloat16, float16 or int8 (widened to float32 in registers: every product is a
 * float32 one). A block's 16 keys fill one 512-bit register, so a query row's scores for a block are
 * 64 broadcast-FMAs; a V row is 4 registers. Every token takes the tiles below (tile_item); other
 * shapes and fp8 take the generic loop.
 */
#include <immintrin.h>

#define KVPILOT_FAST 1
#define FD 64
#define FBS 16
#define MAX_FG 8
#define NEG_BIG (-1e30f) /* stands in for -inf: -ffast-math assumes there are no infinities */

static inline __attribute__((always_inline)) __m512 ld16(const void *base, int dt, size_t off) {
    switch (dt) {
        case DT_F32: return _mm512_loadu_ps((const float *)base + off);
        case DT_BF16:
            return _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off))),
                16));
        case DT_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off)));
        default: /* DT_I8 */
            return _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)base + off))));
    }
}

/* exp(x) for x <= 0 (Cephes expf's polynomial, relative error ~2e-7; exp(x < -87) ~ 0) */
static inline __attribute__((always_inline)) __m512 exp512(__m512 x) {
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

/*
 * Tiles (AVX-512): a sequence's new tokens are split into tiles of TQ(G) = 24 / G consecutive tokens
 * (a decode step: one token), and one work item is (tile, kv head): its R = tokens x G query rows
 * share every K/V block they load, where one item per token read the whole context once per token
 * (a 4,096-token prefill spent 24 of 40 s there). Per chunk of TKC keys (4 blocks): S = Q K^T for 8
 * rows at a time (4 when R <= 4: a decode), one K^T row load per row's broadcast-FMA; the causal
 * mask; one online-softmax update per row for the whole chunk (the horizontal max and sum once per
 * 64 keys, not per 16); then O += P V for 4 rows at a time (16 accumulators, one V row load per 4 x 4
 * FMAs). A row's result depends only on its own query and keys (chunks start at absolute key
 * positions; masked keys add exact zeros), never on the other rows of its tile: a prompt computed in
 * chunks of any size, a decode and a speculative verification of the same token attend bit for bit
 * alike.
 */
#define KVPILOT_TILED 1
#define TROWS 24 /* query rows of a tile: tokens x G (at most; a multiple of 8) */
#define TKC 64   /* keys per softmax update */
#define PF_CHUNKS 2 /* software prefetch distance in chunks of TKC keys */

static inline int tile_tokens(int G) { return TROWS / G; }

/* S rows [NR][16] (row stride TKC) = NR query rows . one block's K^T tile (times the keys' int8 scales);
 * meanwhile the K (and head-major V) tiles at pk / pv, PF_CHUNKS chunks ahead, are fetched into L2 a
 * line at a time (one burst of 512 prefetches per chunk, or the hardware prefetcher alone, left a
 * decode at 16k keys 1.25x slower: a block's tiles are 4 KiB apart in the pool) */
static inline __attribute__((always_inline)) void qk_rows(const int NR, const int dt, const float *qr,
                                                          const void *k_cache, size_t tile, __m512 ks, float *sp,
                                                          const char *pk, const char *pv, int pstep) {
    __m512 s[8];
    for (int j = 0; j < NR; j++) s[j] = _mm512_setzero_ps();
    for (int d = 0; d < FD; d++) {
        if (pk && d % pstep == 0) { /* one line of a later block's K and V tiles per pstep rows */
            _mm_prefetch(pk + (d / pstep) * 64, _MM_HINT_T1);
            if (pv) _mm_prefetch(pv + (d / pstep) * 64, _MM_HINT_T1);
        }
        const __m512 k = ld16(k_cache, dt, tile + (size_t)d * FBS);
        for (int j = 0; j < NR; j++) s[j] = _mm512_fmadd_ps(_mm512_set1_ps(qr[j * FD + d]), k, s[j]);
    }
    for (int j = 0; j < NR; j++) _mm512_store_ps(sp + j * TKC, dt == DT_I8 ? _mm512_mul_ps(s[j], ks) : s[j]);
}

static inline __attribute__((always_inline)) void tile_item(
    const int G, const int dt, const int R, const float *qs /* [TROWS][64], scaled, pad rows 0 */,
    float *o /* [TROWS][64] */, const int *rctx /* [TROWS] keys each row may see */,
    const void *k_cache, const void *v_cache, const uint16_t *k_scale, const uint16_t *v_scale,
    const int32_t *table, int Hkv, int h, int vhm) {
    (void)G;
    float sb[TROWS][TKC] __attribute__((aligned(64)));
    float m[TROWS], l[TROWS], corr[TROWS];
    const int R8 = (R + 7) & ~7, R4 = (R + 3) & ~3;
    const size_t tile_bytes = (size_t)FD * FBS * elem_size(dt);
    const int pstep = (int)(FD * 64 / tile_bytes); /* K^T rows per 64-byte line: 1 (f32), 2, 4 (int8) */
    int ctx_max = 0;
    for (int r = 0; r < R; r++) ctx_max = rctx[r] > ctx_max ? rctx[r] : ctx_max;
    for (int r = 0; r < R4; r++) {
        m[r] = NEG_BIG;
        l[r] = 0.0f;
        for (int c = 0; c < 4; c++) _mm512_store_ps(o + r * FD + c * 16, _mm512_setzero_ps());
    }
    for (int c0 = 0; c0 < ctx_max; c0 += TKC) {
        const int nk = ctx_max - c0 < TKC ? ctx_max - c0 : TKC; /* keys of this chunk any row sees */
        const int nbk = (nk + FBS - 1) / FBS;
        /* S = Q K^T, one block of 16 keys and 8 rows at a time */
        for (int bb = 0; bb < nbk; bb++) {
            const size_t blk = (size_t)table[c0 / FBS + bb];
            const size_t tile = (blk * Hkv + h) * (size_t)FD * FBS;
            const char *pk = NULL, *pv = NULL;
            const int ahead = (c0 + PF_CHUNKS * TKC) / FBS + bb;
            if (ahead < (ctx_max + FBS - 1) / FBS) {
                const size_t nb = (size_t)table[ahead];
                pk = (const char *)k_cache + (nb * Hkv + h) * tile_bytes;
                pv = vhm ? (const char *)v_cache + (nb * Hkv + h) * tile_bytes : NULL;
            }
            __m512 ks = _mm512_set1_ps(1.0f);
            if (dt == DT_I8) {
                float kf[FBS];
                const int n = nk - bb * FBS < FBS ? nk - bb * FBS : FBS;
                for (int j = 0; j < FBS; j++) kf[j] = j < n ? f16_to_f32(k_scale[(blk * FBS + j) * Hkv + h]) : 0.0f;
                ks = _mm512_loadu_ps(kf);
            }
            if (R <= 4) {
                qk_rows(4, dt, qs, k_cache, tile, ks, &sb[0][bb * FBS], pk, pv, pstep);
            } else {
                for (int r0 = 0; r0 < R8; r0 += 8)
                    qk_rows(8, dt, qs + r0 * FD, k_cache, tile, ks, &sb[r0][bb * FBS], r0 ? NULL : pk, pv, pstep);
            }
        }
        /* mask, one online-softmax update per row, P in place of S */
        for (int r = 0; r < R4; r++) {
            const int vis = r < R ? (rctx[r] - c0 < nk ? rctx[r] - c0 : nk) : 0;
            if (vis <= 0) { /* nothing of this chunk is visible to the row (or a pad row) */
                corr[r] = 1.0f;
                for (int bb = 0; bb < nbk; bb++) _mm512_store_ps(&sb[r][bb * FBS], _mm512_setzero_ps());
                continue;
            }
            __m512 mx = _mm512_set1_ps(NEG_BIG);
            __mmask16 live[TKC / FBS];
            for (int bb = 0; bb < nbk; bb++) {
                const int n = vis - bb * FBS;
                live[bb] = n >= FBS ? (__mmask16)0xFFFFu : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
                mx = _mm512_mask_max_ps(mx, live[bb], mx, _mm512_load_ps(&sb[r][bb * FBS]));
            }
            const float bmax = _mm512_reduce_max_ps(mx);
            const float m_new = bmax > m[r] ? bmax : m[r];
            corr[r] = m[r] == NEG_BIG ? 0.0f : expf(m[r] - m_new);
            const __m512 mv = _mm512_set1_ps(m_new);
            __m512 sum = _mm512_setzero_ps();
            for (int bb = 0; bb < nbk; bb++) {
                const __m512 p = _mm512_maskz_mov_ps(live[bb], exp512(_mm512_sub_ps(_mm512_load_ps(&sb[r][bb * FBS]), mv)));
                sum = _mm512_add_ps(sum, p);
                _mm512_store_ps(&sb[r][bb * FBS], p);
            }
            l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(sum);
            m[r] = m_new;
        }
        /* O = corr O + P V, 4 rows at a time */
        for (int r0 = 0; r0 < R4; r0 += 4) {
            __m512 acc[4][4];
            for (int j = 0; j < 4; j++) {
                const __m512 cv = _mm512_set1_ps(corr[r0 + j]);
                for (int c = 0; c < 4; c++) acc[j][c] = _mm512_mul_ps(_mm512_load_ps(o + (r0 + j) * FD + c * 16), cv);
            }
            for (int bb = 0; bb < nbk; bb++) {
                const size_t blk = (size_t)table[c0 / FBS + bb];
                const int n = nk - bb * FBS < FBS ? nk - bb * FBS : FBS;
                for (int kr = 0; kr < n; kr++) {
                    const size_t off = (vhm ? (blk * Hkv + h) * FBS + kr : (blk * FBS + kr) * Hkv + h) * (size_t)FD;
                    __m512 v[4];
                    for (int c = 0; c < 4; c++) v[c] = ld16(v_cache, dt, off + (size_t)c * 16);
                    if (dt == DT_I8) {
                        const __m512 vsc = _mm512_set1_ps(f16_to_f32(v_scale[(blk * FBS + kr) * Hkv + h]));
                        for (int c = 0; c < 4; c++) v[c] = _mm512_mul_ps(v[c], vsc);
                    }
                    for (int j = 0; j < 4; j++) {
                        const __m512 p = _mm512_set1_ps(sb[r0 + j][bb * FBS + kr]);
                        for (int c = 0; c < 4; c++) acc[j][c] = _mm512_fmadd_ps(p, v[c], acc[j][c]);
                    }
                }
            }
            for (int j = 0; j < 4; j++)
                for (int c = 0; c < 4; c++) _mm512_store_ps(o + (r0 + j) * FD + c * 16, acc[j][c]);
        }
    }
    for (int r = 0; r < R; r++) {
        const __m512 inv = _mm512_set1_ps(l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
        for (int c = 0; c < 4; c++) _mm512_store_ps(o + r * FD + c * 16, _mm512_mul_ps(_mm512_load_ps(o + r * FD + c * 16), inv));
    }
}
#elif defined(KVPILOT_ISA_AVX2)
/*
 * AVX2+FMA+F16C fast path, the same shape and dtypes as the AVX-512 one: a block's 16 keys are two
 * 256-bit registers, so its scores are 2 x 64 broadcast-FMAs per query head. P.V runs one 8-float
 * column chunk of the output at a time across the block's rows (G accumulators in registers, the
 * running output in a small L1-resident array), because a whole 64-float V row per query head would
 * need more than AVX2's 16 registers. bf16 K/V are widened to float32 (no bf16 dot product here).
 */
#include <immintrin.h>

#define KVPILOT_FAST 1
#define FD 64
#define FBS 16
#define MAX_FG 8
#define NEG_BIG (-1e30f) /* stands in for -inf: -ffast-math assumes there are no infinities */

static inline __attribute__((always_inline)) __m256 ld8(const void *base, int dt, size_t off) {
    switch (dt) {
        case DT_F32: return _mm256_loadu_ps((const float *)base + off);
        case DT_BF16:
            return _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + off))), 16));
        case DT_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + off)));
        default: /* DT_I8 */
            return _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + off))));
    }
}

/* exp(x) for x <= 0 (the AVX-512 path's polynomial; 2^k built in the exponent bits, k >= -126) */
static inline __attribute__((always_inline)) __m256 exp256(__m256 x) {
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

static inline float hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* One (token, kv head) item: qf [G][64] already scaled; writes the normalized output to o [G][64]. */
static inline __attribute__((always_inline)) void fast_item(
    const int G, const int dt, const float *qf, float *o, const void *k_cache, const void *v_cache,
    const uint16_t *k_scale, const uint16_t *v_scale, const int32_t *table, int ctx, int Hkv, int h,
    int vhm) {
    float acc[MAX_FG][FD] __attribute__((aligned(32)));
    float m[MAX_FG], l[MAX_FG], corr[MAX_FG];
    float pb[MAX_FG][FBS] __attribute__((aligned(32)));
    for (int g = 0; g < G; g++) {
        for (int d = 0; d < FD; d++) acc[g][d] = 0.0f;
        m[g] = NEG_BIG;
        l[g] = 0.0f;
    }
    const __m256 lane_lo = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 lane_hi = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
    const int nblocks = (ctx + FBS - 1) / FBS;
    for (int i = 0; i < nblocks; i++) {
        const size_t blk = (size_t)table[i];
        const int n = (i + 1) * FBS <= ctx ? FBS : ctx - i * FBS;
        if (i + 1 < nblocks) { /* the next block is elsewhere in the pool: start fetching it */
            const size_t nb = (size_t)table[i + 1], tile_bytes = (size_t)FD * FBS * elem_size(dt);
            const char *nk = (const char *)k_cache + (nb * Hkv + h) * tile_bytes;
            for (size_t c = 0; c < tile_bytes; c += 64) _mm_prefetch(nk + c, _MM_HINT_T0);
            if (vhm) {
                const char *nv = (const char *)v_cache + (nb * Hkv + h) * tile_bytes;
                for (size_t c = 0; c < tile_bytes; c += 64) _mm_prefetch(nv + c, _MM_HINT_T0);
            }
        }
        __m256 s0[MAX_FG], s1[MAX_FG];
        for (int g = 0; g < G; g++) s0[g] = s1[g] = _mm256_setzero_ps();
        const size_t tile = (blk * Hkv + h) * (size_t)FD * FBS;
        for (int d = 0; d < FD; d++) {
            const __m256 k0 = ld8(k_cache, dt, tile + (size_t)d * FBS);
            const __m256 k1 = ld8(k_cache, dt, tile + (size_t)d * FBS + 8);
            for (int g = 0; g < G; g++) {
                const __m256 qd = _mm256_set1_ps(qf[g * FD + d]);
                s0[g] = _mm256_fmadd_ps(qd, k0, s0[g]);
                s1[g] = _mm256_fmadd_ps(qd, k1, s1[g]);
            }
        }
        float vs[FBS];
        if (dt == DT_I8) {
            float ks[FBS];
            for (int r = 0; r < FBS; r++) {
                ks[r] = r < n ? f16_to_f32(k_scale[(blk * FBS + r) * Hkv + h]) : 0.0f;
                vs[r] = r < n ? f16_to_f32(v_scale[(blk * FBS + r) * Hkv + h]) : 0.0f;
            }
            const __m256 ks0 = _mm256_loadu_ps(ks), ks1 = _mm256_loadu_ps(ks + 8);
            for (int g = 0; g < G; g++) {
                s0[g] = _mm256_mul_ps(s0[g], ks0);
                s1[g] = _mm256_mul_ps(s1[g], ks1);
            }
        }
        const __m256 nv = _mm256_set1_ps((float)n);
        const __m256 live0 = _mm256_cmp_ps(lane_lo, nv, _CMP_LT_OQ);
        const __m256 live1 = _mm256_cmp_ps(lane_hi, nv, _CMP_LT_OQ);
        const __m256 neg = _mm256_set1_ps(NEG_BIG);
        for (int g = 0; g < G; g++) {
            const __m256 a = _mm256_blendv_ps(neg, s0[g], live0), b = _mm256_blendv_ps(neg, s1[g], live1);
            const float bmax = hmax8(_mm256_max_ps(a, b));
            const float m_new = bmax > m[g] ? bmax : m[g];
            corr[g] = m[g] == NEG_BIG ? 0.0f : expf(m[g] - m_new);
            const __m256 mv = _mm256_set1_ps(m_new);
            const __m256 p0 = _mm256_and_ps(live0, exp256(_mm256_sub_ps(a, mv)));
            const __m256 p1 = _mm256_and_ps(live1, exp256(_mm256_sub_ps(b, mv)));
            l[g] = l[g] * corr[g] + hsum8(_mm256_add_ps(p0, p1));
            m[g] = m_new;
            _mm256_store_ps(pb[g], p0);
            _mm256_store_ps(pb[g] + 8, p1);
        }
        for (int c = 0; c < FD; c += 8) {
            __m256 a[MAX_FG];
            for (int g = 0; g < G; g++) a[g] = _mm256_mul_ps(_mm256_load_ps(acc[g] + c), _mm256_set1_ps(corr[g]));
            for (int r = 0; r < n; r++) {
                const size_t off = (vhm ? (blk * Hkv + h) * FBS + r : (blk * FBS + r) * Hkv + h) * (size_t)FD;
                __m256 v = ld8(v_cache, dt, off + (size_t)c);
                if (dt == DT_I8) v = _mm256_mul_ps(v, _mm256_set1_ps(vs[r]));
                for (int g = 0; g < G; g++) a[g] = _mm256_fmadd_ps(_mm256_set1_ps(pb[g][r]), v, a[g]);
            }
            for (int g = 0; g < G; g++) _mm256_store_ps(acc[g] + c, a[g]);
        }
    }
    for (int g = 0; g < G; g++) {
        const __m256 inv = _mm256_set1_ps(l[g] > 0.0f ? 1.0f / l[g] : 0.0f);
        for (int c = 0; c < FD; c += 8) _mm256_storeu_ps(o + g * FD + c, _mm256_mul_ps(_mm256_load_ps(acc[g] + c), inv));
    }
}
#endif

#if defined(KVPILOT_FAST)

#if !defined(KVPILOT_TILED)
#define FAST_DT(G, dt) \
    fast_item(G, dt, qf, o, k_cache, v_cache, k_scale, v_scale, table, ctx, Hkv, h, vhm)
#define FAST_CASE(G)                                      \
    case G:                                               \
        switch (kv_dtype) {                               \
            case DT_F32: FAST_DT(G, DT_F32); break;       \
            case DT_BF16: FAST_DT(G, DT_BF16); break;     \
            case DT_F16: FAST_DT(G, DT_F16); break;       \
            default: FAST_DT(G, DT_I8); break;            \
        }                                                 \
        break;

static void fast_dispatch(int G, int kv_dtype, const float *qf, float *o, const void *k_cache,
                          const void *v_cache, const uint16_t *k_scale, const uint16_t *v_scale,
                          const int32_t *table, int ctx, int Hkv, int h, int vhm) {
    switch (G) {
        FAST_CASE(1)
        FAST_CASE(2)
        FAST_CASE(3)
        FAST_CASE(4)
        FAST_CASE(5)
        FAST_CASE(6)
        FAST_CASE(7)
        FAST_CASE(8)
    }
}
#endif

static int fast_path_applies(int G, int D, int BS, int kv_dtype, int k_transposed) {
    return G >= 1 && G <= MAX_FG && D == FD && BS == FBS && k_transposed &&
           (kv_dtype == DT_F32 || kv_dtype == DT_BF16 || kv_dtype == DT_F16 || kv_dtype == DT_I8);
}

#if defined(KVPILOT_TILED)
#define TILE_DT(dt) tile_item(G, dt, R, qs, o, rctx, k_cache, v_cache, k_scale, v_scale, table, Hkv, h, vhm)
static void tile_dispatch(int G, int kv_dtype, int R, const float *qs, float *o, const int *rctx,
                          const void *k_cache, const void *v_cache, const uint16_t *k_scale,
                          const uint16_t *v_scale, const int32_t *table, int Hkv, int h, int vhm) {
    switch (kv_dtype) {
        case DT_F32: TILE_DT(DT_F32); break;
        case DT_BF16: TILE_DT(DT_BF16); break;
        case DT_F16: TILE_DT(DT_F16); break;
        default: TILE_DT(DT_I8); break;
    }
}
#endif
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
#if defined(KVPILOT_TILED)
        if (fast) tq = tile_tokens(G), tiled = 1;
#endif
        for (int t = lo; t < hi; t += tq) {
            int32_t *u = units + 4 * nunits++;
            u[0] = b, u[1] = t, u[2] = hi - t < tq ? hi - t : tq, u[3] = tiled;
        }
    }
    const long items = nunits * Hkv;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (long it = 0; it < items; it++) {
        const long item = items - 1 - it; /* a prefill's last tiles (the most keys) first */
        const int32_t *u = units + 4 * (item / Hkv);
        const int h = (int)(item % Hkv), b = u[0], t = u[1];
        const int qlen = query_start_loc[b + 1] - query_start_loc[b];
        const int j = t - query_start_loc[b];
        const int ctx = seq_lens[b] - qlen + j + 1; /* keys this token may see */
        const int32_t *table = block_tables + (size_t)b * max_blocks;
#if defined(KVPILOT_TILED)
        if (u[3]) {
            const int nt = u[2], R = nt * G;
            float qs[TROWS * FD] __attribute__((aligned(64))), o[TROWS * FD] __attribute__((aligned(64)));
            int rctx[TROWS];
            memset(qs, 0, sizeof(qs));
            for (int r = 0; r < R; r++) {
                const int i = r / G, g = r % G;
                load_row(q, q_dtype, ((size_t)(t + i) * Hq + (size_t)h * G + g) * D, D, 1.0f, qs + r * FD);
                for (int d = 0; d < D; d++) qs[r * FD + d] *= sm_scale;
                rctx[r] = ctx + i;
            }
            tile_dispatch(G, kv_dtype, R, qs, o, rctx, k_cache, v_cache, k_scale, v_scale, table, Hkv, h,
                          v_head_major);
            for (int r = 0; r < R; r++)
                store_row(out, q_dtype, ((size_t)(t + r / G) * Hq + (size_t)h * G + r % G) * D, D, o + r * FD);
            continue;
        }
#endif
        float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], m[MAX_G], l[MAX_G];
#if defined(KVPILOT_FAST) && !defined(KVPILOT_TILED)
        if (fast) {
            float qs[MAX_FG * FD], o[MAX_FG * FD];
            for (int g = 0; g < G; g++) {
                load_row(q, q_dtype, ((size_t)t * Hq + (size_t)h * G + g) * D, D, 1.0f, qs + g * FD);
                for (int d = 0; d < D; d++) qs[g * FD + d] *= sm_scale;
            }
            fast_dispatch(G, kv_dtype, qs, o, k_cache, v_cache, k_scale, v_scale, table, ctx, Hkv, h,
                          v_head_major);
            for (int g = 0; g < G; g++)
                store_row(out, q_dtype, ((size_t)t * Hq + (size_t)h * G + g) * D, D, o + g * FD);
            continue;
        }
#endif
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
