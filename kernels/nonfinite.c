/* nonfinite.c: the count of a gradient's inf/NaN elements, per level (scalar, AVX2, AVX-512) and dispatching. */

#include <string.h>

#include "cossd_internal.h"

/* cossd_copy_count_nonfinite copies this many bytes, then counts them in the destination
 * while they are still in L1 (Zen 4 and recent Intel cores have 32-48 KiB of it). */
#define COPY_COUNT_CHUNK_BYTES ((size_t)16384)

/* The AVX2 and AVX-512 counters are two algorithms (per-lane counters against opmask
 * popcounts), not one body in two widths, so they are written out here, each with its
 * target attribute. Every one takes the format's exponent mask. */
typedef size_t count_kernel_fn(const uint16_t *grad, uint16_t mask16, size_t n);

static size_t count_nonfinite_scalar_impl(const uint16_t *grad, uint16_t mask, size_t n)
{
    size_t count = 0;
    for (size_t i = 0; i < n; i++)
        count += (grad[i] & mask) == mask;
    return count;
}

#if COSSD_X86
COSSD_AVX2 static size_t count_nonfinite_avx2_impl(const uint16_t *grad, uint16_t mask16, size_t n)
{
    const __m256i mask = _mm256_set1_epi16((short)mask16);
    const __m256i ones16 = _mm256_set1_epi16(1);
    size_t count = 0;
    size_t i = 0;
    while (i + 16 <= n) {
        /* Per-lane 16-bit counters (compare gives -1, subtracting adds 1) are
         * flushed after at most 32767 hits, because madd_epi16 below reads
         * them as signed. */
        __m256i acc = _mm256_setzero_si256();
        size_t block_end = n - i > (size_t)16 * 32767 ? i + (size_t)16 * 32767 : n;
        for (; i + 16 <= block_end; i += 16) {
            __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)(grad + i));
            __m256i hit = _mm256_cmpeq_epi16(_mm256_and_si256(h, mask), mask);
            acc = _mm256_sub_epi16(acc, hit);
        }
        __m256i s32 = _mm256_madd_epi16(acc, ones16); /* pairs -> 8 x int32, each <= 65534 */
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
        count += (uint32_t)_mm_cvtsi128_si32(s);
    }
    for (; i < n; i++)
        count += (grad[i] & mask16) == mask16;
    return count;
}

COSSD_AVX512 static size_t count_nonfinite_avx512_impl(const uint16_t *grad, uint16_t mask16, size_t n)
{
    const __m512i mask = _mm512_set1_epi16((short)mask16);
    const __m512i ones16 = _mm512_set1_epi16(1);
    size_t count = 0;
    size_t i = 0;
    while (i + 32 <= n) {
        /* Same per-lane 16-bit counters as the AVX2 path, flushed after at
         * most 32767 hits per lane (madd_epi16 reads them as signed). */
        __m512i acc = _mm512_setzero_si512();
        size_t block_end = n - i > (size_t)32 * 32767 ? i + (size_t)32 * 32767 : n;
        for (; i + 32 <= block_end; i += 32) {
            __m512i h = _mm512_loadu_si512((const void *)(grad + i));
            __mmask32 hit = _mm512_cmpeq_epi16_mask(_mm512_and_si512(h, mask), mask);
            acc = _mm512_mask_add_epi16(acc, hit, acc, ones16);
        }
        count += (uint32_t)_mm512_reduce_add_epi32(_mm512_madd_epi16(acc, ones16));
    }
    if (i < n) { /* 1..31 left: masked load, the lanes outside read as 0 (finite) */
        __mmask32 km = (__mmask32)((1u << (n - i)) - 1u);
        __m512i h = _mm512_maskz_loadu_epi16(km, (const void *)(grad + i));
        __mmask32 hit = _mm512_cmpeq_epi16_mask(_mm512_and_si512(h, mask), mask);
        count += (size_t)__builtin_popcount((unsigned)(hit & km));
    }
    return count;
}
#endif

/* Indexed by COSSD_SIMD_* level; NULL where this build has no such path. */
static count_kernel_fn *const count_kernels[COSSD_SIMD_AVX512 + 1] = {
    [COSSD_SIMD_SCALAR] = count_nonfinite_scalar_impl,
#if COSSD_X86
    [COSSD_SIMD_AVX2] = count_nonfinite_avx2_impl,
    [COSSD_SIMD_AVX512] = count_nonfinite_avx512_impl,
#endif
};

/* FP32 and FP8 gradients: one loop, the same at every level (-O3 vectorizes it), since a count
 * is the same number whichever path counts it. */
static size_t count_nonfinite_wide_or_byte(const void *grad, int fmt, size_t n)
{
    size_t count = 0;
    for (size_t i = 0; i < n; i++)
        count += (size_t)grad_nonfinite(grad, i, fmt);
    return count;
}

/* Returns the count, or COSSD_COUNT_ERROR for a bad format, a NULL buffer or a level this
 * CPU lacks (a size_t result has no room for the return codes). */
static size_t count_nonfinite_at(int level, const void *grad, int fmt, size_t n)
{
    if (!grad_fmt_ok(fmt) || (n > 0 && !grad) || !cossd_level_present(level))
        return COSSD_COUNT_ERROR;
    if (!half_fmt_ok(fmt))
        return count_nonfinite_wide_or_byte(grad, fmt, n);
    return count_kernels[level]((const uint16_t *)grad, exp_mask(fmt), n);
}

size_t cossd_count_nonfinite_scalar(const void *grad, int fmt, size_t n)
{
    return count_nonfinite_at(COSSD_SIMD_SCALAR, grad, fmt, n);
}

size_t cossd_count_nonfinite_avx2(const void *grad, int fmt, size_t n)
{
    return count_nonfinite_at(COSSD_SIMD_AVX2, grad, fmt, n);
}

size_t cossd_count_nonfinite_avx512(const void *grad, int fmt, size_t n)
{
    return count_nonfinite_at(COSSD_SIMD_AVX512, grad, fmt, n);
}

size_t cossd_count_nonfinite(const void *grad, int fmt, size_t n)
{
    return count_nonfinite_at(simd_level_now(), grad, fmt, n);
}

/* Copies a gradient out of memory another party may change (a lent CMB window) into `dst`,
 * and counts dst's inf/NaN elements: one pass over the source where a copy and a count would
 * take two over the whole block. Counting the destination, never the source, is what makes
 * it safe: whatever the source held while it was read, the count is of the values the caller
 * then steps. src and dst must not overlap; src may start at any byte (it is only copied). */
size_t cossd_copy_count_nonfinite(const void *src, void *dst, int fmt, size_t n)
{
    if (!grad_fmt_ok(fmt) || (n > 0 && (!src || !dst)))
        return COSSD_COUNT_ERROR;
    int level = simd_level_now();
    size_t itemsize = grad_itemsize(fmt);
    size_t chunk = COPY_COUNT_CHUNK_BYTES / itemsize;
    size_t count = 0;
    for (size_t done = 0; done < n; done += chunk) {
        size_t part = n - done < chunk ? n - done : chunk;
        void *out = (char *)dst + done * itemsize;
        memcpy(out, (const char *)src + done * itemsize, part * itemsize);
        count += count_nonfinite_at(level, out, fmt, part);
    }
    return count;
}
