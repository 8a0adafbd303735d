/* Shared helpers of the CPU platform's C kernels (paged_decode.c, fused_ops.c): dtype
 * codes, scalar conversions between float32 and bf16 / fp16 (round to nearest even, NaN
 * kept), row conversions and, on AVX-512, a vector exp. Header-only (static inline). */

#ifndef PORTASERVE_CPU_SIMD_H
#define PORTASERVE_CPU_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PS_AVX512 1
#else
#define PS_AVX512 0
#if defined(__F16C__)
#include <immintrin.h>
#endif
#endif

enum { PS_F32 = 0, PS_BF16 = 1, PS_F16 = 2 };


/* ----- scalar conversions -------------------------------------------------------------- */

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
#if PS_AVX512 || defined(__F16C__)
    /* one instruction (vcvtph2ps), exact like the bit manipulation below; in the GGUF
     * kernels' per-block scale loads the software version cost a third of the time */
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400u));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);      /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);     /* overflow -> inf */
    if (a < 0x38800000u) {                                      /* subnormal or zero */
        float v;
        memcpy(&v, &a, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(v * 16777216.0f)); /* v / 2^-24, nearest even */
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - ((uint32_t)(127 - 15) << 23);
    return (uint16_t)(sign | (r >> 13));
}

/* One row of `n` elements of `dtype` at `src` -> float32 `dst`. */
static inline void row_to_f32(float *dst, const void *src, int n, int dtype) {
    int i = 0;
    if (dtype == PS_F32) {
        memcpy(dst, src, (size_t)n * 4);
        return;
    }
    const uint16_t *s = (const uint16_t *)src;
#if PS_AVX512
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(s + i));
        __m512 v = dtype == PS_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                                    : _mm512_cvtph_ps(h);
        _mm512_storeu_ps(dst + i, v);
    }
#endif
    for (; i < n; i++) dst[i] = dtype == PS_BF16 ? bf16_to_f32(s[i]) : f16_to_f32(s[i]);
}

/* v rounded to `dtype`'s precision (torch's reduced-precision ops round every result) */
static inline float round_to(float v, int dtype) {
    if (dtype == PS_BF16) return bf16_to_f32(f32_to_bf16(v));
    if (dtype == PS_F16) return f16_to_f32(f32_to_f16(v));
    return v;
}

static inline void store_row(void *dst, const float *src, float mul, int n, int dtype) {
    if (dtype == PS_F32) {
        float *d = (float *)dst;
        for (int i = 0; i < n; i++) d[i] = src[i] * mul;
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    for (int i = 0; i < n; i++) d[i] = dtype == PS_BF16 ? f32_to_bf16(src[i] * mul) : f32_to_f16(src[i] * mul);
}

#if PS_AVX512
/* e^x as 2^n * p(r) with |r| <= ln2 / 2, |rel err| < 2e-7; x is clamped to [-104, 88]
 * (0 and 1.6e38 at the ends, no inf). */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* n (<= 16) elements of `dtype` at `src` as float32 lanes (the rest zero) */
static inline __m512 load16(const void *src, int n, int dtype) {
    __mmask16 m = (__mmask16)((1u << n) - 1u);
    if (dtype == PS_F32) return _mm512_maskz_loadu_ps(m, src);
    __m256i h = _mm256_maskz_loadu_epi16(m, src);
    if (dtype == PS_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* v's lanes as `dtype` (bf16 / fp16) bits, rounded to nearest even */
static inline __m256i to_half16(__m512 v, int dtype) {
    __m256i h;
    if (dtype == PS_BF16) {
#if defined(__AVX512BF16__)
        h = (__m256i)_mm512_cvtneps_pbh(v);
#else
        __m512i u = _mm512_castps_si512(v);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
        __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
        h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
    } else {
        h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    return h;
}

/* v rounded to `dtype`'s precision (float32 lanes again) */
static inline __m512 round16(__m512 v, int dtype) {
    if (dtype == PS_F32) return v;
    __m256i h = to_half16(v, dtype);
    if (dtype == PS_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* the first n (<= 16) lanes of v to `dst` as `dtype`, rounded to nearest even */
static inline void store16(void *dst, __m512 v, int n, int dtype) {
    __mmask16 m = (__mmask16)((1u << n) - 1u);
    if (dtype == PS_F32) {
        _mm512_mask_storeu_ps(dst, m, v);
        return;
    }
    _mm256_mask_storeu_epi16(dst, m, to_half16(v, dtype));
}
#endif

#endif
