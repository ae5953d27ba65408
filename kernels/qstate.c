/* qstate.c: the block-scaled moment formats (FP16 with a scale per block, INT8 with a dynamic map and an absmax per block): the maps, the scalar step kernel, the step's entry points, and encode/decode for readers and writers of the state. */

#include <stdlib.h>

#include "cossd_internal.h"
#include "qstate_scalar.h"

COSSD_HIDDEN float g_qmap[2][256] __attribute__((aligned(64)));
COSSD_HIDDEN float g_qmid[2][256] __attribute__((aligned(64)));
COSSD_HIDDEN float g_qprobe[2][QPROBE_LEVELS][128] __attribute__((aligned(64)));

/*
 * The INT8 maps, a dynamic construction: a code spends more of its bits on the fraction the
 * nearer its value is to the block's absmax, and on the exponent the further away. Decade z
 * (values in (10^-(z+1), 10^-z]) gets half the codes of decade z-1, spaced linearly:
 *   unsigned (exp_avg_sq): 0, then decades 0..7 with 128, 64, ..., 1 codes (255), down to 1e-7;
 *   signed (exp_avg): 0, decades 0..6 with 64, ..., 1 codes on each side (127 each), and one
 *   more negative code at -1e-7 so that the table has 256 entries with its zero at index 128
 *   (the stored byte, index ^ 0x80, is then an int8 whose zero is 0).
 * Within decade z the j-th code (j = 0 first) is 10^-z * (1 - 0.9 j / count): 1.0 is a code, so
 * each block's largest element is stored exactly. Relative step: 0.7% near 1, 6.3% at the
 * bottom of decade 0 (bitsandbytes' dynamic map has the same shape; this table is built from
 * that description, not from its code).
 */
static int decade_values(float *out, int decades, int first_count)
{
    int n = 0;
    double top = 1.0;
    for (int z = 0, count = first_count; z < decades; z++, count /= 2, top /= 10.0)
        for (int j = 0; j < count; j++)
            out[n++] = (float)(top * (1.0 - 0.9 * j / count));
    return n;
}

static int ascending(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

void cossd_qmap_init(void)
{
    float *u = g_qmap[COSSD_MOMENT_EXP_AVG_SQ];
    u[0] = 0.0f;
    decade_values(u + 1, 8, 128); /* 255 positive values */
    float *sgn = g_qmap[COSSD_MOMENT_EXP_AVG];
    float pos[128];
    int np = decade_values(pos, 7, 64); /* 127 */
    int n = 0;
    for (int i = 0; i < np; i++)
        sgn[n++] = -pos[i];
    sgn[n++] = -1e-7f;
    sgn[n++] = 0.0f;
    for (int i = 0; i < np; i++)
        sgn[n++] = pos[i];
    for (int m = 0; m < 2; m++) {
        qsort(g_qmap[m], 256, sizeof(float), ascending);
        for (int i = 0; i < 255; i++)
            g_qmid[m][i] = q8_midpoint(g_qmap[m][i], g_qmap[m][i + 1]); /* cossd_elem.h, as the CUDA tables */
        g_qmid[m][255] = INFINITY; /* never probed: the search reads entries 0..254 */
        for (int level = 0; level < QPROBE_LEVELS; level++) {
            int step = 128 >> level;
            for (int j = 0; j < 128; j++)
                g_qprobe[m][level][j] = j * 2 * step < 256 ? g_qmid[m][j * 2 * step + step - 1] : INFINITY;
        }
    }
}

/* ---- The step, scalar ----------------------------------------------------- */

void adamq_kernel_scalar(const void *grad, int gfmt, const float *mi, const void *ai, const float *as_in,
                         const void *vi, const float *vs_in, float *mo, void *ao, float *as_out, void *vo,
                         float *vs_out, int sfmt, uint16_t *po, int pfmt, size_t n, const adam_k *k,
                         cossd_qstate_counts *counts)
{
    float mbuf[COSSD_STATE_BLOCK], vbuf[COSSD_STATE_BLOCK];
    for (size_t b0 = 0; b0 < n; b0 += QBLOCK) {
        size_t cnt = n - b0 < QBLOCK ? n - b0 : QBLOCK, blk = b0 / QBLOCK;
        /* Read both scales before anything of this block is written: in place, as_out is as_in. */
        float a_scale = as_in[blk], v_scale = vs_in[blk];
        for (size_t j = 0; j < cnt; j++)
            adamq_elem(grad, gfmt, mi, ai, a_scale, vi, v_scale, mo, sfmt, po, pfmt, b0 + j, k, &mbuf[j], &vbuf[j]);
        q_encode_block_scalar(mbuf, cnt, sfmt, COSSD_MOMENT_EXP_AVG, ao, b0, &as_out[blk], counts);
        q_encode_block_scalar(vbuf, cnt, sfmt, COSSD_MOMENT_EXP_AVG_SQ, vo, b0, &vs_out[blk], counts);
    }
}

static adamq_kernel_fn *const adamq_kernels[COSSD_SIMD_AVX512 + 1] = {
    [COSSD_SIMD_SCALAR] = adamq_kernel_scalar,
#if COSSD_X86
    [COSSD_SIMD_AVX2] = adamq_kernel_avx2,
    [COSSD_SIMD_AVX512] = adamq_kernel_avx512,
#endif
};

static int adam_step_q_at(int level, const void *grad, int grad_fmt, const float *master_in,
                          const void *exp_avg_in, const float *as_in, const void *exp_avg_sq_in, const float *vs_in,
                          float *master_out, void *exp_avg_out, float *as_out, void *exp_avg_sq_out, float *vs_out,
                          int state_fmt, uint16_t *param_out, int param_fmt, size_t n, const cossd_adam_scalars *s,
                          cossd_qstate_counts *counts)
{
    cossd_qstate_counts scratch; /* where the counts go when the caller wants none */
    memset(&scratch, 0, sizeof scratch);
    if (counts)
        *counts = scratch;
    if (state_fmt_ok(state_fmt)) { /* elementwise moments: no scales; the level's own entry checks the rest */
        switch (level) {
        case COSSD_SIMD_AVX2:
            return cossd_adam_step_avx2(grad, grad_fmt, master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out,
                                        exp_avg_sq_out, state_fmt, param_out, param_fmt, n, s);
        case COSSD_SIMD_AVX512:
            return cossd_adam_step_avx512(grad, grad_fmt, master_in, exp_avg_in, exp_avg_sq_in, master_out,
                                          exp_avg_out, exp_avg_sq_out, state_fmt, param_out, param_fmt, n, s);
        default:
            return cossd_adam_step_scalar(grad, grad_fmt, master_in, exp_avg_in, exp_avg_sq_in, master_out,
                                          exp_avg_out, exp_avg_sq_out, state_fmt, param_out, param_fmt, n, s);
        }
    }
    if (!grad_fmt_ok(grad_fmt) || !half_fmt_ok(param_fmt) || !qstate_fmt(state_fmt))
        return COSSD_ERR_FORMAT;
    if (n > 0 && (!grad || !master_in || !exp_avg_in || !as_in || !exp_avg_sq_in || !vs_in || !master_out ||
                  !exp_avg_out || !as_out || !exp_avg_sq_out || !vs_out || !param_out || !s))
        return COSSD_ERR_NULL;
    if (!cossd_level_present(level))
        return COSSD_ERR_UNSUPPORTED;
    if (n > 0) {
        adam_k k = adam_load_scalars(s);
        adamq_kernels[level](grad, grad_fmt, master_in, exp_avg_in, as_in, exp_avg_sq_in, vs_in, master_out,
                             exp_avg_out, as_out, exp_avg_sq_out, vs_out, state_fmt, param_out, param_fmt, n, &k,
                             counts ? counts : &scratch);
    }
    return COSSD_OK;
}

#define ADAM_STEP_Q_ENTRY(name, level)                                                                       \
    int name(const void *grad, int grad_fmt, const float *master_in, const void *exp_avg_in,             \
             const float *as_in, const void *exp_avg_sq_in, const float *vs_in, float *master_out,           \
             void *exp_avg_out, float *as_out, void *exp_avg_sq_out, float *vs_out, int state_fmt,           \
             uint16_t *param_out, int param_fmt, size_t n, const cossd_adam_scalars *s)                       \
    {                                                                                                        \
        return adam_step_q_at(level, grad, grad_fmt, master_in, exp_avg_in, as_in, exp_avg_sq_in, vs_in,     \
                              master_out, exp_avg_out, as_out, exp_avg_sq_out, vs_out, state_fmt, param_out, \
                              param_fmt, n, s, NULL);                                                        \
    }

ADAM_STEP_Q_ENTRY(cossd_adam_step_q_scalar, COSSD_SIMD_SCALAR)
ADAM_STEP_Q_ENTRY(cossd_adam_step_q_avx2, COSSD_SIMD_AVX2)
ADAM_STEP_Q_ENTRY(cossd_adam_step_q_avx512, COSSD_SIMD_AVX512)
ADAM_STEP_Q_ENTRY(cossd_adam_step_q, simd_level_now())

int cossd_adam_step_q_counted(const void *grad, int grad_fmt, const float *master_in, const void *exp_avg_in,
                              const float *as_in, const void *exp_avg_sq_in, const float *vs_in, float *master_out,
                              void *exp_avg_out, float *as_out, void *exp_avg_sq_out, float *vs_out, int state_fmt,
                              uint16_t *param_out, int param_fmt, size_t n, const cossd_adam_scalars *s,
                              cossd_qstate_counts *counts)
{
    return adam_step_q_at(simd_level_now(), grad, grad_fmt, master_in, exp_avg_in, as_in, exp_avg_sq_in, vs_in,
                          master_out, exp_avg_out, as_out, exp_avg_sq_out, vs_out, state_fmt, param_out, param_fmt, n,
                          s, counts);
}

/* ---- Encode and decode, for the state's readers and writers ------------- */

static int moment_ok(int moment) { return moment == COSSD_MOMENT_EXP_AVG || moment == COSSD_MOMENT_EXP_AVG_SQ; }

int cossd_state_encode(const float *x, size_t n, int state_fmt, int moment, void *codes_out, float *scales_out)
{
    if (!any_state_fmt(state_fmt) || !moment_ok(moment))
        return COSSD_ERR_FORMAT;
    if (n > 0 && (!x || !codes_out || (qstate_fmt(state_fmt) && !scales_out)))
        return COSSD_ERR_NULL;
    cossd_qstate_counts unused; /* a writer's encode reports nothing */
    memset(&unused, 0, sizeof unused);
    for (size_t b0 = 0; b0 < n; b0 += QBLOCK) {
        size_t cnt = n - b0 < QBLOCK ? n - b0 : QBLOCK;
        if (state_fmt == COSSD_STATE_FP32)
            memmove((float *)codes_out + b0, x + b0, cnt * sizeof(float));
        else if (state_fmt == COSSD_STATE_BF16)
            for (size_t j = b0; j < b0 + cnt; j++)
                ((uint16_t *)codes_out)[j] = f32_to_bf16(canon_nan(x[j]));
        else
            q_encode_block_scalar(x + b0, cnt, state_fmt, moment, codes_out, b0, &scales_out[b0 / QBLOCK], &unused);
    }
    return COSSD_OK;
}

int cossd_state_decode(const void *codes, const float *scales, size_t n, int state_fmt, int moment, float *out)
{
    if (!any_state_fmt(state_fmt) || !moment_ok(moment))
        return COSSD_ERR_FORMAT;
    if (n > 0 && (!codes || !out || (qstate_fmt(state_fmt) && !scales)))
        return COSSD_ERR_NULL;
    for (size_t i = 0; i < n; i++) {
        if (state_fmt == COSSD_STATE_FP32)
            out[i] = ((const float *)codes)[i];
        else if (state_fmt == COSSD_STATE_BF16)
            out[i] = bf16_to_f32(((const uint16_t *)codes)[i]);
        else
            out[i] = q_decode(codes, i, scales[i / QBLOCK], state_fmt, moment);
    }
    return COSSD_OK;
}

int cossd_state_map(int moment, float *out)
{
    if (!moment_ok(moment))
        return COSSD_ERR_FORMAT;
    if (!out)
        return COSSD_ERR_NULL;
    memcpy(out, g_qmap[moment], sizeof g_qmap[moment]);
    return COSSD_OK;
}
