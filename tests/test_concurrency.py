"""Many processes at once: no lost update (sums of known integers exact to the last
unit), no torn read (per shard for consistent pulls, per 16 KiB stripe otherwise),
and hogwild mode runs without crashing.  Workers are 'spawn' processes (helpers.py)."""
from __future__ import annotations

import time

import numpy as np
import pytest

import shmps
from helpers import (GO, STOP, Workers, assign_writer, expected_sum, new_flags, push_known,
                     push_ones, split_ones_pusher, torn_reader, wait_until)

pytestmark = pytest.mark.timeout(180)

NPROCS = 4
STRIPE_BYTES = 16384


def run_pushers(store_name: str, tensor: str, seeds: list, n_whole: int, n_rows: int) -> list:
    """Start one push_known worker per seed, release them together, wait for all."""
    flags = new_flags(len(seeds))
    with Workers() as ws:
        for i, seed in enumerate(seeds):
            ws.start(push_known, store_name, tensor, seed, n_whole, n_rows, flags, i)
        wait_until(lambda: all(flags[2 + i] for i in range(len(seeds))), 90, "pushers ready")
        flags[GO] = 1
        return ws.results(120)


@pytest.mark.parametrize("dtype,shape,shard_rows", [
    ("int32", (64, 1024), None),        # 16 stripes
    ("float32", (64, 1024), None),      # small integers: exact
    ("float64", (64, 1024), None),      # 32 stripes
    ("int8", (64, 1024), None),         # full int8 range: wraps modulo 256
    ("float32", (256, 512), 16),        # 16 shards of 2 stripes
], ids=["int32", "float32", "float64", "int8", "float32-multishard"])
def test_concurrent_sums_are_exact(store, store_name, dtype, shape, shard_rows):
    """4 processes pushing known integers (whole and overlapping rows=) give the exact total."""
    t = store.dense("w", shape=shape, dtype=dtype, shard_rows=shard_rows, init=3)
    seeds = [101, 202, 303, 404][:NPROCS]
    n_whole, n_rows = 150, 150
    results = run_pushers(store_name, "w", seeds, n_whole, n_rows)
    assert [r["pushes"] for r in results] == [n_whole + n_rows] * NPROCS
    want = expected_sum(seeds, shape, dtype, n_whole, n_rows, init=3)
    got = t.pull()
    wrong = np.flatnonzero(got.astype(np.int64).ravel() != want.ravel())
    assert wrong.size == 0, (f"{wrong.size} elements differ, first at {wrong[:5]}: "
                             f"got {got.ravel()[wrong[:5]]}, want {want.ravel()[wrong[:5]]}")
    s = t.stats()
    assert s["pushes"] == s["step"] == NPROCS * (n_whole + n_rows)


STEP_UPDATERS = [
    shmps.Adam(lr=0.1),
    shmps.Momentum(lr=0.1, momentum=0.9, dampening=0.5),
    shmps.Adagrad(lr=0.1, lr_decay=0.05),
]


@pytest.mark.parametrize("opt", STEP_UPDATERS, ids=lambda o: type(o).__name__)
def test_concurrent_pushes_of_step_reading_updaters_follow_one_order_per_stripe(
        store, store_name, opt):
    """4 processes push the same gradient 40 times each to a 64-stripe tensor whose
    updater reads the step (Adam's bias correction, Momentum's first step with
    dampening, Adagrad's lr_decay).  Every sequential order of identical pushes gives
    the same values, so every element must equal one process's 160 pushes, bit for bit.
    (A push took its step before it locked any stripe: a stripe reached by two pushes
    in the other order applied them out of step, and stripes differed: review 14 F1,
    in 5 of 5 Adam trials of 2 processes.)"""
    shape = (64, 4096)   # 64 stripes of 16 KiB
    t = store.dense("w", shape=shape, dtype="float32", optimizer=opt, init=0.0)
    ref = store.dense("ref", shape=shape, dtype="float32", optimizer=opt, init=0.0)
    nper = 40
    flags = new_flags(NPROCS)
    with Workers() as ws:
        for i in range(NPROCS):
            ws.start(push_ones, store_name, "w", nper, flags, i)
        time.sleep(0.5)   # all attached (most): they start together
        flags[GO] = 1
        assert ws.results(120) == [nper] * NPROCS
    for _ in range(NPROCS * nper):
        ref.push(np.ones(shape, np.float32))
    got, want = t.pull(), ref.pull()
    stripes = np.unique(got.reshape(64, -1)[:, 0])
    assert stripes.size == 1 and got.tobytes() == want.tobytes(), (stripes[:4], want[0, 0])
    assert t.stats()["step"] == NPROCS * nper


def test_a_push_overtaken_on_its_stripe_applies_after_the_one_that_overtook_it(store):
    """Forced: pusher A takes step 1 and is held at the shard's door (the shard frozen
    for a moment, A stopped), pusher B takes step 2 and applies, then A.  The stripe
    must show B then A, as one process pushing B then A: Momentum with dampening gives
    B's gradient the first step's branch (b <- d) and A's the other.  (Before, A ran
    the first step's branch last and B's gradient left the buffer: no sequential
    order gave the values.)"""
    import os
    import signal

    opt = shmps.Momentum(lr=0.1, momentum=0.9, dampening=0.5)
    w = store.dense("w", shape=(4,), dtype="float64", optimizer=opt, init=0.0)
    ref = store.dense("ref", shape=(4,), dtype="float64", optimizer=opt, init=0.0)
    ga, gb = np.full(4, 1.0), np.full(4, 10.0)
    with w._frozen_shared(0):                    # pushers wait at the shard's door
        pid = os.fork()
        if pid == 0:                             # pusher A
            code = 1
            try:
                s = shmps.attach(store.name, namespace=store.namespace)
                s["w"].push(ga)                  # step 1, then waits for the thaw
                s.close()
                code = 0
            finally:
                os._exit(code)
        try:
            wait_until(lambda: w.stats()["step"] >= 1, 30, "A took its step")
            os.kill(pid, signal.SIGSTOP)
        except BaseException:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise
    try:
        w.push(gb)                               # step 2, applied first
    finally:
        os.kill(pid, signal.SIGCONT)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    ref.push(gb)
    ref.push(ga)
    w.push(np.zeros(4))
    ref.push(np.zeros(4))                        # the buffers count too
    assert w.pull().tolist() == ref.pull().tolist(), (w.pull(), ref.pull())
    assert w.stats()["step"] == 3


def test_a_push_stalled_while_a_million_others_pass_applies_after_them(store):
    """A push that took its step and then did not run (SIGSTOP, a debugger, a starved
    CPU) while 2^20 + 10 pushes went by applies after them on its stripe, at their
    count + 1, as a push coming last would; the stripe's last step goes on from
    there.  (With the stripe's last step read next to the push's own ticket, beyond
    2^20 steps apart it was ignored: the push applied at its old step, the stripe's
    step went back; review 15 F1.)  The stall is the C push called with a ticket taken
    before the others."""
    from shmps import _native

    lib, ffi = _native.lib, _native.ffi
    t = store.dense("w", shape=(1,), dtype="float64", optimizer=shmps.Momentum(
        lr=0.1, momentum=0.9, dampening=0.5))
    sh = t._shards[0]
    ticket = ffi.new("uint64_t *")
    lib.shmps_dense_next_step(sh.ptr, ticket)   # the stalled push's step
    g = np.ones(1)
    n = (1 << 20) + 10
    for _ in range(n):
        t.push(g)
    buf = float(np.array(sh.state(0))[0])
    assert lib.shmps_dense_push(sh.ptr, sh.ptr, _native.token(), ffi.from_buffer(g),
                                t._gcode, 0, 1, ticket[0], 0) == 0
    # applied at step n + 1: the buffer decays and takes (1 - dampening) of the gradient
    # (at its own step 1 the first-step branch would have reset the buffer to 1)
    # (to an ulp: a compiler may fuse the C update's multiply and add)
    assert float(np.array(sh.state(0))[0]) == pytest.approx(0.9 * buf + 0.5, rel=1e-15)
    last = int(sh.seg.array(np.uint32, sh.spec["stripes_off"], 4)[3])
    assert last == n + 1 and t.stats()["step"] == n + 1


def test_after_an_overtaken_push_a_tensor_given_rows_pushes_goes_on_at_its_tickets(store):
    """A tensor that took a rows= push (its stripes then apply at max(ticket, last)):
    a push overtaken on its stripe by a later one applies at that one's step, and the
    pushes after go on at their own tickets, not one above for ever (review 15 F2:
    with max(ticket, last + 1), one overlap left the stripe a step ahead of every
    later push).  The overtaken push is the C push called with an earlier ticket."""
    from shmps import _native

    lib, ffi = _native.lib, _native.ffi
    t = store.dense("w", shape=(2,), dtype="float64", optimizer=shmps.Adam(lr=0.1))
    sh = t._shards[0]

    def last() -> int:
        return int(sh.seg.array(np.uint32, sh.spec["stripes_off"], 4)[3])

    t.push(np.ones(1), rows=[0])                  # step 1: steps by ticket from here
    ticket = ffi.new("uint64_t *")
    lib.shmps_dense_next_step(sh.ptr, ticket)    # step 2, overtaken by ...
    t.push(np.ones(2))                           # ... step 3
    assert last() == 3
    g = np.ones(2)
    assert lib.shmps_dense_push(sh.ptr, sh.ptr, _native.token(), ffi.from_buffer(g),
                                t._gcode, 0, 1, ticket[0], 0) == 0
    assert last() == 3                           # at the step that overtook it
    for step in (4, 5, 6):
        t.push(np.ones(2))
        assert last() == step == t.stats()["step"]


def test_hogwild_mode_runs(store, store_name):
    """Hogwild pushes from 4 processes never crash and never invent values (losses allowed)."""
    shape = (64, 1024)
    t = store.dense("w", shape=shape, dtype="int32", mode="hogwild")
    seeds = [11, 22, 33, 44][:NPROCS]
    results = run_pushers(store_name, "w", seeds, 100, 100)
    assert all(r["pushes"] == 200 for r in results)
    got = t.pull()
    assert got.shape == shape
    # gradients can be negative, so bound by the sums of positive and negative parts
    pos = np.zeros(shape, np.int64)
    neg = np.zeros(shape, np.int64)
    from helpers import known_grads

    for seed in seeds:
        for g, rows in known_grads(seed, shape, "int32", 100, 100):
            g = g.astype(np.int64)
            if rows is None:
                pos += np.maximum(g, 0)
                neg += np.minimum(g, 0)
            else:
                np.add.at(pos, rows, np.maximum(g, 0))
                np.add.at(neg, rows, np.minimum(g, 0))
    assert np.all(got >= neg) and np.all(got <= pos)
    assert t.stats()["pushes"] == NPROCS * 200


def run_torn(store_name: str, how: str, seconds: float = 2.0, rows: bool = False) -> tuple:
    """One assign writer (k = 1, 2, ...) and two readers (consistent and not) for
    ``seconds``; returns (last k, consistent reader's result, stripe reader's result)."""
    flags = new_flags(3)
    with Workers() as ws:
        writer = ws.start(assign_writer, store_name, "w", flags, 0, how)
        per_shard = 64 * 1024
        cons = ws.start(torn_reader, store_name, "w", True, per_shard, flags, 1, 30.0, rows)
        # a stripe pull copies each 16 KiB stripe whole; one of rows=, each row's part
        racy = ws.start(torn_reader, store_name, "w", False,
                        1024 if rows else STRIPE_BYTES // 4, flags, 2, 30.0, rows)
        wait_until(lambda: all(flags[2 + i] for i in range(3)), 90, "workers ready")
        flags[GO] = 1
        wait_until(lambda: flags[2] > 2, 30, "writer progress")
        import time

        time.sleep(seconds)
        flags[STOP] = 1
        return writer.result(60), cons.result(60), racy.result(60)


@pytest.mark.parametrize("how,pull_rows", [("whole", False), ("rows", False), ("whole", True)],
                         ids=["whole", "rows", "pull-rows"])
def test_no_torn_reads(store, store_name, how, pull_rows):
    """Under an assign writer (pushing the whole tensor, or rows=), consistent pulls see
    one k per shard, stripe pulls one per stripe.  pull-rows: the readers pull rows= of
    every row, or of 60, in a random order (one C call grouping them by shard; a
    stripe pull then copies each row's part of a stripe whole)."""
    # 4 shards x 16 stripes of 4096 float32 (a row is 4 KiB: 4 rows per stripe)
    t = store.dense("w", shape=(256, 1024), dtype="float32", optimizer="assign",
                    shard_rows=64)
    assert t.nshards == 4
    last_k, cons, racy = run_torn(store_name, how, rows=pull_rows)
    assert last_k > 2
    for name, r in (("consistent", cons), ("stripe", racy)):
        assert r["pulls"] > 1
        assert r["mixed"] == 0, f"{name} reader saw mixed values: {r['examples']}"
        assert r["backwards"] == 0, f"{name} reader saw a unit go back in time"
    assert cons["distinct"] > 1 and racy["distinct"] > 1, "the writer ran during the reads"
    final = t.pull()
    assert np.all(final == final.flat[0]) and final.flat[0] == last_k


@pytest.mark.parametrize("shape,shard_rows", [((4096, 1024), None), ((6144, 1024), 2048)],
                         ids=["one-shard-16MiB", "3-shards-24MiB"])
def test_split_push_is_whole_for_consistent_pulls(store, store_name, shape, shard_rows):
    """A whole push of >= 16 MiB split over threads (parts cutting one shard) is one
    push to a consistent pull: every shard it copies holds one count of pushes."""
    t = store.dense("w", shape=shape, dtype="int32", optimizer="sum", shard_rows=shard_rows)
    unit = t.shard_rows * t.row_len
    flags = new_flags(2)
    with Workers() as ws:
        pusher = ws.start(split_ones_pusher, store_name, "w", flags, 0)
        reader = ws.start(torn_reader, store_name, "w", True, unit, flags, 1, 30.0)
        wait_until(lambda: all(flags[2 + i] for i in range(2)), 90, "workers ready")
        flags[GO] = 1
        wait_until(lambda: flags[2] > 2 and flags[3] > 2, 30, "pushes and pulls")
        time.sleep(3.0)
        flags[STOP] = 1
        pushes, r = pusher.result(60), reader.result(60)
    assert pushes > 2 and r["pulls"] > 2
    assert r["mixed"] == 0, f"{r['mixed']} shard copies of {r['pulls']} pulls held part of " \
                            f"a push: {r['examples']}"
    assert r["backwards"] == 0
    final = t.pull()
    assert np.all(final == pushes)


def test_no_torn_stripe_reads_with_shuffled_rows(store, store_name):
    """A rows= push listing rows in random order never tears a stripe or a shard."""
    store.dense("w", shape=(256, 1024), dtype="float32", optimizer="assign", shard_rows=64)
    last_k, cons, racy = run_torn(store_name, "shuffled")
    assert cons["mixed"] == 0 and cons["backwards"] == 0
    assert racy["mixed"] == 0, f"stripe reader saw mixed values: {racy['examples']}"


def test_single_process_two_handles_interleave_exactly(store_name):
    """Two handles in one process (two attaches) pushing alternately lose nothing."""
    a = shmps.attach(store_name)
    b = shmps.attach(store_name)
    try:
        ta = a.dense("w", shape=(1000,), dtype="int32")
        tb = b.dense("w")
        for i in range(100):
            (ta if i % 2 else tb).push(np.ones(1000, np.int32))
        np.testing.assert_array_equal(ta.pull(), 100)
    finally:
        a.close()
        b.destroy()


def test_threads_pushing_concurrently_are_exact(store):
    """4 threads of one process pushing (GIL released in C) lose nothing."""
    import threading

    t = store.dense("w", shape=(128, 1024), dtype="int32")
    g = np.ones((128, 1024), np.int32)
    rows = np.arange(128).repeat(2)

    def work():
        for i in range(50):
            t.push(g) if i % 2 else t.push(np.ones((256, 1024), np.int32), rows=rows)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads)
    np.testing.assert_array_equal(t.pull(), 4 * (25 + 25 * 2))
