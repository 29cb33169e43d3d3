/* shmps native core: public header.
 *
 * The region between the CDEF markers is fed verbatim to cffi's ffi.cdef() by
 * shmps/_build.py, so it holds only what cffi's parser accepts: no #include, no
 * #ifdef, no attributes, integer constants as enums.
 *
 * Conventions (as LMDB): every function returns 0 (SHMPS_OK), a small positive
 * informational value where documented, a negative SHMPS_E_* code, or a positive
 * errno.  Results go through out-parameters.  Nothing here prints, aborts, or
 * allocates on the push/pull path.
 *
 * A "token" names a live process: (pid << 32) | (low 32 bits of its start time in
 * clock ticks, field 22 of /proc/PID/stat).  0 is never a token.  A word holding a
 * token is a claim (lock, freeze, slot); a claim whose token names no live process
 * (no such pid, a zombie, or a reused pid with another start time) may be taken over.
 */
#ifndef SHMPS_H
#define SHMPS_H
#include <stdint.h>
#include <stddef.h>

/* CDEF BEGIN */
enum {
    SHMPS_OK = 0,
    SHMPS_RECOVERED = 1,          /* lock acquired from a dead owner: repair state */
    SHMPS_UNSORTED = 4,           /* dense push/pull of rows: sort the rows first, nothing done */
    SHMPS_E_CORRUPT = -30001,     /* segment header not ours / inconsistent */
    SHMPS_E_BOUNDS = -30002,      /* index or size out of range */
    SHMPS_E_TIMEOUT = -30003,     /* bounded wait ran out */
    SHMPS_E_FULL = -30004,        /* capacity reached, nothing changed */
    SHMPS_E_NONFINITE = -30005,   /* NaN/Inf in a gradient, nothing changed */
    SHMPS_E_ARG = -30006,         /* bad argument (unsupported dtype/updater combo) */
    SHMPS_E_NOTFOUND = -30007,    /* key or entry not present */
    SHMPS_E_VERSION = -30008,     /* layout version we do not read */
    SHMPS_E_REMOVED = -30009,     /* the store is being removed (shmps-tool gc) */
    SHMPS_E_BUSY = -30010,        /* a live process holds it: nothing done */
    SHMPS_E_PIDNS = -30011,       /* the store is another PID namespace's: nothing done */
    SHMPS_E_UNBACKED = -30012     /* an outbox's new rows are not backed yet: nothing done */
};

enum {
    SHMPS_LAYOUT_VERSION = 3, /* 3 (2026-11-27): dense stripe steps (pad, steps_by_ticket); 2: table outboxes keep keys (ob_dirty) */
    SHMPS_HEADER_SIZE = 4096,        /* shard header bytes; arrays follow */
    SHMPS_STRIPE_BYTES = 16384,      /* dense stripe: values per lock word */
    SHMPS_ACTIVE_SLOTS = 64,         /* concurrent pushers per shard */
    SHMPS_LANDING_SLOTS = 64,        /* dense pushes landing at once in an outbox shard */
    SHMPS_MAX_STATE = 4,             /* optimizer state arrays per value */
    SHMPS_NPARAMS = 8,               /* updater hyper-parameters */
    SHMPS_MAX_STRIPES = 1048576,     /* stripes per shard (bitmap bound) */
    SHMPS_MANIFEST_SIZE = 8388608,   /* manifest segment bytes (the catalog backed as used) */
    SHMPS_MAX_PROCS = 1024,          /* attached-process slots in a manifest */
    SHMPS_MAX_WORKERS = 1024,        /* worker-clock slots in a manifest */
    SHMPS_CATALOG_BYTES = 4194304,   /* append-only tensor catalog */
    SHMPS_CATALOG_OFF = 1048576      /* where the catalog starts in the manifest */
};

/* kinds */
enum { SHMPS_DENSE = 1, SHMPS_CSR = 2, SHMPS_TABLE = 3 };
/* dtypes (codes are stable: they are stored in segments and files) */
enum { SHMPS_INT8 = 1, SHMPS_INT32 = 2, SHMPS_FLOAT16 = 3, SHMPS_FLOAT32 = 4,
       SHMPS_FLOAT64 = 5 };
/* updaters */
enum { SHMPS_SUM = 1, SHMPS_ASSIGN = 2, SHMPS_MAX = 3, SHMPS_MIN = 4, SHMPS_SGD = 5,
       SHMPS_MOMENTUM = 6, SHMPS_ADAGRAD = 7, SHMPS_ADAM = 8, SHMPS_FTRL = 9 };
/* flags */
enum { SHMPS_F_HOGWILD = 1, SHMPS_F_ALLOW_NONFINITE = 2, SHMPS_F_IMPLICIT = 4,
       SHMPS_F_OUTBOX = 8 /* a bridge outbox (dense or table, updater sum, exact) */ };

/* What a shard holds.  Callers fill the inputs; shmps_layout() fills the rest.
 * The whole struct is stored in the shard header, and attach recomputes the
 * derived fields from the stored inputs and compares (validation). */
typedef struct {
    /* inputs */
    uint32_t kind, dtype, updater, flags;
    uint64_t nrows;        /* rows in this shard (table: row capacity) */
    uint64_t row_len;      /* values per row (dense: prod(shape[1:]); table: dim) */
    uint64_t nnz;          /* values in this shard (dense: nrows * row_len) */
    uint64_t row_begin;    /* global index of this shard's first row */
    uint64_t ncols;        /* csr: columns of the whole matrix */
    uint64_t seed;         /* table init seed */
    double params[8];      /* updater hyper-parameters, see updaters.h */
    double init[4];        /* table init: kind, a, b, unused */
    /* derived by shmps_layout() */
    uint64_t total_size;   /* segment bytes */
    uint64_t rowcnt_off;   /* int64[nrows+1] (csr); 0 when implicit (dense, table) */
    uint64_t colidx_off;   /* int64[nnz] (csr), uint64 keys (table); 0 if implicit */
    uint64_t value_off;    /* dtype[nnz] */
    uint64_t state_off[4]; /* state arrays, state_dtype[nnz] each; 0 = absent */
    uint64_t rowstep_off;  /* uint64[nrows] per-row step counts (csr, table) */
    uint64_t stripes_off;  /* shmps_stripe_t[nstripes] */
    uint64_t index_off;    /* table: hash index slots */
    uint64_t nslots;       /* table: hash index slot count */
    uint64_t nstripes;
    uint64_t stripe_elems; /* dense: values per stripe; csr/table: 0 (per row) */
    uint32_t nstate, state_dtype, itemsize, state_itemsize;
} shmps_spec_t;

/* Counters kept in the shard header (relaxed atomics; read with shmps_stats). */
typedef struct {
    uint64_t pushes, pulls, bytes_pushed, bytes_pulled, rows_pushed, rows_pulled;
    uint64_t last_push_ns, last_pull_ns, step, takeovers, contended, rows_used;
} shmps_stats_t;

uint64_t shmps_self_token(void);
int shmps_token_alive(uint64_t token);
uint64_t shmps_now_ns(void);

int shmps_layout(shmps_spec_t *spec);
int shmps_shard_init(void *base, uint64_t size, const shmps_spec_t *spec);
int shmps_shard_validate(const void *base, uint64_t size, shmps_spec_t *out);
/* init and validate keep a private copy of the spec, which every later call on the
 * mapping uses (specs.c; SHMPS_E_CORRUPT, and the copy unchanged, if the mapping has
 * one with another spec); forget drops it, before the mapping goes (Segment.close).
 * A call on a mapping without one returns SHMPS_E_ARG. */
int shmps_shard_forget(const void *base);
int shmps_stats(const void *base, shmps_stats_t *out);

/* dense push/pull; token = shmps_self_token() of the caller */
int shmps_dense_push(void *base, void *base0, uint64_t token, const void *grad,
                     uint32_t grad_dtype, uint64_t stripe_lo, uint64_t stripe_hi,
                     uint64_t step, int check);
int shmps_dense_push_entered(void *base, void *base0, uint64_t token, uint32_t slot,
                             const void *grad, uint32_t grad_dtype, uint64_t stripe_lo,
                             uint64_t stripe_hi, uint64_t step);
int shmps_dense_push_sorted_rows(void **bases, uint32_t nshards, uint64_t shard_rows,
                                 uint64_t token, const int64_t *rows, uint64_t n,
                                 const void *grad, uint32_t grad_dtype, int check,
                                 int new_step, uint64_t pushes);
int shmps_dense_push_all(void *base, const uint32_t *forward, uint64_t token,
                         const void *grad, uint32_t grad_dtype, int check);
int shmps_dense_pull_all(void *base, uint64_t token, void *out, int consistent);
int shmps_check_finite(const void *data, uint32_t dtype, uint64_t n);
int shmps_next_step(void *base, uint64_t *step);
int shmps_set_step(void *base, uint64_t step);
int shmps_dense_next_step(void *base, uint64_t *step);
int shmps_dense_step_again(void *base, uint64_t *step);
int shmps_dense_set_stripe_steps(void *base, uint64_t step);
int shmps_set_table_used(void *base, uint64_t used);
int shmps_count(void *base, int pull, uint64_t nbytes, uint64_t rows);
int shmps_count_push(void *base, uint64_t pushes, uint64_t nbytes, uint64_t rows);

int shmps_freeze(void *base, uint64_t token, double timeout_s);
int shmps_thaw(void *base, uint64_t token);
int shmps_freeze_shared(void *base, uint64_t token, double timeout_s);
int shmps_thaw_shared(void *base, uint64_t token);
int shmps_enter(void *base, uint64_t token, double timeout_s, uint32_t *slot);
int shmps_leave(void *base, uint64_t token, uint32_t slot);
int shmps_dense_pull(void *base, uint64_t token, void *out, uint64_t elem_lo,
                     uint64_t elem_hi, int consistent);
int shmps_dense_pull_rows(void **bases, uint32_t nshards, uint64_t shard_rows,
                          uint64_t token, const int64_t *rows, const int64_t *pos,
                          uint64_t n, void *out, int consistent);
int shmps_active_pushers(const void *base, uint32_t *n);
int shmps_note_pusher(void *base, uint64_t token, uint64_t window_ns, uint32_t *others);

/* a read-only view of several shards' values, mapped back to back */
int shmps_view_map(const int *fds, const uint64_t *offs, const uint64_t *lens, uint32_t n,
                   void **addr, uint64_t *total);
int shmps_view_unmap(void *addr, uint64_t total);

/* manifest */
int shmps_manifest_init(void *base, uint64_t size, uint64_t token, double timeout_s,
                        const char *ident, uint32_t ident_len, int restoring);
int shmps_manifest_ident(const void *base, char *out, uint32_t cap, uint32_t *len);
int shmps_manifest_validate(const void *base, uint64_t size);
int shmps_manifest_lock(void *base, double timeout_s);
int shmps_manifest_unlock(void *base);
int shmps_catalog_append(void *base, const char *rec, uint32_t len);
int shmps_catalog_read(const void *base, char *out, uint64_t cap, uint64_t *len,
                       uint64_t *generation);
uint64_t shmps_catalog_generation(const void *base);
int shmps_proc_register(void *base, uint64_t token, uint32_t *slot);
int shmps_proc_unregister(void *base, uint64_t token, uint32_t slot);
int shmps_proc_list(void *base, uint64_t *tokens, uint32_t cap, uint32_t *n);
int shmps_proc_handover(void *base, uint32_t slot, uint64_t from, uint64_t to);
/* removing an idle store without racing attachers (manifest.c) */
int shmps_manifest_retire(void *base, uint64_t token);
int shmps_manifest_take_removal(void *base, uint64_t token);
int shmps_manifest_remove_unborn(void *base, uint64_t token);
int shmps_manifest_let_go(void *base, uint64_t token);
int shmps_manifest_restore_begin(void *base, uint64_t token);
int shmps_manifest_restore_end(void *base, uint64_t token);
uint64_t shmps_manifest_retired_by(const void *base);
uint64_t shmps_manifest_init_owner(const void *base);
uint64_t shmps_manifest_pid_ns(const void *base);
uint32_t shmps_manifest_state(const void *base);
/* 1 if a manifest at state 0 has catalog words: READY once, its state word damaged */
int shmps_manifest_was_ready(const void *base);
uint64_t shmps_self_pid_ns(void);
int shmps_manifest_usable(const void *base, uint64_t token);
int shmps_manifest_attached(const void *base, uint64_t token);
/* worker clocks (bounded delay): clock.c */
int shmps_worker_join(void *base, uint64_t token, int32_t want, uint32_t *slot,
                      uint64_t *clock);
int shmps_worker_leave(void *base, uint64_t token, uint32_t slot);
int shmps_worker_clock(void *base, uint64_t token, uint32_t slot, double timeout_s,
                       uint64_t *clock, int32_t *behind);
int shmps_worker_wait(void *base, uint64_t target, int64_t staleness, double timeout_s,
                      int32_t *behind);
int shmps_worker_list(void *base, uint64_t *tokens, uint64_t *clocks, uint32_t cap);
int shmps_set_staleness(void *base, int64_t staleness);
int64_t shmps_get_staleness(const void *base);
/* aggregation (aggregate.c): rounds of synchronous aggregation; the control block
 * lives in a hidden int32 dense tensor of SHMPS_AGG_CTL_BYTES bytes */
enum {
    SHMPS_AGG_CTL_BYTES = 20480,
    SHMPS_AGG_E_CLOSED = -30101,  /* the pusher's round was already applied */
    SHMPS_AGG_E_TWICE = -30102,   /* this worker already pushed in this round */
    SHMPS_AGG_E_AHEAD = -30103,   /* the pusher is 2 rounds ahead of the oldest unapplied */
    SHMPS_AGG_E_ASSEMBLING = -30104, /* fewer than `workers` workers have joined yet */
    SHMPS_AGG_E_STALE = -30105,   /* rounds of another manifest (restored): reset first */
    SHMPS_AGG_E_CLAIMED = -30106, /* the pusher's round is claimed (being applied): closed */
    SHMPS_AGG_E_FOREIGN = -30107, /* pushes by another path are in flight (shmps_agg_pushing:
                                     still at its timeout), or the table of them is full */
    SHMPS_AGG_RESET_DONE = 0, SHMPS_AGG_RESET_CLAIMED = 1, SHMPS_AGG_RESET_BUSY = 2,
    SHMPS_AGG_NOTHING = 0, SHMPS_AGG_APPLY = 1, SHMPS_AGG_BUSY = 2,
    SHMPS_AGG_PH_SUM = 1, SHMPS_AGG_PH_PUSHING = 2, SHMPS_AGG_PH_ZEROING = 3
};
/* Set in the step of a dense whole push that finishes the push of ticket (step & (this
 * - 1)) a dead process began: the stripes whose last step is that ticket or later are
 * skipped, the others get the push at the ticket (dense.c "Stripe steps";
 * aggregate.c, a round's PUSHING taken over). */
#define SHMPS_STEP_RESUME 0x4000000000000000
typedef struct {
    uint64_t next_round, applied, skipped, takeovers;
    uint64_t rounds[2];
    uint32_t contributed[2], in_flight[2];
    uint32_t assembled, applier_pid;
} shmps_agg_info_t;
int shmps_agg_begin(void *ctl, void *man, uint64_t token, uint32_t slot, uint32_t want,
                    uint64_t *round);
int shmps_agg_assemble(void *ctl, void *man, uint64_t token, uint32_t want, double timeout_s,
                       uint32_t *njoined);
int shmps_agg_commit(void *ctl, uint64_t token, uint32_t slot, uint64_t round, uint32_t want);
int shmps_agg_abort(void *ctl, uint64_t token, uint32_t slot, uint64_t round);
int shmps_agg_next(void *ctl, void *man, uint64_t token, uint32_t want, uint32_t *what,
                   uint64_t *round, uint32_t *count, uint32_t *phase, int32_t *behind);
int shmps_agg_phase(void *ctl, uint64_t token, uint64_t round, uint32_t phase);
int shmps_agg_pushing(void *ctl, uint64_t token, uint64_t round, void *base0, double timeout_s,
                      uint64_t *step);
int shmps_agg_pushed(void *ctl, uint64_t token, uint64_t round, void *base0, uint64_t nbytes,
                     uint64_t rows);
int shmps_agg_foreign(void *ctl, void *man, uint64_t token, int end, uint32_t *what,
                      uint64_t *round);
int shmps_agg_push_step(void *ctl, uint64_t token, uint64_t round, uint64_t *step);
int shmps_agg_release(void *ctl, uint64_t token, uint64_t round);
int shmps_agg_finish(void *ctl, uint64_t token, uint64_t round);
int shmps_agg_wait(void *ctl, void *man, uint64_t token, uint32_t want, uint64_t round,
                   double timeout_s, uint32_t *done, int32_t *behind);
int shmps_agg_reset(void *ctl, void *man, uint64_t token, int finish, uint32_t *state);
int shmps_agg_info(void *ctl, shmps_agg_info_t *out);
uint64_t shmps_agg_mark(void *ctl, void *man);
/* a read-write view (view.c; DenseTensor.view(writable=True), the torch adapter) */
int shmps_view_map_rw(const int *fds, const uint64_t *offs, const uint64_t *lens, uint32_t n,
                      void **addr, uint64_t *total);
/* tables (table.c; docs/tables.md).  A table shard's segment has, after the hash
 * index, a control block of SHMPS_TABLE_CTL_BYTES and SHMPS_TABLE_ROWMETA_BYTES of
 * metadata per row (its free-list link).  `bases` lists the mapped
 * shards of one table in shard order; every call checks they agree. */
enum {
    SHMPS_TABLE_CTL_BYTES = 256,
    SHMPS_TABLE_ROWMETA_BYTES = 8,
    SHMPS_TABLE_MAX_SHARDS = 256,
    SHMPS_TABLE_MAX_BATCH = 1073741824,   /* keys per call */
    SHMPS_TABLE_INFO_LEN = 4              /* uint64 info[] filled on errors */
};
/* init kinds, stored in spec.init[0]; init[1], init[2] are their parameters */
enum { SHMPS_INIT_ZEROS = 0, SHMPS_INIT_CONSTANT = 1, SHMPS_INIT_UNIFORM = 2,
       SHMPS_INIT_NORMAL = 3 };
/* evict criteria (bits of `which`) */
enum { SHMPS_EVICT_MIN_PUSHES = 1, SHMPS_EVICT_IDLE = 2 };

uint64_t shmps_key_hash(uint64_t key);
uint32_t shmps_key_shard(uint64_t key, uint32_t nshards);
int shmps_key_shards(const uint64_t *keys, uint64_t n, uint32_t nshards, uint32_t *out);
int shmps_table_init_values(const double *init, uint64_t seed, uint64_t key,
                            uint32_t dtype, uint64_t dim, void *out);
int shmps_table_setup(void *base, uint64_t capacity, uint32_t nshards, uint32_t shard);
int shmps_table_attach_check(const void *base, uint64_t capacity, uint32_t nshards,
                             uint32_t shard);
uint64_t shmps_table_scratch_bytes(uint64_t n, uint64_t dim);
/* the (smaller) scratch of contains and row_stats: n keys' hashes */
uint64_t shmps_table_hash_scratch_bytes(uint64_t n);
int shmps_table_push(void **bases, uint32_t nshards, uint64_t token, const uint64_t *keys,
                     uint64_t n, const void *grad, uint32_t grad_dtype, int check,
                     void *scratch, uint64_t scratch_bytes, uint64_t *info);
int shmps_table_push_read(void **bases, uint32_t nshards, uint64_t token,
                          const uint64_t *keys, uint64_t n, const void *grad,
                          uint32_t grad_dtype, int check, void *scratch,
                          uint64_t scratch_bytes, uint64_t *info, void *vals,
                          void *const *states, uint32_t nstates, uint64_t *rowsteps);
int shmps_table_pull(void **bases, uint32_t nshards, uint64_t token, const uint64_t *keys,
                     uint64_t n, void *out, int create, uint8_t *found, void *scratch,
                     uint64_t scratch_bytes, uint64_t *info);
int shmps_table_contains(void **bases, uint32_t nshards, uint64_t token,
                         const uint64_t *keys, uint64_t n, uint8_t *found, void *scratch,
                         uint64_t scratch_bytes);
int shmps_table_row_stats(void **bases, uint32_t nshards, uint64_t token,
                          const uint64_t *keys, uint64_t n, uint64_t *pushes,
                          uint64_t *last_step, uint8_t *found, void *scratch,
                          uint64_t scratch_bytes);
int shmps_table_delete(void **bases, uint32_t nshards, uint32_t shard, uint64_t token,
                       const uint64_t *keys, uint64_t n, uint64_t *deleted);
int shmps_table_evict(void **bases, uint32_t nshards, uint32_t shard, uint64_t token,
                      uint32_t which, uint64_t min_pushes, uint64_t idle_steps,
                      uint64_t *evicted);
int shmps_table_keys(void **bases, uint32_t nshards, uint32_t shard, uint64_t token,
                     uint64_t *out, uint64_t cap, uint64_t *n);
int shmps_table_len(void **bases, uint32_t nshards, uint64_t *n);
/* An outbox shard's rows [0, rows) and (once) its index and links are backed: a monotone
 * max of its ctl `backed` (create_missing refuses new rows past it: SHMPS_E_UNBACKED). */
int shmps_table_set_backed(void **bases, uint32_t nshards, uint32_t shard, uint64_t rows);
int shmps_table_check(void **bases, uint32_t nshards, uint64_t token, uint64_t *info);
int shmps_table_check_some(void **bases, uint32_t nshards, const uint64_t *want,
                           uint64_t token, uint64_t *info);
int shmps_table_attach_counts(void **bases, uint32_t nshards, uint64_t token,
                              uint32_t *checked);

/* csr (csr.c): fixed structure, per-row locks and steps.  Pushed entries are given
 * by `rowcnt` (nrows+1 offsets into colidx/grad, the shard's rows) and located in the
 * structure first (shmps_csr_locate), so a push with an absent entry changes nothing. */
int shmps_csr_locate(const void *base, const int64_t *rowcnt, uint64_t nrows,
                     const int64_t *colidx, int64_t *pos, uint64_t *bad);
int shmps_csr_push(void *base, uint64_t token, const int64_t *rowcnt, uint64_t nrows,
                   const int64_t *pos, const void *grad, uint32_t grad_dtype,
                   void *scratch, uint64_t scratch_bytes);
int shmps_csr_pull(void *base, uint64_t token, const int64_t *rows, uint64_t n, void *out,
                   int consistent);
uint64_t shmps_csr_scratch_bytes(const void *base);
int shmps_csr_read_entries(void *base, uint64_t token, const int64_t *pos, uint64_t n,
                           void *vals, void *const *states, uint32_t nstates,
                           uint64_t *rowsteps);
int shmps_csr_write_entries(void *base, uint64_t token, const int64_t *pos, uint64_t n,
                            const void *vals, void *const *states, uint32_t nstates,
                            const uint64_t *rowsteps);
/* outboxes of the multi-host bridge (outbox.c, table.c; docs/concurrency.md
 * "Outboxes").  The forwarding switch lives in the manifest; the counters in each
 * outbox shard's header.  A drain waits at most timeout_s for any one lock or freeze
 * (dead holders are taken over in ~1 ms): SHMPS_E_TIMEOUT before it took anything
 * (nothing changed), or SHMPS_DRAIN_PARTIAL (dense: a stripe stayed locked by a live
 * process; the rows taken are returned, and *pushed is the previous drain's, claiming
 * no new push). */
enum { SHMPS_DRAIN_PARTIAL = 2,
       SHMPS_FORWARDING = 3 /* shmps_dense_push_all: *forward set, nothing done */ };
int shmps_forward_set(void *man, uint32_t on);
uint32_t shmps_forward_get(const void *man);
uint32_t *shmps_forward_word(void *man);
/* the store-wide count of forwarded pushes: a pusher adds 1 after each push into an
 * outbox (after the push counted itself in its shards); the bridge skips its scan of the
 * outboxes while it has not moved (outbox.c).  forward_pushed returns 1 if the bridge
 * sleeps and this push is to wake it (its doorbell, else forward_wake) */
int shmps_forward_pushed(void *man);
uint64_t shmps_forward_pushes(const void *man);
int shmps_forward_wake(void *man);
uint32_t shmps_forward_wakes(const void *man);
/* the bridge, with nothing to do: 1 if it may sleep until a push (no push counted since
 * `seen`; the next one wakes it through flush_req), else 0; awake: it is awake again */
int shmps_forward_idle(void *man, uint64_t seen);
void shmps_forward_awake(void *man);
int shmps_flush_request(void *man);
uint32_t shmps_flush_wait(void *man, uint32_t seen, uint64_t max_ns);
void shmps_ack_notify(void *man);
uint32_t shmps_ack_seq(const void *man);
void shmps_ack_waiting(void *man, int32_t delta);
uint32_t shmps_ack_wait(void *man, uint32_t seen, uint64_t max_ns);
int shmps_outbox_pushed(void *base);
/* A dense push into an outbox (outbox.c "Landing"): land claims a landing slot (slots[i])
 * of every outbox shard bases[i] with touched[i], before the push writes any of them
 * (the others, and all on failure: SHMPS_LANDING_NONE); landed, after the writes,
 * counts the push in each (count != 0) and frees the slots (skipping NONE ones). */
enum { SHMPS_LANDING_NONE = 255 };
int shmps_outbox_land(void *const *bases, uint32_t n, const uint8_t *touched,
                      uint64_t token, uint8_t *slots);
int shmps_outbox_landed(void *const *bases, uint32_t n, const uint8_t *touched,
                        uint64_t token, const uint8_t *slots, int count);
int shmps_outbox_counters(const void *base, uint64_t *pushed, uint64_t *acked);
int shmps_outbox_ack(void *base, uint64_t pushed, uint64_t ticket);
int shmps_outbox_recover(void *base, uint64_t *lost);
int shmps_outbox_lost(const void *base, uint64_t *lo, uint64_t *hi, uint64_t *count);
int shmps_outbox_lost_open(const void *base, uint32_t *open);
/* The owner refused a drain's frames for good (REJECTED): record its pushes, counted
 * in (prev, pushed] (its Drained's; up to ob_pushed now if that is empty), as lost,
 * past any recorded already, unless a range recover left open will count them; *lost:
 * how many.  The caller then acknowledges the drain as usual (shmps_outbox_ack), and
 * store.flush() raises PushesLost for them instead of returning as if applied. */
int shmps_outbox_reject(void *base, uint64_t prev, uint64_t pushed, uint64_t *lost);
/* *lost (both drains): pushes recorded lost by this drain, which ended a lost range
 * recover had left open, or (a table drain) failed after it took rows, which the caller
 * cannot deliver (store.flush() raises PushesLost for them) */
int shmps_outbox_drain(void *base, uint64_t token, double timeout_s, int64_t *rows,
                       void *vals, uint64_t cap, uint64_t *n, uint64_t *pushed,
                       uint64_t *prev, uint64_t *ticket, uint64_t *lost);
int shmps_outbox_pending(const void *base, uint64_t *out, uint64_t cap);
int shmps_outbox_busy(void *const *bases, uint32_t n, uint8_t *busy, uint32_t *nbusy);
int shmps_dense_write_rows(void *base, uint64_t token, const int64_t *rows, uint64_t n,
                           const void *vals, void *const *states, uint32_t nstates);
int shmps_raise_step(void *base, uint64_t step);
int shmps_count_pushes(void *base, int64_t delta);
int shmps_table_drain(void **bases, uint32_t nshards, uint32_t shard, uint64_t token,
                      double timeout_s, uint64_t *keys, void *vals, uint64_t cap,
                      uint64_t *n, uint64_t *pushed, uint64_t *prev, uint64_t *ticket,
                      uint64_t *lost);
int shmps_table_read_rows(void **bases, uint32_t nshards, uint32_t shard, uint64_t token,
                          const uint64_t *keys, uint64_t n, uint64_t *keys_out, void *vals,
                          void *const *states, uint64_t *rowsteps, uint64_t cap,
                          uint64_t *nout);
int shmps_table_write_rows(void **bases, uint32_t nshards, uint32_t shard, uint64_t token,
                           const uint64_t *keys, uint64_t n, const void *vals,
                           void *const *states, uint32_t nstates, const uint64_t *rowsteps,
                           uint64_t *info);
/* CDEF END */

#endif
