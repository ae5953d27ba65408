/* adam_step.h: the C interface of the CUDA Adam step (adam_step.cu): the launcher, its device-side counters and their conversion to cossd_qstate_counts. */
#ifndef COSSD_CUDA_ADAM_STEP_H
#define COSSD_CUDA_ADAM_STEP_H

#include <stddef.h>
#include <stdint.h>

#include <string.h>

#include "../cossd_elem.h"
#include "../cossd_kernels.h"
#include "../qstate_counts.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A CUDA launch or runtime call failed (cudaGetLastError's code is in *cuda_error_out). */
#define COSSD_ERR_CUDA -4

/* The counters as the kernel accumulates them on the device: sums by atomicAdd, the scales'
 * range by atomicMin/atomicMax on their bits (positive floats order as their bits do).
 * cossd_cuda_counts_reset sets them before a step, cossd_cuda_counts_finish turns a host copy
 * into the C kernels' cossd_qstate_counts. */
typedef struct {
    unsigned long long underflow[2];
    unsigned long long overflow[2];
    unsigned long long scaled_blocks[2];
    unsigned int scale_min_bits[2];
    unsigned int scale_max_bits[2];
} cossd_cuda_counts;

/* Inline for the host harness (host_step.cu), exported by adam_step.cu for the loader. */
static inline void cuda_counts_reset(cossd_cuda_counts *c)
{
    memset(c, 0, sizeof *c);
    c->scale_min_bits[0] = c->scale_min_bits[1] = 0xFFFFFFFFu; /* above every float's bits */
}

static inline void cuda_counts_finish(const cossd_cuda_counts *c, cossd_qstate_counts *out)
{
    for (int m = 0; m < 2; m++) {
        out->underflow[m] = c->underflow[m];
        out->overflow[m] = c->overflow[m];
        out->scaled_blocks[m] = c->scaled_blocks[m];
        out->scale_min[m] = c->scaled_blocks[m] ? f32_from_bits(c->scale_min_bits[m]) : 0.0f;
        out->scale_max[m] = c->scaled_blocks[m] ? f32_from_bits(c->scale_max_bits[m]) : 0.0f;
    }
}

void cossd_cuda_counts_reset(cossd_cuda_counts *host_counts);
void cossd_cuda_counts_finish(const cossd_cuda_counts *host_counts, cossd_qstate_counts *out);

/* Fills a cossd_q8_tables (host memory, 4 KiB: each moment's map, then its midpoints) from
 * maps[moment][256] (cossd_state_map's), the midpoints by cossd_elem.h's q8_midpoint; the
 * caller copies it to the device. */
void cossd_cuda_tables(const float *maps, void *out);

/* cossd_adam_step_q_counted on the GPU. Every buffer pointer is device memory (tables too: a
 * cossd_q8_tables, needed for INT8 only; counts: a cossd_cuda_counts already reset, or NULL);
 * s is host memory. The launch is asynchronous on `stream` (a cudaStream_t; NULL: the default
 * stream). Returns COSSD_OK, COSSD_ERR_FORMAT, COSSD_ERR_NULL (nothing launched), or
 * COSSD_ERR_CUDA with the CUDA error code in *cuda_error_out (may be NULL). */
int cossd_cuda_adam_step_q(const uint16_t *grad, int grad_fmt, const float *master_in, const void *exp_avg_in,
                           const float *exp_avg_scale_in, const void *exp_avg_sq_in, const float *exp_avg_sq_scale_in,
                           float *master_out, void *exp_avg_out, float *exp_avg_scale_out, void *exp_avg_sq_out,
                           float *exp_avg_sq_scale_out, int state_fmt, uint16_t *param_out, int param_fmt, size_t n,
                           const cossd_adam_scalars *s, const void *tables, cossd_cuda_counts *counts, void *stream,
                           int *cuda_error_out);

#ifdef __cplusplus
}
#endif

#endif /* COSSD_CUDA_ADAM_STEP_H */
