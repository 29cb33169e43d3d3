/* Stripe locks with seqlocks, and the per-shard freeze used for consistent copies.
 *
 * Exactness: a value is written only by the process holding its stripe's lock
 * word (owner == token), so the read-modify-write of a push on that stripe is never
 * interleaved with another push's: pushes are applied to each stripe one at a time,
 * whole, in some order.  Lock words name their holder; a holder that died is
 * replaced (CAS from its token) after its death is seen, within ~1 ms of waiting.
 *
 * Consistent shard copies: a reader sets `freeze` (exclusive: table delete/evict)
 * or one of the `readers` slots (shared: pulls and checkpoints, which may overlap)
 * to its token, then waits until no pusher holds an `active` slot.  A pusher claims a slot and then re-reads
 * `freeze`; both sides use seq_cst so that (Dekker) at least one sees the other:
 * either the pusher sees the freeze and backs out, or the reader sees the slot and
 * waits for it.  While frozen, no push is inside the shard, so the copy reflects a
 * whole number of pushes.
 */
#include "internal.h"

int shmps_stripe_trylock(shmps_stripe_t *s, uint64_t token) {
    uint64_t expected = 0;
    /* acquire: pairs with the release store of owner=0 in shmps_stripe_unlock, so
     * the previous holder's value writes happen-before ours. */
    return CAS(&s->owner, &expected, token, ACQUIRE, RELAXED);
}

int shmps_stripe_lock(shmps_stripe_t *s, uint64_t token, double timeout_s,
                      uint64_t *takeovers) {
    uint64_t was;
    return shmps_stripe_lock_was(s, token, timeout_s, takeovers, &was);
}

int shmps_stripe_lock_was(shmps_stripe_t *s, uint64_t token, double timeout_s,
                          uint64_t *takeovers, uint64_t *was) {
    shmps_wait_t w;
    shmps_wait_init(&w, timeout_s);
    for (;;) {
        /* relaxed: only a hint whether to try the CAS; the CAS orders */
        uint64_t cur = LOAD(&s->owner, RELAXED);
        if (cur == 0) {
            if (shmps_stripe_trylock(s, token)) return SHMPS_OK;
            continue;
        }
        int r = shmps_wait_step(&w, cur);
        if (r == WAIT_HOLDER_DEAD) {
            /* acquire: pairs with the dead holder's last release (if any); its
             * unfinished writes are whatever reached memory, which the seqlock
             * repair in write_begin accounts for. */
            if (CAS(&s->owner, &cur, token, ACQUIRE, RELAXED)) {
                if (takeovers) FETCH_ADD(takeovers, 1, RELAXED);
                *was = cur;
                return SHMPS_RECOVERED;
            }
        } else if (r < 0) {
            return r;
        }
    }
}

void shmps_stripe_write_begin(shmps_stripe_t *s) {
    /* We hold the lock, so only we write seq.  If a dead holder left it odd, it
     * stays odd (readers keep retrying) until our write_end makes it even. */
    uint32_t seq = LOAD(&s->seq, RELAXED);
    if (!(seq & 1)) STORE(&s->seq, seq + 1, RELAXED);
    /* release fence: the odd seq becomes visible before any of the value stores
     * that follow (pairs with the reader's acquire fence before its re-check). */
    __atomic_thread_fence(RELEASE);
}

void shmps_stripe_write_end(shmps_stripe_t *s) {
    uint32_t seq = LOAD(&s->seq, RELAXED);
    /* release: the value stores happen-before the even seq (pairs with the
     * reader's acquire load of seq at the start of its copy). */
    STORE(&s->seq, seq + 1, RELEASE);
}

void shmps_stripe_unlock(shmps_stripe_t *s) {
    /* release: pairs with the acquire CAS of the next holder */
    STORE(&s->owner, 0, RELEASE);
}

int shmps_stripe_read(shmps_stripe_t *s, uint64_t token, void *dst, const void *src,
                      size_t nbytes) {
    for (int attempt = 0; attempt < 64; attempt++) {
        /* acquire: pairs with write_end's release; values read below are at least
         * as new as that even seq. */
        uint32_t s1 = LOAD(&s->seq, ACQUIRE);
        if (s1 & 1) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
            continue;
        }
        memcpy(dst, src, nbytes);
        /* acquire fence: the copy's loads complete before the re-check below
         * (pairs with write_begin's release fence). */
        __atomic_thread_fence(ACQUIRE);
        if (LOAD(&s->seq, RELAXED) == s1) return SHMPS_OK;
    }
    /* Writers keep interfering (or one died mid-write): copy under the lock. */
    int r = shmps_stripe_lock(s, token, SHMPS_LOCK_TIMEOUT_S, NULL);
    if (r < 0) return r;
    memcpy(dst, src, nbytes);
    if (r == SHMPS_RECOVERED) {
        /* a dead writer left seq odd: close its write so readers make progress */
        uint32_t seq = LOAD(&s->seq, RELAXED);
        if (seq & 1) STORE(&s->seq, seq + 1, RELEASE);
    }
    shmps_stripe_unlock(s);
    return SHMPS_OK;
}

/* The first set word of the freeze line (exclusive freeze, then reader slots), or
 * NULL.  seq_cst loads: the pusher's half of the Dekker pair (see file comment). */
static uint64_t *frozen_by(shmps_shard_hdr_t *h, uint64_t *holder) {
    uint64_t v = LOAD(&h->freeze, SEQ_CST);
    if (v) { *holder = v; return &h->freeze; }
    for (uint32_t i = 0; i < SHMPS_READERS; i++) {
        v = LOAD(&h->readers[i], SEQ_CST);
        if (v) { *holder = v; return &h->readers[i]; }
    }
    return NULL;
}

/* Frees the active slot of pusher `v`, seen dead.  A table outbox push it left half
 * done may have pushed to rows it did not list for the drain yet (table.c "Outbox
 * drains"): first ob_rescan = 1, so the next drain looks at every row.  Seq_cst, before
 * the slot's clearing CAS: a drain's freeze reads every slot free (seq_cst loads) after
 * that CAS, and then reads ob_rescan (seq_cst), so it sees the 1.  (The private spec:
 * shmps_spec_of.) */
static void clear_dead_pusher(shmps_shard_hdr_t *h, uint64_t *slot, uint64_t v) {
    const shmps_spec_t *s = shmps_spec_of(h);
    if (s && s->kind == SHMPS_TABLE && (s->flags & SHMPS_F_OUTBOX))
        STORE(&h->ob_rescan, 1, SEQ_CST);
    CAS(slot, &v, 0, SEQ_CST, RELAXED);
}

/* Waits until no pusher holds an active slot (dead pushers' slots are cleared). */
static int drain_pushers(shmps_shard_hdr_t *h, double timeout_s) {
    for (uint32_t i = 0; i < SHMPS_ACTIVE_SLOTS; i++) {
        shmps_wait_t ws;
        shmps_wait_init(&ws, timeout_s);
        for (;;) {
            /* seq_cst: other half of the Dekker pair (see file comment) */
            uint64_t v = LOAD(&h->active[i], SEQ_CST);
            if (v == 0) break;
            int r = shmps_wait_step(&ws, v);
            if (r == WAIT_HOLDER_DEAD) clear_dead_pusher(h, &h->active[i], v);
            else if (r < 0) return r;
        }
    }
    return SHMPS_OK;
}

int shmps_freeze_shared(void *base, uint64_t token, double timeout_s) {
    shmps_shard_hdr_t *h = hdr_of(base);
    shmps_wait_t w;
    shmps_wait_init(&w, timeout_s);
    uint32_t first = (uint32_t)((token >> 32) * 0x9e3779b9u) % SHMPS_READERS;
    for (;;) {
        uint64_t f = LOAD(&h->freeze, SEQ_CST);
        if (f) { /* an exclusive freezer (table delete/evict) goes first */
            int r = shmps_wait_step(&w, f);
            if (r == WAIT_HOLDER_DEAD) CAS(&h->freeze, &f, 0, SEQ_CST, RELAXED);
            else if (r < 0) return r;
            continue;
        }
        int got = -1;
        for (uint32_t k = 0; k < SHMPS_READERS && got < 0; k++) {
            uint32_t i = (first + k) % SHMPS_READERS;
            uint64_t expected = 0;
            /* seq_cst: Dekker pair with enter()'s slot CAS + freeze-line loads, and
             * with an exclusive freezer's CAS + reader-slot loads */
            if (CAS(&h->readers[i], &expected, token, SEQ_CST, RELAXED)) got = (int)i;
        }
        if (got < 0) { /* 7 readers already: wait for one (or clear a dead one) */
            uint64_t v = LOAD(&h->readers[first], RELAXED);
            int r = shmps_wait_step(&w, v);
            if (r == WAIT_HOLDER_DEAD) CAS(&h->readers[first], &v, 0, SEQ_CST, RELAXED);
            else if (r < 0) return r;
            continue;
        }
        if (LOAD(&h->freeze, SEQ_CST)) { /* an exclusive freezer came in: let it go */
            STORE(&h->readers[got], 0, SEQ_CST);
            continue;
        }
        int r = drain_pushers(h, timeout_s);
        if (r < 0) STORE(&h->readers[got], 0, SEQ_CST);
        return r;
    }
}

int shmps_thaw_shared(void *base, uint64_t token) {
    shmps_shard_hdr_t *h = hdr_of(base);
    for (uint32_t i = 0; i < SHMPS_READERS; i++) {
        uint64_t cur = token;
        /* release: our reads of the shard happen-before pushers that enter after.
         * Two threads of one process share a token: clearing either slot is the same. */
        if (CAS(&h->readers[i], &cur, 0, RELEASE, RELAXED)) return SHMPS_OK;
    }
    return SHMPS_E_ARG;
}

int shmps_freeze(void *base, uint64_t token, double timeout_s) {
    shmps_shard_hdr_t *h = hdr_of(base);
    shmps_wait_t w;
    shmps_wait_init(&w, timeout_s);
    /* 1. take the freeze word (one consistent reader per shard at a time) */
    for (;;) {
        uint64_t cur = 0;
        /* seq_cst: the Dekker pair with enter()'s slot CAS + freeze load */
        if (CAS(&h->freeze, &cur, token, SEQ_CST, SEQ_CST)) break;
        int r = shmps_wait_step(&w, cur);
        if (r == WAIT_HOLDER_DEAD) {
            CAS(&h->freeze, &cur, 0, SEQ_CST, RELAXED); /* clear a dead reader's */
        } else if (r < 0) {
            return r;
        }
    }
    /* 2. wait for shared readers already inside, then for the pushers */
    for (uint32_t i = 0; i < SHMPS_READERS; i++) {
        shmps_wait_t ws;
        shmps_wait_init(&ws, timeout_s);
        for (;;) {
            uint64_t v = LOAD(&h->readers[i], SEQ_CST);
            if (v == 0) break;
            int r = shmps_wait_step(&ws, v);
            if (r == WAIT_HOLDER_DEAD) {
                CAS(&h->readers[i], &v, 0, SEQ_CST, RELAXED); /* dead reader's slot */
            } else if (r < 0) {
                STORE(&h->freeze, 0, SEQ_CST);
                return r;
            }
        }
    }
    int r = drain_pushers(h, timeout_s);
    if (r < 0) STORE(&h->freeze, 0, SEQ_CST);
    return r;
}

int shmps_thaw(void *base, uint64_t token) {
    shmps_shard_hdr_t *h = hdr_of(base);
    uint64_t cur = token;
    /* release: our reads of the shard happen-before pushers that enter after */
    if (!CAS(&h->freeze, &cur, 0, RELEASE, RELAXED)) return SHMPS_E_ARG;
    return SHMPS_OK;
}

int shmps_enter(void *base, uint64_t token, double timeout_s, uint32_t *slot) {
    shmps_shard_hdr_t *h = hdr_of(base);
    shmps_wait_t w;
    shmps_wait_init(&w, timeout_s);
    uint32_t first = (uint32_t)((token >> 32) * 0x9e3779b9u) % SHMPS_ACTIVE_SLOTS;
    for (;;) {
        uint64_t f = 0, *fw = frozen_by(h, &f);
        if (fw) {
            int r = shmps_wait_step(&w, f);
            if (r == WAIT_HOLDER_DEAD) CAS(fw, &f, 0, SEQ_CST, RELAXED);
            else if (r < 0) return r;
            continue;
        }
        int got = -1;
        for (uint32_t k = 0; k < SHMPS_ACTIVE_SLOTS && got < 0; k++) {
            uint32_t i = (first + k) % SHMPS_ACTIVE_SLOTS;
            uint64_t expected = 0;
            if (LOAD(&h->active[i], RELAXED) == 0 &&
                CAS(&h->active[i], &expected, token, SEQ_CST, RELAXED))
                got = (int)i;
        }
        if (got < 0) { /* all slots busy: wait on one of them */
            uint64_t v = LOAD(&h->active[first], RELAXED);
            int r = shmps_wait_step(&w, v);
            if (r == WAIT_HOLDER_DEAD) clear_dead_pusher(h, &h->active[first], v);
            else if (r < 0) return r;
            continue;
        }
        /* seq_cst re-check (Dekker): a reader that froze after our first look
         * either sees our slot and waits, or we see its freeze here and back out. */
        uint64_t f2 = 0;
        if (frozen_by(h, &f2) != NULL) {
            STORE(&h->active[got], 0, SEQ_CST);
            continue;
        }
        *slot = (uint32_t)got;
        return SHMPS_OK;
    }
}

int shmps_leave(void *base, uint64_t token, uint32_t slot) {
    shmps_shard_hdr_t *h = hdr_of(base);
    if (slot >= SHMPS_ACTIVE_SLOTS) return SHMPS_E_BOUNDS;
    uint64_t cur = token;
    /* release: our value writes happen-before a reader that sees the slot free */
    if (!CAS(&h->active[slot], &cur, 0, RELEASE, RELAXED)) return SHMPS_E_ARG;
    return SHMPS_OK;
}

/* Records this pusher and says whether another process started a push within
 * window_ns: then the cores are shared already and a push should not be split into
 * threads.  Relaxed and racy on purpose: a heuristic, never a correctness input. */
int shmps_note_pusher(void *base, uint64_t token, uint64_t window_ns, uint32_t *others) {
    shmps_shard_hdr_t *h = hdr_of(base);
    uint64_t now = shmps_now_ns();
    uint64_t prev = LOAD(&h->last_pusher, RELAXED);
    uint64_t prev_ns = LOAD(&h->last_pusher_ns, RELAXED);
    *others = prev != 0 && prev != token && now - prev_ns < window_ns;
    if (prev != token) STORE(&h->last_pusher, token, RELAXED);
    STORE(&h->last_pusher_ns, now, RELAXED);
    return SHMPS_OK;
}

int shmps_no_pusher_inside(const shmps_shard_hdr_t *h) {
    for (uint32_t i = 0; i < SHMPS_ACTIVE_SLOTS; i++)
        /* seq_cst, as the freeze's loads (drain_pushers): each reads a pusher's claim,
         * or its release in shmps_leave (and what it did before), or a later value */
        if (LOAD(&h->active[i], SEQ_CST)) return 0;
    return 1;
}

int shmps_active_pushers(const void *base, uint32_t *n) {
    const shmps_shard_hdr_t *h = (const shmps_shard_hdr_t *)base;
    uint32_t c = 0;
    for (uint32_t i = 0; i < SHMPS_ACTIVE_SLOTS; i++)
        c += LOAD(&h->active[i], RELAXED) != 0; /* a snapshot for heuristics only */
    *n = c;
    return SHMPS_OK;
}
