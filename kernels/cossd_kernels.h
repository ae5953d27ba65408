/* cossd_kernels.h: public C declarations of the stateless cossd kernels (Adam step, conversions, counts, CRC32C). */
#ifndef COSSD_KERNELS_H
#define COSSD_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Everything between the two CDEF markers is fed verbatim to cffi's cdef(),
 * so it must stay within the subset cffi parses: integer #defines, plain
 * typedefs and prototypes (no other preprocessor lines, no expressions).
 */
/* BEGIN CDEF */

/* 16-bit storage formats ("half" buffers are raw uint16_t bit patterns). */
#define COSSD_HALF_FP16 0
#define COSSD_HALF_BF16 1

/* Gradient formats: the two half formats above, FP32 (float, 4 bytes an element) and the
 * two OCP FP8 formats (one byte an element; decoded exactly, the per-tensor scale being the
 * caller's grad_scale). A gradient buffer is `const void *` of grad_fmt's element width. */
#define COSSD_GRAD_FP32 2
#define COSSD_GRAD_FP8_E4M3 3
#define COSSD_GRAD_FP8_E5M2 4

/* Moment (exp_avg / exp_avg_sq) storage formats. FP32 and BF16 are elementwise; FP16 (IEEE
 * binary16 codes with a power-of-two scale per block) and INT8 (codes into a dynamic map with
 * an FP32 absmax per block) keep one FP32 scale per COSSD_STATE_BLOCK elements beside the
 * codes, and step through cossd_adam_step_q. */
#define COSSD_STATE_FP32 0
#define COSSD_STATE_BF16 1
#define COSSD_STATE_FP16 2
#define COSSD_STATE_INT8 3
#define COSSD_STATE_BLOCK 256

/* Which moment a block-scaled buffer holds: INT8 uses the signed map for exp_avg and the
 * unsigned one for exp_avg_sq. */
#define COSSD_MOMENT_EXP_AVG 0
#define COSSD_MOMENT_EXP_AVG_SQ 1

/* Return codes of the int-returning kernels. */
#define COSSD_OK 0
#define COSSD_ERR_NULL -1
#define COSSD_ERR_FORMAT -2
#define COSSD_ERR_UNSUPPORTED -3

/* SIMD levels, lowest to highest (cossd_simd_level / cossd_set_simd_level). */
#define COSSD_SIMD_SCALAR 0
#define COSSD_SIMD_AVX2 1
#define COSSD_SIMD_AVX512 2

typedef struct {
    float grad_scale;
    float beta1;
    float beta2;
    float one_minus_beta1;
    float one_minus_beta2;
    float eps;
    float step_size;
    float bias_correction2_sqrt;
    float decay;
    float weight_decay;
    int decoupled;
} cossd_adam_scalars;

int cossd_adam_step(const void *grad, int grad_fmt, const float *master_in,
                    const void *exp_avg_in, const void *exp_avg_sq_in,
                    float *master_out, void *exp_avg_out, void *exp_avg_sq_out,
                    int state_fmt, uint16_t *param_out, int param_fmt, size_t n,
                    const cossd_adam_scalars *s);
int cossd_adam_step_scalar(const void *grad, int grad_fmt, const float *master_in,
                           const void *exp_avg_in, const void *exp_avg_sq_in,
                           float *master_out, void *exp_avg_out, void *exp_avg_sq_out,
                           int state_fmt, uint16_t *param_out, int param_fmt, size_t n,
                           const cossd_adam_scalars *s);
int cossd_adam_step_avx2(const void *grad, int grad_fmt, const float *master_in,
                         const void *exp_avg_in, const void *exp_avg_sq_in,
                         float *master_out, void *exp_avg_out, void *exp_avg_sq_out,
                         int state_fmt, uint16_t *param_out, int param_fmt, size_t n,
                         const cossd_adam_scalars *s);
int cossd_adam_step_avx512(const void *grad, int grad_fmt, const float *master_in,
                           const void *exp_avg_in, const void *exp_avg_sq_in,
                           float *master_out, void *exp_avg_out, void *exp_avg_sq_out,
                           int state_fmt, uint16_t *param_out, int param_fmt, size_t n,
                           const cossd_adam_scalars *s);

/* Returns the count of inf/NaN elements of a gradient in any COSSD_GRAD_* format (FP8 E4M3
 * has no inf: its NaNs), or (size_t)-1 on bad arguments. */
size_t cossd_count_nonfinite(const void *grad, int fmt, size_t n);
size_t cossd_count_nonfinite_scalar(const void *grad, int fmt, size_t n);
size_t cossd_count_nonfinite_avx2(const void *grad, int fmt, size_t n);
size_t cossd_count_nonfinite_avx512(const void *grad, int fmt, size_t n);
/* Copies n gradient elements from src (memory that may change meanwhile) into dst and returns
 * the count of dst's inf/NaN elements, or (size_t)-1 on bad arguments. */
size_t cossd_copy_count_nonfinite(const void *src, void *dst, int fmt, size_t n);

int cossd_master_to_param(const float *master, uint16_t *param_out, int param_fmt, size_t n);
int cossd_master_to_param_scalar(const float *master, uint16_t *param_out, int param_fmt, size_t n);
int cossd_master_to_param_avx2(const float *master, uint16_t *param_out, int param_fmt, size_t n);
int cossd_master_to_param_avx512(const float *master, uint16_t *param_out, int param_fmt, size_t n);

int cossd_param_to_master(const uint16_t *param, int param_fmt, float *master_out, size_t n);
int cossd_param_to_master_scalar(const uint16_t *param, int param_fmt, float *master_out, size_t n);
int cossd_param_to_master_avx2(const uint16_t *param, int param_fmt, float *master_out, size_t n);
int cossd_param_to_master_avx512(const uint16_t *param, int param_fmt, float *master_out, size_t n);

uint32_t cossd_crc32c(uint32_t crc, const void *buf, size_t len);
uint32_t cossd_crc32c_scalar(uint32_t crc, const void *buf, size_t len);
uint32_t cossd_crc32c_sse42(uint32_t crc, const void *buf, size_t len);

/* CRC32C of A followed by B, from the CRC of each and the length of B. */
uint32_t cossd_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

/* The CRC32C of each `block`-byte piece of buf (the last one may be shorter) into out, which
   holds ceil(len / block) values: many checksums in one call, with Python's lock released. */
void cossd_crc32c_blocks(const void *buf, size_t len, size_t block, uint32_t *out);

/* An Adam step out of place (outputs must not overlap inputs) that also returns the CRC32C
 * of its outputs as the device checksums a block: master_out, exp_avg_out, exp_avg_sq_out
 * and param_out, in that order, from 0. One pass: each chunk's outputs are checksummed in
 * cache and then written with streaming stores. */
int cossd_adam_step_crc(const void *grad, int grad_fmt, const float *master_in,
                        const void *exp_avg_in, const void *exp_avg_sq_in,
                        float *master_out, void *exp_avg_out, void *exp_avg_sq_out,
                        int state_fmt, uint16_t *param_out, int param_fmt, size_t n,
                        const cossd_adam_scalars *s, uint32_t *crc_out);

/* cossd_adam_step_crc that also stores the params into param_copy (NULL: nowhere), which
 * must not overlap any other buffer: the device hands a step's params to the host this way
 * as it computes them (a controller memory buffer), with no second pass. With nonfinite_out
 * (NULL: not counted) it also counts the gradient's inf/NaN elements, on the AVX-512 path from
 * the very register each element's step used (a gradient in memory the host shares cannot
 * change between the count and its use). With param_crc_out (NULL: not wanted) it also returns
 * the CRC32C of param_out alone, the part of the block checksum a restart verifies before it
 * serves the params (the four parts are computed apart and combined anyway). */
int cossd_adam_step_crc_copy(const void *grad, int grad_fmt, const float *master_in,
                             const void *exp_avg_in, const void *exp_avg_sq_in,
                             float *master_out, void *exp_avg_out, void *exp_avg_sq_out,
                             int state_fmt, uint16_t *param_out, uint16_t *param_copy, int param_fmt,
                             size_t n, const cossd_adam_scalars *s, uint32_t *crc_out,
                             uint32_t *param_crc_out, size_t *nonfinite_out);

/* cossd_adam_step_crc_copy for a gradient in memory its lender may change meanwhile (a
 * controller memory buffer): each round copies the next 4096 elements into memory of its
 * own, counts their inf/NaN elements there and steps that copy, so every element is read once
 * and what is counted is what is stepped. The first non-finite element ends the stepping: the
 * block is lost (*crc_out and *param_crc_out 0), the rounds before it have written their
 * outputs (*stepped_out: the elements stepped, n for a finite block), and the rest is only
 * counted. nonfinite_out and stepped_out are required. */
int cossd_adam_step_crc_lent(const void *grad, int grad_fmt, const float *master_in,
                             const void *exp_avg_in, const void *exp_avg_sq_in,
                             float *master_out, void *exp_avg_out, void *exp_avg_sq_out,
                             int state_fmt, uint16_t *param_out, uint16_t *param_copy, int param_fmt,
                             size_t n, const cossd_adam_scalars *s, uint32_t *crc_out,
                             uint32_t *param_crc_out, size_t *nonfinite_out, size_t *stepped_out);

/* Adam step over block-scaled moments (any state_fmt; FP32 and BF16 ignore the scales and run
 * cossd_adam_step). exp_avg_* and exp_avg_sq_* hold n codes (uint16_t for FP16, uint8_t for
 * INT8); *_scale_* hold one float per COSSD_STATE_BLOCK elements, ceil(n / COSSD_STATE_BLOCK),
 * the first for elements 0..255. One pass per block: decode, step, then choose the block's new
 * scale from its new values and encode. Outputs may be their inputs (in place), as in
 * cossd_adam_step. */
int cossd_adam_step_q(const void *grad, int grad_fmt, const float *master_in,
                      const void *exp_avg_in, const float *exp_avg_scale_in,
                      const void *exp_avg_sq_in, const float *exp_avg_sq_scale_in,
                      float *master_out, void *exp_avg_out, float *exp_avg_scale_out,
                      void *exp_avg_sq_out, float *exp_avg_sq_scale_out,
                      int state_fmt, uint16_t *param_out, int param_fmt, size_t n,
                      const cossd_adam_scalars *s);
int cossd_adam_step_q_scalar(const void *grad, int grad_fmt, const float *master_in,
                             const void *exp_avg_in, const float *exp_avg_scale_in,
                             const void *exp_avg_sq_in, const float *exp_avg_sq_scale_in,
                             float *master_out, void *exp_avg_out, float *exp_avg_scale_out,
                             void *exp_avg_sq_out, float *exp_avg_sq_scale_out,
                             int state_fmt, uint16_t *param_out, int param_fmt, size_t n,
                             const cossd_adam_scalars *s);
int cossd_adam_step_q_avx2(const void *grad, int grad_fmt, const float *master_in,
                           const void *exp_avg_in, const float *exp_avg_scale_in,
                           const void *exp_avg_sq_in, const float *exp_avg_sq_scale_in,
                           float *master_out, void *exp_avg_out, float *exp_avg_scale_out,
                           void *exp_avg_sq_out, float *exp_avg_sq_scale_out,
                           int state_fmt, uint16_t *param_out, int param_fmt, size_t n,
                           const cossd_adam_scalars *s);
int cossd_adam_step_q_avx512(const void *grad, int grad_fmt, const float *master_in,
                             const void *exp_avg_in, const float *exp_avg_scale_in,
                             const void *exp_avg_sq_in, const float *exp_avg_sq_scale_in,
                             float *master_out, void *exp_avg_out, float *exp_avg_scale_out,
                             void *exp_avg_sq_out, float *exp_avg_sq_scale_out,
                             int state_fmt, uint16_t *param_out, int param_fmt, size_t n,
                             const cossd_adam_scalars *s);

/* FP32 moments into a state format's codes and per-block scales (as the step encodes them),
 * and back (exact for FP16 and INT8: a code times its scale). moment is COSSD_MOMENT_*. For
 * FP32 and BF16 the scales are not touched (may be NULL). */
int cossd_state_encode(const float *x, size_t n, int state_fmt, int moment, void *codes_out,
                       float *scales_out);
int cossd_state_decode(const void *codes, const float *scales, size_t n, int state_fmt, int moment,
                       float *out);
/* The INT8 map of a moment (256 floats, ascending). A stored byte indexes it directly for
 * exp_avg_sq and XORed with 0x80 for exp_avg (whose zero is at index 128). */
int cossd_state_map(int moment, float *out);

/* FP8 params out (fp8_param.c): the largest |x[i]| (NaNs passed over; 0 for n == 0), and
 * x[i] * scale as OCP FP8 codes of fmt (COSSD_GRAD_FP8_E4M3 or _E5M2), round to nearest even,
 * saturating at the largest finite value (inf too; NaN stays NaN). counts_out[0] gets the
 * overflows (saturated), counts_out[1] the underflows (a nonzero x[i] whose code is zero). */
float cossd_absmax_f32(const float *x, size_t n);
int cossd_fp8_encode(const float *x, size_t n, float scale, int fmt, uint8_t *codes_out, uint64_t *counts_out);

int cossd_simd_available(void);
int cossd_avx512_available(void);
int cossd_crc_simd_available(void);
/* 1 where CRC32C folds by carry-less multiplication (VPCLMULQDQ with AVX-512) at the avx512 level. */
int cossd_crc_fold_available(void);
void cossd_set_simd(int enabled);
int cossd_simd_active(void);
int cossd_simd_level_available(void);
void cossd_set_simd_level(int level);
int cossd_simd_level(void);

/* Streaming (non-temporal) stores in the SIMD Adam paths: used for the write-only outputs
 * (param_out; master/moment outputs that are not their input's memory) of a call whose
 * footprint, n x bytes read and written per element, is at least this many bytes
 * (default 32 MiB). Process-wide; 0 streams every call, SIZE_MAX none. Results are the
 * same bits either way. */
void cossd_set_stream_threshold(size_t bytes);
size_t cossd_stream_threshold(void);

/* Which outputs the `level` path would stream for these buffers (an OR of the bits below; 0
 * for the scalar path or a level this CPU lacks). For tests and benchmarks. */
#define COSSD_STREAM_MASTER 1
#define COSSD_STREAM_EXP_AVG 2
#define COSSD_STREAM_EXP_AVG_SQ 4
#define COSSD_STREAM_PARAM 8
unsigned cossd_adam_stream_plan(int level, const float *master_in, const void *exp_avg_in,
                                const void *exp_avg_sq_in, float *master_out, void *exp_avg_out,
                                void *exp_avg_sq_out, int state_fmt, uint16_t *param_out, size_t n);

/* Memory roofline probe: the Adam step's eight streams (grad, master, m, v in; master, m, v,
 * param out; 28 bytes per element) with trivial arithmetic, so its speed is what the memory
 * system allows for that access pattern. In place like the step. Used by `cossd bench`. */
void cossd_stream_probe(uint16_t *grad_param, float *master, float *exp_avg, float *exp_avg_sq, size_t n);

/* The same streams out of place, the outputs with streaming stores where aligned, as the
 * device's block update writes its shadow copy: what memory allows an A/B update. */
void cossd_stream_probe_out_of_place(const uint16_t *grad, const float *master, const float *exp_avg,
                                     const float *exp_avg_sq, float *master_out, float *exp_avg_out,
                                     float *exp_avg_sq_out, uint16_t *param_out, size_t n);

/* END CDEF */

#ifdef __cplusplus
}
#endif

#endif /* COSSD_KERNELS_H */
