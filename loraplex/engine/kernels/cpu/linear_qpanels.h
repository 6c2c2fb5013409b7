/* linear.c's vector walk over a block panel's integers, and a panel dequantized whole (quant_blocks.h's
 * layout; included by linear.c's vector section in a block format's build, after its vector types). */
#ifndef LORAPLEX_CPU_LINEAR_QPANELS_H
#define LORAPLEX_CPU_LINEAR_QPANELS_H

/* Over the integers of sub-block h of group g (vals: its value bytes): the statements given per k = 32 g + kk, with i0, i1,
 * i2 the three vectors of k's integers (less QOFF). The low-bit bytes of a k pair and the high-bit bytes of
 * QHSTEP k's are widened once. */
#define Q_FOR_INTS(vals, h, ...)                                                                               \
    for (int k0 = (h) * QK / QSUBS; k0 < ((h) + 1) * QK / QSUBS; k0 += QHSTEP) {                                \
        __attribute__((unused)) const ivec_t h0 = Q_HRAW(vals, k0, 0), h1 = Q_HRAW(vals, k0, 1),               \
                                             h2 = Q_HRAW(vals, k0, 2);                                         \
        _Pragma("GCC unroll 8") for (int kp = k0; kp < k0 + QHSTEP; kp += QSTEP) {                             \
            const ivec_t r0 = Q_RAW(vals, kp, 0), r1 = Q_RAW(vals, kp, 1), r2 = Q_RAW(vals, kp, 2);           \
            Q_AT_K(kp, kp - k0, __VA_ARGS__)                                                                   \
            if (QSTEP > 1) Q_AT_K(kp + 1, kp - k0 + 1, __VA_ARGS__)                                            \
        }                                                                                                      \
    }
/* (one k of them: its integers i0, i1, i2; e its place in its high-bit byte) */
#define Q_AT_K(k_, e, ...)                                                                                     \
    {                                                                                                          \
        const int kk = (k_);                                                                                   \
        __attribute__((unused)) const int odd = (e) & 1; /* k odd (a constant once the k loop is unrolled) */ \
        const ivec_t i0 = Q_INTS(r0, h0, e), i1 = Q_INTS(r1, h1, e), i2 = Q_INTS(r2, h2, e);                   \
        __VA_ARGS__                                                                                            \
    }

/* Over every k of a panel of K (group g, sub-block h, kk): the statements given, with i0, i1, i2 k's integers
 * (Q_FOR_INTS) and d0..d2, m0..m2 its sub-block's scales and mins as Q_WEIGHTS takes them. */
#define Q_FOR_WEIGHTS(wp, K, ...)                                                                              \
    for (int64_t g = 0; g < (K) / QK; g++) {                                                                   \
        const wt_t *hd = Q_HEAD(wp, g), *gp = Q_GROUP(wp, g), *vals = gp + QSCALES;                            \
        (void)hd;                                                                                              \
        for (int h = 0; h < QSUBS; h++) {                                                                      \
            const vec_t d0 = Q_SCALE(hd, gp, h, 0), d1 = Q_SCALE(hd, gp, h, 1), d2 = Q_SCALE(hd, gp, h, 2);   \
            __attribute__((unused)) const vec_t m0 = QMIN ? Q_MINV(hd, gp, 0) : d0,                            \
                                                m1 = QMIN ? Q_MINV(hd, gp, 1) : d1,                            \
                                                m2 = QMIN ? Q_MINV(hd, gp, 2) : d2;                            \
            Q_FOR_INTS(vals, h, __VA_ARGS__)                                                                   \
        }                                                                                                      \
    }

/* A panel's weights as fp32 [K][NR], each the value q_panel_at gives (so the fp32 panel() over them sums
 * exactly as this build's own would). */
static void dequant_panel(const wt_t *wp, int64_t K, float *out) {
    Q_FOR_WEIGHTS(wp, K, {
        float *o = out + (g * QK + kk) * NR;
        VSTORE(o, Q_WEIGHTS(i0, d0, m0));
        VSTORE(o + VW, Q_WEIGHTS(i1, d1, m1));
        VSTORE(o + 2 * VW, Q_WEIGHTS(i2, d2, m2));
    })
}

#endif
