/* GGUF's 8- and 4-bit block formats as linear.c's quantized builds keep them in packed panels.
 *
 * Semantics: a GGUF tensor [N, K] holds, per row, K / 32 blocks of 32 weights (q the stored integer,
 * d and m fp16, widened exactly to fp32); weight i of a block is
 *   Q8_0 (34 bytes: d, int8 q[32]):            w = (float)q[i] * d
 *   Q4_0 (18 bytes: d, uint8 qs[16]):           w = (float)(nib_i - 8) * d
 *   Q4_1 (20 bytes: d, m, uint8 qs[16]):        w = (float)nib_i * d + m   (a product, then a sum: no FMA)
 * with nib_i = qs[i] & 15 for i < 16 and qs[i - 16] >> 4 for i >= 16: gguf's own dequantization,
 * rounded alike, so a kernel that dequantizes in registers computes with exactly the weights that the
 * fp32 build gets from gguf's dequantized tensor.
 *
 * Panel layout (lp_pack_<fmt>): a panel of NR output columns is K / 32 groups, each
 *   d [NR] fp16, then (Q4_1) m [NR] fp16, then the values of k = 32 g .. 32 g + 31:
 *   Q8_0: int8 [32][NR]; Q4: uint8 [16][NR], byte (k / 2, j) holding k even in its low nibble and
 *   k odd in its high one,
 * so the kernel reads a panel front to back, one group's scales then its values, at 8.5, 4.5 or 5
 * bits a weight: the bytes GGUF stores. Columns past N hold zeros (d = 0).
 */
#ifndef LORAPLEX_CPU_QUANT_BLOCKS_H
#define LORAPLEX_CPU_QUANT_BLOCKS_H
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define QK 32 /* weights per block (and per panel group) */

#if LP_LINEAR_WTYPE == LP_W_Q8_0
#define QBITS 8
#define QMIN 0
#define QBLOCK 34
#elif LP_LINEAR_WTYPE == LP_W_Q4_0
#define QBITS 4
#define QMIN 0
#define QBLOCK 18
#elif LP_LINEAR_WTYPE == LP_W_Q4_1
#define QBITS 4
#define QMIN 1
#define QBLOCK 20
#endif

#define QSCALES (2 * LP_NR * (1 + QMIN))           /* bytes of a group's d (and m) */
#define GROUP_BYTES (QSCALES + QK * QBITS / 8 * LP_NR) /* bytes of a group */

static inline float q_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return lp_f16_to_f32(h);
}

/* Stored integer i (0..31) of a GGUF block, as the format defines it (4-bit: the nibble, unsigned). */
static inline int q_block_int(const uint8_t *block, int i) {
    const uint8_t *qs = block + 2 * (1 + QMIN);
#if QBITS == 8
    return (int8_t)qs[i];
#else
    return i < 16 ? qs[i] & 15 : qs[i - 16] >> 4;
#endif
}

/* Weight (k, j) of a packed panel, dequantized as the Semantics say. */
static inline float q_panel_at(const uint8_t *panel, int64_t k, int64_t j) {
    const uint8_t *g = panel + (k / QK) * GROUP_BYTES, *vals = g + QSCALES;
    const int64_t kk = k % QK;
    const float d = q_half(g + 2 * j);
#if QBITS == 8
    return (float)(int8_t)vals[kk * LP_NR + j] * d;
#else
    const int nib = kk & 1 ? vals[(kk / 2) * LP_NR + j] >> 4 : vals[(kk / 2) * LP_NR + j] & 15;
#if QMIN
    return (float)nib * d + q_half(g + 2 * LP_NR + 2 * j);
#else
    return (float)(nib - 8) * d;
#endif
#endif
}

/* Panels from GGUF blocks [N, K / 32 * QBLOCK] (row-major, rows of K / 32 blocks). */
static inline void q_pack(const uint8_t *blocks, int64_t N, int64_t K, uint8_t *wp) {
    const int64_t panels = (N + LP_NR - 1) / LP_NR, groups = K / QK;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *out = wp + (p * groups + g) * GROUP_BYTES;
            memset(out, 0, GROUP_BYTES);
            for (int64_t j = 0; j < LP_NR && p * LP_NR + j < N; j++) {
                const uint8_t *block = blocks + ((p * LP_NR + j) * groups + g) * QBLOCK;
                memcpy(out + 2 * j, block, 2);                          /* d */
                if (QMIN) memcpy(out + 2 * LP_NR + 2 * j, block + 2, 2); /* m */
                for (int i = 0; i < QK; i++) {
                    const int q = q_block_int(block, i);
#if QBITS == 8
                    out[QSCALES + i * LP_NR + j] = (uint8_t)(int8_t)q;
#else
                    out[QSCALES + (i / 2) * LP_NR + j] |= (uint8_t)(i & 1 ? q << 4 : q);
#endif
                }
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
#define Q_AND15(v) _mm512_and_si512(v, _mm512_set1_epi32(15))
#define Q_SHR4(v) _mm512_srli_epi32(v, 4)
#define Q_SUB8(v) _mm512_sub_epi32(v, _mm512_set1_epi32(8))
#define Q_FLOAT(v) _mm512_cvtepi32_ps(v)
#define Q_MUL _mm512_mul_ps
#define Q_ADD _mm512_add_ps
#else
#define Q_HALVES(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define Q_BYTES(p) _mm_loadl_epi64((const __m128i *)(p))
#define Q_I8(b) _mm256_cvtepi8_epi32(b)
#define Q_U8(b) _mm256_cvtepu8_epi32(b)
#define Q_AND15(v) _mm256_and_si256(v, _mm256_set1_epi32(15))
#define Q_SHR4(v) _mm256_srli_epi32(v, 4)
#define Q_SUB8(v) _mm256_sub_epi32(v, _mm256_set1_epi32(8))
#define Q_FLOAT(v) _mm256_cvtepi32_ps(v)
#define Q_MUL _mm256_mul_ps
#define Q_ADD _mm256_add_ps
#endif
/* Vector c of a group's stored bytes for k = 32 g + kk (8-bit) or for kk and kk + 1 (4-bit: both nibbles),
 * widened to 32-bit lanes once; Q_INTS takes k's integers from them (HIGH: kk odd, 4-bit). */
#if QBITS == 8
#define Q_RAW(vals, kk, c) Q_I8(Q_BYTES((vals) + (kk) * LP_NR + (c) * LP_VW))
#define Q_INTS(raw, HIGH) (raw)
#else
#define Q_RAW(vals, kk, c) Q_U8(Q_BYTES((vals) + (kk) / 2 * LP_NR + (c) * LP_VW))
#if QMIN
#define Q_INTS(raw, HIGH) ((HIGH) ? Q_SHR4(raw) : Q_AND15(raw))
#else
#define Q_INTS(raw, HIGH) Q_SUB8((HIGH) ? Q_SHR4(raw) : Q_AND15(raw))
#endif
#endif
/* The dequantized weights, as q_panel_at gives them one by one: d and m are vectors of the group's scales */
#if QMIN
#define Q_WEIGHTS(raw, HIGH, d, m) Q_ADD(Q_MUL(Q_FLOAT(Q_INTS(raw, HIGH)), d), m)
#else
#define Q_WEIGHTS(raw, HIGH, d, m) Q_MUL(Q_FLOAT(Q_INTS(raw, HIGH)), d)
#endif
#endif

#endif
