/* The register-blocked pieces lora.c's two phases are made of (AVX2 / AVX-512): dot products over
 * weight rows for one to six tokens, the 8x8 transposes that pack 16-row tiles, and the tile GEMM
 * microkernel. Included by lora.c only (every function is static). A row's or an output's sum is
 * formed the same way whichever function or split serves it, so a thread's share never changes bits.
 */
#ifndef LORAPLEX_CPU_LORA_TILES_H
#define LORAPLEX_CPU_LORA_TILES_H
#include <stdint.h>

#define MAX_RANK 256
#define EXPAND_TILE 16 /* outputs per transposed B tile */
#define DOT_KC 768     /* features per dot-product pass: six tokens' worth (18 KB) stay in L1 */

#if defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>

static const int32_t MASK_TABLE[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

/* Lanes 0 .. n-1 on (0 < n <= 8). */
static inline __m256i lane_mask(int64_t n) { return _mm256_loadu_si256((const __m256i *)(MASK_TABLE + 8 - n)); }

/* ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)): the order of hsum4x8 and hsum8x8, so a row's or
 * an output's sum has the same bits whichever of them serves it, however the rows or outputs are
 * split between threads. */
static inline float hsum8(__m256 v) {
    __m256 t = _mm256_hadd_ps(v, v);
    t = _mm256_hadd_ps(t, t);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

/* [sum(a), sum(b), sum(c), sum(d)] */
static inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* [sum(v[0]), .., sum(v[7])] */
static inline __m256 hsum8x8(const __m256 *v) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* t0's halves added, then t1's: 128-bit adds (a cross-lane permute costs 8 uops on Zen 1) */
    const __m128 lo = _mm_add_ps(_mm256_castps256_ps128(t0), _mm256_extractf128_ps(t0, 1));
    const __m128 hi = _mm_add_ps(_mm256_castps256_ps128(t1), _mm256_extractf128_ps(t1, 1));
    return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}

/* The dot products' chunk of a weight row: 16 lanes with AVX-512, else 8; rfold sums a chunk's halves
 * to the 8 lanes hsum8 and its kin take, so every row's or output's sum has one order. */
#if defined(__AVX512F__)
#define DOT_CHUNK 16
typedef __m512 rvec_t;
typedef __mmask16 rmask_t;
static inline rmask_t chunk_mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
static inline rvec_t rzero(void) { return _mm512_setzero_ps(); }
static inline rvec_t rload(const float *p, int whole, rmask_t m) {
    return whole ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
}
static inline rvec_t rfma(rvec_t a, rvec_t b, rvec_t c) { return _mm512_fmadd_ps(a, b, c); }
static inline __m256 rfold(rvec_t v) { /* (the 64-bit extract is AVX-512F; the 32-bit one needs DQ) */
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#else
#define DOT_CHUNK 8
typedef __m256 rvec_t;
typedef __m256i rmask_t;
static inline rmask_t chunk_mask(int64_t n) { return lane_mask(n < 8 ? n : 8); }
static inline rvec_t rzero(void) { return _mm256_setzero_ps(); }
static inline rvec_t rload(const float *p, int whole, rmask_t m) {
    return whole ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, m);
}
static inline rvec_t rfma(rvec_t a, rvec_t b, rvec_t c) { return _mm256_fmadd_ps(a, b, c); }
static inline __m256 rfold(rvec_t v) { return v; }
#endif

/* Shrink, R rows of A (a, row stride lda) x M tokens over kc features: y[m * ldy + r] (+)= A_r . x_m
 * (added when acc_y: a later chunk of features). Inlined with constant R and M so the R * M
 * accumulators stay in registers. Lanes beyond kc read as zero; nothing past a row is touched. */
static inline __attribute__((always_inline)) void shrink_rm(const float *a, int64_t lda, int64_t kc,
                                                            const float *const *xr, int64_t x0, float *y, int64_t ldy,
                                                            int acc_y, const int R, const int M) {
    rvec_t acc[4][6];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = rzero();
    for (int64_t k = 0; k < kc; k += DOT_CHUNK) {
        const int whole = kc - k >= DOT_CHUNK;
        const rmask_t mk = chunk_mask(kc - k);
        rvec_t av[4];
        for (int r = 0; r < R; r++) av[r] = rload(a + r * lda + k, whole, mk);
        for (int m = 0; m < M; m++) {
            const rvec_t xv = rload(xr[m] + x0 + k, whole, mk);
            for (int r = 0; r < R; r++) acc[r][m] = rfma(av[r], xv, acc[r][m]);
        }
    }
    for (int m = 0; m < M; m++) {
        if (R == 4) {
            __m128 v = hsum4x8(rfold(acc[0][m]), rfold(acc[1][m]), rfold(acc[2][m]), rfold(acc[3][m]));
            _mm_storeu_ps(y + m * ldy, acc_y ? _mm_add_ps(_mm_loadu_ps(y + m * ldy), v) : v);
        } else {
            for (int r = 0; r < R; r++) y[m * ldy + r] = (acc_y ? y[m * ldy + r] : 0.0f) + hsum8(rfold(acc[r][m]));
        }
    }
}

/* Shrink by dot products over A's rows (fewer than MANY_TOKENS tokens): the tokens in groups, each
 * against the rows two at a time (four for one or two tokens: memory-bound, A read once in order),
 * over DOT_KC features at a time so a group's features stay in L1 while A comes from L2. */
static void shrink_dot(const float *a, int64_t K, int64_t j0, int64_t j1, const float *const *xr, int m, float *y,
                       int64_t ldy) {
    const int ng = (m + 5) / 6;
    const int64_t step = m <= 2 ? K : DOT_KC;
    for (int64_t x0 = 0; x0 < K; x0 += step) {
        const int64_t kc = K - x0 < step ? K - x0 : step;
        const int acc = x0 > 0;
        for (int g = 0; g < ng; g++) {
            const int t = m * g / ng, c = m * (g + 1) / ng - t;
            const float *const *xs = xr + t;
            float *ys = y + t * ldy;
            const float *ax = a + x0;
            int64_t j = j0;
            for (; c <= 2 && j + 4 <= j1; j += 4) {
                if (c == 1)
                    shrink_rm(ax + j * K, K, kc, xs, x0, ys + j, ldy, acc, 4, 1);
                else
                    shrink_rm(ax + j * K, K, kc, xs, x0, ys + j, ldy, acc, 4, 2);
            }
            for (; c > 2 && j + 2 <= j1; j += 2) {
                switch (c) {
                    case 3: shrink_rm(ax + j * K, K, kc, xs, x0, ys + j, ldy, acc, 2, 3); break;
                    case 4: shrink_rm(ax + j * K, K, kc, xs, x0, ys + j, ldy, acc, 2, 4); break;
                    case 5: shrink_rm(ax + j * K, K, kc, xs, x0, ys + j, ldy, acc, 2, 5); break;
                    default: shrink_rm(ax + j * K, K, kc, xs, x0, ys + j, ldy, acc, 2, 6); break;
                }
            }
            for (; j < j1; j++)
                for (int q = 0; q < c; q++) shrink_rm(ax + j * K, K, kc, xs + q, x0, ys + q * ldy + j, ldy, acc, 1, 1);
        }
    }
}

/* Expand by dot products over B's rows, for one or two tokens (memory-bound: B streamed in order):
 * out_m[n] += B[n, :rk] . y_m for n0 <= n < n1. */
static inline __attribute__((always_inline)) void expand_dot(const float *b, int64_t r_max, int64_t rk, int64_t n0,
                                                             int64_t n1, const float *y, int64_t ldy,
                                                             float *const *outr, const int M) {
    rvec_t yv[2][MAX_RANK / DOT_CHUNK];
    const int64_t chunks = (rk + DOT_CHUNK - 1) / DOT_CHUNK;
    const rmask_t tail = chunk_mask(rk - (chunks - 1) * DOT_CHUNK); /* padding columns read as 0 */
    const int full = rk % DOT_CHUNK == 0;                            /* the last chunk needs no mask */
    for (int m = 0; m < M; m++)
        for (int64_t c = 0; c < chunks; c++) yv[m][c] = rload(y + m * ldy + c * DOT_CHUNK, c + 1 < chunks || full, tail);
    int64_t n = n0;
    /* chunk by chunk over 8 rows at a time, the rows' loop unrolled: the accumulators stay in
     * registers (a run-time chunk loop inside the row loop kept them in memory, at 8 GB/s from L2) */
    for (; n + 8 <= n1; n += 8) {
        rvec_t p[2][8];
        const float *br = b + n * r_max;
        for (int m = 0; m < M; m++)
            for (int i = 0; i < 8; i++) p[m][i] = rzero();
        for (int64_t c = 0; c < chunks; c++) {
            const int whole = c + 1 < chunks || full;
            for (int i = 0; i < 8; i++) {
                const rvec_t bv = rload(br + i * r_max + c * DOT_CHUNK, whole, tail);
                for (int m = 0; m < M; m++) p[m][i] = rfma(bv, yv[m][c], p[m][i]);
            }
        }
        for (int m = 0; m < M; m++) {
            const __m256 f[8] = {rfold(p[m][0]), rfold(p[m][1]), rfold(p[m][2]), rfold(p[m][3]),
                                 rfold(p[m][4]), rfold(p[m][5]), rfold(p[m][6]), rfold(p[m][7])};
            _mm256_storeu_ps(outr[m] + n, _mm256_add_ps(_mm256_loadu_ps(outr[m] + n), hsum8x8(f)));
        }
    }
    for (; n < n1; n++) {
        const float *br = b + n * r_max;
        for (int m = 0; m < M; m++) {
            rvec_t acc = rzero();
            for (int64_t c = 0; c < chunks; c++)
                acc = rfma(rload(br + c * DOT_CHUNK, c + 1 < chunks || full, tail), yv[m][c], acc);
            outr[m][n] += hsum8(rfold(acc));
        }
    }
}

/* Bt[k * 16 + i] = B[n0 + i, k] for k < rk, i < 16 (rows of B r_max apart; also A's, then r_max = K);
 * rows at or beyond `rows` read as zero. Loads whole 8-column chunks, up to round_up(rk, 8) <= r_max,
 * but stores only k < rk. */
static void pack_tile(const float *b, int64_t r_max, int64_t rk, int64_t n0, int64_t rows, float *bt) {
    if (r_max % 8) { /* rows are not 8-float aligned chunks: scalar */
        for (int64_t k = 0; k < rk; k++)
            for (int64_t i = 0; i < EXPAND_TILE; i++)
                bt[k * EXPAND_TILE + i] = i < rows ? b[(n0 + i) * r_max + k] : 0.0f;
        return;
    }
    for (int h = 0; h < EXPAND_TILE; h += 8) {
        for (int64_t k0 = 0; k0 < rk; k0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = h + i < rows ? _mm256_loadu_ps(b + (n0 + h + i) * r_max + k0) : _mm256_setzero_ps();
            /* 8x8 transpose */
            __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
            __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
            __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
            __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
            __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
            __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
            __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
            __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
            __m256 c[8] = {
                _mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31),
            };
            for (int i = 0; i < 8 && k0 + i < rk; i++) _mm256_store_ps(bt + (k0 + i) * EXPAND_TILE + h, c[i]);
        }
    }
}

/* The GEMM microkernel of both phases, M tokens x one packed tile of 16 columns (12 accumulators):
 * out_m[n + i] = (init ? 0 : out_m[n + i]) + sum_{k < kn} in_m[k] * P[k * 16 + i] for i < cols <= 16.
 * Shrink: P = 16 rows of A transposed, in = x rows, out = y rows; expand: P = 16 rows of B
 * transposed, in = y rows, out = out rows. */
static inline __attribute__((always_inline)) void tile_gemm(const float *P, int64_t kn, const float *const *in,
                                                            float *const *outr, int64_t n, int64_t cols, int init,
                                                            const int M) {
#if defined(__AVX512F__)
    /* a tile row is one 512-bit vector (twice the AVX2 body's columns per FMA); even and odd k in
     * separate accumulators, so 2 * M chains hide the FMA latency as the AVX2 body's 12 do */
    const __mmask16 live = (__mmask16)((1u << cols) - 1);
    __m512 acc5[6][2];
    for (int m = 0; m < M; m++) {
        acc5[m][0] = init ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(live, outr[m] + n);
        acc5[m][1] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 2 <= kn; k += 2) {
        __m512 p0 = _mm512_load_ps(P + k * EXPAND_TILE), p1 = _mm512_load_ps(P + (k + 1) * EXPAND_TILE);
        for (int m = 0; m < M; m++) {
            acc5[m][0] = _mm512_fmadd_ps(p0, _mm512_set1_ps(in[m][k]), acc5[m][0]);
            acc5[m][1] = _mm512_fmadd_ps(p1, _mm512_set1_ps(in[m][k + 1]), acc5[m][1]);
        }
    }
    if (k < kn) {
        __m512 p0 = _mm512_load_ps(P + k * EXPAND_TILE);
        for (int m = 0; m < M; m++) acc5[m][0] = _mm512_fmadd_ps(p0, _mm512_set1_ps(in[m][k]), acc5[m][0]);
    }
    for (int m = 0; m < M; m++) _mm512_mask_storeu_ps(outr[m] + n, live, _mm512_add_ps(acc5[m][0], acc5[m][1]));
#else
    __m256 acc[6][2];
    int full = cols == EXPAND_TILE;
    __m256i m0 = lane_mask(cols < 8 ? cols : 8), m1 = lane_mask(cols > 8 ? cols - 8 : 1);
    for (int m = 0; m < M; m++) {
        if (init) {
            acc[m][0] = acc[m][1] = _mm256_setzero_ps();
        } else if (full) {
            acc[m][0] = _mm256_loadu_ps(outr[m] + n);
            acc[m][1] = _mm256_loadu_ps(outr[m] + n + 8);
        } else {
            acc[m][0] = _mm256_maskload_ps(outr[m] + n, m0);
            acc[m][1] = cols > 8 ? _mm256_maskload_ps(outr[m] + n + 8, m1) : _mm256_setzero_ps();
        }
    }
    for (int64_t k = 0; k < kn; k++) {
        __m256 p0 = _mm256_load_ps(P + k * EXPAND_TILE), p1 = _mm256_load_ps(P + k * EXPAND_TILE + 8);
        for (int m = 0; m < M; m++) {
            __m256 v = _mm256_broadcast_ss(in[m] + k);
            acc[m][0] = _mm256_fmadd_ps(p0, v, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(p1, v, acc[m][1]);
        }
    }
    for (int m = 0; m < M; m++) {
        if (full) {
            _mm256_storeu_ps(outr[m] + n, acc[m][0]);
            _mm256_storeu_ps(outr[m] + n + 8, acc[m][1]);
        } else {
            _mm256_maskstore_ps(outr[m] + n, m0, acc[m][0]);
            if (cols > 8) _mm256_maskstore_ps(outr[m] + n + 8, m1, acc[m][1]);
        }
    }
#endif
}

/* tile_gemm for a group of c (3 to 6) tokens. */
static inline __attribute__((always_inline)) void tile_group(const float *P, int64_t kn, const float *const *in,
                                                             float *const *outr, int64_t n, int64_t cols, int init,
                                                             int c) {
    switch (c) {
        case 3: tile_gemm(P, kn, in, outr, n, cols, init, 3); break;
        case 4: tile_gemm(P, kn, in, outr, n, cols, init, 4); break;
        case 5: tile_gemm(P, kn, in, outr, n, cols, init, 5); break;
        default: tile_gemm(P, kn, in, outr, n, cols, init, 6); break;
    }
}

#endif /* AVX2 */
#endif
