/* Decode attention over the paged KV cache, in any of its element types (kv_types.h), fp32 math.
 *
 * Semantics:
 *   lp_decode_attention_f32: one query token per sequence b < B, over its paged context:
 *                         for head h (kv head g = h / (H / KVH)), context j < lens[b],
 *                         slot(j) = tables[b, j / bs] * bs + j % bs,
 *                         p = softmax_j(scale * q[b, h] . K(slot(j), g));
 *                         out[b, h] = sum_j p[j] * V(slot(j), g),
 *                         K(s, g), V(s, g): row g of slot s of k, v ([slots, KVH] rows of kv_type,
 *                         kv_types.h), as fp32 values (8-bit rows: q * scale); in fp32 math as
 *                         (scale * s_K) * (q . k) for a K row's values k and scale s_K, and
 *                         (e^(score - max) * s_V) * v for V; the sums' order depends on the build (AVX-512,
 *                         AVX2 or portable), so builds agree within fp32 rounding, not bit for bit.
 *                         q: fp32, row stride q_stride, heads D apart; tables: [B, max_blocks] int64;
 *                         lens: [B] int64; out: [B, H, D] fp32. lens[b] <= 0 gives zeros. Returns 0, or
 *                         -1 for an unknown kv_type (scratch is on the stack; only with very many heads
 *                         does splitting a context between threads take a heap buffer, and without one
 *                         it does not split).
 *   lp_kv_store:          x [KVH, D] fp32 -> KVH cache rows of kv_type at dst: rounded to nearest even
 *                         (bf16, fp16, fp8), int8 as round(x / s) in [-127, 127] with s = absmax / 127 and
 *                         fp8 as x / s with s = absmax / 448 (s = 0 for an all-zero row: all values 0),
 *                         exactly as engine/kv/kv_dtype.py's quantize.
 *
 * Why 8- and 16-bit caches: at batch 32 a decode step of the default model reads ~300 MB of fp32 K/V;
 * the attention is bound by that stream, and an 8-bit row is ~1/4 of it. Rows are widened as they are
 * loaded, a row's scale applied to the score for K and to the softmax weight for V. AVX-512 builds widen each
 * 16- or 8-bit row once for all the query heads of its kv head (decode_attention_avx512.h); AVX2 builds widen
 * it per query head, and so widen fp8 chunks, whose widening costs more, once per kv head into L1 first
 * (att_chunk_widened). fp32 rows take the AVX2 loop in both (it streamed them faster).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp8.h"
#include "kv_types.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* A piece of work is one sequence over a range of its context, for a run of its query heads. It
 * walks the range in chunks of ATT_CHUNK cache slots, and each chunk kv head by kv head: score the
 * chunk for every query head of the kv head's group (its K rows stay in L1 across those heads),
 * take an online-softmax step per head (running max m and sum l; acc and l are rescaled by
 * e^(m_old - m_new) when the max grows), then add the chunk's weighted V rows to acc [D], held in
 * registers over the chunk. So nothing beyond one chunk's scores is kept, at any length, and
 * nothing is allocated. Slots are found through pointer arrays, so any block size works; a short
 * chunk repeats a real slot in its spare lanes (with weight 0), so no other slot is ever read.
 * Work is memory-bound once the cache is out of L3 (as it is in a real step): the order above,
 * with long chunks, is what streamed fastest of the orders tried. */
#define ATT_CHUNK 64         /* slots per softmax step, a multiple of 16 */
#define ATT_HEADS 32         /* most query heads a piece takes at once (its scores: ATT_HEADS x ATT_CHUNK) */
#define ATT_ACC_FLOATS 2048  /* a whole sequence's accumulators, on the stack: heads per pass x (D + 2) */
#define ATT_PART_FLOATS 8192 /* the partials of split sequences (two per thread), on the stack if they fit */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX2__) && defined(__FMA__) && \
    defined(__F16C__)
#define ATT_AVX512 1 /* 16- and 8-bit rows through decode_attention_avx512.h */
#else
#define ATT_AVX512 0
#endif
#ifndef ATT_CONV_FLOATS /* (a build may set it: 0 reads fp8 chunks in place too) */
#if ATT_AVX512
#define ATT_CONV_FLOATS 0 /* AVX-512 widens a row once for a kv head's query heads anyway: in place is faster */
#else
#define ATT_CONV_FLOATS 4096 /* an fp8 chunk's K (and V) rows widened to fp32: 16 KB each, in L1 */
#endif
#endif
/* Below this much work (context positions x query heads x D) one thread does it all. */
#define ATT_PARALLEL_MIN (128 * 1024)

typedef struct {
    const float *q;
    const char *k, *v; /* cache rows of kt, row_bytes each, KVH per slot */
    const int64_t *tables, *lens;
    int64_t q_stride, max_blocks, B, H, KVH, D, bs, group, row_bytes;
    float scale;
    float *out;
    int kt;
} att_t;

/* 8-bit rows: each of n slots' score factor (scale times its K row's scale) and its V row's scale. */
ALWAYS_INLINE void row_scales(const char *const *kp, const char *const *vp, int64_t off, int64_t n, int64_t D, int kt,
                              float scale, float *ks, float *vs) {
    for (int64_t p = 0; p < n; p++)
        ks[p] = scale * lp_kv_row_scale(kp[p] + off, D, kt), vs[p] = lp_kv_row_scale(vp[p] + off, D, kt);
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
static const int32_t att_mask_src[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

static inline __m256i first_lanes(int64_t n) { /* lanes < n set (n >= 0; all of them past 8) */
    return _mm256_loadu_si256((const __m256i *)(att_mask_src + 8 - (n < 8 ? n : 8)));
}

static inline float hmax8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static inline float hsum8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/* One online-softmax step of one head over a chunk's scores sr (np valid, read up to a multiple of 8): the
 * running max *m and sum *l, acc [D] rescaled when the max grows; sr then holds each slot's softmax weight, times
 * vs[p] (its V row's scale) when vs is given. */
ALWAYS_INLINE void att_softmax(float *sr, int64_t np, float *acc, int64_t D, float *m, float *l, const float *vs) {
    const int64_t n8 = (np + 7) / 8 * 8;
    __m256 mx = _mm256_loadu_ps(sr);
    for (int64_t p = 8; p < n8; p += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sr + p));
    const float mt = hmax8(mx);
    if (mt > *m) { /* the running max grows: rescale what is accumulated */
        const float alpha = expf(*m - mt);
        for (int64_t i = 0; i < D; i++) acc[i] *= alpha;
        *l *= alpha;
        *m = mt;
    }
    __m256 sum = _mm256_setzero_ps(), mv = _mm256_set1_ps(*m);
    for (int64_t p = 0; p < n8; p += 8) { /* (-inf lanes: exp8 clamps, so zero them) */
        __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + p), mv)),
                                 _mm256_castsi256_ps(first_lanes(np - p)));
        sum = _mm256_add_ps(sum, e);
        _mm256_storeu_ps(sr + p, vs ? _mm256_mul_ps(e, _mm256_loadu_ps(vs + p)) : e);
    }
    *l += hsum8(sum);
}

/* Lane p: q [D] . row kp[p] + off [D] (unscaled values of kt), for 8 rows at once (one horizontal-sum
 * tree for all 8). */
ALWAYS_INLINE __m256 dot8(const float *q, const char *const *kp, int64_t off, int64_t D, int kt) {
    __m256 a[8];
    for (int p = 0; p < 8; p++) a[p] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 x = _mm256_loadu_ps(q + d);
        for (int p = 0; p < 8; p++) a[p] = _mm256_fmadd_ps(x, lp_kv_load8(kp[p] + off, d, kt), a[p]);
    }
    if (d < D) {
        __m256i mk = first_lanes(D - d);
        __m256 x = _mm256_maskload_ps(q + d, mk);
        for (int p = 0; p < 8; p++) a[p] = _mm256_fmadd_ps(x, lp_kv_load_tail(kp[p] + off, d, D - d, kt), a[p]);
    }
    __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* One chunk for nh heads of one kv head: q [nh, D] (heads D apart); slots kp, vp (the kv head's
 * rows at kp[p] + off, of kt), of which the first np are the chunk's and the rest up to a multiple of 8
 * repeat a real one; s: scratch [nh, ATT_CHUNK]; acc [nh, D], m, l [nh]. */
ALWAYS_INLINE void att_chunk_t(const float *q, int64_t nh, int64_t D, float scale, const char *const *kp,
                               const char *const *vp, int64_t off, int64_t np, float *s, float *acc, float *m,
                               float *l, int kt) {
    const int64_t n8 = (np + 7) / 8 * 8;
    float ks[ATT_CHUNK], vs[ATT_CHUNK]; /* 8-bit rows: each slot's score factor and V scale */
    if (lp_kv_scaled(kt)) row_scales(kp, vp, off, n8, D, kt, scale, ks, vs);
    for (int64_t r = 0; r < nh; r++) /* all the scores first: independent work, no stalls */
        for (int64_t p = 0; p < n8; p += 8) {
            __m256 f = lp_kv_scaled(kt) ? _mm256_loadu_ps(ks + p) : _mm256_set1_ps(scale);
            __m256 x = _mm256_mul_ps(dot8(q + r * D, kp + p, off, D, kt), f);
            __m256 valid = _mm256_castsi256_ps(first_lanes(np - p));
            _mm256_storeu_ps(s + r * ATT_CHUNK + p, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, valid));
        }
    for (int64_t r = 0; r < nh; r++) {
        float *sr = s + r * ATT_CHUNK, *ar = acc + r * D;
        att_softmax(sr, np, ar, D, m + r, l + r, lp_kv_scaled(kt) ? vs : 0);
        /* acc += weights . V rows: 64 floats of acc held in registers over the whole chunk */
        int64_t d = 0;
        for (; d + 64 <= D; d += 64) {
            __m256 c[8];
            for (int i = 0; i < 8; i++) c[i] = _mm256_loadu_ps(ar + d + 8 * i);
            for (int64_t p = 0; p < np; p++) {
                __m256 w = _mm256_broadcast_ss(sr + p);
                for (int i = 0; i < 8; i++) c[i] = _mm256_fmadd_ps(w, lp_kv_load8(vp[p] + off, d + 8 * i, kt), c[i]);
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(ar + d + 8 * i, c[i]);
        }
        for (; d < D; d += 8) { /* the rest of D, 8 at a time (the last ones masked), two chains */
            const int64_t n = D - d < 8 ? D - d : 8;
            __m256i mk = first_lanes(n);
            __m256 c0 = _mm256_maskload_ps(ar + d, mk), c1 = _mm256_setzero_ps();
#define V_AT(p) (n == 8 ? lp_kv_load8(vp[p] + off, d, kt) : lp_kv_load_tail(vp[p] + off, d, n, kt))
            int64_t p = 0;
            for (; p + 2 <= np; p += 2) {
                c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(sr + p), V_AT(p), c0);
                c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(sr + p + 1), V_AT(p + 1), c1);
            }
            if (p < np) c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(sr + p), V_AT(p), c0);
#undef V_AT
            _mm256_maskstore_ps(ar + d, mk, _mm256_add_ps(c0, c1));
        }
    }
}

#if ATT_AVX512
#include "decode_attention_avx512.h" /* att_chunk16_t: each K and V row widened once for a kv head's query heads */
#define att_chunk_narrow att_chunk16_t
#endif
#else
/* q [n] . row [n] (unscaled values of kt). */
ALWAYS_INLINE float dot(const float *a, const char *row, int64_t n, int kt) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[i + l] * lp_kv_get(row, i + l, kt);
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += a[i] * lp_kv_get(row, i, kt);
    return s;
}

ALWAYS_INLINE void att_chunk_t(const float *q, int64_t nh, int64_t D, float scale, const char *const *kp,
                               const char *const *vp, int64_t off, int64_t np, float *s, float *acc, float *m,
                               float *l, int kt) {
    for (int64_t r = 0; r < nh; r++) {
        float *sr = s + r * ATT_CHUNK, mt = -INFINITY, *ar = acc + r * D;
        for (int64_t p = 0; p < np; p++) {
            sr[p] = scale * lp_kv_row_scale(kp[p] + off, D, kt) * dot(q + r * D, kp[p] + off, D, kt);
            mt = sr[p] > mt ? sr[p] : mt;
        }
        if (mt > m[r]) {
            float alpha = expf(m[r] - mt);
            for (int64_t i = 0; i < D; i++) ar[i] *= alpha;
            l[r] *= alpha;
            m[r] = mt;
        }
        for (int64_t p = 0; p < np; p++) {
            float w = expf(sr[p] - m[r]), wv = w * lp_kv_row_scale(vp[p] + off, D, kt);
            l[r] += w;
            for (int64_t i = 0; i < D; i++) ar[i] += wv * lp_kv_get(vp[p] + off, i, kt);
        }
    }
}
#endif
#ifndef att_chunk_narrow /* the chunk loop of 16- and 8-bit rows: AVX-512's where built, else the one above */
#define att_chunk_narrow att_chunk_t
#endif

/* Rows kp[p] + off (p < n) of kt widened to fp32 into buf [n, D], each times its row's scale (8-bit types):
 * the values attention reads, exactly as kv_dtype.py's dequantize makes them; rows[p] points at row p. */
ALWAYS_INLINE void widen_rows(const char *const *kp, int64_t off, int64_t n, int64_t D, int kt, float *buf,
                              const char **rows) {
    for (int64_t p = 0; p < n; p++) {
        const char *src = kp[p] + off;
        float *dst = buf + p * D;
        const float sc = lp_kv_row_scale(src, D, kt);
        int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        const __m256 sv = _mm256_set1_ps(sc);
        for (; d + 8 <= D; d += 8) {
            __m256 x = lp_kv_load8(src, d, kt);
            _mm256_storeu_ps(dst + d, lp_kv_scaled(kt) ? _mm256_mul_ps(x, sv) : x);
        }
#endif
        for (; d < D; d++) dst[d] = lp_kv_scaled(kt) ? lp_kv_get(src, d, kt) * sc : lp_kv_get(src, d, kt);
        rows[p] = (const char *)dst;
    }
}

/* A chunk of kt rows, ATT_CONV_FLOATS / D slots at a time: widened once per kv head (the group's query heads and
 * both passes over the rows then read fp32 from L1), then the fp32 loop. For fp8, whose widening takes six
 * operations per vector, this is faster than widening at every read; for bf16, fp16 and int8 (two) slower. */
ALWAYS_INLINE void att_chunk_widened(const att_t *a, const float *q, int64_t nh, const char *const *kp,
                                     const char *const *vp, int64_t off, int64_t np, float *s, float *acc, float *m,
                                     float *l, int kt) {
    float kb[ATT_CONV_FLOATS], vb[ATT_CONV_FLOATS];
    const char *kr[ATT_CHUNK], *vr[ATT_CHUNK];
    const int64_t D = a->D, per = ATT_CONV_FLOATS / D / 16 * 16 < ATT_CHUNK ? ATT_CONV_FLOATS / D / 16 * 16 : ATT_CHUNK;
    for (int64_t p0 = 0; p0 < np; p0 += per) {
        const int64_t n = np - p0 < per ? np - p0 : per, n16 = (n + 15) / 16 * 16; /* (kp repeats a real slot) */
        widen_rows(kp + p0, off, n16, D, kt, kb, kr);
        widen_rows(vp + p0, off, n16, D, kt, vb, vr);
        att_chunk_t(q, nh, D, a->scale, kr, vr, 0, n, s, acc, m, l, LP_KV_F32);
    }
}

/* The chunk loop for the table's kt (att_chunk_t for fp32, att_chunk_narrow for the others), each type's compiled
 * apart (the type is a constant in each); fp8 chunks widened first (att_chunk_widened) where ATT_CONV_FLOATS holds
 * 16 rows (AVX2 builds, head_dim <= 256). */
static void att_chunk(const att_t *a, const float *q, int64_t nh, const char *const *kp, const char *const *vp,
                      int64_t off, int64_t np, float *s, float *acc, float *m, float *l) {
    const int64_t D = a->D;
    const float sc = a->scale;
    switch (a->kt) {
        case LP_KV_F32: att_chunk_t(q, nh, D, sc, kp, vp, off, np, s, acc, m, l, LP_KV_F32); break;
        case LP_KV_BF16: att_chunk_narrow(q, nh, D, sc, kp, vp, off, np, s, acc, m, l, LP_KV_BF16); break;
        case LP_KV_F16: att_chunk_narrow(q, nh, D, sc, kp, vp, off, np, s, acc, m, l, LP_KV_F16); break;
        case LP_KV_I8: att_chunk_narrow(q, nh, D, sc, kp, vp, off, np, s, acc, m, l, LP_KV_I8); break;
        default:
            if (16 * D <= ATT_CONV_FLOATS)
                att_chunk_widened(a, q, nh, kp, vp, off, np, s, acc, m, l, LP_KV_FP8);
            else
                att_chunk_narrow(q, nh, D, sc, kp, vp, off, np, s, acc, m, l, LP_KV_FP8);
            break;
    }
}

/* The slots of sequence positions from block index *blk, offset *o (both advanced): np of them,
 * then copies of the first up to a multiple of 16. */
static void att_rows(const att_t *a, const int64_t *table, int64_t np, int64_t *blk, int64_t *o, const char **kp,
                     const char **vp) {
    const int64_t bs = a->bs, slot_bytes = a->KVH * a->row_bytes;
    int64_t p = 0;
    for (; p < np; p++) {
        int64_t at = (table[*blk] * bs + *o) * slot_bytes;
        kp[p] = a->k + at, vp[p] = a->v + at;
        if (++*o == bs) *o = 0, ++*blk;
    }
    for (; p % 16; p++) kp[p] = kp[0], vp[p] = vp[0];
}

/* Asks for bytes [off, off + bytes) of the K and V slots kp, vp [n] (the piece's kv heads' rows) in L1. */
ALWAYS_INLINE void att_prefetch(const char *const *kp, const char *const *vp, int64_t n, int64_t off, int64_t bytes) {
    for (int64_t p = 0; p < n; p++) {
        for (int64_t i = 0; i < bytes; i += 64)
            __builtin_prefetch(kp[p] + off + i, 0, 3), __builtin_prefetch(vp[p] + off + i, 0, 3);
        __builtin_prefetch(kp[p] + off + bytes - 1, 0, 3), __builtin_prefetch(vp[p] + off + bytes - 1, 0, 3);
    }
}

/* Query heads [h0, h0 + nh) (nh <= ATT_HEADS) of sequence b over its context [j0, j1), from
 * scratch: acc [nh, D], m, l [nh].
 * 16- and 8-bit rows: each chunk first asks for the next chunk's rows (of the piece's kv heads). A kv head's row
 * is a slice of each slot's kv heads, so reading one kv head at a time skips through memory in a walk the
 * hardware prefetcher does not follow, and a chunk waited on a miss per row (Zen 4, 2048 tokens of context:
 * 16-bit rows 1.24-1.33x faster with it). fp32 rows stream well alone and were slower with it. */
static void att_piece(const att_t *a, int64_t b, int64_t h0, int64_t nh, int64_t j0, int64_t j1, float *acc,
                      float *m, float *l) {
    const int64_t D = a->D, G = a->group, *table = a->tables + b * a->max_blocks;
    for (int64_t i = 0; i < nh * D; i++) acc[i] = 0.0f;
    for (int64_t r = 0; r < nh; r++) m[r] = -INFINITY, l[r] = 0.0f;
    if (j0 >= j1) return;
    const float *q = a->q + b * a->q_stride + h0 * D;
    const char *rows[2][2][ATT_CHUNK]; /* [this chunk, the next][K, V] slots */
    float s[ATT_HEADS * ATT_CHUNK];
    const int prefetch = a->kt != LP_KV_F32;
    const int64_t pf_off = h0 / G * a->row_bytes, pf_bytes = ((h0 + nh - 1) / G + 1) * a->row_bytes - pf_off;
    int64_t blk = j0 / a->bs, o = j0 % a->bs; /* walk the blocks: no division per position */
    int64_t np = j1 - j0 < ATT_CHUNK ? j1 - j0 : ATT_CHUNK;
    att_rows(a, table, np, &blk, &o, rows[0][0], rows[0][1]);
    for (int64_t j = j0, c = 0;; c ^= 1) {
        const char *const *kp = rows[c][0], *const *vp = rows[c][1];
        const int64_t next = j1 - j - np < ATT_CHUNK ? j1 - j - np : ATT_CHUNK;
        if (next > 0) {
            att_rows(a, table, next, &blk, &o, rows[c ^ 1][0], rows[c ^ 1][1]);
            if (prefetch) att_prefetch(rows[c ^ 1][0], rows[c ^ 1][1], next, pf_off, pf_bytes);
        }
        for (int64_t h = h0, hn; h < h0 + nh; h += hn) { /* the heads of one kv head at a time */
            int64_t g = h / G, end = (g + 1) * G < h0 + nh ? (g + 1) * G : h0 + nh;
            hn = end - h;
            att_chunk(a, q + (h - h0) * D, hn, kp, vp, g * a->row_bytes, np, s, acc + (h - h0) * D, m + (h - h0),
                      l + (h - h0));
        }
        j += np;
        if (next <= 0) break;
        np = next;
    }
}

/* How many heads a pass takes, given room for `fit`: whole kv-head groups when one fits (a group
 * split between passes would read its K and V rows twice). */
static int64_t att_pass(const att_t *a, int64_t fit) {
    fit = fit < ATT_HEADS ? fit : ATT_HEADS;
    return fit >= a->group ? fit / a->group * a->group : fit;
}

/* All H heads of sequence b over [j0, j1) into acc [H, D], m, l [H], in passes. */
static void att_piece_all(const att_t *a, int64_t b, int64_t j0, int64_t j1, float *acc, float *m, float *l) {
    const int64_t per_pass = att_pass(a, ATT_HEADS);
    for (int64_t h0 = 0, nh; h0 < a->H; h0 += nh) {
        nh = a->H - h0 < per_pass ? a->H - h0 : per_pass;
        att_piece(a, b, h0, nh, j0, j1, acc + h0 * a->D, m + h0, l + h0);
    }
}

/* A whole sequence b of n > 0 positions into out: its heads in passes of as many as the stack
 * buffer holds (all of them but for huge H x D). */
static void att_seq(const att_t *a, int64_t b, int64_t n) {
    float buf[ATT_ACC_FLOATS];
    const int64_t D = a->D, per_pass = att_pass(a, ATT_ACC_FLOATS / (D + 2));
    for (int64_t h0 = 0, nh; h0 < a->H; h0 += nh) {
        nh = per_pass ? (a->H - h0 < per_pass ? a->H - h0 : per_pass) : 1;
        float *o = a->out + (b * a->H + h0) * D;
        float *acc = per_pass ? buf : o, *m = per_pass ? buf + nh * D : buf, *l = m + nh; /* huge D: in out */
        att_piece(a, b, h0, nh, 0, n, acc, m, l);
        for (int64_t r = 0; r < nh; r++) {
            float inv = 1.0f / l[r];
            for (int64_t i = 0; i < D; i++) o[r * D + i] = acc[r * D + i] * inv;
        }
    }
}

/* The work is flattened: sequence b holds positions [start, start + lens[b]), sequences in order.
 * Returns the non-empty sequence holding position pos (B when pos is past the end) and sets
 * *start to where it starts. */
static int64_t att_locate(const att_t *a, int64_t pos, int64_t *start) {
    int64_t s = 0, b = 0;
    for (; b < a->B; b++) {
        int64_t n = a->lens[b] > 0 ? a->lens[b] : 0;
        if (pos < s + n) break;
        s += n;
    }
    *start = s;
    return b;
}

/* Thread t's share [s, e): whole sequences go straight to out; a sequence cut by the share's
 * edges leaves a partial (acc [H, D], m, l [H]) in slot 2t when it is the first one t touches, else
 * in slot 2t + 1. */
static void att_run(const att_t *a, int64_t s, int64_t e, int t, float *part) {
    if (s >= e) return;
    const int64_t H = a->H, slot = H * (a->D + 2);
    int64_t start, b = att_locate(a, s, &start), first = b;
    for (; b < a->B && start < e; b++) {
        int64_t n = a->lens[b] > 0 ? a->lens[b] : 0;
        int64_t j0 = s > start ? s - start : 0, j1 = e - start < n ? e - start : n;
        if (j0 == 0 && j1 == n) {
            if (n) att_seq(a, b, n);
        } else {
            float *p = part + (2 * t + (b != first)) * slot;
            att_piece_all(a, b, j0, j1, p, p + H * a->D, p + H * a->D + H);
        }
        start += n;
    }
}

#ifdef _OPENMP
/* Where thread t of nt starts: an equal share of the positions, or, when sequences may not be
 * split, the sequence edge nearest to that. */
static int64_t att_bound(const att_t *a, int64_t total, int t, int nt, int split) {
    int64_t pos = total * t / nt, start;
    if (split || pos >= total) return pos;
    int64_t n = a->lens[att_locate(a, pos, &start)];
    return pos - start <= start + n - pos ? start : start + n;
}

/* After all shares are done, thread t finishes the cut sequence that ends in its share, if any:
 * it folds the earlier threads' partials of that sequence into its own, then writes acc / l. */
static void att_merge(const att_t *a, int64_t total, int t, int nt, float *part) {
    const int64_t H = a->H, D = a->D, slot = H * (D + 2);
    int64_t s = total * t / nt, e = total * (t + 1) / nt, start;
    if (s >= e) return;
    int64_t b = att_locate(a, s, &start), n = a->lens[b];
    if (start >= s || start + n > e) return; /* not cut, or it goes on into a later share */
    float *acc = part + 2 * t * slot, *m = acc + H * D, *l = m + H;
    for (int u = t - 1; u >= 0; u--) {
        int64_t su = total * u / nt, eu = total * (u + 1) / nt, su_start;
        if (eu <= start) break;
        if (su >= eu) continue;
        const float *pa = part + (2 * u + (att_locate(a, su, &su_start) != b)) * slot, *pm = pa + H * D;
        for (int64_t r = 0; r < H; r++) {
            float mm = m[r] > pm[r] ? m[r] : pm[r], w0 = expf(m[r] - mm), w1 = expf(pm[r] - mm);
            l[r] = l[r] * w0 + pm[H + r] * w1;
            m[r] = mm;
            for (int64_t i = 0; i < D; i++) acc[r * D + i] = acc[r * D + i] * w0 + pa[r * D + i] * w1;
        }
    }
    float *o = a->out + b * H * D;
    for (int64_t r = 0; r < H; r++) {
        float inv = 1.0f / l[r];
        for (int64_t i = 0; i < D; i++) o[r * D + i] = acc[r * D + i] * inv;
    }
}
#endif

int lp_decode_attention_f32(const float *q, int64_t q_stride, const void *k, const void *v, int64_t kv_type,
                            const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t B,
                            int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, float *out) {
    if (!lp_kv_valid(kv_type)) return -1;
    const att_t a = {q, k, v, tables, lens, q_stride, max_blocks, B, H, KVH, D, bs, H / KVH,
                     lp_kv_row_bytes((int)kv_type, D), scale, out, (int)kv_type};
    int64_t total = 0; /* context positions, all sequences */
    for (int64_t b = 0; b < B; b++) {
        if (lens[b] > 0)
            total += lens[b];
        else /* no context: zeros, as an empty weighted sum */
            for (int64_t i = 0; i < H * D; i++) out[b * H * D + i] = 0.0f;
    }
#ifdef _OPENMP
    int nt = total * H * D >= ATT_PARALLEL_MIN && !omp_in_parallel() ? omp_get_max_threads() : 1;
    if (nt > 1) {
        /* Threads take equal shares of all positions, cutting sequences where needed and merging
         * their partial softmaxes after (as flash-decoding does): a batch of one uses every
         * thread, and uneven lengths still balance. */
        float stack_part[ATT_PART_FLOATS], *part;
        int64_t need = 2 * (int64_t)nt * H * (D + 2);
        part = need <= ATT_PART_FLOATS ? stack_part : malloc(sizeof(float) * (size_t)need);
        int split = part != 0; /* (no memory for the partials: whole sequences per thread) */
#pragma omp parallel num_threads(nt)
        {
            int t = omp_get_thread_num(), n = omp_get_num_threads();
            att_run(&a, att_bound(&a, total, t, n, split), att_bound(&a, total, t + 1, n, split), t, part);
            if (split && n > 1) {
#pragma omp barrier
                att_merge(&a, total, t, n, part);
            }
        }
        if (part != stack_part) free(part);
        return 0;
    }
#endif
    att_run(&a, 0, total, 0, 0);
    return 0;
}

void lp_kv_store(void *dst, const float *x, int64_t KVH, int64_t D, int64_t kv_type) {
    const int kt = (int)kv_type;
    const int64_t rb = lp_kv_row_bytes(kt, D);
    for (int64_t g = 0; g < KVH; g++) {
        char *row = (char *)dst + g * rb;
        const float *xs = x + g * D;
        if (kt == LP_KV_F32) {
            memcpy(row, xs, sizeof(float) * D);
        } else if (kt == LP_KV_BF16 || kt == LP_KV_F16) {
            for (int64_t i = 0; i < D; i++) {
                const uint16_t b = kt == LP_KV_BF16 ? lp_f32_to_bf16(xs[i]) : lp_f32_to_f16(xs[i]);
                memcpy(row + 2 * i, &b, 2);
            }
        } else {
            float amax = 0.0f;
            for (int64_t i = 0; i < D; i++) amax = fabsf(xs[i]) > amax ? fabsf(xs[i]) : amax;
            const float qmax = kt == LP_KV_I8 ? 127.0f : 448.0f, s = amax / qmax, div = s > 0 ? s : 1.0f;
            for (int64_t i = 0; i < D; i++) {
                const float y = xs[i] / div;
                if (kt == LP_KV_I8) {
                    const float r = nearbyintf(y);
                    row[i] = (char)(int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
                } else {
                    row[i] = (char)lp_f32_to_fp8(y > 448.0f ? 448.0f : y < -448.0f ? -448.0f : y);
                }
            }
            memcpy(row + D, &s, sizeof s);
        }
    }
}
