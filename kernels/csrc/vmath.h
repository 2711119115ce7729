/* Vectorizable math shared by the CPU extensions (plain float arithmetic, no libm calls). */
#ifndef KVPILOT_VMATH_H
#define KVPILOT_VMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/*
 * exp(x) in plain float arithmetic that the compiler vectorizes without -ffast-math (libm's expf is a
 * call per element): x = n ln2 + r with n = rint(x / ln2) (a vector round instruction) and ln2 in
 * two parts, Cephes' degree-6 polynomial for e^r, times 2^n built in the exponent bits. Within ~2 ulp
 * of expf over [-87.3, 88]; infinity above 88.72 as expf (tests/kernels/test_cpu_ops.py).
 */
static inline float exp_poly(float x0) {
    float x = x0 < -87.3f ? -87.3f : x0;
    x = x > 88.0f ? 88.0f : x;
    const float n = __builtin_rintf(x * 1.44269504088896341f); /* vroundps: survives -fassociative-math */
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return x0 > 88.72f ? INFINITY : p * scale; /* where expf overflows (silu(-100) is then -0, as torch's) */
}

/* silu(g) = g / (1 + exp(-g)) with exp_poly */
static inline float silu_poly(float g) { return g / (1.0f + exp_poly(-g)); }

#endif
