/* block_update.c: the device's block update, an Adam step out of place that also returns the CRC32C of its outputs: folded from the registers (AVX-512 with VPCLMULQDQ, FP32 moments) or chunk by chunk through cache. */

#include "crc32c_internal.h"

#if COSSD_X86
/* The in-register path reuses the AVX-512 Adam vector math, so its bits are the step's. */
#define SIMD_ISA_AVX512 1
#include "simd.h"
#include "adam_body.h"
#endif

/* ---- Chunk by chunk: the step into scratch, its CRC, then the copy out ---- */

#if COSSD_X86
/* One chunk of the four output streams (master, exp_avg, exp_avg_sq, param) into their raw
 * CRC registers `regs`. A crc32 instruction waits 3 cycles for its previous one, so every
 * stream is cut into pieces as long as the param's (2 bytes an element): 7 independent chains
 * with FP32 moments, 5 with BF16, which keep the unit busy. Then each stream's pieces are
 * joined by linearity: reg(A|B) = shift(reg(A), |B|) ^ reg_from_0(B). */
__attribute__((target("sse4.2"))) static void crc32c_chunk(uint32_t regs[4], const uint8_t *const p[4],
                                                           size_t count, size_t ssz)
{
    size_t len = 2 * count;
    const int per_state = (int)(ssz / 2); /* pieces of a moment stream: 2 (FP32) or 1 (BF16) */
    const uint8_t *piece[7];
    uint64_t reg[7];
    int stream_of[7], pieces = 0;
    for (int s = 0; s < 4; s++) {
        int n_pieces = s == 0 ? 2 : s == 3 ? 1 : per_state;
        for (int k = 0; k < n_pieces; k++) {
            piece[pieces] = p[s] + (size_t)k * len;
            reg[pieces] = k == 0 ? regs[s] : 0;
            stream_of[pieces++] = s;
        }
    }
    size_t i = 0;
    if (pieces == 7) {
        for (; i + 8 <= len; i += 8)
            for (int k = 0; k < 7; k++) {
                uint64_t w;
                memcpy(&w, piece[k] + i, 8);
                reg[k] = _mm_crc32_u64(reg[k], w);
            }
    } else {
        for (; i + 8 <= len; i += 8)
            for (int k = 0; k < 5; k++) {
                uint64_t w;
                memcpy(&w, piece[k] + i, 8);
                reg[k] = _mm_crc32_u64(reg[k], w);
            }
    }
    for (; i < len; i++)
        for (int k = 0; k < pieces; k++)
            reg[k] = _mm_crc32_u8((uint32_t)reg[k], piece[k][i]);
    for (int k = 0; k < pieces; k++) {
        int s = stream_of[k];
        regs[s] = (k > 0 && stream_of[k - 1] == s) ? crc_shift_bytes(regs[s], len) ^ (uint32_t)reg[k]
                                                     : (uint32_t)reg[k];
    }
}

/* Copy with streaming stores where `dst` is 16-byte aligned: the block's outputs go to memory
 * without first reading the lines they replace (the device's shadow copy is not in cache). */
static void copy_streaming(void *dst, const void *src, size_t bytes)
{
    uint8_t *d = (uint8_t *)dst;
    const uint8_t *s = (const uint8_t *)src;
    if (((uintptr_t)d & 15u) == 0) {
        for (; bytes >= 16; bytes -= 16, d += 16, s += 16)
            _mm_stream_si128((__m128i *)d, _mm_loadu_si128((const __m128i *)s));
    }
    memcpy(d, s, bytes);
}
#endif

/* One chunk of the four output streams into their CRC values `crc` (value semantics, as
 * cossd_crc32c: 0 before the first byte). */
static void crc32c_streams(uint32_t crc[4], const uint8_t *const p[4], size_t count, size_t ssz)
{
#if COSSD_X86
    if (crc_fold_usable(count * 2)) {
        const size_t lengths[4] = {count * 4, count * ssz, count * ssz, count * 2};
        for (int s = 0; s < 4; s++)
            crc[s] = ~crc32c_fold(~crc[s], p[s], lengths[s]);
        return;
    }
    if (g_has_sse42 && simd_enabled()) {
        uint32_t regs[4];
        for (int s = 0; s < 4; s++)
            regs[s] = ~crc[s];
        crc32c_chunk(regs, p, count, ssz);
        for (int s = 0; s < 4; s++)
            crc[s] = ~regs[s];
        return;
    }
#endif
    const size_t lengths[4] = {count * 4, count * ssz, count * ssz, count * 2};
    for (int s = 0; s < 4; s++)
        crc[s] = cossd_crc32c_scalar(crc[s], p[s], lengths[s]);
}

static void copy_out(void *dst, const void *src, size_t bytes)
{
#if COSSD_X86
    if (simd_enabled()) {
        copy_streaming(dst, src, bytes);
        return;
    }
#endif
    memcpy(dst, src, bytes);
}

static int step_crc_in_registers(const void *grad, int gfmt, const float *mi, const void *ai, const void *vi,
                                 float *mo, void *ao, void *vo, int sfmt, uint16_t *po, uint16_t *po2, int pfmt,
                                 size_t n, const cossd_adam_scalars *s, uint32_t crc[4], size_t *nonfinite);

/* Steps n elements (every pointer already at the range's first element), continuing the four
 * output streams' CRC values crc[] (value semantics: 0 before a stream's first byte), and adds
 * the range's inf/NaN gradient elements to *nonfinite where it is not NULL. Consecutive ranges
 * through one crc[] give the CRCs of one call over all of them. */
static int step_crc_range(const void *grad, int grad_fmt, const float *master_in, const void *exp_avg_in,
                          const void *exp_avg_sq_in, float *master_out, void *exp_avg_out, void *exp_avg_sq_out,
                          int state_fmt, uint16_t *param_out, uint16_t *param_copy, int param_fmt, size_t n,
                          const cossd_adam_scalars *s, uint32_t crc[4], size_t *nonfinite)
{
    size_t counted = 0;
    if (n && step_crc_in_registers(grad, grad_fmt, master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out,
                                   exp_avg_sq_out, state_fmt, param_out, param_copy, param_fmt, n, s, crc,
                                   &counted)) {
        if (nonfinite) /* no scratch: the checksum was folded from the registers */
            *nonfinite += counted;
        return COSSD_OK;
    }
    size_t ssz = state_fmt == COSSD_STATE_BF16 ? 2 : 4;
    size_t gsz = grad_itemsize(grad_fmt);
    /* One chunk's outputs, in cache: 14 KiB on the stack (a thread-local buffer in a shared
     * library costs a __tls_get_addr call per access). */
    float scratch_master[STEP_CRC_CHUNK] __attribute__((aligned(64)));
    float scratch_avg[STEP_CRC_CHUNK] __attribute__((aligned(64)));
    float scratch_avg_sq[STEP_CRC_CHUNK] __attribute__((aligned(64)));
    uint16_t scratch_param[STEP_CRC_CHUNK] __attribute__((aligned(64)));
    for (size_t i = 0; i < n; i += STEP_CRC_CHUNK) {
        size_t count = n - i < STEP_CRC_CHUNK ? n - i : STEP_CRC_CHUNK;
        if (nonfinite) /* this chunk's gradient, about to be read by the step too */
            *nonfinite += cossd_count_nonfinite((const uint8_t *)grad + i * gsz, grad_fmt, count);
        int rc = cossd_adam_step((const uint8_t *)grad + i * gsz, grad_fmt, master_in + i,
                                 (const uint8_t *)exp_avg_in + i * ssz, (const uint8_t *)exp_avg_sq_in + i * ssz,
                                 scratch_master, scratch_avg, scratch_avg_sq, state_fmt, scratch_param, param_fmt,
                                 count, s);
        if (rc != COSSD_OK)
            return rc;
        const uint8_t *const outputs[4] = {(const uint8_t *)scratch_master, (const uint8_t *)scratch_avg,
                                           (const uint8_t *)scratch_avg_sq, (const uint8_t *)scratch_param};
        const size_t lengths[4] = {count * 4, count * ssz, count * ssz, count * 2};
        crc32c_streams(crc, outputs, count, ssz);
        copy_out(master_out + i, scratch_master, lengths[0]);
        copy_out((uint8_t *)exp_avg_out + i * ssz, scratch_avg, lengths[1]);
        copy_out((uint8_t *)exp_avg_sq_out + i * ssz, scratch_avg_sq, lengths[2]);
        copy_out(param_out + i, scratch_param, lengths[3]);
        if (param_copy)
            copy_out(param_copy + i, scratch_param, lengths[3]);
    }
#if COSSD_X86
    _mm_sfence(); /* streaming stores are weakly ordered: visible before the caller goes on */
#endif
    return COSSD_OK;
}

/* The block's CRC from its four streams' (master, moments, param: their bytes one after the
 * other), and the params' alone. */
static void block_crcs(const uint32_t crc[4], size_t n, size_t ssz, uint32_t *crc_out, uint32_t *param_crc_out)
{
    if (param_crc_out) /* the params alone: what a restart checks before it serves them */
        *param_crc_out = crc[3];
    uint32_t block = cossd_crc32c_combine(crc[0], crc[1], (uint64_t)n * ssz);
    block = cossd_crc32c_combine(block, crc[2], (uint64_t)n * ssz);
    *crc_out = cossd_crc32c_combine(block, crc[3], (uint64_t)n * 2);
}

int cossd_adam_step_crc(const void *grad, int grad_fmt, const float *master_in, const void *exp_avg_in,
                        const void *exp_avg_sq_in, float *master_out, void *exp_avg_out, void *exp_avg_sq_out,
                        int state_fmt, uint16_t *param_out, int param_fmt, size_t n, const cossd_adam_scalars *s,
                        uint32_t *crc_out)
{
    return cossd_adam_step_crc_copy(grad, grad_fmt, master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out,
                                    exp_avg_sq_out, state_fmt, param_out, NULL, param_fmt, n, s, crc_out, NULL, NULL);
}

int cossd_adam_step_crc_copy(const void *grad, int grad_fmt, const float *master_in, const void *exp_avg_in,
                             const void *exp_avg_sq_in, float *master_out, void *exp_avg_out, void *exp_avg_sq_out,
                             int state_fmt, uint16_t *param_out, uint16_t *param_copy, int param_fmt, size_t n,
                             const cossd_adam_scalars *s, uint32_t *crc_out, uint32_t *param_crc_out,
                             size_t *nonfinite_out)
{
    int rc = adam_check(grad, grad_fmt, master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out,
                        exp_avg_sq_out, state_fmt, param_out, param_fmt, n, s);
    if (rc != COSSD_OK)
        return rc;
    if (!crc_out)
        return COSSD_ERR_NULL;
    uint32_t crc[4] = {0, 0, 0, 0};
    size_t nonfinite = 0;
    rc = step_crc_range(grad, grad_fmt, master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out,
                        exp_avg_sq_out, state_fmt, param_out, param_copy, param_fmt, n, s, crc,
                        nonfinite_out ? &nonfinite : NULL);
    if (rc != COSSD_OK)
        return rc;
    if (nonfinite_out)
        *nonfinite_out = nonfinite;
    block_crcs(crc, n, state_fmt == COSSD_STATE_BF16 ? 2 : 4, crc_out, param_crc_out);
    return COSSD_OK;
}

/* Whether the register path (where step_crc_in_registers takes the call) reads a gradient of
 * n elements once, in its main loop only: no peel and no masked tail, the two places that read
 * the gradient again for their count. */
static int whole_vectors_only(const float *master_out, size_t n)
{
    return n % 16 == 0 && adam_peel(master_out, n, 64) == 0;
}

/* Gradient elements cossd_adam_step_crc_lent reads from lent memory per round: 16 KiB of
 * FP32 (8 KiB of FP16), held in L1 from the copy to the step. */
#define LENT_CHUNK ((size_t)4096)

int cossd_adam_step_crc_lent(const void *grad, int grad_fmt, const float *master_in, const void *exp_avg_in,
                             const void *exp_avg_sq_in, float *master_out, void *exp_avg_out, void *exp_avg_sq_out,
                             int state_fmt, uint16_t *param_out, uint16_t *param_copy, int param_fmt, size_t n,
                             const cossd_adam_scalars *s, uint32_t *crc_out, uint32_t *param_crc_out,
                             size_t *nonfinite_out, size_t *stepped_out)
{
    int rc = adam_check(grad, grad_fmt, master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out,
                        exp_avg_sq_out, state_fmt, param_out, param_fmt, n, s);
    if (rc != COSSD_OK)
        return rc;
    if (!crc_out || !nonfinite_out || !stepped_out)
        return COSSD_ERR_NULL;
    *stepped_out = 0;
    size_t ssz = state_fmt == COSSD_STATE_BF16 ? 2 : 4;
    size_t gsz = grad_itemsize(grad_fmt);
    uint32_t crc[4] = {0, 0, 0, 0};
    size_t nonfinite = 0;
    if (whole_vectors_only(master_out, n) &&
        step_crc_in_registers(grad, grad_fmt, master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out,
                              exp_avg_sq_out, state_fmt, param_out, param_copy, param_fmt, n, s, crc, &nonfinite)) {
        /* Every element stepped, each read once from the lender's memory into the register
         * that is both counted and stepped. A non-finite block's outputs are discarded:
         * the step is skipped, and the host's param copy is refilled from the committed
         * copy (settle_param_copies). */
        *stepped_out = n;
    } else {
        uint8_t chunk[LENT_CHUNK * 4] __attribute__((aligned(64)));
        for (size_t i = 0; i < n; i += LENT_CHUNK) {
            size_t count = n - i < LENT_CHUNK ? n - i : LENT_CHUNK;
            /* Read once, into memory only this call writes: what is counted is what is
             * stepped, whatever the lender does to its buffer meanwhile. Only ever through
             * memcpy: the lent gradient may start at any byte (a network receive buffer). */
            memcpy(chunk, (const uint8_t *)grad + i * gsz, count * gsz);
            size_t found = cossd_count_nonfinite(chunk, grad_fmt, count);
            if (nonfinite || found) { /* the block is lost: only the count of the rest is wanted */
                nonfinite += found;
                continue;
            }
            rc = step_crc_range(chunk, grad_fmt, master_in + i, (const uint8_t *)exp_avg_in + i * ssz,
                                (const uint8_t *)exp_avg_sq_in + i * ssz, master_out + i,
                                (uint8_t *)exp_avg_out + i * ssz, (uint8_t *)exp_avg_sq_out + i * ssz, state_fmt,
                                param_out + i, param_copy ? param_copy + i : NULL, param_fmt, count, s, crc, NULL);
            if (rc != COSSD_OK)
                return rc;
            *stepped_out += count;
        }
    }
    *nonfinite_out = nonfinite;
    if (nonfinite) {
        *crc_out = 0;
        if (param_crc_out)
            *param_crc_out = 0;
        return COSSD_OK;
    }
    block_crcs(crc, n, ssz, crc_out, param_crc_out);
    return COSSD_OK;
}

/* ---- Checksum folded in registers (AVX-512 with VPCLMULQDQ, FP32 moments) --- */

#if COSSD_X86
#define COSSD_AVX512_CRC_TARGET COSSD_AVX512_TARGET ",vpclmulqdq,pclmul,sse4.2,popcnt"
#define COSSD_AVX512_CRC_INLINE static inline __attribute__((always_inline, target(COSSD_AVX512_CRC_TARGET)))

COSSD_AVX512_CRC_INLINE __m256i fold_ymm(__m256i acc, __m256i k, __m256i next)
{
    return _mm256_ternarylogic_epi64(_mm256_clmulepi64_epi128(acc, k, 0x00), _mm256_clmulepi64_epi128(acc, k, 0x11),
                                     next, 0x96);
}

/* The CRC register of a folded 128-bit remainder: its 16 bytes through crc32 from zero. */
COSSD_AVX512_CRC_INLINE uint32_t crc_register_of(__m128i r)
{
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(r));
    return (uint32_t)_mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(r, 1));
}

COSSD_AVX512_CRC_INLINE uint32_t crc_register_of_zmm(__m512i x)
{
    __m128i r = _mm512_extracti32x4_epi32(x, 3);
    r = _mm_xor_si128(r, fold_xmm(_mm512_extracti32x4_epi32(x, 0), FOLD_384));
    r = _mm_xor_si128(r, fold_xmm(_mm512_extracti32x4_epi32(x, 1), FOLD_256));
    r = _mm_xor_si128(r, fold_xmm(_mm512_extracti32x4_epi32(x, 2), FOLD_128));
    return crc_register_of(r);
}

COSSD_AVX512_CRC_INLINE uint32_t crc_register_of_ymm(__m256i x)
{
    __m128i r = _mm_xor_si128(_mm256_extracti128_si256(x, 1), fold_xmm(_mm256_castsi256_si128(x), FOLD_128));
    return crc_register_of(r);
}

/* Elements [from, to) of the four outputs, already in memory, into the raw registers. */
static void crc_outputs_from_memory(uint32_t reg[4], const float *mo, const void *ao, const void *vo,
                                    const uint16_t *po, size_t from, size_t to)
{
    if (to <= from)
        return;
    const void *const streams[4] = {mo + from, (const float *)ao + from, (const float *)vo + from, po + from};
    for (int s = 0; s < 4; s++)
        reg[s] = ~cossd_crc32c_sse42(~reg[s], streams[s], (to - from) * (s == 3 ? 2 : 4));
}

/* The 16-element main loop: compute, store (streaming where NT), and fold each output
 * vector into its stream's accumulator: 64 bytes a fold for master and the moments, 32 for
 * the param. The first vector of each stream takes the running register on its first 4
 * bytes, as the crc32 instruction would. */
#define ADAM_CRC_LOOP(NT)                                                                                    \
    do {                                                                                                     \
        __m512 p, m, v;                                                                                      \
        __m512i xp, xm, xv, ap = _mm512_setzero_si512(), am = ap, av = ap;                                   \
        __m256i xh, ah = _mm256_setzero_si256();                                                             \
        for (size_t j = 0; j < vectors; j++, i += 16) {                                                      \
            __m256i bits = _mm256_loadu_si256((const __m256i *)(const void *)(grad + i));                   \
            /* One load, pinned to its register: the count and the step below both read it, \
             * never memory again (a lent gradient may change under the kernel). */                           \
            __asm__ volatile("" : "+x"(bits));                                                               \
            nonfinite += (size_t)_mm_popcnt_u32(                                                             \
                _mm256_cmpeq_epi16_mask(_mm256_and_si256(bits, exponent), exponent));                        \
            adam_vec_math(simd_h_to_f32(bits, gfmt), mi, ai, vi, sfmt, i, &c, decoupled, 0xFFFF, 0, &p, &m, &v); \
            m = simd_canon_nan(m);                                                                              \
            v = simd_canon_nan(v);                                                                              \
            xh = simd_f32_to_half(p, pfmt);                                                                     \
            simd_putf(mo + i, p, NT);                                                                        \
            simd_putf((float *)ao + i, m, NT);                                                               \
            simd_putf((float *)vo + i, v, NT);                                                               \
            simd_puth(po + i, xh, NT);                                                                         \
            if (po2) {                                                                                       \
                if (nt2)                                                                                     \
                    _mm256_stream_si256((__m256i *)(void *)(po2 + i), xh);                                   \
                else                                                                                         \
                    _mm256_storeu_si256((__m256i *)(void *)(po2 + i), xh);                                   \
            }                                                                                                \
            xp = _mm512_castps_si512(p);                                                                     \
            xm = _mm512_castps_si512(m);                                                                     \
            xv = _mm512_castps_si512(v);                                                                     \
            if (j == 0) {                                                                                    \
                ap = _mm512_xor_si512(xp, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)reg[0])));           \
                am = _mm512_xor_si512(xm, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)reg[1])));           \
                av = _mm512_xor_si512(xv, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)reg[2])));           \
                ah = _mm256_xor_si256(xh, _mm256_zextsi128_si256(_mm_cvtsi32_si128((int)reg[3])));           \
            } else {                                                                                         \
                ap = fold_zmm(ap, k512, xp);                                                                 \
                am = fold_zmm(am, k512, xm);                                                                 \
                av = fold_zmm(av, k512, xv);                                                                 \
                ah = fold_ymm(ah, k256, xh);                                                                 \
            }                                                                                                \
        }                                                                                                    \
        if (NT || nt2)                                                                                       \
            _mm_sfence();                                                                                    \
        reg[0] = crc_register_of_zmm(ap);                                                                    \
        reg[1] = crc_register_of_zmm(am);                                                                    \
        reg[2] = crc_register_of_zmm(av);                                                                    \
        reg[3] = crc_register_of_ymm(ah);                                                                    \
    } while (0)

COSSD_AVX512_CRC_INLINE size_t adam_avx512_crc_body(const uint16_t *grad, int gfmt, const float *mi, const void *ai,
                                                    const void *vi, float *mo, void *ao, void *vo, int sfmt,
                                                    uint16_t *po, uint16_t *po2, int pfmt, size_t n,
                                                    const adam_k *k, int decoupled, uint32_t reg[4])
{
    if (sfmt != COSSD_STATE_FP32)
        return 0; /* never called so: the caller checks */
    const adam_vk c = adam_vk_make(k);
    /* Non-finite gradient elements: all exponent bits set (inf or NaN). */
    const __m256i exponent = _mm256_set1_epi16((short)(gfmt == COSSD_HALF_BF16 ? 0x7F80 : 0x7C00));
    size_t nonfinite = 0;
    /* As adam_body: one masked vector first so that master_out is 64-byte aligned. */
    size_t i = adam_peel(mo, n, 64);
    if (i) {
        adam_vec(grad, gfmt, mi, ai, vi, mo, ao, vo, sfmt, po, pfmt, 0, &c, decoupled,
                        (__mmask16)((1u << i) - 1u), 1, 0);
        crc_outputs_from_memory(reg, mo, ao, vo, po, 0, i);
        if (po2)
            memcpy(po2, po, i * sizeof(uint16_t));
        nonfinite += cossd_count_nonfinite_scalar(grad, gfmt, i);
    }
    size_t vectors = (n - i) / 16;
    if (vectors) {
        const __m512i k512 = _mm512_broadcast_i32x4(
            _mm_set_epi64x((long long)g_fold[FOLD_512][1], (long long)g_fold[FOLD_512][0]));
        const __m256i k256 = _mm256_broadcastsi128_si256(
            _mm_set_epi64x((long long)g_fold[FOLD_256][1], (long long)g_fold[FOLD_256][0]));
        /* Streaming needs every output aligned to its vector. master_out is after a peel, but
         * a call too short to peel (adam_peel) may start anywhere: check it too. */
        int stream = aligned_to(mo + i, 64) && aligned_to((float *)ao + i, 64) && aligned_to((float *)vo + i, 64) &&
                     aligned_to(po + i, 32);
        /* The copy of the params streams where it is aligned too; it is write-only. */
        const int nt2 = po2 != NULL && aligned_to(po2 + i, 32);
        if (stream)
            ADAM_CRC_LOOP(1);
        else
            ADAM_CRC_LOOP(0);
    }
    if (i < n) { /* 1..15 left: one masked vector */
        size_t from = i;
        adam_vec(grad, gfmt, mi, ai, vi, mo, ao, vo, sfmt, po, pfmt, i, &c, decoupled,
                        (__mmask16)((1u << (n - i)) - 1u), 1, 0);
        crc_outputs_from_memory(reg, mo, ao, vo, po, from, n);
        if (po2)
            memcpy(po2 + from, po + from, (n - from) * sizeof(uint16_t));
        nonfinite += cossd_count_nonfinite_scalar(grad + from, gfmt, n - from);
    }
    return nonfinite;
}
#undef ADAM_CRC_LOOP

__attribute__((target(COSSD_AVX512_CRC_TARGET))) static size_t
adam_avx512_crc_dispatch(const uint16_t *grad, int gfmt, const float *mi, const void *ai, const void *vi, float *mo,
                         void *ao, void *vo, int sfmt, uint16_t *po, uint16_t *po2, int pfmt, size_t n,
                         const adam_k *k, uint32_t reg[4])
{
    size_t nonfinite = 0;
#define ADAM_CRC_CALL(GF, SF, PF, DC) \
    nonfinite = adam_avx512_crc_body(grad, GF, mi, ai, vi, mo, ao, vo, SF, po, po2, PF, n, k, DC, reg)
    ADAM_SPECIALISE_HALF(ADAM_CRC_CALL); /* 16-bit gradients only: step_crc_in_registers */
#undef ADAM_CRC_CALL
    return nonfinite;
}
#endif

/* step_crc_range with the checksum folded from the registers, where the CPU and formats
 * allow; returns 0 (nothing done) otherwise. crc[] holds the four streams' running CRC values. */
static int step_crc_in_registers(const void *grad, int gfmt, const float *mi, const void *ai, const void *vi,
                                 float *mo, void *ao, void *vo, int sfmt, uint16_t *po, uint16_t *po2, int pfmt,
                                 size_t n, const cossd_adam_scalars *s, uint32_t crc[4], size_t *nonfinite)
{
#if COSSD_X86
    /* The register path counts the non-finite elements of 16-bit gradients from the very
     * register it steps; FP32 and FP8 gradients take the scratch path, which counts each chunk
     * just before stepping it. */
    if (!g_has_vpclmul || sfmt != COSSD_STATE_FP32 || simd_level_now() != COSSD_SIMD_AVX512 || !half_fmt_ok(gfmt))
        return 0;
    adam_k k = adam_load_scalars(s);
    uint32_t reg[4] = {~crc[0], ~crc[1], ~crc[2], ~crc[3]}; /* the running CRC values' registers */
    *nonfinite = adam_avx512_crc_dispatch((const uint16_t *)grad, gfmt, mi, ai, vi, mo, ao, vo, sfmt, po, po2, pfmt, n, &k, reg);
    for (int i = 0; i < 4; i++)
        crc[i] = ~reg[i];
    return 1;
#else
    (void)grad; (void)gfmt; (void)mi; (void)ai; (void)vi; (void)mo; (void)ao; (void)vo; (void)sfmt; (void)po;
    (void)po2; (void)pfmt; (void)n; (void)s; (void)crc; (void)nonfinite;
    return 0;
#endif
}
