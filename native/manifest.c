/* The manifest: one segment per store naming its tensors and attached processes.
 *
 *   [0, 4096)                header: magic, version, init protocol, robust mutex,
 *                            catalog length and generation
 *   [4096, +16 KiB)          process slots: uint64 token, uint64 attach time (ns)
 *   [20480, +64 KiB)         worker slots (clocks), 64 bytes each
 *   [1 MiB, +4 MiB)          catalog: records of u32 length + JSON bytes, append-only
 *
 * Creation race: every attacher opens-or-creates the segment and sizes it (all to
 * the same size, so concurrent ftruncates agree), claims the store's PID namespace
 * (`pid_ns`, CAS 0 -> its own; another namespace's: refused, claim_pid_ns), then claims
 * `init_owner` by CAS 0 -> token.  The winner initialises and publishes state=READY;
 * the others wait.  If the initialiser dies, a waiter sees its token dead and takes
 * over by CAS, restarting the initialisation: bounded by the liveness check (~1 ms)
 * plus the time to initialise.
 */
#include "internal.h"
#include <errno.h>
#include <stddef.h>
#include <time.h>

static shmps_manifest_t *man(void *base) { return (shmps_manifest_t *)base; }
static proc_slot_t *procs(void *base) { return (proc_slot_t *)at(base, PROCS_OFF); }

/* restorer: 0, or the token of a restore that creates this store (checkpoint.py): the
 * store is born RESTORING and claimed by it, so no attacher ever sees it empty */
static int initialise(void *base, uint64_t size, const char *ident, uint32_t ident_len,
                      uint64_t restorer) {
    shmps_manifest_t *m = man(base);
    /* We own init_owner; anything else in the header may be a dead initialiser's
     * half-work, so rewrite all of it (state stays 0 until the end) -- but never
     * init_owner itself: a 0 there, even for an instant, would let another attacher
     * claim the initialisation too. */
    memset(base, 0, offsetof(shmps_manifest_t, init_owner));
    memset((char *)base + offsetof(shmps_manifest_t, state), 0,
           offsetof(shmps_manifest_t, pid_ns) - offsetof(shmps_manifest_t, state));
    /* ... nor pid_ns, claimed before init_owner (claim_pid_ns): a 0 there would let a
     * process of another namespace claim it, and judge our token by its /proc */
    memset((char *)base + offsetof(shmps_manifest_t, pid_ns) + sizeof m->pid_ns, 0,
           PROCS_OFF - offsetof(shmps_manifest_t, pid_ns) - sizeof m->pid_ns);
    memset(at(base, PROCS_OFF), 0, CATALOG_OFF - PROCS_OFF);
    pthread_mutexattr_t attr;
    if (pthread_mutexattr_init(&attr)) return SHMPS_E_ARG;
    pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    int r = pthread_mutex_init(&m->lock, &attr);
    pthread_mutexattr_destroy(&attr);
    if (r) return r;
    m->version = SHMPS_LAYOUT_VERSION;
    m->header_size = PROCS_OFF;
    m->total_size = size;
    m->created_ns = shmps_now_ns();
    m->staleness = -1; /* eventual until someone asks for bounded delay */
    memcpy(m->ident, ident, ident_len);
    m->ident_len = ident_len;
    m->magic = SHMPS_MANIFEST_MAGIC;
    m->retired_by = restorer;
    /* release: everything above happens-before any attacher's acquire of the state */
    STORE(&m->state, restorer ? STATE_RESTORING : STATE_READY, RELEASE);
    return SHMPS_OK;
}

int shmps_manifest_validate(const void *base, uint64_t size) {
    const shmps_manifest_t *m = (const shmps_manifest_t *)base;
    if (size != SHMPS_MANIFEST_SIZE) return SHMPS_E_CORRUPT;
    /* acquire: pairs with the release store of READY in initialise() */
    uint32_t st = LOAD(&m->state, ACQUIRE);
    if (st == STATE_REMOVED || st == STATE_RESTORING || st == STATE_RETIRING)
        return SHMPS_E_REMOVED;
    if (st != STATE_READY) return SHMPS_E_CORRUPT;
    if (m->magic != SHMPS_MANIFEST_MAGIC) return SHMPS_E_CORRUPT;
    if (m->version != SHMPS_LAYOUT_VERSION) return SHMPS_E_VERSION;
    if (m->header_size != PROCS_OFF || m->total_size != size) return SHMPS_E_CORRUPT;
    if (LOAD(&m->catalog_len, ACQUIRE) > SHMPS_CATALOG_BYTES) return SHMPS_E_CORRUPT;
    if (m->ident_len > sizeof m->ident) return SHMPS_E_CORRUPT;
    /* only ever 0 or 1 (shmps_forward_set); any other value is damage, which every push
     * would read as "forwarding on" and sum into a new outbox nothing drains */
    if (LOAD(&m->forward, RELAXED) > 1u) return SHMPS_E_CORRUPT;
    return SHMPS_OK;
}

int shmps_manifest_ident(const void *base, char *out, uint32_t cap, uint32_t *len) {
    const shmps_manifest_t *m = (const shmps_manifest_t *)base;
    uint32_t n = m->ident_len; /* immutable after READY (validated by the caller) */
    if (n > sizeof m->ident || n > cap) return SHMPS_E_CORRUPT;
    memcpy(out, m->ident, n);
    *len = n;
    return SHMPS_OK;
}

/* A manifest's PID namespace is claimed before its initialisation (CAS pid_ns 0 -> this
 * process's), and never changes after: every token in init_owner is then one of the
 * namespace pid_ns names, so a waiter judges it by its own /proc only when that is its
 * namespace too.  (pid_ns was written by initialise(): a waiter of another namespace
 * judged a live initialiser's token by its /proc, found it dead, or another process
 * under a reused pid, and took the initialisation over.)  SHMPS_E_PIDNS if the claim is
 * another namespace's; SHMPS_OK if it is this one's, or this process's is unknown (0:
 * /proc unreadable, where liveness falls back to kill(0) anyway). */
static int claim_pid_ns(shmps_manifest_t *m) {
    uint64_t ours = shmps_self_pid_ns();
    if (ours == 0) return SHMPS_OK;
    /* acq_rel: one namespace wins; a loser reads the winner's */
    uint64_t cur = 0;
    if (CAS(&m->pid_ns, &cur, ours, ACQ_REL, ACQUIRE) || cur == ours) return SHMPS_OK;
    return SHMPS_E_PIDNS;
}

int shmps_manifest_init(void *base, uint64_t size, uint64_t token, double timeout_s,
                        const char *ident, uint32_t ident_len, int restoring) {
    uint64_t restorer = restoring ? token : 0;
    if (size != SHMPS_MANIFEST_SIZE) return SHMPS_E_CORRUPT;
    if (ident_len > sizeof(((shmps_manifest_t *)0)->ident)) return SHMPS_E_ARG;
    shmps_manifest_t *m = man(base);
    shmps_wait_t w;
    shmps_wait_init(&w, timeout_s);
    for (;;) {
        uint32_t st = LOAD(&m->state, ACQUIRE); /* pairs with initialise()'s release */
        if (st != 0) return shmps_manifest_validate(base, size);
        uint64_t magic = LOAD(&m->magic, RELAXED);
        if (magic != 0 && magic != SHMPS_MANIFEST_MAGIC) return SHMPS_E_CORRUPT;
        /* taking the initialisation over would wipe the catalog of a live store (its
         * tensors orphaned, a get-or-create making an empty one over their segments) */
        if (shmps_manifest_was_ready(base)) return SHMPS_E_CORRUPT;
        /* before any look at init_owner: its token is judged only in its namespace */
        int r = claim_pid_ns(m);
        if (r) return r;
        uint64_t cur = LOAD(&m->init_owner, ACQUIRE);
        if (cur == 0) {
            /* acq_rel: we become the initialiser; ordering against a dead
             * predecessor is not needed since we rewrite everything */
            if (CAS(&m->init_owner, &cur, token, ACQ_REL, ACQUIRE))
                return initialise(base, size, ident, ident_len, restorer);
            continue;
        }
        r = shmps_wait_step(&w, cur);
        if (r == WAIT_HOLDER_DEAD) {
            if (CAS(&m->init_owner, &cur, token, ACQ_REL, ACQUIRE)) {
                /* The initialiser may have finished (READY) and then exited between
                 * our look at `state` and its death: never wipe a ready store.
                 * acquire: pairs with initialise()'s release of READY. */
                if (LOAD(&m->state, ACQUIRE) != 0)
                    return shmps_manifest_validate(base, size);
                return initialise(base, size, ident, ident_len, restorer);
            }
        } else if (r < 0) {
            return r;
        }
    }
}

int shmps_manifest_lock(void *base, double timeout_s) {
    shmps_manifest_t *m = man(base);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    double whole = (double)(long)timeout_s;
    ts.tv_sec += (time_t)whole;
    ts.tv_nsec += (long)((timeout_s - whole) * 1e9);
    if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
    int r = pthread_mutex_timedlock(&m->lock, &ts);
    if (r == 0) return SHMPS_OK;
    if (r == EOWNERDEAD) {
        /* The holder died inside.  Everything the lock guards is either committed
         * (catalog_len, released last) or ignored, so the state is consistent. */
        pthread_mutex_consistent(&m->lock);
        return SHMPS_RECOVERED;
    }
    if (r == ETIMEDOUT) return SHMPS_E_TIMEOUT;
    if (r == ENOTRECOVERABLE) return SHMPS_E_CORRUPT;
    return r;
}

int shmps_manifest_unlock(void *base) {
    int r = pthread_mutex_unlock(&man(base)->lock);
    return r ? r : SHMPS_OK;
}

int shmps_catalog_append(void *base, const char *rec, uint32_t len) {
    shmps_manifest_t *m = man(base);
    uint64_t cur = m->catalog_len; /* we hold the lock: only we append */
    if (cur > SHMPS_CATALOG_BYTES || 4ull + len > SHMPS_CATALOG_BYTES - cur) return SHMPS_E_FULL;
    char *dst = at(base, CATALOG_OFF + cur);
    memcpy(dst, &len, 4);
    memcpy(dst + 4, rec, len);
    /* release: the record bytes happen-before the length that makes them visible
     * (pairs with the acquire load in shmps_catalog_read) */
    STORE(&m->catalog_len, cur + 4 + len, RELEASE);
    FETCH_ADD(&m->generation, 1, RELEASE);
    return SHMPS_OK;
}

int shmps_catalog_read(const void *base, char *out, uint64_t cap, uint64_t *len,
                       uint64_t *generation) {
    const shmps_manifest_t *m = (const shmps_manifest_t *)base;
    /* acquire on generation, then on length: a record counted by the generation we
     * return is within the length we copy */
    *generation = LOAD(&m->generation, ACQUIRE);
    uint64_t n = LOAD(&m->catalog_len, ACQUIRE);
    if (n > SHMPS_CATALOG_BYTES) return SHMPS_E_CORRUPT;
    *len = n;
    if (n > cap) return SHMPS_E_BOUNDS;
    memcpy(out, (const char *)base + CATALOG_OFF, n);
    /* committed records never change, so the copy needs no re-check */
    return SHMPS_OK;
}

uint64_t shmps_catalog_generation(const void *base) {
    return LOAD(&((const shmps_manifest_t *)base)->generation, ACQUIRE);
}

int shmps_proc_register(void *base, uint64_t token, uint32_t *slot) {
    proc_slot_t *p = procs(base);
    for (int pass = 0; pass < 2; pass++) {
        for (uint32_t i = 0; i < SHMPS_MAX_PROCS; i++) {
            uint64_t cur = LOAD(&p[i].token, RELAXED);
            if (cur != 0 && (pass == 0 || shmps_token_alive(cur))) continue;
            /* seq_cst: claim the slot, before the attacher's load of `state`
             * (shmps_manifest_attached): the Dekker pair with shmps_manifest_retire.
             * The attach time below is advisory. */
            if (CAS(&p[i].token, &cur, token, SEQ_CST, RELAXED)) {
                STORE(&p[i].attach_ns, shmps_now_ns(), RELAXED);
                *slot = i;
                return SHMPS_OK;
            }
        }
    }
    return SHMPS_E_FULL;
}

int shmps_proc_unregister(void *base, uint64_t token, uint32_t slot) {
    if (slot >= SHMPS_MAX_PROCS) return SHMPS_E_BOUNDS;
    uint64_t cur = token;
    /* release: nothing guarded, but keep the slot's reuse ordered after our use */
    CAS(&procs(base)[slot].token, &cur, 0, RELEASE, RELAXED);
    return SHMPS_OK;
}

/* A fork's slot (store.py, the fork handlers): the parent registers a second slot under
 * its own token before fork(), and the child moves it to its token, so the store has a
 * live attached process at every instant between the parent's fork and its close(): a
 * child registering only after the fork left a gap in which the parent's close() and a
 * gc's retire removed the store under the child.  seq_cst, as a registration's CAS (the
 * Dekker pair with shmps_manifest_retire: a gc's slot load sees the parent's token or
 * the child's, both alive).  SHMPS_E_BUSY if the slot no longer holds `from`. */
int shmps_proc_handover(void *base, uint32_t slot, uint64_t from, uint64_t to) {
    if (slot >= SHMPS_MAX_PROCS || from == 0) return SHMPS_E_BOUNDS;
    uint64_t cur = from;
    return CAS(&procs(base)[slot].token, &cur, to, SEQ_CST, RELAXED) ? SHMPS_OK
                                                                    : SHMPS_E_BUSY;
}

int shmps_proc_list(void *base, uint64_t *tokens, uint32_t cap, uint32_t *n) {
    proc_slot_t *p = procs(base);
    uint32_t c = 0;
    for (uint32_t i = 0; i < SHMPS_MAX_PROCS && c < cap; i++) {
        /* seq_cst: a restore lists the attached processes after its READY -> RESTORING
         * CAS, the other half of the Dekker pair with a registration's CAS and state
         * load (shmps_manifest_restore_begin); a plain listing needs only acquire */
        uint64_t t = LOAD(&p[i].token, SEQ_CST);
        if (t) tokens[c++] = t;
    }
    *n = c;
    return SHMPS_OK;
}

/* ---- removing an idle store (shmps-tool gc) ------------------------------------------
 *
 * gc found no live process attached and unlinks the store's segments; an attacher that
 * opened the manifest meanwhile must not go on with a store whose segments disappear
 * under it (NotFound for its tensors, or pushes into memory nobody else sees while
 * later attachers create a new store).  So gc first retires the manifest:
 *
 *   gc:        claim retired_by (claim()); state READY -> RETIRING (seq_cst); then
 *              load every process slot (seq_cst): a live token undoes it all (state
 *              READY, retired_by 0) and gc leaves the store (SHMPS_E_BUSY); else it
 *              stores REMOVED (decided) and unlinks the shards, then the manifest.
 *   attacher:  register in a slot (seq_cst CAS, shmps_proc_register); then load state
 *              (seq_cst, shmps_manifest_attached): not READY -> unregister, attach anew.
 *
 * In the single order of seq_cst operations either the attacher's CAS comes before
 * gc's load of that slot (gc sees it, and the token is alive: gc backs off), or gc's
 * load comes first, so gc's store of RETIRING, before it in program order, comes before
 * the CAS and the attacher's load after it reads RETIRING (or later states).  An
 * attacher that finds the manifest not READY (shmps_manifest_init/validate:
 * SHMPS_E_REMOVED) waits while the holder of retired_by lives (a remover unlinks the
 * manifest last, after the shards: a new store made under the same name never has a
 * shard unlinked by the old removal), and runs this function itself if it died. */

/* Claim retired_by for token: from none, from a holder that died (nothing it did needs
 * undoing here: the caller looks at the state next), or already its own.  acq_rel: one
 * claimant wins; a loser (SHMPS_E_BUSY) sees the winner's token next time. */
static int claim(shmps_manifest_t *m, uint64_t token) {
    uint64_t cur = LOAD(&m->retired_by, ACQUIRE);
    if (cur == token) return SHMPS_OK;
    if (cur != 0 && shmps_token_alive(cur)) return SHMPS_E_BUSY;
    return CAS(&m->retired_by, &cur, token, ACQ_REL, ACQUIRE) ? SHMPS_OK : SHMPS_E_BUSY;
}

int shmps_manifest_retire(void *base, uint64_t token) {
    shmps_manifest_t *m = man(base);
    /* A manifest being initialised (state 0) is not judged, nor claimed: initialise()
     * writes retired_by plainly, and a claim racing it could be lost, leaving a gc
     * removing under a claim it no longer holds.  Acquire: initialise()'s writes, then
     * its release store of the state, come before; it never runs again once the state
     * is not 0. */
    if (LOAD(&m->state, ACQUIRE) == 0) return SHMPS_E_BUSY;
    if (claim(m, token)) return SHMPS_E_BUSY;
    /* REMOVED: decided (a destroy(), or a gc after its scan) by a remover that died:
     * the removal is ours to finish.  READY; RESTORING by a restorer that died (its
     * claim is ours now: a store whose restore was cut off goes like an idle one); or
     * RETIRING, a gc that died while deciding: decide again.  0 (being initialised):
     * not ours to judge yet. */
    uint32_t st = LOAD(&m->state, SEQ_CST);
    if (st == STATE_REMOVED) return SHMPS_OK;
    if ((st != STATE_READY && st != STATE_RESTORING && st != STATE_RETIRING)
            || !CAS(&m->state, &st, STATE_RETIRING, SEQ_CST, SEQ_CST)) {
        STORE(&m->retired_by, 0, RELEASE);
        return st == 0 || st == STATE_REMOVED ? SHMPS_E_BUSY : SHMPS_E_CORRUPT;
    }
    proc_slot_t *p = procs(base);
    for (uint32_t i = 0; i < SHMPS_MAX_PROCS; i++) {
        uint64_t t = LOAD(&p[i].token, SEQ_CST); /* after the RETIRING store: see above */
        if (t != 0 && shmps_token_alive(t)) {
            /* seq_cst: an attacher that read RETIRING retries, and reads READY now */
            STORE(&m->state, STATE_READY, SEQ_CST);
            STORE(&m->retired_by, 0, RELEASE);
            return SHMPS_E_BUSY;
        }
    }
    /* decided: a takeover from here on finishes the removal without a second look */
    STORE(&m->state, STATE_REMOVED, SEQ_CST);
    return SHMPS_OK;
}

/* Remove a store whose creation never finished (shmps-tool gc, remove_idle): a manifest
 * still being initialised (state 0; gc sized it first if it was still size 0, as every
 * opener does), its initialiser dead or none yet.  gc claims the initialisation as an
 * attacher taking it over would (this namespace's only: claim_pid_ns), but instead of
 * initialising it marks it REMOVED under its own retired_by, so attachers from then on
 * wait for the removal (or finish it if gc dies) and then make a new store, as they do
 * for any removal; gc unlinks it and lets go (shmps_manifest_let_go).  SHMPS_E_BUSY if
 * it is initialised (READY or later: a store now, judged as one by gc's next run), a
 * live initialiser holds it, or it is another PID namespace's. */
int shmps_manifest_remove_unborn(void *base, uint64_t token) {
    shmps_manifest_t *m = man(base);
    /* acquire: pairs with initialise()'s release of the state */
    if (LOAD(&m->state, ACQUIRE) != 0) return SHMPS_E_BUSY;
    uint64_t magic = LOAD(&m->magic, RELAXED);
    if (magic != 0 && magic != SHMPS_MANIFEST_MAGIC) return SHMPS_E_CORRUPT;
    /* its state word is damaged: removed only as a corrupt store (gc --corrupt) */
    if (shmps_manifest_was_ready(base)) return SHMPS_E_CORRUPT;
    if (claim_pid_ns(m)) return SHMPS_E_BUSY;
    uint64_t cur = LOAD(&m->init_owner, ACQUIRE);
    if (cur != 0 && shmps_token_alive(cur)) return SHMPS_E_BUSY;
    /* acq_rel: as an attacher's claim; a dead or absent initialiser's is ours now, and
     * no attacher initialises while we hold it (it waits for a live init_owner) */
    if (!CAS(&m->init_owner, &cur, token, ACQ_REL, ACQUIRE)) return SHMPS_E_BUSY;
    /* the initialiser may have finished (READY) and died between our look at the state
     * and our claim: never remove a store that way (as shmps_manifest_init) */
    if (LOAD(&m->state, ACQUIRE) != 0) return SHMPS_E_BUSY;
    STORE(&m->retired_by, token, RELEASE);
    /* seq_cst: as the state's other stores; an attacher's acquire of it sees retired_by */
    STORE(&m->state, STATE_REMOVED, SEQ_CST);
    return SHMPS_OK;
}

/* Take the removal of a store over, whoever is attached: store.destroy() (global by
 * contract), or an attacher that found the remover dead (attach() then finishes it).
 * Claims retired_by from none, a dead remover or this caller, then marks the manifest
 * REMOVED (seq_cst, as in shmps_manifest_retire: attachers from now on wait, and
 * finish the removal if this caller dies).  SHMPS_E_BUSY while a live remover holds it
 * (gc deciding whether the store is idle, or removing it): the caller waits for it to
 * let go or for the manifest to be gone, and never removes shards it did not list
 * under its own claim (a removal racing a second one could unlink the shards of a new
 * store made under the name after the first unlinked the manifest). */
int shmps_manifest_take_removal(void *base, uint64_t token) {
    shmps_manifest_t *m = man(base);
    if (claim(m, token)) return SHMPS_E_BUSY;
    STORE(&m->state, STATE_REMOVED, SEQ_CST);
    return SHMPS_OK;
}

/* A destroy() interrupted in a live process (an exception between its take_removal and
 * its last unlink) lets go of its claim: the state stays REMOVED, which nothing turns
 * back, and the next attach or gc finishes the removal as it does a dead remover's
 * (claim() takes a retired_by of 0) instead of waiting for this process to exit.  Only
 * for REMOVED: a RESTORING store let go while its restorer is still registered would be
 * put back READY, half restored, by a gc's retire.  Release: the removal's stores come
 * before a takeover's acquire of the claim.  SHMPS_E_ARG if the caller holds no claim
 * or the store is not REMOVED. */
int shmps_manifest_let_go(void *base, uint64_t token) {
    shmps_manifest_t *m = man(base);
    if (LOAD(&m->state, SEQ_CST) != STATE_REMOVED) return SHMPS_E_ARG;
    uint64_t cur = token;
    return CAS(&m->retired_by, &cur, 0, RELEASE, RELAXED) ? SHMPS_OK : SHMPS_E_ARG;
}

/* Restoring a checkpoint into a store (checkpoint.py, restore()): until restore_end,
 * attachers wait as for a removal (the state is not READY: shmps_manifest_validate
 * answers SHMPS_E_REMOVED, and a registration that reads it backs off: the Dekker pair
 * of shmps_manifest_retire, with RESTORING for RETIRING), so no process sees a
 * half-restored store; if the restorer dies, the next attach (or gc) removes the
 * partial store (retired_by dead: shmps_manifest_retire).  restore_begin claims
 * retired_by (claim(): SHMPS_E_BUSY while a live remover or restorer holds it), then
 * CASes READY -> RESTORING (seq_cst). */
int shmps_manifest_restore_begin(void *base, uint64_t token) {
    shmps_manifest_t *m = man(base);
    /* acquire: pairs with a claim; a store born RESTORING for this restorer
     * (shmps_manifest_init with restoring) has its claim already */
    uint64_t was = LOAD(&m->retired_by, ACQUIRE);
    if (claim(m, token)) return SHMPS_E_BUSY;
    uint32_t ready = STATE_READY;
    if (!CAS(&m->state, &ready, STATE_RESTORING, SEQ_CST, SEQ_CST)) {
        if (ready == STATE_RESTORING && was == token) return SHMPS_OK;
        STORE(&m->retired_by, 0, RELEASE);
        return SHMPS_E_BUSY;
    }
    return SHMPS_OK;
}

/* The restore is complete: READY again (seq_cst, as the state's other stores; it also
 * orders the restored catalog before any attacher's acquire of READY), then the claim
 * is let go.  SHMPS_E_ARG if this caller is not the restorer. */
int shmps_manifest_restore_end(void *base, uint64_t token) {
    shmps_manifest_t *m = man(base);
    if (LOAD(&m->retired_by, ACQUIRE) != token) return SHMPS_E_ARG;
    uint32_t restoring = STATE_RESTORING;
    if (!CAS(&m->state, &restoring, STATE_READY, SEQ_CST, SEQ_CST)) return SHMPS_E_ARG;
    STORE(&m->retired_by, 0, RELEASE);
    return SHMPS_OK;
}

int shmps_manifest_attached(const void *base, uint64_t token) {
    const shmps_manifest_t *m = (const shmps_manifest_t *)base;
    /* seq_cst: after the registration's CAS (the attacher's half of the pair above) */
    uint32_t st = LOAD(&m->state, SEQ_CST);
    /* a store born RESTORING (or being restored) is attached to by its restorer only */
    return st == STATE_READY
        || (st == STATE_RESTORING && LOAD(&m->retired_by, ACQUIRE) == token);
}

/* May a process attached to this store create tensors in it?  READY; RETIRING (a gc
 * deciding: it sees the attached caller and puts READY back); RESTORING by the caller.
 * Not REMOVED (destroyed: what it made would be orphans) nor another's restore. */
int shmps_manifest_usable(const void *base, uint64_t token) {
    /* seq_cst: as the state's other loads; destroy() sets REMOVED before it takes the
     * manifest lock, which a creator holds across this check and its creation */
    return LOAD(&((const shmps_manifest_t *)base)->state, SEQ_CST) == STATE_RETIRING
        || shmps_manifest_attached(base, token);
}

/* A manifest at state 0 ("being created") that has catalog words was READY once:
 * initialise() zeroes them before it publishes READY, and the state never goes back to
 * 0, so its state word is damaged, not a dead initialiser's half-work.  Relaxed: read
 * only at state 0, where nothing publishes them. */
int shmps_manifest_was_ready(const void *base) {
    const shmps_manifest_t *m = (const shmps_manifest_t *)base;
    return LOAD(&m->catalog_len, RELAXED) != 0 || LOAD(&m->generation, RELAXED) != 0;
}

uint32_t shmps_manifest_state(const void *base) {
    /* acquire: as an attacher's load; for shmps-tool ls, which reads without attaching */
    return LOAD(&((const shmps_manifest_t *)base)->state, ACQUIRE);
}

uint64_t shmps_manifest_pid_ns(const void *base) {
    /* written before the release store of the state, which the attacher acquired */
    return ((const shmps_manifest_t *)base)->pid_ns;
}

uint64_t shmps_manifest_init_owner(const void *base) {
    /* acquire: pairs with the claim; for gc's look at a restore's new manifest */
    return LOAD(&((const shmps_manifest_t *)base)->init_owner, ACQUIRE);
}

uint64_t shmps_manifest_retired_by(const void *base) {
    /* acquire: pairs with a claim; for messages (who removes or restores) */
    return LOAD(&((const shmps_manifest_t *)base)->retired_by, ACQUIRE);
}
