/* Synchronous aggregation: the bookkeeping of rounds (one round per worker clock).
 *
 * A tensor created with aggregate="sum"|"mean" and workers=N collects the pushes of
 * one clock from every live worker in an accumulator (a hidden Sum tensor per
 * buffer; the arithmetic is the ordinary exact dense push) and applies its updater
 * once with the aggregate.  This file keeps the control block that decides who
 * contributes to which round, when a round is complete, and who applies it.  The
 * values themselves never pass through here: Python pushes into the accumulator,
 * reads it back, pushes the aggregate into the tensor and zeroes the accumulator,
 * each step announced here first (phases) so a process killed at any instant
 * leaves a state the next caller can finish.
 *
 * The control block lives in the value array of a hidden int32 dense tensor
 * (zero-initialised, so "never used" is all zeros); every function validates that
 * shard before touching it.
 *
 * Rounds.  A push by worker slot w carries w's clock c (read here from the
 * manifest): it contributes to round c, collected in buffer c % 2.  Rounds are
 * applied in order; `next_round` is the oldest round not yet applied.  A push for
 * round c < next_round is refused (CLOSED: the round was applied without it); a
 * push for c >= next_round + 2 must wait (AHEAD: its buffer still holds round
 * c - 2), so pushes for clock c + 1 never mix into round c (double buffering by
 * clock parity, at most two rounds in flight).
 *
 * Round r is complete when every joined worker slot w is covered:
 *   - w contributed to r (its bit is set), or
 *   - w's clock is past r and no push of w for r is in flight (it moved on
 *     without pushing), or
 *   - w's process is dead (a dead worker counts as left at once; the clock code
 *     drops it from the slots within milliseconds),
 * no live process that left has a push for r in flight, and the team has
 * assembled: N workers have been seen joined (or N contributed).  Until then a
 * push waits (ASSEMBLING, shmps_agg_assemble): a worker that starts early
 * neither makes a round alone nor runs ahead, so the others join at its clock (a
 * new worker starts at the slowest live worker's clock).  A complete round with
 * contributors is applied by the first process that looks (normally the last
 * pusher); a complete round with none is skipped.
 *
 * Locking.  One lock word (a stripe lock: owner token, dead owners taken over)
 * guards every field except `seq` (futex word) and the lock-free reads of
 * `next_round` by waiters.  Each critical section orders its stores so that a
 * holder killed in the middle leaves a state that is still valid:
 *   begin:  clear the buffer's bits and in-flight tokens, then set its round;
 *   commit: set the contribution bit, then clear the in-flight token;
 *   claim:  phase and count, then claim_round, then applier (the claim is valid
 *           only while applier != 0 and claim_round == next_round);
 *   finish: next_round = r + 1 is the commit point; clearing applier follows.
 * "Then" is kept by the compiler too: the fields whose order matters are written
 * with relaxed atomic stores and each step ends with CRASH_ORDER(), a compiler-only
 * fence (a SIGKILL stops the process at an instruction boundary, so what the next
 * lock holder finds is the stores the instructions before it made; with plain stores
 * the compiler could have merged or reordered them).  Relaxed suffices between
 * processes: the lock's release/acquire (or its takeover CAS, acquire, after the
 * holder's death) orders all of them before the next holder's reads.
 * A dead applier's claim (or one released on an error, shmps_agg_release: its applier
 * is then a token no process has) is taken over according to its phase: SUM (nothing
 * written to the tensor yet) restarts the round, PUSHING (the aggregate was being
 * pushed, at the ticket recorded in push_step before any stripe was written:
 * shmps_agg_pushing) finishes the push on the stripes the dead applier did not reach
 * (each stripe keeps the step it last applied a push at, dense.c "Stripe steps"; the
 * stripe it was writing keeps the part it wrote, possibly none, as any push cut by a
 * kill), then zeroes the buffer;
 * ZEROING goes on with zeroing the buffer.  A PUSHING claim without push_step (set
 * with shmps_agg_phase, by a build before 2026-11-28) is taken over as ZEROING: the
 * round is applied on the stripes the dead process reached only.  The resume's test
 * (a stripe has the round if its step is the ticket or later) holds only if nothing
 * else moves a stripe past the ticket: pushes to the tensor by another path (the
 * bridge's direct applies) are bracketed by shmps_agg_foreign, and a round takes its
 * ticket and enters PUSHING only while none is in flight, and none starts while a
 * round is in PUSHING (it is refused BUSY, or finishes a dead applier's round first),
 * nor while a live process's round waits to take its ticket (round_waits).  The
 * round's push counts once in the tensor's statistics, by whoever ends PUSHING
 * (shmps_agg_pushed, `counted`).
 *
 * Closing.  A round is closed to new pushes from its claim on (begin: CLAIMED, then
 * CLOSED once applied): a worker that joined after the claim starts at the round's
 * clock, and its push, added to the accumulator the applier had read (or would read
 * again in a resume), was lost with the zeroing or pushed to part of the stripes.
 *
 * Restored stores.  Round numbers are worker clocks, which belong to one manifest.
 * The control block is stamped with its manifest's creation time; a block carried
 * into another manifest (a checkpoint restored) is STALE: pushes refuse it until
 * one process has reset it (shmps_agg_reset: claim, clear the accumulators, finish),
 * and rounds then start again from the new workers' clocks.  The pushes of a round
 * left unfinished in the checkpoint are dropped with the accumulators.
 */
#include "internal.h"
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define AGG_MAGIC 0x4c54434741504853ull /* "SHPAGCTL" little-endian */
#define AGG_VERSION 1u
#define AGG_WORDS (SHMPS_MAX_WORKERS / 64)
#define AGG_FOREIGN 64     /* processes pushing to the tensor by another path at once */
#define AGG_RELEASED 1ull  /* applier of a claim given up on an error: pid 0, no process */
#define NAP_NS 2000000ull /* waiters re-check liveness and clocks every 2 ms */
/* The compiler emits no store after it before any store ahead of it (C11's fence for
 * a signal in the same thread, which is what a kill at any instant is to the crash
 * order of the file comment); no instruction, the CPU's own order of stores across a
 * kill is the instruction order. */
#define CRASH_ORDER() __atomic_signal_fence(__ATOMIC_SEQ_CST)

/* Test-only kill points: the crash tests of tests/test_aggregate.py start a process
 * with SHMPS_TEST_KILL_AT=<name> in its environment, and it SIGKILLs itself at that
 * point, between two stores whose order a kill relies on (names below).  Read once, as
 * the library is loaded (a constructor: before any thread of it runs, so a plain int);
 * otherwise a point is a load and a compare, and none is on a hot path (they are per
 * round, or per push by another path).  A point is a call: the compiler completes the
 * stores before it, and moves none after it above it. */
enum { KILL_NONE, KILL_FOREIGN_TOKEN, KILL_COUNTED, KILL_COUNT };
static int kill_at;

__attribute__((constructor)) static void kill_point_from_env(void) {
    static const char *const names[] = {"", "foreign-token", "pushed-counted", "pushed-count"};
    const char *s = getenv("SHMPS_TEST_KILL_AT");
    for (int i = 1; s && i < (int)(sizeof names / sizeof *names); i++)
        if (!strcmp(s, names[i])) kill_at = i;
}

#define KILL_POINT(p)                                                              \
    do {                                                                           \
        if (__builtin_expect(kill_at == (p), 0)) kill(getpid(), SIGKILL);         \
    } while (0)

typedef struct {
    uint64_t round;                    /* round collected here; stale if < next_round */
    uint64_t bits[AGG_WORDS];          /* worker slots that contributed */
    uint64_t pend[SHMPS_MAX_WORKERS];  /* token of a slot's push in flight, else 0 */
} agg_buf_t;

/* A process's pushes to the tensor by another path (the bridge's direct applies) in
 * flight: token 0 = a free entry; a dead token's entry is free too. */
typedef struct {
    uint64_t token, count;
} agg_foreign_t;

typedef struct {
    uint64_t magic;       /* AGG_MAGIC once next_round is set (all zero before) */
    uint32_t version, pad0;
    shmps_stripe_t lock;  /* guards every field below except seq */
    uint32_t seq;         /* futex word: bumped on commit, finish and skip */
    uint32_t assembled;   /* sticky: N workers were seen joined (or contributed); written
                           * under the lock with atomic stores (set_assembled), read
                           * without it by shmps_agg_assemble and shmps_agg_info */
    uint64_t next_round;  /* oldest round not yet applied */
    uint64_t applier;     /* token applying claim_round, 0 = none */
    uint64_t claim_round;
    uint32_t phase, count;
    uint64_t applied, skipped, takeovers;
    uint64_t stamp;       /* created_ns of the manifest the rounds belong to */
    uint64_t resetter;    /* token resetting a stale block, 0 = none */
    agg_buf_t buf[2];
    uint64_t push_step;   /* the ticket of the claimed round's push (PUSHING), 0 = none */
    uint64_t counted;     /* r + 1 once round r's push was counted in the tensor's pushes */
    agg_foreign_t foreign[AGG_FOREIGN]; /* pushes by another path in flight, per process */
    uint64_t waiter;      /* the round waiting: its applier's token, 0 = none (round_waits) */
    uint64_t wait_until;  /* ... until then (shmps_now_ns; the waiter's own deadline) */
    uint64_t push_base;   /* the tensor's pushes statistic as the round entered PUSHING */
} agg_ctl_t;

_Static_assert(sizeof(agg_ctl_t) <= SHMPS_AGG_CTL_BYTES, "aggregation control block");

/* The control block inside a hidden int32 dense shard, or NULL if the shard
 * cannot hold one (not ours, or too small). */
static agg_ctl_t *ctl_of(void *base) {
    const shmps_spec_t *s = shmps_spec_of(base);
    if (!s || s->kind != SHMPS_DENSE || s->dtype != SHMPS_INT32 ||
        s->nnz * 4 < (uint64_t)SHMPS_AGG_CTL_BYTES || (s->value_off & 63))
        return NULL;
    return (agg_ctl_t *)at(base, s->value_off);
}

static worker_slot_t *wslots(void *man) { return (worker_slot_t *)at(man, WORKERS_OFF); }

static uint64_t man_stamp(void *man) { return ((shmps_manifest_t *)man)->created_ns; }

/* Rounds were begun under another manifest (a restored checkpoint). */
static int stale(agg_ctl_t *c, void *man) {
    return LOAD(&c->magic, ACQUIRE) == AGG_MAGIC && c->stamp != man_stamp(man);
}

static int bit_get(const agg_buf_t *b, uint32_t i) { return (b->bits[i >> 6] >> (i & 63)) & 1; }

static uint32_t popcount(const agg_buf_t *b) {
    uint32_t n = 0;
    for (uint32_t k = 0; k < AGG_WORDS; k++) n += (uint32_t)__builtin_popcountll(b->bits[k]);
    return n;
}

static void wake(agg_ctl_t *c) {
    /* release: the state change made before this bump happens-before a waiter's
     * re-check (which starts with an acquire load of seq) */
    FETCH_ADD(&c->seq, 1, RELEASE);
    syscall(SYS_futex, &c->seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* The deadline of a wait of timeout_s seconds (< 0: none). */
static uint64_t deadline_of(double timeout_s) {
    return timeout_s < 0 ? UINT64_MAX : shmps_now_ns() + (uint64_t)(timeout_s * 1e9);
}

/* Sleep on futex word `word` while it reads `seen` (the caller loaded it, acquire,
 * before looking at what it waits for: a change made after that look bumps the word
 * first, and the wait returns at once), at most NAP_NS (waiters look again that often:
 * a process that dies wakes nobody) and not past `deadline`.  SHMPS_E_TIMEOUT once the
 * deadline has passed (no sleep), else SHMPS_OK: look again. */
static int nap(uint32_t *word, uint32_t seen, uint64_t deadline) {
    uint64_t now = shmps_now_ns();
    if (now >= deadline) return SHMPS_E_TIMEOUT;
    uint64_t ns = deadline - now < NAP_NS ? deadline - now : NAP_NS;
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, NULL, 0);
    return SHMPS_OK;
}

static int lock(agg_ctl_t *c, uint64_t token) {
    /* RECOVERED (a holder died inside) needs no repair: see the store orders above */
    int r = shmps_stripe_lock(&c->lock, token, SHMPS_LOCK_TIMEOUT_S, &c->takeovers);
    return r < 0 ? r : SHMPS_OK;
}

static void unlock(agg_ctl_t *c) { shmps_stripe_unlock(&c->lock); }

/* The team has assembled (lock held).  An atomic store, as shmps_agg_assemble reads the
 * flag without the lock; relaxed: the flag orders no other data for that reader (it
 * only stops waiting, and begin looks again under the lock), and holders of the lock
 * get it through the lock's release/acquire. */
static void set_assembled(agg_ctl_t *c) { STORE(&c->assembled, 1, RELAXED); }

/* Joined slots: count them (dead ones included until dropped) for the assembly
 * gate; *minclock is the smallest clock among them (UINT64_MAX if none). */
static uint32_t joined(void *man, uint64_t *minclock) {
    worker_slot_t *w = wslots(man);
    uint32_t n = 0;
    *minclock = UINT64_MAX;
    for (uint32_t i = 0; i < SHMPS_MAX_WORKERS; i++) {
        if (!LOAD(&w[i].token, ACQUIRE)) continue; /* pairs with join's CAS */
        uint64_t clk = LOAD(&w[i].clock, ACQUIRE); /* pairs with clock()'s release */
        if (clk < *minclock) *minclock = clk;
        n++;
    }
    return n;
}

/* Is round r complete?  (Caller holds the lock.)  Returns 1 if every joined slot
 * is covered (see the top of the file), else 0 with *behind = the first live
 * slot that is not.  *passed counts slots whose clock is past r without a push in
 * flight, *njoined the joined slots. */
static int complete(agg_ctl_t *c, void *man, uint64_t r, int32_t *behind, uint32_t *passed,
                    uint32_t *njoined) {
    agg_buf_t *b = &c->buf[r & 1];
    int active = b->round == r;
    worker_slot_t *w = wslots(man);
    *passed = *njoined = 0;
    for (uint32_t i = 0; i < SHMPS_MAX_WORKERS; i++) {
        uint64_t tok = LOAD(&w[i].token, ACQUIRE); /* pairs with join's CAS */
        if (!tok) continue;
        (*njoined)++;
        if (active && bit_get(b, i)) continue;
        /* acquire: pairs with clock()'s release store, so a slot seen past r has
         * finished (committed or never begun) every push it made before clock() */
        uint64_t clk = LOAD(&w[i].clock, ACQUIRE);
        uint64_t inflight = active ? b->pend[i] : 0;
        if (clk > r && inflight != tok) { (*passed)++; continue; }
        if (!shmps_token_alive(tok)) continue; /* dead: counts as left */
        *behind = (int32_t)i;
        return 0;
    }
    if (active) {
        /* a push still in flight from a worker that left meanwhile (leave() with a
         * non-blocking push pending) must land before the round is applied */
        for (uint32_t i = 0; i < SHMPS_MAX_WORKERS; i++) {
            uint64_t p = b->pend[i];
            if (p && LOAD(&w[i].token, ACQUIRE) != p && shmps_token_alive(p)) {
                *behind = (int32_t)i;
                return 0;
            }
        }
    }
    return 1;
}

/* The state machine's step (lock held): finish a dead claim, skip empty complete
 * rounds, claim a complete one.  what: AGG_NOTHING (*behind says who is awaited:
 * a slot, -1 for "fewer than N joined"), AGG_BUSY (a live process applies
 * *round), AGG_APPLY (claimed for `token` when claim != 0: apply *round with
 * *count contributors starting at *phase). */
static void step(agg_ctl_t *c, void *man, uint64_t token, uint32_t want, int claim,
                 uint32_t *what, uint64_t *round, uint32_t *count, uint32_t *phase,
                 int32_t *behind) {
    *what = SHMPS_AGG_NOTHING;
    *behind = -1;
    *count = 0;
    *phase = 0;
    /* relaxed: under the lock, and every store of magic (begin's and reset's, release
     * for the readers without the lock) is made holding it: the lock's acquire orders
     * it, and the fields begin set before it, before our reads */
    if (LOAD(&c->magic, RELAXED) != AGG_MAGIC || stale(c, man)) return; /* no rounds */
    for (;;) {
        uint64_t r = c->next_round;
        *round = r;
        if (c->applier && c->claim_round == r) {
            if (c->applier != token && shmps_token_alive(c->applier)) {
                *what = SHMPS_AGG_BUSY;
                return;
            }
            /* a dead applier, a claim released on an error (AGG_RELEASED), or our own
             * claim, left by an exception before its release: go on; PUSHING
             * with its ticket recorded is finished (resumed), without it cleared */
            uint32_t ph = c->phase;
            if (ph == SHMPS_AGG_PH_PUSHING && !LOAD(&c->push_step, RELAXED))
                ph = SHMPS_AGG_PH_ZEROING;
            *what = SHMPS_AGG_APPLY;
            *count = c->count;
            *phase = ph;
            if (claim && c->applier != token) {
                /* either order leaves a valid claim (a PUSHING phase is finished again
                 * by whoever takes it over next: stripes that have the push are
                 * skipped): relaxed, as the claim below */
                STORE(&c->phase, ph, RELAXED);
                STORE(&c->applier, token, RELAXED);
                c->takeovers++;
            }
            return;
        }
        uint32_t passed, njoined;
        int ok = complete(c, man, r, behind, &passed, &njoined);
        if (njoined >= want) set_assembled(c);
        if (!ok) return;
        agg_buf_t *b = &c->buf[r & 1];
        int active = b->round == r;
        uint32_t n = active ? popcount(b) : 0;
        if (!active) {
            /* nobody began a push for r: skip it if some worker moved past it
             * (with no one past r, r is the current round, not an empty one) */
            if (!passed) return;
            /* release: pairs with the acquire load in shmps_agg_wait */
            STORE(&c->next_round, r + 1, RELEASE);
            /* relaxed: a statistic, only ever written under the lock; shmps_agg_info
             * reads it without the lock, so the store is atomic (no torn read) */
            STORE(&c->skipped, c->skipped + 1, RELAXED);
            wake(c);
            continue;
        }
        if (n == 0 && !passed) return; /* begun (in-flight pushes of dead workers) only */
        /* relaxed: under the lock, which orders every store of it (set_assembled) */
        if (n && !LOAD(&c->assembled, RELAXED) && n < want) return; /* not here yet */
        *what = SHMPS_AGG_APPLY;
        *count = n;
        *phase = n ? SHMPS_AGG_PH_SUM : SHMPS_AGG_PH_ZEROING;
        if (claim) {
            /* relaxed stores in this order (CRASH_ORDER).  Killed before the applier
             * store, we leave no claim (applier 0), or, where a finish killed past its
             * commit point left its dead token in applier, that token's claim of r
             * with this phase and count: taken over as ours would be.  Hence phase
             * and count before claim_round. */
            STORE(&c->push_step, 0, RELAXED); /* the last round's ticket: not ours */
            STORE(&c->phase, *phase, RELAXED);
            STORE(&c->count, n, RELAXED);
            CRASH_ORDER();
            STORE(&c->claim_round, r, RELAXED);
            CRASH_ORDER();
            STORE(&c->applier, token, RELAXED); /* last: the claim is valid from here */
        }
        return;
    }
}

int shmps_agg_begin(void *ctl, void *man, uint64_t token, uint32_t slot, uint32_t want,
                    uint64_t *round) {
    agg_ctl_t *c = ctl_of(ctl);
    if (!c) return SHMPS_E_CORRUPT;
    if (slot >= SHMPS_MAX_WORKERS) return SHMPS_E_BOUNDS;
    worker_slot_t *w = &wslots(man)[slot];
    /* relaxed: our own slot; only this process writes its token and clock */
    if (LOAD(&w->token, RELAXED) != token) return SHMPS_E_ARG; /* not joined, or dropped */
    uint64_t r = LOAD(&w->clock, RELAXED);
    *round = r;
    int e = lock(c, token);
    if (e) return e;
    if (stale(c, man)) {
        unlock(c);
        return SHMPS_AGG_E_STALE;
    }
    if (c->magic != AGG_MAGIC) {
        uint64_t m;
        joined(man, &m);
        /* relaxed: a reader that checks magic first (acquire) sees this value, ordered
         * by magic's release store below; shmps_agg_mark, which does not, reads 0 or
         * this value atomically, and a mark that differs from the next one only makes
         * its pull copy again */
        STORE(&c->next_round, m < r ? m : r, RELAXED);
        c->version = AGG_VERSION;
        c->stamp = man_stamp(man);
        c->buf[0].round = c->buf[1].round = UINT64_MAX;
        STORE(&c->magic, AGG_MAGIC, RELEASE); /* last: pairs with step()'s check */
    }
    e = SHMPS_OK;
    uint64_t minclock;
    agg_buf_t *b = &c->buf[r & 1];
    if (r < c->next_round) {
        /* applied: with our contribution (a second push) or without it */
        e = b->round == r && bit_get(b, slot) ? SHMPS_AGG_E_TWICE : SHMPS_AGG_E_CLOSED;
    } else if (r >= c->next_round + 2) {
        e = SHMPS_AGG_E_AHEAD;
    } else if (r == c->next_round && c->applier && c->claim_round == r) {
        /* claimed (its applier may be reading the accumulator, or dead in PUSHING with a
         * resume to come, which reads it again): closed to new pushes, which would be
         * lost with the zeroing or pushed by a resume to part of the stripes.  Only a
         * worker that joined after the claim gets here (every joined worker was
         * covered when the round was claimed); the caller waits for the round, and
         * its push is then refused as one to an applied round (CLOSED) */
        e = SHMPS_AGG_E_CLAIMED;
    } else if (/* relaxed: under the lock, as in step() */
               !LOAD(&c->assembled, RELAXED) && joined(man, &minclock) < want) {
        e = SHMPS_AGG_E_ASSEMBLING;
    } else {
        set_assembled(c);
        if (b->round != r) {
            /* the buffer held round r - 2 (applied) or nothing: reset, round last
             * (CRASH_ORDER: killed before it, the buffer still reads as the old
             * round's, which is applied: stale, and reset again by the next begin) */
            memset(b->bits, 0, sizeof b->bits);
            memset(b->pend, 0, sizeof b->pend);
            CRASH_ORDER();
            STORE(&b->round, r, RELAXED);
        }
        if (bit_get(b, slot) || b->pend[slot] == token) {
            e = SHMPS_AGG_E_TWICE;
        } else {
            b->pend[slot] = token;
        }
    }
    unlock(c);
    return e;
}

int shmps_agg_assemble(void *ctl, void *man, uint64_t token, uint32_t want, double timeout_s,
                       uint32_t *njoined) {
    agg_ctl_t *c = ctl_of(ctl);
    if (!c) return SHMPS_E_CORRUPT;
    uint32_t *seq = &((shmps_manifest_t *)man)->clock_seq;
    uint64_t deadline = deadline_of(timeout_s);
    for (;;) {
        /* acquire: pairs with clock.c's wake_all (bumped by every join); a join
         * after this load makes the futex wait return at once */
        uint32_t seen = LOAD(seq, ACQUIRE);
        uint64_t m;
        *njoined = joined(man, &m);
        /* relaxed, without the lock: a sticky flag (set_assembled) that only ends this
         * wait; nothing is read on its word (the caller's begin looks again under the
         * lock), and a store it does not see yet costs one more nap (NAP_NS) */
        if (*njoined >= want || LOAD(&c->assembled, RELAXED)) {
            int e = lock(c, token);
            if (e) return e;
            set_assembled(c);
            unlock(c);
            wake(c);
            return SHMPS_OK;
        }
        if (nap(seq, seen, deadline)) return SHMPS_E_TIMEOUT;
    }
}

int shmps_agg_commit(void *ctl, uint64_t token, uint32_t slot, uint64_t round, uint32_t want) {
    agg_ctl_t *c = ctl_of(ctl);
    if (!c) return SHMPS_E_CORRUPT;
    if (slot >= SHMPS_MAX_WORKERS) return SHMPS_E_BOUNDS;
    int e = lock(c, token);
    if (e) return e;
    agg_buf_t *b = &c->buf[round & 1];
    if (b->round != round || b->pend[slot] != token) {
        e = SHMPS_E_ARG; /* no push of ours in flight for this round */
    } else {
        /* the bit, then the in-flight token cleared (CRASH_ORDER): killed between,
         * the slot counts as contributed, and its dead in-flight token holds nobody */
        STORE(&b->bits[slot >> 6], b->bits[slot >> 6] | 1ull << (slot & 63), RELAXED);
        CRASH_ORDER();
        STORE(&b->pend[slot], 0, RELAXED);
        if (popcount(b) >= want) set_assembled(c);
    }
    unlock(c);
    if (!e) wake(c);
    return e;
}

int shmps_agg_abort(void *ctl, uint64_t token, uint32_t slot, uint64_t round) {
    agg_ctl_t *c = ctl_of(ctl);
    if (!c) return SHMPS_E_CORRUPT;
    if (slot >= SHMPS_MAX_WORKERS) return SHMPS_E_BOUNDS;
    int e = lock(c, token);
    if (e) return e;
    agg_buf_t *b = &c->buf[round & 1];
    if (b->round == round && b->pend[slot] == token) b->pend[slot] = 0;
    unlock(c);
    wake(c);
    return SHMPS_OK;
}

int shmps_agg_next(void *ctl, void *man, uint64_t token, uint32_t want, uint32_t *what,
                   uint64_t *round, uint32_t *count, uint32_t *phase, int32_t *behind) {
    agg_ctl_t *c = ctl_of(ctl);
    if (!c) return SHMPS_E_CORRUPT;
    *what = SHMPS_AGG_NOTHING;
    *behind = -1;
    /* acquire: pairs with begin's release store of magic */
    if (LOAD(&c->magic, ACQUIRE) != AGG_MAGIC) return SHMPS_OK;
    int e = lock(c, token);
    if (e) return e;
    step(c, man, token, want, 1, what, round, count, phase, behind);
    unlock(c);
    return SHMPS_OK;
}

int shmps_agg_phase(void *ctl, uint64_t token, uint64_t round, uint32_t phase) {
    agg_ctl_t *c = ctl_of(ctl);
    if (!c) return SHMPS_E_CORRUPT;
    int e = lock(c, token);
    if (e) return e;
    if (c->applier != token || c->claim_round != round || c->next_round != round)
        e = SHMPS_E_ARG; /* our claim was taken over (we were thought dead?) */
    else
        c->phase = phase;
    unlock(c);
    return e;
}

/* Is a push by another path (shmps_agg_foreign) of a live process other than `token`
 * in flight?  Dead processes' entries are freed.  (Lock held.) */
static int foreign_in_flight(agg_ctl_t *c, uint64_t token) {
    int busy = 0;
    for (uint32_t i = 0; i < AGG_FOREIGN; i++) {
        agg_foreign_t *f = &c->foreign[i];
        if (!f->token || !f->count) continue;
        if (!shmps_token_alive(f->token)) {
            f->token = 0; /* a dead process pushes nothing more (under the lock) */
            continue;
        }
        if (f->token != token) busy = 1;
    }
    return busy;
}

/* The control block `ctl` (*out), for a round's push to the dense tensor whose shard 0
 * is `base0`; an error code, else. */
static int ctl_for_push(void *ctl, void *base0, agg_ctl_t **out) {
    agg_ctl_t *c = ctl_of(ctl);
    if (!c) return SHMPS_E_CORRUPT;
    const shmps_spec_t *s0 = shmps_spec_of(base0);
    if (!s0 || s0->kind != SHMPS_DENSE) return SHMPS_E_ARG;
    *out = c;
    return SHMPS_OK;
}

/* Does a round wait to take its ticket (shmps_agg_pushing's mark: `waiter`), for
 * shmps_agg_foreign by `token` to refuse a new push by another path?  The mark counts
 * while its waiter is another process, alive, holding the claim of the oldest round,
 * still in phase SUM, and `wait_until` (its own deadline) has not passed: a waiter that
 * was killed, gave up, or whose claim was taken over or went on leaves a mark that
 * counts no more, whatever it holds (lock held; relaxed loads, as every field under
 * it). */
static int round_waits(agg_ctl_t *c, uint64_t token) {
    uint64_t w = LOAD(&c->waiter, RELAXED);
    return w && w != token && w == c->applier && c->claim_round == c->next_round &&
           c->phase == SHMPS_AGG_PH_SUM && shmps_now_ns() < LOAD(&c->wait_until, RELAXED) &&
           shmps_token_alive(w);
}

/* shmps_agg_pushing's one look, under the lock: SHMPS_AGG_E_FOREIGN while a push by
 * another path is in flight, the round then marked as waiting until `deadline`
 * (round_waits: new pushes by another path are refused meanwhile, so the ones in flight
 * end and none holds the round off); any other outcome clears our mark.  The mark's
 * deadline, then its token (CRASH_ORDER): killed between, the token left there is not
 * the claim's applier (we are), and round_waits ignores it.  Relaxed: under the lock,
 * whose release orders them for the next holder. */
static int pushing_once(agg_ctl_t *c, uint64_t token, uint64_t round, void *base0,
                        uint64_t deadline, uint64_t *step) {
    int e = lock(c, token);
    if (e) return e;
    if (c->applier != token || c->claim_round != round || c->next_round != round) {
        e = SHMPS_E_ARG; /* our claim was taken over (we were thought dead?) */
    } else if (foreign_in_flight(c, token)) {
        STORE(&c->wait_until, deadline, RELAXED);
        CRASH_ORDER();
        STORE(&c->waiter, token, RELAXED);
        e = SHMPS_AGG_E_FOREIGN;
    } else {
        uint64_t t;
        shmps_dense_next_step(base0, &t);
        t &= ~(uint64_t)(SHMPS_STEP_BY_STRIPE | SHMPS_STEP_RESUME); /* by ticket: below */
        if (!t) {
            e = SHMPS_E_ARG;
        } else {
            /* the pushes statistic the round's count goes from (shmps_agg_pushed): every
             * push by another path has ended (its count made before its bracket's end,
             * which our lock orders before this load), and none starts until the round
             * leaves PUSHING; relaxed: a statistic, read once, under our lock */
            STORE(&c->push_base, LOAD(&hdr_of(base0)->stats.pushes, RELAXED), RELAXED);
            STORE(&c->push_step, t, RELAXED);
            CRASH_ORDER();
            STORE(&c->phase, SHMPS_AGG_PH_PUSHING, RELAXED);
            *step = t;
        }
    }
    if (e != SHMPS_AGG_E_FOREIGN && LOAD(&c->waiter, RELAXED) == token)
        STORE(&c->waiter, 0, RELAXED);
    unlock(c);
    return e;
}

/* shmps_agg_pushing gives up: our mark of a waiting round (if it is still ours) goes. */
static void stop_waiting(agg_ctl_t *c, uint64_t token) {
    if (lock(c, token)) return; /* (the mark then lapses at its deadline) */
    /* relaxed: under the lock */
    if (LOAD(&c->waiter, RELAXED) == token) STORE(&c->waiter, 0, RELAXED);
    unlock(c);
}

/* Phase PUSHING of our claim of `round`: takes the push's ticket here (*step, from
 * shard 0 `base0` of the tensor, its flags masked off: the push goes by ticket, without
 * SHMPS_STEP_BY_STRIPE, so that a stripe has the push exactly if its last step is the
 * ticket or later) and records it, once no push by another path is in flight: while
 * one is, it sleeps on the block's futex, woken as one ends (shmps_agg_foreign), and
 * looks again every NAP_NS (a process that dies in one ends nothing), for at most
 * `timeout_s` seconds (< 0: no limit; SHMPS_AGG_E_FOREIGN after them, nothing done).
 * The ticket is taken under the lock, after that check: every push by another path
 * then took its ticket before ours and has finished writing, or takes it after this
 * round has left PUSHING (it is refused, or resumes a dead applier's round first), so
 * no stripe reaches the ticket otherwise than by this round, which a resume relies on.  Relaxed stores in this order
 * (CRASH_ORDER): killed between them, the phase is still SUM, and whoever takes the
 * claim over restarts the round (a new ticket; this one's step is skipped, which
 * by-ticket pushes allow).  The lock's release (or its takeover CAS, acquire) orders
 * both before the next holder's reads. */
int shmps_agg_pushing(void *ctl, uint64_t token, uint64_t round, void *base0, double timeout_s,
                      uint64_t *step) {
    agg_ctl_t *c;
    int e = ctl_for_push(ctl, base0, &c);
    if (e) return e;
    uint64_t deadline = deadline_of(timeout_s);
    for (;;) {
        /* acquire: pairs with wake()'s release after a push by another path ends
         * (shmps_agg_foreign); loaded before our look under the lock, so an end that
         * comes after the look bumps it past `seen`, and the nap returns at once */
        uint32_t seen = LOAD(&c->seq, ACQUIRE);
        e = pushing_once(c, token, round, base0, deadline, step);
        if (e != SHMPS_AGG_E_FOREIGN) return e;
        if (nap(&c->seq, seen, deadline)) {
            stop_waiting(c, token);
            return SHMPS_AGG_E_FOREIGN;
        }
    }
}

/* The push of our claim of `round` (PUSHING, with its ticket) reached every stripe:
 * count it as one push in the tensor's statistics (shard 0 `base0`: nbytes, rows), once
 * per round whoever finished it (the dead applier's push counted nothing yet: it
 * counts here), and go to phase ZEROING.  The count is a CAS of the pushes statistic
 * from `push_base` (its value as the round entered PUSHING: nothing else counts a push
 * of the tensor while a round is in PUSHING, pushes by another path being kept out) to
 * push_base + 1: it succeeds once per round, whoever makes it, however many times a
 * holder killed in here is resumed; the bytes and rows follow it (killed between, they
 * miss the round: statistics).  Then `counted` records it (a resume skips the CAS).
 * Killed anywhere, the round counts one push, never none nor two (tried by the kill
 * points pushed-count, after the count, and pushed-counted, after the record).  Under
 * the lock, relaxed stores in this order (CRASH_ORDER); the lock's release (or takeover
 * CAS, acquire) orders them before the next holder's reads. */
int shmps_agg_pushed(void *ctl, uint64_t token, uint64_t round, void *base0, uint64_t nbytes,
                     uint64_t rows) {
    agg_ctl_t *c;
    int e = ctl_for_push(ctl, base0, &c);
    if (!e) e = lock(c, token);
    if (e) return e;
    if (c->applier != token || c->claim_round != round || c->next_round != round ||
        c->phase != SHMPS_AGG_PH_PUSHING || !LOAD(&c->push_step, RELAXED)) {
        e = SHMPS_E_ARG;
    } else {
        /* relaxed, here and in the stores below: written only under this lock, whose
         * release (or takeover CAS, acquire) orders them for the next holder; the
         * order a kill sees is kept by CRASH_ORDER */
        if (LOAD(&c->counted, RELAXED) != round + 1) {
            uint64_t was = LOAD(&c->push_base, RELAXED);
            /* relaxed: a statistic; only its atomicity matters (a CAS fails on any
             * other value: the round's count is there already, or a push the rounds do
             * not bracket moved it, and the round then counts none rather than two) */
            if (CAS(&hdr_of(base0)->stats.pushes, &was, was + 1, RELAXED, RELAXED))
                shmps_count_push(base0, 0, nbytes, rows); /* (relaxed adds, likewise) */
            CRASH_ORDER();
            KILL_POINT(KILL_COUNT);
            STORE(&c->counted, round + 1, RELAXED);
            CRASH_ORDER();
            KILL_POINT(KILL_COUNTED);
        }
        STORE(&c->phase, SHMPS_AGG_PH_ZEROING, RELAXED);
    }
    unlock(c);
    return e;
}

/* A push to the tensor by another path than the rounds (the bridge's direct applies),
 * bracketed by this call with end = 0 before it and end = 1 after it.  end = 0: if a
 * round is claimed in phase PUSHING, nothing is registered and *what says what to do
 * first, if it is pushed by ticket (push_step set: a resumable round)
 * (SHMPS_AGG_BUSY: a live process pushes round *round, wait for it;
 * SHMPS_AGG_APPLY: its applier is dead, finish it, shmps_agg_next), and likewise while
 * a live process's round waits to take its ticket (round_waits: SHMPS_AGG_BUSY, unless
 * this process has a push by another path in flight already); else the push is
 * registered (*what = SHMPS_AGG_NOTHING) and a round's PUSHING waits until it ends
 * (shmps_agg_pushing), because a stripe this push moved past a round's ticket would
 * pass for having the round when a resume finishes it.  SHMPS_AGG_E_FOREIGN: the
 * table is full (AGG_FOREIGN processes at once), try again.  Entries are per process
 * (threads share the token; the caller serialises them with the round's applier,
 * aggregate.py _apply_lock); a dead process's entry is ignored and reused. */
int shmps_agg_foreign(void *ctl, void *man, uint64_t token, int end, uint32_t *what,
                      uint64_t *round) {
    agg_ctl_t *c = ctl_of(ctl);
    if (!c) return SHMPS_E_CORRUPT;
    *what = SHMPS_AGG_NOTHING;
    *round = 0;
    int e = lock(c, token);
    if (e) return e;
    agg_foreign_t *mine = NULL, *free_ = NULL;
    for (uint32_t i = 0; i < AGG_FOREIGN; i++) {
        agg_foreign_t *f = &c->foreign[i];
        if (f->token == token) mine = f;
        else if (!free_ && (!f->token || !f->count || !shmps_token_alive(f->token))) free_ = f;
    }
    if (end) {
        /* relaxed: under the lock (as every field of the block) */
        if (mine && mine->count) STORE(&mine->count, mine->count - 1, RELAXED);
    } else if (/* relaxed: under the lock, which orders begin's release store of it */
               LOAD(&c->magic, RELAXED) == AGG_MAGIC && !stale(c, man) &&
               c->applier && c->claim_round == c->next_round &&
               ((c->phase == SHMPS_AGG_PH_PUSHING && LOAD(&c->push_step, RELAXED)) ||
                (!(mine && mine->count) && round_waits(c, token)))) {
        /* (only a round pushed by ticket, which a resume finishes by the stripes'
         * steps: one pushed without (shmps_agg_phase: the tensor forwarded to a
         * bridge, which is what applies by another path) is no resume's concern, and
         * the bridge's event loop must not wait for a worker's push, which a paused
         * worker would make last; relaxed, as the loads beside it: under the lock) */
        /* (or a round waits to take its ticket: round_waits, whose waiter is alive, so
         * BUSY; a process with a push by another path in flight already, nested in it,
         * goes on: refused, it would not end the one the round waits for) */
        *round = c->next_round;
        *what = c->applier != token && shmps_token_alive(c->applier) ? SHMPS_AGG_BUSY
                                                                     : SHMPS_AGG_APPLY;
    } else if (mine) {
        /* relaxed: under the lock, which orders it for the next holder (the count is
         * read only there: foreign_in_flight) */
        STORE(&mine->count, mine->count + 1, RELAXED);
    } else if (free_) {
        /* the token, then the count (CRASH_ORDER): killed between, the entry holds our
         * dead token with the count it had, which foreign_in_flight ignores and frees.
         * (The count first left a live process's idle entry, reused, at its token with
         * count 1 when the kill came between: that process's brackets then took it
         * 1 -> 2 -> 1, never 0, and every round waited for it: review H2 F6; kill point
         * foreign-token.)  The lock orders both for the next holder */
        STORE(&free_->token, token, RELAXED);
        CRASH_ORDER();
        KILL_POINT(KILL_FOREIGN_TOKEN);
        STORE(&free_->count, 1, RELAXED);
    } else {
        e = SHMPS_AGG_E_FOREIGN;
    }
    unlock(c);
    /* An end wakes a round waiting to take its ticket (shmps_agg_pushing): that waiter
     * loaded seq before it took the lock and found our count, so this bump, after our
     * unlock (the lock orders its look before our decrement, and our decrement before
     * the bump), is one it has not seen, and its futex wait returns.  wake()'s release
     * is the ordering; a process that dies inside its bracket ends nothing, and the
     * waiter finds its entry dead at its next look (NAP_NS). */
    if (end && !e) wake(c);
    return e;
}

/* The ticket of our claim of `round` in phase PUSHING (shmps_agg_pushing), to finish
 * its push: SHMPS_E_ARG if we hold no such claim or it has none. */
int shmps_agg_push_step(void *ctl, uint64_t token, uint64_t round, uint64_t *step) {
    agg_ctl_t *c = ctl_of(ctl);
    if (!c) return SHMPS_E_CORRUPT;
    int e = lock(c, token);
    if (e) return e;
    /* relaxed: under the lock, whose acquire orders the recording holder's stores */
    uint64_t t = LOAD(&c->push_step, RELAXED);
    if (c->applier != token || c->claim_round != round || c->next_round != round ||
        c->phase != SHMPS_AGG_PH_PUSHING || !t || t >= SHMPS_STEP_RESUME)
        e = SHMPS_E_ARG;
    else
        *step = t;
    unlock(c);
    return e;
}

/* Our claim of `round` (any phase), which our apply left on an error (Python raises it
 * to its caller), handed to whoever looks next: applier becomes AGG_RELEASED, a token
 * no process has (pid 0: shmps_token_alive says dead), so the next step() takes the
 * claim over as a dead applier's, by its phase: SUM restarts the round, PUSHING with a
 * ticket resumes the push by ticket (SHMPS_STEP_RESUME: the stripes our push reached,
 * at the ticket, are skipped; the others get it), ZEROING zeroes again.  Kept by us
 * instead, every other process took the claim for a live applier's (BUSY) and waited,
 * and a process that never called again held the round for ever.  Nothing else
 * changes (relaxed: under the lock, whose release orders it for the next holder).
 * A claim that is not ours (taken over meanwhile) is left alone; SHMPS_OK either way. */
int shmps_agg_release(void *ctl, uint64_t token, uint64_t round) {
    agg_ctl_t *c = ctl_of(ctl);
    if (!c) return SHMPS_E_CORRUPT;
    int e = lock(c, token);
    if (e) return e;
    int mine = c->applier == token && c->claim_round == round && c->next_round == round;
    if (mine) STORE(&c->applier, AGG_RELEASED, RELAXED);
    unlock(c);
    if (mine) wake(c); /* waiters (shmps_agg_wait) look again at once and take it over */
    return SHMPS_OK;
}

int shmps_agg_finish(void *ctl, uint64_t token, uint64_t round) {
    agg_ctl_t *c = ctl_of(ctl);
    if (!c) return SHMPS_E_CORRUPT;
    int e = lock(c, token);
    if (e) return e;
    if (c->applier != token || c->claim_round != round || c->next_round != round) {
        e = SHMPS_E_ARG;
    } else {
        /* release: the commit point; pairs with the waiters' acquire load.  The
         * tensor and the zeroed buffer were written before (under their own
         * stripe locks / by us alone) and are published by this store too. */
        STORE(&c->next_round, round + 1, RELEASE);
        /* after the commit point (CRASH_ORDER: a release store keeps the stores before
         * it there, not the ones after): killed before these, the claim is of an
         * applied round (claim_round != next_round), which step() ignores; cleared
         * first, the round would be claimed and applied a second time */
        CRASH_ORDER();
        STORE(&c->applier, 0, RELAXED);
        STORE(&c->phase, 0, RELAXED);
        /* the ticket of an applied round is nobody's (a claim by an older build, which
         * does not record one, must not find it) */
        STORE(&c->push_step, 0, RELAXED);
        STORE(&c->applied, c->applied + 1, RELAXED);   /* as skipped: a statistic */
    }
    unlock(c);
    if (!e) wake(c);
    return e;
}

int shmps_agg_wait(void *ctl, void *man, uint64_t token, uint32_t want, uint64_t round,
                   double timeout_s, uint32_t *done, int32_t *behind) {
    agg_ctl_t *c = ctl_of(ctl);
    if (!c) return SHMPS_E_CORRUPT;
    *done = 0;
    *behind = -1;
    uint64_t deadline = deadline_of(timeout_s);
    for (;;) {
        /* acquire: pairs with wake()'s release; a change after this load makes the
         * futex wait below return at once */
        uint32_t seen = LOAD(&c->seq, ACQUIRE);
        /* acquire: pairs with finish's release store (the applied values are
         * visible to the caller once it sees next_round past its round) */
        if (LOAD(&c->magic, ACQUIRE) == AGG_MAGIC &&
            (LOAD(&c->next_round, ACQUIRE) > round || c->stamp != man_stamp(man))) {
            *done = 1; /* applied, or a round of a former manifest: never applied here */
            return SHMPS_OK;
        }
        int e = lock(c, token);
        if (e) return e;
        uint32_t what, count, phase;
        uint64_t r;
        step(c, man, token, want, 0, &what, &r, &count, &phase, behind);
        int moved = c->next_round > round;
        unlock(c);
        if (moved) continue;
        if (what == SHMPS_AGG_APPLY) return SHMPS_OK; /* *done = 0: the caller applies */
        if (what == SHMPS_AGG_BUSY) *behind = -2;     /* another process is applying */
        if (nap(&c->seq, seen, deadline)) return SHMPS_E_TIMEOUT;
    }
}

int shmps_agg_reset(void *ctl, void *man, uint64_t token, int finish, uint32_t *state) {
    agg_ctl_t *c = ctl_of(ctl);
    if (!c) return SHMPS_E_CORRUPT;
    int e = lock(c, token);
    if (e) return e;
    if (!stale(c, man)) {
        *state = SHMPS_AGG_RESET_DONE;
    } else if (!finish) {
        if (c->resetter && c->resetter != token && shmps_token_alive(c->resetter)) {
            *state = SHMPS_AGG_RESET_BUSY;
        } else {
            c->resetter = token; /* (a dead resetter's claim is taken over) */
            *state = SHMPS_AGG_RESET_CLAIMED;
        }
    } else if (c->resetter != token) {
        e = SHMPS_E_ARG;
    } else {
        /* the accumulators are clear: start afresh (begin initialises lazily) */
        STORE(&c->magic, 0, RELEASE); /* first: the block is "never used" from here */
        CRASH_ORDER(); /* (as in finish: the release keeps only earlier stores above) */
        /* atomic stores where a reader without the lock loads the field (next_round,
         * applier, claim_round: shmps_agg_mark, shmps_agg_wait; assembled:
         * shmps_agg_assemble); relaxed: shmps_agg_wait takes the lock once it sees magic
         * 0 (the store above, which it loads acquire), a mark of a block being reset
         * brackets no change a pull could copy (a reset writes only the accumulators),
         * assemble's reader only stops waiting (set_assembled), and lock holders get
         * them through the lock */
        STORE(&c->next_round, 0, RELAXED);
        STORE(&c->applier, 0, RELAXED);
        STORE(&c->claim_round, 0, RELAXED);
        STORE(&c->assembled, 0, RELAXED);
        c->phase = c->count = 0;
        c->stamp = c->resetter = 0;
        c->counted = 0; /* round numbers start again: no round of theirs is counted */
        c->waiter = 0;
        *state = SHMPS_AGG_RESET_DONE;
    }
    unlock(c);
    if (!e) wake(c);
    return e;
}

/* What a pull brackets its copy with (aggregate.py): the oldest round not yet
 * applied, or UINT64_MAX while a round is claimed (being applied, its values going
 * into the tensor: the claim step() waits for or takes over; none in a stale block).
 * Two equal marks other than UINT64_MAX, one read before the copy and one after, mean
 * no round was applied in between: the copy is of one whole round.  Lock-free. */
uint64_t shmps_agg_mark(void *ctl, void *man) {
    agg_ctl_t *c = ctl_of(ctl);
    if (!c) return 0; /* no control block: no rounds (the pull's own checks refuse it) */
    /* acquire: pairs with finish's release store; a mark read after a copy that saw
     * any shard the applier wrote is ordered after the applier's claim (its stores
     * reach us through that shard's lock or seqlock, release then acquire), so it
     * sees applier set, or next_round moved on */
    uint64_t r = LOAD(&c->next_round, ACQUIRE);
    /* relaxed: written under the lock; no load moves before an acquire, so these
     * come after the copy's and the one above.  A claim counts as step() counts it:
     * applier set and claim_round == next_round */
    int claimed = LOAD(&c->applier, RELAXED) != 0 && LOAD(&c->claim_round, RELAXED) == r &&
                  !stale(c, man); /* a restored block's claim is never carried on */
    return claimed ? UINT64_MAX : r;
}

int shmps_agg_info(void *ctl, shmps_agg_info_t *out) {
    agg_ctl_t *c = ctl_of(ctl);
    if (!c) return SHMPS_E_CORRUPT;
    memset(out, 0, sizeof *out);
    /* relaxed: a diagnostic snapshot (fields may be from slightly different moments) */
    if (LOAD(&c->magic, ACQUIRE) != AGG_MAGIC) return SHMPS_OK;
    out->next_round = LOAD(&c->next_round, RELAXED);
    out->applied = LOAD(&c->applied, RELAXED);
    out->skipped = LOAD(&c->skipped, RELAXED);
    out->takeovers = LOAD(&c->takeovers, RELAXED);
    out->assembled = LOAD(&c->assembled, RELAXED);
    out->applier_pid = (uint32_t)(LOAD(&c->applier, RELAXED) >> 32);
    for (int k = 0; k < 2; k++) {
        agg_buf_t *b = &c->buf[k];
        out->rounds[k] = LOAD(&b->round, RELAXED);
        uint32_t n = 0, p = 0;
        for (uint32_t i = 0; i < AGG_WORDS; i++)
            n += (uint32_t)__builtin_popcountll(LOAD(&b->bits[i], RELAXED));
        for (uint32_t i = 0; i < SHMPS_MAX_WORKERS; i++) p += LOAD(&b->pend[i], RELAXED) != 0;
        out->contributed[k] = n;
        out->in_flight[k] = p;
    }
    return SHMPS_OK;
}
