/* Per-layer elementwise work of a decoder step, fused, for CPU serving in fp32.
 *
 * Why: at decode batch sizes a layer's non-GEMM work is a dozen tiny torch ops (residual add,
 * RMSNorm, RoPE, the paged KV gather and attention), each costing a dispatch of several
 * microseconds; here each is one call.
 *
 * Semantics:
 *   lp_add_rms_norm_f32:  if delta: h[t] += delta[t];  out[t] = h[t] * w / sqrt(mean(h[t]^2) + eps)
 *                         h, delta, out: [T, H] contiguous; w: [H].
 *   lp_rope_f32:          for t < T and head j < n_heads of row t of x (row stride `stride`):
 *                         v = x[t, j*D : (j+1)*D], c = cos[pos[t]], s = sin[pos[t]] ([max_pos, D]
 *                         tables, each half-frequency repeated twice);
 *                         v <- v * c + rotate_half(v) * s, rotate_half(v) = (-v[D/2:], v[:D/2]).
 *   lp_silu_mul_f32:      out[t, i] = silu(gu[t, i]) * gu[t, I + i], silu(x) = x / (1 + e^-x);
 *                         gu: [T, 2I] (gate | up), out: [T, I].
 *   lp_decode_attention_f32: one query token per sequence b < B, over its paged context:
 *                         for head h (kv head g = h / (H / KVH)), context j < lens[b],
 *                         slot(j) = tables[b, j / bs] * bs + j % bs,
 *                         p = softmax_j(scale * q[b, h] . k[slot(j), g]);
 *                         out[b, h] = sum_j p[j] * v[slot(j), g].
 *                         q: row stride q_stride, heads D apart; k, v: [slots, KVH, D];
 *                         tables: [B, max_blocks] int64; lens: [B] int64; out: [B, H, D].
 *                         lens[b] <= 0 gives zeros. Returns 0: nothing can fail (scratch is on
 *                         the stack; only with very many heads does splitting a context between
 *                         threads take a heap buffer, and without one it does not split).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#define PRAGMA(x) _Pragma(#x)
#define PARALLEL_IF(cond) PRAGMA(omp parallel for schedule(static) if(cond))
#else
#define PARALLEL_IF(cond)
#endif

/* Below these sizes a second thread costs more than it saves (a fork/join is a few microseconds,
 * and far more when another process holds the other core). */
#define PARALLEL_MIN_ROWS 8

void lp_add_rms_norm_f32(float *h, const float *delta, const float *w, int64_t T, int64_t H, float eps,
                         float *out) {
    PARALLEL_IF(T >= PARALLEL_MIN_ROWS)
    for (int64_t t = 0; t < T; t++) {
        float *row = h + t * H;
        float ss = 0.0f;
        if (delta) {
            const float *d = delta + t * H;
            for (int64_t i = 0; i < H; i++) {
                row[i] += d[i];
                ss += row[i] * row[i];
            }
        } else {
            for (int64_t i = 0; i < H; i++) ss += row[i] * row[i];
        }
        float inv = 1.0f / sqrtf(ss / (float)H + eps);
        float *o = out + t * H;
        for (int64_t i = 0; i < H; i++) o[i] = w[i] * (row[i] * inv);
    }
}

void lp_rope_f32(float *x, int64_t T, int64_t stride, int64_t n_heads, int64_t D, const int64_t *pos,
                 const float *cos_t, const float *sin_t) {
    int64_t half = D / 2;
    PARALLEL_IF(T >= PARALLEL_MIN_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + pos[t] * D, *s = sin_t + pos[t] * D;
        for (int64_t j = 0; j < n_heads; j++) {
            float *v = x + t * stride + j * D;
            for (int64_t i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* e^x for 8 lanes, x clamped to [-87, 88] (the normal float range): 2^n * p(r) with
 * x = n ln2 + r, |r| <= ln2 / 2, p a degree-7 Taylor polynomial; relative error ~2e-7, like expf. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  /* ln2, split in two */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

static void silu_mul_row(const float *g, const float *u, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(x, den), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

#else
static void silu_mul_row(const float *g, const float *u, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

#endif

void lp_silu_mul_f32(const float *gu, int64_t T, int64_t I, float *out) {
    PARALLEL_IF(T * I >= PARALLEL_MIN_ROWS * 1024)
    for (int64_t t = 0; t < T; t++) silu_mul_row(gu + t * 2 * I, gu + t * 2 * I + I, I, out + t * I);
}


/* ---- Decode attention ----
 * A piece of work is one sequence over a range of its context, for a run of its query heads. It
 * walks the range in chunks of ATT_CHUNK cache slots, and each chunk kv head by kv head: score the
 * chunk for every query head of the kv head's group (its K rows stay in L1 across those heads),
 * take an online-softmax step per head (running max m and sum l; acc and l are rescaled by
 * e^(m_old - m_new) when the max grows), then add the chunk's weighted V rows to acc [D], held in
 * registers over the chunk. So nothing beyond one chunk's scores is kept, at any length, and
 * nothing is allocated. Slots are found through pointer arrays, so any block size works; a short
 * chunk repeats a real slot in its spare lanes (with weight 0), so no other slot is ever read.
 * Work is memory-bound once the cache is out of L3 (as it is in a real step): the order above,
 * with long chunks, is what streamed fastest of the orders tried. */
#define ATT_CHUNK 64         /* slots per softmax step, a multiple of 8 */
#define ATT_HEADS 32         /* most query heads a piece takes at once (its scores: ATT_HEADS x ATT_CHUNK) */
#define ATT_ACC_FLOATS 2048  /* a whole sequence's accumulators, on the stack: heads per pass x (D + 2) */
#define ATT_PART_FLOATS 8192 /* the partials of split sequences (two per thread), on the stack if they fit */
/* Below this much work (context positions x query heads x D) one thread does it all. */
#define ATT_PARALLEL_MIN (128 * 1024)

typedef struct {
    const float *q, *k, *v;
    const int64_t *tables, *lens;
    int64_t q_stride, max_blocks, B, H, KVH, D, bs, group;
    float scale;
    float *out;
} att_t;

#if defined(__AVX2__) && defined(__FMA__)
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

/* Lane p: q [D] . kp[p] [D], for 8 rows at once (one horizontal-sum tree for all 8). */
static inline __m256 dot8(const float *q, const float *const *kp, int64_t off, int64_t D) {
    __m256 a[8];
    for (int p = 0; p < 8; p++) a[p] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 x = _mm256_loadu_ps(q + d);
        for (int p = 0; p < 8; p++) a[p] = _mm256_fmadd_ps(x, _mm256_loadu_ps(kp[p] + off + d), a[p]);
    }
    if (d < D) {
        __m256i mk = first_lanes(D - d);
        __m256 x = _mm256_maskload_ps(q + d, mk);
        for (int p = 0; p < 8; p++) a[p] = _mm256_fmadd_ps(x, _mm256_maskload_ps(kp[p] + off + d, mk), a[p]);
    }
    __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* One chunk for nh heads of one kv head: q [nh, D] (heads D apart); slots kp, vp (the kv head's
 * rows at kp[p] + off), of which the first np are the chunk's and the rest up to a multiple of 8
 * repeat a real one; s: scratch [nh, ATT_CHUNK]; acc [nh, D], m, l [nh]. */
static void att_chunk(const float *q, int64_t nh, int64_t D, float scale, const float *const *kp,
                      const float *const *vp, int64_t off, int64_t np, float *s, float *acc, float *m, float *l) {
    const int64_t n8 = (np + 7) / 8 * 8;
    for (int64_t r = 0; r < nh; r++) /* all the scores first: independent work, no stalls */
        for (int64_t p = 0; p < n8; p += 8) {
            __m256 x = _mm256_mul_ps(dot8(q + r * D, kp + p, off, D), _mm256_set1_ps(scale));
            __m256 valid = _mm256_castsi256_ps(first_lanes(np - p));
            _mm256_storeu_ps(s + r * ATT_CHUNK + p, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, valid));
        }
    for (int64_t r = 0; r < nh; r++) {
        float *sr = s + r * ATT_CHUNK, *ar = acc + r * D;
        __m256 mx = _mm256_loadu_ps(sr);
        for (int64_t p = 8; p < n8; p += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sr + p));
        float mt = hmax8(mx);
        if (mt > m[r]) { /* the running max grows: rescale what is accumulated */
            float alpha = expf(m[r] - mt);
            for (int64_t i = 0; i < D; i++) ar[i] *= alpha;
            l[r] *= alpha;
            m[r] = mt;
        }
        __m256 sum = _mm256_setzero_ps(), mv = _mm256_set1_ps(m[r]);
        for (int64_t p = 0; p < n8; p += 8) { /* (-inf lanes: exp8 clamps, so zero them) */
            __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + p), mv)),
                                     _mm256_castsi256_ps(first_lanes(np - p)));
            _mm256_storeu_ps(sr + p, e);
            sum = _mm256_add_ps(sum, e);
        }
        l[r] += hsum8(sum);
        /* acc += weights . V rows: 64 floats of acc held in registers over the whole chunk */
        int64_t d = 0;
        for (; d + 64 <= D; d += 64) {
            __m256 c[8];
            for (int i = 0; i < 8; i++) c[i] = _mm256_loadu_ps(ar + d + 8 * i);
            for (int64_t p = 0; p < np; p++) {
                __m256 w = _mm256_broadcast_ss(sr + p);
                for (int i = 0; i < 8; i++) c[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vp[p] + off + d + 8 * i), c[i]);
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(ar + d + 8 * i, c[i]);
        }
        for (; d < D; d += 8) { /* the rest of D, 8 at a time (masked at the end), two chains */
            __m256i mk = first_lanes(D - d);
            __m256 c0 = _mm256_maskload_ps(ar + d, mk), c1 = _mm256_setzero_ps();
            int64_t p = 0;
            for (; p + 2 <= np; p += 2) {
                c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(sr + p), _mm256_maskload_ps(vp[p] + off + d, mk), c0);
                c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(sr + p + 1), _mm256_maskload_ps(vp[p + 1] + off + d, mk), c1);
            }
            if (p < np) c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(sr + p), _mm256_maskload_ps(vp[p] + off + d, mk), c0);
            _mm256_maskstore_ps(ar + d, mk, _mm256_add_ps(c0, c1));
        }
    }
}
#else
static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[i + l] * b[i + l];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static void att_chunk(const float *q, int64_t nh, int64_t D, float scale, const float *const *kp,
                      const float *const *vp, int64_t off, int64_t np, float *s, float *acc, float *m, float *l) {
    for (int64_t r = 0; r < nh; r++) {
        float *sr = s + r * ATT_CHUNK, mt = -INFINITY, *ar = acc + r * D;
        for (int64_t p = 0; p < np; p++) {
            sr[p] = scale * dot(q + r * D, kp[p] + off, D);
            mt = sr[p] > mt ? sr[p] : mt;
        }
        if (mt > m[r]) {
            float alpha = expf(m[r] - mt);
            for (int64_t i = 0; i < D; i++) ar[i] *= alpha;
            l[r] *= alpha;
            m[r] = mt;
        }
        for (int64_t p = 0; p < np; p++) {
            float w = expf(sr[p] - m[r]);
            l[r] += w;
            for (int64_t i = 0; i < D; i++) ar[i] += w * vp[p][off + i];
        }
    }
}
#endif

/* The slots of sequence positions from block index *blk, offset *o (both advanced): np of them,
 * then copies of the first up to a multiple of 8. */
static void att_rows(const att_t *a, const int64_t *table, int64_t np, int64_t *blk, int64_t *o, const float **kp,
                     const float **vp) {
    const int64_t bs = a->bs, row = a->KVH * a->D;
    int64_t p = 0;
    for (; p < np; p++) {
        int64_t at = (table[*blk] * bs + *o) * row;
        kp[p] = a->k + at, vp[p] = a->v + at;
        if (++*o == bs) *o = 0, ++*blk;
    }
    for (; p % 8; p++) kp[p] = kp[0], vp[p] = vp[0];
}

/* Query heads [h0, h0 + nh) (nh <= ATT_HEADS) of sequence b over its context [j0, j1), from
 * scratch: acc [nh, D], m, l [nh]. */
static void att_piece(const att_t *a, int64_t b, int64_t h0, int64_t nh, int64_t j0, int64_t j1, float *acc,
                      float *m, float *l) {
    const int64_t D = a->D, G = a->group, *table = a->tables + b * a->max_blocks;
    for (int64_t i = 0; i < nh * D; i++) acc[i] = 0.0f;
    for (int64_t r = 0; r < nh; r++) m[r] = -INFINITY, l[r] = 0.0f;
    const float *q = a->q + b * a->q_stride + h0 * D, *kp[ATT_CHUNK], *vp[ATT_CHUNK];
    float s[ATT_HEADS * ATT_CHUNK];
    int64_t blk = j0 / a->bs, o = j0 % a->bs; /* walk the blocks: no division per position */
    for (int64_t j = j0, np; j < j1; j += np) {
        np = j1 - j < ATT_CHUNK ? j1 - j : ATT_CHUNK;
        att_rows(a, table, np, &blk, &o, kp, vp);
        for (int64_t h = h0, hn; h < h0 + nh; h += hn) { /* the heads of one kv head at a time */
            int64_t g = h / G, end = (g + 1) * G < h0 + nh ? (g + 1) * G : h0 + nh;
            hn = end - h;
            att_chunk(q + (h - h0) * D, hn, D, a->scale, kp, vp, g * D, np, s, acc + (h - h0) * D, m + (h - h0),
                      l + (h - h0));
        }
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

int lp_decode_attention_f32(const float *q, int64_t q_stride, const float *k, const float *v,
                            const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t B,
                            int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, float *out) {
    const att_t a = {q, k, v, tables, lens, q_stride, max_blocks, B, H, KVH, D, bs, H / KVH, scale, out};
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
