/* cossd_scalar.h: the scalar, bit-exact element functions every path shares (gradient decode, one Adam element with its loads and stores, argument checks); the arithmetic itself is cossd_elem.h's, shared with the CUDA kernel. */
#ifndef COSSD_SCALAR_H
#define COSSD_SCALAR_H

/*
 * Every SIMD path must give the scalar path's bits: the AVX2 peel and tail call
 * adam_elem itself, the vector bodies (adam_body.h) do the same operations in
 * the same order. Only correctly rounded operations (+ - * / sqrt, and fma in
 * the three places the contract fuses) appear here.
 */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cossd_elem.h" /* the element arithmetic, shared with kernels/cuda/ */
#include "cossd_kernels.h"

#define COSSD_INLINE static inline __attribute__((always_inline))

/* ------------------------------------------------------------------------ */
/* Scalar bit-exact conversions.                                            */
/* ------------------------------------------------------------------------ */

/* f32_bits, canon_nan, fp16/bf16 <-> FP32 (f32_to_half, half_to_f32): cossd_elem.h, shared
 * with the CUDA kernel. */

COSSD_INLINE int half_fmt_ok(int fmt) { return fmt == COSSD_HALF_FP16 || fmt == COSSD_HALF_BF16; }

/* ------------------------------------------------------------------------ */
/* Gradient formats: FP16, BF16, FP32, FP8 E4M3 and E5M2 (COSSD_GRAD_*).    */
/* ------------------------------------------------------------------------ */

COSSD_INLINE int grad_fmt_ok(int fmt) { return fmt >= COSSD_HALF_FP16 && fmt <= COSSD_GRAD_FP8_E5M2; }

COSSD_INLINE int grad_is_fp8(int fmt) { return fmt == COSSD_GRAD_FP8_E4M3 || fmt == COSSD_GRAD_FP8_E5M2; }

/* Bytes of one gradient element. */
COSSD_INLINE size_t grad_itemsize(int fmt) { return fmt == COSSD_GRAD_FP32 ? 4 : grad_is_fp8(fmt) ? 1 : 2; }

/* One FP8 code as FP32, exactly (every FP8 value is a float). E4M3 is OCP's E4M3FN: bias 7, no
 * inf, S.1111.111 the only NaN (decoded as sign | quiet NaN), max 448, subnormals m * 2^-9.
 * E5M2 is IEEE-like (bias 15, inf, NaNs): its code is the top byte of a binary16, decoded as
 * fp16_to_f32 does (a NaN keeps its payload, quieted). */
COSSD_INLINE float fp8_decode(uint8_t c, int fmt)
{
    if (fmt == COSSD_GRAD_FP8_E5M2)
        return fp16_to_f32((uint16_t)(c << 8));
    uint32_t sign = (uint32_t)(c & 0x80u) << 24;
    uint32_t exp = (c >> 3) & 0xFu, mant = c & 0x7u;
    if (exp == 0xF && mant == 0x7)
        return f32_from_bits(sign | F32_CANONICAL_NAN);
    if (exp == 0) {
        if (mant == 0)
            return f32_from_bits(sign);
        int top = 31 - __builtin_clz(mant); /* 0..2: value = 2^(top-9) * (mant / 2^top) */
        return f32_from_bits(sign | ((uint32_t)(top + 118) << 23) | ((mant << (23 - top)) & 0x7FFFFFu));
    }
    return f32_from_bits(sign | ((exp + 120u) << 23) | (mant << 20)); /* rebias 7 -> 127 */
}

/* Every path decodes FP8 through this table (filled from fp8_decode at load time, convert.c):
 * the SIMD paths gather from it, so they give the scalar bits by construction.
 * [0] E4M3, [1] E5M2. */
extern float cossd_fp8_lut[2][256] __attribute__((visibility("hidden")));

/* Gradient element i of a buffer in `fmt`, as FP32 (before grad_scale). */
COSSD_INLINE float grad_to_f32(const void *grad, size_t i, int fmt)
{
    if (fmt == COSSD_GRAD_FP32)
        return ((const float *)grad)[i];
    if (grad_is_fp8(fmt))
        return cossd_fp8_lut[fmt - COSSD_GRAD_FP8_E4M3][((const uint8_t *)grad)[i]];
    return half_to_f32(((const uint16_t *)grad)[i], fmt);
}

/* 1 where gradient element i is inf or NaN (all exponent bits set; E4M3's NaN is S.1111.111). */
COSSD_INLINE int grad_nonfinite(const void *grad, size_t i, int fmt)
{
    switch (fmt) {
    case COSSD_GRAD_FP32:
        return (((const uint32_t *)grad)[i] & 0x7F800000u) == 0x7F800000u;
    case COSSD_GRAD_FP8_E4M3:
        return (((const uint8_t *)grad)[i] & 0x7Fu) == 0x7Fu;
    case COSSD_GRAD_FP8_E5M2:
        return (((const uint8_t *)grad)[i] & 0x7Cu) == 0x7Cu;
    case COSSD_HALF_BF16:
        return (((const uint16_t *)grad)[i] & 0x7F80u) == 0x7F80u;
    default:
        return (((const uint16_t *)grad)[i] & 0x7C00u) == 0x7C00u;
    }
}

COSSD_INLINE int state_fmt_ok(int fmt) { return fmt == COSSD_STATE_FP32 || fmt == COSSD_STATE_BF16; }

/* ------------------------------------------------------------------------ */
/* One Adam element.                                                        */
/* ------------------------------------------------------------------------ */

/* adam_k, adam_load_scalars and the step's arithmetic (adam_elem_math): cossd_elem.h. */

COSSD_INLINE float load_state(const void *p, size_t i, int fmt)
{
    return fmt == COSSD_STATE_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

COSSD_INLINE void store_state(void *p, size_t i, int fmt, float x)
{
    if (fmt == COSSD_STATE_BF16)
        ((uint16_t *)p)[i] = f32_to_bf16(x);
    else
        ((float *)p)[i] = x;
}

/* One element, in the contract's exact operation order. Used by the scalar
 * path and for the AVX2 tail, so the tail is identical by construction. */
COSSD_INLINE void adam_elem(const void *grad, int gfmt, const float *mi, const void *ai, const void *vi,
                            float *mo, void *ao, void *vo, int sfmt, uint16_t *po, int pfmt, size_t i,
                            const adam_k *k)
{
    float g = grad_to_f32(grad, i, gfmt) * k->grad_scale;
    float p = mi[i];
    float m_in = load_state(ai, i, sfmt);
    float v_in = load_state(vi, i, sfmt);
    float m, v;
    adam_elem_math(g, p, m_in, v_in, k, &p, &m, &v);
    mo[i] = p;
    store_state(ao, i, sfmt, canon_nan(m));
    store_state(vo, i, sfmt, canon_nan(v));
    po[i] = f32_to_half(p, pfmt);
}

COSSD_INLINE int adam_check(const void *grad, int gfmt, const float *mi, const void *ai, const void *vi,
                            float *mo, void *ao, void *vo, int sfmt, uint16_t *po, int pfmt, size_t n,
                            const cossd_adam_scalars *s)
{
    if (!grad_fmt_ok(gfmt) || !half_fmt_ok(pfmt) || !state_fmt_ok(sfmt))
        return COSSD_ERR_FORMAT;
    if (n > 0 && (!grad || !mi || !ai || !vi || !mo || !ao || !vo || !po || !s))
        return COSSD_ERR_NULL;
    return COSSD_OK;
}

/* A 16-bit value is inf/NaN iff all its exponent bits are set. */
COSSD_INLINE uint16_t exp_mask(int fmt) { return fmt == COSSD_HALF_BF16 ? 0x7F80u : 0x7C00u; }

#endif /* COSSD_SCALAR_H */
