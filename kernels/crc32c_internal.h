/* crc32c_internal.h: what crc32c.c shares with block_update.c: the carry-less folding constants and steps, the register shift, the chunk length. */
#ifndef COSSD_CRC32C_INTERNAL_H
#define COSSD_CRC32C_INTERNAL_H

#include "cossd_internal.h"

/* Castagnoli polynomial 0x1EDC6F41, bit-reflected. */
#define CRC32C_POLY_REFLECTED 0x82F63B78u

/* Elements per pass of cossd_adam_step_crc: its outputs (14-22 bytes an element, 14-22 KiB)
 * stay in L1 between the step, their checksum and the copy out. crc_shift_bytes caches the
 * power for 2 * STEP_CRC_CHUNK bytes, the length its chunk joins shift by again and again. */
#define STEP_CRC_CHUNK 1024

/* Folding constants, as 64-bit lane pairs {low, high}: a 128-bit piece of the message
 * moved F bits further is congruent to its low half times x^(F+63) plus its high half
 * times x^(F-1) (a reflected carry-less product comes out one degree short, hence the
 * -1). A 32-bit reflected constant sits in the upper half of its 64-bit lane. */
enum { FOLD_2048, FOLD_512, FOLD_384, FOLD_256, FOLD_128, FOLD_COUNT };
extern COSSD_HIDDEN uint64_t g_fold[FOLD_COUNT][2];

/* Fills the CRC tables; called once by the module's constructor (dispatch.c). */
COSSD_HIDDEN void cossd_crc_init(void);

/* The CRC register (or CRC value: the map is linear) `reg` moved past `len` more bytes. */
COSSD_HIDDEN uint32_t crc_shift_bytes(uint32_t reg, uint64_t len);

#if COSSD_X86
/* 1 where a `len`-byte stream folds by VPCLMULQDQ at the current level (AVX-512). */
COSSD_HIDDEN int crc_fold_usable(size_t len);
/* The raw CRC register after `len` (crc_fold_usable) more bytes. */
COSSD_HIDDEN uint32_t crc32c_fold(uint32_t reg, const uint8_t *p, size_t len);

#define COSSD_CLMUL_TARGET "avx512f,avx512bw,avx512dq,avx512vl,vpclmulqdq,pclmul,sse4.2"

__attribute__((target(COSSD_CLMUL_TARGET))) static inline __m512i fold_zmm(__m512i x, __m512i k, __m512i next)
{
    /* 0x96: three-way XOR */
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11),
                                     next, 0x96);
}

__attribute__((target(COSSD_CLMUL_TARGET))) static inline __m128i fold_xmm(__m128i x, int which)
{
    __m128i k = _mm_set_epi64x((long long)g_fold[which][1], (long long)g_fold[which][0]);
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}
#endif

#endif /* COSSD_CRC32C_INTERNAL_H */
