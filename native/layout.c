/* Shard segment layout: computing it, writing it, validating it.
 *
 *   [0, 4096)        header (shmps_shard_hdr_t, zero padded)
 *   rowcnt_off       int64[nrows + 1]      csr only (dense: implicit, absent)
 *   colidx_off       int64[nnz] (csr) | uint64[nrows] keys (table); dense: absent
 *   value_off        dtype[nnz]
 *   state_off[k]     state_dtype[nnz]      k < nstate (optimizer state)
 *   rowstep_off      uint64[nrows]         csr and table: per-row step counts;
 *                                          dense outbox: per-row pending counts
 *   stripes_off      shmps_stripe_t[nstripes]
 *   index_off        table hash index: uint64[2 * nslots] (key, row+1 | flags)
 *   (table)          control block (SHMPS_TABLE_CTL_BYTES) at index_off + 16 * nslots,
 *                    then rowmeta {uint64 link}[nrows]; see table.c
 * Every array starts on a 64-byte boundary.  docs/segment-layout.md has the bytes.
 */
#include "internal.h"
#include <math.h>

#define ALIGN64(x) (((x) + 63ull) & ~63ull)

size_t shmps_dtype_size(uint32_t dtype) {
    switch (dtype) {
    case SHMPS_INT8: return 1;
    case SHMPS_INT32: return 4;
    case SHMPS_FLOAT16: return 2;
    case SHMPS_FLOAT32: return 4;
    case SHMPS_FLOAT64: return 8;
    default: return 0;
    }
}

/* Gradients for float16 tensors arrive as float32 (they are computed in float32). */
size_t shmps_grad_size(uint32_t dtype) {
    return dtype == SHMPS_FLOAT16 ? 4 : shmps_dtype_size(dtype);
}

static int is_float(uint32_t dtype) {
    return dtype == SHMPS_FLOAT16 || dtype == SHMPS_FLOAT32 || dtype == SHMPS_FLOAT64;
}

static uint32_t nstate_of(uint32_t updater, const double *params) {
    switch (updater) {
    case SHMPS_MOMENTUM: return 1;
    case SHMPS_ADAGRAD: return 1;
    case SHMPS_ADAM: return params[5] != 0.0 ? 3 : 2;
    case SHMPS_FTRL: return 2;
    default: return 0;
    }
}

/* The updater's hyper-parameters in the ranges shmps/updaters.py accepts (params[] by
 * updater: updaters.c): checked on creation and, through shmps_shard_validate, on
 * every attach, so a header written with lr = -1 (ascent instead of descent) or betas
 * >= 1 is refused as corrupt.  Python also compares the values with the catalog
 * record (_check_shards): in range but changed, such as lr = 1e300, is refused there. */
static int params_ok(uint32_t updater, const double *p) {
#define NONNEG(i) (p[i] >= 0.0)
#define FLAG(i) (p[i] == 0.0 || p[i] == 1.0)
#define UNIT(i) (p[i] >= 0.0 && p[i] < 1.0)
    switch (updater) {
    case SHMPS_SGD: return NONNEG(0) && NONNEG(1);
    case SHMPS_MOMENTUM: /* lr, momentum, dampening (any), nesterov, weight_decay */
        return NONNEG(0) && NONNEG(1) && FLAG(3) && NONNEG(4);
    case SHMPS_ADAGRAD: return NONNEG(0) && NONNEG(1) && NONNEG(2) && NONNEG(3) && NONNEG(4);
    case SHMPS_ADAM: return NONNEG(0) && UNIT(1) && UNIT(2) && NONNEG(3) && NONNEG(4) && FLAG(5);
    case SHMPS_FTRL: return p[0] > 0.0 && NONNEG(1) && NONNEG(2) && NONNEG(3);
    default: return 1; /* sum, assign, max, min: none */
    }
#undef NONNEG
#undef FLAG
#undef UNIT
}

/* overflow-checked a*b and a+b; return 0 on overflow */
static int mul_ok(uint64_t a, uint64_t b, uint64_t *out) {
    return !__builtin_mul_overflow(a, b, out);
}
static int add_ok(uint64_t a, uint64_t b, uint64_t *out) {
    return !__builtin_add_overflow(a, b, out);
}

int shmps_layout(shmps_spec_t *s) {
    if (s->kind < SHMPS_DENSE || s->kind > SHMPS_TABLE) return SHMPS_E_ARG;
    size_t isz = shmps_dtype_size(s->dtype);
    if (isz == 0) return SHMPS_E_ARG;
    if (s->updater < SHMPS_SUM || s->updater > SHMPS_FTRL) return SHMPS_E_ARG;
    if (s->updater >= SHMPS_SGD && !is_float(s->dtype)) return SHMPS_E_ARG;
    if (s->flags & ~(uint32_t)(SHMPS_F_HOGWILD | SHMPS_F_ALLOW_NONFINITE | SHMPS_F_IMPLICIT |
                               SHMPS_F_OUTBOX))
        return SHMPS_E_ARG;
    /* an outbox accumulates gradients exactly: sum, locked, dense or table */
    if ((s->flags & SHMPS_F_OUTBOX) &&
        (s->kind == SHMPS_CSR || s->updater != SHMPS_SUM || (s->flags & SHMPS_F_HOGWILD)))
        return SHMPS_E_ARG;
    if (s->row_len == 0 && s->nrows != 0 && s->kind != SHMPS_CSR) return SHMPS_E_ARG;
    for (int i = 0; i < SHMPS_NPARAMS; i++)
        if (!isfinite(s->params[i])) return SHMPS_E_ARG;
    if (!params_ok(s->updater, s->params)) return SHMPS_E_ARG;

    uint64_t nnz = s->nnz;
    if (s->kind == SHMPS_DENSE) {
        uint64_t want;
        if (!mul_ok(s->nrows, s->row_len, &want) || want != nnz) return SHMPS_E_ARG;
        if (!(s->flags & SHMPS_F_IMPLICIT)) return SHMPS_E_ARG;
    } else if (s->kind == SHMPS_TABLE) {
        uint64_t want;
        if (!mul_ok(s->nrows, s->row_len, &want) || want != nnz) return SHMPS_E_ARG;
        if (s->flags & SHMPS_F_IMPLICIT) return SHMPS_E_ARG;
    } else if (s->flags & SHMPS_F_IMPLICIT) {
        return SHMPS_E_ARG;
    }
    if (s->nrows > (1ull << 40) || nnz > (1ull << 44)) return SHMPS_E_BOUNDS;

    s->itemsize = (uint32_t)isz;
    s->nstate = nstate_of(s->updater, s->params);
    s->state_dtype = s->dtype == SHMPS_FLOAT64 ? SHMPS_FLOAT64 : SHMPS_FLOAT32;
    s->state_itemsize = (uint32_t)shmps_dtype_size(s->state_dtype);
    if (s->kind == SHMPS_DENSE) {
        s->stripe_elems = SHMPS_STRIPE_BYTES / isz;
        s->nstripes = (nnz + s->stripe_elems - 1) / s->stripe_elems;
    } else {
        s->stripe_elems = 0;
        s->nstripes = s->nrows;
    }
    if (s->nstripes > (uint64_t)SHMPS_MAX_STRIPES * 1024) return SHMPS_E_BOUNDS;

    uint64_t off = SHMPS_HEADER_SIZE, len;
    s->rowcnt_off = s->colidx_off = s->rowstep_off = s->index_off = 0;
    s->nslots = 0;
    for (int k = 0; k < SHMPS_MAX_STATE; k++) s->state_off[k] = 0;
    if (s->kind == SHMPS_CSR) {
        s->rowcnt_off = off;
        if (!mul_ok(s->nrows + 1, 8, &len) || !add_ok(off, len, &off)) return SHMPS_E_BOUNDS;
        off = ALIGN64(off);
        s->colidx_off = off;
        if (!mul_ok(nnz, 8, &len) || !add_ok(off, len, &off)) return SHMPS_E_BOUNDS;
        off = ALIGN64(off);
    } else if (s->kind == SHMPS_TABLE) {
        s->colidx_off = off; /* keys */
        if (!mul_ok(s->nrows, 8, &len) || !add_ok(off, len, &off)) return SHMPS_E_BOUNDS;
        off = ALIGN64(off);
    }
    s->value_off = off;
    if (!mul_ok(nnz, isz, &len) || !add_ok(off, len, &off)) return SHMPS_E_BOUNDS;
    off = ALIGN64(off);
    for (uint32_t k = 0; k < s->nstate; k++) {
        s->state_off[k] = off;
        if (!mul_ok(nnz, s->state_itemsize, &len) || !add_ok(off, len, &off))
            return SHMPS_E_BOUNDS;
        off = ALIGN64(off);
    }
    /* csr, table: per-row steps; dense outbox: per-row pending counts (outbox.c) */
    if (s->kind != SHMPS_DENSE || (s->flags & SHMPS_F_OUTBOX)) {
        s->rowstep_off = off;
        if (!mul_ok(s->nrows, 8, &len) || !add_ok(off, len, &off)) return SHMPS_E_BOUNDS;
        off = ALIGN64(off);
    }
    s->stripes_off = off;
    if (!mul_ok(s->nstripes, sizeof(shmps_stripe_t), &len) || !add_ok(off, len, &off))
        return SHMPS_E_BOUNDS;
    off = ALIGN64(off);
    if (s->kind == SHMPS_TABLE) {
        uint64_t slots = 16;
        while (slots < 2 * s->nrows) slots <<= 1; /* load factor <= 1/2 */
        s->nslots = slots;
        s->index_off = off;
        if (!mul_ok(slots, 16, &len) || !add_ok(off, len, &off)) return SHMPS_E_BOUNDS;
        off = ALIGN64(off);
        /* table.c: control block at index_off + 16 * nslots, then per-row metadata */
        if (!add_ok(off, SHMPS_TABLE_CTL_BYTES, &off)) return SHMPS_E_BOUNDS;
        if (!mul_ok(s->nrows, SHMPS_TABLE_ROWMETA_BYTES, &len) || !add_ok(off, len, &off))
            return SHMPS_E_BOUNDS;
        off = ALIGN64(off);
    }
    s->total_size = off;
    return SHMPS_OK;
}

static void fill_state(void *base, const shmps_spec_t *s) {
    /* Adagrad's accumulator starts at initial_accumulator_value (params[3]). */
    if (s->updater != SHMPS_ADAGRAD || s->params[3] == 0.0) return;
    if (s->state_dtype == SHMPS_FLOAT64) {
        double *a = (double *)at(base, s->state_off[0]);
        for (uint64_t i = 0; i < s->nnz; i++) a[i] = s->params[3];
    } else {
        float *a = (float *)at(base, s->state_off[0]);
        for (uint64_t i = 0; i < s->nnz; i++) a[i] = (float)s->params[3];
    }
}

int shmps_shard_init(void *base, uint64_t size, const shmps_spec_t *spec) {
    shmps_spec_t s = *spec;
    int r = shmps_layout(&s);
    if (r) return r;
    if (size != s.total_size) return SHMPS_E_BOUNDS;
    if ((r = shmps_spec_keep(base, &s))) return r; /* before anything is written */
    shmps_shard_hdr_t *h = hdr_of(base);
    memset(h, 0, SHMPS_HEADER_SIZE);
    h->spec = s;
    h->header_size = SHMPS_HEADER_SIZE;
    h->version = SHMPS_LAYOUT_VERSION;
    h->fingerprint = SHMPS_FINGERPRINT;
    fill_state(base, &s);
    /* release: the whole layout is written before the magic that validates it
     * (pairs with the acquire load in shmps_shard_validate) */
    STORE(&h->magic, SHMPS_SHARD_MAGIC, RELEASE);
    return SHMPS_OK;
}

#define SAME(f) (a->f == b->f)
static int same_layout(const shmps_spec_t *a, const shmps_spec_t *b) {
    if (!(SAME(total_size) && SAME(rowcnt_off) && SAME(colidx_off) && SAME(value_off) &&
          SAME(rowstep_off) && SAME(stripes_off) && SAME(index_off) && SAME(nslots) &&
          SAME(nstripes) && SAME(stripe_elems) && SAME(nstate) && SAME(state_dtype) &&
          SAME(itemsize) && SAME(state_itemsize)))
        return 0;
    for (int k = 0; k < SHMPS_MAX_STATE; k++)
        if (!SAME(state_off[k])) return 0;
    return 1;
}

/* On success, the spec checked (recomputed from one copy of the inputs, so consistent
 * whatever is written into the header meanwhile) is kept privately (specs.c): from
 * then on, calls on the mapping use that copy.  A mapping validated before keeps the
 * spec it had: SHMPS_E_CORRUPT if the header now says another. */
static int validate(const void *base, uint64_t size, shmps_spec_t *out);

int shmps_shard_validate(const void *base, uint64_t size, shmps_spec_t *out) {
    shmps_spec_t s;
    int r = validate(base, size, &s);
    if (r == SHMPS_OK) r = shmps_spec_keep(base, &s);
    if (r == SHMPS_OK && out) *out = s;
    return r;
}

static int validate(const void *base, uint64_t size, shmps_spec_t *out) {
    if (size < SHMPS_HEADER_SIZE) return SHMPS_E_CORRUPT;
    const shmps_shard_hdr_t *h = (const shmps_shard_hdr_t *)base;
    /* acquire: pairs with the release store of magic in shmps_shard_init */
    if (LOAD(&h->magic, ACQUIRE) != SHMPS_SHARD_MAGIC) return SHMPS_E_CORRUPT;
    if (h->version != SHMPS_LAYOUT_VERSION) return SHMPS_E_VERSION;
    if (h->header_size != SHMPS_HEADER_SIZE) return SHMPS_E_CORRUPT;
    if (h->fingerprint != SHMPS_FINGERPRINT) return SHMPS_E_VERSION; /* another build */
    shmps_spec_t s = h->spec; /* the inputs, recomputed below, must agree */
    if (shmps_layout(&s) != SHMPS_OK) return SHMPS_E_CORRUPT;
    if (!same_layout(&s, &h->spec) || s.total_size != size) return SHMPS_E_CORRUPT;
    if (s.kind == SHMPS_CSR) { /* row offsets are read on every push: check once */
        const int64_t *rc = (const int64_t *)((const char *)base + s.rowcnt_off);
        if (rc[0] != 0 || (uint64_t)rc[s.nrows] != s.nnz) return SHMPS_E_CORRUPT;
        for (uint64_t i = 0; i < s.nrows; i++)
            if (rc[i + 1] < rc[i]) return SHMPS_E_CORRUPT;
        const int64_t *ci = (const int64_t *)((const char *)base + s.colidx_off);
        for (uint64_t i = 0; i < s.nnz; i++)
            if (ci[i] < 0 || (uint64_t)ci[i] >= s.ncols) return SHMPS_E_CORRUPT;
    }
    *out = s;
    return SHMPS_OK;
}

int shmps_stats(const void *base, shmps_stats_t *out) {
    const shmps_shard_hdr_t *h = (const shmps_shard_hdr_t *)base;
    /* relaxed: counters are statistics, read field by field without a snapshot */
    out->pushes = LOAD(&h->stats.pushes, RELAXED);
    out->pulls = LOAD(&h->stats.pulls, RELAXED);
    out->bytes_pushed = LOAD(&h->stats.bytes_pushed, RELAXED);
    out->bytes_pulled = LOAD(&h->stats.bytes_pulled, RELAXED);
    out->rows_pushed = LOAD(&h->stats.rows_pushed, RELAXED);
    out->rows_pulled = LOAD(&h->stats.rows_pulled, RELAXED);
    out->last_push_ns = LOAD(&h->stats.last_push_ns, RELAXED);
    out->last_pull_ns = LOAD(&h->stats.last_pull_ns, RELAXED);
    out->takeovers = LOAD(&h->stats.takeovers, RELAXED);
    out->contended = LOAD(&h->stats.contended, RELAXED);
    out->step = LOAD(&h->step, RELAXED);
    out->rows_used = LOAD(&h->table_used, RELAXED);
    return SHMPS_OK;
}
