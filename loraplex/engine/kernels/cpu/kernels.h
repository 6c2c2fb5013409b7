/* What the kernels of this directory call across files (the fused decode step calls the others). */
#ifndef LORAPLEX_CPU_KERNELS_H
#define LORAPLEX_CPU_KERNELS_H
#include <stdint.h>

#include "lora_weights.h"

/* Memory a GEMM asks for while it runs, for the kernel after it (linear.c, side prefetch): `n` spans,
 * each int64 (address, rows, row stride in bytes, bytes per row), a row being ceil(bytes / 64) 64-byte
 * lines from its start. */
typedef struct {
    const int64_t *spans;
    int64_t n;
} lp_side_t;

/* Packed GEMM panels hold LP_NR output columns (linear.c's layout): three vectors of LP_VW floats,
 * the build's vector width (lp_panel_columns tells the Python side). */
#if defined(__AVX512F__)
#define LP_VW 16
#else
#define LP_VW 8
#endif
#define LP_NR (3 * LP_VW)

/* One adapter's LoRA folded into a packed GEMM (linear.c, lp_linear_fold_f32): its A as extra panels
 * whose outputs (the shrink, y) feed an extension of each output panel's reduction (the expand).
 * lora_fold.c packs them: ap [pa, K, aw] holds A's live rows (S slices of `rank` rows, in slice
 * order: row i = s * rank + r), zero beyond S * rank, in panels of aw = lp_fold_width(S, rank) columns
 * (pa = lp_fold_panels); bp holds, per output panel p in order,
 * [len_p, LP_NR] with len_p, e0_p from lp_fold_ext: bp_p[e, j] = B[p * LP_NR + j, r] where column
 * p * LP_NR + j lies in slice s and e0_p + e = s * rank + r, else 0. */
typedef struct {
    const float *ap, *bp;
    int64_t pa, rank, S;
    const int64_t *widths; /* S slice widths (their sum is the GEMM's N) */
    float *y;              /* scratch [M, pa * LP_NR]: the shrink */
    const uint8_t *keep;   /* rows the adapter applies to (others get no delta); NULL = all */
} lp_fold_t;

/* The y columns output panel p (of a GEMM with N outputs) reads: the rank-blocks of the slices its
 * columns lie in. Returns their count len_p and sets *e0 to the first. */
int64_t lp_fold_ext(const int64_t *widths, int64_t S, int64_t rank, int64_t N, int64_t p, int64_t *e0);

/* Floats of one module's fold block (ap, then bp) for an adapter of this rank (lora_fold.c). */
int64_t lp_fold_module_floats(int64_t K, int64_t N, int64_t S, const int64_t *widths, int64_t rank);
int64_t lp_lora_fold_floats(const int64_t *tab, const int64_t *ins, int64_t layers, int64_t rank);

/* The LoRA table (decode_step.py's DecodeStepLora): slots, r_max, ranks, the buffers' element type
 * (LP_W_*, lora_weights.h), then per fused module (qkv, o, gate_up, down) its slice count and up to
 * LP_LORA_WIDTHS widths, then per layer and module the A [slots, S * r_max, in] and rank-major
 * B [slots, r_max, out] buffers (lora.c's layout). */
enum { LP_LORA_MODULES = 4, LP_LORA_WIDTHS = 4 };
enum { LP_R_SLOTS, LP_R_RMAX, LP_R_RANKS, LP_R_WTYPE, LP_R_MODULES,
       LP_LORA_HEADER = LP_R_MODULES + LP_LORA_MODULES * (1 + LP_LORA_WIDTHS) };

/* Fused module m's entry in the LoRA table: its slice count, then its widths. */
static inline const int64_t *lp_lora_module(const int64_t *tab, int64_t m) {
    return tab + LP_R_MODULES + m * (1 + LP_LORA_WIDTHS);
}

/* A module's output features: the sum of its slices' widths. */
static inline int64_t lp_lora_module_out(const int64_t *mod) {
    int64_t N = 0;
    for (int64_t s = 0; s < mod[0] && s < LP_LORA_WIDTHS; s++) N += mod[1 + s];
    return N;
}

/* A fold's shrink panel width over S slices of `rank` rows: whole vectors, at most LP_NR (so a rank-16
 * adapter's o and down shrink read one vector-wide panel, not a panel two thirds padding). */
static inline int64_t lp_fold_width(int64_t S, int64_t rank) {
    const int64_t w = (S * rank + LP_VW - 1) / LP_VW * LP_VW;
    return w < LP_NR ? w : LP_NR;
}

/* A fold's shrink panels over S slices of `rank` rows. */
static inline int64_t lp_fold_panels(int64_t S, int64_t rank) {
    return (S * rank + lp_fold_width(S, rank) - 1) / lp_fold_width(S, rank);
}

/* Floats of a fold's shrink panels (ap) over K input features: where its bp starts. */
static inline int64_t lp_fold_shrink_floats(int64_t K, int64_t S, int64_t rank) {
    return lp_fold_panels(S, rank) * K * lp_fold_width(S, rank);
}

int64_t lp_panel_columns(void);
int64_t lp_fold_shrink_width(int64_t S, int64_t rank); /* lp_fold_width, for the Python side */
/* linear.c's GEMMs over packed panels of element type WT (suffix T): linear.c itself for fp32 (f32),
 * linear_bf16.c for bf16 bits (bf16), linear_q*.c for GGUF's block formats (bytes). */
#define LP_LINEAR_DECLS(T, WT)                                                                               \
    int lp_linear_packed_##T(const float *x, int64_t M, int64_t lda, int64_t K, const WT *wp, int64_t N,      \
                             const float *bias, float *y);                                                   \
    int lp_linear_packed_side_##T(const float *x, int64_t M, int64_t lda, int64_t K, const WT *wp, int64_t N, \
                                  const float *bias, float *y, const lp_side_t *side);                       \
    int lp_linear_fold_##T(const float *x, int64_t M, int64_t lda, int64_t K, const WT *wp, int64_t N,        \
                           const float *bias, float *y, const lp_side_t *side, const lp_fold_t *fold);
LP_LINEAR_DECLS(f32, float)
LP_LINEAR_DECLS(bf16, uint16_t)
LP_LINEAR_DECLS(q8_0, uint8_t) /* linear_q8_0.c ... linear_q6_k.c: GGUF blocks (quant_blocks.h) */
LP_LINEAR_DECLS(q4_0, uint8_t)
LP_LINEAR_DECLS(q4_1, uint8_t)
LP_LINEAR_DECLS(q4_k, uint8_t)
LP_LINEAR_DECLS(q5_k, uint8_t)
LP_LINEAR_DECLS(q6_k, uint8_t)
/* ... over int8 activations (linear_act8.h): lp_linear_packed_a8_<fmt>, lp_linear_packed_side_a8_<fmt>, ... */
LP_LINEAR_DECLS(a8_q8_0, uint8_t)
LP_LINEAR_DECLS(a8_q4_0, uint8_t)
LP_LINEAR_DECLS(a8_q4_1, uint8_t)
LP_LINEAR_DECLS(a8_q4_k, uint8_t)
LP_LINEAR_DECLS(a8_q5_k, uint8_t)
LP_LINEAR_DECLS(a8_q6_k, uint8_t)
/* A fold's shrink (its fp32 panels) by thread t of nt, which every build of linear.c runs first. */
void lp_linear_fold_shrink(const float *x, int64_t M, int64_t lda, int64_t K, const lp_fold_t *fold, int64_t t,
                           int64_t nt);
void lp_add_rms_norm_f32(float *h, const float *delta, const float *w, int64_t T, int64_t H, float eps, float *out);
void lp_rope_f32(float *x, int64_t T, int64_t stride, int64_t n_heads, int64_t D, const int64_t *pos,
                 const float *cos_t, const float *sin_t);
void lp_silu_mul_f32(const float *gu, int64_t T, int64_t I, float *out);
/* decode_attention.c: K/V rows of kv_type (kv_types.h, LP_KV_*) */
int lp_decode_attention_f32(const float *q, int64_t q_stride, const void *k, const void *v, int64_t kv_type,
                            const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t B,
                            int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, float *out);
void lp_kv_store(void *dst, const float *x, int64_t KVH, int64_t D, int64_t kv_type);
int lp_lora_f32_packed(const int64_t *p);  /* lora.c, fp32 slot buffers */
int lp_lora_bf16_packed(const int64_t *p); /* lora_bf16.c */
int lp_lora_f16_packed(const int64_t *p);  /* lora_f16.c */

#endif
