"""Synchronous data-parallel SGD with shmps: 4 processes, aggregate="mean".

Multinomial logistic regression on scikit-learn's bundled digits data (no
download).  The training set is cut into 4 equal shards, one per process.  Every
step each process pulls the weights, computes the gradient of its shard and pushes
it to a tensor created with ``aggregate="mean", workers=4``: shmps sums the 4
pushes of the step exactly and applies SGD once with their mean, so the result
is full-batch gradient descent.  With ``staleness=0`` every ``store.clock()`` is a
barrier, so each step's gradients are computed at the weights of the previous
step.  The script checks that against single-process full-batch gradient descent
(numpy) and prints the largest difference.

    python examples/sync_sgd.py           # 4 workers, 200 steps, a few seconds
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
import uuid

import numpy as np

import shmps
from shmps.cli_args import at_least_one, non_negative


def load_data(workers: int, seed: int = 0):
    """Digits scaled to [0, 1] with a bias column; a stratified 75/25 split whose
    training part is trimmed to a multiple of ``workers`` (equal shards, so the
    mean of the shard gradients is the full-batch gradient)."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        print("this example needs scikit-learn: pip install 'shmps[examples]'")
        sys.exit(0)
    X, y = load_digits(return_X_y=True)
    X = np.hstack([X / 16.0, np.ones((X.shape[0], 1))])
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_size=0.25, random_state=seed,
                                              stratify=y)
    n = len(y_tr) // workers * workers
    return X_tr[:n], X_te, y_tr[:n], y_te


def softmax_grad(w: np.ndarray, X: np.ndarray, y: np.ndarray, l2: float) -> np.ndarray:
    """Gradient of the mean cross-entropy (+ l2/2 |w|^2) of softmax(X @ w)."""
    z = X @ w
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return X.T @ p / len(y) + l2 * w


def worker(store_name: str, X: np.ndarray, y: np.ndarray, steps: int, l2: float) -> None:
    """One process: its shard (X, y) of the training set, ``steps`` steps."""
    store = shmps.attach(store_name)
    try:
        store.join()
        W = store["W"]  # its first push waits until all the workers have joined
        for _ in range(steps):
            W.push(softmax_grad(W.pull(), X, y, l2))  # this clock's round
            store.clock(timeout=60)                   # barrier: the round is applied
    finally:
        store.close()


def full_batch(X: np.ndarray, y: np.ndarray, steps: int, lr: float, l2: float) -> np.ndarray:
    """The single-process reference: plain full-batch gradient descent."""
    w = np.zeros((X.shape[1], 10))
    for _ in range(steps):
        w = w - lr * softmax_grad(w, X, y, l2)
    return w


def accuracy(w: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
    return float(((X @ w).argmax(axis=1) == y).mean())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=at_least_one, default=4)
    ap.add_argument("--steps", type=at_least_one, default=200)
    ap.add_argument("--lr", type=non_negative, default=2.0)
    ap.add_argument("--l2", type=non_negative, default=1e-4)
    args = ap.parse_args(argv)
    X_tr, X_te, y_tr, y_te = load_data(args.workers)
    store_name = f"syncsgd-{uuid.uuid4().hex[:8]}"
    store = shmps.attach(store_name, staleness=0)
    try:
        store.dense("W", shape=(X_tr.shape[1], 10), dtype="float64",
                    optimizer=shmps.SGD(lr=args.lr), aggregate="mean", workers=args.workers)
        ctx = mp.get_context("spawn")
        shards = np.array_split(np.arange(len(y_tr)), args.workers)  # equal sizes
        procs = [ctx.Process(target=worker, args=(store_name, X_tr[i], y_tr[i], args.steps,
                                                  args.l2))
                 for i in shards]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        elapsed = time.perf_counter() - t0
        if any(p.exitcode != 0 for p in procs):
            print("a worker failed", file=sys.stderr)
            return 1
        W = store["W"]
        w = W.pull()
        rounds = W.rounds()
        updates = W.stats()["step"]
    finally:
        store.destroy()

    ref = full_batch(X_tr, y_tr, args.steps, args.lr, args.l2)
    diff = float(np.abs(w - ref).max())
    print(f"shmps synchronous SGD, {args.workers} processes x {len(y_tr) // args.workers} "
          f"examples: {args.steps} steps in {elapsed:.2f} s ({updates} updates, "
          f"{rounds['applied']} rounds applied), held-out accuracy {accuracy(w, X_te, y_te):.4f}")
    print(f"single-process full-batch gradient descent:            "
          f"held-out accuracy {accuracy(ref, X_te, y_te):.4f}")
    print(f"largest difference between the two weight matrices: {diff:.3g}")
    ok = diff <= 1e-9 and updates == args.steps
    print("OK: equal to full-batch gradient descent (to 1e-9)" if ok else
          "FAIL: differs from full-batch gradient descent")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
