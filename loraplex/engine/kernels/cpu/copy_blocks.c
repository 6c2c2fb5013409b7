/* Many strided 2-d block copies (scaled, or zero fills) in one call, from fp32 into fp32, bf16 or fp16
 * (lora_weights.h): an adapter's load into its slot.
 *
 * Semantics: table holds n entries of BLOCK_FIELDS int64 (src, dst, rows, cols, src_ld, dst_ld,
 * scale_bits, src_cs); pointers as integers, strides in elements, scale_bits a double's bits. For each entry:
 *     dst[i * dst_ld + j] = src ? round(scale * src[i * src_ld + j * src_cs]) : 0      i < rows, j < cols
 * (the product in fp32, rounded once to the destination's type, to nearest even, as torch's .to() does;
 * src_cs 1: rows of src are dense; src_ld 1 and src_cs > 1: src is read transposed, as a PEFT B
 * [out, rank] goes into the slot buffers' rank-major rows). Entries must not overlap each other's dst
 * (they run in parallel, in no set order).
 *
 * Why: writing a rank-16 adapter of a 30-layer model into the stacked slot buffers is 420 small copies
 * (A rows, scaled B columns) plus the zeroing of rank padding; as torch ops each pays Python dispatch
 * and runs on one core. One call spreads the ~20 MB over the threads, at memory speed, and the load
 * sits on a waiting request's path.
 */
#include <stdint.h>
#include <string.h>

#include "lora_weights.h"
#include "transpose8.h"

enum { B_SRC, B_DST, B_ROWS, B_COLS, B_SRC_LD, B_DST_LD, B_SCALE, B_SRC_CS, BLOCK_FIELDS };

/* Columns of a strided source read per pass: their source lines (64 of them) stay in L1 while every
 * row of the block takes its part. */
#define STRIDED_COLS 64

/* Below this many floats in all, one thread. */
#define PARALLEL_MIN_FLOATS (256 * 1024)

static void copy_block(const int64_t *e, int64_t wtype) {
    const float *src = (const float *)(intptr_t)e[B_SRC];
    void *dst = (void *)(intptr_t)e[B_DST];
    const int64_t rows = e[B_ROWS], cols = e[B_COLS], sld = e[B_SRC_LD], dld = e[B_DST_LD], scs = e[B_SRC_CS];
    double scale_d;
    memcpy(&scale_d, e + B_SCALE, sizeof scale_d);
    const float scale = (float)scale_d;
    if (src && scs != 1) { /* a strided (transposed) source, a band of columns at a time */
#if defined(__AVX2__) && defined(__F16C__)
        if (sld == 1 && rows % 8 == 0 && scs % 8 == 0 && cols >= 8) { /* 8x8 tiles through registers */
            const __m256 sv = _mm256_set1_ps(scale);
            for (int64_t j0 = 0; j0 < cols; j0 += 8) {
                const int64_t j = j0 + 8 <= cols ? j0 : cols - 8; /* the last tile overlaps: same values */
                for (int64_t i = 0; i < rows; i += 8) {
                    __m256 r[8];
                    for (int k = 0; k < 8; k++) r[k] = _mm256_loadu_ps(src + (j + k) * scs + i);
                    transpose8x8(r); /* r[k] = src column i + k over rows j .. j+7 */
                    for (int k = 0; k < 8; k++) lp_weight_store8(dst, (i + k) * dld + j, wtype, _mm256_mul_ps(sv, r[k]));
                }
            }
            return;
        }
#endif
        for (int64_t j0 = 0; j0 < cols; j0 += STRIDED_COLS) {
            const int64_t j1 = j0 + STRIDED_COLS < cols ? j0 + STRIDED_COLS : cols;
            for (int64_t i = 0; i < rows; i++) {
                const float *s = src + i * sld;
                for (int64_t j = j0; j < j1; j++) lp_weight_store(dst, i * dld + j, wtype, scale * s[j * scs]);
            }
        }
        return;
    }
    const int64_t wb = lp_weight_bytes(wtype);
    for (int64_t i = 0; i < rows; i++) {
        if (!src) {
            memset((char *)dst + i * dld * wb, 0, (size_t)(wb * cols));
        } else if (scale == 1.0f && wtype == LP_W_F32) {
            memcpy((float *)dst + i * dld, src + i * sld, sizeof(float) * cols);
        } else {
            const float *s = src + i * sld;
            int64_t j = 0;
#if defined(__AVX2__) && defined(__F16C__)
            const __m256 sv = _mm256_set1_ps(scale);
            for (; j + 8 <= cols; j += 8) lp_weight_store8(dst, i * dld + j, wtype, _mm256_mul_ps(sv, _mm256_loadu_ps(s + j)));
#endif
            for (; j < cols; j++) lp_weight_store(dst, i * dld + j, wtype, scale * s[j]);
        }
    }
}

/* Returns 0, or -1 (nothing written) when an entry has negative sizes, a column stride below 1, or rows
 * that overlap (a row stride shorter than the row), or the destination type is unknown. */
int lp_copy_blocks_to(const int64_t *table, int64_t n, int64_t wtype) {
    if (wtype != LP_W_F32 && wtype != LP_W_BF16 && wtype != LP_W_F16) return -1;
    int64_t floats = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t *e = table + i * BLOCK_FIELDS;
        if (e[B_ROWS] < 0 || e[B_COLS] < 0 || e[B_SRC_CS] < 1) return -1;
        if (e[B_ROWS] > 1 && (e[B_DST_LD] < e[B_COLS] || (e[B_SRC] && e[B_SRC_CS] == 1 && e[B_SRC_LD] < e[B_COLS])))
            return -1;
        floats += e[B_ROWS] * e[B_COLS];
    }
#pragma omp parallel for schedule(dynamic, 8) if (floats >= PARALLEL_MIN_FLOATS)
    for (int64_t i = 0; i < n; i++) copy_block(table + i * BLOCK_FIELDS, wtype);
    return 0;
}
