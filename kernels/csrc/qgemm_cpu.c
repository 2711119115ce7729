/*
 * Many-row quantized matmul with int8 activations (W8A8 / W4A8): out[M, N] = x[M, K] @ dequant(W)[N, K]^T
 * (+ bias) for the batched and prefill case, where the matmul is bound by arithmetic, not by reading W.
 * Same formats and the same arithmetic as the small-M path of qmatmul_cpu.c (kernels/qlinear.py
 * `reference_q8_matmul` specifies both): x quantized per block of 32 to int8 with one float scale per
 * block, weight codes times activation codes in integer dot products, scaled per block in float.
 *
 * What makes it faster than a float32 GEMM at the AVX2 level: the lanes of an integer accumulator
 * hold different blocks. K is cut into chunks of G = 8 blocks (then 4, 2, 1 for the tail); in a chunk
 * each block is split into G pieces of 32 / G bytes and register i holds piece i of every block
 * ("chunk layout"): of the 8 int32 lanes of a dot product, 8 / G lanes belong to each block (one
 * lane each when G = 8), and G iterations accumulate each block's whole 32-product sum in its lanes. The conversion to
 * float and the per-block scales are then applied once per chunk, not once per block:
 *   int4 codes (0..15) x int8: vpmaddubsw into int16 (pairs <= 2 * 15 * 127, 8 of them <= 30480, no
 *     overflow), one vpmaddwd per chunk: ~2 instructions per 32 multiply-adds per (row, weight row),
 *     against 4 float32 FMAs;
 *   int8 weights: |w| x sign-flipped activations (vpsignb), vpmaddubsw + vpmaddwd into int32.
 * With AVX512-VNNI (+VL) one vpdpbusd replaces each product. The weights are unpacked into the chunk
 * layout one panel of NP rows at a time (int4 nibbles to bytes, an 8 x 8 dword transpose per chunk)
 * and the panel, in L1/L2, is reused by every row of x; an MR x NR register tile of (x row, weight
 * row) accumulators runs over K.
 *
 * int4 (w = q * s + min) uses the small-M path's centring: per block b,
 *   x_b . w_b ~ s_b * (dx_b * sum q * xq + 8 * rs_b) + min_b * xs_b,
 * xs_b the exact float sum of the block's activations and rs_b = xs_b - dx_b * sum xq (per block
 * here, per group in qmatmul_cpu.c: the same sum, in another order).
 *
 * Returns 0, -1 on bad arguments, -2 where it does not apply (generic ISA level, K or the group not a
 * multiple of 32), -3 when out of memory.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "isa.h"
#include "kvpilot_kernels.h"


#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
#include <immintrin.h>

#define QB 32   /* activation block (llama.cpp's Q8_0 block) */
#ifndef MR
#define MR 4 /* x rows per register tile */
#endif
#ifndef NR
#define NR 2 /* weight rows per register tile */
#endif
#define NP 16   /* weight rows unpacked per panel */
#ifndef MBLK
#define MBLK 128 /* rows of x per pass over the weight panels */
#endif
#define MAXC 1024 /* chunks of a row (a table on the stack): K <= 8 * 32 * (MAXC - 3) (qlinear.GEMM_MAX_K) */

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QG_VNNI 1
#endif

static inline float h2f(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* K's blocks in chunks: greedy 8, then 4, 2, 1 */
typedef struct {
    int n;
    int g[MAXC];
    long b0[MAXC];
} chunks;

static int make_chunks(long nb, chunks *ch) {
    ch->n = 0;
    long b = 0;
    for (int g = 8; g >= 1; g /= 2)
        while (nb - b >= g) {
            if (ch->n == MAXC) return -1;
            ch->g[ch->n] = g, ch->b0[ch->n] = b, ch->n++;
            b += g;
        }
    return 0;
}

/* G blocks of 32 bytes (src, block after block) into the chunk layout (dst: register i = piece i of
 * every block, pieces of 32 / G bytes) */
static inline void to_chunk(const uint8_t *src, uint8_t *dst, int g) {
    const int p = QB / g;
    if (g == 1) {
        memcpy(dst, src, QB);
        return;
    }
    if (g == 8) { /* an 8 x 8 transpose of dwords */
        __m256i r[8], t[8], u[8];
        for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_si256((const __m256i *)(src + j * QB));
        for (int j = 0; j < 4; j++) {
            t[2 * j] = _mm256_unpacklo_epi32(r[2 * j], r[2 * j + 1]);
            t[2 * j + 1] = _mm256_unpackhi_epi32(r[2 * j], r[2 * j + 1]);
        }
        for (int h = 0; h < 2; h++) { /* blocks 4h .. 4h + 3 */
            u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
            u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
            u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
            u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
        }
        for (int i = 0; i < 4; i++) {
            _mm256_storeu_si256((__m256i *)(dst + i * QB), _mm256_permute2x128_si256(u[i], u[4 + i], 0x20));
            _mm256_storeu_si256((__m256i *)(dst + (i + 4) * QB), _mm256_permute2x128_si256(u[i], u[4 + i], 0x31));
        }
        return;
    }
    for (int i = 0; i < g; i++)
        for (int j = 0; j < g; j++) memcpy(dst + i * QB + j * p, src + j * QB + i * p, (size_t)p);
}

/* the element of x stored at position i of a row (int4 groups wider than 32 are stored as 16-byte
 * chunks: low nibbles = weights 16c.., high = group / 2 + 16c..; see qlinear.storage_order) */
static inline long source_index(long i, int wbits, int group) {
    if (wbits == 8 || group == QB) return i;
    const long g = i / group, j = i % group;
    return g * group + (j % QB >= 16) * (group / 2) + (j / QB) * 16 + j % 16;
}

/* one row of x: int8 codes in chunk layout (xq, K bytes), per chunk and lane the block's scale (dxl),
 * and for int4 8 * rs_b and xs_b in the block's first lane (0 in its other lanes, so that summing
 * the lanes counts them once) */
static void quantize_row(const float *xr, long K, int wbits, int group, const chunks *ch, int8_t *xq, float *dxl,
                         float *rsl, float *xsl) {
    int8_t nat[8 * QB];
    float tmp[QB];
    (void)K; /* the chunks cover it */
    for (int c = 0; c < ch->n; c++) {
        const int g = ch->g[c], lanes = 8 / g;
        for (int j = 0; j < g; j++) {
            const long b = ch->b0[c] + j;
            float amax = 0.0f, sum = 0.0f;
            for (int t = 0; t < QB; t++) {
                tmp[t] = xr[source_index(b * QB + t, wbits, group)];
                const float a = tmp[t] < 0 ? -tmp[t] : tmp[t];
                amax = a > amax ? a : amax;
                sum += tmp[t];
            }
            const float id = amax > 0 ? 127.0f / amax : 0.0f, d = amax / 127.0f;
            int codes = 0;
            for (int t = 0; t < QB; t++) {
                const int q = (int)__builtin_lrintf(tmp[t] * id);
                nat[j * QB + t] = (int8_t)q;
                codes += q;
            }
            for (int l = 0; l < lanes; l++) {
                dxl[c * 8 + j * lanes + l] = d;
                if (rsl) {
                    rsl[c * 8 + j * lanes + l] = l ? 0.0f : 8.0f * (sum - d * (float)codes);
                    xsl[c * 8 + j * lanes + l] = l ? 0.0f : sum;
                }
            }
        }
        to_chunk((const uint8_t *)nat, (uint8_t *)(xq + ch->b0[c] * QB), g);
    }
}

/* one weight row into the chunk layout (wp, K bytes: int4 codes 0..15 or int8 codes) with its block
 * scales (wsl) and int4 mins (mnl) per chunk and lane */
static void unpack_row(const uint8_t *w, int wbits, long K, int group, const uint16_t *sc, const uint16_t *mn,
                       const chunks *ch, uint8_t *wp, float *wsl, float *mnl) {
    uint8_t nat[8 * QB];
    (void)K; /* the chunks cover it */
    const long bpg = group / QB; /* blocks per scale */
    const __m128i m15 = _mm_set1_epi8(15);
    for (int c = 0; c < ch->n; c++) {
        const int g = ch->g[c], lanes = 8 / g;
        const long b0 = ch->b0[c];
        const uint8_t *src;
        if (wbits == 8) {
            src = w + b0 * QB;
        } else {
            for (int j = 0; j < g; j++) {
                const __m128i raw = _mm_loadu_si128((const __m128i *)(w + (b0 + j) * 16));
                _mm_storeu_si128((__m128i *)(nat + j * QB), _mm_and_si128(raw, m15));
                _mm_storeu_si128((__m128i *)(nat + j * QB + 16), _mm_and_si128(_mm_srli_epi16(raw, 4), m15));
            }
            src = nat;
        }
        to_chunk(src, wp + b0 * QB, g);
        if (g == 8 && bpg == 1) { /* one scale per block: 8 float16 -> 8 lanes */
            _mm256_storeu_ps(wsl + c * 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + b0))));
            if (mnl) _mm256_storeu_ps(mnl + c * 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + b0))));
            continue;
        }
        for (int j = 0; j < g; j++) {
            const long s = (b0 + j) / bpg;
            const float sv = h2f(sc[s]), mv = mn ? h2f(mn[s]) : 0.0f;
            for (int l = 0; l < lanes; l++) {
                wsl[c * 8 + j * lanes + l] = sv;
                if (mnl) mnl[c * 8 + j * lanes + l] = mv;
            }
        }
    }
}

/* res[m][n] = x row m . weight row n for an mr x nr tile (constants at each call site) */
static inline __attribute__((always_inline)) void tile(const int mr, const int nr, const int wbits, const chunks *ch,
                                                       long K, const int8_t *xq, const float *dxl,
                                                       const float *rsl, const float *xsl, const uint8_t *wp,
                                                       const float *wsl, const float *mnl, long lstride,
                                                       float res[MR][NR]) {
    __m256 facc[MR][NR];
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) facc[m][n] = _mm256_setzero_ps();
#if !defined(QG_VNNI)
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    for (int c = 0; c < ch->n; c++) {
        const int g = ch->g[c];
        const long off = ch->b0[c] * QB;
        __m256i acc[MR][NR];
        for (int m = 0; m < mr; m++)
            for (int n = 0; n < nr; n++) acc[m][n] = _mm256_setzero_si256();
        for (int i = 0; i < g; i++) {
            __m256i wv[NR], wa[NR];
            for (int n = 0; n < nr; n++) {
                wv[n] = _mm256_loadu_si256((const __m256i *)(wp + n * K + off + i * QB));
                wa[n] = wbits == 8 ? _mm256_abs_epi8(wv[n]) : wv[n];
            }
            for (int m = 0; m < mr; m++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + m * K + off + i * QB));
                for (int n = 0; n < nr; n++) {
                    const __m256i s = wbits == 8 ? _mm256_sign_epi8(xv, wv[n]) : xv;
#if defined(QG_VNNI)
                    acc[m][n] = _mm256_dpbusd_epi32(acc[m][n], wa[n], s);
#else
                    if (wbits == 8)
                        acc[m][n] = _mm256_add_epi32(acc[m][n], _mm256_madd_epi16(_mm256_maddubs_epi16(wa[n], s), ones));
                    else
                        acc[m][n] = _mm256_add_epi16(acc[m][n], _mm256_maddubs_epi16(wa[n], s));
#endif
                }
            }
        }
        for (int m = 0; m < mr; m++) {
            const __m256 d = _mm256_loadu_ps(dxl + m * lstride + c * 8);
            const __m256 r = wbits == 4 ? _mm256_loadu_ps(rsl + m * lstride + c * 8) : _mm256_setzero_ps();
            const __m256 xs = wbits == 4 ? _mm256_loadu_ps(xsl + m * lstride + c * 8) : _mm256_setzero_ps();
            for (int n = 0; n < nr; n++) {
#if defined(QG_VNNI)
                const __m256 v = _mm256_cvtepi32_ps(acc[m][n]);
#else
                const __m256 v = _mm256_cvtepi32_ps(wbits == 8 ? acc[m][n] : _mm256_madd_epi16(acc[m][n], ones));
#endif
                const __m256 ws = _mm256_loadu_ps(wsl + n * lstride + c * 8);
                if (wbits == 4) {
                    facc[m][n] = _mm256_fmadd_ps(_mm256_fmadd_ps(v, d, r), ws, facc[m][n]);
                    facc[m][n] = _mm256_fmadd_ps(_mm256_loadu_ps(mnl + n * lstride + c * 8), xs, facc[m][n]);
                } else {
                    facc[m][n] = _mm256_fmadd_ps(_mm256_mul_ps(v, d), ws, facc[m][n]);
                }
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) res[m][n] = hsum8(facc[m][n]);
}

/* the tile at a constant size: the full MR x NR, or a smaller one at the edges */
#define TILE_CASE(a, b)                                                                                            \
    case (a) * 8 + (b):                                                                                            \
        if ((a) <= MR && (b) <= NR) {                                                                              \
            if (wbits == 8)                                                                                        \
                tile((a) <= MR ? (a) : 1, (b) <= NR ? (b) : 1, 8, ch, K, xq, dxl, rsl, xsl, wp, wsl, mnl, lstride, \
                     res);                                                                                         \
            else                                                                                                   \
                tile((a) <= MR ? (a) : 1, (b) <= NR ? (b) : 1, 4, ch, K, xq, dxl, rsl, xsl, wp, wsl, mnl, lstride, \
                     res);                                                                                         \
        }                                                                                                          \
        break;
#define TILE_ROW(a) TILE_CASE(a, 1) TILE_CASE(a, 2) TILE_CASE(a, 3) TILE_CASE(a, 4)

static void run_tile(int mr, int nr, int wbits, const chunks *ch, long K, const int8_t *xq, const float *dxl,
                     const float *rsl, const float *xsl, const uint8_t *wp, const float *wsl, const float *mnl,
                     long lstride, float res[MR][NR]) {
    switch (mr * 8 + nr) {
        TILE_ROW(1)
        TILE_ROW(2)
        TILE_ROW(3)
        TILE_ROW(4)
        TILE_ROW(5)
        TILE_ROW(6)
    default: break;
    }
}
#endif

int kvpilot_qgemm(const void *x, int dtype, void *out, const void *bias, long M, long K, long N, const uint8_t *w,
                  int wbits, int group, const uint16_t *scales, const uint16_t *mins, int num_threads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || (wbits != 8 && wbits != 4) || group <= 0 || K <= 0 ||
        K % group || (wbits == 4 && (group % 2 || !mins)) || M <= 0 || N <= 0)
        return -1;
#if defined(KVPILOT_ISA_AVX512) || defined(KVPILOT_ISA_AVX2)
    if (K % QB || group % QB) return -2;
    chunks chs;
    if (make_chunks(K / QB, &chs)) return -2;
    const chunks *ch = &chs;
    const long lstride = (long)ch->n * 8, row_bytes = wbits == 8 ? K : K / 2, ng = K / group;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *dxl = (float *)malloc(sizeof(float) * (size_t)(M * lstride));
    float *rsl = wbits == 4 ? (float *)malloc(sizeof(float) * (size_t)(M * lstride)) : NULL;
    float *xsl = wbits == 4 ? (float *)malloc(sizeof(float) * (size_t)(M * lstride)) : NULL;
    int failed = !xq || !dxl || (wbits == 4 && (!rsl || !xsl));
    const long panels = (N + NP - 1) / NP, blocks = (M + MBLK - 1) / MBLK;
    /* pass 1: every row of x quantized; in parallel only for long inputs (prefill): on a loaded
     * machine each extra fork/join or barrier can wait a scheduler time slice for a preempted thread */
#pragma omp parallel num_threads(num_threads) if (!failed && M >= 256)
    {
        float *row = (float *)malloc(sizeof(float) * (size_t)K);
        if (!row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long m = 0; m < M; m++) {
            if (!row || failed) continue;
            if (dtype == DT_BF16)
                for (long k = 0; k < K; k++) row[k] = bf16_to_f32(((const uint16_t *)x)[m * K + k]);
            else
                memcpy(row, (const float *)x + m * K, sizeof(float) * (size_t)K);
            quantize_row(row, K, wbits, group, ch, xq + m * K, dxl + m * lstride, rsl ? rsl + m * lstride : NULL,
                         xsl ? xsl + m * lstride : NULL);
        }
        free(row);
    }
#pragma omp parallel num_threads(num_threads) if (!failed)
    {
        uint8_t *wp = (uint8_t *)aligned_alloc(64, (size_t)(NP * K));
        float *wsl = (float *)malloc(sizeof(float) * (size_t)(NP * lstride));
        float *mnl = wbits == 4 ? (float *)malloc(sizeof(float) * (size_t)(NP * lstride)) : NULL;
        const int stop = failed || !wp || !wsl || (wbits == 4 && !mnl);
        if (stop) {
#pragma omp atomic write
            failed = 1; /* this thread's items are skipped: the call reports -3 */
        }
        /* pass 2: work items (row block, panel), row blocks outermost: the threads share one block
         * of x (MBLK rows, in L2) while they go through the panels, and each panel is unpacked once
         * per row block (the x of a long prefill chunk would not stay in cache across panels) */
#pragma omp for schedule(dynamic, 1) nowait
        for (long item = 0; item < blocks * panels; item++) {
            if (stop) continue;
            const long p = item % panels, mlo = item / panels * MBLK;
            const long mhi = M - mlo < MBLK ? M : mlo + MBLK;
            const long n0 = p * NP, np = N - n0 < NP ? N - n0 : NP;
            for (long j = 0; j < np; j++)
                unpack_row(w + (n0 + j) * row_bytes, wbits, K, group, scales + (n0 + j) * ng,
                           mins ? mins + (n0 + j) * ng : NULL, ch, wp + j * K, wsl + j * lstride,
                           mnl ? mnl + j * lstride : NULL);
            for (long m0 = mlo; m0 < mhi; m0 += MR) {
                const int mr = mhi - m0 < MR ? (int)(mhi - m0) : MR;
                for (long j = 0; j < np; j += NR) {
                    const int nr = np - j < NR ? (int)(np - j) : NR;
                    float res[MR][NR];
                    run_tile(mr, nr, wbits, ch, K, xq + m0 * K, dxl + m0 * lstride, rsl ? rsl + m0 * lstride : NULL,
                             xsl ? xsl + m0 * lstride : NULL, wp + j * K, wsl + j * lstride,
                             mnl ? mnl + j * lstride : NULL, lstride, res);
                    for (int a = 0; a < mr; a++)
                        for (int b = 0; b < nr; b++) {
                            const long n = n0 + j + b;
                            float v = res[a][b];
                            if (bias)
                                v += dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)bias)[n])
                                                      : ((const float *)bias)[n];
                            if (dtype == DT_BF16)
                                ((uint16_t *)out)[(m0 + a) * N + n] = f32_to_bf16(v);
                            else
                                ((float *)out)[(m0 + a) * N + n] = v;
                        }
                }
            }
        }
        free(wp), free(wsl), free(mnl);
    }
    free(xq), free(dxl), free(rsl), free(xsl);
    return failed ? -3 : 0;
#else
    (void)x, (void)out, (void)bias, (void)w, (void)scales, (void)num_threads;
    return -2;
#endif
}
