/* cossd_scalar.h: the scalar, bit-exact element functions every path shares (half <-> FP32 rounding, one Adam element, argument checks). */
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

#include "cossd_kernels.h"

#define COSSD_INLINE static inline __attribute__((always_inline))

/* ------------------------------------------------------------------------ */
/* Scalar bit-exact conversions.                                            */
/* ------------------------------------------------------------------------ */

COSSD_INLINE uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u); /* memcpy avoids strict-aliasing UB; compiles to a move */
    return u;
}

COSSD_INLINE float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#define F32_CANONICAL_NAN 0x7FC00000u

/* Adam outputs store NaN as one canonical quiet NaN: which payload survives
 * when two NaNs meet depends on operand order the compiler is free to swap,
 * so canonicalising is what keeps the two paths bit-identical on NaNs. */
COSSD_INLINE float canon_nan(float x) { return x != x ? f32_from_bits(F32_CANONICAL_NAN) : x; }

COSSD_INLINE float fp16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;
    if (exp == 0x1F) {
        /* inf stays inf; NaN keeps its payload and is quieted, as F16C does. */
        return f32_from_bits(sign | 0x7F800000u | (mant << 13) | (mant ? 0x00400000u : 0u));
    }
    if (exp == 0) {
        if (mant == 0)
            return f32_from_bits(sign);
        /* Subnormal: value = mant * 2^-24, renormalised around its top set bit. */
        int top = 31 - __builtin_clz(mant); /* 0..9 */
        uint32_t f_exp = (uint32_t)(top + 103); /* (top - 24) + 127 */
        uint32_t f_mant = (mant << (23 - top)) & 0x7FFFFFu;
        return f32_from_bits(sign | (f_exp << 23) | f_mant);
    }
    return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13)); /* rebias 15 -> 127 */
}

COSSD_INLINE uint16_t f32_to_fp16(float f)
{
    uint32_t x = f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) /* NaN: quiet bit set, top payload bits kept (matches F16C) */
        return (uint16_t)(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
    if (ax >= 0x477FF000u) /* >= 65520 (incl. inf) rounds to inf: 65520 ties to even */
        return (uint16_t)(sign | 0x7C00u);
    if (ax >= 0x38800000u) { /* result is a normal half (|f| >= 2^-14 before rounding) */
        uint32_t odd = (ax >> 13) & 1u;
        ax += 0x0FFFu + odd; /* RNE; a carry propagates into the exponent correctly */
        return (uint16_t)(sign | ((ax >> 13) - (112u << 10)));
    }
    uint32_t exp = ax >> 23;
    if (exp < 102) /* |f| < 2^-25 rounds to zero (2^-25 itself ties to even zero) */
        return (uint16_t)sign;
    /* Subnormal half: value / 2^-24 = mant24 >> (126 - exp), rounded to nearest even. */
    uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126u - exp; /* 14..24 */
    uint32_t r = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u)))
        r++; /* may become 0x400, which is exactly the smallest normal */
    return (uint16_t)(sign | r);
}

COSSD_INLINE float bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

COSSD_INLINE uint16_t f32_to_bf16(float f)
{
    uint32_t x = f32_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) /* NaN: truncate and force quiet so it cannot become inf */
        return (uint16_t)((x >> 16) | 0x0040u);
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

COSSD_INLINE float half_to_f32(uint16_t h, int fmt) { return fmt == COSSD_HALF_BF16 ? bf16_to_f32(h) : fp16_to_f32(h); }

COSSD_INLINE uint16_t f32_to_half(float f, int fmt) { return fmt == COSSD_HALF_BF16 ? f32_to_bf16(f) : f32_to_fp16(f); }

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

/* Scalars copied to locals once: through the pointer the compiler would have
 * to reload them after every store, since it may alias an output buffer. */
typedef struct {
    float grad_scale, beta2, omb1, omb2, eps, step_size, bc2_sqrt, decay, wd;
    /* exp_avg is torch's lerp(m, g, 1 - beta1), which ATen's vectorized CPU kernel
     * computes as one FMA: fma(w, g - m, m) for a weight below 0.5, else
     * fma(w - 1, g - m, g). lerp_coeff and lerp_from_grad pick the branch once. */
    float lerp_coeff;
    int lerp_from_grad;
    int decoupled;
} adam_k;

COSSD_INLINE adam_k adam_load_scalars(const cossd_adam_scalars *s)
{
    adam_k k;
    k.grad_scale = s->grad_scale;
    k.beta2 = s->beta2;
    k.omb1 = s->one_minus_beta1;
    k.omb2 = s->one_minus_beta2;
    k.eps = s->eps;
    k.step_size = s->step_size;
    k.bc2_sqrt = s->bias_correction2_sqrt;
    k.decay = s->decay;
    k.wd = s->weight_decay;
    k.lerp_from_grad = !(fabsf(k.omb1) < 0.5f);
    k.lerp_coeff = k.lerp_from_grad ? k.omb1 - 1.0f : k.omb1;
    k.decoupled = s->decoupled != 0;
    return k;
}

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
    if (k->decoupled)
        p = p * k->decay;
    else
        g = fmaf(k->wd, p, g); /* fused, as torch's vectorized add(alpha=wd) does */
    float m = fmaf(k->lerp_coeff, g - m_in, k->lerp_from_grad ? g : m_in);
    float v = fmaf(k->omb2 * g, g, v_in * k->beta2); /* fused, as ATen's addcmul */
    float denom = sqrtf(v) / k->bc2_sqrt + k->eps;
    p = p + (-k->step_size * m) / denom;
    p = canon_nan(p);
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
