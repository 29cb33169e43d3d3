/* CSR tensors: a matrix with a fixed sparsity structure, sharded by row ranges.
 *
 * Each shard holds rows [row_begin, row_begin + nrows): rowcnt int64[nrows + 1] (local
 * offsets, 0 .. nnz), colidx int64[nnz] (global columns, strictly increasing within a
 * row: checked at creation), the values and optimizer state, rowstep uint64[nrows]
 * (per-row push count, Adam's t) and one lock word per row.  The structure never
 * changes after creation; attach validates it once (shmps_shard_validate) and every
 * read of it here is bounds-checked again.
 *
 * A push is a CSR of the same rows.  shmps_csr_locate() finds each pushed entry in
 * the structure (binary search within its row) without touching the values, so a push
 * naming an absent entry is rejected before anything changes.  shmps_csr_push() then
 * locks each pushed row, increments its step and applies the updater to the located
 * entries: runs of consecutive positions go to the updater in one call; a row with
 * repeated columns has them applied one after the other for sum/assign/max/min/plain
 * SGD, or summed first (in the caller's scratch) for the stateful updaters.
 */
#include "internal.h"

static int seq_updater(const shmps_spec_t *s) {
    switch (s->updater) {
    case SHMPS_SUM: case SHMPS_ASSIGN: case SHMPS_MAX: case SHMPS_MIN: return 1;
    case SHMPS_SGD: return s->params[1] == 0.0;
    default: return 0;
    }
}

/* Structure row r as [*lo, *hi); SHMPS_E_CORRUPT if the segment's offsets are bad. */
static inline int span(const shmps_spec_t *s, const int64_t *rc, uint64_t r, uint64_t *lo,
                       uint64_t *hi) {
    int64_t a = rc[r], b = rc[r + 1];
    if (a < 0 || b < a || (uint64_t)b > s->nnz) return SHMPS_E_CORRUPT;
    *lo = (uint64_t)a;
    *hi = (uint64_t)b;
    return SHMPS_OK;
}

uint64_t shmps_csr_scratch_bytes(const void *base) {
    const shmps_spec_t *s = shmps_spec_of(base);
    if (!s || s->kind != SHMPS_CSR) return 0;
    const int64_t *rc = (const int64_t *)((const char *)base + s->rowcnt_off);
    uint64_t widest = 0, lo, hi;
    for (uint64_t r = 0; r < s->nrows; r++)
        if (span(s, rc, r, &lo, &hi) == SHMPS_OK && hi - lo > widest) widest = hi - lo;
    return widest * 9 + 64; /* per entry: a float64 sum and a mark byte */
}

int shmps_csr_locate(const void *base, const int64_t *rowcnt, uint64_t nrows,
                     const int64_t *colidx, int64_t *pos, uint64_t *bad) {
    const shmps_spec_t *s = shmps_spec_of(base);
    if (!s || s->kind != SHMPS_CSR || nrows != s->nrows) return SHMPS_E_ARG;
    const int64_t *rc = (const int64_t *)((const char *)base + s->rowcnt_off);
    const int64_t *sc = (const int64_t *)((const char *)base + s->colidx_off);
    for (uint64_t r = 0; r < nrows; r++) {
        int64_t a = rowcnt[r], b = rowcnt[r + 1];
        if (a < 0 || b < a) return SHMPS_E_ARG;
        uint64_t lo, hi;
        int rr = span(s, rc, r, &lo, &hi);
        if (rr) return rr;
        uint64_t from = lo;
        int64_t prev = -1;
        for (int64_t k = a; k < b; k++) {
            int64_t c = colidx[k];
            uint64_t l = c > prev ? from : lo, h = hi; /* sorted pushes search the rest */
            while (l < h) {
                uint64_t mid = l + (h - l) / 2;
                if (sc[mid] < c) l = mid + 1;
                else h = mid;
            }
            if (l >= hi || sc[l] != c) {
                if (bad) bad[0] = r, bad[1] = (uint64_t)c, bad[2] = (uint64_t)k;
                return SHMPS_E_NOTFOUND;
            }
            pos[k] = (int64_t)l;
            from = l + 1;
            prev = c;
        }
    }
    return SHMPS_OK;
}

/* Row r's entries [a, b) of the push, at positions pos[] (all within the row). */
static int apply_row(void *base, const shmps_spec_t *s, uint64_t lo, uint64_t hi,
                     const int64_t *pos, int64_t a, int64_t b, const char *grad,
                     uint32_t gdt, uint64_t step, char *scratch) {
    size_t gsz = shmps_dtype_size(gdt);
    int inc = 1;
    for (int64_t k = a + 1; k < b && inc; k++) inc = pos[k] > pos[k - 1];
    int r = SHMPS_OK;
    if (inc) { /* runs of consecutive positions, one updater call each */
        for (int64_t k0 = a; k0 < b && r == SHMPS_OK;) {
            int64_t k1 = k0 + 1;
            while (k1 < b && pos[k1] == pos[k1 - 1] + 1) k1++;
            r = shmps_apply(base, s, (uint64_t)pos[k0], (uint64_t)(k1 - k0), grad + k0 * gsz, step);
            k0 = k1;
        }
        return r;
    }
    if (seq_updater(s)) { /* in the order given: the same as summed, assign's last wins */
        for (int64_t k = a; k < b && r == SHMPS_OK; k++)
            r = shmps_apply(base, s, (uint64_t)pos[k], 1, grad + k * gsz, step);
        return r;
    }
    /* stateful updater, repeated or unsorted columns: sum per position, then apply */
    uint64_t len = hi - lo;
    char *acc = scratch, *mark = scratch + len * gsz;
    memset(mark, 0, len);
    for (int64_t k = a; k < b; k++) {
        uint64_t o = (uint64_t)pos[k] - lo;
        if (gdt == SHMPS_FLOAT64) {
            double *x = (double *)acc + o, g = ((const double *)grad)[k];
            *x = mark[o] ? *x + g : g;
        } else {
            float *x = (float *)acc + o, g = ((const float *)grad)[k];
            *x = mark[o] ? *x + g : g;
        }
        mark[o] = 1;
    }
    for (uint64_t o = 0; o < len && r == SHMPS_OK;) {
        if (!mark[o]) { o++; continue; }
        uint64_t e = o + 1;
        while (e < len && mark[e]) e++;
        r = shmps_apply(base, s, lo + o, e - o, acc + o * gsz, step);
        o = e;
    }
    return r;
}

int shmps_csr_push(void *base, uint64_t token, const int64_t *rowcnt, uint64_t nrows,
                   const int64_t *pos, const void *grad, uint32_t grad_dtype, void *scratch,
                   uint64_t scratch_bytes) {
    shmps_shard_hdr_t *h = hdr_of(base);
    const shmps_spec_t *s = shmps_spec_of(base);
    if (!s) return SHMPS_E_ARG;
    uint32_t want = s->dtype == SHMPS_FLOAT16 ? SHMPS_FLOAT32 : s->dtype;
    if (s->kind != SHMPS_CSR || nrows != s->nrows || grad_dtype != want) return SHMPS_E_ARG;
    const int64_t *rc = (const int64_t *)at(base, s->rowcnt_off);
    size_t gsz = shmps_dtype_size(grad_dtype);
    int seq = seq_updater(s);
    /* every position within its row, scratch wide enough: checked before any change */
    for (uint64_t r = 0; r < nrows; r++) {
        int64_t a = rowcnt[r], b = rowcnt[r + 1];
        uint64_t lo, hi;
        if (a < 0 || b < a) return SHMPS_E_ARG;
        int rr = span(s, rc, r, &lo, &hi);
        if (rr) return rr;
        for (int64_t k = a; k < b; k++)
            if (pos[k] < (int64_t)lo || (uint64_t)pos[k] >= hi) return SHMPS_E_BOUNDS;
        if (!seq && b > a && (hi - lo) * (gsz + 1) > scratch_bytes) return SHMPS_E_ARG;
    }
    uint32_t slot;
    int r = shmps_enter(base, token, SHMPS_LOCK_TIMEOUT_S, &slot);
    if (r < 0) return r;
    uint64_t step;
    shmps_next_step(base, &step); /* the shard's push count (statistics) */
    shmps_stripe_t *stripes = (shmps_stripe_t *)at(base, s->stripes_off);
    uint64_t *rowstep = (uint64_t *)at(base, s->rowstep_off);
    const char *g = (const char *)grad;
    uint64_t contended = 0, entries = 0;
    for (uint64_t row = 0; row < nrows && r == SHMPS_OK; row++) {
        int64_t a = rowcnt[row], b = rowcnt[row + 1];
        if (a == b) continue;
        uint64_t lo = 0, hi = 0;
        if ((r = span(s, rc, row, &lo, &hi))) break; /* checked above: immutable */
        shmps_stripe_t *lk = &stripes[row];
        if (!shmps_stripe_trylock(lk, token)) {
            contended++;
            int lr = shmps_stripe_lock(lk, token, SHMPS_LOCK_TIMEOUT_S, &h->stats.takeovers);
            if (lr < 0) { r = lr; break; }
        }
        shmps_stripe_write_begin(lk);
        /* relaxed: written only under the row lock */
        uint64_t rs = LOAD(&rowstep[row], RELAXED) + 1;
        STORE(&rowstep[row], rs, RELAXED);
        r = apply_row(base, s, lo, hi, pos, a, b, g, grad_dtype, rs, (char *)scratch);
        shmps_stripe_write_end(lk);
        shmps_stripe_unlock(lk);
        entries += (uint64_t)(b - a);
    }
    /* relaxed: a statistic */
    if (contended) FETCH_ADD(&h->stats.contended, contended, RELAXED);
    shmps_leave(base, token, slot);
    if (r == SHMPS_OK) shmps_count(base, 0, entries * gsz, nrows);
    return r;
}

int shmps_csr_pull(void *base, uint64_t token, const int64_t *rows, uint64_t n, void *out,
                   int consistent) {
    const shmps_spec_t *s = shmps_spec_of(base);
    if (!s || s->kind != SHMPS_CSR) return SHMPS_E_ARG;
    const int64_t *rc = (const int64_t *)at(base, s->rowcnt_off);
    const char *v = at(base, s->value_off);
    shmps_stripe_t *stripes = (shmps_stripe_t *)at(base, s->stripes_off);
    size_t isz = s->itemsize;
    uint64_t count = rows ? n : s->nrows;
    if (rows)
        for (uint64_t i = 0; i < n; i++)
            if (rows[i] < 0 || (uint64_t)rows[i] >= s->nrows) return SHMPS_E_BOUNDS;
    int r = SHMPS_OK;
    if (consistent && (r = shmps_freeze_shared(base, token, SHMPS_LOCK_TIMEOUT_S)) < 0) return r;
    char *o = (char *)out;
    uint64_t copied = 0;
    if (!rows && consistent) {
        memcpy(o, v, s->nnz * isz);
        copied = s->nnz;
    } else {
        for (uint64_t i = 0; i < count && r == SHMPS_OK; i++) {
            uint64_t row = rows ? (uint64_t)rows[i] : i, lo, hi;
            if ((r = span(s, rc, row, &lo, &hi))) break;
            uint64_t nb = (hi - lo) * isz;
            if (nb == 0) continue;
            if (consistent) memcpy(o, v + lo * isz, nb);
            else r = shmps_stripe_read(&stripes[row], token, o, v + lo * isz, nb);
            o += nb;
            copied += hi - lo;
        }
    }
    if (consistent) shmps_thaw_shared(base, token);
    if (r == SHMPS_OK) shmps_count(base, 1, copied * isz, count);
    return r;
}

/* ---- replication (the bridge): entries of a csr shard ----------------------------- */

/* Local entries pos[0..n) strictly increasing within [0, nnz): checked before anything
 * is read or changed.  *row0: the row of pos[0]; each later entry's row is found by
 * walking on (entries ascend, so rows do). */
static int check_entries(const shmps_spec_t *s, const int64_t *rc, const int64_t *pos,
                         uint64_t n, uint64_t *row0) {
    for (uint64_t i = 0; i < n; i++)
        if (pos[i] < 0 || (uint64_t)pos[i] >= s->nnz || (i && pos[i] <= pos[i - 1]))
            return SHMPS_E_BOUNDS;
    uint64_t l = 0, h = s->nrows; /* the last row starting at or before pos[0] */
    while (n && h - l > 1) {
        uint64_t m = l + (h - l) / 2;
        if (rc[m] <= pos[0]) l = m;
        else h = m;
    }
    *row0 = l;
    return SHMPS_OK;
}

/* Advances *row to the row holding entry e (e >= that row's start); SHMPS_E_CORRUPT
 * if the structure's offsets do not cover e. */
static int walk_to(const shmps_spec_t *s, const int64_t *rc, uint64_t *row, uint64_t e,
                   uint64_t *lo, uint64_t *hi) {
    for (;;) {
        int r = span(s, rc, *row, lo, hi);
        if (r) return r;
        if (e < *hi && e >= *lo) return SHMPS_OK;
        if (e < *lo || ++*row >= s->nrows) return SHMPS_E_CORRUPT;
    }
}

int shmps_csr_read_entries(void *base, uint64_t token, const int64_t *pos, uint64_t n,
                           void *vals, void *const *states, uint32_t nstates,
                           uint64_t *rowsteps) {
    const shmps_spec_t *s = shmps_spec_of(base);
    if (!s || s->kind != SHMPS_CSR || nstates != s->nstate) return SHMPS_E_ARG;
    const int64_t *rc = (const int64_t *)at(base, s->rowcnt_off);
    uint64_t row = 0, lo, hi;
    int r = check_entries(s, rc, pos, n, &row);
    if (r) return r;
    /* the shared freeze keeps pushers out: each row whole, values and state together */
    if ((r = shmps_freeze_shared(base, token, SHMPS_LOCK_TIMEOUT_S)) < 0) return r;
    const uint64_t *rowstep = (const uint64_t *)at(base, s->rowstep_off);
    size_t isz = s->itemsize, ssz = s->state_itemsize;
    for (uint64_t i = 0; i < n && r == SHMPS_OK; i++) {
        uint64_t e = (uint64_t)pos[i];
        if ((r = walk_to(s, rc, &row, e, &lo, &hi))) break;
        memcpy((char *)vals + i * isz, at(base, s->value_off + e * isz), isz);
        for (uint32_t k = 0; k < nstates; k++)
            memcpy((char *)states[k] + i * ssz, at(base, s->state_off[k] + e * ssz), ssz);
        /* relaxed: written only under the row lock, and no pusher is inside (frozen) */
        rowsteps[i] = LOAD(&rowstep[row], RELAXED);
    }
    shmps_thaw_shared(base, token);
    return r;
}

/* Writes entries pos[i] := vals[i] with their optimizer state and (rowsteps not NULL)
 * the step of each entry's row := rowsteps[i], under the shard's exclusive freeze and,
 * row by row, the row lock with its seqlock write open (pull(consistent=False) never
 * sees a half-written row). */
int shmps_csr_write_entries(void *base, uint64_t token, const int64_t *pos, uint64_t n,
                            const void *vals, void *const *states, uint32_t nstates,
                            const uint64_t *rowsteps) {
    shmps_shard_hdr_t *h = hdr_of(base);
    const shmps_spec_t *s = shmps_spec_of(base);
    if (!s || s->kind != SHMPS_CSR || nstates != s->nstate) return SHMPS_E_ARG;
    const int64_t *rc = (const int64_t *)at(base, s->rowcnt_off);
    uint64_t row = 0, lo = 0, hi = 0;
    int r = check_entries(s, rc, pos, n, &row);
    if (r) return r;
    if ((r = shmps_freeze(base, token, SHMPS_LOCK_TIMEOUT_S)) < 0) return r;
    shmps_stripe_t *st = (shmps_stripe_t *)at(base, s->stripes_off);
    uint64_t *rowstep = (uint64_t *)at(base, s->rowstep_off);
    size_t isz = s->itemsize, ssz = s->state_itemsize;
    uint64_t held = UINT64_MAX; /* the row whose lock is held */
    for (uint64_t i = 0; i < n && r >= 0; i++) {
        uint64_t e = (uint64_t)pos[i];
        if ((r = walk_to(s, rc, &row, e, &lo, &hi))) break;
        if (held != row) {
            if (held != UINT64_MAX) {
                shmps_stripe_write_end(&st[held]);
                shmps_stripe_unlock(&st[held]);
                held = UINT64_MAX;
            }
            /* a dead pusher's lock is taken over; no live pusher is inside (frozen) */
            r = shmps_stripe_lock(&st[row], token, SHMPS_LOCK_TIMEOUT_S, &h->stats.takeovers);
            if (r < 0) break;
            shmps_stripe_write_begin(&st[row]);
            held = row;
        }
        memcpy(at(base, s->value_off + e * isz), (const char *)vals + i * isz, isz);
        for (uint32_t k = 0; k < nstates; k++)
            memcpy(at(base, s->state_off[k] + e * ssz), (const char *)states[k] + i * ssz, ssz);
        /* relaxed: under the row lock, as a push writes it */
        if (rowsteps) STORE(&rowstep[row], rowsteps[i], RELAXED);
    }
    if (held != UINT64_MAX) {
        shmps_stripe_write_end(&st[held]);
        shmps_stripe_unlock(&st[held]);
    }
    shmps_thaw(base, token);
    return r < 0 ? r : SHMPS_OK;
}
