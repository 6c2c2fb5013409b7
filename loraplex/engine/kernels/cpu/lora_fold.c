/* One adapter's LoRA weights packed for folding into the base GEMMs (linear.c, lp_linear_fold_f32).
 *
 * Semantics: for a slot of the LoRA table (kernels.h) holding an adapter of rank rk = ranks[slot]
 * (1 <= rk <= r_max), lp_lora_fold_pack writes, for each layer l and fused module m in order
 * (qkv, o, gate_up, down), with K = ins[m], N and the S slice widths w_s of m, off_s = w_0 + .. + w_{s-1}:
 *     ap [pa, K, aw], aw = min(NR, S * rk rounded up to whole vectors of LP_VW), pa = ceil(S * rk / aw):
 *         ap[q, k, j] = A[slot, s * r_max + r, k]  (q * aw + j = s * rk + r), 0 beyond S * rk rows
 *     bp, per output panel p < ceil(N / NR), [len_p, NR] (len_p, e0_p: lp_fold_ext):
 *         bp_p[e, j] = B[slot, r, n]  where n = p * NR + j < N lies in slice s and e0_p + e = s * rk + r,
 *                      0 elsewhere
 * so that a GEMM over x with the fold gives x @ W^T + (x @ A_s^T) @ B_s^T for each slice: the
 * adapter's delta at the GEMM's rate.
 *
 * B is the slot buffers' rank-major [slots, r_max, N] (lora.c's layout). 16-bit buffers (the table's
 * LP_R_WTYPE) are widened to fp32 here: the packed copy is always fp32.
 *
 * Why a separate copy: the slot buffers keep lora.c's layout (padded to r_max, read by every adapter
 * of a mixed batch); the packed copy is made only for an adapter that holds most of a
 * step's tokens (engine/lora/slots.py), once per load.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define NR LP_NR

int64_t lp_fold_module_floats(int64_t K, int64_t N, int64_t S, const int64_t *widths, int64_t rank) {
    int64_t floats = lp_fold_shrink_floats(K, S, rank), e0;
    for (int64_t p = 0; p < (N + NR - 1) / NR; p++) floats += lp_fold_ext(widths, S, rank, N, p, &e0) * NR;
    return floats;
}

/* Where each module's block starts within a layer's (off[LP_LORA_MODULES]: the layer's floats). */
static void module_offsets(const int64_t *tab, const int64_t *ins, int64_t rank, int64_t *off) {
    off[0] = 0;
    for (int64_t m = 0; m < LP_LORA_MODULES; m++) {
        const int64_t *mod = lp_lora_module(tab, m);
        off[m + 1] = off[m] + lp_fold_module_floats(ins[m], lp_lora_module_out(mod), mod[0], mod + 1, rank);
    }
}

/* Floats of a slot's whole fold block: every layer's four modules. */
int64_t lp_lora_fold_floats(const int64_t *tab, const int64_t *ins, int64_t layers, int64_t rank) {
    int64_t off[LP_LORA_MODULES + 1];
    module_offsets(tab, ins, rank, off);
    return off[LP_LORA_MODULES] * layers;
}

static void pack_module(const void *A, const void *B, int64_t wtype, int64_t K, int64_t N, int64_t S,
                        const int64_t *widths, int64_t r_max, int64_t rk, float *dst) {
    const int64_t pa = lp_fold_panels(S, rk), aw = lp_fold_width(S, rk);
    for (int64_t q = 0; q < pa; q++)
        for (int64_t j = 0; j < aw; j++) { /* one A row into column j of panel q */
            const int64_t i = q * aw + j, s = i / rk, r = i % rk;
            float *col = dst + q * K * aw + j;
            if (i < S * rk)
                for (int64_t k = 0; k < K; k++) col[k * aw] = lp_weight_at(A, (s * r_max + r) * K + k, wtype);
            else
                for (int64_t k = 0; k < K; k++) col[k * aw] = 0.0f;
        }
    float *bp = dst + lp_fold_shrink_floats(K, S, rk);
    for (int64_t p = 0; p < (N + NR - 1) / NR; p++) {
        int64_t e0, len = lp_fold_ext(widths, S, rk, N, p, &e0);
        memset(bp, 0, sizeof(float) * len * NR);
        for (int64_t j = 0, n = p * NR, s = 0, off = 0; j < NR && n < N; j++, n++) {
            while (n >= off + widths[s]) off += widths[s++];
            for (int64_t r = 0; r < rk; r++) bp[(s * rk + r - e0) * NR + j] = lp_weight_at(B, r * N + n, wtype);
        }
        bp += len * NR;
    }
}

/* Writes slot's fold block (lp_lora_fold_floats floats) to dst. Returns 0, or -1 when the slot is out
 * of range, empty, or `floats` does not match its rank, or the table's element type is unknown. */
int lp_lora_fold_pack(const int64_t *tab, const int64_t *ins, int64_t layers, int64_t slot, float *dst,
                      int64_t floats) {
    if (slot < 0 || slot >= tab[LP_R_SLOTS] || layers < 1) return -1;
    const int64_t r_max = tab[LP_R_RMAX], rk = ((const int32_t *)(intptr_t)tab[LP_R_RANKS])[slot];
    const int64_t wtype = tab[LP_R_WTYPE], wb = lp_weight_bytes(wtype);
    if (rk < 1 || rk > r_max || floats != lp_lora_fold_floats(tab, ins, layers, rk)) return -1;
    if (wtype != LP_W_F32 && wtype != LP_W_BF16 && wtype != LP_W_F16) return -1;
    int64_t module_off[LP_LORA_MODULES + 1];
    module_offsets(tab, ins, rk, module_off);
#pragma omp parallel for schedule(dynamic)
    for (int64_t lm = 0; lm < layers * LP_LORA_MODULES; lm++) {
        const int64_t l = lm / LP_LORA_MODULES, m = lm % LP_LORA_MODULES, *mod = lp_lora_module(tab, m);
        const int64_t K = ins[m], N = lp_lora_module_out(mod), S = mod[0];
        const int64_t *ab = tab + LP_LORA_HEADER + lm * 2;
        const char *A = (const char *)(intptr_t)ab[0] + slot * S * r_max * K * wb;
        const char *B = (const char *)(intptr_t)ab[1] + slot * N * r_max * wb;
        pack_module(A, B, wtype, K, N, S, mod + 1, r_max, rk, dst + l * module_off[LP_LORA_MODULES] + module_off[m]);
    }
    return 0;
}
