/*
 * A stack of Llama-family decoder layers in one call, for CPU steps of few tokens (decode, speculative
 * verification, small prefill chunks), where a step's Python and torch dispatch cost more than its
 * arithmetic. Each layer runs the same kernels, in the same order, as the Python layer does:
 *
 *   x, res = rms_norm(h, res)                         (the first layer: x = rms_norm(h), res = h)
 *   qkv = x W_qkv^T (+ b);  [q, k = rms_norm of each head (Qwen3)];  rotary(q, k);  write_kv(k, v);
 *   a = paged_attention(q)
 *   x, res = rms_norm(a W_o^T (+ b), res)
 *   h = (silu(g) * u) W_down^T,  [g, u] = x W_gate_up^T
 *
 * The kernels come from the other libraries as function pointers (kernels/cpu_decoder.py passes the
 * exported functions of cpu_ops, paged_attention_cpu and qmatmul_cpu): nothing is compiled twice,
 * and every kernel keeps its own build flags: the stack's results equal the Python layers' bit for
 * bit (the only copy here is q out of the fused QKV output, as the attention call's .contiguous()).
 *
 * Weights are the tiled quantized layout (kvpilot_qmatmul_tiled). Returns 0, or the first failing
 * kernel's code plus 100 * (the stage: 1 norm, 2 qkv, 3 rotary, 4 write_kv, 5 attention, 6 o_proj,
 * 7 gate_up, 8 down, 9 silu_mul), or -1 on bad arguments, -3 out of memory.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "isa.h"
#include "kvpilot_kernels.h"

/* kv_linear, kv_layer and kv_step: kvpilot_kernels.h */

static int linear(const kv_step *s, const kv_linear *l, const void *x, void *out, long T) {
    return s->qmatmul(x, s->dtype, out, l->bias, T, l->in_features, l->out_features, l->codes, l->bits, l->group,
                      l->scales, l->mins, s->num_threads);
}

#define STAGE(call, stage)                                                                                     \
    do {                                                                                                       \
        const int rc_ = (call);                                                                                \
        if (rc_ != 0) {                                                                                        \
            rc = (rc_ < 0 ? -rc_ : rc_) + 100 * (stage);                                                       \
            goto done;                                                                                         \
        }                                                                                                      \
    } while (0)

/* hidden [T, H]: the embeddings in, the last layer's MLP output out; residual [T, H]: the running
 * residual out (the caller's final norm adds the two, as the Python model does). */
int kvpilot_decoder_stack(const kv_step *s, const kv_layer *layers, int num_layers, void *hidden, void *residual,
                          long T, long H) {
    if (!s || !layers || num_layers <= 0 || T <= 0 || H <= 0 || (s->dtype != DT_F32 && s->dtype != DT_BF16))
        return -1;
    const size_t es = s->dtype == DT_BF16 ? 2 : 4;
    const long q_size = (long)s->num_heads * s->head_dim, kv_size = (long)s->num_kv_heads * s->head_dim;
    const long qkv_size = q_size + 2 * kv_size, inter = layers[0].gate_up.out_features / 2;
    for (int l = 0; l < num_layers; l++) {
        const kv_layer *L = &layers[l];
        if (L->qkv.out_features != qkv_size || L->qkv.in_features != H || L->o.in_features != q_size ||
            L->o.out_features != H || L->gate_up.out_features != 2 * inter || L->gate_up.in_features != H ||
            L->down.in_features != inter || L->down.out_features != H)
            return -1;
    }
    char *xn = malloc(es * (size_t)(T * H)), *qkv = malloc(es * (size_t)(T * qkv_size));
    char *q = malloc(es * (size_t)(T * q_size)), *attn = malloc(es * (size_t)(T * q_size));
    char *o = malloc(es * (size_t)(T * H)), *gu = malloc(es * (size_t)(T * 2 * inter));
    char *act = malloc(es * (size_t)(T * inter));
    int rc = -3;
    if (!xn || !qkv || !q || !attn || !o || !gu || !act) goto done;
    rc = 0;
    memcpy(residual, hidden, es * (size_t)(T * H));
    for (int l = 0; l < num_layers; l++) {
        const kv_layer *L = &layers[l];
        if (l == 0)
            STAGE(s->rms_norm(hidden, NULL, NULL, xn, L->norm1, s->dtype, T, (int)H, L->eps1, s->num_threads), 1);
        else
            STAGE(s->rms_norm(hidden, residual, residual, xn, L->norm1, s->dtype, T, (int)H, L->eps1, s->num_threads),
                  1);
        STAGE(linear(s, &L->qkv, xn, qkv, T), 2);
        char *k = qkv + es * (size_t)q_size, *v = qkv + es * (size_t)(q_size + kv_size);
        if (L->q_norm) /* each token's heads are rows of head_dim, in place (the kernel is row by row) */
            for (long t = 0; t < T; t++) {
                char *qt = qkv + es * (size_t)(t * qkv_size), *kt = k + es * (size_t)(t * qkv_size);
                STAGE(s->rms_norm(qt, NULL, NULL, qt, L->q_norm, s->dtype, s->num_heads, s->head_dim, L->qk_eps,
                                  s->num_threads),
                      1);
                STAGE(s->rms_norm(kt, NULL, NULL, kt, L->k_norm, s->dtype, s->num_kv_heads, s->head_dim, L->qk_eps,
                                  s->num_threads),
                      1);
            }
        STAGE(s->rotary(qkv, k, qkv_size, qkv_size, s->positions, s->cos_sin, s->dtype, T, s->num_heads,
                        s->num_kv_heads, s->head_dim, s->rotary_dim, s->max_position, s->num_threads),
              3);
        STAGE(s->write_kv(k, v, qkv_size, qkv_size, L->k_cache, L->v_cache, L->k_strides, L->v_strides, L->k_scale,
                          L->v_scale, s->slots, s->dtype, s->kv_dtype, T, s->num_kv_heads, s->head_dim,
                          s->block_size, s->num_slots),
              4);
        for (long t = 0; t < T; t++) /* q as the attention kernel takes it: [T, Hq, D], contiguous */
            memcpy(q + es * (size_t)(t * q_size), qkv + es * (size_t)(t * qkv_size), es * (size_t)q_size);
        STAGE(s->attention(q, s->dtype, attn, L->k_cache, L->v_cache, s->kv_dtype, s->k_transposed, s->v_head_major,
                           L->k_scale, L->v_scale, s->block_tables, s->max_blocks, s->query_start_loc, s->seq_lens, s->num_seqs,
                           s->num_heads, s->num_kv_heads, s->head_dim, s->block_size, s->sm_scale, s->num_threads,
                           s->allow_fast),
              5);
        STAGE(linear(s, &L->o, attn, o, T), 6);
        STAGE(s->rms_norm(o, residual, residual, xn, L->norm2, s->dtype, T, (int)H, L->eps2, s->num_threads), 1);
        STAGE(linear(s, &L->gate_up, xn, gu, T), 7);
        STAGE(s->silu_mul(gu, act, s->dtype, T, inter, s->num_threads), 9);
        STAGE(linear(s, &L->down, act, hidden, T), 8);
    }
done:
    free(xn), free(qkv), free(q), free(attn), free(o), free(gu), free(act);
    return rc;
}
