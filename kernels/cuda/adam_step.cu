/* adam_step.cu: the AdamW step on the GPU over FP32 master weights and moments in FP32, BF16, FP16 (a power-of-two scale per 256 elements) or INT8 (dynamic map, absmax per 256), one pass per state block: decode, step, encode. */

/*
 * Layout of the work: one thread block of 256 threads per 256-element state block, one
 * element per thread, the thread blocks striding over the state blocks (a grid of at most
 * COSSD_CUDA_MAX_GRID). A state block is exactly one thread block so that its largest |m| and
 * |v| are a warp reduction (__reduce_max_sync on the bits: non-negative floats order as
 * their bits) plus 8 warp results through shared memory, and its encode needs no second
 * launch and no trip through global memory: each thread keeps its new moments in registers
 * between the step and the encode. Loads and stores are coalesced (consecutive threads,
 * consecutive elements). The INT8 tables (4 KiB) are copied into shared memory once per
 * thread block: every lane probes different entries, which the constant cache would
 * serialise.
 *
 * The arithmetic is cossd_elem.h's, through adam_lane.cuh: the same source the C kernels
 * compile. Built with -fmad=false (no contraction into FMAs) and IEEE division and square
 * root (nvcc's defaults), it gives the C kernels' bits; NOT RUN ON A GPU YET (docs/kernels.md,
 * "CUDA").
 *
 * In place: every thread reads its element's inputs (and the block's scales) before the
 * block's first barrier, and the scales are written after it, so outputs may be inputs.
 */

#include <cuda_runtime.h>

#include "adam_lane.cuh"
#include "adam_step.h"

#define COSSD_CUDA_THREADS COSSD_STATE_BLOCK
#define COSSD_CUDA_WARPS (COSSD_CUDA_THREADS / 32)
#define COSSD_CUDA_MAX_GRID 8192

static_assert(COSSD_STATE_BLOCK == 256, "one thread per element of a 256-element state block");

/* The block's largest of the lanes' non-negative values a (every thread gets it). `red` is
 * this reduction's own shared slots; the caller's next barrier orders their reuse. */
__device__ __forceinline__ float block_max_nonneg(float a, unsigned *red)
{
    unsigned bits = __reduce_max_sync(0xFFFFFFFFu, __float_as_uint(a));
    if ((threadIdx.x & 31u) == 0)
        red[threadIdx.x >> 5] = bits;
    __syncthreads();
    unsigned m = red[0];
    for (int w = 1; w < COSSD_CUDA_WARPS; w++)
        m = max(m, red[w]);
    return __uint_as_float(m);
}

/* Thread 0's share of a block's counters for one moment (qcount_block, qcount_flags). */
__device__ __forceinline__ void block_count(cossd_cuda_counts *c, int moment, const qblock_params *q, float amax,
                                            unsigned cnt, unsigned underflows, unsigned overflows)
{
    if (q->poisoned)
        overflows = cnt; /* every element of a poisoned INT8 block decodes to NaN */
    if (underflows)
        atomicAdd(&c->underflow[moment], (unsigned long long)underflows);
    if (overflows)
        atomicAdd(&c->overflow[moment], (unsigned long long)overflows);
    if (qblock_scaled(q, amax)) {
        atomicAdd(&c->scaled_blocks[moment], 1ull);
        atomicMin(&c->scale_min_bits[moment], f32_bits(q->stored));
        atomicMax(&c->scale_max_bits[moment], f32_bits(q->stored));
    }
}

template <int GF, int SF, int PF>
__global__ void __launch_bounds__(COSSD_CUDA_THREADS)
    adam_step_kernel(const uint16_t *__restrict__ grad, const float *mi, const void *ai, const float *as_in,
                     const void *vi, const float *vs_in, float *mo, void *ao, float *as_out, void *vo, float *vs_out,
                     uint16_t *__restrict__ po, size_t n, adam_k k, const cossd_q8_tables *tables,
                     cossd_cuda_counts *counts)
{
    const bool scaled = SF == COSSD_STATE_FP16 || SF == COSSD_STATE_INT8;
    __shared__ cossd_q8_tables s_tables;
    __shared__ unsigned s_red[2][COSSD_CUDA_WARPS];
    const cossd_q8_tables *t = 0;
    if (SF == COSSD_STATE_INT8) {
        const float *src = &tables->map[0][0];
        float *dst = &s_tables.map[0][0];
        for (unsigned e = threadIdx.x; e < sizeof s_tables / sizeof(float); e += COSSD_CUDA_THREADS)
            dst[e] = src[e];
        __syncthreads();
        t = &s_tables;
    }
    const size_t nblocks = (n + COSSD_STATE_BLOCK - 1) / COSSD_STATE_BLOCK;
    for (size_t blk = blockIdx.x; blk < nblocks; blk += gridDim.x) {
        const size_t b0 = blk * COSSD_STATE_BLOCK, i = b0 + threadIdx.x;
        const unsigned cnt = (unsigned)(n - b0 < COSSD_STATE_BLOCK ? n - b0 : COSSD_STATE_BLOCK);
        const bool live = threadIdx.x < cnt;
        float m = 0.0f, v = 0.0f;
        /* A: decode, step; master and param stored, the moments kept in registers. */
        if (live)
            lane_step<GF, SF, PF>(grad, mi, ai, scaled ? as_in[blk] : 0.0f, vi, scaled ? vs_in[blk] : 0.0f, mo, po,
                                  i, &k, t, &m, &v);
        if (!scaled) {
            if (live) {
                lane_store_elementwise<SF>(ao, i, m);
                lane_store_elementwise<SF>(vo, i, v);
            }
            continue;
        }
        /* B: each moment's largest finite |x| and whether it holds a non-finite value. */
        int nf_m = 0, nf_v = 0;
        float am = q_finite_abs(m, &nf_m), av = q_finite_abs(v, &nf_v); /* dead lanes: 0, 0 */
        const int poisoned_m = __syncthreads_or(nf_m), poisoned_v = __syncthreads_or(nf_v);
        const float amax_m = block_max_nonneg(am, s_red[0]);
        const float amax_v = block_max_nonneg(av, s_red[1]);
        const qblock_params qm = qblock_params_of(amax_m, poisoned_m, SF);
        const qblock_params qv = qblock_params_of(amax_v, poisoned_v, SF);
        /* C: encode; then the counts, whose barriers also order s_red's reuse. */
        unsigned fm = 0, fv = 0;
        if (live) {
            fm = lane_encode<SF>(ao, i, m, &qm, COSSD_MOMENT_EXP_AVG, t);
            fv = lane_encode<SF>(vo, i, v, &qv, COSSD_MOMENT_EXP_AVG_SQ, t);
        }
        const unsigned under_m = __syncthreads_count(fm & QFLAG_UNDERFLOW);
        const unsigned over_m = __syncthreads_count(fm & QFLAG_OVERFLOW);
        const unsigned under_v = __syncthreads_count(fv & QFLAG_UNDERFLOW);
        const unsigned over_v = __syncthreads_count(fv & QFLAG_OVERFLOW);
        if (threadIdx.x == 0) {
            as_out[blk] = qm.stored; /* every lane read as_in[blk] before the barriers above */
            vs_out[blk] = qv.stored;
            if (counts) {
                block_count(counts, COSSD_MOMENT_EXP_AVG, &qm, amax_m, cnt, under_m, over_m);
                block_count(counts, COSSD_MOMENT_EXP_AVG_SQ, &qv, amax_v, cnt, under_v, over_v);
            }
        }
    }
}

/* ---- Host side ---------------------------------------------------------------------- */

typedef void (*adam_kernel_ptr)(const uint16_t *, const float *, const void *, const float *, const void *,
                                const float *, float *, void *, float *, void *, float *, uint16_t *, size_t, adam_k,
                                const cossd_q8_tables *, cossd_cuda_counts *);

/* The 16 specialisations, indexed [grad_fmt][state_fmt][param_fmt]. */
#define COSSD_CUDA_SF_ROW(GF, PF)                                                                             \
    { adam_step_kernel<GF, COSSD_STATE_FP32, PF>, adam_step_kernel<GF, COSSD_STATE_BF16, PF>,                 \
      adam_step_kernel<GF, COSSD_STATE_FP16, PF>, adam_step_kernel<GF, COSSD_STATE_INT8, PF> }
static const adam_kernel_ptr k_kernels[2][2][4] = {
    {COSSD_CUDA_SF_ROW(COSSD_HALF_FP16, COSSD_HALF_FP16), COSSD_CUDA_SF_ROW(COSSD_HALF_FP16, COSSD_HALF_BF16)},
    {COSSD_CUDA_SF_ROW(COSSD_HALF_BF16, COSSD_HALF_FP16), COSSD_CUDA_SF_ROW(COSSD_HALF_BF16, COSSD_HALF_BF16)},
};
#undef COSSD_CUDA_SF_ROW

static bool half_ok(int fmt) { return fmt == COSSD_HALF_FP16 || fmt == COSSD_HALF_BF16; }

extern "C" void cossd_cuda_tables(const float *maps, void *out)
{
    cossd_q8_tables *t = (cossd_q8_tables *)out;
    memcpy(t->map, maps, sizeof t->map);
    cossd_q8_tables_fill_mid(t);
}

extern "C" void cossd_cuda_counts_reset(cossd_cuda_counts *c) { cuda_counts_reset(c); }

extern "C" void cossd_cuda_counts_finish(const cossd_cuda_counts *c, cossd_qstate_counts *out)
{
    cuda_counts_finish(c, out);
}

extern "C" int cossd_cuda_adam_step_q(const uint16_t *grad, int gfmt, const float *mi, const void *ai,
                                      const float *as_in, const void *vi, const float *vs_in, float *mo, void *ao,
                                      float *as_out, void *vo, float *vs_out, int sfmt, uint16_t *po, int pfmt,
                                      size_t n, const cossd_adam_scalars *s, const void *tables,
                                      cossd_cuda_counts *counts, void *stream, int *cuda_error_out)
{
    if (!half_ok(gfmt) || !half_ok(pfmt) || sfmt < COSSD_STATE_FP32 || sfmt > COSSD_STATE_INT8)
        return COSSD_ERR_FORMAT;
    const bool scaled = sfmt == COSSD_STATE_FP16 || sfmt == COSSD_STATE_INT8;
    if (n == 0)
        return COSSD_OK;
    if (!grad || !mi || !ai || !vi || !mo || !ao || !vo || !po || !s ||
        (scaled && (!as_in || !vs_in || !as_out || !vs_out)) || (sfmt == COSSD_STATE_INT8 && !tables))
        return COSSD_ERR_NULL;
    const size_t nblocks = (n + COSSD_STATE_BLOCK - 1) / COSSD_STATE_BLOCK;
    const unsigned grid = (unsigned)(nblocks < COSSD_CUDA_MAX_GRID ? nblocks : COSSD_CUDA_MAX_GRID);
    k_kernels[gfmt][pfmt][sfmt]<<<grid, COSSD_CUDA_THREADS, 0, (cudaStream_t)stream>>>(
        grad, mi, ai, as_in, vi, vs_in, mo, ao, as_out, vo, vs_out, po, n, adam_load_scalars(s),
        (const cossd_q8_tables *)tables, counts);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
        if (cuda_error_out)
            *cuda_error_out = (int)err;
        return COSSD_ERR_CUDA;
    }
    return COSSD_OK;
}
