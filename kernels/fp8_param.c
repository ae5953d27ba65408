/* fp8_param.c: the device's FP8 params out: the absolute maximum of FP32 masters and their encoding to OCP FP8 (E4M3FN, E5M2) times a per-tensor scale, saturating, with overflow and underflow counted. */

#include <math.h>

#include "cossd_internal.h"

float cossd_absmax_f32(const float *x, size_t n)
{
    /* NaNs are passed over (a comparison with NaN is false); an inf makes the result inf. */
    float best = 0.0f;
    if (!x)
        return 0.0f;
    for (size_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (a > best)
            best = a;
    }
    return best;
}

/* One master times the scale as an FP8 code: round to nearest, ties to even, on the
 * format's grid; beyond its largest finite value (or inf) the largest finite value with the
 * sign (an overflow); a nonzero value that rounds to zero keeps its sign (an underflow). The
 * grid's quantum in a binade [2^e, 2^(e+1)) is 2^(e - mbits), in the subnormal range
 * 2^(emin - mbits): a / quantum is exact (a power of two), so nearbyintf does the one rounding. */
static uint8_t fp8_encode_one(float master, float scale, int fmt, uint64_t *overflows, uint64_t *underflows)
{
    const int e5 = fmt == COSSD_GRAD_FP8_E5M2;
    const int mbits = e5 ? 2 : 3;
    const int bias = e5 ? 15 : 7;
    const int emin = 1 - bias;
    const float largest = e5 ? 57344.0f : 448.0f;
    const uint8_t largest_code = e5 ? 0x7Bu : 0x7Eu;
    const float x = master * scale;
    const uint8_t sign = (f32_bits(x) >> 24) & 0x80u;
    float a = fabsf(x);
    if (a != a) /* NaN: E4M3FN's only NaN is S.1111.111; E5M2's quiet NaN is binary16's top byte */
        return sign | (e5 ? 0x7Eu : 0x7Fu);
    if (a > largest) {
        (*overflows)++;
        return sign | largest_code;
    }
    if (a == 0.0f) { /* zero, or a master so small that times the scale it is below float's range */
        if (master != 0.0f)
            (*underflows)++;
        return sign;
    }
    int exponent;
    frexpf(a, &exponent); /* a = f * 2^exponent, f in [0.5, 1): floor(log2 a) = exponent - 1 */
    int e = exponent - 1 < emin ? emin : exponent - 1;
    uint32_t units = (uint32_t)nearbyintf(ldexpf(a, mbits - e)); /* a / 2^(e - mbits), rounded */
    if (units == 0) {
        (*underflows)++;
        return sign;
    }
    if (units < (1u << mbits)) /* subnormal: exponent field 0 (only where e == emin) */
        return sign | (uint8_t)units;
    int field = e + bias;
    if (units >= (2u << mbits)) { /* rounded up into the next binade */
        units >>= 1;
        field++;
    }
    return sign | (uint8_t)((field << mbits) | (units - (1u << mbits)));
}

int cossd_fp8_encode(const float *x, size_t n, float scale, int fmt, uint8_t *codes_out, uint64_t *counts_out)
{
    if (fmt != COSSD_GRAD_FP8_E4M3 && fmt != COSSD_GRAD_FP8_E5M2)
        return COSSD_ERR_FORMAT;
    if (!counts_out || (n > 0 && (!x || !codes_out)))
        return COSSD_ERR_NULL;
    uint64_t overflows = 0, underflows = 0;
    for (size_t i = 0; i < n; i++)
        codes_out[i] = fp8_encode_one(x[i], scale, fmt, &overflows, &underflows);
    counts_out[0] = overflows;
    counts_out[1] = underflows;
    return COSSD_OK;
}
