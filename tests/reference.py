"""A float64 numpy reference of every updater, written from docs/updaters.md, and of the
table init generator (docs/tables.md).  The tests compare shmps (C, float32/float64)
against it; nothing here imports the compiled core.

``step(name, params, w, g, state, t)`` applies one push to arrays ``w`` (values) and
``g`` (gradient, duplicates already summed where docs/updaters.md says so) with the
state dict ``state`` and step ``t``, in float64, in place.  ``RefDense``, ``RefTable``
and ``RefCSR`` model the three tensor kinds: which values a push touches, when the step
advances, how duplicates accumulate.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

SEQUENTIAL = ("Sum", "Assign", "Max", "Min")


def params_of(opt: Any) -> dict:
    """The updater's parameters as a dict (from a shmps updater object's to_dict())."""
    d = dict(opt.to_dict())
    d.pop("type")
    return d


def kind_of(opt: Any) -> str:
    return type(opt).__name__


def sequential(opt: Any) -> bool:
    """Duplicates applied one after the other (else summed first)."""
    k = kind_of(opt)
    return k in SEQUENTIAL or (k == "SGD" and opt.weight_decay == 0)


def new_state(opt: Any, shape: tuple) -> dict:
    """Initial state arrays (float64)."""
    k, p = kind_of(opt), params_of(opt)
    z = lambda: np.zeros(shape, np.float64)  # noqa: E731
    if k == "Momentum":
        return {"b": z()}
    if k == "Adagrad":
        return {"s": np.full(shape, p["initial_accumulator_value"], np.float64)}
    if k == "Adam":
        st = {"m": z(), "v": z()}
        if p["amsgrad"]:
            st["vmax"] = z()
        return st
    if k == "FTRL":
        return {"z": z(), "n": z()}
    return {}


def step(opt: Any, w: np.ndarray, g: np.ndarray, state: dict, t: int) -> None:
    """One push of gradient ``g`` onto ``w`` (float64 arrays of one shape), in place."""
    k, p = kind_of(opt), params_of(opt)
    g = np.asarray(g, np.float64)
    if k == "Sum":
        w += g
    elif k == "Assign":
        w[...] = g
    elif k == "Max":
        np.maximum(w, g, out=w)
    elif k == "Min":
        np.minimum(w, g, out=w)
    elif k == "SGD":
        d = g + p["weight_decay"] * w
        w -= p["lr"] * d
    elif k == "Momentum":
        d = g + p["weight_decay"] * w
        b = state["b"]
        if t == 1:
            b[...] = d
        else:
            b[...] = p["momentum"] * b + (1 - p["dampening"]) * d
        w -= p["lr"] * (d + p["momentum"] * b if p["nesterov"] else b)
    elif k == "Adagrad":
        d = g + p["weight_decay"] * w
        clr = p["lr"] / (1 + (t - 1) * p["lr_decay"])
        s = state["s"]
        s += d * d
        w -= clr * d / (np.sqrt(s) + p["eps"])
    elif k == "Adam":
        b1, b2 = p["betas"]
        d = g + p["weight_decay"] * w
        m, v = state["m"], state["v"]
        m += (1 - b1) * (d - m)
        v[...] = b2 * v + (1 - b2) * d * d
        if p["amsgrad"]:
            np.maximum(state["vmax"], v, out=state["vmax"])
            u = state["vmax"]
        else:
            u = v
        w -= (p["lr"] / (1 - b1 ** t)) * m / (np.sqrt(u) / math.sqrt(1 - b2 ** t) + p["eps"])
    elif k == "FTRL":
        z, n = state["z"], state["n"]
        sigma = (np.sqrt(n + g * g) - np.sqrt(n)) / p["alpha"]
        z += g - sigma * w
        n += g * g
        wn = -(z - np.sign(z) * p["l1"]) / ((p["beta"] + np.sqrt(n)) / p["alpha"] + p["l2"])
        w[...] = np.where(np.abs(z) <= p["l1"], 0.0, wn)
    else:
        raise NotImplementedError(k)


def _aggregate(idx: np.ndarray, g: np.ndarray) -> tuple[list, list]:
    """Unique indices in order of first occurrence, and their summed gradients."""
    order: dict = {}
    for i, x in enumerate(idx.tolist()):
        if x in order:
            order[x] = order[x] + g[i]
        else:
            order[x] = np.array(g[i], np.float64)
    return list(order), list(order.values())


def combine(opt: Any, grads: list) -> np.ndarray:
    """What a table push does with a key's repeated gradients: sum them (sum, SGD and
    the stateful updaters), take the element-wise max or min, or the last (assign)."""
    k = kind_of(opt)
    if k == "Assign":
        return grads[-1]
    if k == "Max":
        return np.maximum.reduce(grads)
    if k == "Min":
        return np.minimum.reduce(grads)
    return np.sum(grads, axis=0)


def _occurrences(opt: Any, idx: np.ndarray, g: np.ndarray) -> list[tuple[Any, list]]:
    """Per distinct index (first-occurrence order): the gradients its updates apply:
    each occurrence for sequential updaters, the sum otherwise."""
    if sequential(opt):
        groups: dict = {}
        for i, x in enumerate(idx.tolist()):
            groups.setdefault(x, []).append(np.asarray(g[i], np.float64))
        return list(groups.items())
    keys, sums = _aggregate(idx, g)
    return [(k, [s]) for k, s in zip(keys, sums)]


class RefDense:
    """A dense tensor: per-tensor step, rows= pushes touch only their rows."""

    def __init__(self, opt: Any, init: np.ndarray) -> None:
        self.opt = opt
        self.w = np.array(init, np.float64)
        self.state = new_state(opt, self.w.shape)
        self.t = 0

    def push(self, g: np.ndarray, rows: Optional[np.ndarray] = None) -> None:
        self.t += 1
        if rows is None:
            step(self.opt, self.w, g, self.state, self.t)
            return
        for r, grads in _occurrences(self.opt, np.asarray(rows), np.asarray(g)):
            sub = {k: v[r] for k, v in self.state.items()}
            w = self.w[r].copy()
            for gi in grads:
                step(self.opt, w, gi, sub, self.t)
            self.w[r] = w
            for k in sub:
                self.state[k][r] = sub[k]


class RefTable:
    """A table: rows created from ``init_row(key)`` on first touch, per-row steps,
    duplicate keys combined first (``combine``), push counts (occurrences) and last push
    steps per row."""

    def __init__(self, opt: Any, dim: int, init_row: Any) -> None:
        self.opt, self.dim, self.init_row = opt, dim, init_row
        self.rows: dict[int, np.ndarray] = {}
        self.state: dict[int, dict] = {}
        self.steps: dict[int, int] = {}
        self.pushes: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.t = 0  # table pushes

    def _create(self, key: int, last: int) -> None:
        if key not in self.rows:
            self.rows[key] = np.array(self.init_row(key), np.float64)
            self.state[key] = new_state(self.opt, (self.dim,))
            self.steps[key] = 0
            self.pushes[key] = 0
            self.last[key] = last

    def new_keys(self, keys: Any) -> int:
        return len({int(k) for k in keys} - set(self.rows))

    def pull(self, keys: Any, create: bool = True) -> np.ndarray:
        out = np.zeros((len(keys), self.dim))
        for i, k in enumerate(int(x) for x in keys):
            if create:
                self._create(k, self.t)
            if k in self.rows:
                out[i] = self.rows[k]
        return out

    def push(self, keys: Any, g: np.ndarray) -> None:
        self.t += 1
        keys = np.asarray(keys, np.uint64)
        for k in keys.tolist():
            self._create(int(k), self.t)
        groups: dict = {}
        for k, gi in zip(keys.tolist(), np.asarray(g, np.float64)):
            groups.setdefault(int(k), []).append(gi)
        for k, grads in groups.items():
            self.steps[k] += 1
            step(self.opt, self.rows[k], combine(self.opt, grads), self.state[k], self.steps[k])
            self.last[k] = self.t
        for k in keys.tolist():  # every occurrence counts
            self.pushes[int(k)] += 1

    def delete(self, keys: Any) -> int:
        n = 0
        for k in {int(x) for x in keys}:
            if k in self.rows:
                for d in (self.rows, self.state, self.steps, self.pushes, self.last):
                    del d[k]
                n += 1
        return n

    def evict(self, min_pushes: Optional[int] = None, idle_steps: Optional[int] = None) -> int:
        cold = [k for k in self.rows
                if (min_pushes is not None and self.pushes[k] < min_pushes)
                or (idle_steps is not None and self.t - self.last[k] >= idle_steps)]
        return self.delete(cold)


class RefCSR:
    """A csr tensor: the structure's values, per-row steps, pushed entries only."""

    def __init__(self, opt: Any, rowcnt: np.ndarray, colidx: np.ndarray,
                 values: np.ndarray) -> None:
        self.opt = opt
        self.rowcnt, self.colidx = np.asarray(rowcnt), np.asarray(colidx)
        self.w = np.array(values, np.float64)
        self.state = new_state(opt, self.w.shape)
        self.steps = np.zeros(len(rowcnt) - 1, np.int64)

    def pos(self, row: int, col: int) -> int:
        a, b = int(self.rowcnt[row]), int(self.rowcnt[row + 1])
        k = a + int(np.searchsorted(self.colidx[a:b], col))
        assert k < b and self.colidx[k] == col, (row, col)
        return k

    def push(self, rowcnt: np.ndarray, colidx: np.ndarray, g: np.ndarray) -> None:
        for r in range(len(rowcnt) - 1):
            a, b = int(rowcnt[r]), int(rowcnt[r + 1])
            if a == b:
                continue
            self.steps[r] += 1
            idx = np.array([self.pos(r, int(c)) for c in colidx[a:b]])
            for k, grads in _occurrences(self.opt, idx, np.asarray(g[a:b])):
                sub = {n: v[k:k + 1] for n, v in self.state.items()}
                w = self.w[k:k + 1]
                for gi in grads:
                    step(self.opt, w, np.array([gi]), sub, int(self.steps[r]))


# ---- the table init generator (docs/tables.md) ---------------------------------------

M64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def mix64(z: int) -> int:
    """splitmix64's finaliser, on Python ints."""
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def key_hash(key: int) -> int:
    return mix64(key + GAMMA)


def key_shard(key: int, nshards: int) -> int:
    return ((key_hash(key) >> 32) * nshards) >> 32


def init_row(spec: list, seed: int, key: int, dim: int) -> np.ndarray:
    """The float64 initial row of ``key`` for a normalised init spec."""
    kind = spec[0]
    if kind == "zeros":
        return np.zeros(dim)
    if kind == "constant":
        return np.full(dim, float(spec[1]))
    r0 = mix64(key ^ mix64(seed + GAMMA))
    word = lambda c: mix64(r0 + (c + 1) * GAMMA)  # noqa: E731
    out = np.empty(dim)
    if kind == "uniform":
        a, b = spec[1], spec[2]
        for j in range(dim):
            out[j] = a + (b - a) * ((word(j) >> 11) * 2.0 ** -53)
        return out
    mean, std = spec[1], spec[2]
    for j in range(dim):
        p = j >> 1
        u1 = ((word(2 * p) >> 11) + 1) * 2.0 ** -53
        u2 = (word(2 * p + 1) >> 11) * 2.0 ** -53
        rad = math.sqrt(-2.0 * math.log(u1))
        z = rad * (math.sin(2 * math.pi * u2) if j & 1 else math.cos(2 * math.pi * u2))
        out[j] = mean + std * z
    return out
