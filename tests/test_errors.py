"""Bad input raises a typed shmps.Error (also the matching builtin) with a hint, and a
rejected call changes nothing: every test pulls before and after."""
from __future__ import annotations

import json
import os
import re
import signal
import stat
import time

import numpy as np
import pytest

import shmps
from helpers import SHM, needs_small_shm, peek, poke, remove_store, store_segments

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def w(store):
    """A float32 (6, 4) SGD tensor over 3 shards, with known values."""
    t = store.dense("w", shape=(6, 4), dtype="float32", optimizer=shmps.SGD(lr=0.5),
                    shard_rows=2, init=np.arange(24, dtype=np.float32).reshape(6, 4))
    return t


@pytest.fixture
def iw(store):
    """An int32 (5, 3) sum tensor with known values."""
    return store.dense("iw", shape=(5, 3), dtype="int32",
                       init=np.arange(15, dtype=np.int32).reshape(5, 3))


def rejected(tensor, exc, call, match=None):
    """``call()`` raises ``exc`` (with a hint) and leaves ``tensor``'s values unchanged."""
    before = tensor.pull()
    with pytest.raises(exc, match=match) as info:
        call()
    assert isinstance(info.value, shmps.Error)
    assert info.value.hint, "every error says what to do"
    np.testing.assert_array_equal(tensor.pull(), before)
    return info.value


# ---- the error classes -----------------------------------------------------------------

@pytest.mark.parametrize("cls,builtin", [
    (shmps.Error, Exception), (shmps.InvalidArgument, ValueError),
    (shmps.SchemaError, ValueError), (shmps.OutOfRange, IndexError),
    (shmps.OutOfRange, ValueError), (shmps.NonFinite, ValueError),
    (shmps.NotFound, KeyError), (shmps.CapacityError, RuntimeError),
    (shmps.CorruptSegment, ValueError), (shmps.CorruptFile, ValueError),
    (shmps.Timeout, TimeoutError), (shmps.Closed, ValueError),
])
def test_error_classes_subclass_error_and_builtin(cls, builtin):
    """Every error class is a shmps.Error and its builtin, and prints its hint."""
    assert issubclass(cls, shmps.Error) and issubclass(cls, builtin)
    err = cls("something broke")
    assert "something broke" in str(err)
    if cls is not shmps.Error:  # the base class is never raised itself
        assert err.hint and err.hint in str(err)


def test_not_found_prints_plainly():
    """NotFound (a KeyError) prints its message, not a quoted repr."""
    assert str(shmps.NotFound("no tensor 'x'")).startswith("no tensor 'x'")


# ---- shapes and dtypes ---------------------------------------------------------------

@pytest.mark.parametrize("shape", [(6, 5), (5, 4), (24,), (6, 4, 1), ()])
def test_wrong_shape(w, shape):
    """A gradient of another shape is a SchemaError naming both shapes."""
    rejected(w, shmps.SchemaError, lambda: w.push(np.ones(shape, np.float32)),
             match=r"shape")


def test_wrong_rows_gradient_shape(w):
    """A rows= gradient must be (len(rows),) + row shape."""
    rejected(w, shmps.SchemaError, lambda: w.push(np.ones((3, 4)), rows=[0, 1]))
    rejected(w, shmps.SchemaError, lambda: w.push(np.ones((2, 5)), rows=[0, 1]))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "complex64"])
def test_float_into_int_tensor(iw, dtype):
    """Floats (or complex) into an int tensor are a SchemaError (numpy same_kind)."""
    rejected(iw, shmps.SchemaError, lambda: iw.push(np.ones((5, 3), dtype)), match="cast")


def test_complex_into_float_tensor(w):
    """Complex gradients into a float tensor are a SchemaError."""
    rejected(w, shmps.SchemaError, lambda: w.push(np.ones((6, 4), np.complex64)))


def test_float64_into_float32_is_fine(w):
    """float64 gradients are cast to a float32 tensor (same_kind)."""
    before = w.pull()
    w.push(np.full((6, 4), 2.0, np.float64))
    np.testing.assert_array_equal(w.pull(), before - np.float32(1.0))


def test_lists_are_accepted(iw):
    """Nested lists are converted like np.asarray."""
    iw.push([[1, 1, 1]] * 5)
    np.testing.assert_array_equal(iw.pull(), np.arange(15).reshape(5, 3) + 1)


@pytest.mark.parametrize("make", [
    lambda: np.arange(24, dtype=np.float32).reshape(4, 6).T,          # transposed
    lambda: np.arange(48, dtype=np.float32).reshape(12, 4)[::2],      # strided rows
    lambda: np.asfortranarray(np.arange(24, dtype=np.float64).reshape(6, 4)),
], ids=["transposed", "strided", "fortran"])
def test_non_contiguous_gradient_is_copied(w, make):
    """Non-contiguous gradients are accepted (copied) and applied correctly."""
    g = make()
    assert not g.flags.c_contiguous
    before = w.pull()
    w.push(g)
    np.testing.assert_allclose(w.pull(), before - np.float32(0.5) * g.astype(np.float32))


def test_non_contiguous_rows_and_rows_gradient(iw):
    """Strided rows and a strided rows gradient are accepted and applied correctly."""
    rows = np.array([4, 9, 0, 9, 4, 9])[::2]            # [4, 0, 4]
    g = np.arange(18, dtype=np.int32).reshape(3, 6)[:, ::2]
    assert not rows.flags.c_contiguous and not g.flags.c_contiguous
    want = iw.pull()
    np.add.at(want, rows, g)
    iw.push(g, rows=rows)
    np.testing.assert_array_equal(iw.pull(), want)


# ---- NaN / Inf ------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_whole_push_rejected(w, bad):
    """A NaN/Inf anywhere in a gradient is NonFinite and changes no shard."""
    g = np.ones((6, 4), np.float32)
    g[5, 3] = bad  # last shard: earlier shards must not have been updated either
    rejected(w, shmps.NonFinite, lambda: w.push(g), match="NaN")


def test_nonfinite_rows_push_rejected(w):
    """A NaN in a rows= gradient is NonFinite and changes no row."""
    g = np.ones((3, 4))
    g[2, 0] = np.nan
    rejected(w, shmps.NonFinite, lambda: w.push(g, rows=[0, 3, 5]))


def test_nonfinite_float16_tensor(store):
    """float16 tensors reject non-finite gradients too (checked in float32)."""
    t = store.dense("h", shape=(4,), dtype="float16", init=1.0)
    rejected(t, shmps.NonFinite, lambda: t.push(np.array([0, 0, np.inf, 0], np.float32)))


def test_nonfinite_accepted_with_allow_nonfinite(store):
    """allow_nonfinite=True stores NaN/Inf as pushed."""
    t = store.dense("w", shape=(3,), dtype="float64", allow_nonfinite=True)
    t.push(np.array([np.nan, np.inf, 1.0]))
    a = t.pull()
    assert np.isnan(a[0]) and a[1] == np.inf and a[2] == 1.0


def test_nonfinite_init_rejected(store):
    """A NaN init is an InvalidArgument and creates nothing."""
    with pytest.raises(shmps.InvalidArgument):
        store.dense("w", shape=(3,), init=np.nan)
    assert store.tensors() == []


CSR2 = (np.array([0, 2]), np.array([0, 1]))   # one row, two entries


@pytest.mark.parametrize("kind", ["dense", "csr"])
@pytest.mark.parametrize("dtype,init,exc,match", [
    ("float32", [np.nan, 1.0], shmps.InvalidArgument, r"init\[0\] = nan is not finite"),
    ("float64", [1.0, -np.inf], shmps.InvalidArgument, r"init\[1\] = -inf is not finite"),
    ("float16", [1e5, 1.0], shmps.InvalidArgument, r"init\[0\] = 100000.0 cannot be stored in float16"),
    ("float32", [1.0, 1e300], shmps.InvalidArgument, "cannot be stored in float32"),
    ("float16", np.array([1, 70000]), shmps.InvalidArgument, "cannot be stored in float16"),
    ("int8", [300, 1], shmps.SchemaError, r"init\[0\] = 300 cannot be stored in int8"),
    ("int8", np.array([1, -129], np.int16), shmps.SchemaError, "cannot be stored in int8"),
    ("int32", np.array([0, 2 ** 63], np.uint64), shmps.SchemaError, "cannot be stored in int32"),
    ("float32", [True, False], shmps.SchemaError, "not a number"),
], ids=["nan", "-inf", "past-float16", "past-float32", "int-past-float16", "int8-300",
        "int16-past-int8", "uint64-past-int32", "bool"])
def test_bad_array_init_rejected(store, kind, dtype, init, exc, match):
    """An array init is checked element by element as a scalar init is (finite, within
    the float dtype's range, integers in range), with the same error classes, naming
    the first bad element; nothing is created (review 14 F3: NaN went in, float16
    overflowed to inf, int8 300 wrapped to 44)."""
    with pytest.raises(exc, match=match) as info:
        if kind == "dense":
            store.dense("w", shape=(2,), dtype=dtype, init=init)
        else:
            store.csr("w", *CSR2, dtype=dtype, init=init)
    assert type(info.value) is exc and info.value.hint
    assert store.tensors() == []


@pytest.mark.parametrize("dtype,init,exc", [
    ("float16", 1e5, shmps.InvalidArgument), ("float32", np.nan, shmps.InvalidArgument),
    ("int8", 300, shmps.SchemaError), ("int8", 0.5, shmps.SchemaError),
    ("float32", True, shmps.SchemaError),
])
def test_bad_scalar_init_rejected_alike(store, dtype, init, exc):
    """A scalar init gets the same checks in a dense and a csr tensor (a csr float16
    init of 1e5 was stored as inf)."""
    with pytest.raises(exc):
        store.dense("w", shape=(2,), dtype=dtype, init=init)
    with pytest.raises(exc):
        store.csr("w", *CSR2, dtype=dtype, init=init)
    assert store.tensors() == []


def test_nonfinite_init_with_allow_nonfinite(store):
    """allow_nonfinite=True takes NaN/Inf inits (a max tensor starting at -inf), scalar
    or array; a finite value past the dtype's range is still refused."""
    m = store.dense("m", shape=(2,), init=-np.inf, optimizer="max", allow_nonfinite=True)
    m.push(np.array([1.0, -2.0]))
    assert m.pull().tolist() == [1.0, -2.0]
    a = store.dense("a", shape=(2,), dtype="float16", init=[np.nan, np.inf],
                    allow_nonfinite=True)
    assert np.isnan(a.pull()[0]) and a.pull()[1] == np.inf
    c = store.csr("c", *CSR2, init=[np.inf, 1.0], allow_nonfinite=True)
    assert c.pull().value.tolist() == [np.inf, 1.0]
    with pytest.raises(shmps.InvalidArgument, match="float16"):
        store.dense("b", shape=(2,), dtype="float16", init=[1e5, np.nan], allow_nonfinite=True)


@pytest.mark.parametrize("make", [lambda: (k for k in (1, 2)), lambda: {1, 2},
                                  lambda: iter([1, 2]), lambda: {1: 0, 2: 0}.keys()],
                         ids=["generator", "set", "iterator", "dict-keys"])
def test_table_keys_given_as_an_iterable_numpy_cannot_read_say_so(store, make):
    """Table keys given as a generator, a set, an iterator or a dict view (numpy makes a
    0-d object array of each) are a SchemaError that names what was given and how to
    pass it, and nothing changes.  Before, "keys must be integers in [0, 2**64)": the
    keys were integers (a user walk-through, H17)."""
    t = store.table("t", dim=1, capacity=8)
    for call in (lambda: t.pull(make()), lambda: t.push(make(), np.ones((2, 1))),
                 lambda: t.delete(make())):
        with pytest.raises(shmps.SchemaError, match="pass them as a list or a 1-d numpy "
                           "array") as info:
            call()
        assert type(make()).__name__ in str(info.value) and info.value.hint
    assert t.keys().tolist() == [] and t.stats()["step"] == 0
    assert t.pull(range(1, 3)).shape == (2, 1)        # a range is read as it is


@pytest.mark.parametrize("bools", [[5, True], (0, np.bool_(True)), [True], [2, False, 1]],
                         ids=["list", "tuple-np-bool", "only-bool", "false"])
def test_bool_in_a_list_of_keys_or_rows(store, bools):
    """A bool inside a list or tuple of table keys, dense rows= or csr rows is refused
    with the error a bool array gets, and nothing changes (review 14 F5: [5, True] was
    taken as key/row 1, creating key 1)."""
    t = store.table("t", dim=1, capacity=8)
    t.pull([5])
    as_array = pytest.raises(shmps.SchemaError, match="bool")
    with as_array:
        t.pull(np.array([True]))
    for call in (lambda: t.pull(bools), lambda: t.push(bools, np.ones((len(bools), 1))),
                 lambda: t.delete(bools)):
        with pytest.raises(shmps.SchemaError, match="bool") as info:
            call()
        assert info.value.hint
    assert sorted(t.keys().tolist()) == [5] and t.stats()["step"] == 0
    d = store.dense("d", shape=(3, 2), init=1.0)
    g = np.ones((len(bools), 2))
    for call in (lambda: d.push(g, rows=np.array(bools, dtype=bool)),   # the array's error
                 lambda: d.push(g, rows=bools), lambda: d.push(g, rows=bools, wait=False),
                 lambda: d.pull(rows=bools)):
        rejected(d, shmps.OutOfRange, call, match="bool")
    assert d.stats()["step"] == 0
    c = store.csr("c", np.array([0, 1, 2, 3]), np.array([0, 0, 0]))
    for call in (lambda: c.pull(rows=np.array(bools, dtype=bool)), lambda: c.pull(rows=bools)):
        with pytest.raises(shmps.OutOfRange, match="bool"):
            call()


# ---- rows --------------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [[0, 6], [-1], [2, -3], [10**12],
                                  np.array([1, 2**63 + 5], np.uint64),
                                  np.array([0, 6], np.int64), np.array([2, -3], np.int64),
                                  np.array([10**12], np.int64)],
                         ids=["past-end", "negative", "negative-later", "huge", "uint64-huge",
                              "int64-past-end", "int64-negative-later", "int64-huge"])
def test_rows_out_of_range(w, rows):
    """Rows past the end or negative are OutOfRange (an IndexError) naming the row; no
    row changes.  An int64 array goes to C unchecked (rows_for_c): C refuses it before
    it changes or copies anything, and Python names the row; with wait=False the push
    is refused at once, not at its wait."""
    bad = [r for r in np.asarray(rows).tolist() if not 0 <= r < 6][0]
    g = np.ones((len(rows), 4), np.float32)
    err = rejected(w, shmps.OutOfRange, lambda: w.push(g, rows=rows), match=f"row {bad} ")
    assert isinstance(err, IndexError)
    rejected(w, shmps.OutOfRange, lambda: w.push(g, rows=rows, wait=False),
             match=f"row {bad} ")
    rejected(w, shmps.OutOfRange, lambda: w.pull(rows=rows), match=f"row {bad} ")


@pytest.mark.parametrize("rows", [np.array([0.0, 1.0]), np.array([True, False]), [[0], [1]],
                                  np.array(["0", "1"])],
                         ids=["float", "bool", "2-d", "str"])
def test_rows_of_wrong_type(w, rows):
    """Float, bool, 2-d or string rows are OutOfRange, not silently converted."""
    g = np.ones((2, 4), np.float32)
    rejected(w, shmps.OutOfRange, lambda: w.push(g, rows=rows))
    rejected(w, shmps.OutOfRange, lambda: w.pull(rows=rows))


def test_out_of_range_after_valid_rows_in_other_shards(w):
    """A bad row after good rows (in other shards) still changes nothing."""
    g = np.ones((4, 4), np.float32)
    rejected(w, shmps.OutOfRange, lambda: w.push(g, rows=[0, 2, 4, 6]))


def test_uint_rows_accepted(iw):
    """Unsigned integer rows within range are fine."""
    iw.push(np.ones((2, 3), np.int32), rows=np.array([4, 4], np.uint32))
    assert iw.pull(rows=[4])[0, 0] == 14


# ---- names ---------------------------------------------------------------------------------

def test_unknown_tensor(store):
    """store[name] of an unknown tensor is NotFound (a KeyError) listing what exists."""
    store.dense("a", shape=(1,))
    with pytest.raises(shmps.NotFound, match="existing: a") as info:
        store["nope"]
    assert isinstance(info.value, KeyError)
    with pytest.raises(shmps.NotFound, match="shape"):
        store.dense("nope")  # no shape: cannot create


@pytest.mark.parametrize("name", ["..", ".", "/x", "", "a" * 65, "a/b", "a b", "x\0y",
                                  "ü", None, 5, b"abc"])
def test_invalid_store_names(name):
    """Store names outside [A-Za-z0-9_.-]{1,64}, or '.'/'..', are InvalidArgument."""
    with pytest.raises(shmps.InvalidArgument, match="store name"):
        shmps.attach(name)
    assert not [n for n in os.listdir(SHM) if n.startswith("shmps..")]


@pytest.mark.parametrize("ns", ["..", "/x", "a/b", "a" * 65])
def test_invalid_namespaces(store_name, ns):
    """Namespaces follow the store-name rule."""
    with pytest.raises(shmps.InvalidArgument, match="namespace"):
        shmps.attach(store_name, namespace=ns)


def test_longest_valid_name(request):
    """A 64-character name with every allowed character class works."""
    name = ("A-z_0.9" + request.node.name[-8:].replace("[", "").replace("]", "")).ljust(64, "x")
    assert len(name) == 64
    s = shmps.attach(name)
    try:
        assert store_segments(name) == [f"shmps.{name}.manifest"]
    finally:
        s.destroy()


@pytest.mark.parametrize("name", ["", None, "x" * 257])
def test_invalid_tensor_names(store, name):
    """Tensor names must be non-empty strings of at most 256 characters."""
    with pytest.raises(shmps.InvalidArgument):
        store.dense(name, shape=(1,))


@pytest.mark.parametrize("timeout", [-1, float("nan"), "soon", None])
def test_attach_refuses_a_bad_timeout(store_name, timeout):
    """attach(timeout=) takes seconds >= 0 (math.inf: no limit); -1 was taken as no
    limit by the C core, a string failed inside it."""
    with pytest.raises(shmps.InvalidArgument, match="timeout"):
        shmps.attach(store_name, timeout=timeout)
    assert store_segments(store_name) == []


def test_attach_missing_store_without_create(store_name):
    """attach(name, create=False) of a missing store is NotFound and creates nothing."""
    with pytest.raises(shmps.NotFound, match=store_name):
        shmps.attach(store_name, create=False)
    assert store_segments(store_name) == []


# ---- creation arguments ----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,exc", [
    (dict(shape=(3,), dtype="uint8"), shmps.SchemaError),
    (dict(shape=(3,), dtype="int64"), shmps.SchemaError),
    (dict(shape=(3,), dtype="int32", optimizer=shmps.SGD(lr=0.1)), shmps.SchemaError),
    (dict(shape=(3,), dtype="int8", optimizer=shmps.Momentum(lr=0.1)), shmps.SchemaError),
    (dict(shape=(3,), optimizer="adam"), shmps.InvalidArgument),
    (dict(shape=(3,), mode="racy"), shmps.InvalidArgument),
    (dict(shape=(3,), shard_rows=0), shmps.InvalidArgument),
    (dict(shape=(-1, 2)), shmps.SchemaError),
    (dict(shape=(1,) * 9), shmps.SchemaError),
    (dict(shape=(3,), dtype="int8", init=300), shmps.SchemaError),
    (dict(shape=(3,), dtype="int32", init=0.5), shmps.SchemaError),
    (dict(shape=(3,), init=np.ones(4)), shmps.SchemaError),
    (dict(shape=(2.5,)), shmps.SchemaError),
    (dict(shape=(True, 3)), shmps.SchemaError),
    (dict(shape=("3",)), shmps.SchemaError),
    (dict(shape=(2,), dtype="float16", init=1e10), shmps.InvalidArgument),
    (dict(shape=(2 ** 40, 1024)), shmps.CapacityError),
    (dict(shape=(2 ** 62, 2 ** 62)), shmps.CapacityError),
], ids=["uint8", "int64", "sgd-int", "momentum-int8", "unknown-opt", "mode", "shard_rows",
        "negative-dim", "9-d", "init-range", "init-fraction", "init-shape", "float-dim",
        "bool-dim", "str-dim", "init-past-float16", "4PiB", "2^124-values"])
def test_bad_creation_arguments(store, kwargs, exc):
    """Bad dtype/optimizer/mode/shape/init arguments raise and create nothing; a tensor
    larger than /dev/shm's free space is refused at once (a shape of 2**40 rows ran for
    minutes, laying out one shard record per 16 MiB under the store's manifest lock)."""
    with pytest.raises(exc) as info:
        store.dense("w", **kwargs)
    assert info.value.hint
    assert store.tensors() == []
    assert len(store_segments(store.name)) == 1  # the manifest only


@pytest.mark.parametrize("shape", [np.array([2, 3]), np.array([4], np.uint8),
                                   np.array([], np.int64)], ids=["int64", "uint8", "0-d"])
def test_a_shape_given_as_a_numpy_array_is_its_dimensions(store, shape):
    """shape= a 1-d integer numpy array (what arithmetic on shapes gives) is taken as
    the dimensions, as numpy's np.zeros(shape) takes it; a float or bool array is
    refused as a float or bool dimension is.  It was taken for one dimension: "invalid
    shape array([2, 3]): array([2, 3]) is not an integer"."""
    t = store.dense("w", shape=shape)
    assert t.shape == tuple(int(x) for x in shape)
    assert store.dense("w", shape=tuple(t.shape)) is not None   # the same schema
    for bad in (np.array([2.0, 3.0]), np.array([True, False])):
        with pytest.raises(shmps.SchemaError, match="is not"):
            store.dense("v", shape=bad)
    assert "v" not in store


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(dim=4, capacity=10, dtype="float16", init=("uniform", 1e9, 1e10)),
     shmps.InvalidArgument, "float16"),
    (dict(dim=4, capacity=10, dtype="float16", init=7e4), shmps.InvalidArgument, "float16"),
    (dict(dim=1024, capacity=2 ** 40), shmps.CapacityError, "/dev/shm"),
    (dict(dim=4, capacity=10, seed=-1), shmps.InvalidArgument, "seed"),
], ids=["uniform-past-float16", "constant-past-float16", "past-dev-shm", "seed"])
def test_bad_table_creation_arguments(store, kwargs, exc, match):
    """The same for tables; the hint names the argument that is wrong."""
    with pytest.raises(exc) as info:
        store.table("emb", **kwargs)
    assert match in str(info.value)
    assert store.tensors() == []
    assert len(store_segments(store.name)) == 1


# what operator.index takes (numpy and PyTorch integers, a 0-d integer array), and what
# it does not (a float of any kind, a bool, a string, a 1-d array)
INDEXES = [np.int64(2), np.uint8(2), np.array(2)]
NOT_INTEGERS = [2.5, np.float64(2.0), np.array(2.0), True, np.bool_(True), np.array(True),
                "2", np.array([2])]
NOT_INTEGER_IDS = ["float", "np.float64", "0-d float", "bool", "np.bool_", "0-d bool",
                   "str", "1-d"]


@pytest.mark.parametrize("two", INDEXES, ids=["np.int64", "np.uint8", "0-d"])
def test_integer_arguments_take_what_operator_index_takes(store, two):
    """Every integer argument of tensor creation and eviction (dense and csr
    shard_rows, an aggregated tensor's workers, a table's dim, capacity, seed and
    shards, evict's min_pushes and idle_steps) takes an integer-like as numpy and
    PyTorch users pass it (operator.index: a 0-d integer array was refused by the
    isinstance checks, which int() took before), through one check (checks.check_int)."""
    w = store.dense("w", shape=(4, 4), dtype="int32", shard_rows=two)
    assert w.shard_rows == 2 and w.nshards == 2
    x = store.csr("x", np.array([0, 1, 2, 2, 3]), np.array([0, 1, 0]), shard_rows=two)
    assert x.nshards == 2
    a = store.dense("a", shape=(4,), aggregate="sum", workers=two)
    assert a.record["workers"] == 2
    t = store.table("emb", dim=two, capacity=two * 8, seed=two, shards=two)
    assert (t.record["dim"], t.record["capacity"], t.record["seed"], t.nshards) == (2, 16, 2, 2)
    assert store.table("emb", dim=two, capacity=two * 8, seed=two) is t
    t.push(np.array([1, 2], np.uint64), np.ones((2, 2), np.float32))
    t.push(np.array([1], np.uint64), np.ones((1, 2), np.float32))
    assert t.evict(min_pushes=two) == 1 and t.evict(idle_steps=two) == 0


@pytest.mark.parametrize("bad", NOT_INTEGERS, ids=NOT_INTEGER_IDS)
@pytest.mark.parametrize("call", ["dense shard_rows", "csr shard_rows", "workers", "dim",
                                  "capacity", "seed", "shards", "min_pushes", "idle_steps"])
def test_integer_arguments_refuse_what_is_no_integer(store, call, bad):
    """The same arguments refuse a float (2.5 was taken as 2 by int() for shard_rows), a
    bool, a string and a 1-d array: InvalidArgument naming the argument, with a hint,
    and nothing created or evicted."""
    t = store.table("t", dim=2, capacity=8)
    t.push(np.array([1], np.uint64), np.ones((1, 2), np.float32))
    calls = {
        "dense shard_rows": lambda: store.dense("w", shape=(4,), shard_rows=bad),
        "csr shard_rows": lambda: store.csr("x", np.array([0, 1]), np.array([0]),
                                            shard_rows=bad),
        "workers": lambda: store.dense("w", shape=(4,), aggregate="sum", workers=bad),
        "dim": lambda: store.table("e", dim=bad, capacity=8),
        "capacity": lambda: store.table("e", dim=2, capacity=bad),
        "seed": lambda: store.table("e", dim=2, capacity=8, seed=bad),
        "shards": lambda: store.table("e", dim=2, capacity=8, shards=bad),
        "min_pushes": lambda: t.evict(min_pushes=bad),
        "idle_steps": lambda: t.evict(idle_steps=bad),
    }
    with pytest.raises(shmps.InvalidArgument) as info:
        calls[call]()
    assert f"{call.split()[-1]}=" in str(info.value) and info.value.hint, str(info.value)
    assert [d["name"] for d in store.tensors()] == ["t"]
    assert t.contains(np.array([1], np.uint64)).tolist() == [True]


FLAG_CALLS = ["attach create", "restore force", "dense allow_nonfinite",
              "table allow_nonfinite", "csr allow_nonfinite", "dense push wait",
              "dense pull consistent", "dense view writable", "table push wait",
              "table pull create", "csr push wait", "csr pull consistent",
              "csr to_scipy consistent", "aggregated push wait",
              "aggregated pull consistent", "Momentum nesterov", "Adam amsgrad",
              "CSR.from_dense keep_zeros", "read_csr mmap", "read_csr check",
              "read_dense mmap", "inspect.scan with_fill", "finish_replacement any_host"]


@pytest.mark.parametrize("bad", ["no", "", 1, 0.0, None], ids=["no", "empty", "1", "0.0",
                                                                "None"])
@pytest.mark.parametrize("call", FLAG_CALLS)
def test_boolean_keywords_refuse_what_is_no_bool(store, tmp_path, call, bad):
    """Every public boolean keyword takes True or False (numpy's np.bool_ too) and
    refuses anything else with InvalidArgument naming it and saying to pass True or
    False (checks.check_flag), before anything is done: a truthy test took
    pull(consistent="no") as True, attach(create="no") created the store, and
    allow_nonfinite="no" made a tensor that takes NaN.  (None too, where it is no
    choice of its own: allow_nonfinite=None means "whatever the tensor has".)"""
    from shmps import files
    from shmps import inspect as shm_inspect

    if bad is None and call.endswith("allow_nonfinite"):
        pytest.skip("allow_nonfinite=None accepts the existing tensor's")
    w = store.dense("w", shape=(4,), dtype="float32")
    t = store.table("t", dim=2, capacity=8)
    x = store.csr("x", np.array([0, 1]), np.array([0]))
    a = store.dense("a", shape=(4,), aggregate="sum", workers=1)
    ck = str(tmp_path / "ck")
    if call == "restore force":
        store.checkpoint(ck)
    keys, g2 = np.array([1], np.uint64), np.ones((1, 2), np.float32)
    other = store.name + "b"
    calls = {
        "attach create": lambda: shmps.attach(other, create=bad),
        "restore force": lambda: shmps.restore(ck, other, force=bad),
        "dense allow_nonfinite": lambda: store.dense("n", shape=(4,), allow_nonfinite=bad),
        "table allow_nonfinite": lambda: store.table("n", dim=2, capacity=8,
                                                     allow_nonfinite=bad),
        "csr allow_nonfinite": lambda: store.csr("n", np.array([0, 1]), np.array([0]),
                                                 allow_nonfinite=bad),
        "dense push wait": lambda: w.push(np.ones(4), wait=bad),
        "dense pull consistent": lambda: w.pull(consistent=bad),
        "dense view writable": lambda: w.view(writable=bad),
        "table push wait": lambda: t.push(keys, g2, wait=bad),
        "table pull create": lambda: t.pull(keys, create=bad),
        "csr push wait": lambda: x.push(shmps.CSR(np.array([0, 1]), np.array([0]),
                                                  np.ones(1, np.float32)), wait=bad),
        "csr pull consistent": lambda: x.pull(consistent=bad),
        "csr to_scipy consistent": lambda: x.to_scipy(consistent=bad),
        "aggregated push wait": lambda: a.push(np.ones(4), wait=bad),
        "aggregated pull consistent": lambda: a.pull(consistent=bad),
        "Momentum nesterov": lambda: shmps.Momentum(lr=0.1, nesterov=bad),
        "Adam amsgrad": lambda: shmps.Adam(lr=0.1, amsgrad=bad),
        "CSR.from_dense keep_zeros": lambda: shmps.CSR.from_dense(np.eye(2),
                                                                  keep_zeros=bad),
        "read_csr mmap": lambda: files.read_csr(ck, mmap=bad),
        "read_csr check": lambda: files.read_csr(ck, check=bad),
        "read_dense mmap": lambda: files.read_dense(ck, mmap=bad),
        "inspect.scan with_fill": lambda: shm_inspect.scan(with_fill=bad),
        "finish_replacement any_host": lambda: files.finish_replacement(ck, any_host=bad),
    }
    name = call.split()[-1]
    try:
        with pytest.raises(shmps.InvalidArgument, match=f"{name}=") as info:
            calls[call]()
        assert f"pass {name}=True or {name}=False" in str(info.value)
        assert store_segments(other) == []
        assert sorted(d["name"] for d in store.tensors()
                      if "#" not in d["name"]) == ["a", "t", "w", "x"]
        assert not w.pull().any() and not t.contains(keys).any() and not x.pull().value.any()
        assert not a.pull().any()
    finally:
        remove_store(other)


@pytest.mark.parametrize("yes", [True, np.bool_(True)], ids=["True", "np.True_"])
def test_boolean_keywords_take_numpy_bools(store, yes):
    """np.bool_ (what a numpy comparison gives) is taken where a bool is."""
    w = store.dense("w", shape=(4,), dtype="float32", allow_nonfinite=yes)
    w.push(np.full(4, np.nan), wait=yes)
    assert np.isnan(w.pull(consistent=yes)).all() and w.view(writable=yes).flags.writeable
    t = store.table("t", dim=2, capacity=8)
    assert t.pull(np.array([1], np.uint64), create=yes).shape == (1, 2)
    assert len(t) == 1


def test_a_shard_rows_making_too_many_shards_is_refused(store):
    """An explicit shard_rows that would split a dense or csr tensor into more than
    MAX_ROW_SHARDS shards (each a mapping in every process; Linux allows 65530) is a
    SchemaError before anything is created."""
    from shmps.tensor import MAX_ROW_SHARDS
    n = MAX_ROW_SHARDS + 1
    with pytest.raises(shmps.SchemaError, match=f"makes {n:,} shards"):
        store.dense("w", shape=(n, 2), shard_rows=1)
    with pytest.raises(shmps.SchemaError, match=f"makes {n:,} shards"):
        store.csr("c", np.arange(n + 1, dtype=np.int64), np.zeros(n, np.int64), shard_rows=1)
    assert store.tensors() == []


def test_shard_rows_above_the_rows_are_the_rows(store):
    """shard_rows= larger than the tensor's rows makes one shard of them all; the same
    call again gets the tensor (it raised SchemaError 'exists with another schema', and
    had created it)."""
    w = store.dense("w", shape=(10, 4), shard_rows=16)
    assert (w.nshards, w.record["shard_rows"]) == (1, 10)
    again = store.dense("w", shape=(10, 4), shard_rows=16)
    assert again is w
    with pytest.raises(shmps.SchemaError, match="shard_rows"):
        store.dense("w", shard_rows=5)


def _on_small_shm(script: str) -> dict:
    """Run ``script`` (which prints a JSON object last) in a private mount namespace with
    a 64 MiB tmpfs on /dev/shm; its object."""
    import subprocess
    import sys
    r = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64m tmpfs "
                        f"/dev/shm && exec {sys.executable} -c '{script}'"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr + r.stdout
    return json.loads(r.stdout.splitlines()[-1])


def _still_works(name: str) -> str:
    """The end of a script on a small /dev/shm: tensor ``name`` can be created and pushed
    to (out["works"]), and destroying the store leaves /dev/shm empty (out["end"])."""
    return f"""
w = s.dense("{name}", shape=(1024,))
w.push(np.ones(1024, np.float32))
out["works"] = float(w.pull().sum())
s.destroy()
out["end"] = sorted(os.listdir("/dev/shm"))
print(json.dumps(out))
"""


FULL_SHM_SCRIPT = """
import json, os, numpy as np, shmps
out = {}
s = shmps.attach("full")
for what, make in [("dense", lambda: s.dense("w", shape=(1 << 25,))),
                   ("dense_init", lambda: s.dense("w", shape=(1 << 25,), init=1.0)),
                   ("table", lambda: s.table("emb", dim=16, capacity=10_000_000)),
                   ("adam", lambda: s.dense("a", shape=(3 << 22,), optimizer=shmps.Adam(lr=0.1)))]:
    try:
        make()
        out[what] = "created"
    except shmps.CapacityError as e:
        out[what] = str(e)
    out[what + "_left"] = sorted(os.listdir("/dev/shm"))
from shmps import segment
seg = segment.Segment.create("/shmps.full.sparse", 96 << 20, reserve=False)
try:
    segment.allocate(seg.name, seg.size, seg.ino)
    out["allocate"] = "backed"
except shmps.CapacityError as e:
    out["allocate"] = str(e)
seg.close()
segment.unlink(seg.name)
""" + _still_works("small")


@needs_small_shm
def test_a_tensor_larger_than_dev_shm_is_refused_not_a_crash():
    """On a 64 MiB /dev/shm (a private tmpfs), a 128 MiB tensor or a 1.3 GiB table is
    refused with CapacityError and leaves no segment, and so is a 48 MiB Adam tensor,
    whose values fit but not with its state (refused by the reservation of its
    segments, not the first test of its size); a small one still works.  Before,
    each was created, and the first write (the init fill, a push) killed the process
    with SIGBUS: tmpfs sizes a segment without reserving its pages."""
    out = _on_small_shm(FULL_SHM_SCRIPT)
    for what in ("dense", "dense_init", "table", "adam"):
        assert "no room" in out[what] or "needs at least" in out[what], out
        assert out[what + "_left"] == ["shmps.full.manifest"], out
    # a segment made without backing (shmps-bridge's) and backed later: the same refusal
    assert "no room for segment /shmps.full.sparse" in out["allocate"], out
    assert out["works"] == 1024.0
    assert out["end"] == []


FULL_CATALOG_SCRIPT = """
import json, os, numpy as np, shmps
from shmps import segment
out = {}
s = shmps.attach("full")
s.dense("probe", shape=(1024,))   # the pages its segments take
need = sum(-(-os.stat("/dev/shm/" + n).st_size // 4096) * 4096
           for n in os.listdir("/dev/shm") if ".t" in n)
s.destroy()
s = shmps.attach("full")          # a new store: the first page of its catalog not backed
filler = segment.Segment.create("/filler", segment.shm_free() - need)
try:
    s.dense("w", shape=(1024,))
    out["w"] = "created"
except shmps.CapacityError as e:
    out["w"] = str(e)
out["left"] = sorted(os.listdir("/dev/shm"))
filler.close()
segment.unlink("/filler")
""" + _still_works("w")


@needs_small_shm
def test_a_tensor_whose_catalog_record_finds_dev_shm_full_leaves_nothing():
    """On a private tmpfs filled so that a new tensor's segments fit but not the catalog
    page its record goes to (a new store's catalog pages are backed as records reach
    them), creating the tensor raises CapacityError and leaves no segment of it; with
    room again, the same name is created and works.  (Its segments were left behind,
    taking the space, until the next tensor reused the id.)"""
    out = _on_small_shm(FULL_CATALOG_SCRIPT)
    assert "no room for the catalog page of tensor 'w'" in out["w"], out
    assert out["left"] == ["filler", "shmps.full.manifest"], out
    assert out["works"] == 1024.0 and out["end"] == [], out


FULL_OUTBOX_SCRIPT = """
import json, os, numpy as np, shmps
from shmps import segment
out = {}
s = shmps.attach("full")
t = s.table("emb", dim=16, capacity=100_000)
s._set_forwarding(True)
filler = segment.Segment.create("/filler", segment.shm_free())   # /dev/shm full
try:
    t.push(np.arange(3, dtype=np.uint64), np.ones((3, 16), np.float32))
    out["push"] = "pushed"
except shmps.CapacityError as e:
    out["push"] = str(e)
filler.close()
segment.unlink("/filler")
t.push(np.arange(3, dtype=np.uint64), np.ones((3, 16), np.float32))
out["pending"] = int(t._outbox()._shards[0].seg.size > 0)
s._set_forwarding(False)
""" + _still_works("w")


@needs_small_shm
def test_an_outbox_made_on_a_full_dev_shm_is_refused_not_a_crash():
    """A worker's first forwarded push makes its tensor's outbox, whose pages are not
    backed (it holds only what is pushed): on a full /dev/shm the push raises
    CapacityError, and once there is room the same push makes the outbox.  (Making it
    wrote its header and a table's control block into unbacked pages: SIGBUS killed the
    worker.)"""
    out = _on_small_shm(FULL_OUTBOX_SCRIPT)
    assert "no room" in out["push"], out
    assert out["pending"] == 1 and out["works"] == 1024.0 and out["end"] == [], out


UNBACKED_SCRIPT = """
import json, os, numpy as np, shmps
out = {}
s = shmps.attach("full")
s.reserve_memory = False          # as the handle of shmps-bridge: copies backed later
try:   # 24 MiB of values fit in 64 MiB, not with the two Adam moments (72 MiB in all)
    s.dense("a", shape=(6 << 20,), optimizer=shmps.Adam(lr=0.1))
    out["adam"] = "created"
except shmps.CapacityError as e:
    out["adam"] = str(e)
out["adam_left"] = sorted(os.listdir("/dev/shm"))
s.unbacked_bytes = lambda: 40 << 20   # copies made before, not backed yet
try:   # 32 MiB fits alone, not beside them
    s.dense("b", shape=(8 << 20,))
    out["beside"] = "created"
except shmps.CapacityError as e:
    out["beside"] = str(e)
s.unbacked_bytes = lambda: 0
s.dense("b", shape=(8 << 20,))
out["alone"] = s["b"].shape[0]
s.reserve_memory = True
""" + _still_works("w")


@needs_small_shm
def test_a_tensor_made_unbacked_must_fit_whole_beside_those_being_backed():
    """shmps-bridge creates its copies of peers' tensors without backing them (a thread
    backs them after): on a 64 MiB /dev/shm such a tensor is refused unless all its
    segments fit, an Adam tensor's moments included, beside the tensors still being
    backed (Store.unbacked_bytes), and nothing of it is left.  Before, only its values
    were compared with the free space: the Adam copy was created and its backing failed,
    or the first write past the room killed the bridge with SIGBUS; and two copies made
    in a row each counted the same free space."""
    out = _on_small_shm(UNBACKED_SCRIPT)
    assert re.search(r"tensor 'a' \(\d segments of 75,\d+,\d+ bytes in all\) needs",
                     out["adam"]), out
    assert out["adam_left"] == ["shmps.full.manifest"], out
    assert "beside 41,943,040 bytes of tensors still being backed" in out["beside"], out
    assert out["alone"] == 8 << 20
    assert out["works"] == 1024.0 and out["end"] == [], out


#: the start of a script on a small /dev/shm: a Bridge (not started) on store "full",
#: its handle creating tensors unbacked and counting them as shmps-bridge's does
BRIDGE_BY_HAND = """
import asyncio, json, os, sys, tempfile, numpy as np, shmps
from shmps import segment
from shmps.bridge.node import Bridge, Config, TInfo
out = {}
d = tempfile.mkdtemp()
open(d + "/hosts.txt", "w").write("127.0.0.2:7001")
node = Bridge(Config(peers_file=d + "/hosts.txt", store="full", listen="127.0.0.2:7001"))
node.store = shmps.attach("full")
node.store.reserve_memory = False
node.store.unbacked_bytes = node._still_unbacked
node._stop_event = asyncio.Event()
"""


BACKING_FAILS_SCRIPT = BRIDGE_BY_HAND + """
rec = dict(name="emb", kind="table", dtype="float32", dim=16, capacity=200_000,
           nshards=2, optimizer=dict(type="Sum"))
node.create_from_record(rec)                     # 30 MiB, created unbacked: it fits
t = node.store["emb"]
node.by_name["emb"] = TInfo("emb", 0, "table", t, 2, np.dtype("float32"),
                            np.dtype("float32"), 16, (16,), None, 1, rec)
filler = segment.Segment.create("/filler", segment.shm_free())   # then /dev/shm is full
node._back_pages("emb")                          # (no event loop: backs it at once)
out["fatal"] = str(node.fatal)
out["stop"] = node._stop_event.is_set()
out["hurry"] = node._hurry
out["pending"] = node._still_unbacked()
filler.close()
segment.unlink("/filler")
node.store.close()
s = shmps.attach("full")
""" + _still_works("w")


COPIES_IN_A_ROW_SCRIPT = BRIDGE_BY_HAND + """

def rec(name, rows):
    return dict(name=name, kind="dense", shape=[rows, 1024], dtype="float32",
                shard_rows=rows, optimizer=dict(type="Sum"))

node.create_from_record(rec("a", 10240))            # 40 MiB, not backed yet
out["a"] = node._still_unbacked() >> 20
try:                                                # 40 more: 80 of 64 MiB
    node.create_from_record(rec("b", 10240))
    out["b"] = "created"
except segment.NoRoom as e:
    out["b"] = str(e)
a = node.store["a"]._shards[0].seg
segment.allocate(a.name, a.size, a.ino)             # backed (its callback not run yet)
out["a_backed"] = node._still_unbacked()
node.create_from_record(rec("c", 4096))             # 16 MiB of the 24 left
out["c"] = node.store["c"].shape[0]
node.store.close()
s = shmps.attach("full")
""" + _still_works("w")


@needs_small_shm
def test_copies_made_in_a_row_count_what_the_earlier_ones_still_need():
    """On a 64 MiB /dev/shm, a bridge that made a 40 MiB copy (not backed yet) refuses a
    second one in the same catalog pass (each counted the same free space as its own:
    both were made, and the second one's pages were missing); once the first is backed,
    its pages count as used, not twice, and a 16 MiB copy is made (a copy backed whose
    callback had not run yet counted in full, and refused one that fit: the host left
    the cluster for nothing)."""
    out = _on_small_shm(COPIES_IN_A_ROW_SCRIPT)
    assert out["a"] == 40, out
    assert "tensor 'b' (1 segments of" in out["b"] and \
        "beside 41,9" in out["b"] and "still being backed" in out["b"], out
    assert out["a_backed"] == 0 and out["c"] == 4096, out
    assert out["works"] == 1024.0 and out["end"] == [], out


@needs_small_shm
def test_a_bridge_whose_copy_cannot_be_backed_leaves(caplog):
    """shmps-bridge backs the copy of a peer's tensor after creating it; when /dev/shm is
    full by then (another process took the room), it leaves the cluster at once (the
    leave's waits skipped: they touch the copy), with a CapacityError naming the tensor
    that serve raises once it has left (exit status 2); the copy still counts as not
    backed (its pages are still missing).  Before, it logged an error and tried again
    every 10 s, a bridge on the ring with a copy whose next touch of a missing page
    would kill it with SIGBUS."""
    out = _on_small_shm(BACKING_FAILS_SCRIPT)
    assert out["fatal"].startswith("this host's /dev/shm has no room for its copy of "
                                   "tensor 'emb' (/dev/shm has no room for segment"), out
    assert "then start shmps-bridge again" in out["fatal"], out
    assert out["stop"] is True and out["hurry"] is True, out
    assert out["pending"] > 0, out   # (its pages still missing)
    assert out["works"] == 1024.0 and out["end"] == [], out


def test_backing_a_segment_later_leaves_a_new_one_under_its_name_alone(store_name):
    """shmps-bridge backs its copies in a thread, after their creation: by then the name
    may hold another, smaller segment (the store destroyed and made anew); backing it
    by name grew that one to the old size, which then failed its size check on attach."""
    from shmps import segment

    name = f"/shmps.{store_name}.backing"
    old = segment.Segment.create(name, 8 << 20, reserve=False)
    ino, size = old.ino, old.size
    old.close()
    segment.unlink(name)
    new = segment.Segment.create(name, 1 << 20, reserve=False)
    try:
        assert segment.allocate(name, size, ino) is False
        assert os.stat("/dev/shm" + name).st_size == 1 << 20
        assert segment.allocate(name, new.size, new.ino) is True
    finally:
        new.close()
        segment.unlink(name)


@pytest.mark.parametrize("make", [lambda: shmps.SGD(lr=-1), lambda: shmps.SGD(lr=float("nan")),
                                  lambda: shmps.Momentum(lr=0.1, momentum=-0.5),
                                  lambda: shmps.Momentum(lr=0.1, nesterov=True, dampening=0.5)],
                         ids=["lr<0", "lr-nan", "momentum<0", "nesterov-dampening"])
def test_bad_optimizer_parameters(make):
    """Updater parameters are validated when the updater is made."""
    with pytest.raises(shmps.InvalidArgument):
        make()


# ---- segments: permissions and corruption --------------------------------------------------

def test_segments_are_mode_0600(store):
    """Every segment of a store (manifest and shards) is created mode 0600."""
    store.dense("a", shape=(10, 2), shard_rows=3)
    store.dense("b", shape=(3,), dtype="int8")
    segs = store_segments(store.name)
    assert len(segs) == 1 + 4 + 1
    for seg in segs:
        mode = stat.S_IMODE(os.stat(os.path.join(SHM, seg)).st_mode)
        assert mode == 0o600, (seg, oct(mode))


@pytest.fixture
def corruptible(store_name):
    """A store with one int32 tensor "x" (pushed once), closed; the test damages a
    segment and attaches again.  Segments are removed without attaching afterwards."""
    s = shmps.attach(store_name)
    t = s.dense("x", shape=(40, 3), dtype="int32", init=1)
    t.push(np.ones((40, 3), np.int32))
    s.close()
    yield store_name, os.path.join(SHM, f"shmps.{store_name}.t0.s0"), \
        os.path.join(SHM, f"shmps.{store_name}.manifest")
    remove_store(store_name)


def open_x(name):
    """Attach and pull tensor x in this process (whatever is damaged)."""
    with shmps.attach(name) as s:
        return s["x"].pull()


def test_intact_store_reads_back(corruptible):
    """Control: the undamaged store reads back what was pushed."""
    name, _, _ = corruptible
    np.testing.assert_array_equal(open_x(name), 2)


@pytest.mark.parametrize("offset,fmt,value", [
    (0, "<Q", 0x0123456789ABCDEF),        # magic
    (8, "<I", 99),                         # version
    (12, "<I", 64),                        # header_size
    (16, "<I", 7),                         # kind
    (20, "<I", 9),                         # dtype
    (24, "<I", 200),                       # updater
    (32, "<Q", 10**9),                     # nrows
    (48, "<Q", 1),                         # nnz
    (176, "<Q", 1 << 40),                  # total_size
    (200, "<Q", 0),                        # value_off
    (248, "<Q", 1 << 50),                  # stripes_off
    (272, "<Q", 10**6),                    # nstripes
], ids=["magic", "version", "header_size", "kind", "dtype", "updater", "nrows", "nnz",
        "total_size", "value_off", "stripes_off", "nstripes"])
def test_corrupt_shard_header(corruptible, offset, fmt, value):
    """Any damaged shard header field (docs/segment-layout.md) is CorruptSegment on open."""
    name, shard, _ = corruptible
    poke(shard, offset, fmt, value)
    with pytest.raises(shmps.CorruptSegment):
        open_x(name)


_PARAM_CASES = [
    (80, -1.0, "lr-negative"),    # lr < 0: out of range (native/layout.c): ascent
    (80, 1e300, "lr-huge"),       # lr in range, not the catalog record's (_check_shards)
    (88, 1.0, "beta1-1"),         # Adam beta1 = 1: out of [0, 1)
    (120, 0.5, "amsgrad-half"),   # amsgrad neither 0 nor 1
]


@pytest.mark.parametrize("kind,offset,value", [
    pytest.param(k, o, v, id=f"{k}-{i}") for k in ("dense", "table", "csr")
    for o, v, i in _PARAM_CASES] + [pytest.param("table", 144, 3.0, id="table-init-kind")])
def test_updater_parameters_in_a_header_are_checked_on_attach(store_name, kind, offset, value):
    """A shard header whose optimizer parameters (params[], init[]) are out of range or
    differ from the catalog record is CorruptSegment on open, not silently pushed with."""
    s = shmps.attach(store_name)
    try:
        opt = shmps.Adam(lr=0.01)
        if kind == "dense":
            t = s.dense("x", shape=(4, 4), dtype="float32", init=1.0, optimizer=opt)
        elif kind == "table":
            t = s.table("x", dim=4, capacity=16, shards=1, optimizer=opt)
        else:
            t = s.csr("x", [0, 2, 3], [0, 1, 1], dtype="float32", optimizer=opt)
        path = "/dev/shm" + t._shards[0].seg.name
    finally:
        s.close()
    try:
        poke(path, offset, "<d", value)
        with shmps.attach(store_name) as s2:
            with pytest.raises(shmps.CorruptSegment):
                s2["x"]
    finally:
        remove_store(store_name)


def test_garbage_shard_header(corruptible):
    """A shard whose whole header is random bytes is CorruptSegment."""
    name, shard, _ = corruptible
    poke(shard, 0, "4096s", np.random.default_rng(0).bytes(4096))
    with pytest.raises(shmps.CorruptSegment):
        open_x(name)


@pytest.mark.parametrize("size", [0, 100, 4096, 4100, "grow"])
def test_truncated_or_grown_shard(corruptible, size):
    """A shard segment of the wrong size (empty, short, truncated, grown) is CorruptSegment."""
    name, shard, _ = corruptible
    os.truncate(shard, os.path.getsize(shard) + 4096 if size == "grow" else size)
    with pytest.raises(shmps.CorruptSegment):
        open_x(name)


def test_missing_shard_segment(corruptible):
    """A tensor whose shard segment was removed raises a shmps.Error on open."""
    name, shard, _ = corruptible
    os.unlink(shard)
    with pytest.raises(shmps.Error):
        open_x(name)


def test_corrupt_manifest_header(corruptible):
    """A manifest whose header is garbage is CorruptSegment on attach (create or not),
    whose hint names the gc that removes it: `shmps-tool gc` skips a store whose
    manifest it cannot read unless --corrupt, and destroy() needs an attached store.
    (The hint said "remove it with `shmps-tool gc` or store.destroy()": neither did.)"""
    name, _, manifest = corruptible
    poke(manifest, 0, "16s", b"garbage!garbage!")
    with pytest.raises(shmps.CorruptSegment) as info:
        shmps.attach(name)
    assert "shmps-tool gc --corrupt" in info.value.hint, info.value.hint
    with pytest.raises(shmps.CorruptSegment):
        shmps.attach(name, create=False)


PID_NS_OFF = 408   # manifest header: pid_ns (docs/segment-layout.md)


def test_a_manifest_claimed_in_another_pid_namespace_is_worded_as_attach_words_it(
        store, tmp_path, monkeypatch):
    """The C refusal of a manifest claimed in another PID namespace (SHMPS_E_PIDNS,
    through _native.check: here restore --force's new manifest, claimed there between
    its creation and its initialisation, as a restorer of another namespace with this
    pid would) says what attach says of such a store, with attach's fix, bar the two
    namespaces check has not read; the old store is given back.  (check had its own
    shorter wording.)"""
    import re

    import shmps.store as st

    from helpers import OTHER_PID_NS_FIX

    lib = shmps._native.lib
    ours = int(lib.shmps_self_pid_ns())
    if ours == 0:
        pytest.skip("/proc/self/ns/pid unreadable: C claims no PID namespace")
    store.dense("w", shape=(3,), init=1.0)
    store.checkpoint(tmp_path / "ck")
    store["w"].push(np.full(3, 4.0, np.float32))
    # attach's words: the store's own manifest marked another namespace's for a moment
    pid_ns = store._manifest.array(np.uint64, PID_NS_OFF, 1)
    pid_ns[0] = ours ^ 1
    try:
        with pytest.raises(shmps.InvalidArgument) as attach_refused:
            shmps.attach(store.name)
    finally:
        pid_ns[0] = ours
    del pid_ns
    real = st.Segment.open_or_create

    def claimed_elsewhere(name: str, *a, **k):
        seg, created = real(name, *a, **k)
        if ".restore-" in name:
            seg.array(np.uint64, PID_NS_OFF, 1)[0] = ours ^ 1
        return seg, created

    monkeypatch.setattr(st.Segment, "open_or_create", claimed_elsewhere)
    with pytest.raises(shmps.InvalidArgument) as refused:
        shmps.restore(tmp_path / "ck", store.name, force=True)
    monkeypatch.undo()
    told = str(refused.value)
    subject = re.match(re.escape(f"store {store.name!r} new manifest ") + r"\S+\.restore-\d+",
                       told)
    assert subject, told
    said = str(attach_refused.value)
    assert said.startswith(f"store {store.name!r} was made (or is being made) in another "
                           "PID namespace (pid:["), said
    want = re.sub(r" \(pid:\[\d+\]; this process is in pid:\[\d+\]\)", "", said, count=1)
    assert told == subject.group() + want[len(f"store {store.name!r}"):]
    assert told.endswith(f" ({OTHER_PID_NS_FIX['attach']})")
    assert (store["w"].pull() == 5.0).all()
    assert not [n for n in os.listdir(SHM) if ".restore-" in n]


def test_foreign_manifest_of_wrong_size(store_name):
    """A foreign segment under the manifest's name, of the wrong size, is CorruptSegment."""
    path = os.path.join(SHM, f"shmps.{store_name}.manifest")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, b"not a shmps manifest\n" * 100)
        os.close(fd)
        with pytest.raises(shmps.CorruptSegment, match="size"):
            shmps.attach(store_name)
    finally:
        remove_store(store_name)


def test_foreign_manifest_of_right_size(store_name):
    """A foreign segment of the manifest's exact size holding random bytes is CorruptSegment."""
    path = os.path.join(SHM, f"shmps.{store_name}.manifest")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, np.random.default_rng(1).bytes(4096))
        os.ftruncate(fd, shmps.store.MANIFEST_SIZE)
        os.close(fd)
        with pytest.raises(shmps.CorruptSegment):
            shmps.attach(store_name)
    finally:
        remove_store(store_name)


CATALOG = 1 << 20  # docs/segment-layout.md: the manifest's catalog


def _rewrite_record(manifest, edit):
    """Replace the first catalog record by ``edit(record)``, padded to its length."""
    (ln,) = peek(manifest, CATALOG, "<I")
    rec = json.loads(peek(manifest, CATALOG + 4, f"{ln}s")[0])
    data = edit(rec)
    data = data if isinstance(data, bytes) else json.dumps(data, separators=(",", ":")).encode()
    assert len(data) <= ln
    poke(manifest, CATALOG + 4, f"{ln}s", data.ljust(ln))


@pytest.mark.parametrize("edit", [
    lambda r: b"{not json",
    lambda r: {"a": 1},
    lambda r: [1, 2],
    lambda r: dict(r, kind="blob"),
    lambda r: dict(r, dtype="int8"),
    lambda r: dict(r, dtype="bool"),
    lambda r: dict(r, shape=[10, 3]),       # fewer rows than the segment holds
    lambda r: dict(r, shape=[80, 3]),       # more rows than the segment holds
    lambda r: dict(r, shape=[40, 1]),
    lambda r: dict(r, shard_rows=7),
    lambda r: dict(r, nshards=2),
    lambda r: dict(r, optimizer={"type": "Max"}),
    lambda r: dict(r, shape="oops"),
], ids=["not-json", "no-fields", "not-object", "kind", "dtype", "bad-dtype", "fewer-rows",
        "more-rows", "row-len", "shard_rows", "nshards", "optimizer", "shape-type"])
def test_corrupt_catalog_record(corruptible, edit):
    """A bad or inconsistent catalog record is a shmps.Error on open: no crash, no wild copy."""
    name, _, manifest = corruptible
    _rewrite_record(manifest, edit)
    with pytest.raises(shmps.Error):
        open_x(name)


def test_catalog_record_overrunning(corruptible):
    """A catalog record length past the catalog's end is CorruptSegment."""
    name, _, manifest = corruptible
    poke(manifest, CATALOG, "<I", 0xFFFF)
    with pytest.raises(shmps.CorruptSegment, match="overruns"):
        shmps.attach(name)


# ---- closed stores and tensors -----------------------------------------------------------------

def test_closed_store_raises_closed(store_name):
    """After close(), the store and its tensors raise Closed (a ValueError)."""
    s = shmps.attach(store_name)
    try:
        t = s.dense("w", shape=(10, 2), shard_rows=3)
        u = s.dense("u", shape=(2,))
        s.close()
        s.close()  # idempotent
        for call in (lambda: s["w"], lambda: s.dense("w"), lambda: s.tensors(),
                     lambda: "w" in s, lambda: t.pull(), lambda: u.pull(),
                     lambda: t.push(np.ones((10, 2))), lambda: u.push(np.ones(2)),
                     lambda: t.pull(rows=[1]), lambda: t.view(), lambda: t.stats(),
                     lambda: s.processes()):
            with pytest.raises(shmps.Closed):
                call()
    finally:
        remove_store(store_name)


# ---- a header written after attach (review 13, finding 2) --------------------------------

def _header_written_after_attach(name: str, tensor: str, offset: int, fmt: str,
                                 value: int) -> str:
    """In a forked child: attach, open ``tensor``, write ``value`` into its shard 0's
    header (another writer of the segment), then push and pull.  Returns the child's
    report ("ok", "typed <Error>" or "wrong ...") or "signal <name>" / "hang"."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(r)
        msg = "?"
        try:
            s = shmps.attach(name)
            t = s[tensor]
            path = SHM + t._shards[0].seg.name
            try:
                if tensor == "d":
                    before = t.pull()
                    poke(path, offset, fmt, value)
                    g = np.ones(t.shape, np.float32)
                    t.push(g)                                         # whole, split by shard
                    t.push(np.ones((2, 64), np.float32), rows=[1, 40])  # rows
                    want = before + g
                    want[[1, 40]] += 1
                    got, got2 = t.pull(), t.pull(consistent=False)
                    rows = t.pull(rows=[40, 1, 3])
                    ok = (np.array_equal(got, want) and np.array_equal(got2, want)
                          and np.array_equal(rows, want[[40, 1, 3]]))
                else:
                    keys = np.arange(5, dtype=np.uint64)     # 0..2 exist, 3, 4 are new
                    before = t.pull(keys[:3])
                    poke(path, offset, fmt, value)
                    t.push(keys, np.ones((5, 8), np.float32))
                    got = t.pull(keys)
                    ok = (np.array_equal(got[:3], before + 1)
                          and np.array_equal(got[3:], np.ones((2, 8), np.float32)))
                msg = "ok" if ok else "wrong values"
            except shmps.Error as e:
                msg = f"typed {type(e).__name__}"
            s.close()
        except BaseException as e:  # noqa: BLE001 - reported, not raised in the child
            msg = f"wrong {e!r}"[:200]
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + 15
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return "hang"
        time.sleep(0.01)
    out = os.read(r, 4096).decode()
    os.close(r)
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return out


@pytest.fixture
def written_after_attach(store_name):
    """A store with a float32 dense tensor "d" (64 x 64, 2 shards, Sum), a float32 table
    "t" (dim 8, 1 shard) holding keys 0..2, and an int32 tensor "other" to check for
    damage.  Removed without attaching afterwards."""
    s = shmps.attach(store_name)
    s.dense("d", shape=(64, 64), dtype="float32", shard_rows=32,
            init=np.arange(64 * 64, dtype=np.float32).reshape(64, 64))
    s.table("t", dim=8, dtype="float32", capacity=64, shards=1).push(
        np.arange(3, dtype=np.uint64), np.full((3, 8), 2, np.float32))
    s.dense("other", shape=(16, 8), dtype="int32", init=7)
    paths = {k: SHM + s[k]._shards[0].seg.name for k in ("d", "t")}
    s.close()
    yield store_name, paths
    remove_store(store_name)


@pytest.mark.parametrize("tensor,offset,fmt,value", [
    ("d", 296, "<I", 9),           # itemsize 4 -> 9: pull copied 2.25x its output
    ("d", 20, "<I", 5),            # dtype float32 -> float64 (derived fields left)
    ("d", 40, "<Q", 1 << 20),      # row_len
    ("d", 48, "<Q", 1 << 40),      # nnz
    ("d", 200, "<Q", 1 << 40),     # value_off
    ("d", 248, "<Q", 1 << 50),     # stripes_off
    ("d", 272, "<Q", 0),           # nstripes
    ("d", 280, "<Q", 0),           # stripe_elems: SIGFPE, or a push applying nothing
    ("d", 28, "<I", 1),            # flags: hogwild
    ("t", 40, "<Q", 1 << 30),      # row_len (rowbytes = row_len * itemsize)
    ("t", 296, "<I", 9),           # itemsize
    ("t", 192, "<Q", 1),           # colidx_off (the keys)
    ("t", 256, "<Q", 1 << 40),     # index_off
    ("t", 264, "<Q", 3),           # nslots
    ("t", 32, "<Q", 1 << 40),      # nrows
], ids=["d-itemsize", "d-dtype", "d-row_len", "d-nnz", "d-value_off", "d-stripes_off",
        "d-nstripes", "d-stripe_elems", "d-flags", "t-row_len", "t-itemsize", "t-colidx_off",
        "t-index_off", "t-nslots", "t-nrows"])
def test_a_header_written_after_attach_is_not_read(written_after_attach, tensor, offset,
                                                   fmt, value):
    """A shard header changed after attach neither crashes nor misleads the process that
    has it open (C keeps the spec validated at attach: docs/segment-layout.md), and
    damages nothing else: the other tensor and the catalog read back in a new process."""
    name, paths = written_after_attach
    original = peek(paths[tensor], offset, fmt)
    got = _header_written_after_attach(name, tensor, offset, fmt, value)
    assert got == "ok" or got.startswith("typed "), got
    poke(paths[tensor], offset, fmt, *original)  # what was written on purpose, put back
    with shmps.attach(name) as s:
        assert {d["name"] for d in s.tensors()} >= {"d", "t", "other"}
        np.testing.assert_array_equal(s["other"].pull(), 7)
        s[tensor]  # the shard header is whole again: attach validates it


def test_private_specs_follow_init_validate_and_close():
    """C keeps each shard's spec from init/validate until the mapping is closed: a
    validation finding another header keeps it, calls on a mapping it forgot are
    InvalidArgument; hundreds of mappings, forgotten in any order, keep the rest."""
    import mmap
    import random

    from shmps import _native
    from shmps._shmps_native import ffi, lib
    from shmps.segment import Segment

    lay = _native.layout({"kind": lib.SHMPS_DENSE, "dtype": lib.SHMPS_FLOAT32,
                          "updater": lib.SHMPS_SUM, "flags": lib.SHMPS_F_IMPLICIT, "nrows": 4,
                          "row_len": 4, "nnz": 16})
    out = np.empty(16, np.float32)

    def pull(seg):
        return lib.shmps_dense_pull_all(seg.ptr, _native.token(), ffi.from_buffer(out), 0)

    segs = [Segment(f"(spec {i})", mmap.mmap(-1, lay["total_size"]), lay["total_size"])
            for i in range(300)]
    try:
        for seg in segs:
            _native.shard_init(seg.ptr, seg.size, dict(lay, params=[0.0] * 8, init=[0.0] * 4))
        assert all(pull(seg) == lib.SHMPS_OK for seg in segs)
        gone = set(random.Random(1).sample(range(300), 150))
        for i in gone:
            _native.forget(segs[i].ptr)
        assert [pull(seg) for seg in segs] == [
            lib.SHMPS_E_ARG if i in gone else lib.SHMPS_OK for i in range(300)]
        seg = segs[min(gone)]
        _native.shard_validate(seg.ptr, seg.size, seg.name)  # validated: kept again
        assert pull(seg) == lib.SHMPS_OK
        seg.mm[0:8] = b"\0" * 8                              # a bad magic
        with pytest.raises(shmps.CorruptSegment):
            _native.shard_validate(seg.ptr, seg.size, seg.name)
        assert pull(seg) == lib.SHMPS_OK                     # the attach-time spec stays
        seg = segs[min(set(range(300)) - gone)]
        seg.mm[56:64] = (5).to_bytes(8, "little")    # row_begin: valid, but not the same
        with pytest.raises(shmps.CorruptSegment):
            _native.shard_validate(seg.ptr, seg.size, seg.name)
        assert pull(seg) == lib.SHMPS_OK
    finally:
        for seg in segs:
            seg.close()


def test_an_error_told_outside_python_drops_only_the_docstring_hint():
    """Error.told: for a command line or an HTTP client, InvalidArgument's default hint
    (a docstring they do not have) gives way to the one given (or none); any other hint
    stays, so shmps-tool, shmps-bridge and the bridge's answers say what to do."""
    plain = shmps.InvalidArgument("bad value")
    assert str(plain) == "bad value (check the argument against the docstring)"
    assert plain.told("see shmps-tool --help") == "bad value (see shmps-tool --help)"
    assert plain.told(None) == "bad value"
    own = shmps.InvalidArgument("bad value", "pass 3")
    assert own.told("see --help") == own.told(None) == "bad value (pass 3)"
    schema = shmps.SchemaError("wrong shape")            # a subclass with its own hint
    assert schema.told(None) == str(schema) and "docstring" not in str(schema)


@pytest.mark.parametrize("ident", [b"\0\0\0\0", b"zz", b"a/b"],
                         ids=["nul", "another-store", "slash"])
def test_ls_of_a_manifest_whose_ident_is_damaged(store_name, ident):
    """A manifest whose ident (offset 68: namespace NUL store) no longer names it is shown
    as unreadable by ls.  A NUL in it crashed `shmps-tool ls` with SIGSEGV: the table fill
    built shard names from the ident and posix_ipc dies on a name holding a NUL; another
    valid name made this manifest speak for that store's segments."""
    import subprocess
    import sys
    from helpers import child_env

    ns = store_name
    s = shmps.attach(store_name, namespace=ns)
    s.table("emb", dim=2, capacity=8).push(np.arange(3, dtype=np.uint64), np.ones((3, 2)))
    s.close()
    manifest = os.path.join(SHM, f"shmps.{ns}.{store_name}.manifest")
    try:
        poke(manifest, 68 + len(ns) + 2, f"{len(ident)}s", ident)
        r = subprocess.run([sys.executable, "-m", "shmps.cli", "ls", "--namespace", ns],
                           env=child_env(), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (r.returncode, r.stderr)
        assert "unreadable: manifest" in r.stdout and "its ident names store" in r.stdout
        assert "Traceback" not in r.stderr
    finally:
        remove_store(store_name, ns)


def refused_by_attach_and_ls(store_name: str, words: str) -> None:
    """attach(create=False) raises CorruptSegment saying ``words``, and `shmps-tool ls
    --json` (a subprocess) lists the store with an error saying them."""
    import subprocess
    import sys
    from helpers import child_env

    with pytest.raises(shmps.CorruptSegment, match=words):
        shmps.attach(store_name, create=False)
    r = subprocess.run([sys.executable, "-m", "shmps.cli", "ls", "--json"],
                       env=child_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr)
    mine = [x for x in json.loads(r.stdout)["stores"] if x["store"] == store_name]
    assert mine and words in (mine[0].get("error") or ""), mine


@pytest.mark.parametrize("body", [b"[1]", b"7", b'{"kind": "dense"}', b"[" * 5000, b"TABLE"],
                         ids=["list", "number", "no-name", "nested", "nshards"])
def test_ls_and_attach_of_a_damaged_catalog_record(store_name, body):
    """A catalog record (manifest offset 1 MiB: uint32 length + JSON) that is JSON but not
    a record, or nested past json's recursion limit, is CorruptSegment for attach and
    `unreadable` for ls.  ls did not check records as attach does: an internal
    AttributeError / KeyError (exit 1); a nested one was a RecursionError for both."""
    s = shmps.attach(store_name)
    if body == b"TABLE":   # a table's shard count beyond any table's: ls opened 10**12
        s.table("t", dim=2, capacity=64)      # shard names, for good (review 21 F11)
        body = json.dumps({**s._record("t"), "nshards": 10**12}).encode()
    else:
        s.dense("d", shape=(4,))
    s.close()
    manifest = os.path.join(SHM, f"shmps.{store_name}.manifest")
    try:
        (ln,) = peek(manifest, 1 << 20, "<I")
        if len(body) > ln:   # one record, grown to hold the body (the catalog's length too)
            poke(manifest, 1 << 20, "<I", len(body))
            poke(manifest, 40, "<Q", len(body) + 4)
        poke(manifest, (1 << 20) + 4, f"{max(ln, len(body))}s", body.ljust(ln))
        refused_by_attach_and_ls(store_name, "catalog record at 0")
    finally:
        remove_store(store_name)


@pytest.mark.parametrize("generation_too", [False, True], ids=["state", "state-generation"])
def test_a_store_whose_state_word_is_damaged_to_0_is_not_initialised_again(store_name,
                                                                          generation_too):
    """A ready store's manifest whose state word (offset 32) reads 0, 'being created',
    with its creator dead: attach took the initialisation over and wiped the catalog, so
    attach(create=False) returned an empty store, the tensor's values were lost and a
    get-or-create made a new empty tensor over its segment; `shmps-tool gc` removed it
    as a creation cut off.  A manifest with a catalog was READY once: CorruptSegment for
    attach, unreadable for ls, and gc leaves it (without --corrupt)."""
    import subprocess
    import sys
    from helpers import child_env

    ns = store_name
    subprocess.run([sys.executable, "-c",
                    "import sys, numpy as np, shmps\n"
                    "s = shmps.attach(sys.argv[1], namespace=sys.argv[1])\n"
                    "s.dense('d', shape=(4,)).push(np.full(4, 5.0))\n"
                    "s.close()\n", store_name],
                   env=child_env(), check=True, timeout=60)   # its creator is dead now
    manifest = os.path.join(SHM, f"shmps.{ns}.{store_name}.manifest")
    try:
        poke(manifest, 32, "<I", 0)
        if generation_too:   # (ls and gc looked at the generation only: review 22 F5)
            (generation,) = peek(manifest, 48, "<Q")
            poke(manifest, 48, "<Q", 0)
        for create in (False, True):
            with pytest.raises(shmps.CorruptSegment):
                shmps.attach(store_name, namespace=ns, create=create, timeout=1)
        env = child_env(SHMPS_GC_MIN_AGE="0")
        for verb in ("ls", "gc"):
            r = subprocess.run([sys.executable, "-m", "shmps.cli", verb, "--namespace", ns],
                               env=env, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, (verb, r.returncode, r.stderr)
            assert "it has a catalog" in r.stdout + r.stderr, (verb, r.stdout, r.stderr)
        assert os.path.exists(manifest) and len(store_segments(store_name, ns)) == 2
        poke(manifest, 32, "<I", 1)   # READY again: the store as it was
        if generation_too:
            poke(manifest, 48, "<Q", generation)
        s = shmps.attach(store_name, namespace=ns, create=False)
        assert s["d"].pull().tolist() == [5.0] * 4
        s.close()
    finally:
        remove_store(store_name, ns)


@pytest.mark.parametrize("word", [0xFFFFFFFF, 0x40000000, 2])
def test_a_damaged_forwarding_switch_is_corrupt_not_pushes_into_a_new_outbox(store_name, word):
    """The manifest's forwarding switch (offset 276, uint32) is 0 or 1 (shmps-bridge sets
    it); a damaged value was taken as "forwarding on": every push was summed into a new
    hidden tensor `d#outbox` that no bridge drains, and pull never saw it (the previous
    fuzzing pass's tensors t3..t5 that no one created).  Attach now refuses it, and ls
    shows the store unreadable."""
    import subprocess
    import sys
    from helpers import child_env

    s = shmps.attach(store_name)
    s.dense("d", shape=(4,))
    s.close()
    manifest = os.path.join(SHM, f"shmps.{store_name}.manifest")
    try:
        poke(manifest, 276, "<I", word)
        with pytest.raises(shmps.CorruptSegment):
            shmps.attach(store_name, create=False, timeout=1)
        r = subprocess.run([sys.executable, "-m", "shmps.cli", "ls", "--json"],
                           env=child_env(), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (r.returncode, r.stderr)
        mine = [x for x in json.loads(r.stdout)["stores"] if x["store"] == store_name]
        assert mine and mine[0].get("error"), mine
        poke(manifest, 276, "<I", 0)
        s = shmps.attach(store_name, create=False)
        s["d"].push(np.ones(4))
        assert s["d"].pull().tolist() == [1.0] * 4
        assert [t["name"] for t in s.tensors()] == ["d"]
        s.close()
    finally:
        remove_store(store_name)


@pytest.mark.parametrize("damage", ["empty", "one-record", "generation"])
def test_a_catalog_shorter_than_its_generation_is_corrupt(store_name, damage):
    """The catalog is append-only and each append bumps the generation (offset 48) once:
    a length word (offset 40) damaged to 0, or to the end of an earlier record, made
    attach see fewer tensors, and a get-or-create of a hidden one made a new, empty tensor
    (the values of 'd' read 0 instead of 5).  Fewer records than the generation counts is
    CorruptSegment for attach and unreadable for ls."""
    s = shmps.attach(store_name)
    s.dense("d", shape=(4,)).push(np.full(4, 5.0))
    s.dense("e", shape=(2,))
    s.close()
    manifest = os.path.join(SHM, f"shmps.{store_name}.manifest")
    try:
        (length,) = peek(manifest, 40, "<Q")
        (first,) = peek(manifest, 1 << 20, "<I")
        if damage == "empty":
            poke(manifest, 40, "<Q", 0)
        elif damage == "one-record":
            poke(manifest, 40, "<Q", 4 + first)
        else:
            poke(manifest, 48, "<Q", 3)
        refused_by_attach_and_ls(store_name, "were appended")
        poke(manifest, 40, "<Q", length)
        poke(manifest, 48, "<Q", 2)
        s = shmps.attach(store_name, create=False)
        assert sorted(s) == ["d", "e"] and s["d"].pull().tolist() == [5.0] * 4
        s.close()
    finally:
        remove_store(store_name)


# ---- hints that fit the mistake ------------------------------------------------------

#: the hints of a mismatch with an existing tensor and of "read the docstring": right for
#: those, but the caller of the calls below made another mistake, which its hint names
GENERIC_HINTS = (shmps.SchemaError.hint, shmps.InvalidArgument.hint)


@pytest.mark.parametrize("call", [
    lambda s: s.dense("d", shape=(-1, 2)),
    lambda s: s.dense("d", shape=(1,) * 9),
    lambda s: s.dense("d", shape=(2, 2), init=np.ones(3)),
    lambda s: s.csr("c", [0, 1], [0], shape=(1, 2, 3)),
    lambda s: s.csr("c", [0, 1], [0], shape=(2, 2)),
    lambda s: s.csr("c", [[0, 1]], [0]),
    lambda s: s.csr("c", [0.0, 1.0], [0]),
    lambda s: s.csr("c", [], []),
], ids=["negative-dim", "nine-dims", "init-shape", "csr-3d-shape", "csr-shape-rows",
        "csr-2d-rowcnt", "csr-float-rowcnt", "csr-empty-rowcnt"])
def test_a_bad_creation_argument_gets_a_hint_about_it(store, call):
    """A creation argument that is wrong in itself gets a hint saying how to give it, not
    the hint of a mismatch with an existing tensor ("pass the same shape/dtype/optimizer
    as the tensor's creator, or use a new name": there is none) or "check the argument
    against the docstring".  Nothing is created."""
    with pytest.raises(shmps.InvalidArgument) as info:
        call(store)
    assert info.value.hint and info.value.hint not in GENERIC_HINTS, str(info.value)
    assert store.tensors() == []


def test_a_bad_gradient_gets_a_hint_about_it(store):
    """The same for pushes: a table's grads of the wrong shape, a csr push whose value is
    not 1-d or not one per entry; the tensors are unchanged."""
    emb = store.table("emb", dim=4, capacity=8, init=1.0)
    m = store.csr("m", [0, 2, 3], [0, 2, 1], init=1.0)
    rows, before = emb.pull([1, 2]), m.pull().value
    for tensor, call in [
            (emb, lambda: emb.push([1, 2], np.ones((2, 3)))),
            (emb, lambda: emb.push([1, 2], np.ones(8))),
            (m, lambda: m.push(shmps.CSR(np.array([0, 2, 3]), np.array([0, 2, 1]),
                                         np.ones((3, 1))))),
            (m, lambda: m.push(shmps.CSR(np.array([0, 2, 3]), np.array([0, 2, 1]),
                                         np.ones(2))))]:
        with pytest.raises(shmps.InvalidArgument) as info:
            call()
        assert info.value.hint and info.value.hint not in GENERIC_HINTS, str(info.value)
    np.testing.assert_array_equal(emb.pull([1, 2]), rows)
    np.testing.assert_array_equal(m.pull().value, before)


# ---- arrays numpy cannot make --------------------------------------------------------

class _NoArray:
    """What numpy reads through ``__array__`` and cannot convert: a torch tensor that
    requires grad raises RuntimeError there, one of bfloat16 TypeError (no torch needed
    for the test: the same protocol)."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def __array__(self, dtype=None, copy=None):
        raise self.exc

    def __len__(self) -> int:
        return 2


NO_ARRAYS = [pytest.param([[1.0, 2.0, 3.0, 4.0], [5.0]], id="ragged"),
             pytest.param(_NoArray(RuntimeError("Can't call numpy() on Tensor that requires "
                                                "grad. Use tensor.detach().numpy() instead.")),
                          id="requires-grad"),
             pytest.param(_NoArray(TypeError("Got unsupported ScalarType BFloat16")),
                          id="bfloat16")]


@pytest.mark.parametrize("bad", NO_ARRAYS)
def test_an_input_numpy_cannot_make_an_array_of_is_a_schema_error(store, w, bad):
    """A gradient, init, rows, keys or csr structure numpy cannot read as an array (a
    ragged list; a torch tensor that requires grad, or of bfloat16) is a SchemaError
    (rows: OutOfRange, as every malformed rows=) saying what to pass, and changes
    nothing.  They escaped as numpy's or torch's own ValueError, RuntimeError or
    TypeError, no shmps.Error and no hint ("Can't call numpy() on Tensor that requires
    grad", "setting an array element with a sequence")."""
    t = store.table("t", dim=2, capacity=8)
    t.push([1], np.ones((1, 2)))
    c = store.csr("c", [0, 1, 2], [0, 1], init=1.0)
    for call, exc in [(lambda: w.push(bad), shmps.SchemaError),
                      (lambda: w.push(bad, rows=[0, 1]), shmps.SchemaError),
                      (lambda: w.push(np.ones((2, 4)), rows=bad), shmps.OutOfRange),
                      (lambda: w.pull(rows=bad), shmps.OutOfRange),
                      (lambda: t.push([1, 2], bad), shmps.SchemaError),
                      (lambda: t.push(bad, np.ones((2, 2))), shmps.SchemaError),
                      (lambda: t.pull(bad), shmps.SchemaError),
                      (lambda: c.push(shmps.CSR([0, 1, 2], [0, 1], bad)), shmps.SchemaError),
                      (lambda: c.push(shmps.CSR(bad, [0, 1], [1.0, 1.0])), shmps.SchemaError)]:
        err = rejected(w, exc, call, match="cannot be read as an array")
        assert "numpy" in err.hint
    assert len(t) == 1 and t.pull([1]).tolist() == [[1.0, 1.0]]
    assert c.pull().value.tolist() == [1.0, 1.0]
    for name, kw in [("d", {"shape": (2, 4)}), ("c2", {})]:
        with pytest.raises(shmps.SchemaError, match="cannot be read as an array"):
            if name == "d":
                store.dense(name, init=bad, **kw)
            else:
                store.csr(name, [0, 1, 2], [0, 1], init=bad)
        assert name not in store
    with pytest.raises(shmps.SchemaError, match="cannot be read as an array"):
        store.dense("w", init=bad)   # an existing tensor's init is checked too
