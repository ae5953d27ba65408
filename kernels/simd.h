/* simd.h: one macro layer over the AVX2 and AVX-512 intrinsics, so the kernel bodies (adam_body.h, convert_body.h) are written once and compiled per ISA. */

/*
 * Include after cossd_internal.h with exactly one of SIMD_ISA_AVX2 or
 * SIMD_ISA_AVX512 defined. It gives:
 *  - simd_f (a vector of SIMD_LANES floats), simd_h (SIMD_LANES 16-bit values),
 *    simd_mask (which lanes a masked load/store touches), simd_flag (a scalar
 *    condition as the ISA selects on it best);
 *  - SIMD_FN (static, always inlined, compiled for the ISA) and SIMD_KERNEL (an
 *    entry of the per-ISA kernel tables, compiled for the ISA);
 *  - one-to-one macros (SIMD_ADD, SIMD_FMA, SIMD_LOADF, SIMD_STREAMH...) and
 *    the composite operations as inline functions (half <-> FP32, canonical NaN).
 * SIMD_MASKED is 1 where the ISA has masked loads and stores (AVX-512): the
 * bodies then run the alignment peel and the tail as one masked vector; AVX2
 * runs them through the scalar element functions. Both give the same bits,
 * since every operation is elementwise.
 * Only intrinsics that round exactly as the scalar code does appear: F16C's
 * conversions with an immediate RNE, and integer RNE for BF16 (not
 * vcvtneps2bf16, which flushes denormals and rounds NaNs differently).
 */

#ifndef COSSD_SIMD_H
#define COSSD_SIMD_H

#if !COSSD_X86
#error "simd.h is for x86-64 builds with SIMD (see COSSD_X86 in cossd_internal.h)"
#endif

#if defined(SIMD_ISA_AVX2) == defined(SIMD_ISA_AVX512)
#error "define exactly one of SIMD_ISA_AVX2 and SIMD_ISA_AVX512 before including simd.h"
#endif

#if defined(SIMD_ISA_AVX512)
/* ---- AVX-512 F/BW/DQ/VL + F16C + FMA: 16 lanes ------------------------- */

#define SIMD_TARGET COSSD_AVX512_TARGET
#define SIMD_LANES 16
#define SIMD_BYTES 64 /* of a float vector */
#define SIMD_MASKED 1
#define SIMD_SUFFIX avx512

typedef __m512 simd_f;
typedef __m256i simd_h;
typedef __mmask16 simd_mask;
typedef __mmask16 simd_flag; /* all lanes or none */

#define SIMD_MASK_ALL ((simd_mask)0xFFFF)
#define SIMD_MASK_FIRST(count) ((simd_mask)((1u << (count)) - 1u)) /* count in 1..15 */
#define SIMD_FLAG(cond) ((cond) ? (simd_flag)0xFFFF : (simd_flag)0)

#define SIMD_SET1(x) _mm512_set1_ps(x)
#define SIMD_ADD(a, b) _mm512_add_ps(a, b)
#define SIMD_SUB(a, b) _mm512_sub_ps(a, b)
#define SIMD_MUL(a, b) _mm512_mul_ps(a, b)
#define SIMD_DIV(a, b) _mm512_div_ps(a, b)
#define SIMD_SQRT(a) _mm512_sqrt_ps(a)
#define SIMD_FMA(a, b, c) _mm512_fmadd_ps(a, b, c) /* a * b + c, one rounding */
#define SIMD_LOADF(p) _mm512_loadu_ps(p)
#define SIMD_STOREF(p, x) _mm512_storeu_ps(p, x)
#define SIMD_STREAMF(p, x) _mm512_stream_ps(p, x) /* p aligned to SIMD_BYTES */
#define SIMD_LOADH(p) _mm256_loadu_si256((const __m256i *)(const void *)(p))
#define SIMD_STOREH(p, x) _mm256_storeu_si256((__m256i *)(void *)(p), x)
#define SIMD_STREAMH(p, x) _mm256_stream_si256((__m256i *)(void *)(p), x)
#define SIMD_LOADF_MASKED(p, km) _mm512_maskz_loadu_ps(km, p) /* lanes outside km: 0, never read */
#define SIMD_STOREF_MASKED(p, x, km) _mm512_mask_storeu_ps(p, km, x)
#define SIMD_LOADH_MASKED(p, km) _mm256_maskz_loadu_epi16(km, p)
#define SIMD_STOREH_MASKED(p, x, km) _mm256_mask_storeu_epi16(p, km, x)

#define SIMD_FN static inline __attribute__((always_inline, target(SIMD_TARGET)))

SIMD_FN simd_f simd_h_to_f32(simd_h h, int fmt)
{
    if (fmt == COSSD_HALF_FP16)
        return _mm512_cvtph_ps(h); /* exact, like fp16_to_f32 (incl. NaN quieting) */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Same integer RNE as f32_to_bf16. */
SIMD_FN simd_h simd_f32_to_bf16(simd_f x)
{
    __m512i b = _mm512_castps_si512(x);
    __m512i hi = _mm512_srli_epi32(b, 16);
    __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    __mmask16 isnan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, isnan, hi, _mm512_set1_epi32(0x0040)); /* NaN: truncate, force quiet */
    return _mm512_cvtepi32_epi16(r); /* every lane <= 0xFFFF: a plain narrow */
}

SIMD_FN simd_h simd_f32_to_fp16(simd_f x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT); }

SIMD_FN simd_f simd_canon_nan(simd_f x)
{
    __mmask16 isnan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(x, isnan, _mm512_castsi512_ps(_mm512_set1_epi32((int)F32_CANONICAL_NAN)));
}

/* flag ? a : b, lane by lane */
SIMD_FN simd_f simd_pick(simd_flag flag, simd_f a, simd_f b) { return _mm512_mask_mov_ps(b, flag, a); }

/* 16 FP8 codes as FP32 (lanes outside km: code 0, never read), fp8_decode's bits: E5M2 is the
 * top byte of a binary16; an E4M3 magnitude shifted into a binary16 (exponent bias 15, not 7)
 * is its value times 2^-8, so F16C's exact conversion times 256 (exact) gives it; its NaN
 * (magnitude 0x7F) is blended in as sign | 0x7FC00000. */
SIMD_FN simd_f simd_fp8_to_f32(const uint8_t *p, int fmt, simd_mask km, int masked)
{
    __m128i codes = masked ? _mm_maskz_loadu_epi8(km, p) : _mm_loadu_si128((const __m128i *)(const void *)p);
    __m256i c16 = _mm256_cvtepu8_epi16(codes);
    if (fmt == COSSD_GRAD_FP8_E5M2)
        return _mm512_cvtph_ps(_mm256_slli_epi16(c16, 8));
    __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(c16, _mm256_set1_epi16(0x80)), 8),
                                _mm256_slli_epi16(_mm256_and_si256(c16, _mm256_set1_epi16(0x7F)), 7));
    __m512 x = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
    __m512i c32 = _mm512_cvtepu8_epi32(codes);
    __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(c32, _mm512_set1_epi32(0x7F)), _mm512_set1_epi32(0x7F));
    __m512i nan_bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(c32, _mm512_set1_epi32(0x80)), 24),
                                       _mm512_set1_epi32((int)F32_CANONICAL_NAN));
    return _mm512_mask_mov_ps(x, nan, _mm512_castsi512_ps(nan_bits));
}

#else
/* ---- AVX2 + F16C + FMA: 8 lanes ---------------------------------------- */

#define SIMD_TARGET COSSD_AVX2_TARGET
#define SIMD_LANES 8
#define SIMD_BYTES 32
#define SIMD_MASKED 0
#define SIMD_SUFFIX avx2

typedef __m256 simd_f;
typedef __m128i simd_h;
typedef unsigned simd_mask; /* no masked forms: the bodies never pass a partial mask */
typedef int simd_flag;

#define SIMD_MASK_ALL ((simd_mask)0xFF)
#define SIMD_FLAG(cond) ((cond) != 0)

#define SIMD_SET1(x) _mm256_set1_ps(x)
#define SIMD_ADD(a, b) _mm256_add_ps(a, b)
#define SIMD_SUB(a, b) _mm256_sub_ps(a, b)
#define SIMD_MUL(a, b) _mm256_mul_ps(a, b)
#define SIMD_DIV(a, b) _mm256_div_ps(a, b)
#define SIMD_SQRT(a) _mm256_sqrt_ps(a)
#define SIMD_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SIMD_LOADF(p) _mm256_loadu_ps(p)
#define SIMD_STOREF(p, x) _mm256_storeu_ps(p, x)
#define SIMD_STREAMF(p, x) _mm256_stream_ps(p, x)
#define SIMD_LOADH(p) _mm_loadu_si128((const __m128i *)(const void *)(p))
#define SIMD_STOREH(p, x) _mm_storeu_si128((__m128i *)(void *)(p), x)
#define SIMD_STREAMH(p, x) _mm_stream_si128((__m128i *)(void *)(p), x)
/* Never reached with masked != 0 (SIMD_MASKED is 0): plain forms keep the bodies compiling. */
#define SIMD_LOADF_MASKED(p, km) ((void)(km), SIMD_LOADF(p))
#define SIMD_STOREF_MASKED(p, x, km) ((void)(km), SIMD_STOREF(p, x))
#define SIMD_LOADH_MASKED(p, km) ((void)(km), SIMD_LOADH(p))
#define SIMD_STOREH_MASKED(p, x, km) ((void)(km), SIMD_STOREH(p, x))

#define SIMD_FN static inline __attribute__((always_inline, target(SIMD_TARGET)))

SIMD_FN simd_f simd_h_to_f32(simd_h h, int fmt)
{
    if (fmt == COSSD_HALF_FP16)
        return _mm256_cvtph_ps(h); /* exact, like fp16_to_f32 (incl. NaN quieting) */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

SIMD_FN simd_h simd_f32_to_bf16(simd_f x)
{
    __m256i b = _mm256_castps_si256(x);
    __m256i hi = _mm256_srli_epi32(b, 16);
    __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    __m256i qnan = _mm256_or_si256(hi, _mm256_set1_epi32(0x0040));
    __m256i isnan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, qnan, isnan);
    /* Every lane is <= 0xFFFF, so unsigned-saturating pack is a plain narrow;
     * packing the two 128-bit halves keeps element order. */
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

SIMD_FN simd_h simd_f32_to_fp16(simd_f x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT); }

SIMD_FN simd_f simd_canon_nan(simd_f x)
{
    __m256 isnan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_blendv_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32((int)F32_CANONICAL_NAN)), isnan);
}

SIMD_FN simd_f simd_pick(simd_flag flag, simd_f a, simd_f b) { return flag ? a : b; }

/* 8 FP8 codes as FP32, as the AVX-512 form above (AVX2 has no masked forms: never masked). */
SIMD_FN simd_f simd_fp8_to_f32(const uint8_t *p, int fmt, simd_mask km, int masked)
{
    (void)km;
    (void)masked;
    __m128i codes = _mm_loadl_epi64((const __m128i *)(const void *)p);
    __m128i c16 = _mm_cvtepu8_epi16(codes);
    if (fmt == COSSD_GRAD_FP8_E5M2)
        return _mm256_cvtph_ps(_mm_slli_epi16(c16, 8));
    __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(c16, _mm_set1_epi16(0x80)), 8),
                             _mm_slli_epi16(_mm_and_si128(c16, _mm_set1_epi16(0x7F)), 7));
    __m256 x = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
    __m256i c32 = _mm256_cvtepu8_epi32(codes);
    __m256i nan = _mm256_cmpeq_epi32(_mm256_and_si256(c32, _mm256_set1_epi32(0x7F)), _mm256_set1_epi32(0x7F));
    __m256i nan_bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(c32, _mm256_set1_epi32(0x80)), 24),
                                       _mm256_set1_epi32((int)F32_CANONICAL_NAN));
    return _mm256_blendv_ps(x, _mm256_castsi256_ps(nan_bits), _mm256_castsi256_ps(nan));
}

#endif

/* ---- Written once on the layer above ----------------------------------- */

/* An entry of the per-ISA kernel tables (cossd_internal.h), named NAME_avx2 or NAME_avx512. */
#define SIMD_CAT2(a, b) a##_##b
#define SIMD_CAT(a, b) SIMD_CAT2(a, b)
#define SIMD_KERNEL(name) __attribute__((target(SIMD_TARGET))) SIMD_CAT(name, SIMD_SUFFIX)

/* FP32 -> 16-bit with an immediate RNE (ignores MXCSR.RC) for FP16, integer RNE for BF16. */
SIMD_FN simd_h simd_f32_to_half(simd_f x, int fmt)
{
    return fmt == COSSD_HALF_FP16 ? simd_f32_to_fp16(x) : simd_f32_to_bf16(x);
}

/* Loads and stores of one vector; `masked` (a compile-time constant) selects the masked
 * forms for a peel or tail, where lanes outside `km` are neither read (so no fault past the
 * end) nor written. */
SIMD_FN simd_f simd_loadf(const float *p, simd_mask km, int masked)
{
    return masked ? SIMD_LOADF_MASKED(p, km) : SIMD_LOADF(p);
}

SIMD_FN void simd_storef(float *p, simd_f x, simd_mask km, int masked)
{
    if (masked)
        SIMD_STOREF_MASKED(p, x, km);
    else
        SIMD_STOREF(p, x);
}

SIMD_FN simd_h simd_loadh(const uint16_t *p, simd_mask km, int masked)
{
    return masked ? SIMD_LOADH_MASKED(p, km) : SIMD_LOADH(p);
}

SIMD_FN void simd_storeh(uint16_t *p, simd_h x, simd_mask km, int masked)
{
    if (masked)
        SIMD_STOREH_MASKED(p, x, km);
    else
        SIMD_STOREH(p, x);
}

/* One vector of gradient elements i.. in any COSSD_GRAD_* format, as FP32 (before grad_scale):
 * exactly grad_to_f32's values (the tests compare all 256 FP8 codes on every path). */
SIMD_FN simd_f simd_load_grad(const void *grad, size_t i, int fmt, simd_mask km, int masked)
{
    if (fmt == COSSD_GRAD_FP32)
        return simd_loadf((const float *)grad + i, km, masked);
    if (grad_is_fp8(fmt))
        return simd_fp8_to_f32((const uint8_t *)grad + i, fmt, km, masked);
    return simd_h_to_f32(simd_loadh((const uint16_t *)grad + i, km, masked), fmt);
}

/* Streaming forms of the unmasked stores (the address is aligned: see adam_stream_mask);
 * `stream` is a compile-time constant in each loop. */
SIMD_FN void simd_putf(float *p, simd_f x, int stream)
{
    if (stream)
        SIMD_STREAMF(p, x);
    else
        SIMD_STOREF(p, x);
}

SIMD_FN void simd_puth(uint16_t *p, simd_h x, int stream)
{
    if (stream)
        SIMD_STREAMH(p, x);
    else
        SIMD_STOREH(p, x);
}

#endif /* COSSD_SIMD_H */
