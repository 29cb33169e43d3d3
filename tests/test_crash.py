"""kill -9 at any instant never deadlocks, corrupts, or blocks the others for long.

Two kinds of tests: SIGKILL of real workers at random instants (pushers, creators,
attachers, frozen readers), repeated with random delays; and deterministic ones that
plant a dead process's token in each kind of claim (stripe lock, shard freeze, active
slot, manifest initialiser, manifest mutex) through the layout of
docs/segment-layout.md, so every takeover path runs on every run."""
from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest

import shmps
import shmps._native as native
from helpers import (GO, SHM, STOP, Workers, attach_loop, create_dense, dead_token,
                     hold_manifest_lock_and_die, new_flags, peek, poke, pull_loop, push_loop,
                     remove_store, wait_until)

pytestmark = pytest.mark.timeout(240)

FREEZE_OFF, ACTIVE_OFF = 384, 448      # shard header (docs/segment-layout.md)
INIT_OWNER_OFF, STATE_OFF = 24, 32     # manifest header
LOW = 20                               # survivors push 1, victims 1 << LOW


def shard_path(store: shmps.Store, tid: int = 0, shard: int = 0) -> str:
    return os.path.join(SHM, f"shmps.{store.name}.t{tid}.s{shard}")


def timed(call):
    t0 = time.monotonic()
    result = call()
    return result, time.monotonic() - t0


# ---- SIGKILL of real processes at random instants ------------------------------------------

def test_sigkill_pushers_at_random_instants(store, store_name):
    """Pushers killed -9 at random never block survivors 2 s, tear or lose their pushes."""
    rng = random.Random(1234)
    t = store.dense("w", shape=(256, 1024), dtype="int32")     # 1 MiB, 64 stripes
    nvictims = 10
    survivors_flags = new_flags(2)
    victim_flags = [new_flags(1) for _ in range(nvictims)]
    with Workers() as ws:
        survivors = [ws.start(push_loop, store_name, "w", 1, survivors_flags, i, 10, LOW)
                     for i in range(2)]
        victims = [ws.start(push_loop, store_name, "w", 1 << LOW, victim_flags[i], 0)
                   for i in range(nvictims)]
        wait_until(lambda: survivors_flags[2] and survivors_flags[3]
                   and all(f[2] for f in victim_flags), 120, "workers ready")
        survivors_flags[GO] = 1
        for victim, flags in zip(victims, victim_flags):
            flags[GO] = 1
            wait_until(lambda: flags[2] >= 2, 30, "victim pushing")
            time.sleep(rng.uniform(0, 0.03))
            victim.kill()
            before = [survivors_flags[2], survivors_flags[3]]
            wait_until(lambda: survivors_flags[2] >= before[0] + 3
                       and survivors_flags[3] >= before[1] + 3, 10,
                       "survivors to keep pushing after a kill")
        survivors_flags[STOP] = 1
        results = [w.result(60) for w in survivors]
    for r in results:
        assert r["worst"] < 2.0, f"a survivor push took {r['worst']:.3f} s"
        assert r["torn"] == 0, "a consistent pull saw part of a survivor's push"
    total = sum(r["pushes"] for r in results)
    a = t.pull()
    low = a & ((1 << LOW) - 1)
    np.testing.assert_array_equal(low, total, err_msg="survivor pushes lost")
    # the tensor stays usable (stats()["takeovers"] grows when a kill hit a held
    # stripe, which is likely but not certain: test_dead_stripe_owner_* force it)
    t.push(np.ones(t.shape, np.int32))
    assert np.all((t.pull() & ((1 << LOW) - 1)) == total + 1)


def test_sigkill_creator_mid_create(store, store_name):
    """After a creator is killed -9 mid-create, get-or-create finishes in < 2 s and works."""
    rng = random.Random(99)
    shape = (4096, 2048)  # 32 MiB of float32: 2 shards
    rounds = 6
    flags = [new_flags(1) for _ in range(rounds)]
    with Workers() as ws:
        for i in range(rounds):
            victim = ws.start(create_dense, store_name, f"big{i}", shape, "float32", 1.0,
                              flags[i], 0)
            wait_until(lambda: flags[i][2] >= 1, 60, "creator attached")
            time.sleep(rng.uniform(0, 0.06))
            victim.kill()
            t, dt = timed(lambda: store.dense(f"big{i}", shape=shape, dtype="float32",
                                              init=1.0))
            assert dt < 2.0, f"get-or-create after a killed creator took {dt:.2f} s"
            a = t.pull()
            assert a.shape == shape and np.all(a == 1.0)
            t.push(np.ones((2, 2048), np.float32), rows=[0, 4095])
            assert t.pull(rows=[4095])[0, 0] == 2.0
    assert sorted(d["name"] for d in store.tensors()) == [f"big{i}" for i in range(rounds)]


def test_sigkill_during_attach_race(store_name):
    """Attachers killed -9 mid-race never leave the store unusable (attach + create < 2 s)."""
    rng = random.Random(7)
    n, rounds = 5, 4
    names = [f"{store_name}r{rnd}" for rnd in range(rounds)]
    flags = [new_flags(n) for _ in range(rounds)]
    try:
        with Workers() as ws:
            # every round's 5 fresh processes spawned at once, each round's waiting for
            # its go (one round after the other, their spawns took most of the test)
            racers = [[ws.start(attach_loop, name, fl, i) for i in range(n)]
                      for name, fl in zip(names, flags)]
            for name, fl, workers in zip(names, flags, racers):
                wait_until(lambda: all(fl[2 + i] for i in range(n)), 90, "workers ready")
                fl[GO] = 1
                time.sleep(rng.uniform(0, 0.004))
                killed = rng.sample(workers, 2)
                for w in killed:
                    w.kill()
                    time.sleep(rng.uniform(0, 0.01))
                time.sleep(0.05)
                fl[STOP] = 1
                for w in workers:
                    if w not in killed:
                        assert w.result(30) > 0, "a survivor attached at least once"
                s, dt = timed(lambda: shmps.attach(name))
                try:
                    assert dt < 2.0
                    t, dt = timed(lambda: s.dense("w", shape=(4,), dtype="int32"))
                    assert dt < 2.0
                    t.push(np.ones(4, np.int32))
                    np.testing.assert_array_equal(t.pull(), 1)
                finally:
                    s.close()
                remove_store(name)
    finally:
        for name in names:
            remove_store(name)


def test_sigkill_frozen_reader_does_not_block_pushers(store, store_name):
    """A consistent reader killed -9 mid-pull (shard frozen) delays pushes < 1 s."""
    rng = random.Random(5)
    t = store.dense("w", shape=(4096, 1024), dtype="float32")  # one 16 MiB shard
    assert t.nshards == 1
    rounds = 5
    flags = [new_flags(1) for _ in range(rounds)]
    g = np.ones((1, 1024), np.float32)
    with Workers() as ws:
        readers = [ws.start(pull_loop, store_name, "w", True, flags[i], 0)
                   for i in range(rounds)]
        wait_until(lambda: all(f[2] for f in flags), 120, "readers ready")
        for i, reader in enumerate(readers):
            flags[i][GO] = 1
            wait_until(lambda: flags[i][2] >= 3, 30, "reader pulling")
            time.sleep(rng.uniform(0, 0.02))
            reader.kill()
            _, dt = timed(lambda: t.push(g, rows=[i]))
            assert dt < 1.0, f"push after killing a frozen reader took {dt:.3f} s"
            _, dt = timed(lambda: t.pull())
            assert dt < 1.0
    np.testing.assert_array_equal(t.pull(rows=list(range(rounds))), 1.0)


# ---- a dead process's token planted in each kind of claim ----------------------------------

@pytest.fixture(scope="module")
def dead():
    """The token of a process that has exited."""
    tok = dead_token()
    assert not native.token_alive(tok)
    return tok


def stripe_word(store: shmps.Store, tensor: str, stripe: int) -> tuple[str, int]:
    """Path of the tensor's first shard and the offset of a stripe's lock word."""
    t = store[tensor]
    spec = t._shards[0].spec
    assert stripe < spec["nstripes"]
    return shard_path(store, t.record["id"]), spec["stripes_off"] + 16 * stripe


@pytest.mark.parametrize("odd_seq", [False, True], ids=["between-writes", "mid-write"])
def test_dead_stripe_owner_taken_over(store, dead, odd_seq):
    """A stripe lock of a dead process (even mid-write) is taken over in < 1 s, losing nothing."""
    # Whole push, rows= push and stripe-seqlocked pull each meet the dead owner.
    t = store.dense("w", shape=(64, 1024), dtype="int32")  # 16 stripes of 4 rows
    path, off = stripe_word(store, "w", 3)
    poke(path, off, "<QI", dead, 7 if odd_seq else 6)
    _, dt = timed(lambda: t.push(np.ones((64, 1024), np.int32)))
    assert dt < 1.0
    assert peek(path, off, "<Q")[0] == 0, "lock released after the takeover"
    assert peek(path, off + 8, "<I")[0] % 2 == 0, "seqlock left even"
    assert t.stats()["takeovers"] >= 1
    poke(path, off, "<QI", dead, 9)
    _, dt = timed(lambda: t.push(np.ones((2, 1024), np.int32), rows=[12, 13]))
    assert dt < 1.0
    poke(path, off, "<QI", dead, 11)
    a, dt = timed(lambda: t.pull(consistent=False))
    assert dt < 1.0
    want = np.ones((64, 1024), np.int32)
    want[12:14] += 1
    np.testing.assert_array_equal(a, want)
    np.testing.assert_array_equal(t.pull(), want)


def test_reused_pid_is_not_the_owner(store):
    """A lock word naming a live pid with another start time (a reused pid) is taken over."""
    t = store.dense("w", shape=(8, 1024), dtype="float32")
    path, off = stripe_word(store, "w", 1)
    me = native.token()
    poke(path, off, "<Q", (me & ~0xFFFFFFFF) | ((me + 1) & 0xFFFFFFFF))
    _, dt = timed(lambda: t.push(np.ones((8, 1024), np.float32)))
    assert dt < 1.0
    np.testing.assert_array_equal(t.pull(), 1.0)


def test_dead_freeze_holder_taken_over(store, dead):
    """A shard frozen by a dead reader delays neither pushes nor pulls by 1 s."""
    t = store.dense("w", shape=(16, 16), dtype="float64")
    path = shard_path(store)
    poke(path, FREEZE_OFF, "<Q", dead)
    _, dt = timed(lambda: t.push(np.ones((16, 16))))
    assert dt < 1.0
    poke(path, FREEZE_OFF, "<Q", dead)
    a, dt = timed(lambda: t.pull())
    assert dt < 1.0
    np.testing.assert_array_equal(a, 1.0)
    assert peek(path, FREEZE_OFF, "<Q")[0] == 0


def test_a_live_holder_is_waited_for_until_the_timeout(store):
    """A claim a live process holds is waited for until the caller's timeout, which
    counts from the wait's first yield (a free claim reads no clock): with the freeze
    word naming this live process, shmps_freeze with 0.3 s gives up with
    SHMPS_E_TIMEOUT after about 0.3 s (not at once, not for ever) and leaves the word."""
    t = store.dense("w", shape=(16, 16), dtype="float64")
    path = shard_path(store)
    me = native.token()
    poke(path, FREEZE_OFF, "<Q", me)
    r, dt = timed(lambda: native.lib.shmps_freeze(t._shards[0].ptr, me, 0.3))
    assert r == native.lib.SHMPS_E_TIMEOUT and 0.25 < dt < 2.0, (r, dt)
    assert peek(path, FREEZE_OFF, "<Q")[0] == me
    poke(path, FREEZE_OFF, "<Q", 0)
    t.push(np.ones((16, 16)))
    np.testing.assert_array_equal(t.pull(), 1.0)


@pytest.mark.parametrize("slot", [0, 17, 63])
def test_dead_active_pusher_slot_cleared(store, dead, slot):
    """An active-pusher slot left by a dead pusher delays a consistent pull by < 1 s."""
    t = store.dense("w", shape=(16, 16), dtype="float32", init=2.0)
    path = shard_path(store)
    poke(path, ACTIVE_OFF + 8 * slot, "<Q", dead)
    a, dt = timed(lambda: t.pull())
    assert dt < 1.0
    np.testing.assert_array_equal(a, 2.0)
    assert peek(path, ACTIVE_OFF + 8 * slot, "<Q")[0] == 0


def test_all_active_slots_dead(store, dead):
    """Every active slot held by dead pushers: a push still gets in within 1 s."""
    t = store.dense("w", shape=(4, 4), dtype="int32")
    path = shard_path(store)
    poke(path, ACTIVE_OFF, "<64Q", *([dead] * 64))
    _, dt = timed(lambda: t.push(np.ones((4, 4), np.int32)))
    assert dt < 1.0
    np.testing.assert_array_equal(t.pull(), 1)


def test_dead_manifest_initialiser_taken_over(store_name, dead):
    """A store whose initialiser died mid-initialisation is taken over by attach in < 2 s."""
    path = os.path.join(SHM, f"shmps.{store_name}.manifest")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, shmps.store.MANIFEST_SIZE)
        os.close(fd)
        poke(path, INIT_OWNER_OFF, "<Q", dead)
        s, dt = timed(lambda: shmps.attach(store_name, timeout=2.0))
        assert dt < 2.0
        try:
            assert peek(path, STATE_OFF, "<I")[0] == 1
            t = s.dense("w", shape=(3,), dtype="int32")
            t.push(np.ones(3, np.int32))
            np.testing.assert_array_equal(t.pull(), 1)
        finally:
            s.close()
    finally:
        remove_store(store_name)


PID_NS_OFF = 408                       # manifest header: the store's PID namespace


def test_an_initialiser_of_another_pid_namespace_is_not_judged(store_name, dead):
    """A manifest being initialised by a process of another PID namespace (a container
    sharing /dev/shm), whose token is no process here: attach refuses the store with
    InvalidArgument at once, and leaves the initialiser's claim and the manifest as
    they were.  (attach judged the token by this namespace's /proc, found it dead and
    took the initialisation over, under a live initialiser.)"""
    path = os.path.join(SHM, f"shmps.{store_name}.manifest")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, shmps.store.MANIFEST_SIZE)
        os.close(fd)
        theirs = int(native.lib.shmps_self_pid_ns()) + 1   # no namespace of this process
        poke(path, PID_NS_OFF, "<Q", theirs)
        poke(path, INIT_OWNER_OFF, "<Q", dead)
        for create in (True, False):
            with pytest.raises(shmps.InvalidArgument, match="another PID namespace") as e:
                timed(lambda: shmps.attach(store_name, create=create, timeout=2.0))
            assert e.value.hint and "PID namespace" in e.value.hint
        assert peek(path, INIT_OWNER_OFF, "<Q")[0] == dead
        assert peek(path, STATE_OFF, "<I")[0] == 0
        assert peek(path, PID_NS_OFF, "<Q")[0] == theirs
    finally:
        remove_store(store_name)


LIVE_INITIALISER = """
import sys
import numpy as np
import shmps
from shmps import _native, names
from shmps.segment import Segment
from shmps.store import MANIFEST_RESERVED, MANIFEST_SIZE
seg, _ = Segment.open_or_create(names.manifest_name({store!r}, None), MANIFEST_SIZE,
                                reserve=MANIFEST_RESERVED)
words = seg.array(np.uint64, 0, 52)
words[408 // 8] = int(_native.lib.shmps_self_pid_ns())   # the namespace claim, then
words[24 // 8] = _native.token()                          # init_owner: initialising
print("claimed", flush=True)
sys.stdin.read()
"""


def test_a_live_initialiser_of_another_pid_namespace_is_not_taken_over(store_name):
    """The same with a real process of another PID namespace (a container sharing
    /dev/shm), alive and initialising the store, its pid no process here: this
    process's attach is refused at once and leaves its claim alone."""
    from helpers import start_in_other_pid_namespace

    path = os.path.join(SHM, f"shmps.{store_name}.manifest")
    pid = next(p for p in range(31000, 60000) if not os.path.exists(f"/proc/{p}"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(shmps.__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = start_in_other_pid_namespace(LIVE_INITIALISER.format(store=store_name), pid, env)
    try:
        assert p.stdout.readline().strip() == "claimed", p.poll()
        owner = peek(path, INIT_OWNER_OFF, "<Q")[0]
        assert owner >> 32 == pid and not native.token_alive(owner)   # dead, seen from here
        with pytest.raises(shmps.InvalidArgument, match="another PID namespace"):
            shmps.attach(store_name, timeout=2.0)
        assert peek(path, INIT_OWNER_OFF, "<Q")[0] == owner
        assert peek(path, STATE_OFF, "<I")[0] == 0
    finally:
        p.stdin.close()
        assert p.wait(timeout=30) == 0
        remove_store(store_name)


def test_an_initialisation_claims_the_pid_namespace_first(store_name):
    """The PID namespace is claimed before the initialisation (so a waiter never judges
    an initialiser of another namespace): a manifest whose initialiser claimed only the
    namespace (it died before its claim of init_owner) is initialised by an attach of
    that namespace, and refused to one of another."""
    path = os.path.join(SHM, f"shmps.{store_name}.manifest")
    ours = int(native.lib.shmps_self_pid_ns())
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, shmps.store.MANIFEST_SIZE)
        os.close(fd)
        poke(path, PID_NS_OFF, "<Q", ours)
        with shmps.attach(store_name) as s:
            assert s.tensors() == []
        assert peek(path, STATE_OFF, "<I")[0] == 1
        assert peek(path, PID_NS_OFF, "<Q")[0] == ours
    finally:
        remove_store(store_name)


def test_dead_manifest_lock_holder(store, store_name):
    """A process killed -9 holding the robust manifest mutex delays creation by < 2 s."""
    with Workers() as ws:
        w = ws.start(hold_manifest_lock_and_die, store_name)
        w.process.join(60)
        assert w.process.exitcode == -9
    t, dt = timed(lambda: store.dense("w", shape=(5,), dtype="int8"))
    assert dt < 2.0
    t.push(np.ones(5, np.int8))
    np.testing.assert_array_equal(t.pull(), 1)
    t2, dt = timed(lambda: store.dense("v", shape=(5,)))
    assert dt < 2.0, "the mutex stays usable after the recovery"


def test_half_created_segments_are_replaced(store, store_name):
    """Shard debris of a creator that died before registering is replaced on creation."""
    debris = os.path.join(SHM, f"shmps.{store_name}.t0.s0")
    with open(debris, "wb") as f:
        f.write(b"half written" * 100)
    os.chmod(debris, 0o600)
    t = store.dense("w", shape=(10,), dtype="float32", init=3.0)
    np.testing.assert_array_equal(t.pull(), 3.0)
    assert os.path.getsize(debris) != 1200
