"""``bench.py table`` (issue 3): a 1,000,000 x 64 float32 table, batches of 4096 ids.

Ids are zipf(a=1.1) (hashed by a fixed random permutation of the rows, so hot rows are
scattered) or uniform.  Baselines work on a shared ``(rows, 64)`` array with the ids as
direct row indices; shmps gets ``uint64`` keys (the ids times an odd 64-bit constant,
a bijection, so keys look like hashed features) and pays its own hash lookup.
g == 1 and lr == 1, so the exact table is known from the id counts: 'lost' compares the
final values (or Adagrad's sum of squares) with it.
"""
from __future__ import annotations

import importlib.util
from functools import lru_cache
from typing import Any, Optional

import numpy as np

from .context import PROCS, RunContext
from .harness import progress
from .report import Check, Ref, Row, Section, data_sum_of, quotient_of
from .shm import Attached, ShmSpec, create_array, single_threaded_torch
from .tensors import OptimizerSpec, TableSpec, close_quietly

ROWS = 1_000_000
DIM = 64
BATCH = 4096
CAPACITY = 1_100_000
POOL = 64                  # batches generated per worker, cycled through while timing
ZIPF_A = 1.1
PERM_SEED = 20261122
KEY_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd: id -> key is a bijection on uint64
LR = 1.0
EPS = 1e-10
EXACT_F32 = 2**24          # counts at or above this are not exact in float32
DISTS = ("zipf", "uniform")
PREFILL_CHUNK = 65536

ADAGRAD_LR = 0.1
SGD = OptimizerSpec("SGD", {"lr": LR})
ADAGRAD = OptimizerSpec("Adagrad", {"lr": ADAGRAD_LR})


# ---------------------------------------------------------------- ids and keys

@lru_cache(maxsize=1)
def _permutation() -> np.ndarray:
    return np.random.default_rng(PERM_SEED).permutation(ROWS)


def batch_ids(dist: str, rank: int) -> np.ndarray:
    """The (POOL, BATCH) int64 ids worker ``rank`` pushes; deterministic, so the parent
    can recount them."""
    rng = np.random.default_rng([DISTS.index(dist), rank, 7])
    if dist == "zipf":
        raw = rng.zipf(ZIPF_A, size=(POOL, BATCH))
        return _permutation()[(raw - 1) % ROWS].astype(np.int64)
    return rng.integers(0, ROWS, size=(POOL, BATCH), dtype=np.int64)


def keys_of(ids: np.ndarray) -> np.ndarray:
    """uint64 keys of row ids (wrapping multiply by an odd constant)."""
    return np.multiply(ids.astype(np.uint64), KEY_MULT)


def expected_counts(dist: str, uses: list[list[int]]) -> np.ndarray:
    """How many times each row was pushed, from each worker's per-batch use counts."""
    counts = np.zeros(ROWS, dtype=np.int64)
    for rank, per_batch in enumerate(uses):
        ids = batch_ids(dist, rank)
        weights = np.repeat(np.asarray(per_batch, dtype=np.float64), BATCH)
        counts += np.rint(np.bincount(ids.ravel(), weights=weights, minlength=ROWS)).astype(np.int64)
    return counts


# ---------------------------------------------------------------- workloads

class _Batches:
    """A worker's pool of id batches, cycled through, with a count of each batch's uses."""

    def __init__(self, rank: int, dist: str) -> None:
        self.ids = batch_ids(dist, rank)
        self.uses = np.zeros(POOL, dtype=np.int64)
        self.i = -1
        self.g = np.ones((BATCH, DIM), dtype=np.float32)
        self.units = BATCH

    def next(self) -> int:
        self.i = (self.i + 1) % POOL
        self.uses[self.i] += 1
        return self.i

    def finish(self) -> dict[str, Any]:
        return {"uses": self.uses.tolist()}


class _SharedArrays(_Batches):
    def __init__(self, rank: int, dist: str, shm: ShmSpec, g2: Optional[ShmSpec] = None) -> None:
        super().__init__(rank, dist)
        self._att = [Attached(shm)] + ([Attached(g2)] if g2 else [])
        self.w = self._att[0].array
        self.g2 = self._att[1].array if g2 else None

    def close(self) -> None:
        del self.w, self.g2
        for a in self._att:
            a.close()


class NpAddAt(_SharedArrays):
    """numpy ``np.add.at(w, idx, -lr*g)``: exact scatter-add, slow."""

    def __init__(self, rank: int, nprocs: int, dist: str, shm: ShmSpec) -> None:
        super().__init__(rank, dist, shm)

    def op(self) -> None:
        np.add.at(self.w, self.ids[self.next()], -LR * self.g)


class NpFancy(_SharedArrays):
    """numpy ``w[idx] -= lr*g``: drops duplicate ids within a batch."""

    def __init__(self, rank: int, nprocs: int, dist: str, shm: ShmSpec) -> None:
        super().__init__(rank, dist, shm)

    def op(self) -> None:
        self.w[self.ids[self.next()]] -= LR * self.g


class NpTake(_SharedArrays):
    """numpy ``np.take(w, idx, axis=0, out=buf)``."""

    def __init__(self, rank: int, nprocs: int, dist: str, shm: ShmSpec) -> None:
        super().__init__(rank, dist, shm)
        self.buf = np.zeros((BATCH, DIM), dtype=np.float32)

    def op(self) -> None:
        np.take(self.w, self.ids[self.next()], axis=0, out=self.buf)


class NpAdagradAddAt(_SharedArrays):
    """Adagrad in numpy with np.add.at: g2 += g*g; w -= lr*g/(sqrt(g2)+eps) (exact, slow)."""

    def __init__(self, rank: int, nprocs: int, dist: str, shm: ShmSpec, g2: ShmSpec) -> None:
        super().__init__(rank, dist, shm, g2)
        assert self.g2 is not None
        self.state: np.ndarray = self.g2

    def op(self) -> None:
        idx = self.ids[self.next()]
        np.add.at(self.state, idx, self.g * self.g)
        np.add.at(self.w, idx, -ADAGRAD_LR * self.g / (np.sqrt(self.state[idx]) + EPS))

    def close(self) -> None:
        del self.state
        super().close()


class _Torch(_SharedArrays):
    def __init__(self, rank: int, dist: str, shm: ShmSpec) -> None:
        super().__init__(rank, dist, shm)
        torch = single_threaded_torch()
        self.tw = torch.from_numpy(self.w)
        self.tids = [torch.from_numpy(b) for b in self.ids]
        self.tg = torch.from_numpy(self.g)
        self.tbuf = torch.zeros((BATCH, DIM), dtype=torch.float32)
        self.torch = torch

    def close(self) -> None:
        del self.tw
        super().close()


class TorchIndexAdd(_Torch):
    """torch ``w.index_add_(0, idx, g, alpha=-lr)`` (Hogwild: racy across processes)."""

    def __init__(self, rank: int, nprocs: int, dist: str, shm: ShmSpec) -> None:
        super().__init__(rank, dist, shm)

    def op(self) -> None:
        self.tw.index_add_(0, self.tids[self.next()], self.tg, alpha=-LR)


class TorchIndexSelect(_Torch):
    """torch ``torch.index_select(w, 0, idx, out=buf)``."""

    def __init__(self, rank: int, nprocs: int, dist: str, shm: ShmSpec) -> None:
        super().__init__(rank, dist, shm)

    def op(self) -> None:
        self.torch.index_select(self.tw, 0, self.tids[self.next()], out=self.tbuf)


class _Shmps(_Batches):
    def __init__(self, rank: int, dist: str, spec: TableSpec) -> None:
        import shmps

        super().__init__(rank, dist)
        self.keys = keys_of(self.ids)
        self.store, self.t = spec.open(shmps)

    def close(self) -> None:
        close_quietly(self.store)


class ShmpsPush(_Shmps):
    """shmps ``t.push(keys, g)`` (hash lookup + updater, exact per row)."""

    def __init__(self, rank: int, nprocs: int, dist: str, spec: TableSpec) -> None:
        super().__init__(rank, dist, spec)

    def op(self) -> None:
        self.t.push(self.keys[self.next()], self.g)


class ShmpsPull(_Shmps):
    """shmps ``t.pull(keys, out=buf)`` of existing rows."""

    def __init__(self, rank: int, nprocs: int, dist: str, spec: TableSpec) -> None:
        super().__init__(rank, dist, spec)
        self.buf = np.zeros((BATCH, DIM), dtype=np.float32)

    def op(self) -> None:
        self.t.pull(self.keys[self.next()], out=self.buf)


# ---------------------------------------------------------------- exactness

def note_lost(row: Row, moved_per_row: np.ndarray, counts: np.ndarray, what: str) -> None:
    """Compare how far each row moved (summed over its DIM values) with its exact count."""
    valid = counts < EXACT_F32
    expected = counts[valid] * DIM
    moved = np.rint(moved_per_row[valid]).astype(np.int64)
    lost = int((expected - moved).sum())
    total = int(expected.sum())
    rows_off = int(np.count_nonzero(moved != expected))
    row.data.update(lost=lost, updates=total, rows_off=rows_off, rows_unchecked=int((~valid).sum()))
    text = f"lost {lost / total:.2%} of {what} upd" if total else f"no {what} updates"
    if rows_off and not lost:
        text += f", {rows_off} rows off"
    if not valid.all():
        text += f" ({int((~valid).sum())} rows over 2^24 unchecked)"
    row.note(text)


def row_sums(a: np.ndarray) -> np.ndarray:
    return a.sum(axis=1, dtype=np.float64)


def table_rows(t: Any) -> np.ndarray:
    """Every row of a shmps table, pulled in chunks, summed over its values."""
    keys = keys_of(np.arange(ROWS, dtype=np.int64))
    out = np.empty(ROWS, dtype=np.float64)
    for s in range(0, ROWS, PREFILL_CHUNK):
        out[s:s + PREFILL_CHUNK] = row_sums(t.pull(keys[s:s + PREFILL_CHUNK]))
    return out


# ---------------------------------------------------------------- the section

def section() -> Section:
    return Section(
        "table", f"TABLE: {ROWS:,} x {DIM} float32, batches of {BATCH} ids (zipf a={ZIPF_A} and uniform)",
        "rows/s = ids processed per second (duplicates included), summed over processes. "
        "Baselines use direct row indices into a shared array; shmps gets uint64 keys and pays "
        "its hash lookup. The table is prefilled with every id before timing. g == 1, so "
        "'lost' compares the final values (SGD) or Adagrad's g2 with the exact id counts.")


def run(ctx: RunContext, sec: Section) -> None:
    """For each id distribution and process count: baselines, then shmps."""
    add_checks(sec)
    w_spec, w = create_array(ctx.stack, (ROWS, DIM), "float32")
    g2_spec, g2 = create_array(ctx.stack, (ROWS, DIM), "float32")
    have_torch = importlib.util.find_spec("torch") is not None
    if not have_torch:
        sec.messages.append("torch: not installed, its baselines are skipped")
    shmps_ok = _shmps_has_tables(ctx, sec)
    for dist in DISTS:
        for procs in PROCS:
            run_baselines(ctx, sec, dist, procs, (w_spec, w), (g2_spec, g2), have_torch)
            if shmps_ok:
                run_shmps(ctx, sec, dist, procs)


def _shmps_has_tables(ctx: RunContext, sec: Section) -> bool:
    if ctx.shmps is None:
        sec.messages.append(f"shmps: not importable ({ctx.shmps_error})")
        return False
    missing = [f"shmps.{n}" for n in ("SGD", "Adagrad") if not hasattr(ctx.shmps, n)]
    if not hasattr(getattr(ctx.shmps, "Store", None), "table"):
        missing.insert(0, "Store.table")
    if missing:
        sec.messages.append(f"shmps: tables not available yet (missing {', '.join(missing)})")
        return False
    return True


def run_baselines(ctx: RunContext, sec: Section, dist: str, procs: int,
                  w: tuple[ShmSpec, np.ndarray], g2: tuple[ShmSpec, np.ndarray],
                  have_torch: bool) -> None:
    """numpy and torch on direct row indices."""
    push_ref = Ref(f"row:torch_index_add_{dist}", "torch index_add_") if have_torch else None
    pulls = [("np_take", "numpy np.take(w, idx, out=buf)", "NpTake")]
    pushes = [("np_add_at", "numpy np.add.at(w, idx, -lr*g)", "NpAddAt"),
              ("np_fancy", "numpy w[idx] -= lr*g", "NpFancy")]
    if have_torch:
        pulls.append(("torch_index_select", "torch index_select(w, 0, idx, out=buf)", "TorchIndexSelect"))
        pushes.append(("torch_index_add", "torch w.index_add_(0, idx, g, alpha=-lr) (Hogwild)",
                       "TorchIndexAdd"))
    params = {"dist": dist, "shm": w[0]}
    for key, label, cls in pulls:
        ctx.measure(sec, f"{key}_{dist}", f"pull {label}, {dist}", procs, "rows/s",
                    f"benchlib.table:{cls}", params)
    for key, label, cls in pushes:
        w[1][...] = 0
        row, res = ctx.measure(sec, f"{key}_{dist}", f"push {label}, {dist}", procs, "rows/s",
                               f"benchlib.table:{cls}", params,
                               baseline=push_ref if key != "torch_index_add" else None)
        if res is not None:
            note_lost(row, -row_sums(w[1]), expected_counts(dist, [e["uses"] for e in res.extras]), "w")
    w[1][...] = 0
    g2[1][...] = 0
    row, res = ctx.measure(sec, f"np_adagrad_{dist}", f"adagrad numpy np.add.at, {dist}", procs,
                           "rows/s", "benchlib.table:NpAdagradAddAt", {**params, "g2": g2[0]})
    if res is not None:
        note_lost(row, row_sums(g2[1]), expected_counts(dist, [e["uses"] for e in res.extras]), "g2")


def run_shmps(ctx: RunContext, sec: Section, dist: str, procs: int) -> None:
    """SGD push (with lost updates) and pull on one fresh table, Adagrad push on another."""
    for opt, kind in ((SGD, "sgd"), (ADAGRAD, "adagrad")):
        with ctx.temp_store("t") as (name, store):
            spec = TableSpec(name, "t", DIM, CAPACITY, opt)
            _, t = spec.open(ctx.shmps, store)
            prefill(t, sec, dist, procs, kind)
            before = table_rows(t) if kind == "sgd" else None
            params = {"dist": dist, "spec": spec}
            base = (Ref(f"row:torch_index_add_{dist}", "torch index_add_") if kind == "sgd"
                    else Ref(f"row:np_adagrad_{dist}", "np.add.at adagrad"))
            row, res = ctx.measure(sec, f"shmps_{kind}_{dist}", f"push shmps t.push(keys, g) {opt}, {dist}",
                                   procs, "rows/s", "benchlib.table:ShmpsPush", params, baseline=base)
            if res is not None:
                row.note(f"{res.cores:.2f} cores busy")
            if res is not None and before is not None:
                counts = expected_counts(dist, [e["uses"] for e in res.extras])
                note_lost(row, before - table_rows(t), counts, "w")
            if kind == "sgd":
                row, res = ctx.measure(sec, f"shmps_pull_{dist}", f"pull shmps t.pull(keys, out=buf), {dist}",
                                       procs, "rows/s", "benchlib.table:ShmpsPull", params,
                                       baseline=Ref(f"row:torch_index_select_{dist}", "torch index_select"))
                if res is not None:
                    row.note(f"{res.cores:.2f} cores busy")


def prefill(t: Any, sec: Section, dist: str, procs: int, kind: str) -> None:
    """Create every row (pull of all 1M keys) so the timed pulls and pushes find them."""
    import time

    keys = keys_of(np.arange(ROWS, dtype=np.int64))
    t0 = time.perf_counter()
    for s in range(0, ROWS, PREFILL_CHUNK):
        t.pull(keys[s:s + PREFILL_CHUNK])
    dt = time.perf_counter() - t0
    progress(f"[table] prefill {ROWS:,} rows ({kind}, {dist}, {procs}p): {dt:.2f} s")
    if dist == DISTS[0] and procs == 1:
        sec.messages.append(f"Prefill ({kind}): creating {ROWS:,} rows with pull(keys) in chunks of "
                            f"{PREFILL_CHUNK} took {dt:.2f} s ({ROWS / dt / 1e6:.2f} M rows/s, one process).")


def add_checks(sec: Section) -> None:
    """The targets of issue 3, per distribution and process count."""
    for dist in DISTS:
        for p in PROCS:
            sec.checks += [
                Check(f"SGD push / torch index_add_, {dist} {p}p",
                      quotient_of(f"shmps_sgd_{dist}", f"torch_index_add_{dist}", p), ">=", 2.0),
                Check(f"Adagrad push / numpy np.add.at Adagrad, {dist} {p}p",
                      quotient_of(f"shmps_adagrad_{dist}", f"np_adagrad_{dist}", p), ">=", 10.0),
                Check(f"pull / torch index_select, {dist} {p}p",
                      quotient_of(f"shmps_pull_{dist}", f"torch_index_select_{dist}", p), ">=", 0.5),
                Check(f"SGD push exact: lost updates + rows off, {dist} {p}p",
                      data_sum_of(f"shmps_sgd_{dist}", p, "lost", "rows_off"), "==", 0, "{:.0f}"),
            ]
