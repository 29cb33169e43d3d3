/* Outboxes of the multi-host bridge, and the row writes that replication needs.
 *
 * While the manifest's `forward` word is 1, every push to a dense tensor or table is
 * summed into the tensor's *outbox* (a hidden tensor of the same rows, updater sum,
 * flag SHMPS_F_OUTBOX) instead of applying the updater; the bridge drains outboxes
 * and the owner's bridge applies what they held.  docs/concurrency.md "Outboxes" has
 * the whole argument; in short:
 *
 *   pusher:  pending[row]++, then values += g, under the stripe (row) lock, for every
 *            stripe; then ob_pushed += 1 (release), once per outbox shard it touched.
 *   drainer: P = ob_pushed (acquire); then, holding every stripe of a row (in
 *            increasing order), take the row's values and zero them and its pending
 *            count if that count is > 0.
 *
 * Every push counted in P wrote its values and counts before its release add, which
 * the drainer's acquire load reads (or a later add of the same release sequence), so
 * the drain sees them: each was taken by this drain or an earlier one.  Values are
 * only ever written under the covering stripe lock, so the sums taken by all drains
 * plus what is left equal the sums pushed, exactly.
 *
 * Acknowledgement.  ob_acked is the highest P the bridge reports applied by the
 * owner; store.flush() waits until ob_acked reaches ob_pushed as read at the call.
 * A drain can find nothing left for pushes it counts (a push still in flight at the
 * previous drain had its values taken then, its count only now): ob_drained (the
 * latest drain's P), ob_sent (how many drains took rows: each such drain's ticket)
 * and ob_sent_acked (the highest ticket acknowledged) let such an empty drain, or the
 * ack of the latest drain that took rows, raise ob_acked to ob_drained.  One drainer
 * per outbox shard at a time (the bridge), acks in drain order.
 *
 * Tickets, not P values, say which drains are acknowledged: two drains that took rows
 * can read the same P (the second took only values of a push still landing, whose
 * count comes after it), so an ack carrying that P cannot tell whether the second one
 * was applied.  With ob_sent holding P (as before 2026-11-24), the first one's ack
 * made the next empty drain acknowledge the landing push while the second drain's
 * frames, which held all of its values, were still on their way: store.flush()
 * returned before the owner had applied them.
 */
#include "internal.h"

#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* ---- the forwarding switch (manifest) ------------------------------------------- */

int shmps_forward_set(void *man, uint32_t on) {
    /* release: what the bridge did before switching (creating outboxes, say) is
     * visible to a process that acquire-loads the new value (shmps_forward_get) */
    STORE(&((shmps_manifest_t *)man)->forward, on ? 1u : 0u, RELEASE);
    return SHMPS_OK;
}

uint32_t shmps_forward_get(const void *man) {
    /* acquire: pairs with shmps_forward_set's release */
    return LOAD(&((const shmps_manifest_t *)man)->forward, ACQUIRE);
}

/* The word itself, for the push path's cheapest test (Python reads it through a
 * uint32_t pointer: one aligned 4-byte load).  No order is needed there: nothing a
 * pusher reads afterwards was published through this word (outboxes are found
 * through the catalog, which has its own release/acquire). */
uint32_t *shmps_forward_word(void *man) { return &((shmps_manifest_t *)man)->forward; }

/* store.flush(): ask the bridge to drain now rather than at its next flush interval:
 * bump flush_req and wake its waiter (a futex on a MAP_SHARED word: the shared ops).
 * Relaxed: a wake-up hint only.  The pushes the flusher waits for are published by
 * their own release adds of ob_pushed, which the drain acquires; a bridge that misses
 * this bump drains them at its next interval anyway. */
int shmps_flush_request(void *man) {
    uint32_t *w = &((shmps_manifest_t *)man)->flush_req;
    FETCH_ADD(w, 1, RELAXED);
    syscall(SYS_futex, w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    return SHMPS_OK;
}

/* The bridge's waiting thread: sleep until flush_req differs from `seen` (at once if it
 * does already) or max_ns pass; returns flush_req.  Relaxed, as above. */
uint32_t shmps_flush_wait(void *man, uint32_t seen, uint64_t max_ns) {
    uint32_t *w = &((shmps_manifest_t *)man)->flush_req;
    struct timespec ts = {(time_t)(max_ns / 1000000000ull), (long)(max_ns % 1000000000ull)};
    syscall(SYS_futex, w, FUTEX_WAIT, seen, &ts, NULL, 0);
    return LOAD(w, RELAXED);
}

/* store.flush() waiting for acknowledgements: instead of polling the counters, it sleeps
 * on the manifest's ack_seq (a futex word), which the bridge bumps after a unit of work
 * that may have raised some shard's ob_acked (acks handled, an empty drain), waking the
 * sleepers when ack_waiters says there are any.  Pairing (all seq_cst, one total order):
 *
 *   flusher: ack_waiters += 1; g = ack_seq; read ob_acked (short); futex_wait(ack_seq, g)
 *   bridge:  raise ob_acked;   ack_seq += 1; if ack_waiters: futex_wake
 *
 * If the flusher's read of ob_acked missed the raise, that read precedes the raise, so
 * its read of ack_seq precedes the bridge's add: the wait finds ack_seq != g and returns,
 * or sleeps first and is woken, since the bridge's load of ack_waiters follows the
 * flusher's add.  A flusher killed while registered leaves ack_waiters high: the
 * bridge then makes a needless wake call per unit of work, nothing worse. */
void shmps_ack_notify(void *man) {
    shmps_manifest_t *m = man;
    FETCH_ADD(&m->ack_seq, 1, SEQ_CST);
    if (LOAD(&m->ack_waiters, SEQ_CST))
        syscall(SYS_futex, &m->ack_seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

uint32_t shmps_ack_seq(const void *man) {
    /* seq_cst: see above (read after registering, before the counters) */
    return LOAD(&((const shmps_manifest_t *)man)->ack_seq, SEQ_CST);
}

void shmps_ack_waiting(void *man, int32_t delta) {
    /* seq_cst: the registration comes before the flusher's read of ack_seq (above) */
    FETCH_ADD(&((shmps_manifest_t *)man)->ack_waiters, (uint32_t)delta, SEQ_CST);
}

/* Sleep until ack_seq differs from `seen` (at once if it does already) or max_ns pass;
 * returns ack_seq. */
uint32_t shmps_ack_wait(void *man, uint32_t seen, uint64_t max_ns) {
    uint32_t *w = &((shmps_manifest_t *)man)->ack_seq;
    struct timespec ts = {(time_t)(max_ns / 1000000000ull), (long)(max_ns % 1000000000ull)};
    syscall(SYS_futex, w, FUTEX_WAIT, seen, &ts, NULL, 0);
    return LOAD(w, SEQ_CST);
}

/* ---- counters -------------------------------------------------------------------- */

static shmps_shard_hdr_t *outbox_hdr(void *base) {
    shmps_shard_hdr_t *h = hdr_of(base);
    return (h->spec.flags & SHMPS_F_OUTBOX) ? h : NULL;
}

int shmps_outbox_pushed(void *base) {
    shmps_shard_hdr_t *h = outbox_hdr(base);
    if (!h) return SHMPS_E_ARG;
    /* release: this push's value and pending writes into the shard (all made before,
     * under stripe or row locks) happen-before a drainer's acquire load of ob_pushed
     * that reads this add or a later one (an RMW continues the release sequence) */
    FETCH_ADD(&h->ob_pushed, 1, RELEASE);
    return SHMPS_OK;
}

int shmps_outbox_counters(const void *base, uint64_t *pushed, uint64_t *acked) {
    shmps_shard_hdr_t *h = outbox_hdr((void *)base);
    if (!h) return SHMPS_E_ARG;
    /* acquire: pairs with the pushers' release adds (a flusher's own pushes are
     * before its load in program order, so it reads at least its own count) */
    *pushed = LOAD(&h->ob_pushed, ACQUIRE);
    /* acquire: pairs with cas_max's seq_cst (release) store by an ack */
    *acked = LOAD(&h->ob_acked, ACQUIRE);
    return SHMPS_OK;
}

/* *p = max(*p, v).  seq_cst: the ack / empty-drain pair below is a Dekker pattern
 * (each writes one word, then reads the other's). */
static void cas_max(uint64_t *p, uint64_t v) {
    uint64_t cur = LOAD(p, SEQ_CST);
    while (cur < v && !CAS(p, &cur, v, SEQ_CST, SEQ_CST)) {
    }
}

int shmps_outbox_ack(void *base, uint64_t pushed, uint64_t ticket) {
    shmps_shard_hdr_t *h = outbox_hdr(base);
    if (!h) return SHMPS_E_ARG;
    /* never acknowledge more than a drain took (a confused caller) */
    uint64_t d = LOAD(&h->ob_drained, SEQ_CST);
    if (pushed > d) pushed = d;
    cas_max(&h->ob_acked, pushed);
    cas_max(&h->ob_sent_acked, ticket);
    /* A drain that took rows takes its ticket (ob_sent) before it raises ob_drained
     * (seq_cst, outbox_drained), so if we see its ob_drained we see its ticket. */
    uint64_t d2 = LOAD(&h->ob_drained, SEQ_CST);
    uint64_t sent = LOAD(&h->ob_sent, SEQ_CST);
    /* Every drain that took rows is acknowledged: the empty drains after the last one
     * found nothing of the pushes they counted, whose values that one (or an earlier
     * one) took, so those pushes are acknowledged too.  (A ticket of 0, from a caller
     * without one, acknowledges only while no drain has taken rows.) */
    if (ticket >= sent) cas_max(&h->ob_acked, d2);
    return SHMPS_OK;
}

/* A bridge starting on a store, before its first drain of this outbox shard: what an
 * earlier bridge process drained and did not see acknowledged, (ob_acked, ob_drained],
 * lived only in that process's frames.  The owner may have applied it (an ACK lost with
 * the process) or not; nobody can resend it.  Record the range as lost, then
 * acknowledge it, so store.flush() neither waits forever nor returns as if those pushes
 * had been applied: it reads the range and raises.  *lost: the pushes in the range. */
int shmps_outbox_recover(void *base, uint64_t *lost) {
    shmps_shard_hdr_t *h = outbox_hdr(base);
    if (!h) return SHMPS_E_ARG;
    *lost = 0;
    /* the ended process's drains count as acknowledged: their rows are in the lost
     * range below, or, with nothing lost, one took only values of a push still landing
     * (it claimed no P: header comment), and left unacknowledged it would keep every
     * later empty drain from acknowledging */
    cas_max(&h->ob_sent_acked, LOAD(&h->ob_sent, SEQ_CST));
    uint64_t d = LOAD(&h->ob_drained, SEQ_CST);
    uint64_t a = LOAD(&h->ob_acked, SEQ_CST);
    if (a >= d) return SHMPS_OK;
    /* one bridge per store: no other writer of these words runs now */
    STORE(&h->ob_lost_lo, a, RELAXED);
    STORE(&h->ob_lost_hi, d, RELAXED);
    FETCH_ADD(&h->ob_lost, d - a, RELAXED);
    /* the seq_cst raise of ob_acked below publishes the three words above: a flusher
     * that reads the raised ob_acked (acquire) reads them too */
    cas_max(&h->ob_acked, d);
    *lost = d - a;
    return SHMPS_OK;
}

int shmps_outbox_lost(const void *base, uint64_t *lo, uint64_t *hi, uint64_t *count) {
    shmps_shard_hdr_t *h = outbox_hdr((void *)base);
    if (!h) return SHMPS_E_ARG;
    /* relaxed: the caller loaded ob_acked (acquire) first, which orders these loads
     * after the recover that raised it (see shmps_outbox_recover) */
    *lo = LOAD(&h->ob_lost_lo, RELAXED);
    *hi = LOAD(&h->ob_lost_hi, RELAXED);
    *count = LOAD(&h->ob_lost, RELAXED);
    return SHMPS_OK;
}

uint64_t shmps_outbox_drained(shmps_shard_hdr_t *h, uint64_t pushed, int took,
                              uint64_t *ticket) {
    uint64_t prev = LOAD(&h->ob_drained, SEQ_CST);
    if (took) {
        /* its ticket before ob_drained: see shmps_outbox_ack (one drainer at a time) */
        *ticket = FETCH_ADD(&h->ob_sent, 1, SEQ_CST) + 1;
        cas_max(&h->ob_drained, pushed);
        return prev;
    }
    *ticket = 0;
    cas_max(&h->ob_drained, pushed);
    /* Dekker with shmps_outbox_ack: we write ob_drained then read ob_sent_acked, an ack
     * writes ob_sent_acked then reads ob_drained; seq_cst: at least one sees the other,
     * so an ack racing with this empty drain cannot leave ob_acked short of it. */
    uint64_t done = LOAD(&h->ob_sent_acked, SEQ_CST);
    if (done >= LOAD(&h->ob_sent, SEQ_CST)) cas_max(&h->ob_acked, pushed);
    return prev;
}

/* ---- dense drain ------------------------------------------------------------------ */

/* Closes the writes of, and unlocks, stripes [*lo, upto). */
static void unhold(shmps_stripe_t *st, uint64_t *lo, uint64_t upto) {
    for (; *lo < upto; (*lo)++) {
        shmps_stripe_write_end(&st[*lo]);
        shmps_stripe_unlock(&st[*lo]);
    }
}

int shmps_outbox_drain(void *base, uint64_t token, double timeout_s, int64_t *rows,
                       void *vals, uint64_t cap, uint64_t *n_out, uint64_t *pushed,
                       uint64_t *prev, uint64_t *ticket) {
    shmps_shard_hdr_t *h = outbox_hdr(base);
    if (!h || h->spec.kind != SHMPS_DENSE) return SHMPS_E_ARG;
    const shmps_spec_t *s = &h->spec;
    if (cap < s->nrows) return SHMPS_E_BOUNDS;
    *n_out = 0;
    *ticket = 0;
    /* acquire: pairs with the pushers' release adds (shmps_outbox_pushed): every push
     * counted in P wrote its values and pending counts before, visible to us now */
    uint64_t P = LOAD(&h->ob_pushed, ACQUIRE);
    uint32_t slot;
    int r = shmps_enter(base, token, timeout_s, &slot); /* as a pusher */
    if (r < 0) return r;
    uint64_t *pend = (uint64_t *)at(base, s->rowstep_off);
    shmps_stripe_t *st = (shmps_stripe_t *)at(base, s->stripes_off);
    char *v = at(base, s->value_off);
    uint64_t rl = s->row_len, se = s->stripe_elems, rb = rl * s->itemsize, n = 0;
    uint64_t lo = 0, hi = 0; /* stripes [lo, hi) are held, their writes open */
    int partial = 0;
    for (uint64_t row = 0; row < s->nrows; row++) {
        /* relaxed, unlocked: a cheap scan.  A push counted in P made its count before
         * its release add, read by our acquire load above: this load sees that count
         * or a later value (a later count, or a drain's zero after taking it). */
        if (LOAD(&pend[row], RELAXED) == 0) continue;
        uint64_t ja = row * rl / se, jb = (row * rl + rl - 1) / se;
        unhold(st, &lo, ja < hi ? ja : hi); /* rows ascend: stripes below ja are done */
        if (lo >= hi) lo = hi = ja;
        for (; hi <= jb; hi++) { /* increasing order: two drainers cannot deadlock, and
                                  * pushers hold one stripe at a time */
            int lr = shmps_stripe_lock(&st[hi], token, timeout_s, &h->stats.takeovers);
            if (lr < 0) { partial = 1; break; }
            shmps_stripe_write_begin(&st[hi]);
        }
        if (partial) break;
        /* relaxed: we hold every stripe of the row, so no one else writes it now */
        if (LOAD(&pend[row], RELAXED) == 0) continue;
        memcpy((char *)vals + n * rb, v + row * rb, rb);
        memset(v + row * rb, 0, rb);
        STORE(&pend[row], 0, RELAXED);
        rows[n++] = (int64_t)row;
    }
    unhold(st, &lo, hi);
    shmps_leave(base, token, slot);
    *n_out = n;
    if (partial) {
        /* Claim no new push (rows we did not reach may hold pushes counted in P); rows
         * taken get a ticket, so that no empty drain acknowledges anything until they
         * are (the row we stopped at stays pending, so the next whole drain takes rows
         * and is acknowledged normally). */
        if (n) *ticket = FETCH_ADD(&h->ob_sent, 1, SEQ_CST) + 1;
        *pushed = *prev = LOAD(&h->ob_drained, SEQ_CST);
        return SHMPS_DRAIN_PARTIAL;
    }
    *prev = shmps_outbox_drained(h, P, n > 0, ticket);
    *pushed = P;
    return SHMPS_OK;
}

int shmps_outbox_pending(const void *base, uint64_t *out, uint64_t cap) {
    shmps_shard_hdr_t *h = outbox_hdr((void *)base);
    if (!h || h->spec.kind != SHMPS_DENSE) return SHMPS_E_ARG;
    if (cap < h->spec.nrows) return SHMPS_E_BOUNDS;
    const uint64_t *pend = (const uint64_t *)((const char *)base + h->spec.rowstep_off);
    /* relaxed: a snapshot for tests and statistics */
    for (uint64_t r = 0; r < h->spec.nrows; r++) out[r] = LOAD(&pend[r], RELAXED);
    return SHMPS_OK;
}

/* The flush loop's test, one call over any set of outbox shards (the bridge passes
 * every shard of every forwarded tensor: outbox.BusyScan): busy[i] = 1 where outbox shard
 * bases[i] holds pushes no drain has counted yet (ob_pushed != ob_drained), else 0 (a
 * base that is no outbox: 0).  *nbusy: how many are busy.  Relaxed loads suffice: this
 * is a hint, and the drain it leads to makes its own acquire load of ob_pushed, which
 * orders the pushes it takes.  A push whose release add this reads too early (not yet
 * visible) is seen by the next call, one flush interval later; a shard left with
 * ob_drained short of ob_pushed (a partial or timed-out drain) stays busy. */
int shmps_outbox_busy(void *const *bases, uint32_t n, uint8_t *busy, uint32_t *nbusy) {
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
        shmps_shard_hdr_t *h = bases[i] ? outbox_hdr(bases[i]) : NULL;
        busy[i] = h && LOAD(&h->ob_pushed, RELAXED) != LOAD(&h->ob_drained, RELAXED);
        k += busy[i];
    }
    *nbusy = k;
    return SHMPS_OK;
}

/* ---- replication: absolute writes of dense rows ------------------------------------ */

/* Writes rows[i] (local) := vals[i], and its optimizer state, under the shard's
 * exclusive freeze (no pusher or consistent reader inside) and, stripe by stripe,
 * the stripe lock with its seqlock write open (so pull(consistent=False) never sees a
 * half-written stripe either). */
int shmps_dense_write_rows(void *base, uint64_t token, const int64_t *rows, uint64_t n,
                           const void *vals, void *const *states, uint32_t nstates) {
    shmps_shard_hdr_t *h = hdr_of(base);
    const shmps_spec_t *s = &h->spec;
    if (s->kind != SHMPS_DENSE || nstates != s->nstate) return SHMPS_E_ARG;
    for (uint64_t i = 0; i < n; i++) /* all rows checked before anything changes */
        if (rows[i] < 0 || (uint64_t)rows[i] >= s->nrows) return SHMPS_E_BOUNDS;
    int r = shmps_freeze(base, token, SHMPS_LOCK_TIMEOUT_S);
    if (r < 0) return r;
    shmps_stripe_t *st = (shmps_stripe_t *)at(base, s->stripes_off);
    uint64_t rl = s->row_len, se = s->stripe_elems;
    size_t isz = s->itemsize, ssz = s->state_itemsize;
    for (uint64_t i = 0; i < n && r >= 0; i++) {
        uint64_t e0 = (uint64_t)rows[i] * rl, e1 = e0 + rl;
        for (uint64_t e = e0; e < e1;) {
            uint64_t j = e / se, stop = (j + 1) * se < e1 ? (j + 1) * se : e1;
            /* a dead pusher's lock is taken over; a live one cannot be inside (frozen)
             * unless it is a seqlock reader that fell back to the lock, briefly */
            r = shmps_stripe_lock(&st[j], token, SHMPS_LOCK_TIMEOUT_S, &h->stats.takeovers);
            if (r < 0) break;
            shmps_stripe_write_begin(&st[j]);
            memcpy(at(base, s->value_off + e * isz), (const char *)vals + (i * rl + e - e0) * isz,
                   (stop - e) * isz);
            for (uint32_t k = 0; k < nstates; k++)
                memcpy(at(base, s->state_off[k] + e * ssz),
                       (const char *)states[k] + (i * rl + e - e0) * ssz, (stop - e) * ssz);
            shmps_stripe_write_end(&st[j]);
            shmps_stripe_unlock(&st[j]);
            e = stop;
        }
    }
    shmps_thaw(base, token);
    return r < 0 ? r : SHMPS_OK;
}

int shmps_raise_step(void *base, uint64_t step) {
    uint64_t *p = &hdr_of(base)->step;
    /* relaxed: only atomicity matters (as shmps_next_step); a monotone max */
    uint64_t cur = LOAD(p, RELAXED);
    while (cur < step && !CAS(p, &cur, step, RELAXED, RELAXED)) {
    }
    return SHMPS_OK;
}

int shmps_count_pushes(void *base, uint64_t n) {
    /* relaxed: a statistic (a batch the owner applies stands for n pushes) */
    FETCH_ADD(&hdr_of(base)->stats.pushes, n, RELAXED);
    return SHMPS_OK;
}
