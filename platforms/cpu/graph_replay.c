/* CPU decode graphs: a recorded list of kernel calls replayed in one call from Python.
 *
 * A decode step of a small model on the CPU is ~300 calls of the kernels in this library
 * (matmuls, norms, rotary, the KV write, attention). Each costs a few microseconds of
 * math, and about as much again of Python around it (module calls, argument checks,
 * tensor allocation, the ctypes call). `graphs.py` records the calls one eager step makes,
 * with every pointer the step touched kept alive, and `ps_graph_replay` makes them again
 * in order, with no Python between them: the CPU's analogue of a CUDA graph.
 *
 * A record holds the kernel's id and its arguments in order, each in one 64-bit slot:
 * integers and pointers as int64, float arguments as the float's bits in the low 32 bits.
 * The ids are `graphs.py`'s KERNEL_IDS; each case below calls its kernel with the
 * prototype of its own file.
 */

#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

/* ----- the KV-cache write: rows of K and V copied into their cache rows ---------------- */

/* For each of `tokens` tokens and `heads` KV heads, copies head_size * elem_bytes bytes of
 * K (at k + t * k_stride + h * k_head_stride, strides in elements) to cache row
 * rows_k[t * heads + h] of `table` (rows of head_size elements), and the same for V. The
 * CPU attention backend's `index_copy_` pair, without the copy that made the V slice of
 * the qkv projection contiguous. Returns 0, or 1 for a negative row. */
int ps_kv_write(void *table, const int64_t *rows_k, const int64_t *rows_v, const void *k, int64_t k_stride,
                int64_t k_head_stride, const void *v, int64_t v_stride, int64_t v_head_stride, int64_t tokens, int heads,
                int head_size, int elem_bytes) {
    size_t row_bytes = (size_t)head_size * elem_bytes;
    char *dst = (char *)table;
    for (int64_t t = 0; t < tokens; t++) {
        for (int h = 0; h < heads; h++) {
            int64_t i = t * heads + h;
            if (rows_k[i] < 0 || rows_v[i] < 0) return 1;
            memcpy(dst + rows_k[i] * row_bytes, (const char *)k + (t * k_stride + h * k_head_stride) * elem_bytes,
                   row_bytes);
            memcpy(dst + rows_v[i] * row_bytes, (const char *)v + (t * v_stride + h * v_head_stride) * elem_bytes,
                   row_bytes);
        }
    }
    return 0;
}

/* ----- replay ------------------------------------------------------------------------ */

#define PS_GRAPH_MAX_ARGS 24

typedef struct {
    int64_t kernel; /* graphs.py KERNEL_IDS */
    int64_t a[PS_GRAPH_MAX_ARGS];
} ps_graph_op;

enum {
    K_PAGED_DECODE = 1,
    K_RMS_NORM = 2,
    K_SILU_AND_MUL = 3,
    K_ROTARY = 4,
    K_GGUF_MATMUL = 5,
    K_GGUF_DEQUANTIZE = 6,
    K_GGUF_EMBEDDING = 7,
    K_KV_WRITE = 8,
    K_GGUF_GEMM = 9,
};

static inline float as_f32(int64_t slot) {
    uint32_t bits = (uint32_t)slot;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#define P(n) ((void *)(intptr_t)op->a[n])
#define I(n) (op->a[n])
#define N(n) ((int)op->a[n])
#define F(n) (as_f32(op->a[n]))

/* Runs ops[0..count) in order. Returns 0; else (index of the failing op + 1) * 1000 + its
 * kernel's nonzero return code (the kernels return small codes), or -(index + 1) for an
 * unknown kernel id. Every kernel checked its arguments when it was recorded. */
int64_t ps_graph_replay(const ps_graph_op *ops, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        const ps_graph_op *op = &ops[i];
        int rc;
        switch (op->kernel) {
        case K_PAGED_DECODE:
            rc = ps_paged_decode(P(0), I(1), P(2), P(3), I(4), P(5), P(6), P(7), P(8), P(9), P(10), N(11), N(12), N(13),
                                 N(14), N(15), N(16), F(17), F(18), N(19), P(20), P(21), N(22));
            break;
        case K_RMS_NORM:
            rc = ps_rms_norm(P(0), I(1), P(2), P(3), P(4), P(5), I(6), N(7), F(8), N(9), P(10), N(11));
            break;
        case K_SILU_AND_MUL:
            rc = ps_silu_and_mul(P(0), I(1), P(2), I(3), N(4), N(5), N(6));
            break;
        case K_ROTARY:
            rc = ps_rotary(P(0), P(1), I(2), I(3), P(4), I(5), I(6), P(7), P(8), P(9), I(10), N(11), N(12), N(13), N(14),
                           N(15), N(16), P(17), N(18));
            break;
        case K_GGUF_MATMUL:
            rc = ps_gguf_matmul(P(0), I(1), N(2), I(3), I(4), P(5), N(6), N(7), P(8), P(9), I(10), P(11), P(12), I(13),
                                N(14), N(15));
            break;
        case K_GGUF_GEMM:
            rc = ps_gguf_gemm(P(0), I(1), N(2), I(3), I(4), P(5), N(6), N(7), P(8), P(9), I(10), P(11), P(12), I(13),
                              N(14), N(15));
            break;
        case K_GGUF_DEQUANTIZE:
            rc = ps_gguf_dequantize(P(0), N(1), N(2), P(3), P(4), I(5), I(6), P(7), N(8), N(9));
            break;
        case K_GGUF_EMBEDDING:
            rc = ps_gguf_embedding(P(0), I(1), P(2), N(3), N(4), P(5), P(6), I(7), I(8), P(9), N(10));
            break;
        case K_KV_WRITE:
            rc = ps_kv_write(P(0), P(1), P(2), P(3), I(4), I(5), P(6), I(7), I(8), I(9), N(10), N(11), N(12));
            break;
        default:
            return -(i + 1);
        }
        if (rc != 0) return (i + 1) * 1000 + rc;
    }
    return 0;
}
