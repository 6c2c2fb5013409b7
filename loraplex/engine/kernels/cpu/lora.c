/* Multi-LoRA deltas for a flat token batch on the CPU, fp32: shrink (A) then expand (B), in one call.
 *
 * Semantics (the layout of kernels/lora_ops.py): x [T, K], out [T, N] (row-major, contiguous),
 * A [slots, S * r_max, K], B [slots, N, r_max], N = w_0 + .. + w_{S-1}, off_s = w_0 + .. + w_{s-1}.
 * The LoRA tokens come grouped by slot: rows [n] holds token indices, groups [G][3] holds
 * (slot, begin, end): tokens rows[begin .. end-1] use that slot (tokens of no group are untouched).
 * With rk = min(max(ranks[slot], 0), r_max) (r_max when ranks is NULL), for each such token t:
 *     y[s][j]                  = sum_{k < K}  A[slot, s * r_max + j, k] * x[t, k]     j < rk
 *     out[t, off_s + n]       += sum_{j < rk} B[slot, off_s + n, j] * y[s][j]          n < w_s
 * A's rows and B's columns at or beyond rk are padding: never read into a result.
 *
 * Why: a decode step makes 4 calls per layer; torch ops cost a dispatch per adapter or copy the
 * gathered weights, while the FLOPs are a few percent of the base model's. Here the work is one
 * OpenMP region in two phases split by a barrier. Shrink: every block (up to BLOCK_TOKENS tokens of
 * one slot) against its rows of A, as dot products register-blocked over R rows x M tokens (A's rows
 * and x's rows are both contiguous). Expand: against B's rows, as a small GEMM on a transposed tile
 * of 16 outputs (M tokens x 16 outputs per rank step), or, for one or two tokens (memory-bound), as
 * dot products over B's contiguous rows. In each phase the threads take contiguous ranges of equal
 * estimated cost (weights read + FLOPs) over all blocks' weight rows, so every weight row is read by
 * one thread: one adapter for the whole batch is split over the threads, many adapters are not
 * read twice.
 */
#include <stdint.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* Tokens of one slot per block: bounds the token pointer arrays; longer groups (prefill) are split so
 * the threads can share them and a block's x rows stay in L2. */
#define BLOCK_TOKENS 64
/* Cost of reading a weight once, in units of one token's FMA on it (balances memory against compute). */
#define FIXED_COST 8
/* Below this much estimated work a second thread costs more than it saves. */
#define PARALLEL_MIN_WORK (96 * 1024)
#define MAX_SLICES 4
#define MAX_RANK 256
#define EXPAND_TILE 16 /* outputs per transposed B tile */
#define SHRINK_KC 768   /* features per shrink pass: six tokens' worth (18 KB) stay in L1 */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES (128 * 1024) /* of B asked into L2 ahead of the expand, per thread */
#endif
#define PANEL_FLOATS 4096 /* transposed B tiles packed at once (16 KB, in L1) */
_Static_assert(PANEL_FLOATS >= MAX_RANK * EXPAND_TILE, "a panel holds at least one tile");

typedef struct {
    int32_t slot, begin, end; /* tokens rows[begin .. end-1], at most BLOCK_TOKENS */
    int32_t rank;
} block_t;

typedef struct {
    const float *x, *A, *B;
    float *out, *y;
    int64_t K, N, r_max, S, ldy;
    int64_t off[MAX_SLICES], w[MAX_SLICES];
    const int32_t *rows;
    const block_t *blocks;
    int64_t n_blocks;
    double shrink_total, expand_total; /* estimated work of each phase */
} job_t;

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static const int32_t MASK_TABLE[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

/* Lanes 0 .. n-1 on (0 < n <= 8). */
static inline __m256i lane_mask(int64_t n) { return _mm256_loadu_si256((const __m256i *)(MASK_TABLE + 8 - n)); }

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
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
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* Shrink, R rows of A (a, row stride lda) x M tokens over kc features: y[m * ldy + r] (+)= A_r . x_m
 * (added when acc: a later chunk of features). Inlined with constant R and M so the R * M
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void shrink_rm(const float *a, int64_t lda, int64_t kc,
                                                            const float *const *xr, int64_t x0, float *y, int64_t ldy,
                                                            int acc_y, const int R, const int M) {
    __m256 acc[4][6];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= kc; k += 8) {
        __m256 av[4];
        for (int r = 0; r < R; r++) av[r] = _mm256_loadu_ps(a + r * lda + k);
        for (int m = 0; m < M; m++) {
            __m256 xv = _mm256_loadu_ps(xr[m] + x0 + k);
            for (int r = 0; r < R; r++) acc[r][m] = _mm256_fmadd_ps(av[r], xv, acc[r][m]);
        }
    }
    if (k < kc) { /* masked tail: lanes beyond kc read as zero, nothing past a row is touched */
        __m256i mk = lane_mask(kc - k);
        __m256 av[4];
        for (int r = 0; r < R; r++) av[r] = _mm256_maskload_ps(a + r * lda + k, mk);
        for (int m = 0; m < M; m++) {
            __m256 xv = _mm256_maskload_ps(xr[m] + x0 + k, mk);
            for (int r = 0; r < R; r++) acc[r][m] = _mm256_fmadd_ps(av[r], xv, acc[r][m]);
        }
    }
    for (int m = 0; m < M; m++) {
        if (R == 4) {
            __m128 v = hsum4x8(acc[0][m], acc[1][m], acc[2][m], acc[3][m]);
            _mm_storeu_ps(y + m * ldy, acc_y ? _mm_add_ps(_mm_loadu_ps(y + m * ldy), v) : v);
        } else {
            for (int r = 0; r < R; r++) y[m * ldy + r] = (acc_y ? y[m * ldy + r] : 0.0f) + hsum8(acc[r][m]);
        }
    }
}

/* Rows j0 .. j1-1 of A (a = row 0, row stride lda) over features x0 .. x0+kc-1, M tokens. */
static inline __attribute__((always_inline)) void shrink_block(const float *a, int64_t lda, int64_t j0, int64_t j1,
                                                               int64_t kc, const float *const *xr, int64_t x0,
                                                               float *y, int64_t ldy, int acc_y, const int M) {
    int64_t j = j0;
    if (M <= 2)
        for (; j + 4 <= j1; j += 4) shrink_rm(a + j * lda, lda, kc, xr, x0, y + j, ldy, acc_y, 4, M);
    for (; j + 2 <= j1; j += 2) shrink_rm(a + j * lda, lda, kc, xr, x0, y + j, ldy, acc_y, 2, M);
    for (; j < j1; j++) shrink_rm(a + j * lda, lda, kc, xr, x0, y + j, ldy, acc_y, 1, M);
}

/* Rows j0 .. j1-1 of one slice of A (a = its row 0) against m tokens: y[t * ldy + j] = A[j] . x_t.
 * Six tokens at a time against all the rows, over SHRINK_KC features at a time, so the tokens'
 * features stay in L1 while A's rows stream from L2. One or two tokens (memory-bound): four rows at
 * a time, independent FMA chains while A streams from memory. */
static void shrink_rows(const float *a, int64_t K, int64_t j0, int64_t j1, const float *const *xr, int m, float *y,
                        int64_t ldy) {
    if (m <= 2) { /* A's rows read once each, in order */
        if (m == 1)
            shrink_block(a, K, j0, j1, K, xr, 0, y, ldy, 0, 1);
        else
            shrink_block(a, K, j0, j1, K, xr, 0, y, ldy, 0, 2);
        return;
    }
    for (int64_t x0 = 0; x0 < K; x0 += SHRINK_KC) {
        int64_t kc = K - x0 < SHRINK_KC ? K - x0 : SHRINK_KC;
        for (int t = 0; t < m; t += 6) {
            const float *const *xs = xr + t;
            float *ys = y + t * ldy;
            switch (m - t < 6 ? m - t : 6) {
                case 1: shrink_block(a + x0, K, j0, j1, kc, xs, x0, ys, ldy, x0 > 0, 1); break;
                case 2: shrink_block(a + x0, K, j0, j1, kc, xs, x0, ys, ldy, x0 > 0, 2); break;
                case 3: shrink_block(a + x0, K, j0, j1, kc, xs, x0, ys, ldy, x0 > 0, 3); break;
                case 4: shrink_block(a + x0, K, j0, j1, kc, xs, x0, ys, ldy, x0 > 0, 4); break;
                case 5: shrink_block(a + x0, K, j0, j1, kc, xs, x0, ys, ldy, x0 > 0, 5); break;
                case 6: shrink_block(a + x0, K, j0, j1, kc, xs, x0, ys, ldy, x0 > 0, 6); break;
            }
        }
    }
}

/* Expand by dot products over B's rows, for one or two tokens (memory-bound: B streamed in order):
 * out_m[n] += B[n, :rk] . y_m for n0 <= n < n1. */
static inline __attribute__((always_inline)) void expand_dot(const float *b, int64_t r_max, int64_t rk, int64_t n0,
                                                             int64_t n1, const float *y, int64_t ldy,
                                                             float *const *outr, const int M) {
    __m256 yv[2][MAX_RANK / 8];
    int64_t chunks = (rk + 7) / 8;
    __m256i tail = lane_mask(rk - (chunks - 1) * 8);
    for (int m = 0; m < M; m++)
        for (int64_t c = 0; c < chunks; c++)
            yv[m][c] = c + 1 < chunks ? _mm256_loadu_ps(y + m * ldy + c * 8)
                                      : _mm256_maskload_ps(y + m * ldy + c * 8, tail);
    int64_t n = n0;
    for (; n + 8 <= n1; n += 8) {
        __m256 p[2][8];
        for (int i = 0; i < 8; i++) {
            const float *br = b + (n + i) * r_max;
            for (int m = 0; m < M; m++) p[m][i] = _mm256_setzero_ps();
            for (int64_t c = 0; c + 1 < chunks; c++) {
                __m256 bv = _mm256_loadu_ps(br + c * 8);
                for (int m = 0; m < M; m++) p[m][i] = _mm256_fmadd_ps(bv, yv[m][c], p[m][i]);
            }
            __m256 bv = _mm256_maskload_ps(br + (chunks - 1) * 8, tail); /* padding columns read as 0 */
            for (int m = 0; m < M; m++) p[m][i] = _mm256_fmadd_ps(bv, yv[m][chunks - 1], p[m][i]);
        }
        for (int m = 0; m < M; m++)
            _mm256_storeu_ps(outr[m] + n, _mm256_add_ps(_mm256_loadu_ps(outr[m] + n), hsum8x8(p[m])));
    }
    for (; n < n1; n++) {
        const float *br = b + n * r_max;
        for (int m = 0; m < M; m++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t c = 0; c < chunks; c++) {
                __m256 bv = c + 1 < chunks ? _mm256_loadu_ps(br + c * 8) : _mm256_maskload_ps(br + c * 8, tail);
                acc = _mm256_fmadd_ps(bv, yv[m][c], acc);
            }
            outr[m][n] += hsum8(acc);
        }
    }
}

/* Bt[k * 16 + i] = B[n0 + i, k] for k < rk, i < 16; rows at or beyond `rows` read as zero. Columns
 * k in [rk, round_up(rk, 8)) may hold padding values: the caller never reads them. */
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

/* One packed tile x M tokens: out_m[0:cols] += sum_k y_m[k] * Bt[k, 0:16], cols <= 16. */
static inline __attribute__((always_inline)) void expand_tile(const float *bt, int64_t rk, const float *y,
                                                              int64_t ldy, float *const *outr, int64_t n,
                                                              int64_t cols, const int M) {
    __m256 acc[6][2];
    int full = cols == EXPAND_TILE;
    __m256i m0 = lane_mask(cols < 8 ? cols : 8), m1 = lane_mask(cols > 8 ? cols - 8 : 1);
    for (int m = 0; m < M; m++) {
        if (full) {
            acc[m][0] = _mm256_loadu_ps(outr[m] + n);
            acc[m][1] = _mm256_loadu_ps(outr[m] + n + 8);
        } else {
            acc[m][0] = _mm256_maskload_ps(outr[m] + n, m0);
            acc[m][1] = cols > 8 ? _mm256_maskload_ps(outr[m] + n + 8, m1) : _mm256_setzero_ps();
        }
    }
    for (int64_t k = 0; k < rk; k++) {
        __m256 b0 = _mm256_load_ps(bt + k * EXPAND_TILE), b1 = _mm256_load_ps(bt + k * EXPAND_TILE + 8);
        for (int m = 0; m < M; m++) {
            __m256 yb = _mm256_broadcast_ss(y + m * ldy + k);
            acc[m][0] = _mm256_fmadd_ps(b0, yb, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(b1, yb, acc[m][1]);
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
}

/* Outputs n0 .. n1-1 of one slice (b = its row 0; n0 a multiple of EXPAND_TILE) for m tokens:
 * out_t[n] += B[n, :rk] . y_t. */
static void expand_range(const float *b, int64_t r_max, int64_t rk, int64_t n0, int64_t n1, const float *y,
                         int64_t ldy, float *const *outr, int m) {
    if (m <= 2) {
        if (m == 1)
            expand_dot(b, r_max, rk, n0, n1, y, ldy, outr, 1);
        else
            expand_dot(b, r_max, rk, n0, n1, y, ldy, outr, 2);
        return;
    }
    /* A panel of tiles is packed, then run six tokens at a time, so each token's out row is walked in
     * order: few streams, and no run over one tile's rows, which alias in L1 when they are a multiple
     * of 4 KB apart (gate_up: 12 KB). */
    float bt[PANEL_FLOATS] __attribute__((aligned(32)));
    const int64_t tile_floats = rk * EXPAND_TILE, per_panel = PANEL_FLOATS / tile_floats;
    for (int64_t p0 = n0; p0 < n1; p0 += per_panel * EXPAND_TILE) {
        int64_t p1 = p0 + per_panel * EXPAND_TILE < n1 ? p0 + per_panel * EXPAND_TILE : n1;
        for (int64_t n = p0; n < p1; n += EXPAND_TILE)
            pack_tile(b, r_max, rk, n, p1 - n < EXPAND_TILE ? p1 - n : EXPAND_TILE,
                      bt + (n - p0) / EXPAND_TILE * tile_floats);
        for (int t = 0; t < m; t += 6) {
            for (int64_t n = p0; n < p1; n += EXPAND_TILE) {
                const float *tile = bt + (n - p0) / EXPAND_TILE * tile_floats;
                int64_t cols = p1 - n < EXPAND_TILE ? p1 - n : EXPAND_TILE;
                switch (m - t < 6 ? m - t : 6) {
                    case 1: expand_tile(tile, rk, y + t * ldy, ldy, outr + t, n, cols, 1); break;
                    case 2: expand_tile(tile, rk, y + t * ldy, ldy, outr + t, n, cols, 2); break;
                    case 3: expand_tile(tile, rk, y + t * ldy, ldy, outr + t, n, cols, 3); break;
                    case 4: expand_tile(tile, rk, y + t * ldy, ldy, outr + t, n, cols, 4); break;
                    case 5: expand_tile(tile, rk, y + t * ldy, ldy, outr + t, n, cols, 5); break;
                    case 6: expand_tile(tile, rk, y + t * ldy, ldy, outr + t, n, cols, 6); break;
                }
            }
        }
    }
}

#else
static void shrink_rows(const float *a, int64_t K, int64_t j0, int64_t j1, const float *const *xr, int m, float *y,
                        int64_t ldy) {
    for (int64_t j = j0; j < j1; j++)
        for (int t = 0; t < m; t++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += a[j * K + k] * xr[t][k];
            y[t * ldy + j] = s;
        }
}

static void expand_range(const float *b, int64_t r_max, int64_t rk, int64_t n0, int64_t n1, const float *y,
                         int64_t ldy, float *const *outr, int m) {
    for (int t = 0; t < m; t++)
        for (int64_t n = n0; n < n1; n++) {
            float s = 0.0f;
            for (int64_t j = 0; j < rk; j++) s += b[n * r_max + j] * y[t * ldy + j];
            outr[t][n] += s;
        }
}
#endif

/* Pointers to the rows of a block's tokens in x and (shifted to column `off`) in out. */
static void token_rows(const job_t *job, const block_t *blk, const float **xr, float **outr, int64_t off) {
    for (int t = 0; t < blk->end - blk->begin; t++) {
        int64_t row = job->rows[blk->begin + t];
        if (xr) xr[t] = job->x + row * job->K;
        if (outr) outr[t] = job->out + row * job->N + off;
    }
}

/* Of a run of `units` equal units of cost `unit` starting at cost `base`, the first one whose cost
 * midpoint lies at or beyond `target`: thread tid takes [split(tid * total / nth), split((tid + 1) * ...)),
 * so neighbouring threads compute the same boundary and the ranges tile the run exactly. */
static inline int64_t split_at(double base, double unit, int64_t units, double target) {
    double v = (target - base) / unit - 0.5;
    if (v <= 0) return 0;
    int64_t i = (int64_t)v;
    if ((double)i < v) i++;
    return i > units ? units : i;
}

/* Thread tid's share of the expand: tiles of EXPAND_TILE rows of B over all blocks. With `prefetch`,
 * only asks for the first PREFETCH_BYTES of those rows of B to be brought into L2 (done before the
 * shrink, so a cold adapter's B streams in while the shrink computes). */
static void expand_share(const job_t *job, int64_t tid, int64_t nth, int prefetch) {
    const int64_t r_max = job->r_max, S = job->S, ldy = job->ldy;
    float *outr[BLOCK_TOKENS];
    double lo = job->expand_total * tid / nth, hi = job->expand_total * (tid + 1) / nth, base = 0.0;
    int64_t budget = PREFETCH_BYTES;
    for (int64_t i = 0; i < job->n_blocks; i++) {
        const block_t *blk = job->blocks + i;
        const int m = blk->end - blk->begin;
        const int64_t rk = blk->rank;
        const double unit = (double)EXPAND_TILE * rk * (m + FIXED_COST);
        const float *b = job->B + (int64_t)blk->slot * job->N * r_max;
        for (int64_t s = 0; s < S; s++) {
            int64_t tiles = (job->w[s] + EXPAND_TILE - 1) / EXPAND_TILE;
            int64_t t0 = split_at(base, unit, tiles, lo), t1 = split_at(base, unit, tiles, hi);
            base += unit * tiles;
            if (t0 >= t1) continue;
            int64_t n0 = t0 * EXPAND_TILE, n1 = t1 * EXPAND_TILE < job->w[s] ? t1 * EXPAND_TILE : job->w[s];
            const float *bs = b + job->off[s] * r_max;
            if (prefetch) {
                const char *p0 = (const char *)(bs + n0 * r_max), *p1 = (const char *)(bs + n1 * r_max);
                for (const char *p = p0; p < p1 && budget > 0; p += 64, budget -= 64) __builtin_prefetch(p, 0, 2);
                if (budget <= 0) return;
                continue;
            }
            token_rows(job, blk, NULL, outr, job->off[s]);
            expand_range(bs, r_max, rk, n0, n1, job->y + blk->begin * ldy + s * r_max, ldy, outr, m);
        }
    }
}

/* Thread tid's share of both phases. Shrink: units are rows of A (all of a block's tokens per row);
 * expand: tiles of EXPAND_TILE rows of B. Each weight row is read by one thread per block. */
static void run(const job_t *job, int64_t tid, int64_t nth) {
    const int64_t K = job->K, r_max = job->r_max, S = job->S, ldy = job->ldy;
    const float *xr[BLOCK_TOKENS];
    if (PREFETCH_BYTES > 0) expand_share(job, tid, nth, 1);
    double lo = job->shrink_total * tid / nth, hi = job->shrink_total * (tid + 1) / nth, base = 0.0;
    for (int64_t i = 0; i < job->n_blocks; i++) {
        const block_t *blk = job->blocks + i;
        const int m = blk->end - blk->begin;
        const int64_t rk = blk->rank;
        const double unit = (double)K * (m + FIXED_COST);
        const float *a = job->A + (int64_t)blk->slot * S * r_max * K;
        int have_rows = 0;
        for (int64_t s = 0; s < S; s++, base += unit * rk) {
            int64_t j0 = split_at(base, unit, rk, lo), j1 = split_at(base, unit, rk, hi);
            if (j0 >= j1) continue;
            if (!have_rows) token_rows(job, blk, xr, NULL, 0), have_rows = 1;
            shrink_rows(a + s * r_max * K, K, j0, j1, xr, m, job->y + blk->begin * ldy + s * r_max, ldy);
        }
    }
#pragma omp barrier
    expand_share(job, tid, nth, 0);
}

/* Per calling thread, grown as needed and kept: the blocks and y, with no allocation per call. */
static _Thread_local void *scratch_buf;
static _Thread_local size_t scratch_cap;

static void *scratch(size_t bytes) {
    if (bytes > scratch_cap) {
        size_t cap = (bytes + bytes / 2 + 4095) / 4096 * 4096;
        void *p = aligned_alloc(64, cap);
        if (!p) return NULL;
        free(scratch_buf);
        scratch_buf = p;
        scratch_cap = cap;
    }
    return scratch_buf;
}

/* out += LoRA deltas (see Semantics). widths: S slice widths summing to N; ranks may be NULL.
 * Returns 0, or -1 for invalid sizes, -2 for a group outside [0, slots) or rows, -3 out of memory. */
int lp_lora_f32(const float *x, float *out, int64_t T, int64_t K, int64_t N, const float *A, const float *B,
                int64_t num_slots, int64_t r_max, int64_t S, const int64_t *widths, const int32_t *ranks,
                const int32_t *rows, int64_t num_rows, const int32_t *groups, int64_t G) {
    if (T < 0 || K < 1 || N < 1 || r_max < 1 || r_max > MAX_RANK || S < 1 || S > MAX_SLICES || G < 0) return -1;
    job_t job = {.x = x, .A = A, .B = B, .out = out, .K = K, .N = N, .r_max = r_max, .S = S, .rows = rows,
                 .ldy = S * r_max};
    int64_t off = 0;
    for (int64_t s = 0; s < S; s++) {
        if (widths[s] < 1) return -1;
        job.off[s] = off;
        job.w[s] = widths[s];
        off += widths[s];
    }
    if (off != N) return -1;
    int64_t max_blocks = 0;
    for (int64_t g = 0; g < G; g++) {
        int64_t slot = groups[3 * g], begin = groups[3 * g + 1], end = groups[3 * g + 2];
        if (slot < 0 || slot >= num_slots || begin < 0 || end < begin || end > num_rows) return -2;
        max_blocks += (end - begin + BLOCK_TOKENS - 1) / BLOCK_TOKENS;
    }
    for (int64_t i = 0; i < num_rows; i++)
        if (rows[i] < 0 || rows[i] >= T) return -2;
    if (max_blocks == 0) return 0;
    size_t blocks_bytes = (max_blocks * sizeof(block_t) + 63) / 64 * 64;
    char *buf = scratch(blocks_bytes + (size_t)num_rows * job.ldy * sizeof(float));
    if (!buf) return -3;
    block_t *blocks = (block_t *)buf;
    job.y = (float *)(buf + blocks_bytes); /* y [num_rows, S * r_max]: row i = token rows[i] */
    /* each group in near-equal blocks of at most BLOCK_TOKENS tokens */
    int64_t n = 0, tiles = 0;
    for (int64_t s = 0; s < S; s++) tiles += (job.w[s] + EXPAND_TILE - 1) / EXPAND_TILE;
    for (int64_t g = 0; g < G; g++) {
        int32_t slot = groups[3 * g], begin = groups[3 * g + 1], end = groups[3 * g + 2];
        int64_t rk = ranks ? ranks[slot] : r_max;
        rk = rk < 0 ? 0 : rk > r_max ? r_max : rk;
        if (rk == 0 || end == begin) continue;
        int64_t m = end - begin, parts = (m + BLOCK_TOKENS - 1) / BLOCK_TOKENS;
        for (int64_t p = 0; p < parts; p++) {
            block_t *blk = blocks + n++;
            *blk = (block_t){.slot = slot, .begin = begin + (int32_t)(m * p / parts),
                             .end = begin + (int32_t)(m * (p + 1) / parts), .rank = (int32_t)rk};
            double tokens = blk->end - blk->begin + FIXED_COST;
            job.shrink_total += (double)K * tokens * rk * S;
            job.expand_total += (double)EXPAND_TILE * rk * tokens * tiles;
        }
    }
    job.blocks = blocks;
    job.n_blocks = n;
    if (n == 0) return 0;
#ifdef _OPENMP
    if (job.shrink_total + job.expand_total >= PARALLEL_MIN_WORK && omp_get_max_threads() > 1) {
#pragma omp parallel
        run(&job, omp_get_thread_num(), omp_get_num_threads());
        return 0;
    }
#endif
    run(&job, 0, 1);
    return 0;
}

/* lp_lora_f32 with its arguments packed in one int64 array, pointers as integers (0 = NULL):
 * x, out, T, K, N, A, B, slots, r_max, ranks, rows, num_rows, groups, G, S, widths[0 .. S-1].
 * One ctypes argument instead of sixteen: the Python wrapper saves about 2 us per call. */
int lp_lora_f32_packed(const int64_t *p) {
    if (p[14] < 1 || p[14] > MAX_SLICES) return -1;
    return lp_lora_f32((const float *)(intptr_t)p[0], (float *)(intptr_t)p[1], p[2], p[3], p[4],
                       (const float *)(intptr_t)p[5], (const float *)(intptr_t)p[6], p[7], p[8], p[14], p + 15,
                       (const int32_t *)(intptr_t)p[9], (const int32_t *)(intptr_t)p[10], p[11],
                       (const int32_t *)(intptr_t)p[12], p[13]);
}
