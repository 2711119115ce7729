/* Scalar conversions between float32 and the 16-bit storage types, shared by the CPU extensions. */
#ifndef KVPILOT_DTYPES_H
#define KVPILOT_DTYPES_H

#include <stdint.h>
#include <string.h>

/* element type codes, the same in every extension and in kernels/cpu_ops.py DTYPE_CODES: activations are
 * DT_F32 or DT_BF16 (DT_F16 too for attention); KV caches any of them, DT_I8 and DT_FP8 (float8 e4m3fn)
 * with per-(token, head) float16 scales */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_I8 = 3, DT_FP8 = 4 };

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
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    _Float16 x;
    memcpy(&x, &h, 2);
    return (float)x;
}

static inline uint16_t f32_to_f16(float f) { /* round to nearest even */
    _Float16 x = (_Float16)f;
    uint16_t h;
    memcpy(&h, &x, 2);
    return h;
}

#endif
