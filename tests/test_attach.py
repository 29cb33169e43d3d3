"""Stores: racing attach and get-or-create from many processes, attach cost,
namespaces, destroy, close, attached processes."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from typing import Any

import numpy as np
import pytest

import shmps
from helpers import (STOP, Workers, attach_and_hold, attach_timing, child_env, fork_dying_at_unlink,
                     new_flags, other_pid_ns_message, pull_after_destroy, race_attach,
                     remove_store, store_segments, times_out_for_the_removal_holder,
                     unshare_pid_command, wait_until)

pytestmark = pytest.mark.timeout(120)

SPECS = [("a", (100, 10), "float32"), ("b", (64, 1024), "int32"), ("c", (7,), "int8")]


@pytest.mark.slow
def test_racing_attach_and_get_or_create(store_name):
    """8 processes racing attach + dense() all get the same tensors in 20 s (5 rounds)."""
    # Fails (a 60 s hang in the manifest lock, or tensors vanishing) while
    # native/manifest.c initialise() zeroes init_owner in its memset of the header: a
    # second attacher claims init_owner in that window and initialises the store again
    # (seen: 4 initialisations in one race, one over a locked mutex with waiters).
    # The 40 processes of the 5 rounds are spawned at once, each round's 8 wait for its
    # go: a round is still 8 fresh processes racing their first attach (processes
    # reused from round to round, each arriving hot, no longer caught that bug).
    n, rounds = 8, 5
    names = [f"{store_name}r{rnd}" for rnd in range(rounds)]
    flags = [new_flags(n) for _ in range(rounds)]
    try:
        with Workers() as ws:
            racers = [[ws.start(race_attach, name, SPECS, fl, i) for i in range(n)]
                      for name, fl in zip(names, flags)]
            for rnd, (name, fl, ours) in enumerate(zip(names, flags, racers)):
                wait_until(lambda: all(fl[2 + i] for i in range(n)), 60, "workers ready")
                assert store_segments(name) == [], "nobody attached before go"
                fl[0] = 1
                deadline = time.monotonic() + 20
                seen = [w.result(max(0.0, deadline - time.monotonic())) for w in ours]
                assert all(s == seen[0] for s in seen), f"round {rnd}: {seen}"
                with shmps.attach(name, create=False) as s:
                    desc = s.tensors()
                    assert sorted(d["name"] for d in desc) == ["a", "b", "c"], f"round {rnd}"
                    for tname, shape, dtype in SPECS:
                        np.testing.assert_array_equal(s[tname].pull(), np.full(shape, n, dtype),
                                                      err_msg=f"round {rnd}: {tname}")
                nshards = sum(d["nshards"] for d in desc)
                assert len(store_segments(name)) == 1 + nshards, "no orphan segments"
                remove_store(name)
    finally:
        for name in names:
            remove_store(name)


def test_attach_of_100_tensors_is_fast(store_name):
    """A fresh process attaches to a store of 100 tensors in < 50 ms (loose CI bound)."""
    # tools/bench.py measures the 10 ms target.
    s = shmps.attach(store_name)
    try:
        for i in range(100):
            s.dense(f"layer{i}.w", shape=(64, 32), dtype="float32")
        times = []
        with Workers() as ws:
            for attempt in range(3):  # a fresh process each time; a loaded CI box may
                r = ws.start(attach_timing, store_name).result(60)  # stall one of them
                assert r["tensors"] == 100
                times.append(r["seconds"])
                if r["seconds"] < 0.050:
                    break
        assert min(times) < 0.050, f"attach took {times} s"
    finally:
        s.destroy()


def test_namespaces_isolate_same_store_name(store_name):
    """One store name in namespaces hostA, hostB and none gives three separate stores."""
    a = shmps.attach(store_name, namespace="hostA")
    b = shmps.attach(store_name, namespace="hostB")
    plain = shmps.attach(store_name)
    try:
        a.dense("w", shape=(3,), dtype="int32").push(np.array([1, 2, 3], np.int32))
        b.dense("w", shape=(3,), dtype="int32").push(np.array([10, 20, 30], np.int32))
        np.testing.assert_array_equal(a["w"].pull(), [1, 2, 3])
        np.testing.assert_array_equal(b["w"].pull(), [10, 20, 30])
        assert plain.tensors() == []
        assert store_segments(store_name, "hostA") == [
            f"shmps.hostA.{store_name}.manifest", f"shmps.hostA.{store_name}.t0.s0"]
        assert len(store_segments(store_name, "hostB")) == 2
        assert store_segments(store_name) == [f"shmps.{store_name}.manifest"]
        a.destroy()
        assert store_segments(store_name, "hostA") == []
        np.testing.assert_array_equal(b["w"].pull(), [10, 20, 30])
    finally:
        for s in (a, b, plain):
            s.destroy()


def test_namespace_from_environment(store_name, monkeypatch):
    """SHMPS_NAMESPACE is the default namespace; an explicit namespace wins."""
    explicit = shmps.attach(store_name, namespace="hostA")
    try:
        explicit.dense("w", shape=(2,), init=5.0)
        monkeypatch.setenv("SHMPS_NAMESPACE", "hostA")
        with shmps.attach(store_name) as s:
            assert s.namespace == "hostA"
            np.testing.assert_array_equal(s["w"].pull(), 5.0)
        with shmps.attach(store_name, namespace="hostB") as s:
            assert s.tensors() == []
        monkeypatch.setenv("SHMPS_NAMESPACE", "..")
        with pytest.raises(shmps.InvalidArgument):
            shmps.attach(store_name)
    finally:
        explicit.destroy()
        remove_store(store_name, "hostB")


def test_namespace_in_child_process_environment(store_name, monkeypatch):
    """A worker started with SHMPS_NAMESPACE set sees that namespace's store."""
    s = shmps.attach(store_name, namespace="hostC")
    try:
        s.dense("w", shape=(4,), dtype="int32")
        monkeypatch.setenv("SHMPS_NAMESPACE", "hostC")
        from helpers import stats_worker

        with Workers() as ws:
            ws.start(stats_worker, store_name, "w", 2, 0).result(60)
        np.testing.assert_array_equal(s["w"].pull(), 2)
        assert store_segments(store_name) == []
    finally:
        s.destroy()


def test_destroy_removes_every_segment(store_name):
    """destroy() unlinks the manifest and every shard of every tensor."""
    s = shmps.attach(store_name)
    s.dense("a", shape=(100, 4), shard_rows=7)
    s.dense("b", shape=(3,), dtype="int8")
    s.dense("c", shape=(2, 2), optimizer=shmps.Momentum(lr=0.1))
    assert len(store_segments(store_name)) == 1 + 15 + 1 + 1
    s.destroy()
    assert store_segments(store_name) == []
    s.destroy()  # idempotent


def test_destroy_leaves_other_stores(store_name):
    """destroy() of store "x" leaves stores named "x.y" and "x-1" alone."""
    others = [shmps.attach(store_name + ".y"), shmps.attach(store_name + "-1")]
    for o in others:
        o.dense("t0", shape=(2,))
    try:
        s = shmps.attach(store_name)
        s.dense("w", shape=(2,))
        s.destroy()
        left = [g for g in store_segments(store_name) if not g.startswith(f"shmps.{store_name}.y.")]
        assert left == []
        for o in others:
            assert len(store_segments(o.name)) == 2
            assert o["t0"].pull().shape == (2,)
    finally:
        for o in others:
            o.destroy()


def test_attached_process_keeps_its_mapping_after_destroy(store_name):
    """A process attached at destroy() keeps its mapping; a re-attach starts empty."""
    s = shmps.attach(store_name)
    s.dense("w", shape=(3,), dtype="int32", init=4)
    flags = new_flags(1)
    try:
        with Workers() as ws:
            w = ws.start(pull_after_destroy, store_name, "w", flags, 0)
            wait_until(lambda: flags[2], 60, "worker attached")
            s.destroy()
            assert store_segments(store_name) == []
            flags[0] = 1
            assert w.result(60) == [5, 5, 5]
        assert store_segments(store_name) == []
        with shmps.attach(store_name) as fresh:
            assert fresh.tensors() == []
    finally:
        remove_store(store_name)


def test_close_is_idempotent_and_local(store_name):
    """close() twice is fine and detaches only that handle; data and other handles stay."""
    s1 = shmps.attach(store_name)
    s2 = shmps.attach(store_name)
    try:
        s1.dense("w", shape=(2,), init=1.0)
        s1.close()
        s1.close()
        with pytest.raises(shmps.Closed):
            s1["w"]
        np.testing.assert_array_equal(s2["w"].pull(), 1.0)
        assert len(store_segments(store_name)) == 2
    finally:
        s2.destroy()


def test_context_manager_closes(store_name):
    """`with shmps.attach(...) as s:` closes s at the end, keeping the store."""
    try:
        with shmps.attach(store_name) as s:
            s.dense("w", shape=(1,))
        with pytest.raises(shmps.Closed):
            s.tensors()
        assert len(store_segments(store_name)) == 2
    finally:
        remove_store(store_name)


def test_processes_lists_live_attached_pids(store_name):
    """processes() lists live attached pids and drops a worker once it is killed."""
    s = shmps.attach(store_name)
    flags = new_flags(1)
    try:
        with Workers() as ws:
            w = ws.start(attach_and_hold, store_name, flags, 0)
            wait_until(lambda: flags[2], 60, "worker attached")
            assert set(s.processes()) == {os.getpid(), w.pid}
            w.kill()
            assert s.processes() == [os.getpid()]
    finally:
        s.destroy()


def test_processes_after_worker_closes(store_name):
    """A worker that closes its store is no longer listed."""
    s = shmps.attach(store_name)
    flags = new_flags(1)
    try:
        with Workers() as ws:
            w = ws.start(attach_and_hold, store_name, flags, 0)
            wait_until(lambda: flags[2], 60, "worker attached")
            flags[STOP] = 1
            assert w.result(60) == w.pid
        assert s.processes() == [os.getpid()]
    finally:
        s.destroy()


def test_reattach_sees_existing_data(store_name):
    """Closing every handle keeps the data; attaching again reads it."""
    try:
        with shmps.attach(store_name) as s:
            s.dense("w", shape=(2, 2), dtype="float64", init=2.5)
        with shmps.attach(store_name, create=False) as s:
            np.testing.assert_array_equal(s["w"].pull(), 2.5)
    finally:
        remove_store(store_name)


def test_tensor_created_after_attach_is_visible(store_name):
    """A tensor created by another handle after this one attached is found by name."""
    s1 = shmps.attach(store_name)
    s2 = shmps.attach(store_name)
    try:
        assert s2.tensors() == []
        s1.dense("late", shape=(3,), init=1.0)
        assert "late" in s2
        np.testing.assert_array_equal(s2["late"].pull(), 1.0)
        assert [d["name"] for d in s2.tensors()] == ["late"]
    finally:
        s1.close()
        s2.destroy()


def test_repeated_attach_close_does_not_leak_process_slots(store_name):
    """Attaching and closing 2000 times (more than the 1024 process slots) works."""
    s = shmps.attach(store_name)
    try:
        t0 = time.monotonic()
        for _ in range(2000):
            shmps.attach(store_name).close()
        assert s.processes() == [os.getpid()]
        assert time.monotonic() - t0 < 30
    finally:
        s.destroy()


def _mapping_of(path: str) -> dict:
    """This process's /proc/self/smaps entry of the mapping of file ``path``."""
    entry: dict = {}
    found = False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if len(head) >= 5 and "-" in head[0] and not line.startswith(("VmFlags", " ")):
            if found:
                break
            found = line.rstrip().endswith(path)
            continue
        if found and ":" in line:
            k, _, v = line.partition(":")
            entry[k.strip()] = v.strip()
    return entry


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage"),
                    reason="a kernel without transparent huge pages refuses MADV_HUGEPAGE")
def test_large_segments_ask_for_huge_pages(store):
    """Shard segments of 2 MiB and more are advised MADV_HUGEPAGE (smaps VmFlags "hg")
    in the process that creates them and in one that maps them later; small shards and
    the manifest (8 MiB, a few KiB used) are not.  A table's rows are read at random, a
    TLB miss a row in 4 KiB pages.  Where /dev/shm is mounted with huge=advise the
    kernel takes the advice; the default mount ignores it (docs/tables.md, "Huge pages")."""
    import subprocess
    import sys

    store.dense("big", (1024, 1024), "float32", shard_rows=512)   # two 2 MiB shards
    store.dense("small", (64, 64), "float32")
    names = {os.path.basename(sh.seg.name): name for name in ("big", "small")
             for sh in store[name]._shards}
    check = (
        "import os, sys, shmps\n"
        "sys.path.insert(0, sys.argv[3])\n"
        "from test_attach import _mapping_of\n"
        "s = shmps.attach(sys.argv[1], create=False)\n"
        "for n in ('big', 'small'): s[n].pull()\n"
        "for n in sys.argv[2].split(','):\n"
        "    print(n, 'hg' in _mapping_of('/dev/shm/' + n).get('VmFlags', '?').split())\n"
        "s.close()\n")
    out = subprocess.run([sys.executable, "-c", check, store.name, ",".join(names),
                          os.path.dirname(__file__)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    other = dict(line.split() for line in out.stdout.splitlines())
    manifest = f"shmps.{store.name}.manifest"
    assert "hg" not in _mapping_of(f"/dev/shm/{manifest}").get("VmFlags", "hg").split()
    for seg, tensor in names.items():
        here = "hg" in _mapping_of(f"/dev/shm/{seg}").get("VmFlags", "").split()
        assert here == (tensor == "big") and other[seg] == str(tensor == "big"), (seg, here,
                                                                                 other)


def _push_pickled(store, tensor, n: int) -> list:
    """In a spawned process: the store and tensor it was given arrive attached."""
    try:
        for _ in range(n):
            tensor.push(np.ones(4, np.int32))
        return [store.name, store.namespace, [t["name"] for t in store.tensors()],
                int(tensor.pull().sum())]
    finally:
        store.close()


def test_store_and_tensor_pickle_as_their_names(store_name, monkeypatch):
    """A store or tensor passed to a spawned process (pickled) arrives attached to the
    same store, namespace included, even where the child's environment names another
    one (it raised "cannot pickle 'mmap.mmap' object"); one unpickled after the store
    is destroyed raises NotFound rather than create an empty store."""
    import multiprocessing as mp
    import pickle

    s = shmps.attach(store_name, namespace="hostP")
    try:
        w = s.dense("w", shape=(4,), dtype="int32")
        monkeypatch.setenv("SHMPS_NAMESPACE", "elsewhere")
        with mp.get_context("spawn").Pool(1) as pool:
            got = pool.apply(_push_pickled, (s, w, 5))
        assert got == [store_name, "hostP", ["w"], 20]
        np.testing.assert_array_equal(w.pull(), 5)
        monkeypatch.delenv("SHMPS_NAMESPACE")
        blob = pickle.dumps(w)
        again = pickle.loads(blob)
        assert again.name == "w" and again._store is not s
        np.testing.assert_array_equal(again.pull(), 5)
        again._store.close()
    finally:
        s.destroy()
    with pytest.raises(shmps.NotFound):
        pickle.loads(blob)
    assert store_segments(store_name) == []
    s.close()
    with pytest.raises(shmps.Closed):
        pickle.dumps(s)


def test_a_forked_child_counts_as_attached(store_name):
    """A child forked after attach maps the store and may push: it is listed among the
    attached processes while it lives, keeps the store from `shmps-tool gc` after the
    parent closed it (gc removed it under the child, whose later pushes were lost), and
    its close frees only its own entry; it is not the parent's clock worker."""
    import subprocess
    import sys

    ns = "fork" + store_name[-8:]
    s = shmps.attach(store_name, namespace=ns)
    w = s.dense("w", shape=(4,), dtype="int32")
    s.join()
    r, wr = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: report, wait for the parent's close, push, close
        try:
            os.close(r)
            os.close(go_w)
            listed = os.getpid() in s.processes()
            os.read(go_r, 1)
            w.push(np.ones(4, np.int32))
            worker = s._worker
            s.close()
            os.write(wr, f"{int(listed)} {worker}".encode())
        finally:
            os._exit(0)
    os.close(wr)
    os.close(go_r)
    try:
        time.sleep(0.3)
        assert sorted(s.processes()) == sorted([os.getpid(), pid])
        s.close()
        env = dict(os.environ, SHMPS_GC_MIN_AGE="0")
        gc = subprocess.run([sys.executable, "-m", "shmps.cli", "gc", "--namespace", ns],
                            env=env,
                            capture_output=True, text=True, timeout=60)
        assert store_name not in gc.stdout, gc.stdout   # the child still uses it
        os.write(go_w, b"1")
        listed, worker = os.read(r, 64).decode().split()
        os.waitpid(pid, 0)
        assert (listed, worker) == ("1", "None")
        with shmps.attach(store_name, create=False, namespace=ns) as again:
            np.testing.assert_array_equal(again["w"].pull(), 1)
            assert again.processes() == [os.getpid()]
    finally:
        os.close(r)
        os.close(go_w)
        remove_store(store_name, ns)


def test_a_store_is_never_unattached_between_a_fork_and_the_child_taking_its_slot(store_name):
    """The usual hand-over: the parent attaches, forks, and closes at once.  A gc that
    looks right after that close must still find the store attached (by the child, or
    by the slot the parent took for it before the fork), whenever the child's fork
    handler runs.  A child that registered only once forked lost its store this way
    428 of 429 times beside a gc loop (review 12, F6)."""
    from shmps.store import remove_idle

    ns = "fgap" + store_name[-8:]
    lost = 0
    try:
        for _ in range(20):
            s = shmps.attach(store_name, namespace=ns)
            r, wr = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(wr)
                    os.read(r, 1)   # until the parent has closed and gc has looked
                    named = s._manifest.is_named() and os.getpid() in s.processes()
                    s.close()
                finally:
                    os._exit(0 if named else 3)
            os.close(r)
            s.close()
            removed = remove_idle(store_name, ns)
            os.write(wr, b"1")
            os.close(wr)
            _, status = os.waitpid(pid, 0)
            lost += removed is not None or os.WEXITSTATUS(status) != 0
            remove_idle(store_name, ns)   # the child has closed: gone now
    finally:
        remove_store(store_name, ns)
    assert lost == 0, f"{lost} of 20 stores were removed under the child forked from them"


#: attaches, then forks 1100 times under RLIMIT_NPROC 0 (every fork fails); prints the
#: failures and this process's slots in the table, closes, and stays alive until stdin
_FAILING_FORKS = r"""
import os, resource, sys
import shmps
from shmps import _native
if os.geteuid() == 0:   # root's forks ignore RLIMIT_NPROC: become nobody (shmps imported)
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
s = shmps.attach(sys.argv[1])
s.dense("w", shape=(4,), dtype="int32", init=1)
lib, ffi = _native.lib, _native.ffi


def own_slots():
    n, toks = ffi.new("uint32_t *"), ffi.new("uint64_t[]", lib.SHMPS_MAX_PROCS)
    lib.shmps_proc_list(s._mptr, toks, lib.SHMPS_MAX_PROCS, n)
    return sum(int(toks[i]) == _native.token() for i in range(n[0]))


failed = 0
for i in range(1100):   # more than the table's 1024 slots
    try:
        pid = os.fork()
    except OSError:
        failed += 1
        continue
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    if i == 0:
        print("forks do not fail here", flush=True)
        s.close()
        sys.exit(0)
print("failed", failed, own_slots(), flush=True)
sys.stdin.readline()      # the test attaches meanwhile
s.close()
print("closed", flush=True)
sys.stdin.readline()      # alive while the test removes the store
"""


def test_closing_one_store_while_a_fork_is_pending_gives_back_another_stores_lease(
        store_name):
    """Two stores open; a child takes the first store's lease, stays in its fork
    handler while the parent closes that store, and is killed before it reaches the
    second store's.  The parent gives the second lease back (only its own slot stays):
    the child's bytes answer the leases by position, and the closed store's entry
    stays in place as "no lease".  (Removed from the list, the second lease was judged
    by the first's byte and kept until the parent exited: review 15 F5.)  The child's
    handler is slowed and killed through Store._forked, on the instances."""
    import signal

    import shmps.store as store_mod

    other = f"{store_name}b"
    a, b = shmps.attach(store_name), shmps.attach(other)
    try:
        # in the order the fork handler takes their leases (other tests' stores, closed
        # and not yet collected, may be in the set too)
        first, second = [st for st in list(store_mod._OPEN_STORES) if st is a or st is b]

        def mine(st) -> int:
            tab = st._manifest.array(np.uint64, 4096, 2 * 1024)
            return int((tab[0::2] == np.uint64(shmps._native.token())).sum())

        orig = store_mod.Store._forked

        def slow(lease):            # child: takes the first lease, then waits in there
            took = orig(first, lease)
            time.sleep(1.0)
            return took

        def die(lease):             # child: killed before it reaches the second lease
            os.kill(os.getpid(), signal.SIGKILL)

        first._forked, second._forked = slow, die
        try:
            pid = os.fork()
            if pid == 0:
                os._exit(0)         # (not reached: the handler kills the child)
        finally:
            del first._forked, second._forked
        first.close()               # the child still in its handler
        os.waitpid(pid, 0)
        for _ in range(2):          # later forks settle the pending one
            p = os.fork()
            if p == 0:
                os._exit(0)
            os.waitpid(p, 0)
        assert mine(second) == 1
    finally:
        for st in (a, b):
            (shmps.attach(st.name) if st._manifest is None else st).destroy()


def _end_child(p, store_name: str) -> None:
    """After a test with a child process: kill it if it still runs, reap it, and remove
    whatever is left of the store."""
    if p.poll() is None:
        p.kill()
    p.wait(timeout=30)
    remove_store(store_name)


def _closed_child_leaves_an_idle_store(p: Any, store_name: str) -> None:
    """The child ``p`` (a script that closes the store on a first line of stdin and
    exits on a second) closes the store while it lives on: then nothing of it holds a
    slot, gc's remove_idle removes both segments, and the child exits 0."""
    from shmps.store import remove_idle

    p.stdin.write("\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "closed"
    assert len(remove_idle(store_name, None) or []) == 2   # idle: nothing leaked
    assert store_segments(store_name) == []
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.wait(timeout=30) == 0


def test_a_fork_that_fails_gives_back_the_slot_taken_for_its_child(store_name):
    """os.fork() failing (RLIMIT_NPROC: EAGAIN) after the before-fork handler took a slot
    for the child: the parent gives the slot back, so 1100 failed forks leave it one slot
    (others still attach: the table holds 1024), and once it closes the store, it alive,
    gc's remove_idle removes the store.  (The slots stayed the parent's until it exited:
    1024 of them, the table full for everyone else, and gc kept the closed store.)"""
    import subprocess
    import sys

    env = child_env()
    p = subprocess.Popen([sys.executable, "-c", _FAILING_FORKS, store_name], env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline().split()
        if line == ["forks", "do", "not", "fail", "here"]:
            pytest.skip("fork() does not fail under RLIMIT_NPROC 0 here")
        assert line == ["failed", "1100", "1"], line
        with shmps.attach(store_name, create=False) as s:   # the table is not full
            s["w"].push(np.ones(4, np.int32))
            assert s.processes() == sorted([os.getpid(), p.pid])
        assert len(store_segments(store_name)) == 2
        _closed_child_leaves_an_idle_store(p, store_name)
    finally:
        _end_child(p, store_name)


def test_a_child_forked_while_another_thread_uses_the_store_does_not_hang(store):
    """Another thread of the parent inside a store call (holding the store's lock, or
    the split-push pool's) at the fork: the child, where that thread does not exist,
    still pushes (each child has 3 s, then SIGALRM).  With the inherited locks 15 of 20
    children hung on their first store call."""
    import signal
    import threading

    w = store.dense("w", shape=(64, 64), dtype="int32")
    stop = threading.Event()

    def reader() -> None:   # a data-loader or logging thread reading tensors
        while not stop.is_set():
            store["w"]
            w.describe()

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    statuses = []
    try:
        for _ in range(20):
            time.sleep(0.005)
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    signal.alarm(3)
                    store["w"].push(np.ones((64, 64), np.int32))
                    store.close()
                    code = 0
                finally:
                    os._exit(code)
            statuses.append(os.waitpid(pid, 0)[1])
    finally:
        stop.set()
        th.join(5)
    # (a hung child ends by its alarm: killed, or, under pytest-timeout's inherited
    # SIGALRM handler, an exception and status 1)
    failed = sum(st != 0 for st in statuses)
    assert failed == 0, f"{failed} of 20 forked children did not push (hung until their alarm)"
    assert (w.pull() == 20).all()


def test_a_destroy_killed_midway_is_finished_by_the_next_attach(store_name):
    """destroy() killed after it unlinked some shards (the crash point: os._exit in its
    unlink): the next attach finishes the removal and makes a new, empty store, where
    tensors of the old names can be created.  (The half-removed store stayed: attach
    gave it, its catalog listed all 40 tensors, and creating or opening one raised
    NotFound for its missing shard, for every process, until someone destroyed it.)"""
    from shmps import names

    with shmps.attach(store_name) as s:
        for i in range(40):
            s.dense(f"w{i}", shape=(4,), dtype="int32", init=i)
    # the destroyer: dies after its 10th unlink
    pid = fork_dying_at_unlink(10, lambda: shmps.attach(store_name).destroy())
    try:
        assert os.waitpid(pid, 0)[1] == 0
        left = store_segments(store_name)
        assert names.manifest_name(store_name, None)[1:] in left and len(left) == 31, left
        with shmps.attach(store_name, timeout=5) as s:
            assert s.tensors() == []
            w = s.dense("w7", shape=(4,), dtype="int32")
            assert (w.pull() == 0).all()
        assert len(store_segments(store_name)) == 2   # the new manifest and w7's shard
    finally:
        remove_store(store_name)


def test_destroy_waits_a_bounded_time_for_a_process_holding_the_removal(store_name,
                                                                        monkeypatch):
    """destroy() of a store whose removal a live process holds (a gc deciding about it)
    waits at most DESTROY_WAIT, then raises Timeout naming that process and saying what
    to do, the store left whole; once the process lets go, destroy() removes it."""
    monkeypatch.setattr(shmps.store, "DESTROY_WAIT", 0.3)
    s = shmps.attach(store_name)
    try:
        s.dense("w", shape=(4,), init=1.0)
        times_out_for_the_removal_holder(s, s.destroy, 0.3, "retry destroy() once it is done")
        assert len(store_segments(store_name)) == 2 and (s["w"].pull() == 1.0).all()
        s.destroy()
        assert store_segments(store_name) == []
    finally:
        s.close()
        remove_store(store_name)


def test_destroy_through_a_stale_handle_leaves_the_new_store_alone(store_name):
    """A process still attached to a store that another process destroyed, and that was
    made anew under the name since, calls destroy(): the new store and its tensor stay.
    (destroy() removed whatever the name held: the new, live store.)"""
    import subprocess
    import sys

    old = shmps.attach(store_name)
    try:
        r = subprocess.run([sys.executable, "-c", "import shmps, sys; "
                            "shmps.attach(sys.argv[1]).destroy()", store_name],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        with shmps.attach(store_name) as new:
            new.dense("w", shape=(4,), init=1.0)
            # nor does creating a tensor through it (its "debris" unlink of the name
            # t0.s0 took the new store's shard, and made an orphan of its own)
            with pytest.raises(shmps.Closed, match="destroyed or replaced"):
                old.dense("v", shape=(4,), init=5.0)
            old.destroy()
            assert len(store_segments(store_name)) == 2
            with shmps.attach(store_name, create=False) as again:
                assert (again["w"].pull() == 1.0).all()
    finally:
        old.close()
        remove_store(store_name)


def test_a_destroy_interrupted_in_a_live_process_is_finished_by_the_next_attach(
        store_name, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) reaches destroy() after its 10th unlink, and the
    process lives on (a notebook): another process's attach finishes the removal and
    makes a new, empty store at once.  (The removal stayed claimed by the live process:
    every attach waited and raised Timeout, and gc reported the store busy, until that
    process exited.)"""
    import subprocess
    import sys
    import shmps.store as st

    with shmps.attach(store_name) as s:
        for i in range(20):
            s.dense(f"w{i}", shape=(4,), dtype="int32", init=i)
    real, count = st.unlink, [0]

    def interrupted_unlink(name: str) -> bool:
        count[0] += 1
        if count[0] > 10:
            raise KeyboardInterrupt
        return real(name)

    s = shmps.attach(store_name)
    monkeypatch.setattr(st, "unlink", interrupted_unlink)
    try:
        with pytest.raises(KeyboardInterrupt):
            s.destroy()
        monkeypatch.setattr(st, "unlink", real)
        with pytest.raises(shmps.Closed):
            s.tensors()
        r = subprocess.run([sys.executable, "-c", "import shmps, sys\n"
                            "with shmps.attach(sys.argv[1], timeout=3) as s:\n"
                            "    print(len(s.tensors()))", store_name],
                           capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout.strip()) == (0, "0"), r.stderr[-400:]
        assert len(store_segments(store_name)) == 1   # the new store's manifest
    finally:
        monkeypatch.setattr(st, "unlink", real)
        remove_store(store_name)


def test_destroy_through_a_closed_handle_removes_only_its_own_store(store_name):
    """destroy() after close(): the store under the name goes if it is still the one
    the handle had; if another process destroyed it and made a new one since, the new
    one stays.  (A closed handle's destroy() unlinked whatever the name held.)"""
    import subprocess
    import sys

    s = shmps.attach(store_name)
    s.dense("w", shape=(4,), init=1.0)
    s.close()
    try:
        r = subprocess.run([sys.executable, "-c", "import shmps, sys\n"
                            "shmps.attach(sys.argv[1]).destroy()\n"
                            "shmps.attach(sys.argv[1]).dense('v', shape=(2,), init=2.0)",
                            store_name], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        s.destroy()
        with shmps.attach(store_name, create=False) as again:
            assert (again["v"].pull() == 2.0).all()
            again.close()
            again.destroy()            # closed, and still its store: removed
        assert store_segments(store_name) == []
        s.destroy()                    # nothing under the name: nothing to do
    finally:
        remove_store(store_name)


def test_a_gc_that_opened_a_store_before_it_was_remade_leaves_the_new_one_alone(
        store_name, monkeypatch):
    """gc (remove_idle) opens an idle store's manifest, then another process removes
    that store and makes a new one under the name before gc goes on: gc's claim is of
    the old manifest, and it removes nothing.  (It unlinked by name: the new, live
    store.)"""
    import subprocess
    import sys
    import shmps.store as st

    with shmps.attach(store_name) as s:
        s.dense("old", shape=(4,))
    real = st.Segment.open
    remake = ("import shmps, sys\nshmps.attach(sys.argv[1]).destroy()\n"
              "shmps.attach(sys.argv[1]).dense('new', shape=(4,), init=2.0)")

    def open_then_remade(name: str, *a, **k):
        seg = real(name, *a, **k)
        r = subprocess.run([sys.executable, "-c", remake, store_name],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return seg

    monkeypatch.setattr(st.Segment, "open", open_then_remade)
    try:
        assert st.remove_idle(store_name, None) == []
        monkeypatch.undo()
        with shmps.attach(store_name, create=False) as again:
            assert (again["new"].pull() == 2.0).all()
    finally:
        monkeypatch.undo()
        remove_store(store_name)


def test_gc_keeps_a_store_whose_manifest_is_being_made(store_name):
    """A manifest of size 0 (a new store's, made since gc's scan, not yet sized): gc's
    remove_idle keeps it (None) rather than failing on it."""
    from shmps.store import remove_idle
    from shmps import names

    path = "/dev/shm" + names.manifest_name(store_name, None)
    open(path, "wb").close()
    try:
        assert remove_idle(store_name, None) is None
        assert os.path.exists(path)
    finally:
        os.unlink(path)


def test_attach_without_create_waits_for_a_manifest_being_made(store_name):
    """A manifest of size 0 is a store being created (its creator between shm_open and
    ftruncate) or one whose creator died there.  attach(create=False) waits for it, at
    most its timeout, and gets the store once made; if it stays unmade, NotFound saying
    so and what to do.  (It raised CorruptSegment at once, "has size 0".)"""
    import threading

    from shmps import names

    path = "/dev/shm" + names.manifest_name(store_name, None)
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    made: list = []
    try:
        t0 = time.monotonic()
        with pytest.raises(shmps.NotFound, match="being created, or its creator died") as e:
            shmps.attach(store_name, create=False, timeout=0.3)
        assert 0.3 <= time.monotonic() - t0 < 2.0
        assert "shmps-tool gc" in e.value.hint
        assert os.path.getsize(path) == 0   # not made by an attach that may not create
        maker = threading.Timer(0.2, lambda: made.append(shmps.attach(store_name)))
        maker.start()
        with shmps.attach(store_name, create=False, timeout=10) as s:
            assert s.tensors() == []
        maker.join()
    finally:
        for s in made:
            s.close()
        remove_store(store_name)


def test_a_gc_killed_removing_a_store_being_created_is_finished_by_the_next_attach(
        store_name):
    """gc's removal of a store whose creator died before sizing its manifest: it sizes
    the manifest and marks it removed under its claim of the initialisation
    (shmps_manifest_remove_unborn), then unlinks it.  Killed in between, the next attach
    finishes the removal as a dead remover's: NotFound without create, else a new
    store."""
    from shmps import names
    from shmps._native import lib
    from shmps.segment import Segment

    mname = names.manifest_name(store_name, None)

    def gc_killed_after_its_mark() -> None:
        os.close(os.open("/dev/shm" + mname, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                seg = Segment.open(mname, expect_size=shmps.store.MANIFEST_SIZE,
                                   size_if_empty=True)
                code = 3 if lib.shmps_manifest_remove_unborn(seg.ptr,
                                                             shmps._native.token()) else 0
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0

    try:
        gc_killed_after_its_mark()
        seg = Segment.open(mname)
        try:   # removed: not a second time, nor initialised by a new claim
            assert lib.shmps_manifest_remove_unborn(seg.ptr, shmps._native.token()) == \
                lib.SHMPS_E_BUSY
        finally:
            seg.close()
        with pytest.raises(shmps.NotFound, match="no store"):
            shmps.attach(store_name, create=False)
        assert not os.path.exists("/dev/shm" + mname)
        gc_killed_after_its_mark()
        with shmps.attach(store_name, timeout=5) as s:
            s.dense("w", shape=(2,), init=1.0)
            assert (s["w"].pull() == 1.0).all()
    finally:
        remove_store(store_name)


def test_a_process_of_another_pid_namespace_is_refused(store_name):
    """A process sharing /dev/shm but not the PID namespace (a container of the same
    pod) cannot attach, either way round: tokens are pids of one namespace, so each side
    took the other's live locks and freezes for a dead process's and took them over
    (lost updates, torn consistent pulls; review 13)."""
    import subprocess
    import sys

    cmd = unshare_pid_command()
    code = ("import shmps, sys\n"
            "try:\n"
            "    shmps.attach(sys.argv[1], create=sys.argv[2] == 'make').close()\n"
            "    print('attached')\n"
            "except shmps.InvalidArgument as e:\n"
            "    print('refused', e)\n")
    try:
        with shmps.attach(store_name) as s:
            s.dense("w", shape=(4,))
            r = subprocess.run(cmd + [sys.executable, "-c", code, store_name, "open"],
                               capture_output=True, text=True, timeout=60)
            # (the attach of a ready store of another namespace: refused by its claim)
            assert re.fullmatch("refused " + other_pid_ns_message(f"store {store_name!r}",
                                                                  "attach") + "\n",
                                r.stdout), (r.stdout, r.stderr[-300:])
            assert s.processes() == [os.getpid()]
        remove_store(store_name)
        r = subprocess.run(cmd + [sys.executable, "-c", code, store_name, "make"],
                           capture_output=True, text=True, timeout=60)
        assert r.stdout.startswith("attached"), (r.stdout, r.stderr[-300:])
        with pytest.raises(shmps.InvalidArgument,
                           match=other_pid_ns_message(f"store {store_name!r}", "attach")):
            shmps.attach(store_name, create=False)
    finally:
        remove_store(store_name)


def test_a_gc_killed_while_deciding_does_not_get_a_live_store_removed(store_name):
    """A gc that died after it marked a store "retiring" and before its look at the
    attached processes (the crash state written into the manifest, as that gc left it):
    the next attach decides again, finds this live process attached and keeps the store,
    its tensor intact.  (The takeover finished the removal unconditionally: the live
    process's store was unlinked under it.)"""
    from shmps._native import lib
    from helpers import dead_token

    s = shmps.attach(store_name)
    try:
        s.dense("w", shape=(4,), init=3.0)
        m = s._manifest.array(np.uint64, 0, 51)   # the header's words
        st = s._manifest.array(np.uint32, 32, 1)
        m[400 // 8] = dead_token()                # retired_by: a dead gc
        st[0] = 4                                 # STATE_RETIRING
        with shmps.attach(store_name, timeout=5) as again:
            assert (again["w"].pull() == 3.0).all()
        assert lib.shmps_manifest_usable(s._mptr, 0) and st[0] == 1   # READY again
    finally:
        s.close()
        remove_store(store_name)


def test_attach_finishes_the_removal_of_a_dead_gc(store_name):
    """A `shmps-tool gc` killed after it retired an idle store (state "being removed")
    and before it unlinked the manifest: the next attach sees the remover dead, finishes
    the removal (attach(create=False) then finds no store: NotFound) and attach makes a
    new, empty store."""
    from shmps._native import lib

    with shmps.attach(store_name) as s:
        s.dense("w", shape=(4,), init=3.0)
    pid = os.fork()
    if pid == 0:   # the "gc": retire the idle store and die
        code = 1
        try:
            from shmps.segment import Segment
            from shmps import names
            seg = Segment.open(names.manifest_name(store_name, None))
            code = 0 if lib.shmps_manifest_retire(seg.ptr, shmps._native.token()) == 0 else 3
        finally:
            os._exit(code)
    try:
        assert os.waitpid(pid, 0)[1] == 0
        with pytest.raises(shmps.NotFound, match="no store"):
            shmps.attach(store_name, create=False)
        t0 = time.monotonic()
        with shmps.attach(store_name) as s:
            assert s.tensors() == []
        assert time.monotonic() - t0 < 1.0
    finally:
        remove_store(store_name)


def test_attach_does_not_take_over_a_store_being_restored_in_another_pid_namespace(
        store_name):
    """A store of another PID namespace being restored there by a live process (state
    RESTORING, claimed by that process's token): an attach here refuses it
    (InvalidArgument) and leaves it whole, and the restore there ends as it would have.
    The restorer's pid means nothing in this namespace and looks dead, so the takeover of
    a dead remover's store (retire, then unlink) removed the live restore's store; Store()
    refuses only a ready one, and the takeover ran before it."""
    import subprocess
    import sys

    cmd = unshare_pid_command()
    code = ("import shmps, sys\n"
            "from shmps import _native\n"
            "lib = _native.lib\n"
            "s = shmps.attach(sys.argv[1])\n"
            "s.dense('w', shape=(4,), dtype='int32', init=3)\n"
            "assert lib.shmps_manifest_restore_begin(s._mptr, _native.token()) == 0\n"
            "print('restoring', flush=True)\n"
            "sys.stdin.readline()\n"
            "s.dense('v', shape=(2,), dtype='int32', init=5)   # the restore goes on\n"
            "assert lib.shmps_manifest_restore_end(s._mptr, _native.token()) == 0\n"
            "print(s['w'].pull().tolist(), s['v'].pull().tolist(), flush=True)\n"
            "s.close()\n")
    env = child_env()
    p = subprocess.Popen(cmd + [sys.executable, "-c", code, store_name], env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "restoring"
        before = store_segments(store_name)
        assert len(before) == 2, before
        t0 = time.monotonic()
        # (attach's wait for the removal or restore: refused before it)
        with pytest.raises(shmps.InvalidArgument,
                           match=other_pid_ns_message(f"store {store_name!r}", "attach")):
            shmps.attach(store_name, timeout=5)
        assert time.monotonic() - t0 < 2.0   # refused at once, not after the timeout
        assert store_segments(store_name) == before
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().split() == ["[3,", "3,", "3,", "3]", "[5,", "5]"]
        assert p.wait(timeout=30) == 0
    finally:
        _end_child(p, store_name)


#: a store user whose children are SIGKILLed before the store's fork handler runs: a
#: fork hook registered before shmps is imported runs first in the child, and kills it
#: when KILL is set (phase 1); then children the parent kills at once, wherever they
#: are (phase 2).  Pushes between the forks; prints its slots in the attached-process
#: table after each phase, closes when told, stays alive until told again.
_KILLED_CHILDREN = r"""
import os, signal, sys, time
KILL = False
def _die_first():
    if KILL:
        os.kill(os.getpid(), signal.SIGKILL)
os.register_at_fork(after_in_child=_die_first)    # before shmps's handler: runs first
import numpy as np
import shmps
from shmps import _native
lib, ffi = _native.lib, _native.ffi
s = shmps.attach(sys.argv[1], create=False)
w = s["w"]


def own_slots():
    n, toks = ffi.new("uint32_t *"), ffi.new("uint64_t[]", lib.SHMPS_MAX_PROCS)
    lib.shmps_proc_list(s._mptr, toks, lib.SHMPS_MAX_PROCS, n)
    return sum(int(toks[i]) == _native.token() for i in range(n[0]))


def reap(pid):
    _, st = os.waitpid(pid, 0)
    return os.WIFSIGNALED(st) and os.WTERMSIG(st) == signal.SIGKILL


killed = 0
for _ in range(20):
    KILL = True
    pid = os.fork()
    KILL = False
    if pid == 0:
        os._exit(3)      # (not reached: the hook killed the child)
    killed += reap(pid)
    w.push(np.ones(4, np.int32))
    w.pull()
print("before-handler", killed, own_slots(), flush=True)
killed = 0
for _ in range(20):
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(3)
    os.kill(pid, signal.SIGKILL)
    killed += reap(pid)
    w.push(np.ones(4, np.int32))
print("killed-at-once", killed, own_slots(), flush=True)
sys.stdin.readline()      # the test attaches, pushes and looks meanwhile
s.close()
print("closed", flush=True)
sys.stdin.readline()      # alive while the test removes the store
"""


def test_children_killed_before_their_fork_handler_leak_no_slot(store_name):
    """A process with the store open forks 20 children that die (SIGKILL) before the
    store's fork handler runs in them, then 20 that it kills at once (before, inside or
    after the handler): it goes on pushing; it holds at most its own slot and the lease
    of its last fork, still pending (given back at its next fork or its close); another
    process attaches, pushes and sees exactly the two live processes (ls too); once it
    closes, alive, gc's remove_idle removes the store: no lease of a dead child is left
    counted as its."""
    import subprocess
    import sys

    with shmps.attach(store_name) as s:
        s.dense("w", shape=(4,), dtype="int32")
    p = subprocess.Popen([sys.executable, "-c", _KILLED_CHILDREN, store_name],
                         env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        for phase in ("before-handler", "killed-at-once"):
            what, killed, slots = p.stdout.readline().split()
            assert (what, killed) == (phase, "20") and slots in ("1", "2"), (what, slots)
        with shmps.attach(store_name, create=False) as s:
            s["w"].push(np.ones(4, np.int32))
            assert (s["w"].pull() == 41).all()
            assert s.processes() == sorted([os.getpid(), p.pid])
            ls = subprocess.run([sys.executable, "-m", "shmps.cli", "ls"], env=child_env(),
                                capture_output=True, text=True, timeout=60)
            line = next(x for x in ls.stdout.splitlines() if x.startswith(store_name))
            pids = line.split("live processes:")[1].replace(",", " ").split()
            assert sorted(map(int, pids)) == sorted([os.getpid(), p.pid]), line
        _closed_child_leaves_an_idle_store(p, store_name)
    finally:
        _end_child(p, store_name)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (the Hit)
def test_a_signal_raising_inside_the_fork_handler_leaves_no_fork_lock_held(store):
    """A signal handler that raises (Ctrl-C, a SIGTERM handler's SystemExit) at the
    instant the fork handler has taken the fork lock (_FORK_SERIAL) from another thread:
    CPython prints the exception and forks on.  The lock must not stay held: it did
    (30 of 30 here, review 16 F1), and every later fork of any thread waited 10 s for it
    and took no lease."""
    import signal
    import threading

    import shmps.store as store_mod

    store.dense("w", shape=(4,), dtype="int32")

    class Hit(Exception):
        pass

    def raise_hit(signum: int, frame: object) -> None:
        raise Hit()

    def free_for_another_thread() -> bool:
        got: list = []
        th = threading.Thread(target=lambda: got.append(
            store_mod._FORK_SERIAL.acquire(timeout=0) and store_mod._FORK_SERIAL.release()
            is None))
        th.start()
        th.join(10)
        return got == [True]

    pid_r, pid_w = os.pipe()
    old = signal.signal(signal.SIGUSR1, raise_hit)
    held = 0
    try:
        for _ in range(10):
            holding = threading.Event()

            def other() -> None:
                if store_mod._FORK_SERIAL.acquire(timeout=10):   # another thread's fork ...
                    holding.set()
                    time.sleep(0.02)
                    store_mod._FORK_SERIAL.release()   # ... ends, and a signal comes at once
                    os.kill(os.getpid(), signal.SIGUSR1)

            lock_holder = threading.Thread(target=other)
            lock_holder.start()
            if not holding.wait(10):
                held += 1                             # (left held by an earlier round)
                lock_holder.join(10)
                continue
            try:
                if os.fork() == 0:
                    os.write(pid_w, b"x")
                    os._exit(0)
            except Hit:       # (the signal came after the handlers: the fork happened)
                pass
            lock_holder.join(10)
            time.sleep(0.01)
            held += not free_for_another_thread()
            if held:      # (left held, every later round would wait its 10 s for it)
                break
    finally:
        signal.signal(signal.SIGUSR1, old)
        os.close(pid_w)
        children = 0
        while os.read(pid_r, 1):
            children += 1
        os.close(pid_r)
        for _ in range(children):
            os.wait()
    assert held == 0, "the fork lock stayed held after a fork"
    assert children == 10
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert time.monotonic() - t0 < 5, "a later fork waited for the fork lock"


def test_a_fork_inside_a_fork_hook_does_not_wait_for_the_fork_lock(tmp_path):
    """A library whose after-fork hook, registered before shmps was imported, forks:
    that nested fork runs while the outer fork holds the fork lock, on the same thread.
    It must not wait for it (it waited the full 10 s: review 16), and both forks settle."""
    # (the standard library's own fork hooks that take plain locks are registered first,
    # as the library's would be: a fork nested in a hook registered before theirs
    # deadlocks in them, whatever shmps does)
    code = textwrap.dedent("""
        import os, sys, time, logging, concurrent.futures.thread
        state = {}
        def nested():
            if "t" not in state:
                state["t"] = None
                t0 = time.monotonic()
                pid = os.fork()
                if pid == 0:
                    os._exit(0)
                os.waitpid(pid, 0)
                state["t"] = time.monotonic() - t0
        os.register_at_fork(after_in_parent=nested)   # before shmps's handlers
        import shmps, shmps.store as sm
        s = shmps.attach(sys.argv[1], namespace=sys.argv[2])
        s.dense("w", shape=(4,))
        try:
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
            with sm._FORKS_LOCK:
                sm._settle_forks_locked()
            print(f"{state['t']:.3f} {len(sm._PENDING_FORKS)}")
        finally:
            s.destroy()
    """)
    name, ns = f"nest{os.getpid()}", "nestns"
    try:
        r = subprocess.run([sys.executable, "-c", code, name, ns], capture_output=True,
                           text=True, timeout=60, env=child_env())
    finally:   # (a child killed by the timeout leaves its store)
        try:
            shmps.attach(name, namespace=ns, create=False).destroy()
        except shmps.NotFound:
            pass
    assert r.returncode == 0, r.stderr
    took, pending = r.stdout.split()
    assert float(took) < 5 and pending == "0", r.stdout


def test_two_threads_forking_at_once_leave_no_fork_pending(store):
    """Two threads fork 40 children each at once, the store open; every child lives on
    (until the test lets it go) once its fork handler has run.  Every fork's pipe then
    reads end of file and settles: no child holds another fork's write end.  (A thread
    whose os.pipe2 released the GIL came back to it after the other thread had forked:
    that child inherited the pipe unknown to its handler, and the fork stayed pending
    while the child lived, its lease not given back had its own child died: review 15
    F6; 26 to 51 of 100 forks here.)"""
    import select
    import threading

    import shmps.store as store_mod

    store.dense("w", shape=(4,), dtype="int32")
    go_r, go_w = os.pipe()
    ready_r, ready_w = os.pipe()
    pids: list[int] = []

    def forker() -> None:
        for _ in range(40):
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(go_w)
                    os.write(ready_w, b"r")            # its handler has run
                    select.select([go_r], [], [], 60)  # alive until the test lets go
                finally:
                    os._exit(0)
            pids.append(pid)

    try:
        threads = [threading.Thread(target=forker) for _ in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        got = 0
        while got < len(pids) and select.select([ready_r], [], [], 30)[0]:
            got += len(os.read(ready_r, 4096))
        assert got == len(pids) == 80
        with store_mod._FORKS_LOCK:
            store_mod._settle_forks_locked()
            stuck = len(store_mod._PENDING_FORKS)
        assert stuck == 0, f"{stuck} of 80 forks pending while their children have all run"
    finally:
        for fd in (go_w, go_r, ready_r, ready_w):
            os.close(fd)
        for pid in pids:
            os.waitpid(pid, 0)
        with store_mod._FORKS_LOCK:
            store_mod._settle_forks_locked()


@pytest.mark.timeout(60)
def test_threads_reading_the_catalog_at_once_see_each_tensor_once(store_name):
    """Threads of one process that look at the catalog at the same time (``name in
    store``, ``len``, ``tensors()``, each reading the records added since the last
    look) each see every tensor once, and the next tensor this handle creates gets the
    next id.  Before, each thread read from the same last position and appended the
    same records: tensors() listed them twice, len() counted them twice, and the next
    id (the list's length) skipped (review H10 of 2026-11-28)."""
    import threading

    maker = shmps.attach(store_name)
    looker = shmps.attach(store_name)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # (thread switches inside the record loop)
    try:
        for rnd in range(5):
            for i in range(40):
                maker.dense(f"r{rnd}t{i}", shape=(1,), shard_rows=1)
            go = threading.Barrier(8)

            def look() -> None:
                go.wait()
                len(looker)
            threads = [threading.Thread(target=look) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            names = [d["name"] for d in looker.tensors()]
            assert len(names) == len(set(names)) == 40 * (rnd + 1) == len(looker), \
                (rnd, len(names), len(set(names)), len(looker))
        sys.setswitchinterval(old)
        looker.dense("last", shape=(1,))
        assert [d["name"] for d in maker.tensors()][-1] == "last"
        np.testing.assert_array_equal(maker["last"].pull(), 0.0)
    finally:
        sys.setswitchinterval(old)
        looker.close()
        maker.destroy()


@pytest.mark.timeout(120)
def test_a_fork_while_another_thread_attaches_takes_its_leases(store_name):
    """One thread forks while another attaches and closes handles of the store: every
    fork's before-fork handler lists the open stores and takes their leases without
    an error.  Before, it iterated the WeakSet of open stores while the other thread's
    attach added to it: RuntimeError (Set changed size during iteration), printed by
    CPython as "Exception ignored in" the fork hook, and that fork took no lease for
    any store (its child registered anew: the gap the leases close) (review H11 of
    2026-11-28)."""
    import threading

    held = [shmps.attach(store_name) for _ in range(50)]   # (a long list to iterate)
    ignored: list = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = lambda u: ignored.append(f"{u.exc_type.__name__}: {u.exc_value}")
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # (thread switches inside the handler's iteration)
    done = threading.Event()
    errors: list[BaseException] = []

    def attacher() -> None:
        try:
            while not done.is_set():
                shmps.attach(store_name).close()
        except BaseException as exc:   # (the test's failure, shown below)
            errors.append(exc)

    th = threading.Thread(target=attacher)
    th.start()
    try:
        for _ in range(150):
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
            if ignored:
                break
    finally:
        done.set()
        th.join(60)
        sys.setswitchinterval(old)
        sys.unraisablehook = old_hook
        for s in held[1:]:
            s.close()
        held[0].destroy()
    assert not errors, errors
    assert not ignored, ignored


def test_a_store_name_with_a_dot_does_not_alias_a_store_of_a_namespace(store_name):
    """Store "hostA.NAME" of no namespace and store NAME of namespace "hostA" would be
    the same segments (/shmps.hostA.NAME.*): whichever attaches second is refused with
    an InvalidArgument naming the store that holds them, and creates nothing, both ways
    round; the first store is unchanged.  Before, the second attach opened the first
    store as its own: its tensors and values, across the namespace boundary."""
    for first, second in [((f"hostA.{store_name}", ""), (store_name, "hostA")),
                          ((store_name, "hostA"), (f"hostA.{store_name}", ""))]:
        s = shmps.attach(first[0], namespace=first[1])
        try:
            s.dense("w", shape=(2,)).push(np.ones(2))
            with pytest.raises(shmps.InvalidArgument, match="segments .* hold store") as info:
                shmps.attach(second[0], namespace=second[1])
            assert "another store name or namespace" in info.value.hint
            with pytest.raises(shmps.InvalidArgument, match="segments .* hold store"):
                shmps.attach(second[0], namespace=second[1], create=False)
            assert s.tensors()[0]["name"] == "w" and s["w"].pull().tolist() == [1.0, 1.0]
            assert len(s.processes()) == 1   # the refused attach left no process behind
        finally:
            s.destroy()


@pytest.mark.timeout(60)
def test_a_full_attached_process_table_says_how_to_free_a_slot(store_name):
    """Every attach() handle takes a slot of the store's attached-process table
    (SHMPS_MAX_PROCS), also in one process.  A full table is a CapacityError whose hint
    says so (close() unused handles); it said "create the table with a larger capacity,
    or evict cold rows with table.evict()", which are a hash table's remedies."""
    from shmps._native import lib

    handles = [shmps.attach(store_name)]
    try:
        with pytest.raises(shmps.CapacityError) as info:
            for _ in range(lib.SHMPS_MAX_PROCS):
                handles.append(shmps.attach(store_name))
        assert len(handles) == lib.SHMPS_MAX_PROCS
        assert "evict" not in info.value.hint and "close()" in info.value.hint
        assert str(lib.SHMPS_MAX_PROCS) in str(info.value)
    finally:
        for h in handles[1:]:
            h.close()
        handles[0].destroy()
