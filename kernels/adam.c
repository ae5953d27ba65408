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
 * vectorizes with AVX2 where the CPU has it; with AVX-512, explicit vectors in runs of four
 * per stream, as the kernel's own loop reads them (adam_body.h, ADAM_GROUP): the AVX2 loop
 * measured 20-25% below what the kernel itself reached at 2 threads, so it bounded nothing. */
#if COSSD_X86
COSSD_AVX2 static void stream_probe_avx2(uint16_t *grad_param, float *master, float *exp_avg, float *exp_avg_sq,
                                         size_t n)
{
    STREAM_PROBE_LOOP
}

COSSD_AVX512 static void stream_probe_avx512(uint16_t *grad_param, float *master, float *exp_avg, float *exp_avg_sq,
                                             size_t n)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m256i flip = _mm256_set1_epi16(1);
    float *const floats[3] = {master, exp_avg, exp_avg_sq};
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        /* Every load of the run before any store, as the kernel: the arrays lie a multiple of
         * 4 KiB apart, so a store then a load of another stream alias (a false dependency). */
        __m512 x[3][4];
        __m256i h[4];
        for (int s = 0; s < 3; s++)
            for (int u = 0; u < 4; u++)
                x[s][u] = _mm512_loadu_ps(floats[s] + i + 16 * u);
        for (int u = 0; u < 4; u++)
            h[u] = _mm256_loadu_si256((const __m256i *)(const void *)(grad_param + i + 16 * u));
        for (int s = 0; s < 3; s++)
            for (int u = 0; u < 4; u++)
                _mm512_storeu_ps(floats[s] + i + 16 * u, _mm512_add_ps(x[s][u], one));
        for (int u = 0; u < 4; u++)
            _mm256_storeu_si256((__m256i *)(void *)(grad_param + i + 16 * u), _mm256_xor_si256(h[u], flip));
    }
    grad_param += i, master += i, exp_avg += i, exp_avg_sq += i, n -= i; /* the tail */
    STREAM_PROBE_LOOP
}
#endif

void cossd_stream_probe(uint16_t *grad_param, float *master, float *exp_avg, float *exp_avg_sq, size_t n)
{
#if COSSD_X86
    if (g_has_avx512 && simd_level_now() == COSSD_SIMD_AVX512) {
        stream_probe_avx512(grad_param, master, exp_avg, exp_avg_sq, n);
        return;
    }
    if (g_has_avx2) {
        stream_probe_avx2(grad_param, master, exp_avg, exp_avg_sq, n);
        return;
    }
#endif
    STREAM_PROBE_LOOP
}


/* The same streams out of place, as the device's block update moves them: grad, master and
 * moments read, then master, moments and param written to a second set of arrays with
 * streaming stores (as the block update's outputs go, so no line is read before it is
 * written). Its speed over the in-place probe's is what memory allows an A/B update against
 * a step in place: on a 2-core AMD EPYC VM about 0.73x at 1 thread and 0.80x at 2. Each
 * float stream gets a whole 64-byte line per iteration: there, streaming half lines (one
 * 32-byte store a stream at a time) measured a third slower. */
#define STREAM_PROBE_OUT_ELEM(i)                                                                          \
    do {                                                                                                 \
        master_out[i] = master[i] + 1.0f;                                                                \
        exp_avg_out[i] = exp_avg[i] + 1.0f;                                                              \
        exp_avg_sq_out[i] = exp_avg_sq[i] + 1.0f;                                                        \
        param_out[i] = (uint16_t)(grad[i] ^ 1u);                                                         \
    } while (0)

/* Streaming stores need every output aligned: until master_out is, and everywhere when
 * another output is not, the elements go one by one (the bench's arrays are aligned). */
#define STREAM_PROBE_OUT(VECTOR_LOOP)                                                                     \
    do {                                                                                                 \
        size_t i = 0;                                                                                    \
        for (; i < n && !aligned_to(master_out + i, 64); i++)                                            \
            STREAM_PROBE_OUT_ELEM(i);                                                                    \
        if (aligned_to(exp_avg_out + i, 64) && aligned_to(exp_avg_sq_out + i, 64) &&                     \
            aligned_to(param_out + i, 32)) {                                                             \
            VECTOR_LOOP;                                                                                 \
            _mm_sfence();                                                                                \
        }                                                                                                \
        for (; i < n; i++)                                                                               \
            STREAM_PROBE_OUT_ELEM(i);                                                                    \
    } while (0)

#if COSSD_X86
COSSD_AVX512 static void stream_probe_out_avx512(const uint16_t *grad, const float *master, const float *exp_avg,
                                                 const float *exp_avg_sq, float *master_out, float *exp_avg_out,
                                                 float *exp_avg_sq_out, uint16_t *param_out, size_t n)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m256i flip = _mm256_set1_epi16(1);
    STREAM_PROBE_OUT(for (; i + 16 <= n; i += 16) {
        _mm512_stream_ps(master_out + i, _mm512_add_ps(_mm512_loadu_ps(master + i), one));
        _mm512_stream_ps(exp_avg_out + i, _mm512_add_ps(_mm512_loadu_ps(exp_avg + i), one));
        _mm512_stream_ps(exp_avg_sq_out + i, _mm512_add_ps(_mm512_loadu_ps(exp_avg_sq + i), one));
        _mm256_stream_si256((__m256i *)(void *)(param_out + i),
                            _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(const void *)(grad + i)), flip));
    });
}

COSSD_AVX2 static void stream_probe_out_avx2(const uint16_t *grad, const float *master, const float *exp_avg,
                                             const float *exp_avg_sq, float *master_out, float *exp_avg_out,
                                             float *exp_avg_sq_out, uint16_t *param_out, size_t n)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256i flip = _mm256_set1_epi16(1);
    STREAM_PROBE_OUT(for (; i + 16 <= n; i += 16) {
        for (size_t h = 0; h < 16; h += 8) { /* the two halves of each float stream's line */
            _mm256_stream_ps(master_out + i + h, _mm256_add_ps(_mm256_loadu_ps(master + i + h), one));
            _mm256_stream_ps(exp_avg_out + i + h, _mm256_add_ps(_mm256_loadu_ps(exp_avg + i + h), one));
            _mm256_stream_ps(exp_avg_sq_out + i + h, _mm256_add_ps(_mm256_loadu_ps(exp_avg_sq + i + h), one));
        }
        _mm256_stream_si256((__m256i *)(void *)(param_out + i),
                            _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(const void *)(grad + i)), flip));
    });
}
#endif

void cossd_stream_probe_out_of_place(const uint16_t *grad, const float *master, const float *exp_avg,
                                     const float *exp_avg_sq, float *master_out, float *exp_avg_out,
                                     float *exp_avg_sq_out, uint16_t *param_out, size_t n)
{
#if COSSD_X86
    /* As wide as the block update's own path, so the probe is never narrower than what it bounds. */
    if (g_has_avx512 && simd_level_now() == COSSD_SIMD_AVX512) {
        stream_probe_out_avx512(grad, master, exp_avg, exp_avg_sq, master_out, exp_avg_out, exp_avg_sq_out,
                                param_out, n);
        return;
    }
    if (g_has_avx2 && simd_level_now() != COSSD_SIMD_SCALAR) {
        stream_probe_out_avx2(grad, master, exp_avg, exp_avg_sq, master_out, exp_avg_out, exp_avg_sq_out, param_out,
                              n);
        return;
    }
#endif
    for (size_t i = 0; i < n; i++)
        STREAM_PROBE_OUT_ELEM(i);
}
