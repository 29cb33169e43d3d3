"""CSR tensors: creation and validation of the structure, pull (whole, rows, scipy),
pushes of entries (subsets, repeats, across shards), get-or-create, bad input leaving
the data unchanged, and exactness of concurrent pushes."""
from __future__ import annotations

import re
import threading

import numpy as np
import pytest

import shmps

pytestmark = pytest.mark.timeout(120)
sparse = pytest.importorskip("scipy.sparse")


def random_matrix(seed: int = 0, rows: int = 40, cols: int = 30, density: float = 0.2):
    m = sparse.random(rows, cols, density=density, format="csr", random_state=seed,
                      dtype=np.float64)
    m.sort_indices()
    return m


def make(store, m, **kw):
    return store.csr("X", m.indptr, m.indices, init=m.data, **kw)


def test_round_trip_and_shards(store):
    """Created from scipy arrays, sharded by rows: pull() gives back the structure and
    values; to_scipy() is the same matrix."""
    m = random_matrix()
    x = make(store, m, dtype="float64", shard_rows=7)
    assert x.nshards == 6 and x.shape == m.shape and x.nnz == m.nnz
    c = x.pull()
    assert isinstance(c, shmps.CSR)
    np.testing.assert_array_equal(c.rowcnt, m.indptr)
    np.testing.assert_array_equal(c.colidx, m.indices)
    np.testing.assert_array_equal(c.value, m.data)
    assert (x.to_scipy() != m).nnz == 0
    np.testing.assert_array_equal(x.pull(consistent=False).value, m.data)


def test_pull_rows_any_order(store):
    """pull(rows=idx) returns those rows, in that order, repeats and empty rows too."""
    m = random_matrix(1, rows=12, cols=10, density=0.3)
    m = m.tolil()
    m[4, :] = 0
    m = m.tocsr()
    m.eliminate_zeros()
    x = make(store, m, shard_rows=5)
    rows = [11, 0, 4, 11, 7]
    c = x.pull(rows=rows)
    want = m[rows]
    np.testing.assert_array_equal(c.rowcnt, want.indptr)
    np.testing.assert_array_equal(c.colidx, want.indices)
    np.testing.assert_allclose(c.value, want.data.astype(np.float32))
    with pytest.raises(shmps.OutOfRange):
        x.pull(rows=[12])
    with pytest.raises(shmps.OutOfRange):
        x.pull(rows=[-1])


def test_push_full_structure_and_subsets(store):
    """sum: pushing the whole structure adds everywhere; pushing some entries of some
    rows adds there only; a scipy matrix can be pushed too."""
    m = random_matrix(2)
    x = make(store, m, dtype="float64", optimizer="sum", shard_rows=9)
    x.push(shmps.CSR(m.indptr, m.indices, np.ones(m.nnz)))
    np.testing.assert_array_equal(x.pull().value, m.data + 1)
    sub = m.copy()
    sub.data[:] = 2.0
    sub = sub.tolil()
    sub[::2, :] = 0
    sub = sub.tocsr()
    sub.eliminate_zeros()
    x.push(sub)
    want = m.copy()
    want.data += 1
    want = want + sub
    np.testing.assert_array_equal(x.to_scipy().toarray(), want.toarray())


def test_repeated_entries_accumulate(store):
    """A pushed entry repeated (and rows with unsorted columns) accumulates (sum) or
    the last one wins (assign)."""
    rowcnt, colidx = np.array([0, 2, 3]), np.array([1, 4, 0])
    s = store.csr("S", rowcnt, colidx, dtype="int32", optimizer="sum")
    a = store.csr("A", rowcnt, colidx, dtype="int32", optimizer="assign")
    push = shmps.CSR(np.array([0, 3, 3]), np.array([4, 1, 4]), np.array([1, 2, 3], np.int32))
    s.push(push)
    a.push(push)
    assert s.pull().value.tolist() == [2, 4, 0]
    assert a.pull().value.tolist() == [2, 3, 0]


def test_per_row_steps(store):
    """Adam on csr counts steps per row: a row pushed for the first time at the 3rd push
    moves as a fresh parameter does."""
    rowcnt, colidx = np.array([0, 1, 2]), np.array([0, 0])
    x = store.csr("X", rowcnt, colidx, optimizer=shmps.Adam(lr=0.1))
    only0 = shmps.CSR(np.array([0, 1, 1]), np.array([0]), np.array([1.0]))
    x.push(only0)
    x.push(only0)
    x.push(shmps.CSR(np.array([0, 0, 1]), np.array([0]), np.array([1.0])))
    v = x.pull().value
    # row 1's first step: m/(1-b1) / (sqrt(v/(1-b2)) + eps) == 1 -> moves by lr
    np.testing.assert_allclose(v[1], -0.1, rtol=1e-5)


def test_get_or_create(store):
    """The same structure gets the tensor; another structure, shape or dtype is a
    SchemaError; a missing tensor needs the structure."""
    m = random_matrix(3)
    x = make(store, m)
    assert store.csr("X", m.indptr, m.indices) is x and store.csr("X") is x
    assert store["X"] is x
    other = random_matrix(4)
    with pytest.raises(shmps.SchemaError):
        store.csr("X", other.indptr, other.indices)
    with pytest.raises(shmps.SchemaError):
        store.csr("X", m.indptr, m.indices, dtype="float64")
    with pytest.raises(shmps.SchemaError):
        store.csr("X", shape=(40, 31))
    with pytest.raises(shmps.NotFound):
        store.csr("Y")


def test_get_or_create_refuses_a_bad_init_in_a_worker_that_did_not_create(store):
    """As for dense tensors: an existing csr tensor's init is not used, but one not of
    one value per entry, or not finite, is refused in every worker, and changes
    nothing."""
    m = random_matrix(3)
    x = make(store, m)
    before = x.pull().value.copy()
    with pytest.raises(shmps.SchemaError):
        store.csr("X", m.indptr, m.indices, init=np.ones(m.nnz + 1))
    with pytest.raises(shmps.InvalidArgument, match="not finite"):
        store.csr("X", init=float("nan"))
    np.testing.assert_array_equal(x.pull().value, before)
    assert store.csr("X", init=np.full(m.nnz, 7.0)) is x


def test_a_worker_that_did_not_create_checks_a_large_init_in_little_memory(store):
    """As for a dense tensor: an existing csr tensor's large init (4 Mi entries as
    float64, 32 MiB, into float32) is checked a chunk at a time: a traced peak of
    24.0 MiB before (cast_init's cast copy and masks of the whole init), 1.5 MiB after;
    a bad one still gets the creator's error, naming the same entry."""
    import tracemalloc

    rows, per = 4096, 1024
    rowcnt = np.arange(rows + 1, dtype=np.int64) * per
    colidx = np.tile(np.arange(per, dtype=np.int64), rows)
    x = store.csr("X", rowcnt, colidx, dtype="float32", init=1.0)
    init = np.full(rows * per, 2.0)
    tracemalloc.start()
    try:
        assert store.csr("X", init=init) is x
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB"
    init[3_000_000] = np.inf
    with pytest.raises(shmps.InvalidArgument) as creating:
        store.csr("Y", rowcnt, colidx, dtype="float32", init=init)
    with pytest.raises(shmps.InvalidArgument) as getting:
        store.csr("X", init=init)
    assert str(getting.value) == str(creating.value) and "init[3000000]" in str(getting.value)
    assert x.pull().value.max() == 1.0


def test_shape_and_empty_matrix(store):
    """shape= may add empty columns; a matrix with no rows or no entries works."""
    x = store.csr("X", [0, 1], [2], shape=(1, 10), init=5.0)
    assert x.shape == (1, 10) and x.to_scipy().shape == (1, 10)
    e = store.csr("E", [0], [])
    assert e.shape == (0, 0) and e.pull().value.size == 0
    e.push(shmps.CSR([0], [], []))
    z = store.csr("Z", [0, 0, 0], [], shape=(2, 3))
    assert z.pull(rows=[1, 0]).rowcnt.tolist() == [0, 0, 0]


# ---- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("rowcnt,colidx,kw,exc", [
    ([0, 2, 1, 3], [0, 1, 2], {}, shmps.InvalidArgument),         # not monotone
    ([1, 2, 3], [0, 1], {}, shmps.InvalidArgument),               # does not start at 0
    ([0, 2, 4], [0, 1, 2], {}, shmps.InvalidArgument),            # ends past colidx
    ([0, 1, 2], [0, -1], {}, shmps.OutOfRange),                   # negative column
    ([0, 1, 2], [0, 5], {"shape": (2, 5)}, shmps.OutOfRange),     # column >= cols
    ([0, 2], [3, 1], {}, shmps.InvalidArgument),                  # unsorted row
    ([0, 2], [1, 1], {}, shmps.InvalidArgument),                  # repeated column
    ([0, 1, 2], [0.0, 1.0], {}, shmps.SchemaError),               # float columns
    ([[0, 1]], [0], {}, shmps.SchemaError),                       # 2-d rowcnt
    ([0, 1, 2], [0, 1], {"init": [1.0, 2.0, 3.0]}, shmps.SchemaError),  # init length
    ([0, 1, 2], [0, 1], {"shape": (3, 2)}, shmps.SchemaError),    # shape rows
    ([0, 1, 2], [0, 1], {"dtype": "int8", "optimizer": shmps.Adam()}, shmps.SchemaError),
    ([0, 1, 2], [0, 1], {"dtype": "int8", "init": 0.5}, shmps.SchemaError),
])
def test_bad_structure_is_rejected(store, rowcnt, colidx, kw, exc):
    """A malformed structure raises a typed error saying what is wrong; nothing is made."""
    with pytest.raises(exc):
        store.csr("X", rowcnt, colidx, **kw)
    assert "X" not in store


def test_missing_entry_rejects_whole_push(store):
    """An entry absent from the structure (in a later shard) raises InvalidArgument
    naming it, and nothing is applied, not even to earlier shards."""
    m = random_matrix(5)
    x = make(store, m, optimizer="sum", shard_rows=5)
    before = x.pull().value.copy()
    dense = m.toarray()
    r, c = 37, int(np.flatnonzero(dense[37] == 0)[0])
    g = m.copy()
    g.data[:] = 1
    g = g.tolil()
    g[r, c] = 1.0
    g = g.tocsr()
    with pytest.raises(shmps.InvalidArgument, match=f"row {r}, col {c}"):
        x.push(g)
    np.testing.assert_array_equal(x.pull().value, before)


@pytest.mark.parametrize("bad,exc", [
    (lambda m: shmps.CSR(m.indptr[:-1], m.indices[:m.indptr[-2]], m.data[:m.indptr[-2]]),
     shmps.SchemaError),                                            # a row short
    (lambda m: shmps.CSR(m.indptr[::-1].copy(), m.indices, m.data), shmps.InvalidArgument),
    (lambda m: shmps.CSR(m.indptr, m.indices + 100, m.data), shmps.OutOfRange),
    (lambda m: shmps.CSR(m.indptr, m.indices, m.data[:-1]), shmps.InvalidArgument),
    (lambda m: shmps.CSR(m.indptr, m.indices, np.full(m.nnz, np.nan)), shmps.NonFinite),
    (lambda m: shmps.CSR(m.indptr, m.indices.astype(float), m.data), shmps.SchemaError),
    (lambda m: (m.indptr, m.indices), shmps.InvalidArgument),
    (lambda m: shmps.CSR(m.indptr, m.indices, m.data.reshape(1, -1)), shmps.SchemaError),
])
def test_bad_push_raises_and_changes_nothing(store, bad, exc):
    """A pushed CSR with the wrong row count, non-monotone rowcnt, columns out of range,
    mismatched lengths, NaN or wrong types raises a typed error; nothing changes."""
    m = random_matrix(6)
    x = make(store, m, optimizer="sum", shard_rows=8)
    before = x.pull().value.copy()
    with pytest.raises(exc):
        x.push(bad(m))
    np.testing.assert_array_equal(x.pull().value, before)


def test_int_tensor_rejects_float_values(store):
    """float values into an int csr tensor are a SchemaError (same_kind casting)."""
    x = store.csr("X", [0, 1], [0], dtype="int32")
    with pytest.raises(shmps.SchemaError):
        x.push(shmps.CSR([0, 1], [0], [1.5]))


# ---- concurrency --------------------------------------------------------------------------

def test_concurrent_pushes_are_exact(store):
    """Threads pushing the whole structure with sum (GIL released in C) lose nothing."""
    m = random_matrix(7, rows=200, cols=50, density=0.2)
    x = store.csr("X", m.indptr, m.indices, dtype="int32", optimizer="sum", shard_rows=32)
    ones = shmps.CSR(m.indptr, m.indices, np.ones(m.nnz, np.int32))
    n, nthreads = 150, 3

    def work():
        for _ in range(n):
            x.push(ones)

    threads = [threading.Thread(target=work) for _ in range(nthreads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert (x.pull().value == n * nthreads).all()
    assert x.stats()["takeovers"] == 0


def test_a_matrix_given_to_store_csr_says_how_to_pass_it(store):
    """store.csr(name, m) with a scipy matrix or a shmps.CSR (push takes either, so a
    user tries it) is an InvalidArgument that shows the call taking its structure and
    values apart, and creates nothing; it said "pass both rowcnt and colidx, or
    neither", with the API's generic hint."""
    sp = pytest.importorskip("scipy.sparse")
    m = sp.csr_matrix(np.array([[1.0, 0, 2], [0, 3, 0]], np.float32))
    for given in (m, shmps.CSR(m.indptr, m.indices, m.data)):
        with pytest.raises(shmps.InvalidArgument, match="matrix given as rowcnt") as info:
            store.csr("c", given)
        assert "init=" in info.value.hint
    assert "c" not in store
    c = store.csr("c", m.indptr, m.indices, init=m.data, shape=m.shape)   # the hint's call
    assert (c.to_scipy() != m).nnz == 0


def test_a_push_of_another_shape_is_refused_naming_both_shapes(store):
    """A scipy matrix of more (or fewer) columns than the tensor, or of more rows, is a
    SchemaError naming both shapes, and nothing changes, even when every entry it
    holds is in the structure.  Before, only the row count was checked: a 4 x 9 scipy
    matrix pushed into a 4 x 5 tensor was applied (its entries existed), and a 5 x 5
    one said "the pushed CSR has 5 rows" without the shapes."""
    m = sparse.csr_matrix(np.array([[1.0, 0, 2, 0, 0], [0, 3, 0, 0, 4], [0, 0, 0, 0, 0],
                                    [5, 0, 0, 0, 6]]))
    x = make(store, m, optimizer="sum", shard_rows=2)
    assert x.shape == (4, 5)
    before = x.pull().value.copy()
    for shape in ((4, 9), (4, 6), (5, 5), (6, 9)):
        g = sparse.csr_matrix((m.data, m.indices, np.concatenate(
            [m.indptr, np.full(shape[0] - 4, m.nnz)])), shape=shape)
        with pytest.raises(shmps.SchemaError, match=re.escape(
                f"shape {shape}, 'X' has shape (4, 5)")):
            x.push(g)
    with pytest.raises(shmps.SchemaError, match=re.escape("shape (4, 3), 'X' has shape")):
        x.push(sparse.csr_matrix(m[:, :3]))                        # fewer columns
    with pytest.raises(shmps.SchemaError, match=re.escape("has 4 (shape (4, 5))")):
        x.push(shmps.CSR(np.concatenate([m.indptr, [m.nnz]]), m.indices, m.data))
    np.testing.assert_array_equal(x.pull().value, before)
    x.push(sparse.csr_matrix((m.data, m.indices, m.indptr), shape=(4, 5)))   # its shape
    np.testing.assert_array_equal(x.pull().value, 2 * before)
