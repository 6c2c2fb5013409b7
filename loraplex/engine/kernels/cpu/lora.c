/* Multi-LoRA deltas for a flat token batch on the CPU, fp32: shrink (A) then expand (B), in one call.
 *
 * Built three times: here for fp32 slot buffers (lp_lora_f32), and by lora_bf16.c and lora_f16.c for
 * 16-bit ones (lp_lora_bf16, lp_lora_f16: lora_weights.h), which read A and B widened to fp32 as they
 * are loaded; x, out and every sum are fp32 in each.
 *
 * Semantics (the layout of kernels/lora_ops.py): x [T, K], out [T, N] (row-major, contiguous),
 * A [slots, S * r_max, K], B [slots, r_max, N] (rank-major: the storage of lora_ops' B [slots, N, r_max]
 * view), N = w_0 + .. + w_{S-1}, off_s = w_0 + .. + w_{s-1}.
 * The LoRA tokens come grouped by slot: rows [n] holds token indices, groups [G][3] holds
 * (slot, begin, end): tokens rows[begin .. end-1] use that slot (tokens of no group are untouched).
 * With rk = min(max(ranks[slot], 0), r_max) (r_max when ranks is NULL), for each such token t:
 *     y[s][j]                  = sum_{k < K}  A[slot, s * r_max + j, k] * x[t, k]     j < rk
 *     out[t, off_s + n]       += sum_{j < rk} B[slot, j, off_s + n] * y[s][j]          n < w_s
 * (the sum as FMAs onto out[t, off_s + n] in j order). Rows of A and of B at or beyond rk are padding:
 * never read. So an adapter of rank rk reads rk whole rows of B whatever r_max: a fleet whose largest
 * rank is 64 costs its rank-16 adapters no extra memory traffic.
 *
 * Why: a decode step makes 4 calls per layer; torch ops cost a dispatch per adapter or copy the
 * gathered weights, while the FLOPs are a few percent of the base model's. Here the work is one
 * OpenMP region in two phases split by a barrier, over blocks (up to BLOCK_TOKENS tokens of one slot)
 * whose tokens go in near-equal groups of up to six (32 = 5 + 5 + 6 + 5 + 5 + 6: a lone group of two
 * would run its FMA chains at half speed). The shrink is a small GEMM, a group x 16 rows of A packed
 * transposed (tile_gemm), where the tokens pay for the packing (MANY_TOKENS); else dot products over
 * A's contiguous rows, register-blocked over rows x tokens, memory-bound for one or two tokens. The expand runs FMAs over B's rows as they lie, a group of
 * tokens at a time over an L1-sized panel of columns. In each phase the threads take contiguous ranges of equal
 * estimated cost (weights read + FLOPs) over all blocks' weight rows, so every weight row is read by
 * one thread: one adapter for the whole batch is split over the threads, many adapters are not read
 * twice. The weights come from memory (the base model's GEMMs evict them between calls): a block of
 * many tokens asks for the weights its thread reads next while it computes (prefetch_ahead). The
 * register-blocked pieces (dot products, tile packing, the tile GEMM) are in lora_tiles.h.
 */
#include <stdint.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "lora_tiles.h"

#if LP_LORA_WTYPE == LP_W_BF16
#define LORA_ENTRY lp_lora_bf16
#define LORA_PACKED lp_lora_bf16_packed
#elif LP_LORA_WTYPE == LP_W_F16
#define LORA_ENTRY lp_lora_f16
#define LORA_PACKED lp_lora_f16_packed
#else
#define LORA_ENTRY lp_lora_f32
#define LORA_PACKED lp_lora_f32_packed
#endif

/* Tokens of one slot per block: bounds the token pointer arrays; longer groups (prefill) are split so
 * the threads can share them and a block's x rows stay in L2. */
#define BLOCK_TOKENS 64
/* Cost of reading a weight once, in units of one token's FMA on it (balances memory against compute). */
#define FIXED_COST 8
/* Below this much estimated work a second thread costs more than it saves. */
#define PARALLEL_MIN_WORK (96 * 1024)
#define MAX_SLICES 4
#define MANY_TOKENS 16 /* a block this big is compute-bound: packed shrink, weights asked for ahead */
#define SHRINK_KC 256   /* features of A per packed tile: 16 rows x 256 fill a panel */
#define PF_AHEAD (24 * 1024) /* bytes of weights asked for ahead of the compute: more than a panel */
#define PF_BURST 1024        /* bytes asked for at once beyond what was read since the last ask */
/* Blocks of few tokens (memory-bound) ask for their weights ahead too (1), or leave them to the hardware
 * prefetcher (0). fp32 weights stream at the memory's rate without it (asking made distinct's LoRA work
 * 10% slower on an AMX Xeon); 16-bit ones, half the bytes per row, did not: asking for them took a
 * 32-adapter decode step's LoRA work from 17.4 to 16.0 ms there (bench/RESULTS.md). */
#define STREAM_PF (LP_LORA_WTYPE != LP_W_F32)
#define PANEL_FLOATS 4096 /* a packed A tile (16 KB, in L1); the weights of an expand panel (elements) */
_Static_assert(PANEL_FLOATS >= SHRINK_KC * EXPAND_TILE, "a tile fits");

typedef struct {
    int32_t slot, begin, end; /* tokens rows[begin .. end-1], at most BLOCK_TOKENS */
    int32_t rank;
} block_t;

typedef struct {
    const float *x;
    const wt_t *A, *B;
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
 * units are rows of A (shrink) or EXPAND_TILE columns of B's rk rows (expand). */
typedef struct {
    const job_t *job;
    int expand;
    double lo, hi, base;
    int64_t i, s, u0, u1;
    const wt_t *p, *end;  /* the range's weights: rows of [p, end), the next `rows` of them `stride` apart */
    int64_t rows, stride; /* (stride in elements) */
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
        if (w->base + unit * units <= w->lo) { /* wholly before the thread's share: skipped without dividing */
            w->base += unit * units;
            continue;
        }
        w->u0 = split_at(w->base, unit, units, w->lo);
        w->u1 = split_at(w->base, unit, units, w->hi);
        w->base += unit * units;
        if (w->u0 >= w->u1) continue;
        const int64_t r_max = job->r_max, n0 = w->u0 * EXPAND_TILE, n1 = w->u1 * EXPAND_TILE;
        if (w->expand) { /* columns n0 .. n1-1 of the slice (n1 clipped to its width) in B's rk rows */
            w->p = job->B + (int64_t)blk->slot * r_max * job->N + job->off[w->s] + n0;
            w->end = w->p + (n1 < job->w[w->s] ? n1 : job->w[w->s]) - n0;
            w->rows = blk->rank, w->stride = job->N;
        } else {
            w->p = job->A + (((int64_t)blk->slot * job->S + w->s) * r_max + w->u0) * job->K;
            w->end = w->p + (w->u1 - w->u0) * job->K;
            w->rows = 1, w->stride = 0;
        }
        return 1;
    }
    return 0;
}

/* The prefetch walk: the thread's shrink ranges, then its expand ranges, asked for in order (a range's
 * rows one after another). */
typedef struct {
    walk_t w;
    int64_t tid, nth, lead; /* lead: bytes asked for beyond what the compute has reported read */
    int64_t row;            /* the range's row being asked for */
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
            if (pf->row + 1 < pf->w.rows) {
                pf->row++;
            } else if (!walk_next(&pf->w)) {
                if (pf->w.expand) return;
                walk_start(&pf->w, pf->w.job, 1, pf->tid, pf->nth);
                continue;
            } else {
                pf->row = 0;
            }
            const wt_t *row = pf->w.p + pf->row * pf->w.stride;
            pf->p = (const char *)((uintptr_t)row & ~(uintptr_t)63), pf->end = (const char *)(row + (pf->w.end - pf->w.p));
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
/* Rows j0 .. j1-1 of one slice of A (a = its row 0; rk rows live) against m tokens:
 * y[t * ldy + j] = A[j] . x_t. MANY_TOKENS or more: the rows of the slice's whole 16-row tiles (from
 * row 0) by a GEMM like the expand's over a tile x SHRINK_KC features of A packed transposed (in L1),
 * with no horizontal sums, and A read evenly while it runs; a thread's share that cuts a tile takes
 * its part of it the same way, so each row's bits do not depend on how the rows were split. Other
 * rows (a rank not a multiple of 16) and fewer tokens: shrink_dot. */
static void shrink_rows(const wt_t *a, int64_t K, int64_t rk, int64_t j0, int64_t j1, const float *const *xr, int m,
                        float *y, int64_t ldy, prefetch_t *pf) {
    float at[PANEL_FLOATS] __attribute__((aligned(64)));
    const float *xs[BLOCK_TOKENS];
    float *yr[BLOCK_TOKENS];
    for (int t = 0; t < m; t++) yr[t] = y + t * ldy;
    const int ng = (m + 5) / 6;
    const int64_t tiled = m >= MANY_TOKENS ? rk / EXPAND_TILE * EXPAND_TILE : 0;
    int64_t j = j0;
    while (j < j1 && j < tiled) {
        const int64_t tile_end = (j / EXPAND_TILE + 1) * EXPAND_TILE, rows = (tile_end < j1 ? tile_end : j1) - j;
        for (int64_t x0 = 0; x0 < K; x0 += SHRINK_KC) {
            const int64_t kc = K - x0 < SHRINK_KC ? K - x0 : SHRINK_KC, used = rows * kc * WT_BYTES / ng;
            pack_tile(a + x0, K, kc, j, rows, at);
            for (int t = 0; t < m; t++) xs[t] = xr[t] + x0;
            for (int g = 0; g < ng; g++) {
                const int t = m * g / ng;
                prefetch_ahead(pf, used, 1);
                tile_group(at, kc, xs + t, yr + t, j, rows, x0 == 0, m * (g + 1) / ng - t);
            }
        }
        j += rows;
    }
    prefetch_ahead(pf, (j1 - j) * K * WT_BYTES, STREAM_PF);
    shrink_dot(a, K, j, j1, xr, m, y, ldy);
}

/* Outputs n0 .. n1-1 of one slice (bt = its column 0 in B's row 0, rows ldb elements apart) for m tokens:
 * out_t[n] += B[:rk, n] . y_t, by groups of up to six tokens over a panel of columns whose rk rows
 * (PANEL_FLOATS in all) stay in L1 while the groups read them. */
static void expand_range(const wt_t *bt, int64_t ldb, int64_t rk, int64_t n0, int64_t n1, const float *y,
                         int64_t ldy, float *const *outr, int m, prefetch_t *pf) {
    const float *yr[BLOCK_TOKENS];
    for (int t = 0; t < m; t++) yr[t] = y + t * ldy;
    if (m <= 2) {
        prefetch_ahead(pf, (n1 - n0) * rk * WT_BYTES, STREAM_PF);
        expand_group(bt, ldb, rk, yr, outr, n0, n1, m);
        return;
    }
    const int ng = (m + 5) / 6;
    int64_t panel = PANEL_FLOATS / rk / EXPAND_TILE * EXPAND_TILE;
    panel = panel < EXPAND_TILE ? EXPAND_TILE : panel;
    for (int64_t p0 = n0; p0 < n1; p0 += panel) {
        const int64_t p1 = p0 + panel < n1 ? p0 + panel : n1, used = (p1 - p0) * rk * WT_BYTES / ng;
        for (int g = 0; g < ng; g++) {
            const int t = m * g / ng;
            prefetch_ahead(pf, used, m >= MANY_TOKENS);
            expand_group(bt, ldb, rk, yr + t, outr + t, p0, p1, m * (g + 1) / ng - t);
        }
    }
}

#else /* portable: plain loops */
static void shrink_rows(const wt_t *a, int64_t K, int64_t rk, int64_t j0, int64_t j1, const float *const *xr, int m,
                        float *y, int64_t ldy, prefetch_t *pf) {
    (void)rk;
    prefetch_ahead(pf, (j1 - j0) * K * WT_BYTES, 0);
    for (int64_t j = j0; j < j1; j++)
        for (int t = 0; t < m; t++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += wscalar(a + j * K + k) * xr[t][k];
            y[t * ldy + j] = s;
        }
}

static void expand_range(const wt_t *bt, int64_t ldb, int64_t rk, int64_t n0, int64_t n1, const float *y,
                         int64_t ldy, float *const *outr, int m, prefetch_t *pf) {
    prefetch_ahead(pf, (n1 - n0) * rk * WT_BYTES, 0);
    for (int t = 0; t < m; t++)
        for (int64_t n = n0; n < n1; n++) {
            float s = outr[t][n];
            for (int64_t j = 0; j < rk; j++) s += wscalar(bt + j * ldb + n) * y[t * ldy + j];
            outr[t][n] = s;
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
        shrink_rows(job->A + ((int64_t)blk->slot * S + w.s) * r_max * K, K, blk->rank, w.u0, w.u1, xr,
                    blk->end - blk->begin, job->y + blk->begin * ldy + w.s * r_max, ldy, &pf);
    }
#pragma omp barrier
    walk_start(&w, job, 1, tid, nth);
    while (walk_next(&w)) {
        const block_t *blk = job->blocks + w.i;
        const int64_t n1 = w.u1 * EXPAND_TILE < job->w[w.s] ? w.u1 * EXPAND_TILE : job->w[w.s];
        token_rows(job, blk, NULL, outr, job->off[w.s]);
        expand_range(job->B + (int64_t)blk->slot * r_max * job->N + job->off[w.s], job->N, blk->rank,
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
int LORA_ENTRY(const float *x, float *out, int64_t T, int64_t K, int64_t N, const wt_t *A, const wt_t *B,
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

/* LORA_ENTRY with its arguments packed in one int64 array, pointers as integers (0 = NULL):
 * x, out, T, K, N, A, B, slots, r_max, ranks, rows, num_rows, groups, G, S, widths[0 .. S-1].
 * One ctypes argument instead of sixteen: the Python wrapper saves about 2 us per call. */
int LORA_PACKED(const int64_t *p) {
    if (p[14] < 1 || p[14] > MAX_SLICES) return -1;
    return LORA_ENTRY((const float *)(intptr_t)p[0], (float *)(intptr_t)p[1], p[2], p[3], p[4],
                      (const wt_t *)(intptr_t)p[5], (const wt_t *)(intptr_t)p[6], p[7], p[8], p[14], p + 15,
                      (const int32_t *)(intptr_t)p[9], (const int32_t *)(intptr_t)p[10], p[11],
                      (const int32_t *)(intptr_t)p[12], p[13]);
}
