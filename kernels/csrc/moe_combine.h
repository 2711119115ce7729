/* The last step of a fused Mixture-of-Experts call, shared by moe_cpu.c (16-bit / float32 experts)
 * and qmatmul_cpu.c (quantized experts): each token's top-k expert outputs combined with its routing
 * weights in float32, rounded once to the output dtype. */
#ifndef KVPILOT_MOE_COMBINE_H
#define KVPILOT_MOE_COMBINE_H

#include <stdint.h>

#include "dtypes.h"

/* out[t] = sum over t's slots j held here (row_of[t * topk + j] >= 0) of wts[t * topk + j] *
 * partial[row_of[...]], for T tokens of width H; `bf16`: out is bfloat16, else float32. Tokens in
 * parallel where there is enough work to pay for the threads. */
static inline void moe_combine(void *out, int bf16, long T, long H, int topk, const long *row_of, const float *wts,
                               const float *partial, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * H * topk >= 65536)
    for (long t = 0; t < T; t++)
        for (long h = 0; h < H; h++) {
            float v = 0.0f;
            for (int j = 0; j < topk; j++) {
                const long r = row_of[t * topk + j];
                if (r >= 0) v += wts[t * topk + j] * partial[r * H + h];
            }
            if (bf16)
                ((uint16_t *)out)[t * H + h] = f32_to_bf16(v);
            else
                ((float *)out)[t * H + h] = v;
        }
}

#endif
