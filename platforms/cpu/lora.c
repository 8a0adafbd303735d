/* LoRA adapters over one linear layer, mixed in a batch: the `lora_linear` op for a few
 * tokens (decode steps). y[t] += (x[t] A_s^T) Bt_s for each token t whose slot s >= 0.
 *
 * Shrink: one dot product of length `in` per (token, rank) pair, in float32.
 * Expand: Bt_s is stored [rank, out] (rows of outputs), so each token's term is a sum of
 * rank rows scaled by its shrunk values: broadcast FMAs over 64 outputs at a time, no
 * horizontal reductions; threads split the outputs, so every B row chunk is read once
 * per call and stays in cache for the tokens of its slot. y is rounded once, like the
 * torch reference (float32 accumulation, one conversion). */
#include "cpu_simd.h"

static inline float dot_row(const void *a, const float *v, int64_t n, int dtype) {
    int es = dtype == PS_F32 ? 4 : 2;
#if PS_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        int m = n - i < 16 ? (int)(n - i) : 16;
        __m512 av = load16((const char *)a + i * es, m, dtype);
        __m512 vv = _mm512_maskz_loadu_ps((__mmask16)((1u << m) - 1u), v + i);
        acc = _mm512_fmadd_ps(av, vv, acc);
    }
    return _mm512_reduce_add_ps(acc);
#else
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float av = dtype == PS_F32 ? ((const float *)a)[i] : dtype == PS_BF16 ? bf16_to_f32(((const uint16_t *)a)[i])
                                                                              : f16_to_f32(((const uint16_t *)a)[i]);
        acc += av * v[i];
    }
    return acc;
#endif
}

static inline float load_one(const void *p, int64_t i, int dtype) {
    if (dtype == PS_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return dtype == PS_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

static inline void store_one(void *p, int64_t i, float v, int dtype) {
    if (dtype == PS_F32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = dtype == PS_BF16 ? f32_to_bf16(v) : f32_to_f16(v);
}

/* up to GROUP tokens of one slot share each load (and bf16 conversion) of A and B */
#define GROUP 4

/* y [tokens, d_out] (rows y_stride elements apart), x [tokens, d_in] (x_stride apart),
 * a [slots, rank, d_in], bt [slots, rank, d_out] contiguous; slots [tokens] (-1: none).
 * scratch: tokens * (d_in + rank + 2) + 1 floats (8-byte aligned). */
int ps_lora_linear(void *y, int64_t y_stride, const void *x, int64_t x_stride, const void *a, const void *bt,
                   const int64_t *slots, int64_t tokens, int64_t d_in, int64_t d_out, int64_t rank, int64_t num_slots,
                   int dtype, float *scratch, int num_threads) {
    if (tokens < 0 || d_in <= 0 || d_out <= 0 || rank <= 0 || num_threads <= 0) return -1;
    if (dtype != PS_F32 && dtype != PS_BF16 && dtype != PS_F16) return -3;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= num_slots) return -2;
    int es = dtype == PS_F32 ? 4 : 2;
    float *xs = scratch, *shrunk = scratch + tokens * d_in;
    /* the tokens ordered by slot, cut into groups of <= GROUP tokens of one slot; the
     * int64 order starts on an 8-byte boundary of the scratch */
    int64_t order_at = tokens * (d_in + rank);
    int64_t *order = (int64_t *)(scratch + order_at + (order_at & 1)), n = 0;
    int64_t group_start[tokens + 1], num_groups = 0;
    for (int64_t s = 0; s < num_slots; s++) {
        int64_t run = 0;
        for (int64_t t = 0; t < tokens; t++) {
            if (slots[t] != s) continue;
            if (run % GROUP == 0) group_start[num_groups++] = n;
            order[n++] = t;
            run++;
        }
    }
    group_start[num_groups] = n;
    for (int64_t i = 0; i < n; i++)
        row_to_f32(xs + order[i] * d_in, (const char *)x + order[i] * x_stride * es, (int)d_in, dtype);
#pragma omp parallel for num_threads(num_threads) schedule(static) collapse(2)
    for (int64_t g = 0; g < num_groups; g++) {
        for (int64_t r = 0; r < rank; r++) {
            int64_t lo = group_start[g], m = group_start[g + 1] - lo, s = slots[order[lo]];
            const char *arow = (const char *)a + ((s * rank + r) * d_in) * es;
#if PS_AVX512
            __m512 acc[GROUP];
            for (int k = 0; k < GROUP; k++) acc[k] = _mm512_setzero_ps();
            for (int64_t i = 0; i < d_in; i += 16) {
                int w = d_in - i < 16 ? (int)(d_in - i) : 16;
                __mmask16 mask = (__mmask16)((1u << w) - 1u);
                __m512 av = load16(arow + i * es, w, dtype);
                for (int k = 0; k < m; k++)
                    acc[k] = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(mask, xs + order[lo + k] * d_in + i), acc[k]);
            }
            for (int k = 0; k < m; k++) shrunk[order[lo + k] * rank + r] = _mm512_reduce_add_ps(acc[k]);
#else
            for (int k = 0; k < m; k++) shrunk[order[lo + k] * rank + r] = dot_row(arow, xs + order[lo + k] * d_in, d_in, dtype);
#endif
        }
    }
    int64_t chunks = (d_out + 63) / 64;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t o0 = c * 64, width = d_out - o0 < 64 ? d_out - o0 : 64;
        for (int64_t g = 0; g < num_groups; g++) {
            int64_t lo = group_start[g], m = group_start[g + 1] - lo, s = slots[order[lo]];
            const char *brow = (const char *)bt + ((s * rank) * d_out + o0) * es;
#if PS_AVX512
            int vecs = (int)((width + 15) / 16);
            __m512 acc[GROUP][4];
            for (int k = 0; k < GROUP; k++)
                for (int v = 0; v < 4; v++) acc[k][v] = _mm512_setzero_ps();
            for (int64_t r = 0; r < rank; r++) {
                const char *row = brow + r * d_out * es;
                __m512 b[4];
                for (int v = 0; v < vecs; v++) {
                    int w = width - v * 16 < 16 ? (int)(width - v * 16) : 16;
                    b[v] = load16(row + (int64_t)v * 16 * es, w, dtype);
                }
                for (int k = 0; k < m; k++) {
                    __m512 wv = _mm512_set1_ps(shrunk[order[lo + k] * rank + r]);
                    for (int v = 0; v < vecs; v++) acc[k][v] = _mm512_fmadd_ps(wv, b[v], acc[k][v]);
                }
            }
            for (int k = 0; k < m; k++) {
                char *yrow = (char *)y + (order[lo + k] * y_stride + o0) * es;
                for (int v = 0; v < vecs; v++) {
                    int w = width - v * 16 < 16 ? (int)(width - v * 16) : 16;
                    char *dst = yrow + (int64_t)v * 16 * es;
                    store16(dst, _mm512_add_ps(load16(dst, w, dtype), acc[k][v]), w, dtype);
                }
            }
#else
            for (int k = 0; k < m; k++) {
                int64_t t = order[lo + k];
                const float *wr = shrunk + t * rank;
                char *yrow = (char *)y + (t * y_stride + o0) * es;
                float acc[64] = {0};
                for (int64_t r = 0; r < rank; r++)
                    for (int64_t i = 0; i < width; i++) acc[i] += wr[r] * load_one(brow + r * d_out * es, i, dtype);
                for (int64_t i = 0; i < width; i++) store_one(yrow, i, load_one(yrow, i, dtype) + acc[i], dtype);
            }
#endif
        }
    }
    return 0;
}
