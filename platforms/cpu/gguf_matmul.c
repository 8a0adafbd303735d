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
 * scale per 16 values, in the order the weight bytes pair with, and multiplies unsigned
 * codes by signed activations with vpdpbusd (4 products per 32-bit lane), so a weight
 * byte is unpacked once per tile of up to 4 rows of x and costs no float work:
 *   y[m, n] = sum_g scale[n, g] * sum_{i in g} code_i * xs16 * xq_i  +  min[n, g] * sum_{i in g} x_i
 * The second term sums the int8-rounded x, so the result is exactly the matmul of the
 * rounded activations (llama.cpp's Q8_1 sums do the same). Without VNNI (or without AVX-512) a
 * plain float loop computes the same sum from x itself.
 *
 * Rows of W are split over OpenMP threads (torch's threads: see native.py).
 */

#include <stdlib.h>

#include "cpu_simd.h"

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

/* ----- the plain float path ---------------------------------------------------------- */

/* sum_g scale[g] * sum_{i in g} code_i * x_i (the min term is added by the caller) */
static float dot_plain(const float *xf, const uint8_t *w, const uint16_t *sc, int64_t K, int bits, int group) {
    float acc = 0.0f;
    for (int64_t g = 0; g < K / group; g++) {
        float s = 0.0f;
        for (int i = 0; i < group; i++) {
            int64_t k = g * group + i;
            int code;
            if (bits == 8) {
                code = w[k];
            } else {
                int64_t blk = k / 32, j = k % 32;
                uint8_t byte = w[blk * 16 + (j & 15)];
                code = j < 16 ? (byte & 0x0F) : (byte >> 4);
            }
            s += (float)code * xf[k];
        }
        acc += f16_to_f32(sc[g]) * s;
    }
    return acc;
}

#if PS_VNNI
/* ----- the VNNI path ------------------------------------------------------------------ */

/* x8 position of weight k (the order weight bytes pair with): bits 8 keep k; bits 4 put,
 * in each 64 weights, [0..16) [32..48) then [16..32) [48..64) (a last run of 32: as is). */
static inline int64_t kernel_pos(int64_t k, int64_t K, int bits) {
    if (bits == 8) return k;
    int64_t base = k & ~(int64_t)63, r = k & 63;
    if (base + 64 > K) return k; /* the trailing 32 */
    int64_t blk = r >> 5, j = r & 31;
    return base + (j < 16 ? blk * 16 + j : 32 + blk * 16 + (j - 16));
}

/* One row of x -> int8 in kernel order with a scale per 16 (xs16, also in kernel order). */
static void quantize_row(const float *xf, int64_t K, int bits, int8_t *xq, float *xs16, float *tmp) {
    for (int64_t k = 0; k < K; k++) tmp[kernel_pos(k, K, bits)] = xf[k];
    for (int64_t g = 0; g < K / 16; g++) {
        __m512 v = _mm512_loadu_ps(tmp + g * 16);
        float amax = _mm512_reduce_max_ps(_mm512_abs_ps(v));
        float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        xs16[g] = d;
        __m512i q = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(id)),
                                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm_storeu_si128((__m128i *)(xq + g * 16), _mm512_cvtsepi32_epi8(q));
    }
}

static inline __m256 expand2(const float *p) { /* lanes 0-3 p[0], lanes 4-7 p[1] */
    return _mm256_permutexvar_ps(_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_castps128_ps256(_mm_loadu_ps(p)));
}

static inline __m256 expand2h(const uint16_t *p, int step) { /* lanes 0-3 p[0], lanes 4-7 p[step] */
    __m128i h = _mm_setr_epi16((short)p[0], (short)p[step], 0, 0, 0, 0, 0, 0);
    return _mm256_permutexvar_ps(_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_castps128_ps256(_mm_cvtph_ps(h)));
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[m, n] for mt rows m of one weight row n (without the min term). */
static void dot_vnni(int mt, const int8_t *const *xq, const float *const *xs, const uint8_t *w, const uint16_t *sc,
                     int64_t K, int bits, int group, float *out) {
    __m256 acc[PS_MT];
    for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
    const __m256i nib = _mm256_set1_epi8(0x0F);
    if (bits == 8) {
        for (int64_t k = 0; k < K; k += 32) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k));
            __m256 ws = group == 16 ? expand2h(sc + k / 16, 1) : _mm256_set1_ps(f16_to_f32(sc[k / 32]));
            for (int m = 0; m < mt; m++) {
                __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv, _mm256_loadu_si256((const __m256i *)(xq[m] + k)));
                __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(s), expand2(xs[m] + k / 16));
                acc[m] = _mm256_fmadd_ps(f, ws, acc[m]);
            }
        }
    } else {
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k / 2));
            __m256i lo = _mm256_and_si256(wv, nib), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), nib);
            __m256 ws_lo, ws_hi; /* lanes 0-3: the first 32 weights' group, 4-7: the second's */
            if (group == 32) {
                ws_lo = ws_hi = expand2h(sc + k / 32, 1);
            } else {
                ws_lo = expand2h(sc + k / 16, 2);
                ws_hi = expand2h(sc + k / 16 + 1, 2);
            }
            for (int m = 0; m < mt; m++) {
                __m256i slo = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i *)(xq[m] + k)));
                __m256i shi = _mm256_dpbusd_epi32(_mm256_setzero_si256(), hi, _mm256_loadu_si256((const __m256i *)(xq[m] + k + 32)));
                __m256 flo = _mm256_mul_ps(_mm256_cvtepi32_ps(slo), expand2(xs[m] + k / 16));
                __m256 fhi = _mm256_mul_ps(_mm256_cvtepi32_ps(shi), expand2(xs[m] + k / 16 + 2));
                acc[m] = _mm256_fmadd_ps(flo, ws_lo, acc[m]);
                acc[m] = _mm256_fmadd_ps(fhi, ws_hi, acc[m]);
            }
        }
        if (k < K) { /* a last run of 32: 16 bytes, low nibbles then high ones */
            __m128i wv = _mm_loadu_si128((const __m128i *)(w + k / 2));
            __m128i n4 = _mm_set1_epi8(0x0F);
            __m256i both = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(wv, 4), n4), _mm_and_si128(wv, n4));
            __m256 ws = group == 32 ? _mm256_set1_ps(f16_to_f32(sc[k / 32])) : expand2h(sc + k / 16, 1);
            for (int m = 0; m < mt; m++) {
                __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), both, _mm256_loadu_si256((const __m256i *)(xq[m] + k)));
                __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(s), expand2(xs[m] + k / 16));
                acc[m] = _mm256_fmadd_ps(f, ws, acc[m]);
            }
        }
    }
    for (int m = 0; m < mt; m++) out[m] = hsum256(acc[m]);
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
    /* per row of x: float values, group sums, and for VNNI int8 values + scales */
    float *xf = malloc(sizeof(float) * (size_t)(M * K + M * ng + M * (K / 16) + K));
    int8_t *xq = malloc((size_t)(M * K) + 64);
    if (xf == NULL || xq == NULL) {
        free(xf);
        free(xq);
        return -1;
    }
    float *xsum = xf + M * K, *xs16 = xsum + M * ng, *tmp = xs16 + M * (K / 16);
    for (int64_t m = 0; m < M; m++) {
        for (int64_t k = 0; k < K; k++) xf[m * K + k] = load_x((const char *)x + m * x_stride * es, k, x_dtype);
#if PS_VNNI
        quantize_row(xf + m * K, K, bits, xq + m * K, xs16 + m * (K / 16), tmp);
        /* the min term sums the int8-rounded x: y is then exactly the matmul of the rounded x
         * (with the exact sums, rounding errors of the code term would not cancel against it) */
        for (int64_t k = 0; k < K; k++) {
            int64_t p = kernel_pos(k, K, bits);
            tmp[k] = xs16[m * (K / 16) + p / 16] * (float)xq[m * K + p];
        }
        group_sums(tmp, K, group, xsum + m * ng);
#else
        group_sums(xf + m * K, K, group, xsum + m * ng);
#endif
    }
    (void)tmp;
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
                xss[m] = xs16 + (m0 + m) * (K / 16);
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

/* Rows `ids` of the table W (same layout) dequantized into out[len(ids), K] (out_dtype). */
int ps_gguf_embedding(const int64_t *ids, int64_t count, const uint8_t *w, int bits, int group, const uint16_t *scales,
                      const uint16_t *mins, int64_t N, int64_t K, void *out, int out_dtype) {
    int64_t ng = K / group, wrow = bits == 8 ? K : K / 2;
    for (int64_t t = 0; t < count; t++) {
        int64_t n = ids[t];
        if (n < 0 || n >= N) return -1;
        const uint8_t *wn = w + n * wrow;
        for (int64_t k = 0; k < K; k++) {
            int code;
            if (bits == 8) {
                code = wn[k];
            } else {
                int64_t blk = k / 32, j = k % 32;
                uint8_t byte = wn[blk * 16 + (j & 15)];
                code = j < 16 ? (byte & 0x0F) : (byte >> 4);
            }
            int64_t g = k / group;
            float v = f16_to_f32(scales[n * ng + g]) * (float)code + f16_to_f32(mins[n * ng + g]);
            store_y((char *)out + t * K * (out_dtype == PS_F32 ? 4 : 2), k, v, out_dtype);
        }
    }
    return 0;
}
