/* What the kernels of this directory call across files (the fused decode step calls the others). */
#ifndef LORAPLEX_CPU_KERNELS_H
#define LORAPLEX_CPU_KERNELS_H
#include <stdint.h>

/* Memory a GEMM asks for while it runs, for the kernel after it (linear.c, side prefetch): `n` spans,
 * each int64 (address, rows, row stride in bytes, bytes per row), a row being ceil(bytes / 64) 64-byte
 * lines from its start. */
typedef struct {
    const int64_t *spans;
    int64_t n;
} lp_side_t;

int lp_linear_packed_f32(const float *x, int64_t M, int64_t lda, int64_t K, const float *wp, int64_t N,
                         const float *bias, float *y);
int lp_linear_packed_side_f32(const float *x, int64_t M, int64_t lda, int64_t K, const float *wp, int64_t N,
                              const float *bias, float *y, const lp_side_t *side);
void lp_add_rms_norm_f32(float *h, const float *delta, const float *w, int64_t T, int64_t H, float eps, float *out);
void lp_rope_f32(float *x, int64_t T, int64_t stride, int64_t n_heads, int64_t D, const int64_t *pos,
                 const float *cos_t, const float *sin_t);
void lp_silu_mul_f32(const float *gu, int64_t T, int64_t I, float *out);
int lp_decode_attention_f32(const float *q, int64_t q_stride, const float *k, const float *v,
                            const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t B,
                            int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, float *out);
int lp_lora_f32_packed(const int64_t *p);

#endif
