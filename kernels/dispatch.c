/* dispatch.c: CPU feature detection at load time, the process-wide SIMD level cap and the streaming-store threshold that every kernel's dispatch reads. */

#include "cossd_internal.h"
#include "crc32c_internal.h"
#include "qstate_scalar.h"

COSSD_HIDDEN int g_has_avx2;
COSSD_HIDDEN int g_has_avx512;
COSSD_HIDDEN int g_has_sse42;
COSSD_HIDDEN int g_has_vpclmul;
COSSD_HIDDEN int g_best_level;
/* Starts at the top, i.e. "best available". */
COSSD_HIDDEN int g_simd_cap = COSSD_SIMD_AVX512;

/* 32 MiB: about this machine class's L3. Measured (one thread, repeated calls
 * on the same buffers): streaming is a loss at 7 and 14 MiB footprints and a
 * gain from 28 MiB up. Process-wide, relaxed like the SIMD cap: every value
 * gives the same results. */
COSSD_HIDDEN size_t g_stream_min_bytes = (size_t)32 << 20;

__attribute__((constructor)) static void cossd_init(void)
{
    /* Constructors can run before libgcc initialised its CPU model. */
#if COSSD_X86
    __builtin_cpu_init();
    g_has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
    /* libgcc reports avx512* only when XCR0 shows the OS saves opmask/ZMM state. */
    g_has_avx512 = g_has_avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    g_has_sse42 = __builtin_cpu_supports("sse4.2");
    g_has_vpclmul = g_has_avx512 && g_has_sse42 && __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("popcnt") &&
                    __builtin_cpu_supports("vpclmulqdq");
#endif
    g_best_level = g_has_avx512 ? COSSD_SIMD_AVX512 : g_has_avx2 ? COSSD_SIMD_AVX2 : COSSD_SIMD_SCALAR;
    /* One constructor for the whole module, so the tables are filled in a known order. */
    cossd_crc_init();
    cossd_qmap_init(); /* the INT8 moment maps (qstate.c) */
    cossd_fp8_init();  /* the FP8 gradient decode tables (convert.c) */
}

int cossd_level_present(int level)
{
    switch (level) {
    case COSSD_SIMD_SCALAR:
        return 1;
    case COSSD_SIMD_AVX2:
        return g_has_avx2;
    case COSSD_SIMD_AVX512:
        return g_has_avx512;
    default:
        return 0;
    }
}

int cossd_simd_available(void) { return g_has_avx2; }
int cossd_avx512_available(void) { return g_has_avx512; }
int cossd_crc_simd_available(void) { return g_has_sse42; }
int cossd_crc_fold_available(void) { return g_has_vpclmul; }
int cossd_simd_level_available(void) { return g_best_level; }

void cossd_set_simd_level(int level)
{
    level = level < COSSD_SIMD_SCALAR ? COSSD_SIMD_SCALAR : level > COSSD_SIMD_AVX512 ? COSSD_SIMD_AVX512 : level;
    __atomic_store_n(&g_simd_cap, level, __ATOMIC_RELAXED);
}

int cossd_simd_level(void) { return simd_level_now(); }
void cossd_set_simd(int enabled) { cossd_set_simd_level(enabled ? COSSD_SIMD_AVX512 : COSSD_SIMD_SCALAR); }
int cossd_simd_active(void) { return cossd_simd_level() != COSSD_SIMD_SCALAR; }

void cossd_set_stream_threshold(size_t bytes) { __atomic_store_n(&g_stream_min_bytes, bytes, __ATOMIC_RELAXED); }
size_t cossd_stream_threshold(void) { return __atomic_load_n(&g_stream_min_bytes, __ATOMIC_RELAXED); }
