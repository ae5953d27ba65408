/* convert.c: the master (FP32) <-> param (FP16/BF16) conversions: entry points per level and dispatching, and the scalar loops. */

#include "cossd_internal.h"

float cossd_fp8_lut[2][256];

void cossd_fp8_init(void)
{
    for (int code = 0; code < 256; code++) {
        cossd_fp8_lut[0][code] = fp8_decode((uint8_t)code, COSSD_GRAD_FP8_E4M3);
        cossd_fp8_lut[1][code] = fp8_decode((uint8_t)code, COSSD_GRAD_FP8_E5M2);
    }
}

void m2p_kernel_scalar(const float *master, uint16_t *param_out, int fmt, size_t n)
{
    for (size_t i = 0; i < n; i++)
        param_out[i] = f32_to_half(master[i], fmt);
}

void p2m_kernel_scalar(const uint16_t *param, int fmt, float *master_out, size_t n)
{
    for (size_t i = 0; i < n; i++)
        master_out[i] = half_to_f32(param[i], fmt);
}

/* Indexed by COSSD_SIMD_* level; NULL where this build has no such path. */
static m2p_kernel_fn *const m2p_kernels[COSSD_SIMD_AVX512 + 1] = {
    [COSSD_SIMD_SCALAR] = m2p_kernel_scalar,
#if COSSD_X86
    [COSSD_SIMD_AVX2] = m2p_kernel_avx2,
    [COSSD_SIMD_AVX512] = m2p_kernel_avx512,
#endif
};

static p2m_kernel_fn *const p2m_kernels[COSSD_SIMD_AVX512 + 1] = {
    [COSSD_SIMD_SCALAR] = p2m_kernel_scalar,
#if COSSD_X86
    [COSSD_SIMD_AVX2] = p2m_kernel_avx2,
    [COSSD_SIMD_AVX512] = p2m_kernel_avx512,
#endif
};

/* The argument checks every conversion entry point makes, in the same order: format, then
 * pointers (ignored when n == 0), then whether the chosen ISA exists on this CPU. */
static int conversion_args(const void *in, const void *out, int fmt, size_t n, int level)
{
    if (!half_fmt_ok(fmt))
        return COSSD_ERR_FORMAT;
    if (n > 0 && (!in || !out))
        return COSSD_ERR_NULL;
    if (!cossd_level_present(level))
        return COSSD_ERR_UNSUPPORTED;
    return COSSD_OK;
}

static int master_to_param_at(int level, const float *master, uint16_t *param_out, int param_fmt, size_t n)
{
    int rc = conversion_args(master, param_out, param_fmt, n, level);
    if (rc == COSSD_OK)
        m2p_kernels[level](master, param_out, param_fmt, n);
    return rc;
}

static int param_to_master_at(int level, const uint16_t *param, int param_fmt, float *master_out, size_t n)
{
    int rc = conversion_args(param, master_out, param_fmt, n, level);
    if (rc == COSSD_OK)
        p2m_kernels[level](param, param_fmt, master_out, n);
    return rc;
}

#define CONVERSION_ENTRIES(suffix, level)                                                                    \
    int cossd_master_to_param##suffix(const float *master, uint16_t *param_out, int param_fmt, size_t n)     \
    {                                                                                                        \
        return master_to_param_at(level, master, param_out, param_fmt, n);                                   \
    }                                                                                                        \
    int cossd_param_to_master##suffix(const uint16_t *param, int param_fmt, float *master_out, size_t n)     \
    {                                                                                                        \
        return param_to_master_at(level, param, param_fmt, master_out, n);                                   \
    }

CONVERSION_ENTRIES(_scalar, COSSD_SIMD_SCALAR)
CONVERSION_ENTRIES(_avx2, COSSD_SIMD_AVX2)
CONVERSION_ENTRIES(_avx512, COSSD_SIMD_AVX512)
CONVERSION_ENTRIES(, simd_level_now())
