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
 * (The decode attention over the paged cache is decode_attention.c.)
 */
#include <math.h>
#include <stdint.h>

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

#include "exp8.h"

#if defined(__AVX2__) && defined(__FMA__)

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

