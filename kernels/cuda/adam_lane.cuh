/* adam_lane.cuh: one element's share of the CUDA Adam step (decode, step, encode), as __host__ __device__ templates over cossd_elem.h, so the host harness runs the very code the kernel runs. */
#ifndef COSSD_CUDA_ADAM_LANE_CUH
#define COSSD_CUDA_ADAM_LANE_CUH

/*
 * The kernel (adam_step.cu) gives each element of a 256-element state block one thread
 * ("lane"). A block's step is three phases, the same as the C kernels' one pass per block
 * (qstate.c, adamq_kernel_scalar):
 *   A. every lane: decode its moments with the block's scales, step, store master and
 *      param, keep the new moments in registers (lane_step);
 *   B. the block: the largest finite |m| and |v| and whether any is non-finite (a max and
 *      an or, exact in any order), then qblock_params_of (cossd_elem.h);
 *   C. every lane: encode its new moments (lane_encode); the block's counts and scales.
 * The formats are template parameters, so each of the 16 kernels has no format branches.
 */

#include "../cossd_elem.h"

/* The INT8 tables a lane looks up: each moment's 256-entry map (ascending) and its 255
 * midpoints (entry 255 is +inf, never probed). */
struct cossd_q8_tables {
    float map[2][256];
    float mid[2][256];
};

/* Fills t->mid from t->map, the midpoints the C kernels' search uses (qstate.c). */
COSSD_HD void cossd_q8_tables_fill_mid(cossd_q8_tables *t)
{
    for (int m = 0; m < 2; m++) {
        for (int i = 0; i < 255; i++)
            t->mid[m][i] = q8_midpoint(t->map[m][i], t->map[m][i + 1]);
        t->mid[m][255] = INFINITY;
    }
}

/* Element i's decoded moment in state format SF (block scale `scale`; ignored by FP32/BF16). */
template <int SF>
COSSD_HD float lane_decode(const void *codes, size_t i, float scale, const float *map, int moment)
{
    if (SF == COSSD_STATE_FP32)
        return ((const float *)codes)[i];
    if (SF == COSSD_STATE_BF16)
        return bf16_to_f32(((const uint16_t *)codes)[i]);
    if (SF == COSSD_STATE_FP16)
        return q_value_fp16(((const uint16_t *)codes)[i], scale);
    return q_value_int8(((const uint8_t *)codes)[i], scale, map, moment);
}

/* Phase A: element i's step. Stores master and param; returns the new moments in *m, *v. */
template <int GF, int SF, int PF>
COSSD_HD void lane_step(const uint16_t *grad, const float *mi, const void *ai, float a_scale, const void *vi,
                        float v_scale, float *mo, uint16_t *po, size_t i, const adam_k *k,
                        const cossd_q8_tables *t, float *m, float *v)
{
    float g = half_to_f32(grad[i], GF) * k->grad_scale;
    float m_in = lane_decode<SF>(ai, i, a_scale, t ? t->map[COSSD_MOMENT_EXP_AVG] : 0, COSSD_MOMENT_EXP_AVG);
    float v_in = lane_decode<SF>(vi, i, v_scale, t ? t->map[COSSD_MOMENT_EXP_AVG_SQ] : 0, COSSD_MOMENT_EXP_AVG_SQ);
    float p;
    adam_elem_math(g, mi[i], m_in, v_in, k, &p, m, v);
    mo[i] = p;
    po[i] = f32_to_half(p, PF);
}

/* An elementwise format's store (FP32, BF16): the new moment, NaN made canonical. */
template <int SF>
COSSD_HD void lane_store_elementwise(void *out, size_t i, float x)
{
    if (SF == COSSD_STATE_BF16)
        ((uint16_t *)out)[i] = f32_to_bf16(canon_nan(x));
    else
        ((float *)out)[i] = canon_nan(x);
}

/* Phase C: element i's code of a block-scaled format (FP16, INT8) in a block with
 * parameters q; returns its QFLAG_* for the counters. */
template <int SF>
COSSD_HD unsigned lane_encode(void *codes, size_t i, float x, const qblock_params *q, int moment,
                              const cossd_q8_tables *t)
{
    unsigned flags = 0;
    if (SF == COSSD_STATE_FP16)
        ((uint16_t *)codes)[i] = q_code_fp16(x, q, moment, &flags);
    else if (q->poisoned)
        ((uint8_t *)codes)[i] = 0;
    else
        ((uint8_t *)codes)[i] = q_code_int8(x, q, moment, t->mid[moment], &flags);
    return flags;
}

#endif /* COSSD_CUDA_ADAM_LANE_CUH */
