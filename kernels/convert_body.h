/* convert_body.h: the FP32 <-> 16-bit conversion loops, written once on simd.h and compiled per ISA (simd_avx2.c, simd_avx512.c). */

#ifndef COSSD_CONVERT_BODY_H
#define COSSD_CONVERT_BODY_H

/* LANES elements per step; the tail is one masked vector where the ISA has masks, else
 * the scalar functions (the same bits either way). `fmt` is a constant in each caller. */
SIMD_FN void m2p_body(const float *master, uint16_t *param_out, int fmt, size_t n)
{
    size_t i = 0;
    for (; i + SIMD_LANES <= n; i += SIMD_LANES)
        SIMD_STOREH(param_out + i, simd_f32_to_half(SIMD_LOADF(master + i), fmt));
#if SIMD_MASKED
    if (i < n) {
        simd_mask km = SIMD_MASK_FIRST(n - i);
        simd_storeh(param_out + i, simd_f32_to_half(simd_loadf(master + i, km, 1), fmt), km, 1);
    }
#else
    for (; i < n; i++)
        param_out[i] = f32_to_half(master[i], fmt);
#endif
}

SIMD_FN void p2m_body(const uint16_t *param, int fmt, float *master_out, size_t n)
{
    size_t i = 0;
    for (; i + SIMD_LANES <= n; i += SIMD_LANES)
        SIMD_STOREF(master_out + i, simd_h_to_f32(SIMD_LOADH(param + i), fmt));
#if SIMD_MASKED
    if (i < n) {
        simd_mask km = SIMD_MASK_FIRST(n - i);
        simd_storef(master_out + i, simd_h_to_f32(simd_loadh(param + i, km, 1), fmt), km, 1);
    }
#else
    for (; i < n; i++)
        master_out[i] = half_to_f32(param[i], fmt);
#endif
}

#endif /* COSSD_CONVERT_BODY_H */
