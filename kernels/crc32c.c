/* crc32c.c: CRC32C (Castagnoli, reflected, init/final inversion inside): slicing-by-8 tables, the SSE4.2 crc32 instruction in three chains, VPCLMULQDQ folding, and the combination of two CRCs. */

#include "crc32c_internal.h"

static uint32_t g_crc_table[8][256];
/* g_crc_shift[k][b]: the CRC register that byte b in position k (register bits 8k..8k+7)
 * becomes after CRC_STRIDE zero bytes. The register update is linear over GF(2), so
 * shifting a whole register is four lookups; this is what lets three independent streams
 * be combined (see crc32c_sse42_impl). */
#define CRC_STRIDE 4096
static uint32_t g_crc_shift[4][256];
COSSD_HIDDEN uint64_t g_fold[FOLD_COUNT][2];

static uint32_t crc_xnmodp(uint64_t n);

void cossd_crc_init(void)
{
    /* Slicing-by-8 tables: table[k][b] is the CRC of byte b followed by k zero bytes. */
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int bit = 0; bit < 8; bit++)
            c = (c >> 1) ^ ((c & 1u) ? CRC32C_POLY_REFLECTED : 0u);
        g_crc_table[0][b] = c;
    }
    for (int k = 1; k < 8; k++)
        for (uint32_t b = 0; b < 256; b++) {
            uint32_t prev = g_crc_table[k - 1][b];
            g_crc_table[k][b] = (prev >> 8) ^ g_crc_table[0][prev & 0xFFu];
        }
    /* Each single-bit register through CRC_STRIDE zero bytes (one table step per byte),
     * then every byte value of each position as the XOR of its bits' images. */
    uint32_t bit_image[32];
    for (int i = 0; i < 32; i++) {
        uint32_t c = 1u << i;
        for (int n = 0; n < CRC_STRIDE; n++)
            c = (c >> 8) ^ g_crc_table[0][c & 0xFFu];
        bit_image[i] = c;
    }
    for (int k = 0; k < 4; k++)
        for (uint32_t b = 0; b < 256; b++) {
            uint32_t c = 0;
            for (int i = 0; i < 8; i++)
                if (b & (1u << i))
                    c ^= bit_image[8 * k + i];
            g_crc_shift[k][b] = c;
        }
    /* The folding constants (see g_fold). */
    static const unsigned bits[FOLD_COUNT] = {2048, 512, 384, 256, 128};
    for (int i = 0; i < FOLD_COUNT; i++) {
        g_fold[i][0] = (uint64_t)crc_xnmodp(bits[i] + 63) << 32;
        g_fold[i][1] = (uint64_t)crc_xnmodp(bits[i] - 1) << 32;
    }
}

/* The register `c` after CRC_STRIDE zero bytes. */
static inline uint32_t crc_shift_stride(uint32_t c)
{
    return g_crc_shift[0][c & 0xFFu] ^ g_crc_shift[1][(c >> 8) & 0xFFu] ^ g_crc_shift[2][(c >> 16) & 0xFFu] ^
           g_crc_shift[3][c >> 24];
}

/* A NULL buffer with len > 0 cannot be reported through a uint32_t result, so
 * it is treated as an empty buffer (the wrapper never passes one). */
uint32_t cossd_crc32c_scalar(uint32_t crc, const void *buf, size_t len)
{
    const uint8_t *p = (const uint8_t *)buf;
    if (!p)
        return crc;
    crc = ~crc;
    while (len >= 8) {
        /* Bytes assembled explicitly so the code is endian-independent. */
        uint32_t lo = crc ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        uint32_t hi = (uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 | (uint32_t)p[7] << 24;
        crc = g_crc_table[7][lo & 0xFFu] ^ g_crc_table[6][(lo >> 8) & 0xFFu] ^ g_crc_table[5][(lo >> 16) & 0xFFu] ^
              g_crc_table[4][lo >> 24] ^ g_crc_table[3][hi & 0xFFu] ^ g_crc_table[2][(hi >> 8) & 0xFFu] ^
              g_crc_table[1][(hi >> 16) & 0xFFu] ^ g_crc_table[0][hi >> 24];
        p += 8;
        len -= 8;
    }
    while (len--)
        crc = (crc >> 8) ^ g_crc_table[0][(crc ^ *p++) & 0xFFu];
    return ~crc;
}

#if COSSD_X86

__attribute__((target("sse4.2"))) static uint32_t crc32c_sse42_impl(uint32_t crc, const uint8_t *p, size_t len)
{
    if (crc_fold_usable(len))
        return ~crc32c_fold(~crc, p, len);
    uint64_t c = (uint32_t)~crc;
    /* crc32 has a latency of 3 cycles and a throughput of 1 per cycle: one dependent chain
     * uses a third of the unit. Three adjacent CRC_STRIDE-byte pieces run as three chains
     * (the second and third from a zero register), then combine by linearity:
     * reg(A|B) = shift(reg(A), |B|) ^ reg0(B). */
    while (len >= 3 * CRC_STRIDE) {
        uint64_t c1 = 0, c2 = 0;
        for (size_t i = 0; i < CRC_STRIDE; i += 8) {
            uint64_t w0, w1, w2;
            memcpy(&w0, p + i, 8);
            memcpy(&w1, p + CRC_STRIDE + i, 8);
            memcpy(&w2, p + 2 * CRC_STRIDE + i, 8);
            c = _mm_crc32_u64(c, w0);
            c1 = _mm_crc32_u64(c1, w1);
            c2 = _mm_crc32_u64(c2, w2);
        }
        c = crc_shift_stride((uint32_t)c) ^ (uint32_t)c1;
        c = crc_shift_stride((uint32_t)c) ^ (uint32_t)c2;
        p += 3 * CRC_STRIDE;
        len -= 3 * CRC_STRIDE;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, sizeof w); /* unaligned-safe load; x86 is little-endian as crc32 expects */
        c = _mm_crc32_u64(c, w);
        p += 8;
        len -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (len--)
        c32 = _mm_crc32_u8(c32, *p++);
    return ~c32;
}
#endif

/* Without SSE4.2 this falls back to the table path (same result), because a
 * CRC return value has no room for an error code. */
uint32_t cossd_crc32c_sse42(uint32_t crc, const void *buf, size_t len)
{
#if COSSD_X86
    if (g_has_sse42 && buf)
        return crc32c_sse42_impl(crc, (const uint8_t *)buf, len);
#endif
    return cossd_crc32c_scalar(crc, buf, len);
}

uint32_t cossd_crc32c(uint32_t crc, const void *buf, size_t len)
{
    if (simd_enabled())
        return cossd_crc32c_sse42(crc, buf, len);
    return cossd_crc32c_scalar(crc, buf, len);
}

void cossd_crc32c_blocks(const void *buf, size_t len, size_t block, uint32_t *out)
{
    const uint8_t *p = buf;
    for (size_t at = 0, i = 0; at < len; at += block, i++)
        out[i] = cossd_crc32c(0, p + at, len - at < block ? len - at : block);
}

/* ---- Combination: CRC(A|B) from CRC(A), CRC(B) and |B| -------------------- */

/* Product of two polynomials modulo the (reflected) CRC32C polynomial; bit 31 is x^0. */
static uint32_t crc_multmodp(uint32_t a, uint32_t b)
{
    uint32_t product = 0;
    for (uint32_t bit = 1u << 31; bit; bit >>= 1) {
        if (a & bit)
            product ^= b;
        b = (b & 1u) ? (b >> 1) ^ CRC32C_POLY_REFLECTED : b >> 1;
    }
    return product;
}

/* x^n modulo the polynomial, reflected as the CRC register is (bit 31 is x^0), by squaring:
 * x^(2^k) for every set bit k of n. */
static uint32_t crc_xnmodp(uint64_t n)
{
    uint32_t result = 1u << 31, power = 1u << 30; /* x^0, x^1 */
    while (n) {
        if (n & 1u)
            result = crc_multmodp(power, result);
        power = crc_multmodp(power, power);
        n >>= 1;
    }
    return result;
}

/* x^(8 * len): what `len` bytes move a CRC register by. */
static uint32_t crc_x8nmodp(uint64_t len) { return crc_xnmodp(8 * len); }

/* The chunk joins of cossd_adam_step_crc shift by the same length again and again: that
 * power is computed once. */
uint32_t crc_shift_bytes(uint32_t reg, uint64_t len)
{
    static uint32_t chunk_power; /* x^(8 * 2 * STEP_CRC_CHUNK) */
    uint32_t power = __atomic_load_n(&chunk_power, __ATOMIC_RELAXED);
    if (len != 2 * STEP_CRC_CHUNK || power == 0) {
        uint32_t computed = crc_x8nmodp(len);
        if (len == 2 * STEP_CRC_CHUNK)
            __atomic_store_n(&chunk_power, computed, __ATOMIC_RELAXED);
        power = computed;
    }
    return crc_multmodp(power, reg);
}

uint32_t cossd_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b)
{
    /* The CRC register is linear over GF(2): A's register, moved past |B| more bytes, XOR
     * the CRC of B alone. The pre- and post-inversion of both CRCs cancel out. */
    return crc_shift_bytes(crc_a, len_b) ^ crc_b;
}

/* ---- By carry-less multiplication (VPCLMULQDQ): 64 bytes per fold ---------- */

#if COSSD_X86
#define CRC_FOLD_MIN 256 /* below this the crc32 loop is as fast */

int crc_fold_usable(size_t len)
{
    return g_has_vpclmul && len >= CRC_FOLD_MIN && simd_level_now() == COSSD_SIMD_AVX512;
}

/* The raw CRC register after `len` (>= CRC_FOLD_MIN) more bytes. Four 64-byte accumulators
 * fold 256 bytes a round; what is left folds into one 128-bit value, whose register the
 * crc32 instruction gives (its 16 bytes from a zero register); the tail goes through crc32. */
__attribute__((target(COSSD_CLMUL_TARGET))) static uint32_t crc32c_fold_impl(uint32_t reg, const uint8_t *p, size_t len)
{
    __m512i x0 = _mm512_loadu_si512((const void *)p), x1 = _mm512_loadu_si512((const void *)(p + 64));
    __m512i x2 = _mm512_loadu_si512((const void *)(p + 128)), x3 = _mm512_loadu_si512((const void *)(p + 192));
    /* The register is XORed onto the message's first 4 bytes. */
    x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)reg)));
    p += 256;
    len -= 256;
    __m512i k = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)g_fold[FOLD_2048][1], (long long)g_fold[FOLD_2048][0]));
    for (; len >= 256; p += 256, len -= 256) {
        x0 = fold_zmm(x0, k, _mm512_loadu_si512((const void *)p));
        x1 = fold_zmm(x1, k, _mm512_loadu_si512((const void *)(p + 64)));
        x2 = fold_zmm(x2, k, _mm512_loadu_si512((const void *)(p + 128)));
        x3 = fold_zmm(x3, k, _mm512_loadu_si512((const void *)(p + 192)));
    }
    k = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)g_fold[FOLD_512][1], (long long)g_fold[FOLD_512][0]));
    x1 = fold_zmm(x0, k, x1);
    x2 = fold_zmm(x1, k, x2);
    x3 = fold_zmm(x2, k, x3);
    for (; len >= 64; p += 64, len -= 64)
        x3 = fold_zmm(x3, k, _mm512_loadu_si512((const void *)p));
    /* Lane 0 is the earliest (highest degree): 384 bits from the end, lane 3 the last. */
    __m128i r = _mm512_extracti32x4_epi32(x3, 3);
    r = _mm_xor_si128(r, fold_xmm(_mm512_extracti32x4_epi32(x3, 0), FOLD_384));
    r = _mm_xor_si128(r, fold_xmm(_mm512_extracti32x4_epi32(x3, 1), FOLD_256));
    r = _mm_xor_si128(r, fold_xmm(_mm512_extracti32x4_epi32(x3, 2), FOLD_128));
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(r));
    c = _mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(r, 1));
    for (; len >= 8; p += 8, len -= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
    }
    uint32_t c32 = (uint32_t)c;
    while (len--)
        c32 = _mm_crc32_u8(c32, *p++);
    return c32;
}

uint32_t crc32c_fold(uint32_t reg, const uint8_t *p, size_t len) { return crc32c_fold_impl(reg, p, len); }
#endif
