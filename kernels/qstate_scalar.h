/* qstate_scalar.h: the scalar, bit-exact pieces of the block-scaled moment formats (FP16 with a power-of-two scale per block, INT8 codes into a dynamic map with an absmax per block) that every path shares. */
#ifndef COSSD_QSTATE_SCALAR_H
#define COSSD_QSTATE_SCALAR_H

/*
 * Include after cossd_internal.h. A block is COSSD_STATE_BLOCK (256) elements of one call;
 * the last block of a call may be shorter. Each block keeps one FP32 scale per moment:
 *  - FP16: the decode factor 2^-k, codes = RNE_fp16(x * 2^k), value = fp16(code) * 2^-k
 *    (both products exact: powers of two). k is the largest integer with
 *    amax * 2^k <= 65504 (MS-AMP's 2^floor(log2(65504 / amax))), amax the block's largest
 *    finite |x|, clamped to [-126, 126] so both 2^k and 2^-k are normal floats.
 *  - INT8: the block's largest |x| (absmax); the code is the index of the map entry nearest
 *    to x / absmax (ties to the lower index), value = map[index] * absmax. The byte stored
 *    is that index for exp_avg_sq, and index ^ 0x80 for exp_avg: the signed map has its zero
 *    at index 128, so exp_avg's byte is an int8 in the value's order, 0 meaning 0.
 * In both formats all-zero bytes (codes and scales) decode to zero moments: a fresh,
 * zero-filled state needs no encoding. A positive exp_avg_sq never gets the code of 0 (INT8:
 * the map's smallest positive entry instead, FP16: the smallest subnormal, 2^-24 times the
 * scale): an element whose second moment vanished would step by m / eps.
 * Non-finite values: FP16 keeps inf and NaN per element (NaN canonical, 0x7E00); an INT8
 * block with any non-finite value stores the canonical NaN as its absmax and 0 codes, so
 * the whole block decodes to NaN. (The device never commits a step with a non-finite
 * gradient; this only has to be the same in every path.)
 */

#include "qstate_counts.h"

#define QBLOCK ((size_t)COSSD_STATE_BLOCK)
#define FP16_MAX 65504.0f

/* The INT8 maps (ascending) and the midpoints between neighbours (255 of them; entry 255 is
 * +inf, never compared), per moment; filled once at load (qstate.c, cossd_qmap_init). */
extern COSSD_HIDDEN float g_qmap[2][256] __attribute__((aligned(64)));
extern COSSD_HIDDEN float g_qmid[2][256] __attribute__((aligned(64)));
/* The midpoints each level of the search can probe, for the SIMD paths to look up in
 * registers: level L (step s = 128 >> L, idx a multiple of 2s) probes g_qmid[idx + s - 1],
 * stored at g_qprobe[moment][L][idx / 2s] (2^L entries, the rest +inf). */
#define QPROBE_LEVELS 8
extern COSSD_HIDDEN float g_qprobe[2][QPROBE_LEVELS][128] __attribute__((aligned(64)));
COSSD_HIDDEN void cossd_qmap_init(void);

COSSD_INLINE int qstate_fmt(int fmt) { return fmt == COSSD_STATE_FP16 || fmt == COSSD_STATE_INT8; }
COSSD_INLINE int any_state_fmt(int fmt) { return state_fmt_ok(fmt) || qstate_fmt(fmt); }
COSSD_INLINE size_t qblocks(size_t n) { return (n + QBLOCK - 1) / QBLOCK; }

/* 2^e as a float, for e in [-126, 127]: built from its bits, exact. */
COSSD_INLINE float pow2f(int e) { return f32_from_bits((uint32_t)(e + 127) << 23); }

/* The FP16 scale exponent k of a block whose largest finite |x| is amax (0 for an empty or
 * all-zero block). Exact: the exponent from the bits, one product by a power of two. */
COSSD_INLINE int fp16_scale_exp(float amax)
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

COSSD_INLINE qblock_params qblock_params_of(float amax, int nonfinite, int fmt)
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

/* The INT8 code of y = x / absmax: how many midpoints lie below y (a branch-free lower
 * bound over the 255 midpoints, 8 probes; the SIMD paths probe the same entries). */
/* What a stored INT8 byte is XORed with to index the map (and back). */
COSSD_INLINE unsigned q8_xor(int moment) { return moment == COSSD_MOMENT_EXP_AVG ? 0x80u : 0u; }

COSSD_INLINE unsigned q8_search(float y, int moment)
{
    const float *mid = g_qmid[moment];
    unsigned idx = 0;
    for (unsigned step = 128; step; step >>= 1)
        idx += (unsigned)(mid[idx + step - 1] < y) * step; /* no branch: the outcome is a coin flip */
    return idx;
}

/* The map index of 0: the signed map's zero sits at 128, the unsigned map's at 0. */
COSSD_INLINE unsigned q8_zero_index(int moment) { return moment == COSSD_MOMENT_EXP_AVG ? 128u : 0u; }

/* What q_encode reports per element, for the counters (qstate_counts.h). */
#define QFLAG_UNDERFLOW 1u
#define QFLAG_OVERFLOW 2u

COSSD_INLINE float q_decode(const void *codes, size_t i, float scale, int fmt, int moment)
{
    if (fmt == COSSD_STATE_FP16)
        return fp16_to_f32(((const uint16_t *)codes)[i]) * scale;
    return g_qmap[moment][((const uint8_t *)codes)[i] ^ q8_xor(moment)] * scale;
}

/* Encodes x; returns QFLAG_* for it: underflow where x is nonzero and its code (before the
 * second moment's raise) is zero, overflow where the code decodes to inf or NaN. A poisoned
 * block's elements are counted by the caller (qcount_block). */
COSSD_INLINE unsigned q_encode(void *codes, size_t i, float x, const qblock_params *q, int fmt, int moment)
{
    unsigned flags = 0;
    if (fmt == COSSD_STATE_FP16) {
        uint16_t h = f32_to_fp16(canon_nan(x) * q->factor);
        if ((h & 0x7FFFu) == 0 && x != 0.0f)
            flags |= QFLAG_UNDERFLOW;
        if ((h & 0x7C00u) == 0x7C00u)
            flags |= QFLAG_OVERFLOW;
        if (moment == COSSD_MOMENT_EXP_AVG_SQ && h == 0 && x > 0.0f)
            h = 1; /* the smallest subnormal: a positive second moment never decodes to 0 */
        ((uint16_t *)codes)[i] = h;
    } else if (q->poisoned) {
        ((uint8_t *)codes)[i] = 0;
    } else {
        float y = x / q->factor;
        unsigned idx = q8_search(y, moment);
        if (idx == q8_zero_index(moment) && x != 0.0f)
            flags |= QFLAG_UNDERFLOW;
        if (moment == COSSD_MOMENT_EXP_AVG_SQ && idx == 0 && y > 0.0f)
            idx = 1; /* a positive second moment never decodes to 0 */
        ((uint8_t *)codes)[i] = (uint8_t)(idx ^ q8_xor(moment));
    }
    return flags;
}

/* A block's share of the counters, once its scale is chosen: a poisoned block's every element
 * overflows; a block with a nonzero finite largest value joins the scales' range. */
COSSD_INLINE void qcount_block(cossd_qstate_counts *c, int moment, const qblock_params *q, float amax, size_t cnt)
{
    if (q->poisoned) {
        c->overflow[moment] += cnt;
        return;
    }
    if (!(amax > 0.0f))
        return;
    if (c->scaled_blocks[moment] == 0 || q->stored < c->scale_min[moment])
        c->scale_min[moment] = q->stored;
    if (c->scaled_blocks[moment] == 0 || q->stored > c->scale_max[moment])
        c->scale_max[moment] = q->stored;
    c->scaled_blocks[moment]++;
}

COSSD_INLINE void qcount_flags(cossd_qstate_counts *c, int moment, unsigned flags)
{
    c->underflow[moment] += flags & QFLAG_UNDERFLOW;
    c->overflow[moment] += (flags & QFLAG_OVERFLOW) >> 1;
}

/* The largest finite |x| of buf[from..to) folded into *amax; returns 1 if any is non-finite. */
COSSD_INLINE int q_amax(const float *buf, size_t from, size_t to, float *amax)
{
    int nonfinite = 0;
    for (size_t j = from; j < to; j++) {
        float a = fabsf(buf[j]);
        if (a < INFINITY) {
            if (a > *amax)
                *amax = a;
        } else {
            nonfinite = 1;
        }
    }
    return nonfinite;
}

/* One Adam element over decoded moments (the contract's order, as adam_elem): the master
 * and param stored, the new moments returned for the block's encoder. */
COSSD_INLINE void adamq_elem(const void *grad, int gfmt, const float *mi, const void *ai, float a_scale,
                             const void *vi, float v_scale, float *mo, int sfmt, uint16_t *po, int pfmt, size_t i,
                             const adam_k *k, float *m_out, float *v_out)
{
    float g = grad_to_f32(grad, i, gfmt) * k->grad_scale;
    float p = mi[i];
    float m_in = q_decode(ai, i, a_scale, sfmt, COSSD_MOMENT_EXP_AVG);
    float v_in = q_decode(vi, i, v_scale, sfmt, COSSD_MOMENT_EXP_AVG_SQ);
    if (k->decoupled)
        p = p * k->decay;
    else
        g = fmaf(k->wd, p, g);
    float m = fmaf(k->lerp_coeff, g - m_in, k->lerp_from_grad ? g : m_in);
    float v = fmaf(k->omb2 * g, g, v_in * k->beta2);
    float denom = sqrtf(v) / k->bc2_sqrt + k->eps;
    p = p + (-k->step_size * m) / denom;
    p = canon_nan(p);
    mo[i] = p;
    po[i] = f32_to_half(p, pfmt);
    *m_out = m;
    *v_out = v;
}

/* Encode buf[0..cnt) (one block's new values) into codes[b0..b0+cnt) and its scale. */
COSSD_INLINE void q_encode_block_scalar(const float *buf, size_t cnt, int fmt, int moment, void *codes, size_t b0,
                                        float *scale_out, cossd_qstate_counts *counts)
{
    float amax = 0.0f;
    int nonfinite = q_amax(buf, 0, cnt, &amax);
    qblock_params q = qblock_params_of(amax, nonfinite, fmt);
    qcount_block(counts, moment, &q, amax, cnt);
    for (size_t j = 0; j < cnt; j++)
        qcount_flags(counts, moment, q_encode(codes, b0 + j, buf[j], &q, fmt, moment));
    *scale_out = q.stored;
}

/* Calls BODY(GF, SF, PF, DC) with compile-time constant formats and mode for the block-scaled
 * state formats (16 combinations), as ADAM_SPECIALISE does for the elementwise ones. */
#define ADAMQ_SPECIALISE(BODY)                                                                               \
    do {                                                                                                     \
        switch (gfmt) {                                                                                      \
        case COSSD_HALF_BF16: ADAMQ_SPEC_SF(BODY, COSSD_HALF_BF16); break;                                   \
        case COSSD_GRAD_FP32: ADAMQ_SPEC_SF(BODY, COSSD_GRAD_FP32); break;                                   \
        case COSSD_GRAD_FP8_E4M3: ADAMQ_SPEC_SF(BODY, COSSD_GRAD_FP8_E4M3); break;                           \
        case COSSD_GRAD_FP8_E5M2: ADAMQ_SPEC_SF(BODY, COSSD_GRAD_FP8_E5M2); break;                           \
        default: ADAMQ_SPEC_SF(BODY, COSSD_HALF_FP16); break;                                                \
        }                                                                                                    \
    } while (0)
#define ADAMQ_SPEC_SF(BODY, GF)                                                                              \
    do {                                                                                                     \
        if (sfmt == COSSD_STATE_INT8)                                                                        \
            ADAM_SPEC_PF(BODY, GF, COSSD_STATE_INT8);                                                        \
        else                                                                                                 \
            ADAM_SPEC_PF(BODY, GF, COSSD_STATE_FP16);                                                        \
    } while (0)

typedef void adamq_kernel_fn(const void *grad, int gfmt, const float *mi, const void *ai, const float *as_in,
                             const void *vi, const float *vs_in, float *mo, void *ao, float *as_out, void *vo,
                             float *vs_out, int sfmt, uint16_t *po, int pfmt, size_t n, const adam_k *k,
                             cossd_qstate_counts *counts);
COSSD_HIDDEN adamq_kernel_fn adamq_kernel_scalar;
#if COSSD_X86
COSSD_HIDDEN adamq_kernel_fn adamq_kernel_avx2, adamq_kernel_avx512;
#endif

#endif /* COSSD_QSTATE_SCALAR_H */
