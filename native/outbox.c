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
 *
 * Lost with a bridge (shmps_outbox_recover).  A bridge that ends takes with it what it
 * drained and did not see acknowledged; the next bridge records a range (lo, hi] of
 * ob_pushed values as lost and acknowledges it, and store.flush() raises PushesLost.
 * Without more, that range was (ob_acked, ob_drained], which misses two cases:
 *
 *   - a landing push: a drain that took values of a push its P does not count (the
 *     count came after the drain read P).  Recover found nothing counted unacknowledged
 *     and counted every ticket acknowledged; the push then counted, the next drain
 *     found nothing of it and acknowledged it: flush() returned.
 *   - a bridge killed inside a drain: rows taken, and no ticket or ob_drained yet.
 *
 * Landing.  So a dense push also holds a landing slot of every outbox shard it
 * writes, from before its first write there until after its count:
 *
 *   pusher:  claim a free slot (CAS 0 -> its token) before its first value or pending
 *            write to the shard (shmps_outbox_land); after its release add of
 *            ob_pushed, add 1 to the slot's seq and free it (shmps_outbox_landed).
 *   drainer: after taking rows, if a slot is held or ob_pushed moved since its P
 *            (maybe_landing), the drain may hold values of a push P does not count: it
 *            records its ticket in ob_landing_ticket.  A partial drain that took rows
 *            always does (it claims no new P).  ob_draining counts drains in progress.
 *   recover: if a drain of the ended bridge may hold such values (ob_landing_ticket
 *            above the acknowledged tickets) or the bridge ended inside a drain
 *            (ob_draining > 0), the range goes past ob_drained, up to an ob_pushed read
 *            once every push landing at recover has counted: recover snapshots the
 *            held slots (seq + 1 each).  If each is free, re-claimed (its seq moved) or
 *            held by a dead process, the range ends at ob_pushed now; else it stays
 *            open (ob_lost_open) and the first drain that finds so ends it at its
 *            ob_pushed (shmps_outbox_settle).  While a range is open no ack or empty
 *            drain raises ob_acked: a flush waiting past the range waits for its end,
 *            then raises PushesLost.
 *
 * A push whose values the ended bridge took held its slot before that drain took them
 * (its claim comes before its stripe writes, which the drain read under the stripe
 * lock), so at recover it has counted (its count is then <= the ob_pushed recover or
 * settle reads: the slot's release and seq stores, read by acquire loads, order it) or
 * it still holds the slot (snapshotted, waited for).  A drain that saw no slot held and
 * ob_pushed unmoved took no value of a push its P does not count: a taken push's claim
 * is visible to it (the stripe lock), so it read that token or a later value, and a 0
 * or a later claim orders the push's count before its second load of ob_pushed.
 *
 * The range may hold pushes that were not lost (maybe_landing is conservative, and the
 * range ends at a later P): PushesLost says "may or may not have been applied".  A
 * recover with every drain acknowledged and none cut short records nothing, and one
 * whose unacknowledged drains saw nothing landing records (ob_acked, ob_drained] only,
 * as before.  A pusher killed while landing holds its slot until a settle (or a pusher
 * finding every slot held) sees it dead and frees it; a pusher stopped (SIGSTOP) while
 * landing keeps the range open until it resumes: flushes waiting past the range time
 * out meanwhile, none returns.  Tables need no slots: a table drain reads its P under
 * its exclusive freeze, when no pusher is inside the shard (a table push counts itself
 * before it leaves), so its P counts every push whose rows it takes.
 *
 * Lost by a failed drain (shmps_outbox_drain_lost).  A table drain that took rows and
 * then failed (a corrupt row) cannot deliver them: it records the pushes past ob_drained
 * that its P counts as a lost range and claims P as an empty drain, so store.flush()
 * raises PushesLost for them rather than see a later drain's ack cover them.
 *
 * Refused by the owner (shmps_outbox_reject).  An owner that cannot apply a batch (it
 * fails the tensor's schema there, or its updater raises) refuses it for good
 * (REJECTED); nobody resends it.  The bridge records the pushes of the drain it came
 * from, (prev, P] of that drain, as a lost range and then acknowledges the drain as
 * usual, so that a later drain's ack does not cover them silently.  A drain whose P
 * counts none of its own (a partial drain, or one of a landing push's values only)
 * records up to ob_pushed at the refusal; while a range recover left open waits, the
 * settle that ends it counts them.  (A push still landing at the refusal, its values
 * taken and its count to come, is not in the range: best effort, as a REJECTED lost
 * with its owner, which the next owner's duplicate answer OK makes unseen.)
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

/* The store-wide count of forwarded pushes, for the bridge's flush loop: while it has
 * not moved since a scan of every outbox shard (shmps_outbox_busy) found none busy, no
 * push has been counted since, and the scan, one cache miss per shard (thousands of
 * them every few ms: most of an idle bridge's C time), is skipped.
 *
 *   pusher:  the push's release adds of ob_pushed (every shard it touched), then
 *            fwd_pushes += 1 (release).
 *   bridge:  F = fwd_pushes (acquire), then the scan's loads of ob_pushed.
 *
 * A push whose add the bridge's load reads (or a later add: an RMW continues the release
 * sequence) made its ob_pushed adds before, in program order; the acquire orders them
 * before the scan's loads, which read them or later values: the scan sees the shard
 * busy, or already drained.  A push whose add comes later moves fwd_pushes past F, and
 * the next pass scans.  So a scan skipped on an unmoved F misses no push counted before
 * it.  What is not counted here (a pusher killed between its shard counts and this add,
 * or a process of an older build that never adds) is found by the bridge's periodic full
 * scan and its sweep: a hint, as shmps_outbox_busy is.
 *
 * Sleeping until a push.  A bridge with nothing to do sets fwd_idle and sleeps (up to
 * its next full scan or sweep) instead of passing every flush interval; the first push
 * after that wakes it:
 *
 *   pusher:  fwd_pushes += 1; then if fwd_idle is 1, CAS it 1 -> 0; if that won, the
 *            pusher wakes the bridge (its doorbell socket, else shmps_forward_wake).
 *   bridge:  fwd_idle = 1; then F' = fwd_pushes; sleep only if F' is the F of the
 *            scan that found nothing (shmps_forward_idle), else clear fwd_idle.
 *
 * All four accesses are seq_cst, so they fall in one total order: either the pusher's
 * add comes before the bridge's load of fwd_pushes (the bridge sees F' != F and does not
 * sleep), or the bridge's store of 1 comes before the pusher's load of fwd_idle (the
 * pusher wakes it); both may happen (one extra pass).  Of several pushers that see the
 * 1, the CAS lets one wake it.  A wake-up orders nothing: the pass it starts reads
 * fwd_pushes (acquire) and the shards as above.  A pusher killed between its add and
 * the wake leaves the bridge asleep until its timeout (the next full scan). */
int shmps_forward_pushed(void *man) {
    shmps_manifest_t *m = man;
    /* seq_cst: release for the scan skip (above), and ordered before the load of
     * fwd_idle below against the bridge's store-then-load (shmps_forward_idle) */
    FETCH_ADD(&m->fwd_pushes, 1, SEQ_CST);
    uint32_t idle = 1;
    return LOAD(&m->fwd_idle, SEQ_CST) && CAS(&m->fwd_idle, &idle, 0u, SEQ_CST, RELAXED);
}

/* A push's wake-up of a sleeping bridge whose doorbell it cannot ring: fwd_wakes += 1,
 * and a wake of the futex on flush_req that the bridge's waiting thread sleeps on (the
 * word itself unchanged: it counts flush requests).  The thread reads fwd_wakes
 * whenever it wakes; one that was not yet back in its wait misses the futex wake and
 * reads fwd_wakes at its next (1 s) wake-up, when the bridge has passed on its own
 * timeout (the next full scan) anyway. */
int shmps_forward_wake(void *man) {
    shmps_manifest_t *m = man;
    FETCH_ADD(&m->fwd_wakes, 1, RELAXED); /* a hint: the pass orders what it reads */
    syscall(SYS_futex, &m->flush_req, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    return SHMPS_OK;
}

uint32_t shmps_forward_wakes(const void *man) {
    return LOAD(&((const shmps_manifest_t *)man)->fwd_wakes, RELAXED);
}

int shmps_forward_idle(void *man, uint64_t seen) {
    shmps_manifest_t *m = man;
    /* seq_cst store, then seq_cst load: the bridge's half of the argument above */
    STORE(&m->fwd_idle, 1u, SEQ_CST);
    if (LOAD(&m->fwd_pushes, SEQ_CST) != seen) {
        STORE(&m->fwd_idle, 0u, RELAXED); /* a push came meanwhile: pass again, no sleep */
        return 0;
    }
    return 1;
}

void shmps_forward_awake(void *man) {
    /* relaxed: the flag only decides whether a pusher makes the syscall; a pusher that
     * still reads 1 makes one more wake-up, harmless */
    STORE(&((shmps_manifest_t *)man)->fwd_idle, 0u, RELAXED);
}

uint64_t shmps_forward_pushes(const void *man) {
    /* acquire: pairs with shmps_forward_pushed's release add (above) */
    return LOAD(&((const shmps_manifest_t *)man)->fwd_pushes, ACQUIRE);
}

/* store.flush(), and a table push into a full outbox before it tries again (outbox.py,
 * _ask_drain): ask the bridge to drain now rather than at its next flush interval:
 * bump flush_req and wake its waiter (a futex on a MAP_SHARED word: the shared ops).
 * Relaxed: a wake-up hint only.  The pushes the flusher waits for are published by
 * their own release adds of ob_pushed, which the drain acquires; a bridge that misses
 * this bump drains them at its next interval anyway.  The scans a full outbox asks for
 * (ob_rescan, relaxed) are hints too: a scan that misses one sees it at the next full
 * scan (every 0.1 s), within the pusher's retries, or the push's count after its last
 * attempt publishes it (shmps_forward_pushed). */
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

/* The header of an outbox shard, by its private spec (shmps_spec_of), else NULL. */
static shmps_shard_hdr_t *outbox_hdr(void *base) {
    const shmps_spec_t *s = shmps_spec_of(base);
    return s && (s->flags & SHMPS_F_OUTBOX) ? hdr_of(base) : NULL;
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
    cas_max(&h->ob_sent_acked, ticket);
    /* A lost range is open (shmps_outbox_recover): pushes counted after its lower end
     * may be among the lost ones until it ends; shmps_outbox_settle raises ob_acked
     * past every drain before it.  seq_cst: after our write of ob_sent_acked (an empty
     * drain after the range ended sees that write: it reads ob_sent_acked after the
     * settle's seq_cst store of 0, which comes after this load in the total order), and
     * a 0 read here comes after the settle's writes of the range (its seq_cst store). */
    if (LOAD(&h->ob_lost_open, SEQ_CST)) return SHMPS_OK;
    cas_max(&h->ob_acked, pushed);
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

/* ---- landing pushes (header comment "Landing") ------------------------------------ */

/* Takes a free landing slot of h for `token` (*slot: its index), waiting at most the
 * lock bound while all are held (a dead holder's slot is freed). */
int shmps_landing_claim(shmps_shard_hdr_t *h, uint64_t token, uint8_t *slot) {
    shmps_wait_t w;
    shmps_wait_init(&w, SHMPS_LOCK_TIMEOUT_S);
    uint32_t first = (uint32_t)((token >> 32) * 0x9e3779b9u) % SHMPS_LANDING_SLOTS;
    for (;;) {
        for (uint32_t k = 0; k < SHMPS_LANDING_SLOTS; k++) {
            shmps_landing_t *l = &h->ob_landing[(first + k) % SHMPS_LANDING_SLOTS];
            uint64_t expected = 0;
            /* relaxed look (a hint), then CAS acquire: pairs with the previous holder's
             * release of the slot (shmps_outbox_landed), so its count happens-before
             * our claim and anything ordered after it (a drain or settle that reads our
             * token's release acquires that count too).  That our claim precedes our
             * value writes for a drain needs no order here: the claim is sequenced
             * before our stripe lock's release, which the drain acquires. */
            if (LOAD(&l->token, RELAXED) == 0 &&
                CAS(&l->token, &expected, token, ACQUIRE, RELAXED)) {
                *slot = (uint8_t)((first + k) % SHMPS_LANDING_SLOTS);
                return SHMPS_OK;
            }
        }
        /* every slot held (64 pushes landing at once): wait for one */
        uint64_t v = LOAD(&h->ob_landing[first].token, RELAXED);
        int r = shmps_wait_step(&w, v);
        /* relaxed: a dead holder writes nothing more (see landed_since_snap) */
        if (r == WAIT_HOLDER_DEAD) CAS(&h->ob_landing[first].token, &v, 0, RELAXED, RELAXED);
        else if (r < 0) return r;
    }
}

/* The outbox headers of the shards i in [*at_i, n) with touched[i] (touched NULL: every
 * shard), up to OB_BATCH of them, looked up together (one registry lock:
 * shmps_specs_of): idx[k] is the shard, hs[k] its header (NULL: no outbox: a NULL
 * base, an unmapped one, or a shard of another kind).  Returns how many it found, and
 * moves *at_i past the last shard it looked at.  On the stack: a push or a busy scan of
 * many shards takes one lock per OB_BATCH shards, allocating nothing (a lookup per
 * shard took the lock once each).  16: in a C loop of land + landed over 64 and 256
 * shards, batches of 8 and 16 were 10-18 % faster than a lookup per shard, batches of
 * 32 and 64 no faster or slower (their headers, each in its own segment, are walked
 * twice: looked up, then claimed); busy gains about as much at any size. */
#define OB_BATCH 16
static uint32_t outbox_hdrs(void *const *bases, uint32_t n, const uint8_t *touched,
                            uint32_t *at_i, uint32_t *idx, shmps_shard_hdr_t **hs) {
    void *b[OB_BATCH];
    const shmps_spec_t *sp[OB_BATCH];
    uint32_t m = 0, i = *at_i;
    for (; i < n && m < OB_BATCH; i++) {
        if (touched && !touched[i]) continue;
        idx[m] = i;
        b[m++] = bases[i];
    }
    *at_i = i;
    if (m == 0) return 0;
    shmps_specs_of(b, m, sp); /* a NULL base is found in no entry: NULL */
    for (uint32_t k = 0; k < m; k++)
        hs[k] = sp[k] && (sp[k]->flags & SHMPS_F_OUTBOX) ? hdr_of(b[k]) : NULL;
    return m;
}

int shmps_outbox_land(void *const *bases, uint32_t n, const uint8_t *touched,
                      uint64_t token, uint8_t *slots) {
    for (uint32_t i = 0; i < n; i++) slots[i] = SHMPS_LANDING_NONE;
    /* in increasing shard order, as every pusher: one waiting for a slot of shard i
     * holds slots of lower shards only, so no two wait for each other (the headers are
     * looked up OB_BATCH at a time, in that order too) */
    uint32_t idx[OB_BATCH];
    shmps_shard_hdr_t *hs[OB_BATCH];
    for (uint32_t i = 0; i < n;) {
        uint32_t m = outbox_hdrs(bases, n, touched, &i, idx, hs);
        for (uint32_t k = 0; k < m; k++) {
            int r = hs[k] ? shmps_landing_claim(hs[k], token, &slots[idx[k]]) : SHMPS_E_ARG;
            if (r < 0) { /* free the slots taken so far: this push writes nothing */
                shmps_outbox_landed(bases, idx[k], touched, token, slots, 0);
                for (uint32_t j = 0; j < idx[k]; j++) slots[j] = SHMPS_LANDING_NONE;
                return r;
            }
        }
    }
    return SHMPS_OK;
}

int shmps_landing_release(shmps_shard_hdr_t *h, uint64_t token, uint8_t slot, int count) {
    if (slot >= SHMPS_LANDING_SLOTS) return SHMPS_E_ARG;
    /* release: as shmps_outbox_pushed */
    if (count) FETCH_ADD(&h->ob_pushed, 1, RELEASE);
    shmps_landing_t *l = &h->ob_landing[slot];
    /* relaxed: our own claim (a slot is freed by another process only once we are
     * dead) */
    if (LOAD(&l->token, RELAXED) != token) return SHMPS_E_ARG;
    /* only the holder writes seq (relaxed load + store: plain moves).  Release, and the
     * release store of 0 after it: our count (above) happens-before the acquire load
     * that reads the new seq or the free slot (a drain's maybe_landing, a settle,
     * recover's snapshot, the next holder's claim) */
    STORE(&l->seq, LOAD(&l->seq, RELAXED) + 1, RELEASE);
    STORE(&l->token, 0, RELEASE);
    return SHMPS_OK;
}

int shmps_outbox_landed(void *const *bases, uint32_t n, const uint8_t *touched,
                        uint64_t token, const uint8_t *slots, int count) {
    int r = SHMPS_OK;
    uint32_t idx[OB_BATCH];
    shmps_shard_hdr_t *hs[OB_BATCH];
    for (uint32_t i = 0; i < n;) {
        uint32_t m = outbox_hdrs(bases, n, touched, &i, idx, hs);
        for (uint32_t k = 0; k < m; k++) {
            uint8_t slot = slots[idx[k]];
            if (slot == SHMPS_LANDING_NONE) continue; /* none claimed (land failed) */
            int ri = hs[k] ? shmps_landing_release(hs[k], token, slot, count) : SHMPS_E_ARG;
            if (ri) r = ri;
        }
    }
    return r;
}

/* After a drain took rows (P: its ob_pushed): 1 if it may hold values of a push P does
 * not count.  Such a push claimed its slot before the drain took its values (stripe
 * lock), so each load below reads its token, or a later value: a 0 or a new token,
 * after its release (a new holder's claim acquired it), ordering its count before our
 * load of ob_pushed, which then differs from P unless the count was in P. */
static int maybe_landing(shmps_shard_hdr_t *h, uint64_t P) {
    for (uint32_t i = 0; i < SHMPS_LANDING_SLOTS; i++)
        /* acquire: pairs with the slot's release stores (shmps_outbox_landed) */
        if (LOAD(&h->ob_landing[i].token, ACQUIRE)) return 1;
    /* acquire: as the drain's load of P */
    return LOAD(&h->ob_pushed, ACQUIRE) != P;
}

/* Recover's snapshot: every held slot's seq + 1, else 0. */
static void snap_landing(shmps_shard_hdr_t *h) {
    for (uint32_t i = 0; i < SHMPS_LANDING_SLOTS; i++) {
        shmps_landing_t *l = &h->ob_landing[i];
        /* acquire, both: a free slot, or a seq moved, read here orders the released
         * holder's count before recover's later load of ob_pushed */
        uint64_t tok = LOAD(&l->token, ACQUIRE);
        uint64_t snap = tok ? LOAD(&l->seq, ACQUIRE) + 1 : 0;
        /* relaxed: the snapshot is the bridge's alone (recover and its drains; one
         * bridge per store) */
        STORE(&h->ob_landing_snap[i], snap, RELAXED);
    }
}

/* 1 if every push that held a landing slot at recover's snapshot has freed it (its
 * count made) or died; the snapshot's entries found so are cleared.  A slot whose seq
 * did not move is held by the same push still (a holder adds 1 to seq before it frees
 * the slot, and a new holder can claim it only after that).  A seq read after it moved
 * at the snapshot itself makes us wait for the next holder too: later, never wrong. */
static int landed_since_snap(shmps_shard_hdr_t *h) {
    for (uint32_t i = 0; i < SHMPS_LANDING_SLOTS; i++) {
        uint64_t want = LOAD(&h->ob_landing_snap[i], RELAXED); /* the bridge's own */
        if (!want) continue;
        shmps_landing_t *l = &h->ob_landing[i];
        /* acquire, both: as in snap_landing; a new token read here is a claim that
         * acquired the snapshotted holder's release (an RMW continuing its release
         * sequence), so the seq load after it sees the moved seq */
        uint64_t tok = LOAD(&l->token, ACQUIRE);
        if (tok && LOAD(&l->seq, ACQUIRE) + 1 == want) {
            if (shmps_token_alive(tok)) return 0; /* still landing */
            /* Died landing: its push never counts, or counted before it died (a
             * process seen dead wrote everything it ever will).  Relaxed: only the
             * word's value matters. */
            CAS(&l->token, &tok, 0, RELAXED, RELAXED);
        }
        STORE(&h->ob_landing_snap[i], 0, RELAXED);
    }
    return 1;
}

uint64_t shmps_outbox_settle(shmps_shard_hdr_t *h) {
    /* relaxed look: the common case (no range open) costs one load of a line only the
     * bridge writes; recover, which opened a range, ran before in this bridge */
    if (LOAD(&h->ob_lost_open, RELAXED) != 1) return 0;
    uint64_t one = 1;
    /* seq_cst: claims the settle (1 -> 2, against a second drainer) and is ordered with
     * the ack's and empty drain's seq_cst loads of the word (2 still reads open) */
    if (!CAS(&h->ob_lost_open, &one, 2, SEQ_CST, RELAXED)) return 0;
    if (!landed_since_snap(h)) {
        STORE(&h->ob_lost_open, 1, SEQ_CST); /* seq_cst: as the CAS */
        return 0;
    }
    /* acquire: as a drain's; with the slot loads above, every push landing at the
     * snapshot is counted in P (or died) */
    uint64_t P = LOAD(&h->ob_pushed, ACQUIRE);
    /* relaxed: the bridge's words; published by the seq_cst stores below */
    uint64_t hi = LOAD(&h->ob_lost_hi, RELAXED), n = P > hi ? P - hi : 0;
    if (n) {
        FETCH_ADD(&h->ob_lost, n, RELAXED);
        STORE(&h->ob_lost_hi, P, RELAXED);
    }
    /* seq_cst, after the range's words: an ack that reads 0 raises ob_acked only after
     * them, and our raise of ob_acked publishes them to flushers (as in recover) */
    STORE(&h->ob_lost_open, 0, SEQ_CST);
    cas_max(&h->ob_acked, P);
    return n;
}

void shmps_outbox_drain_begin(shmps_shard_hdr_t *h) {
    FETCH_ADD(&h->ob_draining, 1, RELAXED);
    /* a full fence: no write of the rows this drain takes becomes visible before the
     * count above, so a bridge killed inside the drain that took anything leaves
     * ob_draining > 0 for recover (which reads it after that process ended) */
    __atomic_thread_fence(SEQ_CST);
}

void shmps_outbox_drain_end(shmps_shard_hdr_t *h) {
    /* release: this drain's ticket, ob_landing_ticket and ob_drained, all written
     * before, are visible to a recover that reads the decremented count (acquire) */
    FETCH_SUB(&h->ob_draining, 1, RELEASE);
}

/* A bridge starting on a store, before its first drain of this outbox shard: what an
 * earlier bridge process drained and did not see acknowledged, (ob_acked, ob_drained],
 * lived only in that process's frames.  The owner may have applied it (an ACK lost with
 * the process) or not; nobody can resend it.  Record the range as lost, then
 * acknowledge it, so store.flush() neither waits forever nor returns as if those pushes
 * had been applied: it reads the range and raises.  If that process may have held
 * values of a push still landing, or ended inside a drain, the range goes on up to an
 * ob_pushed read once the pushes landing now have counted (header comment, "Landing"):
 * now, or at a later drain (shmps_outbox_settle).  *lost: the pushes recorded now. */
int shmps_outbox_recover(void *base, uint64_t *lost) {
    shmps_shard_hdr_t *h = outbox_hdr(base);
    if (!h) return SHMPS_E_ARG;
    *lost = 0;
    /* The ended process's words.  seq_cst as everywhere for the tickets; acquire for
     * ob_draining: pairs with shmps_outbox_drain_end's release.  (What the process did
     * before it ended is visible to us in any case: it ended before this bridge began.) */
    uint64_t sent = LOAD(&h->ob_sent, SEQ_CST);
    uint64_t done = LOAD(&h->ob_sent_acked, SEQ_CST);
    int cut = LOAD(&h->ob_draining, ACQUIRE) != 0;
    int landing = LOAD(&h->ob_landing_ticket, SEQ_CST) > done;
    /* one bridge per store: no drain runs now, and no other writer of the bridge's
     * words (relaxed: a later drain of this bridge is ordered after us by the bridge) */
    STORE(&h->ob_draining, 0, RELAXED);
    /* the ended process's drains count as acknowledged: their rows are in the lost
     * range below, and left unacknowledged they would keep every later empty drain
     * from acknowledging */
    cas_max(&h->ob_sent_acked, sent);
    uint64_t d = LOAD(&h->ob_drained, SEQ_CST);
    uint64_t a = LOAD(&h->ob_acked, SEQ_CST);
    /* a range an earlier recover left open goes on (its bridge ended before a drain
     * ended it; ob_acked stayed at its upper end since) */
    int was_open = LOAD(&h->ob_lost_open, RELAXED) != 0;
    uint64_t lo = was_open ? LOAD(&h->ob_lost_lo, RELAXED) : a;
    uint64_t hi = d > a ? d : a;
    int open = 0;
    if (cut || landing || was_open) {
        snap_landing(h);
        if (landed_since_snap(h)) {
            /* acquire: as a drain's; every push landing at the snapshot is counted */
            uint64_t P = LOAD(&h->ob_pushed, ACQUIRE);
            if (P > hi) hi = P;
        } else {
            open = 1;
        }
    }
    if (hi == a && !open && !was_open) return SHMPS_OK;
    STORE(&h->ob_lost_lo, lo, RELAXED);
    STORE(&h->ob_lost_hi, hi, RELAXED);
    FETCH_ADD(&h->ob_lost, hi - a, RELAXED);
    /* seq_cst: acks and empty drains of this bridge read it (they come after us) */
    STORE(&h->ob_lost_open, (uint64_t)open, SEQ_CST);
    /* the seq_cst raise of ob_acked below publishes the three words above: a flusher
     * that reads the raised ob_acked (acquire) reads them too */
    cas_max(&h->ob_acked, hi);
    *lost = hi - a;
    return SHMPS_OK;
}

int shmps_outbox_lost_open(const void *base, uint32_t *open) {
    shmps_shard_hdr_t *h = outbox_hdr((void *)base);
    if (!h) return SHMPS_E_ARG;
    /* relaxed: a hint for messages and tests */
    *open = LOAD(&h->ob_lost_open, RELAXED) != 0;
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

int shmps_outbox_reject(void *base, uint64_t prev, uint64_t pushed, uint64_t *lost) {
    shmps_shard_hdr_t *h = outbox_hdr(base);
    if (!h || !lost || prev > pushed) return SHMPS_E_ARG;
    *lost = 0;
    /* relaxed: the bridge's words (one drainer and acker per shard, this thread), as in
     * shmps_outbox_drain_lost.  A range recover left open ends at an ob_pushed a later
     * drain reads (shmps_outbox_settle), past this drain's P: it counts these pushes
     * then (recorded here too, the pushes between its upper end and prev were left out
     * of the count). */
    if (LOAD(&h->ob_lost_open, RELAXED)) return SHMPS_OK;
    if (pushed == prev) {
        /* A drain whose P counts no push of its own took values of pushes counted after
         * it: a partial drain (a pusher held a stripe: P is the drain before's), or one
         * that took only a landing push's values.  The range goes on to ob_pushed now
         * (acquire, as a drain's load), which counts them unless they are still landing;
         * it may count pushes that are not lost (conservative, as recover's range). */
        pushed = LOAD(&h->ob_pushed, ACQUIRE);
    }
    /* pushes up to ob_lost_hi are in a range already (a second refused frame of the
     * same drain adds nothing) */
    uint64_t hi = LOAD(&h->ob_lost_hi, RELAXED);
    uint64_t lo = prev > hi ? prev : hi;
    if (pushed <= lo) return SHMPS_OK;
    STORE(&h->ob_lost_lo, lo, RELAXED);
    STORE(&h->ob_lost_hi, pushed, RELAXED);
    FETCH_ADD(&h->ob_lost, pushed - lo, RELAXED);
    /* Published by the ack of this drain that the caller makes next, or a later one:
     * ob_acked stays at most prev until this drain is acknowledged (its ticket is not,
     * so no empty drain or ack of an earlier drain raises it past prev; no range is
     * open, so no settle does), and every raise of ob_acked past prev comes after these
     * stores in this thread, by a seq_cst CAS; a flusher whose target is past prev reads
     * them after its acquire load of that raised ob_acked (_raise_lost). */
    *lost = pushed - lo;
    return SHMPS_OK;
}

uint64_t shmps_outbox_drained(shmps_shard_hdr_t *h, uint64_t pushed, int took,
                              int landing, uint64_t *ticket) {
    uint64_t prev = LOAD(&h->ob_drained, SEQ_CST);
    if (took) {
        /* its ticket before ob_drained: see shmps_outbox_ack (one drainer at a time) */
        *ticket = FETCH_ADD(&h->ob_sent, 1, SEQ_CST) + 1;
        /* recover reads it after this process ended (or after drain_end's release) */
        if (landing) cas_max(&h->ob_landing_ticket, *ticket);
        cas_max(&h->ob_drained, pushed);
        return prev;
    }
    *ticket = 0;
    cas_max(&h->ob_drained, pushed);
    /* Dekker with shmps_outbox_ack: we write ob_drained then read ob_sent_acked, an ack
     * writes ob_sent_acked then reads ob_drained; seq_cst: at least one sees the other,
     * so an ack racing with this empty drain cannot leave ob_acked short of it.  Not
     * while a lost range is open (shmps_outbox_ack; seq_cst as there). */
    uint64_t done = LOAD(&h->ob_sent_acked, SEQ_CST);
    if (done >= LOAD(&h->ob_sent, SEQ_CST) && !LOAD(&h->ob_lost_open, SEQ_CST))
        cas_max(&h->ob_acked, pushed);
    return prev;
}

/* A drain that failed after it took rows it cannot deliver (a table drain that met a
 * corrupt row part way: the caller raises and throws away what it took, and the rows
 * are gone from the outbox).  P: its ob_pushed, read with no pusher inside the shard,
 * so the rows it took hold pushes counted in (ob_drained, P] only: those counted up to
 * ob_drained had their rows taken by earlier drains, and those up to ob_lost_hi are in
 * a lost range already (recover ends one past ob_drained).  That range is recorded lost
 * as recover records one (a push may have had some rows taken and some left, which a
 * later drain sends: "may or may not have been applied"), and the drain then claims P
 * as an empty drain does: every push P counts is taken, lost or left for a later drain
 * (whose P counts it again), so once the drains that took rows before are acknowledged
 * ob_acked reaches P (here, or by the ack of the latest of them), and a flush waiting
 * for those pushes raises PushesLost instead of waiting or returning.  Returns the
 * pushes recorded lost.  A range recover left open stays open and grows to P (the
 * settle that ends it counts from ob_lost_hi on); a table shard never has one here (its
 * drain's settle ends it: table pushes hold no landing slot). */
uint64_t shmps_outbox_drain_lost(shmps_shard_hdr_t *h, uint64_t P) {
    /* seq_cst, as every load of ob_drained; relaxed for the range: the bridge's words
     * (one drainer per shard; recover ran before, in this bridge or an ended one) */
    uint64_t d = LOAD(&h->ob_drained, SEQ_CST);
    uint64_t hi = LOAD(&h->ob_lost_hi, RELAXED);
    uint64_t lo = d > hi ? d : hi, n = P > lo ? P - lo : 0;
    if (n) {
        /* relaxed: the bridge's word too (this drain's settle wrote it last) */
        if (!LOAD(&h->ob_lost_open, RELAXED)) STORE(&h->ob_lost_lo, lo, RELAXED);
        STORE(&h->ob_lost_hi, P, RELAXED);
        FETCH_ADD(&h->ob_lost, n, RELAXED);
    }
    /* The range's words are published by the seq_cst (release) CAS of ob_drained in
     * shmps_outbox_drained: a flusher whose target is past lo reads them after its
     * acquire load of an ob_acked raised to at least that target.  Until that CAS,
     * ob_acked is at most lo (acks and empty drains raise it to ob_drained at most,
     * recover and settle to ob_lost_hi), and every raise past lo comes after it: the
     * empty drain's own (program order), or an ack's or a later drain's, made after a
     * seq_cst load of ob_drained that reads the CAS or a later one (an RMW, continuing
     * its release sequence). */
    uint64_t ticket;
    shmps_outbox_drained(h, P, 0, 0, &ticket);
    return n;
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
                       uint64_t *prev, uint64_t *ticket, uint64_t *lost) {
    const shmps_spec_t *s = shmps_spec_of(base);
    if (!s || !(s->flags & SHMPS_F_OUTBOX) || s->kind != SHMPS_DENSE) return SHMPS_E_ARG;
    shmps_shard_hdr_t *h = hdr_of(base);
    if (cap < s->nrows) return SHMPS_E_BOUNDS;
    *n_out = 0;
    *ticket = 0;
    *lost = shmps_outbox_settle(h); /* a lost range left open by recover, if it can end */
    /* acquire: pairs with the pushers' release adds (shmps_outbox_pushed): every push
     * counted in P wrote its values and pending counts before, visible to us now */
    uint64_t P = LOAD(&h->ob_pushed, ACQUIRE);
    uint32_t slot;
    int r = shmps_enter(base, token, timeout_s, &slot); /* as a pusher */
    if (r < 0) return r;
    shmps_outbox_drain_begin(h);
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
         * and is acknowledged normally).  They may hold values of pushes the P it
         * claims does not count: for recover, a landing ticket (seq_cst, as in
         * shmps_outbox_drained). */
        if (n) {
            *ticket = FETCH_ADD(&h->ob_sent, 1, SEQ_CST) + 1;
            cas_max(&h->ob_landing_ticket, *ticket);
        }
        *pushed = *prev = LOAD(&h->ob_drained, SEQ_CST);
        shmps_outbox_drain_end(h);
        return SHMPS_DRAIN_PARTIAL;
    }
    *prev = shmps_outbox_drained(h, P, n > 0, n > 0 && maybe_landing(h, P), ticket);
    *pushed = P;
    shmps_outbox_drain_end(h);
    return SHMPS_OK;
}

int shmps_outbox_pending(const void *base, uint64_t *out, uint64_t cap) {
    const shmps_spec_t *s = shmps_spec_of(base);
    if (!s || !(s->flags & SHMPS_F_OUTBOX) || s->kind != SHMPS_DENSE) return SHMPS_E_ARG;
    if (cap < s->nrows) return SHMPS_E_BOUNDS;
    const uint64_t *pend = (const uint64_t *)((const char *)base + s->rowstep_off);
    /* relaxed: a snapshot for tests and statistics */
    for (uint64_t r = 0; r < s->nrows; r++) out[r] = LOAD(&pend[r], RELAXED);
    return SHMPS_OK;
}

/* The flush loop's test, one call over any set of outbox shards (the bridge passes
 * every shard of every forwarded tensor: outbox.BusyScan): busy[i] = 1 where outbox shard
 * bases[i] holds pushes no drain has counted yet (ob_pushed != ob_drained) or a lost
 * range recover left open (shmps_outbox_settle), else 0 (a base that is no outbox: 0).
 * *nbusy: how many are busy.  Relaxed loads suffice: this
 * is a hint, and the drain it leads to makes its own acquire load of ob_pushed, which
 * orders the pushes it takes.  A push whose release add this reads too early (not yet
 * visible) is seen by the next call, one flush interval later (or a full scan's, at most
 * 0.1 s later, if the bridge skipped the call: shmps_forward_pushed); a shard left with
 * ob_drained short of ob_pushed (a partial or timed-out drain) stays busy. */
int shmps_outbox_busy(void *const *bases, uint32_t n, uint8_t *busy, uint32_t *nbusy) {
    uint32_t nb = 0, idx[OB_BATCH];
    shmps_shard_hdr_t *hs[OB_BATCH];
    for (uint32_t i = 0; i < n;) {
        uint32_t m = outbox_hdrs(bases, n, NULL, &i, idx, hs);
        for (uint32_t k = 0; k < m; k++) {
            shmps_shard_hdr_t *h = hs[k];
            uint8_t b = h && (LOAD(&h->ob_pushed, RELAXED) != LOAD(&h->ob_drained, RELAXED) ||
                              LOAD(&h->ob_lost_open, RELAXED) || /* a drain may end the range */
                              LOAD(&h->ob_rescan, RELAXED)); /* (table) its scan frees kept keys */
            busy[idx[k]] = b;
            nb += b;
        }
    }
    *nbusy = nb;
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
    const shmps_spec_t *s = shmps_spec_of(base);
    if (!s || s->kind != SHMPS_DENSE || nstates != s->nstate) return SHMPS_E_ARG;
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
    shmps_shard_hdr_t *h = hdr_of(base);
    uint64_t *p = &h->step;
    /* a copy written row by row (shmps_dense_write_rows: a replica's, a new owner's)
     * holds values its stripes did not apply themselves */
    shmps_steps_by_ticket(h);
    /* relaxed: only atomicity matters (as shmps_next_step); a monotone max */
    uint64_t cur = LOAD(p, RELAXED);
    while (cur < step && !CAS(p, &cur, step, RELAXED, RELAXED)) {
    }
    return SHMPS_OK;
}

int shmps_count_pushes(void *base, int64_t delta) {
    /* relaxed: a statistic.  The owner's table and csr pushes count one push each in C;
     * a batch stands for `pushes` of them, or none (a later frame of one drain): the
     * caller adds the difference, which may be -1 (a modular add of its two's
     * complement: the counter only ever reads as the sum) */
    FETCH_ADD(&hdr_of(base)->stats.pushes, (uint64_t)delta, RELAXED);
    return SHMPS_OK;
}
