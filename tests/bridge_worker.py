"""A training worker for the multi-host tests: run as ``python bridge_worker.py JSON``.

The JSON says what to do on one host's store (``store``, ``namespace``):

- ``create``: tensors to get-or-create: ``{"dense": {name: [shape, dtype, optimizer,
  shard_rows]},
  "table": {name: [dim, dtype, capacity(, shards)]},
  "csr": {name: [rows, cols, seed, dtype, shard_rows]}}`` (optimizer: "sum" or an SGD
  lr; a csr tensor's structure is ``csr_structure(rows, cols, seed)``, the same
  everywhere);
- ``pushes``: how many rounds; each round pushes +1 to every row of each dense tensor,
  ``[1]*dim`` to every key in ``keys`` of each table and +1 to every entry of each csr
  tensor; ``sleep`` between rounds;
- ``flush``: call ``store.flush(timeout)`` at the end (and every ``flush_every`` rounds);
  with ``catch_lost``, a flush raising ``shmps.PushesLost`` is counted (``lost_flushes``)
  and training goes on;
- ``pull``: print the pulled tensors.

Prints one JSON line: the rounds done and (with ``pull``) the pulled values as lists.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

import shmps


def csr_structure(rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A random sparsity structure (0 to 7 entries a row), the same for the same seed."""
    rng = np.random.default_rng(seed)
    per = rng.integers(0, 8, rows)
    ci = np.concatenate([np.sort(rng.choice(cols, k, replace=False)) for k in per])
    return np.concatenate(([0], np.cumsum(per))), ci


def create(store: shmps.Store, what: dict) -> dict:
    """Get-or-create the tensors ``what`` (the spec's ``create``) in ``store``; returns
    them by name (dense first, then tables, then csr)."""
    made = {}
    for name, (shape, dtype, opt, shard_rows) in what.get("dense", {}).items():
        upd = shmps.SGD(lr=opt) if isinstance(opt, (int, float)) else None
        made[name] = store.dense(name, tuple(shape), dtype, optimizer=upd, shard_rows=shard_rows)
    for name, (dim, dtype, cap, *shards) in what.get("table", {}).items():
        made[name] = store.table(name, dim=dim, dtype=dtype, capacity=cap,
                                 **({"shards": shards[0]} if shards else {}))
    for name, (rows, cols, seed, dtype, shard_rows) in what.get("csr", {}).items():
        rc, ci = csr_structure(rows, cols, seed)
        made[name] = store.csr(name, rc, ci, dtype, shard_rows=shard_rows)
    return made


def main() -> None:
    spec = json.loads(sys.argv[1])
    store = shmps.attach(spec["store"], namespace=spec["namespace"])
    made = create(store, spec.get("create", {}))
    keys = np.asarray(spec.get("keys", []), dtype=np.uint64)
    rounds = int(spec.get("pushes", 0))
    done = lost_flushes = 0

    def flush() -> None:
        nonlocal lost_flushes
        try:
            store.flush(timeout=spec.get("flush_timeout", 30.0))
        except shmps.PushesLost:
            if not spec.get("catch_lost"):
                raise
            lost_flushes += 1

    for _ in range(rounds):
        for name, t in made.items():
            if t.kind == "dense":
                t.push(np.ones(t.shape, dtype=t.dtype if t.dtype != np.float16 else "float32"))
            elif t.kind == "csr":
                rc, ci = t.structure()
                t.push(shmps.CSR(rc, ci, np.ones(ci.size, t.dtype)))
            elif len(keys):
                t.push(keys, np.ones((len(keys), t.dim), dtype=t.dtype))
        done += 1
        if spec.get("sleep"):
            time.sleep(spec["sleep"])
        if spec.get("flush_every") and done % spec["flush_every"] == 0:
            flush()
    if spec.get("flush"):
        flush()
    out: dict = {"rounds": done, "lost_flushes": lost_flushes}
    if spec.get("pull"):
        pulled = {}
        for name in spec["pull"]:
            t = store[name]
            if t.kind == "dense":
                pulled[name] = t.pull().tolist()
            elif t.kind == "csr":
                pulled[name] = t.pull().value.tolist()
            else:
                pulled[name] = t.pull(keys).tolist()
        out["pulled"] = pulled
    store.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
