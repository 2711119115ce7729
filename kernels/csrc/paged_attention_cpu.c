/*
 * Paged attention for CPUs: every new token attends, through its sequence's block table, to the
 * keys at or before its position, reading K/V straight out of the block pool (no gather copy).
 *
 * Layouts (the same as the torch reference and flash-attn):
 *   q, out:          [T, Hq, D]            T = new tokens of all sequences, flat
 *   k_cache/v_cache: [NB, BS, Hkv, D]      element type kv_dtype
 *   k_cache when k_transposed: [NB, Hkv, D, BS] storage: each block holds K^T per head, so the
 *                    scores of a whole block are D vector FMAs across its keys, no horizontal sums
 *   k/v_scale:       [NB, BS, Hkv] float16 (only for int8 / fp8 storage; x = q * scale)
 *   block_tables:    [B, max_blocks] int32
 *   query_start_loc: [B + 1] int32;  seq_lens: [B] int32 (context length after this step)
 *
 * One work item is (token, kv head): the G = Hq / Hkv query heads of a group share every K/V row
 * they load. Softmax is computed online, one block of keys at a time. Parallel with OpenMP (the
 * process's libgomp, the one torch already loaded).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_I8 = 3, DT_FP8 = 4 };

#define MAX_G 32
#define MAX_D 256
#define MAX_BS 256

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

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

int kvpilot_paged_attention(
    const void *q, int q_dtype, void *out,
    const void *k_cache, const void *v_cache, int kv_dtype, int k_transposed,
    const uint16_t *k_scale, const uint16_t *v_scale,
    const int32_t *block_tables, int max_blocks,
    const int32_t *query_start_loc, const int32_t *seq_lens, int num_seqs,
    int num_q_heads, int num_kv_heads, int head_dim, int block_size, float sm_scale,
    int num_threads) {
    const int G = num_q_heads / num_kv_heads;
    const int D = head_dim, BS = block_size, Hkv = num_kv_heads, Hq = num_q_heads;
    if (G > MAX_G || D > MAX_D || BS > MAX_BS || G * Hkv != Hq) return -1;
    if ((kv_dtype == DT_I8 || kv_dtype == DT_FP8) && (!k_scale || !v_scale)) return -2;
    if (kv_dtype == DT_FP8 && !fp8_ready) init_fp8_table();
    const int T = query_start_loc[num_seqs];
    int32_t *tok_seq = (int32_t *)malloc(sizeof(int32_t) * (size_t)(T > 0 ? T : 1));
    if (!tok_seq) return -3;
    for (int b = 0; b < num_seqs; b++)
        for (int t = query_start_loc[b]; t < query_start_loc[b + 1]; t++) tok_seq[t] = b;
    const long items = (long)T * Hkv;

#pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads)
    for (long item = 0; item < items; item++) {
        const int t = (int)(item / Hkv), h = (int)(item % Hkv);
        const int b = tok_seq[t];
        const int qlen = query_start_loc[b + 1] - query_start_loc[b];
        const int j = t - query_start_loc[b];
        const int ctx = seq_lens[b] - qlen + j + 1; /* keys this token may see */
        const int32_t *table = block_tables + (size_t)b * max_blocks;

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
                const float vs = v_scale ? f16_to_f32(v_scale[slot]) : 1.0f;
                load_row(v_cache, kv_dtype, slot * D, D, vs, row);
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
    free(tok_seq);
    return 0;
}
