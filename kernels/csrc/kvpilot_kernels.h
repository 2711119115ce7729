/*
 * The C ABI of kvpilot's CPU kernels: every function a library in kernels/csrc exports, and the
 * structs kvpilot_decoder_stack takes. Each .c file includes this header, so the compiler checks
 * every definition against its declaration here; the ctypes declarations in kernels/*.py are
 * checked against it by tests/kernels/test_c_abi.py (names, argument count and types, return type,
 * struct fields). Change a signature here first.
 *
 * What the arguments mean, and the error codes a function returns (0: done), is written above its
 * definition in the .c file.
 */
#ifndef KVPILOT_KERNELS_H
#define KVPILOT_KERNELS_H

#include <stdint.h>

/* every library (isa.h): the ISA level it was compiled for, "avx512", "avx2" or "generic" */
const char *kvpilot_isa(void);

/* cpu_ops.c */
int kvpilot_rms_norm(const void *x, const void *residual, void *sum_out, void *out, const void *weight,
                     int dtype, long T, int H, float eps, int num_threads);
int kvpilot_rotary(void *q, void *k, long q_stride, long k_stride, const int64_t *positions,
                   const float *cos_sin, int dtype, long T, int Hq, int Hk, int D, int R, long max_position,
                   int num_threads);
int kvpilot_write_kv(const void *k, const void *v, long k_stride, long v_stride, void *k_cache, void *v_cache,
                     const long *k_strides, const long *v_strides, uint16_t *k_scale, uint16_t *v_scale,
                     const int64_t *slots, int dtype, int cache_dtype, long T, int Hk, int D, int block_size,
                     long num_slots);
int kvpilot_silu_mul(const void *gu, void *out, int dtype, long T, long I, int num_threads);

/* paged_attention_cpu.c */
int kvpilot_fast_path(int num_q_heads, int num_kv_heads, int head_dim, int block_size, int kv_dtype,
                      int k_transposed); /* 1 when the vectorized path takes these shapes */
int kvpilot_paged_attention(const void *q, int q_dtype, void *out, const void *k_cache, const void *v_cache,
                            int kv_dtype, int k_transposed, int v_head_major, const uint16_t *k_scale,
                            const uint16_t *v_scale, const int32_t *block_tables, int max_blocks,
                            const int32_t *query_start_loc, const int32_t *seq_lens, int num_seqs,
                            int num_q_heads, int num_kv_heads, int head_dim, int block_size, float sm_scale,
                            int num_threads, int allow_fast);

/* qmatmul_cpu.c */
int kvpilot_qmatmul(const void *x, int dtype, void *out, const void *bias, long M, long K, long N,
                    const uint8_t *w, int wbits, int group, const uint16_t *scales, const uint16_t *mins,
                    int num_threads, int int8_activations);
int kvpilot_qmatmul_tiled(const void *x, int dtype, void *out, const void *bias, long M, long K, long N,
                          const uint8_t *w, int wbits, int group, const uint16_t *scales, const uint16_t *mins,
                          int num_threads);
int kvpilot_qmatmul_tiled_float(const void *x, int dtype, void *out, const void *bias, long M, long K, long N,
                                const uint8_t *w, int wbits, int group, const uint16_t *scales,
                                const uint16_t *mins, int num_threads);
int kvpilot_qmatmul_tiled_bf16(const void *x, int dtype, void *out, const void *bias, long M, long K, long N,
                               const uint8_t *w, int wbits, int group, const uint16_t *scales,
                               const uint16_t *mins, int num_threads);
int kvpilot_qmatmul_tiled_i16(const void *x, int dtype, void *out, const void *bias, long M, long K, long N,
                              const uint8_t *w, int wbits, int group, const uint16_t *scales,
                              const uint16_t *mins, int num_threads);
int kvpilot_round_i16(const void *x, int dtype, void *out, long M, long K, int wbits, int group, int num_threads);
int kvpilot_dequantize(const uint8_t *w, int wbits, int group, const uint16_t *scales, const uint16_t *mins,
                       long N, long K, void *out, int dtype, int num_threads);
int kvpilot_qmoe(const void *x, int dtype, void *out, long T, long H, long I, int topk, const int64_t *ids,
                 const float *wts, long E, long offset, const uint8_t *const *w13, const uint16_t *const *s13,
                 const uint16_t *const *m13, const uint8_t *const *w2, const uint16_t *const *s2,
                 const uint16_t *const *m2, int wbits, int group, int tiled, int num_threads);

/* qgemm_cpu.c */
int kvpilot_qgemm(const void *x, int dtype, void *out, const void *bias, long M, long K, long N, const uint8_t *w,
                  int wbits, int group, const uint16_t *scales, const uint16_t *mins, int num_threads);

/* moe_cpu.c */
int kvpilot_moe_bf16_dot(void); /* 1 when built with the bf16 dot-product instructions */
int kvpilot_moe(const void *x, int dtype, void *out, long T, long H, long I, int topk, const int64_t *ids,
                const float *wts, long E, long offset, const void *w13, const void *w2, int num_threads);

/* decoder_cpu.c: a stack of Llama-family decoder layers in one call (kernels/cpu_decoder.py) */

/* one quantized linear layer (tiled layout) */
typedef struct {
    const uint8_t *codes;
    const uint16_t *scales, *mins;
    const void *bias;
    long out_features, in_features;
    int bits, group;
} kv_linear;

/* one decoder layer: its weights and its slice of the KV pool */
typedef struct {
    const void *norm1, *norm2; /* RMSNorm weights, in the activations' dtype */
    float eps1, eps2;
    kv_linear qkv, o, gate_up, down;
    void *k_cache, *v_cache;
    long k_strides[4], v_strides[4]; /* elements, of the logical [blocks, block_size, Hk, D] cache */
    uint16_t *k_scale, *v_scale;     /* [blocks * block_size, Hk] float16: int8 / fp8 caches only, else NULL */
    const void *q_norm, *k_norm;     /* RMSNorm of each query / key head (Qwen3), head_dim weights; else NULL */
    float qk_eps;
} kv_layer;

/* what every layer of one step shares; the kernels are the other libraries' exported functions */
typedef struct {
    __typeof__(kvpilot_rms_norm) *rms_norm;
    __typeof__(kvpilot_rotary) *rotary;
    __typeof__(kvpilot_write_kv) *write_kv;
    __typeof__(kvpilot_paged_attention) *attention;
    __typeof__(kvpilot_silu_mul) *silu_mul;
    __typeof__(kvpilot_qmatmul_tiled) *qmatmul;
    int dtype, num_heads, num_kv_heads, head_dim, rotary_dim, kv_dtype, k_transposed, v_head_major;
    int block_size, max_blocks, num_seqs, num_threads, allow_fast;
    long num_slots, max_position;
    float sm_scale;
    const int64_t *positions, *slots;
    const float *cos_sin;
    const int32_t *block_tables, *query_start_loc, *seq_lens;
} kv_step;

int kvpilot_decoder_stack(const kv_step *s, const kv_layer *layers, int num_layers, void *hidden, void *residual,
                          long T, long H);

#endif
