/* Private specs: what this process believes about each shard's layout.
 *
 * A shard's spec (its inputs and the layout derived from them) is immutable once
 * shmps_shard_init has published the segment, and shmps_shard_validate checks it once,
 * on attach.  The copy in the shard header stays writable by any process of the user,
 * so no entry point reads it after that: each one takes the copy kept here, in private
 * memory, keyed by the mapping's base address.  shmps_shard_init and
 * shmps_shard_validate fill it (keep); shmps_shard_forget, called by Python before it
 * unmaps the segment (Segment.close), empties it; nothing else changes an entry (a
 * validation that fails, or finds another spec, leaves it as it was).  A later write into the header then
 * changes nothing C reads as a size or an offset (docs/segment-layout.md, "The spec is
 * private after attach").
 *
 * The registry: an open-addressing hash table (linear probing, backward-shift deletion)
 * of pointers to heap entries, under a read-write lock.  Lookups (every entry point,
 * once per shard it touches; a call touching several shards looks them up together,
 * shmps_specs_of) take the read lock, so concurrent pushers (a push split over threads)
 * do not wait for each other; keep/forget (attach, create, close) take the write lock
 * and are the only callers that allocate.  An entry's address is stable from
 * keep to forget, so a lookup returns a pointer into it: it stays valid as long as the
 * mapping does, and a caller using a mapping while another thread unmaps it was already
 * wrong (the segment's pages vanish at the same moment).
 *
 * fork: the child inherits the table with the mappings (both are copies of the parent's
 * memory); the write lock is held across fork so the table is whole, and the child
 * initialises a fresh lock (the parent's writer was another thread).
 */
#include "internal.h"
#include <errno.h>
#include <stdlib.h>

typedef struct {
    const void *base;
    shmps_spec_t spec;
} spec_ent_t;

static pthread_rwlock_t reg_lock = PTHREAD_RWLOCK_INITIALIZER;
static pthread_once_t reg_once = PTHREAD_ONCE_INIT;
static spec_ent_t **reg_slots; /* reg_cap slots, NULL = empty */
static uint64_t reg_cap, reg_used;

static void reg_prepare(void) { pthread_rwlock_wrlock(&reg_lock); }
static void reg_parent(void) { pthread_rwlock_unlock(&reg_lock); }
static void reg_child(void) { pthread_rwlock_init(&reg_lock, NULL); }
static void reg_setup(void) { pthread_atfork(reg_prepare, reg_parent, reg_child); }

static uint64_t slot_of(const void *base, uint64_t cap) {
    /* mappings are page-aligned: the page number, Fibonacci-hashed */
    return (((uint64_t)(uintptr_t)base >> 12) * 0x9e3779b97f4a7c15ull) >> 32 & (cap - 1);
}

/* The slot holding base's entry, or the empty slot where it would go (caller holds the
 * lock; the table is never full: load <= 1/2). */
static uint64_t probe(spec_ent_t **slots, uint64_t cap, const void *base) {
    uint64_t i = slot_of(base, cap);
    while (slots[i] && slots[i]->base != base) i = (i + 1) & (cap - 1);
    return i;
}

/* Doubles the table (write lock held); ENOMEM leaves it as it was. */
static int grow(void) {
    uint64_t cap = reg_cap ? 2 * reg_cap : 64;
    spec_ent_t **slots = calloc(cap, sizeof *slots);
    if (!slots) return ENOMEM;
    for (uint64_t i = 0; i < reg_cap; i++)
        if (reg_slots[i]) slots[probe(slots, cap, reg_slots[i]->base)] = reg_slots[i];
    free(reg_slots);
    reg_slots = slots;
    reg_cap = cap;
    return SHMPS_OK;
}

const shmps_spec_t *shmps_spec_of(const void *base) {
    const shmps_spec_t *s = NULL;
    pthread_rwlock_rdlock(&reg_lock);
    if (reg_cap) {
        spec_ent_t *e = reg_slots[probe(reg_slots, reg_cap, base)];
        if (e) s = &e->spec;
    }
    pthread_rwlock_unlock(&reg_lock);
    return s;
}

/* The specs of n mappings at once (out[i]: bases[i]'s, or NULL), under one read lock:
 * a call touching several shards pays the lock (most of a lookup's ~30 ns: the lock
 * word's cache line moves between the cores of concurrent callers) once, then a probe
 * per shard.  Returns the number of bases not found. */
uint64_t shmps_specs_of(void *const *bases, uint64_t n, const shmps_spec_t **out) {
    uint64_t missing = 0;
    pthread_rwlock_rdlock(&reg_lock);
    for (uint64_t i = 0; i < n; i++) {
        spec_ent_t *e = reg_cap ? reg_slots[probe(reg_slots, reg_cap, bases[i])] : NULL;
        out[i] = e ? &e->spec : NULL;
        missing += !e;
    }
    pthread_rwlock_unlock(&reg_lock);
    return missing;
}

int shmps_spec_keep(const void *base, const shmps_spec_t *spec) {
    pthread_once(&reg_once, reg_setup);
    int r = SHMPS_OK;
    pthread_rwlock_wrlock(&reg_lock);
    if (reg_cap) {
        spec_ent_t *e = reg_slots[probe(reg_slots, reg_cap, base)];
        /* The mapping is known already.  The same spec (creation validates what it
         * wrote): it stays.  Another: its header changed under a live mapping, whose
         * users (and Python's buffers, sized by its Shard.spec) follow the first one, so
         * it stays too, and the new one is refused.  (A mapping unmapped without forget
         * would be refused the same way; every unmap path forgets: Segment.close, and a
         * finalizer for Segments dropped without it.) */
        if (e) {
            r = memcmp(&e->spec, spec, sizeof *spec) ? SHMPS_E_CORRUPT : SHMPS_OK;
            goto out;
        }
    }
    if (2 * (reg_used + 1) > reg_cap && (r = grow())) goto out;
    spec_ent_t *e = malloc(sizeof *e);
    if (!e) { r = ENOMEM; goto out; }
    e->base = base;
    e->spec = *spec;
    reg_slots[probe(reg_slots, reg_cap, base)] = e;
    reg_used++;
out:
    pthread_rwlock_unlock(&reg_lock);
    return r;
}

int shmps_shard_forget(const void *base) {
    pthread_rwlock_wrlock(&reg_lock);
    uint64_t i = reg_cap ? probe(reg_slots, reg_cap, base) : 0;
    if (reg_cap && reg_slots[i]) {
        free(reg_slots[i]);
        reg_slots[i] = NULL;
        reg_used--;
        /* backward shift: move up each later entry of the run that may no longer be
         * reachable past the hole (its home slot is not cyclically in (i, j]) */
        for (uint64_t j = (i + 1) & (reg_cap - 1); reg_slots[j]; j = (j + 1) & (reg_cap - 1)) {
            uint64_t home = slot_of(reg_slots[j]->base, reg_cap);
            int reachable = i <= j ? (home > i && home <= j) : (home > i || home <= j);
            if (reachable) continue;
            reg_slots[i] = reg_slots[j];
            reg_slots[j] = NULL;
            i = j;
        }
    }
    pthread_rwlock_unlock(&reg_lock);
    return SHMPS_OK;
}
