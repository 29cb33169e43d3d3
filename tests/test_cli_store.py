"""shmps-tool store verbs (ls, gc, stats, checkpoint, restore, dump --store) through
real subprocesses.

Each test works in its own namespace, so ``gc`` never touches anyone else's stores;
every store and child process is removed in ``finally``/fixtures, also on failure.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from typing import Iterator

import numpy as np
import pytest

import shmps
import cli_runner
from helpers import child_env, other_pid_ns_message

SHM = "/dev/shm"


def tool(*args: object, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``shmps-tool ARGS`` (``python -m shmps.cli``) in a process of its own, forked
    with the imports done (cli_runner)."""
    e = child_env()
    e.pop("SHMPS_NAMESPACE", None)
    e.update(env or {})
    return cli_runner.run("shmps.cli", args, env=e, timeout=120)


def ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0 and "Traceback" not in r.stderr, (r.returncode, r.stdout, r.stderr)
    return r.stdout


def one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, nothing on stdout, one ``shmps-tool: error:`` line holding the needles."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("shmps-tool: error: "), r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def segments(name: str, ns: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM) if n.startswith(f"shmps.{ns}.{name}."))


@pytest.fixture
def ns() -> Iterator[str]:
    """A namespace of this test's own; every segment in it is removed afterwards."""
    space = f"n{uuid.uuid4().hex[:10]}"
    yield space
    remove_namespace(space)


def remove_namespace(space: str) -> None:
    """Unlink every segment of namespace ``space``."""
    for n in os.listdir(SHM):
        if n.startswith(f"shmps.{space}."):
            try:
                os.unlink(os.path.join(SHM, n))
            except FileNotFoundError:
                pass


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


HOLDER = """
import sys, shmps
s = shmps.attach(sys.argv[1], namespace=sys.argv[2])
s.dense("w", shape=(8, 4), dtype="float32", init=1.0)
print("attached", flush=True)
if sys.argv[3] == "hold":
    sys.stdin.read()  # stay attached until the test closes stdin (or kills us)
    s.close()
else:
    s.close()  # exits without destroy(): the store is left with no live process
"""


def spawn_holder(procs: list, name: str, ns: str, mode: str) -> subprocess.Popen:
    env = child_env()
    p = subprocess.Popen([sys.executable, "-c", HOLDER, name, ns, mode], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    procs.append(p)
    assert p.stdout.readline().strip() == "attached"
    return p


# ---- ls -----------------------------------------------------------------------------------

def test_ls_shows_stores_tensors_and_live_pids(ns):
    """`ls` and `ls --json` show the store, its tensors and its live processes' pids."""
    s = shmps.attach("model", namespace=ns)
    try:
        s.dense("fc.w", shape=(16, 4), dtype="float32", optimizer=shmps.Adam())
        s.dense("steps", shape=(3,), dtype="int32")
        text = ok(tool("ls", "--namespace", ns))
        head = [ln for ln in text.splitlines() if ln.startswith("model ")][0]
        assert f"namespace {ns}" in head and "2 tensors" in head
        assert f"live processes: {os.getpid()}" in head
        assert any(ln.split()[:5] == ["fc.w", "dense", "float32", "16x4", "Adam"]
                   for ln in text.splitlines())
        assert any(ln.split()[:5] == ["steps", "dense", "int32", "3", "Sum"]
                   for ln in text.splitlines())
        doc = json.loads(ok(tool("ls", "--namespace", ns, "--json")))
        (st,) = [x for x in doc["stores"] if x["store"] == "model"]
        assert st["namespace"] == ns and st["pids"] == [os.getpid()] and st["error"] is None
        assert [(t["name"], t["kind"], t["dtype"], t["shape"], t["optimizer"])
                for t in st["tensors"]] == [("fc.w", "dense", "float32", [16, 4], "Adam"),
                                            ("steps", "dense", "int32", [3], "Sum")]
        assert st["segments"] == len(segments("model", ns)) == 3
    finally:
        s.destroy()
    assert "model" not in ok(tool("ls", "--namespace", ns))


def test_ls_says_what_is_being_done_to_a_store(ns):
    """A store being restored, or whose removal was cut off, is not shown as if ready:
    `ls` says what, by which pid, and whether that process lives (a restore's store
    listed tensors that were not all in yet, with nothing to tell it from a ready one)."""
    from helpers import dead_token, own_token, poke, remove_store

    with shmps.attach("model", namespace=ns) as s:
        s.dense("w", shape=(4,))
    path = f"{SHM}/shmps.{ns}.model.manifest"
    try:
        assert "being" not in ok(tool("ls", "--namespace", ns))
        doc = json.loads(ok(tool("ls", "--namespace", ns, "--json")))
        assert (doc["stores"][0]["state"], doc["stores"][0]["state_pid"]) == ("ready", None)
        poke(path, 400, "<Q", own_token())   # retired_by: this (live) process
        poke(path, 32, "<I", 3)              # RESTORING
        text = ok(tool("ls", "--namespace", ns))
        assert f"being restored by pid {os.getpid()}: its tensors are not all in yet" \
            in text, text
        doc = json.loads(ok(tool("ls", "--namespace", ns, "--json")))
        assert (doc["stores"][0]["state"], doc["stores"][0]["state_pid"]) == \
            ("restoring", os.getpid())
        dead = dead_token()
        poke(path, 400, "<Q", dead)
        poke(path, 32, "<I", 2)              # REMOVED, its remover dead
        text = ok(tool("ls", "--namespace", ns))
        assert (f"a removal cut off (pid {dead >> 32} died): the next attach or gc "
                "removes the store") in text, text
    finally:
        remove_store("model", ns)


# ---- gc -----------------------------------------------------------------------------------

def test_gc_removes_only_stores_without_live_processes(ns, procs):
    """`gc` removes a store its exited creator left, keeps a live one's, spares young ones."""
    spawn_holder(procs, "dead", ns, "exit").wait(timeout=30)
    holder = spawn_holder(procs, "alive", ns, "hold")
    dead_segs, alive_segs = segments("dead", ns), segments("alive", ns)
    assert len(dead_segs) == 2 and len(alive_segs) == 2
    # both are younger than the minimum age: nothing is touched (an hour here: the
    # default 5 s passed under load between the spawn and the gc, and it removed "dead")
    young = {"SHMPS_GC_MIN_AGE": "3600"}
    r = tool("gc", "--namespace", ns, env=young)
    assert ok(r).strip() == "nothing to remove"
    # ... and says on stderr which idle store it spared and why (it said nothing: a user
    # whose `ls` showed "live processes: none" was left guessing), and the command that
    # removes it names its namespace (without --namespace, a gc covers every namespace:
    # the command said removed the young idle stores of all of them)
    assert r.stderr.splitlines() == [
        f"spared store dead (namespace {ns}): no live process, but younger than 3600 s (a "
        f"process may be attaching it; SHMPS_GC_MIN_AGE=0 shmps-tool gc --namespace {ns} "
        "removes it now)"]
    now = {"SHMPS_GC_MIN_AGE": "0"}
    dry = ok(tool("gc", "--dry-run", "--namespace", ns, env=now))
    assert dry.splitlines() == [f"would remove store dead (namespace {ns}): 2 segments"]
    assert segments("dead", ns) == dead_segs  # dry run: still there
    assert f"would remove store dead (namespace {ns})" in ok(tool("gc", "--dry-run", env=now))
    out = ok(tool("gc", "--namespace", ns, env=now))
    assert out.splitlines() == [f"removed store dead (namespace {ns}): 2 segments"]
    assert segments("dead", ns) == [] and segments("alive", ns) == alive_segs
    # once its last process is gone, the other one goes too
    holder.stdin.close()
    assert holder.wait(timeout=30) == 0
    assert "removed store alive" in ok(tool("gc", "--namespace", ns, env=now))
    assert segments("alive", ns) == []
    one_line_error(tool("gc", "--namespace", ns, env={"SHMPS_GC_MIN_AGE": "soon"}),
                   "SHMPS_GC_MIN_AGE='soon'")


def test_gc_leaves_a_live_restorers_new_manifest_alone(ns, procs):
    """restore --force makes the new manifest under a temporary name and renames it over
    the store's once the old store's creations have ended and its shards are gone (up
    to a minute): gc must not take it for an orphan while the restorer lives, or the
    rename failed.  A dead restorer's is an orphan like any other."""
    from shmps import names, segment

    live = names.restore_manifest_name("st", ns, os.getpid())
    dead_pid = spawn_holder(procs, "x", ns, "exit").pid
    procs[-1].wait(timeout=30)
    dead = names.restore_manifest_name("st", ns, dead_pid)
    for n in (live, dead):
        segment.Segment.create(n, 4096, reserve=False).close()
    try:
        listed = ok(tool("ls", "--namespace", ns))
        assert f"restore in progress (pid {os.getpid()}), its new manifest: {live}" \
            in listed, listed
        assert f"orphan segment (no store): {dead}" in listed, listed
        out = ok(tool("gc", "--namespace", ns, env={"SHMPS_GC_MIN_AGE": "0"}))
        assert os.path.exists(SHM + live), out
        assert not os.path.exists(SHM + dead), out
    finally:
        for n in (live, dead):
            segment.unlink(n)


def test_gc_judges_a_restorers_new_manifest_by_the_token_in_it(ns, tmp_path):
    """A restore --force killed after it made its new manifest (`…manifest.restore-PID`)
    leaves it behind, RESTORING under the dead restorer's token.  Its PID reused by an
    unrelated live process (here: renamed to this test's pid) does not make it a restore
    in progress: gc judged by the pid in the name and kept it for as long as that
    process lived.  By the token inside it goes, as the orphan it is."""
    from helpers import fork_dying_at_unlink
    from shmps import names

    with shmps.attach("st", namespace=ns) as s:
        s.dense("w", shape=(8, 4), shard_rows=1, init=1.0)
        s.checkpoint(tmp_path / "ck")
    holder = shmps.attach("st", namespace=ns)   # (restore --force of a store in use)
    try:
        pid = fork_dying_at_unlink(0, lambda: shmps.restore(tmp_path / "ck", "st", namespace=ns,
                                                            force=True), ".t0.s")
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        holder.close()
    left = names.restore_manifest_name("st", ns, pid)
    assert os.path.exists(SHM + left)
    reused = names.restore_manifest_name("st", ns, os.getpid())   # a live pid, not its maker
    os.rename(SHM + left, SHM + reused)
    listed = ok(tool("ls", "--namespace", ns))
    assert f"orphan segment (no store): {reused}" in listed, listed
    out = ok(tool("gc", "--namespace", ns, env={"SHMPS_GC_MIN_AGE": "0"}))
    assert not os.path.exists(SHM + reused), out
    assert segments("st", ns) == [], out


def left_restore_manifest(ns: str, store: str) -> tuple[int, str]:
    """The new manifest of a forced restore whose process died right after making it (as
    Store._renew_for_restore makes it): (that process's pid, the manifest's name)."""
    from shmps import _native, names
    from shmps.segment import Segment
    from shmps.store import MANIFEST_RESERVED, MANIFEST_SIZE

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            name = names.restore_manifest_name(store, ns, os.getpid())
            seg, _ = Segment.open_or_create(name, MANIFEST_SIZE, reserve=MANIFEST_RESERVED)
            ident = names.manifest_ident(store, ns)
            code = _native.lib.shmps_manifest_init(seg.ptr, seg.size, _native.token(), 2.0,
                                                   ident, len(ident), 1)
        finally:
            os._exit(3 if code else 0)
    os.close(w)
    os.close(r)
    assert os.waitpid(pid, 0)[1] == 0
    return pid, names.restore_manifest_name(store, ns, pid)


def test_gc_leaves_a_restore_of_another_pid_namespace_alone(ns):
    """A forced restore's new manifest made by a process of another PID namespace (its
    pid_ns not this process's): the pid in its name, and its token, mean nothing here;
    gc judged by the pid and removed it (the restore's rename then failed).  gc leaves
    it with a message, and ls says whose it is; both say what to do."""
    from helpers import poke

    pid, left = left_restore_manifest(ns, "st")
    theirs = int(shmps._native.lib.shmps_self_pid_ns()) + 1
    poke(SHM + left, 408, "<Q", theirs)   # pid_ns: another namespace's
    listed = ok(tool("ls", "--namespace", ns))
    assert re.search(re.escape(f"restore in another PID namespace, its new manifest: {left}\n")
                     + "  " + other_pid_ns_message("a forced restore's new manifest", "ls")
                     + "\n", listed), listed
    out = tool("gc", "--namespace", ns, env={"SHMPS_GC_MIN_AGE": "0"})
    assert out.returncode == 0 and os.path.exists(SHM + left), (out.stdout, out.stderr)
    assert re.fullmatch(re.escape(f"skipped {left}: ")
                        + other_pid_ns_message("a forced restore's new manifest", "gc") + "\n",
                        out.stderr), out.stderr
    poke(SHM + left, 408, "<Q", int(shmps._native.lib.shmps_self_pid_ns()))   # ours again
    assert f"orphan segment (no store): {left}" in ok(tool("ls", "--namespace", ns))
    ok(tool("gc", "--namespace", ns, env={"SHMPS_GC_MIN_AGE": "0"}))
    assert not os.path.exists(SHM + left)


def test_ls_and_gc_agree_on_a_restorers_new_manifest(ns):
    """ls and gc take one verdict on a forced restore's new manifest: what ls calls an
    orphan gc removes, and what ls calls a restore in progress, or one of another PID
    namespace, gc leaves; by the token inside (alive, dead, another namespace's) or, in
    a manifest empty (size 0) or unreadable, by the pid in its name (alive or dead)."""
    from helpers import dead_token, poke
    from shmps import _native, names
    from shmps.segment import Segment, unlink
    from shmps.store import MANIFEST_RESERVED, MANIFEST_SIZE

    me, dead = os.getpid(), dead_token() >> 32
    made: dict[str, str] = {}   # segment -> the verdict expected of both
    try:
        # the token of a live restorer (this process), under a dead pid's name
        live = names.restore_manifest_name("token_live", ns, dead)
        seg, _ = Segment.open_or_create(live, MANIFEST_SIZE, reserve=MANIFEST_RESERVED)
        made[live] = f"restore in progress (pid {me})"
        try:
            ident = names.manifest_ident("token_live", ns)
            assert _native.lib.shmps_manifest_init(seg.ptr, seg.size, _native.token(), 2.0,
                                                   ident, len(ident), 1) == 0
        finally:
            seg.close()
        _, gone = left_restore_manifest(ns, "token_dead")   # a dead restorer's token
        made[gone] = "orphan"
        _, there = left_restore_manifest(ns, "token_there")
        poke(SHM + there, 408, "<Q", int(_native.lib.shmps_self_pid_ns()) + 1)
        made[there] = "restore in another PID namespace"
        for pid, verdict in ((me, f"restore in progress (pid {me})"), (dead, "orphan")):
            for size in (0, 4096):   # empty (its maker not at ftruncate yet), unreadable
                n = names.restore_manifest_name(f"s{size}", ns, pid)
                os.close(os.open(SHM + n, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
                os.truncate(SHM + n, size)
                made[n] = verdict
        listed = ok(tool("ls", "--namespace", ns))
        said = {line.rpartition(": ")[2]: ("orphan" if line.startswith("orphan segment")
                                            else line.partition(",")[0])
                for line in listed.splitlines()
                if line.startswith(("orphan segment", "restore in"))}
        assert said == made, listed
        out = tool("gc", "--namespace", ns, env={"SHMPS_GC_MIN_AGE": "0"})
        assert out.returncode == 0, out.stderr
        kept = {n: os.path.exists(SHM + n) for n in made}
        assert kept == {n: v != "orphan" for n, v in made.items()}, (out.stdout, out.stderr)
        assert out.stdout == "removed orphan segments: 3 segments\n", out.stdout
        assert re.fullmatch(re.escape(f"skipped {there}: ")
                            + other_pid_ns_message("a forced restore's new manifest", "gc")
                            + "\n", out.stderr), out.stderr
    finally:
        for n in made:
            unlink(n)


def test_ls_and_gc_agree_with_attach_on_a_store_being_created(ns):
    """A manifest of size 0 (its creator killed between shm_open and ftruncate), and one
    sized whose initialiser died: a store being created, or whose creation was cut off,
    as attach takes them (it waits, or takes the initialisation over), not unreadable:
    ls says so, gc leaves it while young and removes it after (it was skipped as
    corrupt, or with --corrupt unlinked even under an attach sizing it meanwhile)."""
    from helpers import dead_token, poke
    from shmps import names

    unsized = SHM + names.manifest_name("fresh", ns)
    cut = SHM + names.manifest_name("cut", ns)
    os.close(os.open(unsized, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    fd = os.open(cut, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, shmps.store.MANIFEST_SIZE)
    os.close(fd)
    dead = dead_token()
    poke(cut, 408, "<Q", int(shmps._native.lib.shmps_self_pid_ns()))   # pid_ns: ours
    poke(cut, 24, "<Q", dead)                                          # init_owner: dead
    text = ok(tool("ls", "--namespace", ns))
    assert "unreadable" not in text, text
    assert (f"fresh (namespace {ns}): 0 tensors, 0 B in 1 segments, live processes: none\n"
            "  being created: its manifest is not sized yet; if it stays so, its creator "
            "died (`shmps-tool gc` removes it)") in text, text
    assert (f"  a creation cut off (pid {dead >> 32} died): the next attach takes it over; "
            "gc removes it") in text, text
    doc = json.loads(ok(tool("ls", "--namespace", ns, "--json")))
    states = {x["store"]: (x["state"], x["state_pid"], x["error"]) for x in doc["stores"]}
    assert states == {"fresh": ("being created", None, None),
                      "cut": ("being created", dead >> 32, None)}, states
    young = {"SHMPS_GC_MIN_AGE": "3600"}
    assert ok(tool("gc", "--namespace", ns, env=young)).strip() == "nothing to remove"
    out = ok(tool("gc", "--namespace", ns, env={"SHMPS_GC_MIN_AGE": "0"}))
    assert sorted(out.splitlines()) == [f"removed store cut (namespace {ns}): 1 segments",
                                        f"removed store fresh (namespace {ns}): 1 segments"], out
    assert not os.path.exists(unsized) and not os.path.exists(cut)
    with pytest.raises(shmps.NotFound, match="no store"):
        shmps.attach("fresh", namespace=ns, create=False)


def test_gc_leaves_a_store_of_another_pid_namespace_alone(ns, procs):
    """A store made in another PID namespace sharing /dev/shm (a container of the same
    pod), with a live process there: its tokens' pids are not in this /proc, so all of
    them looked dead, and gc removed the store under that process.  gc skips it and
    says why; ls says its processes are unknown here; both say what to do."""
    from helpers import unshare_pid_command

    env = child_env()
    p = subprocess.Popen(unshare_pid_command() + [sys.executable, "-c", HOLDER, "there", ns, "hold"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    procs.append(p)
    assert p.stdout.readline().strip() == "attached"
    before = segments("there", ns)
    out = tool("gc", "--namespace", ns, env={"SHMPS_GC_MIN_AGE": "0"})
    assert segments("there", ns) == before and len(before) == 2, out.stdout
    assert re.fullmatch(re.escape(f"skipped store there (namespace {ns}): ")
                        + other_pid_ns_message("store 'there'", "gc") + "\n",
                        out.stderr), out.stderr
    listed = ok(tool("ls", "--namespace", ns))
    assert re.search(re.escape("live processes: unknown (made in another PID namespace)\n")
                     + "  " + other_pid_ns_message("store 'there'", "ls") + "\n",
                     listed), listed
    p.stdin.close()
    assert p.wait(timeout=30) == 0


def test_gc_leaves_a_store_remade_in_another_pid_namespace_since_its_scan_alone(
        ns, procs, monkeypatch, capsys):
    """gc scans and finds store "x" idle; before it removes it, "x" is destroyed and made
    anew by a live process of another PID namespace: gc's remove_idle refuses that store
    (all its processes would look dead from here) and gc says so, not "a process attached
    to it meanwhile".  remove_idle itself raises InvalidArgument for it."""
    from helpers import unshare_pid_command
    from shmps import cli, cli_store
    from shmps.store import remove_idle

    cmd = unshare_pid_command()
    env = child_env()
    spawn_holder(procs, "x", ns, "exit")      # ours, idle
    assert procs[-1].wait(timeout=30) == 0
    real_scan = cli_store.shm_inspect.scan

    def scan_then_remade_there(*a, **k):
        found = real_scan(*a, **k)
        shmps.attach("x", namespace=ns, create=False).destroy()
        p = subprocess.Popen(cmd + [sys.executable, "-c", HOLDER, "x", ns, "hold"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        procs.append(p)
        assert p.stdout.readline().strip() == "attached"
        return found

    monkeypatch.setenv("SHMPS_GC_MIN_AGE", "0")
    monkeypatch.delenv("SHMPS_NAMESPACE", raising=False)
    monkeypatch.setattr(cli_store.shm_inspect, "scan", scan_then_remade_there)
    assert cli.main(["gc", "--namespace", ns]) == 0
    monkeypatch.undo()
    out, err = capsys.readouterr()
    assert len(segments("x", ns)) == 2, (out, err)
    assert out.strip() == "nothing to remove", out
    assert "meanwhile" not in out + err
    assert re.fullmatch(re.escape(f"skipped store x (namespace {ns}): ")
                        + other_pid_ns_message("store 'x'", "gc") + "\n", err), err
    with pytest.raises(shmps.InvalidArgument, match=other_pid_ns_message("store 'x'", "gc")):
        remove_idle("x", ns)
    assert len(segments("x", ns)) == 2
    procs[-1].stdin.close()
    assert procs[-1].wait(timeout=30) == 0


def test_ls_and_gc_follow_shmps_namespace(ns, procs):
    """`ls` and `gc` default --namespace to $SHMPS_NAMESPACE like the other store verbs:
    with it set, stores of other namespaces are neither listed nor removed; `--namespace`
    still wins, and an empty variable means every namespace, as without it."""
    other = f"{ns}o"
    try:
        spawn_holder(procs, "mine", ns, "exit").wait(timeout=30)
        spawn_holder(procs, "theirs", other, "exit").wait(timeout=30)
        env = {"SHMPS_NAMESPACE": ns, "SHMPS_GC_MIN_AGE": "0"}
        text = ok(tool("ls", env=env))
        assert f"mine (namespace {ns})" in text and "theirs" not in text
        doc = json.loads(ok(tool("ls", "--json", env=env)))
        assert [(x["store"], x["namespace"]) for x in doc["stores"]] == [("mine", ns)]
        assert "theirs" in ok(tool("ls", "--namespace", other, env=env))
        both = ok(tool("ls", env={"SHMPS_NAMESPACE": ""}))
        assert "mine" in both and "theirs" in both
        dry = ok(tool("gc", "--dry-run", env=env))
        assert dry.splitlines() == [f"would remove store mine (namespace {ns}): 2 segments"]
        out = ok(tool("gc", env=env))
        assert out.splitlines() == [f"removed store mine (namespace {ns}): 2 segments"]
        assert segments("mine", ns) == [] and len(segments("theirs", other)) == 2
        one_line_error(tool("ls", env={"SHMPS_NAMESPACE": "bad/ns"}),
                       "invalid namespace (from $SHMPS_NAMESPACE) 'bad/ns'")
        one_line_error(tool("gc", "--dry-run", env={"SHMPS_NAMESPACE": "bad/ns"}),
                       "invalid namespace")
    finally:
        remove_namespace(other)


# ---- stats -----------------------------------------------------------------------------------

def test_stats_once_prints_counters_as_json(ns):
    """`stats STORE --once` prints each tensor's push/pull counts and step as JSON."""
    s = shmps.attach("st", namespace=ns)
    try:
        a = s.dense("a", shape=(4, 2), dtype="float32")
        b = s.dense("b", shape=(5,), dtype="int32")
        for _ in range(7):
            a.push(np.ones((4, 2)))
        a.push(np.ones((2, 2)), rows=[0, 3])
        for _ in range(3):
            a.pull()
        b.push(np.ones(5, np.int32))
        doc = json.loads(ok(tool("stats", "st", "--namespace", ns, "--once")))
        assert doc["store"] == "st" and set(doc["tensors"]) == {"a", "b"}
        sa, sb = doc["tensors"]["a"], doc["tensors"]["b"]
        assert (sa["pushes"], sa["pulls"], sa["step"]) == (8, 3, 8)
        assert (sb["pushes"], sb["pulls"], sb["step"]) == (1, 0, 1)
        assert sa["rows_pushed"] == 7 * 4 + 2
        text = ok(tool("stats", "st", "--namespace", ns, "--count", "1"))
        assert text.splitlines()[1].split()[:3] == ["tensor", "push/s", "pull/s"]
    finally:
        s.destroy()


# ---- checkpoint, restore, dump --store -------------------------------------------------------

def test_checkpoint_restore_as_and_force(ns, tmp_path):
    """`checkpoint`, `restore --as` recreate the store; `restore` onto it needs `--force`."""
    s = shmps.attach("src", namespace=ns)
    try:
        w = s.dense("w", shape=(6, 3), dtype="float32", optimizer=shmps.Adam(lr=0.1),
                    shard_rows=4)
        w.push(np.arange(18.0).reshape(6, 3))
        path = tmp_path / "ck"
        out = ok(tool("checkpoint", "src", path, "--namespace", ns))
        assert out.strip() == f"checkpoint of src: 1 tensors written to {path}"
        assert (path / "checkpoint.json").exists()
        out = ok(tool("restore", path, "--as", "copy", "--namespace", ns))
        assert out.strip() == f"restored 1 tensors from {path} into store copy"
        c = shmps.attach("copy", namespace=ns, create=False)
        try:
            assert np.array_equal(c["w"].pull(), w.pull())
            assert c["w"].stats()["step"] == 1 and c["w"].nshards == 2
        finally:
            c.destroy()
        one_line_error(tool("restore", path, "--namespace", ns),
                       "store 'src' exists", "--force")
        w.push(np.ones((6, 3)))  # diverge; --force brings the checkpoint back
        before = w.pull()
        ok(tool("restore", path, "--force", "--namespace", ns))
    finally:
        s.close()
    s = shmps.attach("src", namespace=ns, create=False)
    try:
        got = s["w"].pull()
        assert not np.array_equal(got, before) and s["w"].stats()["step"] == 1
    finally:
        s.destroy()


def test_dump_store_tensor_values_and_state(ns, tmp_path):
    """`dump --store S --tensor T [--array state0]` prints what its checkpoint set prints."""
    s = shmps.attach("d", namespace=ns)
    try:
        t = s.dense("emb", shape=(5, 2, 2), dtype="float64", optimizer=shmps.Adagrad(
            lr=0.5, initial_accumulator_value=0.25), shard_rows=2)
        t.push(np.arange(20.0).reshape(5, 2, 2))
        doc = json.loads(ok(tool("dump", "--store", "d", "--tensor", "emb", "--namespace", ns,
                                 "--format", "json")))
        assert (doc["rows"], doc["cols"]) == (5, 4)
        assert doc["rowcnt"] == [0, 4, 8, 12, 16, 20] and doc["colidx"] == [0, 1, 2, 3] * 5
        assert np.array_equal(np.array(doc["value"]), t.pull().ravel())
        st = json.loads(ok(tool("dump", "--store", "d", "--tensor", "emb", "--namespace", ns,
                                "--format", "json", "--array", "state0")))
        assert np.array_equal(np.array(st["value"]), 0.25 + np.arange(20.0) ** 2)
        table = ok(tool("dump", "--store", "d", "--tensor", "emb", "--namespace", ns,
                        "--head", "1"))
        assert table.splitlines()[0] == \
            "# 5 x 4, nnz 20 (dense, structure implicit; value float64), rows 0:1"
        summary = ok(tool("dump", "--store", "d", "--tensor", "emb", "--namespace", ns,
                          "--format", "summary"))
        assert "kind:      dense (tensor shape 5 x 2 x 2" in summary
        assert "also state0 (--array NAME)" in summary and "step 1" in summary
        s.checkpoint(tmp_path / "ck")
        for fmt in ("json", "csv", "table"):
            live = ok(tool("dump", "--store", "d", "--tensor", "emb", "--namespace", ns,
                           "--format", fmt))
            assert ok(tool("dump", tmp_path / "ck", "--tensor", "emb", "--format", fmt)) == live
            assert ok(tool("dump", tmp_path / "ck" / "t0", "--format", fmt)) == live
        assert ok(tool("dump", tmp_path / "ck" / "t0", "--array", "state0", "--format",
                       "json")) == ok(tool("dump", "--store", "d", "--tensor", "emb",
                                           "--namespace", ns, "--format", "json",
                                           "--array", "state0"))
        assert ok(tool("check", tmp_path / "ck" / "t0")).strip() == (
            "ok: 5 x 4, dense (structure implicit), nnz 20 (dtypes value=float64); "
            "state0 float64 ok")
    finally:
        s.destroy()


# ---- errors ----------------------------------------------------------------------------------

def test_dump_store_of_a_table_or_csr_tensor_says_how_to_print_it(ns, tmp_path):
    """`dump --store` cannot print a table or csr tensor; its error says how to (through a
    checkpoint), and following it literally works."""
    s = shmps.attach("tc", namespace=ns)
    try:
        emb = s.table("emb", dim=2, capacity=8)
        emb.push(np.array([3, 5], np.uint64), np.ones((2, 2)))
        s.csr("X", np.array([0, 2, 3]), np.array([0, 1, 1]), init=2.0)
        for name, kind, want in (("emb", "table", "row 0: (0, 1.0) (1, 1.0)"),
                                 ("X", "csr", "row 1: (1, 2.0)")):
            line = one_line_error(tool("dump", "--store", "tc", "--tensor", name,
                                       "--namespace", ns),
                                  f"tensor '{name}' is a {kind} tensor")
            cmds = [c.split() for c in line.split("`")[1::2]]
            assert cmds == [["shmps-tool", "checkpoint", "tc", "--namespace", ns, "DIR"],
                            ["shmps-tool", "dump", "DIR", "--tensor", name]], line
            ck = str(tmp_path / kind)
            for cmd in cmds:
                ok(tool(*[ck if a == "DIR" else a for a in cmd[1:]]))
            assert want in ok(tool("dump", ck, "--tensor", name))
    finally:
        s.destroy()


def test_store_verb_errors_are_one_line_exit_2(ns, tmp_path):
    """Every store-verb error is one `shmps-tool: error:` line, exit 2, no traceback."""
    s = shmps.attach("e", namespace=ns)
    try:
        s.dense("w", shape=(2, 2), dtype="float32")
        s.checkpoint(tmp_path / "ck")
        (tmp_path / "plain").write_text("not a checkpoint")
        (tmp_path / "dir").mkdir()
        (tmp_path / "dir" / "x").write_text("x")
        cases = [
            (("stats", "nosuch", "--namespace", ns, "--once"), ["no store 'nosuch'"]),
            (("checkpoint", "nosuch", tmp_path / "x", "--namespace", ns), ["no store"]),
            (("dump", "--store", "nosuch", "--tensor", "w", "--namespace", ns), ["no store"]),
            (("dump", "--store", "e", "--tensor", "nope", "--namespace", ns),
             ["no tensor 'nope'", "existing: w"]),
            (("dump", "--store", "e", "--tensor", "w", "--namespace", ns, "--array",
              "state0"), ["has no array 'state0'"]),
            (("dump", "--store", "e", "--namespace", ns), ["needs --tensor"]),
            (("checkpoint", "e", tmp_path / "plain", "--namespace", ns),
             ["is not a shmps checkpoint"]),
            (("checkpoint", "e", tmp_path / "dir", "--namespace", ns),
             ["is not a shmps checkpoint"]),
            (("restore", tmp_path / "missing", "--namespace", ns),
             ["no checkpoint directory"]),
            (("restore", tmp_path / "dir", "--namespace", ns), ["not a shmps checkpoint"]),
            (("restore", tmp_path / "plain", "--namespace", ns), ["no checkpoint directory"]),
            (("restore", tmp_path / "ck", "--namespace", ns), ["exists", "--force"]),
            (("restore", tmp_path / "ck", "--as", "bad/name", "--namespace", ns),
             ["invalid store name"]),
            (("dump", tmp_path / "ck", "--tensor", "nope"), ["no tensor 'nope' in checkpoint"]),
            (("dump", tmp_path / "ck"), ["is a checkpoint directory", "--tensor"]),
            (("gc", "--namespace", "../up"), ["invalid namespace"]),
            (("checkpoint", "e", "/proc/shmps-nope", "--namespace", ns),
             ["error: /proc/shmps-nope: ", "choose a path"]),
            (("ls", "--namespace", "bad/ns"), ["invalid namespace"]),
            (("gc", "--namespace", ""), ["--namespace '' is empty"]),
            (("restore",), ["the following arguments are required"]),
        ]
        for args, needles in cases:
            one_line_error(tool(*args), *needles)
        assert sorted(os.listdir(tmp_path / "dir")) == ["x"]
        assert (tmp_path / "plain").read_text() == "not a checkpoint"
        assert segments("bad", ns) == [] and [d["name"] for d in s.tensors()] == ["w"]
    finally:
        s.destroy()


GC_LOOP = """
import contextlib, io, os, sys, time
from shmps import cli
end = time.monotonic() + float(sys.argv[2])
runs = 0
while time.monotonic() < end:
    with contextlib.redirect_stdout(io.StringIO()):
        cli.main(["gc", "--namespace", sys.argv[1]])
    runs += 1
print(runs)
"""

ATTACH_LOOP = """
import sys, time, numpy as np, shmps
end = time.monotonic() + float(sys.argv[2])
loops, errors = 0, []
while time.monotonic() < end:
    try:
        with shmps.attach("busy", namespace=sys.argv[1]) as s:
            w = s.dense("w", shape=(4,), dtype="int32")
            before = int(w.pull()[0])
            w.push(np.ones(4, np.int32))
            after = int(w.pull()[0])
            if after != before + 1:
                errors.append(f"pull {after} after {before} + 1")
            with shmps.attach("busy", namespace=sys.argv[1], create=False) as again:
                if int(again["w"].pull()[0]) != after:
                    errors.append("a second attach sees another store")
    except shmps.Error as e:
        errors.append(f"{type(e).__name__}: {e}")
    loops += 1
print(loops, len(errors), errors[:3])
"""


def test_gc_never_removes_a_store_under_an_attach(ns, procs):
    """`gc` looping while a process attaches an idle store, pushes, pulls and closes
    again and again: no attach meets a store half removed.  Before, gc unlinked what its
    scan had found idle without looking again: an attach in between got NotFound for its
    tensor, or held a manifest nobody else saw (5 failures in 40 s in the review).  Now
    gc retires the store first and backs off if a process registered meanwhile, and an
    attach that finds it retired waits for the removal and makes a new store."""
    env = child_env(SHMPS_GC_MIN_AGE="0")
    env.pop("SHMPS_NAMESPACE", None)
    secs = "6"
    gc = subprocess.Popen([sys.executable, "-c", GC_LOOP, ns, secs], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(gc)
    att = subprocess.Popen([sys.executable, "-c", ATTACH_LOOP, ns, secs], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(att)
    a_out, a_err = att.communicate(timeout=60)
    g_out, g_err = gc.communicate(timeout=60)
    assert att.returncode == 0 and gc.returncode == 0, a_err + g_err
    loops, nerr, errs = a_out.split(" ", 2)
    gc_runs = int(g_out)
    assert int(loops) > 100 and gc_runs > 100, (loops, gc_runs)
    assert int(nerr) == 0, (nerr, errs, loops, gc_runs)


def test_stats_refuses_an_interval_it_cannot_sleep():
    """--interval must be a finite number of seconds > 0 and at most a day (the shared
    cli_args.positive): nan, inf, 0 and -1 were taken, and 1e10 printed one screen,
    then died of an internal OverflowError in time.sleep.  --count must be >= 0: -1
    refreshed for ever."""
    for opt, bad in [("--interval", b) for b in ("nan", "inf", "0", "-1", "x", "1e10",
                                                   "86401")] + [("--count", "-1"),
                                                                ("--count", "1.5")]:
        r = tool("stats", "model", opt, bad)
        assert r.returncode == 2 and f"argument {opt}" in r.stderr, (bad, r.stderr)
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


@pytest.fixture
def fake_bridge() -> Iterator[tuple[str, list[bytes]]]:
    """An HTTP server on loopback answering every request with ``answer[0]`` (a JSON
    body, status 200): something on a bridge's address that is not a bridge."""
    import http.server
    import threading

    answer = [b"{}"]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer[0])))
            self.end_headers()
            self.wfile.write(answer[0])

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", answer
    finally:
        server.shutdown()
        server.server_close()


def test_members_refuses_a_health_answer_whose_members_are_not_a_bridges(fake_bridge):
    """`shmps-tool members HOST:PORT` whose /health lists members that are not
    {"address": str, "state": str} objects (something else listens there): one line
    saying it is not a bridge's answer, exit 2, nothing on stdout.  Before, an address
    that was a list died of an internal TypeError (exit 1) after the first line was
    printed, and entries that were not objects printed as '?' each marked "(this
    bridge)"; an answer nested deeper than the JSON parser goes died of an internal
    RecursionError (fuzzing, review 24)."""
    target, answer = fake_bridge
    for members in ([{"address": [1], "state": "alive"}], [5, None, "x"],
                    [{"address": "10.0.0.1:7070", "state": {"x": 1}}], [{}], "x"):
        answer[0] = json.dumps({"epoch": 1, "members": members}).encode()
        r = tool("members", target, "--timeout", "5")
        one_line_error(r, "is not a bridge's", "hosts.txt")
    answer[0] = b"[" * 100_000 + b"]" * 100_000   # deeper than json.loads goes
    one_line_error(tool("members", target, "--timeout", "5"), "is not a bridge's")
    answer[0] = json.dumps({"epoch": 3, "quorum": True, "acting": True,
                            "address": "10.0.0.1:7070",
                            "members": [{"address": "10.0.0.1:7070", "state": "alive"},
                                        {"address": "10.0.0.2:7070", "state": "dead"}]}).encode()
    out = ok(tool("members", target, "--timeout", "5"))
    assert "10.0.0.1:7070" in out and "alive  (this bridge)" in out and "dead" in out


def test_members_shows_the_store_that_a_change_must_name(fake_bridge):
    """`shmps-tool members HOST:PORT` says which store that bridge serves (its /health's
    `store`), in its first line and in --json; a change without --store is refused with
    a line that says where to find it.  Before, --add/--remove needed --store but
    nothing the tool printed named the bridge's store, and the error's only hint was an
    example with a made-up name (`--store model`)."""
    target, answer = fake_bridge
    answer[0] = json.dumps({"epoch": 3, "quorum": True, "acting": True, "store": "wts",
                            "address": "10.0.0.1:7070",
                            "members": [{"address": "10.0.0.1:7070", "state": "alive"}]}
                           ).encode()
    first = ok(tool("members", target, "--timeout", "5")).splitlines()[0]
    assert first == (f"bridge {target}: epoch 3, has a majority (owns shards); "
                     "store 'wts'"), first
    assert json.loads(ok(tool("members", target, "--json", "--timeout", "5"))) == {
        "epoch": 3, "store": "wts",
        "members": [{"address": "10.0.0.1:7070", "state": "alive"}]}
    line = one_line_error(tool("members", target, "--add", "127.0.0.1:2"),
                          "--add and --remove need --store NAME")
    assert f"`shmps-tool members {target}` says which store that bridge serves" in line, \
        line
    assert "--store model" not in line, line
    # listing with another --store: said so, as a listing (it said "nothing was changed"
    # and how "to change the members", which no listing does: review H18)
    line = one_line_error(tool("members", target, "--store", "other", "--timeout", "5"),
                          f"the bridge at {target} serves store 'wts', not 'other'")
    assert "changed" not in line and "to list the members of store 'wts'" in line, line


def test_a_fifo_as_hosts_or_secret_file_is_refused_not_waited_on(tmp_path):
    """A FIFO given as shmps-bridge's --peers or --secret-file, or as shmps-tool
    members' --secret-file, is refused with one line (not a regular file), exit 2.
    Before, opening it blocked until a writer came: each command hung for ever
    (fuzzing, review 24)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("127.0.0.1:1\n")
    bridge = ["--store", "x", "--namespace", f"n{uuid.uuid4().hex[:10]}"]
    for argv, what in ((bridge + ["--peers", str(fifo)], "hosts file"),
                       (bridge + ["--peers", str(hosts), "--secret-file", str(fifo)],
                        "secret file")):
        r = cli_runner.run("shmps.bridge.cli", argv, env=child_env(), timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert f"{what} {fifo} is not a regular file" in r.stderr, r.stderr
    # (with --store, which a change needs: without it, this tested the FIFO only as long
    # as the tool reads the secret file before it asks for --store)
    r = tool("members", "127.0.0.1:1", "--store", "x", "--add", "127.0.0.1:2",
             "--secret-file", fifo)
    one_line_error(r, f"secret file {fifo} is not a regular file")


def test_restore_as_empty_and_a_bridge_path_with_a_newline_are_one_line(ns, tmp_path):
    """`restore CKPT --as ''` is refused as an invalid store name (exit 2, no store
    made); before, '' meant "the checkpointed store's name", so a `--as "$NAME"` with
    NAME unset restored over that store.  shmps-bridge --peers with a newline in the
    path says so on one line (it printed two) (fuzzing, review 24)."""
    s = shmps.attach("orig", namespace=ns)
    s.dense("w", shape=(2, 2), dtype="float32", init=1.0)
    s.checkpoint(tmp_path / "ck")
    s.destroy()
    one_line_error(tool("restore", tmp_path / "ck", "--as", "", "--namespace", ns),
                   "invalid store name ''")
    assert segments("orig", ns) == []
    r = cli_runner.run("shmps.bridge.cli", ["--store", "x", "--peers", tmp_path / "a\nb"],
                       env=child_env(), timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "cannot read hosts file" in r.stderr


@pytest.mark.parametrize("module", ["shmps.cli_store", "shmps.cli_files", "shmps.cli_bridge"])
def test_running_a_verb_module_runs_shmps_tool(module, ns):
    """`python -m shmps.cli_store --help` (a module of shmps-tool's verbs) printed
    nothing and exited 0; it runs shmps-tool now: usage, and a verb works."""
    env = {**child_env(), "SHMPS_NAMESPACE": ns}
    r = subprocess.run([sys.executable, "-m", module, "--help"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage: shmps-tool"), (r.stdout, r.stderr)
    r = subprocess.run([sys.executable, "-m", module, "ls"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert r.stdout.strip() == f"no shmps stores on this host in namespace {ns}", r.stdout
