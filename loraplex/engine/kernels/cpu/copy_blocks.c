/* Many strided 2-d block copies (scaled, or zero fills) in one call, fp32: an adapter's load into its slot.
 *
 * Semantics: table holds n entries of BLOCK_FIELDS int64 (src, dst, rows, cols, src_ld, dst_ld,
 * scale_bits); pointers as integers, lds in floats, scale_bits a double's bits. For each entry:
 *     dst[i * dst_ld + j] = src ? scale * src[i * src_ld + j] : 0        i < rows, j < cols
 * Entries must not overlap each other's dst (they run in parallel, in no set order).
 *
 * Why: writing a rank-16 adapter of a 30-layer model into the stacked slot buffers is 420 small copies
 * (A rows, scaled B columns) plus the zeroing of rank padding; as torch ops each pays Python dispatch
 * and runs on one core. One call spreads the ~20 MB over the threads, at memory speed, and the load
 * sits on a waiting request's path.
 */
#include <stdint.h>
#include <string.h>

enum { B_SRC, B_DST, B_ROWS, B_COLS, B_SRC_LD, B_DST_LD, B_SCALE, BLOCK_FIELDS };

/* Below this many floats in all, one thread. */
#define PARALLEL_MIN_FLOATS (256 * 1024)

static void copy_block(const int64_t *e) {
    const float *src = (const float *)(intptr_t)e[B_SRC];
    float *dst = (float *)(intptr_t)e[B_DST];
    const int64_t rows = e[B_ROWS], cols = e[B_COLS], sld = e[B_SRC_LD], dld = e[B_DST_LD];
    double scale_d;
    memcpy(&scale_d, e + B_SCALE, sizeof scale_d);
    const float scale = (float)scale_d;
    for (int64_t i = 0; i < rows; i++) {
        float *d = dst + i * dld;
        if (!src) {
            memset(d, 0, sizeof(float) * cols);
        } else if (scale == 1.0f) {
            memcpy(d, src + i * sld, sizeof(float) * cols);
        } else {
            const float *s = src + i * sld;
            for (int64_t j = 0; j < cols; j++) d[j] = scale * s[j];
        }
    }
}

/* Returns 0, or -1 (nothing written) when an entry has negative sizes or rows that overlap (a row stride
 * shorter than the row). */
int lp_copy_blocks_f32(const int64_t *table, int64_t n) {
    int64_t floats = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t *e = table + i * BLOCK_FIELDS;
        if (e[B_ROWS] < 0 || e[B_COLS] < 0) return -1;
        if (e[B_ROWS] > 1 && (e[B_DST_LD] < e[B_COLS] || (e[B_SRC] && e[B_SRC_LD] < e[B_COLS]))) return -1;
        floats += e[B_ROWS] * e[B_COLS];
    }
#pragma omp parallel for schedule(dynamic, 8) if (floats >= PARALLEL_MIN_FLOATS)
    for (int64_t i = 0; i < n; i++) copy_block(table + i * BLOCK_FIELDS);
    return 0;
}
