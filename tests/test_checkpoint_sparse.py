"""Checkpoints of tables and csr tensors: exact save/restore (values, optimizer state,
per-row steps, push counts, index, free lists), checkpoints during pushes, and corrupt
region files.  Every test destroys the stores it made and kills its processes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

import shmps
from shmps import _native, files
from shmps.errors import CorruptFile

SHM = "/dev/shm"
ROOT = str(Path(shmps.__file__).resolve().parents[1])

CASES = [  # (optimizer, dtype, shards)
    (shmps.Sum(), "int8", 1),
    (shmps.Assign(), "int32", 3),
    (shmps.Max(), "float16", 2),
    (shmps.Min(), "float64", 3),
    (shmps.SGD(lr=0.1, weight_decay=0.01), "float32", 4),
    (shmps.Momentum(lr=0.1, momentum=0.9, nesterov=True), "float64", 3),
    (shmps.Adagrad(lr=0.1, initial_accumulator_value=0.5), "float16", 2),
    (shmps.Adam(lr=0.01, amsgrad=True, weight_decay=0.01), "float32", 3),
    (shmps.Adam(lr=0.01), "float64", 1),
    (shmps.FTRL(alpha=0.5, beta=1.0, l1=0.1, l2=0.1), "float32", 3),
]


def drop(name: str) -> None:
    for n in os.listdir(SHM):
        if n.startswith(f"shmps.{name}."):
            try:
                os.unlink(os.path.join(SHM, n))
            except FileNotFoundError:
                pass


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


def grads(t: Any, rng: np.random.Generator, n: int) -> np.ndarray:
    if t.dtype.kind == "f":
        return rng.uniform(-1, 1, (n, t.dim if hasattr(t, "dim") else n)).astype(np.float32)
    return rng.integers(-3, 4, (n, t.dim)).astype(t.dtype)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_same_table(t: Any, u: Any) -> None:
    k = np.sort(t.keys())
    assert same(k, np.sort(u.keys()))
    assert len(t) == len(u)
    assert same(t.pull(k, create=False), u.pull(k, create=False))
    probe = np.arange(0, 400, dtype=np.uint64)
    assert same(t.contains(probe), u.contains(probe))
    st, su = t.row_stats(k), u.row_stats(k)
    assert st.keys() == su.keys()
    for f in st:
        assert same(st[f], su[f]), f


@pytest.mark.parametrize("upd,dtype,nshards", CASES,
                         ids=[f"{type(u).__name__}-{d}-{s}" for u, d, s in CASES])
def test_table_roundtrip_is_exact(store, tmp_path, names, upd, dtype, nshards):
    """A table restores exactly: keys, len, rows, stats, and the same future under pushes."""
    rng = np.random.default_rng(7)
    init = ("uniform", -1.0, 1.0) if np.dtype(dtype).kind == "f" else 1
    t = store.table("e", dim=5, dtype=dtype, capacity=300, optimizer=upd, init=init,
                    seed=3, shards=nshards)
    for b in range(6):
        k = rng.integers(0, 250, 80).astype(np.uint64)  # duplicates within a batch
        t.push(k, grads(t, rng, k.size))
        if b == 2:
            t.delete(rng.integers(0, 250, 30).astype(np.uint64))
        if b == 4:
            t.evict(min_pushes=2)
    t.delete(np.arange(0, 10, dtype=np.uint64))
    path = tmp_path / "ck"
    store.checkpoint(path)
    r = shmps.restore(path, new_name(names))
    u = r["e"]
    u.check()
    assert u.stats()["step"] == t.stats()["step"]
    assert_same_table(t, u)
    for _ in range(2):  # existing and new keys: reuses free rows, same steps and state
        k = np.concatenate([rng.integers(0, 250, 40), rng.integers(1000, 1100, 20)]
                           ).astype(np.uint64)
        g = grads(t, rng, k.size)
        t.push(k, g)
        u.push(k, g)
        assert same(t.pull(k), u.pull(k))
    assert_same_table(t, u)
    u.check()
    r.destroy()


@pytest.mark.parametrize("upd,dtype", [(shmps.Sum(), "int32"), (shmps.Max(), "float16"),
                                       (shmps.Adam(lr=0.01, amsgrad=True), "float32"),
                                       (shmps.FTRL(alpha=0.5, beta=1.0), "float64"),
                                       (shmps.Momentum(lr=0.1, momentum=0.9), "float32")])
def test_csr_roundtrip_is_exact(store, tmp_path, names, upd, dtype):
    """A csr tensor restores exactly (values, state, row steps) and evolves identically."""
    rng = np.random.default_rng(11)
    nrows, ncols = 40, 30
    mask = rng.random((nrows, ncols)) < 0.2
    mask[5] = False  # an empty row
    rc = np.concatenate([[0], np.cumsum(mask.sum(1))]).astype(np.int64)
    ci = np.nonzero(mask)[1].astype(np.int64)
    c = store.csr("m", rc, ci, dtype=dtype, init=1, optimizer=upd, shard_rows=7)
    assert c.nshards == 6

    def push(t: Any, g: np.ndarray) -> None:
        t.push(shmps.CSR(rc, ci, g))

    gdt = np.float32 if np.dtype(dtype).kind == "f" else dtype
    for _ in range(3):
        push(c, rng.integers(-3, 4, ci.size).astype(gdt))
    path = tmp_path / "ck"
    store.checkpoint(path)
    ms = files.read_csr(path / "t0")  # a readable csr file set (shmps-tool dump)
    assert same(np.asarray(ms.csr.value), c.pull().value)
    assert same(np.asarray(ms.csr.rowcnt), rc)
    r = shmps.restore(path, new_name(names))
    d = r["m"]
    a, b = c.pull(), d.pull()
    assert same(a.rowcnt, b.rowcnt) and same(a.colidx, b.colidx) and same(a.value, b.value)
    g = rng.integers(-3, 4, ci.size).astype(gdt)
    push(c, g)
    push(d, g)
    assert same(c.pull().value, d.pull().value)
    r.destroy()


PUSHER = r"""
import sys, numpy as np, shmps
s = shmps.attach(sys.argv[1]); t = s.table("e")
rng = np.random.default_rng(int(sys.argv[3]))
print("ready", flush=True)
import json
import os
import re
while not os.path.exists(sys.argv[2]):
    k = rng.integers(0, 5000, 64).astype(np.uint64)
    t.push(k, np.ones((64, t.dim), np.float32))
s.close()
"""


def test_table_checkpoint_during_pushes_restores_consistent(store, tmp_path, names, procs):
    """A table checkpointed while another process pushes (creating keys) restores and checks."""
    t = store.table("e", dim=8, capacity=6000, optimizer=shmps.Adam(lr=0.01), shards=4)
    stop = tmp_path / "stop"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs.append(subprocess.Popen([sys.executable, "-c", PUSHER, store.name, str(stop), "1"],
                                  stdout=subprocess.PIPE, text=True, env=env))
    assert procs[0].stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 30
    while len(t) < 300:
        assert time.monotonic() < deadline, "the pusher never pushed"
        time.sleep(0.005)
    for i in range(3):
        store.checkpoint(tmp_path / f"ck{i}")
    stop.touch()
    assert procs[0].wait(timeout=30) == 0
    for i in range(3):
        r = shmps.restore(tmp_path / f"ck{i}", new_name(names))
        u = r["e"]
        u.check()
        assert len(u) == len(u.keys()) > 0
        k = np.sort(u.keys())
        assert (u.row_stats(k)["pushes"] > 0).all()
        u.push(np.arange(6000, 6010, dtype=np.uint64), np.ones((10, 8), np.float32))
        u.check()
        r.destroy()
    t.check()


@pytest.mark.parametrize("victim,how", [("t0.s1.index", "truncate"), ("t0.s0.links", "delete"),
                                        ("t0.s2.ctl", "zero"), ("t1.s0.stripes", "truncate"),
                                        ("t1.colidx", "truncate")])
def test_corrupt_region_file_raises_and_creates_nothing(store, tmp_path, names, victim, how):
    """A damaged region file: restore raises CorruptFile before creating any segment."""
    t = store.table("e", dim=3, capacity=100, shards=3)
    t.push(np.arange(50, dtype=np.uint64), np.ones((50, 3), np.float32))
    store.csr("m", [0, 2, 3], [0, 1, 1])
    path = tmp_path / "ck"
    store.checkpoint(path)
    f = path / victim
    if how == "truncate":
        f.write_bytes(f.read_bytes()[:-8])
    elif how == "delete":
        f.unlink()
    else:
        f.write_bytes(bytes(len(f.read_bytes())))
    name = new_name(names)
    with pytest.raises(CorruptFile):
        shmps.restore(path, name)
    assert not [n for n in os.listdir(SHM) if n.startswith(f"shmps.{name}.")]


@pytest.mark.parametrize("tensor,edit,needle", [
    ("e", lambda e: e["shards"][1].update(step=2**64), 'field "shards[1].step" = 18446744073'),
    ("e", lambda e: e["shards"][0].update(table_used=2**64), 'field "shards[0].table_used"'),
    ("m", lambda e: e["shards"][0].update(step=-1), 'field "shards[0].step" = -1 is not'),
    ("m", lambda e: e["record"].update(shape=[2, 2**64]), "shape [2, 18446744073709551616]"),
    ("m", lambda e: e["record"].update(shard_rows=0), "shard_rows 0 and nshards 1"),
], ids=["table step", "table_used", "csr step", "csr cols", "csr shard_rows 0"])
def test_out_of_range_words_are_refused_before_force(store, tmp_path, names, tensor, edit,
                                                     needle):
    """An integer of checkpoint.json that goes to C out of range (a shard's step or
    table_used, a csr's shape or shard_rows) is a CorruptFile naming the field, raised
    before restore --force destroys the old store (a step of 2**64 was an internal
    OverflowError after the old store was gone)."""
    t = store.table("e", dim=3, capacity=100, shards=3)
    t.push(np.arange(50, dtype=np.uint64), np.ones((50, 3), np.float32))
    store.csr("m", [0, 2, 3], [0, 1, 1])
    path = tmp_path / "ck"
    store.checkpoint(path)
    doc = json.loads((path / "checkpoint.json").read_text())
    edit(next(e for e in doc["tensors"] if e["record"]["name"] == tensor))
    (path / "checkpoint.json").write_text(json.dumps(doc))
    name = new_name(names)
    with pytest.raises(CorruptFile, match=re.escape(needle)):
        shmps.restore(path, name)
    assert not [n for n in os.listdir(SHM) if n.startswith(f"shmps.{name}.")]
    with pytest.raises(CorruptFile, match=re.escape(needle)):
        shmps.restore(path, store.name, force=True)
    again = shmps.attach(store.name)  # a new handle: the old one keeps unlinked mappings
    try:
        assert sorted(d["name"] for d in again.tensors()) == ["e", "m"]
    finally:
        again.close()


# (tensor, region file, which uint64 word of it: "live" row 0, "fresh" the last row
# slot, never handed out, "empty" csr row 1, which has no entries; + 2 * row + 1 for a
# row's second stripe word, its aux), the word written, what the refusal says
STATS_EDITS = [
    ("e", "rowstep", ("live", 0), 7, "but its updater Sum keeps no per-row step"),
    ("a", "rowstep", ("fresh", 0), 3, "never handed out"),
    ("a", "stripes", ("fresh", 1), 5 << 40, "never handed out"),
    ("a", "stripes", ("fresh", 0), 1 << 40, "never handed out"),
    ("a", "rowstep", ("live", 0), 2**64 - 1, "more pushes than a row can have"),
    ("m", "rowstep", ("live", 0), 2**63, "more pushes than a row can have"),
    ("m", "rowstep", ("empty", 0), 1, "has no entries"),
    ("m", "stripes", ("empty", 1), 2, "has no entries"),
    ("m", "stripes", ("live", 1), 1 << 32, "bits 63-32 of its seqlock word"),
]


@pytest.mark.parametrize("tensor,region,word,value,needle", STATS_EDITS,
                         ids=[f"{t}-{r}-{w[0]}{w[1]}" for t, r, w, _, _ in STATS_EDITS])
def test_impossible_row_statistics_are_refused_before_force(store, tmp_path, names, tensor,
                                                            region, word, value, needle):
    """Per-row statistics the C core never writes (a step on a table whose updater keeps
    none, statistics on a row slot never handed out or a csr row without entries, a step
    that would wrap to 0 at the next push, a csr row's unused stripe bits) were restored as
    they were, the values and keys right: restore refuses them (CorruptFile naming the
    file, row and what is wrong, with the checkpoint hint) before it creates anything or
    destroys a store that --force would replace."""
    e = store.table("e", dim=3, capacity=100, shards=3)
    e.push(np.arange(50, dtype=np.uint64), np.ones((50, 3), np.float32))
    a = store.table("a", dim=2, capacity=100, shards=2, optimizer=shmps.Adam(lr=0.1))
    a.push(np.arange(30, dtype=np.uint64), np.ones((30, 2), np.float32))
    m = store.csr("m", [0, 2, 2, 3], [0, 1, 1], dtype="float32")
    m.push(shmps.CSR([0, 2, 2, 3], [0, 1, 1], np.ones(3, np.float32)))
    path = tmp_path / "ck"
    store.checkpoint(path)
    shmps.restore(path, new_name(names)).destroy()   # as written, it restores
    doc = json.loads((path / "checkpoint.json").read_text())
    prefix = next(e["prefix"] for e in doc["tensors"] if e["record"]["name"] == tensor)
    f = path / f"{prefix}.s0.{region}"
    words = np.fromfile(f, np.uint64)
    nrows = np.fromfile(path / f"{prefix}.s0.rowstep", np.uint64).size
    if tensor == "m":
        row = {"live": 0, "empty": 1}[word[0]]
    else:
        hwm = int(np.fromfile(path / f"{prefix}.s0.ctl", np.uint64)[11])
        assert 0 < hwm < nrows
        row = {"live": 0, "fresh": nrows - 1}[word[0]]
    at = row if region == "rowstep" else 2 * row + word[1]
    words[at] = value
    words.tofile(f)
    name = new_name(names)
    with pytest.raises(CorruptFile, match=re.escape(needle)) as info:
        shmps.restore(path, name)
    assert str(f) in str(info.value) and f"row {row}" in str(info.value), info.value
    assert info.value.hint == files._CKPT_HINT
    assert not [n for n in os.listdir(SHM) if n.startswith(f"shmps.{name}.")]
    with pytest.raises(CorruptFile, match=re.escape(needle)):
        shmps.restore(path, store.name, force=True)
    again = shmps.attach(store.name)  # a new handle: the old one keeps unlinked mappings
    try:
        assert sorted(d["name"] for d in again.tensors()) == ["a", "e", "m"]
        assert again["e"].pull(np.arange(50, dtype=np.uint64)).tolist() == \
            e.pull(np.arange(50, dtype=np.uint64)).tolist()
    finally:
        again.close()


def test_checkpoint_of_impossible_row_statistics_is_refused_and_keeps_the_old_one(
        store, tmp_path, names):
    """Row statistics damaged in shared memory (a step on a table row never handed out)
    made `checkpoint` write and swap in a checkpoint restore refuses, deleting the good
    one at the path.  The checkpoint runs restore's own checks (_plan_sparse) on what it
    wrote and refuses (CorruptSegment naming the tensor, row and what is wrong); the old
    checkpoint still restores, and a new one is written once the word is repaired."""
    e = store.table("e", dim=3, capacity=100, shards=1)
    keys = np.arange(10, dtype=np.uint64)
    e.push(keys, np.ones((10, 3), np.float32))
    path = tmp_path / "ck"
    store.checkpoint(path)
    spec = e._shards[0].spec
    steps = e._shards[0].seg.array(np.uint64, spec["rowstep_off"], spec["nrows"])
    last = spec["nrows"] - 1
    assert steps[last] == 0
    steps[last] = 7
    try:
        with pytest.raises(shmps.CorruptSegment, match=re.escape(
                f"table tensor 'e' in shared memory is not what shmps writes (t{e.record['id']}"
                f".s0.rowstep: row {last} of shard 0 of table 'e' was never handed out")):
            store.checkpoint(path)
        assert sorted(os.listdir(tmp_path)) == ["ck"]   # no temporary directory left
    finally:
        steps[last] = 0
    q = shmps.restore(path, new_name(names))   # the old checkpoint, whole
    try:
        assert q["e"].pull(keys, create=False).tolist() == [[1.0] * 3] * 10
    finally:
        q.destroy()
    store.checkpoint(path)   # repaired: written again


@pytest.mark.parametrize("tensor,region,at,needle", [
    ("e", "stripes", 0, "row 0 of shard 0 of table 'e' is locked by live process"),
    ("e", "ctl", 8, "word 8 of shard 0 of table 'e', the table's creation lock, is held by"),
    ("m", "stripes", 2, "row 1 of shard 0 of csr 'm' is locked by live process"),
], ids=["table row", "table creation", "csr row"])
def test_a_lock_word_of_a_live_process_is_refused(store, tmp_path, names, tensor, region, at,
                                                 needle):
    """A checkpoint keeps the lock words of dead holders only (saving clears live ones), so
    the restored store takes them over.  One naming a live process was restored as it was,
    and that lock is never released: every push to the row, or every key creation, waited
    and timed out.  Restore refuses it (CorruptFile naming the file) before creating
    anything."""
    e = store.table("e", dim=3, capacity=100)
    e.push(np.arange(5, dtype=np.uint64), np.ones((5, 3), np.float32))
    store.csr("m", [0, 2, 3], [0, 1, 1])
    path = tmp_path / "ck"
    store.checkpoint(path)
    prefix = {"e": "t0", "m": "t1"}[tensor]
    f = path / f"{prefix}.s0.{region}"
    words = np.fromfile(f, np.uint64)
    assert words[at] == 0
    words[at] = _native.token()   # this process: alive
    words.tofile(f)
    name = new_name(names)
    with pytest.raises(CorruptFile, match=re.escape(needle)) as info:
        shmps.restore(path, name)
    assert str(f) in str(info.value) and f"{os.getpid()}" in str(info.value), info.value
    assert not [n for n in os.listdir(SHM) if n.startswith(f"shmps.{name}.")]


@pytest.mark.parametrize("victim,scramble,what", [
    ("t0.s0.keys", "reverse", "an index entry's key differs from the key of its row"),
    ("t0.s0.index", "reverse", "the rows marked in use do not match the index entries"),
    ("t0.s1.links", "zero", "a row the index uses is not marked in use"),
])
def test_damaged_table_index_is_reported_in_user_terms(store, tmp_path, names, victim,
                                                       scramble, what):
    """Region files of the right size but inconsistent contents: the restore's table check
    refuses them with a message naming the table, shard and files and saying what is
    wrong (not "invariant N broken"), with the checkpoint hint (use another checkpoint),
    not the file-set one; no store is left, and a store that --force would replace is
    left as it was (the index is checked before the old store is destroyed)."""
    t = store.table("e", dim=3, capacity=100, shards=3)
    t.push(np.arange(50, dtype=np.uint64), np.ones((50, 3), np.float32))
    path = tmp_path / "ck"
    store.checkpoint(path)
    f = path / victim
    a = np.fromfile(f, np.uint64)
    (a[::-1] if scramble == "reverse" else np.zeros_like(a)).tofile(f)
    name = new_name(names)
    with pytest.raises(CorruptFile) as info:
        shmps.restore(path, name)
    msg, shard = str(info.value), victim.split(".")[1][1:]
    assert "invariant" not in msg and what in msg, msg
    assert f"table 'e', shard {shard}" in msg and str(path / f"t0.s{shard}") in msg, msg
    assert info.value.hint == files._CKPT_HINT and "use another checkpoint" in msg
    assert not [n for n in os.listdir(SHM) if n.startswith(f"shmps.{name}.")]
    before = t.pull(np.arange(50, dtype=np.uint64))
    with pytest.raises(CorruptFile, match=what):
        shmps.restore(path, store.name, force=True)
    again = shmps.attach(store.name)  # a new handle: the old one keeps unlinked mappings
    try:
        assert again["e"].pull(np.arange(50, dtype=np.uint64)).tolist() == before.tolist()
    finally:
        again.close()


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    """Child processes of a test; killed and reaped afterwards, whatever happened."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def test_checkpoint_of_a_table_whose_index_is_damaged_is_refused_and_keeps_the_old_one(
        store, tmp_path, names):
    """A table whose index is damaged in shared memory (the key word of a row in use no
    longer matches its index entry) made `checkpoint` succeed and swap in a checkpoint
    that restore refuses ("its saved index is inconsistent"), deleting the good checkpoint
    at the path.  The checkpoint runs restore's index check on the files it wrote and
    refuses (CorruptSegment, naming the table and shard) before anything is installed; the
    old checkpoint still restores, and so does a new one once the word is repaired."""
    t = store.table("e", dim=2, capacity=64, shards=2, optimizer=shmps.Adam(lr=0.1))
    keys = np.arange(1, 21, dtype=np.uint64)
    t.push(keys, np.ones((20, 2), np.float32))
    before = t.pull(keys, create=False)
    path = tmp_path / "ck"
    store.checkpoint(path)
    sh = next(i for i in range(2) if _native.stats(t._shards[i].ptr)["rows_used"])
    spec = t._shards[sh].spec
    row_keys = t._shards[sh].seg.array(np.uint64, spec["colidx_off"], 1)   # row 0's key
    good = int(row_keys[0])
    row_keys[0] = good ^ (1 << 40)
    try:
        with pytest.raises(shmps.CorruptSegment,
                           match=rf"table tensor 'e' in shared memory is not what shmps "
                                 rf"writes \(table 'e', shard {sh}: its saved index is "
                                 "inconsistent"):
            store.checkpoint(path)
        r = subprocess.run([sys.executable, "-m", "shmps.cli", "checkpoint", store.name,
                            str(path)], env=dict(os.environ, PYTHONPATH=ROOT),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert sorted(os.listdir(tmp_path)) == ["ck"]   # no temporary directory left
    finally:
        row_keys[0] = good
    name = new_name(names)
    q = shmps.restore(path, name)   # the old checkpoint, whole
    try:
        assert q["e"].pull(keys, create=False).tolist() == before.tolist()
    finally:
        q.destroy()
    store.checkpoint(path)   # repaired: written again


def test_a_saved_index_is_checked_one_shard_at_a_time(store, tmp_path, names, monkeypatch):
    """Restore's check of a table's saved index (and the checkpoint's of what it wrote)
    lays out shard 0 and one other shard at a time in private memory, not every shard's
    index at once (about 140 B a key of the whole table, held together: the last note's
    left item), and still finds a damaged index in the last shard, naming it."""
    from shmps import checkpoint as ck
    from shmps.segment import Segment

    open_now, most = [0], [0]

    class Counted(Segment):   # (observes the private images; changes nothing)
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            open_now[0] += 1
            most[0] = max(most[0], open_now[0])

        def close(self) -> None:
            if self.mm is not None:
                open_now[0] -= 1
            super().close()

    t = store.table("e", dim=2, capacity=256, shards=4, optimizer=shmps.Adam(lr=0.1))
    keys = np.arange(1, 101, dtype=np.uint64)
    t.push(keys, np.ones((100, 2), np.float32))
    before = t.pull(keys, create=False)
    assert all(_native.stats(t._shards[i].ptr)["rows_used"] for i in range(4))
    monkeypatch.setattr(ck, "Segment", Counted)
    path = tmp_path / "ck"
    store.checkpoint(path)
    assert most[0] == 2 and open_now[0] == 0, (most, open_now)
    most[0] = 0
    q = shmps.restore(path, new_name(names))
    try:
        assert q["e"].pull(keys, create=False).tolist() == before.tolist()
    finally:
        q.destroy()
    assert most[0] == 2 and open_now[0] == 0, (most, open_now)
    spec = t._shards[3].spec
    row_keys = t._shards[3].seg.array(np.uint64, spec["colidx_off"], 1)   # row 0's key
    good = int(row_keys[0])
    row_keys[0] = good ^ (1 << 40)
    try:
        with pytest.raises(shmps.CorruptSegment,
                           match=r"table 'e', shard 3: its saved index is inconsistent"):
            store.checkpoint(tmp_path / "ck2")
    finally:
        row_keys[0] = good
    assert open_now[0] == 0


def test_checkpoint_of_a_csr_tensor_whose_structure_is_damaged_is_refused(store, tmp_path,
                                                                          names):
    """A csr tensor whose column index is damaged in shared memory, still a valid structure
    (row 0's columns 0, 2 read 1, 2) but not the one in its record: `checkpoint` wrote it
    and swapped it in for the good checkpoint at the path, and restore refused it ("the
    structure differs from the record's").  The checkpoint compares the digest of the
    rowcnt/colidx files it wrote with the record's and refuses (CorruptSegment); the old
    checkpoint still restores."""
    rc, ci = np.array([0, 2, 3, 5, 5, 7]), np.array([0, 2, 1, 0, 3, 1, 2])
    c = store.csr("c", rc, ci, dtype="float32", init=np.arange(7.0), shard_rows=2)
    path = tmp_path / "ck"
    store.checkpoint(path)
    spec = c._shards[0].spec
    colidx = c._shards[0].seg.array(np.int64, spec["colidx_off"], spec["nnz"])
    assert colidx[0] == 0
    colidx[0] = 1
    try:
        with pytest.raises(shmps.CorruptSegment, match="csr tensor 'c' in shared memory "
                           "is not .* the structure differs from the record's"):
            store.checkpoint(path)
        assert sorted(os.listdir(tmp_path)) == ["ck"]
    finally:
        colidx[0] = 0
    q = shmps.restore(path, new_name(names))
    try:
        got = q["c"].pull()
        assert got.colidx.tolist() == ci.tolist() and got.value.tolist() == list(range(7))
    finally:
        q.destroy()
    store.checkpoint(path)
