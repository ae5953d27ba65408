/* adam_body.h: the Adam step's vector loop, written once on simd.h and compiled per ISA (simd_avx2.c, simd_avx512.c; block_update.c reuses its AVX-512 vector math). */

/*
 * Include after simd.h. Every function here is SIMD_FN (inlined, compiled for the
 * ISA), in adam_elem's exact operation order (cossd_scalar.h), so that every
 * path gives the scalar path's bits.
 */

#ifndef COSSD_ADAM_BODY_H
#define COSSD_ADAM_BODY_H

/* The broadcast scalars, built once per call. */
typedef struct {
    simd_f grad_scale, beta2, lerp_coeff, omb2, eps, neg_step, bc2_sqrt, decay, wd;
    simd_flag lerp_from_grad; /* picks g or m_in as the lerp's addend */
} adam_vk;

SIMD_FN adam_vk adam_vk_make(const adam_k *k)
{
    adam_vk c;
    c.grad_scale = SIMD_SET1(k->grad_scale);
    c.beta2 = SIMD_SET1(k->beta2);
    c.lerp_coeff = SIMD_SET1(k->lerp_coeff);
    c.omb2 = SIMD_SET1(k->omb2);
    c.eps = SIMD_SET1(k->eps);
    c.neg_step = SIMD_SET1(-k->step_size); /* negation is exact: same as scalar -step*m */
    c.bc2_sqrt = SIMD_SET1(k->bc2_sqrt);
    c.decay = SIMD_SET1(k->decay);
    c.wd = SIMD_SET1(k->wd);
    c.lerp_from_grad = SIMD_FLAG(k->lerp_from_grad);
    return c;
}

SIMD_FN simd_f simd_load_state(const void *p, size_t i, int fmt, simd_mask km, int masked)
{
    if (fmt == COSSD_STATE_BF16)
        return simd_h_to_f32(simd_loadh((const uint16_t *)p + i, km, masked), COSSD_HALF_BF16);
    return simd_loadf((const float *)p + i, km, masked);
}

SIMD_FN void simd_store_state(void *p, size_t i, int fmt, simd_f x, simd_mask km, int masked)
{
    if (fmt == COSSD_STATE_BF16)
        simd_storeh((uint16_t *)p + i, simd_f32_to_bf16(x), km, masked);
    else
        simd_storef((float *)p + i, x, km, masked);
}

SIMD_FN void simd_put_state(void *p, size_t i, int fmt, simd_f x, int stream)
{
    if (fmt == COSSD_STATE_BF16)
        simd_puth((uint16_t *)p + i, simd_f32_to_bf16(x), stream);
    else
        simd_putf((float *)p + i, x, stream);
}

/* The step's arithmetic on loaded (decoded) operands, in adam_elem's order: the new master
 * (NaN made canonical), exp_avg and exp_avg_sq. Shared with the block-scaled formats
 * (qstate_body.h), which decode their moments differently. */
SIMD_FN void adam_vec_core(simd_f g, simd_f p, simd_f m_in, simd_f v_in, const adam_vk *c, int decoupled,
                           simd_f *p_out, simd_f *m_out, simd_f *v_out)
{
    if (decoupled)
        p = SIMD_MUL(p, c->decay);
    else
        g = SIMD_FMA(c->wd, p, g); /* fused, mirroring fmaf() in adam_elem */
    /* torch's lerp, fused as in adam_elem */
    simd_f m = SIMD_FMA(c->lerp_coeff, SIMD_SUB(g, m_in), simd_pick(c->lerp_from_grad, g, m_in));
    simd_f v = SIMD_FMA(SIMD_MUL(c->omb2, g), g, SIMD_MUL(v_in, c->beta2));
    simd_f denom = SIMD_ADD(SIMD_DIV(SIMD_SQRT(v), c->bc2_sqrt), c->eps);
    p = SIMD_ADD(p, SIMD_DIV(SIMD_MUL(c->neg_step, m), denom));
    *p_out = simd_canon_nan(p);
    *m_out = m;
    *v_out = v;
}

/* The new master (NaN made canonical), exp_avg and exp_avg_sq of elements i..i+LANES-1
 * (only the lanes in km when masked), from gradient bits already loaded: the checksummed
 * block update counts the non-finite ones from the same register the step uses. Lanes
 * outside km compute on zeros and are discarded. graw: the gradient decoded, before grad_scale. */
SIMD_FN void adam_vec_math(simd_f graw, const float *mi, const void *ai, const void *vi, int sfmt,
                           size_t i, const adam_vk *c, int decoupled, simd_mask km, int masked, simd_f *p_out,
                           simd_f *m_out, simd_f *v_out)
{
    simd_f g = SIMD_MUL(graw, c->grad_scale);
    simd_f p = simd_loadf(mi + i, km, masked);
    simd_f m_in = simd_load_state(ai, i, sfmt, km, masked);
    simd_f v_in = simd_load_state(vi, i, sfmt, km, masked);
    adam_vec_core(g, p, m_in, v_in, c, decoupled, p_out, m_out, v_out);
}

/* Elements i..i+LANES-1 (only the lanes in km when masked): computed and stored, the
 * outputs in `nt` (NT_* bits) with streaming stores. */
SIMD_FN void adam_vec(const void *grad, int gfmt, const float *mi, const void *ai, const void *vi, float *mo,
                      void *ao, void *vo, int sfmt, uint16_t *po, int pfmt, size_t i, const adam_vk *c,
                      int decoupled, simd_mask km, int masked, unsigned nt)
{
    simd_f p, m, v;
    adam_vec_math(simd_load_grad(grad, i, gfmt, km, masked), mi, ai, vi, sfmt, i, c, decoupled, km, masked, &p, &m,
                  &v);
    if (masked) { /* peel and tail: never streamed (callers pass nt == 0) */
        simd_storef(mo + i, p, km, 1);
        simd_store_state(ao, i, sfmt, simd_canon_nan(m), km, 1);
        simd_store_state(vo, i, sfmt, simd_canon_nan(v), km, 1);
        simd_storeh(po + i, simd_f32_to_half(p, pfmt), km, 1);
        return;
    }
    simd_putf(mo + i, p, nt & NT_MASTER);
    simd_put_state(ao, i, sfmt, simd_canon_nan(m), nt & NT_EXP_AVG);
    simd_put_state(vo, i, sfmt, simd_canon_nan(v), nt & NT_EXP_AVG_SQ);
    simd_puth(po + i, simd_f32_to_half(p, pfmt), nt & NT_PARAM);
}

/* ADAM_GROUP vectors of elements from i on, unmasked: every stream's loads first, then the
 * arithmetic, then the stores. In place, a store may alias a later load, so neither the
 * compiler nor the core can move the next vector's loads above this one's stores (and the
 * arrays, a multiple of 4 KiB apart, alias in the store buffer); grouped, each stream is read
 * in runs of ADAM_GROUP vectors. On a 2-core AMD EPYC VM that gave a memory-bound loop 4-5%
 * more elements/s, and the kernel 2-4% at one thread in alternating bench runs (none
 * measurable at two). Same operations per element, in the same order: the same bits. */
#define ADAM_GROUP 4
SIMD_FN void adam_vec_group(const void *grad, int gfmt, const float *mi, const void *ai, const void *vi, float *mo,
                            void *ao, void *vo, int sfmt, uint16_t *po, int pfmt, size_t i, const adam_vk *c,
                            int decoupled, unsigned nt)
{
    simd_f g[ADAM_GROUP], p[ADAM_GROUP], m[ADAM_GROUP], v[ADAM_GROUP];
    for (int u = 0; u < ADAM_GROUP; u++)
        g[u] = SIMD_MUL(simd_load_grad(grad, i + (size_t)u * SIMD_LANES, gfmt, SIMD_MASK_ALL, 0), c->grad_scale);
    for (int u = 0; u < ADAM_GROUP; u++)
        p[u] = simd_loadf(mi + i + (size_t)u * SIMD_LANES, SIMD_MASK_ALL, 0);
    for (int u = 0; u < ADAM_GROUP; u++)
        m[u] = simd_load_state(ai, i + (size_t)u * SIMD_LANES, sfmt, SIMD_MASK_ALL, 0);
    for (int u = 0; u < ADAM_GROUP; u++)
        v[u] = simd_load_state(vi, i + (size_t)u * SIMD_LANES, sfmt, SIMD_MASK_ALL, 0);
    for (int u = 0; u < ADAM_GROUP; u++)
        adam_vec_core(g[u], p[u], m[u], v[u], c, decoupled, &p[u], &m[u], &v[u]);
    for (int u = 0; u < ADAM_GROUP; u++)
        simd_putf(mo + i + (size_t)u * SIMD_LANES, p[u], nt & NT_MASTER);
    for (int u = 0; u < ADAM_GROUP; u++)
        simd_put_state(ao, i + (size_t)u * SIMD_LANES, sfmt, simd_canon_nan(m[u]), nt & NT_EXP_AVG);
    for (int u = 0; u < ADAM_GROUP; u++)
        simd_put_state(vo, i + (size_t)u * SIMD_LANES, sfmt, simd_canon_nan(v[u]), nt & NT_EXP_AVG_SQ);
    for (int u = 0; u < ADAM_GROUP; u++)
        simd_puth(po + i + (size_t)u * SIMD_LANES, simd_f32_to_half(p[u], pfmt), nt & NT_PARAM);
}

/* Elements [from, to) before or after the vector loop (fewer than LANES): one masked vector
 * where the ISA has masks, else the scalar element function. */
SIMD_FN void adam_edge(const void *grad, int gfmt, const float *mi, const void *ai, const void *vi, float *mo,
                       void *ao, void *vo, int sfmt, uint16_t *po, int pfmt, size_t from, size_t to,
                       const adam_vk *c, const adam_k *k, int decoupled)
{
    if (from >= to)
        return;
#if SIMD_MASKED
    (void)k;
    adam_vec(grad, gfmt, mi, ai, vi, mo, ao, vo, sfmt, po, pfmt, from, c, decoupled, SIMD_MASK_FIRST(to - from), 1,
             0);
#else
    (void)c;
    (void)decoupled;
    for (size_t i = from; i < to; i++)
        adam_elem(grad, gfmt, mi, ai, vi, mo, ao, vo, sfmt, po, pfmt, i, k);
#endif
}

/* Always inlined with constant formats/mode (see ADAM_SPECIALISE). */
SIMD_FN void adam_body(const void *grad, int gfmt, const float *mi, const void *ai, const void *vi, float *mo,
                       void *ao, void *vo, int sfmt, uint16_t *po, int pfmt, size_t n, const adam_k *k,
                       int decoupled)
{
    const adam_vk c = adam_vk_make(k);
    /* The first elements on their own, until master_out is aligned to a vector, so that no
     * vector store splits a cache line. Measured on 16M-element numpy arrays (which start
     * 16 bytes past a 64-byte boundary): ~10% more elements/s with AVX2, ~15% with AVX-512;
     * no change when already aligned. */
    size_t i = adam_peel(mo, n, SIMD_BYTES);
    adam_edge(grad, gfmt, mi, ai, vi, mo, ao, vo, sfmt, po, pfmt, 0, i, &c, k, decoupled);
    /* One loop per streaming mask, each with the mask a constant (see adam_stream_mask). */
#define ADAM_LOOP(NT)                                                                                        \
    do {                                                                                                     \
        for (const size_t stop = i + (n - i) / (ADAM_GROUP * SIMD_LANES) * (ADAM_GROUP * SIMD_LANES); i < stop; \
             i += ADAM_GROUP * SIMD_LANES)                                                                   \
            adam_vec_group(grad, gfmt, mi, ai, vi, mo, ao, vo, sfmt, po, pfmt, i, &c, decoupled, NT);        \
        for (const size_t stop = i + (n - i) / SIMD_LANES * SIMD_LANES; i < stop; i += SIMD_LANES)           \
            adam_vec(grad, gfmt, mi, ai, vi, mo, ao, vo, sfmt, po, pfmt, i, &c, decoupled, SIMD_MASK_ALL, 0, NT); \
    } while (0)
    unsigned nt = adam_stream_mask(mi, ai, vi, mo, ao, vo, sfmt, po, n, i, SIMD_LANES);
    if (nt == NT_ALL)
        ADAM_LOOP(NT_ALL);
    else if (nt == NT_PARAM)
        ADAM_LOOP(NT_PARAM);
    else
        ADAM_LOOP(0);
#undef ADAM_LOOP
    if (nt)
        _mm_sfence(); /* streaming stores are weakly ordered: publish them before returning */
    adam_edge(grad, gfmt, mi, ai, vi, mo, ao, vo, sfmt, po, pfmt, i, n, &c, k, decoupled);
}

/* The 16 specialisations of adam_body, one of them chosen per call. */
SIMD_FN void adam_simd(const void *grad, int gfmt, const float *mi, const void *ai, const void *vi, float *mo,
                       void *ao, void *vo, int sfmt, uint16_t *po, int pfmt, size_t n, const adam_k *k)
{
#define ADAM_CALL(GF, SF, PF, DC) adam_body(grad, GF, mi, ai, vi, mo, ao, vo, SF, po, PF, n, k, DC)
    ADAM_SPECIALISE(ADAM_CALL);
#undef ADAM_CALL
}

#endif /* COSSD_ADAM_BODY_H */
