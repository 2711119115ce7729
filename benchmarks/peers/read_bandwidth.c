/* The read-only memory bandwidth a few threads reach: what a batch-1 decode step is bound by.
 *
 * A decode step reads its weights and writes almost nothing, so its ceiling is a read stream, not a copy.
 * The two differ: on a 2-core Zen 4 VM a copy measured 51-61 GB/s counting read + write bytes where a
 * read stream on the same two threads reached 30-34 GB/s (2026-12-06, docs/benchmarks.md). A plain
 * stream, so an engine may beat it by a little: a ceiling to within a few percent.
 * benchmarks/peers/measure.read_bandwidth builds and calls this. Plain C (auto-vectorized at the ISA
 * level the runtime's kernels are built for), OpenMP threads.
 */
#include <omp.h>
#include <stdint.h>

/* the best seconds of `rounds` passes over buf[0, n) (n a multiple of 64 * threads) on `threads`
 * threads, each reading its contiguous share; software prefetch `pf` bytes ahead (0: none, the hardware
 * prefetchers alone). *sink gets the sum (mod 2^64) of the words a pass read, so that no pass is optimized away. */
double kvpilot_bench_read(const uint64_t *buf, long n, int threads, long pf, int rounds, uint64_t *sink) {
    double best = 1e30;
    const long words = n / 8, share = words / threads, ahead = pf / 8;
    for (int r = 0; r < rounds; r++) {
        uint64_t total = 0;
        const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : total)
        {
            const uint64_t *p = buf + (long)omp_get_thread_num() * share;
            uint64_t acc[8] = {0};
            for (long i = 0; i < share; i += 8) {
                if (ahead) __builtin_prefetch(p + i + ahead, 0, 2);
                for (int j = 0; j < 8; j++) acc[j] += p[i + j];
            }
            for (int j = 0; j < 8; j++) total += acc[j];
        }
        const double dt = omp_get_wtime() - t0;
        if (dt < best) best = dt;
        *sink = total;
    }
    return best;
}
