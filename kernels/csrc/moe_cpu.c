/*
 * A Mixture-of-Experts layer's unquantized experts (bfloat16 or float32 weights) in one call, for CPUs:
 *   out[t] = sum over t's top-k slots j whose expert is held here of wts[t, j] * expert_e(x[t]),
 *   expert_e(x) = w2_e . (silu(g) * u),  [g; u] = w13_e . x
 * x, out: [T, H]; ids, wts: [T, topk] (global expert ids, float32 routing weights); experts offset ..
 * offset + E - 1 are held here (the rest contribute zero: expert parallelism), stacked as w13 [E, 2I, H]
 * (gate rows, then up rows) and w2 [E, H, I], contiguous, in x's dtype.
 *
 * The assignments are counting-sorted by expert (token order kept), so each active expert's weight rows
 * are read once for all its tokens; pass 1 runs one parallel loop over (expert, pair of intermediate
 * columns), computing the gate and up rows of the pair against every token of the expert in registers
 * and storing silu(g) * u (so the [A, 2I] gate/up product never exists); pass 2 one loop over (expert,
 * 4 rows of w2); then each token's slots are combined with their routing weights.
 *
 * Arithmetic: every dot product accumulates in float32, and the intermediates stay float32 except as
 * noted. float32 weights: float32 FMAs throughout. bfloat16 weights: x is bfloat16 already, and the
 * activation silu(g) * u is rounded to bfloat16 before pass 2 (as torch's bfloat16 per-expert matmuls
 * round it); g, u, the per-expert outputs and the combine stay float32 (torch rounds each to bfloat16),
 * and the result is rounded once to bfloat16. With AVX512-BF16 the products are `vdpbf16ps` (a pair of
 * exact bf16 x bf16 products added to the float32 accumulator, bf16 denormal inputs read as zero);
 * elsewhere (AVX2 + FMA, AVX-512 without BF16, generic) bfloat16 is widened to float32 with a shift and
 * multiplied with FMAs. The levels differ only in summation order.
 */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include "dtypes.h"
#include "isa.h"
#include "kvpilot_kernels.h"
#include "moe_combine.h"

enum { K_F32 = 0, K_BF16_WIDEN = 1, K_BF16_DOT = 2 }; /* weights . activations: f32.f32, bf16.f32, bf16.bf16 */

#define WR 4 /* weight rows per register tile */

#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
#include <immintrin.h>
#endif

#if defined(KVPILOT_ISA_AVX512)
#ifndef MR
#define MR 6 /* token rows per register tile: WR * MR = 24 accumulators of 32 zmm registers */
#endif
#if defined(__AVX512BF16__)
#define HAVE_BF16_DOT 1
#endif
#elif defined(KVPILOT_ISA_AVX2)
#define MR 2 /* 16 ymm registers: 8 accumulators, 4 weight vectors, an activation */
#else
#define MR 4
#endif
#ifndef HAVE_BF16_DOT
#define HAVE_BF16_DOT 0
#endif

static inline float f32_id(float v) { return v; }

#ifndef PF_BYTES
#define PF_BYTES 512
#endif
#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
/* weight rows are streamed once: ask for the line PF_BYTES ahead (hardware prefetch alone leaves the
 * core waiting on memory at a few token rows per expert) */
#define PREFETCH(p) _mm_prefetch((const char *)(p) + PF_BYTES, _MM_HINT_T0)
#else
#define PREFETCH(p) ((void)0)
#endif

/* res[r * WR + c] = a_r . w_c (r < mr, c < WR; a_r = a + r * lda, each K long), float32 accumulators;
 * `mr` is a constant at each call site, so the WR * mr accumulators stay in registers. */
#define DEFINE_TILE(NAME, WT, AT, ACC, WV, AV, STEP, ZERO, LOADW, LOADA, FMA, HSUM, WSCALAR, ASCALAR)         \
    static inline __attribute__((always_inline)) void NAME(const WT *const *w, const AT *a, long lda,         \
                                                           const int mr, long K, float *res) {                \
        ACC acc[MR][WR];                                                                                       \
        for (int r = 0; r < mr; r++)                                                                           \
            for (int c = 0; c < WR; c++) acc[r][c] = ZERO;                                                     \
        long k = 0;                                                                                            \
        for (; k + STEP <= K; k += STEP) {                                                                     \
            WV wv[WR];                                                                                         \
            for (int c = 0; c < WR; c++) {                                                                     \
                PREFETCH(w[c] + k);                                                                            \
                wv[c] = LOADW(w[c] + k);                                                                       \
            }                                                                                                  \
            for (int r = 0; r < mr; r++) {                                                                     \
                const AV av = LOADA(a + r * lda + k);                                                          \
                for (int c = 0; c < WR; c++) acc[r][c] = FMA(acc[r][c], av, wv[c]);                            \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < mr; r++)                                                                           \
            for (int c = 0; c < WR; c++) {                                                                     \
                float s = HSUM(acc[r][c]);                                                                     \
                for (long kk = k; kk < K; kk++) s += ASCALAR(a[r * lda + kk]) * WSCALAR(w[c][kk]);             \
                res[r * WR + c] = s;                                                                           \
            }                                                                                                  \
    }

#if defined(KVPILOT_ISA_AVX512)
static inline __m512 ld_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 ld_bf16w(const uint16_t *p) { /* 16 bf16 -> f32: the bits shifted up 16 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 fma_f32(__m512 acc, __m512 a, __m512 w) { return _mm512_fmadd_ps(a, w, acc); }
static inline float hsum_f32(__m512 v) { return _mm512_reduce_add_ps(v); }
DEFINE_TILE(tile_f32, float, float, __m512, __m512, __m512, 16, _mm512_setzero_ps(), ld_f32, ld_f32, fma_f32,
            hsum_f32, f32_id, f32_id)
DEFINE_TILE(tile_bf16w, uint16_t, float, __m512, __m512, __m512, 16, _mm512_setzero_ps(), ld_bf16w, ld_f32,
            fma_f32, hsum_f32, bf16_to_f32, f32_id)
#if HAVE_BF16_DOT
static inline __m512bh ld_bh(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512((const void *)p); }
static inline __m512 dot_bh(__m512 acc, __m512bh a, __m512bh w) { return _mm512_dpbf16_ps(acc, a, w); }
DEFINE_TILE(tile_bf16dot, uint16_t, uint16_t, __m512, __m512bh, __m512bh, 32, _mm512_setzero_ps(), ld_bh, ld_bh,
            dot_bh, hsum_f32, bf16_to_f32, bf16_to_f32)
#endif
#elif defined(KVPILOT_ISA_AVX2)
static inline __m256 ld_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 ld_bf16w(const uint16_t *p) { /* 8 bf16 -> f32: the bits shifted up 16 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline __m256 fma_f32(__m256 acc, __m256 a, __m256 w) { return _mm256_fmadd_ps(a, w, acc); }
static inline float hsum_f32(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
DEFINE_TILE(tile_f32, float, float, __m256, __m256, __m256, 8, _mm256_setzero_ps(), ld_f32, ld_f32, fma_f32,
            hsum_f32, f32_id, f32_id)
DEFINE_TILE(tile_bf16w, uint16_t, float, __m256, __m256, __m256, 8, _mm256_setzero_ps(), ld_bf16w, ld_f32,
            fma_f32, hsum_f32, bf16_to_f32, f32_id)
#else
static inline float ld_f32(const float *p) { return *p; }
static inline float ld_bf16w(const uint16_t *p) { return bf16_to_f32(*p); }
static inline float fma_f32(float acc, float a, float w) { return acc + a * w; }
DEFINE_TILE(tile_f32, float, float, float, float, float, 1, 0.0f, ld_f32, ld_f32, fma_f32, f32_id, f32_id, f32_id)
DEFINE_TILE(tile_bf16w, uint16_t, float, float, float, float, 1, 0.0f, ld_bf16w, ld_f32, fma_f32, f32_id,
            bf16_to_f32, f32_id)
#endif

#define TILE_BY_MR(FN, WT, AT)                                                                                \
    switch (mr) {                                                                                              \
    case 1: FN((const WT *const *)w, (const AT *)a, lda, 1, K, res); break;                                    \
    case 2: FN((const WT *const *)w, (const AT *)a, lda, 2, K, res); break;                                    \
    case 3: if (MR >= 3) FN((const WT *const *)w, (const AT *)a, lda, MR >= 3 ? 3 : 1, K, res); break;         \
    case 4: if (MR >= 4) FN((const WT *const *)w, (const AT *)a, lda, MR >= 4 ? 4 : 1, K, res); break;         \
    case 5: if (MR >= 5) FN((const WT *const *)w, (const AT *)a, lda, MR >= 5 ? 5 : 1, K, res); break;         \
    default: if (MR >= 6) FN((const WT *const *)w, (const AT *)a, lda, MR >= 6 ? 6 : 1, K, res); break;        \
    }

/* one register tile: WR weight rows (w[c], K long) against mr <= MR activation rows (a, row stride lda) */
static void tile(int kind, const void *const *w, const void *a, long lda, int mr, long K, float *res) {
    if (kind == K_F32) {
        TILE_BY_MR(tile_f32, float, float)
    } else if (kind == K_BF16_WIDEN) {
        TILE_BY_MR(tile_bf16w, uint16_t, float)
    }
#if HAVE_BF16_DOT
    else {
        TILE_BY_MR(tile_bf16dot, uint16_t, uint16_t)
    }
#endif
}

/* an activation value v stored at p in the layout pass 2 reads (bf16 for K_BF16_DOT, else float32; with
 * bfloat16 weights rounded to bfloat16 either way) */
static inline void store_act(void *p, long i, float v, int kind, int bf16) {
    if (kind == K_BF16_DOT)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

/* the BF16 dot product is compiled in (this ISA level and CPU): for tests */
int kvpilot_moe_bf16_dot(void) { return HAVE_BF16_DOT; }

/* Returns 0, -1 on bad arguments, -3 when out of memory. */
int kvpilot_moe(const void *x, int dtype, void *out, long T, long H, long I, int topk, const int64_t *ids,
                const float *wts, long E, long offset, const void *w13, const void *w2, int num_threads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || T < 0 || H <= 0 || I <= 0 || topk <= 0 || E <= 0) return -1;
    const int bf16 = dtype == DT_BF16;
    const int kind = !bf16 ? K_F32 : HAVE_BF16_DOT ? K_BF16_DOT : K_BF16_WIDEN;
    const size_t es = bf16 ? 2 : 4;                  /* bytes per weight (and per x / out element) */
    const size_t as = kind == K_BF16_DOT ? 2 : 4;    /* bytes per stored activation */
    long *count = (long *)calloc((size_t)E + 1, sizeof(long));
    long *fill = (long *)malloc(sizeof(long) * (size_t)(E + 1));
    long *active = (long *)malloc(sizeof(long) * (size_t)E);
    long *row_of = (long *)malloc(sizeof(long) * (size_t)(T * topk + 1));
    char *gathered = NULL, *act = NULL;
    float *partial = NULL;
    int rc = -3;
    if (!count || !fill || !active || !row_of) goto done;
    for (long s = 0; s < T * topk; s++) {
        const long e = ids[s] - offset;
        if (e >= 0 && e < E) count[e + 1]++;
    }
    long nact = 0;
    for (long e = 0; e < E; e++) {
        if (count[e + 1]) active[nact++] = e;
        count[e + 1] += count[e]; /* count[e]: first row of expert e */
    }
    const long A = count[E];
    gathered = (char *)malloc(as * (size_t)((A ? A : 1) * H));
    act = (char *)malloc(as * (size_t)((A ? A : 1) * I));
    partial = (float *)malloc(sizeof(float) * (size_t)((A ? A : 1) * H));
    if (!gathered || !act || !partial) goto done;
    memcpy(fill, count, sizeof(long) * (size_t)(E + 1));
    for (long s = 0; s < T * topk; s++) { /* each assignment's token, in expert order */
        const long e = ids[s] - offset;
        row_of[s] = -1;
        if (e < 0 || e >= E) continue;
        const long r = row_of[s] = fill[e]++;
        const char *src = (const char *)x + (size_t)(s / topk) * H * es;
        if (as == es)
            memcpy(gathered + (size_t)r * H * as, src, as * (size_t)H);
        else /* bf16 x widened for the FMA path */
            for (long h = 0; h < H; h++) ((float *)gathered)[r * H + h] = bf16_to_f32(((const uint16_t *)src)[h]);
    }
    const long pairs = (I + 1) / 2, quads = (H + WR - 1) / WR;
    /* pass 1: act = silu(g) * u for every (active expert, pair of intermediate columns i, i + 1) */
#pragma omp parallel for schedule(dynamic, 8) num_threads(num_threads)
    for (long item = 0; item < nact * pairs; item++) {
        const long e = active[item / pairs], i = (item % pairs) * 2, i1 = i + 1 < I ? i + 1 : i;
        const char *we = (const char *)w13 + (size_t)e * 2 * I * H * es;
        const void *w[WR] = {we + (size_t)i * H * es, we + (size_t)i1 * H * es, we + (size_t)(I + i) * H * es,
                             we + (size_t)(I + i1) * H * es};
        float res[MR * WR];
        for (long r0 = count[e]; r0 < count[e + 1]; r0 += MR) {
            const int mr = count[e + 1] - r0 < MR ? (int)(count[e + 1] - r0) : MR;
            tile(kind, w, gathered + (size_t)r0 * H * as, H, mr, H, res);
            for (int r = 0; r < mr; r++)
                for (long c = 0; c <= i1 - i; c++) {
                    const float g = res[r * WR + c], u = res[r * WR + 2 + c];
                    store_act(act, (r0 + r) * I + i + c, g / (1.0f + expf(-g)) * u, kind, bf16);
                }
        }
    }
    /* pass 2: partial = w2_e . act for every (active expert, 4 rows of w2) */
#pragma omp parallel for schedule(dynamic, 8) num_threads(num_threads)
    for (long item = 0; item < nact * quads; item++) {
        const long e = active[item / quads], h = (item % quads) * WR, nh = H - h < WR ? H - h : WR;
        const char *we = (const char *)w2 + (size_t)e * H * I * es;
        const void *w[WR];
        for (int c = 0; c < WR; c++) w[c] = we + (size_t)(h + (c < nh ? c : nh - 1)) * I * es;
        float res[MR * WR];
        for (long r0 = count[e]; r0 < count[e + 1]; r0 += MR) {
            const int mr = count[e + 1] - r0 < MR ? (int)(count[e + 1] - r0) : MR;
            tile(kind, w, act + (size_t)r0 * I * as, I, mr, I, res);
            for (int r = 0; r < mr; r++)
                for (long c = 0; c < nh; c++) partial[(r0 + r) * H + h + c] = res[r * WR + c];
        }
    }
    moe_combine(out, bf16, T, H, topk, row_of, wts, partial, num_threads);
    rc = 0;
done:
    free(count), free(fill), free(active), free(row_of), free(gathered), free(act), free(partial);
    return rc;
}
