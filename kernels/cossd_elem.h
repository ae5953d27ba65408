/* cossd_elem.h: the per-element arithmetic of the Adam step and the moment formats, written once for the C kernels (host) and the CUDA kernel (__host__ __device__), so that every path's bits rest on one source. */
#ifndef COSSD_ELEM_H
#define COSSD_ELEM_H

/*
 * Pure functions of values: no buffers, no tables of their own, no global state. The C
 * kernels (cossd_scalar.h, qstate_scalar.h) wrap them with their loads and stores; the CUDA
 * kernel (kernels/cuda/) calls the same functions on the device. Only correctly rounded
 * operations (+ - * / sqrt, and fmaf in the three places the contract fuses) appear here, so
 * the results are the same wherever they are compiled, provided the compiler neither
 * contracts a product and a sum into an FMA nor relaxes IEEE rounding:
 *   gcc/clang: -ffp-contract=off, no -ffast-math (kernels/_build.py);
 *   nvcc: -fmad=false, and none of -use_fast_math, -ftz=true, -prec-div=false,
 *         -prec-sqrt=false (kernels/cuda/build.py).
 * memcpy and __builtin_clz compile for the device as well (to a register move and clz.b32),
 * so the host and device forms are the same text.
 */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cossd_kernels.h"

#ifdef __CUDACC__
#define COSSD_HD static __host__ __device__ __forceinline__
#else
#define COSSD_HD static inline __attribute__((always_inline))
#endif

/* ---- Bits and NaN ------------------------------------------------------- */

COSSD_HD uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u); /* memcpy avoids strict-aliasing UB; compiles to a move */
    return u;
}

COSSD_HD float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#define F32_CANONICAL_NAN 0x7FC00000u

/* Adam outputs store NaN as one canonical quiet NaN: which payload survives
 * when two NaNs meet depends on operand order the compiler is free to swap,
 * so canonicalising is what keeps the paths bit-identical on NaNs. */
COSSD_HD float canon_nan(float x) { return x != x ? f32_from_bits(F32_CANONICAL_NAN) : x; }

/* ---- Half <-> FP32 (docs/kernels.md, "Conversions") --------------------- */

COSSD_HD float fp16_to_f32(uint16_t h)
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

COSSD_HD uint16_t f32_to_fp16(float f)
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

COSSD_HD float bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

COSSD_HD uint16_t f32_to_bf16(float f)
{
    uint32_t x = f32_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) /* NaN: truncate and force quiet so it cannot become inf */
        return (uint16_t)((x >> 16) | 0x0040u);
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

COSSD_HD float half_to_f32(uint16_t h, int fmt) { return fmt == COSSD_HALF_BF16 ? bf16_to_f32(h) : fp16_to_f32(h); }

COSSD_HD uint16_t f32_to_half(float f, int fmt) { return fmt == COSSD_HALF_BF16 ? f32_to_bf16(f) : f32_to_fp16(f); }

/* ---- One Adam element ----------------------------------------------------- */

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

COSSD_HD adam_k adam_load_scalars(const cossd_adam_scalars *s)
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

/* The step's arithmetic on one element's decoded operands, in the contract's exact order
 * (docs/kernels.md, "Adam step, per element"): g is the gradient already times grad_scale,
 * p the FP32 master, m_in/v_in the decoded moments. Returns the new master (NaN made
 * canonical) and the new moments, not yet canonical or encoded: their format's store does
 * that. */
COSSD_HD void adam_elem_math(float g, float p, float m_in, float v_in, const adam_k *k, float *p_out, float *m_out,
                             float *v_out)
{
    if (k->decoupled)
        p = p * k->decay;
    else
        g = fmaf(k->wd, p, g); /* fused, as torch's vectorized add(alpha=wd) does */
    float m = fmaf(k->lerp_coeff, g - m_in, k->lerp_from_grad ? g : m_in);
    float v = fmaf(k->omb2 * g, g, v_in * k->beta2); /* fused, as ATen's addcmul */
    float denom = sqrtf(v) / k->bc2_sqrt + k->eps;
    p = p + (-k->step_size * m) / denom;
    *p_out = canon_nan(p);
    *m_out = m;
    *v_out = v;
}

/* ---- Block-scaled moments: one element, given its block's parameters ------ */
/* (docs/kernels.md, "Block-scaled moments"; the loops over a block are the callers') */

#define FP16_MAX 65504.0f

/* 2^e as a float, for e in [-126, 127]: built from its bits, exact. */
COSSD_HD float pow2f(int e) { return f32_from_bits((uint32_t)(e + 127) << 23); }

/* The FP16 scale exponent k of a block whose largest finite |x| is amax (0 for an empty or
 * all-zero block). Exact: the exponent from the bits, one product by a power of two. */
COSSD_HD int fp16_scale_exp(float amax)
{
    if (!(amax > 0.0f))
        return 0;
    int e = (int)((f32_bits(amax) >> 23) & 0xFFu) - 127; /* floor(log2 amax); -127 for subnormals */
    int k = 15 - e;                                       /* amax * 2^k in [2^15, 2^16) */
    if (k > 126)
        k = 126;
    if (amax * pow2f(k) > FP16_MAX) /* above fp16's largest finite: one octave less */
        k--;
    return k;
}

/* What the encoder of a block needs, from its largest finite |x| and whether it holds a
 * non-finite value: the multiplier (FP16: 2^k) or divisor (INT8: absmax, 1 for a zero block)
 * and the scale stored beside the codes. */
typedef struct {
    float factor;
    float stored;
    int poisoned; /* INT8 with a non-finite value: 0 codes, NaN absmax */
} qblock_params;

COSSD_HD qblock_params qblock_params_of(float amax, int nonfinite, int fmt)
{
    qblock_params q;
    q.poisoned = 0;
    if (fmt == COSSD_STATE_FP16) {
        int k = fp16_scale_exp(amax);
        q.factor = pow2f(k);
        q.stored = pow2f(-k);
    } else if (nonfinite) {
        q.factor = 1.0f;
        q.stored = f32_from_bits(F32_CANONICAL_NAN);
        q.poisoned = 1;
    } else {
        q.factor = amax > 0.0f ? amax : 1.0f;
        q.stored = amax;
    }
    return q;
}

/* Whether a block joins the counters' range of scales: not poisoned, a nonzero finite
 * largest value (qcount_block). */
COSSD_HD int qblock_scaled(const qblock_params *q, float amax) { return !q->poisoned && amax > 0.0f; }

/* x's contribution to its block's largest finite |x|: |x|, or 0 with *nonfinite set. */
COSSD_HD float q_finite_abs(float x, int *nonfinite)
{
    float a = fabsf(x);
    if (a < INFINITY)
        return a;
    *nonfinite = 1;
    return 0.0f;
}

/* What a stored INT8 byte is XORed with to index the map (and back). */
COSSD_HD unsigned q8_xor(int moment) { return moment == COSSD_MOMENT_EXP_AVG ? 0x80u : 0u; }

/* The map index of 0: the signed map's zero sits at 128, the unsigned map's at 0. */
COSSD_HD unsigned q8_zero_index(int moment) { return moment == COSSD_MOMENT_EXP_AVG ? 128u : 0u; }

/* The midpoint between neighbouring map entries a < b: the search's threshold. */
COSSD_HD float q8_midpoint(float a, float b) { return 0.5f * (a + b); }

/* The INT8 code of y = x / absmax: how many of the 255 midpoints (ascending) lie below y,
 * a branch-free lower bound in 8 probes (its outcome is a coin flip). */
COSSD_HD unsigned q8_search_in(const float *mid, float y)
{
    unsigned idx = 0;
    for (unsigned step = 128; step; step >>= 1)
        idx += (unsigned)(mid[idx + step - 1] < y) * step;
    return idx;
}

/* What an encode reports per element, for the counters (qstate_counts.h). */
#define QFLAG_UNDERFLOW 1u
#define QFLAG_OVERFLOW 2u

/* An FP16 code's value: exact (a power-of-two scale). */
COSSD_HD float q_value_fp16(uint16_t code, float scale) { return fp16_to_f32(code) * scale; }

/* An INT8 byte's value, from its moment's map (256 entries, ascending). */
COSSD_HD float q_value_int8(uint8_t byte, float scale, const float *map, int moment)
{
    return map[byte ^ q8_xor(moment)] * scale;
}

/* x's FP16 code in a block with parameters q, its QFLAG_* or-ed into *flags: underflow
 * where x is nonzero and its code (before the second moment's raise) is zero, overflow
 * where the code decodes to inf or NaN. */
COSSD_HD uint16_t q_code_fp16(float x, const qblock_params *q, int moment, unsigned *flags)
{
    uint16_t h = f32_to_fp16(canon_nan(x) * q->factor);
    if ((h & 0x7FFFu) == 0 && x != 0.0f)
        *flags |= QFLAG_UNDERFLOW;
    if ((h & 0x7C00u) == 0x7C00u)
        *flags |= QFLAG_OVERFLOW;
    if (moment == COSSD_MOMENT_EXP_AVG_SQ && h == 0 && x > 0.0f)
        h = 1; /* the smallest subnormal: a positive second moment never decodes to 0 */
    return h;
}

/* x's INT8 byte in a block with parameters q (not poisoned: a poisoned block's bytes are 0
 * and its elements are counted by the block), given its moment's midpoints. */
COSSD_HD uint8_t q_code_int8(float x, const qblock_params *q, int moment, const float *mid, unsigned *flags)
{
    float y = x / q->factor;
    unsigned idx = q8_search_in(mid, y);
    if (idx == q8_zero_index(moment) && x != 0.0f)
        *flags |= QFLAG_UNDERFLOW;
    if (moment == COSSD_MOMENT_EXP_AVG_SQ && idx == 0 && y > 0.0f)
        idx = 1; /* a positive second moment never decodes to 0 */
    return (uint8_t)(idx ^ q8_xor(moment));
}

#endif /* COSSD_ELEM_H */
