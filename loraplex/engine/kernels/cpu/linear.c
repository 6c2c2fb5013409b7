/* Linear layers for CPU serving over weights packed once at load: y = x @ W^T (+ bias), fp32.
 *
 * Semantics: for m < M, n < N:  y[m, n] = sum_k x[m, k] * W[n, k] + (bias ? bias[n] : 0),
 * where W [N, K] is given packed (lp_pack_f32) as panels of NR = 24 output columns:
 * Wp[p, k, j] = W[p * NR + j, k] (zero beyond N), so a panel is one contiguous K x NR block.
 *
 * Why: the decode batches a server runs (1 to a few dozen tokens) are where MKL is weakest on this
 * kind of CPU: a batch-1 GEMV streams the weights on one thread, and at 32 rows MKL repacks the
 * weights on every call and reaches about half the machine's FMA rate (bench/RESULTS.md). Packed
 * panels are read in order, once per call, by a register-blocked 4 x 24 kernel (12 accumulators),
 * the threads splitting the panels; rows are taken in blocks of 64 so a block of x stays in cache.
 */
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define NR 24
#define ROW_BLOCK 64
/* Below this many weights a second thread costs more than it saves. */
#define PARALLEL_MIN_WEIGHTS (64 * 1024)

int64_t lp_packed_size(int64_t N, int64_t K) { return (N + NR - 1) / NR * NR * K; }

void lp_pack_f32(const float *w, int64_t N, int64_t K, float *wp) {
    int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < NR; j++) {
                int64_t n = p * NR + j;
                wp[(p * K + k) * NR + j] = n < N ? w[n * K + k] : 0.0f;
            }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* R (<= 4) rows of x against one panel; inlined with a constant R so the accumulators stay in
 * registers. Writes `cols` (<= NR) columns of y. */
static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t lda, int64_t K,
                                                             const float *wp, const float *bias, float *y,
                                                             int64_t ldy, int64_t cols, const int R) {
    __m256 acc[4][3];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
        for (int c = 0; c < 3; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 b0 = _mm256_loadu_ps(wp + k * NR), b1 = _mm256_loadu_ps(wp + k * NR + 8),
               b2 = _mm256_loadu_ps(wp + k * NR + 16);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m256 a = _mm256_broadcast_ss(x + r * lda + k);
            acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
            acc[r][2] = _mm256_fmadd_ps(a, b2, acc[r][2]);
        }
    }
    /* the accumulators leave registers only here, by name: indexing them in a loop over a
     * run-time bound makes GCC keep them in memory through the k loop (half the speed) */
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        float *out = y + r * ldy, tmp[NR];
        _mm256_storeu_ps(tmp, acc[r][0]);
        _mm256_storeu_ps(tmp + 8, acc[r][1]);
        _mm256_storeu_ps(tmp + 16, acc[r][2]);
        for (int64_t j = 0; j < cols; j++) out[j] = tmp[j] + (bias ? bias[j] : 0.0f);
    }
}

static void panel(const float *x, int64_t lda, int64_t M, int64_t K, const float *wp, const float *bias,
                  float *y, int64_t ldy, int64_t cols) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) panel_rows(x + m * lda, lda, K, wp, bias, y + m * ldy, ldy, cols, 4);
    switch (M - m) {
        case 3: panel_rows(x + m * lda, lda, K, wp, bias, y + m * ldy, ldy, cols, 3); break;
        case 2: panel_rows(x + m * lda, lda, K, wp, bias, y + m * ldy, ldy, cols, 2); break;
        case 1: panel_rows(x + m * lda, lda, K, wp, bias, y + m * ldy, ldy, cols, 1); break;
    }
}
#else
static void panel(const float *x, int64_t lda, int64_t M, int64_t K, const float *wp, const float *bias,
                  float *y, int64_t ldy, int64_t cols) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < cols; j++) {
            float s = bias ? bias[j] : 0.0f;
            for (int64_t k = 0; k < K; k++) s += x[m * lda + k] * wp[k * NR + j];
            y[m * ldy + j] = s;
        }
}
#endif

int lp_linear_packed_f32(const float *x, int64_t M, int64_t lda, int64_t K, const float *wp, int64_t N,
                         const float *bias, float *y) {
    if (M < 0 || K < 1 || N < 1 || lda < K) return -1;
    int64_t panels = (N + NR - 1) / NR;
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
        int64_t rows = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
#pragma omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_WEIGHTS)
        for (int64_t p = 0; p < panels; p++) {
            int64_t cols = N - p * NR < NR ? N - p * NR : NR;
            panel(x + m0 * lda, lda, rows, K, wp + p * K * NR, bias ? bias + p * NR : 0, y + m0 * N + p * NR, N,
                  cols);
        }
    }
    return 0;
}
