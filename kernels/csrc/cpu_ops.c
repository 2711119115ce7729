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
 * One head's D values quantized as kernels/quant.py quantize() does, bit for bit: amax = max |x| (at
 * least 1e-4), scale = float16(amax / qmax), q = x / float(scale) rounded to nearest even, int8 clamped
 * to +-127; float8 e4m3fn rounded to nearest even (fp8_e4m3), as torch's conversion. Returns the scale.
 */
static uint8_t fp8_e4m3(float y) {
    const uint8_t sign = signbit(y) ? 0x80 : 0x00;
    const float a = fabsf(y);
    if (!(a < 480.0f)) return sign | 0x7f; /* NaN, or past the largest finite (448) by more than half a step */
    if (a < 0x1p-6f) return sign | (uint8_t)rintf(ldexpf(a, 9)); /* zero and subnormals: steps of 2^-9 (8
                                                                    rounds up to the smallest normal, 0x08) */
    int e;
    frexpf(a, &e); /* a = f * 2^e, f in [0.5, 1) */
    e -= 1;        /* a = (1 + m) * 2^e, e >= -6 */
    const int code = ((e + 7) << 3) + (int)rintf(ldexpf(a, 3 - e)) - 8; /* a carry moves into the exponent */
    return sign | (uint8_t)(code > 0x7f ? 0x7f : code);
}

static inline uint16_t quantize_head(const float *x, int D, int cache_dtype, void *dst, long dstep) {
    float amax = 0.0f;
    for (int d = 0; d < D; d++) {
        const float a = fabsf(x[d]);
        amax = a > amax || a != a ? a : amax; /* a NaN stays (torch's amax) */
    }
    if (amax < 1e-4f) amax = 1e-4f;
    const float qmax = cache_dtype == DT_I8 ? 127.0f : 448.0f;
    const uint16_t sh = f32_to_f16(amax / qmax);
    const float scale = f16_to_f32(sh);
    for (int d = 0; d < D; d++) {
        const float y = x[d] / scale;
        if (cache_dtype == DT_I8) {
            const float r = rintf(y);
            ((int8_t *)dst)[d * dstep] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
        } else {
            ((uint8_t *)dst)[d * dstep] = fp8_e4m3(y);
        }
    }
    return sh;
}

/*
 * Write the new keys and values of T tokens into their cache slots. k, v: [T, Hk, D] in the activations'
 * dtype (DT_F32 or DT_BF16), heads adjacent within a token, k_stride / v_stride elements between tokens
 * (views into a fused QKV output). Caches: any layout of the logical [blocks, block_size, Hk, D] array,
 * given by its four strides in elements (the CPU kernel's transposed K and head-major V included), of
 * cache_dtype: the activations' dtype (a plain copy), DT_BF16 under float32 activations (each value
 * rounded to nearest even, as torch's .to(torch.bfloat16): --kv-cache-dtype bfloat16), or DT_I8 / DT_FP8
 * with k_scale / v_scale [blocks * block_size, Hk] float16 (each head quantized: kernels/quant.py,
 * attention.write_kv).
 * Negative slots are padding and skipped. Returns -1 on bad arguments, -2 for a slot out of range.
 */
int kvpilot_write_kv(const void *k, const void *v, long k_stride, long v_stride, void *k_cache, void *v_cache,
                     const long *k_strides, const long *v_strides, uint16_t *k_scale, uint16_t *v_scale,
                     const int64_t *slots, int dtype, int cache_dtype, long T, int Hk, int D, int block_size,
                     long num_slots) {
    const int quantized = cache_dtype == DT_I8 || cache_dtype == DT_FP8;
    if ((dtype != DT_F32 && dtype != DT_BF16) || block_size <= 0 || D <= 0 || D > 1024) return -1;
    const int narrow = !quantized && cache_dtype == DT_BF16 && dtype == DT_F32;
    if (!quantized && cache_dtype != dtype && !narrow) return -1;
    if (quantized && (!k_scale || !v_scale)) return -1;
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
                const size_t at = (size_t)(blk * st[0] + off * st[1] + h * st[2]);
                if (quantized) {
                    float x[1024];
                    for (int d = 0; d < D; d++) x[d] = load(src, dtype, (size_t)d);
                    (c ? v_scale : k_scale)[(size_t)s * Hk + h] =
                        quantize_head(x, D, cache_dtype, (char *)(c ? v_cache : k_cache) + at, st[3]);
                    continue;
                }
                if (narrow) {
                    uint16_t *dst = (uint16_t *)(c ? v_cache : k_cache) + at;
                    for (int d = 0; d < D; d++) dst[(size_t)d * st[3]] = f32_to_bf16(((const float *)src)[d]);
                    continue;
                }
                char *dst = (char *)(c ? v_cache : k_cache) + at * es;
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

