/* Linear layers for CPU serving over weights packed once at load: y = x @ W^T (+ bias), fp32.
 *
 * Semantics: for m < M, n < N:  y[m, n] = sum_k x[m, k] * W[n, k] + (bias ? bias[n] : 0),
 * where W [N, K] is given packed (lp_pack_f32) as panels of NR output columns, three vectors of the
 * build's width (48 with AVX-512, else 24; lp_panel_columns):
 * Wp[p, k, j] = W[p * NR + j, k] (zero beyond N), so a panel is one contiguous K x NR block.
 *
 * Why: the decode batches a server runs (1 to a few dozen tokens) are where MKL is weakest on this
 * kind of CPU: a batch-1 GEMV streams the weights on one thread, and at 32 rows MKL repacks the
 * weights on every call and reaches about half the machine's FMA rate (bench/RESULTS.md). Packed
 * panels are read in order, once per call, by a register-blocked kernel (8 x 48 with AVX-512, 4 x 24
 * with AVX2), the threads splitting the panels; rows are taken in blocks of 64 so a block of x stays in cache.
 * Software prefetches keep the weights arriving at the rate the kernel uses them (see panel()).
 *
 * bf16 weights (linear_bf16.c builds this file again with LP_LINEAR_WTYPE LP_W_BF16: lp_pack_bf16,
 * lp_linear_packed_bf16, ...): the panels hold each weight rounded once to bf16 (nearest even), and
 * the kernel widens them to fp32 as it loads them (exact: a bf16 value b is the fp32 of bits b << 16).
 * x, y, the bias, the fold and every sum stay fp32, and the sums run in the same order as the fp32
 * build's, so y equals the fp32 build's y over the rounded weights bit for bit. Why: a decode step at
 * small batches streams every weight once per step, so half the bytes is up to twice the tokens/s;
 * and checkpoints published in bf16 (most HF models) lose nothing.
 *
 * GGUF blocks (linear_q8_0.c, linear_q4_0.c, linear_q4_1.c and the K-quants' linear_q4_k.c, linear_q5_k.c,
 * linear_q6_k.c build this file again over quant_blocks.h's panels): each weight is dequantized in registers to
 * gguf's own value and the sums run as the fp32 build's, so y equals the fp32 build's over those values bit for
 * bit; except a lone row of 4- to 6-bit weights (ROW_SUMS), which sums x * q per sub-block (32 weights, 16 for
 * Q6_K; even and odd k in two sums, added at the sub-block's end) and applies the scale (and min times the sum
 * of x) once a sub-block. From DEQ_MIN_ROWS rows a vector build dequantizes each panel once into fp32 and runs
 * the fp32 build's panel() over it (lp_panel_f32): the same values in the same order, so the same y. AVX-512
 * builds run the K-quants through the same vector body as AVX2 at their width. Over int8 activations
 * (lp_linear_*_a8_<fmt>, EngineConfig.activation_dtype int8) the same driver quantizes each row block and
 * multiplies integers instead: linear_act8.h has its own Semantics.
 *
 * Fold (lp_linear_fold_f32): with one adapter's LoRA folded in, for the rows it applies to,
 *     y[m, n] += sum_{e < len_p} ys[m, e0_p + e] * bp_p[e, n - p * NR]     (p = n / NR)
 * where ys[m, :] = x[m, :] @ ap^T is computed first (its own panels, the threads splitting the rows),
 * so shrink and expand run at the GEMM's rate inside its parallel region: the expand is a short
 * extension of each panel's k loop (16 more steps after K at rank 16, on the same accumulators).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef LP_LINEAR_WTYPE
#define LP_LINEAR_WTYPE LP_W_F32
#endif
#if LP_LINEAR_WTYPE == LP_W_BF16
typedef uint16_t wt_t; /* a panel's element: bf16 bits */
#define LINEAR_FN(name) name##_bf16
#elif LP_LINEAR_WTYPE == LP_W_F32
typedef float wt_t;
#define LINEAR_FN(name) name##_f32
#elif LP_LINEAR_WTYPE >= LP_W_Q8_0 && LP_LINEAR_WTYPE <= LP_W_Q6_K
typedef uint8_t wt_t; /* a panel's element: a byte of quant_blocks.h's groups */
#define LP_QUANT 1
#include "quant_blocks.h"
#if LP_LINEAR_WTYPE == LP_W_Q8_0
#define LINEAR_FN(name) name##_q8_0
#elif LP_LINEAR_WTYPE == LP_W_Q4_0
#define LINEAR_FN(name) name##_q4_0
#elif LP_LINEAR_WTYPE == LP_W_Q4_1
#define LINEAR_FN(name) name##_q4_1
#elif LP_LINEAR_WTYPE == LP_W_Q4_K
#define LINEAR_FN(name) name##_q4_k
#elif LP_LINEAR_WTYPE == LP_W_Q5_K
#define LINEAR_FN(name) name##_q5_k
#else
#define LINEAR_FN(name) name##_q6_k
#endif
#else
#error "linear.c is built for fp32, bf16 or GGUF block weights"
#endif
#ifndef LP_QUANT
#define LP_QUANT 0
/* Weight (k, j) of a panel of w columns per k, and a panel's elements over K (a GEMM's panels: w = NR) */
#define WAT(panel, K, k, j, w) (LP_LINEAR_WTYPE == LP_W_BF16 ? lp_bf16_to_f32((panel)[(k) * (w) + (j)]) \
                                                             : (float)(panel)[(k) * (w) + (j)])
#define PANEL_ELEMS(K) ((K) * NR)
#define K_MULTIPLE 1 /* K's granule */
/* Bytes a panel holds per k (for the prefetch distances) */
#define K_BYTES(nv) ((nv) * VW * (int64_t)sizeof(wt_t))
#else
#define WAT(panel, K, k, j, w) q_panel_at(panel, k, j)
/* A lone row (R 1) of 4-bit weights (the K-quants' 5 and 6 bits too) sums x * q per sub-block and applies
 * the scale (and the min times sum x) once a sub-block: about half the vector work of dequantizing every
 * weight (a decode step of one sequence is bound by it, not by memory), at the price of rounding otherwise
 * than gguf's dequantized values (quant_blocks.h). */
#define ROW_SUMS(R) (QBITS == 4 && (R) == 1)
#define PANEL_ELEMS(K) ((K) / (QK * QSB) * SB_BYTES)
#define K_MULTIPLE (QK * QSB) /* whole GGUF blocks */
#define K_BYTES(nv) ((SB_BYTES + QK * QSB - 1) / (QK * QSB))
#endif

#define NR LP_NR
#define VW LP_VW
#define ROW_BLOCK 64
/* Below this many weights a second thread costs more than it saves. */
#define PARALLEL_MIN_WEIGHTS (64 * 1024)

#if LP_LINEAR_WTYPE == LP_W_F32 /* (the type-independent exports: once, in the fp32 build) */
int64_t lp_panel_columns(void) { return NR; }

int64_t lp_fold_shrink_width(int64_t S, int64_t rank) { return lp_fold_width(S, rank); }

int64_t lp_packed_size(int64_t N, int64_t K) { return (N + NR - 1) / NR * NR * K; }
#endif

/* Side prefetch (lp_side_t): a compute-bound GEMM asks for memory the kernel after it reads (the
 * step's LoRA weights) with bandwidth the GEMM leaves idle; what arrives is evicted to L3 by the weight
 * stream and read from there. The threads take equal contiguous shares of the lines and spread theirs
 * over their panels' row groups, one line per 4 k-steps between the FMAs. Measured on Zen 3 at 32
 * rows: asked for in bursts between row groups, the lines filled the miss buffers and stalled the
 * GEMM's own loads (15% slower, nothing gained); one line per 2 k-steps was slower than per 4. */
typedef struct {
    const int64_t *spans;
    int64_t n, i, row, line, left; /* position (span, row, line in the row), lines still to ask for */
    int64_t owed;                  /* lines due by now but not yet asked for */
} side_t;

static inline int64_t row_lines(const int64_t *span) { return (span[3] + 63) / 64; }

static int64_t side_lines(const lp_side_t *side) {
    int64_t lines = 0;
    for (int64_t i = 0; side && side->spans && i < side->n; i++)
        lines += side->spans[4 * i + 1] * row_lines(side->spans + 4 * i);
    return lines;
}

static void side_start(side_t *sd, const int64_t *spans, int64_t n, int64_t skip, int64_t count) {
    *sd = (side_t){.spans = spans, .n = n, .left = count};
    for (; sd->i < n && skip >= spans[4 * sd->i + 1] * row_lines(spans + 4 * sd->i); sd->i++)
        skip -= spans[4 * sd->i + 1] * row_lines(spans + 4 * sd->i);
    if (sd->i < n) sd->row = skip / row_lines(spans + 4 * sd->i), sd->line = skip % row_lines(spans + 4 * sd->i);
}

/* Up to `want` lines that lie together in the current row: returns the first one's address and sets
 * *n; moves past them. */
__attribute__((unused)) /* (the portable panel() asks for no side lines) */
static const char *side_take(side_t *sd, int64_t want, int64_t *n) {
    want = want < sd->left ? want : sd->left;
    *n = 0;
    if (want <= 0 || sd->i >= sd->n) return 0;
    const int64_t *s = sd->spans + 4 * sd->i, lines = row_lines(s);
    const char *p = (const char *)(intptr_t)s[0] + sd->row * s[2] + sd->line * 64;
    *n = lines - sd->line < want ? lines - sd->line : want;
    sd->left -= *n;
    if ((sd->line += *n) == lines) {
        sd->line = 0;
        if (++sd->row == s[1]) sd->row = 0, sd->i++;
    }
    return p;
}

/* A panel's folded expand (lp_fold_t): len more k steps over b [len, NR], reading the shrink rows at
 * y (row stride ld). len 0: none. */
typedef struct {
    const float *b, *y;
    int64_t ld, len;
} ext_t;

static const ext_t NO_EXT = {0};

/* One panel's GEMM over fp32 weights [K][NR] (the fp32 build's panel(), exported by it): a quantized build
 * runs a panel of DEQ_MIN_ROWS rows or more through it once dequantized (see linear()). */
void lp_panel_f32(const float *x, int64_t lda, int64_t M, int64_t K, const float *wp, const float *bias, float *y,
                  int64_t ldy, int64_t cols, const ext_t *ext);

#if LP_LINEAR_WTYPE == LP_W_F32
int64_t lp_fold_ext(const int64_t *widths, int64_t S, int64_t rank, int64_t N, int64_t p, int64_t *e0) {
    int64_t c0 = p * NR, c1 = (c0 + NR < N ? c0 + NR : N) - 1, s0 = -1, s1 = -1, off = 0;
    for (int64_t s = 0; s < S; off += widths[s++]) {
        if (s0 < 0 && c0 < off + widths[s]) s0 = s;
        if (c1 < off + widths[s]) {
            s1 = s;
            break;
        }
    }
    *e0 = s0 * rank;
    return s0 < 0 || s1 < 0 ? 0 : (s1 - s0 + 1) * rank;
}
#endif

#if LP_QUANT
int64_t LINEAR_FN(lp_packed_bytes)(int64_t N, int64_t K) { return (N + NR - 1) / NR * PANEL_ELEMS(K); }

/* Panels from GGUF blocks [N, K / block weights] (quant_blocks.h); -1 when K is not whole blocks. */
int LINEAR_FN(lp_pack)(const uint8_t *blocks, int64_t N, int64_t K, wt_t *wp) {
    if (N < 1 || K < QK * QSB || K % (QK * QSB)) return -1;
    q_pack(blocks, N, K, wp);
    return 0;
}

/* The GGUF blocks of rows[0..n) of packed panels [N, K] (the inverse of lp_pack): blocks [n, K / block
 * weights * block bytes]; -1 when a row is out of range. */
int LINEAR_FN(lp_unpack_rows)(const wt_t *wp, int64_t N, int64_t K, const int64_t *rows, int64_t n,
                              uint8_t *blocks) {
    if (K < QK * QSB || K % (QK * QSB)) return -1;
    for (int64_t r = 0; r < n; r++)
        if (rows[r] < 0 || rows[r] >= N) return -1;
    q_unpack_rows(wp, K, rows, n, blocks);
    return 0;
}
#else
void LINEAR_FN(lp_pack)(const float *w, int64_t N, int64_t K, wt_t *wp) {
    int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < NR; j++) {
                int64_t n = p * NR + j;
                lp_weight_store(wp, (p * K + k) * NR + j, LP_LINEAR_WTYPE, n < N ? w[n * K + k] : 0.0f);
            }
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && (!LP_QUANT || defined(__F16C__)))
#include <immintrin.h>
#define VECTOR_PANELS 1
/* One kernel body for both vector widths: a panel row is three vectors (NR = 3 * VW columns). With
 * AVX-512, 8 rows x 48 columns (24 accumulators of the 32 registers); with AVX2, 4 x 24 (12 of 16). */
#if defined(__AVX512F__)
#define MR 8
typedef __m512 vec_t;
typedef __m512i ivec_t;
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VSET1 _mm512_set1_ps
#define VZERO _mm512_setzero_ps
#define VFMA _mm512_fmadd_ps
#define VADD _mm512_add_ps
#define VFNMA _mm512_fnmadd_ps
/* 16 bf16 weights widened to fp32 */
#define WLOAD16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#else
#define MR 4
typedef __m256 vec_t;
typedef __m256i ivec_t;
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VSET1 _mm256_set1_ps
#define VZERO _mm256_setzero_ps
#define VFMA _mm256_fmadd_ps
#define VADD _mm256_add_ps
#define VFNMA _mm256_fnmadd_ps
/* 8 bf16 weights widened to fp32 */
#define WLOAD16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#endif
#if LP_QUANT && QMIN < 0
#define VMIN_FMA VFNMA /* acc - m * xs */
#else
#define VMIN_FMA VFMA
#endif
#if LP_LINEAR_WTYPE == LP_W_F32
#define WLOAD VLOAD
#else
#define WLOAD WLOAD16
#endif
_Static_assert(NR == 3 * VW, "a panel row is three vectors");
/* Side lines: one per 2^SIDE_SHIFT k-steps. Denser was slower on Zen 3 (AVX2) and on a Xeon with
 * AVX-512 (one per k or per 2: distinct 0.59 / 0.64 of base against 0.65 at one per 4). */
#ifndef SIDE_SHIFT
#define SIDE_SHIFT 2
#endif
#define SIDE_MASK ((1 << SIDE_SHIFT) - 1)

/* y[j] = tmp[j] (+ bias[j]) for j < cols: a partial panel's row. Not inlined: the vectorizer would
 * otherwise compile this loop once per row of every instantiation of panel_rows (40 s of build). */
static __attribute__((noinline)) void store_cols(const float *tmp, int64_t cols, const float *bias, float *y) {
    for (int64_t j = 0; j < cols; j++) y[j] = tmp[j] + (bias ? bias[j] : 0.0f);
}
#if LP_QUANT
#include "linear_qpanels.h" /* (Q_FOR_INTS: a block panel's integers in vectors; dequant_panel) */
#endif

/* R (<= MR) rows of x against one panel of NV (1 to 3) vectors per k (a GEMM's panels have 3, a fold's
 * shrink panels may be narrower), writing `cols` (<= NV * VW) columns of y; inlined with constant R,
 * NV, PF and SIDE so the accumulators stay in registers. With PF it prefetches pfn lines from
 * pf + k * pfstep on each k; with SIDE also one line of side on every 2^SIDE_SHIFT-th k below side_k.
 * The folded expand (ext) runs on full panels only (NV 3). */
static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t lda, int64_t K,
                                                             const wt_t *wp, const float *bias, float *y,
                                                             int64_t ldy, int64_t cols, uintptr_t pf,
                                                             int64_t pfstep, int64_t pfn, const char *side,
                                                             int64_t side_k, const ext_t *ext, const float *ey,
                                                             const int R, const int NV, const int PF, const int SIDE) {
    const int W = NV * VW; /* weights per panel row */
    vec_t acc[MR][3];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
        for (int c = 0; c < NV; c++) acc[r][c] = VZERO();
/* one k step over the panel row b0, b1, b2 (the weights of k, as fp32 vectors) */
#define K_STEP(k)                                                                                          \
    do {                                                                                                   \
        /* Pins the panel row in registers. Left alone, GCC folds the three loads into every row's          \
         * FMAs (12 loads per k instead of 3), and the load ports, not the FMAs, set the pace. With         \
         * 1-2 rows the FMAs are not the limit, and the folded form (fewer instructions) was faster. */    \
        if (R > 2) __asm__("" : "+v"(b0), "+v"(b1), "+v"(b2));                                             \
        if (PF)                                                                                            \
            for (int64_t i = 0; i < pfn; i++) _mm_prefetch((const char *)(pf + (k) * pfstep + 64 * i), _MM_HINT_T0); \
        if (SIDE && ((k) & SIDE_MASK) == (SIDE_MASK + 1) / 2 && (k) < side_k)                               \
            _mm_prefetch(side + ((k) >> SIDE_SHIFT) * 64, _MM_HINT_T1);                                    \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                              \
            vec_t a = VSET1(x[r * lda + (k)]);                                                             \
            acc[r][0] = VFMA(a, b0, acc[r][0]);                                                            \
            if (NV > 1) acc[r][1] = VFMA(a, b1, acc[r][1]);                                                \
            if (NV > 2) acc[r][2] = VFMA(a, b2, acc[r][2]);                                                \
        }                                                                                                  \
    } while (0)
#if LP_QUANT
    /* per group and sub-block its scales, then its k steps, each dequantized in registers (quant_blocks.h);
     * one row of 4-bit weights by sub-block sums (ROW_SUMS) */
    if (!ROW_SUMS(R))
        Q_FOR_WEIGHTS(wp, K, {
            vec_t b0 = Q_WEIGHTS(i0, d0, m0), b1 = Q_WEIGHTS(i1, d1, m1), b2 = Q_WEIGHTS(i2, d2, m2);
            K_STEP(g * QK + kk);
        })
    for (int64_t g = 0; g < K / QK && ROW_SUMS(R); g++) {
        const wt_t *hd = Q_HEAD(wp, g), *gp = Q_GROUP(wp, g), *vals = gp + QSCALES;
        (void)hd;
        for (int h = 0; h < QSUBS; h++) {
            /* sum x q per column and sum x, even k and odd k apart: each sum waits for the FMA before it
             * (4-5 cycles), and one chain per vector left the FMA units idle most of the time */
            vec_t s0 = VZERO(), s1 = VZERO(), s2 = VZERO(), xs = VZERO();
            vec_t t0 = VZERO(), t1 = VZERO(), t2 = VZERO(), xt = VZERO();
            Q_FOR_INTS(vals, h, {
                const vec_t a = VSET1(x[g * QK + kk]);
                if (odd) {
                    t0 = VFMA(a, Q_FLOAT(i0), t0);
                    if (NV > 1) t1 = VFMA(a, Q_FLOAT(i1), t1);
                    if (NV > 2) t2 = VFMA(a, Q_FLOAT(i2), t2);
                    if (QMIN) xt = VADD(xt, a);
                } else {
                    s0 = VFMA(a, Q_FLOAT(i0), s0);
                    if (NV > 1) s1 = VFMA(a, Q_FLOAT(i1), s1);
                    if (NV > 2) s2 = VFMA(a, Q_FLOAT(i2), s2);
                    if (QMIN) xs = VADD(xs, a);
                }
            })
            s0 = VADD(s0, t0), s1 = VADD(s1, t1), s2 = VADD(s2, t2), xs = VADD(xs, xt);
            acc[0][0] = VFMA(Q_SCALE(hd, gp, h, 0), s0, acc[0][0]);
            if (NV > 1) acc[0][1] = VFMA(Q_SCALE(hd, gp, h, 1), s1, acc[0][1]);
            if (NV > 2) acc[0][2] = VFMA(Q_SCALE(hd, gp, h, 2), s2, acc[0][2]);
            if (QMIN) { /* + m * sum x (Q4_1), - dmin * mn * sum x (the K-quants) */
                acc[0][0] = VMIN_FMA(Q_MINV(hd, gp, 0), xs, acc[0][0]);
                if (NV > 1) acc[0][1] = VMIN_FMA(Q_MINV(hd, gp, 1), xs, acc[0][1]);
                if (NV > 2) acc[0][2] = VMIN_FMA(Q_MINV(hd, gp, 2), xs, acc[0][2]);
            }
        }
    }
#else
    for (int64_t k = 0; k < K; k++) {
        vec_t b0 = WLOAD(wp + k * W), b1 = NV > 1 ? WLOAD(wp + k * W + VW) : VZERO(),
              b2 = NV > 2 ? WLOAD(wp + k * W + 2 * VW) : VZERO();
        K_STEP(k);
    }
#endif
    for (int64_t e = 0; NV == 3 && e < ext->len; e++) { /* the folded expand: more k steps, over ys and bp */
        vec_t b0 = VLOAD(ext->b + e * NR), b1 = VLOAD(ext->b + e * NR + VW), b2 = VLOAD(ext->b + e * NR + 2 * VW);
        if (R > 2) __asm__("" : "+v"(b0), "+v"(b1), "+v"(b2)); /* (as above) */
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            vec_t a = VSET1(ey[r * ext->ld + e]);
            acc[r][0] = VFMA(a, b0, acc[r][0]);
            acc[r][1] = VFMA(a, b1, acc[r][1]);
            acc[r][2] = VFMA(a, b2, acc[r][2]);
        }
    }
    /* the accumulators leave registers only here, by name: indexing them in a loop over a
     * run-time bound makes GCC keep them in memory through the k loop (half the speed) */
    if (cols == W) {
        vec_t d0 = VZERO(), d1 = d0, d2 = d0;
        if (bias) d0 = VLOAD(bias), d1 = NV > 1 ? VLOAD(bias + VW) : d1, d2 = NV > 2 ? VLOAD(bias + 2 * VW) : d2;
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            VSTORE(y + r * ldy, VADD(acc[r][0], d0));
            if (NV > 1) VSTORE(y + r * ldy + VW, VADD(acc[r][1], d1));
            if (NV > 2) VSTORE(y + r * ldy + 2 * VW, VADD(acc[r][2], d2));
        }
        return;
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        float tmp[NR];
        VSTORE(tmp, acc[r][0]);
        if (NV > 1) VSTORE(tmp + VW, acc[r][1]);
        if (NV > 2) VSTORE(tmp + 2 * VW, acc[r][2]);
        store_cols(tmp, cols, bias, y + r * ldy);
    }
}

#define ROWS(R, NV, PF, SD)                                                                                  \
    panel_rows(x + m * lda, lda, K, wp, bias, y + m * ldy, ldy, cols, gpf, step, pfn, side, side_k, ext,     \
               ext->len ? ext->y + m * ext->ld : 0, R, NV, PF, SD)
#if MR == 8
#define WIDE_ROWS(NV, PF, SD)               \
    case 8: ROWS(8, NV, PF, SD); break;     \
    case 7: ROWS(7, NV, PF, SD); break;     \
    case 6: ROWS(6, NV, PF, SD); break;     \
    case 5: ROWS(5, NV, PF, SD); break;
#else
#define WIDE_ROWS(NV, PF, SD)
#endif
/* r (1 to MR) rows at m, with or without prefetching (and side prefetching) */
#define GROUP(NV, PF, SD)                    \
    switch (r) {                             \
        WIDE_ROWS(NV, PF, SD)                \
        case 4: ROWS(4, NV, PF, SD); break;  \
        case 3: ROWS(3, NV, PF, SD); break;  \
        case 2: ROWS(2, NV, PF, SD); break;  \
        default: ROWS(1, NV, PF, SD); break; \
    }
/* ... for a panel of nv vectors per k (side prefetching only on full panels, as the GEMMs ask) */
#define GROUP_NV(PF)             \
    if (nv == 3) {               \
        GROUP(3, PF, 0)          \
    } else if (nv == 2) {        \
        GROUP(2, PF, 0)          \
    } else {                     \
        GROUP(1, PF, 0)          \
    }

/* M rows of x against one panel (nv vectors of VW columns per k), in groups of at most MR rows as even
 * as can be (with MR 4: 5 = 3 + 2, 9 = 3 + 3 + 3, measured faster than 4 + 1 and 4 + 4 + 1).
 * Prefetching as measured best on Zen 3: with several groups, they read the panel from L2 and
 * prefetch the next one (`next`, or none) in equal slices, so it arrives from memory at an even rate
 * instead of in a burst that the first group waits on. One group of 2 to MR rows streams the panel
 * from memory and prefetches 1-1.5 KB ahead of its reads (up to 15% faster than the hardware
 * prefetcher alone); one row needs neither. A group asks for one line per whole 64 bytes of its
 * per-k share (at least one). A prefetch never faults, so the ones that run past the last panel are
 * harmless (their addresses are integers, not pointers past the array). */
static void panel(const float *x, int64_t lda, int64_t M, int64_t K, const wt_t *wp, int64_t nv, const float *bias,
                  float *y, int64_t ldy, int64_t cols, const wt_t *next, side_t *sd, int64_t side_lines,
                  const ext_t *ext) {
    const int64_t row_bytes = K_BYTES(nv);
    int64_t groups = (M + MR - 1) / MR, step = (row_bytes + groups - 1) / groups, m = 0;
    uintptr_t pf = (uintptr_t)next;
    if (groups == 1) pf = (uintptr_t)wp + (M == 2 ? 1024 : 1536), step = row_bytes;
    const int64_t pfn = step < 128 ? 1 : step / 64;
    for (int64_t g = 0; g < groups; g++) {
        int64_t r = (M - m + groups - g - 1) / (groups - g);
        uintptr_t gpf = pf ? pf + g * step * K : 0;
        /* this group's share of the side lines (and what earlier groups could not take) */
        int64_t n = 0, side_k = 0;
        sd->owed += side_lines * (g + 1) / groups - side_lines * g / groups;
        const int64_t room = K >> SIDE_SHIFT;
        const char *side = gpf && nv == 3 ? side_take(sd, sd->owed < room ? sd->owed : room, &n) : 0;
        sd->owed -= n, side_k = n << SIDE_SHIFT;
        if (M > 1 && gpf && side_k) {
            GROUP(3, 1, 1)
        } else if (M > 1 && gpf) {
            GROUP_NV(1)
        } else {
            GROUP_NV(0)
        }
        m += r;
    }
}
#else
static void panel(const float *x, int64_t lda, int64_t M, int64_t K, const wt_t *wp, int64_t nv, const float *bias,
                  float *y, int64_t ldy, int64_t cols, const wt_t *next, side_t *sd, int64_t side_lines,
                  const ext_t *ext) {
    (void)next, (void)sd, (void)side_lines;
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < cols; j++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += x[m * lda + k] * WAT(wp, K, k, j, nv * VW);
            for (int64_t e = 0; e < ext->len; e++) s += ext->y[m * ext->ld + e] * ext->b[e * NR + j];
            y[m * ldy + j] = s + (bias ? bias[j] : 0.0f);
        }
}
#endif
#if LP_LINEAR_WTYPE == LP_W_F32
void lp_panel_f32(const float *x, int64_t lda, int64_t M, int64_t K, const float *wp, const float *bias, float *y,
                  int64_t ldy, int64_t cols, const ext_t *ext) {
    side_t none = {0};
    panel(x, lda, M, K, wp, 3, bias, y, ldy, cols, 0, &none, 0, ext);
}
#endif
/* From this many rows (two groups of MR: 8 with AVX2, 16 with AVX-512) a vector build of a block format
 * dequantizes each panel once into fp32 and runs the fp32 kernel over it, rather than dequantizing it again for
 * every group of MR rows; the result is the same, bit for bit (dequant_panel). One group dequantizes once
 * anyway. */
#if LP_QUANT && defined(VECTOR_PANELS)
#define DEQ_MIN_ROWS (2 * MR)
/* The calling thread's buffer of at least `floats` fp32 (NULL when memory runs out): kept between calls and
 * grown to the largest panel the thread has dequantized (K * NR floats), so a step's GEMMs allocate nothing. */
static float *deq_buffer(int64_t floats) {
    static __thread float *buf;
    static __thread int64_t cap;
    if (floats > cap) {
        float *grown = realloc(buf, sizeof(float) * floats);
        if (!grown) return 0;
        buf = grown, cap = floats;
    }
    return buf;
}
#else
#define DEQ_MIN_ROWS (ROW_BLOCK + 1) /* never */
#endif
#if LP_QUANT
#include "linear_act8.h" /* (int8 activations: a8_quantize, a8_panel) */
#else
#define A8 0
#endif

/* Floats per row of a fold's shrink output (its panels' columns): the row stride of fold->y. */
static inline int64_t fold_ld(const lp_fold_t *fold) { return fold->pa * lp_fold_width(fold->S, fold->rank); }

#if LP_LINEAR_WTYPE == LP_W_F32
/* The fold's first phase, by thread t of nt (its share of the rows, panels of ap against each): the
 * shrink ys = x @ ap^T, zeroed in the rows the adapter does not apply to. The fold's panels are fp32
 * whatever the GEMM's weights, so every build calls this one (kernels.h). */
void lp_linear_fold_shrink(const float *x, int64_t M, int64_t lda, int64_t K, const lp_fold_t *fold, int64_t t,
                           int64_t nt) {
    const int64_t aw = lp_fold_width(fold->S, fold->rank), ld = fold_ld(fold), r0 = M * t / nt, r1 = M * (t + 1) / nt;
    side_t none = {0};
    for (int64_t m0 = r0; m0 < r1; m0 += ROW_BLOCK) {
        const int64_t rows = r1 - m0 < ROW_BLOCK ? r1 - m0 : ROW_BLOCK;
        for (int64_t q = 0; q < fold->pa; q++)
            panel(x + m0 * lda, lda, rows, K, fold->ap + q * K * aw, aw / VW, 0, fold->y + m0 * ld + q * aw, ld, aw,
                  q + 1 < fold->pa ? fold->ap + (q + 1) * K * aw : 0, &none, 0, &NO_EXT);
    }
    for (int64_t m = r0; fold->keep && m < r1; m++)
        if (!fold->keep[m]) memset(fold->y + m * ld, 0, sizeof(float) * ld);
}
#endif

/* y = x @ W^T (+ bias), asking for the side lines while it runs (side may be NULL), with the fold's
 * adapter delta added to its rows (fold may be NULL); act8: over int8 activations (linear_act8.h). */
static int linear(const float *x, int64_t M, int64_t lda, int64_t K, const wt_t *wp, int64_t N, const float *bias,
                  float *y, const lp_side_t *side, const lp_fold_t *fold, const int act8) {
    if (M < 0 || K < 1 || N < 1 || lda < K || K % K_MULTIPLE) return -1;
    if (side && side->n < 0) return -1;
    if (fold && (fold->rank < 1 || fold->S < 1 || fold->pa != lp_fold_panels(fold->S, fold->rank))) return -1;
    if (M == 0) return 0;
    const int64_t panels = (N + NR - 1) / NR, blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t side_count = side_lines(side);
#if A8
    a8_t a8 = {0};
    if (act8 && a8_alloc(&a8, M < ROW_BLOCK ? M : ROW_BLOCK, K)) return a8_free(&a8), -2;
    if (act8) a8_quantize(x, lda, M < ROW_BLOCK ? M : ROW_BLOCK, &a8, 0, 1); /* (a decode step's rows: no barrier) */
#else
    (void)act8;
#endif
#pragma omp parallel if (N * K >= PARALLEL_MIN_WEIGHTS)
    {
        int64_t t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num(), nt = omp_get_num_threads();
#endif
        if (fold) {
            lp_linear_fold_shrink(x, M, lda, K, fold, t, nt);
#pragma omp barrier
        }
        /* a contiguous run of panels per thread, so "the next panel" is the thread's own; the row
         * blocks need no barrier between them, so one parallel region serves them all */
        int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt, items = (p1 - p0) * blocks, item = 0;
        int64_t s0 = side_count * t / nt, share = side_count * (t + 1) / nt - s0;
        /* where panel p0's expand block starts in bp (the blocks of the panels before it) */
        int64_t b0 = 0, e0 = 0;
        const int64_t ys_ld = fold ? fold_ld(fold) : 0;
        for (int64_t p = 0; fold && p < p0; p++) b0 += lp_fold_ext(fold->widths, fold->S, fold->rank, N, p, &e0) * NR;
        side_t sd;
        side_start(&sd, share ? side->spans : 0, share ? side->n : 0, s0, share);
        for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
            int64_t rows = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK, boff = b0;
#if A8
            if (act8 && m0) { /* the next row block, once every thread is done with the last */
#pragma omp barrier
                a8_quantize(x + m0 * lda, lda, rows, &a8, t, nt);
#pragma omp barrier
            }
#endif
            for (int64_t p = p0; p < p1; p++, item++) {
                int64_t cols = N - p * NR < NR ? N - p * NR : NR;
                ext_t ext = NO_EXT;
                if (fold) {
                    ext.len = lp_fold_ext(fold->widths, fold->S, fold->rank, N, p, &e0);
                    ext.b = fold->bp + boff, ext.ld = ys_ld, ext.y = fold->y + m0 * ext.ld + e0;
                    boff += ext.len * NR;
                    /* the next panel's expand block (about as long as this one's), asked for now: the
                     * weights' prefetch does not cover it, and its first row group would wait on it */
                    for (int64_t off = 0; p + 1 < p1 && off < ext.len * NR; off += 16)
                        __builtin_prefetch(fold->bp + boff + off, 0, 3);
                }
#if A8
                if (act8) {
                    a8_panel(&a8, rows, wp + p * PANEL_ELEMS(K), bias ? bias + p * NR : 0, y + m0 * N + p * NR, N, cols, &ext);
                    continue;
                }
#endif
#if DEQ_MIN_ROWS <= ROW_BLOCK
                float *deq;
                if (rows >= DEQ_MIN_ROWS && (deq = deq_buffer(K * NR))) {
                    dequant_panel(wp + p * PANEL_ELEMS(K), K, deq);
                    lp_panel_f32(x + m0 * lda, lda, rows, K, deq, bias ? bias + p * NR : 0, y + m0 * N + p * NR, N,
                                 cols, &ext);
                    continue;
                }
#endif
                panel(x + m0 * lda, lda, rows, K, wp + p * PANEL_ELEMS(K), 3, bias ? bias + p * NR : 0, y + m0 * N + p * NR,
                      N, cols, p + 1 < p1 ? wp + (p + 1) * PANEL_ELEMS(K) : 0, &sd,
                      share * (item + 1) / items - share * item / items, &ext);
            }
        }
    }
#if A8
    a8_free(&a8);
#endif
    return 0;
}

int LINEAR_FN(lp_linear_packed_side)(const float *x, int64_t M, int64_t lda, int64_t K, const wt_t *wp, int64_t N,
                              const float *bias, float *y, const lp_side_t *side) {
    return linear(x, M, lda, K, wp, N, bias, y, side, 0, 0);
}

int LINEAR_FN(lp_linear_fold)(const float *x, int64_t M, int64_t lda, int64_t K, const wt_t *wp, int64_t N,
                       const float *bias, float *y, const lp_side_t *side, const lp_fold_t *fold) {
    return linear(x, M, lda, K, wp, N, bias, y, side, fold, 0);
}

int LINEAR_FN(lp_linear_packed)(const float *x, int64_t M, int64_t lda, int64_t K, const wt_t *wp, int64_t N,
                         const float *bias, float *y) {
    return linear(x, M, lda, K, wp, N, bias, y, 0, 0, 0);
}
