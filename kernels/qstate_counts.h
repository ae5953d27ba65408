/* qstate_counts.h: public C declarations of the block-scaled moment formats' counters (underflow, overflow, the range of block scales) and the step that fills them. */
#ifndef COSSD_QSTATE_COUNTS_H
#define COSSD_QSTATE_COUNTS_H

#include <stddef.h>
#include <stdint.h>

#include "cossd_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* BEGIN CDEF */

/* What one step's encoders saw, per moment (index COSSD_MOMENT_*), over the elements of the
 * call. underflow: nonzero new values whose code is zero (exp_avg_sq: would be; it is raised to
 * the smallest positive code, which keeps it positive but not its value). overflow: elements
 * whose code decodes to a non-finite value (FP16: inf/NaN codes; INT8: every element of a block
 * holding a non-finite value). scale_min/scale_max: the least and greatest scale stored
 * (FP16: the decode factor 2^-k; INT8: the absmax) over the blocks with a nonzero finite
 * largest value, scaled_blocks of them (0: min and max are 0). */
typedef struct {
    uint64_t underflow[2];
    uint64_t overflow[2];
    uint64_t scaled_blocks[2];
    float scale_min[2];
    float scale_max[2];
} cossd_qstate_counts;

/* cossd_adam_step_q, filling *counts (overwritten) from the encoders' own pass: the same bits
 * on every SIMD level, counts included. counts may be NULL. */
int cossd_adam_step_q_counted(const void *grad, int grad_fmt, const float *master_in,
                              const void *exp_avg_in, const float *exp_avg_scale_in,
                              const void *exp_avg_sq_in, const float *exp_avg_sq_scale_in,
                              float *master_out, void *exp_avg_out, float *exp_avg_scale_out,
                              void *exp_avg_sq_out, float *exp_avg_sq_scale_out,
                              int state_fmt, uint16_t *param_out, int param_fmt, size_t n,
                              const cossd_adam_scalars *s, cossd_qstate_counts *counts);

/* END CDEF */

#ifdef __cplusplus
}
#endif

#endif /* COSSD_QSTATE_COUNTS_H */
