"""Every updater on dense tensors, tables and csr tensors against the float64 reference
written from docs/updaters.md (tests/reference.py), and against torch.optim where torch
is installed: several pushes with duplicate rows, keys and entries each."""
from __future__ import annotations

import numpy as np
import pytest

import shmps
from reference import RefCSR, RefDense, RefTable, init_row, key_hash, key_shard

pytestmark = pytest.mark.timeout(120)

UPDATERS = {
    "sum": shmps.Sum(),
    "assign": shmps.Assign(),
    "max": shmps.Max(),
    "min": shmps.Min(),
    "sgd": shmps.SGD(lr=0.1),
    "sgd_wd": shmps.SGD(lr=0.1, weight_decay=0.05),
    "momentum": shmps.Momentum(lr=0.1, momentum=0.9),
    "momentum_damp_wd": shmps.Momentum(lr=0.05, momentum=0.8, dampening=0.3,
                                       weight_decay=0.01),
    "nesterov": shmps.Momentum(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.02),
    "adagrad": shmps.Adagrad(lr=0.1),
    "adagrad_full": shmps.Adagrad(lr=0.1, lr_decay=0.05, weight_decay=0.01,
                                  initial_accumulator_value=0.1, eps=1e-8),
    "adam": shmps.Adam(lr=0.01),
    "adam_full": shmps.Adam(lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01,
                            amsgrad=True),
    "ftrl": shmps.FTRL(alpha=0.5, beta=1.0, l1=0.05, l2=0.1),
}
TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "float64": dict(rtol=1e-10, atol=1e-12)}
NPUSH = 5


def close(got, want, dtype, what=""):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, err_msg=what, **TOL[dtype])


# ---- reference -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(UPDATERS))
def test_dense_matches_reference(store, name, dtype):
    """Dense: whole and rows= pushes (repeated rows) give the reference's values."""
    opt = UPDATERS[name]
    rng = np.random.default_rng(1)
    init = rng.normal(size=(8, 5))
    t = store.dense("w", shape=(8, 5), dtype=dtype, init=init, optimizer=opt)
    ref = RefDense(opt, init.astype(dtype))
    for k in range(NPUSH):
        if k % 2 == 0:
            g = rng.normal(size=(8, 5)).astype(dtype)
            t.push(g)
            ref.push(g)
        else:
            rows = np.array([1, 6, 1, 3, 1])
            g = rng.normal(size=(5, 5)).astype(dtype)
            t.push(g, rows=rows)
            ref.push(g, rows=rows)
        close(t.pull(), ref.w, dtype, f"{name} after push {k}")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(UPDATERS))
def test_table_matches_reference(store, name, dtype):
    """Table: per-row steps, duplicate keys (summed or sequential), rows created on
    first touch from their init, over several pushes give the reference's rows."""
    opt = UPDATERS[name]
    dim, seed, init = 5, 3, ("uniform", -1.0, 1.0)
    t = store.table("emb", dim=dim, dtype=dtype, capacity=64, optimizer=opt, init=init,
                    seed=seed, shards=3)
    first = {}

    def initial(key):
        if key not in first:
            first[key] = shmps.table.init_values(init, seed, [key], dim, dtype)[0]
        return first[key].astype(np.float64)

    ref = RefTable(opt, dim, initial)
    rng = np.random.default_rng(2)
    universe = np.array([0, 1, 7, 2**64 - 1, 12345678901234567890, 42], np.uint64)
    for k in range(NPUSH):
        keys = rng.choice(universe, size=7)
        keys[3] = keys[0]  # a duplicate in every push
        g = rng.normal(size=(7, dim)).astype(dtype)
        t.push(keys, g)
        ref.push(keys, g)
        close(t.pull(universe[:4], create=False), ref.pull(universe[:4], create=False),
              dtype, f"{name} after push {k}")
    everything = np.array(sorted(ref.rows), np.uint64)
    close(t.pull(everything), ref.pull(everything), dtype, name)
    stats = t.row_stats(everything)
    assert stats["pushes"].tolist() == [ref.pushes[int(k)] for k in everything]
    assert stats["last_push_step"].tolist() == [ref.last[int(k)] for k in everything]
    t.check()


def _structure(rng, nrows=6, ncols=9, density=0.5):
    mask = rng.random((nrows, ncols)) < density
    mask[:, 0] = True
    rowcnt = np.concatenate([[0], np.cumsum(mask.sum(axis=1))])
    return rowcnt, np.nonzero(mask)[1], mask


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(UPDATERS))
def test_csr_matches_reference(store, name, dtype):
    """CSR: pushes listing some entries of some rows (repeated and unsorted columns
    included) update exactly those entries, with per-row steps, as the reference does."""
    opt = UPDATERS[name]
    rng = np.random.default_rng(3)
    rowcnt, colidx, mask = _structure(rng)
    init = rng.normal(size=colidx.size)
    m = store.csr("X", rowcnt, colidx, dtype=dtype, init=init, optimizer=opt, shard_rows=4)
    ref = RefCSR(opt, rowcnt, colidx, init.astype(dtype))
    for k in range(NPUSH):
        rows_cols = []
        for r in range(len(rowcnt) - 1):
            cols = colidx[rowcnt[r]:rowcnt[r + 1]]
            if r == k % 6:
                continue  # one row untouched by each push
            pick = list(rng.choice(cols, size=min(3, cols.size), replace=False))
            if r == 2:
                pick = pick[::-1] + [pick[0]]  # unsorted, with a repeat
            rows_cols.append((r, pick))
        rc = np.zeros(len(rowcnt), np.int64)
        ci = []
        for r, pick in rows_cols:
            rc[r + 1] = len(pick)
            ci += pick
        rc = np.cumsum(rc)
        g = rng.normal(size=len(ci)).astype(dtype)
        m.push(shmps.CSR(rc, np.array(ci), g))
        ref.push(rc, np.array(ci), g)
        got = m.pull()
        close(got.value, ref.w, dtype, f"{name} after push {k}")
        np.testing.assert_array_equal(got.rowcnt, rowcnt)
        np.testing.assert_array_equal(got.colidx, colidx)


def test_float16_computes_in_float32(store):
    """float16 tables compute in float32 and round once per push (Adam)."""
    opt = shmps.Adam(lr=0.01)
    t = store.table("h", dim=4, dtype="float16", capacity=8, optimizer=opt, init=0.5)
    ref = RefTable(opt, 4, lambda k: np.full(4, 0.5))
    rng = np.random.default_rng(4)
    for _ in range(3):
        g = rng.normal(size=(2, 4)).astype(np.float32)
        t.push([1, 2], g)
        ref.push([1, 2], g)
    np.testing.assert_allclose(t.pull([1, 2]).astype(np.float64), ref.pull([1, 2]),
                               rtol=2e-3, atol=2e-3)


def test_ftrl_l1_gives_exact_zeros(store):
    """FTRL: coordinates whose |z| stays within l1 are exactly 0 (sparsity)."""
    t = store.dense("w", shape=(4,), dtype="float32", optimizer=shmps.FTRL(l1=10.0))
    t.push(np.array([0.1, -0.2, 30.0, -40.0], np.float32))
    w = t.pull()
    assert w[0] == 0 and w[1] == 0 and w[2] < 0 and w[3] > 0


# ---- constructor arguments -------------------------------------------------------------------

FLOAT_ARGS = {
    shmps.SGD: ("lr", "weight_decay"),
    shmps.Momentum: ("lr", "momentum", "dampening", "weight_decay"),
    shmps.Adagrad: ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"),
    shmps.Adam: ("lr", "eps", "weight_decay"),
    shmps.FTRL: ("alpha", "beta", "l1", "l2"),
}
BOOL_ARGS = {shmps.Momentum: ("nesterov",), shmps.Adam: ("amsgrad",)}
NEEDS = {shmps.Momentum: dict(momentum=0.9)}


@pytest.mark.parametrize("cls", list(FLOAT_ARGS), ids=lambda c: c.__name__)
def test_updater_arguments_are_checked_and_converted(cls, store):
    """A hyper-parameter of the wrong type is an InvalidArgument naming it, raised by the
    constructor (it was accepted and failed later, at store.dense, with a raw cffi
    TypeError); a number of another type (int, numpy) is stored as a float."""
    for name in FLOAT_ARGS[cls]:
        for bad in ("0.1", [0.1], None, True, 1j, np.array([0.1]), 10**400):
            with pytest.raises(shmps.InvalidArgument, match=f"^{name}="):
                cls(**{name: bad})
        u = cls(**{name: np.float32(0.5) if name != "lr" else 1})
        assert type(getattr(u, name)) is float
    for name in BOOL_ARGS.get(cls, ()):
        for bad in ("yes", 1, 0.0, None):
            with pytest.raises(shmps.InvalidArgument, match=f"^{name}="):
                cls(**{name: bad}, **NEEDS.get(cls, {}))
        u = cls(**{name: np.bool_(True)}, **NEEDS.get(cls, {}))
        assert getattr(u, name) is True
    # what the constructor accepts, store.dense accepts (a record round trip included)
    kw = {name: 1 for name in FLOAT_ARGS[cls] if name not in ("dampening",)}
    u = cls(**kw)
    t = store.dense("w", shape=(2,), dtype="float32", optimizer=u)
    assert t.optimizer == u == shmps.updaters.from_dict(u.to_dict())


@pytest.mark.parametrize("betas", ["ab", 0.9, (0.9,), (0.9, "0.9"), (0.9, None), (0.9, 1.0),
                                   (True, 0.9), (0.9, float("nan"))])
def test_adam_betas_are_checked(betas):
    """betas: two real numbers in [0, 1), else InvalidArgument (not a raw TypeError or
    ValueError from len()/float())."""
    with pytest.raises(shmps.InvalidArgument, match="^betas="):
        shmps.Adam(betas=betas)


# ---- the init generator and the key hash -------------------------------------------------

@pytest.mark.parametrize("init", [("uniform", -0.5, 2.0), ("normal", 0.25, 0.1),
                                  ("constant", 3.0), "zeros"])
def test_init_generator_matches_reference(init):
    """The C generator is splitmix64 + Box-Muller exactly as docs/tables.md writes it."""
    keys = [0, 1, 2**64 - 1, 987654321]
    got = shmps.table.init_values(init, 11, keys, 7, "float64")
    spec = shmps.table.init_spec(init, np.dtype("float64"))
    for i, k in enumerate(keys):
        np.testing.assert_allclose(got[i], init_row(spec, 11, k, 7), rtol=1e-14, atol=1e-15)


def test_key_hash_and_shard_match_reference():
    """Keys hash (splitmix64 of key + golden gamma) and shard (high bits) as documented."""
    keys = [0, 1, 2**63, 2**64 - 1, 5]
    assert shmps.table.key_hash(keys).tolist() == [key_hash(k) for k in keys]
    assert shmps.table.key_shards(keys, 7).tolist() == [key_shard(k, 7) for k in keys]


# ---- torch.optim ----------------------------------------------------------------------------

TORCH = {
    "sgd": ("SGD", dict(lr=0.1)),
    "sgd_wd": ("SGD", dict(lr=0.1, weight_decay=0.05)),
    "momentum": ("SGD", dict(lr=0.1, momentum=0.9)),
    "momentum_damp_wd": ("SGD", dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01)),
    "nesterov": ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.02)),
    "adagrad": ("Adagrad", dict(lr=0.1)),
    "adagrad_full": ("Adagrad", dict(lr=0.1, lr_decay=0.05, weight_decay=0.01,
                                     initial_accumulator_value=0.1, eps=1e-8)),
    "adam": ("Adam", dict(lr=0.01)),
    "adam_full": ("Adam", dict(lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01,
                               amsgrad=True)),
}
TORCH_TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(TORCH))
def test_dense_matches_torch(store, name):
    """Dense whole pushes follow torch.optim step for step (float32)."""
    torch = pytest.importorskip("torch")
    cls, kw = TORCH[name]
    rng = np.random.default_rng(5)
    init = rng.normal(size=(6, 4)).astype(np.float32)
    t = store.dense("w", shape=(6, 4), init=init, optimizer=UPDATERS[name])
    p = torch.nn.Parameter(torch.from_numpy(init.copy()))
    opt = getattr(torch.optim, cls)([p], foreach=False, **kw)
    for _ in range(6):
        g = rng.normal(size=(6, 4)).astype(np.float32)
        t.push(g)
        p.grad = torch.from_numpy(g.copy())
        opt.step()
        np.testing.assert_allclose(t.pull(), p.detach().numpy(), **TORCH_TOL)


@pytest.mark.parametrize("name", list(TORCH))
def test_table_matches_torch_per_row_params(store, name):
    """Tables are lazy per row: each row behaves as its own torch parameter whose grad
    is None when the row is not pushed (duplicate keys' grads summed)."""
    torch = pytest.importorskip("torch")
    cls, kw = TORCH[name]
    rng = np.random.default_rng(6)
    keys_all = np.array([3, 9, 2**64 - 1, 100, 5], np.uint64)
    init = ("normal", 0.0, 0.5)
    t = store.table("emb", dim=4, capacity=16, optimizer=UPDATERS[name], init=init, seed=9,
                    shards=2)
    start = shmps.table.init_values(init, 9, keys_all, 4)
    params = [torch.nn.Parameter(torch.from_numpy(row.copy())) for row in start]
    opt = getattr(torch.optim, cls)(params, foreach=False, **kw)
    for _ in range(8):
        idx = rng.choice(len(keys_all), size=4)
        g = rng.normal(size=(4, 4)).astype(np.float32)
        t.push(keys_all[idx], g)
        for p in params:
            p.grad = None
        for j, i in enumerate(idx):
            gi = torch.from_numpy(g[j].copy())
            params[i].grad = gi if params[i].grad is None else params[i].grad + gi
        opt.step()
        want = np.stack([p.detach().numpy() for p in params])
        np.testing.assert_allclose(t.pull(keys_all), want, **TORCH_TOL)
