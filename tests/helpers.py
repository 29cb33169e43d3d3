"""Shared by the multi-process tests: spawned workers with a hard timeout and a
guaranteed kill, lock-free shared flags, dead tokens, and store clean-up that works
even after a child was killed in the middle of creating something.

Workers are plain functions defined here (a 'spawn' child imports this module, not
the test module).  A worker reports through its own pipe; it never touches a lock
that a SIGKILL could leave held, so a test can kill any worker at any instant.

Flags are a ``RawArray("q")`` (no lock): by convention ``flags[0]`` is "go",
``flags[1]`` is "stop", and ``flags[2 + i]`` is worker ``i``'s progress counter.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import struct
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import pytest

CTX = mp.get_context("spawn")
SHM = "/dev/shm"
GO, STOP = 0, 1


# ---- stores -------------------------------------------------------------------------

def child_env(**extra: str) -> dict:
    """The environment of a Python subprocess that must run the shmps under test (this
    tree's with its built module, or the installed package: whichever the tests
    imported), ``extra`` added.  Not the repository root: in a plain install its
    ``shmps/`` holds no compiled module (CI failed so, 2026-11-27)."""
    import shmps

    root = str(Path(shmps.__file__).resolve().parents[1])
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def store_segments(name: str, namespace: Optional[str] = None) -> list[str]:
    """Names (in /dev/shm, no leading '/') of every segment of store ``name``."""
    prefix = f"shmps.{namespace}.{name}." if namespace else f"shmps.{name}."
    return sorted(n for n in os.listdir(SHM) if n.startswith(prefix))


def remove_store(name: str, namespace: Optional[str] = None) -> int:
    """Unlink every segment of store ``name`` without attaching (so it works on a
    corrupt or half-created store); returns how many were removed."""
    n = 0
    for seg in store_segments(name, namespace):
        try:
            os.unlink(os.path.join(SHM, seg))
            n += 1
        except FileNotFoundError:
            pass
    return n


def poke(path: str, offset: int, fmt: str, *values: Any) -> None:
    """Write ``struct.pack(fmt, *values)`` at ``offset`` of a /dev/shm file."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, *values))


def peek(path: str, offset: int, fmt: str) -> tuple:
    with open(path, "rb") as f:
        f.seek(offset)
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))


# ---- flags and waiting --------------------------------------------------------------

def new_flags(nworkers: int) -> Any:
    """go, stop, and one progress counter per worker; lock-free shared int64s."""
    return CTX.RawArray("q", 2 + nworkers)


def wait_until(pred: Callable[[], bool], timeout: float, what: str,
               interval: float = 0.001) -> float:
    """Poll ``pred`` until true; AssertionError after ``timeout`` s.  Returns the wait."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - t0


def _await_go(flags: Any, idx: int, timeout: float = 60.0) -> None:
    flags[2 + idx] = 1  # ready
    deadline = time.monotonic() + timeout
    while not flags[GO]:
        if time.monotonic() > deadline:
            raise TimeoutError("no go signal")
        time.sleep(0.002)


def after_go(go: Any, fn: Callable, *args: Any) -> Any:
    """A worker started ahead of its turn: waits for ``go[GO]``, then returns
    ``fn(*args)``.  Its spawn and imports (about 0.5 s each) are then off the clock, and
    the workers of several rounds start at once instead of one after the other."""
    while not go[GO]:
        time.sleep(0.002)
    return fn(*args)


# ---- workers ------------------------------------------------------------------------

def _child_main(conn: Any, fn: Callable, args: tuple, hard_timeout: float) -> None:
    # Backstop if the parent itself dies: SIGALRM's default action ends us.
    signal.alarm(max(1, int(hard_timeout) + 1))
    try:
        result = fn(*args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    else:
        conn.send(("ok", result))
    finally:
        conn.close()


class Worker:
    """One spawned process and the pipe it reports on."""

    def __init__(self, process: Any, conn: Any, label: str) -> None:
        self.process = process
        self.conn = conn
        self.label = label

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        """SIGKILL (if still running) and reap."""
        if self.process.is_alive():
            try:
                os.kill(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.join(10)

    def result(self, timeout: float) -> Any:
        """The worker's return value; AssertionError (with the child's traceback) if it
        failed, died, or did not finish within ``timeout`` s."""
        if not self.conn.poll(timeout):
            raise AssertionError(f"{self.label} gave no result within {timeout} s "
                                 f"(alive={self.alive()})")
        try:
            status, value = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise AssertionError(f"{self.label} died without a result "
                                 f"(exit code {self.process.exitcode})") from None
        self.process.join(10)
        if status != "ok":
            raise AssertionError(f"{self.label} failed:\n{value}")
        return value


class Workers:
    """Spawns workers; on exit every worker still running is SIGKILLed and reaped,
    whatever happened in the test::

        with Workers() as ws:
            a = ws.start(push_known, ...)
            assert a.result(timeout=30) == ...
    """

    def __init__(self, hard_timeout: float = 120.0) -> None:
        self.hard_timeout = hard_timeout
        self.workers: list[Worker] = []

    def start(self, fn: Callable, *args: Any, label: Optional[str] = None) -> Worker:
        recv, send = CTX.Pipe(duplex=False)
        p = CTX.Process(target=_child_main, args=(send, fn, args, self.hard_timeout),
                        daemon=True)
        p.start()
        send.close()
        w = Worker(p, recv, label or f"{fn.__name__}#{len(self.workers)}")
        self.workers.append(w)
        return w

    def results(self, timeout: float) -> list:
        """Every worker's result, all within ``timeout`` s in total."""
        deadline = time.monotonic() + timeout
        return [w.result(max(0.0, deadline - time.monotonic())) for w in self.workers]

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc: Any) -> None:
        for w in self.workers:
            w.kill()
            w.conn.close()


def fork_dying_at_unlink(after: int, action: Callable[[], Any], match: str = "") -> int:
    """Fork a child that runs ``action()`` and dies (os._exit(0), as a SIGKILL would
    leave things) at its unlink number ``after`` + 1 of a segment whose name holds
    ``match``: the crash point of a removal midway.  Returns the child's pid (exit
    status 0: it died there; 1: ``action`` ended first)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import shmps.store as st
            real, count = st.unlink, [0]

            def dying_unlink(name: str) -> bool:
                if match in name:
                    count[0] += 1
                    if count[0] > after:
                        os._exit(0)
                return real(name)

            st.unlink = dying_unlink
            action()
        finally:
            os._exit(code)
    return pid


def dead_token() -> int:
    """The token of a process that has exited (and been reaped)."""
    with Workers(hard_timeout=30) as ws:
        w = ws.start(own_token)
        tok = w.result(30)
        w.process.join(10)
    assert tok >> 32 == w.pid
    return tok


# ---- known pushes (workers and the parent generate the same ones) ------------------

@contextlib.contextmanager
def holding_the_removal(store: Any) -> Iterator[int]:
    """While it lasts, a live process of its own (as a `shmps-tool gc` deciding about
    ``store``) holds the store's removal claim (retired_by); yields its pid.  After, the
    claim is given back (if ``store`` is still open) and the process ends."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "import sys; from shmps import _native; "
                          "print(_native.token(), flush=True); sys.stdin.read()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=child_env())
    try:
        tok = int(p.stdout.readline())
        store._manifest.array(np.uint64, 400, 1)[0] = tok   # retired_by
        yield p.pid
    finally:
        if store._manifest is not None:
            store._manifest.array(np.uint64, 400, 1)[0] = 0
        p.stdin.close()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:   # (stuck: not left behind)
            p.kill()
            p.wait()


def times_out_for_the_removal_holder(store: Any, action: Callable[[], Any], waited: float,
                                     retry: str) -> None:
    """``action()`` while a live process holds ``store``'s removal (holding_the_removal)
    raises, after ``waited`` s (and not much more), the Timeout that names that process
    and says ``retry``."""
    import re

    import pytest
    import shmps

    with holding_the_removal(store) as pid:
        t0 = time.monotonic()
        with pytest.raises(shmps.Timeout, match=re.escape(
                f"store {store.name!r}: process {pid} has been removing it (`shmps-tool gc`, "
                f"destroy()) or restoring a checkpoint into it for {waited:g} s ({retry})")):
            action()
        assert waited <= time.monotonic() - t0 < waited + 5.0


def known_grads(seed: int, shape: tuple, dtype: str, n_whole: int, n_rows: int):
    """Yield ``(grad, rows)`` pushes, reproducible from ``seed``: ``n_whole`` whole
    pushes (rows None) then ``n_rows`` row pushes whose rows overlap and repeat.
    Values are small integers (exact in every float dtype used), except int8 whose
    full range makes the sums wrap."""
    rng = np.random.default_rng(seed)
    lo, hi = (-128, 128) if dtype == "int8" else (-8, 9)
    nrows = shape[0]
    for k in range(n_whole + n_rows):
        if k < n_whole:
            yield rng.integers(lo, hi, size=shape).astype(dtype), None
        else:
            rows = rng.integers(0, nrows, size=max(1, nrows // 2))
            rows[: len(rows) // 4] = rows[0]  # duplicates inside one push
            yield rng.integers(lo, hi, size=(rows.size,) + tuple(shape[1:])).astype(dtype), rows


def expected_sum(seeds: list, shape: tuple, dtype: str, n_whole: int, n_rows: int,
                 init: int = 0) -> np.ndarray:
    """The exact result of every known push of every seed, summed (int8: mod 256)."""
    acc = np.full(shape, init, np.int64)
    for seed in seeds:
        for g, rows in known_grads(seed, shape, dtype, n_whole, n_rows):
            if rows is None:
                acc += g.astype(np.int64)
            else:
                np.add.at(acc, rows, g.astype(np.int64))
    if dtype == "int8":
        acc = (acc + 128) % 256 - 128
    return acc


# ---- worker functions (run in spawned children) -------------------------------------

def own_token() -> int:
    import shmps._native as native

    return native.token()


def push_known(store: str, tensor: str, seed: int, n_whole: int, n_rows: int,
               flags: Any, idx: int, namespace: Optional[str] = None) -> dict:
    """Push the known gradients of ``seed`` once ``go`` is set; returns counts."""
    import shmps

    s = shmps.attach(store, namespace=namespace)
    try:
        t = s[tensor]
        grads = list(known_grads(seed, t.shape, t.dtype.name, n_whole, n_rows))
        _await_go(flags, idx)
        for g, rows in grads:
            t.push(g, rows=rows)
            flags[2 + idx] += 1
        return {"pushes": len(grads), "pid": os.getpid()}
    finally:
        s.close()


def push_ones(store: str, tensor: str, n: int, flags: Any, idx: int) -> int:
    """Push a gradient of ones, whole, ``n`` times once ``go`` is set; returns ``n``."""
    import shmps

    s = shmps.attach(store)
    try:
        t = s[tensor]
        g = np.ones(t.shape, np.float32 if t.dtype == np.float16 else t.dtype)
        _await_go(flags, idx)
        for k in range(n):
            t.push(g)
            flags[2 + idx] = k + 1
        return n
    finally:
        s.close()


def push_loop(store: str, tensor: str, value: int, flags: Any, idx: int,
              check_every: int = 0, low_bits: int = 20, max_seconds: float = 60.0) -> dict:
    """Push ``value`` everywhere, alternating whole pushes and ``rows=`` pushes of
    every row (shuffled), until ``stop``; count pushes and time the slowest.

    With ``check_every``, every so many pushes take a consistent pull and count
    shards whose low ``low_bits`` bits are not all equal (a survivor's push is
    whole, so its ``value``s must show up the same number of times everywhere)."""
    import shmps

    s = shmps.attach(store)
    try:
        t = s[tensor]
        rng = np.random.default_rng(idx)
        g = np.full(t.shape, value, t.dtype)
        n = worst = 0
        torn = 0
        _await_go(flags, idx)
        t_end = time.monotonic() + max_seconds
        while not flags[STOP] and time.monotonic() < t_end:
            t0 = time.monotonic()
            if n % 2:
                t.push(g)
            else:
                t.push(g, rows=rng.permutation(t.nrows))
            worst = max(worst, time.monotonic() - t0)
            n += 1
            flags[2 + idx] = n
            if check_every and n % check_every == 0:
                a = t.pull().reshape(t.nshards, -1) & ((1 << low_bits) - 1)
                torn += int(np.sum(a.min(axis=1) != a.max(axis=1)))
        return {"pushes": n, "worst": worst, "torn": torn}
    finally:
        s.close()


def publish_token(flags: Any, idx: int, max_seconds: float = 60.0) -> int:
    """Put this process's token in worker idx's counter and stay alive until ``stop``:
    a live owner for a lock word a test writes it into."""
    import shmps._native as native

    flags[2 + idx] = native.token()
    t_end = time.monotonic() + max_seconds
    while not flags[STOP] and time.monotonic() < t_end:
        time.sleep(0.005)
    return 0


def table_push_loop(store: str, tensor: str, nkeys: int, flags: Any, idx: int,
                    max_seconds: float = 60.0) -> int:
    """Push +1 to every element of table keys 0..nkeys-1 until ``stop``; the count."""
    import shmps

    s = shmps.attach(store)
    try:
        t = s[tensor]
        keys = np.arange(nkeys, dtype=np.uint64)
        g = np.ones((nkeys, t.dim), t.dtype)
        n = 0
        _await_go(flags, idx)
        t_end = time.monotonic() + max_seconds
        while not flags[STOP] and time.monotonic() < t_end:
            t.push(keys, g)
            n += 1
            flags[2 + idx] = n
        return n
    finally:
        s.close()


def create_new_keys(store: str, tensor: str, first: int, batch: int, flags: Any,
                    idx: int, max_seconds: float = 60.0) -> int:
    """Push batches of ``batch`` new keys (``first``, ``first + 1``, ...) until ``stop``:
    most of the time inside the table's creation lock (a creator to SIGKILL there)."""
    import shmps

    s = shmps.attach(store)
    try:
        t = s[tensor]
        g = np.ones((batch, t.dim), t.dtype)
        n = 0
        _await_go(flags, idx)
        t_end = time.monotonic() + max_seconds
        while not flags[STOP] and time.monotonic() < t_end:
            flags[2 + idx] = n + 1                        # creating batch n
            t.push(np.arange(first + n * batch, first + (n + 1) * batch, dtype=np.uint64), g)
            n += 1
        return n
    finally:
        s.close()


def keys_observer(store: str, tensor: str, nstable: int, flags: Any, idx: int,
                  max_seconds: float = 60.0) -> dict:
    """Call ``keys()`` until ``stop`` and count the calls that miss one of the stable
    keys 0..nstable-1 (other keys must be >= nstable); also read_rows(keys=None) of
    every shard, the bridge's snapshot, which lists the same rows."""
    import shmps

    s = shmps.attach(store)
    try:
        t = s[tensor]
        calls = bad = worst = 0
        _await_go(flags, idx)
        t_end = time.monotonic() + max_seconds
        while not flags[STOP] and time.monotonic() < t_end:
            k = t.keys()
            miss = nstable - int(np.count_nonzero(k < nstable))
            if calls % 4 == 3:                            # the snapshot's listing too
                got = sum(int(np.count_nonzero(t._snapshot(sh).index < nstable))
                          for sh in range(t.nshards))
                miss = max(miss, nstable - got)
            calls += 1
            bad += miss > 0
            worst = max(worst, miss)
            flags[2 + idx] = calls
        return {"calls": calls, "bad": bad, "worst": worst}
    finally:
        s.close()


def create_dense(store: str, tensor: str, shape: tuple, dtype: str, init: float,
                 flags: Any, idx: int) -> bool:
    """Attach, then create ``tensor`` (flags progress: 1 = attached, about to create;
    2 = created)."""
    import shmps

    s = shmps.attach(store)
    flags[2 + idx] = 1
    s.dense(tensor, shape=shape, dtype=dtype, init=init)
    flags[2 + idx] = 2
    s.close()
    return True


def attach_loop(store: str, flags: Any, idx: int) -> int:
    """Attach and close ``store`` repeatedly until ``stop`` (a target to be killed)."""
    import shmps

    n = 0
    _await_go(flags, idx)
    while not flags[STOP]:
        shmps.attach(store).close()
        n += 1
        flags[2 + idx] = n
    return n


def race_attach(store: str, specs: list, flags: Any, idx: int,
                namespace: Optional[str] = None) -> dict:
    """Once ``go``: attach, get-or-create every ``(name, shape, dtype)`` of ``specs``,
    push ones into each; returns what this process saw."""
    import shmps

    _await_go(flags, idx)
    s = shmps.attach(store, namespace=namespace)
    try:
        seen = {}
        for name, shape, dtype in specs:
            t = s.dense(name, shape=shape, dtype=dtype)
            t.push(np.ones(shape, dtype))
            seen[name] = (t.record["id"], t.nshards)
        return seen
    finally:
        s.close()


def hold_manifest_lock_and_die(store: str) -> None:
    """Take the store's (robust) manifest mutex, then SIGKILL ourselves holding it."""
    import shmps
    import shmps._native as native

    s = shmps.attach(store)
    code = native.lib.shmps_manifest_lock(s._mptr, 5.0)
    assert code in (0, 1), code
    os.kill(os.getpid(), signal.SIGKILL)


def pull_loop(store: str, tensor: str, consistent: bool, flags: Any, idx: int) -> int:
    """Pull the whole tensor until ``stop`` (a reader to be killed mid-pull)."""
    import shmps

    s = shmps.attach(store)
    try:
        t = s[tensor]
        out = np.empty(t.shape, t.dtype)
        n = 0
        _await_go(flags, idx)
        while not flags[STOP]:
            t.pull(out=out, consistent=consistent)
            n += 1
            flags[2 + idx] = n
        return n
    finally:
        s.close()


def assign_writer(store: str, tensor: str, flags: Any, idx: int, how: str = "whole",
                  max_seconds: float = 30.0) -> int:
    """Push ``assign`` of constant arrays k = 1, 2, ... until ``stop``; returns the
    last k.  ``how``: "whole" pushes, or ``rows=`` pushes of every row in order
    ("rows") or shuffled ("shuffled")."""
    import shmps

    s = shmps.attach(store)
    try:
        t = s[tensor]
        g = np.empty(t.shape, t.dtype)
        rng = np.random.default_rng(idx)
        k = 0
        _await_go(flags, idx)
        t_end = time.monotonic() + max_seconds
        while not flags[STOP] and time.monotonic() < t_end:
            k += 1
            g.fill(k)
            if how == "whole":
                t.push(g)
            else:
                rows = np.arange(t.nrows) if how == "rows" else rng.permutation(t.nrows)
                t.push(g, rows=rows)
            flags[2 + idx] = k
        return k
    finally:
        s.close()


def split_ones_pusher(store: str, tensor: str, flags: Any, idx: int,
                      max_seconds: float = 30.0) -> int:
    """Push ones into the whole tensor until ``stop``, each push split over two threads
    as on a machine with two cores or more (dense.NCPU raised to 2; the tensor must be
    at least 16 MiB); returns the pushes made."""
    import shmps
    from shmps import dense

    dense.NCPU = max(2, dense.NCPU)
    s = shmps.attach(store)
    try:
        t = s[tensor]
        g = np.ones(t.shape, t.dtype)
        n = 0
        _await_go(flags, idx)
        t_end = time.monotonic() + max_seconds
        while not flags[STOP] and time.monotonic() < t_end:
            t.push(g)
            n += 1
            flags[2 + idx] = n
        return n
    finally:
        s.close()


def _mixed_units(got: np.ndarray, units: np.ndarray) -> list:
    """(unit, lowest, highest) of each unit whose rows in ``got`` (row i of unit
    ``units[i]``) do not all hold one value."""
    out = []
    for u in np.unique(units):
        part = got[units == u]
        if part.min() != part.max():
            out.append((int(u), float(part.min()), float(part.max())))
    return out


def torn_reader(store: str, tensor: str, consistent: bool, unit: int, flags: Any,
                idx: int, max_seconds: float = 30.0, rows: bool = False) -> dict:
    """Pull until ``stop``; every ``unit`` consecutive elements (a shard for
    consistent pulls, a 16 KiB stripe otherwise; whole rows) must hold one value, and
    a unit's value never goes back in time.  ``rows``: pull rows= in a random order,
    every row and 60 of them in turn; the rows of one unit that one pull took must
    hold one value.  Returns pulls, violations, distinct values seen."""
    import shmps

    s = shmps.attach(store)
    try:
        t = s[tensor]
        out = np.empty(t.shape, t.dtype)
        last = np.zeros(t.size // unit, t.dtype)
        pulls = mixed = backwards = 0
        examples: list = []
        seen: set = set()
        rng = np.random.default_rng(idx)
        nrows = t.shape[0]
        row_len = t.size // nrows
        _await_go(flags, idx)
        t_end = time.monotonic() + max_seconds
        while not flags[STOP] and time.monotonic() < t_end:
            if rows:
                perm = rng.permutation(nrows)[:nrows if pulls % 2 else min(60, nrows)]
                got = t.pull(rows=perm, consistent=consistent).reshape(perm.size, row_len)
                if perm.size < nrows:
                    bad = _mixed_units(got, perm * row_len // unit)
                    mixed += len(bad)
                    examples += bad[:5 - len(examples)]
                    pulls += 1
                    flags[2 + idx] = pulls
                    continue
                out.reshape(nrows, row_len)[perm] = got
            else:
                t.pull(out=out, consistent=consistent)
            u = out.reshape(-1, unit)
            lo, hi = u.min(axis=1), u.max(axis=1)
            bad = np.flatnonzero(lo != hi)
            if bad.size:
                mixed += int(bad.size)
                if len(examples) < 5:
                    examples.append((int(bad[0]), float(lo[bad[0]]), float(hi[bad[0]])))
            backwards += int(np.sum(lo < last))
            last = np.maximum(last, lo)
            seen.update(np.unique(lo).tolist())
            pulls += 1
            flags[2 + idx] = pulls
        return {"pulls": pulls, "mixed": mixed, "backwards": backwards,
                "examples": examples, "distinct": len(seen)}
    finally:
        s.close()


def attach_timing(store: str) -> dict:
    """Time the first ``attach`` of ``store`` in this (fresh) process."""
    import shmps

    t0 = time.perf_counter()
    s = shmps.attach(store, create=False)
    dt = time.perf_counter() - t0
    try:
        return {"seconds": dt, "tensors": len(s.tensors())}
    finally:
        s.close()


def stats_worker(store: str, tensor: str, n_push: int, n_pull: int) -> dict:
    """Push ones ``n_push`` times and pull ``n_pull`` times; returns the stats seen."""
    import shmps

    s = shmps.attach(store)
    try:
        t = s[tensor]
        for _ in range(n_push):
            t.push(np.ones(t.shape, t.dtype))
        for _ in range(n_pull):
            t.pull()
        return t.stats()
    finally:
        s.close()


def attach_and_hold(store: str, flags: Any, idx: int, namespace: Optional[str] = None) -> int:
    """Attach, report ready, stay attached until ``stop``; returns our pid."""
    import shmps

    s = shmps.attach(store, namespace=namespace)
    try:
        flags[2 + idx] = 1
        while not flags[STOP]:
            time.sleep(0.002)
        return os.getpid()
    finally:
        s.close()


def pull_after_destroy(store: str, tensor: str, flags: Any, idx: int) -> list:
    """Attach and map ``tensor``; after the parent destroyed the store (``go``),
    the mapping still reads and writes; returns the pulled values."""
    import shmps

    s = shmps.attach(store)
    try:
        t = s[tensor]
        t.pull()
        _await_go(flags, idx)  # the parent destroys the store, then says go
        t.push(np.ones(t.shape, t.dtype))
        return t.pull().tolist()
    finally:
        s.close()


# ---- the numpy model of a dense tensor (unit and property tests share it) ----------

SEQUENTIAL = ("Sum", "Assign", "Max", "Min")


def compute_dtype(dtype: Any) -> np.dtype:
    """What C computes in: float32 for float16 (and float32), else the dtype."""
    dt = np.dtype(dtype)
    return np.dtype("float32") if dt == np.float16 else dt


class Model:
    """A dense tensor as numpy arrays, updated the way the C updaters are documented
    to (docs/updaters.md, torch.optim.SGD semantics): in the compute dtype, stored
    back in the tensor's dtype after every push; ``rows=`` pushes touch only their
    rows; duplicate rows are applied one after the other for sum/assign/max/min and
    plain SGD, summed first otherwise."""

    def __init__(self, shape: tuple, dtype: Any, optimizer: Any, init: Any = 0) -> None:
        self.dtype = np.dtype(dtype)
        self.c = compute_dtype(self.dtype)
        self.opt = optimizer
        self.kind = type(optimizer).__name__
        self.w = np.empty(shape, self.dtype)
        self.w[...] = init
        self.buf = np.zeros(shape, self.c)  # Momentum's state
        self.step = 0

    def _p(self, name: str) -> Any:
        return self.c.type(getattr(self.opt, name))

    def _apply(self, w: np.ndarray, g: np.ndarray, buf: np.ndarray) -> tuple:
        """New (w, buf) for values ``w`` and gradient ``g`` (compute dtype)."""
        k, c = self.kind, self.c
        if k == "Sum":
            return (w.astype(c) + g).astype(self.dtype), buf
        if k == "Assign":
            return g.astype(self.dtype), buf
        if k == "Max":
            return np.where(g > w.astype(c), g, w.astype(c)).astype(self.dtype), buf
        if k == "Min":
            return np.where(g < w.astype(c), g, w.astype(c)).astype(self.dtype), buf
        p = w.astype(c)
        if k == "SGD":
            lr, wd = self._p("lr"), self._p("weight_decay")
            new = p - lr * g if wd == 0 else p - lr * (g + wd * p)
            return new.astype(self.dtype), buf
        if k == "Momentum":
            lr, mu, damp, wd = (self._p("lr"), self._p("momentum"), self._p("dampening"),
                                self._p("weight_decay"))
            d = g + wd * p
            b = d if self.step <= 1 else mu * buf + (c.type(1) - damp) * d
            new = p - lr * (d + mu * b if self.opt.nesterov else b)
            return new.astype(self.dtype), b.astype(c)
        raise NotImplementedError(k)

    def push(self, grad: Any, rows: Any = None) -> None:
        with np.errstate(over="ignore"):  # integer sums wrap, as in C
            self._push(grad, rows)

    def _push(self, grad: Any, rows: Any) -> None:
        self.step += 1
        g = np.asarray(grad).astype(self.c)
        if rows is None:
            self.w, self.buf = self._apply(self.w, g, self.buf)
            return
        rows = np.asarray(rows, np.int64)
        sequential = self.kind in SEQUENTIAL or (
            self.kind == "SGD" and self.opt.weight_decay == 0)
        if not sequential and rows.size > 1:
            uniq, inv = np.unique(rows, return_inverse=True)
            agg = np.zeros((uniq.size,) + g.shape[1:], self.c)
            for i in range(rows.size):  # in order, in the compute dtype
                agg[inv[i]] = agg[inv[i]] + g[i]
            rows, g = uniq, agg
        for i, r in enumerate(rows):
            self.w[r], self.buf[r] = self._apply(self.w[r], g[i], self.buf[r])

    def check(self, got: np.ndarray, rows: Any = None, what: str = "") -> None:
        """Assert ``got`` equals the model (exactly for ints, to rounding for floats)."""
        want = self.w if rows is None else self.w[np.asarray(rows, np.int64)]
        assert got.dtype == self.dtype and got.shape == want.shape, (got.dtype, got.shape)
        if self.dtype.kind == "i":
            np.testing.assert_array_equal(got, want, err_msg=what)
        else:
            rtol = {"float16": 2e-3, "float32": 1e-5, "float64": 1e-12}[self.dtype.name]
            np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                       rtol=rtol, atol=rtol, err_msg=what)


def poison_frame_buffers(monkeypatch: Any) -> None:
    """Frames written in place (bridge.frames.RowsBuilder) get buffers full of 0xA5
    instead of whatever np.empty returns, so a byte their writers leave unwritten shows
    as a difference from the frame encode_rows makes (the buffers are not zeroed)."""
    from shmps.bridge import frames

    def poisoned(total: int) -> memoryview:
        return memoryview(np.full(total, 0xA5, np.uint8))
    monkeypatch.setattr(frames, "_frame_buffer", poisoned)


# ---- another PID namespace ------------------------------------------------------------

#: Run in a new PID namespace (as its pid 1): makes its next pid ``argv[1]`` and runs the
#: code ``argv[2]`` in that child, whose exit code it passes on.
_AT_PID = r"""
import os, sys, traceback
want, code = int(sys.argv[1]), sys.argv[2]
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(want - 1))
sys.stdout.flush()
child = os.fork()
if child == 0:
    rc = 0
    try:
        assert os.getpid() == want, (os.getpid(), want)
        exec(compile(code, "<other-pid-namespace>", "exec"), {"__name__": "__main__"})
    except BaseException:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
_, status = os.waitpid(child, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def unshare_pid_command() -> list[str]:
    """The command prefix that runs a process in a new PID namespace, /dev/shm and the
    filesystem shared (as the containers of one pod); pytest.skip where the machine does
    not allow it."""
    import shutil
    import subprocess

    import pytest

    exe = shutil.which("unshare")
    if exe is None:
        pytest.skip("no unshare(1) on this machine")
    cmd = [exe, "--pid", "--fork", "--mount-proc"]
    r = subprocess.run(cmd + ["true"], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"new PID namespaces not allowed here: {r.stderr.strip()[:200]}")
    return cmd


#: what to do about a store of another PID namespace, as each verb says it
OTHER_PID_NS_FIX = {
    "attach": "attach from processes of one PID namespace (Kubernetes: "
              "shareProcessNamespace: true), or use another store name or namespace",
    "gc": "run `shmps-tool gc` in that PID namespace",
    "ls": "run `shmps-tool ls` in that PID namespace to see them",
}


def other_pid_ns_message(subject: str, doing: str) -> str:
    """A regular expression of the one message (shmps._native.other_pid_namespace) for
    ``subject`` made in another PID namespace, with the fix for what a process was
    ``doing`` ("attach", "gc", "ls"), written out here so that tests pin its words."""
    import re

    return (re.escape(f"{subject} was made (or is being made) in another PID namespace ")
            + r"\(pid:\[\d+\]; this process is in pid:\[\d+\]\)"
            + re.escape(": its processes cannot tell whether this one is alive, nor this "
                        f"one whether they are ({OTHER_PID_NS_FIX[doing]})"))


def start_in_other_pid_namespace(code: str, pid: int, env: Optional[dict] = None) -> Any:
    """A ``subprocess.Popen`` (text pipes on stdin/stdout) running ``code`` as process
    ``pid`` of a new PID namespace, the filesystem shared: a writer of another host (or
    container) whose pid means nothing here.  ``pytest.skip`` where not allowed."""
    import subprocess
    import sys

    import pytest

    cmd = unshare_pid_command()
    probe = subprocess.run(cmd + [sys.executable, "-c", _AT_PID, "5", "pass"],
                           capture_output=True, text=True, timeout=30, env=env)
    if probe.returncode != 0:
        pytest.skip("a new PID namespace with a chosen pid is not allowed here: "
                    f"{probe.stderr.strip()[-200:]}")
    return subprocess.Popen(cmd + [sys.executable, "-c", _AT_PID, str(pid), code],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)


def build_preload(directory: Any, source: str, what: str) -> str:
    """Compile ``source`` (C) into an LD_PRELOAD library in ``directory`` (``what`` names
    it in a skip); returns its path.  Skips the test where there is no C compiler or
    the build fails (the library only changes one libc call's answer)."""
    import shutil
    import subprocess

    import pytest

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip(f"no C compiler to build the {what} library")
    d = Path(directory)
    (d / "preload.c").write_text(source)
    r = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(d / "preload.so"),
                        str(d / "preload.c"), "-ldl"], capture_output=True, text=True,
                       timeout=120)
    if r.returncode != 0:
        pytest.skip(f"cannot build the {what} library: {r.stderr[-300:]}")
    return str(d / "preload.so")


def _can_mount_tmpfs() -> bool:
    import subprocess
    try:
        r = subprocess.run(["unshare", "-rm", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


#: a test that runs processes on a small /dev/shm of their own (a private tmpfs)
needs_small_shm = pytest.mark.skipif(
    not _can_mount_tmpfs(), reason="needs a private tmpfs on /dev/shm (unshare -rm: user "
    "and mount namespaces), which this machine refuses")
