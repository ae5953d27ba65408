/* simd_kernels.h: the per-ISA kernel table entries (adam_kernel_<isa>, m2p_kernel_<isa>, p2m_kernel_<isa>), defined once for the ISA simd.h was included for. */

#ifndef COSSD_SIMD_KERNELS_H
#define COSSD_SIMD_KERNELS_H

void SIMD_KERNEL(adam_kernel)(const void *grad, int gfmt, const float *mi, const void *ai, const void *vi,
                              float *mo, void *ao, void *vo, int sfmt, uint16_t *po, int pfmt, size_t n,
                              const adam_k *k)
{
    adam_simd(grad, gfmt, mi, ai, vi, mo, ao, vo, sfmt, po, pfmt, n, k);
}

/* One loop per format, each with the format a constant. */
void SIMD_KERNEL(m2p_kernel)(const float *master, uint16_t *param_out, int fmt, size_t n)
{
    if (fmt == COSSD_HALF_BF16)
        m2p_body(master, param_out, COSSD_HALF_BF16, n);
    else
        m2p_body(master, param_out, COSSD_HALF_FP16, n);
}

void SIMD_KERNEL(p2m_kernel)(const uint16_t *param, int fmt, float *master_out, size_t n)
{
    if (fmt == COSSD_HALF_BF16)
        p2m_body(param, COSSD_HALF_BF16, master_out, n);
    else
        p2m_body(param, COSSD_HALF_FP16, master_out, n);
}

#endif /* COSSD_SIMD_KERNELS_H */
