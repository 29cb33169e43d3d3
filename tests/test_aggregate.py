"""Synchronous aggregation (aggregate="sum"|"mean", workers=N): one update per worker
clock from every live worker's push, equal to the single-process reference (exactly
for integer sums), rounds never mixed, and a killed worker never stalls a round.

Multi-process tests use 'spawn' workers (helpers.Workers kills and reaps them);
the worker functions live here, so a child imports this module.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import numpy as np
import pytest

import shmps
from helpers import CTX, Workers, wait_until

pytestmark = pytest.mark.timeout(120)

NPROCS = 3
SHAPE = (16, 33)


# ---- known gradients and references (children and parent compute the same) ----------

def known_int(idx: int, rnd: int) -> np.ndarray:
    """Worker ``idx``'s integer gradient for round ``rnd``."""
    return np.random.default_rng(1000 * idx + rnd).integers(-50, 50, SHAPE).astype("int32")


def regression_part(idx: int) -> tuple[np.ndarray, np.ndarray]:
    """Worker ``idx``'s share of a small least-squares problem."""
    rng = np.random.default_rng(77 + idx)
    X = rng.normal(size=(20, SHAPE[1]))
    y = X @ np.linspace(-1, 1, SHAPE[1]) + 0.1 * rng.normal(size=20)
    return X, y


def regression_grad(w: np.ndarray, idx: int) -> np.ndarray:
    """Least-squares gradient of worker ``idx``'s part, for every row of ``w``."""
    X, y = regression_part(idx)
    return ((X @ w.T - y[:, None]).T @ X) / len(y)


def adam_reference(nrounds: int, workers: list, lr: float) -> list:
    """Single-process full-batch Adam (torch defaults) on the mean of the workers'
    gradients; returns the parameters after each round."""
    w = np.zeros(SHAPE)
    m, v = np.zeros(SHAPE), np.zeros(SHAPE)
    b1, b2, eps = 0.9, 0.999, 1e-8
    out = []
    for t in range(1, nrounds + 1):
        g = np.mean([regression_grad(w, i) for i in workers], axis=0)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w = w - (lr / (1 - b1 ** t)) * m / (np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps)
        out.append(w.copy())
    return out


def max_reference(nrounds: int, contributors: list) -> list:
    """``w = max(w, sum of the round's gradients)`` per round, from 0 (int64, exact);
    ``contributors[r]`` lists the workers that pushed in round r."""
    w = np.zeros(SHAPE, np.int64)
    out = []
    for r in range(nrounds):
        w = np.maximum(w, sum(known_int(i, r).astype(np.int64) for i in contributors[r]))
        out.append(w.copy())
    return out


# ---- worker functions (run in spawned children) -------------------------------------

def agg_worker(store: str, idx: int, barrier, nrounds: int, kind: str,
               stall_at: int = -1, delay: float = 0.0) -> dict:
    """Join (after ``delay`` s), barrier (unless None), then per round: push (a
    known integer gradient, or the regression gradient at the pulled parameters),
    clock(), pull.  At round ``stall_at`` it stops before pushing and sleeps (to be
    killed).  Returns every pull and the CLOCK_MONOTONIC time of each."""
    time.sleep(delay)
    s = shmps.attach(store)
    try:
        s.join()
        W = s["W"]
        if barrier is not None:
            barrier.wait(30)
        pulls, times = [], []
        for r in range(nrounds):
            if r == stall_at:
                time.sleep(60)
            g = known_int(idx, r) if kind == "int" else regression_grad(W.pull(), idx)
            W.push(g)
            s.clock(timeout=30)
            pulls.append(W.pull())
            times.append(time.monotonic())
        return {"pulls": pulls, "times": times, "rounds": W.rounds()}
    finally:
        s.close()


def round_pusher(store: str, nrounds: int) -> int:
    """Join as the job's only worker and push ones for ``nrounds`` rounds as fast as
    it can (eventual consistency): each push completes its round and applies it."""
    s = shmps.attach(store)
    try:
        s.join()
        W = s["B"]
        g = np.ones(W.shape, np.int32)
        for _ in range(nrounds):
            W.push(g)
            s.clock(timeout=30)
        return W.rounds()["applied"]
    finally:
        s.close()


def idle_worker(store: str, flags) -> int:
    """Join, report the worker id in ``flags[1]``, and never push; leave() once
    ``flags[0]`` is set."""
    s = shmps.attach(store)
    try:
        flags[1] = s.join()
        deadline = time.monotonic() + 60
        while not flags[0] and time.monotonic() < deadline:
            time.sleep(0.001)
        s.leave()
        return int(flags[1])
    finally:
        s.close()


def ck_worker(store: str, idx: int, rounds: range, partial: int | None, flags) -> None:
    """Join, then per round r of ``rounds`` push known_int(idx, r) to "W" and the
    regression gradient at the pulled parameters to "A", and clock(); then, with
    ``partial``, push known_int(idx, partial) to "W" alone (a round left open); report
    in ``flags[2 + idx]`` and stay attached (a live worker) until ``flags[0]``."""
    s = shmps.attach(store)
    try:
        s.join()
        W, A = s["W"], s["A"]
        for r in rounds:
            W.push(known_int(idx, r))
            A.push(regression_grad(A.pull(), idx))
            s.clock(timeout=30)
        if partial is not None:
            W.push(known_int(idx, partial))
        flags[2 + idx] = 1
        deadline = time.monotonic() + 60
        while not flags[0] and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        s.close()


def commit_a_push(W, g) -> int:
    """As a pusher of a round of "W" (workers=1) does, by the C calls, in a process that
    joined: begin, accumulate ``g``, commit, and nothing more (the round, complete, is
    not applied); returns the round."""
    from shmps import _native
    from shmps.dense import DenseTensor

    slot = W._slot()
    rnd = W._begin(slot, 10)
    DenseTensor.push(W._acc[rnd % 2], g)
    assert _native.lib.shmps_agg_commit(W._cptr(), _native.token(), slot, rnd, 1) == 0
    return rnd


def claim_a_round(s, W) -> int:
    """As the last pusher of a round of "W" (workers=1) does, by the C calls, in a
    process that joined store ``s``: commit_a_push of known_int(0, 0), and claim the
    round for this process (phase SUM); returns the round."""
    from shmps import _native

    lib, ffi, tok = _native.lib, _native.ffi, _native.token()
    rnd = commit_a_push(W, known_int(0, 0))
    what, r, n = ffi.new("uint32_t *"), ffi.new("uint64_t *"), ffi.new("uint32_t *")
    ph, behind = ffi.new("uint32_t *"), ffi.new("int32_t *")
    assert lib.shmps_agg_next(W._cptr(), s._mptr, tok, 1, what, r, n, ph, behind) == 0
    assert what[0] == lib.SHMPS_AGG_APPLY and int(r[0]) == rnd
    return rnd


def die_while_applying(store: str, phase: str) -> None:
    """The only worker: push once, claim the round's application, and SIGKILL
    itself in phase ``phase`` ("sum": before touching the tensor; "pushing":
    after pushing the aggregate, before clearing the accumulator)."""
    from shmps import _native
    from shmps.dense import DenseTensor

    s = shmps.attach(store)
    s.join()
    W = s["W"]
    rnd = claim_a_round(s, W)
    if phase == "pushing":
        assert _native.lib.shmps_agg_phase(W._cptr(), _native.token(), rnd,
                                           _native.lib.SHMPS_AGG_PH_PUSHING) == 0
        DenseTensor.push(W, W._acc[rnd % 2].pull())
    os.kill(os.getpid(), signal.SIGKILL)


def die_part_way_through_a_round(store: str) -> None:
    """The only worker of a 2-shard aggregated tensor: push round 0 through the public
    API and SIGKILL itself while applying it, after the aggregate reached shard 0 and
    before it reached shard 1."""
    from shmps.dense import DenseTensor

    real = DenseTensor._call_push

    def call_push(self, i, *args, **kw):
        if self.name == "W" and i == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, i, *args, **kw)

    DenseTensor._call_push = call_push
    s = shmps.attach(store)
    s.join()
    s["W"].push(known_int(0, 0))


def die_after_pushing_a_round(store: str) -> None:
    """As die_part_way_through_a_round, but SIGKILLed once the aggregate has reached
    every stripe, before the round leaves phase PUSHING (the accumulator not cleared)."""
    from shmps.aggregate import AggregateDense

    real = AggregateDense._push_round

    def push_round(self, *args, **kw):
        real(self, *args, **kw)
        os.kill(os.getpid(), signal.SIGKILL)

    AggregateDense._push_round = push_round
    s = shmps.attach(store)
    s.join()
    s["W"].push(known_int(0, 0))

def stop_before_pushing_a_round(store: str, flags) -> None:
    """The only worker of a hogwild aggregated tensor "W" (its rounds are pushed without
    a ticket, as a forwarded tensor's are): push round 0 and SIGSTOP itself once the
    round is claimed, in phase PUSHING, before its push (``flags[0]`` set just before)."""
    from shmps.aggregate import AggregateDense
    from shmps.dense import DenseTensor

    real = DenseTensor.push

    def push(self, *args, **kw):
        if isinstance(self, AggregateDense):
            flags[0] = 1
            os.kill(os.getpid(), signal.SIGSTOP)
        return real(self, *args, **kw)

    DenseTensor.push = push
    s = shmps.attach(store)
    s.join()
    AggregateDense.push(s["W"], known_int(0, 0))


def stop_in_a_ticket_push(store: str, flags) -> None:
    """The only worker of an exact aggregated tensor "W", its store not forwarding (no
    bridge yet): its round goes by ticket; SIGSTOP itself in PUSHING (``flags[0]`` set
    just before)."""
    from shmps.aggregate import AggregateDense

    real = AggregateDense._push_round

    def push_round(self, *args):
        flags[0] = 1
        os.kill(os.getpid(), signal.SIGSTOP)
        return real(self, *args)

    AggregateDense._push_round = push_round
    s = shmps.attach(store)
    s.join()
    AggregateDense.push(s["W"], known_int(0, 0))


def keep_an_idle_entry(store: str, flags) -> None:
    """A live process with an idle entry in the table of pushes by another path of "W" (a
    bridge between two applies): an empty push by another path (W._foreign()), then
    ``flags[0]``; a second once ``flags[1]`` is set, then ``flags[2]``; alive until
    ``flags[3]``."""
    s = shmps.attach(store)
    try:
        W = s["W"]
        with W._foreign():
            pass
        flags[0] = 1
        await_flag(flags, 1)
        with W._foreign():
            pass
        flags[2] = 1
        await_flag(flags, 3)
    finally:
        s.close()


def push_by_another_path_empty(store: str) -> None:
    """An empty push by another path to "W" (W._foreign()), for a process that a kill
    point ends in there (run_to_its_kill)."""
    s = shmps.attach(store)
    with s["W"]._foreign():
        pass


def push_a_round(store: str) -> None:
    """The only worker: push round 0 of "W" (known_int(0, 0)), for a process that a kill
    point ends while it applies the round (run_to_its_kill)."""
    s = shmps.attach(store)
    s.join()
    s["W"].push(known_int(0, 0))


def push_a_round_told(store: str) -> str:
    """The only worker: push round 0 of "W" (known_int(0, 0)); returns what the push
    raised (``"Timeout: ..."``), or "" if nothing."""
    s = shmps.attach(store)
    try:
        s.join()
        try:
            s["W"].push(known_int(0, 0))
        except shmps.Error as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""
    finally:
        s.close()


def await_flag(flags, i: int, timeout: float = 30.0) -> None:
    """Wait (in a child) until ``flags[i]`` is set, at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not flags[i] and time.monotonic() < deadline:
        time.sleep(0.001)


def push_by_another_path(store: str, flags) -> None:
    """A bridge's direct apply to "W" (ones), held open: inside the bracket
    (AggregateDense._foreign) it sets ``flags[0]`` and applies once ``flags[1]`` is set."""
    from shmps.dense import DenseTensor

    s = shmps.attach(store)
    try:
        W = s["W"]
        with W._foreign():
            flags[0] = 1
            await_flag(flags, 1)
            DenseTensor._apply_direct(W, None, np.ones(W.shape, W.dtype))
    finally:
        s.close()

# ---- fixtures -----------------------------------------------------------------------

@pytest.fixture
def job(store_name):
    """A store for one job (destroyed afterwards, whatever happens)."""
    s = shmps.attach(store_name)
    yield s
    s.destroy()


def run_job(name: str, nrounds: int, kind: str, stall: dict | None = None,
            kill_after: float = 0.0, barrier: bool = True) -> tuple[list, float]:
    """Run NPROCS agg_workers; ``stall`` maps a worker to the round it stalls at;
    that worker is SIGKILLed once the others have pushed that round and wait.
    Without ``barrier``, worker i joins 0.2 * i s late instead.
    Returns the live workers' results and the kill time."""
    stall = stall or {}
    bar = CTX.Barrier(NPROCS) if barrier else None
    t_kill = 0.0
    with Workers(hard_timeout=90) as ws:
        procs = [ws.start(agg_worker, name, i, bar, nrounds, kind, stall.get(i, -1),
                          0.0 if barrier else 0.2 * i, label=f"w{i}")
                 for i in range(NPROCS)]
        for i, r in stall.items():
            probe = shmps.attach(name)
            try:
                wait_until(lambda: sum(w["clock"] > r for w in probe.workers())
                           == NPROCS - 1, 30, "the others past the stalled round")
            finally:
                probe.close()
            time.sleep(kill_after)
            t_kill = time.monotonic()
            os.kill(procs[i].pid, signal.SIGKILL)
        results = [p.result(60) for i, p in enumerate(procs) if i not in stall]
    return results, t_kill


# ---- multi-process tests ------------------------------------------------------------

def test_pull_never_sees_part_of_a_round_being_applied(job):
    """A process that is no worker pulls while the job's worker applies round after
    round (pushes of ones, Sum: the tensor holds r everywhere after round r) into a
    tensor of 16 shards: every pull holds one number, never some shards of the next
    round (a pull that checked for an apply only before copying mixed 1-2 of about 500
    here, and once in a CI run of test_sum_of_integers_is_exact)."""
    B = job.dense("B", shape=(16 * 4096, 64), dtype="int32", aggregate="sum", workers=1,
                  shard_rows=4096)
    assert B.nshards == 16
    nrounds = 400
    mixed = pulls = 0
    with Workers(hard_timeout=90) as ws:
        w = ws.start(round_pusher, job.name, nrounds)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            a = B.pull()
            pulls += 1
            mixed += int(a.min() != a.max())
            if a.min() == nrounds:
                break
        applied = w.result(60)
    assert applied == nrounds and pulls > 10
    assert mixed == 0, f"{mixed} of {pulls} pulls mixed two rounds"


@pytest.mark.parametrize("k", [0, None])
def test_sum_of_integers_is_exact(job, k):
    """3 processes, 8 clocks, aggregate="sum" into an int32 tensor with the Max
    updater: the tensor equals max(w, sum of each round's pushes) round by round,
    exactly (applied one by one, Max would differ); one update per round."""
    job.set_consistency(k)
    W = job.dense("W", shape=SHAPE, dtype="int32", optimizer="max", aggregate="sum",
                  workers=NPROCS, shard_rows=4)  # 4 shards: the general push path
    assert W.nshards == 4
    nrounds = 8
    results, _ = run_job(job.name, nrounds, "int")
    ref = max_reference(nrounds, [list(range(NPROCS))] * nrounds)
    got = W.pull()
    assert np.array_equal(got, ref[-1])
    assert W.stats()["step"] == nrounds
    for res in results:
        # every pull shows a whole number of rounds (k=0: exactly the rounds so far)
        states = [np.zeros(SHAPE, np.int64)] + ref
        for r, p in enumerate(res["pulls"]):
            whole = [j for j in range(nrounds + 1) if np.array_equal(p, states[j])]
            assert whole, f"pull after round {r} is not the state after any whole round"
            if k == 0:
                assert whole[-1] >= r + 1
    assert W.rounds()["applied"] == nrounds


def test_mean_equals_full_batch_adam(job):
    """3 processes pushing least-squares gradients with aggregate="mean" and Adam
    (float64), staleness 0: after every clock each worker pulls exactly what
    single-process full-batch Adam gives after that many steps (to 1e-12)."""
    job.set_consistency(0)
    lr = 0.05
    W = job.dense("W", shape=SHAPE, dtype="float64", optimizer=shmps.Adam(lr=lr),
                  aggregate="mean", workers=NPROCS)
    nrounds = 10
    results, _ = run_job(job.name, nrounds, "reg")
    ref = adam_reference(nrounds, list(range(NPROCS)), lr)
    np.testing.assert_allclose(W.pull(), ref[-1], rtol=1e-12, atol=1e-12)
    for res in results:
        for r, p in enumerate(res["pulls"]):
            np.testing.assert_allclose(p, ref[r], rtol=1e-12, atol=1e-12)
    assert W.stats()["step"] == nrounds


def test_late_joiners_need_no_barrier(job):
    """Without a start barrier (workers join 0.2 s apart), the first pushes wait
    until workers=3 have joined: the result is still the 3-worker reference."""
    job.set_consistency(0)
    W = job.dense("W", shape=SHAPE, dtype="float64", optimizer=shmps.Adam(lr=0.05),
                  aggregate="mean", workers=NPROCS)
    nrounds = 5
    run_job(job.name, nrounds, "reg", barrier=False)
    ref = adam_reference(nrounds, list(range(NPROCS)), 0.05)
    np.testing.assert_allclose(W.pull(), ref[-1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("phase", ["sum", "pushing"])
def test_applier_killed_mid_round_is_taken_over(job, phase):
    """A process SIGKILLed while applying a round: the next pull takes the round
    over and the update lands exactly once (restarted from the accumulator when
    the tensor was untouched; only the clear is redone when it was pushed)."""
    W = job.dense("W", shape=SHAPE, dtype="int32", optimizer="sum", aggregate="sum",
                  workers=1)
    with Workers(hard_timeout=60) as ws:
        w = ws.start(die_while_applying, job.name, phase)
        w.process.join(30)
        assert w.process.exitcode == -signal.SIGKILL
    assert np.array_equal(W.pull(), known_int(0, 0))
    info = W.rounds()
    assert info["takeovers"] >= 1 and info["next_round"] == 1 and info["applied"] == 1
    assert not W._acc[0].pull().any()  # the accumulator was cleared
    job.join()
    job.clock()  # round 0 is closed; this worker's next round is 1
    W.push(known_int(1, 1))
    assert np.array_equal(W.pull(), known_int(0, 0) + known_int(1, 1))
    assert W.stats()["step"] == 2


def test_a_pull_beside_a_push_in_flight_applies_each_round_once(store):
    """The training loop push(wait=False); pull(); clock() in one process: the pull's
    thread and the push's share the process's token, and the C side hands a claim of
    this token out again (one left by an exception), so the pull took the round the push
    thread was applying and applied it a second time (300 rounds gave 302-319, not the
    same on every stripe, and InvalidArgument at some clock()s).  One thread of a
    process at a time claims and applies a round of a tensor: every element ends at the
    number of rounds, and no call raises."""
    store.join()
    W = store.dense("W", shape=(4096, 64), dtype="int32", optimizer="sum",
                    aggregate="sum", workers=1, shard_rows=512)
    g = np.ones(W.shape, np.int32)
    rounds = 300
    for _ in range(rounds):
        W.push(g, wait=False)
        W.pull()
        store.clock()
    final = W.pull()
    assert final.min() == rounds and final.max() == rounds, np.unique(final)


def test_applier_killed_part_way_through_pushing_a_round_is_finished(job):
    """The applier SIGKILLed with the round's aggregate pushed to shard 0 and not to
    shard 1: the next pull finishes the push on the stripes it did not reach, so the
    round lands exactly once everywhere (before, the takeover only cleared the
    accumulator: shard 1 never got the round, and every contributor's push, returned
    or not, was lost there)."""
    W = _cut_round(job)
    assert np.array_equal(W.pull(), known_int(0, 0))
    info = W.rounds()
    assert info["takeovers"] >= 1 and info["next_round"] == 1 and info["applied"] == 1
    assert not W._acc[0].pull().any()
    assert W.stats()["step"] == 1
    job.join()
    job.clock()
    W.push(known_int(1, 1))   # the next round goes on at the next step, on every stripe
    assert np.array_equal(W.pull(), known_int(0, 0) + known_int(1, 1))
    assert W.stats()["step"] == 2


def start_with(ws, env: dict, fn, *args):
    """``ws.start(fn, *args)`` with ``env`` added to the child's environment (variables
    the library reads as it loads: SHMPS_TEST_KILL_AT, SHMPS_TEST_LOCK_TIMEOUT_S)."""
    os.environ.update(env)
    try:
        return ws.start(fn, *args)   # (the spawned process has the environment of now)
    finally:
        for k in env:
            os.environ.pop(k, None)


def run_to_its_kill(ws, fn, *args, kill_at: str | None = None) -> None:
    """Run worker ``fn(*args)`` (of Workers ``ws``) until it is SIGKILLed: by itself, or
    with ``kill_at``, at that kill point of native/aggregate.c (SHMPS_TEST_KILL_AT in
    its environment, read as the library loads: a point between two stores whose order
    a kill relies on)."""
    w = start_with(ws, {} if kill_at is None else {"SHMPS_TEST_KILL_AT": kill_at}, fn, *args)
    w.process.join(30)
    assert w.process.exitcode == -signal.SIGKILL, w.process.exitcode


def _cut_round(job, child=die_part_way_through_a_round, kill_at: str | None = None):
    """A 2-shard int32 Sum tensor W (workers=1) whose only worker pushed round 0 and was
    SIGKILLed applying it (by ``child``, or at kill point ``kill_at``): round 0 is
    claimed by a dead process in phase PUSHING, and nobody has taken it over yet."""
    W = job.dense("W", shape=SHAPE, dtype="int32", optimizer="sum", aggregate="sum",
                  workers=1, shard_rows=8)
    assert W.nshards == 2
    with Workers(hard_timeout=60) as ws:
        run_to_its_kill(ws, child, job.name, kill_at=kill_at)
    return W


def test_a_round_cut_by_an_error_part_way_is_finished_not_dropped(job):
    """Review H4 F1: the applier's push of round 0 reaches shard 0 and times out waiting
    for shard 1, which another live process holds frozen (the applier's lock timeout
    0.3 s: SHMPS_TEST_LOCK_TIMEOUT_S).  The worker gets the Timeout, and the round is
    left claimed for any process to finish: the next pull pushes it to shard 1 by its
    ticket and not again to shard 0, so it lands once everywhere and counts one push.
    (Any error was taken for the sum's overflow: the round was marked applied and its
    accumulator cleared, and shard 1 never got it.)"""
    from shmps import _native

    W = job.dense("W", shape=SHAPE, dtype="int32", optimizer="sum", aggregate="sum",
                  workers=1, shard_rows=8)
    assert W.nshards == 2
    lib, tok = _native.lib, _native.token()
    assert lib.shmps_freeze(W._shard(1).ptr, tok, 5.0) == 0
    try:
        with Workers(hard_timeout=60) as ws:
            told = start_with(ws, {"SHMPS_TEST_LOCK_TIMEOUT_S": "0.3"}, push_a_round_told,
                              job.name).result(30)
    finally:
        lib.shmps_thaw(W._shard(1).ptr, tok)
    assert told.startswith("Timeout"), told
    assert np.array_equal(W.pull(), known_int(0, 0))
    info = W.rounds()
    assert info["applied"] == 1 and info["next_round"] == 1 and info["takeovers"] >= 1
    assert not W._acc[0].pull().any()
    assert W.stats()["pushes"] == 1 and W.stats()["step"] == 1


def test_a_worker_joining_while_a_round_is_claimed_pushes_to_the_next_round(job):
    """Review F2 of ca12e65: a worker that joins while round 0 is claimed (here by an
    applier SIGKILLed part-way through pushing it) starts at clock 0, whose round is
    closed to new pushes from the claim on: its push is refused as one to an applied
    round (InvalidArgument, call clock()) once the round is finished, and goes to round 1
    after clock().  Before, the push was added to the claimed round's accumulator and the
    resume pushed the larger sum to the stripes the dead applier had not reached: shard 1
    got both pushes, shard 0 the first only (the late push lost there, torn across
    shards), and with "mean" the larger sum was divided by the old count."""
    W = _cut_round(job)
    late = known_int(1, 0)
    assert job.join(worker=1) == 1   # (slot 0, the dead applier's, holds its bit)
    assert job.workers()[0]["clock"] == 0
    with pytest.raises(shmps.InvalidArgument, match="already applied without this worker"):
        W.push(late)
    assert np.array_equal(W.pull(), known_int(0, 0))
    job.clock()
    W.push(late)
    assert np.array_equal(W.pull(), known_int(0, 0) + late)
    info = W.rounds()
    assert info["applied"] == 2 and info["next_round"] == 2
    assert W.stats()["step"] == 2


@pytest.mark.parametrize("path", ["direct", "shard"])
def test_a_push_by_another_path_before_the_resume_does_not_hide_the_round(job, path):
    """Review F3 of ca12e65: round 0's applier SIGKILLed with the aggregate on shard 0
    and not on shard 1, then a push by another path (the bridge's _apply_direct or
    _apply_shard, a plain push on the tensor) before anyone resumed the round: it took
    a later ticket and moved shard 1's stripes past the round's ticket, so the resume
    took shard 1 for having the round and skipped it (shard 1 held the other push
    only).  The other path finishes the cut round first: every element ends at the
    round plus the other push."""
    W = _cut_round(job)
    other = np.ones(SHAPE, np.int32)
    if path == "direct":
        W._apply_direct(None, other)
    else:
        rows = np.arange(8, 16, dtype=np.int64)   # shard 1's rows
        W._apply_shard(1, rows, other[8:])
    want = known_int(0, 0).copy()
    want[8:] += 1
    if path == "direct":
        want[:8] += 1
    assert np.array_equal(W.pull(), want)
    info = W.rounds()
    assert info["applied"] == 1 and info["next_round"] == 1
    assert not W._acc[0].pull().any()


def test_a_worker_in_a_dead_workers_slot_is_told_whose_push_it_found(job):
    """A worker that joins into the slot of a worker that died applying round 0 (its
    push is in the round) finds that push under its slot: the refusal says the push
    may be the slot's earlier holder's, not only this process's (it said only "worker
    0 already pushed", which this process never did), and after clock() it pushes to
    the next round."""
    W = _cut_round(job)
    assert job.join() == 0
    with pytest.raises(shmps.InvalidArgument, match="or the one that held slot 0 before it"):
        W.push(known_int(1, 0))
    job.clock()
    W.push(known_int(1, 1))
    assert np.array_equal(W.pull(), known_int(0, 0) + known_int(1, 1))


@contextlib.contextmanager
def _another_path_open(job):
    """A 2-shard int32 Sum tensor W (workers=1) and a push to it by another path held
    open in another process (push_by_another_path: a bridge's direct apply, inside its
    bracket): yields (W, the Workers, the child's flags).  Setting ``flags[1]`` lets the
    child apply ones and end; the block's end does it (if the body did not) and waits
    for the child."""
    W = job.dense("W", shape=SHAPE, dtype="int32", optimizer="sum", aggregate="sum",
                  workers=1, shard_rows=8)
    flags = CTX.RawArray("q", 2)
    with Workers(hard_timeout=60) as ws:
        other = ws.start(push_by_another_path, job.name, flags)
        wait_until(lambda: flags[0], 30, "the other path's push registered")
        yield W, ws, flags
        flags[1] = 1
        other.result(30)


def test_a_round_does_not_start_pushing_while_a_push_by_another_path_is_in_flight(job):
    """The other half of F3's fix: a round's applier takes its ticket and enters PUSHING
    only once no push by another path is in flight (here a bridge's direct apply held
    open in another process), so no such push writes a stripe at a later ticket while
    the round is being pushed.  The round waits (still not applied while the other push
    is open), then lands: every element is the round plus the other push."""
    with _another_path_open(job) as (W, _, _):
        job.join()
        h = W.push(known_int(0, 0), wait=False)
        wait_until(lambda: W.rounds()["buffers"][0]["contributed"] == 1, 30,
                   "the worker's push accumulated")
        time.sleep(0.2)
        assert W.rounds()["applied"] == 0 and W.stats()["step"] == 0
    h.wait(30)
    assert np.array_equal(W.pull(), known_int(0, 0) + 1)
    assert W.rounds()["applied"] == 1 and W.stats()["step"] == 2


@contextlib.contextmanager
def _round_paused_in(job, child, **kw):
    """A 2-shard int32 Sum tensor W (workers=1, ``kw``) whose only worker, ``child``,
    stopped itself (SIGSTOP) applying round 0 (setting ``flags[0]`` first): yields W
    with the worker stopped, then lets it go on and waits for its push to end."""
    W = job.dense("W", shape=SHAPE, dtype="int32", optimizer="sum", aggregate="sum",
                  workers=1, shard_rows=8, **kw)
    flags = CTX.RawArray("q", 1)
    with Workers(hard_timeout=60) as ws:
        w = ws.start(child, job.name, flags)
        try:
            wait_until(lambda: flags[0], 30, "the round claimed")
            time.sleep(0.1)   # (the SIGSTOP itself)
            yield W
        finally:
            os.kill(w.process.pid, signal.SIGCONT)
        w.result(30)


def test_a_push_by_another_path_does_not_wait_for_a_round_pushed_without_a_ticket(job):
    """A round pushed without a ticket (hogwild here; a tensor forwarded to a bridge
    likewise) is no resume's concern: a push by another path (the bridge's direct
    apply, on its event loop) does not wait for it, even with its applier stopped
    (SIGSTOP) half-way through: it returns at once, and the round lands once the
    applier goes on.  (Waiting, a paused worker stalled the bridge's event loop for
    up to 60 s.)"""
    with _round_paused_in(job, stop_before_pushing_a_round, mode="hogwild") as W:
        assert W.rounds()["applied"] == 0
        t0 = time.monotonic()
        W._apply_direct(None, np.ones(SHAPE, np.int32))
        took = time.monotonic() - t0
    assert took < 5.0, took
    assert np.array_equal(W.pull(), known_int(0, 0) + 1)


def test_a_push_by_another_path_refuses_busy_a_round_a_live_worker_pushes(job):
    """A round pushed by ticket (claimed while the store did not forward: a bridge
    starting, or one restarted after a clean stop), its worker paused in PUSHING: the
    bridge's direct apply (on its event loop) raises Busy at once with nothing applied,
    and the bridge answers the batch BUSY (its sender sends it again); applied again
    once the round is done, it lands.  (It waited for the round on the event loop for
    60 s, the bridge counted dead meanwhile, then raised Timeout, and the batch was
    refused for good: review H2 F3.)"""
    with _round_paused_in(job, stop_in_a_ticket_push) as W:
        job._set_forwarding(True)      # the bridge starts (node.py _start)
        t0 = time.monotonic()
        with pytest.raises(shmps.errors.Busy, match="being pushed by another process"):
            W._apply_direct(None, np.ones(SHAPE, np.int32))
        took = time.monotonic() - t0
        assert W.rounds()["applied"] == 0 and W.stats()["step"] <= 1
    W._apply_direct(None, np.ones(SHAPE, np.int32))
    job._set_forwarding(False)
    assert took < 5.0, took
    assert np.array_equal(W.pull(), known_int(0, 0) + 1)


def test_a_round_sleeps_until_a_push_by_another_path_ends(job):
    """shmps_agg_pushing waits in C while another process's push by another path is in
    flight (on the control block's futex, GIL released, woken as that push ends): it
    returns SHMPS_AGG_E_FOREIGN with nothing done once its timeout has passed, and the
    round's ticket once the other push has ended.  (Before, it returned at once and
    aggregate.py polled it every 0.5 ms for up to 60 s.)"""
    from shmps import _native

    lib, ffi, tok = _native.lib, _native.ffi, _native.token()
    job.join()
    got = ffi.new("uint64_t *")
    with _another_path_open(job) as (W, _, flags):
        rnd = claim_a_round(job, W)
        t0 = time.monotonic()
        code = lib.shmps_agg_pushing(W._cptr(), tok, rnd, W._shard(0).ptr, 0.3, got)
        took = time.monotonic() - t0
        assert code == lib.SHMPS_AGG_E_FOREIGN and 0.25 < took < 5.0, (code, took)
        assert W.stats()["step"] == 0   # no ticket taken
        threading.Timer(0.3, flags.__setitem__, (1, 1)).start()   # the other push ends
        t0 = time.monotonic()
        code = lib.shmps_agg_pushing(W._cptr(), tok, rnd, W._shard(0).ptr, 30.0, got)
        took = time.monotonic() - t0
        assert code == 0 and 0.2 < took < 5.0, (code, took)
        assert int(got[0]) == 2   # the other push took ticket 1
    # our claim in PUSHING, handed back to this process by the pull: pushed at the ticket
    assert np.array_equal(W.pull(), known_int(0, 0) + 1)
    assert W.rounds()["applied"] == 1 and W.stats()["step"] == 2


def test_a_round_waits_for_a_push_by_another_path_at_most_its_timeout(job, monkeypatch):
    """A push by another path in flight for longer than the round's wait
    (aggregate.WAIT_TIMEOUT_S, 60 s; 0.3 here): the worker completing the round gets
    Timeout saying so, nothing of the round pushed, and the next pull applies the round
    once the other push has ended."""
    monkeypatch.setattr(shmps.aggregate, "WAIT_TIMEOUT_S", 0.3)
    job.join()
    with _another_path_open(job) as (W, _, _):
        t0 = time.monotonic()
        with pytest.raises(shmps.Timeout, match="a push by another path .* has been in "
                                                "flight for 0.3 s"):
            W.push(known_int(0, 0))
        took = time.monotonic() - t0
        assert 0.25 < took < 5.0, took
        assert W.rounds()["applied"] == 0 and W.stats()["step"] == 0
    assert np.array_equal(W.pull(), known_int(0, 0) + 1)
    assert W.rounds()["applied"] == 1 and W.stats()["step"] == 2


def test_a_round_waiting_for_a_push_by_another_path_refuses_new_ones(job):
    """Review H4 F2: while a round waits to take its ticket (its worker, a child, waits
    for a bridge's direct apply held open in another process), a new push by another
    path is refused Busy (the bridge sends the batch again): pushes that kept starting
    held the round off until its Timeout (before, this one was let in).  The mark dies
    with its waiter: SIGKILLed, the next push by another path goes in, and the round
    lands once the first one ends."""
    from shmps.errors import Busy

    with _another_path_open(job) as (W, ws, _):
        worker = ws.start(push_a_round, job.name)
        wait_until(lambda: W.rounds()["applier_pid"] == worker.pid, 30, "the round claimed")
        time.sleep(0.05)   # (from its claim to its wait: microseconds)
        with pytest.raises(Busy, match="waits to be"):
            with W._foreign():
                pass
        worker.kill()
        with W._foreign():
            pass
    assert np.array_equal(W.pull(), known_int(0, 0) + 1)
    assert W.rounds()["applied"] == 1 and W.stats()["step"] == 2


class _AfterFinish:
    """``shmps.aggregate.lib`` for a test: the library, but ``after(round)`` runs once
    each shmps_agg_finish of a round has returned."""

    def __init__(self, lib, after) -> None:
        self._lib, self._after = lib, after

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def shmps_agg_finish(self, ctl, token, rnd):
        code = self._lib.shmps_agg_finish(ctl, token, rnd)
        self._after(rnd)
        return code


def test_a_push_by_another_path_finishing_a_dead_round_never_waits(job, monkeypatch):
    """Review H4 F3: a push by another path (the bridge's, on its event loop) meets round 0
    left in PUSHING by a dead applier, and finishes it; round 1, complete, comes next, and
    another process's push by another path began in between: round 1 would wait for it to
    take its ticket, so the call raises Busy at once, nothing of its own applied, round 1's
    claim released (before, it waited WAIT_TIMEOUT_S, 1 s here, on the event loop, then
    raised Timeout).  The next pull applies round 1 once the other push has ended, and
    the bridge's batch sent again lands."""
    from shmps import _native
    from shmps.errors import Busy

    monkeypatch.setattr(shmps.aggregate, "WAIT_TIMEOUT_S", 1.0)
    W = _cut_round(job)
    assert job.join(worker=1) == 1
    job.clock()
    assert commit_a_push(W, known_int(1, 1)) == 1
    ones = np.ones(SHAPE, np.int32)
    flags = CTX.RawArray("q", 2)
    with Workers(hard_timeout=60) as ws:
        def begin_another(rnd):
            if rnd == 0:
                ws.start(push_by_another_path, job.name, flags)
                wait_until(lambda: flags[0], 30, "the other path's push registered")

        monkeypatch.setattr(shmps.aggregate, "lib", _AfterFinish(_native.lib, begin_another))
        with pytest.raises(Busy, match="round 1 .* is in flight"):
            W._apply_direct(None, ones)
        monkeypatch.undo()
        info = W.rounds()
        assert info["applied"] == 1 and info["next_round"] == 1 and info["applier_pid"] == 0
        flags[1] = 1
        ws.workers[0].result(30)
    assert np.array_equal(W.pull(), known_int(0, 0) + 1 + known_int(1, 1))
    W._apply_direct(None, ones)
    assert np.array_equal(W.pull(), known_int(0, 0) + 2 + known_int(1, 1))
    assert W.rounds()["applied"] == 2


@pytest.mark.parametrize("child", [die_part_way_through_a_round, die_after_pushing_a_round],
                         ids=["cut", "pushed"])
def test_a_resumed_round_counts_as_one_push(job, child):
    """Review F4 of ca12e65: a round applied by a resume counts once in the tensor's
    pushes statistic, whether the dead applier was cut between its shards or had reached
    every stripe (a resume then writes nothing).  Before, the resume counted no push
    and the dead applier had not counted one yet: stats()["pushes"] stayed 0 ("cut")."""
    W = _cut_round(job, child)
    assert np.array_equal(W.pull(), known_int(0, 0))
    assert W.rounds()["applied"] == 1
    assert W.stats()["pushes"] == 1
    job.join()
    job.clock()
    W.push(known_int(1, 1))
    assert np.array_equal(W.pull(), known_int(0, 0) + known_int(1, 1))
    assert W.stats()["pushes"] == 2 and W.stats()["step"] == 2


@pytest.mark.parametrize("kill_at", ["pushed-count", "pushed-counted"])
def test_an_applier_killed_at_its_count_counts_the_round_once(job, kill_at):
    """The round's applier SIGKILLed in shmps_agg_pushed after the count (kill point
    pushed-count: a CAS of the pushes statistic from its value as the round entered
    PUSHING) and before recording the round as counted, or just after that record
    (pushed-counted): the resume counts it once, not twice nor never, and lands the round
    once.  (With the record before a plain count, the first kill, then between the two,
    left the round counting no push: the documented counted gap; with the count before the
    record, it counted the round twice.)"""
    W = _cut_round(job, push_a_round, kill_at=kill_at)
    assert np.array_equal(W.pull(), known_int(0, 0))
    info = W.rounds()
    assert info["applied"] == 1 and info["takeovers"] >= 1
    assert W.stats()["pushes"] == 1 and W.stats()["step"] == 1


def test_a_push_by_another_path_killed_reusing_an_idle_entry_leaves_no_count(job, monkeypatch):
    """Review H2 F6, tried: a push by another path SIGKILLed between its two stores into
    the table entry it reuses (the token, then the count: kill point foreign-token), the
    entry a live process's idle one: that process's next push by another path leaves
    nothing in flight, and the round takes its ticket at once.  (With the count first, the
    entry was left at the live process's token with count 1, its pushes took it 1 -> 2 ->
    1, and every round waited for it: here Timeout, WAIT_TIMEOUT_S set to 5 s.)"""
    monkeypatch.setattr(shmps.aggregate, "WAIT_TIMEOUT_S", 5.0)
    W = job.dense("W", shape=SHAPE, dtype="int32", optimizer="sum", aggregate="sum",
                  workers=1)
    flags = CTX.RawArray("q", 4)
    with Workers(hard_timeout=60) as ws:
        live = ws.start(keep_an_idle_entry, job.name, flags)
        wait_until(lambda: flags[0], 30, "the live process's first push by another path")
        run_to_its_kill(ws, push_by_another_path_empty, job.name, kill_at="foreign-token")
        flags[1] = 1
        wait_until(lambda: flags[2], 30, "the live process's second push by another path")
        job.join()
        W.push(known_int(0, 0))
        flags[3] = 1
        live.result(30)
    assert np.array_equal(W.pull(), known_int(0, 0))
    info = W.rounds()
    assert info["applied"] == 1 and info["takeovers"] >= 1   # (killed holding the lock)


def test_first_push_waits_for_the_team(job):
    """With workers=2 and one worker joined, a push waits; Timeout says how many
    have joined, and nothing was counted."""
    job.join()
    W = job.dense("W", shape=(2,), aggregate="sum", workers=2)
    t0 = time.monotonic()
    with pytest.raises(shmps.Timeout, match="only 1 of workers=2"):
        W.push(np.ones(2), timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 2.0
    assert W.rounds()["buffers"][0]["in_flight"] == 0


@pytest.mark.parametrize("k", [0, None])
def test_killed_worker_does_not_stall_the_round(job, k):
    """A worker SIGKILLed before pushing round 3 (the others pushed it and wait):
    the round is applied without it within 2 s of the kill, and the result is the
    reference with that round (and the later ones) summed over the survivors."""
    job.set_consistency(k)
    W = job.dense("W", shape=SHAPE, dtype="int32", optimizer="max", aggregate="sum",
                  workers=NPROCS)
    nrounds, stall_at = 6, 3
    results, t_kill = run_job(job.name, nrounds, "int", stall={2: stall_at}, kill_after=0.2)
    everyone, survivors = list(range(NPROCS)), [0, 1]
    ref = max_reference(nrounds, [everyone] * stall_at + [survivors] * (nrounds - stall_at))
    assert np.array_equal(W.pull(), ref[-1])
    for res in results:
        # blocked by the stalled worker until the kill, then done within 2 s
        assert res["times"][-1] - t_kill < 2.0
        last = [j for j in range(nrounds) if np.array_equal(res["pulls"][-1], ref[j])]
        assert last == [nrounds - 1] if k == 0 else last  # eventual: a whole round
    assert W.stats()["step"] == nrounds


# ---- single-process behaviour -------------------------------------------------------

def test_one_push_per_worker_per_clock(job):
    """A second push in the same clock raises InvalidArgument and changes nothing;
    after clock() the worker pushes again."""
    job.join()
    W = job.dense("W", shape=(4,), dtype="int32", aggregate="sum", workers=1)
    W.push(np.ones(4, "int32"))
    with pytest.raises(shmps.InvalidArgument, match="already pushed"):
        W.push(np.ones(4, "int32"))
    assert W.pull().tolist() == [1, 1, 1, 1]
    job.clock()
    W.push(np.full(4, 2, "int32"), rows=None)
    assert W.pull().tolist() == [3, 3, 3, 3]


def test_push_needs_a_worker(job):
    """A process that has not joined cannot push to an aggregated tensor."""
    W = job.dense("W", shape=(4,), dtype="int32", aggregate="sum", workers=1)
    with pytest.raises(shmps.InvalidArgument, match="join"):
        W.push(np.ones(4, "int32"))


def test_schema_and_arguments(job):
    """aggregate/workers are part of the schema (a mismatch is a SchemaError);
    bad values are InvalidArgument; mean needs a float dtype."""
    job.dense("W", shape=(4,), aggregate="mean", workers=2)
    with pytest.raises(shmps.SchemaError, match="aggregate"):
        job.dense("W", aggregate="sum", workers=2)
    with pytest.raises(shmps.SchemaError, match="workers"):
        job.dense("W", aggregate="mean", workers=3)
    assert isinstance(job.dense("W", aggregate="mean", workers=2),
                      shmps.aggregate.AggregateDense)
    job.dense("plain", shape=(4,))
    with pytest.raises(shmps.SchemaError):
        job.dense("plain", aggregate="sum", workers=2)
    with pytest.raises(shmps.InvalidArgument):
        job.dense("x", shape=(4,), aggregate="median", workers=2)
    with pytest.raises(shmps.InvalidArgument):
        job.dense("x", shape=(4,), aggregate="sum")
    with pytest.raises(shmps.InvalidArgument):
        job.dense("x", shape=(4,), aggregate="sum", workers=0)
    with pytest.raises(shmps.SchemaError, match="float"):
        job.dense("x", shape=(4,), dtype="int32", aggregate="mean", workers=2)


def test_hidden_names_are_reserved(job):
    """Names ending in #agg0/#agg1/#aggctl are refused for every kind (a user tensor of
    that name would be taken as an accumulator); only aggregation creates them."""
    for suffix in ("#agg0", "#agg1", "#aggctl"):
        with pytest.raises(shmps.InvalidArgument, match="reserved"):
            job.dense("W" + suffix, shape=(2,), dtype="float64", allow_nonfinite=True)
        with pytest.raises(shmps.InvalidArgument, match="reserved"):
            job.table("T" + suffix, dim=2, capacity=4)
        with pytest.raises(shmps.InvalidArgument, match="reserved"):
            job.csr("C" + suffix, np.array([0, 1]), np.array([0]))
    assert job.tensors() == []
    job.join()
    W = job.dense("W", shape=(2,), dtype="float64", aggregate="sum", workers=1)
    assert sorted(t["name"] for t in job.tensors()) == ["W", "W#agg0", "W#agg1", "W#aggctl"]
    assert job.dense("W#agg0").dtype == np.float64   # an existing one: get, not create
    W.push(np.ones(2))
    job.clock()
    assert W.pull().tolist() == [1.0, 1.0]


def test_pushes_to_hidden_tensors_are_refused(job):
    """store["W#agg0"] (and #agg1, #aggctl) reads like a dense tensor but refuses a push
    or a writable view with InvalidArgument naming W; the rounds stay exact.  (A push
    to W#agg0 was applied: it went into round 0's sum, W got 2 instead of 1.)"""
    job.join()
    W = job.dense("W", shape=(2,), dtype="int32", aggregate="sum", workers=1)
    for name in ("W#agg0", "W#agg1", "W#aggctl"):
        h = job[name]
        g = np.ones(h.shape, h.dtype)
        with pytest.raises(shmps.InvalidArgument, match=r"aggregated tensor 'W'.*push to 'W'"):
            h.push(g)
        with pytest.raises(shmps.InvalidArgument, match="push to 'W' instead"):
            h.push(g[:1], rows=[0], wait=False)
        with pytest.raises(shmps.InvalidArgument, match="writable view"):
            h.view(writable=True)
        assert job.dense(name) is h and h.view().shape == h.shape
    assert not job["W#agg0"].pull().any() and not job["W#agg1"].pull().any()
    W.push(np.ones(2, "int32"))
    job.clock()
    assert W.pull().tolist() == [1, 1]


def test_rows_and_nonblocking_push(job):
    """rows= pushes accumulate into the round; wait=False returns a handle and
    clock() waits for it; rounds nobody pushed to are skipped."""
    job.join()
    W = job.dense("W", shape=(3, 2), dtype="float64", optimizer=shmps.SGD(lr=1.0),
                  aggregate="mean", workers=1)
    W.push(np.ones((2, 2)), rows=[2, 2])
    assert W.pull()[:, 0].tolist() == [0, 0, -2]
    job.clock()
    job.clock()   # a clock with no push
    h = W.push(np.ones((3, 2)), wait=False)
    job.clock()   # the pending push lands first
    h.wait(5)
    W.wait_round(timeout=5)  # (already applied: returns at once)
    assert W.pull()[:, 0].tolist() == [-1, -1, -3]
    info = W.rounds()
    assert info["applied"] == 2 and info["skipped"] == 1 and info["next_round"] == 3


@pytest.mark.parametrize("opt,row1", [("sum", -5.0), (shmps.SGD(lr=0.1), -5.0),
                                       ("assign", 0.0), ("max", 0.0), ("min", -5.0),
                                       (shmps.SGD(lr=0.1, weight_decay=0.5), -4.75)],
                         ids=["sum", "sgd", "assign", "max", "min", "sgd-wd"])
def test_a_round_updates_rows_nobody_pushed(job, opt, row1):
    """As consistency.md says: a round applies the updater to every row, with a zero
    gradient for the rows no worker pushed (assign/max set row 1 from -5 to 0, weight
    decay decays it; Sum, SGD and min keep it), review 14 F4."""
    job.join()
    W = job.dense("W", shape=(2,), dtype="float64", init=-5.0, optimizer=opt,
                  aggregate="sum", workers=1)
    W.push(np.array([3.0]), rows=[0])
    job.clock()
    assert W.pull()[1] == row1


def test_assign_with_whole_pushes_sets_each_rounds_total(job):
    """Why aggregate= is not refused with assign: whole pushes make the tensor each
    round's total (a per-round statistic)."""
    job.join()
    W = job.dense("W", shape=(2,), dtype="int32", optimizer="assign", aggregate="sum",
                  workers=1)
    for total in ([3, 4], [1, 0]):
        W.push(np.array(total, np.int32))
        job.clock()
        assert W.pull().tolist() == total


def test_large_multishard_tensor(job):
    """A 12 MiB float32 tensor in 3 shards (pushes split over threads and shards):
    whole and rows= pushes aggregate into one SGD update per round."""
    job.join()
    W = job.dense("W", shape=(3072, 1024), optimizer=shmps.SGD(lr=0.5), aggregate="mean",
                  workers=1, shard_rows=1024)
    assert W.nshards == 3
    W.push(np.full(W.shape, 2.0, np.float32))
    job.clock()
    W.push(np.ones((2, 1024), np.float32), rows=[5, 3000])
    got = W.pull()
    assert got[0, 0] == -1.0 and got[5, 0] == -1.5 and got[3000, 9] == -1.5
    assert W.stats()["step"] == 2


def test_nonfinite_push_is_rejected_before_the_round(job):
    """A NaN gradient raises NonFinite and does not count as this worker's push."""
    job.join()
    W = job.dense("W", shape=(2,), aggregate="sum", workers=1)
    with pytest.raises(shmps.NonFinite):
        W.push(np.array([1.0, np.nan]))
    W.push(np.ones(2))
    assert W.pull().tolist() == [1.0, 1.0]


def test_a_round_whose_sum_overflows_is_dropped(job):
    """As consistency.md says: the round's sum is checked as a gradient; finite pushes
    that overflow together (here duplicate rows) raise NonFinite to the worker that
    completes the round, the round is dropped, and the next one applies."""
    job.join()
    W = job.dense("W", shape=(2,), dtype="float32", init=1.0, aggregate="sum", workers=1)
    with pytest.raises(shmps.NonFinite):
        W.push(np.full(2, 3e38, np.float32), rows=[0, 0])
    assert W.pull().tolist() == [1.0, 1.0]
    job.clock()
    W.push(np.ones(2, np.float32))
    assert W.pull().tolist() == [2.0, 2.0]


def test_restored_store_starts_rounds_afresh(job, store_name, tmp_path):
    """In a store restored from a checkpoint (new manifest, new clocks) pushes work
    again: the rounds restart, the applied values are kept."""
    job.join()
    W = job.dense("W", shape=(3,), dtype="int32", aggregate="sum", workers=1)
    for _ in range(3):
        W.push(np.ones(3, "int32"))
        job.clock()
    job.checkpoint(tmp_path / "ck")
    s2 = shmps.restore(tmp_path / "ck", store_name + "b")
    try:
        s2.join()
        W2 = s2["W"]
        assert isinstance(W2, shmps.aggregate.AggregateDense)
        assert W2.rounds()["next_round"] == 3  # rounds of the old store's clocks
        assert W2.pull().tolist() == [3, 3, 3]
        W2.push(np.full(3, 5, "int32"))
        assert W2.pull().tolist() == [8, 8, 8]
        s2.clock()
        W2.push(np.ones(3, "int32"))
        assert W2.pull().tolist() == [9, 9, 9]
    finally:
        s2.destroy()


def test_checkpoint_and_restore_of_aggregated_tensors_mid_training(job, tmp_path):
    """Two workers train an int32 sum tensor and a float64 mean Adam tensor for 3
    rounds; one then pushes a 4th round to "W" alone (open: the other lives and has
    not pushed) and the store is checkpointed, destroyed and restored under its name.
    The restored tensors pull what the old ones did (the open round not applied), and
    two new workers carry on: after 2 more rounds "W" is exactly the sum of the 5 whole
    rounds (the open round dropped) and "A" is 5 steps of full-batch Adam (its state
    and step restored)."""
    name, lr, n = job.name, 0.05, 3
    job.set_consistency(0)
    W = job.dense("W", shape=SHAPE, dtype="int32", aggregate="sum", workers=2)
    A = job.dense("A", shape=SHAPE, dtype="float64", optimizer=shmps.Adam(lr=lr),
                  aggregate="mean", workers=2)
    whole = lambda rounds: sum(known_int(i, r) for r in rounds for i in (0, 1))  # noqa: E731
    flags = CTX.RawArray("q", 4)
    with Workers(hard_timeout=90) as ws:
        procs = [ws.start(ck_worker, name, i, range(n), n if i == 0 else None, flags)
                 for i in (0, 1)]
        wait_until(lambda: flags[2] and flags[3], 60, "both workers through 3 rounds")
        assert np.array_equal(W.pull(), whole(range(n)))
        assert W.rounds()["buffers"][n % 2] == {"round": n, "contributed": 1,
                                                 "in_flight": 0}
        before = {"W": W.pull(), "A": A.pull()}
        np.testing.assert_allclose(before["A"], adam_reference(n, [0, 1], lr)[-1],
                                   rtol=1e-12, atol=1e-12)
        job.checkpoint(tmp_path / "ck")
        flags[0] = 1
        for p in procs:
            p.result(30)
    job.destroy()
    s2 = shmps.restore(tmp_path / "ck", name)
    try:
        assert sorted(t["name"] for t in s2.tensors()) == [
            "A", "A#agg0", "A#agg1", "A#aggctl", "W", "W#agg0", "W#agg1", "W#aggctl"]
        assert s2.staleness == 0   # (restored eventual, A trained to other values)
        W2, A2 = s2["W"], s2["A"]
        assert isinstance(W2, shmps.aggregate.AggregateDense) and W2.workers == 2
        assert np.array_equal(W2.pull(), before["W"])
        assert np.array_equal(A2.pull(), before["A"])
        flags2 = CTX.RawArray("q", 4)
        flags2[0] = 1
        with Workers(hard_timeout=90) as ws:
            for p in [ws.start(ck_worker, name, i, range(n, n + 2), None, flags2)
                      for i in (0, 1)]:
                p.result(60)
        assert np.array_equal(W2.pull(), whole(range(n + 2)))
        np.testing.assert_allclose(A2.pull(), adam_reference(n + 2, [0, 1], lr)[-1],
                                   rtol=1e-12, atol=1e-12)
        assert W2.stats()["step"] == A2.stats()["step"] == n + 2
    finally:
        s2.destroy()


def test_waiting_for_a_slow_worker_times_out(job):
    """A worker two rounds ahead of a live worker that does not push waits, and
    Timeout names the worker that is behind."""
    flags = CTX.RawArray("q", 2)
    flags[1] = -1
    with Workers(hard_timeout=60) as ws:
        other = ws.start(idle_worker, job.name, flags)
        wait_until(lambda: flags[1] >= 0, 30, "the other worker joined")
        other_id = flags[1]
        job.join()
        W = job.dense("W", shape=(2,), aggregate="sum", workers=2)
        W.push(np.ones(2))
        job.clock()
        W.push(np.ones(2))
        job.clock()
        t0 = time.monotonic()
        with pytest.raises(shmps.Timeout, match=f"worker {other_id} "):
            W.push(np.ones(2), timeout=0.3)
        assert time.monotonic() - t0 < 2.0
        assert W.pull().tolist() == [0.0, 0.0]   # round 0 still waits for `other`
        flags[0] = 1                             # ... which leaves: rounds 0, 1 apply
        other.result(10)
        W.push(np.ones(2), timeout=5)
        assert W.pull().tolist() == [3.0, 3.0]


def _legacy_dense(store, name: str, init: float) -> None:
    """A dense tensor ``name`` made as a build before the '#agg*' names were reserved
    made it (no check of the name): a user tensor, not an aggregation's."""
    req = {"kind": "dense", "shape": [4], "dtype": "float32"}
    store._get_or_create(name, req, lambda: store._create_dense(name, req, init,
                                                                hidden_ok=True))


def test_a_legacy_user_tensor_named_like_an_accumulator_beside_a_plain_tensor_stays_its_own(
        job, store_name, tmp_path):
    """An older store holding a plain 'x' and a user tensor 'x#agg0': the user's tensor
    is an ordinary dense tensor in every process (pulls, pushes, writable views), listed
    by tensors() and `shmps-tool ls`, saved and restored as itself (the restored store
    the same), and never made x's accumulator: x cannot be turned aggregated
    (SchemaError, as for any schema change)."""
    import subprocess
    import sys

    from helpers import child_env

    x = job.dense("x", shape=(4,), dtype="float32", init=1.0)
    _legacy_dense(job, "x#agg0", 5.0)
    user = job["x#agg0"]
    assert type(user) is shmps.DenseTensor
    user.push(np.ones(4, np.float32))
    user.view(writable=True)[0] = 9.0
    assert user.pull().tolist() == [9, 6, 6, 6] and x.pull().tolist() == [1, 1, 1, 1]
    with shmps.attach(store_name, create=False) as other:
        other["x#agg0"].push(np.ones(4, np.float32))
        assert job.dense("x#agg0", shape=(4,)) is user
    assert user.pull().tolist() == [10, 7, 7, 7]
    assert sorted(t["name"] for t in job.tensors()) == ["x", "x#agg0"]
    ls = subprocess.run([sys.executable, "-m", "shmps.cli", "ls"], env=child_env(),
                        capture_output=True, text=True, timeout=60)
    assert ls.returncode == 0 and "x#agg0" in ls.stdout, ls
    with pytest.raises(shmps.SchemaError, match="aggregate"):
        job.dense("x", aggregate="sum", workers=1)
    job.checkpoint(tmp_path / "ck")
    back = shmps.restore(tmp_path / "ck", store_name + "r")
    try:
        assert sorted(t["name"] for t in back.tensors()) == ["x", "x#agg0"]
        back["x#agg0"].push(np.ones(4, np.float32))
        assert back["x#agg0"].pull().tolist() == [11, 8, 8, 8]
        assert back["x"].pull().tolist() == [1, 1, 1, 1]
    finally:
        back.destroy()


def test_a_legacy_user_tensor_named_like_an_accumulator_without_its_base(job, store_name):
    """A user tensor 'y#agg0' of an older store with no 'y': it is taken for the
    accumulator of a 'y' being created, so a push is refused (InvalidArgument) with a
    hint that says 'y' does not exist and how to keep the values; once a plain 'y' is
    made, it is the user's again, also in a process that opened it before (its handle
    refused pushes for ever, while a new attach pushed)."""
    _legacy_dense(job, "y#agg0", 5.0)
    early = job["y#agg0"]
    with pytest.raises(shmps.InvalidArgument, match=r"no tensor 'y'.*") as err:
        early.push(np.ones(4, np.float32))
    assert "init=" in str(err.value) and early.pull().tolist() == [5, 5, 5, 5]
    job.dense("y", shape=(2,), dtype="int32")
    early.push(np.ones(4, np.float32))
    early.view(writable=True)[0] = 0.0
    assert job["y#agg0"] is early and early.pull().tolist() == [0, 6, 6, 6]
    with shmps.attach(store_name, create=False) as other:
        other["y#agg0"].push(np.ones(4, np.float32))
    assert early.pull().tolist() == [1, 7, 7, 7]


@pytest.mark.parametrize("timeout", [-1, float("nan"), "x", True])
# (thread: should the bug come back, the push waits inside C, where the signal method's
# alarm never reaches Python: the run would hang instead of failing)
@pytest.mark.timeout(30, method="thread")
def test_a_bad_round_timeout_is_refused_before_anything_waits(job, timeout):
    """push(timeout=) and wait_round(timeout=) take None or seconds >= 0.  Before,
    timeout=-1 (or NaN) reached the C core, which reads a negative timeout as no limit:
    a push waiting for the team (1 of workers=2 joined) hung for ever; "x" raised a
    plain ValueError.  Nothing is pushed."""
    job.join()
    W = job.dense("W", shape=(3,), dtype="float64", aggregate="sum", workers=2)
    with pytest.raises(shmps.InvalidArgument, match="number of seconds"):
        W.push(np.ones(3), timeout=timeout)
    with pytest.raises(shmps.InvalidArgument, match="number of seconds"):
        W.wait_round(0, timeout=timeout)
    assert W.rounds()["applied"] == 0
    np.testing.assert_array_equal(W.pull(), 0)


@pytest.mark.timeout(30)
def test_an_infinite_round_timeout_waits_as_long_as_it_takes(job):
    """timeout=math.inf is "no limit" (as for attach, flush and clock): it raised
    OverflowError (int(inf * 1e9), the deadline in ns) from wait_round."""
    job.join()
    W = job.dense("W", shape=(3,), dtype="float64", aggregate="sum", workers=1)
    W.push(np.ones(3), timeout=float("inf"))
    W.wait_round(timeout=float("inf"))
    np.testing.assert_array_equal(W.pull(), 1)
