"""Worker clocks: bounded delay (k = 0, 1, 3) checked from a log of clock events,
eventual mode, dead and departing workers, timeouts and worker ids.

Every worker is a 'spawn' process (helpers.Workers kills and reaps them whatever
happens); the worker functions live here, so a child imports this module.
"""
from __future__ import annotations

import math
import os
import signal
import time

import numpy as np
import pytest

import shmps
from helpers import CTX, Workers, remove_store, store_segments, wait_until

pytestmark = pytest.mark.timeout(120)

NPROCS = 3
CLOCKS = 40


# ---- worker functions (run in spawned children) -------------------------------------

def clock_logger(store: str, k, barrier, slow: bool, nclocks: int) -> list:
    """Join, meet the others at the barrier, then call clock() ``nclocks`` times
    (sleeping 3 ms before each if ``slow``); log (returned clock, min clock of the
    live workers right after) per call."""
    s = shmps.attach(store, staleness=k)
    try:
        s.join()
        barrier.wait(30)
        log = []
        for _ in range(nclocks):
            if slow:
                time.sleep(0.003)
            c = s.clock(timeout=30)
            log.append((c, min(w["clock"] for w in s.workers())))
        s.leave()
        return log
    finally:
        s.close()


def clock_then_report(store: str, barrier, nclocks: int) -> list:
    """Join, barrier, then call clock() ``nclocks`` times; returns the CLOCK_MONOTONIC
    time at which each call returned."""
    s = shmps.attach(store)
    try:
        s.join()
        barrier.wait(30)
        out = []
        for _ in range(nclocks):
            s.clock(timeout=30)
            out.append(time.monotonic())
        return out
    finally:
        s.close()


def idle_worker(store: str, barrier, flags, leave_on_flag: bool, worker=None) -> int:
    """Join (as ``worker`` if given), barrier, then never call clock(): a worker that
    is stuck.  With ``leave_on_flag``, call leave() once ``flags[0]`` is set."""
    s = shmps.attach(store)
    try:
        wid = s.join(worker)
        flags[1] = wid
        if barrier is not None:
            barrier.wait(30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if leave_on_flag and flags[0]:
                s.leave()
                flags[2] = 1
                return wid
            time.sleep(0.001)
        return wid
    finally:
        s.close()


def join_and_report(store: str) -> int:
    """Join and return the clock this worker starts at."""
    s = shmps.attach(store)
    try:
        wid = s.join()
        return next(w["clock"] for w in s.workers() if w["worker"] == wid)
    finally:
        s.close()


# ---- helpers ------------------------------------------------------------------------

def destroy(name: str) -> None:
    s = shmps.attach(name)
    s.destroy()


@pytest.fixture
def clocked_store(store_name):
    """The store's name; the store is destroyed after the test whatever happens."""
    yield store_name
    destroy(store_name)


# ---- tests --------------------------------------------------------------------------

@pytest.mark.parametrize("k", [0, 1, 3])
def test_no_worker_more_than_k_ahead(clocked_store, k):
    """With staleness k and one slow worker among 3, every clock() returns only when
    no live worker is more than k behind (from each worker's log), and fast workers
    do run up to k ahead (the bound is not stricter than asked)."""
    shmps.attach(clocked_store, staleness=k).close()
    barrier = CTX.Barrier(NPROCS)
    with Workers(hard_timeout=60) as ws:
        for i in range(NPROCS):
            ws.start(clock_logger, clocked_store, k, barrier, i == 0, CLOCKS, label=f"w{i}")
        logs = ws.results(60)
    gaps = [c - m for log in logs for c, m in log]
    assert len(gaps) == NPROCS * CLOCKS
    assert max(gaps) <= k, f"a worker returned from clock() {max(gaps)} ahead (k={k})"
    assert max(gaps) == k, f"fast workers never got {k} ahead: gaps {sorted(set(gaps))}"
    assert all(log[-1][0] == CLOCKS for log in logs)


def test_eventual_never_blocks(clocked_store):
    """Without staleness (eventual), a worker's clock() returns at once even when
    another live worker never advances."""
    s = shmps.attach(clocked_store)
    assert s.staleness is None
    flags = CTX.RawArray("q", 3)
    barrier = CTX.Barrier(2)
    try:
        with Workers(hard_timeout=60) as ws:
            ws.start(idle_worker, clocked_store, barrier, flags, True)
            s.join()
            barrier.wait(30)
            t0 = time.monotonic()
            for _ in range(2000):
                s.clock(timeout=1)
            elapsed = time.monotonic() - t0
            clocks = {w["worker"]: w["clock"] for w in s.workers()}
            flags[0] = 1
            ws.results(30)
        assert clocks[s.join()] == 2000 and clocks[flags[1]] == 0
        assert elapsed < 2.0
    finally:
        s.close()


@pytest.mark.parametrize("how", ["sigkill", "leave"])
def test_departed_worker_unblocks_others(clocked_store, how):
    """With k=0, two workers blocked in clock() by a third that never advances return
    within 1 s of it being SIGKILLed, or of its leave()."""
    shmps.attach(clocked_store, staleness=0).close()
    barrier = CTX.Barrier(NPROCS)
    flags = CTX.RawArray("q", 3)
    with Workers(hard_timeout=60) as ws:
        victim = ws.start(idle_worker, clocked_store, barrier, flags, how == "leave",
                          label="victim")
        runners = [ws.start(clock_then_report, clocked_store, barrier, 1, label=f"r{i}")
                   for i in range(NPROCS - 1)]
        s = shmps.attach(clocked_store)
        try:
            # both runners advanced to clock 1 and are waiting for the victim (at 0)
            wait_until(lambda: sorted(w["clock"] for w in s.workers()) == [0, 1, 1], 30,
                       "runners blocked in clock()")
            time.sleep(0.2)
            assert all(r.alive() for r in runners), "clock() returned before the victim left"
            t_gone = time.monotonic()
            if how == "sigkill":
                os.kill(victim.pid, signal.SIGKILL)
            else:
                flags[0] = 1
            returned = [r.result(10)[0] for r in runners]
        finally:
            s.close()
    delays = [t - t_gone for t in returned]
    assert max(delays) < 1.0, f"others unblocked {max(delays):.3f} s after the {how}"


def test_timeout_names_the_slow_worker(clocked_store):
    """clock(timeout=) raises shmps.Timeout (a TimeoutError) naming the worker id and
    pid that is behind."""
    s = shmps.attach(clocked_store, staleness=0)
    flags = CTX.RawArray("q", 3)
    barrier = CTX.Barrier(2)
    try:
        with Workers(hard_timeout=60) as ws:
            slow = ws.start(idle_worker, clocked_store, barrier, flags, True)
            s.join()
            barrier.wait(30)
            t0 = time.monotonic()
            with pytest.raises(shmps.Timeout) as exc:
                s.clock(timeout=0.3)
            assert 0.25 < time.monotonic() - t0 < 2.0
            assert isinstance(exc.value, TimeoutError)
            msg = str(exc.value)
            assert f"worker {flags[1]} (pid {slow.pid})" in msg, msg
            flags[0] = 1
            ws.results(30)
    finally:
        s.close()


def test_a_new_worker_starts_at_the_slowest_live_clock_not_a_dead_one(clocked_store):
    """A worker that joins starts at the slowest *live* worker's clock: a worker killed
    at clock 0 and not yet dropped (nobody waited on it: staleness 10) does not pull
    the new one back to 0.  (join took the minimum over every slot holding a token.)"""
    flags = CTX.RawArray("q", 3)
    s = shmps.attach(clocked_store, staleness=10)
    try:
        with Workers(hard_timeout=60) as ws:
            victim = ws.start(idle_worker, clocked_store, None, flags, False)
            wait_until(lambda: len(s.workers()) == 1, 30, "the victim joined")
            s.join()
            for _ in range(5):
                s.clock(timeout=10)   # 5 ahead of the victim: within k, no wait, no drop
            victim.kill()
            assert ws.start(join_and_report, clocked_store).result(30) == 5
    finally:
        s.close()


def test_join_id_held_by_live_process_is_refused(clocked_store):
    """join(worker=i) raises InvalidArgument while a live process holds id i, and
    succeeds (returning i) once that process is dead."""
    flags = CTX.RawArray("q", 3)
    s = shmps.attach(clocked_store)
    try:
        with Workers(hard_timeout=60) as ws:
            holder = ws.start(idle_worker, clocked_store, None, flags, False, 5)
            wait_until(lambda: any(w["worker"] == 5 for w in s.workers()), 30, "holder joined")
            with pytest.raises(shmps.InvalidArgument):
                s.join(worker=5)
            holder.kill()
            assert s.join(worker=5) == 5
            assert [w["pid"] for w in s.workers() if w["worker"] == 5] == [os.getpid()]
    finally:
        s.close()


@pytest.mark.parametrize("worker", [-5, 2.5, True, "a", 1024, np.array(2.0), np.bool_(True),
                                    np.array([2])])
def test_join_refuses_a_worker_id_that_is_not_one(clocked_store, worker):
    """join(worker=) takes an integer id from 0 to 1023, else InvalidArgument saying so,
    and the process is no worker afterwards.  (int(worker) took -5 as "any id" (0), 2.5
    as 2 and True as 1, raised a plain ValueError for "a", and 1024 got the C core's
    OutOfRange whose hint spoke of rows.)"""
    s = shmps.attach(clocked_store)
    try:
        with pytest.raises(shmps.InvalidArgument, match="from 0 to 1023") as info:
            s.join(worker=worker)
        assert type(info.value) is shmps.InvalidArgument and info.value.hint
        assert s.workers() == []
    finally:
        s.close()


def test_join_again_with_another_id_is_refused(clocked_store):
    """A process is one worker: join() again returns its id, join(worker=j) for another
    id raises InvalidArgument (it returned the old id as if j had been granted)."""
    s = shmps.attach(clocked_store)
    try:
        assert s.join(worker=3) == 3
        assert s.join() == 3 and s.join(worker=3) == 3
        with pytest.raises(shmps.InvalidArgument, match="already worker 3"):
            s.join(worker=4)
        assert [w["worker"] for w in s.workers()] == [3]
        s.leave()
        assert s.join(worker=4) == 4
    finally:
        s.close()


@pytest.mark.parametrize("three", [np.int64(3), np.array(3)], ids=["np.int64", "0-d"])
def test_worker_ids_and_staleness_take_any_integer_like(clocked_store, three):
    """join(worker=), set_consistency() and attach(staleness=) take what operator.index
    takes, as numpy and PyTorch users pass them: np.int64(3) and a 0-d integer array
    np.array(3) (which int() took, and the numbers.Integral checks that replaced it
    refused with InvalidArgument)."""
    s = shmps.attach(clocked_store, staleness=three)
    try:
        assert s.staleness == 3 and type(s.staleness) is int
        s.set_consistency(three - 1)
        assert s.staleness == 2
        assert s.join(worker=three) == 3 and s.join(worker=three) == 3
        assert [w["worker"] for w in s.workers()] == [3]
    finally:
        s.close()


@pytest.mark.parametrize("timeout", [-1, float("nan"), "x", True])
def test_clock_refuses_a_timeout_that_is_not_seconds(clocked_store, timeout):
    """clock(timeout=) is None or seconds >= 0: a negative or NaN timeout went to the C
    core, which reads a negative one as "no limit" (so clock(timeout=-1) waited for ever
    at a barrier) and "x" raised a plain ValueError.  The clock does not advance."""
    s = shmps.attach(clocked_store, staleness=0)
    try:
        s.join()
        with pytest.raises(shmps.InvalidArgument, match="number of seconds"):
            s.clock(timeout=timeout)
        assert s.workers()[0]["clock"] == 0
        assert s.clock(timeout=math.inf) == 1   # alone: no wait
    finally:
        s.close()


@pytest.mark.parametrize("k", [2.7, True, "2", -1, np.array(2.0), np.bool_(True)])
def test_set_consistency_refuses_a_staleness_that_is_not_an_integer(clocked_store, k):
    """staleness is None or an integer >= 0: int() took 2.7 as 2, True as 1, "2" as 2,
    and raised a plain ValueError for other strings.  The bound is unchanged, and
    attach(staleness=k) refuses it before it creates a store."""
    s = shmps.attach(clocked_store, staleness=5)
    try:
        with pytest.raises(shmps.InvalidArgument, match="integer from 0"):
            s.set_consistency(k)
        with pytest.raises(shmps.InvalidArgument, match="integer from 0"):
            shmps.attach(clocked_store, staleness=k)
        other = clocked_store + "b"
        try:
            with pytest.raises(shmps.InvalidArgument, match="integer from 0"):
                shmps.attach(other, staleness=k)
            assert store_segments(other, s.namespace) == []
        finally:
            remove_store(other, s.namespace)
        assert s.staleness == 5
        s.set_consistency(np.int64(3))
        assert s.staleness == 3
    finally:
        s.close()
