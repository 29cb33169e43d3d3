/* Embedding tables: uint64 keys -> rows of `dim` values, sharded by a hash of the key.
 *
 * Hashing.  h = splitmix64_mix(key + 0x9e3779b97f4a7c15) (a bijection: distinct keys
 * never collide in h).  The high 32 bits choose the shard (multiply-shift:
 * ((h >> 32) * nshards) >> 32), the low bits the home slot in that shard's index.
 *
 * Per shard (segment layout: layout.c, docs/tables.md):
 *   keys[nrows]       the key of each row (colidx_off)
 *   values, state     nrows x dim each; rowstep[nrows] per-row push count (Adam's t);
 *                     in an outbox, the list of rows pushed to ("Outbox drains")
 *   stripes[nrows]    per row {owner: lock word, last_step: the table step of its last
 *                     push}; tables keep the seqlock counter in the index slot instead
 *   index[nslots]     {key, state} slots, nslots a power of two >= 2 * nrows
 *   ctl               control block (tctl_t below)
 *   rowmeta[nrows]    {link}: free-list link, or LINK_LIVE
 *
 * Slot state word: tag (bits 63-62) | seq (bits 61-41) | row + 1 (bits 40-0).  Tags:
 * 0 EMPTY (the whole word 0); CLAIM (low bits: the creator's token) while a creator
 * fills the slot; READY once published; TOMB after a delete.  `seq` is the row's
 * seqlock counter (odd while a pusher writes the row), so a lookup loads, in one word,
 * the row and the version a pull then validates: a pull touches the index slot and the
 * row's values, nothing else.  Lookups are lock-free: probe linearly from the home
 * slot, acquire-load each state, stop at EMPTY.
 *
 * Creation.  A batch first looks its keys up lock-free.  Only if some are missing does
 * it take the table's creation lock (a lock word in shard 0's control block, with
 * dead-owner takeover), look the missing keys up again, count them, and check the
 * capacity of the table (exact: `capacity` keys in all) and of every shard (rows in
 * its segment).  If anything is short it returns SHMPS_E_FULL having changed nothing.
 * Otherwise each new key claims a slot by CAS (EMPTY/TOMB -> CLAIM|token), gets a row
 * (free list, else the next never-used row), its row is initialised from (seed, key),
 * the key is written, and the slot is published READY|(row+1) with release.  Existing
 * keys are never blocked by this lock.
 *
 * Updates.  A batch's duplicate keys are grouped (a small hash in the caller's
 * scratch) and their gradients combined (summed; max/min; assign: the last), so each
 * distinct key is updated once per push: its row lock (stripe owner) is held while the
 * updater runs on the row and its optimizer state, its step is incremented (per-row
 * step: lazy Adam) and its push count and last push step recorded.  Row locks are per
 * row, so pushers to different rows never wait for each other.
 *
 * Deletion and eviction free rows for reuse, so they must not run while a batch that
 * looked up a row may still use it.  Every batch (push, pull, contains, keys) runs
 * between shmps_enter/shmps_leave of each shard it touches; delete and evict freeze
 * the shard (which waits for those batches to leave and keeps new ones out), then take
 * the creation lock, tombstone slots and put rows on the free list.  Lock order:
 * enter -> creation lock (creators); freeze -> creation lock (deleters); a creator
 * never waits for a freeze while holding the creation lock, so there is no cycle.
 *
 * Crashes.  A dead holder of a row lock or the creation lock is taken over after ~1 ms
 * (shmps_stripe_lock).  Taking over the creation lock runs table_repair(): every CLAIM
 * slot becomes TOMB, and each shard's live rows, free list and counters are rebuilt
 * from the READY slots (plus rows marked live whose slot a dead compaction or delete
 * had not yet rewritten, which are re-inserted).  A push killed mid-row leaves the
 * row's seq odd; the next pusher of that row (taking the lock over) closes it, and a
 * pull that keeps seeing it odd takes the lock over itself and closes it.
 */
#include "internal.h"
#include <math.h>
#include <stdlib.h>

#define GAMMA 0x9e3779b97f4a7c15ull
#define ST_EMPTY 0ull
#define ST_CLAIM (1ull << 63)
#define ST_READY (1ull << 62)
#define ST_TOMB (3ull << 62)
#define ST_TAGS (3ull << 62)
#define ST_LOW (~ST_TAGS)
#define ST_ROWBITS 41
#define ST_ROW(st) ((st) & ((1ull << ST_ROWBITS) - 1)) /* row + 1 */
#define ST_SEQ_ONE (1ull << ST_ROWBITS)
#define ST_SEQ_MASK (((1ull << 21) - 1) << ST_ROWBITS)
#define ST_ODD(st) (((st) & ST_SEQ_ONE) != 0)
#define LINK_LIVE UINT64_MAX        /* rowmeta.link of a live row */
#define LINK_SEEN (UINT64_MAX - 1)  /* repair: referenced by a READY slot */
#define CTL_MAGIC 0x4c54435453504d48ull /* "HMPSTCTL" */
#define PF 24                       /* prefetch distance of row updates and copies, keys */
#define LPF 32                      /* prefetch distance of lookups (cheaper steps) */
#define WPF 16                      /* rows looked up ahead of their write (write_rows) */
#define NONE UINT64_MAX
#define READ_TRIES 64               /* optimistic row copies before locking */

typedef struct {
    uint64_t key;
    uint64_t state;
} tslot_t;

typedef struct {
    uint64_t magic;      /* CTL_MAGIC, written by shmps_table_setup */
    uint64_t capacity;   /* keys the whole table may hold */
    uint32_t nshards, shard;
    uint64_t pad0[5];
    shmps_stripe_t create __attribute__((aligned(64))); /* shard 0: the creation lock */
    uint64_t table_live; /* shard 0: keys in the whole table */
    uint64_t hwm;        /* rows of this shard handed out at least once */
    uint64_t free_head;  /* first free row + 1, 0 = none */
    uint64_t tombstones; /* TOMB slots in this shard's index */
    uint64_t repairs;    /* times table_repair ran (statistics) */
    uint64_t backed;     /* an outbox shard: rows whose pages its pushers backed, and, once
                          * > 0, its index and links (shmps_table_set_backed) */
} tctl_t;

_Static_assert(sizeof(tctl_t) <= SHMPS_TABLE_CTL_BYTES, "table control block too big");
_Static_assert(SHMPS_TABLE_ROWMETA_BYTES == 8, "rowmeta is one link word");
_Static_assert(sizeof(shmps_stripe_t) == 16, "stripe: owner + 8 bytes of last_step");

/* One shard's arrays, derived from its private spec (shmps_spec_of). */
typedef struct {
    char *base;
    shmps_shard_hdr_t *h;
    const shmps_spec_t *s;
    tslot_t *slots;
    uint64_t mask, nrows, rowbytes;
    uint64_t *keys, *rowstep, *link;
    shmps_stripe_t *stripes;
    tctl_t *ctl;
} tshard_t;

/* A table row's stripe is {owner, aux}: aux (the 8 bytes of seq/pad, which tables do
 * not use for a seqlock: the seq lives in the index slot) packs the times the row's key
 * was pushed (bits 63-40; every occurrence in a batch counts; saturating at 2^24 - 1)
 * and the table step of its last push (bits 39-0, modulo 2^40), next to the lock word a
 * push holds anyway. */
#define AUX_STEP_BITS 40
#define AUX_STEP_MASK ((1ull << AUX_STEP_BITS) - 1)
#define AUX_PUSHES_MAX ((1ull << 24) - 1)
static inline uint64_t *aux_of(tshard_t *t, uint64_t row) {
    return (uint64_t *)((char *)&t->stripes[row] + 8);
}
static inline uint64_t aux_pushes(uint64_t aux) { return aux >> AUX_STEP_BITS; }
static inline uint64_t aux_last(uint64_t aux) { return aux & AUX_STEP_MASK; }
static inline uint64_t aux_make(uint64_t pushes, uint64_t last) {
    if (pushes > AUX_PUSHES_MAX) pushes = AUX_PUSHES_MAX;
    return (pushes << AUX_STEP_BITS) | (last & AUX_STEP_MASK);
}
/* Updaters whose formula reads the per-row step (rowstep[]): the others never touch
 * that array on a push. */
static inline int uses_step(const shmps_spec_t *s) {
    return s->updater == SHMPS_MOMENTUM || s->updater == SHMPS_ADAGRAD ||
           s->updater == SHMPS_ADAM;
}

static inline uint64_t mix64(uint64_t z) { /* splitmix64's finaliser */
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t shmps_key_hash(uint64_t key) { return mix64(key + GAMMA); }

static inline uint32_t shard_of(uint64_t h, uint32_t nshards) {
    return (uint32_t)(((h >> 32) * (uint64_t)nshards) >> 32);
}

uint32_t shmps_key_shard(uint64_t key, uint32_t nshards) {
    return nshards ? shard_of(shmps_key_hash(key), nshards) : 0;
}

int shmps_key_shards(const uint64_t *keys, uint64_t n, uint32_t nshards, uint32_t *out) {
    if (nshards == 0) return SHMPS_E_ARG;
    for (uint64_t i = 0; i < n; i++) out[i] = shard_of(shmps_key_hash(keys[i]), nshards);
    return SHMPS_OK;
}

/* ---- deterministic init ----------------------------------------------------------
 * A row's generator is splitmix64 started at R = mix64(key ^ mix64(seed + GAMMA)):
 * word c (c = 0, 1, ...) is mix64(R + (c + 1) * GAMMA).  uniform(a, b): value j is
 * a + (b - a) * u_j with u_j = (word j >> 11) * 2^-53.  normal(mean, std): values 2p
 * and 2p+1 come from words 2p, 2p+1 by Box-Muller: u1 = ((w >> 11) + 1) * 2^-53 in
 * (0, 1], u2 = (w' >> 11) * 2^-53, r = sqrt(-2 ln u1), z0 = r cos(2 pi u2),
 * z1 = r sin(2 pi u2).  Computed in double, then rounded to the dtype. */
static double init_value(const double *init, uint64_t r0, uint64_t j) {
    switch ((int)init[0]) {
    case SHMPS_INIT_CONSTANT: return init[1];
    case SHMPS_INIT_UNIFORM: {
        double u = (double)(mix64(r0 + (j + 1) * GAMMA) >> 11) * 0x1.0p-53;
        return init[1] + (init[2] - init[1]) * u;
    }
    case SHMPS_INIT_NORMAL: {
        uint64_t p = j >> 1;
        double u1 = (double)((mix64(r0 + (2 * p + 1) * GAMMA) >> 11) + 1) * 0x1.0p-53;
        double u2 = (double)(mix64(r0 + (2 * p + 2) * GAMMA) >> 11) * 0x1.0p-53;
        double rad = sqrt(-2.0 * log(u1));
        double z = (j & 1) ? rad * sin(2.0 * M_PI * u2) : rad * cos(2.0 * M_PI * u2);
        return init[1] + init[2] * z;
    }
    default: return 0.0;
    }
}

static int fill_init(const double *init, uint64_t seed, uint64_t key, uint32_t dtype,
                     uint64_t dim, void *out) {
    int kind = (int)init[0];
    if (kind < SHMPS_INIT_ZEROS || kind > SHMPS_INIT_NORMAL) return SHMPS_E_ARG;
    uint64_t r0 = mix64(key ^ mix64(seed + GAMMA));
    size_t isz = shmps_dtype_size(dtype);
    if (isz == 0) return SHMPS_E_ARG;
    if (kind == SHMPS_INIT_ZEROS) {
        memset(out, 0, dim * isz);
        return SHMPS_OK;
    }
    for (uint64_t j = 0; j < dim; j++) {
        double v = init_value(init, r0, j);
        switch (dtype) {
        case SHMPS_FLOAT16: ((_Float16 *)out)[j] = (_Float16)v; break;
        case SHMPS_FLOAT32: ((float *)out)[j] = (float)v; break;
        case SHMPS_FLOAT64: ((double *)out)[j] = v; break;
        case SHMPS_INT8: ((int8_t *)out)[j] = (int8_t)(int64_t)v; break;
        case SHMPS_INT32: ((int32_t *)out)[j] = (int32_t)(int64_t)v; break;
        }
    }
    return SHMPS_OK;
}

int shmps_table_init_values(const double *init, uint64_t seed, uint64_t key, uint32_t dtype,
                            uint64_t dim, void *out) {
    return fill_init(init, seed, key, dtype, dim, out);
}

/* ---- shards ---------------------------------------------------------------------- */

/* The control block of the shard at base, whose private spec (shmps_spec_of) is s. */
static tctl_t *ctl_of(void *base, const shmps_spec_t *s) {
    return (tctl_t *)at(base, s->index_off + 16 * s->nslots);
}

int shmps_table_setup(void *base, uint64_t capacity, uint32_t nshards, uint32_t shard) {
    const shmps_spec_t *s = shmps_spec_of(base);
    if (!s || s->kind != SHMPS_TABLE || nshards == 0 || nshards > SHMPS_TABLE_MAX_SHARDS ||
        shard >= nshards || capacity == 0)
        return SHMPS_E_ARG;
    tctl_t *c = ctl_of(base, s);
    memset(c, 0, sizeof *c);
    c->capacity = capacity;
    c->nshards = nshards;
    c->shard = shard;
    /* release: the control block is written before its magic (pairs with the acquire
     * loads in shard_views and attach_check); the segment is not yet in the catalog */
    STORE(&c->magic, CTL_MAGIC, RELEASE);
    return SHMPS_OK;
}

int shmps_table_attach_check(const void *base, uint64_t capacity, uint32_t nshards,
                             uint32_t shard) {
    const shmps_spec_t *s = shmps_spec_of(base);
    if (!s) return SHMPS_E_ARG;
    if (s->kind != SHMPS_TABLE || s->nrows >= (1ull << ST_ROWBITS)) return SHMPS_E_CORRUPT;
    const tctl_t *c = ctl_of((void *)base, s);
    /* acquire: pairs with the release store of magic in shmps_table_setup */
    if (LOAD(&c->magic, ACQUIRE) != CTL_MAGIC || c->capacity != capacity ||
        c->nshards != nshards || c->shard != shard)
        return SHMPS_E_CORRUPT;
    /* relaxed: a sanity check of counters changed under the creation lock; each bound
     * holds at every instant, whatever else is read with it (the checks relating two
     * counters are shmps_table_attach_counts, under the lock) */
    if (LOAD(&c->hwm, RELAXED) > s->nrows || LOAD(&c->free_head, RELAXED) > s->nrows ||
        LOAD(&((const shmps_shard_hdr_t *)base)->table_used, RELAXED) > s->nrows ||
        (shard == 0 && LOAD(&c->table_live, RELAXED) > capacity))
        return SHMPS_E_CORRUPT;
    return SHMPS_OK;
}

/* Fills the views of shard 0 and of the shards whose bit is set in want[] (NULL: every
 * shard), from their private specs, looked up together (shmps_specs_of: one lock), and
 * checks they belong to one table.  The other entries of ts are left unset: a batch
 * (push, pull, contains, row_stats) views the shards its keys hash to, a call on one
 * shard that shard, and each reads no other view but shard 0's (the table's dtype and
 * updater, its creation lock, step and key count); a taker of the creation lock views
 * them all before it repairs (table_repair). */
static int shard_views(void **bases, uint32_t nshards, const uint64_t *want, tshard_t *ts) {
    if (nshards == 0 || nshards > SHMPS_TABLE_MAX_SHARDS || !bases) return SHMPS_E_ARG;
    void *vb[SHMPS_TABLE_MAX_SHARDS];
    const shmps_spec_t *vs[SHMPS_TABLE_MAX_SHARDS];
    uint32_t vi[SHMPS_TABLE_MAX_SHARDS], m = 0;
    for (uint32_t w = 0; w < (nshards + 63) / 64; w++) {
        uint64_t bits = want ? want[w] : ~0ull;
        if (w == 0) bits |= 1; /* shard 0 */
        for (; bits; bits &= bits - 1) {
            uint32_t i = 64 * w + (uint32_t)__builtin_ctzll(bits);
            if (i >= nshards) break;
            if (!bases[i]) return SHMPS_E_ARG;
            vb[m] = bases[i], vi[m++] = i;
        }
    }
    if (shmps_specs_of(vb, m, vs)) return SHMPS_E_ARG;
    for (uint32_t k = 0; k < m; k++) { /* vi[0] == 0: shard 0 is viewed first */
        uint32_t i = vi[k];
        tshard_t *t = &ts[i];
        t->base = (char *)bases[i];
        t->h = hdr_of(bases[i]);
        const shmps_spec_t *s = t->s = vs[k];
        if (s->kind != SHMPS_TABLE || s->nslots == 0 || (s->nslots & (s->nslots - 1)) ||
            s->nrows >= (1ull << ST_ROWBITS))
            return SHMPS_E_CORRUPT;
        if (i > 0 && (s->dtype != ts[0].s->dtype || s->row_len != ts[0].s->row_len ||
                      s->updater != ts[0].s->updater))
            return SHMPS_E_CORRUPT;
        t->slots = (tslot_t *)at(bases[i], s->index_off);
        t->mask = s->nslots - 1;
        t->nrows = s->nrows;
        t->rowbytes = s->row_len * s->itemsize;
        t->keys = (uint64_t *)at(bases[i], s->colidx_off);
        t->rowstep = (uint64_t *)at(bases[i], s->rowstep_off);
        t->stripes = (shmps_stripe_t *)at(bases[i], s->stripes_off);
        t->ctl = ctl_of(bases[i], s);
        t->link = (uint64_t *)((char *)t->ctl + SHMPS_TABLE_CTL_BYTES);
        /* acquire: pairs with the release store of magic in shmps_table_setup */
        if (LOAD(&t->ctl->magic, ACQUIRE) != CTL_MAGIC || t->ctl->nshards != nshards ||
            t->ctl->shard != i)
            return SHMPS_E_CORRUPT;
    }
    return SHMPS_OK;
}

/* The views of shard 0 and of `shard` (SHMPS_E_BOUNDS if the table has no such
 * shard): for the calls on one shard. */
static int shard_view(void **bases, uint32_t nshards, uint32_t shard, tshard_t *ts) {
    uint64_t want[SHMPS_TABLE_MAX_SHARDS / 64] = {0};
    if (shard < SHMPS_TABLE_MAX_SHARDS) want[shard >> 6] = 1ull << (shard & 63);
    int r = shard_views(bases, nshards, want, ts);
    if (r) return r;
    return shard < nshards ? SHMPS_OK : SHMPS_E_BOUNDS;
}

/* Row of `key` (hash h) in shard t: >= 0 found, -1 absent, -2 corrupt.  When found,
 * *slot_out gets the slot index and *state_out the state word read (row + seq).
 * Lock-free. */
static inline int64_t find(const tshard_t *t, uint64_t h, uint64_t key, uint64_t *slot_out,
                           uint64_t *state_out) {
    uint64_t i = h & t->mask;
    for (uint64_t probes = 0; probes <= t->mask; probes++, i = (i + 1) & t->mask) {
        /* acquire: pairs with the release store publishing READY in insert_key, and
         * with a pusher's release store of an even seq (write_end): the key and the
         * row's values read after this load are at least that new. */
        uint64_t st = LOAD(&t->slots[i].state, ACQUIRE);
        if (st == ST_EMPTY) return -1;
        /* relaxed: a READY slot's key is stable while we are entered in the shard */
        if ((st & ST_TAGS) == ST_READY && LOAD(&t->slots[i].key, RELAXED) == key) {
            uint64_t r = ST_ROW(st) - 1;
            if (ST_ROW(st) == 0 || r >= t->nrows) return -2;
            if (slot_out) *slot_out = i;
            if (state_out) *state_out = st;
            return (int64_t)r;
        }
    }
    return -1;
}

/* ---- a row's seqlock (in its slot's state word) ------------------------------------
 * Only the holder of the row's lock changes the seq bits of a READY slot (creation,
 * delete and compaction change other slots, or run frozen). */
static inline void row_write_begin(tslot_t *sl) {
    /* relaxed load and store: we hold the row lock, so we are the only writer of these
     * bits (its acquire CAS ordered us after the previous holder's release) */
    uint64_t st = LOAD(&sl->state, RELAXED);
    /* a dead writer may have left it odd: it stays odd until our write_end */
    if (!ST_ODD(st)) STORE(&sl->state, (st & ~ST_SEQ_MASK) | ((st + ST_SEQ_ONE) & ST_SEQ_MASK), RELAXED);
    /* release fence: the odd seq is visible before any of the value stores that follow
     * (pairs with the reader's acquire fence before its re-check) */
    __atomic_thread_fence(RELEASE);
}

static inline void row_write_end(tslot_t *sl) {
    uint64_t st = LOAD(&sl->state, RELAXED); /* relaxed: only we write it (row lock) */
    /* release: the value stores happen-before the even seq (pairs with find()'s or
     * read_row()'s acquire load of the state) */
    STORE(&sl->state, (st & ~ST_SEQ_MASK) | ((st + ST_SEQ_ONE) & ST_SEQ_MASK), RELEASE);
}

/* Copies a row that a lookup saw with state `st` (acquire-loaded): optimistic, then
 * under the row lock if writers keep interfering or one died mid-write. */
static int read_row(tshard_t *t, uint64_t slot, uint64_t st, uint64_t token, char *dst,
                    const char *src, size_t nbytes) {
    tslot_t *sl = &t->slots[slot];
    for (int attempt = 0; attempt < READ_TRIES; attempt++) {
        if (!ST_ODD(st)) {
            memcpy(dst, src, nbytes);
            /* acquire fence: the copy's loads complete before the re-check (pairs with
             * row_write_begin's release fence) */
            __atomic_thread_fence(ACQUIRE);
            if (LOAD(&sl->state, RELAXED) == st) return SHMPS_OK;
        }
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        /* acquire: pairs with row_write_end's release store */
        st = LOAD(&sl->state, ACQUIRE);
    }
    int r = shmps_stripe_lock(&t->stripes[ST_ROW(st) - 1], token, SHMPS_LOCK_TIMEOUT_S,
                              &t->h->stats.takeovers);
    if (r < 0) return r;
    memcpy(dst, src, nbytes);
    /* relaxed: we hold the row lock (acquire), no one else changes the seq now */
    st = LOAD(&sl->state, RELAXED);
    if (ST_ODD(st)) row_write_end(sl); /* a dead writer's: close it so readers go on */
    shmps_stripe_unlock(&t->stripes[ST_ROW(st) - 1]);
    return SHMPS_OK;
}

/* ---- scratch -----------------------------------------------------------------------
 * hash, slot, state uint64[n] | row int64[n] | first, next, groups, tail int32[n] |
 * mh int32[m] (m = power of two >= 2n) | agg double[dim] */
#define A64(x) (((x) + 63ull) & ~63ull)

static uint64_t mh_slots(uint64_t n) {
    uint64_t m = 16;
    while (m < 2 * n) m <<= 1;
    return m;
}

/* Batches above this many keys (2^56) are no caller's: no machine holds their keys,
 * and the sizes below would wrap (mh_slots would not end).  Their scratch is
 * UINT64_MAX bytes, which no caller can give, so they are refused with SHMPS_E_ARG. */
#define TABLE_MAX_BATCH (1ull << 56)

uint64_t shmps_table_scratch_bytes(uint64_t n, uint64_t dim) {
    if (n > TABLE_MAX_BATCH || dim > TABLE_MAX_BATCH) return UINT64_MAX;
    return A64(8 * n) * 4 + A64(4 * n) * 4 + A64(4 * mh_slots(n)) + A64(8 * dim) + 64;
}

/* The scratch a call that uses only its hash array (contains, row_stats) needs. */
uint64_t shmps_table_hash_scratch_bytes(uint64_t n) {
    return n > TABLE_MAX_BATCH ? UINT64_MAX : A64(8 * n) + 64;
}

typedef struct {
    void **bases;
    uint32_t nshards;
    uint64_t token, n, ngroups;
    const uint64_t *keys;
    uint64_t *hash, *slot, *state;
    int64_t *row;
    int32_t *first, *next, *groups, *tail, *mh;
    char *agg;
    uint64_t touched[SHMPS_TABLE_MAX_SHARDS / 64];
    uint32_t active[SHMPS_TABLE_MAX_SHARDS];
} batch_t;

static int carve(batch_t *b, void *scratch, uint64_t bytes, uint64_t dim) {
    if (bytes < shmps_table_scratch_bytes(b->n, dim) || bytes == UINT64_MAX || !scratch)
        return SHMPS_E_ARG;
    char *p = (char *)A64((uintptr_t)scratch);
    uint64_t n = b->n;
    b->hash = (uint64_t *)p; p += A64(8 * n); /* (filled already: hash_keys) */
    b->slot = (uint64_t *)p; p += A64(8 * n);
    b->state = (uint64_t *)p; p += A64(8 * n);
    b->row = (int64_t *)p; p += A64(8 * n);
    b->first = (int32_t *)p; p += A64(4 * n);
    b->next = (int32_t *)p; p += A64(4 * n);
    b->groups = (int32_t *)p; p += A64(4 * n);
    b->tail = (int32_t *)p; p += A64(4 * n);
    b->mh = (int32_t *)p; p += A64(4 * mh_slots(n));
    b->agg = p;
    return SHMPS_OK;
}

/* Hashes every key into the scratch and marks the shards touched.  First in a batch:
 * the shards touched are the ones it views (shard_views), and the scratch is carved
 * once shard 0's view gives the row length, so the hashes go where carve puts them
 * (the scratch's first array), bounds checked here. */
static int hash_keys(batch_t *b, void *scratch, uint64_t bytes) {
    if (b->nshards == 0 || b->nshards > SHMPS_TABLE_MAX_SHARDS) return SHMPS_E_ARG;
    memset(b->touched, 0, sizeof b->touched);
    if (b->n == 0) return SHMPS_OK;
    if (!scratch || bytes < shmps_table_hash_scratch_bytes(b->n) || bytes == UINT64_MAX)
        return SHMPS_E_ARG;
    b->hash = (uint64_t *)A64((uintptr_t)scratch);
    for (uint64_t i = 0; i < b->n; i++) {
        uint64_t h = shmps_key_hash(b->keys[i]);
        b->hash[i] = h;
        uint32_t s = shard_of(h, b->nshards);
        b->touched[s >> 6] |= 1ull << (s & 63);
    }
    return SHMPS_OK;
}

/* Groups equal keys (all of them, or only those whose row is still -1): first[i] is
 * the first occurrence, next[] chains the others in order, groups[] lists the first
 * occurrences.  A small hash table in the scratch; O(n). */
static void group_keys(batch_t *b, int only_missing) {
    uint64_t m = mh_slots(b->n), mask = m - 1, ng = 0;
    memset(b->mh, 0xff, m * sizeof(int32_t));
    for (uint64_t i = 0; i < b->n; i++) {
        if (only_missing && b->row[i] >= 0) continue;
        uint64_t k = b->keys[i];
        uint64_t j = (b->hash[i] >> 7) & mask; /* bits apart from the home slot's */
        for (;;) {
            int32_t f = b->mh[j];
            if (f < 0) {
                b->mh[j] = (int32_t)i;
                b->first[i] = b->tail[i] = (int32_t)i;
                b->next[i] = -1;
                b->groups[ng++] = (int32_t)i;
                break;
            }
            if (b->keys[f] == k) {
                b->first[i] = f;
                b->next[i] = -1;
                b->next[b->tail[f]] = (int32_t)i;
                b->tail[f] = (int32_t)i;
                break;
            }
            j = (j + 1) & mask;
        }
    }
    b->ngroups = ng;
}

static inline int touched(const batch_t *b, uint32_t s) {
    return (b->touched[s >> 6] >> (s & 63)) & 1;
}

static void leave_all(batch_t *b, tshard_t *ts, uint32_t upto) {
    for (uint32_t s = 0; s < upto; s++)
        if (touched(b, s)) shmps_leave(ts[s].base, b->token, b->active[s]);
}

/* Enters every touched shard in increasing order (see the lock order above). */
static int enter_all(batch_t *b, tshard_t *ts) {
    for (uint32_t s = 0; s < b->nshards; s++) {
        if (!touched(b, s)) continue;
        int r = shmps_enter(ts[s].base, b->token, SHMPS_LOCK_TIMEOUT_S, &b->active[s]);
        if (r < 0) {
            leave_all(b, ts, s);
            return r;
        }
    }
    return SHMPS_OK;
}

/* Prefetches the home slot of hash h in shard t, where a lookup of its key starts:
 * in a large shard every lookup's first load is a miss, so the loops that look keys up
 * one after another prefetch the slot LPF keys ahead (lookups, creation, a replica's
 * writes, the outbox drain).  A macro: see PREFETCH_ROW on literal rw arguments. */
#define PREFETCH_HOME(t, h, RW) __builtin_prefetch(&(t)->slots[(h) & (t)->mask], RW, 3)

/* Looks up keys list[0..cnt) (list NULL: every key) into row[], slot[], state[];
 * returns the number missing, or a negative code.  Home slots are prefetched. */
static int64_t lookup_keys(batch_t *b, tshard_t *ts, const int32_t *list, uint64_t cnt) {
    int64_t missing = 0;
    for (uint64_t k = 0; k < cnt; k++) {
        if (k + LPF < cnt) {
            uint64_t hp = b->hash[list ? (uint64_t)list[k + LPF] : k + LPF];
            const tshard_t *tp = &ts[shard_of(hp, b->nshards)];
            PREFETCH_HOME(tp, hp, 0); /* locality t0: t2 measured slower */
        }
        uint64_t i = list ? (uint64_t)list[k] : k;
        uint64_t h = b->hash[i];
        int64_t r = find(&ts[shard_of(h, b->nshards)], h, b->keys[i], &b->slot[i], &b->state[i]);
        if (r == -2) return SHMPS_E_CORRUPT;
        b->row[i] = r;
        missing += r < 0;
    }
    return missing;
}

/* ---- creation ------------------------------------------------------------------- */

static void init_row(tshard_t *t, uint64_t r, uint64_t key, uint64_t step) {
    const shmps_spec_t *s = t->s;
    uint64_t dim = s->row_len;
    fill_init(s->init, s->seed, key, s->dtype, dim, at(t->base, s->value_off + r * t->rowbytes));
    for (uint32_t k = 0; k < s->nstate && k < SHMPS_MAX_STATE; k++) {
        char *st = at(t->base, s->state_off[k] + r * dim * s->state_itemsize);
        double v = (s->updater == SHMPS_ADAGRAD && k == 0) ? s->params[3] : 0.0;
        if (v == 0.0) {
            memset(st, 0, dim * s->state_itemsize);
        } else if (s->state_dtype == SHMPS_FLOAT64) {
            for (uint64_t j = 0; j < dim; j++) ((double *)st)[j] = v;
        } else {
            for (uint64_t j = 0; j < dim; j++) ((float *)st)[j] = (float)v;
        }
    }
    /* relaxed: the row is not reachable until its slot is published (release) */
    STORE(&t->rowstep[r], 0, RELAXED);
    STORE(aux_of(t, r), aux_make(0, step), RELAXED);
}

/* Inserts `key` (not present; creation lock held) with a new row; returns the row or a
 * negative code, and the slot in *slot_out.  Capacity was checked by the caller. */
static int64_t insert_key(tshard_t *t, tctl_t *c0, uint64_t h, uint64_t key, uint64_t token,
                          uint64_t step, uint64_t *slot_out) {
    uint64_t i = h & t->mask, target = NONE, seen = 0;
    for (uint64_t probes = 0; probes <= t->mask; probes++, i = (i + 1) & t->mask) {
        /* relaxed: slots change tag only under the creation lock, which we hold */
        uint64_t st = LOAD(&t->slots[i].state, RELAXED);
        if (st == ST_EMPTY || st == ST_TOMB) {
            target = i;
            seen = st;
            break;
        }
    }
    if (target == NONE) return SHMPS_E_CORRUPT; /* load <= 1/2: cannot happen */
    uint64_t expected = seen;
    /* acq_rel: the claim is ordered before the row and key writes that follow (a
     * repair after our death sees CLAIM and tombstones the slot) */
    if (!CAS(&t->slots[target].state, &expected, ST_CLAIM | (token & ST_LOW), ACQ_REL, RELAXED))
        return SHMPS_E_CORRUPT; /* only the creation lock holder claims slots */
    tctl_t *c = t->ctl;
    uint64_t r;
    /* relaxed (here and below): hwm, free_head, links change only under the lock */
    uint64_t fh = LOAD(&c->free_head, RELAXED);
    if (fh) {
        r = fh - 1;
        if (r >= t->nrows) return SHMPS_E_CORRUPT;
        uint64_t next = LOAD(&t->link[r], RELAXED);
        if (next > t->nrows) return SHMPS_E_CORRUPT;
        STORE(&c->free_head, next, RELAXED);
    } else {
        r = LOAD(&c->hwm, RELAXED);
        if (r >= t->nrows) return SHMPS_E_CORRUPT; /* capacity was checked */
        STORE(&c->hwm, r + 1, RELAXED);
    }
    init_row(t, r, key, step);
    /* relaxed: ordered before the lookups that need them by the release store of READY
     * below (find's acquire load pairs with it) */
    STORE(&t->keys[r], key, RELAXED);
    STORE(&t->slots[target].key, key, RELAXED);
    /* release: the row's values, state, key and the slot key happen-before any lookup
     * that acquire-loads READY (find) */
    STORE(&t->slots[target].state, ST_READY | (r + 1), RELEASE);
    /* release: pairs with the acquire load of link in shmps_table_keys */
    STORE(&t->link[r], LINK_LIVE, RELEASE);
    if (seen == ST_TOMB) STORE(&c->tombstones, LOAD(&c->tombstones, RELAXED) - 1, RELAXED);
    /* relaxed: counters, read as statistics or under the creation lock */
    FETCH_ADD(&t->h->table_used, 1, RELAXED);
    FETCH_ADD(&c0->table_live, 1, RELAXED);
    *slot_out = target;
    return (int64_t)r;
}

/* Re-inserts live row r (key not in the index) during repair; 0 or a code. */
static int reinsert(tshard_t *t, uint64_t r, uint64_t key, uint64_t token) {
    uint64_t i = shmps_key_hash(key) & t->mask;
    for (uint64_t p = 0; p <= t->mask; p++, i = (i + 1) & t->mask) {
        /* relaxed: slot tags change only under the creation lock, which we hold */
        uint64_t st = LOAD(&t->slots[i].state, RELAXED);
        if (st != ST_EMPTY && st != ST_TOMB) continue;
        uint64_t exp = st;
        /* acq_rel: as insert_key's claim */
        if (!CAS(&t->slots[i].state, &exp, ST_CLAIM | (token & ST_LOW), ACQ_REL, RELAXED))
            return SHMPS_E_CORRUPT;
        STORE(&t->slots[i].key, key, RELAXED);
        /* release: pairs with find()'s acquire */
        STORE(&t->slots[i].state, ST_READY | (r + 1), RELEASE);
        if (st == ST_TOMB)
            STORE(&t->ctl->tombstones, LOAD(&t->ctl->tombstones, RELAXED) - 1, RELAXED);
        return SHMPS_OK;
    }
    return SHMPS_E_CORRUPT;
}

/* Repair's marks of the rows READY slots reference: a private bitmap of a shard's rows
 * (`bits`), or, only if that could not be allocated, LINK_SEEN in the shared link words
 * (as before 2026-11-27: readers outside the creation lock -- keys(), read_rows(keys =
 * NULL), a checkpoint's copy of the links -- then miss those rows until step 2). */
static inline int seen_get(const tshard_t *t, const uint64_t *bits, uint64_t r) {
    if (bits) return (int)((bits[r >> 6] >> (r & 63)) & 1);
    return LOAD(&t->link[r], RELAXED) == LINK_SEEN; /* relaxed: under the creation lock */
}
static inline void seen_set(tshard_t *t, uint64_t *bits, uint64_t r) {
    if (bits) bits[r >> 6] |= 1ull << (r & 63);
    else STORE(&t->link[r], LINK_SEEN, RELAXED);
}

/* Whether shard t's bookkeeping already agrees with its index (`live` READY slots, their
 * rows marked in `bits`; `tombs` TOMB slots): each of those rows and no other marked
 * live, the free list holding every other row below hwm once, the counters right.  The
 * repair then writes nothing more in the shard, so a shard the dead creator never got
 * to is never rewritten under the readers that do not take the creation lock.  Relaxed
 * loads: under the creation lock, whose holders alone write these words. */
static int shard_sound(const tshard_t *t, const uint64_t *bits, uint64_t hwm, uint64_t live,
                       uint64_t tombs) {
    for (uint64_t r = 0; r < hwm; r++)
        if (seen_get(t, bits, r) != (LOAD(&t->link[r], RELAXED) == LINK_LIVE)) return 0;
    uint64_t nfree = 0; /* a cycle runs past hwm - live and is refused */
    for (uint64_t f = LOAD(&t->ctl->free_head, RELAXED); f; f = LOAD(&t->link[f - 1], RELAXED))
        if (f > hwm || seen_get(t, bits, f - 1) || ++nfree > hwm - live) return 0;
    return nfree == hwm - live && LOAD(&t->h->table_used, RELAXED) == live &&
           LOAD(&t->ctl->tombstones, RELAXED) == tombs;
}

/* Rebuilds every shard's bookkeeping from its index (ts: a view of every shard);
 * creation lock held after taking it over from a dead holder.  Concurrent lock-free
 * lookups only ever see CLAIM slots turn into TOMB and missing keys become READY, both
 * of which they handle; pushers only touch READY slots' seq bits, which repair leaves
 * alone.  Readers of the link
 * words that do not take the creation lock (shmps_table_keys, read_rows(keys=NULL),
 * a drain's list, a checkpoint's raw copy of the links) run meanwhile too: a live row's
 * link is never changed (the rows READY slots reference are marked in private memory,
 * seen_set), and a shard whose bookkeeping already agrees with its index is not
 * written at all (shard_sound). */
static int table_repair(tshard_t *ts, uint32_t nshards, uint64_t token) {
    uint64_t total = 0, maxrows = 0;
    for (uint32_t s = 0; s < nshards; s++)
        if (ts[s].nrows > maxrows) maxrows = ts[s].nrows;
    /* not the push path: a repair runs once per creator that died holding the lock */
    uint64_t *bits = calloc(maxrows / 64 + 1, sizeof *bits);
    for (uint32_t s = 0; s < nshards; s++) {
        tshard_t *t = &ts[s];
        tctl_t *c = t->ctl;
        /* relaxed throughout: the dead holder's writes are as visible as they will get
         * (its lock word was taken over by CAS); lookups only care about slot states */
        uint64_t hwm = LOAD(&c->hwm, RELAXED);
        if (hwm > t->nrows) { free(bits); return SHMPS_E_CORRUPT; }
        uint64_t tombs = 0, live = 0, ready = 0;
        if (bits) memset(bits, 0, (hwm / 64 + 1) * sizeof *bits);
        /* 0. a repair that died half-way (in the fallback) left SEEN marks: those rows
         * were live */
        for (uint64_t r = 0; r < hwm; r++)
            if (LOAD(&t->link[r], RELAXED) == LINK_SEEN) STORE(&t->link[r], LINK_LIVE, RELAXED);
        /* 1. dead claims become tombstones; rows referenced by READY slots are marked */
        for (uint64_t i = 0; i <= t->mask; i++) {
            uint64_t st = LOAD(&t->slots[i].state, RELAXED);
            if ((st & ST_TAGS) == ST_CLAIM) {
                /* release: a lookup that sees TOMB needs nothing else from us */
                STORE(&t->slots[i].state, ST_TOMB, RELEASE);
                st = ST_TOMB;
            }
            if (st == ST_TOMB) {
                tombs++;
            } else if ((st & ST_TAGS) == ST_READY) {
                uint64_t r = ST_ROW(st) - 1;
                if (ST_ROW(st) == 0 || r >= hwm ||
                    LOAD(&t->keys[r], RELAXED) != LOAD(&t->slots[i].key, RELAXED) ||
                    seen_get(t, bits, r)) {
                    free(bits);
                    return SHMPS_E_CORRUPT;
                }
                seen_set(t, bits, r);
                ready++;
            }
        }
        FETCH_ADD(&c->repairs, 1, RELAXED);
        if (bits && shard_sound(t, bits, hwm, ready, tombs)) {
            total += ready;
            continue;
        }
        STORE(&c->tombstones, tombs, RELAXED);
        /* 2. rows still marked live but unreferenced (a delete or compaction died
         * between its steps) go back into the index; the rest become the free list */
        uint64_t head = 0;
        for (uint64_t r = hwm; r-- > 0;) {
            uint64_t link = LOAD(&t->link[r], RELAXED);
            if (seen_get(t, bits, r)) {
                /* release: pairs with the acquire loads of link in shmps_table_keys
                 * and read_rows (a READY row a dead creator had not marked yet) */
                if (link != LINK_LIVE) STORE(&t->link[r], LINK_LIVE, RELEASE);
                live++;
                continue;
            }
            if (link == LINK_LIVE) {
                uint64_t key = LOAD(&t->keys[r], RELAXED), h = shmps_key_hash(key);
                if (shard_of(h, nshards) == s && find(t, h, key, NULL, NULL) == -1) {
                    int rr = reinsert(t, r, key, token);
                    if (rr) { free(bits); return rr; }
                    live++;
                    continue;
                }
            }
            STORE(&t->link[r], head, RELAXED);
            head = r + 1;
        }
        STORE(&c->free_head, head, RELAXED);
        STORE(&t->h->table_used, live, RELAXED);
        total += live;
    }
    free(bits);
    if (LOAD(&ts[0].ctl->table_live, RELAXED) != total)
        STORE(&ts[0].ctl->table_live, total, RELAXED);
    return SHMPS_OK;
}

/* Takes the creation lock; taken over from a dead holder, repairs the table first.
 * bases: every shard (ts may hold only some views: shard_views).
 *
 * The repair needs a view of every shard.  A caller that cannot view them all for a
 * reason of its own (a shard it has not mapped, whose spec it does not hold:
 * SHMPS_E_ARG) repaired nothing: it hands the lock back to the dead holder (its token
 * again, release: the next taker's acquire CAS pairs with it) and fails, so the next
 * taker repairs, the dead creator's claimed slots and rows with it (released clean,
 * before 2026-11-27, nothing repaired them: review 15 F8).  Damage every process would
 * meet -- a control block that is not the table's (SHMPS_E_CORRUPT), or a corrupt index
 * or row met part way through the repair -- releases the lock clean: handed back, it
 * failed every later call that takes the lock, in every process, each after a takeover
 * (review 17 F1); table.check() reports the damage. */
static int create_lock_within(void **bases, tshard_t *ts, uint32_t nshards, uint64_t token,
                              double timeout_s) {
    shmps_stripe_t *lk = &ts[0].ctl->create;
    uint64_t dead = 0;
    int r = shmps_stripe_lock_was(lk, token, timeout_s, &ts[0].h->stats.takeovers, &dead);
    if (r < 0) return r;
    if (r == SHMPS_RECOVERED) {
        /* the caller viewed the shards it touches: the repair needs them all */
        int rr = shard_views(bases, nshards, NULL, ts);
        if (rr == SHMPS_E_ARG) {   /* this caller's: another may view them all */
            STORE(&lk->owner, dead, RELEASE);
            return rr;
        }
        if (rr) {                  /* a damaged control block: every caller's */
            shmps_stripe_unlock(lk);
            return rr;
        }
        if ((rr = table_repair(ts, nshards, token)) < 0) {
            shmps_stripe_unlock(lk);
            return rr;
        }
    }
    return SHMPS_OK;
}

static int create_lock(void **bases, tshard_t *ts, uint32_t nshards, uint64_t token) {
    return create_lock_within(bases, ts, nshards, token, SHMPS_LOCK_TIMEOUT_S);
}

static void create_unlock(tshard_t *ts) { shmps_stripe_unlock(&ts[0].ctl->create); }

/* PREFETCH_HOME of group g's key, if there is such a group and its key is missing
 * (row -1): the creation loops below look each missing key up again and then insert
 * it, and without this every insert waited for its slot's line (a profile of a table
 * outbox push: 77 % of insert_key on that load). */
#define PREFETCH_MISSING(b, ts, g, RW)                                                   \
    do {                                                                                 \
        if ((g) < (b)->ngroups && (b)->row[(b)->groups[(g)]] < 0) {                      \
            uint64_t hp_ = (b)->hash[(b)->groups[(g)]];                                  \
            PREFETCH_HOME(&(ts)[shard_of(hp_, (b)->nshards)], hp_, RW);                 \
        }                                                                                \
    } while (0)

/* Creates the keys of the groups whose row is -1, all or none.  info (on
 * SHMPS_E_FULL): new keys needed, keys used, capacity, and the shard that is full
 * (UINT64_MAX: the table as a whole); (on SHMPS_E_UNBACKED, an outbox's) the rows of
 * shard info[3] that must be backed, [0, info[0]), those backed, and its rows. */
static int create_missing(batch_t *b, tshard_t *ts, uint64_t step, uint64_t *info) {
    int r = create_lock(b->bases, ts, b->nshards, b->token);
    if (r < 0) return r;
    uint64_t newcnt[SHMPS_TABLE_MAX_SHARDS];
    memset(newcnt, 0, sizeof(uint64_t) * b->nshards);
    uint64_t total = 0;
    for (uint64_t g = 0; g < b->ngroups; g++) {
        PREFETCH_MISSING(b, ts, g + LPF, 0);
        int32_t i = b->groups[g];
        if (b->row[i] >= 0) continue;
        uint64_t h = b->hash[i];
        uint32_t s = shard_of(h, b->nshards);
        int64_t row = find(&ts[s], h, b->keys[i], &b->slot[i], &b->state[i]); /* created meanwhile? */
        if (row == -2) { create_unlock(ts); return SHMPS_E_CORRUPT; }
        b->row[i] = row;
        if (row < 0) newcnt[s]++, total++;
    }
    tctl_t *c0 = ts[0].ctl;
    if (total) {
        /* relaxed: changed only under the creation lock, which we hold */
        uint64_t live = LOAD(&c0->table_live, RELAXED);
        if (live + total > c0->capacity) {
            if (info) info[0] = total, info[1] = live, info[2] = c0->capacity, info[3] = UINT64_MAX;
            create_unlock(ts);
            return SHMPS_E_FULL;
        }
        for (uint32_t s = 0; s < b->nshards; s++) {
            if (!newcnt[s]) continue; /* (not viewed, maybe) */
            /* relaxed: changed only under the creation lock, which we hold */
            uint64_t used = LOAD(&ts[s].h->table_used, RELAXED);
            if (used + newcnt[s] > ts[s].nrows) {
                if (info) info[0] = newcnt[s], info[1] = used, info[2] = ts[s].nrows, info[3] = s;
                create_unlock(ts);
                return SHMPS_E_FULL;
            }
            if (!(ts[s].s->flags & SHMPS_F_OUTBOX)) continue;
            /* An outbox is created without its pages: the rows it hands out are backed
             * by its pushers first (outbox.py), up to `backed`, so that none is written
             * into a page /dev/shm then has no room for (SIGBUS).  The free rows (hwm -
             * used, handed out before) are backed; the rest come from hwm on.  Acquire:
             * pairs with shmps_table_set_backed's release, after its backing. */
            uint64_t hwm = LOAD(&ts[s].ctl->hwm, RELAXED);
            uint64_t fresh = newcnt[s] > hwm - used ? newcnt[s] - (hwm - used) : 0;
            uint64_t backed = LOAD(&ts[s].ctl->backed, ACQUIRE);
            if (backed == 0 || hwm + fresh > backed) {
                if (info) info[0] = hwm + fresh, info[1] = backed, info[2] = ts[s].nrows, info[3] = s;
                create_unlock(ts);
                return SHMPS_E_UNBACKED;
            }
        }
        for (uint64_t g = 0; g < b->ngroups && r == SHMPS_OK; g++) {
            PREFETCH_MISSING(b, ts, g + LPF, 1);
            int32_t i = b->groups[g];
            if (b->row[i] >= 0) continue;
            uint64_t h = b->hash[i];
            tshard_t *t = &ts[shard_of(h, b->nshards)];
            int64_t row = insert_key(t, c0, h, b->keys[i], b->token, step, &b->slot[i]);
            if (row < 0) {
                r = (int)row;
            } else {
                b->row[i] = row;
                b->state[i] = ST_READY | ((uint64_t)row + 1);
            }
        }
    }
    create_unlock(ts);
    return r;
}

/* Groups the missing keys, creates them (all or none) and gives every occurrence its
 * row, slot and state.  For batches looked up key by key (pulls). */
static int create_for_missing(batch_t *b, tshard_t *ts, uint64_t step, uint64_t *info) {
    group_keys(b, 1);
    int r = create_missing(b, ts, step, info);
    if (r) return r;
    for (uint64_t i = 0; i < b->n; i++) {
        if (b->row[i] >= 0) continue;
        int32_t f = b->first[i];
        b->row[i] = b->row[f], b->slot[i] = b->slot[f], b->state[i] = b->state[f];
    }
    return SHMPS_OK;
}

/* ---- push ----------------------------------------------------------------------- */

/* Copies row `row` of t to position k of the outputs (any of which may be NULL). */
static void copy_row_out(const tshard_t *t, uint64_t row, uint64_t k, void *vals,
                         void *const *states, uint64_t *rowsteps) {
    const shmps_spec_t *s = t->s;
    if (vals)
        memcpy((char *)vals + k * t->rowbytes, t->base + s->value_off + row * t->rowbytes,
               t->rowbytes);
    uint64_t sb = s->row_len * s->state_itemsize;
    for (uint32_t j = 0; states && j < s->nstate && j < SHMPS_MAX_STATE; j++)
        memcpy((char *)states[j] + k * sb, t->base + s->state_off[j] + row * sb, sb);
    /* relaxed: the caller holds the shard frozen or the row's lock, so no pusher
     * changes it now */
    if (rowsteps) rowsteps[k] = LOAD(&t->rowstep[row], RELAXED);
}

/* Prefetches what updating (PF_WRITE) or copying (PF_READ) row r at slot `slot`
 * touches.  A macro: __builtin_prefetch needs literal rw/locality arguments (GCC drops
 * the prefetch, silently, when they reach it through an inline function's parameter);
 * without -mprfchw a write hint is emitted as prefetcht0. */
#define PF_READ 0
#define PF_WRITE 1
#define PREFETCH_ROW(t, r, slot, RW)                                                    \
    do {                                                                                \
        const tshard_t *t_ = (t);                                                       \
        uint64_t r_ = (r);                                                              \
        __builtin_prefetch(&t_->slots[(slot)], RW, 3); /* seq: usually still in L2 */  \
        const char *v_ = t_->base + t_->s->value_off + r_ * t_->rowbytes;               \
        uint64_t n_ = t_->rowbytes < 512 ? t_->rowbytes : 512;                          \
        for (uint64_t o_ = 0; o_ < n_; o_ += 64) __builtin_prefetch(v_ + o_, RW, 3);    \
        if (RW) {                                                                       \
            __builtin_prefetch(&t_->stripes[r_], 1, 3);                                 \
            if (uses_step(t_->s)) __builtin_prefetch(&t_->rowstep[r_], 1, 3);           \
            uint64_t sb_ = t_->s->row_len * t_->s->state_itemsize;                      \
            uint64_t m_ = sb_ < 512 ? sb_ : 512;                                        \
            for (uint32_t k_ = 0; k_ < t_->s->nstate && k_ < SHMPS_MAX_STATE; k_++) {   \
                const char *st_ = t_->base + t_->s->state_off[k_] + r_ * sb_;           \
                for (uint64_t o_ = 0; o_ < m_; o_ += 64) __builtin_prefetch(st_ + o_, 1, 3); \
            }                                                                           \
        }                                                                               \
    } while (0)

#define COMBINE_LOOP(T, OP)                                                              \
    do {                                                                                  \
        T *a_ = (T *)b->agg;                                                              \
        const T *g_ = (const T *)grad + (uint64_t)j * dim;                                \
        for (uint64_t e = 0; e < dim; e++) OP;                                            \
    } while (0)

/* The gradient group i's occurrences amount to, for the table's updater: the sum (sum,
 * SGD, and the stateful updaters), the element-wise max or min, or the last one
 * (assign).  Integer sums wrap.  Built in agg (the gradient dtype) unless the key
 * occurs once; *occ gets how many times it occurs. */
static const void *combine(const batch_t *b, int32_t i, const char *grad, uint32_t gdt,
                           uint32_t updater, uint64_t dim, uint64_t *occ) {
    size_t gsz = shmps_dtype_size(gdt);
    *occ = 1;
    if (b->next[i] < 0) return grad + (uint64_t)i * dim * gsz;
    if (updater == SHMPS_ASSIGN) {
        int32_t last = i;
        for (int32_t j = b->next[i]; j >= 0; j = b->next[j]) last = j, (*occ)++;
        return grad + (uint64_t)last * dim * gsz;
    }
    memcpy(b->agg, grad + (uint64_t)i * dim * gsz, dim * gsz);
    for (int32_t j = b->next[i]; j >= 0; j = b->next[j]) {
        (*occ)++;
        switch (gdt * 16 + (updater == SHMPS_MAX ? 1 : updater == SHMPS_MIN ? 2 : 0)) {
        case SHMPS_FLOAT64 * 16: COMBINE_LOOP(double, a_[e] += g_[e]); break;
        case SHMPS_FLOAT64 * 16 + 1: COMBINE_LOOP(double, a_[e] = g_[e] > a_[e] ? g_[e] : a_[e]); break;
        case SHMPS_FLOAT64 * 16 + 2: COMBINE_LOOP(double, a_[e] = g_[e] < a_[e] ? g_[e] : a_[e]); break;
        case SHMPS_FLOAT32 * 16: COMBINE_LOOP(float, a_[e] += g_[e]); break;
        case SHMPS_FLOAT32 * 16 + 1: COMBINE_LOOP(float, a_[e] = g_[e] > a_[e] ? g_[e] : a_[e]); break;
        case SHMPS_FLOAT32 * 16 + 2: COMBINE_LOOP(float, a_[e] = g_[e] < a_[e] ? g_[e] : a_[e]); break;
        case SHMPS_INT32 * 16: COMBINE_LOOP(int32_t, a_[e] = (int32_t)((uint32_t)a_[e] + (uint32_t)g_[e])); break;
        case SHMPS_INT32 * 16 + 1: COMBINE_LOOP(int32_t, a_[e] = g_[e] > a_[e] ? g_[e] : a_[e]); break;
        case SHMPS_INT32 * 16 + 2: COMBINE_LOOP(int32_t, a_[e] = g_[e] < a_[e] ? g_[e] : a_[e]); break;
        case SHMPS_INT8 * 16: COMBINE_LOOP(int8_t, a_[e] = (int8_t)((uint8_t)a_[e] + (uint8_t)g_[e])); break;
        case SHMPS_INT8 * 16 + 1: COMBINE_LOOP(int8_t, a_[e] = g_[e] > a_[e] ? g_[e] : a_[e]); break;
        case SHMPS_INT8 * 16 + 2: COMBINE_LOOP(int8_t, a_[e] = g_[e] < a_[e] ? g_[e] : a_[e]); break;
        }
    }
    return b->agg;
}

/* Where a push copies each updated row (shmps_table_push_read), or NULL. */
typedef struct {
    void *vals;
    void *const *states;
    uint64_t *rowsteps;
} rows_out_t;

/* Under the lock of row `row` (slot `slot`): one updater application of g0 (standing
 * for `occ` occurrences of the key in the batch), one more step (for updaters that use
 * it), the push count and last push step; with `out`, the row as it now is is copied
 * to position i of the outputs and to every later occurrence of the key (next[]);
 * then unlocks. */
static inline int update_row(tshard_t *t, uint64_t row, uint64_t slot, uint64_t dim,
                             const void *g0, uint64_t step, int stepped, uint64_t occ,
                             const rows_out_t *out, const batch_t *b, int32_t i,
                             int *was_clean) {
    tslot_t *sl = &t->slots[slot];
    row_write_begin(sl);
    /* relaxed: rowstep and aux are written only under the row lock; evict reads them
     * frozen, row_stats as statistics */
    uint64_t rs = 1;
    if (stepped) {
        rs = LOAD(&t->rowstep[row], RELAXED) + 1;
        STORE(&t->rowstep[row], rs, RELAXED);
    }
    int r = shmps_apply(t->base, t->s, row * dim, dim, g0, rs);
    uint64_t *aux = aux_of(t, row);
    uint64_t pushes = aux_pushes(LOAD(aux, RELAXED));
    /* an outbox row no push touched since the last drain: this pusher lists it (under
     * the row lock, so one pusher a drain sees it clean) */
    if (was_clean) *was_clean = pushes == 0;
    STORE(aux, aux_make(pushes + occ, step), RELAXED);
    if (out && r == SHMPS_OK)
        /* under the row lock: values, state and step are those of one moment, as a
         * read under the shard's freeze would give them */
        for (int32_t j = i; j >= 0; j = b->next[j])
            copy_row_out(t, row, (uint64_t)j, out->vals, out->states, out->rowsteps);
    row_write_end(sl);
    shmps_stripe_unlock(&t->stripes[row]);
    return r;
}

/* A push found its outbox full (SHMPS_E_FULL from create_missing, which names in
 * `shard` the first shard short of rows, UINT64_MAX for the table as a whole), of keys
 * kept from earlier drains maybe: a drain of their shard removes those once it scans
 * ("Outbox drains"), and a shard holding kept keys and nothing listed is not even
 * frozen by its drain unless asked.  So ask for a scan (ob_rescan: relaxed, a hint; the
 * bridge finds the shards busy, shmps_outbox_busy) every shard whose keys may stand in
 * the way: a shard full, every shard the push viewed (another may be full too: asked
 * one refusal at a time, each cost the pusher's retry a bridge round; review 17 F2);
 * the table full, every shard (each one's kept keys count against its capacity, and
 * this push's keys may hash to none of them), viewed here on this failure path only, so
 * that a base is written through only once its spec says it is a shard of this table:
 * if some shard cannot be viewed, the shards the push viewed, and shard 0. */
static void ask_rescan(void **bases, uint32_t nshards, tshard_t *ts, const batch_t *b,
                       uint64_t shard) {
    if (shard < nshards) {
        for (uint32_t s = 0; s < nshards; s++)
            if (touched(b, s)) STORE(&ts[s].h->ob_rescan, 1, RELAXED);
        return;
    }
    /* the views of every shard; those of the shards the push viewed are left as they
     * were (the same words again, or, on a failure part way, untouched) */
    int all = shard_views(bases, nshards, NULL, ts) == SHMPS_OK;
    for (uint32_t s = 0; s < nshards; s++)
        if (all || s == 0 || touched(b, s)) STORE(&ts[s].h->ob_rescan, 1, RELAXED);
}

static int table_push(void **bases, uint32_t nshards, uint64_t token, const uint64_t *keys,
                      uint64_t n, const void *grad, uint32_t grad_dtype, int check,
                      void *scratch, uint64_t scratch_bytes, uint64_t *info,
                      const rows_out_t *out, uint32_t nstates) {
    tshard_t ts[SHMPS_TABLE_MAX_SHARDS];
    if (n > SHMPS_TABLE_MAX_BATCH) return SHMPS_E_ARG;
    batch_t b;
    b.bases = bases, b.nshards = nshards, b.token = token, b.n = n, b.keys = keys;
    uint64_t own[4], *full = info ? info : own; /* SHMPS_E_FULL: which shard (ask_rescan) */
    int r = hash_keys(&b, scratch, scratch_bytes);
    if (r || (r = shard_views(bases, nshards, b.touched, ts))) return r;
    const shmps_spec_t *s0 = ts[0].s;
    uint32_t want = s0->dtype == SHMPS_FLOAT16 ? SHMPS_FLOAT32 : s0->dtype;
    if (grad_dtype != want) return SHMPS_E_ARG;
    if (out && (nstates != s0->nstate || !out->vals || !out->rowsteps ||
                (nstates && !out->states)))
        return SHMPS_E_ARG;
    uint64_t dim = s0->row_len;
    if (check && (r = shmps_check_finite(grad, grad_dtype, n * dim))) return r;
    if (n == 0) return SHMPS_OK;
    if ((r = carve(&b, scratch, scratch_bytes, dim))) return r;
    group_keys(&b, 0); /* duplicates are combined first: one update per key */
    int stepped = uses_step(s0);
    int outbox = (s0->flags & SHMPS_F_OUTBOX) != 0;
    if ((r = enter_all(&b, ts))) return r;
    int64_t missing = lookup_keys(&b, ts, b.groups, b.ngroups);
    if (missing < 0) {
        r = (int)missing;
    } else if (missing > 0) {
        /* relaxed: the creation step only orders idle-eviction, a heuristic */
        uint64_t now = LOAD(&ts[0].h->step, RELAXED);
        r = create_missing(&b, ts, now, full);
    }
    if (r) { /* nothing changed: not even the step count */
        if (r == SHMPS_E_FULL && outbox) ask_rescan(bases, nshards, ts, &b, full[3]);
        leave_all(&b, ts, nshards);
        return r;
    }
    uint64_t step;
    shmps_next_step(bases[0], &step); /* the table's push count */
    size_t gsz = shmps_dtype_size(grad_dtype);
    /* an outbox: per shard, the chain (row + 1 each, 0 ends it) of rows this push found
     * clean, first and last (table.c "Outbox drains") */
    uint64_t dfirst[SHMPS_TABLE_MAX_SHARDS], dlast[SHMPS_TABLE_MAX_SHARDS];
    if (outbox) memset(dfirst, 0, nshards * sizeof dfirst[0]);
    const char *g = (const char *)grad;
    uint64_t contended = 0;
    for (uint64_t k = 0; k < b.ngroups && r == SHMPS_OK; k++) {
        if (k + PF < b.ngroups) {
            uint64_t ip = (uint64_t)b.groups[k + PF];
            const tshard_t *tp = &ts[shard_of(b.hash[ip], nshards)];
            PREFETCH_ROW(tp, (uint64_t)b.row[ip], b.slot[ip], PF_WRITE);
            /* copy_row_out reads the row's step, which a stepless update never touches
             * (without this, 97 % of copy_row_out waited for that load in a large
             * table) */
            if (out && !stepped) __builtin_prefetch(&tp->rowstep[b.row[ip]], 0, 3);
        }
        uint64_t i = (uint64_t)b.groups[k];
        tshard_t *t = &ts[shard_of(b.hash[i], nshards)];
        uint64_t row = (uint64_t)b.row[i], occ;
        const void *gi = combine(&b, (int32_t)i, g, grad_dtype, s0->updater, dim, &occ);
        shmps_stripe_t *lk = &t->stripes[row];
        uint64_t free_ = 0;
        /* acquire: pairs with the release store of owner = 0 by the previous holder
         * (shmps_stripe_unlock): its row writes happen-before ours (an inlined
         * shmps_stripe_trylock; the slow path below handles waiting and takeover) */
        if (!CAS(&lk->owner, &free_, token, ACQUIRE, RELAXED)) {
            contended++;
            int lr = shmps_stripe_lock(lk, token, SHMPS_LOCK_TIMEOUT_S, &t->h->stats.takeovers);
            if (lr < 0) { r = lr; break; }
        }
        int clean = 0;
        r = update_row(t, row, b.slot[i], dim, gi, step, stepped, occ, out, &b, (int32_t)i,
                       outbox ? &clean : NULL);
        if (clean) {
            /* Outbox drains: chain the row in this push's list of the shard (its link
             * is written by this pusher alone: the only one that found it clean, and no
             * drain runs while we are inside), spliced onto ob_dirty below */
            size_t s = (size_t)(t - ts);
            STORE(&t->rowstep[row], dfirst[s], RELAXED);
            if (!dfirst[s]) dlast[s] = row + 1;
            dfirst[s] = row + 1;
        }
    }
    /* relaxed: a statistic */
    if (contended) FETCH_ADD(&ts[0].h->stats.contended, contended, RELAXED);
    /* an outbox (outbox.c): list the rows this push found clean for the drain (a failed
     * push too: what it wrote goes out with a drain), then count the push in every shard
     * it touched, after its rows landed (the add is a release: see shmps_outbox_pushed).
     * The splice is a Treiber push of a whole chain; relaxed, since a drain reads the
     * list only frozen, after every pusher inside left (shmps_leave's release, the
     * freeze's seq_cst loads), or after an acquire load of ob_pushed that reads this
     * push's add, which the splice precedes. */
    if (outbox)
        for (uint32_t s = 0; s < nshards; s++) {
            if (!dfirst[s]) continue;
            tshard_t *t = &ts[s];
            uint64_t head = LOAD(&t->h->ob_dirty, RELAXED);
            do {
                STORE(&t->rowstep[dlast[s] - 1], head, RELAXED);
            } while (!CAS(&t->h->ob_dirty, &head, dfirst[s], RELAXED, RELAXED));
        }
    if (r == SHMPS_OK && outbox)
        for (uint32_t s = 0; s < nshards; s++)
            if (touched(&b, s)) shmps_outbox_pushed(bases[s]);
    leave_all(&b, ts, nshards);
    if (r == SHMPS_OK) shmps_count(bases[0], 0, n * dim * gsz, n);
    return r;
}

int shmps_table_push(void **bases, uint32_t nshards, uint64_t token, const uint64_t *keys,
                     uint64_t n, const void *grad, uint32_t grad_dtype, int check,
                     void *scratch, uint64_t scratch_bytes, uint64_t *info) {
    return table_push(bases, nshards, token, keys, n, grad, grad_dtype, check, scratch,
                      scratch_bytes, info, NULL, 0);
}

/* A push that also copies each key's row, as its update left it, to position i of
 * vals (rows of the table's dtype), states[j] (nstates == the updater's state arrays)
 * and rowsteps: what the shard's owner sends its copies after applying a batch,
 * without looking every key up again.  A repeated key's positions all get its one
 * updated row.  On an error the outputs are undefined (and nothing changed, as for
 * shmps_table_push). */
int shmps_table_push_read(void **bases, uint32_t nshards, uint64_t token,
                          const uint64_t *keys, uint64_t n, const void *grad,
                          uint32_t grad_dtype, int check, void *scratch,
                          uint64_t scratch_bytes, uint64_t *info, void *vals,
                          void *const *states, uint32_t nstates, uint64_t *rowsteps) {
    rows_out_t out = {vals, states, rowsteps};
    return table_push(bases, nshards, token, keys, n, grad, grad_dtype, check, scratch,
                      scratch_bytes, info, &out, nstates);
}

/* ---- pull ----------------------------------------------------------------------- */

int shmps_table_pull(void **bases, uint32_t nshards, uint64_t token, const uint64_t *keys,
                     uint64_t n, void *out, int create, uint8_t *found, void *scratch,
                     uint64_t scratch_bytes, uint64_t *info) {
    tshard_t ts[SHMPS_TABLE_MAX_SHARDS];
    if (n > SHMPS_TABLE_MAX_BATCH) return SHMPS_E_ARG;
    batch_t b;
    b.bases = bases, b.nshards = nshards, b.token = token, b.n = n, b.keys = keys;
    int r = hash_keys(&b, scratch, scratch_bytes);
    if (r || (r = shard_views(bases, nshards, b.touched, ts))) return r;
    if (n == 0) return SHMPS_OK;
    uint64_t dim = ts[0].s->row_len;
    if ((r = carve(&b, scratch, scratch_bytes, dim))) return r;
    if ((r = enter_all(&b, ts))) return r;
    int64_t missing = lookup_keys(&b, ts, NULL, n);
    if (missing < 0) r = (int)missing;
    if (found) /* existed before this pull */
        for (uint64_t i = 0; i < n; i++) found[i] = b.row[i] >= 0;
    if (r == SHMPS_OK && missing > 0 && create) {
        /* relaxed: the creation step only orders idle-eviction, a heuristic */
        uint64_t step = LOAD(&ts[0].h->step, RELAXED);
        r = create_for_missing(&b, ts, step, info);
    }
    if (r) {
        leave_all(&b, ts, nshards);
        return r;
    }
    uint64_t rb = ts[0].rowbytes;
    char *o = (char *)out;
    for (uint64_t i = 0; i < n && r == SHMPS_OK; i++) {
        if (i + PF < n && b.row[i + PF] >= 0)
            PREFETCH_ROW(&ts[shard_of(b.hash[i + PF], nshards)], (uint64_t)b.row[i + PF],
                         b.slot[i + PF], PF_READ);
        int64_t row = b.row[i];
        if (row < 0) { /* create == 0 */
            memset(o + i * rb, 0, rb);
            continue;
        }
        tshard_t *t = &ts[shard_of(b.hash[i], nshards)];
        r = read_row(t, b.slot[i], b.state[i], token, o + i * rb,
                     t->base + t->s->value_off + (uint64_t)row * rb, rb);
    }
    leave_all(&b, ts, nshards);
    if (r == SHMPS_OK) shmps_count(bases[0], 1, n * rb, n);
    return r;
}

/* ---- lookups: contains, row_stats ------------------------------------------------ */

int shmps_table_contains(void **bases, uint32_t nshards, uint64_t token,
                         const uint64_t *keys, uint64_t n, uint8_t *found, void *scratch,
                         uint64_t scratch_bytes) {
    return shmps_table_row_stats(bases, nshards, token, keys, n, NULL, NULL, found, scratch,
                                 scratch_bytes);
}

/* Each key is hashed once, into the scratch (hash_keys; only its hash array is used:
 * shmps_table_hash_scratch_bytes(n)), for the marking of the shards to view and enter
 * and for the lookups; nothing else of the batch is carved.  (The hashes of the first
 * 512 keys were kept on the stack and the rest hashed twice: 7cc140c.) */
int shmps_table_row_stats(void **bases, uint32_t nshards, uint64_t token,
                          const uint64_t *keys, uint64_t n, uint64_t *pushes,
                          uint64_t *last_step, uint8_t *found, void *scratch,
                          uint64_t scratch_bytes) {
    tshard_t ts[SHMPS_TABLE_MAX_SHARDS];
    batch_t b;
    b.bases = bases, b.nshards = nshards, b.token = token, b.n = n, b.keys = keys;
    int r = hash_keys(&b, scratch, scratch_bytes);
    if (r || (r = shard_views(bases, nshards, b.touched, ts))) return r;
    if (n == 0) return SHMPS_OK;
    if ((r = enter_all(&b, ts))) return r;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t h = b.hash[i];
        tshard_t *t = &ts[shard_of(h, nshards)];
        int64_t row = find(t, h, keys[i], NULL, NULL);
        if (row == -2) { r = SHMPS_E_CORRUPT; break; }
        if (found) found[i] = row >= 0;
        /* relaxed: statistics of a row (a concurrent push may be updating them) */
        uint64_t aux = row >= 0 ? LOAD(aux_of(t, (uint64_t)row), RELAXED) : 0;
        if (pushes) pushes[i] = aux_pushes(aux);
        if (last_step) last_step[i] = aux_last(aux);
    }
    leave_all(&b, ts, nshards);
    return r;
}

int shmps_table_len(void **bases, uint32_t nshards, uint64_t *n) {
    tshard_t ts[SHMPS_TABLE_MAX_SHARDS];
    uint64_t only0[SHMPS_TABLE_MAX_SHARDS / 64] = {0};
    int r = shard_views(bases, nshards, only0, ts);
    if (r) return r;
    *n = LOAD(&ts[0].ctl->table_live, RELAXED); /* relaxed: a count at some instant */
    return SHMPS_OK;
}

int shmps_table_set_backed(void **bases, uint32_t nshards, uint32_t shard, uint64_t rows) {
    tshard_t ts[SHMPS_TABLE_MAX_SHARDS];
    int r = shard_view(bases, nshards, shard, ts);
    if (r) return r;
    if (!(ts[shard].s->flags & SHMPS_F_OUTBOX) || rows == 0 || rows > ts[shard].nrows)
        return SHMPS_E_ARG;
    uint64_t *p = &ts[shard].ctl->backed;
    /* release: the caller's backing of the pages happens-before a creator's acquire load
     * that reads this value (create_missing); a monotone max */
    uint64_t cur = LOAD(p, RELAXED);
    while (cur < rows && !CAS(p, &cur, rows, RELEASE, RELAXED)) {
    }
    return SHMPS_OK;
}

int shmps_table_keys(void **bases, uint32_t nshards, uint32_t shard, uint64_t token,
                     uint64_t *out, uint64_t cap, uint64_t *n) {
    tshard_t ts[SHMPS_TABLE_MAX_SHARDS];
    int r = shard_view(bases, nshards, shard, ts);
    if (r) return r;
    tshard_t *t = &ts[shard];
    uint32_t slot;
    if ((r = shmps_enter(t->base, token, SHMPS_LOCK_TIMEOUT_S, &slot)) < 0) return r;
    /* relaxed: rows below a stale hwm are all we list; new ones are "after" us */
    uint64_t hwm = LOAD(&t->ctl->hwm, RELAXED), k = 0;
    if (hwm > t->nrows) r = SHMPS_E_CORRUPT;
    for (uint64_t row = 0; row < hwm && r == SHMPS_OK; row++) {
        /* acquire: pairs with the release store of LINK_LIVE in insert_key, so the key
         * written before it is the one read */
        if (LOAD(&t->link[row], ACQUIRE) != LINK_LIVE) continue;
        if (k >= cap) { r = SHMPS_E_BOUNDS; break; }
        out[k++] = LOAD(&t->keys[row], RELAXED);
    }
    shmps_leave(t->base, token, slot);
    *n = k;
    return r;
}

/* On attach, after shmps_table_attach_check of every shard: the counters that must
 * agree with each other, O(nshards) -- in each shard free_head <= hwm and table_used <=
 * hwm (rows in use were handed out), and the table's table_live (shard 0) the sum of
 * the shards' table_used.  Too-small values pass attach_check's bounds and would make
 * creations hand out live rows again or lift the capacity (review 13, finding 6).
 * Checked only under the creation lock, which every writer of these words holds
 * (creation, delete, evict, drains, repair): taken with one CAS, never waited for.  A
 * lock held (a creator inside, or a dead one whose successor repairs the counters from
 * the index) skips the check: SHMPS_OK, *checked = 0.  The full check (every slot,
 * link and the free list) is shmps_table_check. */
int shmps_table_attach_counts(void **bases, uint32_t nshards, uint64_t token,
                              uint32_t *checked) {
    tshard_t ts[SHMPS_TABLE_MAX_SHARDS];
    *checked = 0;
    int r = shard_views(bases, nshards, NULL, ts);
    if (r) return r;
    /* one try (acquire: the last holder's counter writes happen-before our loads) */
    if (!shmps_stripe_trylock(&ts[0].ctl->create, token)) return SHMPS_OK;
    uint64_t sum = 0;
    for (uint32_t s = 0; s < nshards && r == SHMPS_OK; s++) {
        /* relaxed: we hold the lock (above) */
        uint64_t hwm = LOAD(&ts[s].ctl->hwm, RELAXED);
        uint64_t used = LOAD(&ts[s].h->table_used, RELAXED);
        /* (hwm <= nrows: shmps_table_attach_check, which attach runs first) */
        if (LOAD(&ts[s].ctl->free_head, RELAXED) > hwm || used > hwm)
            r = SHMPS_E_CORRUPT;
        sum += used;
    }
    if (r == SHMPS_OK && (LOAD(&ts[0].ctl->table_live, RELAXED) != sum ||
                          sum > ts[0].ctl->capacity))
        r = SHMPS_E_CORRUPT;
    create_unlock(ts);
    *checked = 1;
    return r;
}

/* ---- delete and evict (shard frozen, creation lock held) ------------------------- */

/* Tombstones slot i holding row r and puts the row on the free list. */
static void remove_slot(tshard_t *t, tctl_t *c0, uint64_t i, uint64_t r) {
    tctl_t *c = t->ctl;
    /* release: no reader is inside (frozen); ordered before thaw's release anyway */
    STORE(&t->slots[i].state, ST_TOMB, RELEASE);
    /* relaxed: free list and counters change only under the creation lock */
    STORE(&t->link[r], LOAD(&c->free_head, RELAXED), RELAXED);
    STORE(&c->free_head, r + 1, RELAXED);
    STORE(&c->tombstones, LOAD(&c->tombstones, RELAXED) + 1, RELAXED);
    __atomic_fetch_sub(&t->h->table_used, 1, RELAXED);
    __atomic_fetch_sub(&c0->table_live, 1, RELAXED);
}

/* Rebuilds the index without tombstones once they fill a quarter of it.  Frozen and
 * locked: no lookup runs.  A crash half-way is repaired from the rows' live marks. */
static int maybe_compact(tshard_t *t) {
    tctl_t *c = t->ctl;
    /* relaxed throughout: frozen and locked, nobody else reads or writes these */
    if (LOAD(&c->tombstones, RELAXED) * 4 < t->mask + 1) return SHMPS_OK;
    uint64_t hwm = LOAD(&c->hwm, RELAXED);
    if (hwm > t->nrows) return SHMPS_E_CORRUPT;
    for (uint64_t i = 0; i <= t->mask; i++) STORE(&t->slots[i].state, ST_EMPTY, RELAXED);
    for (uint64_t r = 0; r < hwm; r++) {
        if (LOAD(&t->link[r], RELAXED) != LINK_LIVE) continue;
        uint64_t key = LOAD(&t->keys[r], RELAXED), i = shmps_key_hash(key) & t->mask;
        while (LOAD(&t->slots[i].state, RELAXED) != ST_EMPTY) i = (i + 1) & t->mask;
        STORE(&t->slots[i].key, key, RELAXED);
        STORE(&t->slots[i].state, ST_READY | (r + 1), RELAXED);
    }
    STORE(&c->tombstones, 0, RELAXED);
    /* release: the rebuilt index is complete before the thaw that follows (whose
     * release CAS orders it anyway) */
    __atomic_thread_fence(RELEASE);
    return SHMPS_OK;
}

typedef struct {
    const uint64_t *keys;
    uint64_t n;
    uint32_t which;
    uint64_t min_pushes, idle_steps, now;
} removal_t;

static int remove_rows(void **bases, tshard_t *ts, uint32_t nshards, uint32_t shard,
                       uint64_t token, const removal_t *q, uint64_t *count) {
    tshard_t *t = &ts[shard];
    int r = shmps_freeze(t->base, token, SHMPS_LOCK_TIMEOUT_S);
    if (r < 0) return r;
    if ((r = create_lock(bases, ts, nshards, token)) < 0) {
        shmps_thaw(t->base, token);
        return r;
    }
    tctl_t *c0 = ts[0].ctl;
    uint64_t done = 0;
    /* an outbox: a removed row may be listed, and re-created without a push its link
     * would cut the list ("Outbox drains"): the next drain scans (frozen: relaxed) */
    if (t->s->flags & SHMPS_F_OUTBOX) STORE(&t->h->ob_rescan, 1, RELAXED);
    if (q->keys) {
        for (uint64_t k = 0; k < q->n; k++) {
            uint64_t h = shmps_key_hash(q->keys[k]), i;
            if (shard_of(h, nshards) != shard) continue;
            int64_t row = find(t, h, q->keys[k], &i, NULL);
            if (row == -2) { r = SHMPS_E_CORRUPT; break; }
            if (row >= 0) remove_slot(t, c0, i, (uint64_t)row), done++;
        }
    } else {
        for (uint64_t i = 0; i <= t->mask; i++) {
            /* relaxed: frozen (no pusher inside) and locked (no creator) */
            uint64_t st = LOAD(&t->slots[i].state, RELAXED);
            if ((st & ST_TAGS) != ST_READY) continue;
            uint64_t row = ST_ROW(st) - 1;
            if (ST_ROW(st) == 0 || row >= t->nrows) { r = SHMPS_E_CORRUPT; break; }
            uint64_t aux = LOAD(aux_of(t, row), RELAXED);
            uint64_t idle = (q->now - aux_last(aux)) & AUX_STEP_MASK;
            int cold = ((q->which & SHMPS_EVICT_MIN_PUSHES) && aux_pushes(aux) < q->min_pushes) ||
                       ((q->which & SHMPS_EVICT_IDLE) && idle >= q->idle_steps);
            if (cold) remove_slot(t, c0, i, row), done++;
        }
    }
    if (r == SHMPS_OK) r = maybe_compact(t);
    create_unlock(ts);
    shmps_thaw(t->base, token);
    *count = done;
    return r;
}

int shmps_table_delete(void **bases, uint32_t nshards, uint32_t shard, uint64_t token,
                       const uint64_t *keys, uint64_t n, uint64_t *deleted) {
    tshard_t ts[SHMPS_TABLE_MAX_SHARDS];
    int r = shard_view(bases, nshards, shard, ts);
    if (r) return r;
    *deleted = 0;
    if (n == 0) return SHMPS_OK;
    removal_t q = {keys, n, 0, 0, 0, 0};
    return remove_rows(bases, ts, nshards, shard, token, &q, deleted);
}

int shmps_table_evict(void **bases, uint32_t nshards, uint32_t shard, uint64_t token,
                      uint32_t which, uint64_t min_pushes, uint64_t idle_steps,
                      uint64_t *evicted) {
    tshard_t ts[SHMPS_TABLE_MAX_SHARDS];
    int r = shard_view(bases, nshards, shard, ts);
    if (r) return r;
    if (which == 0 || (which & ~(uint32_t)(SHMPS_EVICT_MIN_PUSHES | SHMPS_EVICT_IDLE)))
        return SHMPS_E_ARG;
    /* relaxed: the table's push count at about this instant */
    removal_t q = {NULL, 0, which, min_pushes, idle_steps, LOAD(&ts[0].h->step, RELAXED)};
    *evicted = 0;
    return remove_rows(bases, ts, nshards, shard, token, &q, evicted);
}

/* ---- outbox drain, row reads and writes (the bridge; outbox.c, docs/concurrency.md) --- */

/* Outbox drains.  A table outbox keeps its keys from drain to drain (creating a key
 * costs a push three times what finding it does), and lists the rows pushed to since
 * the last drain so that a drain need not look at the others:
 *
 *   pusher:  under a row's lock, a push that finds the row's push count 0 (clean)
 *            chains the row into its own list of the shard (its rowstep word, unused in
 *            an outbox, holds the next row + 1); before it counts itself (ob_pushed),
 *            it splices each chain onto the shard's ob_dirty (a CAS loop).
 *   drainer: frozen (no pusher inside), it follows ob_dirty, takes each listed row with
 *            a push count > 0 (its values, zeroed, and the count, 0), keeps the key,
 *            and empties the list.
 *
 * Only one pusher finds a row clean between two drains (the row lock), so a row is
 * listed once; the freeze orders every pusher's list writes before the drain's reads.
 * A pusher killed between its push to a row and its splice leaves a row pushed to and
 * not listed: whoever frees its active slot first sets ob_rescan (sync.c), and a drain
 * that finds it set, or a list it cannot follow (a row out of range or not live, or
 * longer than the rows ever handed out (hwm): a row listed twice after a drain killed
 * half way, which makes a cycle), looks at every row and removes them all instead, as
 * before 2026-11-27 (the scan below); so does a drain of a shard, or of an outbox, whose
 * keys fill over a quarter of it, which keeps room for new keys.  A push that finds the
 * outbox full asks every shard it viewed, or, the table full, every shard for a scan
 * (ask_rescan); a delete, an evict or a write of row steps in it asks the shard (a row
 * removed and created again without a push would cut the list).  A drain killed while taking listed rows leaves them zeroed with a count of
 * 0 (values first), and the list in place: the next drain skips them.  Returns
 * DRAIN_SCAN for the scan (also for a row whose key the index does not find there: the
 * scan meets it and fails as it always did), else SHMPS_OK with *n rows taken.  Frozen
 * by the caller; *P is re-read here. */
#define DRAIN_SCAN 1
static int drain_listed(tshard_t *t, const tctl_t *c0, uint64_t *keys, void *vals,
                        uint64_t *n_out, uint64_t *P) {
    /* relaxed throughout but ob_pushed: frozen, no pusher inside (see above); the
     * table-wide key count may move (creators of other shards): a heuristic */
    uint64_t hwm = LOAD(&t->ctl->hwm, RELAXED);
    if (hwm > t->nrows) return SHMPS_E_CORRUPT;
    if (LOAD(&t->h->ob_rescan, SEQ_CST) || 4 * LOAD(&t->h->table_used, RELAXED) > t->nrows ||
        4 * LOAD(&c0->table_live, RELAXED) > c0->capacity)
        return DRAIN_SCAN;
    /* P again, now that no pusher is inside the shard (as in the scan below) */
    *P = LOAD(&t->h->ob_pushed, ACQUIRE);
    /* the listed rows, into keys[] first (cap >= nrows >= hwm): the list is followed
     * and checked before anything is taken */
    uint64_t m = 0;
    for (uint64_t cur = LOAD(&t->h->ob_dirty, RELAXED); cur; m++) {
        uint64_t row = cur - 1;
        if (m >= hwm || row >= hwm || LOAD(&t->link[row], RELAXED) != LINK_LIVE)
            return DRAIN_SCAN;
        keys[m] = row;
        cur = LOAD(&t->rowstep[row], RELAXED);
    }
    for (uint64_t j = 0; j < m; j++) {  /* each row's key is indexed at that row */
        if (j + LPF < m)
            PREFETCH_HOME(t, shmps_key_hash(LOAD(&t->keys[keys[j + LPF]], RELAXED)), 0);
        uint64_t key = LOAD(&t->keys[keys[j]], RELAXED);
        if (find(t, shmps_key_hash(key), key, NULL, NULL) != (int64_t)keys[j])
            return DRAIN_SCAN; /* a corrupt row: the scan finds it, as before */
    }
    shmps_outbox_drain_begin(t->h);
    uint64_t n = 0;
    for (uint64_t j = 0; j < m; j++) {
        uint64_t row = keys[j], *aux = aux_of(t, row), a = LOAD(aux, RELAXED);
        if (aux_pushes(a) == 0) continue; /* taken by a drain killed half way */
        char *v = t->base + t->s->value_off + row * t->rowbytes;
        keys[n] = LOAD(&t->keys[row], RELAXED); /* (n <= j: row j was read already) */
        memcpy((char *)vals + n * t->rowbytes, v, t->rowbytes);
        memset(v, 0, t->rowbytes); /* an outbox's init: zeros (outbox.py) */
        STORE(aux, aux_make(0, aux_last(a)), RELAXED);
        n++;
    }
    STORE(&t->h->ob_dirty, 0, RELAXED);
    *n_out = n;
    return SHMPS_OK; /* (the caller ends the drain once it is recorded) */
}

int shmps_table_drain(void **bases, uint32_t nshards, uint32_t shard, uint64_t token,
                      double timeout_s, uint64_t *keys, void *vals, uint64_t cap,
                      uint64_t *n_out, uint64_t *pushed, uint64_t *prev, uint64_t *ticket,
                      uint64_t *lost) {
    tshard_t ts[SHMPS_TABLE_MAX_SHARDS];
    int r = shard_view(bases, nshards, shard, ts);
    if (r) return r;
    tshard_t *t = &ts[shard];
    if (!(t->s->flags & SHMPS_F_OUTBOX)) return SHMPS_E_ARG;
    if (cap < t->nrows) return SHMPS_E_BOUNDS;
    *n_out = 0;
    *ticket = 0;
    /* a lost range recover left open (outbox.c; table pushes hold no landing slot, so
     * recover ends a table shard's range at once and this finds none open) */
    *lost = shmps_outbox_settle(t->h);
    /* acquire: pairs with the pushers' release adds (shmps_outbox_pushed): every push
     * counted in P created and wrote its rows before */
    uint64_t P = LOAD(&t->h->ob_pushed, ACQUIRE);
    /* relaxed: a push counted in P that created a row counted it (table_used) before
     * its release add, so we read at least that, or a drain's decrement after it took
     * the row.  No live row: nothing to take, and no freeze for the pushers to wait on.
     * (Not so for an empty list: a push counted in P may have pushed to a row that
     * another pusher, still inside, found clean and has not listed yet.) */
    if (LOAD(&t->h->table_used, RELAXED) == 0) {
        *prev = shmps_outbox_drained(t->h, P, 0, 0, ticket);
        *pushed = P;
        return SHMPS_OK;
    }
    /* Nor when no pusher is inside and none listed a row or asked for a scan: a push
     * counted in P spliced its rows before its count, and one that pushed to a row
     * another pusher found clean counted after that pusher's push to it (the row lock),
     * so the slot loads below read that pusher's claim or its release, which its splice
     * precedes; the loads of ob_dirty and ob_rescan come after them.  (A drain of a shard
     * whose keys are kept need not freeze it: the sweep drains idle shards.) */
    if (shmps_no_pusher_inside(t->h) && LOAD(&t->h->ob_dirty, RELAXED) == 0 &&
        LOAD(&t->h->ob_rescan, SEQ_CST) == 0) {
        *prev = shmps_outbox_drained(t->h, P, 0, 0, ticket);
        *pushed = P;
        return SHMPS_OK;
    }
    /* The exclusive freeze waits for the batches inside the shard and keeps new ones
     * out.  Then the rows pushed to since the last drain are taken from the list and
     * kept (a later push of the same key finds it), or, if the list cannot be trusted
     * or the outbox is over a quarter full of keys, every row is taken and removed. */
    if ((r = shmps_freeze(t->base, token, timeout_s)) < 0) return r;
    uint64_t n = 0;
    if ((r = drain_listed(t, ts[0].ctl, keys, vals, &n, &P)) != DRAIN_SCAN) {
        shmps_thaw(t->base, token);
        if (r) return r;   /* (before drain_begin: nothing taken, the list as it was) */
        *n_out = n;
        /* recorded, then ended: a bridge killed before the end left ob_draining > 0, and
         * recover counts what this drain took lost (outbox.c), as for the scan */
        *prev = shmps_outbox_drained(t->h, P, n > 0, 0, ticket);
        *pushed = P;
        shmps_outbox_drain_end(t->h);
        return SHMPS_OK;
    }
    /* Take every row and remove it, as delete does (a pusher of a key we remove waits,
     * then creates it afresh, zero); the creation lock orders us with creators of other
     * shards' rows and the free list. */
    if ((r = create_lock_within(bases, ts, nshards, token, timeout_s)) < 0) {
        shmps_thaw(t->base, token);
        return r;
    }
    /* the list goes with the rows; a scan that fails leaves the next drain scanning */
    STORE(&t->h->ob_rescan, 1, RELAXED);
    STORE(&t->h->ob_dirty, 0, RELAXED);
    shmps_outbox_drain_begin(t->h);
    /* P again, now that no pusher is inside the shard: a push that was inside when we
     * read it above wrote its rows and counted itself (before it left: shmps_table_push)
     * while we waited, and we take its rows now.  Read before the freeze, P did not
     * count it, and a bridge ending with this drain unacknowledged lost it silently
     * (outbox.c "Landing").  Acquire: the freeze read each pusher's slot free (seq_cst
     * loads of its release in shmps_leave), after its count; so this load reads it. */
    P = LOAD(&t->h->ob_pushed, ACQUIRE);
    tctl_t *c0 = ts[0].ctl;
    /* relaxed throughout: frozen and locked (see remove_rows) */
    uint64_t hwm = LOAD(&t->ctl->hwm, RELAXED);
    if (hwm > t->nrows) r = SHMPS_E_CORRUPT;
    for (uint64_t row = 0; row < hwm && r == SHMPS_OK; row++) {
        if (row + LPF < hwm) /* the slot find() and remove_slot() touch, ahead */
            PREFETCH_HOME(t, shmps_key_hash(LOAD(&t->keys[row + LPF], RELAXED)), 1);
        if (LOAD(&t->link[row], RELAXED) != LINK_LIVE) continue;
        uint64_t key = LOAD(&t->keys[row], RELAXED), i = 0;
        if (find(t, shmps_key_hash(key), key, &i, NULL) != (int64_t)row) {
            r = SHMPS_E_CORRUPT;
            break;
        }
        /* pushes == 0: created by a pusher killed before its update; nothing to send */
        if (aux_pushes(LOAD(aux_of(t, row), RELAXED)) > 0) {
            keys[n] = key;
            memcpy((char *)vals + n * t->rowbytes, t->base + t->s->value_off + row * t->rowbytes,
                   t->rowbytes);
            n++;
        }
        remove_slot(t, c0, i, row); /* a reused row is re-initialised (zeros) */
    }
    if (r == SHMPS_OK) r = maybe_compact(t);
    create_unlock(ts);
    shmps_thaw(t->base, token);
    *n_out = n;
    if (r) {
        /* Failed part way (a corrupt row, or compaction): the caller throws away the n
         * rows with pushes taken, already removed.  Record their pushes lost, or the
         * next drain's P counts them and its ack tells store.flush() they were applied
         * (outbox.c, shmps_outbox_drain_lost).  Rows without a push hold nothing to
         * lose; a drain that took none of those leaves the counters as they were. */
        if (n) *lost += shmps_outbox_drain_lost(t->h, P);
        shmps_outbox_drain_end(t->h);
        return r;
    }
    /* no landing push: P was read with no pusher inside */
    *prev = shmps_outbox_drained(t->h, P, n > 0, 0, ticket);
    *pushed = P;
    STORE(&t->h->ob_rescan, 0, RELAXED); /* every row was looked at; still frozen */
    shmps_outbox_drain_end(t->h);
    return SHMPS_OK;
}

/* Rows of `keys` (or, keys NULL, every row) of shard `shard`, under the shard's shared
 * freeze: no push, delete or creation runs inside it meanwhile, so each row is whole
 * and its state and step go with its values.  Missing keys are skipped; *nout says how
 * many rows were written (keys_out names them). */
int shmps_table_read_rows(void **bases, uint32_t nshards, uint32_t shard, uint64_t token,
                          const uint64_t *keys, uint64_t n, uint64_t *keys_out, void *vals,
                          void *const *states, uint64_t *rowsteps, uint64_t cap,
                          uint64_t *nout) {
    tshard_t ts[SHMPS_TABLE_MAX_SHARDS];
    int r = shard_view(bases, nshards, shard, ts);
    if (r) return r;
    tshard_t *t = &ts[shard];
    *nout = 0;
    if (keys) {
        for (uint64_t i = 0; i < n; i++)
            if (shard_of(shmps_key_hash(keys[i]), nshards) != shard) return SHMPS_E_ARG;
    }
    if ((r = shmps_freeze_shared(t->base, token, SHMPS_LOCK_TIMEOUT_S)) < 0) return r;
    uint64_t k = 0;
    if (keys) {
        for (uint64_t i = 0; i < n && r == SHMPS_OK; i++) {
            int64_t row = find(t, shmps_key_hash(keys[i]), keys[i], NULL, NULL);
            if (row == -2) r = SHMPS_E_CORRUPT;
            if (row < 0) continue;
            if (k >= cap) { r = SHMPS_E_BOUNDS; break; }
            keys_out[k] = keys[i];
            copy_row_out(t, (uint64_t)row, k++, vals, states, rowsteps);
        }
    } else {
        /* relaxed: frozen, rows are neither created nor removed meanwhile */
        uint64_t hwm = LOAD(&t->ctl->hwm, RELAXED);
        if (hwm > t->nrows) r = SHMPS_E_CORRUPT;
        for (uint64_t row = 0; row < hwm && r == SHMPS_OK; row++) {
            /* acquire: pairs with insert_key's release store of LINK_LIVE */
            if (LOAD(&t->link[row], ACQUIRE) != LINK_LIVE) continue;
            if (k >= cap) { r = SHMPS_E_BOUNDS; break; }
            keys_out[k] = LOAD(&t->keys[row], RELAXED);
            copy_row_out(t, row, k++, vals, states, rowsteps);
        }
    }
    shmps_thaw_shared(t->base, token);
    *nout = k;
    return r;
}

/* Writes the rows of `keys` (distinct, all of shard `shard`) := vals, their state and
 * (rowsteps not NULL) their steps, creating missing keys first, all or none
 * (SHMPS_E_FULL with info as a push's: nothing written).  Under the shard's exclusive
 * freeze: no batch is inside the shard (pulls included), so nobody sees a half-written
 * row; each row's seqlock is still bumped around the write, which also closes a
 * dead pusher's odd seq.  The creation lock is taken inside the freeze, as delete
 * does (lock order: freeze -> creation lock). */
int shmps_table_write_rows(void **bases, uint32_t nshards, uint32_t shard, uint64_t token,
                           const uint64_t *keys, uint64_t n, const void *vals,
                           void *const *states, uint32_t nstates, const uint64_t *rowsteps,
                           uint64_t *info) {
    tshard_t ts[SHMPS_TABLE_MAX_SHARDS];
    int r = shard_view(bases, nshards, shard, ts);
    if (r) return r;
    tshard_t *t = &ts[shard];
    const shmps_spec_t *s = t->s;
    if (nstates != s->nstate || n > SHMPS_TABLE_MAX_BATCH) return SHMPS_E_ARG;
    for (uint64_t i = 0; i < n; i++)
        if (shard_of(shmps_key_hash(keys[i]), nshards) != shard) return SHMPS_E_ARG;
    if (n == 0) return SHMPS_OK;
    if ((r = shmps_freeze(t->base, token, SHMPS_LOCK_TIMEOUT_S)) < 0) return r;
    /* an outbox (not the bridge's use): written row steps would overwrite the links of
     * listed rows ("Outbox drains"): the next drain scans (frozen: relaxed) */
    if ((t->s->flags & SHMPS_F_OUTBOX) && rowsteps) STORE(&t->h->ob_rescan, 1, RELAXED);
    /* Count the missing keys.  No creation lock for it: frozen, no push, pull or delete
     * is inside this shard, so no key of it is created or removed meanwhile (a repair
     * by a creation lock's taker only puts back keys that a dead delete had half
     * removed, which a count that saw them missing finds again below).  The home slot
     * of the key LPF ahead is prefetched: every lookup is a miss in a large shard. */
    uint64_t missing = 0;
    for (uint64_t i = 0; i < n && r == SHMPS_OK; i++) {
        if (i + LPF < n)
            PREFETCH_HOME(t, shmps_key_hash(keys[i + LPF]), 0);
        int64_t row = find(t, shmps_key_hash(keys[i]), keys[i], NULL, NULL);
        if (row == -2) r = SHMPS_E_CORRUPT;
        missing += row == -1;
    }
    if (r == SHMPS_OK && missing) {
        tctl_t *c0 = ts[0].ctl;
        if ((r = create_lock(bases, ts, nshards, token)) < 0) {
            shmps_thaw(t->base, token);
            return r;
        }
        /* relaxed: changed only under the creation lock, which we hold */
        uint64_t live = LOAD(&c0->table_live, RELAXED), used = LOAD(&t->h->table_used, RELAXED);
        if (live + missing > c0->capacity) {
            if (info) info[0] = missing, info[1] = live, info[2] = c0->capacity, info[3] = UINT64_MAX;
            r = SHMPS_E_FULL;
        } else if (used + missing > t->nrows) {
            if (info) info[0] = missing, info[1] = used, info[2] = t->nrows, info[3] = shard;
            r = SHMPS_E_FULL;
        }
        /* relaxed: the creation step only orders idle-eviction, a heuristic */
        uint64_t now = LOAD(&ts[0].h->step, RELAXED), slot;
        for (uint64_t i = 0; i < n && r == SHMPS_OK; i++) {
            uint64_t h = shmps_key_hash(keys[i]);
            if (find(t, h, keys[i], NULL, NULL) >= 0) continue;
            int64_t row = insert_key(t, c0, h, keys[i], token, now, &slot);
            if (row < 0) r = (int)row;
        }
        create_unlock(ts);
    }
    /* The writes, software-pipelined: key i's row is looked up (its slot is cached by
     * the count) and prefetched for writing WPF keys before it is written, so the
     * misses on the rows overlap instead of queueing.  ring[] holds the rows between. */
    uint64_t sb = s->row_len * s->state_itemsize;
    int64_t ring_row[WPF];
    uint64_t ring_slot[WPF];
    for (uint64_t i = 0; i < n + WPF && r == SHMPS_OK; i++) {
        if (i >= WPF) { /* write key i - WPF (its ring entry is reused for key i below) */
            uint64_t j = i - WPF, row = (uint64_t)ring_row[j % WPF], slot = ring_slot[j % WPF];
            row_write_begin(&t->slots[slot]);
            memcpy(t->base + s->value_off + row * t->rowbytes,
                   (const char *)vals + j * t->rowbytes, t->rowbytes);
            for (uint32_t q = 0; q < nstates && q < SHMPS_MAX_STATE; q++)
                memcpy(t->base + s->state_off[q] + row * sb, (const char *)states[q] + j * sb,
                       sb);
            /* relaxed: frozen; the thaw's release orders it for later pushers */
            if (rowsteps) STORE(&t->rowstep[row], rowsteps[j], RELAXED);
            row_write_end(&t->slots[slot]);
        }
        if (i < n) {
            uint64_t slot;
            int64_t row = find(t, shmps_key_hash(keys[i]), keys[i], &slot, NULL);
            if (row < 0) { r = SHMPS_E_CORRUPT; break; }
            ring_row[i % WPF] = row, ring_slot[i % WPF] = slot;
            PREFETCH_ROW(t, (uint64_t)row, slot, PF_WRITE);
        }
    }
    shmps_thaw(t->base, token);
    return r;
}

/* ---- invariant check (tests, debugging) ------------------------------------------
 * Under the creation lock (no creation or deletion runs): every READY slot's row is
 * below hwm, holds its key, is marked live, and is found by a lookup from its key's
 * home slot; the key hashes to this shard; as many rows are marked live as there are
 * READY slots; live rows + free rows == hwm; counters agree; no CLAIM slot is left.
 * info: {problem code, shard, slot or row, 0}. */
enum { CHK_OK = 0, CHK_ROW = 1, CHK_KEY = 2, CHK_LINK = 3, CHK_DUP = 4, CHK_SHARD = 5,
       CHK_FIND = 6, CHK_FREE = 7, CHK_COUNT = 8, CHK_TOTAL = 9, CHK_CLAIM = 10,
       CHK_TOMB = 11 };

int shmps_table_check(void **bases, uint32_t nshards, uint64_t token, uint64_t *info) {
    return shmps_table_check_some(bases, nshards, NULL, token, info);
}

/* The check of the shards whose bits are set in `want` (NULL: all, and the table's
 * total).  Shard 0 is viewed whatever `want` says (its control block holds the lock and
 * the total; bases[0] must be set), the others only if wanted (their bases may be NULL).
 * With `want`, the total is checked against the capacity only (shard 0 wanted): the
 * caller counts the shards' keys (a restore's check of a saved index, which lays out two
 * shards at a time instead of the whole index: checkpoint.py _check_saved_index). */
int shmps_table_check_some(void **bases, uint32_t nshards, const uint64_t *want,
                           uint64_t token, uint64_t *info) {
    tshard_t ts[SHMPS_TABLE_MAX_SHARDS];
    int r = shard_views(bases, nshards, want, ts);
    if (r) return r;
    if ((r = create_lock(bases, ts, nshards, token)) < 0) return r;
    uint64_t code = CHK_OK, where_s = 0, where_i = 0, total = 0;
#define FAIL(c, s_, i_) do { code = (c); where_s = (s_); where_i = (i_); goto done; } while (0)
    for (uint32_t s = 0; s < nshards; s++) {
        if (want && !((want[s / 64] >> (s % 64)) & 1)) continue;
        tshard_t *t = &ts[s];
        /* relaxed loads throughout: the lock holders' writes happened-before (acquire
         * CAS of the lock); pushers only touch values, state, steps and seq bits */
        uint64_t hwm = LOAD(&t->ctl->hwm, RELAXED), live = 0, tombs = 0;
        if (hwm > t->nrows) FAIL(CHK_ROW, s, hwm);
        for (uint64_t i = 0; i <= t->mask; i++) {
            uint64_t st = LOAD(&t->slots[i].state, RELAXED);
            if ((st & ST_TAGS) == ST_CLAIM) FAIL(CHK_CLAIM, s, i);
            if (st == ST_TOMB) tombs++;
            if ((st & ST_TAGS) != ST_READY) continue;
            uint64_t row = ST_ROW(st) - 1, key = LOAD(&t->slots[i].key, RELAXED), at_ = 0;
            if (ST_ROW(st) == 0 || row >= hwm) FAIL(CHK_ROW, s, i);
            if (LOAD(&t->keys[row], RELAXED) != key) FAIL(CHK_KEY, s, i);
            if (LOAD(&t->link[row], RELAXED) != LINK_LIVE) FAIL(CHK_LINK, s, i);
            uint64_t h = shmps_key_hash(key);
            if (shard_of(h, nshards) != s) FAIL(CHK_SHARD, s, i);
            if (find(t, h, key, &at_, NULL) != (int64_t)row || at_ != i) FAIL(CHK_FIND, s, i);
            live++;
        }
        uint64_t marked = 0;
        for (uint64_t row = 0; row < hwm; row++) marked += LOAD(&t->link[row], RELAXED) == LINK_LIVE;
        if (marked != live) FAIL(CHK_DUP, s, marked);
        uint64_t nfree = 0, f = LOAD(&t->ctl->free_head, RELAXED);
        while (f) {
            if (f > hwm || ++nfree > hwm) FAIL(CHK_FREE, s, f);
            uint64_t link = LOAD(&t->link[f - 1], RELAXED);
            if (link == LINK_LIVE) FAIL(CHK_FREE, s, f);
            f = link;
        }
        if (live + nfree != hwm || LOAD(&t->h->table_used, RELAXED) != live) FAIL(CHK_COUNT, s, live);
        if (LOAD(&t->ctl->tombstones, RELAXED) != tombs) FAIL(CHK_TOMB, s, tombs);
        total += live;
    }
    if (!want && (LOAD(&ts[0].ctl->table_live, RELAXED) != total ||
                  total > ts[0].ctl->capacity))
        FAIL(CHK_TOTAL, 0, total);
    if (want && (want[0] & 1) && LOAD(&ts[0].ctl->table_live, RELAXED) > ts[0].ctl->capacity)
        FAIL(CHK_TOTAL, 0, LOAD(&ts[0].ctl->table_live, RELAXED));
done:
#undef FAIL
    create_unlock(ts);
    if (info) info[0] = code, info[1] = where_s, info[2] = where_i, info[3] = 0;
    return code == CHK_OK ? SHMPS_OK : SHMPS_E_CORRUPT;
}
