/* qstate_body.h: the Adam step over block-scaled moments (FP16 with a scale per block, INT8 with a dynamic map and an absmax per block), written once on simd.h and compiled per ISA: one pass per block of 256, decode, step, new scale, encode. */

/*
 * Include after adam_body.h (it reuses adam_vk and adam_vec_core) and qstate_scalar.h. Each
 * block's full vectors run here, its last few elements (a call's last block only, when n is
 * not a multiple of the vector width) through the scalar element functions: every operation
 * is elementwise or an exact max, so the bits are the scalar path's. The INT8 encoder probes
 * the same 8 midpoints per element as q8_search: the first levels' from registers, the rest
 * with gathers.
 */

#ifndef COSSD_QSTATE_BODY_H
#define COSSD_QSTATE_BODY_H

#if defined(SIMD_ISA_AVX512)
typedef __m512i simd_i;

SIMD_FN simd_f simd_abs(simd_f x) { return _mm512_abs_ps(x); }

/* The codes of elements i..i+15 as 32-bit lane indices. */
SIMD_FN simd_i simd_load_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }

SIMD_FN void simd_store_u8(uint8_t *p, simd_i idx) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(idx)); }

SIMD_FN simd_f simd_gather(const float *table, simd_i idx) { return _mm512_i32gather_ps(idx, table, 4); }

/* idx + (a < b ? add : 0) per lane */
SIMD_FN simd_i simd_add_if_lt(simd_i idx, simd_f a, simd_f b, int add)
{
    return _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), idx, _mm512_set1_epi32(add));
}

/* idx, raised to 1 where y > 0 */
SIMD_FN simd_i simd_at_least_one_if_positive(simd_i idx, simd_f y)
{
    return _mm512_mask_max_epu32(idx, _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_GT_OQ), idx,
                                 _mm512_set1_epi32(1));
}

/* amax = max(amax, |x|) over finite lanes; returns 1 if a lane is not finite. */
SIMD_FN int simd_amax(simd_f *amax, simd_f x)
{
    simd_f a = _mm512_abs_ps(x);
    __mmask16 finite = _mm512_cmp_ps_mask(a, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
    *amax = _mm512_mask_max_ps(*amax, finite, *amax, a);
    return finite != 0xFFFF;
}

SIMD_FN float simd_hmax(simd_f x) { return _mm512_reduce_max_ps(x); }

/* Lane bitmasks for the counters: x != 0 (true for NaN, as the scalar test), a code of +-0,
 * an inf/NaN code, an index equal to v. */
SIMD_FN unsigned simd_nonzero_bits(simd_f x) { return _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_UQ); }
SIMD_FN unsigned simd_h_zero_bits(simd_h h) { return _mm256_testn_epi16_mask(h, _mm256_set1_epi16(0x7FFF)); }
SIMD_FN unsigned simd_h_nonfinite_bits(simd_h h)
{
    const __m256i exponent = _mm256_set1_epi16(0x7C00);
    return _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, exponent), exponent);
}
SIMD_FN unsigned simd_idx_eq_bits(simd_i idx, unsigned v)
{
    return _mm512_cmpeq_epi32_mask(idx, _mm512_set1_epi32((int)v));
}

SIMD_FN simd_i simd_xor_0x80(simd_i idx) { return _mm512_xor_si512(idx, _mm512_set1_epi32(0x80)); }

/* Every level from registers: table[j] for j < entries (a constant once unrolled), by
 * permutes of 32 entries (vpermt2ps), the right one chosen per lane by j's range. Measured
 * against gathers (docs/kernels.md, "Block-scaled moments"). */
#define SIMD_REG_LEVELS 8
/* The decode's 256-entry map from registers too (8 permutes): faster than a gather here. */
#define SIMD_DECODE_LOOKUP(table, idx) simd_lookup(table, idx, 256)
SIMD_FN simd_f simd_lookup(const float *table, simd_i j, int entries)
{
    if (entries <= 16)
        return _mm512_permutexvar_ps(j, _mm512_load_ps(table));
    simd_f r = _mm512_permutex2var_ps(_mm512_load_ps(table), j, _mm512_load_ps(table + 16));
    for (int base = 32; base < entries; base += 32) {
        simd_f t = _mm512_permutex2var_ps(_mm512_load_ps(table + base), j, _mm512_load_ps(table + base + 16));
        r = _mm512_mask_mov_ps(r, _mm512_cmpge_epu32_mask(j, _mm512_set1_epi32(base)), t);
    }
    return r;
}
SIMD_FN simd_i simd_shift_right(simd_i x, int count) { return _mm512_srl_epi32(x, _mm_cvtsi32_si128(count)); }

/* h, raised to 1 (the smallest subnormal) where x > 0: such an h is a non-negative pattern */
SIMD_FN simd_h simd_h_at_least_one_if_positive(simd_h h, simd_f x)
{
    return _mm256_mask_max_epu16(h, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ), h,
                                 _mm256_set1_epi16(1));
}

#else
typedef __m256i simd_i;

SIMD_FN simd_i simd_load_u8(const uint8_t *p)
{
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)p));
}

SIMD_FN void simd_store_u8(uint8_t *p, simd_i idx)
{
    /* every lane is 0..255: the saturating packs are plain narrows, in element order */
    __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(idx), _mm256_extracti128_si256(idx, 1));
    _mm_storel_epi64((__m128i *)(void *)p, _mm_packus_epi16(w, w));
}

SIMD_FN simd_f simd_gather(const float *table, simd_i idx) { return _mm256_i32gather_ps(table, idx, 4); }

SIMD_FN simd_i simd_add_if_lt(simd_i idx, simd_f a, simd_f b, int add)
{
    __m256i lt = _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LT_OQ));
    return _mm256_add_epi32(idx, _mm256_and_si256(lt, _mm256_set1_epi32(add)));
}

SIMD_FN simd_i simd_at_least_one_if_positive(simd_i idx, simd_f y)
{
    __m256i pos = _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_GT_OQ));
    return _mm256_max_epu32(idx, _mm256_and_si256(pos, _mm256_set1_epi32(1)));
}

SIMD_FN int simd_amax(simd_f *amax, simd_f x)
{
    simd_f a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    __m256 finite = _mm256_cmp_ps(a, _mm256_set1_ps(INFINITY), _CMP_LT_OQ);
    *amax = _mm256_max_ps(*amax, _mm256_and_ps(finite, a)); /* a non-finite lane counts as +0 */
    return _mm256_movemask_ps(finite) != 0xFF;
}

SIMD_FN simd_i simd_xor_0x80(simd_i idx) { return _mm256_xor_si256(idx, _mm256_set1_epi32(0x80)); }

/* Levels up to 16 probes from registers (steps 128 down to 8), by permutes of 8 entries
 * (vpermps) chosen per lane by j's range; the last three by gathers. */
#define SIMD_REG_LEVELS 5
#define SIMD_DECODE_LOOKUP(table, idx) simd_gather(table, idx)
SIMD_FN simd_f simd_lookup(const float *table, simd_i j, int entries)
{
    simd_f r = _mm256_permutevar8x32_ps(_mm256_load_ps(table), j);
    for (int base = 8; base < entries; base += 8) {
        __m256 in_range = _mm256_castsi256_ps(_mm256_cmpgt_epi32(j, _mm256_set1_epi32(base - 1)));
        r = _mm256_blendv_ps(r, _mm256_permutevar8x32_ps(_mm256_load_ps(table + base), j), in_range);
    }
    return r;
}
SIMD_FN simd_i simd_shift_right(simd_i x, int count) { return _mm256_srl_epi32(x, _mm_cvtsi32_si128(count)); }

SIMD_FN simd_h simd_h_at_least_one_if_positive(simd_h h, simd_f x)
{
    __m256i pos = _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
    __m128i pos16 = _mm_packs_epi32(_mm256_castsi256_si128(pos), _mm256_extracti128_si256(pos, 1)); /* -1 or 0 */
    return _mm_max_epu16(h, _mm_and_si128(pos16, _mm_set1_epi16(1)));
}

SIMD_FN float simd_hmax(simd_f x)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

SIMD_FN unsigned simd_nonzero_bits(simd_f x)
{
    return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_NEQ_UQ));
}
/* One bit per 16-bit lane of an all-ones/all-zeros compare (the signed pack keeps -1 and 0). */
SIMD_FN unsigned simd_h_lane_bits(__m128i m16) { return (unsigned)_mm_movemask_epi8(_mm_packs_epi16(m16, m16)) & 0xFFu; }
SIMD_FN unsigned simd_h_zero_bits(simd_h h)
{
    return simd_h_lane_bits(_mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7FFF)), _mm_setzero_si128()));
}
SIMD_FN unsigned simd_h_nonfinite_bits(simd_h h)
{
    const __m128i exponent = _mm_set1_epi16(0x7C00);
    return simd_h_lane_bits(_mm_cmpeq_epi16(_mm_and_si128(h, exponent), exponent));
}
SIMD_FN unsigned simd_idx_eq_bits(simd_i idx, unsigned v)
{
    return (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(idx, _mm256_set1_epi32((int)v))));
}
#endif

/* Elements i..i+LANES-1 of a moment, decoded with their block's scale. */
SIMD_FN simd_f simd_q_decode(const void *codes, size_t i, simd_f scale, int fmt, int moment)
{
    if (fmt == COSSD_STATE_FP16)
        return SIMD_MUL(simd_h_to_f32(SIMD_LOADH((const uint16_t *)codes + i), COSSD_HALF_FP16), scale);
    simd_i idx = simd_load_u8((const uint8_t *)codes + i);
    if (moment == COSSD_MOMENT_EXP_AVG)
        idx = simd_xor_0x80(idx);
    return SIMD_MUL(SIMD_DECODE_LOOKUP(g_qmap[moment], idx), scale);
}

/* Encodes x as q_encode does, lane by lane, adding its lanes' underflows and overflows to c. */
SIMD_FN void simd_q_encode(void *codes, size_t i, simd_f x, const qblock_params *q, int fmt, int moment,
                           cossd_qstate_counts *c)
{
    if (fmt == COSSD_STATE_FP16) {
        simd_h h = simd_f32_to_fp16(SIMD_MUL(simd_canon_nan(x), SIMD_SET1(q->factor)));
        c->underflow[moment] += (uint64_t)__builtin_popcount(simd_h_zero_bits(h) & simd_nonzero_bits(x));
        c->overflow[moment] += (uint64_t)__builtin_popcount(simd_h_nonfinite_bits(h));
        if (moment == COSSD_MOMENT_EXP_AVG_SQ)
            h = simd_h_at_least_one_if_positive(h, x);
        SIMD_STOREH((uint16_t *)codes + i, h);
        return;
    }
    simd_f y = SIMD_DIV(x, SIMD_SET1(q->factor));
    const float *mid = g_qmid[moment];
#if defined(SIMD_ISA_AVX512)
    simd_i idx = _mm512_setzero_si512();
#else
    simd_i idx = _mm256_setzero_si256();
#endif
    /* q8_search, lane by lane: the first levels from registers (a level can reach only a
     * few midpoints: a permute of g_qprobe by idx / 2s), the last ones by gathers. */
    int step = 128, level = 0;
    for (; level < SIMD_REG_LEVELS; level++, step >>= 1) {
        simd_i j = simd_shift_right(idx, __builtin_ctz((unsigned)(2 * step)));
        idx = simd_add_if_lt(idx, simd_lookup(g_qprobe[moment][level], j, 1 << level), y, step);
    }
    for (; step; step >>= 1)
        idx = simd_add_if_lt(idx, simd_gather(mid + step - 1, idx), y, step);
    c->underflow[moment] +=
        (uint64_t)__builtin_popcount(simd_idx_eq_bits(idx, q8_zero_index(moment)) & simd_nonzero_bits(x));
    if (moment == COSSD_MOMENT_EXP_AVG_SQ)
        idx = simd_at_least_one_if_positive(idx, y);
    else
        idx = simd_xor_0x80(idx);
    simd_store_u8((uint8_t *)codes + i, idx);
}

/* Encode one block's new values buf[0..cnt) into codes[b0..) and its scale: the vectors
 * here, the last cnt % LANES elements by the scalar functions. */
SIMD_FN void simd_q_encode_block(const float *buf, size_t cnt, int fmt, int moment, void *codes, size_t b0,
                                 float *scale_out, cossd_qstate_counts *counts)
{
    size_t vec_end = cnt / SIMD_LANES * SIMD_LANES;
    simd_f amax_v = SIMD_SET1(0.0f);
    int nonfinite = 0;
    for (size_t j = 0; j < vec_end; j += SIMD_LANES)
        nonfinite |= simd_amax(&amax_v, SIMD_LOADF(buf + j));
    float amax = simd_hmax(amax_v);
    nonfinite |= q_amax(buf, vec_end, cnt, &amax);
    qblock_params q = qblock_params_of(amax, nonfinite, fmt);
    qcount_block(counts, moment, &q, amax, cnt);
    if (q.poisoned) {
        memset((uint8_t *)codes + b0, 0, cnt);
    } else {
        for (size_t j = 0; j < vec_end; j += SIMD_LANES)
            simd_q_encode(codes, b0 + j, SIMD_LOADF(buf + j), &q, fmt, moment, counts);
        for (size_t j = vec_end; j < cnt; j++)
            qcount_flags(counts, moment, q_encode(codes, b0 + j, buf[j], &q, fmt, moment));
    }
    *scale_out = q.stored;
}

/* Always inlined with constant formats and mode (ADAMQ_SPECIALISE). */
SIMD_FN void adamq_body(const void *grad, int gfmt, const float *mi, const void *ai, const float *as_in,
                        const void *vi, const float *vs_in, float *mo, void *ao, float *as_out, void *vo,
                        float *vs_out, int sfmt, uint16_t *po, int pfmt, size_t n, const adam_k *k, int decoupled,
                        cossd_qstate_counts *counts)
{
    const adam_vk c = adam_vk_make(k);
    float mbuf[COSSD_STATE_BLOCK] __attribute__((aligned(64)));
    float vbuf[COSSD_STATE_BLOCK] __attribute__((aligned(64)));
    for (size_t b0 = 0; b0 < n; b0 += QBLOCK) {
        size_t cnt = n - b0 < QBLOCK ? n - b0 : QBLOCK, blk = b0 / QBLOCK;
        size_t vec_end = cnt / SIMD_LANES * SIMD_LANES;
        /* Both scales read before anything of this block is written (in place, as_out is as_in). */
        float a_scale = as_in[blk], v_scale = vs_in[blk];
        const simd_f sa = SIMD_SET1(a_scale), sv = SIMD_SET1(v_scale);
        for (size_t j = 0; j < vec_end; j += SIMD_LANES) {
            size_t i = b0 + j;
            simd_f g = SIMD_MUL(simd_load_grad(grad, i, gfmt, SIMD_MASK_ALL, 0), c.grad_scale);
            simd_f p, m, v;
            adam_vec_core(g, SIMD_LOADF(mi + i), simd_q_decode(ai, i, sa, sfmt, COSSD_MOMENT_EXP_AVG),
                          simd_q_decode(vi, i, sv, sfmt, COSSD_MOMENT_EXP_AVG_SQ), &c, decoupled, &p, &m, &v);
            SIMD_STOREF(mo + i, p);
            SIMD_STOREH(po + i, simd_f32_to_half(p, pfmt));
            SIMD_STOREF(mbuf + j, m);
            SIMD_STOREF(vbuf + j, v);
        }
        for (size_t j = vec_end; j < cnt; j++)
            adamq_elem(grad, gfmt, mi, ai, a_scale, vi, v_scale, mo, sfmt, po, pfmt, b0 + j, k, &mbuf[j], &vbuf[j]);
        simd_q_encode_block(mbuf, cnt, sfmt, COSSD_MOMENT_EXP_AVG, ao, b0, &as_out[blk], counts);
        simd_q_encode_block(vbuf, cnt, sfmt, COSSD_MOMENT_EXP_AVG_SQ, vo, b0, &vs_out[blk], counts);
    }
}

void SIMD_KERNEL(adamq_kernel)(const void *grad, int gfmt, const float *mi, const void *ai, const float *as_in,
                               const void *vi, const float *vs_in, float *mo, void *ao, float *as_out, void *vo,
                               float *vs_out, int sfmt, uint16_t *po, int pfmt, size_t n, const adam_k *k,
                               cossd_qstate_counts *counts)
{
#define ADAMQ_CALL(GF, SF, PF, DC) \
    adamq_body(grad, GF, mi, ai, as_in, vi, vs_in, mo, ao, as_out, vo, vs_out, SF, po, PF, n, k, DC, counts)
    ADAMQ_SPECIALISE(ADAMQ_CALL);
#undef ADAMQ_CALL
}

#endif /* COSSD_QSTATE_BODY_H */
