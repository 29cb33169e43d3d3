"""Tables: the API one behaviour at a time, bad input, capacity, a hypothesis state
machine against a dict-of-rows model, 4 processes pushing known integers to
overlapping zipf keys, deterministic init across processes, and crashes (SIGKILL of
pushers at random instants; dead owners planted in every kind of claim)."""
from __future__ import annotations

import random
import threading
import time
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import shmps
from helpers import (GO, STOP, Workers, create_new_keys, dead_token, keys_observer, new_flags,
                     wait_until)
from reference import RefTable, init_row

pytestmark = pytest.mark.timeout(180)

BIG = 2**64 - 1


def snapshot(t: shmps.Table) -> dict:
    """Everything observable about a table (to prove a rejected call changed nothing)."""
    keys = np.sort(t.keys())
    return {"keys": keys.tolist(), "rows": t.pull(keys, create=False).tolist(),
            "stats": {k: v for k, v in t.row_stats(keys).items() if k != "found"},
            "len": len(t), "step": t.stats()["step"]}


def same(a: dict, b: dict) -> bool:
    return (a["keys"] == b["keys"] and a["rows"] == b["rows"] and a["len"] == b["len"]
            and a["step"] == b["step"]
            and all(np.array_equal(a["stats"][k], b["stats"][k]) for k in a["stats"]))


# ---- the API -----------------------------------------------------------------------------

def test_extreme_keys_and_creation_on_pull(store):
    """Keys 0 and 2**64-1 are ordinary keys; pull creates rows from their init."""
    t = store.table("emb", dim=3, capacity=10, init=0.5)
    v = t.pull(np.array([0, BIG, 0], np.uint64))
    np.testing.assert_array_equal(v, np.full((3, 3), 0.5, np.float32))
    assert len(t) == 2 and sorted(t.keys().tolist()) == [0, BIG]
    assert t.contains([0, BIG, 1]).tolist() == [True, True, False]
    assert 0 in t and 1 not in t


def test_python_int_keys_beyond_int64(store):
    """A list of Python ints up to 2**64-1 keeps every bit (no float round trip)."""
    t = store.table("emb", dim=1, capacity=4, optimizer="sum", dtype="int32")
    t.push([2**63 + 1, 2**63, BIG], np.array([[1], [2], [3]], np.int32))
    assert t.pull([2**63 + 1, 2**63, BIG]).ravel().tolist() == [1, 2, 3]


def test_pull_create_false_and_found(store):
    """create=False gives zero rows for missing keys and creates nothing; found= says
    which keys existed before the call (also with create=True)."""
    t = store.table("emb", dim=2, capacity=10, init=1.0)
    t.pull([5])
    found = np.empty(3, bool)
    v = t.pull([5, 6, 5], create=False, found=found)
    assert found.tolist() == [True, False, True] and len(t) == 1
    np.testing.assert_array_equal(v, [[1, 1], [0, 0], [1, 1]])
    t.pull([6, 7], found=found[:2])
    assert found[:2].tolist() == [False, False] and len(t) == 3


def test_pull_out_buffer(store):
    """pull(keys, out=buf) fills and returns buf; a wrong buffer is a SchemaError."""
    t = store.table("emb", dim=4, capacity=10, init=2.0)
    buf = np.zeros((2, 4), np.float32)
    assert t.pull([1, 2], out=buf) is buf and (buf == 2).all()
    for bad in (np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float64),
                np.zeros((4, 2), np.float32).T, [[0] * 4] * 2):
        with pytest.raises(shmps.SchemaError):
            t.pull([1, 2], out=bad)


def test_int32_sum_duplicates_exact(store):
    """sum on int32: duplicate keys accumulate, to the last unit."""
    t = store.table("c", dim=2, capacity=8, dtype="int32", optimizer="sum")
    t.push([3, 3, 4, 3], np.array([[1, 2], [10, 20], [5, 5], [100, 200]], np.int32))
    np.testing.assert_array_equal(t.pull([3, 4]), [[111, 222], [5, 5]])
    assert t.row_stats([3, 4])["pushes"].tolist() == [3, 1]


@pytest.mark.parametrize("opt,want", [("sum", [-127, 2]), ("max", [127, 2]),
                                      ("min", [0, -1])])
def test_int8_duplicates_combined(store, opt, want):
    """Duplicate keys are combined first: int8 sums wrap like numpy's (127+1+1 is
    -127), max/min reduce (with the zero init)."""
    t = store.table("c", dim=2, capacity=4, dtype="int8", optimizer=opt)
    t.push([1, 1, 1], np.array([[127, 1], [1, 2], [1, -1]], np.int8))
    assert t.pull([1]).ravel().tolist() == want


def test_assign_last_duplicate_wins(store):
    """assign: the last occurrence of a key in a push wins."""
    t = store.table("a", dim=1, capacity=4, optimizer="assign")
    t.push([1, 1, 1], np.array([[1.0], [2.0], [3.0]]))
    assert t.pull([1])[0, 0] == 3.0


def test_delete_then_recreate_from_init(store):
    """A deleted key is gone; pulled again it is re-created with its init."""
    t = store.table("emb", dim=2, capacity=4, optimizer=shmps.SGD(lr=1.0), init=("uniform", 0, 1),
                    seed=7)
    first = t.pull([9]).copy()
    t.push([9], np.ones((1, 2)))
    assert t.delete([9, 10]) == 1 and len(t) == 0 and not t.contains([9])[0]
    np.testing.assert_array_equal(t.pull([9]), first)
    t.check()


def test_delete_frees_capacity(store):
    """Deleted rows are reused: a full table accepts new keys after a delete."""
    t = store.table("emb", dim=2, capacity=3, shards=2)
    t.pull([1, 2, 3])
    with pytest.raises(shmps.CapacityError):
        t.pull([4])
    t.delete([2])
    t.pull([4])
    assert sorted(t.keys().tolist()) == [1, 3, 4]
    t.check()


def test_evict_min_pushes(store):
    """evict(min_pushes=k) removes rows whose key was pushed fewer than k times."""
    t = store.table("emb", dim=1, capacity=10)
    t.push([1, 1, 2], np.ones((3, 1)))
    t.pull([3])
    assert t.evict(min_pushes=2) == 2
    assert t.keys().tolist() == [1]


def test_evict_idle_steps(store):
    """evict(idle_steps=k) removes rows not touched by the table's last k pushes."""
    t = store.table("emb", dim=1, capacity=10)
    t.push([1], np.ones((1, 1)))          # step 1
    t.push([2], np.ones((1, 1)))          # step 2
    t.pull([3])                           # created at step 2
    t.push([2], np.ones((1, 1)))          # step 3
    assert t.row_stats([1, 2, 3])["last_push_step"].tolist() == [1, 3, 2]
    assert t.evict(idle_steps=2) == 1     # key 1: idle 2 steps
    assert sorted(t.keys().tolist()) == [2, 3]
    assert t.evict(min_pushes=1, idle_steps=100) == 1  # key 3 never pushed
    t.check()


def test_evict_with_many_tombstones_compacts(store):
    """Deleting most keys many times over leaves an index that still finds every key."""
    t = store.table("emb", dim=1, capacity=64, optimizer="sum", shards=2)
    rng = np.random.default_rng(0)
    for round_ in range(20):
        keys = rng.integers(0, 10**12, size=60).astype(np.uint64)
        t.push(keys, np.ones((60, 1)))
        t.delete(keys[:55])
        t.check()
        t.delete(t.keys())
    assert len(t) == 0


def test_evict_while_pushing(store):
    """Eviction keeps the table usable by concurrent pushers (threads here)."""
    t = store.table("emb", dim=8, capacity=4096, optimizer=shmps.SGD(lr=0.1), shards=3)
    stop = threading.Event()
    errors = []

    def pusher(seed):
        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                t.push(rng.integers(0, 3000, size=64).astype(np.uint64), np.ones((64, 8)))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=pusher, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    try:
        for _ in range(20):
            t.evict(idle_steps=5)
            time.sleep(0.005)
    finally:
        stop.set()
        for th in threads:
            th.join(30)
    assert not errors
    t.check()


def test_len_keys_stats_describe(store):
    """len, keys, stats and describe agree on the rows in the table."""
    t = store.table("emb", dim=4, capacity=100, shards=4)
    t.pull(np.arange(30, dtype=np.uint64))
    t.push(np.arange(10, dtype=np.uint64), np.ones((10, 4)))
    s = t.stats()
    assert len(t) == 30 and s["len"] == 30 and s["rows_used"] == 30 and s["capacity"] == 100
    assert s["step"] == 1 and s["pushes"] == 1 and s["pulls"] == 1
    assert sorted(t.keys().tolist()) == list(range(30))
    d = t.describe()
    assert d["kind"] == "table" and d["dim"] == 4 and d["rows_used"] == 30
    assert t.shape == (30, 4)


def test_contains_and_row_stats_hash_each_key_once_at_any_batch_size(store):
    """contains and row_stats answer batches of 1, 511, 512, 513 and 5000 keys over 8
    shards (present and absent keys, duplicates) as a dict model does, each key hashed
    once: every key's hash is in the caller's scratch, where the lookups read it (the
    keys past the 512th were hashed a second time, table.c 7cc140c), and a scratch
    without room for every hash is refused."""
    t = store.table("emb", dim=2, capacity=8000, shards=8, optimizer="sum")
    rng = np.random.default_rng(5)
    pool = np.unique(np.r_[rng.integers(0, BIG, 6000, np.uint64, endpoint=True), 0, BIG])
    rng.shuffle(pool)
    present = pool[:3000]
    model: dict[int, tuple[int, int]] = {}   # key -> (pushes, last push step)
    for step, batch in enumerate((present, present[::3], np.repeat(present[:7], 3)), 1):
        t.push(batch, np.ones((batch.size, 2)))
        for key in batch.tolist():
            model[key] = (model.get(key, (0, 0))[0] + 1, step)
    for n in (1, 511, 512, 513, 5000):
        keys = rng.choice(pool, n)   # with replacement: duplicates; half are absent
        keys[: n // 10] = keys[-(n // 10):]   # and some certain ones
        want = [model.get(key, (0, 0)) for key in keys.tolist()]
        assert t.contains(keys).tolist() == [key in model for key in keys.tolist()], n
        st = t.row_stats(keys)
        assert st["found"].tolist() == [key in model for key in keys.tolist()], n
        assert st["pushes"].tolist() == [p for p, _ in want], n
        assert st["last_push_step"].tolist() == [s for _, s in want], n
    # the 5000 hashes, at the scratch's first 64-byte boundary (hash_keys)
    scratch = t._local.buf[2]
    skip = -scratch.ctypes.data % 64
    kept = scratch[skip: skip + 8 * keys.size].view(np.uint64)
    assert kept.tolist() == shmps.table.key_hash(keys).tolist()
    lib, ffi = shmps._native.lib, shmps._native.ffi
    nbytes = int(lib.shmps_table_hash_scratch_bytes(keys.size))
    small = np.zeros(nbytes - 1, np.uint8)
    found = np.zeros(keys.size, np.uint8)
    code = lib.shmps_table_contains(t._ptrs(), t.nshards, shmps._native.token(),
                                    shmps._native.addr(keys), keys.size,
                                    ffi.from_buffer("uint8_t[]", found),
                                    ffi.from_buffer(small), small.size)
    assert code == lib.SHMPS_E_ARG and not found.any()
    # a key count no caller has (2**62) needs a scratch no caller can give: its size
    # wrapped (8 * n + 64 = 64 bytes), and the C call read 2**62 keys from a 5000-key
    # array (review 20 F10)
    huge = 1 << 62
    assert int(lib.shmps_table_hash_scratch_bytes(huge)) == 2**64 - 1
    assert int(lib.shmps_table_scratch_bytes(huge, 2)) == 2**64 - 1
    big = np.zeros(1 << 16, np.uint8)
    code = lib.shmps_table_contains(t._ptrs(), t.nshards, shmps._native.token(),
                                    shmps._native.addr(keys), huge,
                                    ffi.from_buffer("uint8_t[]", found),
                                    ffi.from_buffer(big), big.size)
    assert code == lib.SHMPS_E_ARG and not found.any()


def test_nonblocking_push(store):
    """push(wait=False) returns a handle; waiting applies it."""
    t = store.table("emb", dim=2, capacity=4, optimizer="sum")
    h = t.push([1], np.ones((1, 2)), wait=False)
    store.wait(h)
    np.testing.assert_array_equal(t.pull([1]), [[1, 1]])


def test_get_or_create_and_schema_mismatch(store):
    """Every process can run the same table() line; a differing argument is SchemaError;
    omitted arguments accept the existing table; a missing table needs dim/capacity."""
    a = store.table("emb", dim=4, capacity=10, optimizer=shmps.Adagrad(lr=0.1), seed=3,
                    init=("normal", 0, 0.1))
    assert store.table("emb") is a and store["emb"] is a
    assert store.table("emb", dim=4, capacity=10, seed=3, init=("normal", 0, 0.1)) is a
    for kw in ({"dim": 5}, {"capacity": 11}, {"seed": 4}, {"init": 0.0},
               {"optimizer": shmps.Adagrad(lr=0.2)}, {"dtype": "float64"}, {"shards": 3}):
        with pytest.raises(shmps.SchemaError):
            store.table("emb", **kw)
    with pytest.raises(shmps.NotFound):
        store.table("other")
    assert store.table("z", dim=1, capacity=1, init=0) is not None  # 0 -> "zeros"
    assert store.table("z", init="zeros").init_spec == ["zeros"]


def test_table_visible_to_a_second_store_handle(store, store_name):
    """A second attach sees the same rows (shared memory), with no re-creation."""
    t = store.table("emb", dim=2, capacity=10, optimizer="sum")
    t.push([1], np.ones((1, 2)))
    other = shmps.attach(store_name)
    try:
        u = other["emb"]
        np.testing.assert_array_equal(u.pull([1]), [[1, 1]])
        u.push([1], np.ones((1, 2)))
        np.testing.assert_array_equal(t.pull([1]), [[2, 2]])
    finally:
        other.close()


# ---- capacity -----------------------------------------------------------------------------

def test_capacity_error_names_table_and_changes_nothing(store):
    """A push or pull that would exceed capacity raises CapacityError naming the table,
    its capacity and how to grow it, and changes nothing (rows, counts, step)."""
    t = store.table("emb", dim=2, capacity=5, optimizer="sum", shards=2)
    t.push([1, 2, 3], np.ones((3, 2)))
    before = snapshot(t)
    with pytest.raises(shmps.CapacityError) as err:
        t.push([1, 4, 5, 6, 4], np.ones((5, 2)))
    msg = str(err.value)
    assert "'emb'" in msg and "capacity 5" in msg and "evict" in msg and "capacity=" in msg
    assert same(snapshot(t), before)
    with pytest.raises(shmps.CapacityError):
        t.pull([7, 8, 9])
    assert same(snapshot(t), before)
    t.push([4, 5, 4], np.ones((3, 2)))  # exactly full is fine
    assert len(t) == 5
    t.check()


def test_capacity_is_exact_across_shards(store):
    """A sharded table holds exactly `capacity` keys, whatever shard they hash to."""
    t = store.table("emb", dim=1, capacity=100, shards=8)
    t.pull(np.arange(100, dtype=np.uint64))
    with pytest.raises(shmps.CapacityError):
        t.pull([10**9])
    assert len(t) == 100


# ---- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("keys,exc", [
    (np.array([1.0, 2.0]), shmps.SchemaError),
    (np.array([1, -2]), shmps.InvalidArgument),
    ([1, -2], shmps.InvalidArgument),
    (np.array([[1, 2]], np.uint64), shmps.SchemaError),
    (np.array([True, False]), shmps.SchemaError),
    (5, shmps.SchemaError),
    (["a"], shmps.SchemaError),
])
def test_bad_keys_raise_and_change_nothing(store, keys, exc):
    """Keys of float dtype, negative, 2-d, bool or scalar raise a typed error; nothing
    changes."""
    t = store.table("emb", dim=2, capacity=10, optimizer="sum")
    t.push([1], np.ones((1, 2)))
    before = snapshot(t)
    n = np.size(keys)
    with pytest.raises(exc):
        t.push(keys, np.ones((max(n, 1), 2)))
    with pytest.raises(exc):
        t.pull(keys)
    with pytest.raises(exc):
        t.delete(keys)
    assert same(snapshot(t), before)


def test_bad_grads_raise_and_change_nothing(store):
    """grads of the wrong shape, float grads into an int table, NaN/Inf: typed errors,
    nothing changed (the NaN check reads everything before any row changes)."""
    t = store.table("emb", dim=3, capacity=10, optimizer=shmps.SGD(lr=1.0))
    i = store.table("ints", dim=3, capacity=10, dtype="int32", optimizer="sum")
    t.push([1, 2], np.ones((2, 3)))
    before = snapshot(t)
    with pytest.raises(shmps.SchemaError):
        t.push([1, 2], np.ones((2, 4)))
    with pytest.raises(shmps.SchemaError):
        t.push([1, 2], np.ones(6))
    with pytest.raises(shmps.SchemaError):
        i.push([1], np.ones((1, 3)))
    g = np.ones((3, 3))
    g[2, 1] = np.nan
    with pytest.raises(shmps.NonFinite):
        t.push([1, 2, 9], g)
    g[2, 1] = np.inf
    with pytest.raises(shmps.NonFinite):
        t.push([1, 2, 9], g)
    assert same(snapshot(t), before) and len(i) == 0


def test_allow_nonfinite(store):
    """allow_nonfinite=True accepts Inf gradients."""
    t = store.table("emb", dim=1, capacity=2, optimizer="sum", allow_nonfinite=True)
    t.push([1], np.array([[np.inf]]))
    assert np.isinf(t.pull([1])[0, 0])


@pytest.mark.parametrize("kw", [{"dim": 2, "capacity": 0}, {"dim": 0, "capacity": 5},
                                {"dim": 2, "capacity": True}, {"dim": 2.5, "capacity": 5},
                                {"dim": 2, "capacity": 5, "shards": 0},
                                {"dim": 2, "capacity": 5, "seed": -1},
                                {"dim": 2, "capacity": 5, "init": ("uniform", 1, 0)},
                                {"dim": 2, "capacity": 5, "init": ("normal", 0)},
                                {"dim": 2, "capacity": 5, "init": "ones"},
                                {"dim": 2, "capacity": 5, "init": float("nan")}])
def test_bad_creation_arguments(store, kw):
    """capacity 0, dim 0, non-integers, bad init: InvalidArgument, no table created."""
    with pytest.raises(shmps.InvalidArgument):
        store.table("emb", **kw)
    assert "emb" not in store


def test_random_init_on_int_table_is_schema_error(store):
    """uniform/normal init needs a float dtype; float optimizers need a float dtype."""
    with pytest.raises(shmps.SchemaError):
        store.table("emb", dim=2, capacity=5, dtype="int32", init=("uniform", 0, 1))
    with pytest.raises(shmps.SchemaError):
        store.table("emb", dim=2, capacity=5, dtype="int8", optimizer=shmps.Adam())
    with pytest.raises(shmps.SchemaError):
        store.table("emb", dim=2, capacity=5, dtype="int8", init=300)


def test_bad_evict_and_found(store):
    """evict() needs a criterion (non-negative ints); found= must be a bool array."""
    t = store.table("emb", dim=1, capacity=5)
    for kw in ({}, {"min_pushes": -1}, {"idle_steps": 1.5}, {"min_pushes": True}):
        with pytest.raises(shmps.InvalidArgument):
            t.evict(**kw)
    with pytest.raises(shmps.SchemaError):
        t.pull([1], found=np.zeros(1, np.int8))


def test_closed_table_raises(store):
    """A closed store's table raises Closed instead of touching unmapped memory."""
    t = store.table("emb", dim=1, capacity=5)
    t.close()
    with pytest.raises(shmps.Closed):
        t.pull([1])
    with pytest.raises(shmps.Closed):
        len(t)


# ---- hypothesis: a table against a dict-of-rows model -------------------------------------

UNIVERSE = [0, 1, 2, 3, 17, 1000, 2**32, 2**63, BIG - 1, BIG]
KEYS = st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=6)


class TableMachine(RuleBasedStateMachine):
    """push / pull / delete / evict / capacity errors against tests/reference.RefTable
    (sum of small integers in float64, so the comparison is exact)."""

    @initialize(shards=st.integers(1, 3), capacity=st.integers(2, 7), seed=st.integers(0, 99))
    def create(self, shards, capacity, seed):
        self.name = f"t{uuid.uuid4().hex[:12]}"
        self.store = shmps.attach(self.name)
        self.spec = ["uniform", -4.0, 4.0]
        self.t = self.store.table("m", dim=2, dtype="float64", capacity=capacity,
                                  init=tuple(self.spec), seed=seed, shards=shards)
        self.capacity = capacity
        self.model = RefTable(shmps.Sum(), 2, lambda k: init_row(self.spec, seed, k, 2))

    def teardown(self):
        if hasattr(self, "store"):
            self.store.destroy()

    def _fits(self, keys) -> bool:
        return len(self.model.rows) + self.model.new_keys(keys) <= self.capacity

    @rule(keys=KEYS, data=st.data())
    def push(self, keys, data):
        g = np.array(data.draw(st.lists(st.integers(-9, 9), min_size=2 * len(keys),
                                        max_size=2 * len(keys))), np.float64).reshape(-1, 2)
        if self._fits(keys):
            self.t.push(keys, g)
            self.model.push(keys, g)
        else:
            with pytest.raises(shmps.CapacityError):
                self.t.push(keys, g)

    @rule(keys=KEYS, create=st.booleans())
    def pull(self, keys, create):
        if create and not self._fits(keys):
            with pytest.raises(shmps.CapacityError):
                self.t.pull(keys)
            return
        found = np.empty(len(keys), bool)
        existed = [k in self.model.rows for k in keys]
        got = self.t.pull(keys, create=create, found=found)
        np.testing.assert_array_equal(got, self.model.pull(keys, create=create))
        assert found.tolist() == existed

    @rule(keys=KEYS)
    def delete(self, keys):
        assert self.t.delete(keys) == self.model.delete(keys)

    @rule(min_pushes=st.none() | st.integers(0, 3), idle=st.none() | st.integers(0, 4))
    def evict(self, min_pushes, idle):
        if min_pushes is None and idle is None:
            return
        assert self.t.evict(min_pushes=min_pushes, idle_steps=idle) == \
            self.model.evict(min_pushes, idle)

    @invariant()
    def agrees(self):
        if not hasattr(self, "t"):
            return
        keys = sorted(self.model.rows)
        assert sorted(self.t.keys().tolist()) == keys and len(self.t) == len(keys)
        assert self.t.contains(UNIVERSE).tolist() == [k in self.model.rows for k in UNIVERSE]
        if keys:
            np.testing.assert_array_equal(self.t.pull(keys, create=False),
                                          self.model.pull(keys, create=False))
            stats = self.t.row_stats(keys)
            assert stats["pushes"].tolist() == [self.model.pushes[k] for k in keys]
            assert stats["last_push_step"].tolist() == [self.model.last[k] for k in keys]
        self.t.check()


TestTableMachine = TableMachine.TestCase
TestTableMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


# ---- processes ------------------------------------------------------------------------------
# (worker functions run in spawned children, which import this module by name)

ZIPF_KEYS = 3000


def zipf_batches(seed: int, nbatch: int, size: int, dtype: str):
    """Reproducible (keys, grads) batches: zipf-skewed keys over ZIPF_KEYS hashed ids
    (overlapping between seeds), small integer grads."""
    rng = np.random.default_rng(seed)
    for _ in range(nbatch):
        ids = (rng.zipf(1.3, size=size) - 1) % ZIPF_KEYS
        keys = (ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(seed % 2)
        yield keys, rng.integers(-5, 6, size=(size, 2)).astype(dtype)


def push_zipf(store: str, name: str, seed: int, nbatch: int, size: int, flags, idx: int) -> int:
    """Push this seed's batches once `go` is set; returns the batches pushed."""
    s = shmps.attach(store)
    try:
        t = s[name]
        batches = list(zipf_batches(seed, nbatch, size, t.dtype.name))
        flags[2 + idx] = 1
        while not flags[GO]:
            time.sleep(0.0005)
        for keys, g in batches:
            t.push(keys, g)
        return len(batches)
    finally:
        s.close()


def pull_init(store: str, name: str, keys: list, reverse: bool) -> list:
    """Create table `name` (normal init, seed 42) and pull `keys` (in some order)."""
    s = shmps.attach(store)
    try:
        t = s.table(name, dim=5, capacity=100, init=("normal", 0.0, 1.0), seed=42)
        k = np.array(keys[::-1] if reverse else keys, np.uint64)
        rows = t.pull(k)
        return (rows[::-1] if reverse else rows).tolist()
    finally:
        s.close()


def push_forever(store: str, name: str, flags, idx: int, new_every: int) -> int:
    """Push zipf keys (and every `new_every` batches a new key, so the creation lock is
    taken too) until stop; a victim to be killed."""
    s = shmps.attach(store)
    try:
        t = s[name]
        rng = np.random.default_rng(idx)
        n = 0
        flags[2 + idx] = 0
        while not flags[STOP]:
            keys = ((rng.zipf(1.2, size=256) - 1) % 500).astype(np.uint64)
            if new_every and n % new_every == 0:
                keys[0] = np.uint64(10**6 + 1000 * idx + n)
            t.push(keys, np.ones((256, 8)))
            n += 1
            flags[2 + idx] = n
        return n
    finally:
        s.close()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["int32", "float64"])
def test_four_processes_exact_sums(store, store_name, dtype):
    """4 processes pushing known integers with sum to overlapping zipf keys (creating
    them concurrently) give exact per-key totals and exact push counts."""
    t = store.table("sums", dim=2, dtype=dtype, capacity=2 * ZIPF_KEYS, optimizer="sum",
                    shards=3)
    seeds, nbatch, size = [11, 12, 13, 14], 40, 512
    flags = new_flags(4)
    with Workers() as ws:
        for i, seed in enumerate(seeds):
            ws.start(push_zipf, store_name, "sums", seed, nbatch, size, flags, i)
        wait_until(lambda: all(flags[2 + i] for i in range(4)), 120, "workers ready")
        flags[GO] = 1
        assert ws.results(120) == [nbatch] * 4
    want: dict = {}
    count: dict = {}
    for seed in seeds:
        for keys, g in zipf_batches(seed, nbatch, size, dtype):
            for k, row in zip(keys.tolist(), g.astype(np.int64)):
                want[k] = want.get(k, 0) + row
                count[k] = count.get(k, 0) + 1
    keys = np.array(sorted(want), np.uint64)
    assert len(t) == keys.size
    np.testing.assert_array_equal(t.pull(keys, create=False).astype(np.int64),
                                  np.stack([want[k] for k in keys.tolist()]))
    assert t.row_stats(keys)["pushes"].tolist() == [count[k] for k in keys.tolist()]
    assert t.stats()["step"] == 4 * nbatch
    t.check()


@pytest.mark.slow
def test_init_identical_across_processes(store, store_name):
    """Two processes creating their own tables with the same seed and init (pulling the
    keys in different orders) get bitwise identical rows, equal to the documented
    generator."""
    keys = [0, 1, 12345, 2**40, BIG]
    with Workers() as ws:
        a = ws.start(pull_init, store_name, "a", keys, False)
        b = ws.start(pull_init, store_name, "b", keys, True)
        ra, rb = np.array(a.result(120), np.float32), np.array(b.result(120), np.float32)
    assert ra.tobytes() == rb.tobytes()
    np.testing.assert_array_equal(ra, shmps.table.init_values(("normal", 0.0, 1.0), 42, keys, 5))
    for i, k in enumerate(keys):
        np.testing.assert_allclose(ra[i], init_row(["normal", 0.0, 1.0], 42, k, 5), rtol=1e-6)


@pytest.mark.slow
def test_sigkill_pushers_mid_batch(store, store_name):
    """kill -9 of a pusher at random instants (holding row locks or the creation lock)
    leaves the table usable by the others within 1 s, consistent and complete."""
    rng = random.Random(5)
    t = store.table("emb", dim=8, capacity=5000, optimizer=shmps.Adagrad(lr=0.1), shards=2)
    hot = np.arange(500, dtype=np.uint64)
    t.pull(hot)
    with Workers() as ws:
        for round_ in range(4):
            flags = new_flags(1)
            w = ws.start(push_forever, store_name, "emb", flags, 0, 3)
            wait_until(lambda: flags[2] >= 3, 60, "victim pushing")
            time.sleep(rng.uniform(0, 0.05))
            w.kill()
            t0 = time.monotonic()
            t.push(np.concatenate([hot, [np.uint64(10**9 + round_)]]), np.ones((501, 8)))
            t.pull(hot)
            assert time.monotonic() - t0 < 1.0, f"round {round_}: blocked by the dead pusher"
            t.check()
    assert set(hot.tolist()) <= set(t.keys().tolist())


def _repairs(t: shmps.Table) -> int:
    """Times the table's repair ran (shard 0's ctl.repairs, offset 112)."""
    sp = t._shards[0].spec
    return int(t._shards[0].seg.array(np.uint64, sp["index_off"] + 16 * sp["nslots"], 15)[14])


def test_repair_after_a_killed_creator_hides_no_live_key(store, store_name):
    """A creator SIGKILLed inside the creation lock is repaired by the next creator
    while another process lists the keys (keys(), and the bridge's snapshot of each
    shard): every listing holds every live key, and the table checks out after."""
    nstable, batch = 100_000, 20_000
    t = store.table("emb", dim=1, dtype="int32", capacity=1_000_000, optimizer="sum",
                    shards=8)
    t.push(np.arange(nstable, dtype=np.uint64), np.ones((nstable, 1), np.int32))
    rng = random.Random(7)
    repairs0 = _repairs(t)
    flags = new_flags(1)
    rounds = 0
    with Workers() as ws:
        obs = ws.start(keys_observer, store_name, "emb", nstable, flags, 0)
        wait_until(lambda: flags[2], 60, "observer ready")
        flags[GO] = 1
        deadline = time.monotonic() + 25
        while _repairs(t) - repairs0 < 6 and time.monotonic() < deadline:
            vf = new_flags(1)
            v = ws.start(create_new_keys, store_name, "emb", (1 << 40) + rounds * 10**7,
                         batch, vf, 0)
            wait_until(lambda: vf[2], 60, "creator ready")
            vf[GO] = 1
            wait_until(lambda: vf[2] >= 2, 30, "creator past its first batch")
            time.sleep(rng.uniform(0.0, 0.02))
            v.kill()
            # a new key: takes the creation lock (over, if the creator died in it)
            t.push(np.array([(1 << 50) + rounds], np.uint64), np.ones((1, 1), np.int32))
            rounds += 1
        time.sleep(0.2)
        flags[STOP] = 1
        seen = obs.result(60)
    repairs = _repairs(t) - repairs0
    assert repairs >= 1, f"no creator died inside the creation lock in {rounds} rounds"
    assert seen["calls"] > 10
    assert seen["bad"] == 0, (f"{seen['bad']} of {seen['calls']} listings missed live keys "
                              f"(worst {seen['worst']} of {nstable}) over {repairs} repairs")
    t.check()
    assert np.count_nonzero(t.keys() < nstable) == nstable


# ---- dead owners planted in each kind of claim ------------------------------------------

def _arrays(t: shmps.Table, key: int):
    """(shard, slots (nslots, 2) uint64, stripes (nrows, 2) uint64, slot index, row) of an
    existing key, through docs/tables.md's layout."""
    s = int(shmps.table.key_shards([key], t.nshards)[0])
    sh = t._shards[s]
    sp = sh.spec
    slots = sh.seg.array(np.uint64, sp["index_off"], 2 * sp["nslots"]).reshape(-1, 2)
    stripes = sh.seg.array(np.uint64, sp["stripes_off"], 2 * sp["nrows"]).reshape(-1, 2)
    ready = (slots[:, 1] >> np.uint64(62)) == 1
    i = int(np.flatnonzero(ready & (slots[:, 0] == np.uint64(key)))[0])
    row = int(slots[i, 1] & np.uint64((1 << 41) - 1)) - 1
    return s, slots, stripes, i, row


@pytest.fixture(scope="module")
def dead():
    """A token naming a process that has exited."""
    return dead_token()


def test_dead_row_lock_taken_over(store, dead):
    """A row lock held by a dead process is taken over by the next pusher (< 1 s)."""
    t = store.table("emb", dim=2, capacity=10, optimizer="sum", shards=2)
    t.push([5, 6], np.ones((2, 2)))
    _, _, stripes, _, row = _arrays(t, 5)
    stripes[row, 0] = np.uint64(dead)
    t0 = time.monotonic()
    t.push([5], np.ones((1, 2)))
    assert time.monotonic() - t0 < 1.0
    np.testing.assert_array_equal(t.pull([5, 6]), [[2, 2], [1, 1]])
    assert t.stats()["takeovers"] >= 1
    t.check()


def test_dead_writer_odd_seq_repaired_by_reader(store, dead):
    """A pusher that died mid-row (lock held, seq odd) does not block pulls: the reader
    takes the lock over and closes the seq (< 1 s)."""
    t = store.table("emb", dim=2, capacity=10, init=3.0)
    t.pull([7])
    _, slots, stripes, i, row = _arrays(t, 7)
    stripes[row, 0] = np.uint64(dead)
    slots[i, 1] = slots[i, 1] + np.uint64(1 << 41)   # seq odd: a write in progress
    t0 = time.monotonic()
    np.testing.assert_array_equal(t.pull([7]), [[3, 3]])
    assert time.monotonic() - t0 < 1.0
    assert not (int(slots[i, 1]) >> 41) & 1
    t.push([7], np.ones((1, 2)))
    t.check()


def test_dead_creator_mid_insert_repaired(store, dead):
    """A creator that died holding the creation lock, with a claimed slot and a row
    taken, is taken over within 1 s; repair tombstones the claim and frees the row."""
    t = store.table("emb", dim=2, capacity=4, optimizer="sum")
    t.push([1], np.ones((1, 2)))
    sh = t._shards[0]
    sp = sh.spec
    slots = sh.seg.array(np.uint64, sp["index_off"], 2 * sp["nslots"]).reshape(-1, 2)
    ctl = sh.seg.array(np.uint64, sp["index_off"] + 16 * sp["nslots"], 32)
    empty = int(np.flatnonzero(slots[:, 1] == 0)[0])
    slots[empty] = [np.uint64(77), np.uint64((1 << 63) | (dead & ((1 << 62) - 1)))]  # CLAIM
    ctl[11] = ctl[11] + np.uint64(1)      # hwm (offset 88): the dead creator took a row
    ctl[8] = np.uint64(dead)              # the creation lock's owner (offset 64)
    t0 = time.monotonic()
    t.pull([2, 3, 4])                     # needs 3 more rows: the leaked one is back
    assert time.monotonic() - t0 < 1.0
    assert len(t) == 4 and sorted(t.keys().tolist()) == [1, 2, 3, 4]
    t.check()


def _plant_claim_and_dead_lock(t: shmps.Table, dead: int) -> tuple[np.ndarray, int]:
    """_plant_dead_creator's dead creator, its claim and row in shard 3; returns shard
    3's slots and the claimed one's index."""
    slots3 = _plant_dead_creator(t, dead, shard=3)[3][0]
    return slots3, int(np.flatnonzero(slots3[:, 1] >> np.uint64(62) == 2)[0])


def test_repair_by_a_call_on_one_shard_repairs_every_shard(store, dead):
    """A batch views only the shards its keys hash to (and shard 0); one that takes the
    creation lock over from a dead creator still repairs the shards it does not touch:
    the dead creator's claim and row in shard 3 are undone by a pull of shard-0 keys."""
    t = store.table("emb", dim=2, capacity=64, optimizer="sum", shards=4)
    t.push(np.arange(20, dtype=np.uint64), np.ones((20, 2)))
    slots3, empty = _plant_claim_and_dead_lock(t, dead)
    new = [k for k in range(10**6 + 1, 10**6 + 999)
           if shmps.table.key_shards([k], 4)[0] == 0][:3]
    repairs0 = _repairs(t)
    t.pull(new)                           # new keys of shard 0 only: take the lock over
    assert _repairs(t) == repairs0 + 1
    assert int(slots3[empty, 1]) >> 62 == 3   # the claim is a tombstone
    assert len(t) == 23
    t.check()                             # no claim left, shard 3's row free again


def test_a_repair_that_cannot_view_every_shard_leaves_the_lock_to_the_next_taker(store, dead):
    """A batch that takes the creation lock over from a dead creator views every shard
    before it repairs.  If this caller cannot (here it passes no base for shard 2: a
    shard it has not mapped), it repaired nothing: it fails, and hands the lock back to
    the dead creator, so that the next taker, which views every shard, repairs: the dead
    creator's claim in shard 3 becomes a tombstone and its row is free again (released
    clean, as before 2026-11-27, nothing repaired them: review 15 F8)."""
    from shmps import _native
    from shmps._native import ffi, lib

    t = store.table("emb", dim=2, capacity=64, optimizer="sum", shards=4)
    t.push(np.arange(20, dtype=np.uint64), np.ones((20, 2)))
    slots3, empty = _plant_claim_and_dead_lock(t, dead)
    new = np.asarray([k for k in range(10**6 + 1, 10**6 + 999)
                      if shmps.table.key_shards([k], 4)[0] == 0][:3], np.uint64)
    repairs0 = _repairs(t)
    bases = ffi.new("void *[]", [t._bases[i] if i != 2 else ffi.NULL for i in range(4)])
    out = np.zeros((3, 2), np.float32)
    scratch, nbytes, info = t._scratch(3)
    code = lib.shmps_table_pull(bases, 4, _native.token(), _native.addr(new), 3,
                                ffi.from_buffer(out), 1, ffi.NULL, scratch, nbytes, info)
    assert code == lib.SHMPS_E_ARG        # new keys of shard 0 only: took the lock over
    assert _repairs(t) == repairs0 and int(slots3[empty, 1]) >> 62 == 2   # still CLAIM
    assert int(_ctl(t, 0)[8]) == dead     # the lock is the dead creator's again
    t.pull(new)                           # takes it over again, and repairs
    assert _repairs(t) == repairs0 + 1
    assert int(slots3[empty, 1]) >> 62 == 3   # the claim is a tombstone
    assert len(t) == 23 and int(_ctl(t, 0)[8]) == 0
    t.check()                             # no claim left, shard 3's row free again


def test_a_repair_that_meets_a_damaged_shard_releases_the_lock(store, dead):
    """The same, but the shard cannot be viewed because its control block is damaged
    (its magic overwritten): damage every process meets.  The taker raises
    CorruptSegment and releases the lock clean: handed back to the dead creator, it
    failed every later call that takes the lock in every process, each after a takeover
    (review 17 F1): later creations in the sound shards go on.  (The dead creator's
    claim stays: `table.check()` reports it, docs/tables.md.)"""
    t = store.table("emb", dim=2, capacity=64, optimizer="sum", shards=4)
    t.push(np.arange(20, dtype=np.uint64), np.ones((20, 2)))
    slots3, empty = _plant_claim_and_dead_lock(t, dead)
    _ctl(t, 2)[0] = np.uint64(0)          # shard 2 cannot be viewed
    new = [k for k in range(10**6 + 1, 10**6 + 999)
           if shmps.table.key_shards([k], 4)[0] == 0][:3]
    with pytest.raises(shmps.CorruptSegment):
        t.pull(new)                       # new keys of shard 0 only: take the lock over
    assert int(_ctl(t, 0)[8]) == 0        # released clean
    for k in new:                         # later creations in sound shards go on
        t.pull([k])
    assert len(t) == 23 and int(_ctl(t, 0)[8]) == 0


def test_repair_leaves_a_sound_shard_unwritten(store, dead):
    """The repair after a creator died holding the creation lock writes nothing in a
    shard whose bookkeeping agrees with its index (its links, free list in delete
    order, and control block are the same words after), and repairs the other."""
    t = store.table("emb", dim=2, capacity=64, optimizer="sum", shards=2)
    keys = np.arange(40, dtype=np.uint64)
    t.push(keys, np.ones((40, 2)))
    t.delete(keys[::3])                   # free lists not in row order
    regions = _plant_dead_creator(t, dead)
    before = [(c.copy(), l.copy()) for _, c, l in regions]
    new = next(k for k in range(10**6 + 1, 10**6 + 99)
               if shmps.table.key_shards([k], 2)[0] == 1)
    t.push([new], np.ones((1, 2)))        # a new key (shard 1): takes the lock over, repairs
    ctl0, links0 = regions[0][1], regions[0][2]
    np.testing.assert_array_equal(links0, before[0][1])
    changed = np.flatnonzero(ctl0 != before[0][0]).tolist()
    assert set(changed) <= {8, 9, 10, 14}, changed  # lock word, table_live, repairs only
    assert int(ctl0[14]) == int(before[0][0][14]) + 1
    assert not np.array_equal(regions[1][2], before[1][1])   # shard 1 rebuilt
    assert sorted(t.keys().tolist()) == sorted(set(range(40)) - set(range(0, 40, 3))
                                               | {new})
    t.check()


#: An LD_PRELOAD library whose calloc fails (ENOMEM, one line on stderr) for nmemb
#: ``n`` of 8-byte elements once armed with shmps_test_fail_calloc(n) (-1: disarmed):
#: the repair's private bitmap of a shard's rows, calloc(nrows / 64 + 1, 8), cannot be
#: had.  shmps runs unchanged; only libc's answer is.
_FAILING_CALLOC = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <unistd.h>
extern void *__libc_calloc(size_t, size_t);
static long fail_n = -1, failures = 0;
void shmps_test_fail_calloc(long n) { fail_n = n; }
long shmps_test_calloc_failures(void) { return failures; }
void *calloc(size_t n, size_t size) {
    if (fail_n >= 0 && size == 8 && n == (size_t)fail_n) {
        static const char msg[] = "calloc failed on purpose\n";
        (void)!write(2, msg, sizeof msg - 1);
        failures++;
        errno = ENOMEM;
        return NULL;
    }
    return __libc_calloc(n, size);
}
"""

_PUSH_WITHOUT_BITMAP = r"""
import ctypes, sys
import numpy as np
import shmps
name, n, key = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
libc = ctypes.CDLL(None)
libc.shmps_test_fail_calloc.argtypes = [ctypes.c_long]
with shmps.attach(name, create=False) as s:
    t = s["emb"]
    keys, g = np.array([key], np.uint64), np.ones((1, 2))
    libc.shmps_test_fail_calloc(n)
    t.push(keys, g)        # takes the dead creator's lock over: the repair
    libc.shmps_test_fail_calloc(-1)
    print("failures", libc.shmps_test_calloc_failures(), flush=True)
"""


@pytest.fixture(scope="module")
def failing_calloc(tmp_path_factory) -> str:
    """The path of the _FAILING_CALLOC library (skip without a C compiler)."""
    from helpers import build_preload

    return build_preload(tmp_path_factory.mktemp("calloc"), _FAILING_CALLOC, "failing-calloc")


def _plant_dead_creator(t: shmps.Table, dead: int, shard: int = 1) -> list:
    """The state of a creator that died inside the creation lock: a CLAIM slot and a row
    taken in ``shard``, the lock's owner dead (docs/tables.md's layout).  Returns per
    shard (slots, ctl, links) arrays over the segment."""
    regions = []
    for sh in t._shards:
        sp = sh.spec
        ctl_off = sp["index_off"] + 16 * sp["nslots"]
        regions.append((sh.seg.array(np.uint64, sp["index_off"], 2 * sp["nslots"]).reshape(-1, 2),
                        sh.seg.array(np.uint64, ctl_off, 32),
                        sh.seg.array(np.uint64, ctl_off + 256, sp["nrows"])))
    slots, ctl, _ = regions[shard]
    empty = int(np.flatnonzero(slots[:, 1] == 0)[0])
    slots[empty] = [np.uint64(10**6), np.uint64((1 << 63) | (dead & ((1 << 62) - 1)))]
    ctl[11] = ctl[11] + np.uint64(1)      # hwm: the dead creator took a row
    regions[0][1][8] = np.uint64(dead)    # the creation lock's owner (shard 0, offset 64)
    return regions


def _free_list(ctl: np.ndarray, links: np.ndarray) -> list[int]:
    """A shard's free rows, in free-list order (ctl.free_head at offset 96)."""
    out, f = [], int(ctl[12])
    while f and len(out) <= len(links):
        out.append(f - 1)
        f = int(links[f - 1])
    return out


def test_repair_without_its_bitmap_marks_the_link_words_and_rebuilds_every_shard(
        store, store_name, dead, failing_calloc):
    """The repair's fallback: a process whose calloc of the repair's bitmap fails
    (LD_PRELOAD) takes over a dead creator's lock and repairs with LINK_SEEN marks in
    the shared link words: the claim is tombstoned, the row it took freed, every live
    key kept, every shard's free list rebuilt in row order (no shard is left unwritten
    without the bitmap), no LINK_SEEN left behind, and the table checks out."""
    import subprocess
    import sys

    from helpers import child_env

    t = store.table("emb", dim=2, capacity=100_000, optimizer="sum", shards=2)
    keys = np.arange(40, dtype=np.uint64)
    t.push(keys, np.ones((40, 2)))
    t.delete(keys[::3])                   # free lists in delete order, not row order
    regions = _plant_dead_creator(t, dead)
    new = next(k for k in range(10**6 + 1, 10**6 + 99)
               if shmps.table.key_shards([k], 2)[0] == 1)
    n = max(sh.spec["nrows"] for sh in t._shards) // 64 + 1
    env = child_env(LD_PRELOAD=failing_calloc)
    r = subprocess.run([sys.executable, "-c", _PUSH_WITHOUT_BITMAP, store_name, str(n),
                        str(new)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-600:]
    assert r.stdout.split() == ["failures", "1"], (r.stdout, r.stderr[-300:])
    want = sorted(set(range(40)) - set(range(0, 40, 3)) | {new})
    assert sorted(t.keys().tolist()) == want and len(t) == len(want)
    for s_, (_, ctl, links) in enumerate(regions):
        hwm = int(ctl[11])
        live = links[:hwm] == np.uint64(2**64 - 1)
        assert not (links[:hwm] == np.uint64(2**64 - 2)).any(), f"shard {s_}: LINK_SEEN left"
        free = _free_list(ctl, links)
        assert free == sorted(np.flatnonzero(~live).tolist()), f"shard {s_}: {free}"
    assert int(regions[1][1][11]) - len(_free_list(regions[1][1], regions[1][2])) \
        == int(np.count_nonzero(shmps.table.key_shards(want, 2) == 1))   # the row is back
    t.check()
    t.push([new + 10**6], np.ones((1, 2)))   # creations go on
    t.check()


def test_repair_turns_the_marks_of_a_repair_killed_in_its_fallback_back_live(store, dead):
    """A repair killed half-way in its fallback leaves LINK_SEEN in live rows' link words
    (keys() misses those rows meanwhile); the next repair makes them live again first,
    so a shard whose bookkeeping agrees with its index once they are is left exactly
    as it was (its free list in delete order), and every key is listed again."""
    t = store.table("emb", dim=2, capacity=64, optimizer="sum", shards=2)
    keys = np.arange(40, dtype=np.uint64)
    t.push(keys, np.ones((40, 2)))
    t.delete(keys[::3])
    links0 = [(sh.seg.array(np.uint64, sh.spec["index_off"] + 16 * sh.spec["nslots"] + 256,
                            sh.spec["nrows"])) for sh in t._shards][0]
    before = links0.copy()
    regions = _plant_dead_creator(t, dead)
    marked = np.flatnonzero(links0 == np.uint64(2**64 - 1))[:5]
    assert len(marked) == 5
    links0[marked] = np.uint64(2**64 - 2)         # LINK_SEEN, as the killed repair left it
    assert len(t.keys()) == len(t) - 5            # (missed until the next repair)
    new = next(k for k in range(10**6 + 1, 10**6 + 99)
               if shmps.table.key_shards([k], 2)[0] == 1)
    t.push([new], np.ones((1, 2)))                # takes the lock over: the repair
    np.testing.assert_array_equal(regions[0][2], before)   # shard 0 as it was
    assert sorted(t.keys().tolist()) == sorted(set(range(40)) - set(range(0, 40, 3)) | {new})
    t.check()


def _ctl(t: shmps.Table, shard: int) -> np.ndarray:
    """Shard ``shard``'s control block words (docs/tables.md "ctl")."""
    sp = t._shards[shard].spec
    return t._shards[shard].seg.array(np.uint64, sp["index_off"] + 16 * sp["nslots"], 32)


def _refused_on_attach(store_name: str, table: str) -> None:
    """Another attach of the store refuses the table (CorruptSegment), not a crash."""
    other = shmps.attach(store_name)
    try:
        with pytest.raises(shmps.CorruptSegment):
            other[table]
    finally:
        other.close()


@pytest.mark.parametrize("where,word,value", [
    ("ctl", 11, 0),          # hwm below the rows in use: creations would reuse live rows
    ("ctl", 12, 10**6),      # free head past hwm (and past the rows)
    ("ctl", 10, 0),          # table_live (shard 0) not the sum of the shards' counts
    ("ctl", 10, 65),         # table_live above the capacity
    ("used", 0, 0),          # a shard's table_used (header offset 1088) too small
    ("used", 0, 10**6),      # ... and too large
], ids=["hwm-0", "free-head", "table-live-0", "table-live-over", "used-0", "used-big"])
def test_small_table_counters_are_refused_on_attach(store, store_name, where, word, value):
    """A table whose row counters are damaged, too small included (hwm under the rows
    in use, a key count not the sum of its shards'), is CorruptSegment on attach."""
    t = store.table("emb", dim=2, capacity=64, optimizer="sum", shards=2)
    t.push(np.arange(20, dtype=np.uint64), np.ones((20, 2)))
    shard = 1 if where == "used" or word != 10 else 0
    if where == "ctl":
        _ctl(t, shard)[word] = np.uint64(value)
    else:
        t._shards[shard].seg.array(np.uint64, 1088, 1)[0] = np.uint64(value)
    _refused_on_attach(store_name, "emb")


def test_table_counters_are_not_checked_while_the_creation_lock_is_held(store, store_name,
                                                                        dead):
    """The attach check of the counters is skipped while the creation lock is held (a
    creator inside moves them): a dead creator's table with a wrong key count attaches,
    and the next creation repairs the count from the index."""
    t = store.table("emb", dim=2, capacity=64, optimizer="sum", shards=2)
    t.push(np.arange(20, dtype=np.uint64), np.ones((20, 2)))
    ctl0 = _ctl(t, 0)
    ctl0[10] = np.uint64(3)       # table_live: as a creator killed mid-count could leave it
    ctl0[8] = np.uint64(dead)     # ... holding the creation lock
    other = shmps.attach(store_name)
    try:
        o = other["emb"]
        o.push([100], np.ones((1, 2)))      # takes the lock over: the repair recounts
        assert len(o) == 21
        o.check()
    finally:
        other.close()
    other = shmps.attach(store_name)      # counts agree again: attaches with the check
    try:
        assert len(other["emb"]) == 21
    finally:
        other.close()


def test_dead_freeze_holder_does_not_block_push(store, dead):
    """A deleter that died holding a shard's freeze does not block pushes (< 1 s)."""
    t = store.table("emb", dim=2, capacity=4, optimizer="sum")
    t.push([1], np.ones((1, 2)))
    t._shards[0].seg.array(np.uint64, 384, 1)[0] = np.uint64(dead)
    t0 = time.monotonic()
    t.push([1], np.ones((1, 2)))
    assert time.monotonic() - t0 < 1.0
    np.testing.assert_array_equal(t.pull([1]), [[2, 2]])


def test_corrupt_control_block_is_refused(store, store_name):
    """A table whose control block is damaged is CorruptSegment on attach, not a crash."""
    t = store.table("emb", dim=2, capacity=4)
    sp = t._shards[0].spec
    t._shards[0].seg.array(np.uint64, sp["index_off"] + 16 * sp["nslots"], 1)[0] = 0
    _refused_on_attach(store_name, "emb")
