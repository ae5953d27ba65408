/* cossd_internal.h: what the kernel files share and the library does not export: toolchain checks, CPU feature flags, the per-ISA kernel tables' types, the streaming-store plan. */
#ifndef COSSD_INTERNAL_H
#define COSSD_INTERNAL_H

/*
 * Design rules, all in service of "every SIMD path is bit-identical to the
 * scalar path and all are reproducible IEEE float32":
 *  - build with -ffp-contract=off and never -ffast-math: GCC implements the
 *    _mm256_mul_ps/_mm512_add_ps/... intrinsics as generic vector arithmetic,
 *    so with contraction enabled it could fuse them into FMAs and change
 *    rounding. The only FMAs are the explicit fmaf()/SIMD_FMA calls, in the
 *    same three places in every path.
 *  - only correctly rounded operations (+ - * / sqrt, fma where the contract
 *    says so) in exactly the same order in all paths; the AVX2 tail reuses the
 *    scalar element function, the AVX-512 tail is the vector code with masked
 *    loads and stores (elementwise, so the same bits).
 *  - every kernel reads all inputs of an element before writing its outputs,
 *    so identical in/out pointers (in-place updates) are safe.
 *  - no allocation, no I/O, no global state apart from the CPU feature flags,
 *    the SIMD level cap, the stream threshold and the CRC tables (filled once
 *    by the load-time constructor in dispatch.c).
 *  - SIMD code is compiled per function (__attribute__((target))), never per
 *    file, because setuptools passes one flag list to every source; the entry
 *    points that check the CPU have no target attribute, so nothing before the
 *    check can use an instruction the CPU lacks.
 */

#include <stddef.h>
#include <stdint.h>

#include "cossd_kernels.h"
#include "cossd_scalar.h"

#if !defined(__GNUC__)
#error "cossd kernels need GCC or Clang (target attributes, __builtin_cpu_supports, constructors)"
#endif

/* Clang honours this pragma; GCC would only warn about it and relies on -ffp-contract=off. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

/* -DCOSSD_NO_SIMD builds the scalar-only variant, as on non-x86 targets. */
#if defined(__x86_64__) && !defined(COSSD_NO_SIMD)
#define COSSD_X86 1
#include <immintrin.h>
#else
#define COSSD_X86 0
#endif

/* Shared between the kernel files, not exported from the module. */
#define COSSD_HIDDEN __attribute__((visibility("hidden")))

#define COSSD_COUNT_ERROR ((size_t)-1)

/* The ISA sets, named once: the SIMD paths' functions carry these as target attributes. */
#define COSSD_AVX2_TARGET "avx2,f16c,fma"
#define COSSD_AVX512_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx2,f16c,fma"
#define COSSD_AVX2 __attribute__((target(COSSD_AVX2_TARGET)))
#define COSSD_AVX512 __attribute__((target(COSSD_AVX512_TARGET)))

/* ---- Runtime state (dispatch.c) ---------------------------------------- */

extern COSSD_HIDDEN int g_has_avx2;    /* AVX2 + F16C + FMA usable (CPU and OS) */
extern COSSD_HIDDEN int g_has_avx512;  /* AVX-512 F/BW/DQ/VL (+ the AVX2 set) usable, ZMM/opmask state enabled by the OS */
extern COSSD_HIDDEN int g_has_sse42;   /* SSE4.2 crc32 instruction usable */
extern COSSD_HIDDEN int g_has_vpclmul; /* VPCLMULQDQ on ZMM registers (with the AVX-512 set) usable */
/* The caller's cap on the level (cossd_set_simd_level); the dispatchers use min(cap, best). */
extern COSSD_HIDDEN int g_simd_cap;
extern COSSD_HIDDEN int g_best_level; /* highest COSSD_SIMD_* level this CPU runs */

/* Relaxed atomics: the cap may be changed while other threads run kernels;
 * every path gives the same bits, so a racing call may use either. */
COSSD_INLINE int simd_cap(void) { return __atomic_load_n(&g_simd_cap, __ATOMIC_RELAXED); }
COSSD_INLINE int simd_enabled(void) { return simd_cap() != COSSD_SIMD_SCALAR; }
/* The level the dispatching entry points run now (cossd_simd_level). */
COSSD_INLINE int simd_level_now(void)
{
    int cap = simd_cap();
    return cap < g_best_level ? cap : g_best_level;
}

/* Fills cossd_fp8_lut (cossd_scalar.h) from fp8_decode; called by the module's constructor. */
COSSD_HIDDEN void cossd_fp8_init(void);

/* 1 where this CPU runs `level` (any COSSD_SIMD_* value; the scalar level always). */
COSSD_HIDDEN int cossd_level_present(int level);

/* ---- Per-ISA kernels: arguments checked, n > 0, the ISA present -------- */

/* One table entry per level (scalar, avx2, avx512); the public entry points check the
 * arguments and the CPU once, then call the entry of the level asked for. */
typedef void adam_kernel_fn(const void *grad, int gfmt, const float *mi, const void *ai, const void *vi,
                            float *mo, void *ao, void *vo, int sfmt, uint16_t *po, int pfmt, size_t n,
                            const adam_k *k);
typedef void m2p_kernel_fn(const float *master, uint16_t *param_out, int fmt, size_t n);
typedef void p2m_kernel_fn(const uint16_t *param, int fmt, float *master_out, size_t n);

/* adam.c and convert.c */
COSSD_HIDDEN adam_kernel_fn adam_kernel_scalar;
COSSD_HIDDEN m2p_kernel_fn m2p_kernel_scalar;
COSSD_HIDDEN p2m_kernel_fn p2m_kernel_scalar;
#if COSSD_X86
/* simd_avx2.c and simd_avx512.c: one body each (adam_body.h, convert_body.h) over simd.h */
COSSD_HIDDEN adam_kernel_fn adam_kernel_avx2, adam_kernel_avx512;
COSSD_HIDDEN m2p_kernel_fn m2p_kernel_avx2, m2p_kernel_avx512;
COSSD_HIDDEN p2m_kernel_fn p2m_kernel_avx2, p2m_kernel_avx512;
#endif

/* ---- Streaming (non-temporal) stores ------------------------------------
 * A write-only output stream (param_out always; master/exp_avg/exp_avg_sq
 * out when they are not the input's memory) costs a read-for-ownership per
 * cache line with ordinary stores: on a call far larger than the caches that
 * is 2 extra bytes per element for an in-place step (30 instead of 28) and 14
 * for an out-of-place one. Streaming stores skip that read. On a call that
 * fits the caches they would instead push the outputs (which the caller is
 * about to read, e.g. the device's staging buffers) out to DRAM, so they are
 * used only when the call's footprint (bytes read + written) reaches a
 * threshold. Outputs that are also inputs keep ordinary stores: their lines
 * were just read, and streaming them measured 23-31% slower. Values are
 * unaffected; only where the bytes travel changes. */

/* The stream bits (COSSD_STREAM_*) are in the header: tests ask cossd_adam_stream_plan. */
#define NT_MASTER ((unsigned)COSSD_STREAM_MASTER)
#define NT_EXP_AVG ((unsigned)COSSD_STREAM_EXP_AVG)
#define NT_EXP_AVG_SQ ((unsigned)COSSD_STREAM_EXP_AVG_SQ)
#define NT_PARAM ((unsigned)COSSD_STREAM_PARAM)

/* The footprint from which the SIMD paths stream (cossd_set_stream_threshold; dispatch.c). */
extern COSSD_HIDDEN size_t g_stream_min_bytes;

COSSD_INLINE int same_memory(const void *a, const void *b) { return a == b; }

COSSD_INLINE int aligned_to(const void *p, size_t bytes) { return ((uintptr_t)p & (bytes - 1)) == 0; }

#define NT_ALL (NT_MASTER | NT_EXP_AVG | NT_EXP_AVG_SQ | NT_PARAM)

/* The NT_* bits for the vector loop that starts at element i0 with `lanes`
 * elements per vector: a stream qualifies if it is write-only and its vector
 * stores from i0 on are aligned (streaming stores require it; the element
 * stride keeps them aligned once the first one is). The result is one of three
 * masks, each with its own compiled loop: 0, NT_PARAM (an in-place step) or
 * NT_ALL (out of place). A loop that tested the bits at run time measured
 * twice the instructions per element; mixed cases (some outputs in place, or
 * misaligned against master_out) fall back to the largest of the three that fits. */
COSSD_INLINE unsigned adam_stream_mask(const float *mi, const void *ai, const void *vi, float *mo, void *ao, void *vo,
                                       int sfmt, uint16_t *po, size_t n, size_t i0, size_t lanes)
{
    size_t ssz = sfmt == COSSD_STATE_BF16 ? 2 : 4;
    /* grad 2 + master 4 + 4 + moments 2 x (ssz + ssz) + param 2 */
    size_t per_elem = 12 + 4 * ssz;
    size_t min_bytes = __atomic_load_n(&g_stream_min_bytes, __ATOMIC_RELAXED);
    if (n < i0 + lanes || n > SIZE_MAX / per_elem || n * per_elem < min_bytes)
        return 0;
    unsigned mask = 0;
    if (!same_memory(mo, mi) && aligned_to(mo + i0, 4 * lanes))
        mask |= NT_MASTER;
    if (!same_memory(ao, ai) && aligned_to((const char *)ao + i0 * ssz, ssz * lanes))
        mask |= NT_EXP_AVG;
    if (!same_memory(vo, vi) && aligned_to((const char *)vo + i0 * ssz, ssz * lanes))
        mask |= NT_EXP_AVG_SQ;
    if (aligned_to(po + i0, 2 * lanes))
        mask |= NT_PARAM;
    return mask == NT_ALL ? NT_ALL : mask & NT_PARAM;
}

/* Below this many elements the SIMD paths' alignment peel is not worth its setup. */
#define COSSD_PEEL_MIN 128

/* Elements the SIMD paths run before the vector loop so that master_out is aligned to
 * `vec_bytes` there (no store splits a cache line; streaming stores need it). */
COSSD_INLINE size_t adam_peel(const float *mo, size_t n, size_t vec_bytes)
{
    return n >= COSSD_PEEL_MIN ? (((uintptr_t)0 - (uintptr_t)mo) & (vec_bytes - 1)) / sizeof(float) : 0;
}

/* Calls BODY(GF, SF, PF, DC) with compile-time constant formats and mode, one
 * call per combination (16), so that every specialised inner loop is
 * branch-free. Expects gfmt, sfmt, pfmt and k (an adam_k *) in scope. */
#define ADAM_SPECIALISE_HALF(BODY)                                                                           \
    do {                                                                                                     \
        if (gfmt == COSSD_HALF_BF16)                                                                         \
            ADAM_SPEC_SF(BODY, COSSD_HALF_BF16);                                                             \
        else                                                                                                 \
            ADAM_SPEC_SF(BODY, COSSD_HALF_FP16);                                                             \
    } while (0)
/* ADAM_SPECIALISE_HALF over every gradient format (COSSD_GRAD_*): 40 combinations. */
#define ADAM_SPECIALISE(BODY)                                                                                \
    do {                                                                                                     \
        switch (gfmt) {                                                                                      \
        case COSSD_GRAD_FP32: ADAM_SPEC_SF(BODY, COSSD_GRAD_FP32); break;                                    \
        case COSSD_GRAD_FP8_E4M3: ADAM_SPEC_SF(BODY, COSSD_GRAD_FP8_E4M3); break;                            \
        case COSSD_GRAD_FP8_E5M2: ADAM_SPEC_SF(BODY, COSSD_GRAD_FP8_E5M2); break;                            \
        default: ADAM_SPECIALISE_HALF(BODY); break;                                                          \
        }                                                                                                    \
    } while (0)
#define ADAM_SPEC_SF(BODY, GF)                                                                               \
    do {                                                                                                     \
        if (sfmt == COSSD_STATE_BF16)                                                                        \
            ADAM_SPEC_PF(BODY, GF, COSSD_STATE_BF16);                                                        \
        else                                                                                                 \
            ADAM_SPEC_PF(BODY, GF, COSSD_STATE_FP32);                                                        \
    } while (0)
#define ADAM_SPEC_PF(BODY, GF, SF)                                                                           \
    do {                                                                                                     \
        if (pfmt == COSSD_HALF_BF16)                                                                         \
            ADAM_SPEC_DC(BODY, GF, SF, COSSD_HALF_BF16);                                                     \
        else                                                                                                 \
            ADAM_SPEC_DC(BODY, GF, SF, COSSD_HALF_FP16);                                                     \
    } while (0)
#define ADAM_SPEC_DC(BODY, GF, SF, PF)                                                                       \
    do {                                                                                                     \
        if (k->decoupled)                                                                                    \
            BODY(GF, SF, PF, 1);                                                                             \
        else                                                                                                 \
            BODY(GF, SF, PF, 0);                                                                             \
    } while (0)


#endif /* COSSD_INTERNAL_H */
