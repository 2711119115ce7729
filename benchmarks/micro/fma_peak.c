/*
 * The float32 FMA rate this CPU gives a thread at the kernels' ISA level (benchmarks/micro/attention.py
 * builds it with the attention kernel's flags): twelve independent chains of FMAs on full registers (16
 * lanes at avx512, 8 at avx2), enough to cover the FMA latency, so the figure is the issue rate: the
 * ceiling of a float32 kernel's arithmetic. Returns GFLOP/s per thread, the mean over `threads`
 * OpenMP threads running at once.
 */
#include <omp.h>

#ifdef __AVX512F__
#define LANES 16 /* a zmm register */
#else
#define LANES 8 /* a ymm register (avx2); 16 lanes would be two, and 24 of them spill out of 16 */
#endif
typedef float vf __attribute__((vector_size(4 * LANES)));

double kvpilot_fma_peak(long iters, int threads) {
    double total = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        vf a[12], b, c;
        for (int j = 0; j < 12; j++)
            for (int i = 0; i < LANES; i++) a[j][i] = 1.0f + 1e-3f * (float)(j + i);
        for (int i = 0; i < LANES; i++) b[i] = 0.999999f, c[i] = 1e-7f;
        const double t0 = omp_get_wtime();
        for (long n = 0; n < iters; n++) {
            for (int j = 0; j < 12; j++) a[j] = a[j] * b + c;
        }
        const double dt = omp_get_wtime() - t0;
        float s = 0.0f;
        for (int j = 0; j < 12; j++) s += a[j][0];
        total += (s == 12345.0f ? 0.0 : 12.0 * 2.0 * LANES * (double)iters / dt / 1e9);
    }
    return total / threads;
}
