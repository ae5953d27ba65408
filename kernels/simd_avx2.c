/* simd_avx2.c: the AVX2 + F16C + FMA kernels (Adam step over elementwise and block-scaled moments, conversions), compiled from the bodies written once on simd.h. */

#include "cossd_internal.h"

#if COSSD_X86
#define SIMD_ISA_AVX2 1
#include "simd.h"
#include "adam_body.h"
#include "qstate_scalar.h"
#include "qstate_body.h"
#include "convert_body.h"
#include "simd_kernels.h"
#endif
