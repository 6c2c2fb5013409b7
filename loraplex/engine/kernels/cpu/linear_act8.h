/* Int8 activations for the GGUF block GEMMs (EngineConfig.activation_dtype "int8"): linear.c includes this
 * in its quantized builds, whose linear() quantizes each row block of x here and runs a8_panel over the
 * panels instead of panel(). Exported as lp_linear_packed_a8_<fmt>, lp_linear_packed_side_a8_<fmt> and
 * lp_linear_fold_a8_<fmt> (the float-activation functions' arguments).
 *
 * Semantics (every fp32 operation rounded once, in the order written, no FMA):
 *   each row m of x is cut into groups of 32 k (g); a group whose |x| are all finite has
 *     amax = max |x[k]|;  if amax < 2^-100: sa = 0 and every a = 0;
 *     else sa = amax / 127, inv = 127 / amax, a[k] = round-half-even(x[k] * inv) (in -127..127);
 *   a group holding a NaN or an infinity gets sa = NaN (its row's outputs are NaN, as an fp32 GEMM's would be
 *   or overflow to). Then per weight sub-block h of the group (the whole group; Q6_K: k < 16, then k >= 16),
 *   with q~ the weights' integers less the format's offset (quant_blocks.h: Q8_0 q, Q4_0 q - 8, Q6_K q - 32,
 *   the others q), the exact integers S = sum q~ * a and A = sum a over the sub-block, and its scales as
 *   quant_blocks.h computes them (d = d, or d * (float)sc for the K-quants; m = m, or dmin * (float)mn):
 *     t = d * (float)S                          (Q8_0, Q4_0, Q6_K)
 *     t = d * (float)S + m * (float)A           (Q4_1: the products first, then their sum)
 *     t = d * (float)S - m * (float)A           (Q4_K, Q5_K)
 *     acc = acc + sa * t                        (acc from 0, sub-blocks in order of k)
 *   y[m, n] = acc (+ bias[n]). Every build (vpdpbusd with AVX-512 VNNI or AVX-VNNI, AVX-512BW or AVX2 by vpmaddwd
 *   on widened bytes, the portable loops) gives the same y bit for bit, and a row's y does not depend on the
 *   other rows of the batch. With a fold, the adapter's shrink reads x in fp32 and its expand is added to acc
 *   as linear.c's fold adds it (then the bias), so folded rows agree across builds to fp32 rounding only.
 *
 * Why: at 8+ rows dequantizing every weight to fp32 costs more than the FMAs it feeds (bench blocks); here a weight
 * becomes a byte of a 4-byte word once per panel and row block (a8_build: for all its row groups), and one vpdpbusd
 * does 4 multiply-adds of 16 columns. Activations are quantized once per call and row (not per panel), a row block
 * (ROW_BLOCK rows) at a time into scratch of ROW_BLOCK * K * (1 + (4 + 4 QSUBS) / 32) bytes: the first by the
 * calling thread before the threads start (a decode step's GEMM then has no barrier, which a busy machine makes
 * costly), the later ones by the threads, each taking a share of the rows, between two barriers.
 *
 * The kernel's words: lane j of a vector holds 4 weights' unsigned integers q' (Q8_0: q + 128; the others: q,
 * the K-quants' high bits joined to the low ones) of column j, and the activation words hold the 4 matching a's,
 * so a row's quantized group is stored in the order the words take k in (a8_pos): S = sum q' * a - A8_OFF * A.
 */
#define A8 1
#include <float.h>
#include <math.h>
#include <stdlib.h>

#define A8_TINY 0x1p-100f /* below this a group's absmax quantizes to zero (127 / amax stays finite) */
#if QBITS == 8
#define A8_OFF 128 /* q' = q + 128 (the int8 integer's bits ^ 0x80) */
#else
#define A8_OFF QOFF
#endif

/* Where integer kk of a group goes in a row's quantized group: 4-bit builds take a word of the 4 even
 * (low-nibble) k of 8 consecutive ones, then a word of the 4 odd ones; 8-bit ones k in order. */
static inline int a8_pos(int kk) {
#if QBITS == 8
    return kk;
#else
    return kk / 8 * 8 + kk % 2 * 4 + kk % 8 / 2;
#endif
}

#define A8_SUB (QK / QSUBS) /* k per sub-block */

/* A row block's quantized activations: q [rows, K] int8 (a8_pos order per group), sa [rows, K / 32] and
 * the sums A [rows, K / 32 * QSUBS] (int32, per sub-block). */
typedef struct {
    int8_t *q;
    float *sa;
    int32_t *sum;
    int64_t K;
} a8_t;

static int a8_alloc(a8_t *a, int64_t rows, int64_t K) {
    a->K = K;
    a->q = malloc((size_t)(rows * K));
    a->sa = malloc(sizeof(float) * (size_t)(rows * (K / QK)));
    a->sum = malloc(sizeof(int32_t) * (size_t)(rows * (K / QK) * QSUBS));
    return !a->q || !a->sa || !a->sum;
}

static void a8_free(a8_t *a) { free(a->q), free(a->sa), free(a->sum); }

/* One row of x [K] quantized as the Semantics say into row r of a. */
static void a8_row(const float *x, a8_t *a, int64_t r) {
    const int64_t K = a->K, G = K / QK;
    for (int64_t g = 0; g < G; g++) {
        const float *xg = x + g * QK;
        int8_t *q = a->q + r * K + g * QK;
        float amax = 0.0f;
        int finite = 1;
        for (int i = 0; i < QK; i++) {
            const float v = fabsf(xg[i]);
            finite &= v <= FLT_MAX;
            amax = v > amax ? v : amax;
        }
        int32_t s[QSUBS] = {0};
        if (!finite || amax < A8_TINY) {
            memset(q, 0, QK);
            a->sa[r * G + g] = finite ? 0.0f : NAN;
        } else {
            const float inv = 127.0f / amax;
            a->sa[r * G + g] = amax / 127.0f;
            for (int i = 0; i < QK; i++) {
                float v = nearbyintf(xg[i] * inv); /* (the default rounding: half to even) */
                v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
                q[a8_pos(i)] = (int8_t)v, s[i / A8_SUB] += (int32_t)v;
            }
        }
        for (int h = 0; h < QSUBS; h++) a->sum[(r * G + g) * QSUBS + h] = s[h];
    }
}

/* Rows [0, rows) of x into a, by thread t of nt (its share of the rows). */
static void a8_quantize(const float *x, int64_t lda, int64_t rows, a8_t *a, int64_t t, int64_t nt) {
    for (int64_t r = rows * t / nt; r < rows * (t + 1) / nt; r++) a8_row(x + r * lda, a, r);
}

/* t of one sub-block and column (the Semantics' fp32 combination) from S and A. */
static inline float a8_group_t(float d, float m, int32_t S, int32_t A) {
    const float t = d * (float)S;
    return QMIN > 0 ? t + m * (float)A : QMIN < 0 ? t - m * (float)A : t;
}

#if (defined(__AVX512F__) && defined(__AVX512BW__)) || \
    (!defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define A8_VECTOR 1
/* acc + per 32-bit lane the sum of its 4 byte products u (unsigned) * s (signed), exact: vpdpbusd, or
 * even and odd bytes widened to 16 bits and vpmaddwd (two products of at most 255 * 128 per 32-bit sum). */
#if defined(__AVX512F__)
#define A8_SET1 _mm512_set1_epi32
#define A8_SUBI _mm512_sub_epi32
#define A8_XORI(v, c) _mm512_xor_si512(v, _mm512_set1_epi32(c))
#define Q_MULLO(v, c) _mm512_mullo_epi32(v, _mm512_set1_epi32(c))
#define A8_ADDS8 _mm512_adds_epu8
#define A8_LOW8(v) _mm512_and_si512(v, _mm512_set1_epi16(0xff))
#define A8_SRL16 _mm512_srli_epi16
#define A8_SRA16 _mm512_srai_epi16
#define A8_SLL16 _mm512_slli_epi16
#define A8_MADD16 _mm512_madd_epi16
#define A8_ADD32 _mm512_add_epi32
#else
#define A8_SET1 _mm256_set1_epi32
#define A8_SUBI _mm256_sub_epi32
#define A8_XORI(v, c) _mm256_xor_si256(v, _mm256_set1_epi32(c))
#define Q_MULLO(v, c) _mm256_mullo_epi32(v, _mm256_set1_epi32(c))
#define A8_ADDS8 _mm256_adds_epu8
#define A8_LOW8(v) _mm256_and_si256(v, _mm256_set1_epi16(0xff))
#define A8_SRL16 _mm256_srli_epi16
#define A8_SRA16 _mm256_srai_epi16
#define A8_SLL16 _mm256_slli_epi16
#define A8_MADD16 _mm256_madd_epi16
#define A8_ADD32 _mm256_add_epi32
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define a8_dot _mm512_dpbusd_epi32
#elif !defined(__AVX512F__) && defined(__AVXVNNI__)
#define a8_dot _mm256_dpbusd_avx_epi32 /* AVX-VNNI: the 256-bit VEX form (CPUs with AVX2 and no AVX-512) */
#else
static inline ivec_t a8_dot(ivec_t acc, ivec_t u, ivec_t s) {
    const ivec_t ue = A8_LOW8(u), uo = A8_SRL16(u, 8);                 /* unsigned even / odd bytes */
    const ivec_t se = A8_SRA16(A8_SLL16(s, 8), 8), so = A8_SRA16(s, 8); /* signed even / odd bytes */
    return A8_ADD32(acc, A8_ADD32(A8_MADD16(ue, se), A8_MADD16(uo, so)));
}
#endif

/* 0x10 in each byte of v that is not zero (a saturating add carries any bit to bit 7) */
#define A8_BIT4(v) Q_SHR(Q_ANDI(A8_ADDS8(v, A8_SET1(0x7f7f7f7f)), (int)0x80808080), 3)

/* Vector c of the bytes of rows b, b + 1, b + 2, b + 3 of a group's values, as lane j's bytes 0..3. */
static inline ivec_t a8_bytes4(const uint8_t *vals, int b, int c) {
    const uint8_t *p = vals + b * LP_NR + c * LP_VW;
    return Q_ORI(Q_ORI(Q_U8(Q_BYTES(p)), Q_SHL(Q_U8(Q_BYTES(p + LP_NR)), 8)),
                 Q_ORI(Q_SHL(Q_U8(Q_BYTES(p + 2 * LP_NR)), 16), Q_SHL(Q_U8(Q_BYTES(p + 3 * LP_NR)), 24)));
}

/* The unsigned integers q' of k = 2 b .. 2 b + 7 (4-bit: w[0] the even k, w[1] the odd ones; 8-bit: w[0] k = b ..
 * b + 3) of vector c, in the order a8_pos puts their a's: the low bits, then (Q5_K, Q6_K) the high bits at bit 4
 * of each byte. */
static inline void a8_words(const uint8_t *vals, int b, int c, ivec_t w[2]) {
    const ivec_t v = a8_bytes4(vals, b, c);
#if QBITS == 8
    w[0] = A8_XORI(v, (int)0x80808080);
#else
    w[0] = Q_ANDI(v, 0x0f0f0f0f), w[1] = Q_ANDI(Q_SHR(v, 4), 0x0f0f0f0f);
#if QHBITS == 1 /* k's bit e = k - 2 b of high-bit row b / 4, replicated in each byte; byte i takes bit 2 i (+ 1) */
    const ivec_t hv = Q_U8(Q_BYTES(vals + QLOW + b / 4 * LP_NR + c * LP_VW)), h4 = Q_MULLO(hv, 0x01010101);
    w[0] = Q_ORI(w[0], A8_BIT4(Q_ANDI(h4, 0x40100401))), w[1] = Q_ORI(w[1], A8_BIT4(Q_ANDI(h4, (int)0x80200802)));
#elif QHBITS == 2 /* rows b / 2 and b / 2 + 1 in bytes 0 and 2; k's 2 bits at 2 (e % 4) */
    const uint8_t *hp = vals + QLOW + b / 2 * LP_NR + c * LP_VW;
    const ivec_t hv = Q_ORI(Q_U8(Q_BYTES(hp)), Q_SHL(Q_U8(Q_BYTES(hp + LP_NR)), 16));
    w[0] = Q_ORI(w[0], Q_ORI(Q_ANDI(Q_SHL(hv, 4), 0x00300030), Q_ANDI(Q_SHL(hv, 8), 0x30003000)));
    w[1] = Q_ORI(w[1], Q_ORI(Q_ANDI(Q_SHL(hv, 2), 0x00300030), Q_ANDI(Q_SHL(hv, 6), 0x30003000)));
#endif
#endif
}

#define A8_STEPS (QK * QBITS / 32) /* word steps (4 byte rows each) of a group */

/* R (<= MR) rows of quantized activations (rows of a from m) against one panel: y [R, cols] (+ bias). The
 * weight words come from wb (a8_build's, for panels that several row groups read) or are built here (NULL). */
static inline __attribute__((always_inline)) void a8_rows(const a8_t *a, int64_t m, const wt_t *wp,
                                                          const ivec_t *wb, const float *bias, float *y,
                                                          int64_t ldy, int64_t cols, const ext_t *ext,
                                                          const float *ey, const int R) {
    const int64_t K = a->K, G = K / QK;
    vec_t acc[MR][3];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = acc[r][2] = VZERO();
    for (int64_t g = 0; g < G; g++) {
        const wt_t *hd = Q_HEAD(wp, g), *gp = Q_GROUP(wp, g), *vals = gp + QSCALES;
        (void)hd;
        for (int h = 0; h < QSUBS; h++) {
            ivec_t s[MR][3];
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) s[r][0] = s[r][1] = s[r][2] = Q_IZERO();
            /* the words of 4 k (8-bit) or the two of 8 k (4-bit): their weights, then each row's activation word */
#pragma GCC unroll 8
            for (int b = h * QK * QBITS / 8 / QSUBS; b < (h + 1) * QK * QBITS / 8 / QSUBS; b += 4) {
                ivec_t w[3][2];
                if (wb)
                    for (int c = 0; c < 6; c++) w[c / 2][c % 2] = wb[(g * A8_STEPS + b / 4) * 6 + c];
                else
                    a8_words(vals, b, 0, w[0]), a8_words(vals, b, 1, w[1]), a8_words(vals, b, 2, w[2]);
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    const int8_t *aq = a->q + (m + r) * K + g * QK + b * (8 / QBITS);
#pragma GCC unroll 2
                    for (int i = 0; i < 8 / QBITS; i++) {
                        int32_t word;
                        memcpy(&word, aq + 4 * i, 4);
                        const ivec_t av = A8_SET1(word);
                        s[r][0] = a8_dot(s[r][0], w[0][i], av);
                        s[r][1] = a8_dot(s[r][1], w[1][i], av);
                        s[r][2] = a8_dot(s[r][2], w[2][i], av);
                    }
                }
            }
            const vec_t d0 = Q_SCALE(hd, gp, h, 0), d1 = Q_SCALE(hd, gp, h, 1), d2 = Q_SCALE(hd, gp, h, 2);
            __attribute__((unused)) const vec_t m0 = QMIN ? Q_MINV(hd, gp, 0) : d0, m1 = QMIN ? Q_MINV(hd, gp, 1) : d1,
                                                m2 = QMIN ? Q_MINV(hd, gp, 2) : d2;
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const int32_t A = a->sum[((m + r) * G + g) * QSUBS + h];
                const ivec_t off = A8_SET1(A8_OFF * A);
                const vec_t sa = VSET1(a->sa[(m + r) * G + g]), af = VSET1((float)A);
#define A8_COMBINE(c, dc, mc)                                                                         \
    {                                                                                                 \
        vec_t t = Q_MUL(dc, Q_FLOAT(A8_OFF ? A8_SUBI(s[r][c], off) : s[r][c]));                      \
        if (QMIN) t = QMIN > 0 ? Q_ADD(t, Q_MUL(mc, af)) : Q_SUB(t, Q_MUL(mc, af));                   \
        acc[r][c] = Q_ADD(acc[r][c], Q_MUL(sa, t));                                                   \
    }
                A8_COMBINE(0, d0, m0)
                A8_COMBINE(1, d1, m1)
                A8_COMBINE(2, d2, m2)
#undef A8_COMBINE
            }
        }
    }
    for (int64_t e = 0; e < ext->len; e++) { /* the folded expand, as linear.c's panel_rows adds it */
        const vec_t b0 = VLOAD(ext->b + e * NR), b1 = VLOAD(ext->b + e * NR + VW), b2 = VLOAD(ext->b + e * NR + 2 * VW);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const vec_t x = VSET1(ey[r * ext->ld + e]);
            acc[r][0] = VFMA(x, b0, acc[r][0]), acc[r][1] = VFMA(x, b1, acc[r][1]), acc[r][2] = VFMA(x, b2, acc[r][2]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        float tmp[NR];
        VSTORE(tmp, acc[r][0]), VSTORE(tmp + VW, acc[r][1]), VSTORE(tmp + 2 * VW, acc[r][2]);
        store_cols(tmp, cols, bias, y + r * ldy);
    }
}

/* A panel's weight words, built once for all its row groups: [K / 32, A8_STEPS, 3, 2] vectors. */
static void a8_build(const wt_t *wp, int64_t G, ivec_t *wb) {
    for (int64_t g = 0; g < G; g++)
        for (int b = 0; b < 4 * A8_STEPS; b += 4)
            for (int c = 0; c < 3; c++) a8_words(Q_GROUP(wp, g) + QSCALES, b, c, wb + (g * A8_STEPS + b / 4) * 6 + 2 * c);
}

/* Each thread's words buffer, kept from call to call (grown to the largest K it met: K * 2 NR bytes). */
static __thread ivec_t *a8_wb;
static __thread int64_t a8_wb_groups;

/* M rows of a (from row 0) against one panel, MR rows at a time; with more than MR rows the weight words are
 * built once, into the thread's buffer (without one, by each row group). */
static void a8_panel(const a8_t *a, int64_t M, const wt_t *wp, const float *bias, float *y, int64_t ldy,
                     int64_t cols, const ext_t *ext) {
    const int64_t G = a->K / QK;
    if (M > MR && a8_wb_groups < G) {
        free(a8_wb);
        a8_wb = aligned_alloc(64, sizeof(ivec_t) * 6 * A8_STEPS * (size_t)G);
        a8_wb_groups = a8_wb ? G : 0;
    }
    const ivec_t *wb = M > MR && a8_wb ? a8_wb : 0;
    if (wb) a8_build(wp, G, a8_wb);
    for (int64_t m = 0; m < M; m += MR) {
        const float *ey = ext->len ? ext->y + m * ext->ld : 0;
        switch (M - m < MR ? M - m : MR) {
#define A8_ROWS(R) a8_rows(a, m, wp, wb, bias, y + m * ldy, ldy, cols, ext, ey, R); break;
#if MR == 8
            case 8: A8_ROWS(8)
            case 7: A8_ROWS(7)
            case 6: A8_ROWS(6)
            case 5: A8_ROWS(5)
#endif
            case 4: A8_ROWS(4)
            case 3: A8_ROWS(3)
            case 2: A8_ROWS(2)
            default: A8_ROWS(1)
#undef A8_ROWS
        }
    }
}
#else
/* The portable loops: the same integers and the same fp32 operations, one column at a time. */
static void a8_panel(const a8_t *a, int64_t M, const wt_t *wp, const float *bias, float *y, int64_t ldy,
                     int64_t cols, const ext_t *ext) {
    const int64_t K = a->K, G = K / QK;
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < cols; j++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                const uint8_t *hd = Q_HEAD(wp, g), *gp = Q_GROUP(wp, g);
                (void)hd;
                for (int h = 0; h < QSUBS; h++) {
                    int32_t S = 0;
                    for (int kk = h * A8_SUB; kk < (h + 1) * A8_SUB; kk++)
                        S += (q_group_int(gp + QSCALES, kk, j) - QOFF) * a->q[m * K + g * QK + a8_pos(kk)];
#if !QKQ
                    const float d = q_half(gp + 2 * j), mn = QMIN ? q_half(gp + 2 * LP_NR + 2 * j) : 0.0f;
#else
                    const float d = q_half(hd + 2 * j) * (float)(QMIN ? gp[j] : (int8_t)gp[h * LP_NR + j]);
                    const float mn = QMIN ? q_half(hd + 2 * LP_NR + 2 * j) * (float)gp[LP_NR + j] : 0.0f;
#endif
                    acc = acc + a->sa[m * G + g] * a8_group_t(d, mn, S, a->sum[(m * G + g) * QSUBS + h]);
                }
            }
            for (int64_t e = 0; e < ext->len; e++) acc += ext->y[m * ext->ld + e] * ext->b[e * NR + j];
            y[m * ldy + j] = acc + (bias ? bias[j] : 0.0f);
        }
}
#endif

static int linear(const float *x, int64_t M, int64_t lda, int64_t K, const wt_t *wp, int64_t N, const float *bias,
                  float *y, const lp_side_t *side, const lp_fold_t *fold, const int act8);

/* linear.c's three GEMMs over int8 activations */
int LINEAR_FN(lp_linear_packed_a8)(const float *x, int64_t M, int64_t lda, int64_t K, const wt_t *wp, int64_t N,
                                   const float *bias, float *y) {
    return linear(x, M, lda, K, wp, N, bias, y, 0, 0, 1);
}

int LINEAR_FN(lp_linear_packed_side_a8)(const float *x, int64_t M, int64_t lda, int64_t K, const wt_t *wp,
                                        int64_t N, const float *bias, float *y, const lp_side_t *side) {
    return linear(x, M, lda, K, wp, N, bias, y, side, 0, 1);
}

int LINEAR_FN(lp_linear_fold_a8)(const float *x, int64_t M, int64_t lda, int64_t K, const wt_t *wp, int64_t N,
                                 const float *bias, float *y, const lp_side_t *side, const lp_fold_t *fold) {
    return linear(x, M, lda, K, wp, N, bias, y, side, fold, 1);
}
