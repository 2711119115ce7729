/*
 * Weight-only quantized matmul for CPUs: out[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias), with W kept
 * quantized in memory and dequantized inside the matmul, one output row of W at a time, into a
 * float32 scratch row that stays in L1 and is reused by all M rows of x. For the small-M decode case
 * the matmul is bound by reading W, so reading 1 or 0.5 bytes per weight instead of 2 is the speedup.
 *
 * Formats (kernels/qlinear.py makes them; GGUF Q8_0 / Q4_0 / Q4_1 blocks map onto them unchanged):
 *   wbits 8: w int8 [N, K];            weight = w * scale[n, k / group]
 *   wbits 4: w uint8 [N, K / 2], each group of `group` weights in group / 2 bytes, byte i holding
 *            weight i in its low nibble and weight i + group / 2 in its high one (GGUF's order);
 *            weight = q * scale[n, k / group] + min[n, k / group]      (q in 0..15)
 *   scale, min: float16 [N, K / group]; x, bias, out: float32 or bfloat16 (x's dtype).
 *
 * Built once per ISA level (kernels/isa.py). At the avx512 and avx2 levels the weights are widened
 * and scaled in registers (16 or 8 lanes: VW below) and multiplied into up to MB rows of x at once,
 * never written out; the generic level dequantizes a row into a float32 scratch row and lets the
 * compiler vectorize the dot products.
 */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include "dtypes.h"
#include "isa.h"
#include "kvpilot_kernels.h"
#include "moe_combine.h"
#include "vmath.h"


static inline float h2f(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

static void dequant_row(const uint8_t *restrict w, int wbits, long K, int group, const uint16_t *restrict sc,
                        const uint16_t *restrict mn, float *restrict wf) {
    const long ng = K / group;
    if (wbits == 8) {
        const int8_t *q = (const int8_t *)w;
        for (long g = 0; g < ng; g++) {
            const float s = h2f(sc[g]);
            for (int i = 0; i < group; i++) wf[g * group + i] = (float)q[g * group + i] * s;
        }
    } else {
        const int half = group / 2;
        for (long g = 0; g < ng; g++) {
            const float s = h2f(sc[g]), m = h2f(mn[g]);
            const uint8_t *p = w + g * half;
            float *o = wf + g * group;
            for (int i = 0; i < half; i++) {
                o[i] = (float)(p[i] & 15) * s + m;
                o[half + i] = (float)(p[i] >> 4) * s + m;
            }
        }
    }
}

static inline float dot(const float *restrict a, const float *restrict b, long K) {
    float acc = 0.0f;
    for (long k = 0; k < K; k++) acc += a[k] * b[k];
    return acc;
}

#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
#include <immintrin.h>
#define QB 32 /* activations are quantized to int8 in blocks of QB (llama.cpp's Q8_0 block) */
#define MB 4  /* rows of x per pass over a weight row */
#define SMALL_COLUMN 64 /* output rows computed per weight row before they are stored */

/* Integer dot products of unsigned bytes `u` (weights: int4 codes, or |w| for int8) with signed bytes
 * `s` (activations, sign-flipped where w < 0), 4 products summed per int32 lane. With AVX512-VNNI one
 * instruction; otherwise (every AVX2 CPU, AVX-512 without VNNI) maddubs + madd, which cannot
 * saturate here: u <= 127 and |s| <= 127 give pair sums of at most 2 * 127 * 127 < 32767. */
static inline __m256i dot256(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum8_max(__m256 v) { /* the largest of 8 */
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

/* one 32-weight block as unsigned bytes: int4 codes 0..15 in storage order (16 bytes: low nibbles,
 * then high ones), or |w| for int8 (32 bytes, `*wv` keeps the signs) */
static inline __m256i block256(const uint8_t *w, long b, int wbits, __m256i *wv) {
    if (wbits == 8) {
        *wv = _mm256_loadu_si256((const __m256i *)(w + b * QB));
        return _mm256_abs_epi8(*wv);
    }
    const __m128i m = _mm_set1_epi8(15), raw = _mm_loadu_si128((const __m128i *)(w + b * 16));
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m), _mm_and_si128(raw, m));
}

#if defined(KVPILOT_ISA_AVX512)
static inline __m512i dot512(__m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}

/* two consecutive blocks (b, b + 1) in one register, block b in the low 256 bits */
static inline __m512i block512(const uint8_t *w, long b, int wbits, __mmask64 *neg) {
    if (wbits == 8) {
        const __m512i wv = _mm512_loadu_si512((const void *)(w + b * QB));
        *neg = _mm512_movepi8_mask(wv);
        return _mm512_abs_epi8(wv);
    }
    const __m256i m = _mm256_set1_epi8(15), raw = _mm256_loadu_si256((const __m256i *)(w + b * 16));
    const __m256i lo = _mm256_and_si256(raw, m), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m);
    /* [lo(b), lo(b+1), hi(b), hi(b+1)] -> [lo(b), hi(b), lo(b+1), hi(b+1)] (128-bit lanes) */
    return _mm512_permutexvar_epi64(_mm512_set_epi64(7, 6, 3, 2, 5, 4, 1, 0),
                                    _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
}
#endif

/* Per row: the int8 blocks xq in the weight's storage order and one float scale per block (dx); for
 * int4, per weight group, xs = the exact float sum of the group's activations and rs = xs minus the
 * sum of its quantized activations (sum over blocks of dx * sum of codes). Rounding to nearest, as
 * Q8_0. Storage order: int8 weights are in place; an int4 group of g weights is stored as 16-byte
 * chunks, chunk c holding weights 16c.. in its low nibbles and g/2 + 16c.. in its high ones, read as
 * one 32-weight block (low, then high), so activation block c of the group is those 32 elements.
 *
 * int4 codes q in 0..15 are centred on 8 for the activation rounding: with w = q * s + min,
 *   x . w = s * sum (q - 8) * x + (min + 8 * s) * xs
 * and the kernel computes s * dx * sum q * xq + min * xs + 8 * s * rs, which is that with x rounded
 * only where it multiplies (q - 8): the rounding error scales with |q - 8| <= 8, not with q <= 15. */
static void quantize_rows(const float *x, long M, long K, int wbits, int group, int8_t *xq, float *dx,
                          float *xs, float *rs) {
    float tmp[QB];
    const long nb = K / QB, ng = K / group, bpg = group / QB;
    for (long m = 0; m < M; m++) {
        const float *xr = x + m * K;
        int8_t *q = xq + m * K;
        for (long b = 0; b < nb; b++) {
            float amax = 0.0f;
            for (int t = 0; t < QB; t++) {
                long i = b * QB + t; /* the element stored at position i */
                if (wbits == 4 && group != QB) {
                    const long g = i / group, j = i % group;
                    i = g * group + (j % QB >= 16) * (group / 2) + (j / QB) * 16 + j % 16;
                }
                tmp[t] = xr[i];
                const float a = tmp[t] < 0 ? -tmp[t] : tmp[t];
                amax = a > amax ? a : amax;
            }
            const float id = amax > 0 ? 127.0f / amax : 0.0f;
            dx[m * nb + b] = amax / 127.0f;
            for (int t = 0; t < QB; t++) q[b * QB + t] = (int8_t)__builtin_lrintf(tmp[t] * id);
        }
        if (xs)
            for (long g = 0; g < ng; g++) {
                float s = 0.0f, sq = 0.0f;
                for (int t = 0; t < group; t++) s += xr[g * group + t];
                for (long b = g * bpg; b < (g + 1) * bpg; b++) {
                    int c = 0;
                    for (int t = 0; t < QB; t++) c += q[b * QB + t];
                    sq += dx[m * nb + b] * (float)c;
                }
                xs[m * ng + g] = s;
                rs[m * ng + g] = s - sq;
            }
    }
}

/* sums[r] = x[r] . dequant(weight row) for mb rows from their int8 blocks; `mb` is a constant at
 * each call site so the accumulators stay in registers. Weight scale of block b: sc[b >> gshift].
 * dxe (avx512): each block's activation scale repeated 8 times (one 512-bit load per block pair). */
static inline __attribute__((always_inline)) void row_dots_q8(const int8_t *xq, const float *dx, const float *dxe,
                                                              const float *xs, const float *rs,
                                                              const int mb, long K, const uint8_t *w, int wbits,
                                                              int gshift, long ng, const uint16_t *sc,
                                                              const uint16_t *mn, float *sums) {
    const long nb = K / QB;
    long b = 0;
    __m256 acc[MB];
    for (int r = 0; r < mb; r++) acc[r] = _mm256_setzero_ps();
    /* the weight's block scales as float32: one per row (per channel: applied once at the end), or
     * one per block or group, converted 16 at a time */
    const int per_row = gshift >= 62;
    float wsf[nb > 0 ? nb : 1];
    if (!per_row) {
        long i = 0;
        for (; i + 16 <= nb; i += 16) {
            float g16[16];
            const long g0 = i >> gshift;
            if (gshift == 0) {
                _mm256_storeu_ps(g16, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + g0))));
                _mm256_storeu_ps(g16 + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + g0 + 8))));
                memcpy(wsf + i, g16, sizeof g16);
            } else {
                for (int j = 0; j < 16; j++) wsf[i + j] = h2f(sc[(i + j) >> gshift]);
            }
        }
        for (; i < nb; i++) wsf[i] = h2f(sc[i >> gshift]);
    }
#if defined(KVPILOT_ISA_AVX512)
    __m512 acc2[MB];
    for (int r = 0; r < mb; r++) acc2[r] = _mm512_setzero_ps();
    for (; b + 1 < nb; b += 2) {
        __mmask64 neg = 0;
        const __m512i u = block512(w, b, wbits, &neg);
        const __m512 ws = per_row ? _mm512_set1_ps(1.0f)
                                  : _mm512_insertf32x8(_mm512_set1_ps(wsf[b]), _mm256_set1_ps(wsf[b + 1]), 1);
        for (int r = 0; r < mb; r++) {
            __m512i s = _mm512_loadu_si512((const void *)(xq + r * K + b * QB));
            if (wbits == 8) s = _mm512_mask_sub_epi8(s, neg, _mm512_setzero_si512(), s);
            const __m512 d = _mm512_loadu_ps(dxe + (r * nb + b) * 8); /* dx[b] x 8, dx[b + 1] x 8 */
            const __m512 p = _mm512_cvtepi32_ps(dot512(u, s));
            acc2[r] = _mm512_fmadd_ps(p, per_row ? d : _mm512_mul_ps(ws, d), acc2[r]);
        }
    }
    for (int r = 0; r < mb; r++)
        acc[r] = _mm256_add_ps(_mm512_castps512_ps256(acc2[r]), _mm512_extractf32x8_ps(acc2[r], 1));
#endif
    for (; b < nb; b++) {
        __m256i wv = _mm256_setzero_si256();
        const __m256i u = block256(w, b, wbits, &wv);
        const __m256 ws = _mm256_set1_ps(per_row ? 1.0f : wsf[b]);
        for (int r = 0; r < mb; r++) {
            __m256i s = _mm256_loadu_si256((const __m256i *)(xq + r * K + b * QB));
            if (wbits == 8) s = _mm256_sign_epi8(s, wv); /* x * sign(w), so u * s = w * x */
            const __m256 d = _mm256_broadcast_ss(dx + r * nb + b);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot256(u, s)), _mm256_mul_ps(ws, d), acc[r]);
        }
    }
    for (int r = 0; r < mb; r++) {
        if (per_row) acc[r] = _mm256_mul_ps(acc[r], _mm256_set1_ps(h2f(sc[0])));
        if (wbits == 4) { /* + sum over groups of min * xs + 8 * scale * rs (quantize_rows) */
            long g = 0;
            const __m256 eight = _mm256_set1_ps(8.0f);
            for (; g + 8 <= ng; g += 8) {
                const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + g)));
                const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + g)));
                acc[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + r * ng + g), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(eight, sv), _mm256_loadu_ps(rs + r * ng + g), acc[r]);
            }
            float s = hsum8(acc[r]);
            for (; g < ng; g++) s += h2f(mn[g]) * xs[r * ng + g] + 8.0f * h2f(sc[g]) * rs[r * ng + g];
            sums[r] = s;
        } else {
            sums[r] = hsum8(acc[r]);
        }
    }
}
#endif

#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
/* A weight's scale index shift for activation block b (sc[b >> shift]), or -1 when the int8-activation
 * path does not apply (group not a power-of-two multiple of QB, and more than one group a row). */
static int group_shift(long K, int group) {
    if (group % QB || K % group) return -1;
    if (K == group) return 62; /* one group per row (int8 per channel): every block -> scale 0 */
    int shift = 0;
    while ((QB << shift) < group) shift++;
    return (QB << shift) == group ? shift : -1;
}

/* The tiled int8 kernel with AVX512-VNNI offsets the signed weight codes w to unsigned w + 128 (one
 * xor, no per-row sign flips) and takes back 128 * (the block's activation code sum) per block: xb. */
#if defined(KVPILOT_ISA_AVX512) && defined(__AVX512VNNI__)
#define Q8_OFFSET 1
#else
#define Q8_OFFSET 0
#endif

/* M rows of activations quantized for one weight format (quantize_rows), dxe for avx512, and for
 * int8 with Q8_OFFSET xb[m * nb + b] = -128 * (sum of block b's codes) */
typedef struct {
    long M, K, ng;
    int8_t *xq;
    float *dx, *dxe, *xs, *rs;
    int32_t *xb;
} q8_acts;

static void q8_free(q8_acts *a) {
    free(a->xq), free(a->dx), free(a->dxe), free(a->xs), free(a->rs), free(a->xb);
    a->xq = NULL, a->dx = a->dxe = a->xs = a->rs = NULL, a->xb = NULL;
}

static int q8_alloc(q8_acts *a, long M, long K, int wbits, int group) {
    a->M = M, a->K = K, a->ng = K / group;
    a->xq = (int8_t *)malloc((size_t)(M * K) + 1);
    a->dx = (float *)malloc(sizeof(float) * (size_t)(M * (K / QB)) + 4);
    a->xs = wbits == 4 ? (float *)malloc(sizeof(float) * (size_t)(M * a->ng) + 4) : NULL;
    a->rs = wbits == 4 ? (float *)malloc(sizeof(float) * (size_t)(M * a->ng) + 4) : NULL;
    a->dxe = NULL;
    a->xb = Q8_OFFSET && wbits == 8 ? (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * (K / QB)) + 4) : NULL;
    if (Q8_OFFSET && wbits == 8 && !a->xb) {
        q8_free(a);
        return -3;
    }
#if defined(KVPILOT_ISA_AVX512)
    a->dxe = (float *)malloc(sizeof(float) * (size_t)(M * (K / QB) * 8) + 4);
    if (!a->dxe) {
        q8_free(a);
        return -3;
    }
#endif
    if (!a->xq || !a->dx || (wbits == 4 && (!a->xs || !a->rs))) {
        q8_free(a);
        return -3;
    }
    return 0;
}

static int q8_quantize(q8_acts *a, const float *xf, long M, long K, int wbits, int group, int num_threads) {
    if (q8_alloc(a, M, K, wbits, group)) return -3;
    const long nb = K / QB, chunks = (M + 15) / 16; /* rows in parallel, 16 at a time (prefill) */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M >= 32)
    for (long c = 0; c < chunks; c++) {
        const long m0 = c * 16, rows = M - m0 < 16 ? M - m0 : 16;
        quantize_rows(xf + m0 * K, rows, K, wbits, group, a->xq + m0 * K, a->dx + m0 * nb,
                      a->xs ? a->xs + m0 * a->ng : NULL, a->rs ? a->rs + m0 * a->ng : NULL);
        if (a->dxe)
            for (long i = m0 * nb * 8; i < (m0 + rows) * nb * 8; i++) a->dxe[i] = a->dx[i / 8];
        if (a->xb)
            for (long i = m0 * nb; i < (m0 + rows) * nb; i++) {
                int32_t c = 0;
                for (int t = 0; t < QB; t++) c += a->xq[i * QB + t];
                a->xb[i] = -128 * c;
            }
    }
    return 0;
}

/* dst->row[r] = src->row[src_row[r]] for the dst->M rows (src_row[r] < 0: left as it is) */
static void q8_gather(q8_acts *dst, const q8_acts *src, const long *src_row) {
    const long K = src->K, nb = K / QB, ng = src->ng;
    for (long r = 0; r < dst->M; r++) {
        const long m = src_row[r];
        if (m < 0) continue;
        memcpy(dst->xq + r * K, src->xq + m * K, (size_t)K);
        memcpy(dst->dx + r * nb, src->dx + m * nb, sizeof(float) * (size_t)nb);
        if (src->dxe) memcpy(dst->dxe + r * nb * 8, src->dxe + m * nb * 8, sizeof(float) * (size_t)(nb * 8));
        if (src->xs) memcpy(dst->xs + r * ng, src->xs + m * ng, sizeof(float) * (size_t)ng);
        if (src->rs) memcpy(dst->rs + r * ng, src->rs + m * ng, sizeof(float) * (size_t)ng);
        if (src->xb) memcpy(dst->xb + r * nb, src->xb + m * nb, sizeof(int32_t) * (size_t)nb);
    }
}

/* dst[m * ld] = activation row (first + m) . dequant(weight row w) for m < rows */
static void weight_row_dots(const q8_acts *a, long first, long rows, const uint8_t *w, int wbits, int gshift,
                            const uint16_t *sc, const uint16_t *mn, float *dst, long ld) {
    const long K = a->K, ng = a->ng;
    for (long m0 = first; m0 < first + rows; m0 += MB) {
        const int mb = first + rows - m0 < MB ? (int)(first + rows - m0) : MB;
        const int8_t *q = a->xq + m0 * K;
        const float *d = a->dx + m0 * (K / QB), *de = a->dxe ? a->dxe + m0 * (K / QB) * 8 : NULL;
        const float *s = a->xs ? a->xs + m0 * ng : NULL, *rr = a->rs ? a->rs + m0 * ng : NULL;
        float sums[MB];
        switch (mb) { /* a constant row count per call: accumulators in registers */
        case 1: row_dots_q8(q, d, de, s, rr, 1, K, w, wbits, gshift, ng, sc, mn, sums); break;
        case 2: row_dots_q8(q, d, de, s, rr, 2, K, w, wbits, gshift, ng, sc, mn, sums); break;
        case 3: row_dots_q8(q, d, de, s, rr, 3, K, w, wbits, gshift, ng, sc, mn, sums); break;
        default: row_dots_q8(q, d, de, s, rr, 4, K, w, wbits, gshift, ng, sc, mn, sums); break;
        }
        for (int r = 0; r < mb; r++) dst[(m0 - first + r) * ld] = sums[r];
    }
}
#endif

static void to_float(const void *x, int dtype, long n, float *out) {
    for (long i = 0; i < n; i++)
        out[i] = dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

int kvpilot_qmatmul(const void *x, int dtype, void *out, const void *bias, long M, long K, long N,
                    const uint8_t *w, int wbits, int group, const uint16_t *scales, const uint16_t *mins,
                    int num_threads, int int8_activations) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || (wbits != 8 && wbits != 4) || group <= 0 || K % group ||
        (wbits == 4 && (group % 2 || !mins)) || M <= 0)
        return -1;
    float *xf = (float *)malloc(sizeof(float) * (size_t)(M * K));
    if (!xf) return -3;
    to_float(x, dtype, M * K, xf);
    const long row_bytes = wbits == 8 ? K : K / 2, ng = K / group;
    int failed = 0;
#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
    const int gshift = group_shift(K, group);
    if (int8_activations && gshift >= 0) {
        q8_acts acts;
        if (q8_quantize(&acts, xf, M, K, wbits, group, num_threads)) {
            free(xf);
            return -3;
        }
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (long n = 0; n < N; n++) {
            const float b = !bias ? 0.0f
                            : dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)bias)[n])
                                               : ((const float *)bias)[n];
            float col[SMALL_COLUMN];
            for (long m0 = 0; m0 < M; m0 += SMALL_COLUMN) {
                const long rows = M - m0 < SMALL_COLUMN ? M - m0 : SMALL_COLUMN;
                weight_row_dots(&acts, m0, rows, w + n * row_bytes, wbits, gshift, scales + n * ng,
                                mins ? mins + n * ng : NULL, col, 1);
                for (long r = 0; r < rows; r++) {
                    const float v = col[r] + b;
                    if (dtype == DT_BF16)
                        ((uint16_t *)out)[(m0 + r) * N + n] = f32_to_bf16(v);
                    else
                        ((float *)out)[(m0 + r) * N + n] = v;
                }
            }
        }
        q8_free(&acts);
        free(xf);
        return 0;
    }
#endif
#pragma omp parallel num_threads(num_threads)
    {
        float *wf = (float *)aligned_alloc(64, sizeof(float) * (size_t)((K + 15) / 16 * 16));
        if (!wf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long n = 0; n < N; n++) {
            if (!wf) continue;
            const float b = !bias ? 0.0f
                            : dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)bias)[n])
                                               : ((const float *)bias)[n];
            dequant_row(w + n * row_bytes, wbits, K, group, scales + n * ng, mins ? mins + n * ng : NULL, wf);
            for (long m = 0; m < M; m++) {
                const float v = dot(xf + m * K, wf, K) + b;
                if (dtype == DT_BF16)
                    ((uint16_t *)out)[m * N + n] = f32_to_bf16(v);
                else
                    ((float *)out)[m * N + n] = v;
            }
        }
        free(wf);
    }
    free(xf);
    return failed ? -3 : 0;
}

/*
 * The tiled layout (kernels/qlinear.tile; CPU weights of the int8-activation formats whose row count
 * is a multiple of TR): the same bytes as the row layout above, permuted so that one vector of weight
 * codes spans TR output rows. Rows are taken TR at a time (a tile); for each tile and storage block b
 * (QB weights: 16 bytes a row for int4, 32 for int8) the TR rows' block bytes are interleaved four at
 * a time: vector v (64 bytes) holds bytes 4v..4v+3 of rows 0..TR-1, row r at byte 4r. Codes in
 * vector v multiply activation block elements 4v..4v+3 (int4: the low nibbles of vector v; the high
 * nibbles, elements 16 + 4v.., make code vector 4 + v); scales (and mins) are [N / TR, ng, TR].
 * An integer dot product (vpdpbusd, or maddubs + madd) of a code vector with one activation word
 * broadcast to every lane is then TR rows' partial sums at once: no horizontal sums, no per-row
 * tail, and one activation load serves TR rows (the row layout does one row, or four, at a time).
 * The arithmetic is row_dots_q8's (and reference_q8_matmul's): per block, an exact integer dot
 * times weight scale times activation scale, summed in float32; int4 adds min * xs + 8 * scale * rs.
 * int8 codes are signed, and vpdpbusd / maddubs take unsigned bytes times signed: with AVX512-VNNI
 * (Q8_OFFSET) the codes are read as w + 128 (one xor per code vector) and the block's exact integer
 * dot product is (w + 128) . x - 128 * sum(x) (vpdpbusd does not saturate); otherwise, and on AVX2
 * (maddubs saturates at 16 bits), |w| times x with w's sign, flipped per activation row.
 */
/* the tiled kernels' argument check: 0 where they take (dtype, wbits, group, mins, M, K, N) */
static int tiled_args_bad(int dtype, int wbits, int group, const uint16_t *mins, long M, long K, long N) {
    return (dtype != DT_F32 && dtype != DT_BF16) || (wbits != 8 && wbits != 4) || group <= 0 || K % group ||
           (wbits == 4 && !mins) || M <= 0 || N % 16;
}

#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
#define TR 16 /* weight rows per tile */
/* software prefetch distance in a stream of tiles (the tiles of one weight are consecutive): with a
 * few activation rows a tile (MoE experts at decode) the kernel is bound by reading the weights, and
 * the hardware prefetcher alone kept one core at about half its read bandwidth (benchmarks/kernels_bench.py qmoe) */
#define PF_BYTES 4096
/* activation rows per pass over a tile: a speculative verification (5 rows) in one pass; AVX2 has 16
 * vector registers for 2 accumulators a row */
#if defined(KVPILOT_ISA_AVX512)
#define TM 8
#else
#define TM 6
#endif
/* CALL(n) for a pass of mb <= TM rows, n a constant at each call (the kernels keep a pass's accumulators
 * in registers only for a constant row count) */
#if TM > 6
#define TILE_ROWS(mb, CALL)                                                                                    \
    switch (mb) {                                                                                              \
    case 1: CALL(1); break;                                                                                    \
    case 2: CALL(2); break;                                                                                    \
    case 3: CALL(3); break;                                                                                    \
    case 4: CALL(4); break;                                                                                    \
    case 5: CALL(5); break;                                                                                    \
    case 6: CALL(6); break;                                                                                    \
    case 7: CALL(7); break;                                                                                    \
    default: CALL(TM); break;                                                                                  \
    }
#else
#define TILE_ROWS(mb, CALL)                                                                                    \
    switch (mb) {                                                                                              \
    case 1: CALL(1); break;                                                                                    \
    case 2: CALL(2); break;                                                                                    \
    case 3: CALL(3); break;                                                                                    \
    case 4: CALL(4); break;                                                                                    \
    case 5: CALL(5); break;                                                                                    \
    default: CALL(TM); break;                                                                                  \
    }
#endif

/* activation elements from which a call's preparation of them (widening, rounding, reordering) runs on
 * the call's threads: a prefill chunk's (e.g. 2,048 x 8,192) took a fifth of the call on one thread */
#define SETUP_PAR_MIN (1L << 18)
/* activation bytes a pass over every tile keeps hot: the calls past it (a long prefill chunk at a wide K:
 * 2,048 x 8,192 bfloat16 pairs are 32 MiB) run in blocks of rows, every tile per block, so that the block
 * stays in each core's L2 (2 MiB on Zen 5) instead of streaming from memory once per tile */
#define M_BLOCK_BYTES (1L << 20)

/* passes of up to this many activation rows prefetch the codes into L1 (T0), larger ones into L2 (T1).
 * A one-row pass (a single stream's decode) does little arithmetic per byte and streams the weights at
 * the memory's pace: T0 made it 1.06-1.23x faster on weights that stream from memory (bf16 and int8
 * activations, one and two threads; AMD EPYC Zen 4, kernels_bench.py qmatmul-ab, docs/benchmarks.md);
 * at 5 rows it cost 0.95x (bf16) to 0.78x (int8 activations) on a 128,256-row LM head, and from 8 rows
 * it did nothing measurable (T1 had been chosen for the expert tiles, qmoe, at many rows) */
#define PF_L1_ROWS 1

/* software prefetch in a stream of tiles for a pass of `rows` rows: the codes `pf` bytes ahead and, where
 * `scales`, the scales (and mins) 16 blocks ahead, in the next tile past the last */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *p, long pf, int bytes,
                                                                 const uint16_t *st, const uint16_t *mt, long b,
                                                                 int gshift, int scales, int rows) {
    if (rows <= PF_L1_ROWS)
        for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char *)(p + pf + l), _MM_HINT_T0);
    else
        for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char *)(p + pf + l), _MM_HINT_T1);
    if (scales) {
        _mm_prefetch((const char *)(st + ((b + 16) >> gshift) * TR), _MM_HINT_T1);
        if (mt) _mm_prefetch((const char *)(mt + ((b + 16) >> gshift) * TR), _MM_HINT_T1);
    }
}

/* out rows m0..m0+mb, columns of tile t = res [mb, TR] + bias, in the activations' dtype */
static inline void store_tile(const float *res, long m0, int mb, long t, long N, const void *bias, int dtype,
                              void *out) {
    for (int r = 0; r < mb; r++)
        for (int i = 0; i < TR; i++) {
            const long n = t * TR + i;
            const float v = res[r * TR + i] + (!bias              ? 0.0f
                                               : dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)bias)[n])
                                                                  : ((const float *)bias)[n]);
            if (dtype == DT_BF16)
                ((uint16_t *)out)[(m0 + r) * N + n] = f32_to_bf16(v);
            else
                ((float *)out)[(m0 + r) * N + n] = v;
        }
}

static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(KVPILOT_ISA_AVX512)
/* out[r][0..TR) = activation row m0 + r . the tile's TR weight rows, for r < mb */
static inline __attribute__((always_inline)) void tile_dots(const q8_acts *a, long m0, const int mb,
                                                            const uint8_t *wt, int wbits, int gshift,
                                                            const uint16_t *st, const uint16_t *mt,
                                                            float *out, long ldo, long pf) {
    const long K = a->K, nb = K / QB, ng = a->ng;
    const int per_row = gshift >= 62, bb = wbits == 8 ? QB : QB / 2;
    const __m512i nib = _mm512_set1_epi8(15);
    __m512 acc[TM];
    for (int r = 0; r < mb; r++) acc[r] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = wt + b * TR * bb;
        if (pf) prefetch_ahead(p, pf, TR * bb, st, mt, b, gshift, !per_row, mb);
        const __m512 ws = per_row ? _mm512_set1_ps(1.0f)
                                  : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + (b >> gshift) * TR)));
        __m512i u[8];
#if !Q8_OFFSET
        __mmask64 neg[8];
#endif
        if (wbits == 4) {
            for (int v = 0; v < 4; v++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(p + v * 64));
                u[v] = _mm512_and_si512(raw, nib);
                u[4 + v] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
            }
        } else {
            for (int v = 0; v < 8; v++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(p + v * 64));
#if Q8_OFFSET
                u[v] = _mm512_xor_si512(raw, _mm512_set1_epi8(-128)); /* w + 128, unsigned */
#else
                neg[v] = _mm512_movepi8_mask(raw);
                u[v] = _mm512_abs_epi8(raw);
#endif
            }
        }
        for (int r = 0; r < mb; r++) {
            const int8_t *xq = a->xq + (m0 + r) * K + b * QB;
            __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
#if Q8_OFFSET
            if (wbits == 8) i0 = _mm512_set1_epi32(a->xb[(m0 + r) * nb + b]); /* (w + 128) . x - 128 * sum x */
#endif
            for (int v = 0; v < 8; v += 2) {
                __m512i s0 = _mm512_set1_epi32(load_i32(xq + 4 * v)), s1 = _mm512_set1_epi32(load_i32(xq + 4 * v + 4));
#if !Q8_OFFSET
                if (wbits == 8) { /* x * sign(w), so |w| * s = w * x */
                    s0 = _mm512_mask_sub_epi8(s0, neg[v], _mm512_setzero_si512(), s0);
                    s1 = _mm512_mask_sub_epi8(s1, neg[v + 1], _mm512_setzero_si512(), s1);
                }
#endif
#if defined(__AVX512VNNI__)
                i0 = _mm512_dpbusd_epi32(i0, u[v], s0);
                i1 = _mm512_dpbusd_epi32(i1, u[v + 1], s1);
#else
                i0 = _mm512_add_epi32(i0, _mm512_madd_epi16(_mm512_maddubs_epi16(u[v], s0), _mm512_set1_epi16(1)));
                i1 = _mm512_add_epi32(i1, _mm512_madd_epi16(_mm512_maddubs_epi16(u[v + 1], s1), _mm512_set1_epi16(1)));
#endif
            }
            const __m512 d = _mm512_set1_ps(a->dx[(m0 + r) * nb + b]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)), _mm512_mul_ps(ws, d), acc[r]);
        }
    }
    if (per_row)
        for (int r = 0; r < mb; r++) acc[r] = _mm512_mul_ps(acc[r], _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)st)));
    if (wbits == 4) /* + sum over groups of min * xs + 8 * scale * rs (quantize_rows); each group's
                     * scales and mins converted once for all mb rows */
        for (long g = 0; g < ng; g++) {
            const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mt + g * TR)));
            const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + g * TR)));
            for (int r = 0; r < mb; r++) {
                acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a->xs[(m0 + r) * ng + g]), acc[r]);
                acc[r] = _mm512_fmadd_ps(sv, _mm512_set1_ps(8.0f * a->rs[(m0 + r) * ng + g]), acc[r]);
            }
        }
    for (int r = 0; r < mb; r++) _mm512_storeu_ps(out + r * ldo, acc[r]);
}
#else
/* AVX2: the same, one half tile (8 rows: bytes 32h..32h+31 of each 64-byte vector) at a time */
static inline __attribute__((always_inline)) void tile_dots(const q8_acts *a, long m0, const int mb,
                                                            const uint8_t *wt, int wbits, int gshift,
                                                            const uint16_t *st, const uint16_t *mt,
                                                            float *out, long ldo, long pf) {
    const long K = a->K, nb = K / QB, ng = a->ng;
    const int per_row = gshift >= 62, bb = wbits == 8 ? QB : QB / 2;
    const __m256i nib = _mm256_set1_epi8(15);
    for (int h = 0; h < 2; h++) {
        __m256 acc[TM];
        for (int r = 0; r < mb; r++) acc[r] = _mm256_setzero_ps();
        for (long b = 0; b < nb; b++) {
            const uint8_t *p = wt + b * TR * bb + 32 * h;
            if (pf && h == 0) prefetch_ahead(p, pf, TR * bb, st, mt, b, gshift, !per_row, mb); /* as avx512 */
            const __m256 ws = per_row ? _mm256_set1_ps(1.0f)
                                      : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + (b >> gshift) * TR + 8 * h)));
            __m256i it[TM];
            for (int r = 0; r < mb; r++) it[r] = _mm256_setzero_si256();
            for (int v = 0; v < 8; v++) {
                __m256i u, w = _mm256_setzero_si256();
                if (wbits == 4) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + (v & 3) * 64));
                    u = _mm256_and_si256(v < 4 ? raw : _mm256_srli_epi16(raw, 4), nib);
                } else {
                    w = _mm256_loadu_si256((const __m256i *)(p + v * 64));
                    u = _mm256_abs_epi8(w);
                }
                for (int r = 0; r < mb; r++) {
                    __m256i s = _mm256_set1_epi32(load_i32(a->xq + (m0 + r) * K + b * QB + 4 * v));
                    if (wbits == 8) s = _mm256_sign_epi8(s, w);
                    it[r] = _mm256_add_epi32(it[r], dot256(u, s));
                }
            }
            for (int r = 0; r < mb; r++) {
                const __m256 d = _mm256_set1_ps(a->dx[(m0 + r) * nb + b]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(it[r]), _mm256_mul_ps(ws, d), acc[r]);
            }
        }
        if (per_row)
            for (int r = 0; r < mb; r++)
                acc[r] = _mm256_mul_ps(acc[r], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + 8 * h))));
        if (wbits == 4) /* as avx512: each group's scales and mins converted once for all mb rows */
            for (long g = 0; g < ng; g++) {
                const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mt + g * TR + 8 * h)));
                const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + g * TR + 8 * h)));
                for (int r = 0; r < mb; r++) {
                    acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a->xs[(m0 + r) * ng + g]), acc[r]);
                    acc[r] = _mm256_fmadd_ps(sv, _mm256_set1_ps(8.0f * a->rs[(m0 + r) * ng + g]), acc[r]);
                }
            }
        for (int r = 0; r < mb; r++) _mm256_storeu_ps(out + r * ldo + 8 * h, acc[r]);
    }
}
#endif
#endif

#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
/* tile_dots for mb <= TM rows, a constant row count per call (accumulators in registers), and `pf` a
 * constant at each call site (a copy with prefetches, one without) */
static inline __attribute__((always_inline)) void tile_rows(const q8_acts *a, long m0, int mb, const uint8_t *wt,
                                                            int wbits, int gshift, const uint16_t *st,
                                                            const uint16_t *mt, float *o, long ldo, const long pf) {
#define ROWS_Q8(n) tile_dots(a, m0, n, wt, wbits, gshift, st, mt, o, ldo, pf)
    TILE_ROWS(mb, ROWS_Q8)
#undef ROWS_Q8
}
#endif

/* kvpilot_qmatmul on a weight in the tiled layout (N a multiple of TR, a format with the
 * int8-activation path: int8 per channel or int4/int8 in power-of-two multiples of QB). Returns -1 on
 * bad arguments, -2 where the tiled path does not exist (the generic level), -3 out of memory. */
int kvpilot_qmatmul_tiled(const void *x, int dtype, void *out, const void *bias, long M, long K, long N,
                          const uint8_t *w, int wbits, int group, const uint16_t *scales, const uint16_t *mins,
                          int num_threads) {
    if (tiled_args_bad(dtype, wbits, group, mins, M, K, N)) return -1;
#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
    const int gshift = group_shift(K, group);
    if (gshift < 0) return -1;
    float *xf = (float *)malloc(sizeof(float) * (size_t)(M * K));
    if (!xf) return -3;
    to_float(x, dtype, M * K, xf);
    q8_acts acts;
    const int rc = q8_quantize(&acts, xf, M, K, wbits, group, num_threads);
    free(xf);
    if (rc) return rc;
    const long row_bytes = wbits == 8 ? K : K / 2, ng = K / group;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long t = 0; t < N / TR; t++) {
        const uint8_t *wt = w + t * TR * row_bytes;
        const uint16_t *st = scales + t * TR * ng, *mt = mins ? mins + t * TR * ng : NULL;
        float res[TM * TR];
        for (long m0 = 0; m0 < M; m0 += TM) {
            const int mb = M - m0 < TM ? (int)(M - m0) : TM;
            if (m0 == 0) /* as expert_tiles: the first row group prefetches the next tiles' weights */
                tile_rows(&acts, m0, mb, wt, wbits, gshift, st, mt, res, TR, PF_BYTES);
            else
                tile_rows(&acts, m0, mb, wt, wbits, gshift, st, mt, res, TR, 0);
            store_tile(res, m0, mb, t, N, bias, dtype, out);
        }
    }
    q8_free(&acts);
    return 0;
#else
    (void)x, (void)out, (void)bias, (void)w, (void)scales, (void)num_threads;
    return -2;
#endif
}

/*
 * Float activations on the tiled layout (kvpilot_qmatmul_tiled_float): the exact product, as
 * `--qmatmul-activations float` asks. The codes are widened to float32 in registers (int4: a nibble
 * indexes a 16-float table, vpermps; int8: shifts + convert) and multiplied into the float32
 * activations, summed per weight group, then times the group's scale (int4: + min * the group's
 * float sum of activations). No activation is rounded: the result is x . dequant(W) in float32, as
 * torch's matmul of the dequantized weights computes it, up to the order of the sums.
 * Activations are read in the weight's storage order (xp: for int4 groups above 32 the chunks of a
 * group interleave, storage_order in kernels/qlinear.py), one float per code.
 */
#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
/* Activations are stored by blocks of rows: for each block and 32-block b of K, its rows' 32 values (or
 * 16 bfloat16 pairs) one after another, so that a pass over a tile reads one contiguous run per b. Rows
 * K apart would share the cache's sets (at K = 2,048 every row's line falls in the same L1 set: 16
 * rows of bfloat16 pairs exceeded its ways and ran at 0.55x; 6-8 float rows cost the float kernel
 * ~10% at K = 2,048 on an L1 of 12 ways, more on one of 8). Blocks of F_BLOCK rows (48: passes of 6, 8
 * or 16 rows from a multiple of 48 never straddle one) or all M rows when fewer; the last is padded. */
#define F_BLOCK 48
static inline long f_block(long M) { return M < F_BLOCK ? M : F_BLOCK; }

/* the chunk index of row m, 32-block b: nb blocks a row, blocks of rb rows */
static inline long blk_at(long nb, long rb, long m, long b) { return (m / rb * nb + b) * rb + m % rb; }

#endif

#if defined(KVPILOT_ISA_AVX512)
/* part[r][0] = the sum of row r's `chains` chains of partial sums, for r < mb */
static inline __attribute__((always_inline)) void sum_chains512(__m512 part[][4], int mb, int chains) {
    for (int r = 0; r < mb; r++)
        for (int c = 1; c < chains; c++) part[r][0] = _mm512_add_ps(part[r][0], part[r][c]);
}

/* The end of a weight group in the 512-bit kernels (a whole tile, rows m0..m0+mb): acc += the group's
 * sums times its scale (int4: + its min times the row's activation sum for the group), or, one group a
 * row (per_row), acc += the sums (scaled at the end by tile_end16) */
static inline __attribute__((always_inline)) void group_end16(__m512 *acc, const __m512 *sum, int mb, int per_row,
                                                              int wbits, const uint16_t *st, const uint16_t *mt,
                                                              long g, const float *xs, long m0, long ng) {
    if (per_row) {
        for (int r = 0; r < mb; r++) acc[r] = _mm512_add_ps(acc[r], sum[r]);
        return;
    }
    const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + g * TR)));
    for (int r = 0; r < mb; r++) acc[r] = _mm512_fmadd_ps(sv, sum[r], acc[r]);
    if (wbits == 4) {
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mt + g * TR)));
        for (int r = 0; r < mb; r++) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[(m0 + r) * ng + g]), acc[r]);
    }
}

/* a tile done: one group a row takes its scale (int4: + its min times the row's sum) now; out[r] = acc[r] */
static inline __attribute__((always_inline)) void tile_end16(__m512 *acc, int mb, int per_row, int wbits,
                                                             const uint16_t *st, const uint16_t *mt, const float *xs,
                                                             long m0, long ng, float *out, long ldo) {
    if (per_row) {
        const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)st));
        for (int r = 0; r < mb; r++) acc[r] = _mm512_mul_ps(acc[r], sv);
        if (wbits == 4) {
            const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)mt));
            for (int r = 0; r < mb; r++) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[(m0 + r) * ng]), acc[r]);
        }
    }
    for (int r = 0; r < mb; r++) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

/* out[r][0..TR) = activation row m0 + r . the tile's TR weight rows (float), for r < mb. C chains of
 * sums a row (more when few rows: the FMA latency, not the throughput, bounds one chain) */
static inline __attribute__((always_inline)) void tile_dots_f(const float *xp, const float *xs, long K, long ng,
                                                              long m0, long rb, const int mb, const uint8_t *wt,
                                                              int wbits, int gshift, const uint16_t *st,
                                                              const uint16_t *mt, float *out, long ldo, long pf) {
    enum { C = 4 };
    const int chains = mb <= 2 ? 4 : mb <= 4 ? 2 : 1;
    const long nb = K / QB;
    const int per_row = gshift >= 62, bb = wbits == 8 ? QB : QB / 2;
    const long bpg = per_row ? nb : (1L << gshift);
    const float *x0 = xp + blk_at(nb, rb, m0, 0) * QB; /* block b of the pass's rows: x0 + b rb QB */
    const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc[TM], part[TM][C];
    for (int r = 0; r < mb; r++) acc[r] = _mm512_setzero_ps();
    for (long g0 = 0, g = 0; g0 < nb; g0 += bpg, g++) {
        for (int r = 0; r < mb; r++)
            for (int c = 0; c < chains; c++) part[r][c] = _mm512_setzero_ps();
        for (long b = g0; b < g0 + bpg; b++) {
            const uint8_t *p = wt + b * TR * bb;
            if (pf) prefetch_ahead(p, pf, TR * bb, st, mt, b, gshift, !per_row && b == g0, mb);
            const float *xb = x0 + b * rb * QB; /* row m0 + r: + QB r */
            if (wbits == 4) {
                for (int v = 0; v < 4; v++) {
                    const __m512i raw = _mm512_loadu_si512((const void *)(p + v * 64));
                    for (int j = 0; j < 4; j++) {
                        const __m512 lo = _mm512_permutexvar_ps(j ? _mm512_srli_epi32(raw, 8 * j) : raw, lut);
                        const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 8 * j + 4), lut);
                        const int c0 = (2 * j) % chains, c1 = (2 * j + 1) % chains;
                        for (int r = 0; r < mb; r++) {
                            part[r][c0] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xb[r * QB + 4 * v + j]), part[r][c0]);
                            part[r][c1] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xb[r * QB + 16 + 4 * v + j]), part[r][c1]);
                        }
                    }
                }
            } else {
                for (int v = 0; v < 8; v++) {
                    const __m512i raw = _mm512_loadu_si512((const void *)(p + v * 64));
                    for (int j = 0; j < 4; j++) {
                        const __m512i q = j == 3 ? _mm512_srai_epi32(raw, 24)
                                                 : _mm512_srai_epi32(_mm512_slli_epi32(raw, 24 - 8 * j), 24);
                        const __m512 qf = _mm512_cvtepi32_ps(q);
                        const int c0 = j % chains;
                        for (int r = 0; r < mb; r++)
                            part[r][c0] = _mm512_fmadd_ps(qf, _mm512_set1_ps(xb[r * QB + 4 * v + j]), part[r][c0]);
                    }
                }
            }
        }
        sum_chains512(part, mb, chains);
        __m512 sum[TM];
        for (int r = 0; r < mb; r++) sum[r] = part[r][0];
        group_end16(acc, sum, mb, per_row, wbits, st, mt, g, xs, m0, ng);
    }
    tile_end16(acc, mb, per_row, wbits, st, mt, xs, m0, ng, out, ldo);
}
#endif

#if defined(KVPILOT_ISA_AVX2) && !defined(KVPILOT_ISA_AVX512)
/* The end of a weight group in the AVX2-width kernels (half h of a tile, rows m0..m0+mb): acc += the
 * group's sums times its scale (int4: + its min times the row's activation sum for the group), or,
 * one group a row (per_row), acc += the sums (scaled at the end by tile_end8). */
static inline __attribute__((always_inline)) void group_end8(__m256 *acc, const __m256 *sum, int mb, int per_row,
                                                             int wbits, const uint16_t *st, const uint16_t *mt,
                                                             long g, int h, const float *xs, long m0, long ng) {
    if (per_row) {
        for (int r = 0; r < mb; r++) acc[r] = _mm256_add_ps(acc[r], sum[r]);
        return;
    }
    const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + g * TR + 8 * h)));
    for (int r = 0; r < mb; r++) acc[r] = _mm256_fmadd_ps(sv, sum[r], acc[r]);
    if (wbits == 4) {
        const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mt + g * TR + 8 * h)));
        for (int r = 0; r < mb; r++) acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[(m0 + r) * ng + g]), acc[r]);
    }
}

/* half h of a tile done: one group a row takes its scale (int4: + its min times the row's sum) now;
 * out[r][8h..8h+8) = acc[r] */
static inline __attribute__((always_inline)) void tile_end8(__m256 *acc, int mb, int per_row, int wbits,
                                                            const uint16_t *st, const uint16_t *mt, int h,
                                                            const float *xs, long m0, long ng, float *out,
                                                            long ldo) {
    if (per_row) {
        const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + 8 * h)));
        for (int r = 0; r < mb; r++) acc[r] = _mm256_mul_ps(acc[r], sv);
        if (wbits == 4) {
            const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mt + 8 * h)));
            for (int r = 0; r < mb; r++) acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[(m0 + r) * ng]), acc[r]);
        }
    }
    for (int r = 0; r < mb; r++) _mm256_storeu_ps(out + r * ldo + 8 * h, acc[r]);
}
#endif

#if defined(KVPILOT_ISA_AVX2) && !defined(KVPILOT_ISA_AVX512)
/* AVX2: the same, one half tile (8 rows: bytes 32h..32h+31 of each 64-byte vector) at a time; the
 * codes widened by and/shift + convert (no 16-entry permute at 8 lanes) */
static inline __attribute__((always_inline)) void tile_dots_f(const float *xp, const float *xs, long K, long ng,
                                                              long m0, long rb, const int mb, const uint8_t *wt,
                                                              int wbits, int gshift, const uint16_t *st,
                                                              const uint16_t *mt, float *out, long ldo, long pf) {
    enum { C = 2 };
    const int chains = mb <= 2 ? 2 : 1;
    const long nb = K / QB;
    const int per_row = gshift >= 62, bb = wbits == 8 ? QB : QB / 2;
    const long bpg = per_row ? nb : (1L << gshift);
    const float *x0 = xp + blk_at(nb, rb, m0, 0) * QB; /* block b of the pass's rows: x0 + b rb QB */
    const __m256i nib = _mm256_set1_epi32(15);
    for (int h = 0; h < 2; h++) {
        __m256 acc[TM], part[TM][C];
        for (int r = 0; r < mb; r++) acc[r] = _mm256_setzero_ps();
        for (long g0 = 0, g = 0; g0 < nb; g0 += bpg, g++) {
            for (int r = 0; r < mb; r++)
                for (int c = 0; c < chains; c++) part[r][c] = _mm256_setzero_ps();
            for (long b = g0; b < g0 + bpg; b++) {
                const uint8_t *p = wt + b * TR * bb + 32 * h;
                if (pf && h == 0) prefetch_ahead(p, pf, TR * bb, st, mt, b, gshift, !per_row && b == g0, mb);
                const float *xb = x0 + b * rb * QB; /* row m0 + r: + QB r */
                if (wbits == 4) {
                    for (int v = 0; v < 4; v++) {
                        const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + v * 64));
                        for (int j = 0; j < 4; j++) {
                            const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(raw, 8 * j), nib));
                            const __m256 hi =
                                _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(raw, 8 * j + 4), nib));
                            const int c0 = (2 * j) % chains, c1 = (2 * j + 1) % chains;
                            for (int r = 0; r < mb; r++) {
                                part[r][c0] = _mm256_fmadd_ps(lo, _mm256_set1_ps(xb[r * QB + 4 * v + j]), part[r][c0]);
                                part[r][c1] =
                                    _mm256_fmadd_ps(hi, _mm256_set1_ps(xb[r * QB + 16 + 4 * v + j]), part[r][c1]);
                            }
                        }
                    }
                } else {
                    for (int v = 0; v < 8; v++) {
                        const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + v * 64));
                        for (int j = 0; j < 4; j++) {
                            const __m256i q = j == 3 ? _mm256_srai_epi32(raw, 24)
                                                     : _mm256_srai_epi32(_mm256_slli_epi32(raw, 24 - 8 * j), 24);
                            const __m256 qf = _mm256_cvtepi32_ps(q);
                            const int c0 = j % chains;
                            for (int r = 0; r < mb; r++)
                                part[r][c0] = _mm256_fmadd_ps(qf, _mm256_set1_ps(xb[r * QB + 4 * v + j]), part[r][c0]);
                        }
                    }
                }
            }
            __m256 sum[TM];
            for (int r = 0; r < mb; r++) {
                sum[r] = part[r][0];
                for (int c = 1; c < chains; c++) sum[r] = _mm256_add_ps(sum[r], part[r][c]);
            }
            group_end8(acc, sum, mb, per_row, wbits, st, mt, g, h, xs, m0, ng);
        }
        tile_end8(acc, mb, per_row, wbits, st, mt, h, xs, m0, ng, out, ldo);
    }
}
#endif

#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
static inline __attribute__((always_inline)) void tile_rows_f(const float *xp, const float *xs, long K, long ng,
                                                              long m0, long rb, int mb, const uint8_t *wt, int wbits,
                                                              int gshift, const uint16_t *st, const uint16_t *mt,
                                                              float *o, long ldo, const long pf) {
#define ROWS_F(n) tile_dots_f(xp, xs, K, ng, m0, rb, n, wt, wbits, gshift, st, mt, o, ldo, pf)
    TILE_ROWS(mb, ROWS_F)
#undef ROWS_F
}
#endif

/*
 * bfloat16 activations on the tiled layout (kvpilot_qmatmul_tiled_bf16, `--qmatmul-activations bf16`):
 * each activation rounded once to bfloat16 (to nearest even), the weights' codes exact, the products
 * summed in float32: x_bf16 . dequant(W), up to the order of the sums.
 * int4 at avx512 with AVX512-BF16: `vdpbf16ps` (two products a lane) on code pairs made with one
 * word permute each: `vpermw` looks each 16-bit word's low five bits up in a table of bfloat16(i & 15),
 * so a word holding a nibble in its low four bits (whatever the bit above) becomes that code exactly.
 * Per 64-byte vector of a tile (16 rows x 8 codes): three shifts and four permutes, then four
 * `vdpbf16ps` a row, against eight permutes and eight FMAs a row in float32. (An earlier version or'ed
 * the nibble into the bits of 128.0, 128 + c, and took 128 * sum(x) back off: float32 cancellation that
 * a large activation, such as the first token's, turned into an error of whole units.)
 * int8 there too: each code is a small integer, so bfloat16 holds it exactly; per 64-byte vector (16
 * rows x 4 codes) the codes are widened to float32 as in the float kernel (the bits of a float32 of
 * |c| <= 128 have 16 zero low bits: its high word is its bfloat16) and two codes of a row packed into
 * one 32-bit lane, then two `vdpbf16ps` a row against four FMAs: 1.3-1.7x the float kernel from 3 rows
 * (BF8_MIN_ROWS), 0.7-0.9x at 1-2 rows, where the widening is not shared by enough rows and the float
 * kernel takes them (one thread, SmolLM2's shapes: kernels_bench.py qmatmul --methods int8).
 * Elsewhere (AVX2, no AVX512-BF16) the rounded activations go through the float kernel: the same
 * arithmetic, the float kernel's speed.
 */
#if defined(KVPILOT_ISA_AVX512) && defined(__AVX512BF16__)
#define BF_TILES 1
#define BF_TM 16 /* activation rows of a full pass over a tile: each tile vector's code expansion serves them all */
/* Activation pairs are stored by blocks of bf_block(M) rows (blk_at, as the float activations are; a pass
 * of up to 16 rows stays in one block) */
static inline long bf_block(long M) { return M < BF_TM ? M : BF_TM; }

static uint32_t *bf_alloc(long M, long K) {
    const long rb = bf_block(M), rows = (M + rb - 1) / rb * rb;
    return (uint32_t *)calloc((size_t)(rows * K / 2) + 16, sizeof(uint32_t));
}

/* the 16 words of row m, 32-block b (nb blocks a row; blocks of rb rows) */
static inline uint32_t *bf_at(const uint32_t *xa, long nb, long rb, long m, long b) {
    return (uint32_t *)xa + blk_at(nb, rb, m, b) * 16;
}

/* the activation pairs of the tiles (bf16 bits, first element low; x already rounded to bf16) of one
 * 32-block x in storage order, 16 words into o: int4, for v in 0..3, (x[4v], x[4v+2]), (x[4v+1], x[4v+3]),
 * (x[16+4v], x[16+4v+2]), (x[16+4v+1], x[16+4v+3]), the codes' pairing in tile_dots_bf; int8, (x[2i], x[2i + 1]) */
static inline void bf_words(const float *x, int wbits, uint32_t *o) {
    if (wbits == 8) {
        for (int j = 0; j < 16; j++)
            o[j] = (uint32_t)f32_to_bf16(x[2 * j]) | (uint32_t)f32_to_bf16(x[2 * j + 1]) << 16;
        return;
    }
    for (int v = 0; v < 4; v++)
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 2; j++) {
                const float *y = x + 16 * h + 4 * v + j;
                o[4 * v + 2 * h + j] = (uint32_t)f32_to_bf16(y[0]) | (uint32_t)f32_to_bf16(y[2]) << 16;
            }
}

#define BF8_MIN_ROWS 3 /* rows of a pass from which the int8 tile takes vdpbf16ps (see above) */

/* tile_dots_f's contract on activation pairs xa (bf_pairs; for int8 only passes of mb >=
 * BF8_MIN_ROWS), xs the per-group sums of the rounded activations (int4) */
static inline __attribute__((always_inline)) void tile_dots_bf(const uint32_t *xa, const float *xs, long K, long ng,
                                                               long m0, long rb, const int mb, const uint8_t *wt,
                                                               const int wbits, int gshift, const uint16_t *st,
                                                               const uint16_t *mt, float *out, long ldo, long pf) {
    enum { C = 4 };
    const int chains = mb <= 2 ? 4 : mb <= 4 ? 2 : 1;
    const long nb = K / QB;
    const int per_row = gshift >= 62, bb = wbits == 8 ? QB : QB / 2, nw = wbits == 8 ? 2 : 4;
    const long bpg = per_row ? nb : (1L << gshift);
    static const uint16_t codes[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                       0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
                                       0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                       0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
    const __m512i lut = _mm512_loadu_si512((const void *)codes); /* bfloat16(i & 15), i < 32 */
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    const uint32_t *x0 = bf_at(xa, nb, rb, m0, 0);
    /* the sums over K: in registers for up to TM rows, else in `out`, updated once a group (the registers
     * hold a full pass's partial sums) */
    const int in_regs = mb <= TM;
    __m512 acc[TM], part[BF_TM][C];
    for (int r = 0; r < mb; r++)
        if (in_regs)
            acc[r] = _mm512_setzero_ps();
        else
            _mm512_storeu_ps(out + r * ldo, _mm512_setzero_ps());
    for (long g0 = 0, g = 0; g0 < nb; g0 += bpg, g++) {
        for (int r = 0; r < mb; r++)
            for (int c = 0; c < chains; c++) part[r][c] = _mm512_setzero_ps();
        for (long b = g0; b < g0 + bpg; b++) {
            const uint8_t *p = wt + b * TR * bb;
            if (pf) prefetch_ahead(p, pf, TR * bb, st, mt, b, gshift, !per_row && b == g0, mb);
            const uint32_t *xb = x0 + b * rb * 16; /* bf_at(xa, nb, rb, m0 + r, b) = xb + 16 r */
            for (int v = 0; v < bb / 4; v++) { /* 64-byte vectors: 16 rows x 8 int4 or 4 int8 codes */
                const __m512i raw = _mm512_loadu_si512((const void *)(p + v * 64));
                __m512bh w[4];
                if (wbits == 4) {
                    w[0] = (__m512bh)_mm512_permutexvar_epi16(raw, lut); /* bytes 0, 2: low nibbles */
                    w[1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi32(raw, 8), lut); /* 1, 3: low */
                    w[2] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi32(raw, 4), lut); /* 0, 2: high */
                    w[3] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi32(raw, 12), lut); /* 1, 3: high */
                } else {
                    __m512i f[4]; /* float32 bits of each row's code 4v + j */
                    for (int j = 0; j < 4; j++)
                        f[j] = _mm512_castps_si512(_mm512_cvtepi32_ps(
                            j == 3 ? _mm512_srai_epi32(raw, 24)
                                   : _mm512_srai_epi32(_mm512_slli_epi32(raw, 24 - 8 * j), 24)));
                    /* (code 4v, 4v + 1) and (4v + 2, 4v + 3) as bfloat16 pairs: hi | lo >> 16 */
                    for (int h = 0; h < 2; h++)
                        w[h] = (__m512bh)_mm512_ternarylogic_epi32(f[2 * h + 1], high,
                                                                    _mm512_srli_epi32(f[2 * h], 16), 0xEA);
                }
                for (int j = 0; j < nw; j++) {
                    const int c0 = j % chains;
                    for (int r = 0; r < mb; r++)
                        part[r][c0] = _mm512_dpbf16_ps(
                            part[r][c0], w[j], (__m512bh)_mm512_set1_epi32((int)xb[r * 16 + nw * v + j]));
                }
            }
        }
        sum_chains512(part, mb, chains);
        if (per_row) {
            for (int r = 0; r < mb; r++)
                if (in_regs)
                    acc[r] = _mm512_add_ps(acc[r], part[r][0]);
                else
                    _mm512_storeu_ps(out + r * ldo, _mm512_add_ps(_mm512_loadu_ps(out + r * ldo), part[r][0]));
        } else {
            const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + g * TR)));
            const __m512 mv = wbits == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mt + g * TR)))
                                         : _mm512_setzero_ps();
            for (int r = 0; r < mb; r++) {
                __m512 a = _mm512_fmadd_ps(sv, part[r][0], in_regs ? acc[r] : _mm512_loadu_ps(out + r * ldo));
                if (wbits == 4) a = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[(m0 + r) * ng + g]), a);
                if (in_regs)
                    acc[r] = a;
                else
                    _mm512_storeu_ps(out + r * ldo, a);
            }
        }
    }
    if (per_row) {
        const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)st));
        const __m512 mv =
            wbits == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)mt)) : _mm512_setzero_ps();
        for (int r = 0; r < mb; r++) {
            __m512 a = _mm512_mul_ps(in_regs ? acc[r] : _mm512_loadu_ps(out + r * ldo), sv);
            if (wbits == 4) a = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[(m0 + r) * ng]), a);
            if (in_regs)
                acc[r] = a;
            else
                _mm512_storeu_ps(out + r * ldo, a);
        }
    }
    if (in_regs)
        for (int r = 0; r < mb; r++) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

/* tile_dots_bf with mb and wbits constants in each instantiation */
static inline __attribute__((always_inline)) void tile_rows_bf(const uint32_t *xa, const float *xs, long K, long ng,
                                                               long m0, long rb, int mb, const uint8_t *wt, int wbits,
                                                               int gshift, const uint16_t *st, const uint16_t *mt,
                                                               float *o, long ldo, const long pf) {
#define BF_ROWS(W)                                                                                             \
    switch (mb) {                                                                                              \
    case 1: tile_dots_bf(xa, xs, K, ng, m0, rb, 1, wt, W, gshift, st, mt, o, ldo, pf); break;                  \
    case 2: tile_dots_bf(xa, xs, K, ng, m0, rb, 2, wt, W, gshift, st, mt, o, ldo, pf); break;                  \
    case 3: tile_dots_bf(xa, xs, K, ng, m0, rb, 3, wt, W, gshift, st, mt, o, ldo, pf); break;                  \
    case 4: tile_dots_bf(xa, xs, K, ng, m0, rb, 4, wt, W, gshift, st, mt, o, ldo, pf); break;                  \
    case 5: tile_dots_bf(xa, xs, K, ng, m0, rb, 5, wt, W, gshift, st, mt, o, ldo, pf); break;                  \
    case 6: tile_dots_bf(xa, xs, K, ng, m0, rb, 6, wt, W, gshift, st, mt, o, ldo, pf); break;                  \
    case 7: tile_dots_bf(xa, xs, K, ng, m0, rb, 7, wt, W, gshift, st, mt, o, ldo, pf); break;                  \
    case 8: tile_dots_bf(xa, xs, K, ng, m0, rb, 8, wt, W, gshift, st, mt, o, ldo, pf); break;                  \
    default: tile_dots_bf(xa, xs, K, ng, m0, rb, BF_TM, wt, W, gshift, st, mt, o, ldo, pf); break;             \
    }
    if (wbits == 4)
        BF_ROWS(4)
    else
        BF_ROWS(8)
#undef BF_ROWS
}
#else
#define BF_TILES 0
#endif

#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
/* The activations a float or bfloat16 tiled call reads, all made in one pass over x [M, K] (x's dtype;
 * rounded to bfloat16 first where `round`), a row at a time through a scratch row of its floats that
 * stays in L1: xp the rows in storage order (blocks of f_block(M) rows: blk_at) where `want_xp`, xa
 * their bfloat16 pairs (bf_words; blocks of bf_block(M) rows: bf_at) where `want_xa`, and for int4 each
 * row's float sum per group (xs [M, ng]). Three passes over M x K floats before (widening, reordering,
 * pairing: 8% of a 1,024-token prefill on SmolLM2). */
typedef struct {
    float *xp, *xs;
    uint32_t *xa;
} f_acts;

static void f_acts_free(f_acts *a) { free(a->xp), free(a->xs), free(a->xa); }

static int f_acts_make(const void *x, int dtype, int round, long M, long K, int wbits, int group, int want_xp,
                       int want_xa, f_acts *a, int num_threads) {
    const long ng = K / group, nb = K / QB, rb = f_block(M), rows = (M + rb - 1) / rb * rb;
    int ok = 1;
    memset(a, 0, sizeof *a);
    if (want_xp) ok &= (a->xp = (float *)calloc((size_t)(rows * K) + 16, sizeof(float))) != NULL;
    if (wbits == 4) ok &= (a->xs = (float *)malloc(sizeof(float) * (size_t)(M * ng) + 4)) != NULL;
#if BF_TILES
    if (want_xa) ok &= (a->xa = bf_alloc(M, K)) != NULL;
#else
    (void)want_xa;
#endif
    if (!ok) {
        f_acts_free(a);
        return -3;
    }
    const int half = group / 2, chunks = group / QB;
    const long xbytes = dtype == DT_BF16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (M * K >= SETUP_PAR_MIN)
    {
        float *row = (float *)malloc(sizeof(float) * (size_t)K);
        if (!row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long m = 0; m < M; m++) {
            if (!row) continue;
            to_float((const char *)x + m * K * xbytes, dtype, K, row);
            if (round)
                for (long i = 0; i < K; i++) row[i] = bf16_to_f32(f32_to_bf16(row[i]));
            if (wbits == 4)
                for (long g = 0; g < ng; g++) {
                    float sum = 0.0f;
                    for (int i = 0; i < group; i++) sum += row[g * group + i];
                    a->xs[m * ng + g] = sum;
                }
            float blk[QB];
            for (long b = 0; b < nb; b++) {
                const float *o = row + b * QB;
                if (wbits == 4 && group != QB) { /* chunk c of a group: weights 16c..16c+15, then half + 16c.. */
                    const long g = b / chunks, c = b % chunks;
                    for (int i = 0; i < 16; i++) {
                        blk[i] = row[g * group + 16 * c + i];
                        blk[16 + i] = row[g * group + half + 16 * c + i];
                    }
                    o = blk;
                }
                if (a->xp) memcpy(a->xp + blk_at(nb, rb, m, b) * QB, o, sizeof(float) * QB);
#if BF_TILES
                if (a->xa) bf_words(o, wbits, bf_at(a->xa, nb, bf_block(M), m, b));
#endif
            }
        }
        free(row);
    }
    if (failed) {
        f_acts_free(a);
        return -3;
    }
    return 0;
}

/* The float and bfloat16 tiled kernels past their argument checks and f_acts_make: xp the activations
 * in float32 (rounded to bf16 already for the bfloat16 kernel), xa their pairs where the bfloat16 kernel
 * takes vdpbf16ps. */
static void tiled_float_run(const f_acts *a, int dtype, void *out, const void *bias, long M, long K, long N,
                            const uint8_t *w, int wbits, int group, int gshift, const uint16_t *scales,
                            const uint16_t *mins, int num_threads) {
    const float *xp = a->xp, *xs = a->xs;
    const uint32_t *xa = a->xa;
    const long row_bytes = wbits == 8 ? K : K / 2, ng = K / group;
    /* blocks of rows (M_BLOCK_BYTES), a multiple of 48 rows so that passes of 6, 8 or 16 rows fall as
     * they would without blocks (the same sums in the same order) */
    const long act_row_bytes = xa ? K * 2 : K * (long)sizeof(float);
    const long mblk = M_BLOCK_BYTES / act_row_bytes < 48 ? 48 : M_BLOCK_BYTES / act_row_bytes / 48 * 48;
#pragma omp parallel num_threads(num_threads)
    for (long b0 = 0; b0 < M; b0 += mblk) {
        const long mend = M - b0 < mblk ? M : b0 + mblk;
#pragma omp for schedule(static) nowait /* blocks write disjoint rows: no barrier between them */
        for (long t = 0; t < N / TR; t++) {
            const uint8_t *wt = w + t * TR * row_bytes;
            const uint16_t *st = scales + t * TR * ng, *mt = mins ? mins + t * TR * ng : NULL;
#if BF_TILES
            float res[BF_TM * TR];
#else
            float res[TM * TR];
#endif
            for (long m0 = b0; m0 < mend;) {
                int mb = mend - m0 < TM ? (int)(mend - m0) : TM;
                const long pf = m0 == b0 ? PF_BYTES : 0;
#if BF_TILES
                if (xa && mend - m0 >= BF_TM) mb = BF_TM; /* a full pass; the rest in passes of up to TM rows */
                if (xa && (wbits == 4 || mb >= BF8_MIN_ROWS))
                    tile_rows_bf(xa, xs, K, ng, m0, bf_block(M), mb, wt, wbits, gshift, st, mt, res, TR, pf);
                else
#endif
                    tile_rows_f(xp, xs, K, ng, m0, f_block(M), mb, wt, wbits, gshift, st, mt, res, TR, pf);
                store_tile(res, m0, mb, t, N, bias, dtype, out);
                m0 += mb;
            }
        }
    }
}
#endif

static int tiled_float_entry(const void *x, int dtype, void *out, const void *bias, long M, long K, long N,
                             const uint8_t *w, int wbits, int group, const uint16_t *scales, const uint16_t *mins,
                             int num_threads, int bf16) {
    if (tiled_args_bad(dtype, wbits, group, mins, M, K, N)) return -1;
#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
    const int gshift = group_shift(K, group);
    if (gshift < 0) return -1;
#if BF_TILES
    const int pairs = bf16 && (wbits == 4 || M >= BF8_MIN_ROWS);
#else
    const int pairs = 0;
#endif
    /* with pairs, int4 takes every pass from them; int8 its passes under BF8_MIN_ROWS rows from xp */
    f_acts a;
    const int rc = f_acts_make(x, dtype, bf16 && dtype != DT_BF16, M, K, wbits, group, !pairs || wbits == 8, pairs,
                               &a, num_threads);
    if (rc) return rc;
    tiled_float_run(&a, dtype, out, bias, M, K, N, w, wbits, group, gshift, scales, mins, num_threads);
    f_acts_free(&a);
    return 0;
#else
    (void)x, (void)out, (void)bias, (void)w, (void)scales, (void)num_threads, (void)bf16;
    return -2;
#endif
}

/* kvpilot_qmatmul_tiled with float activations (the exact product, see above); the same arguments,
 * layout and return codes. */
int kvpilot_qmatmul_tiled_float(const void *x, int dtype, void *out, const void *bias, long M, long K, long N,
                                const uint8_t *w, int wbits, int group, const uint16_t *scales,
                                const uint16_t *mins, int num_threads) {
    return tiled_float_entry(x, dtype, out, bias, M, K, N, w, wbits, group, scales, mins, num_threads, 0);
}

/* kvpilot_qmatmul_tiled with activations rounded to bfloat16 (see above); the same arguments, layout and
 * return codes. */
int kvpilot_qmatmul_tiled_bf16(const void *x, int dtype, void *out, const void *bias, long M, long K, long N,
                               const uint8_t *w, int wbits, int group, const uint16_t *scales,
                               const uint16_t *mins, int num_threads) {
    return tiled_float_entry(x, dtype, out, bias, M, K, N, w, wbits, group, scales, mins, num_threads, 1);
}

/*
 * int16 activations on the tiled layout (kvpilot_qmatmul_tiled_i16, `--qmatmul-activations int16`): each
 * 32-block of a row (in the weight's storage order) rounded to int16 with one float scale,
 * d = max|x| / 32767, so an element's error is at most d / 2 = max|x| / 65534 (bfloat16 rounds each
 * element to 8 significant bits: 2^-9 of itself; int8 blocks: max|x| / 254). The weights' codes are
 * exact; int4's group term takes the sum of the group's rounded activations (xs): the product is
 * x rounded . dequant(W), up to the order of the sums. Products by `vpmaddwd` (16 int16 pairs an instruction) into int32 per block, then times
 * the block's scale in float32. Against the float kernel the codes are widened once to int16 for every
 * row of a pass (and, shift, unpack: 8 instructions per 64 codes of 8 rows, against 24 to float32),
 * and each row costs the same count of multiply-adds: at one row (a single stream's decode) half the
 * instructions. Written with 256-bit AVX2 intrinsics (half a tile at a time, as the AVX2 kernels), so
 * every x86 CPU with AVX2 has it; at the avx512 level tile_dots_i16z does the same at 512 bits (a whole
 * tile a vector, `vpdpwssd` with AVX512-VNNI), on every call: 1.0-1.9x the 256-bit kernel with VNNI, 0.87-1.5x
 * without (AMD EPYC Zen 4, one thread, SmolLM2's shapes, 1-256 rows; kernels_bench.py qmatmul).
 * Block b of a row: codes 4v..4v+3 of each weight row in 32-bit lane r of vector v; int4 holds codes
 * 4v+j in the low nibbles and 16+4v+j in the high ones. unpacklo/hi_epi8 widen them to int16, rows
 * {0,1,4,5} and {2,3,6,7} of the half; a 64-bit broadcast of x[4v..4v+3] against them gives two int32
 * pair sums a row, which hadd_epi32 folds into rows 0..7 in order.
 * int4 calls of up to I16_SPLIT_MAX_M rows (single-stream decode, a speculative verification) keep the
 * codes as bytes instead: each rounded activation is split into a signed high byte and an unsigned low
 * one (x = 256 xh + xl, split_block_i16), and `vpmaddubsw` multiplies the codes by each (block_dots_split,
 * which says why no sum overflows). The same int32 a block and the same float sums in the same order, so
 * the same results to the bit; at one row 1.2-1.35x the widening kernel on Zen 3 (there the widening's
 * unpacks and hadd, not the multiplies, were the bound). More rows share the widened codes better.
 */
/* one block of 32 activations rounded to int16 (to nearest even) with one scale, *d = max|x| / 32767;
 * returns the sum of the codes */
static inline int32_t round_block_i16(const float *x, int16_t *q, float *d) {
#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
    /* vcvtps2dq rounds as lrintf (to nearest even, the default MXCSR mode); lrintf itself is a libm call */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(x + 8 * j), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
    const float amax = hsum8_max(m), inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    __m256i sum = _mm256_setzero_si256(), qi[4];
    for (int j = 0; j < 4; j++) {
        qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));
        sum = _mm256_add_epi32(sum, qi[j]);
    }
    /* packs works within 128-bit lanes: [q0 lo, q1 lo, q0 hi, q1 hi] -> permute the 64-bit quarters */
    _mm256_storeu_si256((__m256i *)q, _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[0], qi[1]), 0xD8));
    _mm256_storeu_si256((__m256i *)(q + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[2], qi[3]), 0xD8));
    *d = amax / 32767.0f;
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    return _mm_cvtsi128_si32(s4);
#else
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < 32; i++) sum += q[i] = (int16_t)lrintf(x[i] * inv);
    *d = amax / 32767.0f;
    return sum;
#endif
}

/* x [M, K] (x's dtype) with each 32-block of a weight's storage order (int8, or int4 groups of `group`:
 * chunk c of a group = its weights 16c.. and group/2 + 16c..) rounded to int16 as the tiled int16 kernel
 * rounds it, into out (x's dtype): the activations every other route multiplies under
 * `--qmatmul-activations int16` (qlinear.round_i16; reference_round_i16 is its torch form). -1 on bad
 * arguments (K or the group not a multiple of 32), -3 out of memory. */
int kvpilot_round_i16(const void *x, int dtype, void *out, long M, long K, int wbits, int group, int num_threads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || M < 0 || K <= 0 || K % 32 || (wbits != 8 && wbits != 4) ||
        group <= 0 || group % 32 || K % group)
        return -1;
    const long xbytes = dtype == DT_BF16 ? 2 : 4, nb = K / 32, chunks = group / 32, half = group / 2;
    const int interleaved = wbits == 4 && group != 32;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (M * K >= (1L << 16))
    {
        float *row = (float *)malloc(sizeof(float) * (size_t)K);
        if (!row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long m = 0; m < M; m++) {
            if (!row) continue;
            to_float((const char *)x + m * K * xbytes, dtype, K, row);
            for (long b = 0; b < nb; b++) {
                /* the block's two halves of 16: in place, or a group's chunk (16c.., half + 16c..) */
                const long g = b / chunks, c = b % chunks;
                const long lo = interleaved ? g * group + 16 * c : b * 32, hi = interleaved ? lo + half : lo + 16;
                float blk[32], d;
                int16_t q[32];
                memcpy(blk, row + lo, sizeof(float) * 16);
                memcpy(blk + 16, row + hi, sizeof(float) * 16);
                round_block_i16(blk, q, &d);
                for (int i = 0; i < 32; i++) blk[i] = (float)q[i] * d;
                if (dtype == DT_BF16) {
                    uint16_t *o = (uint16_t *)out + m * K;
                    for (int i = 0; i < 16; i++) o[lo + i] = f32_to_bf16(blk[i]), o[hi + i] = f32_to_bf16(blk[16 + i]);
                } else {
                    float *o = (float *)out + m * K;
                    memcpy(o + lo, blk, sizeof(float) * 16);
                    memcpy(o + hi, blk + 16, sizeof(float) * 16);
                }
            }
        }
        free(row);
    }
    return failed ? -3 : 0;
}

#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
#if !defined(KVPILOT_ISA_AVX512)
/* (avx2) int4 calls of up to this many rows (single-stream decode, a speculative verification) take
 * tile_dots_split (one pass of M rows). It holds 4 int16 accumulators a row (2 halves x high, low bytes),
 * so spills grow with the rows: on Zen 3 a pass of 2-5 rows ran 1.06-1.45x the widening kernel's, one of
 * 6 (TM: every pass of a larger call) 0.92x */
#define I16_SPLIT_MAX_M 5
#endif
typedef struct {
    int16_t *xq; /* rows in f_acts' storage order and row blocks (blk_at), QB a chunk: its int16 codes; at
                    avx512 as the pairs tile_dots_i16z multiplies (i16_words), at avx2 where `split` the
                    same 64 bytes as two byte planes (split_block_i16) */
    float *dx;   /* a chunk's scale, at the chunk's index */
    int split;   /* (avx2) byte planes: int4 weights, M <= I16_SPLIT_MAX_M (tile_dots_split) */
} i16_acts;

static void i16_acts_free(i16_acts *a) { free(a->xq), free(a->dx); }

#if !defined(KVPILOT_ISA_AVX512)
/* a block's 32 int16 codes q as two byte planes in o[0..64): o[i] = q[i] >> 8 (arithmetic: -128..127,
 * a signed byte) and o[32 + i] = q[i] & 255 (0..255, an unsigned byte), so q[i] = 256 o[i] + o[32 + i]
 * exactly; the packs saturate nothing (every value is in its byte's range) */
static inline void split_block_i16(const int16_t *q, uint8_t *o) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)q), b = _mm256_loadu_si256((const __m256i *)(q + 16));
    const __m256i low = _mm256_set1_epi16(255);
    const __m256i hi = _mm256_packs_epi16(_mm256_srai_epi16(a, 8), _mm256_srai_epi16(b, 8));
    const __m256i lo = _mm256_packus_epi16(_mm256_and_si256(a, low), _mm256_and_si256(b, low));
    /* packs works within 128-bit lanes: [a lo, b lo, a hi, b hi] -> permute the 64-bit quarters */
    _mm256_storeu_si256((__m256i *)o, _mm256_permute4x64_epi64(hi, 0xD8));
    _mm256_storeu_si256((__m256i *)(o + 32), _mm256_permute4x64_epi64(lo, 0xD8));
}
#else

/* a block's 32 int16 codes q (storage order) as the pairs tile_dots_i16z multiplies, 16 32-bit words into o
 * (low half first): word i pairs (q[c], q[c + 2]) with c, for int8, 4 (i / 2) + i % 2 (vector v = i / 2 of
 * a tile holds each row's codes 4v..4v+3: j = i % 2 of its two widened words pairs codes 4v + j and 4v + j + 2)
 * and, for int4, 16 (i % 4 / 2) + 4 (i / 4) + i % 2 (vector v = i / 4: codes 4v..4v+3 in the low nibbles,
 * 16 + 4v.. in the high ones; j = i % 4 indexes its four words as tile_dots_i16z makes them) */
static inline void i16_words(const int16_t *q, int wbits, int16_t *o) {
    for (int i = 0; i < 16; i++) {
        const int c = wbits == 8 ? 4 * (i / 2) + i % 2 : 16 * (i % 4 / 2) + 4 * (i / 4) + i % 2;
        o[2 * i] = q[c], o[2 * i + 1] = q[c + 2];
    }
}
#endif

/* xp's chunks (f_acts_make: f_block(M) rows a block) rounded to int16 per chunk (the padding rows stay
 * zero), at avx512 as i16_words' pairs, at avx2 as byte planes where `split`; for int4 (`xs`) each row's
 * group sums are made again from the rounded values, so that the min term multiplies the same activations
 * as the codes (x rounded . dequant(W), as qlinear.round_i16) */
static int i16_acts_make(const float *xp, float *xs, long M, long K, int wbits, int group, int split,
                         i16_acts *a) {
    const long rb = f_block(M), nb = K / QB, ng = K / group, chunks = (M + rb - 1) / rb * rb * nb;
    a->xq = (int16_t *)calloc((size_t)(chunks * QB) + 32, sizeof(int16_t));
    a->dx = (float *)calloc((size_t)chunks + 16, sizeof(float));
    a->split = split;
#if !defined(KVPILOT_ISA_AVX512)
    (void)wbits; /* only the 512-bit kernel's pairs depend on it */
#endif
    if (!a->xq || !a->dx) {
        i16_acts_free(a);
        return -3;
    }
    if (xs) memset(xs, 0, sizeof(float) * (size_t)(M * ng));
    for (long m = 0; m < M; m++)
        for (long b = 0; b < nb; b++) {
            const long c = blk_at(nb, rb, m, b);
            int16_t q[QB];
#if defined(KVPILOT_ISA_AVX512)
            const int32_t sum = round_block_i16(xp + c * QB, q, &a->dx[c]);
            i16_words(q, wbits, a->xq + c * QB);
#else
            const int32_t sum = round_block_i16(xp + c * QB, split ? q : a->xq + c * QB, &a->dx[c]);
            if (split) split_block_i16(q, (uint8_t *)(a->xq + c * QB));
#endif
            if (xs) xs[m * ng + b * QB / group] += (float)sum * a->dx[c];
        }
    return 0;
}

#if !defined(KVPILOT_ISA_AVX512)
static inline __m256i bcast64(const int16_t *p) {
    int64_t v;
    memcpy(&v, p, 8);
    return _mm256_set1_epi64x(v);
}

/* out[r][0..TR) = activation row m0 + r . the tile's TR weight rows, for r < mb (int16 activations) */
static inline __attribute__((always_inline)) void tile_dots_i16(const i16_acts *a, const float *xs, long K, long ng,
                                                                long m0, long rb, const int mb, const uint8_t *wt,
                                                                int wbits, int gshift, const uint16_t *st,
                                                                const uint16_t *mt, float *out, long ldo, long pf) {
    const long nb = K / QB;
    const int per_row = gshift >= 62, bb = wbits == 8 ? QB : QB / 2;
    const long bpg = per_row ? nb : (1L << gshift);
    const int16_t *x0 = a->xq + blk_at(nb, rb, m0, 0) * QB; /* block b of the pass's rows: x0 + b rb QB */
    const float *d0 = a->dx + blk_at(nb, rb, m0, 0);         /* and its scales: d0 + b rb */
    const __m256i nib = _mm256_set1_epi8(15), zero = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        __m256 acc[TM], part[TM];
        for (int r = 0; r < mb; r++) acc[r] = _mm256_setzero_ps();
        for (long g0 = 0, g = 0; g0 < nb; g0 += bpg, g++) {
            for (int r = 0; r < mb; r++) part[r] = _mm256_setzero_ps();
            for (long b = g0; b < g0 + bpg; b++) {
                const uint8_t *p = wt + b * TR * bb + 32 * h;
                if (pf && h == 0) prefetch_ahead(p, pf, TR * bb, st, mt, b, gshift, !per_row && b == g0, mb);
                const int16_t *xb = x0 + b * rb * QB; /* row m0 + r: + QB r */
                __m256i ia[TM], ib[TM];
                for (int r = 0; r < mb; r++) ia[r] = ib[r] = _mm256_setzero_si256();
                if (wbits == 4) {
                    for (int v = 0; v < 4; v++) {
                        const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + v * 64));
                        const __m256i lo = _mm256_and_si256(raw, nib);
                        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
                        const __m256i loa = _mm256_unpacklo_epi8(lo, zero), lob = _mm256_unpackhi_epi8(lo, zero);
                        const __m256i hia = _mm256_unpacklo_epi8(hi, zero), hib = _mm256_unpackhi_epi8(hi, zero);
                        for (int r = 0; r < mb; r++) {
                            const __m256i xl = bcast64(xb + r * QB + 4 * v), xh = bcast64(xb + r * QB + 16 + 4 * v);
                            ia[r] = _mm256_add_epi32(
                                ia[r], _mm256_add_epi32(_mm256_madd_epi16(loa, xl), _mm256_madd_epi16(hia, xh)));
                            ib[r] = _mm256_add_epi32(
                                ib[r], _mm256_add_epi32(_mm256_madd_epi16(lob, xl), _mm256_madd_epi16(hib, xh)));
                        }
                    }
                } else {
                    for (int v = 0; v < 8; v++) {
                        const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + v * 64));
                        const __m256i wa = _mm256_srai_epi16(_mm256_unpacklo_epi8(raw, raw), 8);
                        const __m256i wb = _mm256_srai_epi16(_mm256_unpackhi_epi8(raw, raw), 8);
                        for (int r = 0; r < mb; r++) {
                            const __m256i xv = bcast64(xb + r * QB + 4 * v);
                            ia[r] = _mm256_add_epi32(ia[r], _mm256_madd_epi16(wa, xv));
                            ib[r] = _mm256_add_epi32(ib[r], _mm256_madd_epi16(wb, xv));
                        }
                    }
                }
                const float *db = d0 + b * rb; /* row m0 + r: + r */
                for (int r = 0; r < mb; r++)
                    part[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(ia[r], ib[r])),
                                              _mm256_set1_ps(db[r]), part[r]);
            }
            group_end8(acc, part, mb, per_row, wbits, st, mt, g, h, xs, m0, ng);
        }
        tile_end8(acc, mb, per_row, wbits, st, mt, h, xs, m0, ng, out, ldo);
    }
}

static inline __m256i bcast32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* One 32-block of a whole int4 tile (p: its first code vector; half h = bytes 32h.. of each 64) against
 * split activations (split_block_i16; row r's block at xb + 64 r: xh[0..32) then xl[0..32), x = 256 xh +
 * xl): dots[h][r] lane j = the block's int32 dot product of activation row r and weight row 8h + j. The
 * codes stay bytes (0..15 reads the same as a signed or an unsigned byte), and maddubs multiplies them by
 * the activations' bytes, 2 products summed a 16-bit lane:
 *   H += maddubs(codes, xh): |a pair| <= 2 * 15 * 128 = 3840; 8 of them a lane (4 vectors, low and high
 *        nibbles): |H| <= 30720, an int16;
 *   L += maddubs(xl, codes): a pair in 0..2 * 255 * 15 = 7650; 8 of them <= 61200, past int16 but under
 *        2^16: add_epi16 wraps, so L read as an unsigned 16-bit number is exact.
 * Lane j of vector v holds row 8h + j's codes 4v..4v+3 (low nibbles) and 16+4v..16+4v+3 (high), and a
 * 32-bit broadcast of xh[4v..4v+3] (xh[16+4v..], xl[4v..], xl[16+4v..]) lines up with them, so row
 * j's sum stays in lane j: 256 (H's two halves, signed: madd by 256) + L's two halves (unsigned: mask and
 * shift), |sum| <= 15 * 32767 * 32 < 2^24. The same int32 as tile_dots_i16's, with no unpack and no hadd,
 * and each broadcast serves both halves (16 weight rows). */
static inline __attribute__((always_inline)) void block_dots_split(const uint8_t *p, const uint8_t *xb, const int mb,
                                                                   __m256i dots[2][TM]) {
    const __m256i nib = _mm256_set1_epi8(15);
    __m256i hs[2][TM], ls[2][TM];
    for (int r = 0; r < mb; r++) hs[0][r] = hs[1][r] = ls[0][r] = ls[1][r] = _mm256_setzero_si256();
    for (int v = 0; v < 4; v++) {
        __m256i lo[2], hi[2];
        for (int h = 0; h < 2; h++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + v * 64 + 32 * h));
            lo[h] = _mm256_and_si256(raw, nib), hi[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
        }
        for (int r = 0; r < mb; r++) {
            const uint8_t *xr = xb + 2 * QB * r + 4 * v;
            const __m256i xhl = bcast32(xr), xhh = bcast32(xr + 16), xll = bcast32(xr + 32), xlh = bcast32(xr + 48);
            for (int h = 0; h < 2; h++) {
                hs[h][r] = _mm256_add_epi16(
                    hs[h][r], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xhl), _mm256_maddubs_epi16(hi[h], xhh)));
                ls[h][r] = _mm256_add_epi16(
                    ls[h][r], _mm256_add_epi16(_mm256_maddubs_epi16(xll, lo[h]), _mm256_maddubs_epi16(xlh, hi[h])));
            }
        }
    }
    const __m256i k256 = _mm256_set1_epi16(256), low16 = _mm256_set1_epi32(0xFFFF);
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < mb; r++) {
            const __m256i l32 = _mm256_add_epi32(_mm256_and_si256(ls[h][r], low16), _mm256_srli_epi32(ls[h][r], 16));
            dots[h][r] = _mm256_add_epi32(_mm256_madd_epi16(hs[h][r], k256), l32);
        }
}

/* tile_dots_i16 for int4 weights and split activations (kvpilot_qmatmul_tiled_i16 up to I16_SPLIT_MAX_M
 * rows): both halves of the tile block by block (block_dots_split), each row's float sums in the same
 * order as tile_dots_i16's (block by block, group by group, per half), so the same results to the bit */
static inline __attribute__((always_inline)) void tile_dots_split(const i16_acts *a, const float *xs, long K, long ng,
                                                                  long m0, long rb, const int mb, const uint8_t *wt,
                                                                  int gshift, const uint16_t *st, const uint16_t *mt,
                                                                  float *out, long ldo, long pf) {
    const long nb = K / QB, bb = QB / 2;
    const int per_row = gshift >= 62;
    const long bpg = per_row ? nb : (1L << gshift);
    const uint8_t *x0 = (const uint8_t *)(a->xq + blk_at(nb, rb, m0, 0) * QB); /* block b: x0 + 2 QB b rb */
    const float *d0 = a->dx + blk_at(nb, rb, m0, 0);                          /* and its scales: d0 + b rb */
    __m256 acc[2][TM], part[2][TM];
    for (int r = 0; r < mb; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    for (long g0 = 0, g = 0; g0 < nb; g0 += bpg, g++) {
        for (int r = 0; r < mb; r++) part[0][r] = part[1][r] = _mm256_setzero_ps();
        for (long b = g0; b < g0 + bpg; b++) {
            const uint8_t *p = wt + b * TR * bb;
            if (pf) prefetch_ahead(p, pf, TR * bb, st, mt, b, gshift, !per_row && b == g0, mb);
            __m256i dots[2][TM];
            block_dots_split(p, x0 + b * rb * 2 * QB, mb, dots);
            const float *db = d0 + b * rb; /* row m0 + r: + r */
            for (int h = 0; h < 2; h++)
                for (int r = 0; r < mb; r++)
                    part[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[h][r]), _mm256_set1_ps(db[r]), part[h][r]);
        }
        for (int h = 0; h < 2; h++) group_end8(acc[h], part[h], mb, per_row, 4, st, mt, g, h, xs, m0, ng);
    }
    for (int h = 0; h < 2; h++) tile_end8(acc[h], mb, per_row, 4, st, mt, h, xs, m0, ng, out, ldo);
}

#else
/* The int16 kernel at 512 bits: a whole tile (16 weight rows) a vector, as tile_dots_bf, with the codes
 * widened to int16 pairs in each row's 32-bit lane by shifts and masks (int4: (raw >> 0, 8, 4, 12) & 0xF
 * in each 16-bit word gives codes (4v, 4v + 2), (4v + 1, 4v + 3), (16 + 4v, 16 + 4v + 2), (16 + 4v + 1,
 * 16 + 4v + 3); int8: each word's low and high byte, sign-extended, gives (4v, 4v + 2) and (4v + 1,
 * 4v + 3)) against a broadcast of the activations' matching pair (i16_words), summed by `vpdpwssd`
 * (AVX512-VNNI; `vpmaddwd` + add without it) into an int32 a row and block, exact (|sum| <= 127 *
 * 32767 * 32 < 2^31), then scaled by the block's activation scale into the group's float sums, the
 * weight's scale (and min) at the group's end: the arithmetic of tile_dots_i16, the float sums in the
 * same order. */
#define I16Z_CHAINS 4
#if defined(__AVX512VNNI__)
#define I16Z_DOT(acc, w, x) _mm512_dpwssd_epi32(acc, w, x)
#else
#define I16Z_DOT(acc, w, x) _mm512_add_epi32(acc, _mm512_madd_epi16(w, x))
#endif
static inline __attribute__((always_inline)) void tile_dots_i16z(const i16_acts *a, const float *xs, long K, long ng,
                                                                 long m0, long rb, const int mb, const uint8_t *wt,
                                                                 const int wbits, int gshift, const uint16_t *st,
                                                                 const uint16_t *mt, float *out, long ldo, long pf) {
    const long nb = K / QB;
    const int per_row = gshift >= 62, bb = wbits == 8 ? QB : QB / 2, nw = wbits == 8 ? 2 : 4;
    const long bpg = per_row ? nb : (1L << gshift);
    const uint32_t *x0 = (const uint32_t *)(a->xq + blk_at(nb, rb, m0, 0) * QB); /* block b, row r: + 16 (b rb + r) */
    const float *d0 = a->dx + blk_at(nb, rb, m0, 0);                            /* and its scales: + b rb + r */
    const __m512i nib = _mm512_set1_epi32(0x000F000F);
    /* independent int32 sums a row for passes of few rows: one chain of 16 dependent `vpdpwssd` a block
     * cost a single stream's matmul 4-12% with VNNI (Zen 4, one thread; integer sums: any order, the same) */
    const int chains = mb <= 2 ? I16Z_CHAINS : mb <= 4 ? 2 : 1;
    __m512 acc[TM], part[TM];
    for (int r = 0; r < mb; r++) acc[r] = _mm512_setzero_ps();
    for (long g0 = 0, g = 0; g0 < nb; g0 += bpg, g++) {
        for (int r = 0; r < mb; r++) part[r] = _mm512_setzero_ps();
        for (long b = g0; b < g0 + bpg; b++) {
            const uint8_t *p = wt + b * TR * bb;
            if (pf) prefetch_ahead(p, pf, TR * bb, st, mt, b, gshift, !per_row && b == g0, mb);
            const uint32_t *xb = x0 + b * rb * 16;
            __m512i dots[TM][I16Z_CHAINS];
            for (int r = 0; r < mb; r++)
                for (int c = 0; c < chains; c++) dots[r][c] = _mm512_setzero_si512();
            for (int v = 0; v < bb / 4; v++) { /* 64-byte vectors: 16 rows x 8 int4 or 4 int8 codes */
                const __m512i raw = _mm512_loadu_si512((const void *)(p + v * 64));
                __m512i w[4];
                if (wbits == 4) {
                    w[0] = _mm512_and_si512(raw, nib);
                    w[1] = _mm512_and_si512(_mm512_srli_epi32(raw, 8), nib);
                    w[2] = _mm512_and_si512(_mm512_srli_epi32(raw, 4), nib);
                    w[3] = _mm512_and_si512(_mm512_srli_epi32(raw, 12), nib);
                } else {
                    w[0] = _mm512_srai_epi16(_mm512_slli_epi16(raw, 8), 8);
                    w[1] = _mm512_srai_epi16(raw, 8);
                }
                for (int j = 0; j < nw; j++) {
                    const int c = (nw * v + j) % chains;
                    for (int r = 0; r < mb; r++)
                        dots[r][c] = I16Z_DOT(dots[r][c], w[j], _mm512_set1_epi32((int)xb[r * 16 + nw * v + j]));
                }
            }
            const float *db = d0 + b * rb;
            for (int r = 0; r < mb; r++) {
                for (int c = 1; c < chains; c++) dots[r][0] = _mm512_add_epi32(dots[r][0], dots[r][c]);
                part[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r][0]), _mm512_set1_ps(db[r]), part[r]);
            }
        }
        group_end16(acc, part, mb, per_row, wbits, st, mt, g, xs, m0, ng);
    }
    tile_end16(acc, mb, per_row, wbits, st, mt, xs, m0, ng, out, ldo);
}
#undef I16Z_DOT
#undef I16Z_CHAINS
#endif

static inline __attribute__((always_inline)) void tile_rows_i16(const i16_acts *a, const float *xs, long K, long ng,
                                                                long m0, long rb, int mb, const uint8_t *wt,
                                                                int wbits, int gshift, const uint16_t *st,
                                                                const uint16_t *mt, float *o, long ldo, const long pf) {
#if defined(KVPILOT_ISA_AVX512)
#define ROWS_I16Z(n)                                                                                           \
    if (wbits == 4)                                                                                            \
        tile_dots_i16z(a, xs, K, ng, m0, rb, n, wt, 4, gshift, st, mt, o, ldo, pf);                            \
    else                                                                                                       \
        tile_dots_i16z(a, xs, K, ng, m0, rb, n, wt, 8, gshift, st, mt, o, ldo, pf)
    TILE_ROWS(mb, ROWS_I16Z)
#undef ROWS_I16Z
#else
#define ROWS_I16(n) tile_dots_i16(a, xs, K, ng, m0, rb, n, wt, wbits, gshift, st, mt, o, ldo, pf)
#define ROWS_SPLIT(n) tile_dots_split(a, xs, K, ng, m0, rb, n, wt, gshift, st, mt, o, ldo, pf)
    if (a->split) { /* a call of M <= I16_SPLIT_MAX_M rows: one pass of M */
        switch (mb) {
        case 1: ROWS_SPLIT(1); break;
        case 2: ROWS_SPLIT(2); break;
        case 3: ROWS_SPLIT(3); break;
        case 4: ROWS_SPLIT(4); break;
        default: ROWS_SPLIT(I16_SPLIT_MAX_M); break;
        }
    } else {
        TILE_ROWS(mb, ROWS_I16)
    }
#undef ROWS_SPLIT
#undef ROWS_I16
#endif
}
#endif

/* kvpilot_qmatmul_tiled with int16 activations (see above); the same arguments, layout and return codes. */
int kvpilot_qmatmul_tiled_i16(const void *x, int dtype, void *out, const void *bias, long M, long K, long N,
                              const uint8_t *w, int wbits, int group, const uint16_t *scales, const uint16_t *mins,
                              int num_threads) {
    if (tiled_args_bad(dtype, wbits, group, mins, M, K, N)) return -1;
#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
    const int gshift = group_shift(K, group);
    if (gshift < 0) return -1;
    f_acts fa;
    int rc = f_acts_make(x, dtype, 0, M, K, wbits, group, 1, 0, &fa, num_threads);
    if (rc) return rc;
    i16_acts a;
#if defined(KVPILOT_ISA_AVX512)
    const int split = 0; /* tile_dots_i16z on every call */
#else
    const int split = wbits == 4 && M <= I16_SPLIT_MAX_M;
#endif
    rc = i16_acts_make(fa.xp, wbits == 4 ? fa.xs : NULL, M, K, wbits, group, split, &a);
    if (rc) {
        f_acts_free(&fa);
        return rc;
    }
    const float *xs = fa.xs;
    const long row_bytes = wbits == 8 ? K : K / 2, ng = K / group, rb = f_block(M);
    const long mblk = M_BLOCK_BYTES / (K * 2) < 48 ? 48 : M_BLOCK_BYTES / (K * 2) / 48 * 48;
#pragma omp parallel num_threads(num_threads)
    for (long b0 = 0; b0 < M; b0 += mblk) {
        const long mend = M - b0 < mblk ? M : b0 + mblk;
#pragma omp for schedule(static) nowait /* blocks write disjoint rows: no barrier between them */
        for (long t = 0; t < N / TR; t++) {
            const uint8_t *wt = w + t * TR * row_bytes;
            const uint16_t *st = scales + t * TR * ng, *mt = mins ? mins + t * TR * ng : NULL;
            float res[TM * TR];
            for (long m0 = b0; m0 < mend;) {
                const int mb = mend - m0 < TM ? (int)(mend - m0) : TM;
                tile_rows_i16(&a, xs, K, ng, m0, rb, mb, wt, wbits, gshift, st, mt, res, TR, m0 == b0 ? PF_BYTES : 0);
                store_tile(res, m0, mb, t, N, bias, dtype, out);
                m0 += mb;
            }
        }
    }
    i16_acts_free(&a);
    f_acts_free(&fa);
    return 0;
#else
    (void)x, (void)out, (void)bias, (void)w, (void)scales, (void)num_threads;
    return -2;
#endif
}

/* The whole weight dequantized to float32 or bfloat16 (`dtype`) into out [N, K]: for the matmuls the
 * kernel above does not take (many rows: prefill), where torch multiplies the result. */
int kvpilot_dequantize(const uint8_t *w, int wbits, int group, const uint16_t *scales, const uint16_t *mins,
                       long N, long K, void *out, int dtype, int num_threads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || (wbits != 8 && wbits != 4) || group <= 0 || K % group ||
        (wbits == 4 && (group % 2 || !mins)))
        return -1;
    const long row_bytes = wbits == 8 ? K : K / 2, ng = K / group;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *wf = dtype == DT_BF16 ? (float *)malloc(sizeof(float) * (size_t)K) : NULL;
        if (dtype == DT_BF16 && !wf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long n = 0; n < N; n++) {
            if (dtype == DT_BF16 && !wf) continue;
            float *row = dtype == DT_F32 ? (float *)out + n * K : wf;
            dequant_row(w + n * row_bytes, wbits, K, group, scales + n * ng, mins ? mins + n * ng : NULL, row);
            if (dtype == DT_BF16)
                for (long k = 0; k < K; k++) ((uint16_t *)out)[n * K + k] = f32_to_bf16(row[k]);
        }
        free(wf);
    }
    return failed ? -3 : 0;
}

#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
/* One pass of kvpilot_qmoe over tiled expert weights: out[r, t * TR ..] for the rows r of each
 * expert e (first[e] .. first[e + 1]) times expert e's N output rows, one (expert, tile) an item.
 * An expert's tiles are consecutive in memory, so its first group of rows on a tile prefetches the
 * codes PF_BYTES ahead (and the scales and mins 16 blocks ahead): at decode (a few rows an expert)
 * the call is bound by reading the weights, and more misses in flight are what reads them faster. */
static void expert_tiles(const q8_acts *a, const long *first, long E, long N, const uint8_t *const *w,
                         const uint16_t *const *sc, const uint16_t *const *mn, long row_bytes, long ng, int wbits,
                         int gshift, float *out, long ldo, int num_threads) {
    const long tiles = N / TR;
#pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads)
    for (long item = 0; item < E * tiles; item++) {
        const long e = item / tiles, t = item % tiles;
        const uint8_t *wt = w[e] + t * TR * row_bytes;
        const uint16_t *st = sc[e] + t * TR * ng, *mt = mn && mn[e] ? mn[e] + t * TR * ng : NULL;
        for (long m0 = first[e]; m0 < first[e + 1]; m0 += TM) {
            const int mb = first[e + 1] - m0 < TM ? (int)(first[e + 1] - m0) : TM;
            float *o = out + m0 * ldo + t * TR;
            if (m0 == first[e]) /* two copies: the later row groups (prefill) run without prefetches */
                tile_rows(a, m0, mb, wt, wbits, gshift, st, mt, o, ldo, PF_BYTES);
            else
                tile_rows(a, m0, mb, wt, wbits, gshift, st, mt, o, ldo, 0);
        }
    }
}
#endif

/*
 * A Mixture-of-Experts layer's experts in one call, quantized weights, int8 activations (the path
 * above): out[t] = sum over t's top-k slots j held here of wts[t, j] * expert_e(x[t]), with
 * expert_e(x) = w2_e . (silu(g) * u), [g; u] = w13_e . x. x: [T, H] (dtype); ids, wts: [T, topk]
 * (global expert ids, float32 routing weights); experts offset .. offset + E - 1 are held here, the
 * rest contribute zero; w13_e: [2I, H] and w2_e: [H, I] given per expert as (codes, scales, mins)
 * pointer arrays, in the row layout or (`tiled`, 2I and H multiples of TR) the tiled one. Each token's activations are quantized once for all its experts, each active
 * expert's weight rows are read once for all its tokens, and both passes run in one parallel loop
 * over (expert, weight row), so there is no per-expert call. Intermediates stay float32.
 * Returns -1 on bad arguments, -2 when the int8-activation path does not apply (the caller falls
 * back to one matmul pair per expert), -3 when out of memory.
 */
int kvpilot_qmoe(const void *x, int dtype, void *out, long T, long H, long I, int topk, const int64_t *ids,
                 const float *wts, long E, long offset, const uint8_t *const *w13, const uint16_t *const *s13,
                 const uint16_t *const *m13, const uint8_t *const *w2, const uint16_t *const *s2,
                 const uint16_t *const *m2, int wbits, int group, int tiled, int num_threads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || (wbits != 8 && wbits != 4) || T <= 0 || topk <= 0 || E <= 0)
        return -1;
#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
    const int g13 = wbits == 8 ? (int)H : group, g2 = wbits == 8 ? (int)I : group;
    const int sh13 = group_shift(H, g13), sh2 = group_shift(I, g2);
    if (sh13 < 0 || sh2 < 0) return -2;
    if (tiled && ((2 * I) % TR || H % TR)) return -1;
    const long rb13 = wbits == 8 ? H : H / 2, rb2 = wbits == 8 ? I : I / 2;
    /* assignments (t, j) held here, grouped by expert in token order: a counting sort */
    long *count = (long *)calloc((size_t)E + 1, sizeof(long));
    float *xf = (float *)malloc(sizeof(float) * (size_t)(T * H));
    if (!count || !xf) {
        free(count), free(xf);
        return -3;
    }
    for (long a = 0; a < T * topk; a++) {
        const long e = ids[a] - offset;
        if (e >= 0 && e < E) count[e + 1]++;
    }
    for (long e = 0; e < E; e++) count[e + 1] += count[e]; /* count[e]: first row of expert e */
    const long A = count[E];
    /* each token's activations quantized once (then its rows copied to its experts' places), or,
     * where fewer rows are held here than there are tokens (experts split across ranks), the
     * gathered rows: the same codes and scales either way, a row's quantization being its own */
    const int per_token = A >= T;
    long *fill = (long *)malloc(sizeof(long) * (size_t)(E + 1)), *row_of = (long *)malloc(sizeof(long) * (size_t)(T * topk));
    long *token_of = (long *)malloc(sizeof(long) * (size_t)(A ? A : 1));
    float *gathered = per_token ? NULL : (float *)malloc(sizeof(float) * (size_t)((A ? A : 1) * H));
    float *gu = (float *)malloc(sizeof(float) * (size_t)((A ? A : 1) * 2 * I));
    float *act = (float *)malloc(sizeof(float) * (size_t)((A ? A : 1) * I));
    float *partial = (float *)malloc(sizeof(float) * (size_t)((A ? A : 1) * H));
    int rc = -3;
    q8_acts a13 = {0}, a2 = {0}, tok = {0};
    if (!fill || !row_of || !token_of || (!per_token && !gathered) || !gu || !act || !partial) goto done;
    memcpy(fill, count, sizeof(long) * (size_t)(E + 1));
    to_float(x, dtype, T * H, xf);
    for (long a = 0; a < T * topk; a++) {
        const long e = ids[a] - offset;
        row_of[a] = -1;
        if (e < 0 || e >= E) continue;
        row_of[a] = fill[e]++;
        token_of[row_of[a]] = a / topk;
        if (!per_token) memcpy(gathered + row_of[a] * H, xf + (a / topk) * H, sizeof(float) * (size_t)H);
    }
    rc = 0;
    if (A > 0) {
        if (per_token ? q8_quantize(&tok, xf, T, H, wbits, g13, num_threads) || q8_alloc(&a13, A, H, wbits, g13)
                      : q8_quantize(&a13, gathered, A, H, wbits, g13, num_threads)) {
            rc = -3;
            goto done;
        }
        if (per_token) q8_gather(&a13, &tok, token_of);
        /* pass 1: [g; u] = w13_e . x for every (expert, row of w13), or (expert, tile of 16 rows) */
        if (tiled) {
            expert_tiles(&a13, count, E, 2 * I, w13, s13, m13, rb13, H / g13, wbits, sh13, gu, 2 * I, num_threads);
        } else {
#pragma omp parallel for schedule(dynamic, 16) num_threads(num_threads)
            for (long item = 0; item < E * 2 * I; item++) {
                const long e = item / (2 * I), n = item % (2 * I), rows = count[e + 1] - count[e];
                if (!rows) continue;
                weight_row_dots(&a13, count[e], rows, w13[e] + n * rb13, wbits, sh13, s13[e] + n * (H / g13),
                                wbits == 4 ? m13[e] + n * (H / g13) : NULL, gu + count[e] * 2 * I + n, 2 * I);
            }
        }
        /* silu(g) * u, rows in parallel */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (A * I >= 65536)
        for (long r = 0; r < A; r++)
            for (long i = 0; i < I; i++) act[r * I + i] = silu_poly(gu[r * 2 * I + i]) * gu[r * 2 * I + I + i];
        if (q8_quantize(&a2, act, A, I, wbits, g2, num_threads)) {
            rc = -3;
            goto done;
        }
        /* pass 2: w2_e . act for every (expert, row of w2), or (expert, tile of 16 rows) */
        if (tiled) {
            expert_tiles(&a2, count, E, H, w2, s2, m2, rb2, I / g2, wbits, sh2, partial, H, num_threads);
        } else {
#pragma omp parallel for schedule(dynamic, 16) num_threads(num_threads)
            for (long item = 0; item < E * H; item++) {
                const long e = item / H, n = item % H, rows = count[e + 1] - count[e];
                if (!rows) continue;
                weight_row_dots(&a2, count[e], rows, w2[e] + n * rb2, wbits, sh2, s2[e] + n * (I / g2),
                                wbits == 4 ? m2[e] + n * (I / g2) : NULL, partial + count[e] * H + n, H);
            }
        }
    }
    moe_combine(out, dtype == DT_BF16, T, H, topk, row_of, wts, partial, num_threads);
done:
    q8_free(&a13), q8_free(&a2), q8_free(&tok);
    free(count), free(xf), free(fill), free(row_of), free(token_of), free(gathered), free(gu), free(act), free(partial);
    return rc;
#else
    (void)x, (void)out, (void)H, (void)I, (void)ids, (void)wts, (void)offset, (void)w13, (void)s13, (void)m13, (void)tiled;
    (void)w2, (void)s2, (void)m2, (void)group, (void)num_threads;
    return -2;
#endif
}
