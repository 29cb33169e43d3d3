"""``bench.py training`` (issue 5): the Hogwild example's training, shmps vs torch ``share_memory_()``.

The model and loop of ``examples/hogwild_logreg.py``: multinomial logistic regression on
scikit-learn's digits (a 65 x 10 float64 weight), each of P processes (1, 2, 4) owning
every P-th training example, reshuffled each epoch, minibatches of 32, SGD lr 0.3 times
the example's decay 1/(1 + 0.05 epoch).  Every step computes the example's own numpy
``softmax_grad`` on a zero-copy view of the shared weight; only the update differs:

- torch Hogwild: a ``torch.zeros(...).share_memory_()`` tensor handed to the spawned
  workers (torch.multiprocessing's reductions pass its memory by file descriptor),
  ``w = W.numpy()`` once, then per step ``W.add_(torch.from_numpy(g), alpha=-lr)`` (racy);
- shmps: ``store.dense("W", ..., optimizer=shmps.SGD(lr))``; per step ``w = W.view()``,
  ``W.push(g)`` (exact);
- numpy Hogwild: ``w -= lr * g`` on ``multiprocessing.shared_memory`` (racy).

Each repetition is a fixed amount of work, ``EPOCHS`` epochs from a fresh zero weight
(harness single-shot mode: one timed ``op()`` per repetition), so its rate is steps/s
(all processes' steps over the group's wall time, first start to last end) and its
final weight has a held-out accuracy.  The warm-up repetition is the lost-update
variant: the same steps (gradient computed and discarded) push g == 1 with lr 1 into
their own zero weight, so every element must end at exactly minus the number of
steps; the difference counts lost updates.  Then the example itself runs once, end to
end, and its own lines are quoted.
"""
from __future__ import annotations

import importlib.util
import math
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

import numpy as np

from .context import RunContext
from .dense import note_lost
from .harness import Timing, progress, summary
from .report import Check, Metric, Ref, Row, Section, data_sum_of, fmt_num
from .shm import Attached, ShmSpec, create_array, single_threaded_torch
from .tensors import DenseSpec, OptimizerSpec, close_quietly

REPO = Path(__file__).resolve().parents[2]
TRAINING_EXAMPLE = REPO / "examples" / "hogwild_logreg.py"
LR, BATCH, L2 = 0.3, 32, 1e-4      # the example's defaults
DECAY = 0.05                       # the example's schedule: lr * 1 / (1 + DECAY * epoch)
CLASSES = 10
EPOCHS = 1000                      # per repetition: ~0.8 s of work for one process
TRAINING_PROCS = (1, 2, 4)
EXAMPLE_WORKERS = 2                # the machine's cores
EXAMPLE_TIMEOUT = 300.0
ACCURACY_SLACK = 0.01              # shmps may trail torch's accuracy by at most 1 point

TORCH = Ref("row:torch_train", "torch share_memory_")
METHODS = {  # key: (row label, workload)
    "torch_train": ("torch share_memory_() Hogwild: W.add_(g, alpha=-lr), racy",
                    "benchlib.training:TorchTrainer"),
    "shmps_train": ("shmps: W.view(), W.push(g), exact SGD", "benchlib.training:ShmpsTrainer"),
    "numpy_train": ("numpy Hogwild on multiprocessing.shm: w -= lr*g, racy",
                    "benchlib.training:NumpyTrainer"),
}


def load_example() -> ModuleType:
    """Import examples/hogwild_logreg.py as a module (it is not in a package)."""
    spec = importlib.util.spec_from_file_location("hogwild_logreg", TRAINING_EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class TrainData:
    """The example's training split, loaded once by the parent and pickled to the workers."""

    X: np.ndarray
    y: np.ndarray


def steps_per_rep(n_train: int, rank: int, nprocs: int) -> int:
    """Minibatches one process runs in one repetition (``EPOCHS`` epochs of its shard)."""
    shard = len(range(rank, n_train, nprocs))
    return EPOCHS * math.ceil(shard / BATCH)


# ---------------------------------------------------------------- workloads

class _Trainer:
    """The example's worker loop over one process's shard; subclasses supply the update.

    Repetition 0 (the harness's warm-up) is the lost-update variant: the gradient is
    computed as usual but g == 1 is pushed with lr 1 into weight 0.  Repetition i >= 1
    trains weight i from zero.  ``prepare()`` (untimed) selects the weight and resets
    the shuffling seed, so every repetition sees the same batches.
    """

    def __init__(self, rank: int, nprocs: int, data: TrainData) -> None:
        self.grad_fn: Callable[..., np.ndarray] = load_example().softmax_grad
        self.X, self.y = data.X, data.y
        self.rank = rank
        self.shard = np.arange(rank, len(self.y), nprocs)
        self.mine = self.shard.copy()
        self.units = float(steps_per_rep(len(self.y), rank, nprocs))
        self.ones = np.ones((self.X.shape[1], CLASSES))
        self.rep = -1
        self.rng = np.random.default_rng(rank)
        self.spans: list[tuple[float, float]] = []  # CLOCK_MONOTONIC start, end of each op()

    def select(self, i: int) -> None:
        raise NotImplementedError

    def prepare(self) -> None:
        self.rep += 1
        self.select(self.rep)
        self.rng = np.random.default_rng(self.rank)  # the same batches in every repetition
        self.mine = self.shard.copy()

    def op(self) -> None:
        """``EPOCHS`` epochs, exactly as examples/hogwild_logreg.py's ``worker()``."""
        step = self.step_ones if self.rep == 0 else self.step
        mine = self.mine
        t0 = time.clock_gettime(time.CLOCK_MONOTONIC)
        for epoch in range(EPOCHS):
            self.rng.shuffle(mine)
            decay = 1.0 / (1.0 + DECAY * epoch)
            for start in range(0, len(mine), BATCH):
                step(mine[start:start + BATCH], decay)
        self.spans.append((t0, time.clock_gettime(time.CLOCK_MONOTONIC)))

    def grad(self, w: np.ndarray, idx: np.ndarray, decay: float) -> np.ndarray:
        """The same for every method: the example's scheduled minibatch gradient."""
        return decay * self.grad_fn(w, self.X[idx], self.y[idx], L2)

    def step(self, idx: np.ndarray, decay: float) -> None:
        """Read the shared weight, compute the gradient, update the shared weight."""
        raise NotImplementedError

    def step_ones(self, idx: np.ndarray, decay: float) -> None:
        """The same, but push g == 1 with lr 1 (the gradient is computed and dropped)."""
        raise NotImplementedError

    def finish(self) -> dict[str, Any]:
        return {"steps_per_rep": int(self.units), "spans": self.spans}


class TorchTrainer(_Trainer):
    """torch Hogwild: ``W.add_(torch.from_numpy(g), alpha=-lr)`` on ``share_memory_()`` tensors."""

    def __init__(self, rank: int, nprocs: int, data: TrainData, tensors: list[Any]) -> None:
        super().__init__(rank, nprocs, data)
        self.torch = single_threaded_torch()
        self.tensors = tensors
        self.ones_t = self.torch.from_numpy(self.ones)

    def select(self, i: int) -> None:
        self.W = self.tensors[i]
        self.w = self.W.numpy()  # zero-copy: the shared storage

    def step(self, idx: np.ndarray, decay: float) -> None:
        self.W.add_(self.torch.from_numpy(self.grad(self.w, idx, decay)), alpha=-LR)

    def step_ones(self, idx: np.ndarray, decay: float) -> None:
        self.grad(self.w, idx, decay)
        self.W.add_(self.ones_t, alpha=-1.0)

    def close(self) -> None:
        self.__dict__.pop("w", None)
        self.__dict__.pop("W", None)
        self.tensors = []


class ShmpsTrainer(_Trainer):
    """shmps: ``w = W.view()``; ``W.push(g)`` (SGD applied in C, no update lost)."""

    def __init__(self, rank: int, nprocs: int, data: TrainData, specs: list[DenseSpec]) -> None:
        import shmps

        super().__init__(rank, nprocs, data)
        self.store = shmps.attach(specs[0].store)
        self.tensors = [spec.open(shmps, self.store)[1] for spec in specs]

    def select(self, i: int) -> None:
        self.W = self.tensors[i]

    def step(self, idx: np.ndarray, decay: float) -> None:
        self.W.push(self.grad(self.W.view(), idx, decay))

    def step_ones(self, idx: np.ndarray, decay: float) -> None:
        self.grad(self.W.view(), idx, decay)
        self.W.push(self.ones)

    def close(self) -> None:
        close_quietly(self.store)


class NumpyTrainer(_Trainer):
    """numpy Hogwild: ``w -= lr * g`` on multiprocessing.shared_memory arrays."""

    def __init__(self, rank: int, nprocs: int, data: TrainData, shms: list[ShmSpec]) -> None:
        super().__init__(rank, nprocs, data)
        self.atts = [Attached(s) for s in shms]

    def select(self, i: int) -> None:
        self.w = self.atts[i].array

    def step(self, idx: np.ndarray, decay: float) -> None:
        self.w -= LR * self.grad(self.w, idx, decay)

    def step_ones(self, idx: np.ndarray, decay: float) -> None:
        self.grad(self.w, idx, decay)
        self.w -= self.ones

    def close(self) -> None:
        self.__dict__.pop("w", None)
        for att in self.atts:
            att.close()


# ---------------------------------------------------------------- parent side: weights

class Weights:
    """The 1 + reps zero weights of one method for one group, and how the parent reads them."""

    def __init__(self, params: dict[str, Any], read: Callable[[int], np.ndarray]) -> None:
        self.params = params
        self.read = read


def torch_weights(count: int, shape: tuple[int, int]) -> Weights:
    import torch
    import torch.multiprocessing  # noqa: F401 - registers the reductions that share storage by fd

    tensors = [torch.zeros(shape, dtype=torch.float64).share_memory_() for _ in range(count)]
    return Weights({"tensors": tensors}, lambda i: tensors[i].numpy().copy())


def shmps_weights(ctx: RunContext, store_name: str, store: Any, tag: str, count: int,
                  shape: tuple[int, int]) -> Weights:
    assert ctx.shmps is not None
    specs = [DenseSpec(store_name, f"W{tag}_{i}", shape,
                       OptimizerSpec("SGD", {"lr": 1.0 if i == 0 else LR}), dtype="float64")
             for i in range(count)]
    tensors = [spec.open(ctx.shmps, store)[1] for spec in specs]
    return Weights({"specs": specs}, lambda i: tensors[i].pull())


def numpy_weights(ctx: RunContext, count: int, shape: tuple[int, int]) -> Weights:
    made = [create_array(ctx.stack, shape, "float64") for _ in range(count)]
    return Weights({"shms": [spec for spec, _ in made]}, lambda i: made[i][1].copy())


# ---------------------------------------------------------------- the section

def section() -> Section:
    return Section(
        "training", "TRAINING: Hogwild logistic regression (examples/hogwild_logreg.py), "
                    "shmps vs torch share_memory_()",
        f"The example's loop: digits, a 65 x {CLASSES} float64 weight, each of P processes "
        f"owning every P-th training example, minibatches of {BATCH}, SGD lr {LR} x the "
        f"example's decay 1/(1 + {DECAY} epoch). Every step computes the example's numpy "
        "softmax_grad on a zero-copy view of the shared weight; only the update differs. "
        f"A repetition trains a fresh zero weight for {EPOCHS} epochs (fixed work); its rate "
        "is the steps of all processes over the group's wall time (first start to last end), "
        "and 'accuracy' is the held-out accuracy of the weight it left (median, min-max over "
        "repetitions). The warm-up repetition is the lost-update variant: the same steps "
        "push g == 1 with lr 1 into their own zero weight, so every element must end at "
        "exactly minus the number of steps: 'lost' counts the element-updates missing. "
        "'vs baseline' is the ratio to torch at the same process count.")


def run(ctx: RunContext, sec: Section) -> None:
    """torch, shmps and numpy at 1, 2, 4 processes; then the example end to end."""
    if not TRAINING_EXAMPLE.exists():
        sec.messages.append(f"not available yet: {TRAINING_EXAMPLE.relative_to(REPO)} does not exist")
        return
    if importlib.util.find_spec("sklearn") is None:
        sec.messages.append("not available: the example's data needs scikit-learn "
                            "(pip install 'shmps[examples]')")
        return
    have_torch = importlib.util.find_spec("torch") is not None
    if not have_torch:
        sec.messages.append("torch: not installed, its Hogwild baseline is skipped")
    if ctx.shmps is None:
        sec.messages.append(f"shmps: not importable ({ctx.shmps_error})")
    add_checks(sec)
    ex = load_example()
    X_train, X_test, y_train, y_test = ex.load_data()
    data = TrainData(X_train, y_train)
    shape = (X_train.shape[1], CLASSES)
    count = 1 + ctx.timing.reps
    timing = Timing(window=0.0, warmup=1, reps=ctx.timing.reps,
                    quiet_wait=ctx.timing.quiet_wait, quiet_budget=ctx.timing.quiet_budget)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    def measure(key: str, procs: int, weights: Weights) -> None:
        label, target = METHODS[key]
        row, res = ctx.measure(sec, key, label, procs, "steps/s", target,
                               {"data": data, **weights.params}, timing=timing,
                               baseline=None if key == "torch_train" else TORCH)
        if res is None:
            return
        row.data["sum_of_own_rates"] = row.samples
        row.samples = group_rates(res.extras, timing.warmup)
        progress(f"[training]   {key} {procs}p over the group's wall time: "
                 f"{summary(row.samples)} steps/s")
        accs = [ex.accuracy(weights.read(i), X_test, y_test) for i in range(1, count)]
        row.data["accuracy"] = accs
        row.data["accuracy_median"] = statistics.median(accs)
        row.note(f"accuracy {_acc_text(accs)}")
        steps = sum(e["steps_per_rep"] for e in res.extras)
        note_lost(row, -weights.read(0), steps)
        row.note(f"{res.cores:.2f} cores busy")
        if procs > cores:
            row.note(f"{procs} processes on {cores} cores: oversubscribed")

    with ctx.temp_store("t") if ctx.shmps is not None else nullcontext() as opened:
        for procs in TRAINING_PROCS:
            if have_torch:
                measure("torch_train", procs, torch_weights(count, shape))
            if opened is not None:
                name, store = opened
                measure("shmps_train", procs,
                        shmps_weights(ctx, name, store, str(procs), count, shape))
            measure("numpy_train", procs, numpy_weights(ctx, count, shape))
    sec.messages.append(summary_table(sec, cores))
    run_example(sec)


def group_rates(extras: list[dict[str, Any]], warmup: int) -> list[float]:
    """Per measured repetition: every process's steps / (last end - first start).

    Fixed work, so a process that the scheduler runs late also starts its clock late:
    the harness's sum of each process's own rate would count 4 processes taking turns
    on 2 cores as running in parallel.  The group's wall time does not.
    """
    rates = []
    for rep in range(warmup, len(extras[0]["spans"])):
        start = min(e["spans"][rep][0] for e in extras)
        end = max(e["spans"][rep][1] for e in extras)
        rates.append(sum(e["steps_per_rep"] for e in extras) / (end - start))
    return rates


def _acc_text(accs: list[float]) -> str:
    med = statistics.median(accs)
    if min(accs) == max(accs):
        return f"{med:.4f}"
    return f"{med:.4f} ({min(accs):.4f}-{max(accs):.4f})"


def _lost_text(row: Optional[Row]) -> str:
    if row is None or "lost" not in row.data:
        return "n/a"
    lost, total = row.data["lost"], row.data["updates"]
    return f"{lost} of {fmt_num(total)} ({lost / total:.2%})" if total else "n/a"


def summary_table(sec: Section, cores: int) -> str:
    """The figures beside each other: steps/s, shmps / torch, accuracy, lost updates."""
    out = [f"Side by side ({EPOCHS} epochs per repetition; steps/s medians; lost = "
           "element-updates missing in the g == 1 variant):", "",
           "| procs | torch steps/s | shmps steps/s | shmps / torch | numpy steps/s "
           "| torch accuracy | shmps accuracy | numpy accuracy | torch lost | shmps lost "
           "| numpy lost |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for procs in TRAINING_PROCS:
        rows = {k: sec.row(k, procs) for k in METHODS}
        ratio = sec.quotient("shmps_train", "torch_train", procs)
        accs = [_acc_text(r.data["accuracy"]) if r is not None and "accuracy" in r.data else "-"
                for r in rows.values()]
        meds = [fmt_num(r.median) if r is not None else "-" for r in rows.values()]
        flag = " (oversubscribed)" if procs > cores else ""
        out.append(f"| {procs}{flag} | {meds[0]} | {meds[1]} | "
                   f"{'-' if ratio is None else f'{ratio:.3f}'} | {meds[2]} | {' | '.join(accs)} | "
                   f"{' | '.join(_lost_text(r) for r in rows.values())} |")
    if any(p > cores for p in TRAINING_PROCS):
        over = max(TRAINING_PROCS)
        out += ["", f"Oversubscribed: this machine has {cores} cores, so with {over} processes at "
                f"most {cores} run at once and the others wait for a time slice. steps/s cannot "
                f"exceed what {cores} cores deliver, and racy updates collide only between the "
                "processes running at that moment (or when one is preempted mid-update), so "
                f"the {over}-process figures say how each side copes with oversubscription, "
                f"not how it scales to {over} cores."]
    return "\n".join(out)


def add_checks(sec: Section) -> None:
    """shmps exact (no update lost) and as accurate as torch Hogwild, at every process count."""
    for procs in TRAINING_PROCS:
        sec.checks.append(Check(f"shmps: lost updates in the g == 1 variant, {procs}p",
                                data_sum_of("shmps_train", procs, "lost"), "==", 0, "{:.0f}"))
    for procs in TRAINING_PROCS:
        sec.checks.append(Check(f"shmps accuracy - torch accuracy (medians), {procs}p",
                                accuracy_gap("shmps_train", "torch_train", procs), ">=",
                                -ACCURACY_SLACK, "{:+.4f}"))


def accuracy_gap(key: str, ref_key: str, procs: int) -> Metric:
    def value(section: Section) -> Optional[float]:
        a, b = section.row(key, procs), section.row(ref_key, procs)
        if a is None or b is None or "accuracy_median" not in a.data or "accuracy_median" not in b.data:
            return None
        return float(a.data["accuracy_median"] - b.data["accuracy_median"])
    return Metric([(key, procs), (ref_key, procs)], value)


def run_example(sec: Section) -> None:
    """Run the example once with as many workers as cores and quote its report."""
    cmd = [sys.executable, str(TRAINING_EXAMPLE), "--workers", str(EXAMPLE_WORKERS)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT)
    except subprocess.TimeoutExpired:
        sec.messages.append(f"`{' '.join(cmd[1:])}` did not finish in {EXAMPLE_TIMEOUT:.0f} s")
        return
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    if out.returncode != 0 and not lines:
        lines = out.stderr.strip().splitlines()[-1:]
    quoted = "\n".join(f"    {ln}" for ln in lines)
    sec.messages.append(f"`python examples/hogwild_logreg.py --workers {EXAMPLE_WORKERS}` "
                        f"(exit {out.returncode}):\n\n{quoted}")
    progress(f"[training] example: exit {out.returncode}; {lines[0] if lines else ''}")
