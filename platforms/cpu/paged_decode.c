/* Paged decode attention for the CPU platform: one query token per sequence, its keys
 * and values read straight from the paged KV cache (no gather copy), split-K over long
 * contexts, OpenMP over (sequence, KV head, context part).
 *
 * Built at first use by native.py with the machine's C compiler (-O3 -march=native
 * -fopenmp) and called through ctypes. The process has already loaded torch's
 * libgomp.so.1, so the OpenMP runtime (and its threads) are torch's own.
 *
 * Layouts (element strides; the caller checks them):
 *   q, out      [num_tokens, num_heads, head_size]; q rows `q_stride` apart, out contiguous
 *   cache       [num_blocks, 2, num_kv_heads, block_size, head_size], K at 0, V at 1
 *   block_table [num_seqs, bt_stride] int32
 * Query head j uses KV head j / ratio (ratio = num_heads / num_kv_heads), so the `ratio`
 * query heads of a KV head are `ratio` consecutive rows: each key is read once for all.
 *
 * Numerics: scores and softmax in float32, keys/values widened to float32 (bf16 and
 * fp16 exactly), output rounded to the cache dtype (round to nearest even).
 */

#include "cpu_kernels.h"
#include "cpu_simd.h"

typedef struct {
    const void *q;
    int64_t q_stride;
    const void *cache;
    const int32_t *block_table;
    int64_t bt_stride;
    const int32_t *seq_idx;   /* [n] row of block_table */
    const int32_t *token_idx; /* [n] row of q / out */
    const int32_t *kv_start;  /* [n] first key position */
    const int32_t *kv_len;    /* [n] number of keys */
    const int32_t *part_off;  /* [n + 1] first part of each decode (parts of part_len keys) */
    void *out;
    int num_heads, num_kv_heads, head_size, block_size, dtype, part_len;
    float scale, soft_cap;
    float *scratch;   /* per (part, kv head): ratio * (head_size + 2) floats */
    float *workspace; /* per thread: ps_workspace_floats() floats */
} Args;

static inline float dot_f32(const float *a, const float *b, int n) {
    int i = 0;
    float s = 0.0f;
#if PS_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    s = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* acc[i] += p * v[i] */
static inline void axpy_f32(float *acc, float p, const float *v, int n) {
    int i = 0;
#if PS_AVX512
    __m512 pv = _mm512_set1_ps(p);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + i), _mm512_loadu_ps(acc + i)));
#endif
    for (; i < n; i++) acc[i] += p * v[i];
}

/* s[i] = exp(s[i] - m); returns the sum */
static inline float exp_sum(float *s, float m, int n) {
    int i = 0;
    float z = 0.0f;
#if PS_AVX512
    __m512 mv = _mm512_set1_ps(m), zv = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv));
        _mm512_storeu_ps(s + i, e);
        zv = _mm512_add_ps(zv, e);
    }
    z = _mm512_reduce_add_ps(zv);
#endif
    for (; i < n; i++) {
        s[i] = expf(s[i] - m);
        z += s[i];
    }
    return z;
}

/* ----- one work item: keys [t0, t1) of decode i, KV head h ----------------------------- */

static void attend_part(const Args *A, int i, int h, int t0, int t1, float *res, float *ws) {
    const int r = A->num_heads / A->num_kv_heads, d = A->head_size, bs = A->block_size, hkv = A->num_kv_heads;
    const int esize = A->dtype == PS_F32 ? 4 : 2;
    const int nt = t1 - t0;
    /* workspace: scores [r, part_len], the scaled queries [r, d], one K/V row [d], row maxima [r] */
    float *s = ws, *qf = s + (int64_t)r * A->part_len, *row = qf + (int64_t)r * d, *mx = row + d;
    const char *qbase = (const char *)A->q + ((int64_t)A->token_idx[i] * A->q_stride + (int64_t)h * r * d) * esize;
    for (int a = 0; a < r; a++) {
        row_to_f32(qf + a * d, qbase + (int64_t)a * d * esize, d, A->dtype);
        for (int e = 0; e < d; e++) qf[a * d + e] *= A->scale;
    }
    const int32_t *bt = A->block_table + (int64_t)A->seq_idx[i] * A->bt_stride;
    const char *cache = (const char *)A->cache;
    const int64_t head_stride = (int64_t)bs * d;      /* elements between KV heads of a block */
    const int64_t kv_stride = (int64_t)hkv * head_stride; /* between K and V of a block */
    const int64_t pos_end = (int64_t)A->kv_start[i] + t1;

    /* scores: s[a * nt + t] */
    for (int a = 0; a < r; a++) mx[a] = -INFINITY;
    for (int64_t pos = (int64_t)A->kv_start[i] + t0, t = 0; pos < pos_end;) {
        int64_t blk = bt[pos / bs];
        int off = (int)(pos % bs);
        int cnt = (int)((bs - off) < (pos_end - pos) ? (bs - off) : (pos_end - pos));
        const char *k = cache + ((blk * 2 * kv_stride) + h * head_stride + (int64_t)off * d) * esize;
        for (int c = 0; c < cnt; c++, t++) {
            row_to_f32(row, k + (int64_t)c * d * esize, d, A->dtype);
            for (int a = 0; a < r; a++) {
                float v = dot_f32(qf + a * d, row, d);
                if (A->soft_cap > 0.0f) v = A->soft_cap * tanhf(v / A->soft_cap);
                s[a * nt + t] = v;
                if (v > mx[a]) mx[a] = v;
            }
        }
        pos += cnt;
    }
    /* res per row: [max, sum, acc[d]] */
    for (int a = 0; a < r; a++) {
        float *ra = res + (int64_t)a * (d + 2);
        ra[0] = mx[a];
        ra[1] = exp_sum(s + a * nt, mx[a], nt);
        memset(ra + 2, 0, (size_t)d * 4);
    }
    for (int64_t pos = (int64_t)A->kv_start[i] + t0, t = 0; pos < pos_end;) {
        int64_t blk = bt[pos / bs];
        int off = (int)(pos % bs);
        int cnt = (int)((bs - off) < (pos_end - pos) ? (bs - off) : (pos_end - pos));
        const char *v = cache + ((blk * 2 + 1) * kv_stride + h * head_stride + (int64_t)off * d) * esize;
        for (int c = 0; c < cnt; c++, t++) {
            row_to_f32(row, v + (int64_t)c * d * esize, d, A->dtype);
            for (int a = 0; a < r; a++) axpy_f32(res + (int64_t)a * (d + 2) + 2, s[a * nt + t], row, d);
        }
        pos += cnt;
    }
}

#if PS_AVX512 && defined(__AVX512BF16__)
#define PS_BF16_FAST 1
/* out[c] = the sum of v[c]'s 16 lanes, for 16 vectors: a shuffle-and-add tree (about 3
 * instructions per sum instead of ~10 for a reduce_add each). */
static inline __m512 reduce16(const __m512 *v) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++) /* 128-bit lanes 0,1: v[2i]'s partials; 2,3: v[2i+1]'s */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int j = 0; j < 4; j++) /* 128-bit lane k: v[4j + k]'s partials */
        x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int j = 0; j < 2; j++)
        y[j] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* z[4k + m] is the sum of v[4m + k] */
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, z);
}

/* attend_part for bf16 caches with head_size = 32 * NV, on AVX512-BF16: q.k and p.v as
 * bf16 dot products (vdpbf16ps) with float32 sums; p is rounded to bf16 for p.v (as
 * FlashAttention does), its row sums stay float32. NV is a constant in each caller, so the
 * loops over a row's vectors unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_bf16_impl(const Args *A, int i, int h, int t0, int t1,
                                                                    float *res, float *ws, const int NV) {
    const int r = A->num_heads / A->num_kv_heads, d = 32 * NV, bs = A->block_size, hkv = A->num_kv_heads;
    const int nt = t1 - t0, ntp = ((nt + 15) & ~15) + 16;
    /* rows of p.v accumulated together: 2 * NV accumulators each, 16 in all */
    const int G = 8 / NV > 0 ? 8 / NV : 1;
    const int rp = (r + G - 1) / G * G; /* rows padded to whole groups (the padding has p = 0) */
    /* workspace: scores [r, ntp] float32, probabilities [rp, ntp] bf16, V row pointers [ntp] */
    float *s = ws;
    uint16_t *pb = (uint16_t *)(s + (int64_t)r * ntp);
    const uint16_t **vrows = (const uint16_t **)(pb + (int64_t)rp * ntp);
    static const uint16_t zero_row[32 * 16] __attribute__((aligned(64)));
    const uint16_t *qbase = (const uint16_t *)A->q + (int64_t)A->token_idx[i] * A->q_stride + (int64_t)h * r * d;
    const int32_t *bt = A->block_table + (int64_t)A->seq_idx[i] * A->bt_stride;
    const uint16_t *cache = (const uint16_t *)A->cache;
    const int64_t head_stride = (int64_t)bs * d, kv_stride = (int64_t)hkv * head_stride;
    const int64_t pos_end = (int64_t)A->kv_start[i] + t1;
    const __m512 scale = _mm512_set1_ps(A->scale);
    /* each query row's running maximum, lane-wise: [r] vectors after the V row pointers */
    __m512 *mx = (__m512 *)(((uintptr_t)(vrows + ntp) + 63) & ~(uintptr_t)63);
    for (int a = 0; a < r; a++) mx[a] = _mm512_set1_ps(-INFINITY);

    /* q.k: runs of up to 16 consecutive keys of one block (rows past the run read zeros) */
    for (int64_t pos = (int64_t)A->kv_start[i] + t0, t = 0; pos < pos_end;) {
        int64_t blk = bt[pos / bs];
        int off = (int)(pos % bs);
        int cnt = bs - off;
        if (cnt > pos_end - pos) cnt = (int)(pos_end - pos);
        if (cnt > 16) cnt = 16;
        const uint16_t *k = cache + blk * 2 * kv_stride + h * head_stride + (int64_t)off * d;
        const uint16_t *krow[16];
#pragma GCC unroll 16
        for (int c = 0; c < 16; c++) krow[c] = c < cnt ? k + (int64_t)c * d : zero_row;
        for (int c = 0; c < cnt; c++) vrows[t + c] = k + kv_stride + (int64_t)c * d;
        const __mmask16 valid = (__mmask16)((1u << cnt) - 1u);
        for (int a = 0; a < r; a++) {
            const uint16_t *qa = qbase + (int64_t)a * d;
            __m512 part[16];
#pragma GCC unroll 16
            for (int c = 0; c < 16; c++) part[c] = _mm512_setzero_ps();
#pragma GCC unroll 16
            for (int u = 0; u < NV; u++) {
                __m512bh qv = (__m512bh)_mm512_loadu_si512(qa + 32 * u);
#pragma GCC unroll 16
                for (int c = 0; c < 16; c++)
                    part[c] = _mm512_dpbf16_ps(part[c], qv, (__m512bh)_mm512_loadu_si512(krow[c] + 32 * u));
            }
            __m512 sc = _mm512_mul_ps(reduce16(part), scale);
            if (A->soft_cap > 0.0f) {
                float tmp[16] __attribute__((aligned(64)));
                _mm512_store_ps(tmp, sc);
                for (int c = 0; c < cnt; c++) tmp[c] = A->soft_cap * tanhf(tmp[c] / A->soft_cap);
                sc = _mm512_load_ps(tmp);
            }
            _mm512_mask_storeu_ps(s + (int64_t)a * ntp + t, valid, sc);
            mx[a] = _mm512_mask_max_ps(mx[a], valid, mx[a], sc);
        }
        t += cnt;
        pos += cnt;
    }
    /* softmax numerators (float32 sums), then bf16 probabilities padded with zeros */
    for (int a = 0; a < rp; a++) {
        uint16_t *pa = pb + (int64_t)a * ntp;
        if (a >= r) {
            memset(pa, 0, (size_t)ntp * 2);
            continue;
        }
        float *sa = s + (int64_t)a * ntp;
        float m = _mm512_reduce_max_ps(mx[a]);
        float *ra = res + (int64_t)a * (d + 2);
        ra[0] = m;
        ra[1] = exp_sum(sa, m, nt);
        for (int t = nt; t < ntp; t++) sa[t] = 0.0f;
        for (int t = 0; t < ntp; t += 16) {
            __m256bh half = _mm512_cvtneps_pbh(_mm512_loadu_ps(sa + t));
            _mm256_storeu_si256((__m256i *)(pa + t), (__m256i)half);
        }
    }
    for (int t = nt; t < ntp; t++) vrows[t] = zero_row;
    /* p.v: keys in pairs (t, t + 1), interleaved so each 32-bit lane holds one dimension's
     * (v_t, v_t+1): lane 4L + m of the low half is dimension 32u + 8L + m, of the high half
     * 32u + 8L + 4 + m (unpack works within 128-bit lanes) */
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int a0 = 0; a0 < rp; a0 += G) {
        __m512 acc[8][16];
#pragma GCC unroll 8
        for (int gi = 0; gi < G; gi++)
#pragma GCC unroll 16
            for (int x = 0; x < 2 * NV; x++) acc[gi][x] = _mm512_setzero_ps();
        const uint32_t *pp = (const uint32_t *)(pb + (int64_t)a0 * ntp);
        const int pstride = ntp / 2;
        for (int t = 0; t < nt; t += 2) {
            const uint16_t *v0 = vrows[t], *v1 = vrows[t + 1];
#pragma GCC unroll 16
            for (int u = 0; u < NV; u++) {
                __m512i x0 = _mm512_loadu_si512(v0 + 32 * u), x1 = _mm512_loadu_si512(v1 + 32 * u);
                __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1), hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
#pragma GCC unroll 8
                for (int gi = 0; gi < G; gi++) {
                    __m512bh p2 = (__m512bh)_mm512_set1_epi32((int)pp[gi * pstride + t / 2]);
                    acc[gi][2 * u] = _mm512_dpbf16_ps(acc[gi][2 * u], lo, p2);
                    acc[gi][2 * u + 1] = _mm512_dpbf16_ps(acc[gi][2 * u + 1], hi, p2);
                }
            }
        }
#pragma GCC unroll 8
        for (int gi = 0; gi < G; gi++) {
            if (a0 + gi >= r) break;
            float *dst = res + (int64_t)(a0 + gi) * (d + 2) + 2;
#pragma GCC unroll 16
            for (int u = 0; u < NV; u++) {
                _mm512_storeu_ps(dst + 32 * u, _mm512_permutex2var_ps(acc[gi][2 * u], first, acc[gi][2 * u + 1]));
                _mm512_storeu_ps(dst + 32 * u + 16, _mm512_permutex2var_ps(acc[gi][2 * u], second, acc[gi][2 * u + 1]));
            }
        }
    }
}

static void attend_bf16_d64(const Args *A, int i, int h, int t0, int t1, float *res, float *ws) {
    attend_bf16_impl(A, i, h, t0, t1, res, ws, 2);
}
static void attend_bf16_d128(const Args *A, int i, int h, int t0, int t1, float *res, float *ws) {
    attend_bf16_impl(A, i, h, t0, t1, res, ws, 4);
}
static void attend_bf16_d256(const Args *A, int i, int h, int t0, int t1, float *res, float *ws) {
    attend_bf16_impl(A, i, h, t0, t1, res, ws, 8);
}
#else
#define PS_BF16_FAST 0
#endif

/* Merge the parts of decode i, KV head h (flash-decoding's rescale) and write its rows of out. */
static void merge_parts(const Args *A, int i, int h, float *acc) {
    const int r = A->num_heads / A->num_kv_heads, d = A->head_size, hkv = A->num_kv_heads;
    const int esize = A->dtype == PS_F32 ? 4 : 2;
    const int p0 = A->part_off[i], np = A->part_off[i + 1] - p0;
    const int64_t item = (int64_t)r * (d + 2);
    for (int a = 0; a < r; a++) {
        char *dst = (char *)A->out + ((int64_t)A->token_idx[i] * A->num_heads + (int64_t)h * r + a) * d * esize;
        const float *first = A->scratch + ((int64_t)p0 * hkv + h) * item + (int64_t)a * (d + 2);
        if (np == 1) {
            store_row(dst, first + 2, first[1] > 0.0f ? 1.0f / first[1] : 0.0f, d, A->dtype);
            continue;
        }
        float m = -INFINITY;
        for (int p = 0; p < np; p++) {
            float mp = first[(int64_t)p * hkv * item];
            if (mp > m) m = mp;
        }
        float z = 0.0f;
        memset(acc, 0, (size_t)d * 4);
        for (int p = 0; p < np; p++) {
            const float *rp = first + (int64_t)p * hkv * item;
            float w = expf(rp[0] - m);
            z += w * rp[1];
            axpy_f32(acc, w, rp + 2, d);
        }
        store_row(dst, acc, z > 0.0f ? 1.0f / z : 0.0f, d, A->dtype);
    }
}

/* Floats of per-thread workspace `ps_paged_decode` needs (the caller allocates it). */
int64_t ps_workspace_floats(int ratio, int head_size, int part_len) {
    int64_t generic = (int64_t)ratio * part_len + (int64_t)ratio * head_size + head_size + ratio;
    int64_t ntp = ((part_len + 15) & ~15) + 16;
    int64_t rp = ratio + 8; /* rows padded to whole p.v groups */
    /* scores, bf16 p, V row pointers, row maxima (64-byte aligned) */
    int64_t fast = (int64_t)ratio * ntp + rp * ntp / 2 + 2 * ntp + 16 + 16 * (int64_t)ratio;
    return (generic > fast ? generic : fast) + head_size + 64;
}

/* Floats of scratch for `num_parts` parts (each decode has ceil(kv_len / part_len) parts). */
int64_t ps_scratch_floats(int64_t num_parts, int num_kv_heads, int ratio, int head_size) {
    return num_parts * num_kv_heads * ratio * (int64_t)(head_size + 2);
}

/* Entry point. Returns 0, or a negative code for arguments this kernel does not take.
 * `workspace` holds num_threads * ps_workspace_floats() floats, `scratch` ps_scratch_floats(). */
int ps_paged_decode(const void *q, int64_t q_stride, const void *cache, const int32_t *block_table, int64_t bt_stride,
                    const int32_t *seq_idx, const int32_t *token_idx, const int32_t *kv_start, const int32_t *kv_len,
                    const int32_t *part_off, void *out, int num_decodes, int num_heads, int num_kv_heads, int head_size,
                    int block_size, int dtype, float scale, float soft_cap, int part_len, float *scratch,
                    float *workspace, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return -1;
    if (head_size <= 0) return -2;
    if (dtype != PS_F32 && dtype != PS_BF16 && dtype != PS_F16) return -3;
    if (part_len <= 0 || block_size <= 0 || num_threads <= 0) return -4;
    Args A = {q, q_stride, cache, block_table, bt_stride, seq_idx, token_idx, kv_start, kv_len, part_off, out,
              num_heads, num_kv_heads, head_size, block_size, dtype, part_len, scale, soft_cap, scratch, workspace};
    const int hkv = num_kv_heads, r = num_heads / num_kv_heads, d = head_size;
    const int64_t num_items = (int64_t)part_off[num_decodes] * hkv;
    const int64_t item = (int64_t)r * (d + 2);
    const int64_t ws_floats = ps_workspace_floats(r, d, part_len);
#pragma omp parallel num_threads(num_threads)
    {
#ifdef _OPENMP
        float *ws = workspace + (int64_t)omp_get_thread_num() * ws_floats;
#else
        float *ws = workspace;
#endif
        /* item = global part * num_kv_heads + kv head; part p belongs to decode i when
         * part_off[i] <= p < part_off[i + 1] */
        int i = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < num_items; it++) {
            int64_t p = it / hkv;
            int h = (int)(it % hkv);
            while (part_off[i + 1] <= p) i++;
            while (part_off[i] > p) i--;
            int t0 = (int)(p - part_off[i]) * part_len;
            int t1 = t0 + part_len < kv_len[i] ? t0 + part_len : kv_len[i];
#if PS_BF16_FAST
            if (dtype == PS_BF16 && (d == 64 || d == 128 || d == 256)) {
                if (d == 64) attend_bf16_d64(&A, i, h, t0, t1, scratch + it * item, ws);
                else if (d == 128) attend_bf16_d128(&A, i, h, t0, t1, scratch + it * item, ws);
                else attend_bf16_d256(&A, i, h, t0, t1, scratch + it * item, ws);
                continue;
            }
#endif
            attend_part(&A, i, h, t0, t1, scratch + it * item, ws);
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < (int64_t)num_decodes * hkv; it++)
            merge_parts(&A, (int)(it / hkv), (int)(it % hkv), ws);
    }
    return 0;
}
