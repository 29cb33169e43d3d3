"""A torch MLP trained by 4 processes through shmps.torch, with bounded delay k=2.

scikit-learn's bundled digits data (no download), a 64-128-10 MLP.  Every process
builds the model, calls ``shmps.torch.share(model, store, optimizer=shmps.Adam(...))``
(the parameters become views of shared tensors; the first process's initial values
win) and trains on its quarter of the data with ``shmps.torch.Pusher`` as its
optimizer: each step pushes every gradient, and shmps applies Adam in place, in
C, with one Adam state for all the processes.  ``store.clock()`` after each step
with ``staleness=2`` keeps every process within 2 steps of the slowest.  Prints
the held-out accuracy beside the same MLP trained by torch.optim.Adam in one
process for the same number of epochs.

    python examples/torch_mlp.py          # 4 workers, 30 epochs, ~20 s on 2 cores
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
import uuid

import numpy as np

from shmps.cli_args import at_least_one, at_least_zero, non_negative


def need(module: str, extra: str) -> None:
    """Exit 0 with a message if an optional package is missing (or broken)."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        print(f"this example needs {module}: pip install {extra}")
        sys.exit(0)


def load_data(seed: int = 0):
    """Digits scaled to [0, 1]; a stratified 75/25 split (float32, int64)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    return train_test_split(X, y.astype(np.int64), test_size=0.25, random_state=seed,
                            stratify=y)


def make_model(hidden: int):
    import torch

    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


def batches(n: int, batch: int, rng: np.random.Generator):
    order = rng.permutation(n)
    return [order[s:s + batch] for s in range(0, n, batch)]


def worker(rank: int, store_name: str, X_part: np.ndarray, y_part: np.ndarray,
           args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    import shmps.torch

    torch.set_num_threads(1)
    torch.manual_seed(rank)  # different initial values: the store keeps the first
    X, y = torch.from_numpy(X_part), torch.from_numpy(y_part)
    store = shmps.attach(store_name)
    try:
        store.join()
        model = make_model(args.hidden)
        shmps.torch.share(model, store, optimizer=shmps.Adam(lr=args.lr))
        opt = shmps.torch.Pusher(model)
        rng = np.random.default_rng(rank)
        for _ in range(args.epochs):
            for idx in batches(len(y), args.batch, rng):
                opt.zero_grad()
                F.cross_entropy(model(X[idx]), y[idx]).backward()
                opt.step()
                store.clock(timeout=60)  # at most `staleness` steps ahead of the slowest
    finally:
        store.close()


def accuracy(model, X: np.ndarray, y: np.ndarray) -> float:
    import torch

    with torch.no_grad():
        return float((model(torch.from_numpy(X)).argmax(1).numpy() == y).mean())


def reference(args: argparse.Namespace, X_tr, y_tr, X_te, y_te) -> float:
    """The same MLP trained by torch.optim.Adam in one process, same epochs."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = make_model(args.hidden)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    X, y = torch.from_numpy(X_tr), torch.from_numpy(y_tr)
    rng = np.random.default_rng(0)
    for _ in range(args.epochs):
        for idx in batches(len(y), args.batch, rng):
            opt.zero_grad()
            F.cross_entropy(model(X[idx]), y[idx]).backward()
            opt.step()
    return accuracy(model, X_te, y_te)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=at_least_one, default=4)
    ap.add_argument("--staleness", type=at_least_zero, default=2)
    ap.add_argument("--epochs", type=at_least_one, default=30)
    ap.add_argument("--batch", type=at_least_one, default=32)
    ap.add_argument("--hidden", type=at_least_one, default=128)
    ap.add_argument("--lr", type=non_negative, default=1e-3)
    args = ap.parse_args(argv)
    need("torch", "torch")
    need("sklearn", "'shmps[examples]'")
    import torch

    import shmps.torch

    torch.set_num_threads(1)
    X_tr, X_te, y_tr, y_te = load_data()
    store_name = f"torchmlp-{uuid.uuid4().hex[:8]}"
    store = shmps.attach(store_name, staleness=args.staleness)
    try:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(r, store_name, X_tr[r::args.workers],
                                                  y_tr[r::args.workers], args))
                 for r in range(args.workers)]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        elapsed = time.perf_counter() - t0
        if any(p.exitcode != 0 for p in procs):
            print("a worker failed", file=sys.stderr)
            return 1
        model = make_model(args.hidden)
        shmps.torch.share(model, store)  # the trained parameters, zero-copy
        acc = accuracy(model, X_te, y_te)
        steps = store["0.weight"].stats()["step"]
    finally:
        store.destroy()
    t1 = time.perf_counter()
    ref = reference(args, X_tr, y_tr, X_te, y_te)
    ref_time = time.perf_counter() - t1
    print(f"shmps.torch MLP, {args.workers} processes, staleness {args.staleness}: {steps} "
          f"Adam steps in {elapsed:.2f} s (with process start-up), held-out accuracy {acc:.4f}")
    print(f"torch.optim.Adam, 1 process, same epochs: {ref_time:.2f} s, "
          f"held-out accuracy {ref:.4f}")
    ok = acc >= ref - 0.02
    print("OK: within 2 points of single-process torch or better" if ok else
          "FAIL: more than 2 points below single-process torch")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
