/* y = x @ W^T (+ bias) for a few to a few dozen rows of bf16 x, W in the GGUF code layout
 * of gguf_matmul.c: the small-batch GEMM of batched decodes.
 *
 * Between the int8 dot products (best for 1-8 rows: they read 4-5 bits a weight) and
 * expanding the whole weight to bf16 for oneDNN (best for prompts), a batch of 8-64
 * decodes paid either ~50 us per row of x per SmolLM2 layer, or a 7 MB write and read of
 * the expanded weight per matmul. Here each thread expands 4 weight rows at a time into a
 * buffer that stays in L1 (4 x K bf16), then multiplies them with every row of x with
 * AVX512-BF16 dot products (vdpbf16ps, 32 products an instruction), 4 rows of x by 4 rows
 * of W per tile: 16 accumulators, 8 loads per 16 dot products. The expanded weights never
 * reach memory, and the call is one C call, so a decode graph (graph_replay.c) can record
 * it.
 *
 * Numerics are those of the expand-then-GEMM path: weights rounded to bf16, products
 * summed in float32 (in another order). Only bf16 x; needs AVX512-BF16 (returns -2
 * otherwise, and the caller uses the other paths).
 */

#include <stdlib.h>

#include "cpu_kernels.h"
#include "cpu_simd.h"
#include "gguf_codes.h"

#if PS_AVX512 && defined(__AVX512BF16__)
#define PS_GEMM_BF16 1
#else
#define PS_GEMM_BF16 0
#endif

int ps_gguf_gemm_available(void) { return PS_GEMM_BF16; }

#if PS_GEMM_BF16

#define TM 4 /* rows of x per tile */
#define TN 4 /* rows of W per tile */

/* one row of W (K codes) as bf16: scale * code + min per group */
static void expand_row(const uint8_t *wn, const uint16_t *sn, const uint16_t *mn, int64_t K, int bits, int group,
                       uint16_t *out) {
    for (int64_t b = 0; b < K / 32; b++) {
        __m512 v0, v1;
        gguf_block_values(wn, sn, mn, b, bits, group, &v0, &v1);
        /* cvtne2ps: the second operand fills the low half */
        _mm512_storeu_si512((void *)(out + b * 32), (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
    }
}

/* the sums of a, b, c, d's lanes, in that order */
static inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    __m256 ab = _mm256_hadd_ps(a8, b8), cd = _mm256_hadd_ps(c8, d8); /* a01 a23 b01 b23 | a45 a67 b45 b67 */
    __m256 abcd = _mm256_hadd_ps(ab, cd);                           /* a0-3 b0-3 c0-3 d0-3 | a4-7 ... */
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* out[m][n] = x row m . W row n for the TM x TN tile (xr: TM row pointers, wt: TN rows
 * of K bf16, contiguous) */
static inline void tile_dot(const uint16_t *const *xr, const uint16_t *wt, int64_t K, __m128 *out) {
    __m512 acc[TM][TN];
    for (int m = 0; m < TM; m++)
        for (int n = 0; n < TN; n++) acc[m][n] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh w[TN];
        for (int n = 0; n < TN; n++) w[n] = (__m512bh)_mm512_loadu_si512((const void *)(wt + n * K + k));
        for (int m = 0; m < TM; m++) {
            __m512bh a = (__m512bh)_mm512_loadu_si512((const void *)(xr[m] + k));
            for (int n = 0; n < TN; n++) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], a, w[n]);
        }
    }
    for (int m = 0; m < TM; m++) out[m] = hsum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
}

#endif

/* y[M, N] (row stride y_stride, y_dtype) = x[M, K] (bf16, row stride x_stride) @ W^T + bias.
 * The arguments of ps_gguf_matmul. Returns 0; -1 for bad arguments or no memory; -2 where
 * this build has no AVX512-BF16 or x is not bf16. */
int ps_gguf_gemm(const void *x, int64_t x_stride, int x_dtype, int64_t M, int64_t K, const uint8_t *w, int bits,
                 int group, const uint16_t *scales, const uint16_t *mins, int64_t N, const float *bias, void *y,
                 int64_t y_stride, int y_dtype, int nthreads) {
#if !PS_GEMM_BF16
    (void)x, (void)x_stride, (void)M, (void)K, (void)w, (void)bits, (void)group, (void)scales, (void)mins, (void)N;
    (void)bias, (void)y, (void)y_stride, (void)y_dtype, (void)nthreads;
    (void)x_dtype;
    return -2;
#else
    if ((bits != 4 && bits != 8) || (group != 16 && group != 32) || K % 32 || M <= 0 || N <= 0) return -1;
    if (x_dtype != PS_BF16) return -2;
    int64_t ng = K / group, wrow = bits == 8 ? K : K / 2;
    int ys = y_dtype == PS_F32 ? 4 : 2;
    int64_t tiles = (N + TN - 1) / TN;
    /* rows past M read this zero row (their results are not stored) */
    uint16_t *zero = calloc((size_t)K, sizeof(uint16_t));
    if (zero == NULL) return -1;
    int threads = nthreads > 0 ? nthreads : 1;
    if (tiles < 2 * threads) threads = 1;
    /* each thread's expanded weight rows (TN x K bf16), allocated before the parallel loop */
    size_t per = ((size_t)TN * K * sizeof(uint16_t) + 63) / 64 * 64;
    uint16_t *bufs = aligned_alloc(64, per * threads);
    if (bufs == NULL) {
        free(zero);
        return -1;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
#ifdef _OPENMP
        uint16_t *wt = (uint16_t *)((char *)bufs + per * omp_get_thread_num());
#else
        uint16_t *wt = bufs;
#endif
        int64_t n0 = t * TN;
        int nt = N - n0 < TN ? (int)(N - n0) : TN;
        for (int n = 0; n < TN; n++) {
            if (n < nt)
                expand_row(w + (n0 + n) * wrow, scales + (n0 + n) * ng, mins + (n0 + n) * ng, K, bits, group, wt + n * K);
            else
                memset(wt + n * K, 0, (size_t)K * sizeof(uint16_t));
        }
        float bn[TN];
        for (int n = 0; n < TN; n++) bn[n] = (bias != NULL && n < nt) ? bias[n0 + n] : 0.0f;
        for (int64_t m0 = 0; m0 < M; m0 += TM) {
            int mt = M - m0 < TM ? (int)(M - m0) : TM;
            const uint16_t *xr[TM];
            for (int m = 0; m < TM; m++)
                xr[m] = m < mt ? (const uint16_t *)((const char *)x + (m0 + m) * x_stride * 2) : zero;
            __m128 out[TM];
            tile_dot(xr, wt, K, out);
            for (int m = 0; m < mt; m++) {
                float v[4];
                _mm_storeu_ps(v, out[m]);
                char *yr = (char *)y + (m0 + m) * y_stride * ys;
                for (int n = 0; n < nt; n++) {
                    float r = v[n] + bn[n];
                    if (y_dtype == PS_F32) ((float *)yr)[n0 + n] = r;
                    else if (y_dtype == PS_BF16) ((uint16_t *)yr)[n0 + n] = f32_to_bf16(r);
                    else ((uint16_t *)yr)[n0 + n] = f32_to_f16(r);
                }
            }
        }
    }
    free(bufs);
    free(zero);
    return 0;
#endif
}
