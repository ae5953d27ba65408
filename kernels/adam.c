/* adam.c: the Adam step's entry points (one per level and the dispatching one), the scalar kernel, the streaming-store plan and the roofline probe. */

#include "cossd_internal.h"

void adam_kernel_scalar(const void *grad, int gfmt, const float *mi, const void *ai, const void *vi, float *mo,
                        void *ao, void *vo, int sfmt, uint16_t *po, int pfmt, size_t n, const adam_k *k)
{
    for (size_t i = 0; i < n; i++)
        adam_elem(grad, gfmt, mi, ai, vi, mo, ao, vo, sfmt, po, pfmt, i, k);
}

/* Indexed by COSSD_SIMD_* level; NULL where this build has no such path (cossd_level_present
 * is 0 there). */
static adam_kernel_fn *const adam_kernels[COSSD_SIMD_AVX512 + 1] = {
    [COSSD_SIMD_SCALAR] = adam_kernel_scalar,
#if COSSD_X86
    [COSSD_SIMD_AVX2] = adam_kernel_avx2,
    [COSSD_SIMD_AVX512] = adam_kernel_avx512,
#endif
};

/* Every entry point of the step: check the arguments, then the CPU (an explicit request for
 * a path must not SIGILL on an old CPU), then run the level's kernel. */
static int adam_step_at(int level, const void *grad, int grad_fmt, const float *master_in,
                        const void *exp_avg_in, const void *exp_avg_sq_in, float *master_out, void *exp_avg_out,
                        void *exp_avg_sq_out, int state_fmt, uint16_t *param_out, int param_fmt, size_t n,
                        const cossd_adam_scalars *s)
{
    int rc = adam_check(grad, grad_fmt, master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out,
                        exp_avg_sq_out, state_fmt, param_out, param_fmt, n, s);
    if (rc != COSSD_OK)
        return rc;
    if (!cossd_level_present(level))
        return COSSD_ERR_UNSUPPORTED;
    if (n > 0) {
        adam_k k = adam_load_scalars(s);
        adam_kernels[level](grad, grad_fmt, master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out,
                            exp_avg_sq_out, state_fmt, param_out, param_fmt, n, &k);
    }
    return COSSD_OK;
}

#define ADAM_STEP_ENTRY(name, level)                                                                         \
    int name(const void *grad, int grad_fmt, const float *master_in, const void *exp_avg_in,             \
             const void *exp_avg_sq_in, float *master_out, void *exp_avg_out, void *exp_avg_sq_out,          \
             int state_fmt, uint16_t *param_out, int param_fmt, size_t n, const cossd_adam_scalars *s)       \
    {                                                                                                        \
        return adam_step_at(level, grad, grad_fmt, master_in, exp_avg_in, exp_avg_sq_in, master_out,        \
                            exp_avg_out, exp_avg_sq_out, state_fmt, param_out, param_fmt, n, s);             \
    }

ADAM_STEP_ENTRY(cossd_adam_step_scalar, COSSD_SIMD_SCALAR)
ADAM_STEP_ENTRY(cossd_adam_step_avx2, COSSD_SIMD_AVX2)
ADAM_STEP_ENTRY(cossd_adam_step_avx512, COSSD_SIMD_AVX512)
ADAM_STEP_ENTRY(cossd_adam_step, simd_level_now())

unsigned cossd_adam_stream_plan(int level, const float *master_in, const void *exp_avg_in,
                                const void *exp_avg_sq_in, float *master_out, void *exp_avg_out,
                                void *exp_avg_sq_out, int state_fmt, uint16_t *param_out, size_t n)
{
    if (!state_fmt_ok(state_fmt))
        return 0;
    /* As adam_body: the vector loop starts after the peel, with the level's vector width. */
    size_t vec_bytes = level == COSSD_SIMD_AVX512 ? 64 : 32;
    if ((level == COSSD_SIMD_AVX512 || level == COSSD_SIMD_AVX2) && cossd_level_present(level))
        return adam_stream_mask(master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out, exp_avg_sq_out,
                                state_fmt, param_out, n, adam_peel(master_out, n, vec_bytes), vec_bytes / 4);
    return 0; /* the scalar path never streams */
}

/* ---- Roofline probe ----------------------------------------------------- */

#define STREAM_PROBE_LOOP                                                                                 \
    for (size_t i = 0; i < n; i++) {                                                                     \
        master[i] += 1.0f;                                                                               \
        exp_avg[i] += 1.0f;                                                                              \
        exp_avg_sq[i] += 1.0f;                                                                           \
        grad_param[i] = (uint16_t)(grad_param[i] ^ 1u);                                                  \
    }

/* Reads 2 + 12 bytes and writes 12 + 2 per element, as an in-place step does (the param
 * output reuses the gradient's stream, which moves the same bytes). Plain loops that -O3
 * vectorizes: with AVX2 where the CPU has it, so the probe is never narrower than the kernel. */
#if COSSD_X86
COSSD_AVX2 static void stream_probe_avx2(uint16_t *grad_param, float *master, float *exp_avg, float *exp_avg_sq,
                                         size_t n)
{
    STREAM_PROBE_LOOP
}
#endif

void cossd_stream_probe(uint16_t *grad_param, float *master, float *exp_avg, float *exp_avg_sq, size_t n)
{
#if COSSD_X86
    if (g_has_avx2) {
        stream_probe_avx2(grad_param, master, exp_avg, exp_avg_sq, n);
        return;
    }
#endif
    STREAM_PROBE_LOOP
}
