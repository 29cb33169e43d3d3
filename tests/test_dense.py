"""Unit tests of dense tensors: every dtype and updater, rows, shards, views, shapes,
get-or-create, catalog, stats, non-blocking pushes.  One behaviour per test, each
checked against the numpy model in helpers.Model."""
from __future__ import annotations

import numpy as np
import pytest

import shmps
from helpers import Model, Workers

pytestmark = pytest.mark.timeout(60)

DTYPES = ["int8", "int32", "float16", "float32", "float64"]
FLOATS = ["float16", "float32", "float64"]
REDUCTIONS = ["sum", "assign", "max", "min"]
UPDATERS = {"sum": shmps.Sum(), "assign": shmps.Assign(), "max": shmps.Max(),
            "min": shmps.Min()}


def ints(rng: np.random.Generator, shape: tuple, dtype: str) -> np.ndarray:
    """Small integers (exact in every dtype); int8 gets its full range so sums wrap."""
    lo, hi = (-128, 128) if dtype == "int8" else (-50, 51)
    return rng.integers(lo, hi, size=shape).astype(dtype)


# ---- reductions and updaters ----------------------------------------------------------

@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduction_whole_push(store, dtype, reduction):
    """A whole push applies sum/assign/max/min element-wise, exactly, in every dtype."""
    rng = np.random.default_rng(1)
    init = ints(rng, (6, 5), dtype)
    t = store.dense("w", shape=(6, 5), dtype=dtype, init=init, optimizer=reduction)
    m = Model((6, 5), dtype, UPDATERS[reduction], init)
    m.check(t.pull(), what="init")
    for _ in range(3):
        g = ints(rng, (6, 5), dtype)
        t.push(g)
        m.push(g)
    np.testing.assert_array_equal(t.pull(), m.w)  # small integers: exact even in floats


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduction_rows_push_with_duplicates(store, dtype, reduction):
    """A rows= push changes only its rows; repeats apply in order (sum adds, assign: last wins)."""
    rng = np.random.default_rng(2)
    init = ints(rng, (7, 3), dtype)
    t = store.dense("w", shape=(7, 3), dtype=dtype, init=init, optimizer=reduction)
    m = Model((7, 3), dtype, UPDATERS[reduction], init)
    rows = np.array([0, 4, 4, 6, 0, 4])
    for _ in range(3):
        g = ints(rng, (rows.size, 3), dtype)
        t.push(g, rows=rows)
        m.push(g, rows=rows)
    np.testing.assert_array_equal(t.pull(), m.w)
    untouched = [1, 2, 3, 5]
    np.testing.assert_array_equal(t.pull(rows=untouched), init[untouched])


def test_sum_duplicates_accumulate_exactly(store):
    """Pushing 1 to row 2 five times in one push adds 5 there and nothing elsewhere."""
    t = store.dense("w", shape=(4, 2), dtype="int32")
    t.push(np.ones((5, 2), np.int32), rows=[2, 2, 2, 2, 2])
    np.testing.assert_array_equal(t.pull(), [[0, 0], [0, 0], [5, 5], [0, 0]])


def test_int8_sum_wraps_modulo_256(store):
    """int8 sums wrap like numpy's (127 + 1 == -128)."""
    t = store.dense("w", shape=(3,), dtype="int8", init=127)
    t.push(np.array([1, 2, -128], np.int8))
    np.testing.assert_array_equal(t.pull(), np.array([-128, -127, -1], np.int8))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_sgd(store, dtype, weight_decay):
    """SGD(lr, weight_decay) matches torch.optim.SGD's formula, whole and rows pushes."""
    rng = np.random.default_rng(3)
    opt = shmps.SGD(lr=0.25, weight_decay=weight_decay)
    init = rng.normal(size=(8, 4)).astype(dtype)
    t = store.dense("w", shape=(8, 4), dtype=dtype, init=init, optimizer=opt)
    m = Model((8, 4), dtype, opt, init)
    for k in range(4):
        g = rng.normal(size=(8, 4))
        t.push(g)
        m.push(g)
        rows = np.array([1, 5, 5, 7])
        gr = rng.normal(size=(4, 4))
        t.push(gr, rows=rows)
        m.push(gr, rows=rows)
        m.check(t.pull(), what=f"after push {k}")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("kw", [dict(), dict(dampening=0.3, weight_decay=0.01),
                                dict(nesterov=True, momentum=0.8)],
                         ids=["plain", "dampening+wd", "nesterov"])
def test_momentum(store, dtype, kw):
    """Momentum matches torch.optim.SGD with momentum; duplicate rows are summed first."""
    rng = np.random.default_rng(4)
    opt = shmps.Momentum(lr=0.1, **kw)
    init = rng.normal(size=(6, 3)).astype(dtype)
    t = store.dense("w", shape=(6, 3), dtype=dtype, init=init, optimizer=opt)
    m = Model((6, 3), dtype, opt, init)
    for k in range(3):
        g = rng.normal(size=(6, 3))
        t.push(g)
        m.push(g)
        rows = np.array([2, 0, 2, 2])
        gr = rng.normal(size=(4, 3))
        t.push(gr, rows=rows)
        m.push(gr, rows=rows)
        m.check(t.pull(), what=f"after round {k}")


def test_momentum_duplicates_summed_not_sequential(store):
    """Momentum on rows [0, 0] with grads a, b equals one step with a + b (not two steps)."""
    opt = shmps.Momentum(lr=1.0, momentum=0.5)
    t = store.dense("w", shape=(2,), dtype="float64", optimizer=opt)
    t.push(np.array([1.0, 0.0]))                       # step 1: buf = 1, w = -1
    t.push(np.array([2.0, 3.0]), rows=[0, 0])          # step 2: buf = 0.5 + 5, w = -6.5
    np.testing.assert_array_equal(t.pull(), [-6.5, 0.0])


def test_float16_computed_in_float32(store):
    """float16 values are updated in float32 and rounded once per push."""
    t = store.dense("w", shape=(4,), dtype="float16", init=1.0, optimizer=shmps.SGD(lr=0.1))
    g = np.array([1e-4, 3.3, -2.7, 0.5])
    t.push(g)
    want = (np.float32(1.0) - np.float32(0.1) * g.astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(t.pull(), want)


# ---- pulls --------------------------------------------------------------------------

def test_pull_out_fills_and_returns_the_given_array(store):
    """pull(out=arr) writes into arr and returns arr itself (no allocation)."""
    t = store.dense("w", shape=(5, 4), dtype="float32", init=2.5)
    out = np.zeros((5, 4), np.float32)
    assert t.pull(out=out) is out
    np.testing.assert_array_equal(out, 2.5)
    rows_out = np.zeros((2, 4), np.float32)
    assert t.pull(rows=[4, 1], out=rows_out) is rows_out
    np.testing.assert_array_equal(rows_out, 2.5)


@pytest.mark.parametrize("bad", [np.zeros((5, 4), np.float64), np.zeros((4, 4), np.float32),
                                 np.zeros((4, 5), np.float32).T,
                                 np.zeros((5, 4), np.float32)[::1].copy().view(np.int32)],
                         ids=["dtype", "shape", "non-contiguous", "int view"])
def test_pull_out_wrong_array_rejected(store, bad):
    """pull(out=) with the wrong dtype, shape or layout raises SchemaError."""
    t = store.dense("w", shape=(5, 4), dtype="float32")
    with pytest.raises(shmps.SchemaError):
        t.pull(out=bad)


def test_pull_rows_order_duplicates_and_empty(store):
    """pull(rows=) returns rows in the order asked, repeats included; [] gives 0 rows."""
    init = np.arange(12, dtype=np.int32).reshape(6, 2)
    t = store.dense("w", shape=(6, 2), dtype="int32", init=init)
    np.testing.assert_array_equal(t.pull(rows=[5, 0, 5, 3]), init[[5, 0, 5, 3]])
    empty = t.pull(rows=np.array([], np.int64))
    assert empty.shape == (0, 2) and empty.dtype == np.int32


def test_pull_is_a_private_copy(store):
    """A pulled array does not change when the tensor does."""
    t = store.dense("w", shape=(3,), dtype="int32")
    a = t.pull()
    t.push(np.ones(3, np.int32))
    np.testing.assert_array_equal(a, 0)
    a[0] = 99
    np.testing.assert_array_equal(t.pull(), 1)


def test_inconsistent_pull_returns_the_same_values(store):
    """pull(consistent=False) (seqlocked stripes) returns what pull() does at rest."""
    rng = np.random.default_rng(5)
    init = rng.normal(size=(300, 50)).astype(np.float32)
    t = store.dense("w", shape=(300, 50), init=init, shard_rows=70)
    np.testing.assert_array_equal(t.pull(consistent=False), init)
    np.testing.assert_array_equal(t.pull(rows=[299, 0, 140], consistent=False),
                                  init[[299, 0, 140]])


@pytest.mark.parametrize("consistent", [True, False])
@pytest.mark.parametrize("case", ["one", "few sorted", "few unsorted", "many sorted",
                                  "many unsorted", "repeats"])
def test_pull_rows_over_shards_in_one_call(store, case, consistent):
    """pull(rows=) of rows over several shards, in any order, is one C call: up to 64
    unordered rows are grouped there, more come back SHMPS_UNSORTED and are sorted by
    shard in Python first.  Each case returns what indexing the values returns, and
    counts one pull of len(rows) rows."""
    rng = np.random.default_rng(9)
    init = rng.normal(size=(200, 3)).astype(np.float32)
    t = store.dense("w", shape=(200, 3), init=init, shard_rows=16)
    rows = {"one": np.array([170]), "few sorted": np.array([1, 3, 40, 41, 199]),
            "few unsorted": np.array([199, 0, 150, 3, 40, 16, 15]),
            "many sorted": np.sort(rng.integers(0, 200, 150)),
            "many unsorted": rng.permutation(200)[:150],
            "repeats": np.array([7, 190, 7, 7, 33, 190] * 20)}[case].astype(np.int64)
    before = t.stats()
    out = np.full((rows.size, 3), -1, np.float32)
    assert t.pull(rows=rows, out=out, consistent=consistent) is out
    np.testing.assert_array_equal(out, init[rows])
    np.testing.assert_array_equal(t.pull(rows=rows.tolist(), consistent=consistent),
                                  init[rows])   # a list: checked in Python first
    after = t.stats()
    assert after["pulls"] - before["pulls"] == 2
    assert after["rows_pulled"] - before["rows_pulled"] == 2 * rows.size


@pytest.mark.parametrize("bad", [-1, 200])
def test_pull_rows_out_of_range_names_the_row_and_writes_nothing(store, bad):
    """An int64 array of rows goes to C unchecked; a row out of range there is an
    OutOfRange naming it, with ``out`` untouched (C checks every row before copying)."""
    t = store.dense("w", shape=(200, 3), dtype="float32", init=1.0, shard_rows=16)
    out = np.zeros((3, 3), np.float32)
    with pytest.raises(shmps.OutOfRange, match=f"row {bad} "):
        t.pull(rows=np.array([5, 100, bad], np.int64), out=out)
    np.testing.assert_array_equal(out, 0)
    lib, native = shmps._native.lib, shmps._native
    r = np.array([100, 5], np.int64)                         # shards decreasing
    pos = np.array([0, 1], np.int64)
    assert lib.shmps_dense_pull_rows(t._shard_bases(), t.nshards, t.shard_rows,
                                     native.token(), native.addr(r), native.addr(pos), 2,
                                     native.addr(out), 1) == lib.SHMPS_E_ARG
    r = np.array([5, 100], np.int64)
    for p in ([0, 2], [-1, 0]):                              # a place outside out
        assert lib.shmps_dense_pull_rows(
            t._shard_bases(), t.nshards, t.shard_rows, native.token(), native.addr(r),
            native.addr(np.array(p, np.int64)), 2, native.addr(out), 1) == lib.SHMPS_E_BOUNDS
    # the last shard holds rows 192..199 of 192..207: a row past them in a run of that
    # shard, wherever it is in the run, or among rows C groups by shard itself
    for bad_rows in ([201, 193], [193, 201, 195], [5, 201, 193], [201, 5], [199, 200, 5]):
        r = np.array(bad_rows, np.int64)
        assert lib.shmps_dense_pull_rows(t._shard_bases(), t.nshards, t.shard_rows,
                                         native.token(), native.addr(r), native.ffi.NULL,
                                         r.size, native.addr(out), 1) == lib.SHMPS_E_BOUNDS
    many = np.arange(199, 99, -1, dtype=np.int64)            # 100 rows, unordered
    big = np.zeros((100, 3), np.float32)
    assert lib.shmps_dense_pull_rows(t._shard_bases(), t.nshards, t.shard_rows,
                                     native.token(), native.addr(many), native.ffi.NULL, 100,
                                     native.addr(big), 1) == lib.SHMPS_UNSORTED
    np.testing.assert_array_equal(big, 0)
    np.testing.assert_array_equal(out, 0)


# ---- shards -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["int8", "float32", "float64"])
def test_multi_shard_whole_and_rows_across_shards(store, dtype):
    """Whole and rows= pushes across small shards (unsorted, repeated rows) match the model."""
    rng = np.random.default_rng(6)
    shape = (37, 5)
    t = store.dense("w", shape=shape, dtype=dtype, shard_rows=4)
    assert t.nshards == 10 and t.shard_rows == 4
    m = Model(shape, dtype, shmps.Sum())
    for _ in range(3):
        g = ints(rng, shape, dtype)
        t.push(g)
        m.push(g)
        rows = np.array([36, 0, 3, 4, 36, 17, 4, 4, 35])
        gr = ints(rng, (rows.size, 5), dtype)
        t.push(gr, rows=rows)
        m.push(gr, rows=rows)
    np.testing.assert_array_equal(t.pull(), m.w)
    pick = [36, 3, 4, 0, 20, 36]
    np.testing.assert_array_equal(t.pull(rows=pick), m.w[pick])
    # sorted rows (each shard's rows one run: sliced, not gathered)
    np.testing.assert_array_equal(t.pull(rows=sorted(pick)), m.w[sorted(pick)])
    out = np.empty((len(pick), 5), dtype)
    np.testing.assert_array_equal(t.pull(rows=pick, out=out), m.w[pick])


def test_rows_across_more_shards_than_one_call_holds_on_the_stack(store):
    """A rows= push or pull whose rows lie in over 64 shards (C allocates their specs
    then: dense.c find_runs) matches the model, unsorted and repeated rows included;
    a row past the last shard is refused before anything changes."""
    rng = np.random.default_rng(12)
    t = store.dense("w", shape=(150, 2), dtype="int32", shard_rows=1)
    assert t.nshards == 150
    m = Model((150, 2), "int32", shmps.Sum())
    rows = np.concatenate([rng.permutation(150)[:120], [149, 0, 149]])
    g = ints(rng, (rows.size, 2), "int32")
    t.push(g, rows=rows)
    m.push(g, rows=rows)
    np.testing.assert_array_equal(t.pull(rows=rows), m.w[rows])
    np.testing.assert_array_equal(t.pull(rows=np.sort(rows)), m.w[np.sort(rows)])
    with pytest.raises(shmps.OutOfRange):
        t.push(np.ones((100, 2), np.int32), rows=np.arange(51, 151))
    np.testing.assert_array_equal(t.pull(), m.w)


def test_multi_shard_momentum_rows_across_shards(store):
    """Momentum state lives per shard; rows pushes across shards match the model."""
    rng = np.random.default_rng(7)
    opt = shmps.Momentum(lr=0.05, momentum=0.9)
    t = store.dense("w", shape=(10, 3), dtype="float32", optimizer=opt, shard_rows=3)
    m = Model((10, 3), "float32", opt)
    for _ in range(4):
        rows = np.array([9, 0, 9, 5, 2, 3])
        g = rng.normal(size=(6, 3))
        t.push(g, rows=rows)
        m.push(g, rows=rows)
        m.check(t.pull())


def test_default_shards_of_a_large_tensor(store):
    """A tensor larger than one default shard is split, and reads back whole."""
    t = store.dense("w", shape=(9000, 1024), dtype="float32", init=1.0)  # ~35 MiB
    assert t.nshards >= 2
    t.push(np.full((3, 1024), 2.0, np.float32), rows=[0, 4500, 8999])
    a = t.pull()
    assert a.sum() == 9000 * 1024 + 3 * 1024 * 2
    np.testing.assert_array_equal(a[8999], 3.0)


# ---- view ---------------------------------------------------------------------------

def test_view_is_read_only_and_live(store):
    """view() is a zero-copy read-only array that shows later pushes."""
    t = store.dense("w", shape=(4, 3), dtype="int32")
    v = t.view()
    assert v.shape == (4, 3) and v.dtype == np.int32
    assert not v.flags.writeable
    with pytest.raises(ValueError):
        v[0, 0] = 1
    t.push(np.full((4, 3), 7, np.int32))
    np.testing.assert_array_equal(v, 7)
    t.push(np.ones((1, 3), np.int32), rows=[2])
    assert v[2, 0] == 8 and v[1, 0] == 7


def test_view_spans_page_aligned_shards(store):
    """With shards a whole number of pages, view() shows all shards back to back."""
    t = store.dense("w", shape=(2048, 4), dtype="float32", shard_rows=256)  # 4 KiB shards
    assert t.nshards == 8
    t.push(np.arange(2048 * 4, dtype=np.float32).reshape(2048, 4))
    np.testing.assert_array_equal(t.view(), np.arange(2048 * 4).reshape(2048, 4))


def test_view_of_unaligned_shards_is_a_clear_error(store):
    """view() of shards that are not whole pages raises a typed error saying why."""
    t = store.dense("w", shape=(10, 3), dtype="int32", shard_rows=3)
    with pytest.raises(shmps.InvalidArgument, match="page"):
        t.view()


def test_view_outlives_close(store):
    """An array returned by view() stays readable after the store is closed."""
    t = store.dense("w", shape=(8,), dtype="float64", init=3.0)
    v = t.view()
    store.close()
    np.testing.assert_array_equal(v, 3.0)


# ---- shapes -------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(3, 4, 5), (2, 3, 2, 2), (4, 1)])
def test_nd_shapes(store, shape):
    """n-d tensors: rows are the first axis; whole and rows pushes and pulls keep shape."""
    rng = np.random.default_rng(8)
    t = store.dense("w", shape=shape, dtype="int32", shard_rows=1)
    m = Model(shape, "int32", shmps.Sum())
    g = ints(rng, shape, "int32")
    t.push(g)
    m.push(g)
    rows = [shape[0] - 1, 0, shape[0] - 1]
    gr = ints(rng, (3,) + shape[1:], "int32")
    t.push(gr, rows=rows)
    m.push(gr, rows=rows)
    assert t.pull().shape == shape
    np.testing.assert_array_equal(t.pull(), m.w)
    np.testing.assert_array_equal(t.pull(rows=rows), m.w[rows])


@pytest.mark.parametrize("shape", [(0,), (0, 4)])
def test_zero_row_tensor(store, shape):
    """A tensor with 0 rows exists: pulls are empty, empty pushes are accepted."""
    t = store.dense("w", shape=shape, dtype="float32")
    assert t.pull().shape == shape
    t.push(np.zeros(shape, np.float32))
    t.push(np.zeros((0,) + shape[1:], np.float32), rows=np.array([], np.int64))
    assert t.pull(rows=[]).shape == (0,) + shape[1:]
    with pytest.raises(shmps.OutOfRange):
        t.pull(rows=[0])


def test_one_element_tensor(store):
    """A 1-element tensor pushes and pulls like any other."""
    t = store.dense("w", shape=(1,), dtype="float64", init=1.5, optimizer="max")
    t.push(np.array([4.0]))
    t.push(np.array([2.0]), rows=[0])
    np.testing.assert_array_equal(t.pull(), [4.0])


def test_scalar_tensor(store):
    """shape=() holds one value: push a 0-d gradient, pull a 0-d array."""
    t = store.dense("w", shape=(), dtype="float32", init=1.0)
    t.push(np.float32(2.0))
    t.push(np.array(0.5))
    t.push(np.array(0.25, np.float32))  # the one-call fast path
    a = t.pull()
    assert a.shape == () and a == 3.75
    t.push(np.ones(1, np.float32), rows=[0])
    assert t.pull(rows=[0]).shape == (1,) and t.pull() == 4.75


def test_zero_width_rows_rejected_clearly(store):
    """shape (3, 0) (rows of no values) is refused with a SchemaError naming the shape."""
    with pytest.raises(shmps.SchemaError, match=r"\(3, 0\)"):
        store.dense("w", shape=(3, 0))
    assert store.tensors() == []


def test_init_array_and_scalar(store):
    """init= takes a scalar or an array of the tensor's shape, in every shard."""
    init = np.arange(20, dtype=np.float64).reshape(10, 2)
    t = store.dense("a", shape=(10, 2), dtype="float64", init=init, shard_rows=3)
    np.testing.assert_array_equal(t.pull(), init)
    u = store.dense("b", shape=(10, 2), dtype="int8", init=-7, shard_rows=3)
    np.testing.assert_array_equal(u.pull(), -7)


def test_integer_gradients_wrap_in_the_cast(store):
    """As api.md says: an integer gradient outside the tensor's range wraps in the cast,
    for assign and max as for Sum (pins the documented behaviour, review 14 D1)."""
    a = store.dense("a", shape=(2,), dtype="int8", optimizer="assign")
    a.push([300, -200])
    assert a.pull().tolist() == [44, 56]
    m = store.dense("m", shape=(2,), dtype="int8", optimizer="max")
    m.push([200, 1000])
    assert m.pull().tolist() == [0, 0]
    i = store.dense("i", shape=(1,), dtype="int32")
    i.push(np.array([2 ** 40], np.uint64))
    assert i.pull().tolist() == [0]


def test_finite_gradients_can_still_make_inf(store):
    """As api.md says: allow_nonfinite=False checks the gradients, not the values they
    produce: float16 overflow and overflowing sums of duplicate rows or keys store inf
    without an error (pins the documented behaviour, review 14 D2)."""
    h = store.dense("h", shape=(2,), dtype="float16")
    h.push(np.array([70000.0, 1.0], np.float32))
    assert h.pull().tolist() == [np.inf, 1.0]
    g = store.dense("g", shape=(1,), optimizer=shmps.SGD(lr=1e-3, weight_decay=0.1))
    g.push(np.full(2, 3e38, np.float32), rows=[0, 0])
    assert g.pull().tolist() == [-np.inf]
    t = store.table("t", dim=1, capacity=2, optimizer=shmps.SGD(lr=1e-3))
    t.push([1, 1], np.full((2, 1), 3e38, np.float32))
    assert t.pull([1]).ravel().tolist() == [-np.inf]


# ---- get-or-create ------------------------------------------------------------------

def test_get_or_create_returns_the_existing_tensor(store):
    """A second dense() with the same arguments returns the same data."""
    a = store.dense("w", shape=(4,), dtype="int32", optimizer="sum")
    a.push(np.full(4, 3, np.int32))
    b = store.dense("w", shape=(4,), dtype="int32", optimizer=shmps.Sum())
    np.testing.assert_array_equal(b.pull(), 3)


def test_get_or_create_omitted_arguments_accept_existing(store_name):
    """dense(name) with no schema arguments (here from a second attach) accepts what exists."""
    s1 = shmps.attach(store_name)
    try:
        s1.dense("w", shape=(4, 2), dtype="float64", optimizer=shmps.SGD(lr=0.5),
                 mode="hogwild", allow_nonfinite=True, shard_rows=2, init=1.0)
        with shmps.attach(store_name) as s2:
            t = s2.dense("w")
            assert (t.shape, t.dtype, t.optimizer) == ((4, 2), np.float64, shmps.SGD(lr=0.5))
            assert t.mode == "hogwild" and t.allow_nonfinite and t.nshards == 2
            assert s2.dense("w", dtype="float64").shape == (4, 2)
            np.testing.assert_array_equal(t.pull(), 1.0)
    finally:
        s1.destroy()


@pytest.mark.parametrize("field,kwargs", [
    ("shape", dict(shape=(4, 3))),
    ("dtype", dict(dtype="float64")),
    ("optimizer", dict(optimizer="max")),
    ("optimizer", dict(optimizer=shmps.SGD(lr=0.2))),
    ("mode", dict(mode="hogwild")),
    ("allow_nonfinite", dict(allow_nonfinite=True)),
    ("shard_rows", dict(shard_rows=1)),
])
def test_get_or_create_mismatch_names_the_field(store, field, kwargs):
    """dense() with a differing schema argument raises SchemaError naming that field."""
    t = store.dense("w", shape=(4, 2), dtype="float32", optimizer=shmps.SGD(lr=0.1),
                    shard_rows=2)
    t.push(np.ones((4, 2)))
    before = t.pull()
    with pytest.raises(shmps.SchemaError, match=field):
        store.dense("w", **kwargs)
    np.testing.assert_array_equal(store["w"].pull(), before)


@pytest.mark.parametrize("init,error", [
    (np.ones(7, np.float32), shmps.SchemaError),               # not the tensor's shape
    (np.full((4, 2), np.nan, np.float32), shmps.InvalidArgument),  # NaN, allow_nonfinite off
    ("abc", shmps.SchemaError),                                # not a number
    (float("inf"), shmps.InvalidArgument),
])
def test_get_or_create_refuses_a_bad_init_in_a_worker_that_did_not_create(store, init,
                                                                            error):
    """init is not compared (each worker may pass its own, random, one: only the
    creator's is used), but a bad one is refused in every worker, the same as in the
    creator, and changes nothing: whether a worker's bad init raised depended on which
    worker won the creation race (H3's walk-through).  A good init differing from the
    creator's is accepted and not used."""
    t = store.dense("w", shape=(4, 2), dtype="float32", init=1.0)
    with pytest.raises(error):
        store.dense("w", shape=(4, 2), dtype="float32", init=init)
    with pytest.raises(error):
        store.dense("w", init=init)
    np.testing.assert_array_equal(t.pull(), 1.0)
    assert store.dense("w", init=np.full((4, 2), 5.0)).pull().max() == 1.0


@pytest.mark.parametrize("src", ["float64", "float32", "int64"])
def test_a_worker_that_did_not_create_checks_a_large_init_in_little_memory(store, src):
    """A get-or-create that finds the tensor made checks its caller's init as the
    creator did (the same error, naming the same element), but a good init, which it
    does not use, costs it no copy: it is checked a chunk at a time.  Before, the check
    was the creator's cast_init, whose cast copy and masks of the whole init took
    (measured) +382 MiB peak RSS and 1.6 s in a worker given a 256 MiB-of-float32 init
    as float64, +126 MiB as float32; here, 32 MiB of float32: a traced peak of 48.0 MiB
    from float64 or int64, 16.0 MiB from float32 before, 0.5 to 1.5 MiB after."""
    import tracemalloc

    shape = (8192, 1024)
    t = store.dense("w", shape=shape, dtype="float32", init=1.0)
    init = np.full(shape, 2, dtype=src)
    tracemalloc.start()
    try:
        assert store.dense("w", shape=shape, dtype="float32", init=init) is t
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB"
    assert t.pull()[0, 0] == 1.0
    if src == "int64":
        init[5000, 7] = 1 << 40     # beyond float32's exact integers, within its range
        assert store.dense("w", init=init) is t
        return
    init[5000, 7] = np.nan
    with pytest.raises(shmps.InvalidArgument) as creating:
        store.dense("new", shape=shape, dtype="float32", init=init)
    with pytest.raises(shmps.InvalidArgument) as getting:
        store.dense("w", init=init)
    assert str(getting.value) == str(creating.value) and "init[5000, 7]" in str(getting.value)
    assert "new" not in store


def test_getitem_and_contains(store):
    """store[name] returns an existing tensor; `in` tells whether it exists."""
    store.dense("w", shape=(2,))
    assert "w" in store and "v" not in store
    assert store["w"].shape == (2,)
    with pytest.raises(shmps.NotFound):
        store["v"]


def test_len_of_a_store_counts_the_names_it_iterates(store):
    """A store is a mapping of names to tensors (store[name], `name in store`,
    iteration over the names): len(store) is the number of names its iteration gives,
    hidden tensors (an aggregated tensor's) included, and a tensor another handle
    created counts at once, as iteration sees it.  (len() raised TypeError.)  An empty
    store is still true: a handle, as before (`store or shmps.attach(...)`)."""
    assert len(store) == 0 and list(store) == [] and bool(store)
    store.dense("w", shape=(2,))
    store.dense("a", shape=(2,), aggregate="sum", workers=1)
    assert len(store) == len(list(store)) == len(store.tensors()) == 5   # a's 3 hidden
    assert all(name in store and store[name].name == name for name in store)
    other = shmps.attach(store.name, namespace=store.namespace)
    try:
        other.table("t", dim=2, capacity=4)
    finally:
        other.close()
    assert len(store) == 6 and "t" in list(store)


def test_tensors_describes_every_tensor(store):
    """store.tensors() lists name, kind, dtype, shape, optimizer, mode and nshards."""
    store.dense("a", shape=(10, 2), dtype="int8", optimizer="max", shard_rows=5)
    store.dense("b", shape=(3,), dtype="float32", optimizer=shmps.SGD(lr=0.1), mode="hogwild")
    desc = {d["name"]: d for d in store.tensors()}
    assert set(desc) == {"a", "b"}
    assert desc["a"]["kind"] == "dense" and desc["a"]["dtype"] == "int8"
    assert desc["a"]["shape"] == (10, 2) and desc["a"]["nshards"] == 2
    assert desc["a"]["optimizer"]["type"] == "Max" and desc["a"]["mode"] == "exact"
    assert desc["b"]["optimizer"] == {"type": "SGD", "lr": 0.1, "weight_decay": 0.0}
    assert desc["b"]["mode"] == "hogwild" and desc["b"]["bytes"] > 0


# ---- stats and non-blocking pushes ---------------------------------------------------

@pytest.mark.timeout(120)
def test_stats_count_across_processes(store, store_name):
    """stats() counts pushes, pulls, rows and bytes of every process, and the step."""
    t = store.dense("w", shape=(4, 2), dtype="int32", shard_rows=2)
    t.push(np.ones((4, 2), np.int32))
    t.push(np.ones((3, 2), np.int32), rows=[0, 3, 3])
    t.pull()
    from helpers import stats_worker

    with Workers() as ws:
        child = ws.start(stats_worker, store_name, "w", 5, 2).result(60)
    s = t.stats()
    assert s["pushes"] == 7 and child["pushes"] == 7
    assert s["pulls"] == 3
    assert s["step"] == 7, "every push, whole or rows, advances the step by one"
    assert s["rows_pushed"] == 4 + 3 + 5 * 4
    assert s["bytes_pushed"] == 8 * 4 + 6 * 4 + 5 * 8 * 4
    assert s["rows_pulled"] == 3 * 4 and s["bytes_pulled"] == 3 * 8 * 4
    assert s["last_push_ns"] > 0 and s["last_pull_ns"] > 0
    np.testing.assert_array_equal(t.pull(), [[7, 7], [6, 6], [6, 6], [8, 8]])


def test_push_wait_false_returns_handles(store):
    """push(wait=False) returns a handle; after store.wait(h) the push is applied."""
    t = store.dense("w", shape=(1000, 100), dtype="int32")
    g = np.ones((1000, 100), np.int32)
    handles = [t.push(g, wait=False) for _ in range(5)]
    assert all(isinstance(h, shmps.PushHandle) for h in handles)
    for h in handles:
        store.wait(h, timeout=30)
        assert h.done()
    h = t.push(np.ones((2, 100), np.int32), rows=[0, 0], wait=False)
    h.wait(30)
    a = t.pull()
    assert a[0, 0] == 7 and a[1, 0] == 5 and a.sum() == 5 * 100000 + 200


def test_a_push_handle_whose_wait_runs_out_raises_shmps_timeout(store):
    """handle.wait(timeout) that runs out raises shmps.Timeout (a TimeoutError too),
    saying the push goes on; the push is applied all the same.  It raised the future's
    plain TimeoutError, which `except shmps.Timeout` missed.  (The second push waits
    behind the first, 64 MiB, on the store's push thread: not done at once.)"""
    t = store.dense("w", shape=(4096, 4096), dtype="float32")
    g = np.ones((4096, 4096), np.float32)
    first, second = t.push(g, wait=False), t.push(g, wait=False)
    with pytest.raises(shmps.Timeout, match="goes on in the background") as info:
        second.wait(0)
    assert isinstance(info.value, TimeoutError) and info.value.hint
    store.wait(second, timeout=60)
    assert first.done()
    assert t.pull()[[0, -1], [0, -1]].tolist() == [2.0, 2.0]


def test_a_push_handle_wait_takes_the_timeouts_flush_and_clock_take(store):
    """handle.wait(timeout=) and store.wait(h, timeout=) take what store.flush() and
    store.clock() take: None or math.inf (or a value past what time_t holds) waits as
    long as it takes, numpy numbers are numbers; a negative, NaN, bool or non-number
    timeout is an InvalidArgument, before any wait.  math.inf raised a plain
    OverflowError ("timestamp out of range for platform time_t"), -1 and NaN a Timeout
    "not applied after -1 s", "x" a TypeError, and True waited 1 s."""
    import math

    t = store.dense("w", shape=(64,), dtype="float32")
    g = np.ones(64, np.float32)
    for timeout in (math.inf, 1e10, np.float64(30), np.int64(30)):
        h = t.push(g, wait=False)
        h.wait(timeout)
        store.wait(h, timeout=timeout)
    for bad in (-1, float("nan"), "x", True):
        h = t.push(g, wait=False)
        with pytest.raises(shmps.InvalidArgument, match="number of seconds >= 0"):
            h.wait(bad)
        with pytest.raises(shmps.InvalidArgument, match="number of seconds >= 0"):
            store.wait(h, timeout=bad)
        h.wait()
    assert t.pull()[0] == 8.0


def test_push_wait_false_error_raised_on_wait(store):
    """A rejected wait=False push raises on wait, changing nothing; a bad shape raises at once."""
    t = store.dense("w", shape=(3,), dtype="float32", init=1.0)
    h = t.push(np.array([1.0, np.nan, 1.0]), wait=False)
    with pytest.raises(shmps.NonFinite):
        store.wait(h, timeout=30)
    with pytest.raises(shmps.SchemaError):
        t.push(np.ones(4), wait=False)
    np.testing.assert_array_equal(t.pull(), 1.0)


def test_push_returns_none_when_waiting(store):
    """A blocking push returns None."""
    t = store.dense("w", shape=(2,))
    assert t.push(np.ones(2)) is None


@pytest.mark.parametrize("opt", [shmps.SGD(lr=0.5), shmps.Adam(lr=0.1)])
def test_a_rows_push_over_several_shards_changes_nothing_when_refused(store, opt):
    """A push of rows spread over shards is one C call (shmps_dense_push_sorted_rows) that
    checks every row and the gradient before it changes anything: a NaN in the last
    shard's rows, repeated rows whose gradients are summed first (Adam), unsorted or
    out-of-range rows all leave every shard, the step and the counts as they were; a
    good push lands in every shard, in row order, at one step."""
    t = store.dense("w", shape=(10, 2), dtype="float32", optimizer=opt, shard_rows=3)
    t.push(np.ones((10, 2), np.float32))
    before, stats = t.pull(), t.stats()
    rows = np.array([8, 0, 4, 0, 9])
    g = np.ones((5, 2), np.float32)
    g[4, 1] = np.nan                                      # in the last shard's run
    with pytest.raises(shmps.NonFinite):
        t.push(g, rows=rows)
    g[4, 1] = 1.0
    with pytest.raises(shmps.OutOfRange):
        t.push(g, rows=[8, 0, 4, 0, 10])
    lib, native = shmps._native.lib, shmps._native
    # (the last shard holds row 9 only: 10 and 11 are inside the tensor's shards, past
    # that shard's rows, which C checks at each run's greatest row)
    for bad_rows, code in (([0, 4, 3], lib.SHMPS_UNSORTED), ([0, 4, 12], lib.SHMPS_E_BOUNDS),
                           ([-1, 0, 4], lib.SHMPS_E_BOUNDS), ([0, 4, 10], lib.SHMPS_E_BOUNDS),
                           ([0, 9, 10], lib.SHMPS_E_BOUNDS), ([9, 9, 11], lib.SHMPS_E_BOUNDS),
                           ([0, 11, 10], lib.SHMPS_UNSORTED), ([0, 12, 3], lib.SHMPS_E_BOUNDS)):
        r = np.array(bad_rows, np.int64)
        assert lib.shmps_dense_push_sorted_rows(
            t._shard_bases(), t.nshards, t.shard_rows, native.token(), native.addr(r), 3,
            native.addr(np.ones((3, 2), np.float32)), t._gcode, 1, 1, 1) == code
    np.testing.assert_array_equal(t.pull(), before)
    assert {k: t.stats()[k] for k in ("step", "pushes")} == \
        {k: stats[k] for k in ("step", "pushes")}
    t.push(g, rows=rows)                                  # all good: every shard, one step
    ref = store.dense("ref", shape=(10, 2), dtype="float32", optimizer=opt, shard_rows=10)
    ref.push(np.ones((10, 2), np.float32))
    ref.push(g, rows=rows)                                # one shard: the same arithmetic
    np.testing.assert_array_equal(t.pull(), ref.pull())
    assert t.stats()["step"] == stats["step"] + 1 and t.stats()["pushes"] == 2


def test_a_stateful_rows_push_hands_its_sort_on(store):
    """A push of rows to a stateful updater (Adam) sorts them to find repeats; what it
    hands the C push is then in ascending order, so the C call does not send them back
    to be sorted a second time (SHMPS_UNSORTED).  Rows already ascending and distinct
    go on as they are, without a copy of the gradient."""
    t = store.dense("w", shape=(10, 2), dtype="float32", optimizer=shmps.Adam(lr=0.1))
    g = np.arange(8, dtype=np.float32).reshape(4, 2)
    rows = np.array([7, 1, 9, 4])
    rs, gs = t._aggregate_duplicates(rows, g)
    np.testing.assert_array_equal(rs, [1, 4, 7, 9])
    np.testing.assert_array_equal(gs, g[[1, 3, 0, 2]])
    rs, gs = t._aggregate_duplicates(np.sort(rows), g)
    assert gs is g
    rs, gs = t._aggregate_duplicates(np.array([7, 1, 7, 4]), g)   # repeats summed
    np.testing.assert_array_equal(rs, [1, 4, 7])
    np.testing.assert_array_equal(gs, [g[1], g[3], g[0] + g[2]])
    ref = store.dense("ref", shape=(10, 2), dtype="float32", optimizer=shmps.Adam(lr=0.1))
    t.push(g, rows=rows)
    ref.push(g[[1, 3, 0, 2]], rows=np.sort(rows))
    np.testing.assert_array_equal(t.pull(), ref.pull())


def test_a_split_push_holds_each_shard_once_and_lets_go(store, monkeypatch):
    """A whole push split over threads (forced: two 'cores') runs its parts under one
    active slot per shard, claimed before and freed after them: the sums are exact,
    no slot stays held, and the C part refuses a slot its caller does not hold."""
    from shmps import dense

    monkeypatch.setattr(dense, "NCPU", 2)
    t = store.dense("w", shape=(6144, 1024), dtype="int32", optimizer="sum", shard_rows=2048)
    g = np.ones(t.shape, np.int32)
    assert t._threads_for(g.nbytes) == 2
    for _ in range(3):
        t.push(g)
    assert np.all(t.pull() == 3) and t.stats()["pushes"] == 3
    lib, native = shmps._native.lib, shmps._native
    n = native.ffi.new("uint32_t *")
    for sh in t._shards:
        assert lib.shmps_active_pushers(sh.ptr, n) == 0 and n[0] == 0
    base0 = t._shards[0].ptr
    assert lib.shmps_dense_push_entered(t._shards[1].ptr, base0, native.token(), 0,
                                        native.ffi.from_buffer(g), t._gcode, 0, 1, 9) == \
        lib.SHMPS_E_ARG
    with t._entered() as slots:
        assert lib.shmps_active_pushers(t._shards[2].ptr, n) == 0 and n[0] == 1
        assert lib.shmps_dense_push_entered(t._shards[2].ptr, base0, native.token(),
                                            slots[2], native.ffi.from_buffer(g), t._gcode,
                                            0, 1, 9) == 0
    assert lib.shmps_active_pushers(t._shards[2].ptr, n) == 0 and n[0] == 0
    got = t.pull()
    assert got[4096:4100].min() == 4 and got[4100:].max() == 3   # stripe 0 of shard 2


@pytest.mark.parametrize("where", ["waiting", "submitting"])
def test_an_interrupt_of_a_split_push_surfaces_only_once_no_helper_thread_writes(
        store, monkeypatch, where):
    """Ctrl-C (a real SIGINT to this thread) lands in a split push: the
    KeyboardInterrupt surfaces only once no helper thread runs a part, and no part
    starts after, so the shards' active slots (and an aggregated round's claim) are let
    go of with no thread of the push writing.  "waiting": it lands while the push waits
    for its last part, which a helper runs (the wait was cut by the interrupt: the push
    raised with its last part still running, its slots let go of: review H5 F3).
    "submitting": it lands inside ThreadPoolExecutor.submit, after the second part was
    queued (the futures were never all known: the slots were let go of while a queued
    part then wrote: review H2 of 2026-11-28; the signal comes from submit itself there,
    the one place a real signal cannot be aimed at; the pool's thread is held till
    then, so the queued parts are still queued).  Four parts of 32 MiB (NCPU forced
    to 4) on a pool of one helper thread.  The SIGINT handler raises only inside the
    push (a signal that came late is noted and the push tried again), so no
    KeyboardInterrupt can escape the test.  After it, a push adds exactly one more."""
    import os
    import signal
    import sys
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from shmps import dense, tensor

    assert threading.current_thread() is threading.main_thread()   # (signals go here)
    monkeypatch.setattr(dense, "NCPU", 4)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shmps-split")
    monkeypatch.setitem(tensor._pools, os.getpid(), pool)
    t = store.dense("w", shape=(32768, 1024), dtype="int32", optimizer="sum")
    g = np.ones(t.shape, np.int32)
    assert t._threads_for(g.nbytes) == 4
    push_code = dense.DenseTensor._push_all.__code__
    wait_code = tensor.SplitParts.wait.__code__
    me = threading.get_ident()

    def frame_of(code, frame):
        while frame is not None and frame.f_code is not code:
            frame = frame.f_back
        return frame

    # the parts the helper threads run (the real _run_units, watched)
    lock, running, after = threading.Lock(), [0], []
    surfaced = threading.Event()          # set as the KeyboardInterrupt reached the test
    real_run_units = dense.DenseTensor._run_units

    def run_units(self, *args):
        if threading.get_ident() == me:
            return real_run_units(self, *args)
        with lock:
            running[0] += 1
            if surfaced.is_set():
                after.append(args[0])
        try:
            time.sleep(0.01)     # (so a part queued when the interrupt lands runs late)
            return real_run_units(self, *args)
        finally:
            with lock:
                running[0] -= 1
    monkeypatch.setattr(dense.DenseTensor, "_run_units", run_units)

    landed: list = []          # where each SIGINT's handler ran: in the push, or not

    def on_sigint(signum, frame) -> None:
        landed.append(frame_of(push_code, frame) is not None)
        if landed[-1]:
            raise KeyboardInterrupt

    def interrupt_the_last_wait(stop: threading.Event) -> None:
        """One SIGINT to the test's thread once its push waits for its parts while a
        helper thread runs one."""
        while not stop.is_set():
            frame = frame_of(wait_code, sys._current_frames().get(me))
            if frame is not None and running[0]:
                signal.pthread_kill(me, signal.SIGINT)
                return
            time.sleep(0.0002)

    go = threading.Event()
    if where == "submitting":
        # the pool's one thread held until the interrupt surfaced: the parts queued
        # then are still queued (a part ended just as the push waited for none would
        # let the thread take the next one before this thread woke)
        pool.submit(go.wait, 30)
        real_submit, calls = pool.submit, [0]

        def submit(fn, *args):
            f = real_submit(fn, *args)
            calls[0] += 1
            if calls[0] == 2:
                signal.pthread_kill(me, signal.SIGINT)   # (handled before submit returns)
            return f
        monkeypatch.setattr(pool, "submit", submit)

    old = signal.signal(signal.SIGINT, on_sigint)
    try:
        pushed, interrupted = 0, False
        for _ in range(20):
            stop = threading.Event()
            th = threading.Thread(target=interrupt_the_last_wait, args=(stop,))
            if where == "waiting":
                th.start()
            try:
                t.push(g)
                pushed += 1                              # (no interrupt landed in it)
            except KeyboardInterrupt:
                with lock:
                    surfaced.set()
                    still = running[0]
                interrupted = True
                break
            finally:
                go.set()
                stop.set()
                if th.is_alive():
                    th.join(30)
        assert interrupted, ("no SIGINT landed in the push in 20 pushes", landed)
        assert still == 0, "the interrupt surfaced while a helper thread wrote"
        pool.shutdown(wait=True)
        assert after == [], "a part started after the interrupt surfaced"
        n = shmps._native.ffi.new("uint32_t *")
        for sh in t._shards:
            assert shmps._native.lib.shmps_active_pushers(sh.ptr, n) == 0 and n[0] == 0
        before = t.pull()
        assert pushed <= before.min() and before.max() <= pushed + 1, (
            before.min(), before.max(), pushed)
        monkeypatch.setitem(tensor._pools, os.getpid(), ThreadPoolExecutor(1))
        t.push(g)
        np.testing.assert_array_equal(t.pull(), before + 1)
    finally:
        signal.signal(signal.SIGINT, old)
        pool.shutdown(wait=True)
        tensor._pools.pop(os.getpid()).shutdown(wait=True)


_INTERRUPT_AT_THE_LOCK = r'''
import os, signal, sys, threading, time
from shmps.tensor import SplitParts

where = sys.argv[1]
parts = SplitParts(1)
release, ended = threading.Event(), []

def part() -> None:
    release.wait(30)
    ended.append(1)

parts.submit(0, part)                    # runs on a helper thread until released
me = threading.get_ident()
waits = {SplitParts.wait.__code__, SplitParts.close.__code__}

def holder() -> None:
    with parts._lock:
        until = time.monotonic() + 10    # until the push waits for the lock
        while time.monotonic() < until:
            f = sys._current_frames().get(me)
            while f is not None and f.f_code not in waits:
                f = f.f_back
            if f is not None:
                break
            time.sleep(0.001)
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)   # taken by a thread other than the push's
        time.sleep(0.1)

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
threading.Thread(target=holder, daemon=True).start()
threading.Timer(0.6, release.set).start()     # the part ends after the interrupt
try:
    (parts.wait if where == "waiting" else parts.close)()
    print("no interrupt", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
if where == "waiting":
    parts.close()                 # (the push's way out of its wait)
    print("closed", ended, flush=True)
else:
    print("closed", ended, flush=True)
os._exit(0)
'''


@pytest.mark.parametrize("where", ["waiting", "closing"])
def test_an_interrupt_just_as_a_split_push_takes_its_parts_lock_ends_no_wait(where):
    """A SIGINT handled in the pushing thread right after it took the lock that counts
    the parts of its split push (tensor.SplitParts), in its wait for them ("waiting")
    or in close(), its way out on an error, retried until no part runs ("closing"):
    the interrupt surfaces, and close() returns once the running part ended.  (With a
    threading.Condition, the interrupt could be raised inside Condition.__enter__ after
    the lock was taken and before the with block began: the lock stayed held, close()
    waited for it forever, and the helper thread's part, at its end, too.)  A thread
    holds the lock while the push waits for it, and the SIGINT, blocked in the
    pushing thread, is taken by another one (its handler then runs in the pushing
    thread as soon as the lock is taken, not in the wait for it).  In a child process,
    bounded: the hang was a hang."""
    import subprocess
    import sys

    from helpers import child_env

    try:
        out = subprocess.run([sys.executable, "-c", _INTERRUPT_AT_THE_LOCK, where],
                             env=child_env(), capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the push's wait hung ({where}): {e.stdout!r}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["interrupted", "closed [1]"], (out.stdout,
                                                                          out.stderr)


_PUSH_ON_ONE_HELPER = r'''
import json, os, sys
from concurrent.futures import ThreadPoolExecutor
import numpy as np
import shmps
from shmps import dense, tensor

dense.NCPU = 4                # four parts, whatever this machine has
tensor._pools[os.getpid()] = ThreadPoolExecutor(1, thread_name_prefix="shmps-split")
s = shmps.attach(sys.argv[1], namespace=sys.argv[2])
t = s["w"]
try:
    t.push(np.ones(t.shape, np.int32))
    print(json.dumps(["no error", ""]))
except shmps.Error as e:
    print(json.dumps([type(e).__name__, str(e)]))
s.close()
'''


def test_an_error_in_a_helper_threads_part_stops_the_parts_not_started(store):
    """A split push whose part on a helper thread fails stops the parts not started
    yet, as an error in the pushing thread does: each part is applied whole or not
    started (the failing one applied the stripes it reached), and the error says which
    values are which.  A 32 MiB int32 Sum push in four parts (NCPU forced to 4) on a
    pool of one helper thread, which runs parts 1, 2, 3 in turn; the last stripe of
    part 1 is held by a live process (this one) past the child's lock timeout (0.3 s:
    SHMPS_TEST_LOCK_TIMEOUT_S), so part 1 raises Timeout.  (Before, the helper's error
    stopped nothing: parts 2 and 3 were applied after it, and the error said nothing
    of them.)"""
    import json
    import os
    import subprocess
    import sys

    from helpers import SHM, child_env, own_token, peek, poke

    t = store.dense("w", shape=(8192, 1024), dtype="int32", optimizer="sum")
    assert t.nshards == 2 and [sh.spec["nstripes"] for sh in t._shards] == [1024, 1024]
    elems = t._shards[0].spec["stripe_elems"]      # 4096: 16 KiB of int32
    # parts of 512 stripes: 0 and 1 in shard 0, 2 and 3 in shard 1
    path = os.path.join(SHM, t._shards[0].seg.name.lstrip("/"))
    off = t._shards[0].spec["stripes_off"] + 16 * 1023      # part 1's last stripe
    assert peek(path, off, "<Q") == (0,)
    poke(path, off, "<Q", own_token())
    try:
        out = subprocess.run([sys.executable, "-c", _PUSH_ON_ONE_HELPER, store.name,
                              store.namespace or ""],
                             env=child_env(SHMPS_TEST_LOCK_TIMEOUT_S="0.3"),
                             capture_output=True, text=True, timeout=30)
    finally:
        poke(path, off, "<Q", 0)
    assert out.returncode == 0, out.stderr
    kind, message = json.loads(out.stdout)
    got = t.pull().reshape(-1)
    quarter = got.size // 4
    assert (got[:2 * quarter - elems] == 1).all()           # parts 0 and 1 but its last
    assert (got[2 * quarter - elems:2 * quarter] == 0).all()  # stripe (held)
    assert (got[2 * quarter:] == 0).all(), "a part started after part 1's error"
    assert kind == "Timeout", message
    assert (f"values [0, {quarter}) applied whole, [{quarter}, {2 * quarter}) stopped by "
            f"this error, [{2 * quarter}, {4 * quarter}) not started") in message, message
    n = shmps._native.ffi.new("uint32_t *")
    for sh in t._shards:
        assert shmps._native.lib.shmps_active_pushers(sh.ptr, n) == 0 and n[0] == 0
    t.push(np.ones(t.shape, np.int32))
    np.testing.assert_array_equal(t.pull().reshape(-1), got + 1)


def test_a_split_push_raises_the_first_error_in_time_whichever_thread_met_it():
    """Two parts of a split push raise: the one on a helper thread first, then the
    pushing thread's own part (which waits for the helper's error before it raises).
    The push raises the helper's error, the first in time, its message telling both
    parts' outcomes; the later one is named by its class.  (Before, the pushing
    thread's error was raised whatever came first: helpers' errors were looked at only
    when the pushing thread's part had none.)  tensor.SplitParts with real threads of
    the split pool, its parts plain functions."""
    import threading

    from helpers import wait_until
    from shmps.tensor import SplitParts

    parts = SplitParts(3)
    first = shmps.Timeout("part 1 met a held lock")
    started = threading.Event()

    def helper_part() -> None:
        assert started.wait(10)     # (part 0 started: a part raised before would stop it)
        raise first

    def own_part() -> None:
        started.set()
        wait_until(lambda: parts.errors, 10, "the helper's part raised")
        raise shmps.InvalidArgument("part 0 met another error")

    parts.submit(1, helper_part)
    parts.run_here(0, own_part)
    parts.submit(2, print, "never")      # submitted after both: never started
    parts.wait()
    assert [i for i, _ in parts.errors] == [1, 0] and parts.outcomes[2] is None
    with pytest.raises(shmps.Timeout) as info:
        parts.raise_first(lambda i: (10 * i, 10 * i + 10), "values", "a note")
    assert info.value is first
    assert str(info.value).startswith(
        "part 1 met a held lock; split into 3 parts: values [0, 10) stopped by another "
        "error (InvalidArgument), [10, 20) stopped by this error, [20, 30) not started "
        "(a note)"), str(info.value)


def test_a_copy_written_by_rows_goes_on_at_the_tensors_step(store):
    """A replica's copy (the bridge writes the owner's rows into it, and raises its step)
    holds values its stripes did not apply themselves: a whole push there afterwards
    (the copy's host took the shard over, or the bridge stopped) applies at the
    tensor's next step, as on the owner.  Adam shows the step: the copy and the owner,
    given the same push, hold the same bits.  (Counted per stripe, the copy's stripes,
    which never applied a push, took step 1: the bias correction of a first step.)"""
    opt = shmps.Adam(lr=0.1)
    owner = store.dense("owner", shape=(8, 4096), dtype="float32", optimizer=opt, init=0.0)
    copy = store.dense("copy", shape=(8, 4096), dtype="float32", optimizer=opt, init=0.0)
    rng = np.random.default_rng(3)
    for _ in range(5):
        owner.push(rng.uniform(-1, 1, (8, 4096)).astype(np.float32))
    copy._write_rows(0, owner._snapshot(0))
    assert copy.stats()["step"] == 5
    g = rng.uniform(-1, 1, (8, 4096)).astype(np.float32)
    owner.push(g)
    copy.push(g)
    assert copy.pull().tobytes() == owner.pull().tobytes()


def test_numpy_takes_a_tensor_as_an_array_through_a_pull(store):
    """np.asarray(w) is w.pull(): the values, a private copy (writing it changes no
    tensor), in the dtype asked for; copy=False is refused with numpy's ValueError,
    naming view(); len(w) is the first dimension, and a 0-d tensor has none (numpy's
    TypeError).  (Before, np.asarray(w) made a 0-d object array holding the tensor, and
    len(w) raised TypeError.)"""
    w = store.dense("w", shape=(4, 3), dtype="int32", optimizer="sum", init=2)
    w.push(np.arange(12, dtype=np.int32).reshape(4, 3))
    a = np.asarray(w)
    assert a.dtype == np.int32 and a.shape == (4, 3)
    np.testing.assert_array_equal(a, w.pull())
    a[:] = -1
    assert w.pull().min() == 2
    f = np.asarray(w, dtype=np.float64)
    assert f.dtype == np.float64 and f.sum() == 24 + 66
    assert np.sum(w) == 24 + 66 and np.add(w, 1)[3, 2] == 14
    with pytest.raises(ValueError, match="view()"):
        np.asarray(w, copy=False)
    assert len(w) == 4
    assert len(store.dense("empty", shape=(0, 3), dtype="float32")) == 0
    with pytest.raises(TypeError, match="0-d"):
        len(store.dense("scalar", shape=(), dtype="float32"))


def test_a_tensor_is_true_unless_it_has_no_rows(store):
    """bool(w) is len(w) != 0 for a tensor with rows, and True for a 0-d tensor (it
    holds one value), as before len() was added: `if w:`, `w or other` and `assert w`
    on a scalar tensor raised TypeError "len() of the 0-d tensor" since 6b633b9."""
    scalar = store.dense("scalar", shape=(), dtype="float32", init=0.0)
    assert bool(scalar) and (scalar or None) is scalar
    assert store.dense("w", shape=(4, 3), dtype="float32")
    assert not store.dense("empty", shape=(0, 3), dtype="float32")
    with pytest.raises(TypeError, match="0-d"):
        len(scalar)


def test_numpy_without_a_copy_is_an_invalid_argument_with_a_hint(store):
    """np.asarray(w, copy=False) raises shmps.InvalidArgument, a ValueError as numpy's
    protocol asks (numpy passes it on as it is), with the hint every shmps error has:
    the README says every error is a shmps.Error but for the file system's OSError and
    numpy's own for writing into view().  It raised a plain ValueError."""
    w = store.dense("w", shape=(4, 3), dtype="float32")
    with pytest.raises(shmps.InvalidArgument, match=r"view\(\)") as info:
        np.asarray(w, copy=False)
    assert isinstance(info.value, ValueError) and "view()" in info.value.hint


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [None, "h", 3])
def test_store_wait_of_what_is_no_push_handle_is_an_invalid_argument(store, bad):
    """store.wait(x) of what is no PushHandle (None, which a push with wait=True
    returns, having been applied; a string) is an InvalidArgument saying what wait
    takes; it raised AttributeError ("'NoneType' object has no attribute 'wait'")."""
    t = store.dense("w", shape=(2,))
    with pytest.raises(shmps.InvalidArgument, match="push\\(\\.\\.\\., wait=False\\)") as info:
        store.wait(bad)
    assert "wait=True" in info.value.hint
    store.wait(t.push(np.ones(2), wait=False), timeout=30)   # a handle is waited for
    assert t.pull().tolist() == [1.0, 1.0]


_EXIT_WITH_PUSHES_PENDING = r"""
import sys
import numpy as np
import shmps
s = shmps.attach(sys.argv[1], namespace=sys.argv[2] or None)
w = s["w"]
g = np.ones(w.shape, np.float32)
handles = [w.push(g, wait=False) for _ in range(3)]
# the script ends here, neither waiting nor closing: the store's push thread, which
# Python joins at exit, applies what is queued
"""


@pytest.mark.timeout(120)
def test_large_pushes_queued_with_wait_false_are_applied_when_the_process_exits(store):
    """A process that ends with wait=False pushes queued (no wait(), no close()) gets
    them applied: Python joins the store's push thread at exit.  Pushes of 16 MiB and
    more are split over helper threads, whose pool concurrent.futures shuts down at
    exit first: each queued push then raised "cannot schedule new futures after
    shutdown" on that thread, unseen, its values lost (the tensor stayed 0 after 3
    pushes; in one run with a step taken, step 1).  Now a part the pool refuses runs in
    the pushing thread."""
    import subprocess
    import sys

    from helpers import child_env

    w = store.dense("w", shape=(4096, 4096), dtype="float32")   # 64 MiB: split pushes
    out = subprocess.run([sys.executable, "-c", _EXIT_WITH_PUSHES_PENDING, store.name,
                          store.namespace or ""], env=child_env(), capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    a = w.pull()
    assert (float(a.min()), float(a.max()), w.stats()["step"]) == (3.0, 3.0, 3)


_PUSH_WAIT_FALSE_AT_EXIT = r"""
import atexit
import sys
import numpy as np
import shmps
s = shmps.attach(sys.argv[1], namespace=sys.argv[2] or None)
w = s["w"]
first = w.push(np.ones(w.shape, np.float32), wait=False)   # queued before the exit


def at_exit() -> None:
    h = w.push(np.full(w.shape, 2.0, np.float32), wait=False)
    s.wait(h)
    try:
        w.push(np.full(w.shape, np.nan, np.float32), wait=False).wait()
    except shmps.NonFinite:
        print("refused at wait", flush=True)
    print("pushed", flush=True)


atexit.register(at_exit)
"""


@pytest.mark.timeout(120)
def test_a_push_with_wait_false_in_an_atexit_handler_is_applied(store):
    """push(wait=False) in an atexit handler: concurrent.futures refuses new work from
    every pool once its exit hook ran (before atexit handlers), so the store's push
    thread cannot take the push; it is applied at once, after the pushes queued before
    (the handle is done; its error, if any, raised by its wait as on the push thread).
    Before, the push raised RuntimeError 'cannot schedule new futures after interpreter
    shutdown' (not a shmps.Error) and was not applied."""
    import subprocess
    import sys

    from helpers import child_env

    w = store.dense("w", shape=(64, 64), dtype="float32")
    out = subprocess.run([sys.executable, "-c", _PUSH_WAIT_FALSE_AT_EXIT, store.name,
                          store.namespace or ""], env=child_env(), capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0 and "pushed" in out.stdout, out.stderr
    assert "refused at wait" in out.stdout and "Error" not in out.stderr, out.stderr
    a = w.pull()
    assert (float(a.min()), float(a.max()), w.stats()["step"]) == (3.0, 3.0, 2)
