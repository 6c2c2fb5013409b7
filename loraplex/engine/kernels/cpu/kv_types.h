/* The KV cache's element types (engine/kv/kv_dtype.py) and how the kernels read them as fp32.
 *
 * Semantics: a cache row (one token, one kv head) is D elements of the type: fp32, bf16 or fp16 values
 * as they are; for int8 and fp8 (e4m3), D 8-bit values and then the 4 bytes of an fp32 scale s (the row
 * is D + 4 bytes), value = q * s. An fp8 byte is read through fp16 (bits (b & 0x80) << 8 | (b & 0x7F) << 7,
 * exact, and 2^-8 times its value): lp_kv_unit gives the factor that undoes it (256; 1 for the others).
 * Loads return those values unscaled (the caller applies s * lp_kv_unit once per row).
 */
#ifndef LORAPLEX_CPU_KV_TYPES_H
#define LORAPLEX_CPU_KV_TYPES_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "lora_weights.h"

#define LP_KV_F32 LP_W_F32
#define LP_KV_BF16 LP_W_BF16
#define LP_KV_F16 LP_W_F16
#define LP_KV_I8 3
#define LP_KV_FP8 4
#define LP_KV_SCALE_BYTES 4

static inline int lp_kv_valid(int64_t kt) { return kt >= LP_KV_F32 && kt <= LP_KV_FP8; }
static inline int lp_kv_scaled(int kt) { return kt == LP_KV_I8 || kt == LP_KV_FP8; }
static inline int64_t lp_kv_elem_bytes(int kt) { return kt == LP_KV_F32 ? 4 : kt <= LP_KV_F16 ? 2 : 1; }
/* Bytes of one cache row of D values. */
static inline int64_t lp_kv_row_bytes(int kt, int64_t D) {
    return lp_kv_scaled(kt) ? D + LP_KV_SCALE_BYTES : D * lp_kv_elem_bytes(kt);
}
static inline float lp_kv_unit(int kt) { return kt == LP_KV_FP8 ? 256.0f : 1.0f; }

/* A row's scale (8-bit types; 1 for the others), times lp_kv_unit. */
static inline float lp_kv_row_scale(const char *row, int64_t D, int kt) {
    if (!lp_kv_scaled(kt)) return 1.0f;
    float s;
    memcpy(&s, row + D, sizeof s);
    return s * lp_kv_unit(kt);
}

static inline uint16_t lp_fp8_to_f16_bits(uint8_t b) { return (uint16_t)(((b & 0x80) << 8) | ((b & 0x7F) << 7)); }

/* Element i of a row, unscaled (see the Semantics). */
static inline float lp_kv_get(const char *row, int64_t i, int kt) {
    switch (kt) {
        case LP_KV_F32: { float f; memcpy(&f, row + 4 * i, 4); return f; }
        case LP_KV_BF16: { uint16_t b; memcpy(&b, row + 2 * i, 2); return lp_bf16_to_f32(b); }
        case LP_KV_F16: { uint16_t b; memcpy(&b, row + 2 * i, 2); return lp_f16_to_f32(b); }
        case LP_KV_I8: return (float)(int8_t)row[i];
        default: return lp_f16_to_f32(lp_fp8_to_f16_bits((uint8_t)row[i]));
    }
}

#if defined(__AVX2__) && defined(__F16C__)
/* Elements i .. i+7 of a row, unscaled. */
static inline __m256 lp_kv_load8(const char *row, int64_t i, int kt) {
    switch (kt) {
        case LP_KV_F32: return _mm256_loadu_ps((const float *)row + i);
        case LP_KV_BF16:
            return _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * i))), 16));
        case LP_KV_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * i)));
        case LP_KV_I8: return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + i))));
        default: { /* (b sign-extended to 16 bits, << 7: the sign in bits 15 and 14; clear 14 and 0-6) */
            const __m128i w = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(row + i))), 7);
            return _mm256_cvtph_ps(_mm_and_si128(w, _mm_set1_epi16((short)0xBF80)));
        }
    }
}

/* Elements i .. i+n-1 (n < 8) of a row, unscaled, zero in the other lanes (reads nothing past them). */
static inline __m256 lp_kv_load_tail(const char *row, int64_t i, int64_t n, int kt) {
    char buf[32] = {0};
    const int64_t eb = lp_kv_elem_bytes(kt);
    memcpy(buf, row + i * eb, (size_t)(n * eb));
    return lp_kv_load8(buf, 0, kt);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
/* Elements i .. i+15 of a row, unscaled, lanes outside m zero (and not read). */
static inline __m512 lp_kv_load16(const char *row, int64_t i, __mmask16 m, int kt) {
    switch (kt) {
        case LP_KV_F32: return _mm512_maskz_loadu_ps(m, (const float *)row + i);
        case LP_KV_BF16:
            return _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, row + 2 * i)), 16));
        case LP_KV_F16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, row + 2 * i));
        case LP_KV_I8: return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, row + i)));
        default: {
            const __m256i w = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_maskz_loadu_epi8(m, row + i)), 7);
            return _mm512_cvtph_ps(_mm256_and_si256(w, _mm256_set1_epi16((short)0xBF80)));
        }
    }
}
#endif

/* fp32 to fp8 e4m3 (finite, |f| <= 448), rounded to nearest even: what torch's .to(torch.float8_e4m3fn)
 * gives for such values. */
static inline uint8_t lp_f32_to_fp8(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    u &= 0x7FFFFFFFu;
    float a;
    memcpy(&a, &u, sizeof a);
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.0f); /* below 2^-6: units of 2^-9 */
    u += 0x7FFFFu + ((u >> 20) & 1); /* 23 mantissa bits to 3, to nearest even */
    const uint32_t bits = (((u >> 23) - 120) << 3) | ((u >> 20) & 7);
    return sign | (uint8_t)(bits > 0x7E ? 0x7E : bits);
}

#endif
