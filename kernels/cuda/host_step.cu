/* host_step.cu: the CUDA kernel's per-block step run on the host (a test harness): the same __host__ __device__ lane functions, compiled by nvcc, in the kernel's three phases, serialised, behind cossd_adam_step_q_counted's signature. */

/*
 * Phase A for every lane, then the block's largest |m| and |v| (a max: the same value the
 * device's reduction finds in any order), qblock_params_of, phase C for every lane, then the
 * block's counts by the kernel's rules (block_count in adam_step.cu). What this cannot check
 * is the device's own side: its reductions, barriers, atomics and the device compilation of
 * the lane functions (docs/kernels.md, "CUDA").
 */

#include <string.h>

#include "adam_lane.cuh"
#include "adam_step.h"

static void host_count(cossd_cuda_counts *c, int moment, const qblock_params *q, float amax, unsigned cnt,
                       unsigned underflows, unsigned overflows)
{
    if (q->poisoned)
        overflows = cnt;
    c->underflow[moment] += underflows;
    c->overflow[moment] += overflows;
    if (qblock_scaled(q, amax)) {
        unsigned bits = f32_bits(q->stored);
        c->scaled_blocks[moment]++;
        if (bits < c->scale_min_bits[moment])
            c->scale_min_bits[moment] = bits;
        if (bits > c->scale_max_bits[moment])
            c->scale_max_bits[moment] = bits;
    }
}

template <int GF, int SF, int PF>
static void host_blocks(const uint16_t *grad, const float *mi, const void *ai, const float *as_in, const void *vi,
                        const float *vs_in, float *mo, void *ao, float *as_out, void *vo, float *vs_out, uint16_t *po,
                        size_t n, const adam_k *k, const cossd_q8_tables *t, cossd_cuda_counts *counts)
{
    const bool scaled = SF == COSSD_STATE_FP16 || SF == COSSD_STATE_INT8;
    float m[COSSD_STATE_BLOCK], v[COSSD_STATE_BLOCK];
    for (size_t b0 = 0, blk = 0; b0 < n; b0 += COSSD_STATE_BLOCK, blk++) {
        const unsigned cnt = (unsigned)(n - b0 < COSSD_STATE_BLOCK ? n - b0 : COSSD_STATE_BLOCK);
        const float a_scale = scaled ? as_in[blk] : 0.0f, v_scale = scaled ? vs_in[blk] : 0.0f;
        for (unsigned j = 0; j < cnt; j++)
            lane_step<GF, SF, PF>(grad, mi, ai, a_scale, vi, v_scale, mo, po, b0 + j, k, t, &m[j], &v[j]);
        if (!scaled) {
            for (unsigned j = 0; j < cnt; j++) {
                lane_store_elementwise<SF>(ao, b0 + j, m[j]);
                lane_store_elementwise<SF>(vo, b0 + j, v[j]);
            }
            continue;
        }
        int nf_m = 0, nf_v = 0;
        float amax_m = 0.0f, amax_v = 0.0f;
        for (unsigned j = 0; j < cnt; j++) {
            amax_m = fmaxf(amax_m, q_finite_abs(m[j], &nf_m));
            amax_v = fmaxf(amax_v, q_finite_abs(v[j], &nf_v));
        }
        const qblock_params qm = qblock_params_of(amax_m, nf_m, SF);
        const qblock_params qv = qblock_params_of(amax_v, nf_v, SF);
        unsigned under[2] = {0, 0}, over[2] = {0, 0};
        for (unsigned j = 0; j < cnt; j++) {
            unsigned fm = lane_encode<SF>(ao, b0 + j, m[j], &qm, COSSD_MOMENT_EXP_AVG, t);
            unsigned fv = lane_encode<SF>(vo, b0 + j, v[j], &qv, COSSD_MOMENT_EXP_AVG_SQ, t);
            under[0] += fm & QFLAG_UNDERFLOW;
            over[0] += (fm & QFLAG_OVERFLOW) >> 1;
            under[1] += fv & QFLAG_UNDERFLOW;
            over[1] += (fv & QFLAG_OVERFLOW) >> 1;
        }
        as_out[blk] = qm.stored;
        vs_out[blk] = qv.stored;
        host_count(counts, COSSD_MOMENT_EXP_AVG, &qm, amax_m, cnt, under[0], over[0]);
        host_count(counts, COSSD_MOMENT_EXP_AVG_SQ, &qv, amax_v, cnt, under[1], over[1]);
    }
}

typedef void (*host_blocks_ptr)(const uint16_t *, const float *, const void *, const float *, const void *,
                                const float *, float *, void *, float *, void *, float *, uint16_t *, size_t,
                                const adam_k *, const cossd_q8_tables *, cossd_cuda_counts *);
#define HOST_SF_ROW(GF, PF)                                                                                   \
    { host_blocks<GF, COSSD_STATE_FP32, PF>, host_blocks<GF, COSSD_STATE_BF16, PF>,                           \
      host_blocks<GF, COSSD_STATE_FP16, PF>, host_blocks<GF, COSSD_STATE_INT8, PF> }
static const host_blocks_ptr k_host[2][2][4] = {
    {HOST_SF_ROW(COSSD_HALF_FP16, COSSD_HALF_FP16), HOST_SF_ROW(COSSD_HALF_FP16, COSSD_HALF_BF16)},
    {HOST_SF_ROW(COSSD_HALF_BF16, COSSD_HALF_FP16), HOST_SF_ROW(COSSD_HALF_BF16, COSSD_HALF_BF16)},
};
#undef HOST_SF_ROW

extern "C" {

/* Fills a cossd_q8_tables from the two maps (map[moment][256], from cossd_state_map): the
 * midpoints by the shared q8_midpoint. */
void cossd_cuda_host_tables(const float *maps, cossd_q8_tables *out)
{
    memcpy(out->map, maps, sizeof out->map);
    cossd_q8_tables_fill_mid(out);
}

/* cossd_adam_step_q_counted's contract, on the host, through the kernel's lane functions:
 * host buffers throughout; tables needed for INT8; counts may be NULL. */
int cossd_cuda_host_adam_step_q(const uint16_t *grad, int gfmt, const float *mi, const void *ai, const float *as_in,
                                const void *vi, const float *vs_in, float *mo, void *ao, float *as_out, void *vo,
                                float *vs_out, int sfmt, uint16_t *po, int pfmt, size_t n,
                                const cossd_adam_scalars *s, const cossd_q8_tables *tables,
                                cossd_qstate_counts *counts)
{
    const bool half_ok = (gfmt == COSSD_HALF_FP16 || gfmt == COSSD_HALF_BF16) &&
                         (pfmt == COSSD_HALF_FP16 || pfmt == COSSD_HALF_BF16);
    if (!half_ok || sfmt < COSSD_STATE_FP32 || sfmt > COSSD_STATE_INT8)
        return COSSD_ERR_FORMAT;
    const bool scaled = sfmt == COSSD_STATE_FP16 || sfmt == COSSD_STATE_INT8;
    cossd_cuda_counts c;
    cuda_counts_reset(&c);
    if (n > 0) {
        if (!grad || !mi || !ai || !vi || !mo || !ao || !vo || !po || !s ||
            (scaled && (!as_in || !vs_in || !as_out || !vs_out)) || (sfmt == COSSD_STATE_INT8 && !tables))
            return COSSD_ERR_NULL;
        const adam_k k = adam_load_scalars(s);
        k_host[gfmt][pfmt][sfmt](grad, mi, ai, as_in, vi, vs_in, mo, ao, as_out, vo, vs_out, po, n, &k, tables, &c);
    }
    if (counts)
        cuda_counts_finish(&c, counts);
    return COSSD_OK;
}

} /* extern "C" */
