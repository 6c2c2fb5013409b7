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
 * OpenMP region in two phases split by a barrier, over blocks (up to BLOCK_TOKENS tokens of one slot)
 * whose tokens go in near-equal groups of up to six (32 = 5 + 5 + 6 + 5 + 5 + 6: a lone group of two
 * would run its FMA chains at half speed). Each phase is a small GEMM, a group x 16 weight rows packed
 * transposed (tile_gemm), where the tokens pay for the packing (3 in the expand, MANY_TOKENS in the
 * shrink); else dot products over the weights' contiguous rows, register-blocked over rows x tokens,
 * memory-bound for one or two tokens. In each phase the threads take contiguous ranges of equal
 * estimated cost (weights read + FLOPs) over all blocks' weight rows, so every weight row is read by
 * one thread: one adapter for the whole batch is split over the threads, many adapters are not read
 * twice. The weights come from memory (the base model's GEMMs evict them between calls): a block of
 * many tokens asks for the weights its thread reads next while it computes (prefetch_ahead).
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
#define DOT_KC 768      /* features per dot-product pass: six tokens' worth (18 KB) stay in L1 */
#define MANY_TOKENS 16 /* a block this big is compute-bound: packed shrink, weights asked for ahead */
#define SHRINK_KC 256   /* features of A per packed tile: 16 rows x 256 fill a panel */
#define PF_AHEAD (24 * 1024) /* bytes of weights asked for ahead of the compute: more than a panel */
#define PF_BURST 1024        /* bytes asked for at once beyond what was read since the last ask */
#define PANEL_FLOATS 4096 /* transposed B tiles packed at once (16 KB, in L1) */
_Static_assert(PANEL_FLOATS >= MAX_RANK * EXPAND_TILE && PANEL_FLOATS >= SHRINK_KC * EXPAND_TILE, "a tile fits");

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

/* A thread's share of one phase, range by range: units [u0, u1) of slice s of block i, where the
 * units are rows of A (shrink) or tiles of EXPAND_TILE rows of B (expand). */
typedef struct {
    const job_t *job;
    int expand;
    double lo, hi, base;
    int64_t i, s, u0, u1;
    const float *p, *end; /* the range's weights */
} walk_t;

static void walk_start(walk_t *w, const job_t *job, int expand, int64_t tid, int64_t nth) {
    double total = expand ? job->expand_total : job->shrink_total;
    *w = (walk_t){.job = job, .expand = expand, .lo = total * tid / nth, .hi = total * (tid + 1) / nth, .s = -1};
}

/* Moves to the thread's next non-empty range; 0 when there is none. */
static int walk_next(walk_t *w) {
    const job_t *job = w->job;
    while (w->base < w->hi) {
        if (++w->s == job->S) w->s = 0, w->i++;
        if (w->i >= job->n_blocks) return 0;
        const block_t *blk = job->blocks + w->i;
        const double tokens = blk->end - blk->begin + FIXED_COST;
        const int64_t units = w->expand ? (job->w[w->s] + EXPAND_TILE - 1) / EXPAND_TILE : blk->rank;
        const double unit = w->expand ? (double)EXPAND_TILE * blk->rank * tokens : (double)job->K * tokens;
        w->u0 = split_at(w->base, unit, units, w->lo);
        w->u1 = split_at(w->base, unit, units, w->hi);
        w->base += unit * units;
        if (w->u0 >= w->u1) continue;
        const int64_t r_max = job->r_max, n0 = w->u0 * EXPAND_TILE, n1 = w->u1 * EXPAND_TILE;
        if (w->expand) { /* B's rows n0 .. n1-1 of the slice, n1 clipped to its width */
            w->p = job->B + ((int64_t)blk->slot * job->N + job->off[w->s] + n0) * r_max;
            w->end = w->p + ((n1 < job->w[w->s] ? n1 : job->w[w->s]) - n0) * r_max;
        } else {
            w->p = job->A + (((int64_t)blk->slot * job->S + w->s) * r_max + w->u0) * job->K;
            w->end = w->p + (w->u1 - w->u0) * job->K;
        }
        return 1;
    }
    return 0;
}

/* The prefetch walk: the thread's shrink ranges, then its expand ranges, asked for in order. */
typedef struct {
    walk_t w;
    int64_t tid, nth, lead; /* lead: bytes asked for beyond what the compute has reported read */
    const char *p, *end;
} prefetch_t;

/* The compute has read `used` more bytes of weights (in the walk's order). With `issue` (a block of many
 * tokens) keep about PF_AHEAD bytes asked for ahead, used + PF_BURST at most at once (a longer burst is
 * partly dropped). Memory-bound blocks are streamed well by the hardware prefetcher: only counted. */
static void prefetch_ahead(prefetch_t *pf, int64_t used, int issue) {
    int64_t budget = used + PF_BURST;
    pf->lead -= used;
    if (!issue || pf->lead >= PF_AHEAD - PF_BURST) return;
    for (;;) {
        if (pf->p >= pf->end) {
            if (!walk_next(&pf->w)) {
                if (pf->w.expand) return;
                walk_start(&pf->w, pf->w.job, 1, pf->tid, pf->nth);
                continue;
            }
            pf->p = (const char *)((uintptr_t)pf->w.p & ~(uintptr_t)63), pf->end = (const char *)pf->w.end;
        }
        int64_t n = pf->end - pf->p;
        if (pf->lead < 0) { /* already read */
            n = n < -pf->lead ? n : (-pf->lead + 63) & ~(int64_t)63;
        } else {
            if (pf->lead >= PF_AHEAD || budget <= 0) return;
            n = n < budget ? n : budget;
            n = ((n < PF_AHEAD - pf->lead ? n : PF_AHEAD - pf->lead) + 63) & ~(int64_t)63;
            for (const char *q = pf->p; q < pf->p + n; q += 64) __builtin_prefetch(q, 0, 2);
            budget -= n;
        }
        pf->p += n, pf->lead += n;
    }
}

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
 * (added when acc_y: a later chunk of features). Inlined with constant R and M so the R * M
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

/* Rows j0 .. j1-1 of one slice of A (a = its row 0) against m tokens: y[t * ldy + j] = A[j] . x_t.
 * MANY_TOKENS or more: a GEMM like the expand's over 16 rows x SHRINK_KC features of A packed
 * transposed (in L1), with no horizontal sums, and A read evenly while it runs; other rows (a rank
 * or a thread's share not a multiple of 16) and fewer tokens: shrink_dot. */
static void shrink_rows(const float *a, int64_t K, int64_t j0, int64_t j1, const float *const *xr, int m, float *y,
                        int64_t ldy, prefetch_t *pf) {
    float at[PANEL_FLOATS] __attribute__((aligned(64)));
    const float *xs[BLOCK_TOKENS];
    float *yr[BLOCK_TOKENS];
    for (int t = 0; t < m; t++) yr[t] = y + t * ldy;
    const int ng = (m + 5) / 6;
    int64_t j = j0;
    for (; m >= MANY_TOKENS && j + EXPAND_TILE <= j1; j += EXPAND_TILE) /* whole tiles: none half empty */
        for (int64_t x0 = 0; x0 < K; x0 += SHRINK_KC) {
            const int64_t kc = K - x0 < SHRINK_KC ? K - x0 : SHRINK_KC, used = EXPAND_TILE * kc * 4 / ng;
            pack_tile(a + x0, K, kc, j, EXPAND_TILE, at);
            for (int t = 0; t < m; t++) xs[t] = xr[t] + x0;
            for (int g = 0; g < ng; g++) {
                const int t = m * g / ng;
                prefetch_ahead(pf, used, 1);
                tile_group(at, kc, xs + t, yr + t, j, EXPAND_TILE, x0 == 0, m * (g + 1) / ng - t);
            }
        }
    prefetch_ahead(pf, (j1 - j) * K * 4, 0);
    shrink_dot(a, K, j, j1, xr, m, y, ldy);
}

/* Outputs n0 .. n1-1 of one slice (b = its row 0; n0 a multiple of EXPAND_TILE) for m tokens:
 * out_t[n] += B[n, :rk] . y_t. */
static void expand_range(const float *b, int64_t r_max, int64_t rk, int64_t n0, int64_t n1, const float *y,
                         int64_t ldy, float *const *outr, int m, prefetch_t *pf) {
    if (m <= 2) {
        prefetch_ahead(pf, (n1 - n0) * r_max * 4, 0);
        if (m == 1)
            expand_dot(b, r_max, rk, n0, n1, y, ldy, outr, 1);
        else
            expand_dot(b, r_max, rk, n0, n1, y, ldy, outr, 2);
        return;
    }
    /* A panel of tiles is packed, then run for each group of (near-equally many, up to six) tokens,
     * so each token's out row is walked in order: few streams, and no run over one tile's rows, which
     * alias in L1 when they are a multiple of 4 KB apart (gate_up: 12 KB). */
    float bt[PANEL_FLOATS] __attribute__((aligned(64)));
    const float *yr[BLOCK_TOKENS];
    for (int t = 0; t < m; t++) yr[t] = y + t * ldy;
    const int64_t tile_floats = rk * EXPAND_TILE, per_panel = PANEL_FLOATS / tile_floats;
    const int ng = (m + 5) / 6;
    for (int64_t p0 = n0; p0 < n1; p0 += per_panel * EXPAND_TILE) {
        int64_t p1 = p0 + per_panel * EXPAND_TILE < n1 ? p0 + per_panel * EXPAND_TILE : n1;
        const int64_t used = (p1 - p0) * r_max * 4 / ng;
        for (int64_t n = p0; n < p1; n += EXPAND_TILE)
            pack_tile(b, r_max, rk, n, p1 - n < EXPAND_TILE ? p1 - n : EXPAND_TILE,
                      bt + (n - p0) / EXPAND_TILE * tile_floats);
        for (int g = 0; g < ng; g++) {
            const int t = m * g / ng, c = m * (g + 1) / ng - t;
            prefetch_ahead(pf, used, m >= MANY_TOKENS);
            for (int64_t n = p0; n < p1; n += EXPAND_TILE) {
                const float *tile = bt + (n - p0) / EXPAND_TILE * tile_floats;
                int64_t cols = p1 - n < EXPAND_TILE ? p1 - n : EXPAND_TILE;
                tile_group(tile, rk, yr + t, outr + t, n, cols, 0, c);
            }
        }
    }
}

#else /* portable: plain loops */
static void shrink_rows(const float *a, int64_t K, int64_t j0, int64_t j1, const float *const *xr, int m, float *y,
                        int64_t ldy, prefetch_t *pf) {
    prefetch_ahead(pf, (j1 - j0) * K * 4, 0);
    for (int64_t j = j0; j < j1; j++)
        for (int t = 0; t < m; t++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += a[j * K + k] * xr[t][k];
            y[t * ldy + j] = s;
        }
}

static void expand_range(const float *b, int64_t r_max, int64_t rk, int64_t n0, int64_t n1, const float *y,
                         int64_t ldy, float *const *outr, int m, prefetch_t *pf) {
    prefetch_ahead(pf, (n1 - n0) * r_max * 4, 0);
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

/* Thread tid's share of both phases (see walk_t): each weight row is read by one thread per block. */
static void run(const job_t *job, int64_t tid, int64_t nth) {
    const int64_t K = job->K, r_max = job->r_max, S = job->S, ldy = job->ldy;
    const float *xr[BLOCK_TOKENS];
    float *outr[BLOCK_TOKENS];
    prefetch_t pf = {.tid = tid, .nth = nth};
    walk_start(&pf.w, job, 0, tid, nth);
    prefetch_ahead(&pf, 0, 1);
    walk_t w;
    walk_start(&w, job, 0, tid, nth);
    for (int64_t last = -1; walk_next(&w); last = w.i) {
        const block_t *blk = job->blocks + w.i;
        if (w.i != last) token_rows(job, blk, xr, NULL, 0);
        shrink_rows(job->A + ((int64_t)blk->slot * S + w.s) * r_max * K, K, w.u0, w.u1, xr, blk->end - blk->begin,
                    job->y + blk->begin * ldy + w.s * r_max, ldy, &pf);
    }
#pragma omp barrier
    walk_start(&w, job, 1, tid, nth);
    while (walk_next(&w)) {
        const block_t *blk = job->blocks + w.i;
        const int64_t n1 = w.u1 * EXPAND_TILE < job->w[w.s] ? w.u1 * EXPAND_TILE : job->w[w.s];
        token_rows(job, blk, NULL, outr, job->off[w.s]);
        expand_range(job->B + ((int64_t)blk->slot * job->N + job->off[w.s]) * r_max, r_max, blk->rank,
                     w.u0 * EXPAND_TILE, n1, job->y + blk->begin * ldy + w.s * r_max, ldy, outr,
                     blk->end - blk->begin, &pf);
    }
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
