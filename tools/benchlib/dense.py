"""``bench.py dense`` (issue 2): a 64 MiB float32 parameter, push and pull, 1 and 2 processes.

Baselines on ``multiprocessing.shared_memory``: numpy ``w -= lr*g``, torch
``w.add_(g, alpha=-lr)`` (a tensor built with ``torch.from_numpy`` over the segment:
the same memory and the same kernel as ``share_memory_()``), and ``np.copyto`` for
pulls.  g == 1 and lr == 1, so after P pushes every element must have moved by exactly
-P: lost updates are counted from the final array.
"""
from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .context import PROCS, RunContext
from .harness import progress
from .report import Check, Ref, Row, Section, data_sum_of, median_of, quotient_of
from .shm import Attached, ShmSpec, create_array, single_threaded_torch
from .tensors import DenseSpec, OptimizerSpec, close_quietly

DENSE_SHAPE = (16384, 1024)           # 16 Mi float32 = 64 MiB
DENSE_ELEMS = DENSE_SHAPE[0] * DENSE_SHAPE[1]
GRAD_BYTES = 4 * DENSE_ELEMS          # a push applies 64 MiB of gradient
PULL_BYTES = 2 * GRAD_BYTES           # a pull reads and writes 64 MiB (copy convention)
LR = 1.0
ATTACH_TENSORS = 100

TRIAD_PER_GRAD = Ref("limit:triad", "triad", scale=4 / 12)  # triad GB/s -> GB/s of gradient
COPY = Ref("limit:copy", "copy")
TORCH = Ref("row:torch_push", "torch add_")
COPYTO = Ref("row:np_copyto", "np.copyto")

SHMPS_MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "exact": ("shmps w.push(g), exact (SGD)", {}),
    "nonfinite": ("shmps w.push(g), exact, allow_nonfinite=True", {"allow_nonfinite": True}),
    "hogwild": ("shmps w.push(g), mode='hogwild'", {"mode": "hogwild"}),
}


# ---------------------------------------------------------------- baseline workloads

class NumpyPush:
    """(a) numpy ``w -= lr*g`` on a multiprocessing.shared_memory array (racy)."""

    def __init__(self, rank: int, nprocs: int, shm: ShmSpec) -> None:
        self.att = Attached(shm)
        self.w = self.att.array
        self.g = np.ones(shm.shape, dtype=np.float32)
        self.units = GRAD_BYTES

    def op(self) -> None:
        self.w -= LR * self.g

    def close(self) -> None:
        del self.w
        self.att.close()


class TorchPush:
    """(c) torch ``w.add_(g, alpha=-lr)`` on the shared segment (Hogwild, racy)."""

    def __init__(self, rank: int, nprocs: int, shm: ShmSpec) -> None:
        torch = single_threaded_torch()
        self.att = Attached(shm)
        self.w = torch.from_numpy(self.att.array)
        self.g = torch.ones(shm.shape, dtype=torch.float32)
        self.units = GRAD_BYTES

    def op(self) -> None:
        self.w.add_(self.g, alpha=-LR)

    def close(self) -> None:
        del self.w
        self.att.close()


class CopytoPull:
    """``np.copyto(private, shm)`` into a preallocated private array."""

    def __init__(self, rank: int, nprocs: int, shm: ShmSpec) -> None:
        self.att = Attached(shm)
        self.buf = np.empty(shm.shape, dtype=np.float32)
        self.buf.fill(0)
        self.units = PULL_BYTES

    def op(self) -> None:
        np.copyto(self.buf, self.att.array)

    def close(self) -> None:
        self.att.close()


# ---------------------------------------------------------------- shmps workloads

class ShmpsPush:
    """shmps ``w.push(g)`` with g == 1 (SGD lr == 1)."""

    def __init__(self, rank: int, nprocs: int, spec: DenseSpec) -> None:
        import shmps

        self.store, self.w = spec.open(shmps)
        self.g = np.ones(spec.shape, dtype=np.float32)
        self.units = GRAD_BYTES

    def op(self) -> None:
        self.w.push(self.g)

    def close(self) -> None:
        close_quietly(self.store)


class ShmpsPull:
    """shmps ``w.pull(out=buf)`` into a preallocated private array."""

    def __init__(self, rank: int, nprocs: int, spec: DenseSpec) -> None:
        import shmps

        self.store, self.w = spec.open(shmps)
        self.buf = np.empty(spec.shape, dtype=np.float32)
        self.buf.fill(0)
        self.units = PULL_BYTES

    def op(self) -> None:
        self.w.pull(out=self.buf)

    def close(self) -> None:
        close_quietly(self.store)


# ---------------------------------------------------------------- lost updates

def note_lost(row: Row, delta: np.ndarray, pushes: int) -> None:
    """Record how far ``delta`` (how much each element moved) is from ``pushes`` everywhere."""
    expected = pushes * delta.size
    moved = int(round(float(delta.sum(dtype=np.float64))))
    wrong = int(np.count_nonzero(delta != pushes))
    row.data.update(lost=expected - moved, updates=expected, wrong_elements=wrong, pushes=pushes)
    share = (expected - moved) / expected if expected else 0.0
    row.note(f"lost {expected - moved}/{expected} upd ({share:.2%})"
             + (f", {wrong} elements off" if wrong and moved == expected else ""))


def note_rate(row: Row, unit_bytes: int, what: str) -> None:
    if row.median:
        row.notes.insert(0, f"{row.median * 1e9 / unit_bytes:.1f} {what}/s")


# ---------------------------------------------------------------- the section

def section() -> Section:
    return Section(
        "dense", "DENSE: 64 MiB float32 parameter, push (SGD) and pull",
        f"Parameter {DENSE_SHAPE[0]}x{DENSE_SHAPE[1]} float32 in shared memory. Push GB/s counts "
        "gradient bytes (4 B/elem), compared with the fused triad limit (12 B/elem moved) and "
        "with torch's racy add_ at the same process count. Pull GB/s counts read+write bytes, "
        "compared with the copy limit and np.copyto. g == 1 and lr == 1, so each element must "
        "move by exactly the number of pushes: 'lost' counts element-updates missing.")


def run(ctx: RunContext, sec: Section) -> None:
    """Baselines, then shmps (if importable), then attach time."""
    add_checks(sec)
    run_baselines(ctx, sec)
    if ctx.shmps is None:
        sec.messages.append(f"shmps: not importable ({ctx.shmps_error})")
        return
    with ctx.temp_store("d") as (name, store):
        run_shmps(ctx, sec, name, store)
    with ctx.temp_store("a") as (name, store):
        run_attach(ctx, sec, name, store)
    with ctx.temp_store("r") as (name, store):
        run_one_row(ctx, sec, store)


def run_baselines(ctx: RunContext, sec: Section) -> None:
    """numpy and torch pushes with lost-update counts, and the np.copyto pull."""
    shm, w = create_array(ctx.stack, DENSE_SHAPE, "float32")
    have_torch = importlib.util.find_spec("torch") is not None
    if not have_torch:
        sec.messages.append("torch: not installed, its baselines are skipped")
    for procs in PROCS:
        pushes: list[tuple[str, str, str]] = [("np_push", "(a) numpy w -= lr*g on multiprocessing.shm",
                                              "benchlib.dense:NumpyPush")]
        if have_torch:
            pushes.append(("torch_push", "(c) torch w.add_(g, alpha=-lr) on shm (Hogwild)",
                           "benchlib.dense:TorchPush"))
        for key, label, target in pushes:
            w[...] = 0
            row, res = ctx.measure(sec, key, label, procs, "GB/s grad", target, {"shm": shm},
                                   scale=1e-9, limit=TRIAD_PER_GRAD)
            if res is not None:
                note_rate(row, GRAD_BYTES, "push")
                note_lost(row, -w.astype(np.float64), sum(res.ops))
        row, _ = ctx.measure(sec, "np_copyto", "np.copyto(private, shm), preallocated", procs,
                             "GB/s r+w", "benchlib.dense:CopytoPull", {"shm": shm}, scale=1e-9,
                             limit=COPY)
        note_rate(row, PULL_BYTES, "pull")


def dense_specs(store_name: str) -> dict[str, DenseSpec]:
    opt = OptimizerSpec("SGD", {"lr": LR})
    return {mode: DenseSpec(store_name, f"w_{mode}", DENSE_SHAPE, opt, extra=extra)
            for mode, (_, extra) in SHMPS_MODES.items()}


def run_shmps(ctx: RunContext, sec: Section, name: str, store: Any) -> None:
    """shmps pushes in each mode (lost updates from pulls before/after) and pull(out=)."""
    assert ctx.shmps is not None
    specs = dense_specs(name)
    tensors = {mode: spec.open(ctx.shmps, store)[1] for mode, spec in specs.items()}
    for procs in PROCS:
        for mode, (label, _) in SHMPS_MODES.items():
            before = tensors[mode].pull()
            row, res = ctx.measure(sec, f"shmps_push_{mode}", label, procs, "GB/s grad",
                                   "benchlib.dense:ShmpsPush", {"spec": specs[mode]}, scale=1e-9,
                                   limit=TRIAD_PER_GRAD, baseline=TORCH)
            if res is not None:
                note_rate(row, GRAD_BYTES, "push")
                after = tensors[mode].pull()
                note_lost(row, before.astype(np.float64) - after, sum(res.ops))
            if res is not None:
                row.note(f"{res.cores:.2f} cores busy")
        row, _ = ctx.measure(sec, "shmps_pull", "shmps w.pull(out=buf)", procs, "GB/s r+w",
                             "benchlib.dense:ShmpsPull", {"spec": specs["exact"]}, scale=1e-9,
                             limit=COPY, baseline=COPYTO)
        note_rate(row, PULL_BYTES, "pull")


ATTACH_SCRIPT = r"""
import json, sys, time
import shmps
t0 = time.perf_counter()
store = shmps.attach(sys.argv[1])
t1 = time.perf_counter()
for name in sys.argv[2].split(","):
    store[name]
t2 = time.perf_counter()
store.close()
print(json.dumps({"attach_ms": (t1 - t0) * 1e3, "lookup_ms": (t2 - t1) * 1e3}))
"""


def run_attach(ctx: RunContext, sec: Section, name: str, store: Any) -> None:
    """``shmps.attach`` of a store holding 100 small tensors, each in a fresh process."""
    assert ctx.shmps is not None
    names = [f"p{i:03d}" for i in range(ATTACH_TENSORS)]
    for n in names:
        store.dense(n, shape=(256,), dtype="float32", init=0.0)
    row = sec.add(Row("shmps_attach", f"shmps.attach() of a store with {ATTACH_TENSORS} tensors",
                      1, "ms"))
    runs = 2 if ctx.smoke else 10 if ctx.quick else 20
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([shmps_root(ctx), os.environ.get("PYTHONPATH", "")])}
    lookups: list[float] = []
    try:
        for _ in range(runs):
            out = subprocess.run([sys.executable, "-c", ATTACH_SCRIPT, name, ",".join(names)],
                                 env=env, capture_output=True, text=True, timeout=60, check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            row.samples.append(got["attach_ms"])
            lookups.append(got["lookup_ms"])
    except (subprocess.SubprocessError, ValueError, IndexError, KeyError) as exc:
        err = getattr(exc, "stderr", "") or str(exc)
        row.error = f"error: {err.strip().splitlines()[-1] if err.strip() else exc}"
        return
    row.note(f"fresh process each, {runs} runs; then store[name] x {ATTACH_TENSORS}: "
             f"median {statistics.median(lookups):.2f} ms")
    progress(f"[dense] attach: median {row.median:.2f} ms, lookups {statistics.median(lookups):.2f} ms")


ROW_SHAPE = (4096, 64)                 # 1 MiB float32, 16 shards of 256 rows
ROW_CALLS = 20000                      # calls per sample
NP_ROW = Ref("row:np_row_push", "numpy w[r] -= lr*g")
NP_ROW_PULL = Ref("row:np_row_pull", "numpy w[r]")


def run_one_row(ctx: RunContext, sec: Section, store: Any) -> None:
    """What one call costs when it moves one row (64 float32): shmps push(g, rows=[r])
    and pull(rows=[r]) beside numpy's fancy indexing and torch's index_add_ on a
    shared-memory array (the per-call overhead a small sparse update pays; one process,
    microseconds a call, lower is better)."""
    import timeit
    assert ctx.shmps is not None
    shm, w = create_array(ctx.stack, ROW_SHAPE, "float32")
    g = np.ones((1, ROW_SHAPE[1]), np.float32)
    r = np.array([1000])
    reps = 1 if ctx.smoke else 3 if ctx.quick else 5
    ncalls = ROW_CALLS // 100 if ctx.smoke else ROW_CALLS

    def per_call(fn: Any) -> list[float]:
        fn()
        return [timeit.timeit(fn, number=ncalls) / ncalls * 1e6 for _ in range(reps)]

    def lower_is_better(row: Row, what: str) -> None:
        row.note(f"{what}; us per call, lower is better (a ratio below 1 beats the baseline)")
        progress(f"[dense] {row.label}: {row.median:.2f} us")

    calls: list[tuple[str, str, Any, Optional[Ref]]] = [
        ("np_row_push", "numpy w[r] -= lr*g, one row, on multiprocessing.shm",
         lambda: w.__setitem__(r, w[r] - LR * g), None)]
    if importlib.util.find_spec("torch") is not None:
        torch = single_threaded_torch()
        tw, tg, ti = torch.from_numpy(w), torch.from_numpy(g), torch.from_numpy(r)
        calls.append(("torch_row_push", "torch w.index_add_(0, r, g, alpha=-lr), one row, on "
                      "shm", lambda: tw.index_add_(0, ti, tg, alpha=-LR), NP_ROW))
    t = store.dense("w_row", ROW_SHAPE, "float32", init=0.0,
                    optimizer=ctx.shmps.SGD(lr=LR), shard_rows=256)
    calls += [("shmps_row_push", "shmps w.push(g, rows=[r]), one row, exact (SGD)",
               lambda: t.push(g, rows=r), NP_ROW),
              ("np_row_pull", "numpy w[r], one row", lambda: w[r], None),
              ("shmps_row_pull", "shmps w.pull(rows=[r]), one row",
               lambda: t.pull(rows=r), NP_ROW_PULL),
              ("shmps_row_pull_fast", "shmps w.pull(rows=[r], consistent=False), one row",
               lambda: t.pull(rows=r, consistent=False), NP_ROW_PULL)]
    for key, label, fn, ref in calls:
        row = sec.add(Row(key, label, 1, "us", samples=per_call(fn), baseline=ref))
        lower_is_better(row, f"{ROW_SHAPE[0]}x{ROW_SHAPE[1]} float32, {ncalls} calls a sample")


def shmps_root(ctx: RunContext) -> str:
    """The directory shmps was imported from, for the fresh attach processes."""
    assert ctx.shmps is not None and ctx.shmps.__file__ is not None
    return str(Path(ctx.shmps.__file__).resolve().parent.parent)


def add_checks(sec: Section) -> None:
    """The targets of issue 2."""
    for procs in PROCS:
        sec.checks.append(Check(f"shmps exact push / torch add_, {procs}p",
                                quotient_of("shmps_push_exact", "torch_push", procs), ">=", 0.9))
    for procs in PROCS:
        sec.checks.append(Check(f"shmps pull(out=) / np.copyto, {procs}p",
                                quotient_of("shmps_pull", "np_copyto", procs), ">=", 0.9))
    for procs in PROCS:
        sec.checks.append(Check(f"shmps exact push: lost updates, {procs}p",
                                data_sum_of("shmps_push_exact", procs, "lost"), "==", 0, "{:.0f}"))
        sec.checks.append(Check(f"shmps exact push: elements off their exact value, {procs}p",
                                data_sum_of("shmps_push_exact", procs, "wrong_elements"), "==", 0,
                                "{:.0f}"))
    sec.checks.append(Check(f"attach of a store with {ATTACH_TENSORS} tensors (ms, median)",
                            median_of("shmps_attach", 1), "<", 10.0, "{:.2f}"))
