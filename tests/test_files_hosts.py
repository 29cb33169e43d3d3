"""Writers of one file set on different hosts sharing its directory (NFS, a volume
mounted into containers with their own PID namespaces) take turns, through real
processes and real files.

"Different hosts" are simulated on this machine by processes in new PID namespaces
(``unshare --pid --fork --mount-proc``): their :func:`shmps.files.host_id` differs from
this process's and from each other's, so none can judge the others' processes by pid,
as on separate machines; the filesystem is shared.  Each writer writes a set whose
files all carry its own recognisable content (writer number and round in its rowcnt
pattern, its colidx, its values and its ``.meta``), so a set whose files come from two
writers is seen for what it is.
"""
from __future__ import annotations

import contextlib
import errno
import io
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import shmps
import shmps.files as files
from shmps.files import CSR, read_csr, write_csr

from helpers import child_env

#: a writer of set argv[1] as writer argv[2] (1 or 2); its version of round r is
#: version(who, r).  Mode argv[3]:
#:   "rounds": for each line r read, write round r and print "done r";
#:   "free":   after a line "go", write rounds 0, 1, ... for argv[4] s and at least
#:             argv[5] rounds (a writer the other kept waiting on the lock goes on
#:             alone until it did its share), print the count;
#:   "stall":  write round 0 but, after its second rename, print "mid" and wait for a
#:             line (holding the lock, the set half replaced) before the rest.
#: Every rename is followed by a pause, 1 ms for writer 1 and 15 ms for writer 2 (as
#: on hosts of different speeds), so that two writers' renames interleave and one
#: overtakes the other (without the pauses too, less often).
_WRITER = r"""
import os, sys, time
import numpy as np
from shmps.files import CSR, host_id, write_csr
prefix, who, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
real, n = os.replace, [0]
def replace(a, b):
    n[0] += 1
    real(a, b)
    if mode == "stall" and n[0] == 2:
        print("mid", flush=True)
        sys.stdin.readline()
    time.sleep(0.001 if who == 1 else 0.015)
os.replace = replace
def write(r):
    tag = who * 100000 + r
    rowcnt = [0, 1, 2, 3] if who == 1 else [0, 3, 3, 3]
    write_csr(prefix, CSR(np.array(rowcnt), np.full(3, tag, np.int32),
                          np.full(3, tag, np.float32)), cols=10**6,
              meta={"writer": who, "round": r})
print(host_id(), flush=True)
if mode == "rounds":
    for line in sys.stdin:
        write(int(line))
        print("done", int(line), flush=True)
elif mode == "free":
    assert sys.stdin.readline() == "go\n"
    end, least, r = time.monotonic() + float(sys.argv[4]), int(sys.argv[5]), 0
    while time.monotonic() < end or r < least:
        write(r)
        r += 1
    print(r, flush=True)
else:
    write(0)
    print("written", flush=True)
"""


def version(ms: files.MatrixSet) -> tuple[int, int]:
    """(writer, round) of a set read, every file agreeing; AssertionError naming the
    files that disagree (a mix of two writers' files)."""
    rowcnt = ms.csr.rowcnt.tolist()
    by_rowcnt = {(0, 1, 2, 3): 1, (0, 3, 3, 3): 2}.get(tuple(rowcnt))
    colidx, value = set(ms.csr.colidx.tolist()), set(ms.csr.value.tolist())
    seen = {"rowcnt": by_rowcnt,
            "colidx": colidx.pop() // 100000 if len(colidx) == 1 else colidx,
            "value": int(value.pop()) // 100000 if len(value) == 1 else value,
            "meta": ms.meta.get("writer")}
    tags = {int(ms.csr.colidx[0]), int(ms.csr.value[0]),
            ms.meta.get("writer", 0) * 100000 + ms.meta.get("round", 0)}
    assert len(set(seen.values())) == 1 and len(tags) == 1, f"a mixed set: {seen}, {tags}"
    return seen["rowcnt"], ms.meta["round"]


def start_writer(prefix: Path, who: int, mode: str, *args: str) -> subprocess.Popen:
    """The writer script in a new PID namespace ("another host"); pytest.skip where
    new PID namespaces are not allowed.  Its first line is its host id."""
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    probe = subprocess.run(cmd + ["true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip("cannot simulate another host: new PID namespaces are not allowed "
                    f"here (unshare: {probe.stderr.strip()[:200]})")
    return subprocess.Popen(cmd + [sys.executable, "-c", _WRITER, str(prefix), str(who),
                                   mode, *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=child_env())


@contextlib.contextmanager
def writers(prefix: Path, *modes: str):
    """A writer in each of ``modes`` ("rounds", "free 3 20", "stall"), writer 1, 2, ...,
    each on its own "host" (none this one: all host ids differ while they run); each
    killed at the end."""
    procs = []
    try:
        for who, mode in enumerate(modes, 1):
            procs.append(start_writer(prefix, who, *mode.split()))
        hosts = {p.stdout.readline().strip() for p in procs}
        assert len(hosts | {files.host_id()}) == len(modes) + 1, hosts   # all different
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()   # (unshare --kill-child: its writer gets SIGKILL too)
            p.wait(timeout=30)
            for f in (p.stdin, p.stdout):
                with contextlib.suppress(OSError):
                    f.close()


def send(p: subprocess.Popen, line: str) -> None:
    p.stdin.write(line + "\n")
    p.stdin.flush()


def writer_pid(p: subprocess.Popen) -> int:
    """The pid (here) of the writer that ``unshare --fork`` runs as ``p``'s child."""
    with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
        kids = f.read().split()
    assert len(kids) == 1, kids
    return int(kids[0])


def hidden(directory: Path) -> set[str]:
    return {n for n in os.listdir(directory) if n.startswith(".")}


@pytest.mark.timeout(60)
def test_two_hosts_writing_one_set_at_once_leave_it_whole(tmp_path):
    """Round after round, two writers on two hosts write set X at the same moment,
    each its own version: after each round X is one of the two versions of that round,
    whole.  Before, the second writer replaced the first one's journal and renamed its
    files between the first one's renames: the set ended a mix (rowcnt of one writer,
    values of the other) that read as valid."""
    prefix = tmp_path / "X"
    with writers(prefix, "rounds", "rounds") as procs:
        for r in range(40):
            for p in procs:
                send(p, str(r))
            for p in procs:
                assert p.stdout.readline() == f"done {r}\n"
            who, rnd = version(read_csr(prefix, mmap=False))
            assert rnd == r
    assert hidden(tmp_path) == {".X.lock"}


@pytest.mark.timeout(60)
def test_a_reader_racing_two_hosts_writers_reads_whole_sets(tmp_path):
    """Two writers on two hosts rewrite X as fast as they can for 3 s while this
    process (a third host) reads it: every read returns one writer's version whole, and
    none fails.  Before, reads met mixed sets, and every read that met another host's
    journal failed ("a writer on another host ... is replacing this set")."""
    prefix = tmp_path / "X"
    write_csr(prefix, CSR(np.array([0, 1, 2, 3]), np.full(3, 100000, np.int32),
                          np.full(3, 100000, np.float32)), cols=10**6,
              meta={"writer": 1, "round": 0})
    reads, mixes, errors = 0, [], []
    with writers(prefix, "free 3 20", "free 3 20") as procs:
        for p in procs:
            send(p, "go")
        while any(p.poll() is None for p in procs):
            try:
                version(read_csr(prefix, mmap=False))
            except AssertionError as exc:
                mixes.append(str(exc))
            except shmps.Error as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            reads += 1
        rounds = [int(p.stdout.read()) for p in procs]
        assert [p.wait(timeout=30) for p in procs] == [0, 0]
    assert reads > 50 and min(rounds) >= 20, (reads, rounds)
    assert (mixes, errors) == ([], []), (f"{len(mixes)} mixes and {len(errors)} errors in "
                                         f"{reads} reads", mixes[:2], errors[:2])
    version(read_csr(prefix))
    assert hidden(tmp_path) == {".X.lock"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("next_one", ["reader", "writer"])
def test_a_writer_of_another_host_killed_mid_replacement(tmp_path, next_one):
    """A writer on another host is SIGKILLed holding the lock, two of its four renames
    done: the set on disk is a mix, and its journal stays.  The kernel released its
    lock, so the next reader (here) or writer (a third host) does not wait: it
    finishes the dead writer's renames (its version is then whole), the writer then
    writes its own; nothing is left behind but the lock file.  Before, the reader
    refused the set ("a writer on another host ...") and the writer replaced the
    journal, leaving the dead writer's last two temporaries behind for good."""
    prefix = tmp_path / "X"
    write_csr(prefix, CSR(np.array([0, 3, 3, 3]), np.full(3, 200007, np.int32),
                          np.full(3, 200007, np.float32)), cols=10**6,
              meta={"writer": 2, "round": 7})
    # (the next writer starts first: a new PID namespace may reuse a dead one's
    # inode, and so its host id)
    with writers(prefix, "stall", "rounds") as (p, w):
        assert p.stdout.readline() == "mid\n"
        os.kill(writer_pid(p), signal.SIGKILL)
        assert p.wait(timeout=30) != 0
        assert ".X.replacing" in hidden(tmp_path)
        t0 = time.monotonic()
        if next_one == "reader":
            assert version(read_csr(prefix)) == (1, 0)
        else:
            send(w, "5")
            assert w.stdout.readline() == "done 5\n"
            assert version(read_csr(prefix)) == (2, 5)
        assert time.monotonic() - t0 < 5   # (not the bounded wait: the lock was free)
    assert hidden(tmp_path) == {".X.lock"}


@pytest.mark.timeout(60)
def test_a_live_writer_of_another_host_is_waited_for_a_bounded_time(tmp_path, monkeypatch):
    """A writer on another host stalls holding the lock, its set half replaced: a
    reader here and a writer here wait for it, at most REPLACE_WAIT_S (1 s here), then
    raise shmps.Timeout naming the lock and saying what to do; the set is not touched.
    Once the writer goes on, its set is whole and this host's writer writes.  Before,
    the reader raised CorruptFile at once and the writer here replaced the stalled
    one's journal and renamed its own files among the stalled one's: a mix."""
    monkeypatch.setattr(files, "REPLACE_WAIT_S", 1.0)
    prefix = tmp_path / "X"
    mine = CSR(np.array([0, 3, 3, 3]), np.full(3, 200009, np.int32),
               np.full(3, 200009, np.float32))
    with writers(prefix, "stall") as (p,):
        assert p.stdout.readline() == "mid\n"
        before = {n: os.stat(tmp_path / n).st_ino for n in os.listdir(tmp_path)}
        for act in (lambda: read_csr(prefix),
                    lambda: write_csr(prefix, mine, cols=10**6,
                                      meta={"writer": 2, "round": 9})):
            t0 = time.monotonic()
            with pytest.raises(shmps.Timeout, match=r"\.X\.lock") as info:
                act()
            assert 0.9 < time.monotonic() - t0 < 5
            assert "another host" in str(info.value) and info.value.hint
        assert {n: os.stat(tmp_path / n).st_ino for n in os.listdir(tmp_path)} == before
        send(p, "")
        assert p.stdout.readline() == "written\n"
        assert p.wait(timeout=30) == 0
    assert version(read_csr(prefix)) == (1, 0)
    write_csr(prefix, mine, cols=10**6, meta={"writer": 2, "round": 9})
    assert version(read_csr(prefix)) == (2, 9)
    assert hidden(tmp_path) == {".X.lock"}


def test_without_working_locks_writes_go_on_with_one_warning(tmp_path, monkeypatch):
    """A filesystem whose locks fail (NFS without lockd: ENOLCK) writes as before
    (writers of one host still take turns by the journal's hard link), and says once
    per process that writers of other hosts are not kept apart."""
    real = files._fcntl.fcntl

    def no_locks(fd, cmd, arg=0):
        if cmd in (files._fcntl.F_OFD_SETLK, files._fcntl.F_OFD_SETLKW):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        return real(fd, cmd, arg)

    monkeypatch.setattr(files._fcntl, "fcntl", no_locks)
    monkeypatch.setattr(files, "_LOCKS_WARNED", False)
    a = CSR(np.array([0, 1]), np.array([0], np.int32), np.array([1.0], np.float32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        write_csr(tmp_path / "X", a)
        write_csr(tmp_path / "Y", a)
    assert [str(w.message) for w in caught if w.category is RuntimeWarning] == [
        f"{tmp_path}/.X.lock: file locks do not work here ([Errno {errno.ENOLCK}] "
        f"{os.strerror(errno.ENOLCK)}): writers of a set on different hosts sharing "
        "this directory are not kept apart (see docs/file-format.md, Writing)"]
    assert read_csr(tmp_path / "Y").csr.value.tolist() == [1.0]


@pytest.mark.timeout(60)
def test_check_finish_waits_for_a_live_writer_of_another_host(tmp_path, monkeypatch):
    """``shmps-tool check --finish`` (for a journal that cannot be judged) takes a read
    lock of the set first: a writer on another host stalled mid-rename holds the write
    lock, so --finish waits (1 s here) and fails with one Timeout line, renaming
    nothing; once that writer went on, the set is its version whole.  Before,
    --finish renamed the live writer's files under it."""
    from shmps import cli

    monkeypatch.setattr(files, "REPLACE_WAIT_S", 1.0)
    prefix = tmp_path / "X"
    with writers(prefix, "stall") as (p,):
        assert p.stdout.readline() == "mid\n"
        before = {n: os.stat(tmp_path / n).st_ino for n in os.listdir(tmp_path)}
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = cli.main(["check", "--finish", str(prefix)])
        assert (status, out.getvalue()) == (2, "")
        assert err.getvalue().count("\n") == 1 and "shmps-tool: error: " in err.getvalue()
        assert "has held" in err.getvalue() and ".X.lock" in err.getvalue()
        assert {n: os.stat(tmp_path / n).st_ino for n in os.listdir(tmp_path)} == before
        send(p, "")
        assert p.stdout.readline() == "written\n"
        assert p.wait(timeout=30) == 0
    assert version(read_csr(prefix)) == (1, 0)
    assert hidden(tmp_path) == {".X.lock"}
