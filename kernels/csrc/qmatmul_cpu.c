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

#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
#include <immintrin.h>
#define MB 4 /* rows of x per pass over a weight row */
#if defined(KVPILOT_ISA_AVX512)
#define VW 16
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VSET1(v) _mm512_set1_ps(v)
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSUM(v) _mm512_reduce_add_ps(v)
static inline vec q8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline void q4(const uint8_t *p, vec *lo, vec *hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#else
#define VW 8
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VSET1(v) _mm256_set1_ps(v)
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float VSUM(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
static inline vec q8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline void q4(const uint8_t *p, vec *lo, vec *hi) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
#endif

/* sums[r] = x[r] . dequant(weight row) for mb <= MB rows of x (row stride K) */
static inline __attribute__((always_inline)) void row_dots(const float *x, int mb, long K, const uint8_t *w,
                                                           int wbits, int group, const uint16_t *sc,
                                                           const uint16_t *mn, float *sums) {
    vec acc[MB];
    for (int r = 0; r < MB; r++) acc[r] = VZERO();
    const long ng = K / group;
    if (wbits == 8) {
        const int8_t *q = (const int8_t *)w;
        for (long g = 0; g < ng; g++) {
            const vec s = VSET1(h2f(sc[g]));
            for (int i = 0; i < group; i += VW) {
                const long k = g * group + i;
                const vec ws = VFMA(q8(q + k), s, VZERO());
                for (int r = 0; r < mb; r++) acc[r] = VFMA(VLOAD(x + r * K + k), ws, acc[r]);
            }
        }
    } else {
        const int half = group / 2;
        for (long g = 0; g < ng; g++) {
            const vec s = VSET1(h2f(sc[g])), m = VSET1(h2f(mn[g]));
            const uint8_t *p = w + g * half;
            for (int i = 0; i < half; i += VW) {
                vec lo, hi;
                q4(p + i, &lo, &hi);
                lo = VFMA(lo, s, m);
                hi = VFMA(hi, s, m);
                const long k = g * group + i;
                for (int r = 0; r < mb; r++) {
                    acc[r] = VFMA(VLOAD(x + r * K + k), lo, acc[r]);
                    acc[r] = VFMA(VLOAD(x + r * K + k + half), hi, acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < mb; r++) sums[r] = VSUM(acc[r]);
}
#endif

static inline float dot(const float *restrict a, const float *restrict b, long K) {
    float acc = 0.0f;
    for (long k = 0; k < K; k++) acc += a[k] * b[k];
    return acc;
}

int kvpilot_qmatmul(const void *x, int dtype, void *out, const void *bias, long M, long K, long N,
                    const uint8_t *w, int wbits, int group, const uint16_t *scales, const uint16_t *mins,
                    int num_threads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || (wbits != 8 && wbits != 4) || group <= 0 || K % group ||
        (wbits == 4 && (group % 2 || !mins)) || M <= 0)
        return -1;
    float *xf = (float *)malloc(sizeof(float) * (size_t)(M * K));
    if (!xf) return -3;
    for (long i = 0; i < M * K; i++)
        xf[i] = dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
    const long row_bytes = wbits == 8 ? K : K / 2, ng = K / group;
    int failed = 0;
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
#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
            if (group % (wbits == 8 ? VW : 2 * VW) == 0) {
                for (long m0 = 0; m0 < M; m0 += MB) {
                    const int mb = M - m0 < MB ? (int)(M - m0) : MB;
                    float sums[MB];
                    row_dots(xf + m0 * K, mb, K, w + n * row_bytes, wbits, group, scales + n * ng,
                             mins ? mins + n * ng : NULL, sums);
                    for (int r = 0; r < mb; r++) {
                        const float v = sums[r] + b;
                        if (dtype == DT_BF16)
                            ((uint16_t *)out)[(m0 + r) * N + n] = f32_to_bf16(v);
                        else
                            ((float *)out)[(m0 + r) * N + n] = v;
                    }
                }
                continue;
            }
#endif
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
