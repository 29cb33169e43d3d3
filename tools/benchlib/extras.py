"""``bench.py training`` (the Hogwild example) and ``bench.py bridge`` (not available yet).

training: the minibatch step of ``examples/hogwild_logreg.py`` (digits, multinomial
logistic regression, a 65 x 10 float64 weight, batches of 32) timed in 1 and 2
processes: shmps ``W.view()`` + gradient + ``W.push(g)`` beside the same step on a
numpy array in ``multiprocessing.shared_memory`` (``w -= lr*g``, racy Hogwild).  The
weight is tiny, so this measures per-push overhead inside a real loop.  Then the example
itself runs once, end to end, and its own lines (time, accuracy beside scikit-learn) are
quoted.

bridge: will measure forwarded push throughput between 2 bridges on loopback beside raw
sockets and aiohttp websockets, and failover time over 10 kills (issue 6).
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np

from .context import PROCS, RunContext
from .harness import progress
from .report import Ref, Section
from .shm import Attached, ShmSpec, create_array
from .tensors import DenseSpec, OptimizerSpec, close_quietly

REPO = Path(__file__).resolve().parents[2]
TRAINING_EXAMPLE = REPO / "examples" / "hogwild_logreg.py"
LR, BATCH, L2 = 0.3, 32, 1e-4      # the example's defaults (constant lr here: no decay)
CLASSES = 10
EXAMPLE_WORKERS = 2                # the machine's cores
EXAMPLE_TIMEOUT = 300.0


def load_example() -> ModuleType:
    """Import examples/hogwild_logreg.py as a module (it is not in a package)."""
    spec = importlib.util.spec_from_file_location("hogwild_logreg", TRAINING_EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- training workloads

class _LogregStep:
    """One worker's share of the training set, cut into shuffled minibatches."""

    def __init__(self, rank: int, nprocs: int) -> None:
        self.ex = load_example()
        self.X, _, self.y, _ = self.ex.load_data()
        mine = np.random.default_rng(rank).permutation(np.arange(rank, len(self.y), nprocs))
        self.batches = [mine[s:s + BATCH] for s in range(0, len(mine), BATCH)]
        self.i = -1
        self.units = 1.0  # one push

    def next_batch(self) -> np.ndarray:
        self.i = (self.i + 1) % len(self.batches)
        return self.batches[self.i]

    def grad(self, w: np.ndarray) -> np.ndarray:
        idx = self.next_batch()
        return self.ex.softmax_grad(w, self.X[idx], self.y[idx], L2)


class ShmpsLogreg(_LogregStep):
    """shmps: ``w = W.view()``; ``W.push(softmax_grad(w, batch))`` (SGD applied in C)."""

    def __init__(self, rank: int, nprocs: int, spec: DenseSpec) -> None:
        import shmps

        super().__init__(rank, nprocs)
        self.store, self.W = spec.open(shmps)

    def op(self) -> None:
        self.W.push(self.grad(self.W.view()))

    def close(self) -> None:
        close_quietly(self.store)


class NumpyLogreg(_LogregStep):
    """numpy Hogwild: ``w -= lr * softmax_grad(w, batch)`` on multiprocessing.shared_memory."""

    def __init__(self, rank: int, nprocs: int, shm: ShmSpec) -> None:
        super().__init__(rank, nprocs)
        self.att = Attached(shm)
        self.w = self.att.array

    def op(self) -> None:
        self.w -= LR * self.grad(self.w)

    def close(self) -> None:
        del self.w
        self.att.close()


# ---------------------------------------------------------------- sections

def training_section() -> Section:
    return Section(
        "training", "TRAINING: Hogwild logistic regression step (examples/hogwild_logreg.py)",
        f"One step = read the weight, softmax gradient of a batch of {BATCH} digits, push "
        f"(SGD lr={LR}). The weight is 65 x {CLASSES} float64 (5 KiB), so this is the "
        "per-push overhead inside a real training loop. 'accuracy' is the held-out accuracy "
        "of the weight each run left behind.")


def bridge_section() -> Section:
    return Section("bridge", "BRIDGE: forwarded pushes between 2 bridges on loopback, failover")


def run_training(ctx: RunContext, sec: Section) -> None:
    """Step rates (shmps vs numpy Hogwild), then the example end to end."""
    if not TRAINING_EXAMPLE.exists():
        sec.messages.append(f"not available yet: {TRAINING_EXAMPLE.relative_to(REPO)} does not exist")
        return
    if ctx.shmps is None:
        sec.messages.append(f"not available yet: shmps not importable ({ctx.shmps_error})")
        return
    if importlib.util.find_spec("sklearn") is None:
        sec.messages.append("not available: the example needs scikit-learn (pip install 'shmps[examples]')")
        return
    ex = load_example()
    _, X_test, _, y_test = ex.load_data()
    shape = (X_test.shape[1], CLASSES)
    shm, w = create_array(ctx.stack, shape, "float64")
    for procs in PROCS:
        w[...] = 0
        row, res = ctx.measure(sec, "numpy_step", "numpy Hogwild step (w -= lr*g, racy)", procs,
                               "steps/s", "benchlib.extras:NumpyLogreg", {"shm": shm})
        if res is not None:
            row.note(f"accuracy {ex.accuracy(w, X_test, y_test):.4f}")
        with ctx.temp_store("l") as (name, store):
            spec = DenseSpec(name, "W", shape, OptimizerSpec("SGD", {"lr": LR}), dtype="float64")
            _, W = spec.open(ctx.shmps, store)
            row, res = ctx.measure(sec, "shmps_step", "shmps step (W.view(), W.push(g), exact)",
                                   procs, "steps/s", "benchlib.extras:ShmpsLogreg", {"spec": spec},
                                   baseline=Ref("row:numpy_step", "numpy Hogwild"))
            if res is not None:
                row.note(f"accuracy {ex.accuracy(W.pull(), X_test, y_test):.4f}")
    run_example(sec)


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


def run_bridge(ctx: RunContext, sec: Section) -> None:
    """Not implemented until a runnable bridge exists: say why."""
    if ctx.shmps is None:
        sec.messages.append(f"not available yet: shmps not importable ({ctx.shmps_error})")
        return
    if importlib.util.find_spec("shmps.bridge") is None:
        sec.messages.append("not available yet: shmps.bridge does not exist")
        return
    pyproject = (REPO / "pyproject.toml").read_text()
    if "shmps-bridge" not in pyproject:
        sec.messages.append("not available yet: shmps.bridge exists but has no `shmps-bridge` "
                            "entry point in pyproject.toml to start bridges with")
        return
    sec.messages.append("not available yet: shmps-bridge exists, but its benchmark is not "
                        "written (tools/benchlib/extras.py)")
