"""The store side of the multi-host bridge: the forwarding switch, outboxes, drains,
acknowledgements, store.flush(), direct application, and row reads/writes for
replication (shmps/outbox.py, native/outbox.c; docs/concurrency.md "Outboxes").

Real processes and shared memory; every wait is bounded."""
from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shmps
import shmps._native as native
from helpers import (GO, SHM, STOP, Workers, after_go, dead_token, new_flags, peek,
                     poison_frame_buffers, poke, publish_token, table_push_loop, wait_until)

pytestmark = pytest.mark.timeout(240)

lib = native.lib
ACTIVE_OFF = 448  # shard header: active[] (docs/segment-layout.md)
FREEZE_OFF = 384  # the exclusive freezer's token
OB_PUSHED_OFF = 1152  # outbox shards: ob_pushed
LANDING_OFF = 1856  # outbox shards: landing slots {token, seq}[64]


def drain_all(t, into=None):
    """Drain every shard of t's outbox; returns {index: summed grad} (float64/int64)."""
    into = {} if into is None else into
    for s in range(t._nshards):
        d = t._outbox_drain(s)
        if d is None:
            continue
        assert d.pushes >= 1
        for key, g in zip(d.index.tolist(), d.grads):
            acc = into.get(key)
            g = g.astype(np.float64 if g.dtype.kind == "f" else np.int64)
            into[key] = g if acc is None else acc + g
    return into


def as_dense(sums: dict, shape: tuple, dtype=np.int64) -> np.ndarray:
    out = np.zeros(shape, dtype)
    for r, g in sums.items():
        out[r] = g
    return out


def segment_path(store: shmps.Store, tensor) -> str:
    return os.path.join(SHM, tensor._shards[0].seg.name.lstrip("/"))


# ---- forwarding off: nothing changes ----------------------------------------------------

def test_forwarding_off_is_unchanged(store):
    assert store._forwarding is False
    w = store.dense("w", shape=(8, 3), optimizer=shmps.SGD(lr=0.5))
    w.push(np.ones((8, 3), np.float32))
    w.push(np.ones((2, 3), np.float32), rows=[1, 1])
    w.push(np.ones((8, 3), np.float32), wait=False).wait(10)
    want = np.full((8, 3), -1.0, np.float32)
    want[1] -= 1.0
    np.testing.assert_array_equal(w.pull(), want)
    t = store.table("e", dim=2, capacity=10)
    t.push([1, 2], np.ones((2, 2)))
    np.testing.assert_array_equal(t.pull([1, 2]), np.ones((2, 2)))
    assert not any(d["name"].endswith("#outbox") for d in store.tensors())
    t0 = time.monotonic()
    store.flush(timeout=0.0)
    assert time.monotonic() - t0 < 0.05


def test_switch_is_shared_between_attachments(store, store_name):
    other = shmps.attach(store_name)
    try:
        store._set_forwarding(True)
        assert other._forwarding is True
        other._set_forwarding(False)
        assert store._forwarding is False
    finally:
        other.close()


def test_outbox_names_are_reserved(store):
    with pytest.raises(shmps.InvalidArgument, match="reserved"):
        store.dense("x#outbox", shape=(2,))
    with pytest.raises(shmps.InvalidArgument, match="reserved"):
        store.table("y#outbox", dim=2, capacity=4)
    assert len(store.tensors()) == 0


# ---- dense: pushes go to the outbox, drains take them exactly ----------------------------

def test_an_outbox_keeps_pages_only_for_what_is_pushed(store):
    """A worker's forwarded push creates the outbox; its pages are not backed at
    creation (unlike a tensor's): a table outbox is the table's capacity, and a few
    keys pushed take a few pages of it, not all.  (Backed, an outbox on every host
    doubled the model's resident memory.)"""
    t = store.table("emb", dim=64, capacity=100_000, shards=2)   # ~28 MiB of values
    store._set_forwarding(True)
    t.push(np.arange(10, dtype=np.uint64), np.ones((10, 64), np.float32))
    ob = t._outbox()
    used = sum(_allocated(sh.seg) for sh in ob._shards)
    size = sum(sh.seg.size for sh in ob._shards)
    assert used < size // 4, (used, size)
    store._set_forwarding(False)


def test_dense_forwarded_pushes_and_drain(store):
    w = store.dense("w", shape=(10, 3), init=5.0, optimizer=shmps.SGD(lr=0.5), shard_rows=4)
    store._set_forwarding(True)
    g = np.arange(30, dtype=np.float32).reshape(10, 3)
    w.push(g)
    w.push(np.ones((4, 3), np.float32), rows=[1, 1, 9, 5])       # duplicates accumulate
    w.push(np.full((1, 3), 2, np.float32), rows=np.array([9]), wait=False).wait(10)
    w.push(np.ones((0, 3), np.float32), rows=[])                  # touches nothing
    np.testing.assert_array_equal(w.pull(), np.full((10, 3), 5.0, np.float32))
    assert w.stats()["pushes"] == 0                               # no updater ran
    ob = w._outbox()
    assert ob.name == "w#outbox" and ob.dtype == np.float32 and ob.shape == w.shape
    assert "w#outbox" in [d["name"] for d in store.tensors()]
    assert w._outbox() is ob and store["w#outbox"] is ob
    # per-row pending counts: one per push touching the row (rows fit in one stripe)
    np.testing.assert_array_equal(ob._pending(0), [1, 3, 1, 1])
    np.testing.assert_array_equal(ob._pending(1), [1, 2, 1, 1])
    np.testing.assert_array_equal(ob._pending(2), [1, 3])
    pushed = [native_counters(ob, s)[0] for s in range(3)]
    assert pushed == [2, 2, 3]                                    # pushes per shard
    want = g.astype(np.float64)
    np.add.at(want, [1, 1, 9, 5], 1.0)
    want[9] += 2
    got = {}
    for s in range(3):
        d = w._outbox_drain(s)
        assert d.pushed == pushed[s] and d.pushes == pushed[s]
        assert d.index.dtype == np.int64 and d.grads.dtype == np.float32
        assert np.all(np.diff(d.index) > 0)
        assert d.grads.shape == (d.index.size, 3)
        for r, gr in zip(d.index, d.grads):
            got[int(r)] = gr
        assert w._outbox_drain(s) is None                         # nothing left
        assert not ob._pending(s).any()
    np.testing.assert_array_equal(as_dense(got, (10, 3), np.float64), want)
    np.testing.assert_array_equal(ob.pull(), np.zeros((10, 3), np.float32))
    # a push after a drain: counted from the previous drain
    w.push(np.ones((1, 3), np.float32), rows=[0])
    d = w._outbox_drain(0)
    assert (d.pushed, d.pushes, d.index.tolist()) == (3, 1, [0])
    with pytest.raises(shmps.InvalidArgument):
        ob.push(np.ones((10, 3), np.float32))                     # outboxes: forwarded only


def native_counters(ob, shard):
    from shmps.outbox import counters
    return counters(ob, shard)


def test_busy_names_the_shards_worth_draining_and_buffers_are_reused(store):
    from shmps.outbox import DrainBuffers
    w = store.dense("w", shape=(12, 2), dtype="float32", shard_rows=3)      # 4 shards
    t = store.table("e", dim=2, capacity=64, shards=4)
    store._set_forwarding(True)
    assert w._outbox_busy() == [] and t._outbox_busy() == []
    w.push(np.ones((2, 2), np.float32), rows=[1, 10])                      # shards 0, 3
    keys = np.arange(1, 40, dtype=np.uint64)
    home = t._key_shard(keys)
    k1 = keys[home == 1][:3]
    t.push(k1, np.ones((3, 2)))
    assert w._outbox_busy() == [0, 3] and t._outbox_busy() == [1]
    buf = DrainBuffers()
    d0 = w._outbox_drain(0, into=buf)
    assert d0.index.tolist() == [1] and d0.grads.tolist() == [[1.0, 1.0]]
    assert w._outbox_busy() == [3]                # shard 0 is drained, 3 is still busy
    d3 = w._outbox_drain(3, into=buf)
    assert d3.index.tolist() == [10]
    assert np.shares_memory(d0.grads, d3.grads)   # views of the same buffers
    assert w._outbox_busy() == []
    dk = t._outbox_drain(1, into=DrainBuffers())
    assert sorted(dk.index.tolist()) == sorted(k1.tolist()) and t._outbox_busy() == []
    # without buffers a drain owns its arrays; an empty drain leaves nothing busy
    w.push(np.ones((1, 2), np.float32), rows=[4])
    assert w._outbox_busy() == [1]
    d = w._outbox_drain(1)
    assert d.index.tolist() == [4] and w._outbox_drain(1) is None and w._outbox_busy() == []
    # a closed outbox raises Closed (its cached shard bases would point at unmapped
    # memory: before, this call crashed the process with SIGSEGV)
    w._outbox().close()
    t._outbox().close()
    for x in (w, t):
        with pytest.raises(shmps.Closed):
            x._outbox_busy()


def test_one_busy_scan_over_many_tensors_equals_each_tensors_busy(store, store_name):
    """outbox.BusyScan (the bridge's flush loop: one C call for every tensor) names the
    same (tensor, shard) pairs as each tensor's _outbox_busy, for dense, table and csr
    tensors of different shard counts, and raises Closed once the store is closed."""
    from shmps.outbox import BusyScan
    rng = np.random.default_rng(3)
    ts = [store.dense(f"d{i}", shape=(4 * (i + 1), 2), dtype="float32", shard_rows=2)
          for i in range(5)]
    ts.append(store.table("e", dim=2, capacity=64, shards=3))
    rc = np.array([0, 1, 2, 3, 4], np.int64)
    ts.append(store.csr("x", rc, np.array([0, 1, 0, 1], np.int64), "float32", shape=(4, 2),
                        shard_rows=2))
    store._set_forwarding(True)
    scan = BusyScan(ts)
    assert scan.scan() == []
    for _ in range(6):
        i = int(rng.integers(len(ts)))
        t = ts[i]
        if i < 5:
            rows = np.unique(rng.integers(0, t.nrows, 2))
            t.push(np.ones((rows.size, 2), np.float32), rows=rows)
        elif i == 5:
            t.push(rng.integers(1, 1000, 3).astype(np.uint64), np.ones((3, 2)))
        else:
            t.push(shmps.CSR(rc, np.array([0, 1, 0, 1], np.int64), np.ones(4, np.float32)))
        want = [(k, s) for k, x in enumerate(ts) for s in x._outbox_busy()]
        assert scan.scan() == want and want
        k, s = want[0]
        ts[k]._outbox_drain(s)
        assert scan.scan() == want[1:]
        for k, s in want[1:]:
            ts[k]._outbox_drain(s)
        assert scan.scan() == []
    other = shmps.attach(store_name)
    try:
        scan2 = BusyScan([other["d0"]])
    finally:
        other.close()
    with pytest.raises(shmps.Closed):
        scan2.scan()


def test_outbox_calls_over_many_shards_look_them_up_in_batches(store):
    """shmps_outbox_land/landed and shmps_outbox_busy look their shards' specs up 16 at a
    time (native/outbox.c, outbox_hdrs): over 40 shards (batches of 16, 16, 8) a whole
    push and a rows= push land in every shard they touch, count there and free every
    slot; busy names exactly those shards; and a claim that fails in a later batch
    frees the slots of the earlier ones."""
    from shmps.outbox import busy
    n = 40
    w = store.dense("w", shape=(n, 2), dtype="float32", shard_rows=1)   # 40 shards
    store._set_forwarding(True)
    ob = w._outbox()
    rows = np.array([0, 15, 16, 17, 31, 32, 39])
    w.push(np.ones((rows.size, 2), np.float32), rows=rows)
    assert busy(w) == rows.tolist()
    for s in range(n):
        path = os.path.join(SHM, ob._shard(s).seg.name.lstrip("/"))
        assert peek(path, OB_PUSHED_OFF, "<Q")[0] == (1 if s in rows else 0)
        assert not any(peek(path, LANDING_OFF, "<128Q")[0::2])           # no slot held
    w.push(np.ones((n, 2), np.float32))
    assert busy(w) == list(range(n))
    # every shard touched, shard 37 unmapped (NULL): the claims of shards 0..36 (three
    # batches) are undone, and the call says so
    bases = native.ffi.new("void *[]", [ob._shard(s).ptr for s in range(n)])
    bases[37] = native.ffi.NULL
    slots = native.ffi.new("uint8_t[]", [lib.SHMPS_LANDING_NONE] * n)
    code = lib.shmps_outbox_land(bases, n, ob._every_shard(), native.token(), slots)
    assert code == lib.SHMPS_E_ARG
    assert list(slots) == [lib.SHMPS_LANDING_NONE] * n
    for s in range(n):
        path = os.path.join(SHM, ob._shard(s).seg.name.lstrip("/"))
        assert not any(peek(path, LANDING_OFF, "<128Q")[0::2]), s
    for s in range(n):
        d = w._outbox_drain(s)
        assert d.grads.tolist() == [[2.0, 2.0] if s in rows else [1.0, 1.0]]
    assert busy(w) == []


def push_each_kind(store: str, names: tuple) -> int:
    """One forwarded push each: a dense tensor's whole, some of its rows, a table's key
    and a csr tensor's entries; returns how many."""
    s = shmps.attach(store)
    try:
        d, e, x = (s[n] for n in names)
        d.push(np.ones(d.shape, np.float32))
        d.push(np.ones((1, 2), np.float32), rows=[3])
        e.push(np.array([5], np.uint64), np.ones((1, 2)))
        x.push(shmps.CSR(np.array([0, 1, 2, 3, 4], np.int64), np.array([0, 1, 0, 1], np.int64),
                         np.ones(4, np.float32)))
        return 4
    finally:
        s.close()


def test_the_busy_scan_is_skipped_until_a_forwarded_push_counts(store, store_name):
    """Every forwarded push (dense whole and rows=, table, csr), here from another
    process, adds 1 to the store's count of forwarded pushes (shmps_forward_pushes)
    after it counted itself in its shards.  BusyScan skips its C call while that count
    stays where it was at a call that found nothing busy, and calls once it moved, after
    a call that found something, or when asked for a full scan.  A push counted in its
    shard but not in the store's count (its process died in between) is seen by a full
    scan only: the bridge makes one every FULL_SCAN_EVERY s."""
    from shmps.outbox import BusyScan
    d = store.dense("d", shape=(8, 2), dtype="float32", shard_rows=2)
    e = store.table("e", dim=2, capacity=64, shards=3)
    x = store.csr("x", np.array([0, 1, 2, 3, 4], np.int64), np.array([0, 1, 0, 1], np.int64),
                  "float32", shape=(4, 2), shard_rows=2)
    ts = (d, e, x)
    store._set_forwarding(True)
    scan = BusyScan(ts)

    def count() -> int:
        return int(lib.shmps_forward_pushes(store._mptr))

    c0 = count()
    assert scan.scan() == [] and scan.calls == 1
    assert scan.scan() == [] and scan.calls == 1                # nothing pushed: skipped
    assert scan.scan(full=True) == [] and scan.calls == 2
    with Workers() as ws:
        assert ws.start(push_each_kind, store_name, ("d", "e", "x")).result(60) == 4
    assert count() == c0 + 4
    busy = scan.scan()
    assert busy and busy == [(k, s) for k, t in enumerate(ts) for s in t._outbox_busy()]
    assert scan.calls == 3
    ts[busy[0][0]]._outbox_drain(busy[0][1])
    assert scan.scan() == busy[1:] and scan.calls == 4          # it found some: calls
    for k, s in busy[1:]:
        ts[k]._outbox_drain(s)
    assert scan.scan() == [] and scan.calls == 5
    assert scan.scan() == [] and scan.calls == 5
    # counted in shard 1 of d's outbox only, as by a pusher killed before the store's count
    lib.shmps_outbox_pushed(d._outbox()._shard(1).ptr)
    assert count() == c0 + 4 and d._outbox_busy() == [1]
    assert scan.scan() == [] and scan.calls == 5                # unseen...
    assert scan.scan(full=True) == [(0, 1)] and scan.calls == 6  # ...but by a full scan
    assert d._outbox_drain(1) is None and scan.scan() == [] and scan.calls == 7


def test_the_first_push_after_the_bridge_went_idle_wakes_it_once(store, store_name):
    """shmps_forward_idle lets the bridge sleep only if no push was counted since the
    count it names (else it clears the flag: pass again); the first push after it went
    idle clears the flag and wakes the bridge: a PUSH datagram on its doorbell, or, with
    nobody listening there, fwd_wakes bumped and the futex the bridge's waiting thread
    sleeps on woken (flush_req, which counts store.flush() calls, unchanged).  The
    pushes after it make no wake; shmps_forward_awake clears the flag too."""
    from shmps import doorbell

    w = store.dense("w", shape=(4, 2), dtype="float32", shard_rows=2)
    store._set_forwarding(True)
    man = store._mptr

    def count() -> int:
        return int(lib.shmps_forward_pushes(man))

    def wakes() -> tuple:
        # (futex wakes, flush_req: read with max_ns 0)
        return int(lib.shmps_forward_wakes(man)), int(lib.shmps_flush_wait(man, 0, 0))

    seen, w0 = count(), wakes()
    w.push(np.ones((4, 2), np.float32))
    assert lib.shmps_forward_idle(man, seen) == 0                # a push came since
    w.push(np.ones((4, 2), np.float32))
    assert wakes() == w0                                         # (not idle: no wake)
    seen = count()
    assert lib.shmps_forward_idle(man, seen) == 1                # may sleep
    w.push(np.ones((1, 2), np.float32), rows=[3])
    assert wakes() == (w0[0] + 1, w0[1])                         # woken once, by futex
    w.push(np.ones((4, 2), np.float32))
    assert wakes() == (w0[0] + 1, w0[1]) and count() == seen + 2
    assert lib.shmps_forward_idle(man, count()) == 1
    lib.shmps_forward_awake(man)                                 # awake by itself
    w.push(np.ones((4, 2), np.float32))
    assert wakes() == (w0[0] + 1, w0[1])
    # with a bridge on the doorbell: one PUSH datagram, no futex wake
    sock = doorbell.listen(store_name, store.namespace)
    assert sock is not None
    try:
        assert lib.shmps_forward_idle(man, count()) == 1
        w.push(np.ones((4, 2), np.float32))
        w.push(np.ones((4, 2), np.float32))
        assert doorbell.take(sock) == (0, 1) and wakes() == (w0[0] + 1, w0[1])
    finally:
        sock.close()


def push_rows_now_and_then(store: str, tensor: str, seed: int, flags, idx: int) -> int:
    """Push one row at random moments (0-2 ms apart) until STOP; returns how many."""
    s = shmps.attach(store)
    t = s[tensor]
    rng = np.random.default_rng(seed)
    g = np.ones((1, t.shape[1]), t.dtype)
    n = 0
    flags[2 + idx] = 1
    while not flags[GO]:
        time.sleep(0.001)
    while not flags[STOP]:
        t.push(g, rows=[int(rng.integers(t.nrows))])
        n += 1
        time.sleep(float(rng.uniform(0, 0.002)))
    s.close()
    return n


def test_a_bridge_asleep_is_woken_by_the_first_of_concurrent_pushes(store, store_name):
    """The sleep/wake protocol under concurrent pushers (native/outbox.c "Sleeping until a
    push"): a bridge loop here goes idle with the count it saw, as often as it can,
    while three processes push at random moments.  Every idle period in which a push
    was counted ends with a PUSH datagram on the doorbell (no lost wake-up: one pusher
    wins the flag and rings), and a period with no push sees none.  (A winner that does
    not ring, one push in 7, fails it within a second.)"""
    from select import select

    from shmps import doorbell

    w = store.dense("w", shape=(64, 4), dtype="float32", shard_rows=16)
    store._set_forwarding(True)
    w._outbox()
    man = store._mptr
    sock = doorbell.listen(store_name, store.namespace)
    assert sock is not None
    nproc = 3
    flags = new_flags(nproc)
    periods = woken = 0
    try:
        with Workers() as ws:
            procs = [ws.start(push_rows_now_and_then, store_name, "w", 40 + i, flags, i)
                     for i in range(nproc)]
            wait_until(lambda: all(flags[2 + i] for i in range(nproc)), 120, "pushers ready")
            flags[GO] = 1
            end = time.monotonic() + 3.0
            while time.monotonic() < end:
                doorbell.take(sock)                       # (a late ring of a period before)
                seen = int(lib.shmps_forward_pushes(man))
                if not lib.shmps_forward_idle(man, seen):
                    continue                              # a push came since: not asleep
                periods += 1
                ready, _, _ = select([sock], [], [], 1.0)
                if ready:
                    assert doorbell.take(sock)[1] >= 1
                    woken += 1
                else:
                    moved = int(lib.shmps_forward_pushes(man)) - seen
                    assert moved == 0, f"{moved} pushes while asleep, and no wake-up"
                lib.shmps_forward_awake(man)
            flags[STOP] = 1
            pushed = sum(p.result(60) for p in procs)
    finally:
        sock.close()
    assert pushed > 500 and woken > 100, (pushed, periods, woken)


def test_forwarded_push_validation_changes_nothing(store):
    w = store.dense("w", shape=(6, 2), dtype="float32", shard_rows=3)
    t = store.table("e", dim=2, capacity=8)
    store._set_forwarding(True)
    bad = [
        (shmps.SchemaError, lambda: w.push(np.ones((5, 2), np.float32))),
        (shmps.SchemaError, lambda: w.push(np.ones((6, 2), np.complex64))),
        (shmps.NonFinite, lambda: w.push(np.full((6, 2), np.nan, np.float32))),
        (shmps.NonFinite, lambda: w.push(np.full((1, 2), np.inf), rows=[2])),
        (shmps.OutOfRange, lambda: w.push(np.ones((1, 2), np.float32), rows=[6])),
        (shmps.OutOfRange, lambda: w.push(np.ones((1, 2), np.float32), rows=[-1])),
        # int64 arrays: checked by the C push into the outbox, before it writes
        (shmps.OutOfRange, lambda: w.push(np.ones((2, 2), np.float32),
                                          rows=np.array([0, 6], np.int64))),
        (shmps.OutOfRange, lambda: w.push(np.ones((2, 2), np.float32),
                                          rows=np.array([-1, 4], np.int64))),
        (shmps.SchemaError, lambda: w.push(np.ones((2, 2), np.float32), rows=[1])),
        (shmps.SchemaError, lambda: t.push([1, 2], np.ones((3, 2)))),
        (shmps.InvalidArgument, lambda: t.push([-1], np.ones((1, 2)))),
        (shmps.NonFinite, lambda: t.push([1, 2], np.array([[0, 1], [np.nan, 0]]))),
    ]
    for exc, call in bad:
        with pytest.raises(exc):
            call()
    for tensor in (w, t):
        ob = tensor._outbox()
        for s in range(ob.nshards):
            assert native_counters(ob, s) == (0, 0)
            assert tensor._outbox_drain(s) is None
    assert len(t._outbox()) == 0
    np.testing.assert_array_equal(w.pull(), np.zeros((6, 2), np.float32))
    # allow_nonfinite tensors forward NaN/Inf, as they would apply them
    wn = store.dense("wn", shape=(2,), allow_nonfinite=True)
    wn.push(np.array([np.inf, 1.0], np.float32))
    d = wn._outbox_drain(0)
    assert np.isinf(d.grads[0]) and d.grads[1] == 1.0


def test_float16_tensor_forwards_float32_gradients(store):
    w = store.dense("h", shape=(3, 2), dtype="float16")
    store._set_forwarding(True)
    w.push(np.full((3, 2), 1.0 + 2.0 ** -12, np.float32))  # not representable in float16
    d = w._outbox_drain(0)
    assert d.grads.dtype == np.float32
    np.testing.assert_array_equal(d.grads, np.full((3, 2), 1.0 + 2.0 ** -12, np.float32))


def test_rows_straddling_stripes(store):
    # int32 rows of 3000 values: 4096 per 16 KiB stripe, so most rows span two stripes
    w = store.dense("w", shape=(9, 3000), dtype="int32", shard_rows=5)
    store._set_forwarding(True)
    rng = np.random.default_rng(1)
    want = np.zeros((9, 3000), np.int64)
    touches = np.zeros(9, np.int64)
    for k in range(6):
        if k % 2:
            g = rng.integers(-9, 10, size=(9, 3000)).astype(np.int32)
            w.push(g)
            want += g
            touches += 1
        else:
            rows = rng.integers(0, 9, size=5)
            g = rng.integers(-9, 10, size=(5, 3000)).astype(np.int32)
            w.push(g, rows=rows)
            np.add.at(want, rows, g)
            np.add.at(touches, rows, 1)
    # a push counts once per stripe the row spans (offsets within the row's shard)
    local = np.r_[np.arange(5), np.arange(4)] * 3000
    spans = (local + 2999) // 4096 - local // 4096 + 1
    assert spans.max() == 2 and spans.min() == 1
    ob = w._outbox()
    pend = np.r_[ob._pending(0), ob._pending(1)].astype(np.int64)
    np.testing.assert_array_equal(pend, touches * spans)
    np.testing.assert_array_equal(as_dense(drain_all(w), (9, 3000)), want)
    assert all(not ob._pending(s).any() for s in range(2))


# ---- exact against concurrent pushers --------------------------------------------------------

def forward_pusher(store: str, tensor: str, seed: int, npush: int, flags, idx: int) -> dict:
    """Push random integers (whole and rows= with duplicates) into a forwarding store;
    return their exact sum and how many pushes touched each shard."""
    s = shmps.attach(store)
    try:
        t = s[tensor]
        rng = np.random.default_rng(seed)
        total = np.zeros(t.shape, np.int64)
        touched = np.zeros(t.nshards, np.int64)
        flags[2 + idx] = 1
        while not flags[GO]:
            time.sleep(0.001)
        for k in range(npush):
            if k % 3 == 0:
                g = rng.integers(-50, 51, size=t.shape)
                t.push(g.astype(t.dtype))
                total += g
                touched += 1
            else:
                rows = rng.integers(0, t.nrows, size=int(rng.integers(1, 8)))
                rows[: rows.size // 2] = rows[0]
                g = rng.integers(-50, 51, size=(rows.size,) + t.shape[1:])
                t.push(g.astype(t.dtype), rows=rows, wait=k % 5 != 1)
                np.add.at(total, rows, g)
                touched[np.unique(rows // t.shard_rows)] += 1
        s.close()  # waits for the wait=False pushes
        flags[2 + idx] = 2  # done (the result is sent once the parent reads it)
        return {"total": total, "touched": touched}
    finally:
        s.close()


@pytest.mark.parametrize("dtype", ["int32", "float64"])
def test_concurrent_drain_is_exact(store, store_name, dtype):
    shape = (12, 1500) if dtype == "int32" else (12, 700)   # rows straddle stripes
    w = store.dense("w", shape=shape, dtype=dtype, shard_rows=5)
    store._set_forwarding(True)
    w._outbox()  # created once here (the workers would race to create it: also fine)
    nproc, npush = 4, 150
    flags = new_flags(nproc)
    got: dict = {}
    last = [0] * w.nshards
    with Workers() as ws:
        procs = [ws.start(forward_pusher, store_name, "w", 100 + i, npush, flags, i)
                 for i in range(nproc)]
        wait_until(lambda: all(flags[2 + i] for i in range(nproc)), 120, "pushers ready")
        flags[GO] = 1
        drains = 0
        while not all(flags[2 + i] == 2 for i in range(nproc)):
            assert all(p.alive() for p in procs)
            for s in range(w.nshards):
                d = w._outbox_drain(s)
                if d is not None:
                    assert d.pushed >= last[s]
                    last[s] = d.pushed
                    drains += 1
                    for r, g in zip(d.index.tolist(), d.grads):
                        got[r] = got.get(r, 0) + g.astype(np.int64)
            time.sleep(0.001)
        results = [p.result(60) for p in procs]
    for s in range(w.nshards):  # the final drain
        d = w._outbox_drain(s)
        if d is not None:
            for r, g in zip(d.index.tolist(), d.grads):
                got[r] = got.get(r, 0) + g.astype(np.int64)
    want = sum(r["total"] for r in results)
    np.testing.assert_array_equal(as_dense(got, shape), want)
    ob = w._outbox()
    touched = sum(r["touched"] for r in results)
    for s in range(w.nshards):
        assert native_counters(ob, s)[0] == touched[s]
        assert not ob._pending(s).any()
    assert drains > nproc  # drains really ran while pushers pushed
    np.testing.assert_array_equal(w.pull(), np.zeros(shape, dtype))


def table_pusher(store: str, tensor: str, seed: int, npush: int, flags, idx: int) -> dict:
    s = shmps.attach(store)
    try:
        t = s[tensor]
        rng = np.random.default_rng(seed)
        total: dict = {}
        flags[2 + idx] = 1
        while not flags[GO]:
            time.sleep(0.001)
        for _ in range(npush):
            keys = rng.integers(0, 40, size=int(rng.integers(1, 12))).astype(np.uint64)
            g = rng.integers(-50, 51, size=(keys.size, t.dim))
            while True:
                try:
                    t.push(keys, g.astype(t.dtype))
                    break
                except shmps.CapacityError:
                    # the outbox stayed full for FULL_RETRY_S: the parent's drains were
                    # starved (a loaded machine: it failed so at load 15); a refused
                    # push changed nothing, so the same push again
                    time.sleep(0.01)
            for k, row in zip(keys.tolist(), g):
                total[k] = total.get(k, 0) + row
        flags[2 + idx] = 2  # done (the result is sent once the parent reads it)
        return {"total": total}
    finally:
        s.close()


@pytest.mark.parametrize("capacity", [40, 4096])
def test_table_concurrent_drain_is_exact(store, store_name, capacity):
    """Four processes push random keys of 40 while drains run: what the drains take sums
    to what was pushed, exactly.  Capacity 40: the keys fill the outbox, every drain
    scans and removes them; 4096: the drains follow the list of rows pushed to and keep
    the keys (native/table.c "Outbox drains")."""
    t = store.table("e", dim=4, dtype="float64", capacity=capacity, shards=2,
                    optimizer=shmps.Adagrad(lr=0.1))
    store._set_forwarding(True)
    t._outbox()
    nproc, npush = 4, 300
    flags = new_flags(nproc)
    got: dict = {}
    drains = 0
    with Workers() as ws:
        procs = [ws.start(table_pusher, store_name, "e", 7 + i, npush, flags, i)
                 for i in range(nproc)]
        wait_until(lambda: all(flags[2 + i] for i in range(nproc)), 120, "pushers ready")
        flags[GO] = 1
        while not all(flags[2 + i] == 2 for i in range(nproc)):
            assert all(p.alive() for p in procs)
            for s in range(t._nshards):
                d = t._outbox_drain(s)
                if d is not None:
                    drains += 1
                    for k, g in zip(d.index.tolist(), d.grads):
                        got[k] = got.get(k, 0) + g
            time.sleep(0.0005)
        results = [p.result(60) for p in procs]
    assert drains > nproc  # drains really ran while pushers pushed
    drain_all(t, got)
    want: dict = {}
    for r in results:
        for k, g in r["total"].items():
            want[k] = want.get(k, 0) + g
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"key {k}")
    ob = t._outbox()
    assert ob._pending().size == 0  # (drains keep keys under a quarter full: a few stay)
    ob.check()                      # index, free lists and counters consistent
    assert len(t) == 0              # the table itself was never touched


def test_table_drain_removes_rows_and_keeps_counts(store):
    t = store.table("e", dim=2, capacity=6, optimizer=shmps.SGD(lr=1.0), shards=1)
    store._set_forwarding(True)
    ob = t._outbox()
    assert ob.capacity == 6 and ob.nshards == 1 and ob.dtype == np.float32
    for rnd in range(5):  # 5 x 5 distinct keys through a 6-key outbox: drains free rows
        keys = np.arange(rnd * 5, rnd * 5 + 5, dtype=np.uint64)
        t.push(keys, np.ones((5, 2)))
        t.push(keys[:2], np.ones((2, 2)))
        assert len(ob) == 5
        assert ob.row_stats(keys)["pushes"].tolist() == [2, 2, 1, 1, 1]
        d = t._outbox_drain(0)
        assert sorted(d.index.tolist()) == keys.tolist()
        order = np.argsort(d.index)
        np.testing.assert_array_equal(d.grads[order], [[2, 2], [2, 2], [1, 1], [1, 1], [1, 1]])
        assert (d.pushed, d.pushes) == (2 * rnd + 2, 2)
        assert len(ob) == 0 and t._outbox_drain(0) is None
    ob.check()
    # a push that would overflow the outbox: CapacityError naming the bridge, nothing changed
    with pytest.raises(shmps.CapacityError, match="bridge"):
        t.push(np.arange(100, 107, dtype=np.uint64), np.ones((7, 2)))
    assert len(ob) == 0 and native_counters(ob, 0)[0] == 10


OB_DIRTY_OFF = 1160  # table outbox shards: head of the list of rows pushed to (row + 1)
OB_RESCAN_OFF = 1168  # ... and 1: the next drain looks at every row


def test_a_table_outbox_keeps_its_keys_and_a_drain_takes_the_rows_pushed_since(store):
    """A drain takes the rows pushed to since the last one, from the shard's list, and
    keeps their keys (zeroed, no push): pushing those keys again creates nothing, and
    the next drain takes only what was pushed since, summed.  Once the keys fill over a
    quarter of the outbox, a drain takes what is pushed and removes every key."""
    t = store.table("e", dim=2, capacity=64, shards=1, optimizer=shmps.SGD(lr=1.0))
    store._set_forwarding(True)
    ob = t._outbox()
    path = segment_path(store, ob)
    t.push([1, 2, 3], np.ones((3, 2)))
    assert peek(path, OB_DIRTY_OFF, "<Q")[0] != 0
    d = t._outbox_drain(0)
    assert sorted(d.index.tolist()) == [1, 2, 3] and d.pushes == 1
    assert len(ob) == 3 and ob._pending().size == 0             # kept, clean
    assert peek(path, OB_DIRTY_OFF, "<2Q") == (0, 0)            # the list is empty
    assert ob.row_stats([1, 2, 3])["pushes"].tolist() == [0, 0, 0]
    t.push([2, 4], np.full((2, 2), 2.0))
    t.push([2], np.full((1, 2), 3.0))
    assert len(ob) == 4 and sorted(ob._pending().tolist()) == [2, 4]
    d = t._outbox_drain(0)
    order = np.argsort(d.index)
    assert d.index[order].tolist() == [2, 4] and d.pushes == 2
    np.testing.assert_array_equal(d.grads[order], [[5, 5], [2, 2]])
    assert t._outbox_drain(0) is None                           # nothing pushed since
    # over a quarter full (17 keys of 64): the drain takes what was pushed, removes all
    t.push(np.arange(100, 113, dtype=np.uint64), np.ones((13, 2)))
    assert len(ob) == 17
    d = t._outbox_drain(0)
    assert sorted(d.index.tolist()) == list(range(100, 113)) and len(ob) == 0
    ob.check()
    assert len(t) == 0                                          # the table never touched


def _push_and_unlist(store, t, keys):
    """Push ``keys`` into ``t``'s outbox, then empty the shard's list by hand: the rows
    pushed to and not listed that a pusher killed before its splice leaves."""
    t.push(keys, np.ones((len(keys), t.dim)))
    poke(segment_path(store, t._outbox()), OB_DIRTY_OFF, "<Q", 0)


def test_rows_a_dead_pusher_did_not_list_are_found_by_a_scan(store):
    """A pusher killed between its push to a row and the splice of its list leaves the
    row pushed to and not listed.  Whoever frees the dead pusher's active slot (here the
    drain's freeze) asks for a scan (ob_rescan), and the drain looks at every row:
    nothing is left behind.  Without a dead pusher, the same unlisted rows stay (the
    drain follows the list): that is what the scan is for."""
    t = store.table("e", dim=2, capacity=64, shards=1)
    store._set_forwarding(True)
    ob = t._outbox()
    path = segment_path(store, ob)
    t.push([9], np.ones((1, 2)))
    t._outbox_drain(0)                                          # key 9 kept, clean
    _push_and_unlist(store, t, [1, 2])
    t.push([3], np.ones((1, 2)))                                # listed
    assert t._outbox_drain(0).index.tolist() == [3]             # the list only
    assert sorted(ob._pending().tolist()) == [1, 2]
    poke(path, ACTIVE_OFF + 8 * 5, "<Q", dead_token())          # a dead pusher inside
    d = t._outbox_drain(0)
    assert sorted(d.index.tolist()) == [1, 2] and ob._pending().size == 0
    assert len(ob) == 0 and peek(path, OB_DIRTY_OFF, "<2Q") == (0, 0)   # scanned, removed
    t.push([4], np.ones((1, 2)))                                # and the list again
    assert t._outbox_drain(0).index.tolist() == [4] and len(ob) == 1
    ob.check()


@pytest.mark.parametrize("damage", ["cycle", "out of range", "not live", "key moved"])
def test_a_list_the_drain_cannot_follow_makes_it_scan(store, damage):
    """A list with a cycle (a row listed twice after a drain killed half way), a row out
    of range or a row not in use is not followed: the drain looks at every row instead,
    takes exactly what was pushed, and the outbox is consistent after."""
    t = store.table("e", dim=2, capacity=64, shards=1)
    store._set_forwarding(True)
    ob = t._outbox()
    path = segment_path(store, ob)
    t.push([7, 8], np.ones((2, 2)))
    t._outbox_drain(0)                                          # keys 7, 8 kept (rows 0, 1)
    ob.delete([7])                                              # row 0 free, below hwm
    t._outbox_drain(0)                                          # (the scan the delete asked)
    t.push([1, 2, 3], np.full((3, 2), 2.0))
    sp = ob._shards[0].spec
    head = peek(path, OB_DIRTY_OFF, "<Q")[0]
    stored = peek(path, sp["colidx_off"], "<8Q")
    if damage == "cycle":
        poke(path, sp["rowstep_off"] + 8 * (head - 1), "<Q", head)
    elif damage == "out of range":
        poke(path, OB_DIRTY_OFF, "<Q", sp["nrows"] + 5)
    elif damage == "not live":
        free = next(r for r in range(8) if stored[r] not in (1, 2, 3))   # below hwm
        assert free < 4
        poke(path, OB_DIRTY_OFF, "<Q", free + 1)
    else:                                       # a listed row's key: not indexed there
        row = head - 1
        poke(path, sp["colidx_off"] + 8 * row, "<Q", 999_999)
    d = t._outbox_drain(0) if damage != "key moved" else None
    if damage == "key moved":
        with pytest.raises(shmps.CorruptSegment):              # the scan meets it
            t._outbox_drain(0)
        poke(path, sp["colidx_off"] + 8 * row, "<Q", stored[row])   # repaired
        d = t._outbox_drain(0)
    order = np.argsort(d.index)
    assert d.index[order].tolist() == [1, 2, 3][3 - len(d.index):]
    np.testing.assert_array_equal(d.grads[order], np.full((len(d.index), 2), 2.0))
    assert len(ob) == 0 and peek(path, OB_DIRTY_OFF, "<2Q") == (0, 0)
    ob.check()


def test_a_dead_pusher_freed_by_a_pusher_asks_for_a_scan_too(store):
    """A dead pusher's active slot is freed by whoever needs it first: a drain's freeze,
    or a pusher that finds every slot held.  Either asks for a scan (ob_rescan), so the
    rows the dead one pushed to and did not list are taken."""
    t = store.table("e", dim=2, capacity=64, shards=1)
    store._set_forwarding(True)
    ob = t._outbox()
    path = segment_path(store, ob)
    _push_and_unlist(store, t, [1, 2])
    dead = dead_token()
    for i in range(lib.SHMPS_ACTIVE_SLOTS):
        poke(path, ACTIVE_OFF + 8 * i, "<Q", dead)              # every slot held, dead
    t.push([3], np.ones((1, 2)))                                # frees one to get in
    assert peek(path, OB_RESCAN_OFF, "<Q")[0] == 1
    for i in range(lib.SHMPS_ACTIVE_SLOTS):
        poke(path, ACTIVE_OFF + 8 * i, "<Q", 0)
    d = t._outbox_drain(0)
    assert sorted(d.index.tolist()) == [1, 2, 3] and ob._pending().size == 0


def test_keys_a_drain_keeps_never_keep_new_keys_out(store):
    """Kept keys give way: a drain removes them all once keys fill over a quarter of a
    shard or of the outbox, and a push that finds the outbox full (keys kept from
    earlier drains in it) asks every shard's next drain to, then tries again for
    FULL_RETRY_S while the bridge drains (here a thread): a batch that fits the capacity
    goes in, as it did when drains removed every key.  A batch larger than the capacity
    fails at once."""
    from shmps.table import key_shards

    t = store.table("e", dim=2, capacity=64, shards=8)
    u = store.table("u", dim=2, capacity=64, shards=1)
    store._set_forwarding(True)

    def drain_all_shards(x):
        for sh in range(x._nshards):
            d = x._outbox_drain(sh)
            if d is not None:
                x._outbox_ack(sh, d.pushed, d.ticket)

    cand = np.arange(10000, dtype=np.uint64)
    sid = key_shards(cand, 8)
    keys = np.concatenate([cand[sid == i][:8] for i in range(8)])   # 8 a shard, 64 in all
    for i in range(0, 64, 16):
        t.push(keys[i:i + 16], np.ones((16, 2)))
        drain_all_shards(t)
    assert len(t._outbox()) <= 16                  # over a quarter of the outbox: removed
    t.push([10**7], np.ones((1, 2)))               # a new key goes in
    drain_all_shards(t)
    # one shard: 16 keys kept, then 49 new ones (room only without the kept keys)
    u.push(np.arange(16, dtype=np.uint64), np.ones((16, 2)))
    drain_all_shards(u)
    assert len(u._outbox()) == 16
    stop = threading.Event()

    def bridge():
        while not stop.is_set():
            drain_all_shards(u)
            time.sleep(0.002)

    th = threading.Thread(target=bridge)
    th.start()
    try:
        u.push(np.arange(100, 149, dtype=np.uint64), np.ones((49, 2)))
    finally:
        stop.set()
        th.join(10)
    drain_all_shards(u)
    t0 = time.monotonic()
    with pytest.raises(shmps.CapacityError, match="bridge"):
        u.push(np.arange(200, 265, dtype=np.uint64), np.ones((65, 2)))   # over capacity
    assert time.monotonic() - t0 < 0.1
    store.flush(timeout=1)


def test_a_push_retried_into_a_full_outbox_counts_one_forwarded_push(store, store_name):
    """A forwarded table push that finds its outbox full of keys kept by earlier drains
    tries again until a drain removed them.  Each refused attempt wakes the bridge to
    drain now as a store.flush() does (a FLUSH ring on its doorbell, else flush_req:
    the bridge then scans every outbox shard, so it sees the ones asked to rescan), and
    counts no forwarded push: the push counts one, after it went in, however many
    attempts it took (each attempt counted one).  flush waits on ob_pushed, which only
    the attempt that went in adds to."""
    from select import select

    from shmps import doorbell
    from shmps.outbox import counters

    u = store.table("u", dim=2, capacity=64, shards=1)
    store._set_forwarding(True)
    ob = u._outbox()
    man = store._mptr

    def forwarded() -> int:
        return int(lib.shmps_forward_pushes(man))

    def drain_and_ack() -> None:
        d = u._outbox_drain(0)
        if d is not None:
            u._outbox_ack(0, d.pushed, d.ticket)

    def flush_req() -> int:
        return int(lib.shmps_flush_wait(man, 0, 0))

    sock = doorbell.listen(store_name, store.namespace)
    assert sock is not None
    try:
        for listening, first in ((True, 100), (False, 200)):
            if not listening:
                sock.close()
            u.push(np.arange(16, dtype=np.uint64) + np.uint64(first), np.ones((16, 2)))
            drain_and_ack()
            assert len(ob) == 16                     # kept: the outbox's room is 48 keys
            before, req0, wakes = forwarded(), flush_req(), []

            def bridge() -> None:
                # drain once 3 attempts were refused (each woke it; the old build rang
                # none: then after 0.2 s, within the push's FULL_RETRY_S)
                end = time.monotonic() + 0.2
                seen = 0
                while seen < 3 and time.monotonic() < end:
                    if listening:
                        if select([sock], [], [], 0.01)[0]:
                            seen += doorbell.take(sock)[0]   # (flushes, pushes)
                    else:
                        seen = flush_req() - req0
                        time.sleep(0.001)
                wakes.append(seen)
                drain_and_ack()

            th = threading.Thread(target=bridge)
            th.start()
            try:
                u.push(np.arange(49, dtype=np.uint64) + np.uint64(first + 1000),
                       np.ones((49, 2)))
            finally:
                th.join(10)
            # 3 or more: a thread scheduled late (at load 5) reads the rings of the
            # attempts refused meanwhile at once (5 seen); the old build rang none
            assert len(wakes) == 1 and wakes[0] >= 3, (listening, wakes)
            assert forwarded() == before + 1, (listening, forwarded() - before)
            drain_and_ack()
            store.flush(timeout=1)
        assert counters(ob, 0) == (4, 4)             # 4 pushes went in, each counted once
    finally:
        sock.close()


def _forwarded_table_of_400(store: Any) -> tuple:
    """A forwarded table of 400 keys in 4 shards; (table, its outbox, rows a shard,
    candidate keys by shard, the outbox shards' /dev/shm paths)."""
    t = store.table("e", dim=2, capacity=400, shards=4)
    store._set_forwarding(True)
    ob = t._outbox()
    rows = ob._shards[1].spec["nrows"]                 # 196 rows a shard, of 400 keys
    cand = np.arange(1, 20_000, dtype=np.uint64)
    home = t._key_shard(cand)
    by = [cand[home == s] for s in range(4)]
    paths = [os.path.join(SHM, ob._shard(s).seg.name.lstrip("/")) for s in range(4)]
    return t, ob, rows, by, paths


def test_a_push_into_a_full_outbox_asks_the_shards_in_its_way_for_a_scan(store):
    """A forwarded table push refused for want of room asks for a scan (ob_rescan) the
    shards whose kept keys stand in its way (native/table.c ask_rescan): a shard full of
    its own keys, that shard alone (its keys are the push's, so it viewed it); the
    table full, every shard, those the push's keys do not hash to too."""
    t, ob, rows, by, paths = _forwarded_table_of_400(store)

    def rescan() -> list:
        return [peek(p, OB_RESCAN_OFF, "<Q")[0] for p in paths]

    t.push(by[1][:rows], np.ones((rows, 2)))           # shard 1 full, the table not
    assert rescan() == [0, 0, 0, 0]
    with pytest.raises(shmps.CapacityError, match="shard 1"):
        t.push(by[1][rows:rows + 1], np.ones((1, 2)))
    assert rescan() == [0, 1, 0, 0]
    n = (400 - rows) // 3 + 1                          # the rest of the table, over 0, 2, 3
    fill = np.concatenate([by[0][:n], by[2][:n], by[3][:400 - rows - 2 * n]])
    t.push(fill, np.ones((fill.size, 2)))
    assert len(ob) == 400
    for p in paths:
        poke(p, OB_RESCAN_OFF, "<Q", 0)
    with pytest.raises(shmps.CapacityError, match="is full"):
        t.push(by[2][n:n + 1], np.ones((1, 2)))        # a key of shard 2 only
    assert rescan() == [1, 1, 1, 1]


def test_a_push_refused_by_two_full_shards_asks_both_for_a_scan(store):
    """Two shards full of kept keys, a push with keys of both: refused for the first one
    the creation meets, and both are asked for a scan (every shard the push viewed),
    not only the one the error names: asked later, each full shard would cost the
    pusher's retry a bridge round of its own (review 17 F2: [0, 1, 0, 0] here)."""
    t, ob, rows, by, paths = _forwarded_table_of_400(store)
    t.push(by[1][:rows], np.ones((rows, 2)))
    t.push(by[2][:rows], np.ones((rows, 2)))           # shards 1 and 2 full, the table not
    assert [peek(p, OB_RESCAN_OFF, "<Q")[0] for p in paths] == [0, 0, 0, 0]
    with pytest.raises(shmps.CapacityError, match="shard [12]"):
        t.push(np.concatenate([by[1][rows:rows + 1], by[2][rows:rows + 1]]), np.ones((2, 2)))
    assert [peek(p, OB_RESCAN_OFF, "<Q")[0] for p in paths] == [0, 1, 1, 0]


def test_a_delete_in_an_outbox_makes_the_next_drain_scan(store):
    """A key deleted from the outbox by hand frees its row; created again without a
    push (pull(create=True)), the row's link would end the list early and the rows
    after it would stay behind while the drain's ack says they were sent.  The delete
    asks for a scan: every row holding pushes is taken."""
    t = store.table("e", dim=2, capacity=64, shards=1)
    store._set_forwarding(True)
    ob = t._outbox()
    t.push(np.arange(1, 6, dtype=np.uint64), np.ones((5, 2)))   # listed 5, 4, 3, 2, 1
    assert ob.delete([3]) == 1
    ob.pull([100], create=True)                                 # row of 3, unlisted
    d = t._outbox_drain(0)
    assert sorted(d.index.tolist()) == [1, 2, 4, 5] and ob._pending().size == 0


@pytest.mark.parametrize("path", ["list", "scan"])
def test_a_bridge_killed_after_taking_rows_before_recording_its_drain(store, store_name,
                                                                       path):
    """The bridge process is killed (gdb stops it where the drain records its ticket and
    ob_drained, shmps_outbox_drained, then kills it): rows taken, nothing recorded.  The
    drain was counted in progress (ob_draining) until it would have been recorded, so
    the next bridge's recover records its pushes lost and flush() raises PushesLost,
    whether the drain followed the list or scanned.  (A list drain that ended before it
    recorded let the next empty drain acknowledge them: flush() returned.)"""
    import shutil
    import subprocess
    import sys

    if shutil.which("gdb") is None:
        pytest.skip("gdb is not installed: it stops the drain at the moment to kill it")
    t = store.table("e", dim=2, capacity=64, shards=1, optimizer=shmps.SGD(lr=1.0))
    store._set_forwarding(True)
    ob = t._outbox()
    t.push([1, 2, 3], np.ones((3, 2)))
    d = t._outbox_drain(0)
    t._outbox_ack(0, d.pushed, d.ticket)                       # keys kept, acknowledged
    store.flush(timeout=1)
    t.push([1, 2], np.full((2, 2), 7.0))                        # pushed 2, acked 1
    if path == "scan":
        poke(segment_path(store, ob), OB_RESCAN_OFF, "<Q", 1)
    child = ("import shmps, sys; s = shmps.attach(sys.argv[1], create=False); "
             "print('DRAIN RETURNED', s['e']._outbox_drain(0))")
    out = subprocess.run(
        ["gdb", "-q", "-batch", "-ex", "set breakpoint pending on",
         "-ex", "break shmps_outbox_drained", "-ex", "run", "-ex", "kill",
         "--args", sys.executable, "-c", child, store_name],
        capture_output=True, text=True, timeout=120)
    if "Breakpoint 1, " not in out.stdout:
        pytest.skip(f"gdb could not stop the drain here: {out.stdout[-300:]} {out.stderr[-300:]}")
    assert "DRAIN RETURNED" not in out.stdout                   # killed inside the drain
    assert ob._pending().size == 0                              # its rows were taken
    bridge = shmps.attach(store_name, create=False)             # the next bridge
    try:
        assert bridge["e"]._outbox_recover(0) == 1
        d = bridge["e"]._outbox_drain(0)
        if d is not None:
            bridge["e"]._outbox_ack(0, d.pushed, d.ticket)
        with pytest.raises(shmps.PushesLost, match="'e' shard 0: 1"):
            store.flush(timeout=2)
    finally:
        bridge.close()


def test_an_empty_list_is_not_an_empty_drain_while_a_pusher_is_inside(store):
    """A drain of a shard with kept keys, an empty list and no scan asked is empty
    without a freeze only when no pusher is inside: a push counted in its P may have
    pushed to a row another pusher, still inside, found clean and has not listed yet.
    Here that row is pushed to and unlisted by hand, a live token holds an active slot:
    the drain waits for the freeze (and gives up after its timeout) instead of claiming
    the count as an empty drain, which the ack would turn into a flush() that returns
    with the row's values unsent.  With the slot free the same drain claims nothing
    wrongly either (the unlisted row is the dead-pusher case, which asks for a scan)."""
    t = store.table("e", dim=2, capacity=64, shards=1)
    store._set_forwarding(True)
    ob = t._outbox()
    path = segment_path(store, ob)
    t.push([1], np.ones((1, 2)))
    d = t._outbox_drain(0)
    t._outbox_ack(0, d.pushed, d.ticket)                        # key 1 kept, clean
    _push_and_unlist(store, t, [1])                             # pushed 2, not listed
    poke(path, ACTIVE_OFF + 8 * 7, "<Q", native.token())        # "its lister is inside"
    t0 = time.monotonic()
    assert t._outbox_drain(0, timeout=0.05) is None
    assert time.monotonic() - t0 >= 0.04                        # it froze (waited)
    assert peek(path, OB_DRAINED_OFF, "<Q")[0] == 1             # P = 2 not claimed
    poke(path, OB_RESCAN_OFF, "<Q", 1)                          # (the lister died)
    poke(path, ACTIVE_OFF + 8 * 7, "<Q", 0)
    d = t._outbox_drain(0)
    assert d.index.tolist() == [1] and d.pushed == 2
    t._outbox_ack(0, d.pushed, d.ticket)
    store.flush(timeout=1)


def test_an_idle_shard_with_kept_keys_drains_without_a_freeze(store):
    """No pusher inside, nothing listed, no scan asked: the drain (the bridge's sweep
    visits idle shards every second) claims its count without freezing the shard, so
    pushers never wait on it.  A freeze held by another live process shows it: the
    drain does not wait for it."""
    t = store.table("e", dim=2, capacity=64, shards=1)
    store._set_forwarding(True)
    ob = t._outbox()
    path = segment_path(store, ob)
    t.push([1, 2], np.ones((2, 2)))
    d = t._outbox_drain(0)
    t._outbox_ack(0, d.pushed, d.ticket)
    assert len(ob) == 2                                         # kept
    poke(path, FREEZE_OFF, "<Q", native.token())                # a freeze held (live)
    try:
        t0 = time.monotonic()
        assert t._outbox_drain(0, timeout=0.2) is None
        assert time.monotonic() - t0 < 0.1
    finally:
        poke(path, FREEZE_OFF, "<Q", 0)


def test_a_dead_pusher_in_a_dense_outbox_asks_for_no_scan(store):
    """ob_rescan is a table outbox's word: freeing a dead pusher's slot in a dense
    outbox leaves it 0 (a dense drain never clears it, and a shard asking for a scan
    counts as busy: the bridge would drain it every pass for ever)."""
    w = store.dense("w", shape=(8, 4), dtype="float32")
    store._set_forwarding(True)
    ob = w._outbox()
    path = segment_path(store, ob)
    w.push(np.ones((8, 4), np.float32))
    d = w._outbox_drain(0)
    w._outbox_ack(0, d.pushed, d.ticket)
    poke(path, ACTIVE_OFF + 8 * 5, "<Q", dead_token())
    ob.pull()                                                   # its freeze frees the slot
    assert peek(path, ACTIVE_OFF + 8 * 5, "<Q")[0] == 0
    assert peek(path, OB_RESCAN_OFF, "<Q")[0] == 0
    from shmps.outbox import BusyScan
    assert BusyScan([w]).scan(full=True) == []


def push_keys_forever(store: str, tensor: str, first: int, flags, idx: int) -> int:
    """Push 2048 keys never pushed before (from ``first`` on) into a forwarding table,
    again and again, until killed."""
    s = shmps.attach(store)
    t = s[tensor]
    g = np.ones((2048, t.dim), t.dtype)
    keys = np.arange(first, first + 2048, dtype=np.uint64)
    n = 0
    while True:
        t.push(keys + np.uint64(2048 * n), g)
        n += 1
        flags[2 + idx] = n


def test_a_pusher_killed_mid_push_leaves_no_row_behind(store, store_name):
    """SIGKILL a table pusher at random moments while it pushes keys never pushed before
    (a push lists the rows it found clean at its end: a kill inside it leaves rows
    pushed to and not listed); after each kill two drains leave no row holding pushes:
    the dead pusher's unlisted rows are found by the scan its death asks for.  (The
    outbox stays under a quarter full of keys: the drains follow the list.)"""
    t = store.table("e", dim=4, capacity=1 << 18, shards=2)
    store._set_forwarding(True)
    ob = t._outbox()
    rng = np.random.default_rng(5)
    flags = [new_flags(1) for _ in range(12)]
    with Workers() as ws:   # (all 12 spawned at once, each waits for its go)
        ps = [ws.start(after_go, f, push_keys_forever, store_name, "e", (attempt + 1) << 40,
                       f, 0) for attempt, f in enumerate(flags)]
        for attempt, (p, f) in enumerate(zip(ps, flags)):
            f[GO] = 1
            wait_until(lambda: f[2] > 2, 120, "pusher pushing")
            time.sleep(float(rng.uniform(0, 0.003)))
            p.kill()
            for _ in range(2):
                for sh in range(t._nshards):
                    t._outbox_drain(sh)
            assert ob._pending().size == 0, (attempt, ob._pending()[:8])
    ob.check()


# ---- acknowledgements and flush -------------------------------------------------------------

def test_flush_times_out_without_a_bridge(store):
    w = store.dense("w", shape=(4,))
    store._set_forwarding(True)
    w.push(np.ones(4, np.float32))
    t0 = time.monotonic()
    with pytest.raises(shmps.Timeout) as ei:
        store.flush(timeout=0.2)
    assert 0.15 < time.monotonic() - t0 < 2.0
    msg = str(ei.value)
    assert "'w'" in msg and "shard 0" in msg and "1 pushes" in msg and "0 acknowledged" in msg
    assert "is shmps-bridge running for this store and namespace?" in msg
    # and one that runs may be waiting itself: the hint says where to look (it said only
    # "start shmps-bridge for it", to an operator whose bridge ran without a majority)
    assert ("if one runs, its log says why it waits (no majority of its members, say)"
            in msg), msg
    assert isinstance(ei.value, TimeoutError)
    # forwarding off does not forget what is still pending
    store._set_forwarding(False)
    with pytest.raises(shmps.Timeout):
        store.flush(timeout=0.05)


@pytest.mark.parametrize("timeout", ["1", "x", True, -1, float("nan")])
def test_flush_refuses_a_timeout_that_is_not_seconds(store, timeout):
    """flush(timeout=) is None or a number of seconds >= 0: float() took "1" as 1 s,
    True as 1 s, and raised a plain ValueError for "x"."""
    with pytest.raises(shmps.InvalidArgument, match="number of seconds"):
        store.flush(timeout=timeout)


def test_flush_asks_the_bridge_only_when_it_has_to_wait(store):
    """store.flush() bumps the manifest's flush_req word (the bridge's waiting thread
    wakes on it) when a push waits for its acknowledgement, and not when nothing is
    pending; a waiter whose word already moved returns at once, else after its bound."""
    from shmps._native import lib
    man = store._mptr
    w = store.dense("w", shape=(4,))
    store._set_forwarding(True)
    seen = lib.shmps_flush_wait(man, 0, 0)
    store.flush(timeout=0.05)                      # nothing pending: no request
    assert lib.shmps_flush_wait(man, seen, 0) == seen
    w.push(np.ones(4, np.float32))
    with pytest.raises(shmps.Timeout):
        store.flush(timeout=0.05)                  # pending: one request
    now = lib.shmps_flush_wait(man, seen, 0)
    assert now == seen + 1
    t0 = time.monotonic()
    assert lib.shmps_flush_wait(man, seen, 5_000_000_000) == now   # moved: no sleep
    assert lib.shmps_flush_wait(man, now, 50_000_000) == now       # sleeps 50 ms
    assert 0.04 < time.monotonic() - t0 < 2.0


def test_flush_sleeps_on_the_ack_word_and_an_ack_notify_wakes_it(store, monkeypatch):
    """store.flush() waiting for an acknowledgement sleeps on the manifest's ack word,
    registered in ack_waiters, and returns when the bridge's shmps_ack_notify follows
    the ack, not only at its poll bound (set to 20 s here: without the wake, flush would
    sleep it out); ack_waiters is back to 0 after it returns and after a Timeout."""
    from shmps import outbox
    from shmps._native import ffi, lib
    monkeypatch.setattr(outbox, "ACK_POLL_NS", 20_000_000_000)
    man = store._mptr
    waiters = ffi.cast("uint32_t *", ffi.cast("char *", man) + 288)   # segment-layout.md
    w = store.dense("w", shape=(4,))
    store._set_forwarding(True)
    w.push(np.ones(4, np.float32))
    t0 = time.monotonic()
    with pytest.raises(shmps.Timeout):
        store.flush(timeout=0.05)              # the sleep ends at the deadline
    assert time.monotonic() - t0 < 5.0 and waiters[0] == 0
    seen = []

    def bridge():
        while waiters[0] == 0:                 # flush() sleeps on the word
            time.sleep(0.005)
        seen.append(waiters[0])
        d = w._outbox_drain(0)
        w._outbox_ack(0, d.pushed, d.ticket)
        time.sleep(0.2)                        # flush is still asleep: nothing woke it
        seen.append(waiters[0])
        lib.shmps_ack_notify(man)

    th = threading.Thread(target=bridge, daemon=True)
    th.start()
    t0 = time.monotonic()
    store.flush(timeout=30)
    took = time.monotonic() - t0
    th.join(5)
    assert seen == [1, 1] and waiters[0] == 0
    assert 0.2 <= took < 10.0, took


def test_flush_returns_once_acked(store):
    w = store.dense("w", shape=(64, 8), shard_rows=16)
    t = store.table("e", dim=3, capacity=100, shards=3)
    store._set_forwarding(True)
    stop = threading.Event()
    applied = {"w": np.zeros((64, 8)), "e": {}}

    def bridge():  # drain, "apply", ack: what an owner's acknowledgement amounts to
        while not stop.is_set():
            for tensor in (w, t):
                for s in range(tensor._nshards):
                    d = tensor._outbox_drain(s)
                    if d is None:
                        continue
                    time.sleep(0.002)
                    if tensor is w:
                        np.add.at(applied["w"], d.index, d.grads)
                    else:
                        for k, g in zip(d.index.tolist(), d.grads):
                            applied["e"][k] = applied["e"].get(k, 0) + g
                    tensor._outbox_ack(s, d.pushed, d.ticket)
            time.sleep(0.001)

    th = threading.Thread(target=bridge, daemon=True)
    th.start()
    try:
        for k in range(20):
            w.push(np.ones((64, 8), np.float32))
            w.push(np.ones((2, 8), np.float32), rows=[k, 63 - k], wait=False)
            t.push([k, k + 1], np.ones((2, 3)))
        store.flush(timeout=10)
        # everything pushed before flush() was drained and acknowledged
        want = np.full((64, 8), 20.0)
        np.add.at(want, np.r_[np.arange(20), 63 - np.arange(20)], 1.0)
        np.testing.assert_array_equal(applied["w"], want)
        assert sorted(applied["e"]) == list(range(21))
    finally:
        stop.set()
        th.join(10)


def test_empty_drain_acknowledges_pushes_taken_earlier(store):
    """A push still landing during a drain has its values taken by that drain but is
    counted only after: the next (empty) drain, or the ack that catches up, must
    still let flush() return."""
    from shmps.dense import DenseTensor

    w = store.dense("w", shape=(4, 2))
    store._set_forwarding(True)
    ob = w._outbox()
    ptr = ob._shard(0).ptr
    w.push(np.ones((4, 2), np.float32))              # counted: pushed 1
    d0 = w._outbox_drain(0)
    assert d0.pushed == 1
    # a push whose values land before the next drain and whose count comes after it
    DenseTensor._apply(ob, np.ones((4, 2), np.float32), None)
    d1 = w._outbox_drain(0)
    assert d1.pushed == 1 and d1.index.size == 4
    native.check(lib.shmps_outbox_pushed(ptr), "count")   # now it is counted: 2
    assert w._outbox_drain(0) is None                 # empty drain covering pushed 2
    with pytest.raises(shmps.Timeout):
        store.flush(timeout=0.05)                     # nothing acknowledged yet
    w._outbox_ack(0, d0.pushed, d0.ticket)
    w._outbox_ack(0, d1.pushed, d1.ticket)            # catches up with the last drain
    assert native_counters(ob, 0) == (2, 2)
    store.flush(timeout=1)
    # and with the ack first: an empty drain after it raises acked itself
    DenseTensor._apply(ob, np.ones((4, 2), np.float32), None)
    d2 = w._outbox_drain(0)
    w._outbox_ack(0, d2.pushed, d2.ticket)
    native.check(lib.shmps_outbox_pushed(ptr), "count")   # 3
    assert native_counters(ob, 0) == (3, 2)
    assert w._outbox_drain(0) is None
    assert native_counters(ob, 0) == (3, 3)
    store.flush(timeout=1)
    # an ack beyond any drain is clamped
    w._outbox_ack(0, 10**9, 10**9)
    assert native_counters(ob, 0) == (3, 3)
    with pytest.raises(shmps.InvalidArgument):
        w._outbox_ack(0, -1, 0)
    with pytest.raises(shmps.InvalidArgument):
        w._outbox_ack(0, 0, -1)


def test_a_drain_of_a_landing_push_is_acknowledged_only_by_its_own_ack(store):
    """A drain that takes only the values of a push still landing reads the same
    ``pushed`` as the drain before it.  Once that earlier drain is acknowledged, the
    empty drain that counts the landed push must not acknowledge it while the drain
    holding its values is unacknowledged: flush() would return before the owner applied
    them (with P values as the only record, it did: seen as a 64 MiB push + flush on a
    loaded two-host cluster returning in 0.1 s with the copies one step short)."""
    from shmps.dense import DenseTensor

    w = store.dense("w", shape=(4, 2))
    store._set_forwarding(True)
    ob = w._outbox()
    w.push(np.ones((4, 2), np.float32))              # pushed 1
    d0 = w._outbox_drain(0)
    w._outbox_ack(0, d0.pushed, d0.ticket)            # acknowledged: acked 1
    DenseTensor._apply(ob, np.ones((4, 2), np.float32), None)   # values in, not counted
    d1 = w._outbox_drain(0)
    assert d1.pushed == d0.pushed and d1.index.size == 4 and d1.ticket == d0.ticket + 1
    native.check(lib.shmps_outbox_pushed(ob._shard(0).ptr), "count")   # pushed 2
    assert w._outbox_drain(0) is None                 # empty drain covering pushed 2
    assert native_counters(ob, 0) == (2, 1)           # d1 is not acknowledged yet
    with pytest.raises(shmps.Timeout):
        store.flush(timeout=0.05)
    w._outbox_ack(0, d0.pushed, d0.ticket)            # d0's ack again changes nothing
    assert native_counters(ob, 0) == (2, 1)
    w._outbox_ack(0, d1.pushed, d1.ticket)            # d1's ack covers the landed push
    assert native_counters(ob, 0) == (2, 2)
    store.flush(timeout=1)


# ---- direct application (the owner's bridge) ---------------------------------------------------

@pytest.mark.parametrize("opt", [shmps.SGD(lr=0.1, weight_decay=0.01),
                                 shmps.Momentum(lr=0.1, momentum=0.9),
                                 shmps.Adam(lr=0.01), shmps.Adagrad(lr=0.1)])
def test_apply_direct_equals_push(store, opt):
    rng = np.random.default_rng(3)
    a = store.dense("a", shape=(10, 4), dtype="float64", optimizer=opt, shard_rows=4)
    b = store.dense("b", shape=(10, 4), dtype="float64", optimizer=opt, shard_rows=4)
    ta = store.table("ta", dim=4, dtype="float64", capacity=20, optimizer=opt)
    tb = store.table("tb", dim=4, dtype="float64", capacity=20, optimizer=opt)
    steps = []
    for k in range(6):
        if k % 2:
            steps.append((rng.integers(-4, 5, size=(10, 4)).astype(np.float64), None))
        else:
            rows = rng.integers(0, 10, size=5)
            rows[1] = rows[0]  # a duplicate
            steps.append((rng.integers(-4, 5, size=(5, 4)).astype(np.float64), rows))
    for g, rows in steps:   # reference: plain pushes, forwarding off
        a.push(g, rows=rows)
        if rows is not None:
            ta.push(rows.astype(np.uint64), g)
    store._set_forwarding(True)
    for g, rows in steps:   # forwarded, drained, applied directly (switch still on)
        b.push(g, rows=rows)
        if rows is not None:
            tb.push(rows.astype(np.uint64), g)
        parts = [d for d in (b._outbox_drain(s) for s in range(b.nshards)) if d is not None]
        # one call = one step of the per-tensor step: the shards' drains together
        b._apply_direct(np.concatenate([d.index for d in parts]),
                        np.concatenate([d.grads for d in parts]))
        for s in range(tb.nshards):
            d = tb._outbox_drain(s)
            if d is not None:  # per-row steps: shard by shard is the same
                tb._apply_direct(d.index, d.grads, d.pushes)
    np.testing.assert_array_equal(b.pull(), a.pull())
    assert b.stats()["step"] == a.stats()["step"]
    keys = np.arange(10, dtype=np.uint64)
    np.testing.assert_array_equal(tb.pull(keys), ta.pull(keys))
    assert ta.row_stats(keys)["found"].tolist() == tb.row_stats(keys)["found"].tolist()
    # direct application validates as a push does
    with pytest.raises(shmps.NonFinite):
        b._apply_direct([0], np.full((1, 4), np.nan))
    with pytest.raises(shmps.OutOfRange):
        b._apply_direct([10], np.ones((1, 4)))


@pytest.mark.parametrize("opt", [shmps.SGD(lr=0.1, weight_decay=0.01), shmps.Adam(lr=0.01)])
def test_apply_shard_equals_apply_direct(store, opt):
    """The owner's bridge applies a dense BATCH with ``_apply_shard`` (rows of one
    shard, increasing): the same values, steps and counts as ``_apply_direct`` of the
    same rows, continued frames included; the same NaN/Inf rule; and a row outside the
    shard named (one of the next shard's too: the owner of one shard changes no other)
    is refused with nothing changed."""
    rng = np.random.default_rng(5)
    a = store.dense("a", shape=(12, 3), dtype="float32", optimizer=opt, shard_rows=5)
    b = store.dense("b", shape=(12, 3), dtype="float32", optimizer=opt, shard_rows=5)
    store._set_forwarding(True)
    batches = [(1, np.array([0, 2, 3]), False), (2, np.array([0, 1]), False),
               (1, np.array([4]), True), (2, np.array([1]), False), (0, np.arange(5), False)]
    for shard, local, continues in batches:
        g = rng.integers(-4, 5, size=(local.size, 3)).astype(np.float32)
        a._apply_direct(local + 5 * shard, g, pushes=3, continues=continues)
        b._apply_shard(shard, local + 5 * shard, g, pushes=3, continues=continues)
    np.testing.assert_array_equal(b.pull(), a.pull())
    for k in ("step", "pushes"):
        assert b.stats()[k] == a.stats()[k]
    assert b.stats()["pushes"] == 12      # the continued frame counts no further push
    strided = np.array([5, 0, 7, 0])[::2]  # rows 5, 7 as a view that is not contiguous
    a._apply_direct(strided.copy(), np.ones((2, 3), np.float32))
    b._apply_shard(1, strided, np.ones((2, 3), np.float32))
    with pytest.raises(shmps.NonFinite):
        b._apply_shard(0, np.array([1]), np.full((1, 3), np.nan, np.float32))
    with pytest.raises(shmps.OutOfRange):
        b._apply_shard(2, np.array([12]), np.ones((1, 3), np.float32))  # shard 2: rows 10, 11
    with pytest.raises(shmps.OutOfRange):
        b._apply_shard(0, np.array([3, 5]), np.ones((2, 3), np.float32))  # 5: shard 1
    with pytest.raises(shmps.SchemaError):
        b._apply_shard(0, np.array([1, 2]), np.ones((1, 3), np.float32))
    np.testing.assert_array_equal(b.pull(), a.pull())   # refused ones changed nothing


def test_apply_direct_whole_tensor_counts_pushes(store):
    w = store.dense("w", shape=(3,), optimizer="sum")
    store._set_forwarding(True)
    w._apply_direct(None, np.ones(3, np.float32), pushes=5)
    np.testing.assert_array_equal(w.pull(), np.ones(3, np.float32))
    assert w.stats()["pushes"] == 5
    assert w._outbox_drain(0) is None


def test_a_continued_batch_is_applied_as_more_of_the_same_push(store):
    """``_apply_direct(..., continues=True)``: more rows of the batch the previous call
    began (a later BATCH frame of one drain).  Dense: applied at the current step (Adam's
    t stays 1); table and csr: their rows step as usual.  Every kind counts the batch's
    pushes once, with its first frame (docs/bridge-protocol.md, BATCH step)."""
    a = store.dense("a", shape=(4, 2), optimizer=shmps.Adam(lr=0.1), shard_rows=4)
    t = store.table("t", dim=2, capacity=16, shards=1)
    rc = np.array([0, 2, 4], np.int64)
    m = store.csr("m", rc, np.array([0, 1, 0, 1], np.int64), dtype="float32", shard_rows=2)
    store._set_forwarding(True)
    a._apply_direct([0, 1], np.ones((2, 2), np.float32), pushes=5)
    a._apply_direct([2, 3], np.ones((2, 2), np.float32), pushes=5, continues=True)
    w = a.pull()
    assert np.all(w == w[0, 0]) and a.stats()["step"] == 1 and a.stats()["pushes"] == 5
    t._apply_direct([1, 2], np.ones((2, 2), np.float32), pushes=5)
    t._apply_direct([3], np.ones((1, 2), np.float32), pushes=5, continues=True)
    assert t.stats()["pushes"] == 5
    m._apply_direct([0, 1], np.ones(2, np.float32), pushes=5)             # row 0
    m._apply_direct([2, 3], np.ones(2, np.float32), pushes=5, continues=True)  # row 1
    assert m.stats()["pushes"] == 5
    assert m._entry_rows(np.arange(4)).tolist() == [0, 0, 1, 1]
    assert m.pull().value.tolist() == [1.0, 1.0, 1.0, 1.0]


# ---- replication: reads and writes of rows --------------------------------------------------------

@pytest.fixture
def second_store(store_name):
    s = shmps.attach(store_name, namespace="replica")
    yield s
    s.destroy()


def test_dense_rows_round_trip(store, second_store):
    opt = shmps.Adam(lr=0.01)
    a = store.dense("w", shape=(10, 2, 3), optimizer=opt, shard_rows=4)
    b = second_store.dense("w", shape=(10, 2, 3), optimizer=opt, shard_rows=4)
    rng = np.random.default_rng(5)
    for _ in range(3):
        a.push(rng.normal(size=(10, 2, 3)).astype(np.float32))
    assert a._nshards == 3
    for s in range(a._nshards):
        snap = a._snapshot(s)
        assert snap.row_steps is None and snap.step == 3 and len(snap.states) == 2
        assert snap.values.shape == (snap.index.size, 2, 3)
        b._write_rows(s, snap)
    np.testing.assert_array_equal(b.pull(), a.pull())
    assert b.stats()["step"] == 3
    for k in range(2):
        for sa, sb in zip(a._shards, b._shards):
            np.testing.assert_array_equal(sa.state(k), sb.state(k))
    # the same next push gives the same result on both
    g = rng.normal(size=(10, 2, 3)).astype(np.float32)
    a.push(g)
    b.push(g)
    np.testing.assert_array_equal(b.pull(), a.pull())
    # a subset of rows, read and written; others untouched
    a.push(np.ones((2, 2, 3), np.float32), rows=[5, 6])
    rd = a._read_rows(1, [6, 5])
    assert rd.index.tolist() == [6, 5] and rd.step == 5
    np.testing.assert_array_equal(rd.values, a.pull([6, 5]))
    before = b.pull()
    b._write_rows(1, rd)
    after = b.pull()
    np.testing.assert_array_equal(after[[5, 6]], a.pull([5, 6]))
    np.testing.assert_array_equal(np.delete(after, [5, 6], 0), np.delete(before, [5, 6], 0))
    with pytest.raises(shmps.OutOfRange):
        a._read_rows(1, [3])                   # row 3 is in shard 0
    with pytest.raises(shmps.OutOfRange):
        a._snapshot(3)
    with pytest.raises(shmps.SchemaError):
        rd.states = rd.states[:1]
        b._write_rows(1, rd)


@pytest.mark.parametrize("rows", [[5, 6, 7], [4, 6, 7]])        # a run; gathered
def test_dense_rows_read_into_a_frame_match_read_rows(store, monkeypatch, rows):
    """The owner's ROWS built in place (frames.RowsBuilder + _read_rows_into) are the
    bytes encode_rows makes of _read_rows: values, both Adam states and the step; the
    frame's buffer is not zeroed (poisoned here), so the read writes every byte."""
    from shmps.bridge import frames
    poison_frame_buffers(monkeypatch)
    a = store.dense("w", shape=(10, 2, 3), optimizer=shmps.Adam(lr=0.01), shard_rows=4)
    rng = np.random.default_rng(8)
    for _ in range(3):
        a.push(rng.normal(size=(10, 2, 3)).astype(np.float32))
    r = np.array(rows, np.int64)
    ids = dict(epoch=1, sender=2, incarnation=3, tensor=4, shard=1, seq=5)
    rd = a._read_rows(1, r)
    start = {"start": int(r[0])} if r[-1] - r[0] == r.size - 1 else {"rows": r}
    want = frames.encode_rows(**ids, values=rd.values.reshape(r.size, 6), step=rd.step,
                              state=[x.reshape(r.size, 6) for x in rd.states], **start)
    b = frames.RowsBuilder(**ids, n=r.size, cols=6, dtype="float32", nstate=2,
                           state_dtype="float32", **start)
    step = a._read_rows_into(1, r - 4, [b.values] + b.state)
    assert step == rd.step == 3
    assert frames.as_bytes(b.finish(step)) == want
    with pytest.raises(IndexError):                     # rows beyond the shard
        a._read_rows_into(1, np.array([2, 5]), [b.values[:2]] + [x[:2] for x in b.state])


def test_table_push_read_fills_a_frame_as_read_rows_would(store, monkeypatch):
    """A table owner's ROWS built by the push itself (RowsBuilder with keys and row
    steps + Table._apply_direct(out=...)) are the bytes encode_rows makes of
    _read_rows after the same push: keys in the batch's order, values, both Adam states
    and each row's step (into a frame not zeroed first: poisoned here); a repeated key
    gets its one updated row at every position; a refused push changes nothing; buffers
    of the wrong shape are refused first."""
    from shmps.bridge import frames
    poison_frame_buffers(monkeypatch)
    a = store.table("e", dim=3, capacity=100, shards=2, optimizer=shmps.Adam(lr=0.01))
    b = store.table("f", dim=3, capacity=100, shards=2, optimizer=shmps.Adam(lr=0.01))
    keys = np.arange(40, dtype=np.uint64)
    rng = np.random.default_rng(3)
    for i in range(3):
        g = rng.normal(size=(10 * (i + 2), 3)).astype(np.float32)
        a.push(keys[: 10 * (i + 2)], g)
        b.push(keys[: 10 * (i + 2)], g)
    mine = keys[a._key_shard(keys) == 1][::-1].copy()         # not sorted: as pushed
    batch = np.concatenate([mine, mine[:2]])                  # two keys twice
    g = rng.normal(size=(batch.size, 3)).astype(np.float32)
    ids = dict(epoch=1, sender=2, incarnation=3, tensor=4, shard=1, seq=5)
    f = frames.RowsBuilder(**ids, n=batch.size, cols=3, dtype="float32", keys=batch,
                           row_steps=True, nstate=2, state_dtype="float32")
    a._apply_direct(batch, g, out=(f.values, f.state, f.row_steps))
    b.push(batch, g)                                           # the same push, no copy
    rd = b._read_rows(1, batch)
    assert rd.index.tolist() == batch.tolist()
    want = frames.encode_rows(**ids, values=rd.values, step=0, keys=rd.index,
                              state=list(rd.states), row_steps=rd.row_steps)
    assert frames.as_bytes(f.finish(0)) == want
    np.testing.assert_array_equal(a.pull(keys), b.pull(keys))   # and it pushed as push does
    assert sorted(set(f.row_steps.tolist())) == [2, 3, 4]     # pushed 1-3 times before
    np.testing.assert_array_equal(f.values[-2:], f.values[:2])  # a repeated key's one row
    # refused pushes: nothing changes, in the table or the buffers' meaning
    before = a.pull(keys)
    vals, sts, steps = np.empty((2, 3), np.float32), a._state_arrays(2), np.empty(2, np.uint64)
    bad = np.array([[np.nan, 0, 0], [0, 0, 0]], np.float32)
    with pytest.raises(shmps.NonFinite):
        a._apply_direct(mine[:2], bad, out=(vals, sts, steps))
    with pytest.raises(shmps.InvalidArgument, match="wrong shape"):
        a._apply_direct(mine[:2], g[:2], out=(vals[:, :2].copy(), sts, steps))
    with pytest.raises(shmps.InvalidArgument, match="wrong shape"):
        a._apply_direct(mine[:2], g[:2], out=(vals, sts[:1], steps))
    with pytest.raises(shmps.InvalidArgument, match="wrong shape"):
        a._apply_direct(mine[:2], g[:2], out=(vals, sts, steps.astype(np.int64)))
    np.testing.assert_array_equal(a.pull(keys), before)


def test_table_push_read_copies_whole_rows_under_concurrent_pushes(store):
    """The rows a push copies out are taken under each row's lock: while another process
    pushes +1 to every element of the same rows, every copied row holds one number
    throughout, never a row half updated.  (Copied after the unlock instead, about 1 %
    of the rows here were torn.)"""
    t = store.table("c", dim=4096, dtype="int32", capacity=64, shards=1)
    keys = np.arange(16, dtype=np.uint64)
    ones = np.ones((keys.size, 4096), np.int32)
    t.push(keys, 0 * ones)
    flags = new_flags(1)
    with Workers() as ws:
        w = ws.start(table_push_loop, store.name, "c", keys.size, flags, 0)
        wait_until(lambda: flags[2] == 1, 60, "the pusher")
        flags[GO] = 1
        wait_until(lambda: flags[2] > 10, 30, "the pusher's first pushes")
        torn = copies = 0
        vals, steps = np.empty((keys.size, 4096), np.int32), np.empty(keys.size, np.uint64)
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:
            t._apply_direct(keys, ones, out=(vals, [], steps))
            torn += int(np.sum(vals.min(axis=1) != vals.max(axis=1)))
            copies += keys.size
        flags[STOP] = 1
        theirs = w.result(30)
    assert theirs > 10 and copies > 100
    assert torn == 0, f"{torn} of {copies} rows copied out torn"
    final = t.pull(keys)
    assert (final == final[:, :1]).all()


def test_dense_write_rows_skips_the_outbox(store, second_store):
    a = store.dense("w", shape=(4, 2), init=1.0)
    b = second_store.dense("w", shape=(4, 2))
    second_store._set_forwarding(True)
    b._write_rows(0, a._snapshot(0))
    np.testing.assert_array_equal(b.pull(), np.ones((4, 2), np.float32))
    assert "w#outbox" not in second_store


def test_table_rows_round_trip(store, second_store):
    opt = shmps.Adagrad(lr=0.1)
    a = store.table("e", dim=3, capacity=50, shards=3, optimizer=opt, init=("normal", 0, 1),
                    seed=4)
    b = second_store.table("e", dim=3, capacity=50, shards=3, optimizer=opt,
                           init=("normal", 0, 1), seed=4)
    keys = np.arange(0, 30, dtype=np.uint64)
    a.push(keys, np.ones((30, 3)))
    a.push(keys[::3], np.ones((10, 3)))
    b.pull(keys[:5])                     # some keys exist on the replica already
    total = 0
    for s in range(a._nshards):
        snap = a._snapshot(s)
        assert snap.step == 0 and len(snap.states) == 1 and snap.row_steps.dtype == np.uint64
        assert (a._key_shard(snap.index) == s).all()
        total += snap.index.size
        b._write_rows(s, snap)
    assert total == 30 and len(b) == 30
    np.testing.assert_array_equal(b.pull(keys), a.pull(keys))
    for s in range(3):
        ra, rb = a._snapshot(s), b._snapshot(s)
        oa, ob_ = np.argsort(ra.index), np.argsort(rb.index)
        np.testing.assert_array_equal(ra.index[oa], rb.index[ob_])
        np.testing.assert_array_equal(ra.states[0][oa], rb.states[0][ob_])
        np.testing.assert_array_equal(ra.row_steps[oa], rb.row_steps[ob_])
    # a subset; missing keys are left out of a read
    s0 = int(a._key_shard([3])[0])
    mine = keys[a._key_shard(keys) == s0]
    absent = next(k for k in range(1000, 2000) if a._key_shard([k])[0] == s0)
    rd = a._read_rows(s0, np.r_[mine[:2], np.uint64(absent)].astype(np.uint64))
    assert rd.index.tolist() == mine[:2].tolist()
    np.testing.assert_array_equal(rd.values, a.pull(mine[:2]))
    with pytest.raises(shmps.InvalidArgument):
        a._read_rows((s0 + 1) % 3, mine[:1])
    # rows written to the wrong shard: refused whole, naming the key, nothing written
    fresh = np.array([k for k in range(3000, 3100) if a._key_shard([k])[0] == s0][:2],
                     np.uint64)
    foreign = np.uint64(next(k for k in range(3100, 4000) if a._key_shard([k])[0] != s0))
    bad = shmps.outbox.RowData(index=np.r_[fresh, foreign].astype(np.uint64),
                               values=np.ones((3, 3)), states=[np.zeros((3, 3))],
                               row_steps=np.ones(3, np.uint64), step=0)
    with pytest.raises(shmps.InvalidArgument, match=f"key {int(foreign)} belongs to shard"):
        b._write_rows(s0, bad)
    assert len(b) == 30 and not any(int(k) in b for k in bad.index)
    b.check()


@settings(max_examples=40, deadline=None)
@given(existing=st.lists(st.integers(0, 400), max_size=150),
       written=st.lists(st.integers(0, 400), max_size=300))
def test_table_write_rows_writes_each_key_its_last_row(existing, written):
    """Whatever mix of existing and missing keys, repeats included, in batches longer
    than the writes' look-ahead (native/table.c WPF): every key written holds the last
    row and step given for it, the keys not written are unchanged, the table checks."""
    from shmps.outbox import RowData
    s = shmps.attach(f"wr{os.getpid()}x{len(existing)}x{len(written)}")
    try:
        t = s.table("e", dim=5, capacity=1024, shards=1, optimizer=shmps.Adam(lr=0.1))
        old = np.array(sorted(set(existing)), np.uint64)
        t.push(old, np.ones((old.size, 5)))
        before = {int(k): row for k, row in zip(old, t.pull(old))}
        keys = np.array(written, np.uint64)
        n = keys.size
        vals = np.arange(n * 5, dtype=np.float32).reshape(n, 5)
        states = [vals + 0.5, vals + 0.25]
        steps = np.arange(n, dtype=np.uint64) + 100
        t._write_rows(0, RowData(index=keys, values=vals, states=states, row_steps=steps,
                                 step=0))
        last = {int(k): i for i, k in enumerate(written)}
        assert len(t) == len(set(existing) | set(written))
        for k, i in last.items():
            rd = t._read_rows(0, [k])
            np.testing.assert_array_equal(rd.values[0], vals[i])
            np.testing.assert_array_equal(rd.states[1][0], states[1][i])
            assert int(rd.row_steps[0]) == 100 + i
        for k, row in before.items():
            if k not in last:
                np.testing.assert_array_equal(t.pull([k])[0], row)
        t.check()
    finally:
        s.destroy()


def test_table_write_rows_of_existing_keys_does_not_wait_for_the_creation_lock(store):
    """A replica's write of rows whose keys it has does not take the table's creation
    lock (frozen, no key of the shard can appear or go meanwhile): it finishes at once
    while another live process holds that lock, where taking it would wait up to 60 s.
    Once the lock is free, a write with a new key creates it."""
    from shmps.outbox import RowData
    t = store.table("e", dim=2, capacity=64, shards=1)
    keys = np.arange(20, dtype=np.uint64)
    t.push(keys, np.ones((20, 2)))
    sh = t._shards[0]
    ctl = sh.seg.array(np.uint64, sh.spec["index_off"] + 16 * sh.spec["nslots"], 32)
    flags = new_flags(1)
    with Workers() as ws:
        w = ws.start(publish_token, flags, 0)
        wait_until(lambda: flags[2] != 0, 60, "the holder's token")
        ctl[8] = np.uint64(flags[2])          # the creation lock's owner (offset 64)
        try:
            t0 = time.monotonic()
            t._write_rows(0, RowData(index=keys[::-1].copy(),
                                     values=np.full((20, 2), 7, np.float32), states=[],
                                     row_steps=None, step=0))
            took = time.monotonic() - t0
        finally:
            ctl[8] = np.uint64(0)
            flags[STOP] = 1
        w.result(30)
    assert took < 1.0
    np.testing.assert_array_equal(t.pull(keys), np.full((20, 2), 7, np.float32))
    t._write_rows(0, RowData(index=np.array([5, 99], np.uint64),
                             values=np.full((2, 2), 3, np.float32), states=[], row_steps=None,
                             step=0))
    assert len(t) == 21 and t.pull([99]).tolist() == [[3, 3]]
    t.check()


def test_table_write_rows_capacity_is_all_or_nothing(store, second_store):
    a = store.table("e", dim=2, capacity=20, shards=1, optimizer=shmps.SGD(lr=1.0))
    b = second_store.table("e", dim=2, capacity=5, shards=1, optimizer=shmps.SGD(lr=1.0))
    a.push(np.arange(8, dtype=np.uint64), np.ones((8, 2)))
    b.push([0, 1], np.full((2, 2), -3.0))
    snap = a._snapshot(0)
    with pytest.raises(shmps.CapacityError):
        b._write_rows(0, snap)
    assert len(b) == 2
    np.testing.assert_array_equal(b.pull([0, 1]), np.full((2, 2), 3.0, np.float32))
    # duplicates: the last row of a key wins
    from shmps.outbox import RowData
    b._write_rows(0, RowData(index=np.array([0, 0], np.uint64),
                             values=np.array([[1, 1], [2, 2]], np.float32), states=[],
                             row_steps=np.array([4, 7], np.uint64), step=0))
    np.testing.assert_array_equal(b.pull([0]), [[2, 2]])
    assert b._read_rows(0, [0]).row_steps.tolist() == [7]
    # a missing key repeated counts once against the capacity (4 of 5 used: it fits),
    # its last row wins; two missing keys do not fit, and nothing is written
    b.push([2, 3], np.zeros((2, 2)))
    assert len(b) == 4
    b._write_rows(0, RowData(index=np.array([9, 0, 9, 9], np.uint64),
                             values=np.array([[5, 5], [6, 6], [7, 7], [8, 8]], np.float32),
                             states=[], row_steps=None, step=0))
    assert len(b) == 5
    np.testing.assert_array_equal(b.pull([9, 0]), [[8, 8], [6, 6]])
    with pytest.raises(shmps.CapacityError):
        b._write_rows(0, RowData(index=np.array([10, 11, 10], np.uint64),
                                 values=np.ones((3, 2), np.float32), states=[],
                                 row_steps=None, step=0))
    assert len(b) == 5 and 10 not in b and 11 not in b
    b.check()


# ---- csr tensors: forwarded as their entries -------------------------------------------

def test_csr_push_goes_to_the_outbox_as_entries(store):
    # rows: 0 -> cols 0, 3; 1 -> none; 2 -> 1, 2, 4; 3 -> 0; 4 -> 2, 3 (3 shards of 2 rows)
    rc, ci = np.array([0, 2, 2, 5, 6, 8]), np.array([0, 3, 1, 2, 4, 0, 2, 3])
    m = store.csr("m", rc, ci, dtype="int32", init=1, shard_rows=2)
    store._set_forwarding(True)
    m.push(shmps.CSR(rc, ci, np.arange(8, dtype=np.int32)))
    m.push(shmps.CSR([0, 1, 1, 1, 1, 3], [3, 2, 2], np.array([10, 20, 30], np.int32)),
           wait=False).wait(10)
    np.testing.assert_array_equal(m.pull().value, np.ones(8, np.int32))   # not applied here
    ob = m._outbox()
    assert ob.name == "m#outbox" and ob.shape == (3 * 4,) and ob.shard_rows == 4
    # each shard's first entry (from the shards' nnz) is rowcnt at the shard's first row
    assert m._entry_bounds.tolist() == rc[[0, 2, 4, 5]].tolist() == [0, 2, 6, 8]
    # an absent entry, NaN in a float matrix: refused, nothing reaches the outbox
    with pytest.raises(shmps.InvalidArgument, match="not in the structure"):
        m.push(shmps.CSR([0, 1, 1, 1, 1, 1], [1], np.ones(1, np.int32)))
    f = store.csr("f", rc, ci, dtype="float32", shard_rows=2)
    with pytest.raises(shmps.NonFinite):
        f.push(shmps.CSR(rc, ci, np.full(8, np.nan, np.float32)))
    assert f._outbox_busy() == []
    assert m._outbox_busy() == [0, 1, 2]
    got = {}
    for s in range(3):
        d = m._outbox_drain(s)
        assert np.all(np.diff(d.index) > 0)
        got.update(zip(d.index.tolist(), d.grads.tolist()))
        m._apply_direct(d.index, d.grads, d.pushes)        # as the owner's bridge does
    assert got == {0: 0, 1: 11, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6 + 50, 7: 7}
    np.testing.assert_array_equal(m.pull().value, 1 + np.array([0, 11, 2, 3, 4, 5, 56, 7]))
    # entries with their row steps (one step per batch and row), written to another copy
    rd = m._read_rows(2, [6, 7])
    assert rd.values.tolist() == [57, 8] and rd.row_steps.tolist() == [1, 1]
    snap = m._snapshot(1)
    assert snap.index.tolist() == [2, 3, 4, 5] and snap.values.tolist() == [3, 4, 5, 6]
    other = store.csr("copy", rc, ci, dtype="int32", shard_rows=2)
    other._write_rows(2, rd)
    other._write_rows(1, snap)
    np.testing.assert_array_equal(other.pull().value, [0, 0, 3, 4, 5, 6, 57, 8])
    assert other._read_rows(2, [6]).row_steps.tolist() == [1]
    # entries outside the shard, unsorted or repeated: refused before anything changes
    with pytest.raises(shmps.OutOfRange):                  # entries of two shards
        m._apply_direct([5, 6], np.ones(2, np.int32))
    for bad in ([5], [7, 6], [6, 6]):
        with pytest.raises((shmps.InvalidArgument, shmps.OutOfRange)):
            m._read_rows(2, bad)
    with pytest.raises(shmps.InvalidArgument):
        m._apply_direct([7, 6], np.ones(2, np.int32))
    with pytest.raises(shmps.OutOfRange):
        other._write_rows(0, rd)
    np.testing.assert_array_equal(m.pull().value, 1 + np.array([0, 11, 2, 3, 4, 5, 56, 7]))
    # forwarding off: pushes apply here again
    store._set_forwarding(False)
    m.push(shmps.CSR(rc, ci, np.ones(8, np.int32)))
    np.testing.assert_array_equal(m.pull().value, 2 + np.array([0, 11, 2, 3, 4, 5, 56, 7]))


def test_csr_entries_carry_optimizer_state_and_the_c_checks_hold(store):
    """A csr tensor with Adam: the entries read for ROWS carry both moments and each
    entry's row step, and written to another copy (with steps, then without: the steps
    there are kept) reproduce them.  Bad positions given to the C calls directly (what a
    corrupt caller could pass; Python refuses them first) are refused with BOUNDS and
    change nothing."""
    from shmps._native import ffi, lib
    rc, ci = np.array([0, 2, 2, 5, 6, 8]), np.array([0, 3, 1, 2, 4, 0, 2, 3])
    a = store.csr("a", rc, ci, dtype="float32", optimizer=shmps.Adam(lr=0.1), shard_rows=2)
    a.push(shmps.CSR(rc, ci, np.arange(1, 9, dtype=np.float32)))
    a.push(shmps.CSR(rc, ci, np.ones(8, np.float32)))
    rd = a._read_rows(1, [2, 3, 4, 5])
    assert len(rd.states) == 2 and all(np.abs(x).sum() > 0 for x in rd.states)
    assert rd.row_steps.tolist() == [2, 2, 2, 2]
    b = store.csr("b", rc, ci, dtype="float32", optimizer=shmps.Adam(lr=0.1), shard_rows=2)
    b._write_rows(1, rd)
    back = b._read_rows(1, [2, 3, 4, 5])
    for x, y in zip([rd.values, *rd.states, rd.row_steps],
                    [back.values, *back.states, back.row_steps]):
        np.testing.assert_array_equal(x, y)
    from shmps.outbox import RowData
    b._write_rows(1, RowData(index=rd.index, values=rd.values * 0, states=rd.states,
                             row_steps=None, step=0))
    back = b._read_rows(1, [2, 3, 4, 5])
    assert back.values.tolist() == [0, 0, 0, 0] and back.row_steps.tolist() == [2, 2, 2, 2]
    before = a.pull().value.copy()
    sh = a._shard(1)
    vals, m1, m2 = (np.zeros(2, np.float32) for _ in range(3))
    states = ffi.new("void *[]", [ffi.from_buffer(m1), ffi.from_buffer(m2)])
    steps = np.zeros(2, np.uint64)
    for bad in ([1, 0], [0, 0], [0, 4], [-1, 0]):   # unsorted, repeated, past nnz, negative
        pos = np.array(bad, np.int64)
        for call in (lib.shmps_csr_read_entries, lib.shmps_csr_write_entries):
            code = call(sh.ptr, shmps._native.token(), shmps._native.addr(pos), 2,
                        ffi.from_buffer(vals), states, 2, shmps._native.addr(steps))
            assert code == lib.SHMPS_E_BOUNDS, (call, bad, code)
    np.testing.assert_array_equal(a.pull().value, before)


def test_aggregated_tensor_forwards_only_its_round(store):
    store.join()
    w = store.dense("w", shape=(3,), dtype="float64", optimizer=shmps.SGD(lr=1.0),
                    aggregate="sum", workers=1)
    store._set_forwarding(True)
    w.push(np.ones(3))           # the round completes: its one update is forwarded
    np.testing.assert_array_equal(w.pull(), np.zeros(3))
    d = w._outbox_drain(0)
    assert d.pushes == 1
    np.testing.assert_array_equal(d.grads, np.ones(3))
    names = [x["name"] for x in store.tensors()]
    assert "w#outbox" in names and not any(n.startswith("w#agg") and n.endswith("#outbox")
                                           for n in names)
    store.clock()
    store.leave()


def test_restore_skips_outboxes(store, tmp_path):
    w = store.dense("w", shape=(4,))
    t = store.table("e", dim=2, capacity=4)
    store._set_forwarding(True)
    w.push(np.ones(4, np.float32))
    t.push([1, 2, 3], np.ones((3, 2)))   # listed rows: their rowstep words link them
    store._set_forwarding(False)
    w.push(np.full(4, 2, np.float32))
    path = store.checkpoint(tmp_path / "ckpt")
    r = shmps.restore(path, store.name + "r")
    try:
        assert sorted(d["name"] for d in r.tensors()) == ["e", "w"]
        np.testing.assert_array_equal(r["w"].pull(), np.full(4, 2, np.float32))
        r._set_forwarding(True)
        r["w"].push(np.ones(4, np.float32))          # a fresh outbox is made
        assert r["w"]._outbox_drain(0).pushed == 1
    finally:
        r.destroy()


# ---- crashes -----------------------------------------------------------------------------------

def test_dead_pusher_holding_an_outbox_stripe_does_not_stall_the_drain(store):
    w = store.dense("w", shape=(8, 4096), dtype="float32")   # 8 stripes, one per row
    store._set_forwarding(True)
    w.push(np.ones((8, 4096), np.float32))
    ob = w._outbox()
    sp = ob._shards[0].spec
    path = segment_path(store, ob)
    tok = dead_token()
    poke(path, sp["stripes_off"] + 16 * 3, "<QI", tok, 7)    # owner dead, seq odd
    t0 = time.monotonic()
    d = w._outbox_drain(0)
    assert time.monotonic() - t0 < 1.0
    assert d.index.tolist() == list(range(8))
    np.testing.assert_array_equal(d.grads, np.ones((8, 4096), np.float32))
    assert ob.stats()["takeovers"] >= 1
    w.push(np.ones((1, 4096), np.float32), rows=[3])        # the stripe works again
    assert w._outbox_drain(0).index.tolist() == [3]


def test_dead_pusher_inside_a_table_outbox_does_not_stall_the_drain(store):
    t = store.table("e", dim=2, capacity=8, shards=1)
    store._set_forwarding(True)
    t.push([1, 2], np.ones((2, 2)))
    ob = t._outbox()
    poke(segment_path(store, ob), ACTIVE_OFF + 8 * 5, "<Q", dead_token())  # a dead pusher
    t0 = time.monotonic()
    d = t._outbox_drain(0)
    assert time.monotonic() - t0 < 1.0
    assert sorted(d.index.tolist()) == [1, 2]


def test_drain_does_not_wait_long_for_a_live_holder(store):
    """A stopped worker holding an outbox stripe (or inside a table outbox) must not
    stall the bridge: the drain takes what it can reach, or nothing, within its bound."""
    w = store.dense("w", shape=(8, 4096), dtype="float32")
    store._set_forwarding(True)
    w.push(np.ones((8, 4096), np.float32))
    ob = w._outbox()
    path, off = segment_path(store, ob), ob._shards[0].spec["stripes_off"] + 16 * 3
    poke(path, off, "<Q", native.token())                    # a live holder: us
    t0 = time.monotonic()
    d = w._outbox_drain(0, timeout=0.05)
    assert time.monotonic() - t0 < 0.5
    assert d.index.tolist() == [0, 1, 2] and d.pushed == 0   # partial: claims no push
    assert w._outbox_drain(0, timeout=0.05) is None           # stuck at the same row
    poke(path, off, "<Q", 0)
    d2 = w._outbox_drain(0)
    assert d2.index.tolist() == [3, 4, 5, 6, 7] and d2.pushed == 1
    w._outbox_ack(0, d.pushed, d.ticket)
    w._outbox_ack(0, d2.pushed, d2.ticket)
    store.flush(timeout=1)
    t = store.table("e", dim=2, capacity=8, shards=1)
    t.push([1, 2], np.ones((2, 2)))
    tob = t._outbox()
    apath = segment_path(store, tob)
    poke(apath, ACTIVE_OFF + 8 * 7, "<Q", native.token())     # "a pusher inside"
    t0 = time.monotonic()
    assert t._outbox_drain(0, timeout=0.05) is None
    assert time.monotonic() - t0 < 0.5 and len(tob) == 2      # nothing taken
    poke(apath, ACTIVE_OFF + 8 * 7, "<Q", 0)
    assert sorted(t._outbox_drain(0).index.tolist()) == [1, 2]


def forward_forever(store: str, tensor: str, flags, idx: int) -> int:
    s = shmps.attach(store)
    t = s[tensor]
    g = np.ones(t.shape, t.dtype)
    rows = np.arange(t.nrows)
    n = 0
    flags[2 + idx] = 1
    while not flags[STOP]:
        t.push(g) if n % 2 else t.push(g[:4], rows=rows[:4])
        n += 1
        flags[2 + idx] = 1 + n
    return n


def test_sigkilled_forwarding_pusher_does_not_stall_the_drain(store, store_name):
    w = store.dense("w", shape=(64, 4096), dtype="float32", shard_rows=32)
    store._set_forwarding(True)
    w._outbox()
    flags = new_flags(1)
    with Workers() as ws:
        p = ws.start(forward_forever, store_name, "w", flags, 0)
        wait_until(lambda: flags[2] > 50, 120, "pusher pushing")
        p.kill()
    t0 = time.monotonic()
    drain_all(w)
    assert time.monotonic() - t0 < 1.0
    drain_all(w)
    w.push(np.ones((64, 4096), np.float32))
    got = drain_all(w)
    assert sorted(got) == list(range(64))


def push_whole(store: str, tensor: str, flags, idx: int) -> int:
    s = shmps.attach(store)
    t = s[tensor]
    g = np.ones(t.shape, t.dtype)
    n = 0
    while not flags[STOP]:
        t.push(g)
        n += 1
        flags[2 + idx] = 1 + n
    return n


def test_a_pusher_killed_mid_write_leaves_its_rows_counted(store, store_name):
    """A worker SIGKILLed while it writes a stripe of an outbox must leave that stripe's
    rows counted as pending, or no drain would ever take what it wrote (the drain looks
    only at counted rows) and the values would sit in the outbox until some later push
    to the same rows.  16 MiB pushes (most of a worker's time is in the C write), a
    drainer racing it so that counts are often zero when the kill lands; after each of
    12 kills every row holding values is counted, and two drains empty the outbox.
    (With the count made after the write, 1 kill in 5 left a stripe uncounted.)"""
    w = store.dense("w", shape=(4096, 1024), dtype="int32", shard_rows=256)
    store._set_forwarding(True)
    ob = w._outbox()
    rng = np.random.default_rng(7)
    flags = [new_flags(1) for _ in range(12)]
    with Workers() as ws:   # (all 12 spawned at once, each waits for its go)
        ps = [ws.start(after_go, f, push_whole, store_name, "w", f, 0) for f in flags]
        for k, (p, f) in enumerate(zip(ps, flags)):
            stop = threading.Event()

            def drainer() -> None:
                while not stop.is_set():
                    drain_all(w)

            f[GO] = 1
            wait_until(lambda: f[2] > 3, 120, "the pusher pushing")
            th = threading.Thread(target=drainer)
            th.start()
            try:
                time.sleep(float(rng.uniform(0.0, 0.2)))
                p.kill()
            finally:
                stop.set()
                th.join(timeout=60)
            held = ob.pull().any(axis=1)
            pend = np.concatenate([ob._pending(s) for s in range(w._nshards)])
            assert not (held & (pend == 0)).any(), \
                f"kill {k}: rows {np.flatnonzero(held & (pend == 0))[:8]} hold uncounted values"
            drain_all(w)
            drain_all(w)
            assert not ob.pull().any(), f"kill {k}: the drains left values behind"


# ---- a bridge process that ends with drained, unacknowledged pushes ---------------------

@pytest.fixture
def new_handle(store, store_name):
    """Opens another handle of the test's store, as a new bridge process attaches it;
    every handle opened is closed after the test, before the store is destroyed."""
    opened: list = []

    def open_handle():
        h = shmps.attach(store_name, create=False)
        opened.append(h)
        return h

    yield open_handle
    for h in opened:
        h.close()


@pytest.fixture
def outbox_table(store, new_handle):
    """A one-shard table "e" of the test's store with forwarding on: (the table, its
    outbox, the outbox segment's path, a new bridge's handle, the table in it)."""
    t = store.table("e", dim=2, capacity=8, shards=1)
    store._set_forwarding(True)
    ob = t._outbox()
    bridge = new_handle()
    return t, ob, segment_path(store, ob), bridge, bridge["e"]


def drain_and_end(store: str, tensor: str) -> int:
    """An "old bridge": drain every shard of ``tensor``'s outbox, acknowledge nothing,
    and end (what it took ends with it)."""
    s = shmps.attach(store, create=False)
    t = s[tensor]
    took = sum(t._outbox_drain(i) is not None for i in range(t._nshards))
    s.close()
    return took


def push_then_flush(store: str, flags) -> str:
    """A worker: push once to every row, then flush; reports how the flush ended."""
    s = shmps.attach(store, create=False)
    w = s["w"]
    w.push(np.ones(w.shape, np.float32))
    flags[2] = 1
    try:
        s.flush(timeout=30)
        return "returned"
    except shmps.PushesLost as e:
        assert "taken by a bridge process" in str(e) and "'w'" in str(e), str(e)
        s.flush(timeout=30)   # raised once: the next flush is not affected
        return "lost"
    finally:
        s.close()


def test_pushes_taken_by_an_ended_bridge_make_flush_raise(store, store_name):
    """flush() must not return as if pushes had been applied when the bridge process that
    drained them ended before their owner acknowledged them (nobody can resend them)."""
    w = store.dense("w", shape=(64, 8), shard_rows=16)
    store._set_forwarding(True)
    w._outbox()
    bridge = shmps.attach(store_name, create=False)   # the handle of a new bridge process
    wb = bridge["w"]
    assert [wb._outbox_recover(s) for s in range(4)] == [0, 0, 0, 0]   # nothing to recover
    flags = new_flags(1)
    with Workers() as ws:
        worker = ws.start(push_then_flush, store_name, flags)
        wait_until(lambda: flags[2] == 1, 60, "worker pushed")
        old = ws.start(drain_and_end, store_name, "w")
        assert old.result(timeout=60) == 4          # the old bridge took all 4 shards
        time.sleep(0.2)
        assert worker.process.is_alive()             # the worker's flush still waits
        # a new bridge starts: it records what the old one took with it
        assert [wb._outbox_recover(s) for s in range(4)] == [1, 1, 1, 1]
        assert worker.result(timeout=60) == "lost"
    assert [wb._outbox_recover(s) for s in range(4)] == [0, 0, 0, 0]   # recorded once
    bridge.flush(timeout=1)   # the recovering handle knows of the loss: no raise
    # this handle used the outbox before the loss (its pushes may be among the lost):
    # its next flush raises too, once
    with pytest.raises(shmps.PushesLost):
        store.flush(timeout=1)
    store.flush(timeout=1)
    # a handle that first uses the outbox after the loss does not raise
    later = shmps.attach(store_name, create=False)
    try:
        later["w"]._outbox()
        later.flush(timeout=1)
    finally:
        later.close()
    w.push(np.ones((64, 8), np.float32))
    for s in range(4):
        d = w._outbox_drain(s)
        w._outbox_ack(s, d.pushed, d.ticket)
    store.flush(timeout=1)
    # and the handle that pushed before a loss raises once
    w.push(np.ones((64, 8), np.float32))
    for s in range(4):
        assert w._outbox_drain(s) is not None       # drained, never acknowledged
    assert [wb._outbox_recover(s) for s in range(4)] == [1, 1, 1, 1]
    with pytest.raises(shmps.PushesLost):
        store.flush(timeout=1)
    store.flush(timeout=1)
    bridge.flush(timeout=1)
    bridge.close()


# ---- a bridge process that ends holding the values of a push still landing ----------------
#
# A push lands in an outbox shard in two steps: its values (under the stripe locks), then
# its count (ob_pushed).  A drain between the two takes the values of a push that no P
# counts yet.  If the bridge holding that drain ends before the owner acknowledged it,
# the values are gone; the push then counts, the next drain finds nothing of it and, with
# every ticket of the ended bridge counted acknowledged by recover, acknowledged it:
# store.flush() returned as if it had been applied.

def test_a_landing_push_taken_by_an_ended_bridge_makes_flush_raise(store, store_name,
                                                                   monkeypatch):
    """Store level, one process: a push stopped between its values and its count (a
    thread), an "old bridge" drain that takes the values and is never acknowledged, a new
    bridge's recover, then the count and the new bridge's (empty) drain: flush() must
    raise PushesLost, not return."""
    from shmps.dense import DenseTensor

    w = store.dense("w", shape=(4, 2))
    store._set_forwarding(True)
    ob = w._outbox()
    landed, go = threading.Event(), threading.Event()
    apply = DenseTensor._apply

    def stop_after_values(self, *args, **kw):
        out = apply(self, *args, **kw)
        if self is ob:                      # the outbox: values in, count not yet made
            landed.set()
            assert go.wait(60)
        return out

    monkeypatch.setattr(DenseTensor, "_apply", stop_after_values)
    pusher = threading.Thread(target=w.push, args=(np.ones((4, 2), np.float32),))
    pusher.start()
    bridge = shmps.attach(store_name, create=False)   # the new bridge's handle
    try:
        assert landed.wait(60)
        d = w._outbox_drain(0)                         # the old bridge takes the values
        assert d.index.size == 4 and d.pushed == 0     # of a push no P counts yet
        # the old bridge ends with d unacknowledged; a new one starts
        wb = bridge["w"]
        assert wb._outbox_recover(0) == 0              # nothing counted is unacknowledged
        go.set()
        pusher.join(60)
        assert native_counters(ob, 0)[0] == 1          # the push is counted now
        assert wb._outbox_drain(0) is None             # and nothing of it is left
        with pytest.raises(shmps.PushesLost):
            store.flush(timeout=5)
        store.flush(timeout=1)                         # once
        bridge.flush(timeout=1)                        # the bridge's handle knows of it
    finally:
        go.set()
        pusher.join(60)
        bridge.close()


def push_landing_then_flush(store: str, flags) -> str:
    """A worker whose push stops after its values landed in the outbox and before its
    count (flags[2] = 1) until flags[3] is set; then it flushes.  Reports how."""
    from shmps.dense import DenseTensor

    s = shmps.attach(store, create=False)
    try:
        w = s["w"]
        ob = w._outbox()
        apply = DenseTensor._apply

        def stop_after_values(self, *args, **kw):
            out = apply(self, *args, **kw)
            if self is ob:
                flags[2] = 1
                wait_until(lambda: flags[3] == 1, 60, "go")
            return out

        DenseTensor._apply = stop_after_values
        w.push(np.ones(w.shape, np.float32))
        try:
            s.flush(timeout=30)
            return "returned"
        except shmps.PushesLost as e:
            assert "taken by a bridge process" in str(e) and "'w'" in str(e), str(e)
            return "lost"
    finally:
        s.close()


def drain_and_hang(store: str, tensor: str, flags) -> None:
    """An "old bridge": drain every shard of ``tensor``'s outbox (flags[4] = shards that
    gave rows), acknowledge nothing, and wait to be SIGKILLed."""
    s = shmps.attach(store, create=False)
    t = s[tensor]
    flags[4] = sum(t._outbox_drain(i) is not None for i in range(t._nshards))
    time.sleep(120)


def test_a_landing_push_lost_with_a_killed_bridge_makes_its_pushers_flush_raise(
        store, store_name, new_handle):
    """The same with processes: a worker stopped between its push's values and its count,
    a bridge process that drains them and is SIGKILLed, a new bridge (this process) that
    recovers and drains while the worker counts its push and flushes: the worker's
    flush() must raise PushesLost."""
    w = store.dense("w", shape=(64, 8), shard_rows=16)
    store._set_forwarding(True)
    w._outbox()
    flags = new_flags(3)
    bridge = new_handle()
    wb = bridge["w"]
    with Workers() as ws:
        pusher = ws.start(push_landing_then_flush, store_name, flags)
        wait_until(lambda: flags[2] == 1, 60, "the push's values landed")
        old = ws.start(drain_and_hang, store_name, "w", flags)
        wait_until(lambda: flags[4] == 4, 60, "the old bridge drained every shard")
        old.kill()
        assert [wb._outbox_recover(s) for s in range(4)] == [0, 0, 0, 0]
        flags[3] = 1                         # the push counts, the worker flushes
        deadline = time.monotonic() + 60
        while not pusher.conn.poll(0) and time.monotonic() < deadline:
            for s in range(4):              # the new bridge's flush loop
                d = wb._outbox_drain(s)
                if d is not None:
                    wb._outbox_ack(s, d.pushed, d.ticket)
            time.sleep(0.002)
        assert pusher.result(timeout=60) == "lost"


def test_a_table_drain_counts_every_push_whose_rows_it_takes(store, outbox_table):
    """A table drain that read ob_pushed before its freeze took the rows of a push that
    was inside the shard then and counted itself while the drain waited for it: the
    drain's P did not count that push.  The bridge holding the drain ends; the next empty
    drain acknowledged the push: flush() returned.  (The push inside the shard is a real
    push whose count is held back and whose active slot is poked.)"""
    t, ob, path, bridge, tb = outbox_table
    t.push([1], np.ones((1, 2)))                             # pushed 1
    d0 = tb._outbox_drain(0)
    tb._outbox_ack(0, d0.pushed, d0.ticket)                   # acknowledged: acked 1
    t.push([2], np.ones((1, 2)))                             # its rows and count...
    poke(path, OB_PUSHED_OFF, "<Q", 1)                       # ...not counted yet
    poke(path, ACTIVE_OFF + 8 * 9, "<Q", native.token())     # ...still inside
    out = {}
    th = threading.Thread(target=lambda: out.update(d=tb._outbox_drain(0, timeout=30)))
    th.start()
    try:
        wait_until(lambda: peek(path, FREEZE_OFF, "<Q")[0] != 0, 30, "the drain's freeze")
    finally:
        poke(path, OB_PUSHED_OFF, "<Q", 2)                   # the push counts
        poke(path, ACTIVE_OFF + 8 * 9, "<Q", 0)              # and leaves the shard
        th.join(60)
    assert out["d"].index.tolist() == [2]                    # the drain took its row
    # the bridge ends with that drain unacknowledged; a new one starts
    tb._outbox_recover(0)
    assert tb._outbox_drain(0) is None
    with pytest.raises(shmps.PushesLost):
        store.flush(timeout=5)


def drain_until_killed(store: str, tensor: str, flags) -> None:
    """An "old bridge" whose drain of shard 0 stops at a stripe a live process holds
    (the test): killed there, it has taken rows and has no ticket."""
    s = shmps.attach(store, create=False)
    flags[4] = 1
    s[tensor]._outbox_drain(0, timeout=100)


def test_a_bridge_killed_mid_drain_makes_flush_raise(store, store_name, new_handle):
    """A bridge SIGKILLed inside a drain has taken rows (their values gone with it) and
    recorded nothing: no ticket, no ob_drained.  The new bridge's recover saw nothing
    unacknowledged, its drain took the rest and was acknowledged: flush() returned."""
    w = store.dense("w", shape=(8, 4096), dtype="float32")     # 8 stripes, one per row
    store._set_forwarding(True)
    ob = w._outbox()
    path, off = segment_path(store, ob), ob._shards[0].spec["stripes_off"] + 16 * 3
    w.push(np.ones((8, 4096), np.float32))                     # pushed 1
    poke(path, off, "<Q", native.token())                      # stripe 3: a live holder
    flags = new_flags(3)
    bridge = new_handle()
    wb = bridge["w"]
    with Workers() as ws:
        old = ws.start(drain_until_killed, store_name, "w", flags)
        wait_until(lambda: flags[4] == 1 and not ob._pending(0)[:3].any(), 60,
                   "the old bridge taking rows 0-2")
        old.kill()
    poke(path, off, "<Q", 0)
    wb._outbox_recover(0)
    d = wb._outbox_drain(0)
    assert d.index.tolist() == [3, 4, 5, 6, 7] and d.pushed == 1
    wb._outbox_ack(0, d.pushed, d.ticket)
    with pytest.raises(shmps.PushesLost):
        store.flush(timeout=5)


def test_a_partial_drain_taken_by_an_ended_bridge_makes_flush_raise(store, new_handle):
    """A partial drain (a stripe held by a live process) takes the rows before it and
    claims no push: its P is the previous drain's.  The rows it took may hold values of
    pushes counted after that P.  If the bridge holding it ends, recover must count
    those pushes lost: before, it found (ob_acked, ob_drained] empty, the next drain took
    the remaining rows, was acknowledged, and flush() returned without rows 0-2."""
    from shmps.outbox import lost

    w = store.dense("w", shape=(8, 4096), dtype="float32")     # 8 stripes, one per row
    store._set_forwarding(True)
    ob = w._outbox()
    path, off = segment_path(store, ob), ob._shards[0].spec["stripes_off"] + 16 * 3
    w.push(np.ones((8, 4096), np.float32))                     # pushed 1, counted
    bridge = new_handle()            # the new bridge's handle
    poke(path, off, "<Q", native.token())                  # stripe 3: a live holder
    d = w._outbox_drain(0, timeout=0.05)                   # the old bridge's drain
    assert d.index.tolist() == [0, 1, 2] and d.pushed == 0 and d.ticket > 0
    poke(path, off, "<Q", 0)
    # the old bridge ends with d unacknowledged; a new one starts
    wb = bridge["w"]
    assert wb._outbox_recover(0) == 1 and lost(ob, 0)[2] == 1
    d2 = wb._outbox_drain(0)
    assert d2.index.tolist() == [3, 4, 5, 6, 7] and d2.pushed == 1
    wb._outbox_ack(0, d2.pushed, d2.ticket)
    with pytest.raises(shmps.PushesLost):
        store.flush(timeout=5)
    store.flush(timeout=1)                                  # once


def test_recover_records_no_more_than_before_when_nothing_was_landing(store, new_handle):
    """No false alarm in the common cases: every drain acknowledged, recover records
    nothing; a drain left unacknowledged while nothing was landing, recover records
    exactly its range (ob_acked, ob_drained], not the pushes counted after it.  Both
    kinds; nothing is left open."""
    from shmps.outbox import lost, lost_open

    w = store.dense("w", shape=(4, 2))
    t = store.table("e", dim=2, capacity=8, shards=1)
    store._set_forwarding(True)
    ob, tob = w._outbox(), t._outbox()
    bridge = new_handle()
    wb, tb = bridge["w"], bridge["e"]
    for x, xb, push in ((w, wb, lambda: w.push(np.ones((4, 2), np.float32))),
                        (t, tb, lambda: t.push([1, 2], np.ones((2, 2))))):
        o = x._outbox()
        push()
        d = xb._outbox_drain(0)
        xb._outbox_ack(0, d.pushed, d.ticket)
        assert xb._outbox_recover(0) == 0 and not lost_open(o, 0)
        assert native_counters(o, 0) == (1, 1)
        push()
        push()                                         # pushed 3
        assert xb._outbox_drain(0).pushed == 3         # never acknowledged
        push()                                         # pushed 4, in the outbox
        assert xb._outbox_recover(0) == 2 and not lost_open(o, 0)
        assert lost(o, 0) == (1, 3, 2) and native_counters(o, 0) == (4, 3)
        d = xb._outbox_drain(0)                        # the push after: sent as usual
        assert d.pushed == 4
        xb._outbox_ack(0, d.pushed, d.ticket)
        assert native_counters(o, 0) == (4, 4) and lost(o, 0)[2] == 2
    with pytest.raises(shmps.PushesLost):
        store.flush(timeout=1)
    store.flush(timeout=1)
    assert ob._pending(0).sum() == 0 and tob._pending().size == 0


def test_a_dead_landing_pusher_does_not_hold_a_lost_range_open(store, new_handle):
    """A pusher killed while landing holds its landing slot: every drain counts as
    possibly holding a landing push, and recover must not wait for that one to be
    counted (it never will): it sees the holder dead, frees its slot and ends the range
    at once."""
    from shmps.outbox import lost, lost_open

    w = store.dense("w", shape=(4, 2))
    store._set_forwarding(True)
    ob = w._outbox()
    path = segment_path(store, ob)
    bridge = new_handle()
    wb = bridge["w"]
    w.push(np.ones((4, 2), np.float32))                     # pushed 1
    poke(path, LANDING_OFF + 16 * 5, "<QQ", dead_token(), 7)  # killed while landing
    assert wb._outbox_drain(0).pushed == 1                 # not acknowledged
    assert wb._outbox_recover(0) == 1 and not lost_open(ob, 0)
    assert peek(path, LANDING_OFF + 16 * 5, "<QQ") == (0, 7)  # its slot is free again
    assert lost(ob, 0) == (0, 1, 1) and native_counters(ob, 0) == (1, 1)
    with pytest.raises(shmps.PushesLost):
        store.flush(timeout=1)
    # 64 slots held by dead pushers: a push takes one over (within a few ms)
    dead = dead_token()
    for i in range(64):
        poke(path, LANDING_OFF + 16 * i, "<Q", dead)
    t0 = time.monotonic()
    w.push(np.ones((4, 2), np.float32))
    assert time.monotonic() - t0 < 1.0
    assert native_counters(ob, 0)[0] == 2


def _open_lost_range(store, new_handle):
    """A one-shard (4, 2) dense "w" pushed once (pushed 1), a push landing (its slot
    claimed, its values and count to come, as a worker stopped in the middle of a push),
    and a drain of push 1 that a new bridge's recover records lost: the range (0, 1]
    stays open.  Returns (w, its outbox, the bridge's handle, w in it, a gradient, the
    landing push's touched shards and slots)."""
    from shmps.outbox import lost, lost_open

    w = store.dense("w", shape=(4, 2))
    store._set_forwarding(True)
    ob = w._outbox()
    bridge = new_handle()
    wb = bridge["w"]
    g = np.ones((4, 2), np.float32)
    w.push(g)                                              # pushed 1
    touched = ob._every_shard()
    slots = ob._land(touched)                              # a push landing
    assert wb._outbox_drain(0).pushed == 1                 # not acknowledged
    assert wb._outbox_recover(0) == 1                      # (0, 1] now, and open
    assert lost_open(ob, 0) and lost(ob, 0) == (0, 1, 1)
    return w, ob, bridge, wb, g, touched, slots


def test_a_lost_range_waits_for_a_live_landing_push(store, new_handle):
    """A push landing at recover (here: its slot claimed, its values and count to come,
    as a worker stopped in the middle of a push) may be one whose values the ended
    bridge took: the range stays open, acks and empty drains raise ob_acked no further,
    flush() times out (saying why) instead of returning, and the first drain after the
    push counted ends the range; flush() then raises PushesLost, once."""
    from shmps.dense import DenseTensor
    from shmps.outbox import busy, lost, lost_open, take_lost

    w, ob, bridge, wb, g, touched, slots = _open_lost_range(store, new_handle)
    assert busy(wb) == [0]                                 # the bridge drains it
    w.push(g)                                              # pushed 2: a later push
    d = wb._outbox_drain(0)
    wb._outbox_ack(0, d.pushed, d.ticket)
    assert wb._outbox_drain(0) is None
    assert native_counters(ob, 0) == (2, 1)               # nothing past the range
    with pytest.raises(shmps.Timeout, match="stopped in the middle of a push"):
        store.flush(timeout=0.05)
    DenseTensor._apply(ob, g, None)                        # the landing push: values,
    ob._landed(touched, slots, True)                       # count (pushed 3), slot
    d = wb._outbox_drain(0)                                # ends the range at 3
    assert d.pushed == 3 and not lost_open(ob, 0)
    assert lost(ob, 0) == (0, 3, 3) and native_counters(ob, 0) == (3, 3)
    assert take_lost(bridge) == [("w", 0, 2)] and take_lost(bridge) == []
    wb._outbox_ack(0, d.pushed, d.ticket)
    with pytest.raises(shmps.PushesLost, match="'w' shard 0: 3"):
        store.flush(timeout=1)
    store.flush(timeout=1)
    bridge.flush(timeout=1)                                # the bridge's handle knows
    w.push(g)                                              # and on as usual
    d = wb._outbox_drain(0)
    wb._outbox_ack(0, d.pushed, d.ticket)
    store.flush(timeout=1)


def test_a_slot_claimed_again_does_not_hold_a_lost_range_open(store, new_handle):
    """The range waits for the pushes landing at recover, not for the slots: a slot
    freed and claimed again (its seq moved; here by the same process, as a worker pushing
    without pause does) does not keep it open, nor does a push that began landing after
    recover."""
    from shmps.dense import DenseTensor
    from shmps.outbox import lost, lost_open

    w = store.dense("w", shape=(4, 2))
    store._set_forwarding(True)
    ob = w._outbox()
    bridge = new_handle()
    wb = bridge["w"]
    touched = ob._every_shard()
    a = ob._land(touched)                                  # push A landing
    DenseTensor._apply(ob, np.ones((4, 2), np.float32), None)   # A's values
    assert wb._outbox_drain(0).pushed == 0                 # taken, A not counted
    assert wb._outbox_recover(0) == 0 and lost_open(ob, 0)
    c = ob._land(touched)                                  # C begins after recover
    assert list(c) != list(a)
    ob._landed(touched, a, True)                           # A counts: pushed 1
    b = ob._land(touched)                                  # B, in A's slot
    assert list(b) == list(a)
    assert wb._outbox_drain(0) is None                     # ends the range: A counted
    assert not lost_open(ob, 0) and lost(ob, 0) == (0, 1, 1)
    ob._landed(touched, b, True)
    ob._landed(touched, c, True)                           # pushed 3
    assert wb._outbox_drain(0) is None
    assert native_counters(ob, 0) == (3, 3)
    with pytest.raises(shmps.PushesLost):
        store.flush(timeout=1)


# ---- a table drain that fails part way ------------------------------------------------------
#
# A table drain removes each row it takes as it goes.  One that met a corrupt row after
# taking others returned CorruptSegment, and what it had taken was thrown away with its
# buffers; the next drain counted those pushes again and their ack made flush() return
# as if they had been applied.

OB_DRAINED_OFF = 1224  # outbox shards: ob_drained, then ob_sent


def _corrupt_live_row(ob, path, keys, k):
    """Overwrite the stored key of the k-th lowest live row holding one of ``keys`` (the
    drain takes rows in row order, and finds each row's key in the index: that one is
    then CorruptSegment); returns (row, its key)."""
    sp = ob._shards[0].spec
    stored = peek(path, sp["colidx_off"], f"<{sp['nrows']}Q")
    rows = sorted(r for r, key in enumerate(stored) if key in set(keys))
    assert len(rows) == len(keys)
    row = rows[k]
    poke(path, sp["colidx_off"] + 8 * row, "<Q", 999_999)
    return row, stored[row]


def test_a_table_drain_that_fails_after_taking_rows_makes_flush_raise(store, outbox_table):
    """A drain that removed rows and then met a corrupt row records the pushes it took as
    lost: flush() raises PushesLost for them (the next drain, which finds the rest, and
    its ack do not make them acknowledged), and the bridge's handle reports them."""
    from shmps.outbox import lost, take_lost

    t, ob, path, bridge, tb = outbox_table
    t.push([100], np.ones((1, 2)))                           # pushed 1
    d = tb._outbox_drain(0)
    tb._outbox_ack(0, d.pushed, d.ticket)                    # acked 1
    store.flush(timeout=1)
    t.push([1, 2], np.ones((2, 2)))                          # pushed 2, 3, 4
    t.push([3], np.ones((1, 2)))
    t.push([4, 5], np.ones((2, 2)))
    row, key = _corrupt_live_row(ob, path, [1, 2, 3, 4, 5], 2)  # two rows before it
    with pytest.raises(shmps.CorruptSegment):
        tb._outbox_drain(0)
    assert len(ob) == 3                                      # two rows taken and gone
    assert lost(ob, 0) == (1, 4, 3)                          # pushes 2..4 recorded lost
    assert take_lost(bridge) == [("e", 0, 3)] and take_lost(bridge) == []
    assert native_counters(ob, 0) == (4, 4)                  # nothing else to wait for
    sp = ob._shards[0].spec
    poke(path, sp["colidx_off"] + 8 * row, "<Q", key)        # repaired
    d = tb._outbox_drain(0)                                  # takes the other three
    assert len(d.index) == 3 and len(ob) == 0
    tb._outbox_ack(0, d.pushed, d.ticket)
    with pytest.raises(shmps.PushesLost, match="'e' shard 0: 3"):
        store.flush(timeout=5)
    store.flush(timeout=1)                                   # raised once
    bridge.flush(timeout=1)                                  # the drainer's handle knows
    t.push([6], np.ones((1, 2)))                             # and on as usual
    d = tb._outbox_drain(0)
    assert d.index.tolist() == [6] and d.pushed == 5
    tb._outbox_ack(0, d.pushed, d.ticket)
    store.flush(timeout=1)
    ob.check()


@pytest.mark.parametrize("kind", ["dense", "table"])
def test_a_drain_its_owner_refused_makes_flush_raise(store, new_handle, kind):
    """An owner that refuses a batch for good (REJECTED) drops it.  Its drain's pushes
    are recorded lost (outbox.reject) before the bridge acknowledges the drain, so
    flush() raises PushesLost once instead of returning as if they had been applied
    (a later drain's ack covered them before: flush() returned).  The pushes of the
    drains before and after it are acknowledged as usual; a second refusal of the same
    drain (another of its frames) records nothing more; the bridge's own handle knows."""
    from shmps.outbox import lost
    if kind == "dense":
        t = store.dense("w", shape=(8, 2), shard_rows=8)

        def push(k):
            t.push(np.full((8, 2), k, np.float32))
    else:
        t = store.table("e", dim=2, capacity=64, shards=1)

        def push(k):
            t.push([k, k + 100], np.ones((2, 2)))
    store._set_forwarding(True)
    ob = t._outbox()
    bridge = new_handle()
    tb = bridge[t.name]
    push(1)
    d1 = tb._outbox_drain(0)                                   # pushes (0, 1]: applied
    push(2)
    push(3)
    d2 = tb._outbox_drain(0)                                   # (1, 3]: refused
    push(4)
    d3 = tb._outbox_drain(0)                                   # (3, 4]: applied
    assert (d1.prev, d1.pushed, d2.prev, d2.pushed, d3.prev, d3.pushed) == (0, 1, 1, 3, 3, 4)
    tb._outbox_ack(0, d1.pushed, d1.ticket)
    assert tb._outbox_reject(0, d2.prev, d2.pushed) == 2
    assert tb._outbox_reject(0, d2.prev, d2.pushed) == 0       # again: nothing more
    assert lost(ob, 0) == (1, 3, 2)
    tb._outbox_ack(0, d3.pushed, d3.ticket)                    # covers d2's ack too
    with pytest.raises(shmps.PushesLost, match=f"{t.name!r} shard 0: 2"):
        store.flush(timeout=5)
    store.flush(timeout=1)                                     # raised once
    bridge.flush(timeout=1)                                    # the refusing handle knows
    with pytest.raises(shmps.InvalidArgument):
        tb._outbox_reject(0, 3, 2)
    push(5)                                                    # and on as usual
    d = tb._outbox_drain(0)
    tb._outbox_ack(0, d.pushed, d.ticket)
    store.flush(timeout=1)


def test_a_refused_drain_that_counts_no_push_of_its_own_records_up_to_the_pushes_now(
        store, new_handle):
    """A drain whose P counts none of its own pushes (a partial drain, which a pusher
    holding a stripe cut short: P is the drain before's; or one that took only values of
    a push still landing) holds values of pushes counted after it.  Refused, its empty
    (prev, pushed] would record nothing, and the next drain's ack would cover them: the
    range goes on to ob_pushed at the refusal instead, and flush() raises."""
    from shmps.outbox import lost

    w = store.dense("w", shape=(8, 2), shard_rows=8)
    store._set_forwarding(True)
    ob = w._outbox()
    bridge = new_handle()
    wb = bridge["w"]
    w.push(np.ones((8, 2), np.float32))                       # pushed 1
    d1 = wb._outbox_drain(0)
    wb._outbox_ack(0, d1.pushed, d1.ticket)
    store.flush(timeout=1)
    w.push(np.ones((8, 2), np.float32))                       # pushes 2, 3: counted, their
    w.push(np.ones((8, 2), np.float32))                       # values (say) in a drain
    assert wb._outbox_reject(0, 1, 1) == 2                    # of P 1, refused: (1, 3]
    assert lost(ob, 0) == (1, 3, 2)
    d = wb._outbox_drain(0)                                   # the next one: accepted
    wb._outbox_ack(0, d.pushed, d.ticket)
    with pytest.raises(shmps.PushesLost, match="'w' shard 0: 2"):
        store.flush(timeout=5)
    store.flush(timeout=1)


def test_a_refusal_while_a_lost_range_is_open_is_counted_by_the_range(store, new_handle):
    """A range recover left open (a push landing at recover) ends at the ob_pushed of the
    drain that settles it, past every drain refused meanwhile: a refusal then records
    nothing, and the range counts those pushes with the rest.  (Recorded at the refusal,
    the pushes between the range's upper end and the refused drain's prev were left out
    of the count: 3 instead of 4 here.)"""
    from shmps.dense import DenseTensor
    from shmps.outbox import lost, lost_open

    w, ob, bridge, wb, g, touched, slots = _open_lost_range(store, new_handle)
    w.push(g)                                                  # pushed 2: applied
    d = wb._outbox_drain(0)
    wb._outbox_ack(0, d.pushed, d.ticket)
    w.push(g)                                                  # pushed 3: refused
    d = wb._outbox_drain(0)
    assert (d.prev, d.pushed) == (2, 3)
    assert wb._outbox_reject(0, d.prev, d.pushed) == 0         # the range counts it
    wb._outbox_ack(0, d.pushed, d.ticket)
    assert lost(ob, 0) == (0, 1, 1)
    DenseTensor._apply(ob, g, None)                            # the landing push counts
    ob._landed(touched, slots, True)                           # (pushed 4)
    d = wb._outbox_drain(0)                                    # and the range ends at 4
    assert d.pushed == 4 and not lost_open(ob, 0)
    assert lost(ob, 0) == (0, 4, 4)
    wb._outbox_ack(0, d.pushed, d.ticket)
    with pytest.raises(shmps.PushesLost, match="'w' shard 0: 4"):
        store.flush(timeout=1)


def test_a_table_drain_that_fails_before_taking_a_row_changes_nothing(store, outbox_table):
    """A drain whose first row is corrupt removed nothing: rows, counters and the lost
    range stay as they were, and once the row is repaired the next drain takes it all
    and its ack lets flush() return."""
    from shmps.outbox import lost, take_lost

    t, ob, path, bridge, tb = outbox_table
    t.push([1, 2], np.ones((2, 2)))                          # pushed 1, 2
    t.push([3], np.full((1, 2), 2.0))
    before = peek(path, OB_DRAINED_OFF, "<2Q"), native_counters(ob, 0), len(ob)
    row, key = _corrupt_live_row(ob, path, [1, 2, 3], 0)
    with pytest.raises(shmps.CorruptSegment):
        tb._outbox_drain(0)
    assert (peek(path, OB_DRAINED_OFF, "<2Q"), native_counters(ob, 0), len(ob)) == before
    assert lost(ob, 0) == (0, 0, 0) and take_lost(bridge) == []
    sp = ob._shards[0].spec
    poke(path, sp["colidx_off"] + 8 * row, "<Q", key)        # repaired
    d = tb._outbox_drain(0)
    order = np.argsort(d.index)
    assert d.index[order].tolist() == [1, 2, 3] and (d.pushed, d.pushes) == (2, 2)
    np.testing.assert_array_equal(d.grads[order], [[1, 1], [1, 1], [2, 2]])
    tb._outbox_ack(0, d.pushed, d.ticket)
    store.flush(timeout=1)
    ob.check()


def test_a_rows_push_lands_in_each_shard_it_writes_and_counts_there(store):
    """A push of rows into an outbox is one C call (shmps_dense_push_sorted_rows) that
    takes a landing slot of each shard it writes, for that shard's run, and counts the
    push there when it frees it (native/outbox.c "Landing"): the slots' seq move in
    shards 0 and 2 only, each by one, every slot is free again, and ob_pushed counts the
    push in those shards alone.  Without the slot, a bridge killed while holding values
    of this push would let the next one acknowledge it (the landing tests above)."""
    w = store.dense("w", shape=(9, 2), dtype="float32", shard_rows=3)     # 3 shards
    store._set_forwarding(True)
    ob = w._outbox()
    paths = [os.path.join(SHM, ob._shards[k].seg.name.lstrip("/")) for k in range(3)]

    def slots(k):
        words = peek(paths[k], LANDING_OFF, "<128Q")
        return words[0::2], sum(words[1::2])          # tokens, the seqs' sum

    w.push(np.ones((4, 2), np.float32), rows=[7, 0, 1, 6])                 # shards 0, 2
    for k, moved in ((0, 1), (1, 0), (2, 1)):
        tokens, seqs = slots(k)
        assert not any(tokens) and seqs == moved, (k, seqs)
        assert native_counters(ob, k)[0] == moved


# ---- the pages a push writes are backed before it writes them ---------------------------

def _allocated(seg: Any) -> int:
    """Bytes of /dev/shm that segment ``seg`` holds now (its allocated blocks)."""
    return os.stat(os.path.join(SHM, seg.name.lstrip("/"))).st_blocks * 512


def _shm_huge_pages() -> bool:
    """True if /dev/shm's mount gives shmps segments huge pages (its huge= option): then
    pages are allocated 2 MiB at a time, and page counts below mean nothing."""
    huge = "never"
    try:
        with open("/proc/mounts") as mounts:
            lines = mounts.read().splitlines()
        for line in lines:
            f = line.split()
            if len(f) > 3 and f[1] == "/dev/shm":
                opts = [o.split("=", 1)[1] for o in f[3].split(",") if o.startswith("huge=")]
                huge = opts[-1] if opts else "never"
    except OSError:
        pass
    return huge not in ("never", "deny")


def test_a_push_into_an_outbox_backs_the_pages_it_writes_first(store):
    """An outbox is created without its pages (it is as large as its tensor); a push
    backs the granules it writes before it writes them (outbox._Backing), so that
    /dev/shm without room refuses it with CapacityError, not a SIGBUS.  A push of one
    row backs that row's group and the shard's small words, not the shard; a table push
    backs, in the shards its keys hash to only, the index and control block and the row
    arrays for the rows it may take and BACK_AHEAD_ROWS more, not the capacity."""
    from shmps.outbox import BACK_AHEAD_ROWS, BACK_CHUNK

    if _shm_huge_pages():
        pytest.skip("/dev/shm gives huge pages: its allocation is counted 2 MiB at a time")
    w = store.dense("w", shape=(8192, 256), dtype="float32", init=0.0)   # 8 MiB, 1 shard
    e = store.table("e", dim=64, capacity=1 << 16, shards=2)
    store._set_forwarding(True)
    ob_w, ob_e = w._outbox(), e._outbox()
    seg = ob_w._shard(0).seg
    before = _allocated(seg)
    assert before < seg.size // 8
    w.push(np.ones((1, 256), np.float32), rows=[4000])
    one = _allocated(seg) - before
    # (without the backing the write took its own page or two and the words it counts)
    assert BACK_CHUNK <= one < seg.size // 8, (one, seg.size)
    sh = [ob_e._shard(s) for s in range(2)]
    before = [_allocated(x.seg) for x in sh]
    keys = np.arange(1, 5000, dtype=np.uint64)
    keys = keys[e._key_shard(keys) == 1][:100]                    # keys of shard 1 only
    e.push(keys, np.ones((100, 64)))
    grown = [_allocated(x.seg) - b0 for x, b0 in zip(sh, before)]
    assert grown[0] < 4 * 4096, grown                             # shard 0: untouched
    sp = sh[1].spec
    fixed = sh[1].seg.size - sp["index_off"]                      # index, ctl, links
    rows_bytes = sp["index_off"] - sp["colidx_off"]               # keys, values, steps, stripes
    ahead = rows_bytes * (100 + BACK_AHEAD_ROWS) // sp["nrows"]
    # (without the backing: 100 rows and the index pages their slots fall in)
    assert fixed + ahead - 4 * BACK_CHUNK <= grown[1] < sh[1].seg.size // 2, (grown, fixed,
                                                                              ahead)
    assert (ob_w.pull()[4000] == 1).all() and len(ob_e) == 100


#: An LD_PRELOAD library whose madvise(MADV_POPULATE_WRITE) fails with ENOMEM, as on a
#: full /dev/shm, once armed with shmps_test_fail_madvise(1): the backing of a push's
#: pages cannot be had.  shmps runs unchanged; only libc's answer is.
_FAILING_MADVISE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stddef.h>
static int armed = 0;
static long failures = 0;
void shmps_test_fail_madvise(int on) { armed = on; }
long shmps_test_madvise_failures(void) { return failures; }
int madvise(void *addr, size_t len, int advice) {
    static int (*real)(void *, size_t, int);
    if (armed && advice == 23) {   /* MADV_POPULATE_WRITE */
        failures++;
        errno = ENOMEM;
        return -1;
    }
    if (!real) real = (int (*)(void *, size_t, int))dlsym(RTLD_NEXT, "madvise");
    return real(addr, len, advice);
}
"""

_PUSH_WITHOUT_ROOM = r"""
import ctypes, sys
import numpy as np
import shmps
libc = ctypes.CDLL(None)
libc.shmps_test_fail_madvise.argtypes = [ctypes.c_int]
s = shmps.attach(sys.argv[1])
try:
    w = s.dense("w", shape=(4096, 64), dtype="float32", init=0.0)
    e = s.table("e", dim=64, capacity=4096, shards=2)
    s._set_forwarding(True)
    ob_w, ob_e = w._outbox(), e._outbox()
    forwarded = int(shmps._native.lib.shmps_forward_pushes(s._mptr))
    libc.shmps_test_fail_madvise(1)
    for what, push in (("rows", lambda: w.push(np.ones((2, 64), np.float32), rows=[7, 3000])),
                       ("whole", lambda: w.push(np.ones((4096, 64), np.float32))),
                       ("table", lambda: e.push([7, 8], np.ones((2, 64))))):
        try:
            push()
            print(what, "pushed", flush=True)
        except shmps.CapacityError as exc:
            print(what, "refused", "no room" in str(exc), flush=True)
    print("failures", libc.shmps_test_madvise_failures() > 0, flush=True)
    print("unchanged", not ob_w.pull().any(), int(ob_w._pending(0).sum()), len(ob_e),
          int(shmps._native.lib.shmps_forward_pushes(s._mptr)) - forwarded, flush=True)
    libc.shmps_test_fail_madvise(0)
    w.push(np.ones((2, 64), np.float32), rows=[7, 3000])
    e.push([7, 8], np.ones((2, 64)))
    print("after", int(ob_w.pull()[[7, 3000]].sum()), len(ob_e), flush=True)
finally:
    s.destroy()
"""


def test_a_push_into_an_outbox_without_room_is_refused_and_changes_nothing(tmp_path,
                                                                           store_name):
    """/dev/shm without room for the pages a forwarded push would write (madvise made to
    fail as on a full /dev/shm): the push is refused with CapacityError saying so, and
    the outbox is unchanged (no value, no pending count, no key, no forwarded push
    counted: the bridge is not woken for nothing); with room again, the
    same pushes go in.  (Written into pages never backed, such a push died of SIGBUS.)"""
    import subprocess
    import sys

    from helpers import build_preload, child_env

    preload = build_preload(tmp_path, _FAILING_MADVISE, "failing-madvise")
    try:
        r = subprocess.run([sys.executable, "-c", _PUSH_WITHOUT_ROOM, store_name],
                           env=child_env(LD_PRELOAD=preload),
                           capture_output=True, text=True, timeout=120)
    finally:   # (a child that died, of SIGBUS say, or was timed out, left its store)
        try:
            shmps.attach(store_name, create=False).destroy()
        except shmps.NotFound:
            pass
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == ["rows refused True", "whole refused True",
                                     "table refused True", "failures True",
                                     "unchanged True 0 0 0", "after 128 2"], r.stdout


def test_a_destroyed_table_outbox_is_unmapped_while_its_handles_live(store_name):
    """The backing of a table outbox's pushes reads the rows handed out through the
    segment's pointer: a numpy view kept for it held the mapping open, and a destroyed
    store's outbox stayed mapped (its /dev/shm pages not freed) while the user's table
    handle lived (review 18 F1)."""
    s = shmps.attach(store_name)
    t = s.table("e", dim=4, capacity=1024, shards=2)
    s._set_forwarding(True)
    t.push(np.arange(1, 50, dtype=np.uint64), np.ones((49, 4)))
    names = [t._outbox()._shard(i).seg.name.lstrip("/") for i in range(2)]
    s.destroy()
    maps = open("/proc/self/maps").read()
    assert not [n for n in names if n in maps], names
    assert t is not None


def test_a_table_outbox_creates_rows_only_up_to_those_backed(store):
    """The C creation of an outbox's rows checks, under the creation lock, that they
    were backed (ctl ``backed``, shared by every process): past it, SHMPS_E_UNBACKED
    with the rows needed, nothing changed; the pusher backs them and says so
    (shmps_table_set_backed), and the push goes in.  A push whose rows were backed, by
    any process, does no Python work for it (at 256 shards the per-shard checks it made
    before cost 346 us a push).  set_backed refuses a table that is not an outbox."""
    from shmps._native import ffi, lib
    from shmps.outbox import BACK_AHEAD_ROWS

    e = store.table("e", dim=4, capacity=4096, shards=2)
    store._set_forwarding(True)
    ob = e._outbox()
    keys = np.arange(1, 200, dtype=np.uint64)
    keys = keys[e._key_shard(keys) == 1][:10]

    def raw_push() -> tuple[int, list]:
        scratch, nbytes, info = ob._scratch(keys.size)
        g = np.ones((keys.size, 4), np.float32)
        code = lib.shmps_table_push(ob._ptrs(), 2, native.token(), native.addr(keys),
                                    keys.size, ffi.from_buffer(g), ob._gcode, 1, scratch,
                                    nbytes, info)
        return code, [int(info[i]) for i in range(4)]

    def backed(s: int) -> int:
        sp = ob._shard(s).spec
        return int(ob._shard(s).seg.array(np.uint64, sp["index_off"] + 16 * sp["nslots"]
                                          + 120, 1)[0])

    nrows = ob._shard(1).spec["nrows"]
    assert raw_push() == (lib.SHMPS_E_UNBACKED, [10, 0, nrows, 1])
    assert len(ob) == 0 and backed(1) == 0
    e.push(keys, np.ones((10, 4)))                      # backs shard 1, then goes in
    assert len(ob) == 10
    assert backed(1) == min(nrows, 10 + BACK_AHEAD_ROWS) and backed(0) == 0
    assert lib.shmps_table_set_backed(ob._ptrs(), 2, 1, 5) == 0    # a max: stays
    assert backed(1) == min(nrows, 10 + BACK_AHEAD_ROWS)
    assert raw_push()[0] == 0                           # old keys: no new row
    assert lib.shmps_table_set_backed(e._ptrs(), 2, 0, 5) == lib.SHMPS_E_ARG


def test_a_dense_outbox_backs_the_row_groups_of_every_shard_it_writes(store):
    """Shards whose row groups do not divide them (rows of 3 KiB: 21 a group of about
    64 KiB; shards of 100 rows, the last of 50): a push of one row in each shard backs
    that row's group in each shard's segment, no other group; the last shard's groups
    past its rows count as backed from the start, so that once every real group is,
    pushes do no work for it."""
    if _shm_huge_pages():
        pytest.skip("/dev/shm gives huge pages: its allocation is counted 2 MiB at a time")
    w = store.dense("w", shape=(250, 768), dtype="float32", shard_rows=100)
    store._set_forwarding(True)
    ob = w._outbox()
    segs = [ob._shard(s).seg for s in range(3)]
    before = [_allocated(seg) for seg in segs]
    w.push(np.ones((3, 768), np.float32), rows=[5, 190, 249])
    d = ob._dense_backing
    assert (d.per, d.groups, d.flat) == (21, 5, False)
    # row 5: shard 0's group 0; row 190: shard 1's row 90, group 4; row 249: shard 2's
    # row 49, group 2; shard 2's groups 3 and 4 (rows 63 on) do not exist
    assert np.flatnonzero(d.done).tolist() == [0, 9, 12, 13, 14]
    for seg, b0 in zip(segs, before):
        grown = _allocated(seg) - b0
        assert 21 * 3072 <= grown < seg.size * 3 // 4, (grown, seg.size)
    w.push(np.ones((250, 768), np.float32))             # a whole push: every page
    assert d.left == 0 and d.done.all()
    got = ob.pull()[[5, 190, 249, 0]]
    np.testing.assert_array_equal(got, np.repeat([[2], [2], [2], [1]], 768, 1))


@pytest.mark.timeout(120)
def test_a_flush_while_another_thread_first_pushes_to_a_tensor_does_not_raise(store):
    """A thread's store.flush() (a checkpoint thread, say) while a training thread makes
    the first forwarded push to a tensor (which creates its outbox and notes the
    outbox's lost counts in the handle's bookkeeping): the flush returns.  Before,
    the flush's last look for lost pushes iterated that bookkeeping (a dict) while the
    push added to it, and raised RuntimeError: dictionary changed size during
    iteration (review H11 of 2026-11-28)."""
    import sys

    tensors = [store.dense(f"t{i}", shape=(4,), shard_rows=1) for i in range(60)]
    store._set_forwarding(True)
    empty = np.zeros(0, np.float32)
    for t in tensors[:20]:
        t.push(empty, rows=[])      # (an empty push: creates the outbox, pushes nothing)
    go = threading.Barrier(2)
    done = threading.Event()
    errors: list[BaseException] = []

    def flusher() -> None:
        go.wait()
        try:
            while not done.is_set():
                store.flush(timeout=10)
        except BaseException as exc:   # (the test's failure, shown below)
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # (thread switches inside the flush's loop)
    th = threading.Thread(target=flusher)
    th.start()
    try:
        go.wait()
        for t in tensors[20:]:
            t.push(empty, rows=[])
            if errors:
                break
    finally:
        done.set()
        th.join(30)
        sys.setswitchinterval(old)
        store._set_forwarding(False)
    assert not errors, errors
    assert sorted(store._lost_seen) == sorted(f"t{i}#outbox" for i in range(60))


@pytest.mark.timeout(120)
def test_threads_backing_a_dense_outbox_at_once_leave_no_group_counted_backed_twice(store):
    """8 threads of one process making the same forwarded pushes of rows at once (the
    first pushes to a new outbox, which back the row groups they write): the counts
    of groups and granules still to back never fall below what is really left, so
    every later push that writes an unbacked group still backs it (a count at 0 stops
    all backing: a push writing an unbacked page with /dev/shm full is killed by
    SIGBUS, which the backing exists to turn into CapacityError).  Before, threads
    that found the same group unbacked each took it off the count: 64 groups, 32
    pushed by 8 threads, left a count of -192 for 32 groups left (review H11 of
    2026-11-28)."""
    import sys

    # rows of 3 KiB: 21 rows a group of about 64 KiB; one shard of 64 groups
    w = store.dense("w", shape=(21 * 64, 768), dtype="float32", shard_rows=21 * 64)
    store._set_forwarding(True)
    ob = w._outbox()
    rows = np.arange(32) * 21                     # one row in each of groups 0..31
    g = np.ones((rows.size, 768), np.float32)
    go = threading.Barrier(8)
    errors: list[BaseException] = []

    def pusher() -> None:
        go.wait()
        try:
            w.push(g, rows=rows)
        except BaseException as exc:   # (the test's failure, shown below)
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # (thread switches inside the backing's loops)
    try:
        threads = [threading.Thread(target=pusher) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    d = ob._dense_backing
    assert d.done[:32].all() and not d.done[32:].any()
    assert d.left >= 32, d.left
    for b in d.segs:
        assert b.left >= np.count_nonzero(~b.done), (b.left, np.count_nonzero(~b.done))
    # a push into each group left backs it
    w.push(np.ones((32, 768), np.float32), rows=np.arange(32, 64) * 21)
    assert d.done.all()
    np.testing.assert_array_equal(ob.pull()[[0, 21 * 40, 21 * 64 - 1], 0], [8, 1, 0])
    store._set_forwarding(False)
