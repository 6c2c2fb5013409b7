/* decode_attention.c's chunk loop for 16- and 8-bit rows in AVX-512 builds (included there only: it uses that file's ATT_CHUNK,
 * ALWAYS_INLINE and att_softmax).
 *
 * Why its own loop: the AVX2 one widens a K or V row once per query head, so a GQA group of 3 widens every row
 * three times, and that, not the cache's bytes, bounds an 8-bit cache. Here the query heads of a kv head go in
 * sub-groups of up to ATT_SUB: each K row is widened (lp_kv_load16) once and multiplied into every head's
 * score, each V row widened once and added into every head's acc (ATT_SUB x 64 floats held in registers).
 * The math is the AVX2 loop's: fp32 products and sums (in another order), the row's scale on the score
 * and on the softmax weight.
 */
#ifndef LORAPLEX_CPU_DECODE_ATTENTION_AVX512_H
#define LORAPLEX_CPU_DECODE_ATTENTION_AVX512_H

#define ATT_SUB 4 /* query heads that share one widening of a row: their V accs fill 16 of the 32 registers */

/* Lane i: the sum of row i of v [16][16] (64-byte aligned), by one transpose-and-add tree. */
ALWAYS_INLINE __m512 att_hsum16x16(const float *v) {
    __m512 t[8], u[4], w[2];
    for (int k = 0; k < 8; k++) { /* each 128-bit lane: rows 2k, 2k+1, 2k, 2k+1 */
        const __m512 a = _mm512_load_ps(v + 32 * k), b = _mm512_load_ps(v + 32 * k + 16);
        t[k] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    for (int k = 0; k < 4; k++) /* each 128-bit lane: rows 4k .. 4k+3 */
        u[k] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0xEE));
    for (int k = 0; k < 2; k++) /* 128-bit lanes: rows 8k .. 8k+3 twice, then 8k+4 .. 8k+7 twice */
        w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

/* s[r * ATT_CHUNK + p] = q[r] . K row kp[p] + off (unscaled values of kt) for NH heads (q: [NH, D], heads D
 * apart) and p < n16 (a multiple of 16): a row's 16-value pieces loaded once for all NH heads. */
ALWAYS_INLINE void att_scores16(const float *q, int NH, int64_t D, const char *const *kp, int64_t off, int64_t n16,
                                float *s, int kt) {
    float part[ATT_SUB * 256] __attribute__((aligned(64))); /* [head][slot][16 partial sums] */
    const int64_t Dv = D & ~(int64_t)15;
    const __mmask16 tail = (__mmask16)((1u << (D & 15)) - 1);
    for (int64_t p0 = 0; p0 < n16; p0 += 16) {
        for (int i = 0; i < 16; i++) {
            const char *row = kp[p0 + i] + off;
            __m512 a[ATT_SUB];
            for (int r = 0; r < NH; r++) a[r] = _mm512_setzero_ps();
            for (int64_t d = 0; d < Dv; d += 16) {
                const __m512 x = lp_kv_load16(row, d, 0xFFFF, kt);
                for (int r = 0; r < NH; r++) a[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * D + d), x, a[r]);
            }
            if (tail) {
                const __m512 x = lp_kv_load16(row, Dv, tail, kt);
                for (int r = 0; r < NH; r++)
                    a[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, q + r * D + Dv), x, a[r]);
            }
            for (int r = 0; r < NH; r++) _mm512_store_ps(part + r * 256 + i * 16, a[r]);
        }
        for (int r = 0; r < NH; r++) _mm512_storeu_ps(s + r * ATT_CHUNK + p0, att_hsum16x16(part + r * 256));
    }
}

/* acc[r, d0 .. d0+63] += sum_p w[r * ATT_CHUNK + p] * V row vp[p] + off (values of kt) for NH heads, p < np,
 * lanes past D masked (mk[i]: vector i's lanes, FULL: all of them, a constant). */
ALWAYS_INLINE void att_values64(const float *w, int NH, int64_t D, int64_t d0, const __mmask16 *mk, int full,
                                const char *const *vp, int64_t off, int64_t np, float *acc, int kt) {
    __m512 c[ATT_SUB][4];
    for (int r = 0; r < NH; r++)
        for (int i = 0; i < 4; i++) c[r][i] = _mm512_maskz_loadu_ps(full ? 0xFFFF : mk[i], acc + r * D + d0 + 16 * i);
    for (int64_t p = 0; p < np; p++) {
        const char *row = vp[p] + off;
        for (int i = 0; i < 4; i++) {
            const __m512 x = lp_kv_load16(row, d0 + 16 * i, full ? 0xFFFF : mk[i], kt);
            for (int r = 0; r < NH; r++) c[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(w[r * ATT_CHUNK + p]), x, c[r][i]);
        }
    }
    for (int r = 0; r < NH; r++)
        for (int i = 0; i < 4; i++) _mm512_mask_storeu_ps(acc + r * D + d0 + 16 * i, full ? 0xFFFF : mk[i], c[r][i]);
}

/* One chunk for a sub-group of NH heads of one kv head: scores, scaled (ks: 8-bit rows' score factors) and
 * -inf past np, an online-softmax step per head, then the weighted V rows. */
ALWAYS_INLINE void att_sub_chunk(const float *q, int NH, int64_t D, float scale, const char *const *kp,
                                 const char *const *vp, int64_t off, int64_t np, const float *ks, const float *vs,
                                 float *s, float *acc, float *m, float *l, int kt) {
    const int64_t n16 = (np + 15) / 16 * 16;
    att_scores16(q, NH, D, kp, off, n16, s, kt);
    for (int r = 0; r < NH; r++)
        for (int64_t p = 0; p < n16; p += 16) {
            const __m512 f = lp_kv_scaled(kt) ? _mm512_loadu_ps(ks + p) : _mm512_set1_ps(scale);
            const __mmask16 valid = np - p >= 16 ? 0xFFFF : (__mmask16)((1u << (np - p)) - 1);
            float *sp = s + r * ATT_CHUNK + p;
            _mm512_storeu_ps(sp, _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid, _mm512_loadu_ps(sp), f));
        }
    for (int r = 0; r < NH; r++) att_softmax(s + r * ATT_CHUNK, np, acc + r * D, D, m + r, l + r, lp_kv_scaled(kt) ? vs : 0);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        __mmask16 mk[4];
        for (int i = 0; i < 4; i++) {
            const int64_t n = D - d0 - 16 * i;
            mk[i] = n >= 16 ? 0xFFFF : n > 0 ? (__mmask16)((1u << n) - 1) : 0;
        }
        if (D - d0 >= 64)
            att_values64(s, NH, D, d0, mk, 1, vp, off, np, acc, kt);
        else
            att_values64(s, NH, D, d0, mk, 0, vp, off, np, acc, kt);
    }
}

/* One chunk for nh heads of one kv head (as the AVX2 att_chunk_t; slots repeat a real one up to a multiple of
 * 16), in sub-groups of ATT_SUB heads, each compiled for its size. */
ALWAYS_INLINE void att_chunk16_t(const float *q, int64_t nh, int64_t D, float scale, const char *const *kp,
                               const char *const *vp, int64_t off, int64_t np, float *s, float *acc, float *m,
                               float *l, int kt) {
    const int64_t n16 = (np + 15) / 16 * 16;
    float ks[ATT_CHUNK], vs[ATT_CHUNK]; /* 8-bit rows: each slot's score factor and V scale */
    if (lp_kv_scaled(kt)) row_scales(kp, vp, off, n16, D, kt, scale, ks, vs);
    for (int64_t h = 0; h < nh; h += ATT_SUB) {
        const float *qh = q + h * D;
        float *ah = acc + h * D, *mh = m + h, *lh = l + h;
        switch (nh - h < ATT_SUB ? nh - h : ATT_SUB) {
            case 1: att_sub_chunk(qh, 1, D, scale, kp, vp, off, np, ks, vs, s, ah, mh, lh, kt); break;
            case 2: att_sub_chunk(qh, 2, D, scale, kp, vp, off, np, ks, vs, s, ah, mh, lh, kt); break;
            case 3: att_sub_chunk(qh, 3, D, scale, kp, vp, off, np, ks, vs, s, ah, mh, lh, kt); break;
            default: att_sub_chunk(qh, 4, D, scale, kp, vp, off, np, ks, vs, s, ah, mh, lh, kt); break;
        }
    }
}

#endif
