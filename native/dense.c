/* Dense pushes and pulls.
 *
 * A whole-tensor push walks the shard's stripes starting at a per-push
 * pseudo-random stripe, try-locking each: a busy stripe is skipped and revisited
 * after the pass, so two pushers rarely wait for each other.  Only after a full
 * pass without progress does a pusher block (bounded, with dead-owner takeover).
 */
#include "internal.h"
#include <errno.h>
#include <stdlib.h>

#define CHUNK 4096 /* stripes per pass: bitmap of CHUNK bits on the stack */

static int check_dense(const shmps_spec_t *s, uint32_t grad_dtype) {
    if (s->kind != SHMPS_DENSE) return SHMPS_E_ARG;
    uint32_t want = s->dtype == SHMPS_FLOAT16 ? SHMPS_FLOAT32 : s->dtype;
    return grad_dtype == want ? SHMPS_OK : SHMPS_E_ARG;
}

static uint64_t mix64(uint64_t x) { /* splitmix64 finaliser */
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27; x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Outbox shards (SHMPS_F_OUTBOX): counts one push piece on every row that elements
 * [e0, e1) -- all inside one stripe, whose lock the caller holds -- touch.  A row's
 * count is > 0 whenever the row may hold values no drain took: every write of
 * outbox values comes after a count under the same stripe lock (before it, so that a
 * pusher killed mid-write leaves a count too), and a drain zeroes both holding every
 * stripe of the row (outbox.c).  Rows inside one stripe are only
 * ever counted under that stripe's lock (relaxed load + store: plain moves, the
 * lock orders them); a row that straddles stripes is counted under several locks, so
 * with an atomic add.  Relaxed: the lock's acquire/release orders them against the
 * drain, and the push's release add to ob_pushed against a drain's unlocked scan. */
static void note_pending(void *base, const shmps_spec_t *s, uint64_t e0, uint64_t e1) {
    uint64_t *pend = (uint64_t *)at(base, s->rowstep_off);
    uint64_t rl = s->row_len, se = s->stripe_elems;
    uint64_t r0 = e0 / rl, r1 = (e1 - 1) / rl; /* rows touched, inclusive */
    for (uint64_t r = r0; r <= r1; r++) {
        /* only the first and last rows can reach past [e0, e1)'s stripe */
        int straddles = (r == r0 || r == r1) && (r * rl) / se != (r * rl + rl - 1) / se;
        if (straddles) FETCH_ADD(&pend[r], 1, RELAXED);
        else STORE(&pend[r], LOAD(&pend[r], RELAXED) + 1, RELAXED);
    }
}

/* Stripe steps.  A push takes its step (its ticket: the tensor's push count, shard 0's
 * `step`) before it locks any stripe, and whole pushes visit stripes in a per-push
 * order, so two pushes at once can reach a stripe in the other order than their
 * tickets.  The updaters that read the step (Momentum's first step, Adagrad's lr_decay,
 * Adam's bias correction) then followed no sequential order on that stripe (a
 * Momentum buffer lost a gradient; Adam's stripes differed after identical pushes).
 * So each stripe keeps the step it last applied a push at (the low 32 bits, in its
 * lock word's `pad`, read and written only under its lock), and a push applies at:
 *   - a whole push of a tensor that never took a rows= push (SHMPS_STEP_BY_STRIPE in
 *     `step`): the stripe's last step + 1.  Every push reaches every stripe, so each
 *     stripe applies its pushes at 1, 2, 3, ... in the order it took them: a
 *     sequential order per stripe, as docs/concurrency.md promises, and the ticket
 *     itself when nothing runs at once;
 *   - otherwise (a rows= push, or any push once one was made: a rows= push advances
 *     the step of the stripes it skips; a later frame of one drain): max(ticket, last
 *     step), the ticket in any sequential history.  A push overtaken on a stripe
 *     applies at the step of the one that overtook it (never at an earlier step than
 *     the stripe's last, and never above the tensor's count, so later pushes go on at
 *     their tickets).
 * No stripe applies a step above the tensor's count (`now`, read under the stripe's
 * lock: at least the ticket of every push that applied there, whose fetch-add
 * happened before it unlocked), so the last step is the latest value up to `now`
 * with its low 32 bits: exact unless no push touched the stripe for 2^32 steps, and
 * even then a step between the ticket and `now`.  A restore leaves every stripe at the
 * restored step (shmps_dense_set_stripe_steps). */
typedef struct {
    uint64_t step;          /* the push's ticket, SHMPS_STEP_BY_STRIPE set or not */
    const uint64_t *now;    /* shard 0's step word: the tensor's push count */
} push_step_t;

/* The step stripe `st` (locked by the caller) last applied a push at. */
static uint64_t stripe_last(shmps_stripe_t *st, const push_step_t *ps) {
    /* relaxed: the stripe's lock (acquired) orders it after the fetch-add of every push
     * that applied here before */
    uint64_t now = LOAD(ps->now, RELAXED);
    /* relaxed: under the stripe's lock, whose acquire/release orders it */
    uint32_t back = (uint32_t)now - LOAD(&st->pad, RELAXED);
    return back <= now ? now - back : 0;
}

static uint64_t stripe_step(shmps_stripe_t *st, const push_step_t *ps) {
    uint64_t ticket = ps->step & ~(SHMPS_STEP_BY_STRIPE | SHMPS_STEP_RESUME);
    uint64_t last = stripe_last(st, ps);
    uint64_t t = (ps->step & SHMPS_STEP_BY_STRIPE) ? last + 1 : ticket > last ? ticket : last;
    STORE(&st->pad, (uint32_t)t, RELAXED);
    /* a compiler barrier, no instruction: the step is in memory before the values are
     * (a process killed between has the stripe at the step with part of the push, or
     * none: a resume, SHMPS_STEP_RESUME, counts it as having the push), whatever
     * inlining the build does */
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    return t;
}

/* Applies the push to stripe j, which the caller has locked.  s: the shard's private
 * spec (shmps_spec_of), here and in every helper below that takes one. */
static int apply_stripe(void *base, const shmps_spec_t *s, shmps_stripe_t *st, uint64_t j,
                        const char *grad, const push_step_t *ps) {
    if ((ps->step & SHMPS_STEP_RESUME) &&
        stripe_last(st, ps) >= (ps->step & (SHMPS_STEP_RESUME - 1))) {
        /* finishing a dead process's push (SHMPS_STEP_RESUME, passed by ticket, not
         * SHMPS_STEP_BY_STRIPE): it set this stripe's step to its ticket before writing
         * the values (stripe_step, then shmps_apply), so the stripe has the push: whole,
         * or the part it wrote (possibly none) if it died writing here, as any push cut
         * by a kill.  Not applied again; a dead writer's odd seq is closed (relaxed:
         * only the lock holder writes seq). */
        if (LOAD(&st->seq, RELAXED) & 1) {
            shmps_stripe_write_begin(st);
            shmps_stripe_write_end(st);
        }
        shmps_stripe_unlock(st);
        return SHMPS_OK;
    }
    uint64_t i0 = j * s->stripe_elems;
    uint64_t n = s->nnz - i0 < s->stripe_elems ? s->nnz - i0 : s->stripe_elems;
    shmps_stripe_write_begin(st);
    /* count before writing: a pusher killed mid-write leaves its rows counted, so a
     * drain (the bridge's sweep) takes what it wrote; counted after, rows could hold
     * values no drain would ever look at (note_pending) */
    if (s->flags & SHMPS_F_OUTBOX) note_pending(base, s, i0, i0 + n);
    int r = shmps_apply(base, s, i0, n, grad + i0 * shmps_grad_size(s->dtype),
                        stripe_step(st, ps));
    shmps_stripe_write_end(st);
    shmps_stripe_unlock(st);
    return r;
}

/* Stripes [lo, hi) of the push, by a caller that holds an active slot of the shard
 * (shmps_enter) from before this call to after it. */
static int push_stripes(void *base, const shmps_spec_t *s, uint64_t token, const char *g,
                        uint64_t lo, uint64_t hi, const push_step_t *ps) {
    shmps_shard_hdr_t *h = hdr_of(base);
    int r = SHMPS_OK;
    if (s->flags & SHMPS_F_HOGWILD) {
        uint64_t i0 = lo * s->stripe_elems;
        uint64_t i1 = hi * s->stripe_elems < s->nnz ? hi * s->stripe_elems : s->nnz;
        /* hogwild: no lock, so no stripe steps; the ticket */
        return shmps_apply(base, s, i0, i1 - i0, g + i0 * shmps_grad_size(s->dtype),
                           ps->step & ~(SHMPS_STEP_BY_STRIPE | SHMPS_STEP_RESUME));
    }
    shmps_stripe_t *stripes = (shmps_stripe_t *)at(base, s->stripes_off);
    uint64_t contended = 0;
    for (uint64_t clo = lo; clo < hi && r == SHMPS_OK; clo += CHUNK) {
        uint64_t n = hi - clo < CHUNK ? hi - clo : CHUNK;
        uint64_t done[CHUNK / 64];
        memset(done, 0, sizeof done);
        uint64_t remaining = n;
        uint64_t start = mix64(token ^ (ps->step * 0x9e3779b97f4a7c15ull) ^ clo) % n;
        while (remaining && r == SHMPS_OK) {
            uint64_t progress = 0;
            for (uint64_t k = 0; k < n && r == SHMPS_OK; k++) {
                uint64_t j = start + k < n ? start + k : start + k - n;
                if (done[j >> 6] & (1ull << (j & 63))) continue;
                if (!shmps_stripe_trylock(&stripes[clo + j], token)) continue;
                r = apply_stripe(base, s, &stripes[clo + j], clo + j, g, ps);
                done[j >> 6] |= 1ull << (j & 63);
                remaining--, progress++;
            }
            if (remaining && !progress && r == SHMPS_OK) {
                /* every remaining stripe is busy: wait for the first one */
                contended++;
                for (uint64_t k = 0; k < n; k++) {
                    uint64_t j = start + k < n ? start + k : start + k - n;
                    if (done[j >> 6] & (1ull << (j & 63))) continue;
                    int lr = shmps_stripe_lock(&stripes[clo + j], token, SHMPS_LOCK_TIMEOUT_S,
                                               &h->stats.takeovers);
                    if (lr < 0) { r = lr; break; }
                    r = apply_stripe(base, s, &stripes[clo + j], clo + j, g, ps);
                    done[j >> 6] |= 1ull << (j & 63);
                    remaining--;
                    break;
                }
            }
        }
    }
    /* relaxed: a statistic */
    if (contended) FETCH_ADD(&h->stats.contended, contended, RELAXED);
    return r;
}

/* The checks both push entry points make before anything changes: the gradient's
 * dtype, the stripe range, and with `check` no NaN/Inf in the stripes' part. */
static int check_push(const shmps_spec_t *s, const void *grad, uint32_t grad_dtype,
                      uint64_t lo, uint64_t hi, int check) {
    int r = check_dense(s, grad_dtype);
    if (r) return r;
    if (lo > hi || hi > s->nstripes) return SHMPS_E_BOUNDS;
    if (!check) return SHMPS_OK;
    return shmps_check_finite((const char *)grad + lo * s->stripe_elems * shmps_grad_size(s->dtype),
                              grad_dtype,
                              (hi * s->stripe_elems < s->nnz ? hi * s->stripe_elems : s->nnz) -
                                  lo * s->stripe_elems);
}

/* Stripes [lo, hi) of a push (checked), inside an active slot of the shard. */
static int push_range(void *base, const shmps_spec_t *s, uint64_t token, const void *grad,
                      uint64_t lo, uint64_t hi, const push_step_t *ps) {
    uint32_t slot;
    int r = shmps_enter(base, token, SHMPS_LOCK_TIMEOUT_S, &slot);
    if (r < 0) return r;
    r = push_stripes(base, s, token, (const char *)grad, lo, hi, ps);
    shmps_leave(base, token, slot);
    return r;
}

/* The private specs of shard `base` (*s) and of the tensor's shard 0 `base0`, looked up
 * together (one registry lock: a split push calls once per shard and thread), and the
 * push's step for its stripes (Stripe steps).  SHMPS_E_ARG unless both are mapped and
 * shard 0 is dense. */
static int push_specs(void *base, void *base0, uint64_t step, const shmps_spec_t **s,
                      push_step_t *ps) {
    void *b[2] = {base, base0};
    const shmps_spec_t *sp[2] = {NULL, NULL};
    uint64_t n = base0 == base ? 1 : 2;
    if (shmps_specs_of(b, n, sp)) return SHMPS_E_ARG;
    if (sp[n - 1]->kind != SHMPS_DENSE) return SHMPS_E_ARG;
    *s = sp[0];
    ps->step = step;
    ps->now = &hdr_of(base0)->step;
    return SHMPS_OK;
}

/* Stripes [lo, hi) of a push with step `step` (shmps_dense_next_step) to shard `base`
 * of the tensor whose shard 0 is `base0`. */
int shmps_dense_push(void *base, void *base0, uint64_t token, const void *grad,
                     uint32_t grad_dtype, uint64_t lo, uint64_t hi, uint64_t step, int check) {
    const shmps_spec_t *s;
    push_step_t ps;
    if (push_specs(base, base0, step, &s, &ps)) return SHMPS_E_ARG;
    int r = check_push(s, grad, grad_dtype, lo, hi, check);
    if (r) return r;
    return push_range(base, s, token, grad, lo, hi, &ps);
}

/* shmps_dense_push by a caller that already holds active slot `slot` of the shard
 * (shmps_enter) and keeps it until after every part of the push has returned: a push
 * split over threads (dense.py _push_all) is then one occupancy of the shard, and a
 * freeze (consistent pull, checkpoint, the bridge's snapshot) sees all of its parts or
 * none, never the gap between two.  SHMPS_E_ARG if the slot does not hold `token`.
 * Relaxed: the caller's own claim, read by the thread that made it or by one the
 * caller's thread pool handed the work to (the pool's hand-off orders it). */
int shmps_dense_push_entered(void *base, void *base0, uint64_t token, uint32_t slot,
                             const void *grad, uint32_t grad_dtype, uint64_t lo, uint64_t hi,
                             uint64_t step) {
    shmps_shard_hdr_t *h = hdr_of(base);
    const shmps_spec_t *s;
    push_step_t ps;
    if (push_specs(base, base0, step, &s, &ps) || slot >= SHMPS_ACTIVE_SLOTS ||
        LOAD(&h->active[slot], RELAXED) != token)
        return SHMPS_E_ARG;
    /* (no NaN/Inf check: the caller checked the whole gradient before it entered) */
    int r = check_push(s, grad, grad_dtype, lo, hi, 0);
    if (r) return r;
    return push_stripes(base, s, token, (const char *)grad, lo, hi, &ps);
}

/* A whole push to a one-shard tensor in one call (the small-push fast path):
 * NaN/Inf check, step, stripes, statistics.  `forward` is the store's forwarding
 * switch (shmps_forward_word): if set, returns SHMPS_FORWARDING having done nothing
 * (the caller sends the push to the outbox).  Relaxed: the switch orders nothing the
 * push reads (see shmps_forward_word); tested here to spare the small push a
 * separate test in Python. */
int shmps_dense_push_all(void *base, const uint32_t *forward, uint64_t token,
                         const void *grad, uint32_t grad_dtype, int check) {
    if (forward && LOAD(forward, RELAXED)) return SHMPS_FORWARDING;
    const shmps_spec_t *s = shmps_spec_of(base);
    if (!s) return SHMPS_E_ARG;
    int r = check_push(s, grad, grad_dtype, 0, s->nstripes, check);
    if (r) return r;
    push_step_t ps = {0, &hdr_of(base)->step};
    shmps_dense_next_step(base, &ps.step);
    r = push_range(base, s, token, grad, 0, s->nstripes, &ps);
    if (r == SHMPS_OK) shmps_count(base, 0, s->nnz * shmps_grad_size(s->dtype), s->nrows);
    return r;
}

static int pull_range(void *base, const shmps_spec_t *s, uint64_t token, void *out,
                      uint64_t elem_lo, uint64_t elem_hi, int consistent);

int shmps_dense_pull_all(void *base, uint64_t token, void *out, int consistent) {
    const shmps_spec_t *s = shmps_spec_of(base);
    if (!s) return SHMPS_E_ARG;
    int r = pull_range(base, s, token, out, 0, s->nnz, consistent);
    if (r == SHMPS_OK) shmps_count(base, 1, s->nnz * s->itemsize, s->nrows);
    return r;
}

/* Unlocks (and closes the seqlock write of) the stripe held across rows. */
static void release_held(shmps_stripe_t *stripes, uint64_t *held) {
    if (*held == UINT64_MAX) return;
    shmps_stripe_write_end(&stripes[*held]);
    shmps_stripe_unlock(&stripes[*held]);
    *held = UINT64_MAX;
}

/* Rows rows[i] - off of shard `base` (checked by the caller) get gradient row i. */
static int push_rows_at(void *base, const shmps_spec_t *s, uint64_t token,
                        const int64_t *rows, uint64_t n, int64_t off, const void *grad,
                        const push_step_t *ps);

/* The rows of a tensor of nshards shards of shard_rows rows: [0, tensor_end), with
 * tensor_end saturated (then no int64 row reaches it, as no row's shard is nshards). */
static uint64_t tensor_end(uint32_t nshards, uint64_t shard_rows) {
    return shard_rows > UINT64_MAX / nshards ? UINT64_MAX : nshards * shard_rows;
}

/* The shards a rows= call touches, one per run of rows of one shard (the caller's rows
 * are in runs of distinct shards), and their private specs: run j is rows[start[j] ..
 * start[j + 1]) of shard shard[j], whose spec is sp[1 + j], the greatest of its rows
 * being shard[j] * shard_rows + top[j]; sp[0] is shard 0's.  Held on the stack for up
 * to RUNS_ON_STACK runs (any call of that many rows), allocated for more. */
#define RUNS_ON_STACK 64
typedef struct {
    uint64_t nruns, cap;
    uint64_t *start, *shard, *top;
    void **vb; /* the bases looked up, in sp's order */
    const shmps_spec_t **sp;
    uint64_t start_stack[1 + RUNS_ON_STACK], shard_stack[RUNS_ON_STACK];
    uint64_t top_stack[RUNS_ON_STACK];
    void *vb_stack[1 + RUNS_ON_STACK];
    const shmps_spec_t *sp_stack[1 + RUNS_ON_STACK];
} runs_t;

static void runs_free(runs_t *rs) {
    if (rs->start != rs->start_stack) free(rs->start); /* (one block: see runs_grow) */
}

/* Moves rs's first j runs from the stack into one block for `cap` runs (1 + cap starts,
 * cap shards and tops, 1 + cap bases and specs); 0, or ENOMEM leaving rs as it was. */
static int runs_grow(runs_t *rs, uint64_t j, uint64_t cap) {
    _Static_assert(sizeof(void *) == 8, "runs_t's block holds pointers as 8 bytes");
    uint64_t *blk = malloc((5 * cap + 3) * 8);
    if (!blk) return ENOMEM;
    uint64_t *start = blk, *shard = blk + cap + 1, *top = blk + 2 * cap + 1;
    void **vb = (void **)(blk + 3 * cap + 1);
    memcpy(start, rs->start, j * 8), memcpy(shard, rs->shard, j * 8);
    memcpy(top, rs->top, j * 8), memcpy(vb + 1, rs->vb + 1, j * 8);
    rs->start = start, rs->shard = shard, rs->top = top, rs->vb = vb;
    rs->sp = (const shmps_spec_t **)(blk + 4 * cap + 2);
    rs->cap = cap;
    return SHMPS_OK;
}

/* The checks of every run, its shards looked up together (one lock: shmps_specs_of),
 * before anything is read or written: each shard a dense shard of shard 0's dtype and
 * row length (SHMPS_E_ARG: one tensor's shards share a spec but nrows; shard 0 a dense
 * shard), each run's greatest row in range of its shard (SHMPS_E_BOUNDS), run by run. */
static int check_runs(runs_t *rs, void **bases) {
    uint64_t m = rs->nruns;
    rs->vb[0] = bases[0];
    if (shmps_specs_of(rs->vb, 1 + m, rs->sp)) return SHMPS_E_ARG;
    const shmps_spec_t *s0 = rs->sp[0];
    if (s0->kind != SHMPS_DENSE) return SHMPS_E_ARG;
    for (uint64_t j = 0; j < m; j++) {
        const shmps_spec_t *s = rs->sp[1 + j];
        if (s->kind != SHMPS_DENSE || s->dtype != s0->dtype || s->row_len != s0->row_len)
            return SHMPS_E_ARG;
        if (rs->top[j] >= s->nrows) return SHMPS_E_BOUNDS;
    }
    return SHMPS_OK;
}

/* One pass over rows[0..n) (bases: every shard, shard i holding rows i*shard_rows on):
 * each row in the tensor's shards, [0, tensor_end) (else SHMPS_E_BOUNDS), and in order
 * (else SHMPS_UNSORTED, once every row is in range): `ascending`, each row >= the one
 * before (a push); else each row's shard >= the one before's (a pull).  Rows in order
 * are recorded in rs as runs, one per shard, with the greatest row of each (a division
 * a run: the other rows compare, and a division costs tens of cycles); then
 * check_runs.  On success the caller frees rs (runs_free); on an error it is freed
 * here.  (Before 2026-11-27 a rows= call went over its rows three times -- range and
 * order, runs, each row against its shard's nrows -- and a call of more than
 * RUNS_ON_STACK runs recorded them twice.) */
static int find_runs(runs_t *rs, void **bases, uint32_t nshards, uint64_t shard_rows,
                     const int64_t *rows, uint64_t n, int ascending) {
    rs->start = rs->start_stack, rs->shard = rs->shard_stack, rs->top = rs->top_stack;
    rs->vb = rs->vb_stack, rs->sp = rs->sp_stack, rs->cap = RUNS_ON_STACK;
    /* 1 .. INT64_MAX: a negative row, as uint64_t, is then >= shard_rows past any
     * shard's first row, and ends a run (the loop below) instead of joining it */
    if (shard_rows - 1 >= (uint64_t)INT64_MAX) return SHMPS_E_ARG;
    uint64_t end = tensor_end(nshards, shard_rows);
    uint64_t j = 0, first = 0; /* run j - 1's shard's first row */
    int sorted = 1, oom = 0;   /* once either is off, the rows are only checked */
    for (uint64_t i = 0; i < n;) {
        int64_t row = rows[i];
        if (row < 0 || (uint64_t)row >= end) { runs_free(rs); return SHMPS_E_BOUNDS; }
        if (i && (uint64_t)row < first) sorted = 0; /* a lower shard than the run before */
        uint64_t a = i, sh = (uint64_t)row / shard_rows, top = (uint64_t)row - sh * shard_rows;
        first = sh * shard_rows;
        /* the rest of the run: rows of this shard, so in the tensor's shards (a row
         * outside them is in no shard of the tensor, so not this one: it ends the run
         * and is refused above) */
        for (uint64_t prev = top; ++i < n;) {
            uint64_t d = (uint64_t)rows[i] - first; /* (wraps for a row below first) */
            if (d >= shard_rows) break;
            if (ascending && d < prev) sorted = 0;
            top = d > top ? d : top;
            prev = d;
        }
        if (!sorted || oom) continue;
        /* in order, each run is a shard of its own, higher than the last: at most
         * min(n, nshards) runs */
        if (j == rs->cap && runs_grow(rs, j, n < nshards ? n : nshards)) { oom = 1; continue; }
        rs->start[j] = a, rs->shard[j] = sh, rs->top[j] = top, rs->vb[1 + j] = bases[sh];
        j++;
    }
    int r = !sorted ? SHMPS_UNSORTED : oom ? ENOMEM : SHMPS_OK;
    if (r == SHMPS_OK) {
        rs->start[j] = n;
        rs->nruns = j;
        r = check_runs(rs, bases);
    }
    if (r) runs_free(rs);
    return r;
}

/* A push of rows given by their numbers in the tensor, in one call (a few rows cost a
 * dozen calls from Python otherwise): `rows` ascending (repeats allowed, applied in
 * turn), all checked (each in the tensor's shards and in range of its shard, the
 * shards and the gradient's dtype (find_runs),
 * with `check` no NaN/Inf) before anything changes; rows not ascending return
 * SHMPS_UNSORTED having done nothing, once each is in the tensor's shards (the
 * caller sorts them, stably, and calls again: each stripe is then locked once per push,
 * so a stripe always holds whole pushes).  Then the tensor's next step (shard 0; or,
 * new_step 0, its current one, at least 1), each shard's run of rows, and the push
 * counted in shard 0 as `pushes`.  bases: every shard, shard i holding rows
 * i*shard_rows on.
 * Into an outbox (SHMPS_F_OUTBOX), each run holds a landing slot of its shard from
 * before its first write there until the push is counted in that shard's ob_pushed
 * (outbox.c "Landing"; one slot at a time, so none waits holding another); a run that
 * failed is not counted, and what it wrote goes out with the next drain. */
int shmps_dense_push_sorted_rows(void **bases, uint32_t nshards, uint64_t shard_rows,
                                 uint64_t token, const int64_t *rows, uint64_t n,
                                 const void *grad, uint32_t grad_dtype, int check,
                                 int new_step, uint64_t pushes) {
    if (nshards == 0 || shard_rows == 0) return SHMPS_E_ARG;
    runs_t rs; /* ascending: each shard is one run (SHMPS_UNSORTED: the sorted call
                * checks the rest) */
    int r = find_runs(&rs, bases, nshards, shard_rows, rows, n, 1);
    if (r) return r;
    const shmps_spec_t *s0 = rs.sp[0];
    size_t gsz = shmps_grad_size(s0->dtype);
    if ((r = check_dense(s0, grad_dtype)) ||
        (check && (r = shmps_check_finite(grad, grad_dtype, n * s0->row_len)))) {
        runs_free(&rs);
        return r;
    }
    push_step_t ps = {0, &hdr_of(bases[0])->step};
    if (new_step) {
        shmps_steps_by_ticket(hdr_of(bases[0]));
        shmps_next_step(bases[0], &ps.step);
    } else {
        shmps_dense_step_again(bases[0], &ps.step);
    }
    const char *g = (const char *)grad;
    int outbox = (s0->flags & SHMPS_F_OUTBOX) != 0;
    for (uint64_t j = 0; j < rs.nruns && r == SHMPS_OK; j++) {
        uint64_t sh = rs.shard[j], a = rs.start[j], b = rs.start[j + 1];
        shmps_shard_hdr_t *h = hdr_of(bases[sh]);
        const shmps_spec_t *s = rs.sp[1 + j]; /* checked (find_runs) */
        uint8_t slot = 0;
        if (outbox && (r = shmps_landing_claim(h, token, &slot)) < 0) break;
        r = push_rows_at(bases[sh], s, token, rows + a, b - a, (int64_t)(sh * shard_rows),
                         g + a * s0->row_len * gsz, &ps);
        if (outbox) {
            int rr = shmps_landing_release(h, token, slot, r == SHMPS_OK);
            if (r == SHMPS_OK) r = rr;
        }
    }
    if (r == SHMPS_OK) shmps_count_push(bases[0], pushes, n * s0->row_len * gsz, n);
    runs_free(&rs);
    return r;
}

static int push_rows_at(void *base, const shmps_spec_t *s, uint64_t token,
                        const int64_t *rows, uint64_t n, int64_t off, const void *grad,
                        const push_step_t *ps) {
    shmps_shard_hdr_t *h = hdr_of(base);
    uint32_t slot;
    int r = shmps_enter(base, token, SHMPS_LOCK_TIMEOUT_S, &slot);
    if (r < 0) return r;
    const char *g = (const char *)grad;
    size_t gsz = shmps_grad_size(s->dtype);
    uint64_t rl = s->row_len, se = s->stripe_elems;
    shmps_stripe_t *stripes = (shmps_stripe_t *)at(base, s->stripes_off);
    int hog = (s->flags & SHMPS_F_HOGWILD) != 0;
    uint64_t held = UINT64_MAX; /* stripe locked across consecutive rows */
    uint64_t tstep = ps->step;  /* the held stripe's step for this push */
    for (uint64_t i = 0; i < n && r == SHMPS_OK; i++) {
        uint64_t e0 = (uint64_t)(rows[i] - off) * rl, e1 = e0 + rl;
        const char *gr = g + i * rl * gsz;
        if (hog) { r = shmps_apply(base, s, e0, rl, gr, ps->step); continue; }
        for (uint64_t e = e0; e < e1 && r == SHMPS_OK;) {
            uint64_t j = e / se;
            uint64_t stop = (j + 1) * se < e1 ? (j + 1) * se : e1;
            if (held != j) {
                release_held(stripes, &held);
                int lr = shmps_stripe_lock(&stripes[j], token, SHMPS_LOCK_TIMEOUT_S,
                                           &h->stats.takeovers);
                if (lr < 0) { r = lr; break; }
                shmps_stripe_write_begin(&stripes[j]);
                held = j;
                /* rows ascending: the stripe is locked once in this push (Stripe steps) */
                tstep = stripe_step(&stripes[j], ps);
            }
            if (s->flags & SHMPS_F_OUTBOX) note_pending(base, s, e, stop); /* first: above */
            r = shmps_apply(base, s, e, stop - e, gr + (e - e0) * gsz, tstep);
            e = stop;
        }
    }
    release_held(stripes, &held);
    shmps_leave(base, token, slot);
    return r;
}

int shmps_dense_pull(void *base, uint64_t token, void *out, uint64_t elem_lo,
                     uint64_t elem_hi, int consistent) {
    const shmps_spec_t *s = shmps_spec_of(base);
    if (!s) return SHMPS_E_ARG;
    return pull_range(base, s, token, out, elem_lo, elem_hi, consistent);
}

static int pull_range(void *base, const shmps_spec_t *s, uint64_t token, void *out,
                      uint64_t elem_lo, uint64_t elem_hi, int consistent) {
    if (s->kind != SHMPS_DENSE) return SHMPS_E_ARG;
    if (elem_lo > elem_hi || elem_hi > s->nnz) return SHMPS_E_BOUNDS;
    const char *v = at(base, s->value_off);
    size_t isz = s->itemsize;
    if (consistent) {
        int r = shmps_freeze_shared(base, token, SHMPS_LOCK_TIMEOUT_S);
        if (r < 0) return r;
        memcpy(out, v + elem_lo * isz, (elem_hi - elem_lo) * isz);
        return shmps_thaw_shared(base, token);
    }
    shmps_stripe_t *stripes = (shmps_stripe_t *)at(base, s->stripes_off);
    uint64_t se = s->stripe_elems;
    char *o = (char *)out;
    for (uint64_t e = elem_lo; e < elem_hi;) {
        uint64_t j = e / se, stop = (j + 1) * se < elem_hi ? (j + 1) * se : elem_hi;
        int r = shmps_stripe_read(&stripes[j], token, o + (e - elem_lo) * isz, v + e * isz,
                                  (stop - e) * isz);
        if (r < 0) return r;
        e = stop;
    }
    return SHMPS_OK;
}

/* One shard's part of a pull of rows: rows[k] (k < m, numbered in the tensor; the
 * shard's first row is `off`) goes to row pos[k] of out (pos NULL: row first + k).
 * Consistent: under one shared freeze of the shard, so the rows reflect a whole number
 * of pushes; else each row's stripes are read by their seqlocks. */
static int pull_group(void *base, const shmps_spec_t *s, uint64_t token, const int64_t *rows,
                      const int64_t *pos, uint64_t m, int64_t off, char *out, uint64_t first,
                      int consistent) {
    const char *v = at(base, s->value_off);
    size_t rb = s->row_len * s->itemsize;
    if (consistent) {
        int r = shmps_freeze_shared(base, token, SHMPS_LOCK_TIMEOUT_S);
        if (r < 0) return r;
        for (uint64_t k = 0; k < m; k++) {
            uint64_t d = pos ? (uint64_t)pos[k] : first + k;
            memcpy(out + d * rb, v + (uint64_t)(rows[k] - off) * rb, rb);
        }
        return shmps_thaw_shared(base, token);
    }
    for (uint64_t k = 0; k < m; k++) {
        uint64_t d = pos ? (uint64_t)pos[k] : first + k;
        uint64_t e0 = (uint64_t)(rows[k] - off) * s->row_len;
        int r = pull_range(base, s, token, out + d * rb, e0, e0 + s->row_len, 0);
        if (r < 0) return r;
    }
    return SHMPS_OK;
}

/* A pull of rows given by their numbers in the tensor (repeats allowed) in one call:
 * rows[i] is copied to row pos[i] of out (pos NULL: row i).  Everything is checked
 * first (each row in range of its shard, each pos in [0, n): SHMPS_E_BOUNDS with out
 * untouched); then each shard's rows are copied under one freeze of that shard, one
 * shard at a time (none waits holding another), and the pull is counted in shard 0.
 * bases: every shard, shard i holding rows i*shard_rows on.
 * The rows' shard numbers must not decrease (one run per shard), except without pos
 * for up to 64 rows, which are grouped here (on the stack: nothing is allocated).
 * More unordered rows without pos return SHMPS_UNSORTED having done nothing: the
 * caller sorts them by shard and passes their positions as pos. */
int shmps_dense_pull_rows(void **bases, uint32_t nshards, uint64_t shard_rows,
                          uint64_t token, const int64_t *rows, const int64_t *pos,
                          uint64_t n, void *out, int consistent) {
    if (nshards == 0 || shard_rows == 0) return SHMPS_E_ARG;
    for (uint64_t i = 0; pos && i < n; i++)
        if (pos[i] < 0 || (uint64_t)pos[i] >= n) return SHMPS_E_BOUNDS;
    runs_t rs; /* in shard order: each shard is one run */
    int r = find_runs(&rs, bases, nshards, shard_rows, rows, n, 0);
    int64_t srows[64], spos[64];
    if (r == SHMPS_UNSORTED) { /* every row is in the tensor's shards */
        if (pos) return SHMPS_E_ARG;
        if (n > 64) return SHMPS_UNSORTED;
        /* stable insertion sort of the positions by shard: at most 64 rows */
        for (uint64_t i = 0; i < n; i++) {
            uint64_t sh = (uint64_t)rows[i] / shard_rows, k = i;
            for (; k > 0 && (uint64_t)srows[k - 1] / shard_rows > sh; k--) {
                srows[k] = srows[k - 1];
                spos[k] = spos[k - 1];
            }
            srows[k] = rows[i];
            spos[k] = (int64_t)i;
        }
        rows = srows;
        pos = spos;
        r = find_runs(&rs, bases, nshards, shard_rows, rows, n, 0);
    }
    if (r) return r;
    size_t rb = rs.sp[0]->row_len * rs.sp[0]->itemsize;
    char *o = (char *)out;
    for (uint64_t j = 0; j < rs.nruns && r == SHMPS_OK; j++) {
        uint64_t sh = rs.shard[j], a = rs.start[j], b = rs.start[j + 1];
        const shmps_spec_t *s = rs.sp[1 + j]; /* checked (find_runs) */
        r = pull_group(bases[sh], s, token, rows + a, pos ? pos + a : NULL, b - a,
                       (int64_t)(sh * shard_rows), o, a, consistent);
    }
    if (r == SHMPS_OK) shmps_count(bases[0], 1, n * rb, n);
    runs_free(&rs);
    return r;
}

/* Non-finite test on the exponent bits: integer ops that vectorise without
 * -ffast-math.  Large inputs are scanned as four interleaved streams: one core
 * reading one stream is latency-bound (~26 GB/s here); four keep more misses in
 * flight. */
#define FINITE_LOOP(T, MASK, p, lo, hi, bad) \
    for (uint64_t i = (lo); i < (hi); i++) bad |= ((p)[i] & (MASK)) == (MASK)

#define FINITE_SCAN(T, MASK)                                                         \
    {                                                                                \
        const T *p = (const T *)data;                                                \
        uint64_t q = n / 4;                                                          \
        if (q >= 4096) {                                                             \
            const T *a = p, *b = p + q, *c = p + 2 * q, *d = p + 3 * q;             \
            uint64_t b0 = 0, b1 = 0, b2 = 0, b3 = 0;                                 \
            for (uint64_t i = 0; i < q; i++) {                                       \
                b0 |= (a[i] & (MASK)) == (MASK);                                     \
                b1 |= (b[i] & (MASK)) == (MASK);                                     \
                b2 |= (c[i] & (MASK)) == (MASK);                                     \
                b3 |= (d[i] & (MASK)) == (MASK);                                     \
            }                                                                        \
            bad = b0 | b1 | b2 | b3;                                                 \
            FINITE_LOOP(T, MASK, p, 4 * q, n, bad);                                  \
        } else {                                                                     \
            FINITE_LOOP(T, MASK, p, 0, n, bad);                                      \
        }                                                                            \
    }

int shmps_check_finite(const void *data, uint32_t dtype, uint64_t n) {
    uint64_t bad = 0;
    if (dtype == SHMPS_FLOAT32) FINITE_SCAN(uint32_t, 0x7f800000u)
    else if (dtype == SHMPS_FLOAT64) FINITE_SCAN(uint64_t, 0x7ff0000000000000ull)
    else if (dtype == SHMPS_FLOAT16) FINITE_SCAN(uint16_t, (uint16_t)0x7c00u)
    return bad ? SHMPS_E_NONFINITE : SHMPS_OK;
}

int shmps_next_step(void *base, uint64_t *step) {
    /* relaxed: only atomicity matters; each push gets a distinct step number */
    *step = FETCH_ADD(&hdr_of(base)->step, 1, RELAXED) + 1;
    return SHMPS_OK;
}

/* The ticket of a dense whole push (shard 0): with SHMPS_STEP_BY_STRIPE while the
 * tensor never took a rows= push ("Stripe steps").  Acquire: pairs with the release
 * add of a rows= push with an earlier ticket, whose flag is then seen. */
int shmps_dense_next_step(void *base, uint64_t *step) {
    shmps_shard_hdr_t *h = hdr_of(base);
    uint64_t t = FETCH_ADD(&h->step, 1, ACQUIRE) + 1;
    *step = LOAD(&h->steps_by_ticket, RELAXED) ? t : t | SHMPS_STEP_BY_STRIPE;
    return SHMPS_OK;
}

/* The step of a push under way, to apply more of it (a later frame of one drain):
 * the tensor's current step, at least 1, applied as a rows= push's ("Stripe steps":
 * max(ticket, last), so the step its first part applied at on a stripe both touch).
 * Relaxed: as shmps_stats reads it; the caller applied the push's first part. */
int shmps_dense_step_again(void *base, uint64_t *step) {
    uint64_t t = LOAD(&hdr_of(base)->step, RELAXED);
    *step = t ? t : 1;
    return SHMPS_OK;
}

/* Restore: every stripe of the shard last applied a push at `step` (the restored
 * tensor's), before the tensor is visible ("Stripe steps"). */
int shmps_dense_set_stripe_steps(void *base, uint64_t step) {
    const shmps_spec_t *s = shmps_spec_of(base);
    if (!s || s->kind != SHMPS_DENSE) return SHMPS_E_ARG;
    shmps_stripe_t *stripes = (shmps_stripe_t *)at(base, s->stripes_off);
    for (uint64_t j = 0; j < s->nstripes; j++) STORE(&stripes[j].pad, (uint32_t)step, RELAXED);
    return SHMPS_OK;
}

int shmps_set_step(void *base, uint64_t step) {
    STORE(&hdr_of(base)->step, step, RELAXED); /* restore, before the tensor is visible */
    return SHMPS_OK;
}

int shmps_set_table_used(void *base, uint64_t used) {
    shmps_shard_hdr_t *h = hdr_of(base);
    const shmps_spec_t *s = shmps_spec_of(base);
    if (!s || s->kind != SHMPS_TABLE || used > s->nrows) return SHMPS_E_ARG;
    STORE(&h->table_used, used, RELAXED); /* restore, before the tensor is visible */
    return SHMPS_OK;
}

int shmps_count(void *base, int pull, uint64_t nbytes, uint64_t rows) {
    if (!pull) return shmps_count_push(base, 1, nbytes, rows);
    shmps_stats_t *st = &hdr_of(base)->stats;
    /* relaxed: statistics, each counter independently atomic */
    FETCH_ADD(&st->pulls, 1, RELAXED);
    FETCH_ADD(&st->bytes_pulled, nbytes, RELAXED);
    FETCH_ADD(&st->rows_pulled, rows, RELAXED);
    STORE(&st->last_pull_ns, shmps_now_ns(), RELAXED);
    return SHMPS_OK;
}

/* A push's statistics, standing for `pushes` pushes (0: more rows of a push already
 * counted, such as a later frame of one forwarded drain). */
int shmps_count_push(void *base, uint64_t pushes, uint64_t nbytes, uint64_t rows) {
    shmps_stats_t *st = &hdr_of(base)->stats;
    /* relaxed: statistics, each counter independently atomic */
    if (pushes) FETCH_ADD(&st->pushes, pushes, RELAXED);
    FETCH_ADD(&st->bytes_pushed, nbytes, RELAXED);
    FETCH_ADD(&st->rows_pushed, rows, RELAXED);
    STORE(&st->last_push_ns, shmps_now_ns(), RELAXED);
    return SHMPS_OK;
}
