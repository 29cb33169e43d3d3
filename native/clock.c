/* Worker clocks: bounded-delay consistency across the processes of one job.
 *
 * Each worker owns a slot in the manifest {token, clock}.  clock() advances the
 * caller's clock and returns once no live worker's clock is more than `staleness`
 * behind the new value (staleness 0: a barrier per clock; -1: eventual, never waits).
 * Waiting sleeps on a futex word (`clock_seq`) that every clock advance, leave and
 * drop bumps and wakes; every wake-up (and at least every 2 ms) the waiter checks the
 * slowest worker's liveness and drops a dead one (CAS its token to 0), so a dead
 * worker never blocks the others for more than a few milliseconds.
 */
#include "internal.h"
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static shmps_manifest_t *man(void *base) { return (shmps_manifest_t *)base; }
static worker_slot_t *slots(void *base) { return (worker_slot_t *)at(base, WORKERS_OFF); }

/* The futex word lives in a MAP_SHARED segment: use the shared (non-private) ops. */
static void wake_all(void *base) {
    uint32_t *seq = &man(base)->clock_seq;
    /* release: our clock/slot store happens-before a woken waiter's scan (which
     * starts with an acquire load of clock_seq) */
    FETCH_ADD(seq, 1, RELEASE);
    syscall(SYS_futex, seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void sleep_on(void *base, uint32_t seen, uint64_t max_ns) {
    struct timespec ts = {(time_t)(max_ns / 1000000000ull), (long)(max_ns % 1000000000ull)};
    /* returns at once if clock_seq != seen (a change we must look at) */
    syscall(SYS_futex, &man(base)->clock_seq, FUTEX_WAIT, seen, &ts, NULL, 0);
}

/* Minimum clock over the slots that hold a token, live or not (live_min_clock drops
 * the dead).  *slowest gets the slot index with that clock, or -1 if there are no
 * workers. */
static uint64_t min_clock(void *base, int32_t *slowest) {
    worker_slot_t *w = slots(base);
    uint64_t best = UINT64_MAX;
    *slowest = -1;
    for (uint32_t i = 0; i < SHMPS_MAX_WORKERS; i++) {
        uint64_t tok = LOAD(&w[i].token, ACQUIRE); /* pairs with join's release */
        if (!tok) continue;
        uint64_t c = LOAD(&w[i].clock, ACQUIRE);   /* pairs with clock()'s release */
        if (c < best) { best = c; *slowest = (int32_t)i; }
    }
    return best;
}

/* Minimum clock over live workers: a dead slowest worker is dropped (CAS of its token
 * to 0, so a slot that changed hands meanwhile is left alone) and the scan repeated.
 * Checking liveness costs a /proc read, so only the slowest is checked. */
static uint64_t live_min_clock(void *base, int32_t *slowest) {
    for (;;) {
        uint64_t m = min_clock(base, slowest);
        if (*slowest < 0) return m;
        /* acquire: pairs with join's release CAS, as in min_clock */
        uint64_t tok = LOAD(&slots(base)[*slowest].token, ACQUIRE);
        if (tok && shmps_token_alive(tok)) return m;
        if (tok) {
            CAS(&slots(base)[*slowest].token, &tok, 0, ACQ_REL, RELAXED);
            wake_all(base);   /* the minimum may have moved for the waiters too */
        }                     /* (0: it left after the scan) look again */
    }
}

int shmps_set_staleness(void *base, int64_t staleness) {
    if (staleness < -1) return SHMPS_E_ARG;
    STORE(&man(base)->staleness, staleness, RELEASE);
    wake_all(base); /* waiters re-evaluate under the new bound */
    return SHMPS_OK;
}

int64_t shmps_get_staleness(const void *base) {
    return LOAD(&((const shmps_manifest_t *)base)->staleness, ACQUIRE);
}

int shmps_worker_join(void *base, uint64_t token, int32_t want, uint32_t *slot,
                      uint64_t *clock) {
    worker_slot_t *w = slots(base);
    int32_t slowest;
    uint64_t start = live_min_clock(base, &slowest);
    if (slowest < 0) start = 0;
    uint32_t lo = 0, hi = SHMPS_MAX_WORKERS;
    if (want >= 0) {
        if ((uint32_t)want >= SHMPS_MAX_WORKERS) return SHMPS_E_BOUNDS;
        lo = (uint32_t)want, hi = lo + 1;
    }
    for (int pass = 0; pass < 2; pass++) {
        for (uint32_t i = lo; i < hi; i++) {
            uint64_t cur = LOAD(&w[i].token, RELAXED);
            if (cur == token) return SHMPS_E_ARG; /* this process already holds it */
            if (cur != 0 && (pass == 0 || shmps_token_alive(cur))) continue;
            /* Claim the slot, then set its clock (release: pairs with min_clock's
             * acquire).  Until then a scanner may see the previous occupant's
             * clock, which only makes waiters wait until our wake_all below. */
            if (CAS(&w[i].token, &cur, token, ACQ_REL, RELAXED)) {
                STORE(&w[i].clock, start, RELEASE);
                w[i].joined_ns = shmps_now_ns();
                *slot = i;
                *clock = start;
                wake_all(base);
                return SHMPS_OK;
            }
        }
    }
    return want >= 0 ? SHMPS_E_ARG : SHMPS_E_FULL;
}

int shmps_worker_leave(void *base, uint64_t token, uint32_t slot) {
    if (slot >= SHMPS_MAX_WORKERS) return SHMPS_E_BOUNDS;
    uint64_t cur = token;
    if (!CAS(&slots(base)[slot].token, &cur, 0, RELEASE, RELAXED)) return SHMPS_E_ARG;
    wake_all(base); /* the minimum may have moved */
    return SHMPS_OK;
}

int shmps_worker_wait(void *base, uint64_t target, int64_t staleness, double timeout_s,
                      int32_t *behind) {
    *behind = -1;
    if (staleness < 0) return SHMPS_OK;
    uint64_t need = target > (uint64_t)staleness ? target - (uint64_t)staleness : 0;
    uint64_t deadline = timeout_s < 0 ? UINT64_MAX : shmps_now_ns() + (uint64_t)(timeout_s * 1e9);
    for (;;) {
        /* acquire: pairs with wake_all's release; a change after this load makes
         * the futex wait below return at once */
        uint32_t seen = LOAD(&man(base)->clock_seq, ACQUIRE);
        int32_t slowest;
        uint64_t m = min_clock(base, &slowest);
        if (slowest < 0 || m >= need) return SHMPS_OK;
        /* a dead worker never blocks: dropped here (only when it is behind) */
        m = live_min_clock(base, &slowest);
        if (slowest < 0 || m >= need) return SHMPS_OK;
        uint64_t now = shmps_now_ns();
        if (now >= deadline) { *behind = slowest; return SHMPS_E_TIMEOUT; }
        uint64_t nap = deadline - now < 2000000ull ? deadline - now : 2000000ull;
        sleep_on(base, seen, nap);
    }
}

int shmps_worker_clock(void *base, uint64_t token, uint32_t slot, double timeout_s,
                       uint64_t *clock, int32_t *behind) {
    if (slot >= SHMPS_MAX_WORKERS) return SHMPS_E_BOUNDS;
    worker_slot_t *w = &slots(base)[slot];
    if (LOAD(&w->token, RELAXED) != token) return SHMPS_E_ARG; /* dropped or not ours */
    uint64_t c = LOAD(&w->clock, RELAXED) + 1; /* only the owner writes its clock */
    /* release: pushes made before clock() happen-before a waiter that sees c */
    STORE(&w->clock, c, RELEASE);
    wake_all(base);
    *clock = c;
    return shmps_worker_wait(base, c, shmps_get_staleness(base), timeout_s, behind);
}

int shmps_worker_list(void *base, uint64_t *tokens, uint64_t *clocks, uint32_t cap) {
    worker_slot_t *w = slots(base);
    for (uint32_t i = 0; i < SHMPS_MAX_WORKERS && i < cap; i++) {
        tokens[i] = LOAD(&w[i].token, ACQUIRE);
        clocks[i] = LOAD(&w[i].clock, ACQUIRE);
    }
    return SHMPS_OK;
}
