/* The CPU platform's fused layer ops (framework/interfaces/ops.py): RMSNorm with and
 * without the residual add, SiLU-and-mul and rotary embedding, one pass over the data
 * each instead of the 3-10 torch ops (and as many Python dispatches) of the layers' own
 * code. Rows are split over OpenMP threads only when there are enough of them (prefill):
 * a decode step's few rows are faster on the calling thread alone.
 *
 * Numerics are the layers' torch code's (itself transformers'), rounding where it rounds,
 * so greedy outputs do not depend on whether the C kernels are there: RMSNorm normalises
 * in float32, rounds to the activation dtype, multiplies by the weight and rounds again;
 * the residual add rounds; SiLU-and-mul rounds silu(gate), then the product; rotary
 * rounds cos and sin to the activation dtype and every product and sum of
 * `x * cos + rotate_half(x) * sin`. (In float32 every rounding is exact.)
 */

#include "cpu_kernels.h"
#include "cpu_simd.h"

/* rows x cols elements: parallel only above this many (a thread fork costs ~ a few us) */
#define PS_PARALLEL_ELEMENTS (1 << 16)

static inline float silu_f32(float g) { return g / (1.0f + expf(-g)); }

/* the first 2 * half elements of x rotated (rounding like torch's ops in `dtype`) into r */
static inline void rotate_pairs(const float *x, float *r, int half, const float *cosv, const float *sinv, int is_neox,
                                int dtype) {
    for (int i = 0; i < half; i++) {
        int a = is_neox ? i : 2 * i, b = is_neox ? i + half : 2 * i + 1;
        float c = round_to(cosv[i], dtype), s = round_to(sinv[i], dtype);
        float x1 = x[a], x2 = x[b];
        r[a] = round_to(round_to(x1 * c, dtype) - round_to(x2 * s, dtype), dtype);
        r[b] = round_to(round_to(x2 * c, dtype) + round_to(x1 * s, dtype), dtype);
    }
}

/* One row of RMSNorm: out = round(round(r * inv_rms) * w), r = x (+ residual, rounded,
 * written to res_out when residual is given). */
static void rms_row(const void *x, const void *residual, void *res_out, void *out, const void *w, int h, float eps,
                    int dtype, float *tmp) {
    int es = dtype == PS_F32 ? 4 : 2;
#if PS_AVX512
    __m512 ss = _mm512_setzero_ps();
    for (int i = 0; i < h; i += 16) {
        int n = h - i < 16 ? h - i : 16;
        __m512 v = load16((const char *)x + (int64_t)i * es, n, dtype);
        if (residual != NULL) {
            v = round16(_mm512_add_ps(v, load16((const char *)residual + (int64_t)i * es, n, dtype)), dtype);
            store16((char *)res_out + (int64_t)i * es, v, n, dtype);
        }
        _mm512_storeu_ps(tmp + i, v);
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)h + eps);
    __m512 iv = _mm512_set1_ps(inv);
    for (int i = 0; i < h; i += 16) {
        int n = h - i < 16 ? h - i : 16;
        /* rounded to the activation dtype before the weight */
        __m512 v = round16(_mm512_mul_ps(_mm512_loadu_ps(tmp + i), iv), dtype);
        v = _mm512_mul_ps(v, load16((const char *)w + (int64_t)i * es, n, dtype));
        store16((char *)out + (int64_t)i * es, v, n, dtype);
    }
#else
    row_to_f32(tmp, x, h, dtype);
    if (residual != NULL) {
        float *r = tmp + h;
        row_to_f32(r, residual, h, dtype);
        for (int i = 0; i < h; i++) tmp[i] += r[i];
        store_row(res_out, tmp, 1.0f, h, dtype);
        row_to_f32(tmp, res_out, h, dtype);
    }
    (void)es;
    float ss = 0.0f;
    for (int i = 0; i < h; i++) ss += tmp[i] * tmp[i];
    float inv = 1.0f / sqrtf(ss / (float)h + eps);
    float *wf = tmp + h;
    row_to_f32(wf, w, h, dtype);
    for (int i = 0; i < h; i++) {
        float v = tmp[i] * inv;
        if (dtype == PS_BF16) v = bf16_to_f32(f32_to_bf16(v));
        else if (dtype == PS_F16) v = f16_to_f32(f32_to_f16(v));
        tmp[i] = v * wf[i];
    }
    store_row(out, tmp, 1.0f, h, dtype);
#endif
}

/* Floats of per-thread workspace the row ops need. */
int64_t ps_fused_workspace_floats(int h) { return 2 * (int64_t)h + 32; }

/* RMSNorm over rows of h elements. x rows are x_stride elements apart; out, residual and
 * res_out are contiguous [rows, h]; residual NULL: no add. `workspace` holds num_threads *
 * ps_fused_workspace_floats(h) floats. */
int ps_rms_norm(const void *x, int64_t x_stride, const void *residual, void *res_out, void *out, const void *w,
                int64_t rows, int h, float eps, int dtype, float *workspace, int num_threads) {
    if (h <= 0 || rows < 0 || num_threads <= 0) return -1;
    if (dtype != PS_F32 && dtype != PS_BF16 && dtype != PS_F16) return -3;
    int es = dtype == PS_F32 ? 4 : 2;
    int64_t ws = ps_fused_workspace_floats(h);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * h >= PS_PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
#ifdef _OPENMP
        float *tmp = workspace + (int64_t)omp_get_thread_num() * ws;
#else
        float *tmp = workspace;
#endif
        rms_row((const char *)x + r * x_stride * es, residual ? (const char *)residual + r * h * es : NULL,
                residual ? (char *)res_out + r * h * es : NULL, (char *)out + r * h * es, w, h, eps, dtype, tmp);
    }
    return 0;
}

/* out[r, i] = silu(x[r, i]) * x[r, d + i] in float32, rounded once. x rows x_stride apart. */
int ps_silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int d, int dtype, int num_threads) {
    if (d <= 0 || rows < 0 || num_threads <= 0) return -1;
    if (dtype != PS_F32 && dtype != PS_BF16 && dtype != PS_F16) return -3;
    int es = dtype == PS_F32 ? 4 : 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * d >= PS_PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const char *g = (const char *)x + r * x_stride * es, *u = g + (int64_t)d * es;
        char *o = (char *)out + r * d * es;
#if PS_AVX512
        const __m512 one = _mm512_set1_ps(1.0f);
        for (int i = 0; i < d; i += 16) {
            int n = d - i < 16 ? d - i : 16;
            __m512 gv = load16(g + (int64_t)i * es, n, dtype), uv = load16(u + (int64_t)i * es, n, dtype);
            __m512 sg = _mm512_div_ps(gv, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            store16(o + (int64_t)i * es, _mm512_mul_ps(round16(sg, dtype), uv), n, dtype);
        }
#else
        for (int i = 0; i < d; i++) {
            float gv, uv;
            row_to_f32(&gv, g + (int64_t)i * es, 1, dtype);
            row_to_f32(&uv, u + (int64_t)i * es, 1, dtype);
            float v = round_to(silu_f32(gv), dtype) * uv;
            store_row(o + (int64_t)i * es, &v, 1.0f, 1, dtype);
        }
#endif
    }
    return 0;
}

/* Rotate `heads` heads of one token: pairs (i, i + half) (neox) or (2i, 2i + 1) (gpt-j)
 * of the first 2 * half elements by angle i; the rest of each head is copied. */
static void rotate_heads(const char *src, int64_t head_stride, char *dst, int heads, int head_size, int half,
                         const float *cs, int is_neox, int dtype, float *tmp) {
    int es = dtype == PS_F32 ? 4 : 2;
    const float *cosv = cs, *sinv = cs + half;
    for (int hh = 0; hh < heads; hh++) {
        const char *s = src + (int64_t)hh * head_stride * es;
        char *o = dst + (int64_t)hh * head_size * es;
        row_to_f32(tmp, s, head_size, dtype);
        float *r = tmp + head_size;
        rotate_pairs(tmp, r, half, cosv, sinv, is_neox, dtype);
        for (int i = 2 * half; i < head_size; i++) r[i] = tmp[i];
        store_row(o, r, 1.0f, head_size, dtype);
    }
}

#if PS_AVX512
/* rotate_heads for the neox style, 16 pairs at a time; cs holds cos and sin already
 * rounded to `dtype` */
static void rotate_heads_neox16(const char *src, int64_t head_stride, char *dst, int heads, int head_size, int half,
                                const float *cs, int dtype) {
    int es = dtype == PS_F32 ? 4 : 2;
    for (int hh = 0; hh < heads; hh++) {
        const char *s = src + (int64_t)hh * head_stride * es;
        char *o = dst + (int64_t)hh * head_size * es;
        for (int i = 0; i < half; i += 16) {
            int n = half - i < 16 ? half - i : 16;
            __m512 c = _mm512_loadu_ps(cs + i), sn = _mm512_loadu_ps(cs + half + i);
            __m512 x1 = load16(s + (int64_t)i * es, n, dtype), x2 = load16(s + (int64_t)(i + half) * es, n, dtype);
            __m512 o1 = _mm512_sub_ps(round16(_mm512_mul_ps(x1, c), dtype), round16(_mm512_mul_ps(x2, sn), dtype));
            __m512 o2 = _mm512_add_ps(round16(_mm512_mul_ps(x2, c), dtype), round16(_mm512_mul_ps(x1, sn), dtype));
            store16(o + (int64_t)i * es, o1, n, dtype);
            store16(o + (int64_t)(i + half) * es, o2, n, dtype);
        }
        if (2 * half < head_size) memcpy(o + (int64_t)2 * half * es, s + (int64_t)2 * half * es, (size_t)(head_size - 2 * half) * es);
    }
}
#endif

/* Rotary embedding of q and k (new contiguous outputs). q rows (tokens) q_stride apart,
 * heads q_head_stride apart; likewise k. table: [max_positions, 2 * half] float32, cos
 * then sin; index: [tokens] int64 rows of table. workspace: num_threads * (3 * head_size + 16). */
int ps_rotary(const int64_t *index, const void *q, int64_t q_stride, int64_t q_head_stride, const void *k,
              int64_t k_stride, int64_t k_head_stride, void *q_out, void *k_out, const float *table, int64_t tokens,
              int num_q_heads, int num_k_heads, int head_size, int rotary_dim, int is_neox, int dtype, float *workspace,
              int num_threads) {
    if (head_size <= 0 || rotary_dim % 2 || rotary_dim > head_size || tokens < 0 || num_threads <= 0) return -1;
    if (dtype != PS_F32 && dtype != PS_BF16 && dtype != PS_F16) return -3;
    int es = dtype == PS_F32 ? 4 : 2, half = rotary_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (tokens * (num_q_heads + num_k_heads) * head_size >= PS_PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
#ifdef _OPENMP
        float *tmp = workspace + (int64_t)omp_get_thread_num() * (3 * head_size + 16);
#else
        float *tmp = workspace;
#endif
        const float *cs = table + index[t] * (int64_t)rotary_dim;
#if PS_AVX512
        if (is_neox) {
            /* cos and sin rounded to the activation dtype once per token (a multiple of 16 floats
             * past the row buffer's end) */
            float *csr = tmp + 2 * head_size;
            for (int i = 0; i < rotary_dim; i += 16) {
                int n = rotary_dim - i < 16 ? rotary_dim - i : 16;
                _mm512_mask_storeu_ps(csr + i, (__mmask16)((1u << n) - 1u), round16(_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), cs + i), dtype));
            }
            rotate_heads_neox16((const char *)q + t * q_stride * es, q_head_stride,
                                (char *)q_out + t * num_q_heads * head_size * es, num_q_heads, head_size, half, csr, dtype);
            rotate_heads_neox16((const char *)k + t * k_stride * es, k_head_stride,
                                (char *)k_out + t * num_k_heads * head_size * es, num_k_heads, head_size, half, csr, dtype);
            continue;
        }
#endif
        rotate_heads((const char *)q + t * q_stride * es, q_head_stride, (char *)q_out + t * num_q_heads * head_size * es,
                     num_q_heads, head_size, half, cs, is_neox, dtype, tmp);
        rotate_heads((const char *)k + t * k_stride * es, k_head_stride, (char *)k_out + t * num_k_heads * head_size * es,
                     num_k_heads, head_size, half, cs, is_neox, dtype, tmp);
    }
    return 0;
}

/* Structured outputs' mask: logits[r, t] = -inf where bit t % 32 of mask[r, t / 32] is 0.
   float32 logits rows `stride` floats apart; mask rows `words` int32 apart. A word with
   every bit set (an allowed run, or a row without a grammar) is skipped whole. */
int ps_apply_token_bitmask(void *logits, int64_t stride, const int32_t *mask, int64_t words, int64_t rows,
                           int64_t vocab, int num_threads) {
    if (rows < 0 || vocab < 0 || words * 32 < vocab || num_threads <= 0) return -1;
    const float neg_inf = -__builtin_inff();
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * vocab >= PS_PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float *row = (float *)logits + r * stride;
        const int32_t *m = mask + r * words;
        for (int64_t w = 0; w * 32 < vocab; w++) {
            uint32_t bits = (uint32_t)m[w];
            if (bits == 0xFFFFFFFFu) continue;
            int64_t base = w * 32, n = vocab - base < 32 ? vocab - base : 32;
            for (int64_t j = 0; j < n; j++)
                if (!((bits >> j) & 1u)) row[base + j] = neg_inf;
        }
    }
    return 0;
}
