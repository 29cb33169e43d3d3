"""Checkpoints: save/restore equality (every dtype, every updater's state, shards),
consistency under concurrent pushes, atomic replacement, crash and Ctrl-C safety,
restore's refusal rules and corrupt-checkpoint handling.

Every test destroys the stores it made and kills the processes it started, also when
it fails (``finally`` blocks and the ``procs`` fixture).
"""
from __future__ import annotations

import errno
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import pytest

import shmps
from shmps import checkpoint as ckpt_mod
from shmps import files

from test_errors import needs_small_shm
from helpers import child_env, remove_store, times_out_for_the_removal_holder

SHM = "/dev/shm"

FLOAT_UPDATERS = [
    shmps.SGD(lr=0.1, weight_decay=0.01),
    shmps.Momentum(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    shmps.Adagrad(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.5),
    shmps.Adam(lr=0.01, amsgrad=True, weight_decay=0.01),
    shmps.FTRL(alpha=0.5, beta=1.0, l1=0.1, l2=0.1),
]
REDUCTIONS = [shmps.Sum(), shmps.Assign(), shmps.Max(), shmps.Min()]
DTYPES = ["int8", "int32", "float16", "float32", "float64"]


# ---- helpers ---------------------------------------------------------------------------

def tool_cmd() -> list[str]:
    """The shmps-tool command (the console script, else ``python -m shmps.cli``)."""
    exe = shutil.which("shmps-tool")
    return [exe] if exe else [sys.executable, "-m", "shmps.cli"]




def segments(name: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM) if n.startswith(f"shmps.{name}."))


def drop(name: str) -> None:
    """Remove store ``name`` whatever state it is in (never raises)."""
    for n in segments(name):
        try:
            os.unlink(os.path.join(SHM, n))
        except FileNotFoundError:
            pass


def debris(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path.parent)
                  if n.startswith(path.name + ".tmp-") or n.startswith(path.name + ".old-"))


def snapshot(t: Any) -> dict:
    """Values, every optimizer state array (all shards, row order) and the step."""
    nstate = t._shard(0).spec["nstate"]
    states = [np.concatenate([np.array(t._shard(i).state(k)) for i in range(t.nshards)])
              for k in range(nstate)]
    return {"value": t.pull(), "states": states, "step": t.stats()["step"]}


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def grad_for(t: Any, rng: np.random.Generator) -> np.ndarray:
    if t.dtype.kind == "f":
        return rng.uniform(-1, 1, t.shape).astype(np.float32)
    return rng.integers(-3, 4, t.shape).astype(t.dtype)


@pytest.fixture
def names() -> Iterator[list[str]]:
    """Extra store names for a test; every one is removed afterwards."""
    made: list[str] = []
    yield made
    for n in made:
        drop(n)


def new_name(names: list[str]) -> str:
    n = f"t{uuid.uuid4().hex[:12]}"
    names.append(n)
    return n


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    """Child processes of a test; killed and reaped afterwards, whatever happened."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass


# ---- equality --------------------------------------------------------------------------

def test_roundtrip_every_dtype_and_updater_state(store, tmp_path, names):
    """Restore brings back values, state and step of every dtype x updater (bit-exact later)."""
    rng = np.random.default_rng(7)
    made = []
    for dt in DTYPES:
        for upd in REDUCTIONS + (FLOAT_UPDATERS if dt.startswith("float") else []):
            name = f"{dt}/{type(upd).__name__}"
            init = rng.integers(-5, 6, (7, 5)) if dt.startswith("int") else \
                rng.uniform(-1, 1, (7, 5))
            t = store.dense(name, shape=(7, 5), dtype=dt, optimizer=upd, init=init,
                            shard_rows=3)
            assert t.nshards == 3
            for _ in range(3):
                t.push(grad_for(t, rng))
            t.push(grad_for(t, rng)[[1, 5]], rows=[1, 5])
            made.append(t)
    assert len(made) == 35
    path = tmp_path / "ck"
    assert store.checkpoint(path) == str(path)
    other = shmps.restore(path, new_name(names))
    try:
        assert [d["name"] for d in other.tensors()] == [t.name for t in made]
        for t in made:
            r = other[t.name]
            a, b = snapshot(t), snapshot(r)
            assert a["step"] == b["step"] == 4, t.name
            assert same_bits(a["value"], b["value"]), t.name
            assert len(a["states"]) == len(b["states"]), t.name
            for x, y in zip(a["states"], b["states"]):
                assert same_bits(x, y), t.name
            assert r.optimizer == t.optimizer and r.dtype == t.dtype and r.nshards == 3
            for _ in range(2):  # the same pushes continue identically from the restore
                g = grad_for(t, rng)
                t.push(g)
                r.push(g)
            assert same_bits(t.pull(), r.pull()), t.name
            assert r.stats()["step"] == t.stats()["step"] == 6, t.name
    finally:
        other.destroy()


def test_multi_shard_values_are_row_major_dense_sets(store, tmp_path, names):
    """An 11-shard tensor is one row-major dense set equal to its shards, and it restores."""
    t = store.dense("w", shape=(1000, 3, 17), dtype="float64", shard_rows=96,
                    optimizer=shmps.Momentum(lr=0.05), init=np.arange(51000.0).reshape(
                        1000, 3, 17))
    assert t.nshards == 11
    t.push(np.ones(t.shape))
    path = tmp_path / "ck"
    store.checkpoint(path)
    doc = json.loads((path / "checkpoint.json").read_text())
    assert [e["record"]["name"] for e in doc["tensors"]] == ["w"]
    prefix = path / doc["tensors"][0]["prefix"]
    assert not os.path.exists(f"{prefix}.rowcnt") and not os.path.exists(f"{prefix}.colidx")
    ms = files.read_csr(prefix)
    assert (ms.kind, ms.rows, ms.cols, ms.shape, ms.arrays) == \
        ("dense", 1000, 51, (1000, 3, 17), ("value", "state0"))
    assert isinstance(ms.csr.colidx, files.ImplicitIndex)
    snap = snapshot(t)
    assert same_bits(np.array(ms.to_numpy()), snap["value"])
    st = files.read_csr(prefix, array="state0")
    assert same_bits(np.array(st.csr.value), snap["states"][0])
    assert ms.meta["step"] == 1 and ms.meta["optimizer"]["type"] == "Momentum"
    r = shmps.restore(path, new_name(names))
    try:
        assert r["w"].nshards == 11 and same_bits(r["w"].pull(), snap["value"])
    finally:
        r.destroy()


def test_empty_store_and_empty_tensors_roundtrip(store, tmp_path, names):
    """A store without tensors, a 0-row tensor and a scalar tensor round trip."""
    store.checkpoint(tmp_path / "empty")
    r = shmps.restore(tmp_path / "empty", new_name(names))
    try:
        assert r.tensors() == []
    finally:
        r.destroy()
    store.dense("none", shape=(0, 4), dtype="float32")
    store.dense("scalar", shape=(), dtype="int32", init=5)
    store.checkpoint(tmp_path / "small")
    r = shmps.restore(tmp_path / "small", new_name(names))
    try:
        assert r["none"].pull().shape == (0, 4)
        assert r["scalar"].pull().shape == () and int(r["scalar"].pull()) == 5
    finally:
        r.destroy()


def test_a_restored_tensor_is_created_by_the_restore_not_adopted(store, tmp_path, names):
    """A bridge's copy of a peer's tensor records that host as its "origin" (its initial
    values are that host's); a checkpoint of it restored into a new store is this
    store's own tensor (its values are the checkpoint's), of every kind: no origin."""
    with store._adopting("127.0.0.9:7001"):
        store.dense("d", (4, 2), "float32", init=1.5)
        store.table("t", dim=2, capacity=8)
        store.csr("c", [0, 1, 2], [0, 1], "float32", init=2.0)
    assert {store._record(n).get("origin") for n in "dtc"} == {"127.0.0.9:7001"}
    store.dense("mine", (2,), "int32")
    assert "origin" not in store._record("mine")
    store.checkpoint(tmp_path / "ck")
    r = shmps.restore(tmp_path / "ck", new_name(names))
    try:
        assert {n: "origin" in r._record(n) for n in ("d", "t", "c", "mine")} == dict.fromkeys(
            ("d", "t", "c", "mine"), False)
        np.testing.assert_array_equal(r["d"].pull(), np.full((4, 2), 1.5, np.float32))
    finally:
        r.destroy()


# ---- consistency under concurrent pushes ----------------------------------------------

PUSHER = """
import os, sys, numpy as np, shmps
store, stop = sys.argv[1], sys.argv[2]
s = shmps.attach(store)
t = s["c"]
g = np.ones(t.shape, np.int32)
n = 0
print("ready", flush=True)
while not os.path.exists(stop):
    t.push(g)
    n += 1
print(n, flush=True)
s.close()
"""


def test_checkpoint_while_two_processes_push(store, tmp_path, procs):
    """With 2 processes pushing all-ones, every checkpointed shard is constant (whole pushes)."""
    t = store.dense("c", shape=(2048, 64), dtype="int32", shard_rows=128)
    assert t.nshards == 16
    stop = tmp_path / "stop"
    for _ in range(2):
        procs.append(subprocess.Popen([sys.executable, "-c", PUSHER, store.name, str(stop)],
                                      stdout=subprocess.PIPE, text=True, env=child_env()))
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 30
    while t.stats()["pushes"] < 20:
        assert time.monotonic() < deadline, "pushers never pushed"
        time.sleep(0.005)
    seen = []
    for k in range(4):
        before = t.stats()["pushes"]
        path = tmp_path / f"ck{k}"
        store.checkpoint(path)
        after = t.stats()["pushes"]
        v = np.array(files.read_csr(path / "t0").to_numpy())
        per_shard = [v[i * 128:(i + 1) * 128] for i in range(16)]
        for i, sh in enumerate(per_shard):
            assert (sh == sh.flat[0]).all(), f"checkpoint {k}: shard {i} holds a torn push"
        counts = [int(sh.flat[0]) for sh in per_shard]
        assert all(c > 0 for c in counts)
        if seen:  # values only grow: each shard is at least where it was last time
            assert all(c >= c0 for c, c0 in zip(counts, seen[-1][2]))
        seen.append((before, after, counts))
    stop.touch()
    total = 0
    for p in procs:
        out, _ = p.communicate(timeout=30)
        assert p.returncode == 0
        total += int(out.split()[-1])
    assert (t.pull() == total).all()
    # pushes went on while the checkpoints were taken
    assert any(after > before for before, after, _ in seen)


# ---- replacement, debris ---------------------------------------------------------------

def test_checkpoint_replaces_existing_atomically(store, tmp_path, names):
    """A checkpoint replaces an old one with no debris; a non-checkpoint PATH is refused."""
    t = store.dense("w", shape=(10, 4), dtype="float32")
    path = tmp_path / "ck"
    store.checkpoint(path)
    t.push(np.full((10, 4), 3.0))
    store.checkpoint(path)
    assert debris(path) == [] and sorted(os.listdir(tmp_path)) == ["ck"]
    r = shmps.restore(path, new_name(names))
    try:
        assert (r["w"].pull() == 3.0).all()
    finally:
        r.destroy()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(shmps.InvalidArgument, match="is not a shmps checkpoint"):
        store.checkpoint(tmp_path / "notes")
    (tmp_path / "file").write_text("x")
    with pytest.raises(shmps.InvalidArgument, match="is not a shmps checkpoint"):
        store.checkpoint(tmp_path / "file")
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"
    assert (tmp_path / "file").read_text() == "x"
    assert debris(tmp_path / "notes") == [] and debris(tmp_path / "file") == []
    (tmp_path / "emptydir").mkdir()
    store.checkpoint(tmp_path / "emptydir")  # an empty directory is fine
    assert (tmp_path / "emptydir" / "checkpoint.json").exists()
    store.checkpoint(tmp_path / "new" / "sub" / "ck")  # parents are created
    assert (tmp_path / "new" / "sub" / "ck" / "checkpoint.json").exists()


def test_next_checkpoint_cleans_debris_of_dead_writers_only(store, tmp_path, procs):
    """The next checkpoint removes this host's dead writers' PATH.tmp-HOST-PID-HEX, keeps
    a live writer's and another host's whatever its pid; with PATH missing it puts back
    this host's dead writer's PATH.old-*, not another host's."""
    store.dense("w", shape=(4,), dtype="float32")
    path = tmp_path / "ck"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    procs.append(live)
    host = files.host_id()
    other = f"{int(host, 16) ^ 0x80000001:08x}"  # another host's (or container's)
    for h, pid in ((host, dead.pid), (host, live.pid), (other, dead.pid)):
        d = tmp_path / f"ck.tmp-{h}-{pid}-abcdef"
        d.mkdir()
        (d / "t0.value").write_bytes(b"half")
    store.checkpoint(path)
    theirs = f"ck.tmp-{other}-{dead.pid}-abcdef"
    assert debris(path) == sorted([f"ck.tmp-{host}-{live.pid}-abcdef", theirs])
    # the fallback's set-aside old checkpoint is put back when PATH is missing, if it is
    # this host's dead writer's
    shutil.copytree(path, tmp_path / f"ck.old-{other}-{dead.pid}-123456")
    shutil.move(str(path), str(tmp_path / f"ck.old-{host}-{dead.pid}-123456"))
    ckpt_mod._clean_debris(str(path))
    assert (path / "checkpoint.json").exists()
    assert debris(path) == sorted([f"ck.old-{other}-{dead.pid}-123456",
                                   f"ck.tmp-{host}-{live.pid}-abcdef", theirs])
    shutil.rmtree(path)
    ckpt_mod._clean_debris(str(path))
    assert not path.exists()  # another host's is not put back


def test_a_checkpoint_in_progress_in_another_pid_namespace_is_not_debris(store, tmp_path,
                                                                         procs):
    """A checkpoint to PATH in progress in another PID namespace (another host or
    container on a shared directory), its pid dead here: the next checkpoint to PATH here
    removes this host's dead writer's temporary directory, not the other's.  (Judged by
    its pid alone, the other's was removed under it.)"""
    from helpers import start_in_other_pid_namespace

    store.dense("w", shape=(4,), dtype="float32")
    path = tmp_path / "ck"
    aside = ("import os, sys\n"
             "from shmps import checkpoint\n"
             "tmp = checkpoint._aside_name(sys.argv[1], 'tmp')\n"
             "os.mkdir(tmp)\n"
             "open(os.path.join(tmp, 't0.value'), 'wb').close()\n")
    here = subprocess.run([sys.executable, "-c", aside, str(path)], env=child_env(),
                          timeout=60)  # this host's checkpoint, killed in step 3
    mine = debris(path)
    assert here.returncode == 0 and len(mine) == 1
    theirs = (f"import sys; sys.argv[1:] = [{str(path)!r}]\n{aside}"
              "print('writing', flush=True)\n"
              "input()\n"
              "print('intact' if os.path.exists(os.path.join(tmp, 't0.value')) else 'gone')\n"
              "import shutil; shutil.rmtree(tmp, ignore_errors=True)\n")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    other = start_in_other_pid_namespace(theirs, dead.pid, env=child_env())
    procs.append(other)
    assert other.stdout.readline() == "writing\n"
    their_tmp = sorted(set(debris(path)) - set(mine))
    assert len(their_tmp) == 1
    store.checkpoint(path)
    assert debris(path) == their_tmp
    other.stdin.write("\n")
    other.stdin.flush()
    assert other.stdout.readline() == "intact\n"
    assert other.wait(timeout=60) == 0
    assert debris(path) == [] and (path / "checkpoint.json").exists()


def test_checkpoint_leaves_the_users_own_dirs_beside_path(store, tmp_path, names):
    """Only the names a checkpoint makes (PATH.tmp-HOST-PID-6HEX, PATH.old-HOST-PID-6HEX)
    are debris: a user's PATH.old-2023 (a checkpoint kept by hand), PATH.tmp-notes, the
    earlier form without HOST, ... are neither removed nor, with PATH missing, put back
    as PATH."""
    store.dense("w", shape=(4,), dtype="float32", init=1.0)
    path = tmp_path / "ck"
    store.checkpoint(path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    h = f"{files.host_id()}-{dead.pid}"
    mine = ["ck.old-2023", "ck.tmp-notes", "ck.old-backup", f"ck.tmp-{h}-abcdef0",
            f"ck.old-{h}-ABCDEF", f"ck.old-{h}-abcdef.keep", "ck.tmp--abcdef",
            f"ck.old-{dead.pid}-abcdef", f"ck.tmp-{dead.pid}-abcdef",  # the earlier form
            f"ck.old-{files.host_id()[:7]}-{dead.pid}-abcdef", f"ck.tmp-{h[:8]}-abcdef",
            f"ck.old-{files.host_id()}-{10**20}-abcdef"]
    for n in mine:  # each one a whole checkpoint
        shutil.copytree(path, tmp_path / n)
    shutil.rmtree(path)
    (tmp_path / f"ck.tmp-{h}-fedcba").write_text("a file, not a checkpoint's")
    store["w"].push(np.ones(4, np.float32))
    store.checkpoint(path)
    assert sorted(os.listdir(tmp_path)) == sorted(["ck", f"ck.tmp-{h}-fedcba", *mine])
    assert all((tmp_path / n / "checkpoint.json").exists() for n in mine)
    r = shmps.restore(path, new_name(names))
    try:
        assert (r["w"].pull() == 2.0).all()
    finally:
        r.destroy()


# ---- restore rules ----------------------------------------------------------------------

def test_restore_without_a_name_recreates_the_checkpointed_store(store, tmp_path, names):
    """shmps.restore(path) takes the checkpointed store's name, as `shmps-tool restore
    PATH` without --as does (it was a required argument: TypeError); an empty name is
    refused, not taken for that default."""
    store.dense("w", shape=(3, 2), dtype="int32", init=4)
    path = tmp_path / "ck"
    store.checkpoint(path)
    with pytest.raises(shmps.InvalidArgument, match="exists .*force"):
        shmps.restore(path)                    # (the checkpointed store: it is live)
    with pytest.raises(shmps.InvalidArgument):
        shmps.restore(path, "")
    name = store.name
    store.destroy()
    r = shmps.restore(path)
    try:
        assert r.name == name and (r["w"].pull() == 4).all()
    finally:
        r.destroy()


def test_restore_refuses_existing_store_unless_force(store, tmp_path, procs, names):
    """restore() refuses a store with tensors or other live processes unless force=True."""
    t = store.dense("w", shape=(3, 2), dtype="int32", init=1)
    path = tmp_path / "ck"
    store.checkpoint(path)
    t.push(np.full((3, 2), 5, np.int32))
    store.dense("extra", shape=(2,), dtype="float32")
    with pytest.raises(shmps.InvalidArgument, match="exists .*force"):
        shmps.restore(path, store.name)
    assert (t.pull() == 6).all() and "extra" in store
    # an empty store another live process is attached to is refused too
    empty = new_name(names)
    procs.append(subprocess.Popen(
        [sys.executable, "-c", "import shmps, sys; s = shmps.attach(sys.argv[1]); "
         "print('up', flush=True); sys.stdin.read()", empty],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env()))
    assert procs[-1].stdout.readline().strip() == "up"
    with pytest.raises(shmps.InvalidArgument, match="live processes"):
        shmps.restore(path, empty)
    r = shmps.restore(path, store.name, force=True)
    try:
        assert [d["name"] for d in r.tensors()] == ["w"]
        assert (r["w"].pull() == 1).all()
    finally:
        # (the fixture's handle is of the replaced store: its destroy() leaves this one)
        r.destroy()


@pytest.mark.parametrize("where", ["new manifest", "rename"])
def test_a_forced_restore_interrupted_while_replacing_leaves_no_claimed_store(
        store, tmp_path, monkeypatch, where):
    """Ctrl-C reaches restore --force while it replaces the store, and the process
    lives on.  Before it changed anything (making the new manifest), the old store is
    given back as it was; after (here at the rename, the old shards gone), neither is
    left.  Either way another process's attach goes on at once.  (The old manifest
    stayed RESTORING, claimed by the live restorer, its shards gone: every attach waited
    and raised Timeout until that process exited.)"""
    import shmps.store as st

    store.dense("w", shape=(3,), init=1.0)
    store.checkpoint(tmp_path / "ck")
    store["w"].push(np.full(3, 4.0, np.float32))

    def interrupted(*a: Any, **k: Any) -> Any:
        raise KeyboardInterrupt

    if where == "rename":
        monkeypatch.setattr(st.os, "rename", interrupted)
    else:
        real = st.Segment.open_or_create
        monkeypatch.setattr(st.Segment, "open_or_create", lambda name, *a, **k: (
            interrupted() if ".restore-" in name else real(name, *a, **k)))
    with pytest.raises(KeyboardInterrupt):
        shmps.restore(tmp_path / "ck", store.name, force=True)
    monkeypatch.undo()
    r = subprocess.run([sys.executable, "-c", "import shmps, sys\n"
                        "with shmps.attach(sys.argv[1], timeout=3) as s:\n"
                        "    print([float(s[t['name']].pull()[0]) for t in s.tensors()])",
                        store.name], capture_output=True, text=True, timeout=60,
                       env=child_env())
    try:
        want = "[5.0]" if where == "new manifest" else "[]"
        assert (r.returncode, r.stdout.strip()) == (0, want), r.stderr[-400:]
        assert not [n for n in os.listdir(SHM) if ".restore-" in n]
    finally:
        if where == "rename":
            remove_store(store.name)   # the new one (the fixture's handle is of the old)


def _corrupt_cases() -> list[tuple[str, Any, str]]:
    def rm(name: str) -> Any:
        return lambda p: (p / name).unlink()

    def trunc(name: str, by: int) -> Any:
        def f(p: Path) -> None:
            with open(p / name, "r+b") as fh:
                fh.truncate(os.path.getsize(p / name) - by)
        return f

    def write(name: str, text: str) -> Any:
        return lambda p: (p / name).write_text(text)

    def edit_json(fn: Any) -> Any:
        def f(p: Path) -> None:
            doc = json.loads((p / "checkpoint.json").read_text())
            fn(doc)
            (p / "checkpoint.json").write_text(json.dumps(doc))
        return f

    def edit_meta(fn: Any) -> Any:
        def f(p: Path) -> None:
            m = json.loads((p / "t1.meta").read_text())
            fn(m)
            (p / "t1.meta").write_text(json.dumps(m))
        return f

    def set_prefix(doc: dict) -> None:
        doc["tensors"][1]["prefix"] = "../t1"

    return [
        ("missing value file", rm("t1.value"), "missing file"),
        ("missing state file", rm("t1.state1"), "missing file"),
        ("missing meta", rm("t1.meta"), "missing file"),
        ("truncated value (partial entry)", trunc("t1.value", 2), "truncated"),
        ("truncated value (whole entries)", trunc("t1.value", 8), "rows * cols"),
        ("truncated state", trunc("t1.state0", 4), "rows * cols"),
        ("unparsable checkpoint.json", write("checkpoint.json", '{"format": '),
         "unparsable JSON"),
        # RecursionError / a plain ValueError from json.loads escaped restore
        ("checkpoint.json nested too deeply", write("checkpoint.json", "[" * 100000),
         "unparsable JSON: nested too deeply"),
        ("checkpoint.json integer of 5000 digits", write(
            "checkpoint.json", '{"format": "shmps-checkpoint", "version": ' + "1" * 5000 + "}"),
         "unparsable JSON: a number with more digits"),
        ("checkpoint.json a directory", lambda p: ((p / "checkpoint.json").unlink(),
                                                   (p / "checkpoint.json").mkdir()),
         "checkpoint.json: not a regular file"),
        ("checkpoint.json not an object", write("checkpoint.json", "[]"), "JSON object"),
        ("missing checkpoint.json", rm("checkpoint.json"), "not a shmps checkpoint"),
        ("wrong format", edit_json(lambda d: d.update(format="zip")), 'field "format"'),
        ("newer version", edit_json(lambda d: d.update(version=99)), "newer than this"),
        ("tensors not a list", edit_json(lambda d: d.update(tensors={})), '"tensors"'),
        ("negative staleness", edit_json(lambda d: d.update(staleness=-1)), '"staleness"'),
        ("staleness past int64", edit_json(lambda d: d.update(staleness=2**63)), '"staleness"'),
        ("prefix escapes", edit_json(set_prefix), "prefix"),
        ("record shape disagrees", edit_json(lambda d: d["tensors"][1]["record"].update(
            shape=[6, 2])), "records tensor"),
        ("record shards do not split rows", edit_json(
            lambda d: d["tensors"][1]["record"].update(nshards=1)), "invalid record"),
        ("bad optimizer record", edit_json(
            lambda d: d["tensors"][1]["record"].update(optimizer={"type": "Nope"})),
         "invalid record"),
        ("meta dtype disagrees", edit_meta(lambda m: m["dtypes"].update(value="float64")),
         "dtypes.value"),
        ("meta state count disagrees", edit_meta(lambda m: m["state"].update(
            count=m["state"]["count"] - 1)),
         "state arrays"),
        ("meta not dense", edit_meta(lambda m: m.update(kind="csr")), "missing file"),
        # integers that go to C: in range, or refused before anything is replaced (a step
        # of 2**64 was an internal OverflowError after --force had destroyed the store)
        ("step beyond uint64", edit_json(lambda d: d["tensors"][1].update(step=2**64)),
         'field "tensors[1].step" = 18446744073709551616 is not an integer in 0 .. 2**64-1'),
        ("record shape beyond uint64", edit_json(
            lambda d: d["tensors"][1]["record"].update(shape=[6, 2**64])), "shape [6, 18446"),
        ("record shard_rows beyond its rows", edit_json(
            lambda d: d["tensors"][1]["record"].update(shard_rows=7, nshards=1)),
         "shard_rows 7 and nshards 1 do not split 6 rows"),
    ]


@pytest.mark.parametrize("what,damage,needle", _corrupt_cases(),
                         ids=[c[0] for c in _corrupt_cases()])
def test_restore_of_corrupt_checkpoint_raises_and_leaves_no_store(store, tmp_path, names,
                                                                  what, damage, needle):
    """Each damage raises CorruptFile, creates no store, leaves a force target intact."""
    store.dense("a", shape=(4,), dtype="int8", init=3)
    store.dense("b", shape=(6, 3), dtype="float32", optimizer=shmps.Adam(), shard_rows=4)
    store["b"].push(np.ones((6, 3)))
    path = tmp_path / "ck"
    store.checkpoint(path)
    damage(path)
    target = new_name(names)
    with pytest.raises(shmps.CorruptFile) as info:
        shmps.restore(path, target)
    assert needle in str(info.value), str(info.value)
    # (the file verbs' hint, "pass --rowcnt-dtype/.../--cols", names flags restore has not)
    assert "--rowcnt-dtype" not in str(info.value), str(info.value)
    assert segments(target) == []
    before = store["b"].pull()
    with pytest.raises(shmps.CorruptFile):
        shmps.restore(path, store.name, force=True)
    assert same_bits(store["b"].pull(), before) and "a" in store


LIMITED_RESTORE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from shmps import cli
sys.exit(cli.main(["restore", sys.argv[1], "--as", sys.argv[2]]))
"""


def test_restore_of_a_huge_shard_count_is_refused_at_once(store, tmp_path, names):
    """A record of 10**9 one-row shards whose files hold 6 rows is refused from the file
    sizes, at once and in 1 GiB of address space (a spec per shard was built first:
    14 s, then out of memory)."""
    store.dense("b", shape=(6, 3), dtype="float32", optimizer=shmps.Adam(), shard_rows=4)
    path = tmp_path / "ck"
    store.checkpoint(path)
    doc = json.loads((path / "checkpoint.json").read_text())
    doc["tensors"][0]["record"].update(shape=[10**9, 3], shard_rows=1, nshards=10**9)
    (path / "checkpoint.json").write_text(json.dumps(doc))
    target = new_name(names)
    r = subprocess.run(["timeout", "60", sys.executable, "-c", LIMITED_RESTORE, str(path),
                        target], capture_output=True, text=True, env=child_env(), timeout=90)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "t0.meta: a 6 x 3 float32 set, but" in r.stderr and "(1000000000, 3)" in r.stderr
    assert segments(target) == []


def test_restore_of_more_shards_than_a_tensor_has_is_refused(store, tmp_path, names):
    """A record that splits a tensor its files do hold into more shards than a tensor
    may have (tensor.MAX_ROW_SHARDS: each is a mapping in every process) is a
    CorruptFile before anything is created (it went on to create 100,000 segments)."""
    store.dense("b", shape=(100_000, 1), dtype="int8")
    path = tmp_path / "ck"
    store.checkpoint(path)
    doc = json.loads((path / "checkpoint.json").read_text())
    doc["tensors"][0]["record"].update(shard_rows=1, nshards=100_000)
    (path / "checkpoint.json").write_text(json.dumps(doc))
    target = new_name(names)
    with pytest.raises(shmps.CorruptFile, match="100,000 shards, more than a tensor has"):
        shmps.restore(path, target)
    assert segments(target) == []


def test_checkpoint_to_an_unwritable_place_names_the_path(store, tmp_path):
    """A path whose directory cannot hold the checkpoint's temporary copy (a /proc entry,
    a read-only directory) gives an OSError naming the path the user gave, not the
    internal PATH.tmp-* name, and saying what to do; nothing is left behind."""
    store.dense("w", shape=(2,))
    with pytest.raises(OSError) as info:
        store.checkpoint("/proc/shmps-no-such-dir")
    msg = str(info.value)
    assert info.value.filename == "/proc/shmps-no-such-dir" and ".tmp-" not in msg, msg
    assert "choose a path" in msg
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if not os.access(ro, os.W_OK):   # root may write anyway
            with pytest.raises(OSError) as info:
                store.checkpoint(ro / "ck")
            assert info.value.filename == str(ro / "ck") and ".tmp-" not in str(info.value)
        assert sorted(os.listdir(ro)) in ([], ["ck"])
    finally:
        os.chmod(ro, 0o700)


FULL_DISK_SCRIPT = """
import json, os, subprocess, sys, numpy as np, shmps
from shmps import files
mnt, name = sys.argv[1], sys.argv[2]
ck, out = os.path.join(mnt, "ck"), {}
s = shmps.attach(name)
try:
    s.dense("w", shape=(256, 1024), dtype="float32", init=1.0)   # 1 MiB
    s.checkpoint(ck)
    s.dense("big", shape=(2048, 1024), dtype="float32")           # 8 MiB more: no room
    try:
        s.checkpoint(ck)
    except OSError as e:
        out["api"] = [e.errno, e.filename, str(e)]
    r = subprocess.run([sys.executable, "-m", "shmps.cli", "checkpoint", name, ck],
                       capture_output=True, text=True)
    out["cli"] = [r.returncode, r.stderr]
    out["left"] = sorted(os.listdir(mnt))
    out["old"] = [e["record"]["name"] for e in files.read_checkpoint_manifest(ck)["tensors"]]
finally:
    s.destroy()
print(json.dumps(out))
"""


@needs_small_shm
def test_checkpoint_onto_a_full_disk_names_the_path_and_says_what_to_do(tmp_path, names):
    """On a full filesystem (a private 6 MiB tmpfs) a checkpoint's write error names the
    user's PATH and says to free space or use another disk, from the API and as one
    shmps-tool line; the old checkpoint stays and no PATH.tmp-* is left (the error was
    a bare "No space left on device": write/fsync errors carry no filename)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=6m tmpfs "$1" '
                        '&& exec "$2" -c "$3" "$1" "$4"', "sh", str(mnt), sys.executable,
                        FULL_DISK_SCRIPT, new_name(names)],
                       capture_output=True, text=True, env=child_env(), timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    out = json.loads(r.stdout.splitlines()[-1])
    ck = str(mnt / "ck")
    assert "api" in out, out
    code, filename, msg = out["api"]
    assert code == errno.ENOSPC and filename == ck and ".tmp-" not in msg, out
    assert "free space" in msg and "another disk" in msg, msg
    status, err = out["cli"]
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"shmps-tool: error: {ck}: No space left on device ("), err
    assert out["left"] == ["ck"] and out["old"] == ["w"], out


def test_restore_missing_directory_is_not_found(tmp_path, names):
    """restore() of a missing path raises NotFound and creates nothing."""
    target = new_name(names)
    with pytest.raises(shmps.NotFound, match="no checkpoint directory"):
        shmps.restore(tmp_path / "nope", target)
    assert segments(target) == []


# ---- interruption -------------------------------------------------------------------------

class _FreezeThenInterrupt:
    """Stands in for the native lib: the (shared) freeze succeeds, then Ctrl-C arrives."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def shmps_freeze_shared(self, *args: Any) -> int:
        code = self._real.shmps_freeze_shared(*args)
        assert code == 0
        raise KeyboardInterrupt


def test_interrupted_in_process_checkpoint_thaws_and_cleans(store, tmp_path, monkeypatch):
    """Ctrl-C in store.checkpoint (mid-write, after a freeze) leaves no debris or frozen shard."""
    t = store.dense("w", shape=(64, 8), dtype="float32", shard_rows=16)
    path = tmp_path / "ck"
    store.checkpoint(path)
    t.push(np.ones((64, 8)))
    calls = {"n": 0}
    real_append = ckpt_mod._Writer.append

    def append(self: Any, kind: str, arr: np.ndarray) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        real_append(self, kind, arr)

    monkeypatch.setattr(ckpt_mod._Writer, "append", append)
    with pytest.raises(KeyboardInterrupt):
        store.checkpoint(path)
    monkeypatch.setattr(ckpt_mod._Writer, "append", real_append)
    assert debris(path) == []
    monkeypatch.setattr(ckpt_mod, "lib", _FreezeThenInterrupt(ckpt_mod.lib))
    with pytest.raises(KeyboardInterrupt):
        store.checkpoint(path)
    monkeypatch.undo()
    assert debris(path) == []
    t0 = time.monotonic()
    t.push(np.ones((64, 8)))  # shard 0 was frozen when Ctrl-C came: it must be thawed
    assert time.monotonic() - t0 < 0.5
    assert (np.array(files.read_csr(path / "t0").to_numpy()) == 0).all()  # previous one


def test_ctrl_c_as_the_tmp_directory_is_made_leaves_none(store, tmp_path, monkeypatch):
    """Ctrl-C arriving just as the temporary directory's mkdir returns (where SIGINT to
    shmps-tool lands when sent as soon as PATH.tmp-* shows) removes it: it was made
    outside the try that cleans up, and stayed."""
    store.dense("w", shape=(4,), dtype="float32")
    path = tmp_path / "ck"
    real_mkdir = os.mkdir

    def mkdir_then_interrupt(p: Any, mode: int = 0o777) -> None:
        real_mkdir(p, mode)
        if ".tmp-" in os.fspath(p):
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "mkdir", mkdir_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        store.checkpoint(path)
    monkeypatch.undo()
    assert debris(path) == [] and not path.exists()


CHECKPOINTER = "import sys; from shmps.cli import main; sys.exit(main(sys.argv[1:]))"


def test_ctrl_c_of_cli_checkpoint_leaves_no_tmp_directory(store, tmp_path, procs):
    """SIGINT to `shmps-tool checkpoint`: one error line, exit 2, no PATH.tmp-* and no PATH."""
    store.dense("big", shape=(1 << 14, 1024), dtype="float32", init=1.0)  # 64 MiB
    path = tmp_path / "ck"
    for attempt in range(5):
        p = subprocess.Popen(tool_cmd() + ["checkpoint", store.name, str(path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=child_env())
        procs.append(p)
        deadline = time.monotonic() + 30
        while not debris(path) and p.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        if p.poll() is not None:  # finished before we saw it start: try again
            shutil.rmtree(path, ignore_errors=True)
            continue
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
        if p.returncode == 0:  # it completed just before the signal: try again
            shutil.rmtree(path, ignore_errors=True)
            continue
        assert p.returncode == 2, (out, err)
        assert err.strip().splitlines() == ["shmps-tool: error: interrupted"], err
        assert "Traceback" not in err
        assert debris(path) == [] and not path.exists()
        return
    pytest.fail("the checkpoint always finished before SIGINT could interrupt it")


# ---- SIGKILL mid-checkpoint ------------------------------------------------------------------

def _whole(path: Path) -> Optional[float]:
    """The constant value of the checkpoint at ``path`` (checked whole), else None."""
    v = np.asarray(files.read_csr(path / "t0").csr.value)
    first = float(v[0])
    return first if bool((v == v[0]).all()) else None


KILLED_INSIDE_TQDM = r"""
import os, signal, sys, threading
import shmps
name, path = sys.argv[1], sys.argv[2]
s = shmps.attach(name)
s.dense("w", shape=(4,))
s.checkpoint(path)                  # the parent's first checkpoint (and progress bar)
pid = os.fork()
if pid == 0:                        # a process forked afterwards, killed while it holds
    from tqdm import tqdm           # the lock every tqdm bar of the process takes
    tqdm.get_lock().acquire()
    os.kill(os.getpid(), signal.SIGKILL)
os.waitpid(pid, 0)
for call in (lambda: s.checkpoint(path), lambda: shmps.restore(path, name + "r").destroy()):
    done = threading.Event()
    threading.Thread(target=lambda: (call(), done.set()), daemon=True).start()
    if not done.wait(20):
        os._exit(3)                 # blocked on the dead process's lock
s.close()
"""


def test_a_process_killed_inside_a_progress_bar_blocks_no_checkpoint(tmp_path, procs, names):
    """A process SIGKILLed while it holds tqdm's lock (its own progress bar, or
    checkpoint()'s) never blocks another process's checkpoint() or restore().  tqdm's
    default lock is a multiprocessing lock shared by every process forked after the
    first bar: checkpoint() took it for a bar even when none was shown, and a process
    killed inside it left every other process of the family blocked for ever in its
    next checkpoint (found by a kill fuzzer; fails without the fix)."""
    name = new_name(names)
    names.append(name + "r")
    p = subprocess.Popen([sys.executable, "-c", KILLED_INSIDE_TQDM, name, str(tmp_path / "ck")],
                         env=child_env(), stderr=subprocess.PIPE)
    procs.append(p)
    assert p.wait(timeout=90) == 0, p.stderr.read().decode()[-2000:]


@pytest.mark.slow
def test_sigkill_mid_checkpoint_keeps_previous_checkpoint(store, tmp_path, procs, names):
    """SIGKILL mid-checkpoint (64 MiB in 16 shards, random instants) leaves PATH whole
    and restorable.  (The kills land at fractions of the probe's measured write time, so
    the size only sets how long each write takes: 256 MiB took 12 s of the suite.)"""
    t = store.dense("big", shape=(1 << 14, 1024), dtype="float32", init=1.0,
                    shard_rows=1 << 10)  # 64 MiB, 16 shards of 4 MiB (as 256 MiB had 16)
    path = tmp_path / "ck"
    store.checkpoint(path)  # the previous checkpoint: all ones
    t.push(np.ones(t.shape, np.float32))  # live values now all twos

    def start(target: Path) -> tuple[subprocess.Popen, float]:
        """Start `shmps-tool checkpoint`; return it once its PATH.tmp-HOST-PID-* exists."""
        p = subprocess.Popen(tool_cmd() + ["checkpoint", store.name, str(target)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env=child_env())
        procs.append(p)
        mine = f"{target.name}.tmp-{files.host_id()}-{p.pid}-"
        deadline = time.monotonic() + 60
        while not any(n.startswith(mine) for n in os.listdir(target.parent)):
            assert p.poll() is None, p.stderr.read() if p.stderr else ""
            assert time.monotonic() < deadline, "the checkpoint never started writing"
            time.sleep(0.001)
        return p, time.monotonic()

    probe, began = start(tmp_path / "probe")  # how long writing takes here, now
    assert probe.wait(timeout=120) == 0
    writing = time.monotonic() - began
    shutil.rmtree(tmp_path / "probe")
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    on_disk, live = 1.0, 2.0
    outcomes = []
    for i in range(6):
        p, _ = start(path)
        # kill while writing (copying shards, writing, fsync, swapping, removing the
        # old one), the last time near the end
        time.sleep(rng.uniform(0.0, 1.1) * writing if i < 5 else 0.95 * writing)
        p.kill()
        p.wait(timeout=30)
        value = _whole(path)
        assert value in (on_disk, live), f"kill {i}: PATH is not a whole checkpoint"
        doc = files.read_checkpoint_manifest(path)
        assert [e["record"]["name"] for e in doc["tensors"]] == ["big"]
        outcomes.append((on_disk, value))
        for left in debris(path):  # a leftover is never a usable half checkpoint
            target = new_name(names)
            try:
                r = shmps.restore(path.parent / left, target)
            except (shmps.CorruptFile, shmps.NotFound):
                assert segments(target) == []
            else:  # only a whole one restores (the new one, or the old one swapped out)
                got = r["big"].pull()
                assert float(got.flat[0]) in (on_disk, live) and (got == got.flat[0]).all()
                r.destroy()
        on_disk = value
        t.push(np.ones(t.shape, np.float32))  # the next checkpoint would differ again
        live += 1.0
    r = shmps.restore(path, new_name(names))
    try:
        assert (r["big"].pull() == on_disk).all()
    finally:
        r.destroy()
    store.checkpoint(path)
    assert debris(path) == []
    assert _whole(path) == live


def test_a_restored_tensor_goes_on_at_its_step_on_every_stripe(store, tmp_path, names):
    """A dense tensor that only took whole pushes counts its steps per stripe (docs/
    concurrency.md, "The step"); a restore sets every stripe, of every shard, to the
    restored step, so the pushes after it apply at the steps the tensor would have
    given them: Momentum with dampening (its first step differs) and Adagrad with
    lr_decay, restored after 3 pushes and pushed twice more, equal the tensor pushed 5
    times, bit for bit.  (A restored stripe left at 0 would apply at step 1 again.)"""
    rng = np.random.default_rng(11)
    opts = {"m": shmps.Momentum(lr=0.1, momentum=0.9, dampening=0.5),
            "a": shmps.Adagrad(lr=0.1, lr_decay=0.5)}
    grads = [rng.uniform(-1, 1, (64, 1024)).astype(np.float32) for _ in range(5)]
    for k, opt in opts.items():
        t = store.dense(k, shape=(64, 1024), dtype="float32", optimizer=opt, shard_rows=32)
        for g in grads[:3]:
            t.push(g)
    path = tmp_path / "ck"
    store.checkpoint(path)
    other = shmps.restore(path, new_name(names))
    try:
        for k in opts:
            t, r = store[k], other[k]
            for g in grads[3:]:
                t.push(g)
                r.push(g)
            assert same_bits(t.pull(), r.pull()), k
    finally:
        other.destroy()


def test_a_restore_waits_a_bounded_time_for_a_process_holding_the_removal(store, tmp_path,
                                                                          names, monkeypatch):
    """A restore into a store whose removal a live process holds (a gc deciding about it)
    waits at most RESTORE_WAIT, then raises Timeout naming that process and saying what
    to do, the store unchanged; once the process lets go, the restore goes through."""
    store.dense("w", shape=(4,), init=2.0)
    store.checkpoint(tmp_path / "ck")
    target = store.name + "r"
    names.append(target)
    monkeypatch.setattr(ckpt_mod, "RESTORE_WAIT", 0.3)
    held = shmps.attach(target)
    try:
        times_out_for_the_removal_holder(held, lambda: shmps.restore(tmp_path / "ck", target),
                                         0.3, "retry the restore once it is done")
        assert held.tensors() == []
        with shmps.restore(tmp_path / "ck", target) as again:
            assert (again["w"].pull() == 2.0).all()
    finally:
        held.close()


def _checkpoint_at_step(store: Any, path: Path, step: int) -> None:
    """Checkpoint ``store`` into ``path`` as if each tensor had taken ``step`` pushes
    (its checkpoint.json entry's step: what restore gives the tensor and its stripes)."""
    store.checkpoint(path)
    cj = path / files.CHECKPOINT_JSON
    doc = json.loads(cj.read_text())
    for e in doc["tensors"]:
        e["step"] = step
    cj.write_text(json.dumps(doc))


#: the updaters whose update reads the step: Adagrad's lr_decay (lr / t at t ~ 2**32:
#: one step off changes every update by 2**-32 of itself, 2**32 off halves it) and
#: Adam's bias correction (1 at such steps: tells a step wrapped to a small one)
_WRAP_OPTS = {"adagrad": shmps.Adagrad(lr=1.0, lr_decay=1.0),
              "adam": shmps.Adam(lr=1e-3)}


def _wrap_reference(opt: Any, grads: list, first: int) -> np.ndarray:
    """float64 numpy model: zeros, then ``grads`` at steps first, first + 1, ..."""
    import reference

    w = np.zeros(grads[0].shape)
    state = reference.new_state(opt, w.shape)
    for k, g in enumerate(grads):
        reference.step(opt, w, g, state, first + k)
    return w


@pytest.mark.parametrize("start", [2**32 - 2, 2**33 - 2], ids=["2^32", "2^33"])
def test_a_tensor_whose_step_crosses_a_multiple_of_2_32_applies_at_its_steps(
        store, tmp_path, names, start):
    """Each stripe keeps the low 32 bits of its last step (docs/concurrency.md, "The
    step"), rebuilt against the tensor's 64-bit count: a tensor restored at step
    2**32 - 2 (2**33 - 2) and pushed 4 times applies at 2**32 - 1, 2**32, 2**32 + 1,
    2**32 + 2 on every stripe of both shards, whole pushes and rows= pushes alike:
    Adagrad with lr_decay and Adam equal a float64 numpy model of those steps (to
    1e-12: one step off is 2e-10), and the whole and rows= runs equal each other bit
    for bit.  (Seen failing with the rebuild made naive: the count's high half with the
    stripe's low one.)"""
    rng = np.random.default_rng(5)
    grads = [rng.uniform(-1, 1, (64, 1024)) for _ in range(4)]
    for k, opt in _WRAP_OPTS.items():
        store.dense(k, shape=(64, 1024), dtype="float64", optimizer=opt, shard_rows=32)
    _checkpoint_at_step(store, tmp_path / "ck", start)
    whole, by_rows = (shmps.restore(tmp_path / "ck", new_name(names)) for _ in range(2))
    try:
        every = np.arange(64)
        for k, opt in _WRAP_OPTS.items():
            for g in grads:
                whole[k].push(g)
                by_rows[k].push(g[::-1], rows=every[::-1])
            ref = _wrap_reference(opt, grads, start + 1)
            got = whole[k].pull()
            np.testing.assert_allclose(got, ref, rtol=1e-12, atol=0, err_msg=k)
            assert same_bits(got, by_rows[k].pull()), k
            assert whole[k].stats()["step"] == start + 4
    finally:
        whole.destroy()
        by_rows.destroy()


_WRAP_PUSHER = r"""
import sys, numpy as np, shmps
s = shmps.attach(sys.argv[1], create=False)
t = s[sys.argv[2]]
g = np.random.default_rng(9).uniform(-1, 1, t.shape)
print("ready", flush=True)
sys.stdin.readline()
for _ in range(int(sys.argv[3])):
    t.push(g)
s.close()
"""


def test_whole_pushes_from_two_processes_across_the_2_32_wrap(store, tmp_path, names):
    """Two processes each push one gradient 60 times at once into an Adagrad (lr_decay)
    tensor restored at step 2**32 - 60, so the count crosses 2**32 mid-run while
    pushes overtake each other on the stripes: every stripe still applies its 120
    pushes at steps 2**32 - 59 .. 2**32 + 60, so the tensor equals, bit for bit, the
    same restore pushed 120 times by one process, and the numpy model to 1e-12."""
    opt = _WRAP_OPTS["adagrad"]
    store.dense("adagrad", shape=(64, 1024), dtype="float64", optimizer=opt,
                shard_rows=32)
    start, n = 2**32 - 60, 60
    _checkpoint_at_step(store, tmp_path / "ck", start)
    both, one = (shmps.restore(tmp_path / "ck", new_name(names)) for _ in range(2))
    procs = [subprocess.Popen([sys.executable, "-c", _WRAP_PUSHER, both.name, "adagrad",
                               str(n)], env=child_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
        for p in procs:
            assert p.wait(timeout=120) == 0
        g = np.random.default_rng(9).uniform(-1, 1, (64, 1024))
        for _ in range(2 * n):
            one["adagrad"].push(g)
        got = both["adagrad"].pull()
        assert same_bits(got, one["adagrad"].pull())
        np.testing.assert_allclose(got, _wrap_reference(opt, [g] * (2 * n), start + 1),
                                   rtol=1e-12, atol=0)
        assert both["adagrad"].stats()["step"] == start + 2 * n
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        both.destroy()
        one.destroy()


class _Terminal(io.StringIO):
    """stderr as a terminal, so that checkpoint and restore show their progress bars."""

    def isatty(self) -> bool:
        return True


@pytest.mark.timeout(60)
def test_the_progress_bars_of_checkpoint_and_restore_end_at_their_totals(
        store, tmp_path, names, monkeypatch):
    """The progress bar of a checkpoint and of a restore (on a terminal) counts up to
    exactly the total it shows, for dense tensors of every size, a table and a csr
    tensor.  Before, restore's total was the bytes of the files while each dense
    tensor counted its segments (headers, stripe words, page rounding): small tensors
    ran the bar past its total, where tqdm drops the percentage ("restore m: 867MB
    [00:01, ...]"): this store's restore counted 51,392 bytes of a 26,022 total."""
    for i, shape in enumerate([(), (3,), (5, 2), (0, 4), (40, 30)]):
        store.dense(f"d{i}", shape=shape, optimizer=shmps.Adam())
    store.dense("h", shape=(7, 3), dtype="float16", optimizer=shmps.Momentum())
    store.table("t", dim=3, capacity=20, optimizer=shmps.Adagrad()).push(
        np.arange(5, dtype=np.uint64), np.ones((5, 3)))
    store.csr("c", np.array([0, 2, 3]), np.array([0, 2, 1]), optimizer=shmps.FTRL())
    bars: list = []
    real_bar = ckpt_mod.progress.bar

    def recorded(total: int, desc: str, *args: Any, **kw: Any) -> Any:
        b = real_bar(total, desc, *args, **kw)
        bars.append(b)
        return b

    monkeypatch.setattr(ckpt_mod.progress, "bar", recorded)
    monkeypatch.setattr(sys, "stderr", _Terminal())
    store.checkpoint(tmp_path / "ck")
    shmps.restore(tmp_path / "ck", new_name(names)).close()
    monkeypatch.undo()
    # (restore's check of the csr tensor's files has a bar too, shown only from
    # files.PROGRESS_MIN_BYTES on: this one shows nothing)
    bars = [b for b in bars if not isinstance(b, ckpt_mod.progress._NoBar)]
    assert [b.desc.split()[0] for b in bars] == ["checkpoint", "restore"]
    assert [(b.desc, b.n) for b in bars] == [(b.desc, b.total) for b in bars]


@pytest.mark.timeout(120)
def test_a_checkpoint_holds_the_pushes_this_process_made_with_wait_false(store, tmp_path,
                                                                        names):
    """store.checkpoint() first waits for this process's push(wait=False)s, as flush()
    and clock() do: a training loop with non-blocking pushes (shmps.torch's
    Pusher(wait=False)) that checkpoints at the end of an epoch saves its last steps.
    Before, the checkpoint began at once and missed the pushes still queued on the
    store's push thread (here the restored tensor held 0 or 1 of the 3 pushes)."""
    w = store.dense("w", shape=(2048, 4096), dtype="float32", optimizer=shmps.SGD(lr=1.0))
    g = np.full(w.shape, -1.0, np.float32)
    for _ in range(3):
        w.push(g, wait=False)
    store.checkpoint(tmp_path / "ck")
    r = shmps.restore(tmp_path / "ck", new_name(names))
    try:
        a = r["w"].pull()
        assert (float(a.min()), float(a.max()), r["w"].stats()["step"]) == (3.0, 3.0, 3)
    finally:
        r.destroy()


_CHECKPOINT_AT_EXIT = r"""
import atexit
import sys

import numpy as np

import shmps

s = shmps.attach(sys.argv[1], namespace=sys.argv[2] or None)
w = s["w"]


def at_exit() -> None:
    s.clock()
    s.checkpoint(sys.argv[3])
    print("checkpointed", flush=True)


atexit.register(at_exit)
w.push(np.full(w.shape, -1.0, np.float32), wait=False)
"""


@pytest.mark.timeout(120)
def test_a_checkpoint_in_an_atexit_handler_after_pushes_with_wait_false(store, tmp_path,
                                                                      names):
    """store.checkpoint() (and clock()) in an atexit handler of a process that pushed
    with wait=False: concurrent.futures shuts the store's push thread's pool down at
    interpreter exit, before atexit handlers run (having applied what was queued), so
    the wait for this process's pushes must not submit to it.  It did: checkpoint()
    raised RuntimeError 'cannot schedule new futures after shutdown' and nothing was
    saved (since the checkpoint began to wait for those pushes)."""
    w = store.dense("w", shape=(256, 256), dtype="float32", optimizer=shmps.SGD(lr=1.0))
    ck = tmp_path / "ck"
    out = subprocess.run([sys.executable, "-c", _CHECKPOINT_AT_EXIT, store.name,
                          store.namespace or "", str(ck)], env=child_env(),
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0 and "checkpointed" in out.stdout, out.stderr
    assert "Error" not in out.stderr, out.stderr
    r = shmps.restore(ck, new_name(names))
    try:
        a = r["w"].pull()
        assert (float(a.min()), float(a.max()), r["w"].stats()["step"]) == (1.0, 1.0, 1)
    finally:
        r.destroy()
    assert float(w.pull().min()) == 1.0
