/* GGUF's block formats as linear.c's quantized builds keep them in packed panels.
 *
 * Semantics: a GGUF tensor [N, K] holds, per row, K / QBLOCK_K blocks (q the stored integer; d, m and dmin
 * fp16, widened exactly to fp32; every product and sum below is one fp32 operation, rounded once, in the order
 * written: no FMA); weight i of a block is
 *   Q8_0 (32 weights, 34 bytes: d, int8 q[32]):        w = (float)q * d
 *   Q4_0 (32, 18 bytes: d, uint8 qs[16]):               w = (float)(q - 8) * d
 *   Q4_1 (32, 20 bytes: d, m, uint8 qs[16]):            w = (float)q * d + m
 *   Q4_K (256, 144 bytes: d, dmin, 12 bytes of 6-bit sc[8] and mn[8], qs[128]), 4-bit q:
 *                                                       w = (float)q * (d * (float)sc[s]) - dmin * (float)mn[s]
 *   Q5_K (256, 176 bytes: as Q4_K, then qh[32] before qs): the same over 5-bit q (a fifth bit from qh)
 *   Q6_K (256, 210 bytes: ql[128], qh[64], int8 sc[16], d), 6-bit q: w = (float)(q - 32) * (d * (float)sc[t])
 * with s = i / 32 and t = i / 16 the sub-block, and the bits of q where gguf's dequantization takes them
 * (q_block_int); these are gguf's own formulas, rounded alike (d * sc is gguf's fp32 product, then times q,
 * then less dmin * mn), so a kernel that dequantizes in registers computes with exactly the weights the fp32
 * build gets from gguf's dequantized tensor.
 *
 * Panel layout (lp_pack_<fmt>): a panel of NR output columns is K / (32 QSB) super-blocks, each a header
 * (QHEAD bytes) and QSB groups of 32 k; the K-quants (QSB 8: one GGUF block per super-block) head theirs
 * with d [NR] (and dmin [NR]) fp16, the others (QSB 1) have none. A group of k = 32 g .. 32 g + 31 is
 *   its scales (QSCALES bytes): Q8_0, Q4_0: d [NR] fp16; Q4_1: d, m [NR] fp16; Q4_K, Q5_K: sc [NR], mn [NR]
 *   uint8 (the 6-bit integers, unpacked); Q6_K: sc [2][NR] int8 (k < 16, k >= 16),
 *   then the low bits of its integers: Q8_0: int8 [32][NR]; else uint8 [16][NR], byte (k / 2, j) holding
 *   k even in its low nibble and k odd in its high one,
 *   then (Q5_K, Q6_K) their high bits: uint8 [32 QHBITS / 8][NR], byte (k / QHSTEP, j) holding k's bits at
 *   bit QHBITS * (k % QHSTEP),
 * so the kernel reads a panel front to back, one group's scales then its values, at 8.5, 4.5, 5, 4.625,
 * 5.625 or 6.5625 bits a weight: the bytes GGUF stores (the K-quants' 6-bit sub-block scales and mins take a
 * byte each here: 0.125 bits a weight more). The kernel computes d * sc (and dmin * mn) once a group, as
 * gguf does. Columns past N hold zeros (d = 0).
 */
#ifndef LORAPLEX_CPU_QUANT_BLOCKS_H
#define LORAPLEX_CPU_QUANT_BLOCKS_H
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define QK 32 /* weights per panel group */

/* QBITS: the stored integers' low bits (8 or 4); QHBITS: high bits beside them; QBLOCK: a GGUF block's bytes;
 * QSB: groups per GGUF block; QOFF: the offset subtracted from q; QMIN: a min added (1) or subtracted (-1);
 * QSUBS: scales per group. */
#if LP_LINEAR_WTYPE == LP_W_Q8_0
#define QBITS 8
#define QHBITS 0
#define QBLOCK 34
#define QSB 1
#define QOFF 0
#define QMIN 0
#elif LP_LINEAR_WTYPE == LP_W_Q4_0
#define QBITS 4
#define QHBITS 0
#define QBLOCK 18
#define QSB 1
#define QOFF 8
#define QMIN 0
#elif LP_LINEAR_WTYPE == LP_W_Q4_1
#define QBITS 4
#define QHBITS 0
#define QBLOCK 20
#define QSB 1
#define QOFF 0
#define QMIN 1
#elif LP_LINEAR_WTYPE == LP_W_Q4_K
#define QBITS 4
#define QHBITS 0
#define QBLOCK 144
#define QSB 8
#define QOFF 0
#define QMIN (-1)
#elif LP_LINEAR_WTYPE == LP_W_Q5_K
#define QBITS 4
#define QHBITS 1
#define QBLOCK 176
#define QSB 8
#define QOFF 0
#define QMIN (-1)
#elif LP_LINEAR_WTYPE == LP_W_Q6_K
#define QBITS 4
#define QHBITS 2
#define QBLOCK 210
#define QSB 8
#define QOFF 32
#define QMIN 0
#endif

#define QKQ (QSB > 1)                          /* a K-quant: group scales are integers times the header's */
#define QSUBS (LP_LINEAR_WTYPE == LP_W_Q6_K ? 2 : 1)
#define QSTEP (QBITS == 8 ? 1 : 2)             /* k per byte of low bits */
#define QHSTEP (QHBITS ? 8 / QHBITS : QSTEP)   /* k per byte of high bits */
#define QHEAD (QKQ ? 2 * LP_NR * (QMIN ? 2 : 1) : 0)
#define QSCALES (QKQ ? 2 * LP_NR : 2 * LP_NR * (QMIN ? 2 : 1))
#define QLOW (QK * QBITS / 8 * LP_NR)
#define GROUP_BYTES (QSCALES + QLOW + QK * QHBITS / 8 * LP_NR)
#define SB_BYTES (QHEAD + QSB * GROUP_BYTES)   /* a super-block of a panel */
#define Q_HEAD(wp, g) ((wp) + (g) / QSB * SB_BYTES)
#define Q_GROUP(wp, g) (Q_HEAD(wp, g) + QHEAD + (g) % QSB * GROUP_BYTES)

static inline float q_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return lp_f16_to_f32(h);
}

/* Q4_K / Q5_K: sub-block s's 6-bit scale (mn 0) or min (mn 1) from the block's 12 bytes, as gguf's
 * get_scale_min unpacks them; q_kscale_put is its inverse. */
static inline int q_kscale(const uint8_t *b, int s, int mn) {
    if (s < 4) return b[s + 4 * mn] & 63;
    return (mn ? b[s + 4] >> 4 : b[s + 4] & 15) | (b[s - 4 + 4 * mn] >> 6) << 4;
}

static inline void q_kscale_put(uint8_t *b, int s, int mn, int v) {
    if (s < 4) {
        b[s + 4 * mn] |= (uint8_t)(v & 63);
        return;
    }
    b[s + 4] |= (uint8_t)(mn ? (v & 15) << 4 : v & 15);
    b[s - 4 + 4 * mn] |= (uint8_t)((v >> 4) << 6);
}

/* Where bit field `bits` (at `shift`) of weight i lies in a GGUF block: *byte's offset; returns the shift. */
static inline int q_block_field(int i, int high, int *byte) {
#if QBITS == 8
    (void)high;
    *byte = 2 + i;
    return 0;
#elif !QKQ /* Q4_0, Q4_1: nibble i < 16 low, else high, of qs[i % 16] */
    (void)high;
    *byte = 2 * (1 + QMIN) + i % 16;
    return i < 16 ? 0 : 4;
#elif QHBITS == 0 /* Q4_K: qs[32 (i / 64) + i % 32], low nibble for i % 64 < 32 */
    (void)high;
    *byte = 16 + 32 * (i / 64) + i % 32;
    return i % 64 < 32 ? 0 : 4;
#elif QHBITS == 1 /* Q5_K: the nibble as Q4_K's (after qh[32]); bit i / 32 of qh[i % 32] */
    *byte = high ? 16 + i % 32 : 48 + 32 * (i / 64) + i % 32;
    return high ? i / 32 : (i % 64 < 32 ? 0 : 4);
#else /* Q6_K: nibble (i % 128) / 64 of ql[64 (i / 128) + i % 64]; bits 2 ((i % 128) / 32) of qh[32 (i / 128) + i % 32] */
    *byte = high ? 128 + 32 * (i / 128) + i % 32 : 64 * (i / 128) + i % 64;
    return high ? 2 * ((i % 128) / 32) : 4 * ((i % 128) / 64);
#endif
}

/* Stored integer i of a GGUF block (before QOFF; Q8_0's signed), and its inverse into a zeroed block. */
static inline int q_block_int(const uint8_t *block, int i) {
    int byte, q;
    const int shift = q_block_field(i, 0, &byte);
#if QBITS == 8
    (void)shift;
    q = (int8_t)block[byte];
#else
    q = (block[byte] >> shift) & 15;
#endif
#if QHBITS
    const int hshift = q_block_field(i, 1, &byte);
    q |= ((block[byte] >> hshift) & ((1 << QHBITS) - 1)) << 4;
#endif
    return q;
}

static inline void q_block_int_put(uint8_t *block, int i, int q) {
    int byte;
    const int shift = q_block_field(i, 0, &byte);
    block[byte] |= (uint8_t)(QBITS == 8 ? q : (q & 15) << shift);
#if QHBITS
    const int hshift = q_block_field(i, 1, &byte);
    block[byte] |= (uint8_t)((q >> 4) << hshift);
#endif
}

/* A group's value bytes: integer kk (0..31) of column j, and its inverse into zeroed bytes. */
static inline int q_group_int(const uint8_t *vals, int kk, int64_t j) {
#if QBITS == 8
    return (int8_t)vals[kk * LP_NR + j];
#else
    int q = (vals[kk / 2 * LP_NR + j] >> (kk & 1 ? 4 : 0)) & 15;
#if QHBITS
    q |= ((vals[QLOW + kk / QHSTEP * LP_NR + j] >> (QHBITS * (kk % QHSTEP))) & ((1 << QHBITS) - 1)) << 4;
#endif
    return q;
#endif
}

static inline void q_group_int_put(uint8_t *vals, int kk, int64_t j, int q) {
#if QBITS == 8
    vals[kk * LP_NR + j] = (uint8_t)q;
#else
    vals[kk / 2 * LP_NR + j] |= (uint8_t)((q & 15) << (kk & 1 ? 4 : 0));
#if QHBITS
    vals[QLOW + kk / QHSTEP * LP_NR + j] |= (uint8_t)((q >> 4) << (QHBITS * (kk % QHSTEP)));
#endif
#endif
}

/* Where the fp16 header fields (d, then dmin) lie in a GGUF block, and a group's scale bytes (gs) from it. */
#define Q_BLOCK_D (LP_LINEAR_WTYPE == LP_W_Q6_K ? 208 : 0)

static inline void q_group_scales(const uint8_t *block, int g, int64_t j, uint8_t *gs) {
#if !QKQ
    (void)g;
    memcpy(gs + 2 * j, block, 2);                                 /* d */
    if (QMIN) memcpy(gs + 2 * LP_NR + 2 * j, block + 2, 2);       /* m */
#elif QMIN
    gs[j] = (uint8_t)q_kscale(block + 4, g, 0), gs[LP_NR + j] = (uint8_t)q_kscale(block + 4, g, 1);
#else
    gs[j] = block[192 + 2 * g], gs[LP_NR + j] = block[193 + 2 * g];
#endif
}

static inline void q_group_scales_put(uint8_t *block, int g, int64_t j, const uint8_t *gs) {
#if !QKQ
    (void)g;
    memcpy(block, gs + 2 * j, 2);
    if (QMIN) memcpy(block + 2, gs + 2 * LP_NR + 2 * j, 2);
#elif QMIN
    q_kscale_put(block + 4, g, 0, gs[j]), q_kscale_put(block + 4, g, 1, gs[LP_NR + j]);
#else
    block[192 + 2 * g] = gs[j], block[193 + 2 * g] = gs[LP_NR + j];
#endif
}

/* Weight (k, j) of a packed panel, dequantized as the Semantics say. */
static inline float q_panel_at(const uint8_t *panel, int64_t k, int64_t j) {
    const uint8_t *gp = Q_GROUP(panel, k / QK);
    const int kk = (int)(k % QK);
    const float q = (float)(q_group_int(gp + QSCALES, kk, j) - QOFF);
#if !QKQ
    const float d = q_half(gp + 2 * j);
    return QMIN ? q * d + q_half(gp + 2 * LP_NR + 2 * j) : q * d;
#else
    const uint8_t *hd = Q_HEAD(panel, k / QK);
#if QMIN
    const float sd = q_half(hd + 2 * j) * (float)gp[j], smin = q_half(hd + 2 * LP_NR + 2 * j) * (float)gp[LP_NR + j];
    return q * sd - smin;
#else
    return q * (q_half(hd + 2 * j) * (float)(int8_t)gp[kk / 16 * LP_NR + j]);
#endif
#endif
}

/* Panels from GGUF blocks [N, K / (32 QSB) blocks] (row-major), or (unpack) the blocks of rows[0..n) back
 * from the panels (the exact inverse: every bit of a block lands in the panel). */
static inline void q_pack(const uint8_t *blocks, int64_t N, int64_t K, uint8_t *wp) {
    const int64_t panels = (N + LP_NR - 1) / LP_NR, sbs = K / (QK * QSB);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t sb = 0; sb < sbs; sb++) {
            uint8_t *out = wp + (p * sbs + sb) * SB_BYTES;
            memset(out, 0, SB_BYTES);
            for (int64_t j = 0; j < LP_NR && p * LP_NR + j < N; j++) {
                const uint8_t *block = blocks + ((p * LP_NR + j) * sbs + sb) * QBLOCK;
                if (QKQ) memcpy(out + 2 * j, block + Q_BLOCK_D, 2);              /* d */
                if (QKQ && QMIN) memcpy(out + 2 * LP_NR + 2 * j, block + 2, 2); /* dmin */
                for (int g = 0; g < QSB; g++) {
                    uint8_t *gp = out + QHEAD + g * GROUP_BYTES;
                    q_group_scales(block, g, j, gp);
                    for (int kk = 0; kk < QK; kk++) q_group_int_put(gp + QSCALES, kk, j, q_block_int(block, g * QK + kk));
                }
            }
        }
}

static inline void q_unpack_rows(const uint8_t *wp, int64_t K, const int64_t *rows, int64_t n, uint8_t *blocks) {
    const int64_t sbs = K / (QK * QSB);
#pragma omp parallel for schedule(static) if (n * K >= 1 << 20)
    for (int64_t r = 0; r < n; r++)
        for (int64_t sb = 0; sb < sbs; sb++) {
            const int64_t p = rows[r] / LP_NR, j = rows[r] % LP_NR;
            const uint8_t *in = wp + (p * sbs + sb) * SB_BYTES;
            uint8_t *block = blocks + (r * sbs + sb) * QBLOCK;
            memset(block, 0, QBLOCK);
            if (QKQ) memcpy(block + Q_BLOCK_D, in + 2 * j, 2);
            if (QKQ && QMIN) memcpy(block + 2, in + 2 * LP_NR + 2 * j, 2);
            for (int g = 0; g < QSB; g++) {
                const uint8_t *gp = in + QHEAD + g * GROUP_BYTES;
                q_group_scales_put(block, g, j, gp);
                for (int kk = 0; kk < QK; kk++) q_block_int_put(block, g * QK + kk, q_group_int(gp + QSCALES, kk, j));
            }
        }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
/* One vector (LP_VW columns, from column c * LP_VW) of a group's scales or values, as fp32. */
#if defined(__AVX512F__)
#define Q_HALVES(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define Q_BYTES(p) _mm_loadu_si128((const __m128i *)(p))
#define Q_I8(b) _mm512_cvtepi8_epi32(b)
#define Q_U8(b) _mm512_cvtepu8_epi32(b)
#define Q_ANDI(v, c) _mm512_and_si512(v, _mm512_set1_epi32(c))
#define Q_ORI(a, b) _mm512_or_si512(a, b)
#define Q_SHR(v, n) _mm512_srli_epi32(v, n)
#define Q_SHL(v, n) _mm512_slli_epi32(v, n)
#define Q_SUBI(v, c) _mm512_sub_epi32(v, _mm512_set1_epi32(c))
#define Q_FLOAT(v) _mm512_cvtepi32_ps(v)
#define Q_MUL _mm512_mul_ps
#define Q_ADD _mm512_add_ps
#define Q_SUB _mm512_sub_ps
#define Q_IZERO _mm512_setzero_si512
#else
#define Q_HALVES(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define Q_BYTES(p) _mm_loadl_epi64((const __m128i *)(p))
#define Q_I8(b) _mm256_cvtepi8_epi32(b)
#define Q_U8(b) _mm256_cvtepu8_epi32(b)
#define Q_ANDI(v, c) _mm256_and_si256(v, _mm256_set1_epi32(c))
#define Q_ORI(a, b) _mm256_or_si256(a, b)
#define Q_SHR(v, n) _mm256_srli_epi32(v, n)
#define Q_SHL(v, n) _mm256_slli_epi32(v, n)
#define Q_SUBI(v, c) _mm256_sub_epi32(v, _mm256_set1_epi32(c))
#define Q_FLOAT(v) _mm256_cvtepi32_ps(v)
#define Q_MUL _mm256_mul_ps
#define Q_ADD _mm256_add_ps
#define Q_SUB _mm256_sub_ps
#define Q_IZERO _mm256_setzero_si256
#endif
/* Vector c of a group's low-bit bytes for k = 32 g + kk (8-bit) or for kk and kk + 1 (4-bit: both nibbles), and
 * of its high-bit bytes for kk .. kk + QHSTEP - 1, widened to 32-bit lanes once. */
#if QBITS == 8
#define Q_RAW(vals, kk, c) Q_I8(Q_BYTES((vals) + (kk) * LP_NR + (c) * LP_VW))
#else
#define Q_RAW(vals, kk, c) Q_U8(Q_BYTES((vals) + (kk) / 2 * LP_NR + (c) * LP_VW))
#endif
#if QHBITS
#define Q_HRAW(vals, kk, c) Q_U8(Q_BYTES((vals) + QLOW + (kk) / QHSTEP * LP_NR + (c) * LP_VW))
/* the high bits of k = kk0 + e (kk0 a multiple of QHSTEP) moved to bit 4 */
#define Q_HIGH(hraw, e)                                                                                \
    Q_ANDI(QHBITS * (e) <= 4 ? Q_SHL(hraw, 4 - QHBITS * (e)) : Q_SHR(hraw, QHBITS * (e) - 4), \
           ((1 << QHBITS) - 1) << 4)
#else
#define Q_HRAW(vals, kk, c) Q_IZERO()
#endif
/* k's integers (less QOFF) from them; e: k's place in its high-bit byte (kk % QHSTEP, k even or odd alike) */
#if QBITS == 8
#define Q_INTS(raw, hraw, e) (raw)
#else
#define Q_LOW(raw, e) ((e) & 1 ? Q_SHR(raw, 4) : Q_ANDI(raw, 15))
#if QHBITS
#define Q_UINTS(raw, hraw, e) Q_ORI(Q_LOW(raw, e), Q_HIGH(hraw, e))
#else
#define Q_UINTS(raw, hraw, e) Q_LOW(raw, e)
#endif
#define Q_INTS(raw, hraw, e) (QOFF ? Q_SUBI(Q_UINTS(raw, hraw, e), QOFF) : Q_UINTS(raw, hraw, e))
#endif
/* Vector c of sub-block h's scale (d, or d * sc) and min (m, or dmin * mn; unused without one), as
 * q_panel_at computes them: hd the super-block's header, gp the group. */
#if !QKQ
#define Q_SCALE(hd, gp, h, c) Q_HALVES((gp) + 2 * (c) * LP_VW)
#define Q_MINV(hd, gp, c) Q_HALVES((gp) + 2 * LP_NR + 2 * (c) * LP_VW)
#else
#define Q_SCALE(hd, gp, h, c)                                                                              \
    Q_MUL(Q_HALVES((hd) + 2 * (c) * LP_VW),                                                            \
          Q_FLOAT(QMIN ? Q_U8(Q_BYTES((gp) + (c) * LP_VW)) : Q_I8(Q_BYTES((gp) + (h) * LP_NR + (c) * LP_VW))))
#define Q_MINV(hd, gp, c) \
    Q_MUL(Q_HALVES((hd) + 2 * LP_NR + 2 * (c) * LP_VW), Q_FLOAT(Q_U8(Q_BYTES((gp) + LP_NR + (c) * LP_VW))))
#endif
/* The dequantized weights from k's integers, as q_panel_at gives them one by one */
#if QMIN > 0
#define Q_WEIGHTS(ints, d, m) Q_ADD(Q_MUL(Q_FLOAT(ints), d), m)
#elif QMIN < 0
#define Q_WEIGHTS(ints, d, m) Q_SUB(Q_MUL(Q_FLOAT(ints), d), m)
#else
#define Q_WEIGHTS(ints, d, m) Q_MUL(Q_FLOAT(ints), d)
#endif
#endif

#endif
