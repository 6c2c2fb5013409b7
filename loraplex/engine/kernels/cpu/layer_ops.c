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
#define PARALLEL_MIN_ATTENTION (8 * 1024) /* (sequence, kv head) pairs x context length */

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

/* p[j] = e^(p[j] - m) for j < n; returns their sum. */
static float exp_shift_sum(float *p, int64_t n, float m) {
    __m256 acc = _mm256_setzero_ps(), mv = _mm256_set1_ps(m);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv));
        _mm256_storeu_ps(p + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8], sum = 0.0f;
    _mm256_storeu_ps(lanes, acc);
    for (int l = 0; l < 8; l++) sum += lanes[l];
    for (; j < n; j++) {
        p[j] = expf(p[j] - m);
        sum += p[j];
    }
    return sum;
}
#else
static void silu_mul_row(const float *g, const float *u, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static float exp_shift_sum(float *p, int64_t n, float m) {
    float sum = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        p[j] = expf(p[j] - m);
        sum += p[j];
    }
    return sum;
}
#endif

void lp_silu_mul_f32(const float *gu, int64_t T, int64_t I, float *out) {
    PARALLEL_IF(T * I >= PARALLEL_MIN_ROWS * 1024)
    for (int64_t t = 0; t < T; t++) silu_mul_row(gu + t * 2 * I, gu + t * 2 * I + I, I, out + t * I);
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[i + l] * b[i + l];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

int lp_decode_attention_f32(const float *q, int64_t q_stride, const float *k, const float *v,
                            const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t B,
                            int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, float *out) {
    int64_t group = H / KVH, max_len = 1, row = KVH * D; /* row: floats between a block's slots */
    for (int64_t b = 0; b < B; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    int failed = 0;
    PARALLEL_IF(B * KVH >= 2 && B * KVH * max_len >= PARALLEL_MIN_ATTENTION)
    for (int64_t item = 0; item < B * KVH; item++) {
        int64_t b = item / KVH, g = item % KVH, n = lens[b];
        /* scratch: the group's scores [group, n], then its output accumulators [group, D] */
        float *p = malloc(sizeof(float) * (size_t)(group * (max_len + D)));
        if (!p) {
            failed = 1;
            continue;
        }
        float *restrict acc = p + group * max_len;
        const int64_t *table = tables + b * max_blocks;
        const float *qg = q + b * q_stride + g * group * D;
        /* walk the context block by block: no division per position */
        for (int64_t j0 = 0, blk = 0; j0 < n; j0 += bs, blk++) {
            const float *kb = k + table[blk] * bs * row + g * D;
            for (int64_t o = 0; o < bs && j0 + o < n; o++)
                for (int64_t r = 0; r < group; r++) p[r * n + j0 + o] = scale * dot(qg + r * D, kb + o * row, D);
        }
        for (int64_t r = 0; r < group; r++) {
            float *pr = p + r * n, m = -INFINITY;
            for (int64_t j = 0; j < n; j++) m = pr[j] > m ? pr[j] : m;
            float inv = 1.0f / exp_shift_sum(pr, n, m);
            for (int64_t j = 0; j < n; j++) pr[j] *= inv;
        }
        for (int64_t i = 0; i < group * D; i++) acc[i] = 0.0f;
        for (int64_t j0 = 0, blk = 0; j0 < n; j0 += bs, blk++) {
            const float *vb = v + table[blk] * bs * row + g * D;
            for (int64_t o = 0; o < bs && j0 + o < n; o++) {
                const float *restrict vj = vb + o * row;
                for (int64_t r = 0; r < group; r++) {
                    float w = p[r * n + j0 + o];
                    float *restrict ar = acc + r * D;
                    for (int64_t i = 0; i < D; i++) ar[i] += w * vj[i];
                }
            }
        }
        for (int64_t r = 0; r < group; r++) {
            float *o = out + (b * H + g * group + r) * D;
            for (int64_t i = 0; i < D; i++) o[i] = acc[r * D + i];
        }
        free(p);
    }
    return failed ? -1 : 0;
}
