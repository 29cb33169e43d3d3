"""Sparse logistic regression with FTRL: 4 processes, one shared table, hashed features.

A synthetic click log: every impression has 10 categorical fields (vocabularies
from 3 to a million values, drawn with a heavy skew, as real ids are), each
(field, value) hashed into a space of 2**20 features (the hashing trick).  The
click probability is the logistic function of a bias plus a known true weight per
feature: a unit normal per hashed feature, scaled per field (from 1 for the
small fields down to 0.1 for the million-value one: each rare id carries little
signal, as in real logs).  Four
processes each stream their share of the log in minibatches: pull the weights of
the batch's features from a shmps table (``store.table``, rows created on first
touch), compute the logistic-loss gradient, push it back; the table applies
FTRL-proximal (McMahan et al. 2013) per coordinate, in C, exactly.  After each
epoch (a ``store.clock()`` barrier with staleness 0) worker 0 prints the held-out
log-loss and AUC beside the same figures for the true weights; at the end the
recovered weights are compared with the truth.

    python examples/sparse_ftrl.py        # 4 workers, 3 epochs over 400k impressions
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

D = 1 << 20                      # hashed feature space
BIAS_KEY = D                     # one extra key for the bias
VOCAB = np.array([3, 12, 50, 200, 1000, 5000, 20000, 100000, 400000, 1000000])
SCALE = np.array([1.0, 1.0, 0.8, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1])  # per field
TRUE_BIAS = -1.5
TRUE_SEED = 12345


def true_weights() -> np.ndarray:
    """A unit normal per hashed feature (the same in every process); the true weight
    of feature ``k`` of field ``f`` is ``SCALE[f] * true_weights()[k]``."""
    return np.random.default_rng(TRUE_SEED).normal(0.0, 1.0, D)


def hash_features(field: np.ndarray, value: np.ndarray) -> np.ndarray:
    """splitmix64 of (field, value), modulo D: the hashing trick (uint64)."""
    x = (field.astype(np.uint64) << np.uint64(40)) ^ value.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return x % np.uint64(D)


def click_log(n: int, seed: int, w_true: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``n`` impressions: (hashed feature ids, shape (n, fields), uint64; clicks 0/1)."""
    rng = np.random.default_rng(seed)
    u = rng.random((n, len(VOCAB)))
    values = np.floor(VOCAB * u ** 3).astype(np.int64)  # skewed: small ids are common
    fields = np.broadcast_to(np.arange(len(VOCAB)), values.shape)
    keys = hash_features(fields, values)
    logit = (SCALE * w_true[keys.astype(np.int64)]).sum(axis=1) + TRUE_BIAS
    clicks = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float64)
    return keys, clicks


def predict(table, keys: np.ndarray) -> np.ndarray:
    """Click probabilities of impressions ``keys`` with the table's weights."""
    uniq, inv = np.unique(keys, return_inverse=True)
    w = table.pull(uniq, create=False)[:, 0].astype(np.float64)  # unseen features: 0
    bias = float(table.pull(np.array([BIAS_KEY], np.uint64), create=False)[0, 0])
    logit = w[inv.reshape(keys.shape)].sum(axis=1) + bias
    return 1.0 / (1.0 + np.exp(-np.clip(logit, -35, 35)))


def logloss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def auc(p: np.ndarray, y: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties averaged)."""
    order = np.argsort(p, kind="mergesort")
    ranks = np.empty(len(p))
    sp = p[order]
    # average ranks of ties
    starts = np.r_[0, np.flatnonzero(sp[1:] != sp[:-1]) + 1]
    ends = np.r_[starts[1:], len(p)]
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    pos = y == 1
    npos, nneg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - npos * (npos + 1) / 2) / (npos * nneg))


def worker(rank: int, nworkers: int, store_name: str, args: argparse.Namespace) -> None:
    w_true = true_weights()
    keys, clicks = click_log(args.train // nworkers, 1 + rank, w_true)
    test_keys, test_clicks = click_log(args.test, 0, w_true) if rank == 0 else (None, None)
    store = shmps.attach(store_name)
    try:
        store.join()
        T = store["w"]
        rng = np.random.default_rng(rank)
        bias = np.array([BIAS_KEY], np.uint64)
        for epoch in range(args.epochs):
            t0 = time.perf_counter()
            order = rng.permutation(len(clicks))
            for s in range(0, len(order), args.batch):
                idx = order[s:s + args.batch]
                k, y = keys[idx], clicks[idx]
                uniq, inv = np.unique(k, return_inverse=True)
                inv = inv.reshape(k.shape)
                w = T.pull(uniq)[:, 0].astype(np.float64)
                b = float(T.pull(bias)[0, 0])
                p = 1.0 / (1.0 + np.exp(-np.clip(w[inv].sum(axis=1) + b, -35, 35)))
                g = p - y                                      # dloss/dlogit per impression
                grad = np.bincount(inv.ravel(), weights=np.repeat(g, k.shape[1]),
                                   minlength=len(uniq))
                T.push(np.r_[uniq, bias], np.r_[grad, g.sum()][:, None])
            store.clock(timeout=120)  # staleness 0: every worker finished this epoch
            if rank == 0:
                p = predict(T, test_keys)
                print(f"epoch {epoch + 1}: held-out log-loss {logloss(p, test_clicks):.4f}, "
                      f"AUC {auc(p, test_clicks):.4f}  ({len(T)} features in the table, "
                      f"{time.perf_counter() - t0:.2f} s)", flush=True)
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=at_least_one, default=4)
    ap.add_argument("--epochs", type=at_least_one, default=3)
    ap.add_argument("--train", type=at_least_one, default=400_000, help="impressions to train on")
    ap.add_argument("--test", type=at_least_one, default=50_000, help="held-out impressions")
    ap.add_argument("--batch", type=at_least_one, default=256)
    ap.add_argument("--alpha", type=non_negative, default=0.2)
    ap.add_argument("--l1", type=non_negative, default=0.5)
    ap.add_argument("--l2", type=non_negative, default=1.0)
    args = ap.parse_args(argv)
    if not hasattr(shmps.Store, "table"):
        print("this example needs shmps tables (store.table), which this build lacks")
        return 0
    store_name = f"ftrl-{uuid.uuid4().hex[:8]}"
    store = shmps.attach(store_name, staleness=0)
    w_true = true_weights()
    test_keys, test_clicks = click_log(args.test, 0, w_true)
    p_true = 1.0 / (1.0 + np.exp(-((SCALE * w_true[test_keys.astype(np.int64)]).sum(axis=1)
                                   + TRUE_BIAS)))
    print(f"click log: {args.train} training impressions, {len(VOCAB)} fields hashed into "
          f"{D} features; click rate {test_clicks.mean():.3f}; the true weights score "
          f"held-out log-loss {logloss(p_true, test_clicks):.4f}, AUC "
          f"{auc(p_true, test_clicks):.4f}", flush=True)
    try:
        T = store.table("w", dim=1, capacity=D + 1, dtype="float32",
                        optimizer=shmps.FTRL(alpha=args.alpha, beta=1.0, l1=args.l1, l2=args.l2))
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(r, args.workers, store_name, args))
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
        p = predict(T, test_keys)
        final_auc, true_auc = auc(p, test_clicks), auc(p_true, test_clicks)
        # recovered weights vs the truth, on features seen often enough to be learnt
        # (>= 50 times in worker 0's share, so >= ~200 times in all)
        keys = T.keys()
        keys = keys[keys != BIAS_KEY]
        train_keys, _ = click_log(args.train // args.workers, 1, w_true)  # worker 0's share
        freq, truth = [], []
        for f in range(len(VOCAB)):
            k, c = np.unique(train_keys[:, f], return_counts=True)
            freq.append(k[c >= 50])
            truth.append(SCALE[f] * w_true[k[c >= 50].astype(np.int64)])
        frequent = np.concatenate(freq)
        w = T.pull(frequent, create=False)[:, 0]
        corr = float(np.corrcoef(w, np.concatenate(truth))[0, 1])
        nonzero = int(np.count_nonzero(T.pull(keys)))
        pushes = T.stats()["pushes"]
    finally:
        store.destroy()
    print(f"shmps FTRL, {args.workers} processes: {pushes} pushes in {elapsed:.2f} s; "
          f"{len(keys)} features touched, {nonzero} non-zero (L1)")
    print(f"held-out AUC {final_auc:.4f} (true weights {true_auc:.4f}); correlation of the "
          f"recovered weights with the truth on the {len(frequent)} frequent features: {corr:.3f}")
    ok = final_auc >= true_auc - 0.03 and corr >= 0.9
    print("OK: AUC within 0.03 of the true weights', correlation >= 0.9" if ok else
          "FAIL: AUC more than 0.03 below the true weights', or correlation < 0.9")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
