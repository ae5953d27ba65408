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

/* pow2f, fp16_scale_exp, qblock_params and qblock_params_of, q8_xor, q8_zero_index, the
 * QFLAG_* bits and the per-element encode and decode (q_code_*, q_value_*): cossd_elem.h,
 * shared with the CUDA kernel. */

/* The INT8 code of y = x / absmax: how many midpoints lie below y (a branch-free lower
 * bound over the 255 midpoints, 8 probes; the SIMD paths probe the same entries). */
COSSD_INLINE unsigned q8_search(float y, int moment) { return q8_search_in(g_qmid[moment], y); }

COSSD_INLINE float q_decode(const void *codes, size_t i, float scale, int fmt, int moment)
{
    if (fmt == COSSD_STATE_FP16)
        return q_value_fp16(((const uint16_t *)codes)[i], scale);
    return q_value_int8(((const uint8_t *)codes)[i], scale, g_qmap[moment], moment);
}

/* Encodes x; returns QFLAG_* for it: underflow where x is nonzero and its code (before the
 * second moment's raise) is zero, overflow where the code decodes to inf or NaN. A poisoned
 * block's elements are counted by the caller (qcount_block). */
COSSD_INLINE unsigned q_encode(void *codes, size_t i, float x, const qblock_params *q, int fmt, int moment)
{
    unsigned flags = 0;
    if (fmt == COSSD_STATE_FP16)
        ((uint16_t *)codes)[i] = q_code_fp16(x, q, moment, &flags);
    else if (q->poisoned)
        ((uint8_t *)codes)[i] = 0;
    else
        ((uint8_t *)codes)[i] = q_code_int8(x, q, moment, g_qmid[moment], &flags);
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
    adam_elem_math(g, p, m_in, v_in, k, &p, m_out, v_out);
    mo[i] = p;
    po[i] = f32_to_half(p, pfmt);
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
