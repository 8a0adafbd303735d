/* y = x @ W^T (+ bias) with W kept as GGUF-style integer codes (framework/gguf/blocks.py):
 * w = scale[g] * code + min[g] per group g of `group` (16 or 32) weights of a row.
 *
 * Weight layout (repacked once at load by platforms/cpu/gguf_linear.py):
 *   bits 4: [N, K / 2] bytes; each run of 32 weights is 16 bytes, byte j holding weight j
 *           in its low nibble and weight 16 + j in its high one (ggml's Q4_0 order);
 *   bits 8: [N, K] bytes, in order;
 *   scales, mins: float16 [N, K / group].
 *
 * The AVX512-VNNI path (llama.cpp's approach) quantizes each row of x to int8 with one
 * scale per block of 32 values (as llama.cpp's Q8 activations), in the order the weight bytes pair with, and multiplies unsigned
 * codes by signed activations with vpdpbusd (4 products per 32-bit lane), so a weight
 * byte is unpacked once per tile of up to 4 rows of x and costs no float work:
 *   y[m, n] = sum_g scale[n, g] * sum_{i in g} code_i * xs32 * xq_i  +  min[n, g] * sum_{i in g} x_i
 * The second term sums the int8-rounded x, so the result is exactly the matmul of the
 * rounded activations (llama.cpp's Q8_1 sums do the same). Without VNNI (or without AVX-512) a
 * plain float loop computes the same sum from x itself.
 *
 * Rows of W are split over OpenMP threads (torch's threads: see native.py).
 */

#include <stdlib.h>

#include "cpu_kernels.h"
#include "cpu_simd.h"
#include "gguf_codes.h"

#if PS_AVX512 && defined(__AVX512VNNI__)
#define PS_VNNI 1
#else
#define PS_VNNI 0
#endif

#define PS_MT 4 /* rows of x per tile */

static inline float load_x(const void *x, int64_t i, int dtype) {
    if (dtype == PS_F32) return ((const float *)x)[i];
    if (dtype == PS_BF16) return bf16_to_f32(((const uint16_t *)x)[i]);
    return f16_to_f32(((const uint16_t *)x)[i]);
}

static inline void store_y(void *y, int64_t i, float v, int dtype) {
    if (dtype == PS_F32) ((float *)y)[i] = v;
    else if (dtype == PS_BF16) ((uint16_t *)y)[i] = f32_to_bf16(v);
    else ((uint16_t *)y)[i] = f32_to_f16(v);
}

/* The float sum of each group of x's row (for the min term). */
static void group_sums(const float *xf, int64_t K, int group, float *xsum) {
    for (int64_t g = 0; g < K / group; g++) {
        float s = 0.0f;
        for (int i = 0; i < group; i++) s += xf[g * group + i];
        xsum[g] = s;
    }
}

/* The code of weight k of a row (see the layout above). */
static inline int code_at(const uint8_t *row, int64_t k, int bits) {
    if (bits == 8) return row[k];
    uint8_t byte = row[(k / 32) * 16 + (k & 15)];
    return (k & 31) < 16 ? (byte & 0x0F) : (byte >> 4);
}

/* ----- the plain float path ---------------------------------------------------------- */

/* sum_g scale[g] * sum_{i in g} code_i * x_i (the min term is added by the caller) */
static float dot_plain(const float *xf, const uint8_t *w, const uint16_t *sc, int64_t K, int bits, int group) {
    float acc = 0.0f;
    for (int64_t g = 0; g < K / group; g++) {
        float s = 0.0f;
        for (int i = 0; i < group; i++) {
            int64_t k = g * group + i;
            s += (float)code_at(w, k, bits) * xf[k];
        }
        acc += f16_to_f32(sc[g]) * s;
    }
    return acc;
}

#if PS_VNNI
/* ----- the VNNI path ------------------------------------------------------------------ */

/* x8 position of weight k, the order weight bytes pair with. Bits 8: k itself. Bits 4: x
 * is cut into chunks of 4 blocks of 32 (then a chunk of 2 and one of 1 at the end, as K
 * allows); a chunk lists the first 16 values of each of its blocks, then the last 16 of
 * each, so one load of weight bytes and its low (high) nibbles meet one load of x. */
static inline int64_t kernel_pos(int64_t k, int64_t K, int bits) {
    if (bits == 8) return k;
    int64_t c0 = k & ~(int64_t)127, blocks = 4;
    if (c0 + 128 > K) { /* the tail: a chunk of 2 blocks, then one of 1 */
        int64_t rest = K - c0;
        if (rest >= 64 && k < c0 + 64) blocks = 2;
        else if (rest >= 64) { c0 += 64; blocks = 1; }
        else blocks = 1;
    }
    int64_t r = k - c0, blk = r >> 5, j = r & 31;
    return c0 + (j < 16 ? blk * 16 + j : blocks * 16 + blk * 16 + (j - 16));
}

/* One row of x -> int8 in kernel order with one scale per block of 32 values (xs32). */
static void quantize_row(const float *xf, int64_t K, int bits, int8_t *xq, float *xs32, float *tmp) {
    for (int64_t b = 0; b < K / 32; b++) {
        __m512 v0 = _mm512_loadu_ps(xf + b * 32), v1 = _mm512_loadu_ps(xf + b * 32 + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        xs32[b] = amax / 127.0f;
        __m512 s = _mm512_set1_ps(id);
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, s)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, s));
        _mm_storeu_si128((__m128i *)(tmp + b * 8), _mm512_cvtsepi32_epi8(q0)); /* tmp: int8 in natural order */
        _mm_storeu_si128((__m128i *)(tmp + b * 8 + 4), _mm512_cvtsepi32_epi8(q1));
    }
    const int8_t *nat = (const int8_t *)tmp;
    for (int64_t k = 0; k < K; k++) xq[kernel_pos(k, K, bits)] = nat[k];
}

/* n float16 weight scales (4, or 2 in lanes 0-1) as floats */
static inline __m128 weight_scales(const uint16_t *p, int n) {
    return _mm_cvtph_ps(n == 4 ? _mm_loadl_epi64((const __m128i *)p)
                               : _mm_cvtsi32_si128((int)((uint32_t)p[0] | (uint32_t)p[1] << 16)));
}

/* weight scales w times x's block scales, spread over 16 lanes by idx */
static inline __m512 lane_scales(__m128 w, const float *xs, __m512i idx, int xs_per) {
    __m128 x;
    if (xs_per == 1) x = _mm_loadu_ps(xs);  /* one x block per weight scale */
    else x = _mm_setr_ps(xs[0], xs[0], xs[1], xs[1]); /* 16-wide weight groups: two per x block */
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_mul_ps(w, x)));
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[m, n] for mt rows m of one weight row n (without the min term). Always inlined into
 * dot_vnni's cases: with mt a constant the loops over m unroll and the accumulators stay
 * in registers. */
static inline __attribute__((always_inline)) void dot_vnni_mt(const int mt, const int8_t *const *xq, const float *const *xs, const uint8_t *w, const uint16_t *sc,
                     int64_t K, int bits, int group, float *out) {
    __m512 acc[PS_MT];
    for (int m = 0; m < mt; m++) acc[m] = _mm512_setzero_ps();
    const __m512i nib = _mm512_set1_epi8(0x0F);
    const __m512i by4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i by8 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    int64_t k = 0;
    if (bits == 8) {
        /* 64 codes: lanes 0-7 x block k/32, 8-15 the next; weight groups of 32 or 16 */
        for (; k + 64 <= K; k += 64) {
            __m512i wv = _mm512_loadu_si512((const void *)(w + k));
            __m128 ws = group == 32 ? weight_scales(sc + k / 32, 2) : weight_scales(sc + k / 16, 4);
            for (int m = 0; m < mt; m++) {
                __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, _mm512_loadu_si512((const void *)(xq[m] + k)));
                __m512 f = group == 32 ? lane_scales(ws, xs[m] + k / 32, by8, 1) : lane_scales(ws, xs[m] + k / 32, by4, 2);
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), f, acc[m]);
            }
        }
    } else {
        /* 128 codes in 64 bytes: low nibbles = the first 16 of 4 blocks, high = the last 16 */
        for (; k + 128 <= K; k += 128) {
            __m512i wv = _mm512_loadu_si512((const void *)(w + k / 2));
            __m512i lo = _mm512_and_si512(wv, nib), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), nib);
            __m128 ws = group == 32 ? weight_scales(sc + k / 32, 4) : _mm_setzero_ps();
            for (int m = 0; m < mt; m++) {
                __m512i xlo = _mm512_loadu_si512((const void *)(xq[m] + k)), xhi = _mm512_loadu_si512((const void *)(xq[m] + k + 64));
                if (group == 32) { /* both halves of a block share its scales: add in int32 */
                    __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo), hi, xhi);
                    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), lane_scales(ws, xs[m] + k / 32, by4, 1), acc[m]);
                } else {
                    __m512i slo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo);
                    __m512i shi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, xhi);
                    for (int half = 0; half < 2; half++) {
                        /* scales of the first (second) 16 of each of the 4 blocks */
                        const uint16_t *g = sc + k / 16 + half;
                        __m128 wsc = _mm_cvtph_ps(_mm_setr_epi16((short)g[0], (short)g[2], (short)g[4], (short)g[6], 0, 0, 0, 0));
                        __m512 f = _mm512_permutexvar_ps(by4, _mm512_castps128_ps512(_mm_mul_ps(wsc, _mm_loadu_ps(xs[m] + k / 32))));
                        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(half ? shi : slo), f, acc[m]);
                    }
                }
            }
        }
    }
    /* the tail, 32 codes at a time (after 128-code chunks: chunks of 2 blocks and 1 block) */
    __m256 acc8[PS_MT];
    for (int m = 0; m < mt; m++) acc8[m] = _mm256_setzero_ps();
    const int64_t t0 = k; /* bits 4: a chunk of 2 blocks starts here when 64 or 96 codes are left */
    for (; k < K; k += 32) {
        const int pair = bits == 4 && K - t0 >= 64 && k < t0 + 64;
        __m256i both; /* lanes 0-3: the block's first 16 codes, 4-7: its last 16 */
        if (bits == 8) {
            both = _mm256_loadu_si256((const __m256i *)(w + k));
        } else {
            __m128i wv = _mm_loadu_si128((const __m128i *)(w + k / 2)), n4 = _mm_set1_epi8(0x0F);
            both = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(wv, 4), n4), _mm_and_si128(wv, n4));
        }
        __m256 ws = group == 32 ? _mm256_set1_ps(f16_to_f32(sc[k / 32]))
                                : _mm256_setr_m128(_mm_set1_ps(f16_to_f32(sc[k / 16])), _mm_set1_ps(f16_to_f32(sc[k / 16 + 1])));
        for (int m = 0; m < mt; m++) {
            /* x in kernel order: a tail chunk of 2 blocks at t0 is [b0 lo, b1 lo, b0 hi, b1 hi] */
            __m256i xv;
            if (pair && k == t0) {
                xv = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(xq[m] + k + 32)), _mm_loadu_si128((const __m128i *)(xq[m] + k)));
            } else if (pair && k == t0 + 32) {
                xv = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(xq[m] + k + 16)), _mm_loadu_si128((const __m128i *)(xq[m] + k - 16)));
            } else {
                xv = _mm256_loadu_si256((const __m256i *)(xq[m] + k));
            }
            __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), both, xv);
            acc8[m] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), ws), _mm256_set1_ps(xs[m][k / 32]), acc8[m]);
        }
    }
    for (int m = 0; m < mt; m++) out[m] = _mm512_reduce_add_ps(acc[m]) + hsum256(acc8[m]);
}
static void dot_vnni(int mt, const int8_t *const *xq, const float *const *xs, const uint8_t *w, const uint16_t *sc,
                     int64_t K, int bits, int group, float *out) {
    switch (mt) {
    case 1: dot_vnni_mt(1, xq, xs, w, sc, K, bits, group, out); break;
    case 2: dot_vnni_mt(2, xq, xs, w, sc, K, bits, group, out); break;
    case 3: dot_vnni_mt(3, xq, xs, w, sc, K, bits, group, out); break;
    default: dot_vnni_mt(4, xq, xs, w, sc, K, bits, group, out); break;
    }
}
#endif

static inline float min_term(const uint16_t *mn, const float *xsum, int64_t ngroups) {
    float s = 0.0f;
    int64_t g = 0;
#if PS_AVX512
    __m256 acc = _mm256_setzero_ps();
    for (; g + 8 <= ngroups; g += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + g))), _mm256_loadu_ps(xsum + g), acc);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    s = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#endif
    for (; g < ngroups; g++) s += f16_to_f32(mn[g]) * xsum[g];
    return s;
}

/* Whether this build has the int8 dot-product path (for the plan and the tests). */
int ps_gguf_vnni(void) { return PS_VNNI; }

/* y[M, N] (row stride y_stride, y_dtype) = x[M, K] (row stride x_stride, x_dtype) @ W^T + bias.
 * bias: float32 [N] or NULL. Returns 0, or -1 for bad arguments / no memory. */
int ps_gguf_matmul(const void *x, int64_t x_stride, int x_dtype, int64_t M, int64_t K, const uint8_t *w, int bits,
                   int group, const uint16_t *scales, const uint16_t *mins, int64_t N, const float *bias, void *y,
                   int64_t y_stride, int y_dtype, int nthreads) {
    if ((bits != 4 && bits != 8) || (group != 16 && group != 32) || K % 32 || M <= 0 || N <= 0) return -1;
    int es = x_dtype == PS_F32 ? 4 : 2;
    int64_t ng = K / group, wrow = bits == 8 ? K : K / 2;
    /* per row of x: float values, group sums, and for VNNI int8 values, scales and a
     * scratch row (per row, so rows are prepared in parallel in a prefill) */
    float *xf = malloc(sizeof(float) * (size_t)(M * K + M * ng + M * (K / 32) + M * (K + 16)));
    int8_t *xq = malloc((size_t)(M * K) + 64);
    if (xf == NULL || xq == NULL) {
        free(xf);
        free(xq);
        return -1;
    }
    float *xsum = xf + M * K, *xs32 = xsum + M * ng, *tmps = xs32 + M * (K / 32);
    int prep_threads = (nthreads > 1 && M >= 8) ? nthreads : 1;
#pragma omp parallel for schedule(static) num_threads(prep_threads)
    for (int64_t m = 0; m < M; m++) {
        float *tmp = tmps + m * (K + 16);
        for (int64_t k = 0; k < K; k++) xf[m * K + k] = load_x((const char *)x + m * x_stride * es, k, x_dtype);
#if PS_VNNI
        quantize_row(xf + m * K, K, bits, xq + m * K, xs32 + m * (K / 32), tmp);
        /* the min term sums the int8-rounded x: y is then exactly the matmul of the rounded x
         * (with the exact sums, rounding errors of the code term would not cancel against it) */
        for (int64_t k = 0; k < K; k++) {
            int64_t p = kernel_pos(k, K, bits);
            tmp[k] = xs32[m * (K / 32) + k / 32] * (float)xq[m * K + p];
        }
        group_sums(tmp, K, group, xsum + m * ng);
#else
        (void)tmp;
        group_sums(xf + m * K, K, group, xsum + m * ng);
#endif
    }
    int threads = nthreads > 0 ? nthreads : 1;
    if (N * (M < 4 ? M : 4) * K < (1 << 16)) threads = 1; /* too small to pay for a fork */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wn = w + n * wrow;
        const uint16_t *sn = scales + n * ng, *mnn = mins + n * ng;
        float bn = bias != NULL ? bias[n] : 0.0f;
        for (int64_t m0 = 0; m0 < M; m0 += PS_MT) {
            int mt = M - m0 < PS_MT ? (int)(M - m0) : PS_MT;
            float out[PS_MT];
#if PS_VNNI
            const int8_t *xqs[PS_MT];
            const float *xss[PS_MT];
            for (int m = 0; m < mt; m++) {
                xqs[m] = xq + (m0 + m) * K;
                xss[m] = xs32 + (m0 + m) * (K / 32);
            }
            dot_vnni(mt, xqs, xss, wn, sn, K, bits, group, out);
#else
            for (int m = 0; m < mt; m++) out[m] = dot_plain(xf + (m0 + m) * K, wn, sn, K, bits, group);
#endif
            for (int m = 0; m < mt; m++) {
                float v = out[m] + min_term(mnn, xsum + (m0 + m) * ng, ng) + bn;
                store_y((char *)y + (m0 + m) * y_stride * (y_dtype == PS_F32 ? 4 : 2), n, v, y_dtype);
            }
        }
    }
    free(xf);
    free(xq);
    return 0;
}

/* Rows [n0, n1) of W dequantized into out[n1 - n0, K] (out_dtype: float32 or bfloat16), for a
 * prefill's matmul in the platform's GEMM: at 32+ rows of x a bf16 GEMM with the weight
 * expanded once per call beats the int8 dot products. */
int ps_gguf_dequantize(const uint8_t *w, int bits, int group, const uint16_t *scales, const uint16_t *mins, int64_t N,
                       int64_t K, void *out, int out_dtype, int nthreads) {
    if ((bits != 4 && bits != 8) || (group != 16 && group != 32) || K % 32 || (out_dtype != PS_F32 && out_dtype != PS_BF16))
        return -1;
    int64_t ng = K / group, wrow = bits == 8 ? K : K / 2;
    int threads = nthreads > 0 ? nthreads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wn = w + n * wrow;
        char *on = (char *)out + n * K * (out_dtype == PS_F32 ? 4 : 2);
        for (int64_t b = 0; b < K / 32; b++) { /* one block of 32 codes at a time */
#if PS_AVX512
            __m512 v0, v1;
            gguf_block_values(wn, scales + n * ng, mins + n * ng, b, bits, group, &v0, &v1);
            store16(on + (b * 32) * (out_dtype == PS_F32 ? 4 : 2), v0, 16, out_dtype);
            store16(on + (b * 32 + 16) * (out_dtype == PS_F32 ? 4 : 2), v1, 16, out_dtype);
#else
            for (int j = 0; j < 32; j++) {
                int64_t k = b * 32 + j;
                float v = f16_to_f32(scales[n * ng + k / group]) * (float)code_at(wn, k, bits) + f16_to_f32(mins[n * ng + k / group]);
                store_y(on, k, v, out_dtype);
            }
#endif
        }
    }
    return 0;
}

/* Rows `ids` of the table W (same layout) dequantized into out[len(ids), K] (out_dtype). */
int ps_gguf_embedding(const int64_t *ids, int64_t count, const uint8_t *w, int bits, int group, const uint16_t *scales,
                      const uint16_t *mins, int64_t N, int64_t K, void *out, int out_dtype) {
    int64_t ng = K / group, wrow = bits == 8 ? K : K / 2;
    for (int64_t t = 0; t < count; t++) {
        int64_t n = ids[t];
        if (n < 0 || n >= N) return -1;
        const uint8_t *wn = w + n * wrow;
        for (int64_t k = 0; k < K; k++) {
            int64_t g = k / group;
            float v = f16_to_f32(scales[n * ng + g]) * (float)code_at(wn, k, bits) + f16_to_f32(mins[n * ng + g]);
            store_y((char *)out + t * K * (out_dtype == PS_F32 ? 4 : 2), k, v, out_dtype);
        }
    }
    return 0;
}
