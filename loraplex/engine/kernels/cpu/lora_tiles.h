/* The register-blocked pieces lora.c's two phases are made of (AVX2 / AVX-512). The shrink: dot
 * products over A's rows for one to six tokens, the 8x8 transposes that pack 16-row tiles of A, and
 * the tile GEMM microkernel over them. The expand: FMAs straight over rank-major B's rows. Included by
 * lora.c only (every function is static). A row's or an output's sum is formed the same way whichever
 * function or split serves it, so a thread's share never changes bits.
 */
#ifndef LORAPLEX_CPU_LORA_TILES_H
#define LORAPLEX_CPU_LORA_TILES_H
#include <stdint.h>
#include <string.h>

#include "lora_weights.h"

#define MAX_RANK 256
#define EXPAND_TILE 16 /* rows per packed A tile; outputs per unit of the expand's split */
#define DOT_KC 768     /* features per dot-product pass: six tokens' worth (18 KB) stay in L1 */

/* The slot buffers' element type, wt_t: lora.c's build variant (LP_LORA_WTYPE, lora_weights.h; fp32
 * unless a variant file sets it). Weights are widened to fp32 as they are loaded (wload, wload8,
 * wscalar); everything else is fp32. */
#ifndef LP_LORA_WTYPE
#define LP_LORA_WTYPE LP_W_F32
#endif
#if LP_LORA_WTYPE == LP_W_F32
typedef float wt_t;
#else
typedef uint16_t wt_t;
#endif
/* One weight as fp32 (the type is a constant here: the compiler keeps only its branch). */
static inline float wscalar(const wt_t *p) { return lp_weight_at(p, 0, LP_LORA_WTYPE); }
#define WT_BYTES ((int64_t)sizeof(wt_t))

#if defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>

#include "transpose8.h"

static const int32_t MASK_TABLE[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

/* Lanes 0 .. n-1 on (0 < n <= 8). */
static inline __m256i lane_mask(int64_t n) { return _mm256_loadu_si256((const __m256i *)(MASK_TABLE + 8 - n)); }

/* ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)): the order of hsum4x8, so a row's sum has the same
 * bits whichever of them serves it, however the rows are split between threads. */
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

#if LP_LORA_WTYPE != LP_W_F32
/* Eight 16-bit weights widened to fp32 (exact). */
static inline __m256 widen8(__m128i h) {
#if LP_LORA_WTYPE == LP_W_BF16
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
    return _mm256_cvtph_ps(h);
#endif
}
#endif

/* DOT_CHUNK weights from p, widened to fp32: all of them (whole), else the n live lanes of mask m (the
 * others read as zero; nothing past them is touched). */
static inline rvec_t wload(const wt_t *p, int whole, rmask_t m, int64_t n) {
#if LP_LORA_WTYPE == LP_W_F32
    (void)n;
    return rload(p, whole, m);
#else
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    (void)n;
    const __m256i h = whole ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(m, p);
#else
    (void)m;
    uint16_t tail[DOT_CHUNK];
    if (!whole) { /* a part vector through the stack (a row's end, one per span) */
        const int64_t live = n < 0 ? 0 : n > DOT_CHUNK ? DOT_CHUNK : n;
        memset(tail, 0, sizeof tail);
        memcpy(tail, p, (size_t)live * sizeof(uint16_t));
        p = tail;
    }
#if defined(__AVX512F__)
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
#else
    return widen8(_mm_loadu_si128((const __m128i *)p));
#endif
#endif
#if defined(__AVX512F__) && LP_LORA_WTYPE == LP_W_BF16
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#elif defined(__AVX512F__)
    return _mm512_cvtph_ps(h);
#endif
#endif
}

/* Eight weights from p, widened to fp32 (pack_tile's loads). */
static inline __m256 wload8(const wt_t *p) {
#if LP_LORA_WTYPE == LP_W_F32
    return _mm256_loadu_ps(p);
#else
    return widen8(_mm_loadu_si128((const __m128i *)p));
#endif
}

/* Shrink, R rows of A (a, row stride lda) x M tokens over kc features: y[m * ldy + r] (+)= A_r . x_m
 * (added when acc_y: a later chunk of features). Inlined with constant R and M so the R * M
 * accumulators stay in registers. Lanes beyond kc read as zero; nothing past a row is touched. */
static inline __attribute__((always_inline)) void shrink_rm(const wt_t *a, int64_t lda, int64_t kc,
                                                            const float *const *xr, int64_t x0, float *y, int64_t ldy,
                                                            int acc_y, const int R, const int M) {
    rvec_t acc[4][6];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = rzero();
    for (int64_t k = 0; k < kc; k += DOT_CHUNK) {
        const int whole = kc - k >= DOT_CHUNK;
        const rmask_t mk = chunk_mask(kc - k);
        rvec_t av[4];
        for (int r = 0; r < R; r++) av[r] = wload(a + r * lda + k, whole, mk, kc - k);
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
static void shrink_dot(const wt_t *a, int64_t K, int64_t j0, int64_t j1, const float *const *xr, int m, float *y,
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
            const wt_t *ax = a + x0;
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

static inline rvec_t rbcast(const float *p) {
#if defined(__AVX512F__)
    return _mm512_set1_ps(*p);
#else
    return _mm256_broadcast_ss(p);
#endif
}

static inline void rstore(float *p, rvec_t v, int whole, rmask_t m) {
#if defined(__AVX512F__)
    if (whole) _mm512_storeu_ps(p, v); else _mm512_mask_storeu_ps(p, m, v);
#else
    if (whole) _mm256_storeu_ps(p, v); else _mm256_maskstore_ps(p, m, v);
#endif
}

/* The expand for M tokens over V vectors of columns n .. n + cols - 1 (cols <= V * DOT_CHUNK; FULL:
 * cols is exactly that), B rank-major (bt: row j holds rank j's weights to the slice's outputs, rows
 * ldb elements apart): out_m[c] = fma(bt[rk-1][c], y_m[rk-1], .. fma(bt[0][c], y_m[0], out_m[c])), in j
 * order. Every output's sum has that one order whatever M, V or the columns' split, so a token's bits
 * depend neither on its group nor on the threads. Bt's rows are read as they lie: no packing. */
static inline __attribute__((always_inline)) void expand_cols(const wt_t *bt, int64_t ldb, int64_t rk,
                                                              const float *const *yr, float *const *outr, int64_t n,
                                                              int64_t cols, const int M, const int V, const int FULL) {
    rvec_t acc[6][4];
    rmask_t mk[4];
    for (int v = 0; v < V; v++) {
        const int64_t c = cols - v * DOT_CHUNK;
        mk[v] = chunk_mask(c < 0 ? 0 : c);
    }
    for (int m = 0; m < M; m++)
        for (int v = 0; v < V; v++) acc[m][v] = rload(outr[m] + n + v * DOT_CHUNK, FULL, mk[v]);
    for (int64_t j = 0; j < rk; j++) {
        const wt_t *b = bt + j * ldb + n;
        rvec_t bv[4];
        for (int v = 0; v < V; v++) bv[v] = wload(b + v * DOT_CHUNK, FULL, mk[v], cols - v * DOT_CHUNK);
        for (int m = 0; m < M; m++) {
            const rvec_t ym = rbcast(yr[m] + j);
            for (int v = 0; v < V; v++) acc[m][v] = rfma(bv[v], ym, acc[m][v]);
        }
    }
    for (int m = 0; m < M; m++)
        for (int v = 0; v < V; v++) rstore(outr[m] + n + v * DOT_CHUNK, acc[m][v], FULL, mk[v]);
}

/* expand_cols over columns n0 .. n1-1 in steps of V vectors, the last step masked. */
static inline __attribute__((always_inline)) void expand_span(const wt_t *bt, int64_t ldb, int64_t rk,
                                                              const float *const *yr, float *const *outr, int64_t n0,
                                                              int64_t n1, const int M, const int V) {
    const int64_t w = V * DOT_CHUNK;
    int64_t n = n0;
    for (; n + w <= n1; n += w) expand_cols(bt, ldb, rk, yr, outr, n, w, M, V, 1);
    if (n < n1) expand_cols(bt, ldb, rk, yr, outr, n, n1 - n, M, V, 0);
}

/* The expand of a group of c (1 to 6) tokens over columns n0 .. n1-1: one or two tokens take four
 * vectors of columns at a time (four FMA chains each: memory-bound, Bt streamed), more take two
 * (up to 12 accumulators). */
static void expand_group(const wt_t *bt, int64_t ldb, int64_t rk, const float *const *yr, float *const *outr,
                         int64_t n0, int64_t n1, int c) {
    switch (c) {
        case 1: expand_span(bt, ldb, rk, yr, outr, n0, n1, 1, 4); break;
        case 2: expand_span(bt, ldb, rk, yr, outr, n0, n1, 2, 4); break;
        case 3: expand_span(bt, ldb, rk, yr, outr, n0, n1, 3, 2); break;
        case 4: expand_span(bt, ldb, rk, yr, outr, n0, n1, 4, 2); break;
        case 5: expand_span(bt, ldb, rk, yr, outr, n0, n1, 5, 2); break;
        default: expand_span(bt, ldb, rk, yr, outr, n0, n1, 6, 2); break;
    }
}

/* Bt[k * 16 + i] = B[n0 + i, k] for k < rk, i < 16 (here A's rows, r_max = K apart);
 * rows at or beyond `rows` read as zero. Loads whole 8-column chunks, up to round_up(rk, 8) <= r_max,
 * but stores only k < rk. */
static void pack_tile(const wt_t *b, int64_t r_max, int64_t rk, int64_t n0, int64_t rows, float *bt) {
    if (r_max % 8) { /* rows are not 8-float aligned chunks: scalar */
        for (int64_t k = 0; k < rk; k++)
            for (int64_t i = 0; i < EXPAND_TILE; i++)
                bt[k * EXPAND_TILE + i] = i < rows ? wscalar(b + (n0 + i) * r_max + k) : 0.0f;
        return;
    }
    for (int h = 0; h < EXPAND_TILE; h += 8) {
        for (int64_t k0 = 0; k0 < rk; k0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = h + i < rows ? wload8(b + (n0 + h + i) * r_max + k0) : _mm256_setzero_ps();
            transpose8x8(r);
            for (int i = 0; i < 8 && k0 + i < rk; i++) _mm256_store_ps(bt + (k0 + i) * EXPAND_TILE + h, r[i]);
        }
    }
}

/* The shrink's GEMM microkernel, M tokens x one packed tile of 16 columns (12 accumulators):
 * out_m[n + i] = (init ? 0 : out_m[n + i]) + sum_{k < kn} in_m[k] * P[k * 16 + i] for i < cols <= 16,
 * with P = 16 rows of A transposed, in = x rows, out = y rows. */
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
