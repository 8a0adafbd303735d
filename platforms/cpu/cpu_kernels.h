/* The entry points of the CPU platform's C library (see native.py's _SIGNATURES), declared
 * once: every file that defines one includes this, so the compiler checks each
 * definition against the declaration graph_replay.c's replay switch calls through. */

#ifndef PORTASERVE_CPU_KERNELS_H
#define PORTASERVE_CPU_KERNELS_H

#include <stdint.h>

int ps_kv_write(void *table, const int64_t *rows_k, const int64_t *rows_v, const void *k, int64_t k_stride,
                int64_t k_head_stride, const void *v, int64_t v_stride, int64_t v_head_stride, int64_t tokens, int heads,
                int head_size, int elem_bytes);

int ps_paged_decode(const void *q, int64_t q_stride, const void *cache, const int32_t *block_table, int64_t bt_stride,
                    const int32_t *seq_idx, const int32_t *token_idx, const int32_t *kv_start, const int32_t *kv_len,
                    const int32_t *part_off, void *out, int num_decodes, int num_heads, int num_kv_heads, int head_size,
                    int block_size, int dtype, float scale, float soft_cap, int part_len, float *scratch,
                    float *workspace, int num_threads);
int ps_rms_norm(const void *x, int64_t x_stride, const void *residual, void *res_out, void *out, const void *w,
                int64_t rows, int h, float eps, int dtype, float *workspace, int num_threads);
int ps_silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int d, int dtype, int num_threads);
int ps_apply_token_bitmask(void *logits, int64_t stride, const int32_t *mask, int64_t words, int64_t rows,
                           int64_t vocab, int num_threads);
int ps_rotary(const int64_t *index, const void *q, int64_t q_stride, int64_t q_head_stride, const void *k,
              int64_t k_stride, int64_t k_head_stride, void *q_out, void *k_out, const float *table, int64_t tokens,
              int num_q_heads, int num_k_heads, int head_size, int rotary_dim, int is_neox, int dtype, float *workspace,
              int num_threads);
int ps_gguf_matmul(const void *x, int64_t x_stride, int x_dtype, int64_t M, int64_t K, const uint8_t *w, int bits,
                   int group, const uint16_t *scales, const uint16_t *mins, int64_t N, const float *bias, void *y,
                   int64_t y_stride, int y_dtype, int nthreads);
int ps_gguf_gemm(const void *x, int64_t x_stride, int x_dtype, int64_t M, int64_t K, const uint8_t *w, int bits,
                 int group, const uint16_t *scales, const uint16_t *mins, int64_t N, const float *bias, void *y,
                 int64_t y_stride, int y_dtype, int nthreads);
int ps_gguf_dequantize(const uint8_t *w, int bits, int group, const uint16_t *scales, const uint16_t *mins, int64_t N,
                       int64_t K, void *out, int out_dtype, int nthreads);
int ps_gguf_embedding(const int64_t *ids, int64_t count, const uint8_t *w, int bits, int group, const uint16_t *scales,
                      const uint16_t *mins, int64_t N, int64_t K, void *out, int out_dtype);

#endif
