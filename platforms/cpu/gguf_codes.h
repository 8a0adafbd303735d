/* Reading the GGUF code layout of gguf_matmul.c: one block of 32 weights as floats.
 * Shared by the expand-for-oneDNN path (gguf_matmul.c) and the small-batch GEMM
 * (gguf_gemm.c). Header-only (static inline). */

#ifndef PORTASERVE_GGUF_CODES_H
#define PORTASERVE_GGUF_CODES_H

#include "cpu_simd.h"

#if PS_AVX512
/* Weights 32b .. 32b + 31 of a row (codes wn, float16 scales sn and mins mn of the row):
 * *v0 = weights 0-15 of the block, *v1 = 16-31, each scale * code + min of its group. */
static inline void gguf_block_values(const uint8_t *wn, const uint16_t *sn, const uint16_t *mn, int64_t b, int bits,
                                     int group, __m512 *v0, __m512 *v1) {
    __m128i c0, c1; /* codes 0-15 and 16-31 as bytes */
    if (bits == 8) {
        c0 = _mm_loadu_si128((const __m128i *)(wn + b * 32));
        c1 = _mm_loadu_si128((const __m128i *)(wn + b * 32 + 16));
    } else { /* 16 bytes: weight j in the low nibble of byte j, weight 16 + j in its high one */
        __m128i v = _mm_loadu_si128((const __m128i *)(wn + b * 16)), n4 = _mm_set1_epi8(0x0F);
        c0 = _mm_and_si128(v, n4);
        c1 = _mm_and_si128(_mm_srli_epi16(v, 4), n4);
    }
    int64_t g0 = group == 32 ? b : 2 * b, g1 = group == 32 ? b : 2 * b + 1;
    /* _cvtsh_ss: the hardware half conversion */
    *v0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c0)), _mm512_set1_ps(_cvtsh_ss(sn[g0])),
                          _mm512_set1_ps(_cvtsh_ss(mn[g0])));
    *v1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c1)), _mm512_set1_ps(_cvtsh_ss(sn[g1])),
                          _mm512_set1_ps(_cvtsh_ss(mn[g1])));
}
#endif

#endif
