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
#include <string.h>

#include "dtypes.h"
#include "isa.h"

enum { DT_F32 = 0, DT_BF16 = 1 };

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
#if defined(KVPILOT_ISA_AVX512)
    __m512 acc2[MB];
    for (int r = 0; r < mb; r++) acc2[r] = _mm512_setzero_ps();
    for (; b + 1 < nb; b += 2) {
        __mmask64 neg = 0;
        const __m512i u = block512(w, b, wbits, &neg);
        const __m512 ws = _mm512_insertf32x8(_mm512_set1_ps(h2f(sc[b >> gshift])),
                                             _mm256_set1_ps(h2f(sc[(b + 1) >> gshift])), 1);
        for (int r = 0; r < mb; r++) {
            __m512i s = _mm512_loadu_si512((const void *)(xq + r * K + b * QB));
            if (wbits == 8) s = _mm512_mask_sub_epi8(s, neg, _mm512_setzero_si512(), s);
            const __m512 d = _mm512_loadu_ps(dxe + (r * nb + b) * 8); /* dx[b] x 8, dx[b + 1] x 8 */
            acc2[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot512(u, s)), _mm512_mul_ps(ws, d), acc2[r]);
        }
    }
    for (int r = 0; r < mb; r++)
        acc[r] = _mm256_add_ps(_mm512_castps512_ps256(acc2[r]), _mm512_extractf32x8_ps(acc2[r], 1));
#endif
    for (; b < nb; b++) {
        __m256i wv = _mm256_setzero_si256();
        const __m256i u = block256(w, b, wbits, &wv);
        const __m256 ws = _mm256_set1_ps(h2f(sc[b >> gshift]));
        for (int r = 0; r < mb; r++) {
            __m256i s = _mm256_loadu_si256((const __m256i *)(xq + r * K + b * QB));
            if (wbits == 8) s = _mm256_sign_epi8(s, wv); /* x * sign(w), so u * s = w * x */
            const __m256 d = _mm256_broadcast_ss(dx + r * nb + b);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot256(u, s)), _mm256_mul_ps(ws, d), acc[r]);
        }
    }
    for (int r = 0; r < mb; r++) {
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

int kvpilot_qmatmul(const void *x, int dtype, void *out, const void *bias, long M, long K, long N,
                    const uint8_t *w, int wbits, int group, const uint16_t *scales, const uint16_t *mins,
                    int num_threads, int int8_activations) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || (wbits != 8 && wbits != 4) || group <= 0 || K % group ||
        (wbits == 4 && (group % 2 || !mins)) || M <= 0)
        return -1;
    float *xf = (float *)malloc(sizeof(float) * (size_t)(M * K));
    if (!xf) return -3;
    for (long i = 0; i < M * K; i++)
        xf[i] = dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
    const long row_bytes = wbits == 8 ? K : K / 2, ng = K / group;
    int failed = 0;
#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
    /* the weight scale of activation block b is sc[b >> gshift]: group a power-of-two multiple of QB,
     * or one group per row (int8 per channel) */
    int gshift = 0;
    while ((QB << gshift) < group) gshift++;
    if (int8_activations && group % QB == 0 && (ng == 1 || (QB << gshift) == group)) {
        if (ng == 1) gshift = 62; /* every block -> scale 0 */
        int8_t *xq = (int8_t *)malloc((size_t)(M * K));
        float *dx = (float *)malloc(sizeof(float) * (size_t)(M * (K / QB)));
        float *xs = wbits == 4 ? (float *)malloc(sizeof(float) * (size_t)(M * ng)) : NULL;
        float *rs = wbits == 4 ? (float *)malloc(sizeof(float) * (size_t)(M * ng)) : NULL;
        if (!xq || !dx || (wbits == 4 && (!xs || !rs))) {
            free(xq), free(dx), free(xs), free(rs), free(xf);
            return -3;
        }
        quantize_rows(xf, M, K, wbits, group, xq, dx, xs, rs);
        float *dxe = NULL;
#if defined(KVPILOT_ISA_AVX512)
        dxe = (float *)malloc(sizeof(float) * (size_t)(M * (K / QB) * 8));
        if (!dxe) {
            free(xq), free(dx), free(xs), free(rs), free(xf);
            return -3;
        }
        for (long i = 0; i < M * (K / QB) * 8; i++) dxe[i] = dx[i / 8];
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (long n = 0; n < N; n++) {
            const float b = !bias ? 0.0f
                            : dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)bias)[n])
                                               : ((const float *)bias)[n];
            const uint8_t *wn = w + n * row_bytes;
            const uint16_t *sn = scales + n * ng, *mn = mins ? mins + n * ng : NULL;
            for (long m0 = 0; m0 < M; m0 += MB) {
                const int mb = M - m0 < MB ? (int)(M - m0) : MB;
                const int8_t *q = xq + m0 * K;
                const float *d = dx + m0 * (K / QB), *s = xs ? xs + m0 * ng : NULL, *rr = rs ? rs + m0 * ng : NULL;
                const float *de = dxe ? dxe + m0 * (K / QB) * 8 : NULL;
                float sums[MB];
                switch (mb) { /* a constant row count per call: accumulators in registers */
                case 1: row_dots_q8(q, d, de, s, rr, 1, K, wn, wbits, gshift, ng, sn, mn, sums); break;
                case 2: row_dots_q8(q, d, de, s, rr, 2, K, wn, wbits, gshift, ng, sn, mn, sums); break;
                case 3: row_dots_q8(q, d, de, s, rr, 3, K, wn, wbits, gshift, ng, sn, mn, sums); break;
                default: row_dots_q8(q, d, de, s, rr, 4, K, wn, wbits, gshift, ng, sn, mn, sums); break;
                }
                for (int r = 0; r < mb; r++) {
                    const float v = sums[r] + b;
                    if (dtype == DT_BF16)
                        ((uint16_t *)out)[(m0 + r) * N + n] = f32_to_bf16(v);
                    else
                        ((float *)out)[(m0 + r) * N + n] = v;
                }
            }
        }
        free(xq), free(dx), free(dxe), free(xs), free(rs), free(xf);
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
