/*
 * Small per-token ops of a decoder layer, fused for CPUs: RMSNorm (with the residual add), rotary
 * position embedding, silu(gate) * up, and the KV cache write. In torch each is 5-8 kernel launches over small tensors, and at decode batch
 * sizes the launches, not the arithmetic, cost the time.
 *
 * The results equal torch's op sequence in layers.py bit for bit in float32 and bfloat16 except for the
 * order of the mean's sum (RMSNorm): every intermediate the torch code rounds to the activation dtype is
 * rounded here too, and this file is built without -ffast-math and with -ffp-contract=off, so no FMA
 * contracts a product and a sum that torch rounds separately.
 *
 * Layouts: x, residual, out [T, H] contiguous; weight [H]; q [T, Hq, D], k [T, Hk, D] with heads
 * contiguous within a token and q_stride / k_stride elements between tokens (views into a fused QKV
 * projection's output work as they are), rotated in place on their first rotary_dim dims (rotate-half, HF Llama layout); cos_sin [P, R] float32
 * (R = rotary_dim: cos of each frequency, then sin); positions [T] int64.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dtypes.h"
#include "isa.h"
#include "kvpilot_kernels.h"
#include "vmath.h"

enum { DT_F32 = 0, DT_BF16 = 1 };

/* a value as the activation dtype holds it: rounded to bf16 for bf16, unchanged for f32 */
static inline float act(float v, int dt) { return dt == DT_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

static inline float load(const void *p, int dt, size_t i) {
    return dt == DT_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int dt, size_t i, float v) {
    if (dt == DT_BF16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/*
 * One row: s = x + residual (rounded to the dtype; written to sum_out when residual is given), then
 * out = weight * dtype(s * rsqrt(mean(s^2) + eps)) with the norm in float32. The dtype is a constant
 * in each instantiation and the mean sums 16 independent lanes, so the loops vectorize without
 * reassociating any float sum the way -ffast-math would.
 */
static inline __attribute__((always_inline)) void rms_row(
    const void *x, const void *residual, void *sum_out, void *out, const void *weight, const int dtype,
    size_t row, int H, float eps) {
    float lanes[16] = {0};
    int i = 0;
    for (; i + 16 <= H; i += 16)
        for (int j = 0; j < 16; j++) {
            float v = load(x, dtype, row + i + j);
            if (residual) {
                v = act(v + load(residual, dtype, row + i + j), dtype);
                store(sum_out, dtype, row + i + j, v);
            }
            lanes[j] += v * v;
        }
    for (; i < H; i++) {
        float v = load(x, dtype, row + i);
        if (residual) {
            v = act(v + load(residual, dtype, row + i), dtype);
            store(sum_out, dtype, row + i, v);
        }
        lanes[i % 16] += v * v;
    }
    double ss = 0.0;
    for (int j = 0; j < 16; j++) ss += lanes[j];
    const float inv = 1.0f / sqrtf((float)(ss / H) + eps);
    const void *src = residual ? sum_out : x;
    for (i = 0; i < H; i++) {
        const float h = act(load(src, dtype, row + i) * inv, dtype);
        store(out, dtype, row + i, load(weight, dtype, i) * h);
    }
}

int kvpilot_rms_norm(const void *x, const void *residual, void *sum_out, void *out, const void *weight,
                     int dtype, long T, int H, float eps, int num_threads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || H <= 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * H >= 32768)
    for (long t = 0; t < T; t++) {
        if (dtype == DT_BF16)
            rms_row(x, residual, sum_out, out, weight, DT_BF16, (size_t)t * H, H, eps);
        else
            rms_row(x, residual, sum_out, out, weight, DT_F32, (size_t)t * H, H, eps);
    }
    return 0;
}

static inline __attribute__((always_inline)) void rotate_row(void *base, size_t row, const float *cs,
                                                             int half, const int dtype) {
    for (int i = 0; i < half; i++) {
        const float c = act(cs[i], dtype), s = act(cs[half + i], dtype);
        const float x1 = load(base, dtype, row + i), x2 = load(base, dtype, row + half + i);
        const float a = act(x1 * c, dtype), b = act(x2 * s, dtype);
        const float e = act(x2 * c, dtype), f = act(x1 * s, dtype);
        store(base, dtype, row + i, a - b);
        store(base, dtype, row + half + i, e + f);
    }
}

/* rotate-half rotary embedding of q and k in place: for i < R/2, with c, s the table's cos and sin
 * rounded to the dtype: x1' = x1*c - x2*s, x2' = x2*c + x1*s, every product and sum rounded */
int kvpilot_rotary(void *q, void *k, long q_stride, long k_stride, const int64_t *positions,
                   const float *cos_sin, int dtype, long T, int Hq, int Hk, int D, int R, long max_position,
                   int num_threads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || R <= 0 || R > D || R % 2) return -1;
    for (long t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_position) return -2;
    const int half = R / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * (Hq + Hk) * D >= 32768)
    for (long t = 0; t < T; t++) {
        const float *cs = cos_sin + (size_t)positions[t] * R;
        for (int h = 0; h < Hq + Hk; h++) {
            void *base = h < Hq ? q : k;
            const size_t row = h < Hq ? (size_t)t * q_stride + (size_t)h * D
                                      : (size_t)t * k_stride + (size_t)(h - Hq) * D;
            if (dtype == DT_BF16)
                rotate_row(base, row, cs, half, DT_BF16);
            else
                rotate_row(base, row, cs, half, DT_F32);
        }
    }
    return 0;
}

/*
 * Write the new keys and values of T tokens into their cache slots (a plain copy: the cache has the
 * activations' dtype). k, v: [T, Hk, D], heads adjacent within a token, k_stride / v_stride elements
 * between tokens (views into a fused QKV output). Caches: any layout of the logical
 * [blocks, block_size, Hk, D] array, given by its four strides in elements (the CPU kernel's
 * transposed K and head-major V included). Negative slots are padding and skipped.
 */
int kvpilot_write_kv(const void *k, const void *v, long k_stride, long v_stride, void *k_cache, void *v_cache,
                     const long *k_strides, const long *v_strides, const int64_t *slots, int dtype, long T,
                     int Hk, int D, int block_size, long num_slots) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || block_size <= 0) return -1;
    for (long t = 0; t < T; t++)
        if (slots[t] >= num_slots) return -2;
    const size_t es = dtype == DT_BF16 ? 2 : 4;
    for (long t = 0; t < T; t++) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        const long blk = s / block_size, off = s % block_size;
        for (int h = 0; h < Hk; h++)
            for (int c = 0; c < 2; c++) {
                const char *src = (const char *)(c ? v : k) + ((size_t)t * (c ? v_stride : k_stride) + (size_t)h * D) * es;
                const long *st = c ? v_strides : k_strides;
                char *dst = (char *)(c ? v_cache : k_cache) + (size_t)(blk * st[0] + off * st[1] + h * st[2]) * es;
                if (st[3] == 1)
                    memcpy(dst, src, (size_t)D * es);
                else
                    for (int d = 0; d < D; d++) memcpy(dst + (size_t)d * st[3] * es, src + (size_t)d * es, es);
            }
    }
    return 0;
}

/*
 * The gated MLP's activation: out[t, i] = silu(g) * u with [g, u] = gu[t] ([T, 2I] -> [T, I]), silu
 * rounded to the dtype before the product as torch's F.silu(gate) * up rounds it. exp is exp_poly, so
 * a float32 value can differ from torch's F.silu in the last bits: the Python layers and the C decoder
 * stack both call this, so they agree with each other exactly.
 */
static inline __attribute__((always_inline)) void silu_mul_row(const void *gu, void *out, size_t row, long I,
                                                               const int dtype) {
    for (long i = 0; i < I; i++) {
        const float g = load(gu, dtype, 2 * row + i), u = load(gu, dtype, 2 * row + I + i);
        store(out, dtype, row + i, act(g / (1.0f + exp_poly(-g)), dtype) * u);
    }
}

int kvpilot_silu_mul(const void *gu, void *out, int dtype, long T, long I, int num_threads) {
    if ((dtype != DT_F32 && dtype != DT_BF16) || I <= 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * I >= 32768)
    for (long t = 0; t < T; t++) {
        if (dtype == DT_BF16)
            silu_mul_row(gu, out, (size_t)t * I, I, DT_BF16);
        else
            silu_mul_row(gu, out, (size_t)t * I, I, DT_F32);
    }
    return 0;
}

