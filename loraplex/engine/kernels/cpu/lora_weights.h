/* The element types the LoRA slot buffers may hold, and how a kernel reads them as fp32.
 *
 * Why 16-bit slots: a decode step of many adapters reads every adapter's A and B once, at one or two
 * FMAs per weight; on the CPU that is memory traffic, not arithmetic. bf16 or fp16 slots halve it (and
 * the slots' memory) for the cost of widening each vector as it is loaded. Activations, the shrink's y
 * and every sum stay fp32.
 *
 * Semantics: a bf16 value b stands for the fp32 whose bits are b << 16 (exact); an fp16 value for its
 * IEEE binary16 value (exact in fp32, subnormals included).
 */
#ifndef LORAPLEX_CPU_LORA_WEIGHTS_H
#define LORAPLEX_CPU_LORA_WEIGHTS_H
#include <stdint.h>
#include <string.h>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* The LoRA table's element-type codes (kernels.h, LP_R_WTYPE), and lora.c's build variants
 * (macros: lora.c picks its variant with #if). */
#define LP_W_F32 0
#define LP_W_BF16 1
#define LP_W_F16 2
/* GGUF block formats: the packed projections' types only (linear.c's quantized builds, quant_blocks.h) */
#define LP_W_Q8_0 3
#define LP_W_Q4_0 4
#define LP_W_Q4_1 5
#define LP_W_Q4_K 6
#define LP_W_Q5_K 7
#define LP_W_Q6_K 8
#define LP_W_ACT8 16 /* or'ed into a block format's code: GEMMs over int8 activations (linear_act8.h) */

static inline int64_t lp_weight_bytes(int64_t wtype) { return wtype == LP_W_F32 ? 4 : 2; }

static inline float lp_bf16_to_f32(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float lp_f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else /* the IEEE binary16 fields, by hand */
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t u;
    if (exp == 0x1F) {
        u = sign | 0x7F800000u | (man << 13); /* inf, nan */
    } else if (exp) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        uint32_t m = man;
        do e++, m <<= 1; while (!(m & 0x400));
        u = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3FF) << 13);
    } else {
        u = sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* fp32 to bf16, rounded to nearest even (a NaN stays a quiet NaN): what torch's .to(torch.bfloat16) gives. */
static inline uint16_t lp_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

/* fp32 to IEEE binary16, rounded to nearest even (overflow to inf, subnormals kept). */
static inline uint16_t lp_f32_to_f16(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    x &= 0x7FFFFFFFu;
    if (x > 0x7F800000u) return sign | 0x7E00;    /* nan */
    if (x >= 0x477FF000u) return sign | 0x7C00;   /* 65520 and up (and inf) round to inf */
    if (x < 0x38800000u) {                        /* below 2^-14: a subnormal half, or zero */
        if (x < 0x33000000u) return sign;         /* at most 2^-25: rounds to zero */
        const uint32_t shift = 126 - (x >> 23), m = (x & 0x7FFFFFu) | 0x800000u; /* half units of 2^-24 */
        uint32_t h = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), tie = 1u << (shift - 1);
        h += rem > tie || (rem == tie && (h & 1));
        return sign | (uint16_t)h;
    }
    uint32_t h = (x - 0x38000000u) >> 13; /* exponent rebiased from 127 to 15, mantissa cut to 10 bits */
    const uint32_t rem = x & 0x1FFFu;
    h += rem > 0x1000u || (rem == 0x1000u && (h & 1));
    return sign | (uint16_t)h;
#endif
}

/* dst[i] = v in the buffer's element type (rounded to nearest even for 16-bit types). */
static inline void lp_weight_store(void *dst, int64_t i, int64_t wtype, float v) {
    if (wtype == LP_W_BF16)
        ((uint16_t *)dst)[i] = lp_f32_to_bf16(v);
    else if (wtype == LP_W_F16)
        ((uint16_t *)dst)[i] = lp_f32_to_f16(v);
    else
        ((float *)dst)[i] = v;
}

#if defined(__AVX2__) && defined(__F16C__)
/* dst[i .. i+7] = v, as lp_weight_store does one at a time (the same bits). */
static inline void lp_weight_store8(void *dst, int64_t i, int64_t wtype, __m256 v) {
    if (wtype == LP_W_F32) {
        _mm256_storeu_ps((float *)dst + i, v);
        return;
    }
    __m128i h;
    if (wtype == LP_W_F16) {
        h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    } else {
        const __m256i u = _mm256_castps_si256(v), hi = _mm256_srli_epi32(u, 16);
        __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(u, _mm256_add_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7FFF))),
            16);
        const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
        h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)); /* (all <= 0xFFFF) */
    }
    _mm_storeu_si128((__m128i *)((uint16_t *)dst + i), h);
}
#endif

/* Element i of a buffer of the given type, as fp32. */
static inline float lp_weight_at(const void *base, int64_t i, int64_t wtype) {
    if (wtype == LP_W_BF16) return lp_bf16_to_f32(((const uint16_t *)base)[i]);
    if (wtype == LP_W_F16) return lp_f16_to_f32(((const uint16_t *)base)[i]);
    return ((const float *)base)[i];
}

#endif
