/* shmps native core: private definitions shared by the .c files.
 *
 * Atomics are GCC/Clang __atomic builtins on plain integer fields (cffi cannot parse
 * _Atomic), each call naming its memory order.  Every use says, at the call site,
 * which other operation it pairs with and why the order suffices.
 */
#ifndef SHMPS_INTERNAL_H
#define SHMPS_INTERNAL_H
#define _GNU_SOURCE
#include "shmps.h"
#include <pthread.h>
#include <string.h>

#define SHMPS_READERS 7 /* shared-freeze slots: with `freeze`, one cache line */
#define SHMPS_SHARD_MAGIC 0x44485353504d4853ULL    /* "SHMPSSHD" little-endian */
#define SHMPS_MANIFEST_MAGIC 0x4e4d5353504d4853ULL /* "SHMPSSMN" little-endian */
#define SHMPS_CACHELINE 64

#define LOAD(p, mo) __atomic_load_n((p), (mo))
#define STORE(p, v, mo) __atomic_store_n((p), (v), (mo))
#define CAS(p, expp, desired, mo_ok, mo_fail) \
    __atomic_compare_exchange_n((p), (expp), (desired), 0, (mo_ok), (mo_fail))
#define FETCH_ADD(p, v, mo) __atomic_fetch_add((p), (v), (mo))
#define FETCH_SUB(p, v, mo) __atomic_fetch_sub((p), (v), (mo))
#define RELAXED __ATOMIC_RELAXED
#define ACQUIRE __ATOMIC_ACQUIRE
#define RELEASE __ATOMIC_RELEASE
#define ACQ_REL __ATOMIC_ACQ_REL
#define SEQ_CST __ATOMIC_SEQ_CST

/* One lock word per stripe (dense) or per row (csr, table).
 * owner: 0 free, else the holder's token.  seq: seqlock counter, odd while the
 * holder writes the values covered by the stripe.  pad: dense, the low 32 bits of the
 * step the stripe last applied a push at (dense.c "Stripe steps"); tables use seq and
 * pad as one 64-bit word (table.c aux_of). */
typedef struct {
    uint64_t owner;
    uint32_t seq;
    uint32_t pad;
} shmps_stripe_t;

/* Set in the step a dense whole push passes to its stripes when the tensor never took
 * a rows= push: each stripe then counts its own pushes (dense.c "Stripe steps"). */
#define SHMPS_STEP_BY_STRIPE (1ull << 63)

/* A landing slot of an outbox shard (outbox.c "Landing"): token, 0 when free, of a
 * pusher between its first write of values into the shard and its count; seq, how many
 * pushes released the slot (written only by the holder, before it frees the slot). */
typedef struct {
    uint64_t token;
    uint64_t seq;
} shmps_landing_t;

/* The shard header: the first SHMPS_HEADER_SIZE bytes of every shard segment. */
typedef struct {
    uint64_t magic;         /* SHMPS_SHARD_MAGIC */
    uint32_t version;       /* SHMPS_LAYOUT_VERSION */
    uint32_t header_size;   /* SHMPS_HEADER_SIZE */
    shmps_spec_t spec;      /* inputs + derived layout, validated on attach */
    /* mutable words, each group on its own cache line */
    uint64_t step __attribute__((aligned(SHMPS_CACHELINE)));  /* dense push count */
    /* dense, shard 0: 1 once the tensor took a rows= push or a copy was written row by
     * row: whole pushes then apply at the ticket, not each stripe's count (dense.c
     * "Stripe steps") */
    uint64_t steps_by_ticket;
    uint64_t freeze __attribute__((aligned(SHMPS_CACHELINE))); /* exclusive freezer */
    uint64_t readers[SHMPS_READERS];  /* shared freezers (same line as freeze) */
    uint64_t active[SHMPS_ACTIVE_SLOTS] __attribute__((aligned(SHMPS_CACHELINE)));
    shmps_stats_t stats __attribute__((aligned(SHMPS_CACHELINE)));
    uint64_t table_used __attribute__((aligned(SHMPS_CACHELINE))); /* table rows taken */
    uint64_t last_pusher;     /* token of the latest whole-tensor pusher (heuristic) */
    uint64_t last_pusher_ns;  /* and when it started */
    uint64_t fingerprint;     /* SHMPS_FINGERPRINT of the build that laid it out */
    /* outbox shards only (SHMPS_F_OUTBOX; outbox.c): monotone push counters.  Pushers
     * write ob_pushed, the bridge writes the line after it: apart, so pushers do not
     * share a line with the bridge's writes. */
    uint64_t ob_pushed __attribute__((aligned(SHMPS_CACHELINE))); /* pushes landed */
    /* table outboxes (table.c "Outbox drains"): the rows pushed to since the last drain,
     * a list through their rowstep words (row + 1 each; 0 ends it), and 1 when a pusher
     * died inside the shard (its rows may be pushed to and not listed) or a drain failed:
     * the next drain looks at every row.  Pushers write both: the line of ob_pushed. */
    uint64_t ob_dirty;
    uint64_t ob_rescan;
    uint64_t ob_acked __attribute__((aligned(SHMPS_CACHELINE)));  /* owner has them */
    uint64_t ob_drained;      /* ob_pushed covered by the latest drain (empty or not) */
    uint64_t ob_sent;         /* drains that took rows so far (each one's ticket) */
    /* what a bridge process drained and never saw acknowledged before it ended
     * (shmps_outbox_recover): the latest such range (lo, hi] of ob_pushed values, and
     * the pushes of every range so far */
    uint64_t ob_lost_lo;
    uint64_t ob_lost_hi;
    uint64_t ob_lost;
    uint64_t ob_sent_acked;   /* the highest ticket acknowledged (shmps_outbox_ack) */
    /* pushes landing (outbox.c "Landing"): the highest ticket of a drain that took rows
     * while a push may have been landing (values in, count not yet made) */
    uint64_t ob_landing_ticket;
    /* 1 while a lost range opened by recover waits for the pushes landing then to be
     * counted (2 while a drain closes it); the bridge's words, on a line of their own */
    uint64_t ob_lost_open __attribute__((aligned(SHMPS_CACHELINE)));
    uint64_t ob_draining;     /* drains in progress (one killed inside leaves it > 0) */
    /* recover's snapshot of the landing slots: seq + 1 of a slot held then, else 0 */
    uint64_t ob_landing_snap[SHMPS_LANDING_SLOTS];
    /* the pushers' landing slots (shmps_outbox_land / shmps_outbox_landed) */
    shmps_landing_t ob_landing[SHMPS_LANDING_SLOTS] __attribute__((aligned(SHMPS_CACHELINE)));
} shmps_shard_hdr_t;

/* Dense, shard 0's header `h0`: from now on the tensor's whole pushes apply at the
 * ticket rule, not each stripe's count (dense.c "Stripe steps"): a rows= push was made,
 * or a copy was written row by row.  Once: the flag, then a release add of 0 to the
 * step; a whole push's acquire ticket add reads it or a later add of step's chain of
 * adds, so a push whose ticket comes after sees the flag. */
static inline void shmps_steps_by_ticket(shmps_shard_hdr_t *h0) {
    if (LOAD(&h0->steps_by_ticket, RELAXED)) return;
    STORE(&h0->steps_by_ticket, 1, RELAXED);
    FETCH_ADD(&h0->step, 0, RELEASE);
}

_Static_assert(sizeof(shmps_shard_hdr_t) <= SHMPS_HEADER_SIZE, "shard header too big");
_Static_assert(__builtin_offsetof(shmps_shard_hdr_t, ob_pushed) == 1152 &&
               __builtin_offsetof(shmps_shard_hdr_t, ob_dirty) == 1160 &&
               __builtin_offsetof(shmps_shard_hdr_t, ob_rescan) == 1168 &&
               __builtin_offsetof(shmps_shard_hdr_t, ob_acked) == 1216 &&
               __builtin_offsetof(shmps_shard_hdr_t, ob_lost) == 1256 &&
               __builtin_offsetof(shmps_shard_hdr_t, ob_sent_acked) == 1264 &&
               __builtin_offsetof(shmps_shard_hdr_t, ob_landing_ticket) == 1272 &&
               __builtin_offsetof(shmps_shard_hdr_t, ob_lost_open) == 1280 &&
               __builtin_offsetof(shmps_shard_hdr_t, ob_draining) == 1288 &&
               __builtin_offsetof(shmps_shard_hdr_t, ob_landing_snap) == 1296 &&
               __builtin_offsetof(shmps_shard_hdr_t, ob_landing) == 1856,
               "outbox words moved: update docs/segment-layout.md");
/* SHMPS_FINGERPRINT (below) holds sizeof(shmps_shard_hdr_t), which is rounded up to 64
 * bytes: a word added into padding leaves it unchanged, and a build that misreads the
 * new word is not refused (ob_sent_acked at 1264 did so: 1280 bytes before and after).
 * Such a change must bump SHMPS_LAYOUT_VERSION.  The landing words grew it to 2880. */

/* What two builds must agree on to share a shard: the header's and the spec's sizes
 * and where the mutable words sit.  A process of another build refuses the segment
 * (CorruptSegment) instead of misreading it. */
#define SHMPS_FINGERPRINT                                                              \
    ((uint64_t)sizeof(shmps_shard_hdr_t) | (uint64_t)sizeof(shmps_spec_t) << 16 |   \
     (uint64_t)__builtin_offsetof(shmps_shard_hdr_t, active) << 32 |                  \
     (uint64_t)__builtin_offsetof(shmps_shard_hdr_t, table_used) << 48)

/* Bounded waiting with dead-owner detection.  wait_step() spins briefly, then
 * yields, then sleeps; from 1 ms on it checks every millisecond whether the token
 * it waits on names a live process.  The timeout and that 1 ms count from the first
 * yield (64 spins in: microseconds), so init() reads no clock. */
typedef struct {
    uint64_t timeout_ns, deadline_ns, next_check_ns; /* deadline 0: not started */
    uint32_t spins;
} shmps_wait_t;

enum { WAIT_AGAIN = 0, WAIT_HOLDER_DEAD = 1 };

void shmps_wait_init(shmps_wait_t *w, double timeout_s);
int shmps_wait_step(shmps_wait_t *w, uint64_t holder);

static inline shmps_shard_hdr_t *hdr_of(void *base) { return (shmps_shard_hdr_t *)base; }

/* Private specs (specs.c): the spec of the shard mapped at `base` as this process laid
 * it out or validated it, or NULL if it did neither (or forgot it: shmps_shard_forget).
 * Every entry point takes sizes and offsets from here, never from hdr_of(base)->spec,
 * which any process of the user can write after attach.  keep: 0; SHMPS_E_CORRUPT if
 * another spec is kept for base (kept as it is); or ENOMEM. */
const shmps_spec_t *shmps_spec_of(const void *base);
/* out[i] = shmps_spec_of(bases[i]) for i < n, under one lock; returns how many are NULL */
uint64_t shmps_specs_of(void *const *bases, uint64_t n, const shmps_spec_t **out);
int shmps_spec_keep(const void *base, const shmps_spec_t *spec);
static inline char *at(void *base, uint64_t off) { return (char *)base + off; }

/* stripe locks (sync.c) */
int shmps_stripe_trylock(shmps_stripe_t *s, uint64_t token);
int shmps_stripe_lock(shmps_stripe_t *s, uint64_t token, double timeout_s, uint64_t *takeovers);
/* shmps_stripe_lock that says, when it took the lock over (SHMPS_RECOVERED), whose it
 * was: *was, the dead holder's token */
int shmps_stripe_lock_was(shmps_stripe_t *s, uint64_t token, double timeout_s,
                          uint64_t *takeovers, uint64_t *was);
void shmps_stripe_write_begin(shmps_stripe_t *s);
void shmps_stripe_write_end(shmps_stripe_t *s);
void shmps_stripe_unlock(shmps_stripe_t *s);
int shmps_stripe_read(shmps_stripe_t *s, uint64_t token, void *dst, const void *src,
                      size_t nbytes);

/* outboxes (outbox.c): a drain's bookkeeping of ob_drained/ob_sent/ob_acked, shared by
 * the dense and table drains.  `pushed` is ob_pushed read (acquire) before the drain,
 * `took` whether it took any row, `landing` whether it may hold values of a push that
 * `pushed` does not count (outbox.c "Landing"; a table drain never does); returns
 * ob_drained as it was before, and in *ticket the drain's ticket (took) or 0, to be
 * passed to shmps_outbox_ack with its `pushed`. */
uint64_t shmps_outbox_drained(shmps_shard_hdr_t *h, uint64_t pushed, int took,
                              int landing, uint64_t *ticket);
/* and around it: a drain calls shmps_outbox_settle before it reads ob_pushed (it closes
 * a lost range recover left open, returning the pushes it recorded lost),
 * shmps_outbox_drain_begin before it takes anything and shmps_outbox_drain_end after
 * its bookkeeping (shmps_outbox_drained, or a partial drain's ticket) */
uint64_t shmps_outbox_settle(shmps_shard_hdr_t *h);
/* a drain that fails after it took rows (P: its ob_pushed) records the pushes it cannot
 * deliver lost and claims P as an empty drain (outbox.c); returns how many it recorded */
uint64_t shmps_outbox_drain_lost(shmps_shard_hdr_t *h, uint64_t P);
void shmps_outbox_drain_begin(shmps_shard_hdr_t *h);
/* No pusher holds an active slot of the shard now (sync.c; unlike
 * shmps_active_pushers, a count for heuristics, its loads order what follows: a table
 * outbox drain's test before it skips the freeze) */
int shmps_no_pusher_inside(const shmps_shard_hdr_t *h);
void shmps_outbox_drain_end(shmps_shard_hdr_t *h);
/* a dense push's landing slot of one outbox shard (outbox.c "Landing"): claimed before
 * its first write there; released after its writes, counting the push (count != 0) */
int shmps_landing_claim(shmps_shard_hdr_t *h, uint64_t token, uint8_t *slot);
int shmps_landing_release(shmps_shard_hdr_t *h, uint64_t token, uint8_t slot, int count);

/* updaters (updaters.c): apply grads g[0..n) to values starting at element i0 of the
 * shard at base, whose private spec is s */
int shmps_apply(void *base, const shmps_spec_t *s, uint64_t i0, uint64_t n, const void *g,
                uint64_t step);
size_t shmps_dtype_size(uint32_t dtype);
size_t shmps_grad_size(uint32_t dtype);

/* The bound of the C core's waits for a lock, a freeze or an active slot that a live
 * process holds: 60 s, or SHMPS_TEST_LOCK_TIMEOUT_S seconds (> 0) from the environment
 * as the library is loaded (proc.c; a test's process stuck behind a held lock then
 * gets its Timeout at once, as it would after 60 s: test_aggregate.py) */
extern double shmps_lock_timeout_s;
#define SHMPS_LOCK_TIMEOUT_S shmps_lock_timeout_s

/* ---- manifest (manifest.c, clock.c) ---- */
#define PROCS_OFF 4096ull
#define WORKERS_OFF (PROCS_OFF + 16ull * SHMPS_MAX_PROCS)
#define CATALOG_OFF ((uint64_t)SHMPS_CATALOG_OFF)
#define STATE_READY 1u
#define STATE_REMOVED 2u   /* being removed: gc (shmps_manifest_retire), destroy() (take_removal) */
#define STATE_RESTORING 3u /* a checkpoint is being restored into it (restore_begin/end) */
#define STATE_RETIRING 4u  /* gc deciding whether it is idle (shmps_manifest_retire) */

typedef struct {
    uint64_t magic;          /* SHMPS_MANIFEST_MAGIC, written before state (READY, release) */
    uint32_t version;        /* SHMPS_LAYOUT_VERSION */
    uint32_t header_size;    /* 4096 */
    uint64_t total_size;     /* SHMPS_MANIFEST_SIZE */
    uint64_t init_owner;     /* token of the initialiser (CAS-claimed) */
    uint32_t state;          /* 0 while initialising, then STATE_READY/REMOVED/RESTORING/RETIRING */
    uint32_t pad0;
    uint64_t catalog_len;    /* committed catalog bytes */
    uint64_t generation;     /* bumped on every catalog append */
    uint64_t created_ns;
    uint32_t ident_len;      /* bytes of ident */
    char ident[196];         /* "namespace\0store" (namespace may be empty) */
    int64_t staleness;       /* worker clocks: -1 eventual, k >= 0 bounded delay */
    uint32_t clock_seq;      /* futex word: bumped on every clock/leave/drop */
    uint32_t forward;        /* 1: pushes go to outboxes (the bridge runs); outbox.c */
    uint32_t flush_req;      /* bumped by store.flush(): the bridge drains at once */
    uint32_t ack_seq;        /* futex word: bumped by the bridge after acks (outbox.c) */
    uint32_t ack_waiters;    /* store.flush() calls sleeping on ack_seq */
    pthread_mutex_t lock __attribute__((aligned(SHMPS_CACHELINE)));
    /* forwarded pushes, store-wide (outbox.c, shmps_forward_pushed): its own cache line,
     * written by every pusher while the bridge runs, read by the bridge's flush loop */
    uint64_t fwd_pushes __attribute__((aligned(SHMPS_CACHELINE)));
    /* 1 while the bridge sleeps until a push: the first push after it wakes the bridge
     * (outbox.c, shmps_forward_idle) */
    uint32_t fwd_idle;
    /* wake-ups of a sleeping bridge by a push that could not ring its doorbell: bumped,
     * then flush_req's futex woken (not bumped: flush_req counts store.flush() calls) */
    uint32_t fwd_wakes;
    /* token of the process removing the store (shmps_manifest_retire), 0 if none */
    uint64_t retired_by;
    /* the creator's PID namespace (shmps_self_pid_ns), 0 if unknown: a token names a
     * process only within one, so attach refuses processes of another.  Claimed (CAS
     * from 0) before init_owner, and never changed after (manifest.c, claim_pid_ns) */
    uint64_t pid_ns;
} shmps_manifest_t;

typedef struct {
    uint64_t token;
    uint64_t attach_ns;
} proc_slot_t;

_Static_assert(sizeof(shmps_manifest_t) <= PROCS_OFF, "manifest header too big");
_Static_assert(__builtin_offsetof(shmps_manifest_t, flush_req) == 280 &&
               __builtin_offsetof(shmps_manifest_t, ack_seq) == 284 &&
               __builtin_offsetof(shmps_manifest_t, ack_waiters) == 288 &&
               __builtin_offsetof(shmps_manifest_t, lock) == 320 &&
               __builtin_offsetof(shmps_manifest_t, fwd_pushes) == 384 &&
               __builtin_offsetof(shmps_manifest_t, fwd_idle) == 392 &&
               __builtin_offsetof(shmps_manifest_t, fwd_wakes) == 396 &&
               __builtin_offsetof(shmps_manifest_t, retired_by) == 400, "documented offsets");
_Static_assert(WORKERS_OFF + 64ull * SHMPS_MAX_WORKERS <= CATALOG_OFF, "worker area");
_Static_assert(CATALOG_OFF + SHMPS_CATALOG_BYTES <= SHMPS_MANIFEST_SIZE, "catalog area");

typedef struct {
    uint64_t token;          /* 0 = free slot */
    uint64_t clock;          /* written only by the slot's owner (and restore) */
    uint64_t joined_ns;
    uint64_t pad[5];
} worker_slot_t;

_Static_assert(sizeof(worker_slot_t) == 64, "worker slot is one cache line");
#endif
