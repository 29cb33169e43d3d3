"""A restore is invisible until complete: other processes' attach waits for it, and a
restore killed midway leaves no half-restored store (the next attach, or gc, removes
it).  Real processes: the restorer is a forked child, killed at a chosen tensor by an
``os._exit`` in its catalog append (the crash point)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import shmps
from helpers import fork_dying_at_unlink, remove_store, store_segments

pytestmark = pytest.mark.timeout(120)

NTENSORS = 6


@pytest.fixture
def checkpoint(tmp_path, store_name):
    """A checkpoint of 6 tensors (t<i> all i+1), taken from a store destroyed after."""
    src = store_name + "src"
    with shmps.attach(src) as s:
        for i in range(NTENSORS):
            s.dense(f"t{i}", shape=(256, 64), init=float(i + 1))
        s.checkpoint(tmp_path / "ck")
        s.destroy()
    yield tmp_path / "ck"
    remove_store(src)


def restore_in_child(path, name: str, *, die_after: int = -1, pause_after: int = -1,
                     pause: float = 0.0) -> int:
    """Fork a child that restores ``path`` as ``name``; it dies (os._exit) once
    ``die_after`` tensors are in the catalog, or sleeps ``pause`` s after
    ``pause_after`` of them.  Returns its pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import shmps.store as st
            real, n = st.Store._append, [0]

            def append(self, rec: dict) -> dict:
                out = real(self, rec)
                n[0] += 1
                if n[0] == die_after:
                    os._exit(0)
                if n[0] == pause_after:
                    time.sleep(pause)
                return out

            st.Store._append = append
            shmps.restore(path, name).close()
            code = 0
        finally:
            os._exit(code)
    return pid


def test_a_restore_killed_midway_leaves_no_half_restored_store(checkpoint, store_name):
    """The restorer dies with 3 of 6 tensors restored: the next attach finds no partial
    store (it removes it and makes a new, empty one), so a worker's get-or-create never
    trains a mix of restored and freshly initialised tensors; restoring again works.
    (Before: the store had t0-t2 at their checkpointed values, and get-or-create made
    t3-t5 at their init values without a word.)"""
    try:
        pid = restore_in_child(checkpoint, store_name, die_after=3)
        assert os.waitpid(pid, 0)[1] == 0
        assert len(store_segments(store_name)) == 1 + 3   # the manifest, 3 tensors
        with shmps.attach(store_name, timeout=5) as s:
            assert s.tensors() == []
            s.destroy()
        r = shmps.restore(checkpoint, store_name)
        try:
            assert [float(r[f"t{i}"].pull()[0, 0]) for i in range(NTENSORS)] == \
                [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        finally:
            r.close()
    finally:
        remove_store(store_name)


def test_gc_removes_a_restore_killed_midway(checkpoint, store_name):
    """Nobody attaches after the kill: `shmps-tool gc` removes the partial store."""
    try:
        pid = restore_in_child(checkpoint, store_name, die_after=2)
        assert os.waitpid(pid, 0)[1] == 0
        env = dict(os.environ, SHMPS_GC_MIN_AGE="0")
        env.pop("SHMPS_NAMESPACE", None)
        gc = subprocess.run([sys.executable, "-m", "shmps.cli", "gc"], env=env,
                            capture_output=True, text=True, timeout=60)
        assert gc.returncode == 0, gc.stderr
        assert store_segments(store_name) == [], gc.stdout
    finally:
        remove_store(store_name)


def test_an_attach_during_a_restore_waits_for_all_of_it(checkpoint, store_name):
    """A process attaching while a restore runs (paused 1.5 s after 2 of 6 tensors)
    waits and then sees every tensor at its checkpointed value; one with a short
    timeout gets Timeout naming the restorer's pid, and changes nothing."""
    try:
        pid = restore_in_child(checkpoint, store_name, pause_after=2, pause=1.5)
        deadline = time.monotonic() + 10
        while len(store_segments(store_name)) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)   # the restore is under way
        with pytest.raises(shmps.Timeout, match=f"process {pid} .*restoring"):
            shmps.attach(store_name, timeout=0.2)
        with shmps.attach(store_name, timeout=10) as s:
            got = [float(s[f"t{i}"].pull()[0, 0]) for i in range(NTENSORS)]
        assert got == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        remove_store(store_name)


def test_a_forced_restore_never_frees_the_name(checkpoint, store_name):
    """restore --force over a store with tensors: from the start of the restore to its
    end the store's manifest name always exists (the new store is renamed over the
    old one, born "being restored"), so a waiting attacher never makes an empty store
    of its own in between and watches the restored tensors appear (the old store was
    destroyed and the new one attached as ready: 79 partial views in 120 s of stress);
    an attach waits and sees all 6 restored tensors, none of the old store's."""
    from shmps import names

    mpath = "/dev/shm" + names.manifest_name(store_name, None)
    with shmps.attach(store_name) as s:
        s.dense("old", shape=(4,), init=9.0)
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                shmps.restore(checkpoint, store_name, force=True).close()
                code = 0
            finally:
                os._exit(code)
        gone = 0
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            gone += not os.path.exists(mpath)
        with shmps.attach(store_name, timeout=10) as s:
            names_ = sorted(t["name"] for t in s.tensors())
        assert gone == 0, f"the store's name was free at {gone} looks during the restore"
        assert names_ == [f"t{i}" for i in range(NTENSORS)]
    finally:
        remove_store(store_name)


def test_a_refused_restore_leaves_the_store_usable(checkpoint, store_name):
    """A restore refused because the store has tensors (no force) gives the store back
    as it was: attachable at once, its tensor unchanged."""
    with shmps.attach(store_name) as s:
        s.dense("w", shape=(4,), init=7.0)
        with pytest.raises(shmps.InvalidArgument, match="refusing to replace"):
            shmps.restore(checkpoint, store_name)
        with shmps.attach(store_name, timeout=0.5) as again:
            assert again.tensors()[0]["name"] == "w"
            assert (again["w"].pull() == 7.0).all()
        s.destroy()


WRITER = """
import sys, time, shmps
a = shmps.attach(sys.argv[1], create=False)
b = shmps.attach(sys.argv[2], create=False)
end = time.monotonic() + float(sys.argv[4])
while time.monotonic() < end:
    a.checkpoint(sys.argv[3])
    b.checkpoint(sys.argv[3])
a.close()
b.close()
"""


def test_a_restore_racing_a_checkpoint_to_the_same_path_is_never_mixed(tmp_path, store_name):
    """One process checkpoints store A (every value 1) and store B (every value 2) to
    the same PATH in turn for 4 s; restores from PATH meanwhile each give A or B whole,
    never some tensors (or a tensor's first and last rows) of each.  (Restore looked PATH
    up by name file by file: 60 of 116 restores were a mix.)  A restore may be refused
    (a file of its checkpoint deleted before it was opened), as a shmps error."""
    ck = tmp_path / "latest"
    src = [store_name + "a", store_name + "b"]
    for name, v in zip(src, (1.0, 2.0)):
        with shmps.attach(name) as s:
            for i in range(4):
                s.dense(f"w{i}", shape=(1024, 1024), init=v)   # 4 MiB each
    with shmps.attach(src[0]) as s:
        s.checkpoint(ck)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, *src, str(ck), "4"])
    restored, refused, mixed = 0, 0, []
    try:
        end = time.monotonic() + 3.5
        while time.monotonic() < end:
            try:
                r = shmps.restore(ck, store_name, force=True)
            except shmps.Error:
                refused += 1
                continue
            try:
                seen = {float(r[f"w{i}"].view()[k, k]) for i in range(4) for k in (0, -1)}
            finally:
                r.destroy()
            restored += 1
            if len(seen) != 1:
                mixed.append(sorted(seen))
        assert writer.wait(30) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
        for name in src + [store_name]:
            remove_store(name)
    assert not mixed, f"{len(mixed)} of {restored} restores mixed two checkpoints: {mixed[:3]}"
    assert restored >= 5, (restored, refused)


def test_a_forced_restore_killed_while_replacing_never_publishes_the_old_store_half_gone(
        checkpoint, store_name):
    """restore --force dies after it unlinked 10 of the old store's 40 shards, while
    another process (this one) is still attached to the old store: the next attach
    finishes the removal and makes a new, empty store.  (The old manifest was still
    RESTORING under the dead restorer: the next attach decided as for an idle store,
    found this process attached and put it back READY, its catalog naming tensors
    whose shards were gone: NotFound for every process.)"""
    old = shmps.attach(store_name)
    try:
        old.dense("w", shape=(40, 4), shard_rows=1, init=3.0)
        # the restorer: dies at its 11th unlink of an old shard
        pid = fork_dying_at_unlink(
            10, lambda: shmps.restore(checkpoint, store_name, force=True).close(), ".t0.s")
        assert os.waitpid(pid, 0)[1] == 0
        assert 0 < len([n for n in store_segments(store_name) if ".t0.s" in n]) < 40
        r = subprocess.run([sys.executable, "-c", "import shmps, sys\n"
                            "with shmps.attach(sys.argv[1], timeout=5) as s:\n"
                            "    print([t['name'] for t in s.tensors()])", store_name],
                           capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout.strip()) == (0, "[]"), r.stderr[-400:]
    finally:
        old.close()
        remove_store(store_name)


CREATOR = """
import sys, shmps
s = shmps.attach(sys.argv[1])
print("go", flush=True)
try:
    s.dense("big", shape=(256 * 16, 16), shard_rows=16, init=7.0)
except shmps.Error as e:
    print(type(e).__name__, flush=True)
s.close()
"""


def test_a_forced_restore_waits_for_a_creation_under_way_in_another_process(
        checkpoint, store_name):
    """A process attached to the store is creating a tensor of 256 shards when
    restore --force replaces the store: the creation ends before the old shards are
    listed, so none of its shards is left under the new store's names, and the restored
    tensors are whole.  (The renewal listed the old shards without waiting: 21 of 21
    rounds left the creator's later shards as orphans under the new store.)"""
    import random

    bad = []
    try:
        for _ in range(4):
            with shmps.attach(store_name) as s:
                for i in range(NTENSORS):   # the creator's tensor gets id 6
                    s.dense(f"old{i}", shape=(4,))
            c = subprocess.Popen([sys.executable, "-c", CREATOR, store_name],
                                 stdout=subprocess.PIPE, text=True)
            try:
                assert c.stdout.readline().strip() == "go"
                time.sleep(random.uniform(0.0, 0.01))
                r = shmps.restore(checkpoint, store_name, force=True)
                c.wait(timeout=60)
            finally:
                c.kill()
                c.wait()
            try:
                extra = [n for n in store_segments(store_name) if ".t6." in n]
                whole = [float(r[f"t{i}"].pull().min()) for i in range(NTENSORS)]
                if extra or whole != [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]:
                    bad.append((len(extra), whole))
            finally:
                r.destroy()
    finally:
        remove_store(store_name)
    assert not bad, f"creator's shards left under the new store, restored minima: {bad}"
