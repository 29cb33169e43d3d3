"""Several shmps-bridge processes on one machine: exact totals, failover, pause, join and
leave, hostile peers.  Each host is a bridge on its own 127.0.0.x address with its own
shared-memory namespace; workers are separate processes (tests/bridge_worker.py)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Optional

import numpy as np
import pytest

import shmps

from shmps import doorbell
from shmps._native import lib
from shmps.bridge import auth, frames
from shmps.bridge.members import member_id
from shmps.bridge.ring import Ring, shard_key

import cli_runner
from bridge_harness import Cluster, free_port
from bridge_worker import create, csr_structure
from helpers import child_env, needs_small_shm

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

pytestmark = [pytest.mark.timeout(240)]

KEYS = [0, 1, 777, 12345, 2**64 - 1]
DENSE = {"w": [[512, 8], "int32", "sum", 64]}      # 8 shards of 64 rows
CSR = {"X": [256, 40, 5, "int32", 64]}             # 4 shards of 64 rows
TABLE = {"emb": [4, "int32", 1000]}


@pytest.fixture
def make_cluster(tmp_path):
    made: list[Cluster] = []

    def make(n: int, **kw) -> Cluster:
        c = Cluster(tmp_path / f"cluster{len(made)}", n, forked=True, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def create_everywhere(c: Cluster, hosts: list) -> None:
    """Every host of ``hosts`` creates w and emb, then the first one X (in this process,
    as bridge_worker.py would: a worker's Python start-up each took 0.4 s)."""
    for i in hosts:
        with c.attach(i) as s:
            create(s, {"dense": DENSE, "table": TABLE})
    with c.attach(hosts[0]) as s:
        create(s, {"csr": CSR})
    c.wait(lambda: all((c.health(i) or {}).get("tensors") == ["X", "emb", "w"] for i in hosts),
           15, "every bridge to forward the tensors")


def wait_forwarding(c: Cluster, names: set, hosts: list) -> None:
    """Until the bridge of every host in ``hosts`` forwards the tensors ``names``."""
    c.wait(lambda: all(names <= set((c.health(i) or {}).get("tensors", [])) for i in hosts),
           15, f"every bridge to forward {sorted(names)}")


def pulled(c: Cluster, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    s = c.attach(i)
    try:
        w = s["w"].pull()
        e = s["emb"].pull(np.asarray(KEYS, dtype=np.uint64))
        x = s["X"].pull().value
        return w, e, x
    finally:
        s.close()


def wait_totals(c: Cluster, hosts: list, total: int, timeout: float = 10.0) -> None:
    """Every host's copy reaches the exact total (backups at once; other replicas within
    the staleness bound)."""
    last: dict = {}

    def ok() -> bool:
        for i in hosts:
            w, e, x = pulled(c, i)
            last[i] = (int(w.min()), int(w.max()), int(e.min()), int(e.max()), int(x.min()),
                       int(x.max()))
            if last[i][:2] != (total, total):
                bad = sorted({int(r) // 64 for r in np.nonzero((w != total).any(axis=1))[0]})
                last[i] += (f"w shards off: {bad}",)
            if last[i][4:6] != (total, total):
                rc = csr_structure(*CSR["X"][:3])[0]
                off = np.nonzero(x != total)[0]
                shards = sorted({int(r) // 64 for r in np.searchsorted(rc, off, "right") - 1})
                last[i] += (f"X shards off: {shards}",)
        return all(last[i][:6] == (total,) * 6 for i in hosts)

    try:
        c.wait(ok, timeout, f"every host to hold the total {total}")
    except AssertionError:
        raise AssertionError(f"totals (min/max of w, emb and X) per host: {last}, "
                             f"expected {total}\n{c.describe()}") from None


def settled_exact(c: Cluster, procs: list, rounds: int, epoch0: int, bumps: int,
                  converge: float) -> None:
    """After a disruption: every worker of ``procs`` (on hosts 0..2, ``rounds`` pushes
    each) exits 0 (its flushes returned), the 3 bridges converge within ``converge`` s
    on one epoch at least ``bumps`` past ``epoch0``, and every host holds the exact
    totals."""
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode() + c.describe()
    c.wait_converged(converge)
    hs = [c.health(i) for i in range(3)]
    assert len({h["epoch"] for h in hs}) == 1 and hs[0]["epoch"] >= epoch0 + bumps, hs
    wait_totals(c, [0, 1, 2], 3 * rounds)


def push_spec(rounds: int, sleep: float = 0.0, flush: bool = True) -> dict:
    return {"create": {"dense": DENSE, "table": TABLE, "csr": CSR}, "keys": KEYS,
            "pushes": rounds,
            "sleep": sleep, "flush": flush, "flush_timeout": 60.0}


def _ipv6_loopback_port() -> Optional[int]:
    """A free port on ::1, or None where the machine has no IPv6 loopback."""
    import socket
    try:
        with socket.socket(socket.AF_INET6) as sk:
            sk.bind(("::1", 0))
            return int(sk.getsockname()[1])
    except OSError:
        return None


def test_bridges_on_ipv6_addresses_forward_and_replicate(make_cluster, tmp_path):
    """hosts.txt takes IPv6 members ("[::1]:7070"): the bridges listen, dial each other
    and ask each other (catalog, member changes) on them, and 2 hosts pushing +1 reach
    the exact totals on both.  (They did not: the address's host went to the sockets and
    URLs in its brackets, "[[::1]]", and no bridge could reach another.)"""
    ports = [_ipv6_loopback_port(), _ipv6_loopback_port()]
    if None in ports:
        pytest.skip("this machine has no IPv6 loopback (::1)")
    c = make_cluster(2)
    c.addrs = [f"[::1]:{p}" for p in ports]
    c.members = list(c.addrs)
    c.write_hosts()
    c.start_all()
    create_everywhere(c, [0, 1])
    procs = [c.worker(i, push_spec(10)) for i in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode() + c.describe()
    wait_totals(c, [0, 1], 2 * 10)
    r = _tool("members", c.addrs[1], "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert {m["address"]: m["state"] for m in json.loads(r.stdout)["members"]} == {
        a: "alive" for a in c.addrs}


def test_three_hosts_exact_totals(make_cluster):
    c = make_cluster(3)
    c.start_all()
    create_everywhere(c, [0, 1, 2])
    procs = [c.worker(i, push_spec(25)) for i in range(3) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
        assert json.loads(out.decode().splitlines()[-1])["rounds"] == 25
    # flush() returned on every host: each push is applied by its owner and backed up
    wait_totals(c, [0, 1, 2], 3 * 2 * 25)
    # every host owns some shards, and none owns them all
    owned = [len(c.health(i)["owned"]) for i in range(3)]
    assert sum(owned) == 8 + 1 + 4 and all(n < 13 for n in owned), owned


def test_initial_values_come_from_the_creating_host(make_cluster):
    """A tensor created on one host with init= values (an array, or a scalar) has those
    values on every host, including the shards other hosts own: an owner that created
    the tensor from a peer's catalog starts from the origin's copy, not from zeros."""
    c = make_cluster(3)
    c.start_all()
    init = np.random.default_rng(7).integers(-1000, 1000, (512, 8), dtype=np.int32)
    s0 = c.attach(0)
    try:
        s0.dense("wa", (512, 8), "int32", init=init, shard_rows=64)
        s0.dense("ws", (512, 8), "int32", init=3, shard_rows=64)
    finally:
        s0.close()
    wait_forwarding(c, {"wa", "ws"}, [0, 1, 2])
    assert any(k.startswith("wa/") for i in (1, 2) for k in c.health(i)["owned"])

    def copies(extra: int) -> bool:
        for i in range(3):
            s = c.attach(i)
            try:
                if not (np.array_equal(s["wa"].pull(), init + extra)
                        and (s["ws"].pull() == 3 + extra).all()):
                    return False
            finally:
                s.close()
        return True

    c.wait(lambda: copies(0), 10, "every host to hold the initial values")
    s2 = c.attach(2)   # pushes from a host that did not create the tensors
    try:
        for _ in range(3):
            s2["wa"].push(np.ones((512, 8), np.int32))
            s2["ws"].push(np.ones((512, 8), np.int32))
        s2.flush(timeout=30)
    finally:
        s2.close()
    c.wait(lambda: copies(3), 10, "every host to hold the initial values + 3")


def test_the_segments_a_bridge_creates_are_backed_in_the_background(make_cluster):
    """The copy of a peer's tensor a bridge creates is made without backing its pages
    (that would hold the event loop, ~1 ms a MiB), and then backed by a thread
    (posix_fallocate): every page of it is allocated in /dev/shm soon after, so no later
    write can find /dev/shm full and die of SIGBUS.  The outboxes are not: an idle one
    keeps no pages (backing it doubled the model's resident memory on every host).
    An empty table: its copies get no rows (a dense copy is written whole by its
    snapshot), so without the thread they kept almost no pages until keys came."""
    c = make_cluster(3, replicas=1)
    c.start_all()
    s0 = c.attach(0)
    try:
        s0.table("big", dim=64, capacity=100_000, shards=4)   # 4 shards of ~7 MiB
    finally:
        s0.close()
    wait_forwarding(c, {"big"}, [0, 1, 2])

    def allocated(i: int, tensor: str) -> list:
        """(bytes allocated, size) of each shard of ``tensor`` on host i."""
        s = c.attach(i)
        try:
            tid = s._record(tensor)["id"]
        finally:
            s.close()
        prefix = f"shmps.{c.namespaces[i]}.{c.store}.t{tid}.s"
        return [(st.st_blocks * 512, st.st_size) for st in
                (os.stat(os.path.join("/dev/shm", n)) for n in sorted(os.listdir("/dev/shm"))
                 if n.startswith(prefix))]

    c.wait(lambda: all(a >= n for i in (1, 2) for a, n in allocated(i, "big")), 10,
           "hosts 1 and 2's copies of the tensor to be backed")
    assert len(allocated(1, "big")) == 4
    outbox = allocated(1, "big#outbox")
    assert len(outbox) == 4 and sum(a for a, _ in outbox) < sum(n for _, n in outbox) // 4


def _on_small_shm(host: int, mib: int):
    """A Cluster ``wrap`` running host ``host``'s bridge in a private mount namespace with
    a tmpfs of ``mib`` MiB on /dev/shm (its segments vanish with it)."""
    import shlex

    def wrap(i: int, cmd: list) -> list:
        if i != host:
            return cmd
        return ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size={mib}m tmpfs "
                "/dev/shm && exec " + " ".join(shlex.quote(str(x)) for x in cmd)]
    return wrap


@needs_small_shm
def test_a_host_with_no_room_for_a_tensor_leaves_and_the_others_go_on(make_cluster):
    """Host 2's /dev/shm (32 MiB) has no room for its copy of a 48 MiB tensor made on
    host 0.  It leaves the cluster, saying why, and exits with status 2; hosts 0 and 1
    take its shards over, and host 0's pushes are applied and acknowledged: flush()
    returns and both pulls hold the exact totals.  Before, host 2 logged the refusal
    twice a second and stayed on the ring: every shard it owned or backed stalled, and
    flush() timed out for good."""
    c = make_cluster(3, wrap=_on_small_shm(2, 32))
    c.start_all()
    big = {"w": [[12 << 20], "int32", "sum", 2 << 20]}      # 48 MiB, 6 shards of 8 MiB
    out = c.run_worker(0, {"create": {"dense": big}, "pushes": 2, "flush": True,
                           "flush_timeout": 20.0}, timeout=60)
    assert out["rounds"] == 2
    assert c.wait_exit(2, 20) == 2
    log = c.logs[2].read_text(errors="replace")
    assert "no room for its copy of tensor 'w'" in log, log[-3000:]
    c.wait_converged(20, hosts=[0, 1])
    for i in (0, 1):
        s = c.attach(i)
        try:
            w = s["w"].pull()
            assert w.min() == 2 and w.max() == 2, (i, w.min(), w.max())
        finally:
            s.close()


@needs_small_shm
def test_a_host_without_room_the_other_needs_stays_and_says_so_in_health(make_cluster):
    """Of two hosts, host 1's /dev/shm (32 MiB) has no room for a 48 MiB tensor made on
    host 0; host 0 alone would have no majority, so host 1 stays in the cluster: it
    keeps running, host 0 still counts it alive, a tensor it has room for is forwarded
    (host 0's pushes to it are applied and acknowledged: flush() returns, the pull is
    exact), and GET /health over HTTP names the tensor it has no room for, with why."""
    c = make_cluster(2, wrap=_on_small_shm(1, 32))
    c.start_all()
    big = {"w": [[12 << 20], "int32", "sum", 2 << 20]}      # 48 MiB, 6 shards of 8 MiB
    c.run_worker(0, {"create": {"dense": big}}, timeout=60)
    c.wait(lambda: "w" in ((c.health(1) or {}).get("no_room") or {}), 30,
           "host 1's /health to name 'w' in no_room")
    why = c.health(1)["no_room"]["w"]
    assert "/dev/shm" in why and "free" in why, why
    small = {"v": [[64, 4], "int32", "sum", 16]}
    out = c.run_worker(0, {"create": {"dense": small}, "pushes": 3, "flush": True,
                           "flush_timeout": 20.0}, timeout=60)
    assert out["rounds"] == 3
    assert c.running() == [0, 1], c.describe()
    states = {m["address"]: m["state"] for m in (c.health(0) or {}).get("members", [])}
    assert states.get(c.addrs[1]) == "alive", c.describe()
    s = c.attach(0)
    try:
        v = s["v"].pull()
        assert v.min() == 3 and v.max() == 3, (v.min(), v.max())
    finally:
        s.close()
    log = c.logs[1].read_text(errors="replace")
    assert "it stays in the cluster" in log, log[-3000:]


def _made_with_init(c: Cluster, seed: int) -> np.ndarray:
    """Host 0's worker creates tensor "wa" (512 x 8 int32, 16 shards of 32 rows) with
    init= a random array of ``seed``: returns the array."""
    init = np.random.default_rng(seed).integers(-1000, 1000, (512, 8), dtype=np.int32)
    s0 = c.attach(0)
    try:
        s0.dense("wa", (512, 8), "int32", init=init, shard_rows=32)
    finally:
        s0.close()
    return init


def test_initial_values_wait_for_an_origin_that_reads_them_one_at_a_time(make_cluster):
    """The creating host reads the initial values of every shard its peers own in its
    snapshot thread, one at a time: here each read takes 0.35 s longer (failpoint
    slow_snapshot on host 0 only), so the last of 12 or more owners gets its copy well
    after the 3 s an owner waits without news, while a worker on host 1 pushes to every
    shard.  The origin answers each SYNC "coming" (BUSY), so every owner waits for its
    copy (refusing the batches meanwhile): all hosts hold the init= array plus every
    push, and none serves its own copy (zeros: the schema does not carry the array).
    (Each backup's copy is read too, 17 to 25 reads in all: 0.6 s reads with 6 or more
    owners took 12 s of reading for an owners' wait of 3.6 s or more; now 4.2 s or more
    in about 7.5 s.)"""
    delay = 0.35
    slow = {"SHMPS_BRIDGE_FAILPOINTS": f"slow_snapshot={delay}"}
    for _ in range(50):   # ports whose ring gives hosts 1 and 2 enough shards to read
        c = make_cluster(3, wrap=lambda i, cmd: (["env", *(f"{k}={v}" for k, v in
                                                           slow.items())]
                                                if i == 0 else []) + cmd)
        ring = Ring(c.addrs)
        if sum(ring.owner(shard_key("wa", s)) != c.addrs[0] for s in range(16)) >= 12:
            break
    c.start_all()
    init = _made_with_init(c, 8)
    t0 = time.monotonic()
    wait_forwarding(c, {"wa"}, [0, 1, 2])
    others = sum(k.startswith("wa/") for i in (1, 2) for k in c.health(i)["owned"])
    assert others >= 12, (others, c.describe())   # enough reads to outlast the 3 s

    s1 = c.attach(1)
    try:
        rounds = 0
        while time.monotonic() - t0 < delay * others + 1.0:   # past the last owner's copy
            s1["wa"].push(np.ones((512, 8), np.int32))
            rounds += 1
            time.sleep(0.05)
        s1.flush(timeout=60)
    finally:
        s1.close()
    waited = time.monotonic() - t0

    def copies() -> bool:
        for i in range(3):
            s = c.attach(i)
            try:
                if not np.array_equal(s["wa"].pull(), init + rounds):
                    return False
            finally:
                s.close()
        return True

    c.wait(copies, 30, f"every host to hold the initial values + {rounds}")
    logs = {i: c.logs[i].read_text(errors="replace") for i in range(3)}
    assert logs[0].count("failpoint slow_snapshot") >= others, c.describe()
    assert waited > delay * others > 4.0, (waited, others)
    for text in logs.values():
        assert "serving from this host's copy" not in text, c.describe()


def test_a_creator_leaving_at_once_gives_every_owner_the_initial_values(make_cluster):
    """Host 0 creates a tensor with init= an array, and is stopped (SIGTERM) as soon as
    every bridge took it up: hosts 1 and 2 own shards of it and wait for its initial
    values, asked for with SYNCs that may come after host 0 is gone, and take over host
    0's own shards from their backup copies, which host 0 may not have sent yet.  The
    leaving creator sends the initial values unasked to the owners, and waits for the
    next owners of its own shards to hold its copy, and every shard on both hosts holds
    them.  (Before, 2 to 7 of the 16 shards held the schema's init, zeros, in 2 of 3
    runs, and in 2 of 6 with the first half of the fix: review 24 F7.)"""
    c = make_cluster(3)
    c.start_all()
    init = _made_with_init(c, 3)
    wait_forwarding(c, {"wa"}, [0, 1, 2])
    c.signal(0, signal.SIGTERM)
    assert c.wait_exit(0, 30) == 0
    c.wait_converged(20, hosts=[1, 2])

    def holds_init(i: int) -> list:
        s = c.attach(i)
        try:
            got = s["wa"].pull()
        finally:
            s.close()
        return [k for k in range(16)
                if not np.array_equal(got[32 * k:32 * k + 32], init[32 * k:32 * k + 32])]

    time.sleep(1.0)   # (an owner without them would have served its own copy by now)
    bad = {i: holds_init(i) for i in (1, 2)}
    # (for each shard without them: its owner before the leave and after, host numbers)
    moved = {k: (c.addrs.index(Ring(c.addrs).owner(shard_key("wa", k))),
                 c.addrs.index(Ring(c.addrs[1:]).owner(shard_key("wa", k))))
             for k in set(bad[1] + bad[2])}
    assert bad == {1: [], 2: []}, (bad, moved, c.describe())


def test_a_tensor_created_just_before_its_creator_leaves_reaches_the_others(make_cluster):
    """Host 0's worker creates a tensor with init= an array, none of whose two shards host
    0 owns, and host 0 is stopped (SIGTERM) at once, before its bridge's next look at the
    store and before its peers' catalog passes (every 0.5 s).  Its leave waits for no next
    owner, so it may end before the owners take the tensor up: its unasked hand-overs were
    refused BUSY (unknown tensor) and not sent again, and an owner that took the tensor up
    once host 0 was gone (from the other peer's catalog, origin host 0) waited for nothing
    and served the schema's init (in 2 of 2 runs, and in 3 of 8 with the SIGTERM once host
    0's bridge forwarded it).  The leaving bridge takes the tensor up and sends the initial
    values until each owner answered: hosts 1 and 2 hold the tensor with them."""
    for _ in range(50):   # ports whose ring gives host 0 neither shard of "wb"
        c = make_cluster(3)
        ring = Ring(c.addrs)
        if all(ring.owner(shard_key("wb", k)) != c.addrs[0] for k in range(2)):
            break
    c.start_all()
    c.wait_converged(20)
    init = np.random.default_rng(5).integers(-1000, 1000, (64, 8), dtype=np.int32)
    s0 = c.attach(0)
    try:
        s0.dense("wb", (64, 8), "int32", init=init, shard_rows=32)
    finally:
        s0.close()
    c.signal(0, signal.SIGTERM)
    assert c.wait_exit(0, 30) == 0
    c.wait_converged(20, hosts=[1, 2])
    got: dict = {}

    def held(i: int) -> bool:
        s = c.attach(i)
        try:
            got[i] = s["wb"].pull() if "wb" in s else None
        finally:
            s.close()
        return got[i] is not None and np.array_equal(got[i], init)

    # (an owner without the initial values serves its own copy 3 s after its last news)
    c.wait(lambda: all(held(i) for i in (1, 2)), 10,
           "hosts 1 and 2 to hold the tensor with its initial values")

def test_csr_tensors_are_forwarded(make_cluster):
    """csr tensors cross hosts as their entries: created on one host with init values,
    every host holds them; pushes from every host reach each shard's owner exactly once
    and every copy agrees (an int32 sum matrix, exactly; an Adagrad float32 one, the same
    values on every host)."""
    c = make_cluster(3)
    c.start_all()
    rc, ci = csr_structure(300, 50, 3)
    init = np.random.default_rng(4).integers(-50, 50, ci.size, dtype=np.int32)
    s0 = c.attach(0)
    try:
        s0.csr("X", rc, ci, "int32", init=init, shard_rows=32)            # 10 shards
        s0.csr("Y", rc, ci, "float32", init=0.5, optimizer=shmps.Adagrad(lr=0.1),
               shard_rows=64)
    finally:
        s0.close()
    wait_forwarding(c, {"X", "Y"}, [0, 1, 2])
    # hosts that did not create X own some of its shards (1 - 3**-10 of port draws)
    assert any(k.startswith("X/") for i in (1, 2) for k in c.health(i)["owned"])

    def values(i: int) -> tuple:
        s = c.attach(i)
        try:
            return s["X"].pull().value, s["Y"].pull().value
        finally:
            s.close()

    c.wait(lambda: all(np.array_equal(values(i)[0], init) for i in range(3)), 10,
           "every host to hold X's initial values")
    rounds = 4
    for i in range(3):
        s = c.attach(i)
        try:
            for _ in range(rounds):
                s["X"].push(shmps.CSR(rc, ci, np.ones(ci.size, np.int32)))
                s["Y"].push(shmps.CSR(rc, ci, np.ones(ci.size, np.float32)))
            with pytest.raises(shmps.InvalidArgument):   # an absent entry: nothing pushed
                s["X"].push(shmps.CSR([0, 1] + [1] * 299, [49 if 49 not in ci[:rc[1]]
                                                            else 48], [1]))
            s.flush(timeout=30)
        finally:
            s.close()
    c.wait(lambda: all(np.array_equal(values(i)[0], init + 3 * rounds) for i in range(3)),
           10, f"every host to hold X's initial values + {3 * rounds}")
    c.wait(lambda: all(np.array_equal(values(i)[1], values(0)[1]) for i in range(3)), 10,
           "every host to hold the same Y")
    y = values(0)[1]
    assert (y < 0.5).all() and (y > 0.5 - 0.1 * 3 * rounds - 1e-6).all()   # stepped

    # POST /v1/structure: the structure, to a peer with the secret only
    secret = c.secret_file.read_bytes().strip()

    def structure(name: object, sign: bool) -> tuple[int, bytes]:
        body = json.dumps({"name": name}).encode()
        headers = (auth.sign_request(secret, "POST", "/v1/structure", body, c.addrs[1],
                                     target=c.addrs[2], store=c.store) if sign else {})
        req = urllib.request.Request(c.url(2, "/v1/structure"), data=body, method="POST",
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, b""

    status, data = structure("X", True)
    assert status == 200 and data == rc.astype("<i8").tobytes() + ci.astype("<i8").tobytes()
    assert structure("X", False)[0] == 401
    assert structure("nope", True)[0] == 404 and structure(5, True)[0] == 404


def test_flush_wakes_the_bridge_instead_of_waiting_for_the_interval(make_cluster,
                                                                    monkeypatch):
    """store.flush() asks the bridge to drain at once: with --flush-ms 2000, a push to a
    shard owned by the other host is applied there and flushed in far less than the
    interval (about a round trip; without the wake-up, half the interval on average).
    Both ways of asking: the doorbell socket (shmps/doorbell.py; the manifest's
    flush_req word is left alone) and, where no bridge listens on it, the futex word
    (bumped once per flush).  And the bridge wakes the flush when the ack comes: the
    flush's own poll is set to 20 s here, so a bridge that did not tell it would fail
    the time bound."""
    from shmps import outbox
    monkeypatch.setattr(outbox, "ACK_POLL_NS", 20_000_000_000)
    c = make_cluster(2, flush_ms=2000)
    c.start_all()
    create_everywhere(c, [0, 1])
    # push from one host to a shard the other owns (either may own all 8)
    owner = next(i for i in (1, 0) if any(k.startswith("w/") for k in c.health(i)["owned"]))
    key = next(k for k in c.health(owner)["owned"] if k.startswith("w/"))
    row = int(key.split("/")[1]) * 64
    s = c.attach(1 - owner)
    flush_req = lambda: lib.shmps_flush_wait(s._mptr, 0, 0)  # noqa: E731 (reads the word)
    took: dict = {"doorbell": [], "futex": []}
    try:
        for way in ("doorbell", "futex"):
            if way == "futex":
                # as from a process the bridge's doorbell cannot reach (another network
                # namespace, say): nobody listens on this address
                s._bell.address = b"\0shmps-test-nobody-listens-" + str(os.getpid()).encode()
            req0 = flush_req()
            for _ in range(5):
                t0 = time.monotonic()
                s["w"].push(np.ones((1, 8), np.int32), rows=[row])
                s.flush(timeout=30)
                took[way].append(time.monotonic() - t0)
            assert flush_req() - req0 == (0 if way == "doorbell" else 5), way
    finally:
        s.close()
    # the asker's bridge counts each way it was woken (/metrics)
    wakes = _flush_wakes(c, 1 - owner)
    assert wakes["doorbell"] >= 5 and wakes["futex"] == 5, wakes
    for way, t in took.items():
        # every one, the first too (a new stream's first batch is answered GAP and
        # resent after 50 ms, not at the next 2 s interval)
        assert max(t) < 1.0 and sorted(t)[2] < 0.5, (way, took)
    s = c.attach(owner)
    try:
        assert (s["w"].pull(rows=[row]) == 10).all()
    finally:
        s.close()


def _flush_wakes(c: Cluster, i: int) -> dict:
    """Host ``i``'s bridge's store.flush() wake-ups by the way they came (/metrics)."""
    text = urllib.request.urlopen(c.url(i, "/metrics"), timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^shmps_bridge_flush_wakes_total\{via="(\w+)"\} (\S+)$', text, re.M)}


def test_a_taken_flush_doorbell_is_bound_once_it_is_free(make_cluster):
    """A bridge that finds its store's doorbell taken (another process of it still
    ending) says so in its log and binds it once it is free (tried every second):
    store.flush() then wakes it through the doorbell, not the futex word."""
    c = make_cluster(2, flush_ms=2000)
    held = [doorbell.listen(c.store, ns) for ns in c.namespaces]
    try:
        assert all(h is not None for h in held)
        c.start_all()
        create_everywhere(c, [0, 1])
        for i in (0, 1):
            assert "flush doorbell" in c.logs[i].read_text() and "is taken" in \
                c.logs[i].read_text(), c.logs[i].read_text()[-2000:]
    finally:
        for h in held:
            if h is not None:
                h.close()
    owner = next(i for i in (1, 0) if any(k.startswith("w/") for k in c.health(i)["owned"]))
    row = int(next(k for k in c.health(owner)["owned"] if k.startswith("w/")).split("/")[1]) * 64
    pusher = 1 - owner
    c.wait(lambda: "is free: listening on it" in c.logs[pusher].read_text(), 10,
           "the bridge to bind the freed doorbell")
    s = c.attach(pusher)
    try:
        req0 = lib.shmps_flush_wait(s._mptr, 0, 0)
        took = []
        for _ in range(3):
            t0 = time.monotonic()
            s["w"].push(np.ones((1, 8), np.int32), rows=[row])
            s.flush(timeout=30)
            took.append(time.monotonic() - t0)
        assert lib.shmps_flush_wait(s._mptr, 0, 0) == req0      # the futex word unused
    finally:
        s.close()
    assert max(took) < 1.0, took
    assert _flush_wakes(c, pusher)["doorbell"] >= 3


def test_one_bridge_process_per_store(make_cluster):
    """A bridge takes its store's bridge lock (an flock of the manifest file) before it
    listens or touches an outbox: while another process holds it (a bridge of the store
    still ending), it waits, listening on nothing, and starts once it is free.  A second
    bridge of a running store, on another address, gives up after BRIDGE_LOCK_WAIT (here
    1.5 s) with exit status 2 and records nothing lost (it recovered the live bridge's
    outboxes: the worker's flushes raised PushesLost; found by a review, 2026-11-27)."""
    import fcntl

    c = make_cluster(2, spare=1)                   # the spare address: the intruder's
    st = shmps.attach(c.store, namespace=c.namespaces[0])      # (creates host 0's store)
    fd = os.open("/dev/shm" + st._manifest.name, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)            # as a bridge of the store still ending
        c.start(0)
        c.start(1)
        c.wait(lambda: f"another bridge process (pid {os.getpid()}) of store"
               in c.logs[0].read_text(), 10, "host 0's bridge to wait for the lock, "
               "naming the process that holds it")
        time.sleep(0.5)
        assert c.health(0) is None                 # not listening while it waits
    finally:
        os.close(fd)                               # the lock goes with it
        st.close()
    c.wait_converged(20)
    assert "has ended: starting" in c.logs[0].read_text()
    create_everywhere(c, [0, 1])
    # a second bridge of host 1's store, on the spare address (its own hosts file lists
    # it), while a worker pushes there
    worker = c.worker(1, dict(push_spec(200, sleep=0.005), flush_every=20))
    time.sleep(0.3)
    hosts = c.dir / "intruder_hosts.txt"
    hosts.write_text("".join(a + "\n" for a in c.addrs))
    cmd = c.bridge_cmd(2)
    cmd[cmd.index("--namespace") + 1] = c.namespaces[1]
    cmd[cmd.index("--peers") + 1] = str(hosts)
    r = subprocess.run(cmd, capture_output=True, timeout=60,
                       env=dict(os.environ, SHMPS_BRIDGE_LOCK_WAIT="1.5"))
    assert r.returncode == 2, r.stderr.decode()
    assert (f"another shmps-bridge process (pid {c.procs[1].pid}) is running for store"
            .encode() in r.stderr), r.stderr
    out, err = worker.communicate(timeout=120)
    assert worker.returncode == 0, err.decode() + c.describe()      # no PushesLost
    assert "taken by an earlier bridge" not in c.logs[1].read_text(errors="replace")
    wait_totals(c, [0, 1], 200)


def test_pushing_faster_than_the_owner_applies(make_cluster):
    """A worker pushes 16 MiB in a loop without flush(), far more than the other host
    can apply: the bridge drains only as fast as the owner takes the batches (the rest
    keeps summing in the outbox) instead of queueing frames without bound.  Before,
    its event loop stalled for up to 0.8 s copying an ever larger send buffer, and the
    other host took it for dead.  Every push arrives exactly once; the view never
    changes (same epoch, no stall) and the sender's queue stays small."""
    c = make_cluster(2)
    c.start_all()
    big = {"big": [[4096, 1024], "int32", "sum", 256]}   # 16 shards of 1 MiB
    c.run_worker(0, {"create": {"dense": big}})
    wait_forwarding(c, {"big"}, [0, 1])
    epochs = [c.health(i)["epoch"] for i in (0, 1)]
    assert any(k.startswith("big/") for k in c.health(1)["owned"]), c.describe()
    p = c.worker(0, {"create": {"dense": big}, "pushes": 400, "flush": False})
    most_pending, lags = 0, []
    while p.poll() is None:
        h = c.health(0)
        most_pending = max(most_pending, sum(h["pending"].values()))
        lags.append(h["loop_lag_ms"])
        time.sleep(0.2)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err.decode()
    s = c.attach(0)
    try:
        s.flush(timeout=60)
    finally:
        s.close()
    for i in (0, 1):
        s = c.attach(i)
        try:
            w = s["big"].pull()
        finally:
            s.close()
        assert int(w.min()) == int(w.max()) == 400, (i, int(w.min()), int(w.max()))
    assert [c.health(i)["epoch"] for i in (0, 1)] == epochs, c.describe()
    for i in (0, 1):
        assert "did not run for" not in c.logs[i].read_text(), c.describe()
    # the event loop of the pushing host was never held up long (heartbeats go out)
    assert max(lags) < 250, lags
    # batches (of 1 MiB) sent and not acknowledged: the connection's backlog (SEND_AHEAD,
    # 4 MiB), what the sockets hold (the receiver's buffer autotunes up to tcp_rmem's
    # 32 MiB, the sender's to 4 MiB) and ACKs not yet read, not a drain of the whole
    # outbox every interval up to the 256 MiB budget.  (36-56 on a quiet machine, 73
    # once in a loaded CI run; without flow control it climbs to the budget.  Since the
    # owner's ACKs come behind its ROWS, the unacknowledged bytes per owner are capped
    # too: at most ACK_AHEAD (32 MiB) when a drain pass starts, plus what one pass
    # drains (a frame per shard): 31-53 here, 79-248 without that cap.)
    assert most_pending < 96, most_pending


def rejected(c: Cluster, i: int, reason: str) -> float:
    """Host ``i``'s count of frames refused for ``reason`` (0 if none was)."""
    for line in c.metrics(i).splitlines():
        if line.startswith("shmps_bridge_rejected_frames_total{") and f'reason="{reason}"' in line:
            return float(line.split()[-1])
    return 0.0


def test_default_size_shards_go_out_within_the_send_window(make_cluster):
    """Pushes to shards of the default size (16 MiB: a drain is 16 frames) go to their
    owner within a send window (SEND_WINDOW, 8 MiB unacknowledged), the rest as ACKs
    come, so the owner's ROWS back to the sender never pile up to the backlog at which
    it refuses batches (ROWS_AHEAD): eight rounds of push + flush of two such shards (once
    the new tensor's shards are copied: those snapshots may hold the owner's backlog up
    for a moment) see no batch refused BUSY "backlog", and land exactly once.  (Sent all at once, about a
    third of each round's frames were refused while the sender, busy sending, left the
    owner's ROWS unread; each refusal cost a resend 20 ms later, and a flush took 100 ms
    instead of 20: 0.5 GB/s forwarded instead of 0.9.)"""
    c = make_cluster(2)
    c.start_all()
    with c.attach(0) as s:
        t = s.dense("big", (32768, 1024), "int32", optimizer="sum")   # 8 shards of 16 MiB
        assert t.shard_rows == 4096
    wait_forwarding(c, {"big"}, [0, 1])
    owned = {i: sorted(int(k.split("/")[1]) for k in c.health(i)["owned"]
                       if k.startswith("big/")) for i in (0, 1)}
    owner = 1 if len(owned[1]) >= 2 else 0
    assert len(owned[owner]) >= 2, (owned, c.describe())
    shards = owned[owner][:2]
    rows = np.concatenate([np.arange(k * 4096, (k + 1) * 4096) for k in shards])
    with c.attach(1 - owner) as s:
        g = np.ones((rows.size, 1024), np.int32)
        s["big"].push(g, rows=rows)
        s.flush(timeout=60)

        def copied() -> bool:   # every shard's copy made, nothing left to send
            hs = [c.health(i) for i in (0, 1)]
            return sum(h["copied"] for h in hs) >= 8 and all(
                not v["data"] and not v["link"] for h in hs for v in h["send_backlog"].values())
        c.wait(copied, 30, "the copies of the new tensor's shards")
        before = rejected(c, owner, "backlog")
        for _ in range(8):
            s["big"].push(g, rows=rows)
            s.flush(timeout=60)
    assert rejected(c, owner, "backlog") == before, c.describe()
    for i in (0, 1):
        with c.attach(i) as s:
            w = s["big"].pull(rows=rows)
        assert int(w.min()) == int(w.max()) == 9, (i, int(w.min()), int(w.max()))


def test_a_pusher_killed_mid_push_leaves_nothing_behind(make_cluster):
    """A worker SIGKILLed while it pushes 16 MiB may die after writing values into the
    outbox and before counting its push, so no drain is due for them.  The bridge's sweep
    drains shards regardless (64 a second, in turn), so they are forwarded too: soon the
    outbox holds nothing (its pull is all zeros), after each of 5 kills.  (With the sweep
    turned off this test failed in 2 of 5 runs: some kills leave values behind.)"""
    c = make_cluster(2)
    c.start_all()
    big = {"big": [[4096, 1024], "int32", "sum", 256]}   # 16 shards of 1 MiB
    c.run_worker(0, {"create": {"dense": big}})
    wait_forwarding(c, {"big"}, [0, 1])
    for delay in (0.7, 0.9, 1.1, 1.3, 1.5):
        p = c.worker(0, {"create": {"dense": big}, "pushes": 10 ** 6, "flush": False})
        time.sleep(delay)
        assert p.poll() is None
        p.kill()
        p.wait(timeout=10)
        s = c.attach(0)
        try:
            ob = s["big"]._outbox()
            c.wait(lambda: not ob.pull().any(), 10, "the outbox of 'big' to be empty")
        finally:
            s.close()


def metric_value(c: Cluster, i: int, name: str) -> float:
    for line in c.metrics(i).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in host {i}'s /metrics")


def test_a_model_of_many_tensors_is_taken_up_without_a_stall(make_cluster):
    """A worker creates a model's 400 parameter tensors (4 shards each) at once.  Every
    bridge takes them all up (the other host creates them from the catalog) a slice at a
    time, its event loop running in between: no bridge stops for so long that it takes
    itself for stopped (stalls_total) or its peer for dead, and the ring never moves.
    (Taken up in one go, this stalled each bridge 0.8-1.5 s; the 3-host variant saw
    hosts declared dead.)  Then a push to each tensor from the other host and flush:
    every host holds it exactly.  The catalog, unchanged, is answered 304 to its ETag.
    dead_after 1 s: a stall is 500 ms without running, below the 0.8 s of the bug; the
    loop's longest lag here is 100-150 ms on an idle 2-core machine, and CI counted a
    290 ms one (at 0.5 s, before refresh_tensors' calls shared one slice a turn:
    test_bridge_units' test_calls_in_one_loop_turn_share_one_slice_of_taking_up_tensors)."""
    c = make_cluster(2, dead_after=1.0)
    c.start_all()
    n = 400
    model = {f"p{k}": [[64, 16], "int32", "sum", 16] for k in range(n)}
    c.run_worker(0, {"create": {"dense": model}}, timeout=120)
    wait_forwarding(c, set(model), [0, 1])
    for i in (0, 1):
        assert c.health(i)["epoch"] == 0, c.describe()
        assert metric_value(c, i, "shmps_bridge_stalls_total") == 0, c.describe()
        log = c.logs[i].read_text(errors="replace")
        assert "-> dead" not in log and "did not run for" not in log, c.describe()
    with c.attach(1) as s:
        for k in range(n):
            s[f"p{k}"].push(np.ones((64, 16), np.int32))
        s.flush(timeout=60)
    for i in (0, 1):
        with c.attach(i) as s:
            short = [k for k in range(n) if not (s[f"p{k}"].pull() == 1).all()]
        assert not short, (i, short[:10], c.describe())

    # the catalog is not sent again while it has not changed: 304 for its ETag
    def catalog(tag: str | None) -> tuple[int, str, list]:
        headers = auth.sign_request(c.secret_file.read_bytes().strip(), "GET",
                                    "/v1/catalog", b"", c.addrs[1], target=c.addrs[0],
                                    store=c.store)
        if tag is not None:
            headers["If-None-Match"] = tag
        req = urllib.request.Request(c.url(0, "/v1/catalog"), headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.headers["ETag"], json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, e.headers["ETag"], []

    status, tag, recs = catalog(None)
    assert status == 200 and tag and {r["name"] for r in recs} == set(model)
    assert catalog(tag)[:2] == (304, tag)
    c.run_worker(0, {"create": {"dense": {"extra": [[8, 4], "int32", "sum", 8]}}})
    status, tag2, recs = catalog(tag)
    assert status == 200 and tag2 != tag and len(recs) == n + 1
    wait_forwarding(c, {"extra"}, [1])


def test_a_shard_larger_than_the_send_backlog_is_copied(make_cluster):
    """One 64 MiB shard with Adagrad: its snapshot (values and state, 128 MiB) is
    larger than a connection may queue (wsstream.MAX_BACKLOG, 64 MiB).  It is queued
    whole whatever the backlog, the ROWS of later changes after it: the other host gets
    its copy (the new owner its hand-over, or the
    backup its replica), so a push + flush from either host returns and both hold the
    same values, the creating host's init moved by two Adagrad steps.  (Before, every chunk
    past the backlog was refused: the new owner gave up waiting and served its own copy,
    or the owner waited for its backup's copy for ever.)"""
    # dead_after 2 s: the test is about the copy, not failure detection (creating,
    # pushing and reading a 64 MiB shard on a loaded 2-core machine can starve a bridge
    # for 0.5 s; a host taken for dead here used to end with a copy that differed:
    # test_two_hosts_that_took_each_other_for_dead_are_one_ring_again)
    c = make_cluster(2, dead_after=2.0)
    c.start_all()
    rows = 16384
    with c.attach(0) as s:
        s.dense("big", (rows, 1024), "float32", shard_rows=rows, init=0.5,
                optimizer=shmps.Adagrad(lr=0.01))
    wait_forwarding(c, {"big"}, [0, 1])
    steps = [np.float32(0.5 - 0.01),                          # G = 1
             np.float32(0.5 - 0.01 - 0.01 / np.sqrt(2.0))]    # then G = 2
    for k, i in enumerate((1, 0)):
        with c.attach(i) as s:
            s["big"].push(np.ones((rows, 1024), np.float32))
            try:
                s.flush(timeout=30)
            except shmps.Timeout as e:
                raise AssertionError(f"{e}\n{c.describe()}") from None
        # flush() returned: the owner applied the push and its backup (the other host,
        # replicas 2) holds the rows, so both copies show exactly k + 1 steps now
        for j in (0, 1):
            with c.attach(j) as s:
                got = s["big"].pull()
            vals, counts = np.unique(got, return_counts=True)
            assert np.allclose(got, steps[k], atol=1e-6), \
                (f"after flush {k + 1} (host {i}), host {j} holds", dict(zip(vals[:6], counts[:6])),
                 c.describe())
    for i in (0, 1):
        assert "serving from this host's copy" not in c.logs[i].read_text(), c.describe()


def test_a_slow_snapshot_read_leaves_the_event_loop_running(make_cluster, monkeypatch):
    """Snapshots are read and encoded off the event loop, in the snapshot thread.  Every
    read here takes 1.2 s longer (failpoint slow_snapshot: a slow machine's copy of a
    large shard took 0.5-0.7 s for 192 MiB), while a worker pushes and flushes every round:
    - heartbeats go on: with --dead-after 1 s neither host ever sees the other other than
      alive, the epochs do not move, and neither event loop is ever 1 s late;
    - a shard being read refuses batches (BUSY, reason "snapshot"), which the sender
      resends, so every flush returns and the totals are exact on both hosts.
    (Reading in one step of the event loop, as before, fails the first point: a 1.2 s
    read is a stall (0.5 s), a peer silent past dead_after and a 1.2 s lag.  The reads
    took 2 s each before, the failpoint's default.)"""
    monkeypatch.setenv("SHMPS_BRIDGE_FAILPOINTS", "slow_snapshot=1.2")
    c = make_cluster(2, dead_after=1.0)
    c.start_all()
    epochs = {i: c.health(i)["epoch"] for i in (0, 1)}
    rounds = 40
    dense = {"w": [[256, 8], "int32", "sum", 64]}   # 4 shards: their copies are read in turn
    w = c.worker(0, {"create": {"dense": dense}, "pushes": rounds, "sleep": 0.05,
                     "flush": True, "flush_every": 1, "flush_timeout": 60.0})
    states: set = set()
    lag, seen_epochs = 0.0, set()
    deadline = time.monotonic() + 120
    while w.poll() is None and time.monotonic() < deadline:
        for i in (0, 1):
            h = c.health(i)
            if h is None:
                continue
            states |= {(i, m["address"], m["state"]) for m in h["members"]}
            lag = max(lag, h["loop_lag_ms"])
            seen_epochs.add((i, h["epoch"]))
        time.sleep(0.1)
    out, err = w.communicate(timeout=30)
    assert w.returncode == 0, err.decode() + c.describe()
    logs = "".join(c.logs[i].read_text(errors="replace") for i in (0, 1))
    slow = logs.count("failpoint slow_snapshot")
    assert slow >= 4, (slow, c.describe())   # the copies of the 4 shards, at least
    assert {s for _, _, s in states} == {"alive"}, (sorted(states), c.describe())
    assert seen_epochs == {(0, epochs[0]), (1, epochs[1])}, (seen_epochs, epochs, c.describe())
    assert lag < 1000, (lag, c.describe())
    assert "did not run for" not in logs, c.describe()
    assert rejected(c, 0, "snapshot") + rejected(c, 1, "snapshot") > 0, c.describe()
    for i in (0, 1):
        with c.attach(i) as s:
            got = s["w"].pull()
        assert (got == rounds).all(), (i, np.unique(got), c.describe())


def test_a_forwarded_drain_is_one_adam_step_however_many_frames(make_cluster):
    """A 16 MiB shard drains into 16 BATCH frames of 1 MiB.  The frames after the first
    carry Flag.CONTINUES, so the owner applies the whole drain at one step of the dense
    tensor's Adam t: every row moves by the same first Adam step, on both hosts, and the
    owner counts one step and one push.  (Before, t advanced once per frame: the 256-row
    blocks of one push moved by the steps t = 1..16, and the owner counted 16 pushes.)"""
    c = make_cluster(2, replicas=2)
    c.start_all()
    rows, cols, lr = 4096, 1024, 0.01
    with c.attach(0) as s:
        s.dense("adam", (rows, cols), "float32", shard_rows=rows, init=0.5,
                optimizer=shmps.Adam(lr=lr))
    wait_forwarding(c, {"adam"}, [0, 1])
    owner = next(i for i in (0, 1) if "adam/0" in c.health(i)["owned"])
    sender = 1 - owner
    with c.attach(sender) as s:
        s["adam"].push(np.ones((rows, cols), np.float32))
        s.flush(timeout=30)
    # torch.optim.Adam at t = 1 with g = 1: m_hat = v_hat = 1, w -= lr * 1 / (1 + eps)
    want = np.float32(0.5) - np.float32(lr / (1 + 1e-8))
    got = {}
    for i in (owner, sender):
        with c.attach(i) as s:
            got[i] = s["adam"].pull()
            if i == owner:
                st = s["adam"].stats()
                # one push of 16 MiB: one step, counted as one push of all its rows
                assert (st["step"], st["pushes"], st["rows_pushed"], st["bytes_pushed"]) == (
                    1, 1, rows, rows * cols * 4), c.describe()
    np.testing.assert_array_equal(got[owner], got[sender])
    blocks = np.unique(got[owner][::256, 0])
    assert blocks.size == 1 and np.isclose(blocks[0], want, rtol=0, atol=1e-6), (
        blocks, want)


def test_flush_waits_for_the_drain_that_took_a_landing_push(make_cluster):
    """A push whose values landed in the outbox but whose count had not yet (the pusher
    preempted in between) is taken by a drain that reads the same ``pushed`` as the
    drain before it (the flush loop's sweep drains shards that look idle).  Once counted,
    the next drain finds nothing: flush() must still wait for the owner to apply the
    drain that holds the values.  (It returned at once, the owner stopped: the empty
    drain acknowledged the push on the strength of the earlier drain's ack.  On the
    64 MiB test above, two clusters at once on 2 cores, that was a flush returning in
    0.1-0.2 s with the copies one step short, 2 runs in 16.)"""
    from shmps.dense import DenseTensor
    from shmps._native import lib

    c = make_cluster(2, dead_after=4.0)
    c.start_all()
    with c.attach(0) as s:
        s.dense("w", (64, 8), "float32", shard_rows=64, init=0.0, optimizer="sum")
    wait_forwarding(c, {"w"}, [0, 1])
    c.wait(lambda: any((c.health(i) or {}).get("owned") for i in (0, 1)), 15, "an owner")
    owner = next(i for i in (0, 1) if c.health(i)["owned"])
    sender = 1 - owner
    with c.attach(sender) as s:
        t = s["w"]
        t.push(np.ones((64, 8), np.float32))
        s.flush(timeout=30)                          # one drain, acknowledged
        ob = t._outbox()
        os.killpg(c.procs[owner].pid, signal.SIGSTOP)
        try:
            # a push's values land; its count does not yet
            DenseTensor._apply(ob, np.ones((64, 8), np.float32), None)
            c.wait(lambda: sum(((c.health(sender) or {}).get("pending") or {}).values()) > 0,
                   10, "the sweep to drain the landed values")
            assert lib.shmps_outbox_pushed(ob._shard(0).ptr) == 0   # now it is counted
            t0 = time.monotonic()
            with pytest.raises(shmps.Timeout):
                s.flush(timeout=0.5)                 # the owner applied nothing
            assert time.monotonic() - t0 >= 0.5
        finally:
            os.killpg(c.procs[owner].pid, signal.SIGCONT)
        s.flush(timeout=30)
    for i in (0, 1):
        with c.attach(i) as s:
            got = s["w"].pull()
        assert (got == 2.0).all(), (i, np.unique(got), c.describe())


def test_a_flushed_push_shows_in_the_pushing_hosts_pull(make_cluster):
    """Read your writes: once flush() returns, a pull on the pushing host shows its push,
    also where another host owns the shard.  The owner sends its ACK after the ROWS, on
    the same connection (the one the pushing host opened), so the host writes the rows
    into its copy before it takes the ACK.  (The ACK went back on the other connection,
    the one the BATCH came on, and overtook the 256 KiB of ROWS: pull showed the
    previous round.)  Replicas 1: with 2, the pushing host is the owner's backup, and
    its ACK of the ROWS comes before the owner's ACK of the batch anyway.  dead_after
    2 s (a bridge starts by listening for twice that): no host is stopped here, the
    margin is only for a loaded machine."""
    c = make_cluster(2, dead_after=2.0, replicas=1)
    c.start_all()
    with c.attach(0) as s:
        s.dense("w", (1024, 256), "int32", shard_rows=256, init=0, optimizer="sum")
    wait_forwarding(c, {"w"}, [0, 1])
    c.wait(lambda: sum(len([k for k in (c.health(i) or {}).get("owned", []) if k.startswith("w/")])
                       for i in (0, 1)) == 4, 15, "every shard owned")
    owner = max((0, 1), key=lambda i: len(c.health(i)["owned"]))
    sender = 1 - owner
    shard = int(sorted(c.health(owner)["owned"])[0].split("/")[1])
    rows = np.arange(shard * 256, shard * 256 + 256)
    stale = []
    with c.attach(sender) as s:
        t = s["w"]
        t.push(np.ones((256, 256), np.int32), rows=rows)
        s.flush(timeout=30)
        # the owner sends ROWS to a host once it has sent it a copy of the shard
        c.wait(lambda: (t.pull(rows=rows) == 1).all(), 15, "the sender's copy in sync")
        for k in range(2, 102):
            t.push(np.ones((256, 256), np.int32), rows=rows)
            s.flush(timeout=30)
            got = t.pull(rows=rows)
            if not (got == k).all():
                stale.append((k, int(got.min()), int(got.max())))
    assert not stale, f"pull after flush behind (round, min, max): {stale[:5]}, {len(stale)} of 100"
    with c.attach(owner) as s:
        assert (s["w"].pull(rows=rows) == 101).all()


def test_a_corrupt_outbox_shard_stops_only_itself(make_cluster):
    """A table outbox shard that fails every drain (a corrupt row) is counted, logged and
    skipped, and tried again once a second: the other tensors' pushes still reach their
    owners (and a refused first batch is still resent: a failing drain used to end the
    flush pass before its resends), and flush() raises PushesLost for the rows that
    drain took and lost."""
    from test_outbox import _corrupt_live_row, segment_path

    # dead_after 2 s (was 5): host 0 is stopped only while a row is corrupted, far
    # below the 1 s that counts as a stall; a start-up listens for 2 * dead_after
    c = make_cluster(2, replicas=1, dead_after=2.0)
    c.start_all()
    s = c.attach(0)
    try:
        e = s.table("e", dim=2, dtype="float32", capacity=64, shards=1, optimizer="sum")
        w = s.dense("w", (64, 4), "int32", optimizer="sum", shard_rows=16)
        wait_forwarding(c, {"e", "w"}, [0, 1])
        e.push([1], np.ones((1, 2), np.float32))
        s.flush(timeout=20)                          # e's outbox is in use
        path = segment_path(s, e._outbox())
        c.signal(0, signal.SIGSTOP)                  # no drain while the row is broken
        try:
            e.push([2, 3, 4], np.ones((3, 2), np.float32))
            w.push(np.ones((64, 4), np.int32))
            _corrupt_live_row(e._outbox(), path, [2, 3, 4], 1)   # a row taken before it
        finally:
            c.signal(0, signal.SIGCONT)
        with pytest.raises(shmps.PushesLost, match="'e' shard 0"):
            s.flush(timeout=20)
        w.push(np.ones((64, 4), np.int32))
        s.flush(timeout=20)                          # e's loss was raised once
        for i in (0, 1):
            h = c.attach(i)
            try:
                c.wait(lambda: int(h["w"].pull().min()) == 2, 10, f"host {i} to hold w's total")
            finally:
                h.close()
        c.wait(lambda: "shmps_bridge_drain_failures_total" in c.metrics(0)
               and _sample(c.metrics(0), "shmps_bridge_drain_failures_total") >= 1, 10,
               "the failed drains to be counted")
        # pushes keep the broken shard busy: its drain is tried once a second
        # (DRAIN_RETRY_S), not every flush pass (each takes the shard's freeze)
        first = _sample(c.metrics(0), "shmps_bridge_drain_failures_total")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.5:
            e.push([20], np.ones((1, 2), np.float32))
            time.sleep(0.005)
        tries = _sample(c.metrics(0), "shmps_bridge_drain_failures_total") - first
        assert 1 <= tries <= 5, f"{tries} failed drains in 2.5 s of pushes"
    finally:
        s.close()
    # the repair (docs/bridge.md, "A corrupt outbox shard"): with this host's workers
    # stopped (the test's handle closed above), stop its bridge (SIGTERM: it hands its
    # shards over), remove this host's copy of the store, start the bridge again: it
    # joins, takes the tensors from the other host's catalog and copies every shard
    c.signal(0, signal.SIGTERM)
    assert c.wait_exit(0, 30) == 0, c.describe()
    shmps.attach(c.store, namespace=c.namespaces[0]).destroy()
    c.start(0)
    c.wait_converged(30)
    wait_forwarding(c, {"e", "w"}, [0, 1])
    with c.attach(0) as s:
        c.wait(lambda: int(s["w"].pull().min()) == 2, 15, "host 0's copy of w")
        c.wait(lambda: "e" in [t["name"] for t in s.tensors()], 15, "host 0's e")
        s["e"].push([7], np.full((1, 2), 5.0, np.float32))
        s["w"].push(np.ones((64, 4), np.int32))
        s.flush(timeout=20)                          # no PushesLost: a new outbox
    for i in (0, 1):
        with c.attach(i) as h:
            c.wait(lambda: np.array_equal(h["e"].pull([7]), [[5.0, 5.0]])
                   and int(h["w"].pull().min()) == 3, 10, f"host {i} after the repair")
    assert _sample(c.metrics(0), "shmps_bridge_drain_failures_total") == 0


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_owner_killed_mid_stream(make_cluster):
    c = make_cluster(3)
    c.start_all()
    create_everywhere(c, [0, 1, 2])
    owned = {i: c.health(i)["owned"] for i in range(3)}
    victim = max(owned, key=lambda i: len(owned[i]))
    survivors = [i for i in range(3) if i != victim]
    # the victim's shards that every round pushes to: every dense and csr shard, and the
    # table shards of KEYS
    s = c.attach(survivors[0])
    try:
        emb = s["emb"]
        table = {shard_key("emb", k) for k in range(emb.nshards)}
        keyed = {shard_key("emb", k)
                 for k in emb._key_shard(np.array(KEYS, np.uint64)).tolist()}
    finally:
        s.close()
    pushed = {k for k in owned[victim] if k not in table or k in keyed}
    assert pushed, owned
    rounds = 150
    procs = [c.worker(i, push_spec(rounds, sleep=0.01)) for i in survivors for _ in range(2)]
    # mid-stream: the victim applies the workers' batches (a fixed sleep was not enough
    # on a loaded machine, where the workers took over a second to start: the "failover"
    # then measured their start, 1.2-2.6 s)
    c.wait(lambda: _sample(c.metrics(victim), "shmps_bridge_batches_applied_total") >= 20,
           30, "the victim to apply the workers' batches")
    assert all(p.poll() is None for p in procs), "the workers ended before the kill"
    t_kill = c.kill(victim)
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode() + c.describe()
    wait_totals(c, survivors, 2 * 2 * rounds)
    # the victim's shards were taken over: the time from the kill to the first batch
    # applied by a successor, of the first shard (the issue's measure) and of every one
    firsts = {f["shard"]: f["first_apply_wall"] for i in survivors
              for f in c.health(i)["failovers"] if f["dead"] == c.addrs[victim]}
    assert pushed <= set(firsts), (sorted(pushed - set(firsts)), c.describe())
    took = min(firsts[k] for k in pushed) - t_kill
    took_all = max(firsts[k] for k in pushed) - t_kill
    print(f"failover: kill -> first batch applied by the new owner {took * 1000:.0f} ms, "
          f"of every shard pushed to {took_all * 1000:.0f} ms ({len(pushed)} shards)")
    assert 0 < took < 1.0
    # the bench's measure (tools/bench.py bridge) is < 1 s at the max; 2.5 s here, with
    # four workers and three bridges on the test machine's cores (a shard held for the
    # 3 s hand-over timeout still fails it)
    assert took_all < 2.5


def test_paused_host_rejoins_without_split_brain(make_cluster):
    c = make_cluster(3)
    c.start_all()
    create_everywhere(c, [0, 1, 2])
    epoch0 = c.health(0)["epoch"]
    rounds = 300
    procs = [c.worker(i, push_spec(rounds, sleep=0.02)) for i in range(3)]
    time.sleep(1.0)
    os.killpg(c.procs[1].pid, signal.SIGSTOP)
    time.sleep(1.0)
    h0 = c.health(0)
    assert {m["address"]: m["state"] for m in h0["members"]}[c.addrs[1]] == "dead"
    assert c.addrs[1] not in [m for m in h0["owned"]]
    time.sleep(2.0)
    os.killpg(c.procs[1].pid, signal.SIGCONT)
    settled_exact(c, procs, rounds, epoch0, bumps=2, converge=20)
    # the resumed host noticed it had not run, and listened before acting again
    stalls = [line for line in c.metrics(1).splitlines()
              if line.startswith("shmps_bridge_stalls_total ")]
    assert stalls and float(stalls[0].split()[-1]) >= 1, stalls


def test_two_hosts_that_took_each_other_for_dead_are_one_ring_again(make_cluster):
    """Two hosts: one stalls past dead_after (a starved CPU; here SIGSTOP), the other
    counts it dead, alone, so with no majority: no epoch, no shard moves.  Heard again,
    the stalled host is alive, both are on the ring of the same epoch, and pushes from
    both are applied once and backed up.  (It came back joining: it never copied its
    shards, since one peer of two is no majority telling it to, and the other host,
    its quorum back through the joining member, owned every shard on a ring of itself
    with no backup to wait for; when both did, both owned.  Under load, in the 64 MiB
    test with dead_after 0.5 s: a copy left at the adopting host's own init, copies
    that differed, flushes that never returned.)"""
    c = make_cluster(2)
    c.start_all()
    create_everywhere(c, [0, 1])
    epoch0 = c.health(1)["epoch"]

    def state_of_0() -> str:
        h = c.health(1) or {}
        return {m["address"]: m["state"] for m in h.get("members", [])}.get(c.addrs[0], "")

    os.killpg(c.procs[0].pid, signal.SIGSTOP)
    try:
        c.wait(lambda: state_of_0() == "dead", 10, "host 1 to count host 0 dead")
        h1 = c.health(1)
        assert h1["epoch"] == epoch0 and not h1["acting"], h1   # alone: no majority
    finally:
        os.killpg(c.procs[0].pid, signal.SIGCONT)
    c.wait_converged(10)
    assert {c.health(i)["epoch"] for i in (0, 1)} == {epoch0}
    procs = [c.worker(i, push_spec(10)) for i in (0, 1)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode() + c.describe()
    wait_totals(c, [0, 1], 2 * 10)


def test_senders_bridge_killed_and_restarted(make_cluster):
    """The bridge of a host whose worker pushes is SIGKILLed and restarted mid-stream.
    What it had drained and not seen acknowledged ends with it (only that process held
    those batches): the restarted bridge records it as lost, and the worker's flush
    raises PushesLost for it instead of returning as if it had been applied. Every
    other push is applied exactly once, and every host holds the same copy."""
    c = make_cluster(3)
    c.start_all()
    create_everywhere(c, [0, 1, 2])
    rounds = 150
    spec = dict(push_spec(rounds, sleep=0.01), flush_every=10, catch_lost=True)
    procs = [c.worker(1, spec), c.worker(0, push_spec(rounds, sleep=0.01))]
    time.sleep(0.8)
    old_inc = c.health(1)["incarnation"]
    os.killpg(c.procs[1].pid, signal.SIGKILL)
    c.procs[1].wait(10)
    c.start(1)
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode() + c.describe()
        outs.append(json.loads(out.decode().splitlines()[-1]))
    c.wait_converged(30)
    lost = 0.0
    for line in c.metrics(1).splitlines():
        if line.startswith("shmps_bridge_lost_pushes_total "):
            lost = float(line.split()[-1])
    # the worker was told exactly when something was lost
    assert (lost > 0) == (outs[0]["lost_flushes"] > 0), (lost, outs, c.describe())
    assert outs[1]["lost_flushes"] == 0

    def same_everywhere() -> bool:
        copies = [pulled(c, i) for i in range(3)]
        return all(np.array_equal(copies[0][k], cp[k]) for cp in copies for k in (0, 1, 2))

    c.wait(same_everywhere, 15, "every host to hold the same copy")
    w, e, x = pulled(c, 0)
    # each lost push may or may not have been applied (its ACK may be what was lost);
    # nothing else is missing or applied twice
    assert 2 * rounds - lost <= int(w.min()) and int(w.max()) <= 2 * rounds, (w.min(), lost)
    assert 2 * rounds - lost <= int(e.min()) and int(e.max()) <= 2 * rounds, (e.min(), lost)
    assert 2 * rounds - lost <= int(x.min()) and int(x.max()) <= 2 * rounds, (x.min(), lost)
    # the duplicate filters of host 1's old bridge process are forgotten everywhere: each
    # host keeps filters for the three live bridge processes at most
    for i in range(3):
        h = c.health(i)
        assert len(h["filters"]) <= 3, h["filters"]
        assert not any(f.endswith(f"/{old_inc:08x}") for f in h["filters"]), h["filters"]


def test_lost_handover_is_asked_for_again(make_cluster, monkeypatch):
    """A host joins mid-training and every first hand-over snapshot is lost on the way
    (failpoint): each new owner answers BUSY and asks the previous owner again with SYNC
    (every 0.5 s), which sends it again; totals stay exact, and no new owner falls back
    to serving its own copy after the 3 s hand-over timeout."""
    c, logs = train_through_a_join(make_cluster, monkeypatch, "drop_first_handover")
    dropped = re.findall(r"hand-over of (\S+) to (\S+) dropped", "".join(logs.values()))
    assert dropped, c.describe()          # host 3 took shards over: hand-overs were lost
    for key, to in dropped:
        text = logs[c.addrs.index(to)]
        # it came again, after the new owner's SYNC (or before the new owner saw the
        # new ring: then it was kept and used when it did)
        assert (f"shard {key} handed over by" in text
                or f"shard {key}: hand-over snapshot from" in text), (key, to, c.describe())
    for text in logs.values():
        assert "serving from this host's copy" not in text, c.describe()


def test_a_new_owner_that_gets_no_hand_over_serves_its_own_copy(make_cluster, monkeypatch):
    """A host joins mid-training and no hand-over ever arrives (failpoint drop_handovers:
    every one is dropped, no SYNC is answered "coming"): each new owner refuses its
    shard's batches for HANDOVER_TIMEOUT (3 s), then serves its own copy, whether or not
    a batch comes (training may have ended by then).  That copy holds the joiner's
    snapshot and every ROWS the previous owner sent after it, in order on one
    connection, so no acknowledged push is missing and none is applied twice: the totals
    are exact on every host, before the new owner gives up and after."""
    from shmps.bridge.node import HANDOVER_TIMEOUT

    c, logs = train_through_a_join(make_cluster, monkeypatch, "drop_handovers",
                                   totals_timeout=30.0)
    dropped = set(re.findall(r"hand-over of (\S+) to (\S+) dropped", "".join(logs.values())))
    to_joiner = {key for key, to in dropped if to == c.addrs[3]}
    assert to_joiner, c.describe()       # host 3 took shards over: their hand-overs were lost

    def fell_back() -> set:
        return set(re.findall(r"shard (\S+): no hand-over snapshot from \S+; serving from "
                              r"this host's copy", c.logs[3].read_text(errors="replace")))

    c.wait(lambda: to_joiner <= fell_back(), HANDOVER_TIMEOUT + 10,
           f"host 3 to serve its own copy of {sorted(to_joiner)}")
    assert fell_back() == to_joiner, c.describe()
    wait_totals(c, [0, 1, 2, 3], 2 * 200)
    for text in logs.values():
        assert "handed over by" not in text, c.describe()


def test_a_host_joins_while_snapshot_reads_are_slow(make_cluster, monkeypatch):
    """A host joins mid-training while every snapshot read takes 0.5 s longer (failpoint
    slow_snapshot=0.5, --dead-after 0.5): the backups' first copies, the joiner's copies
    and the hand-overs are read in the snapshot thread while roles and epochs move on
    the event loop (a read that a role change or a write overtakes is dropped and read
    again; one an epoch overtakes is stamped with the new epoch).  Totals stay exact on
    every host and no host counts itself stalled.  The creating host reads the initial
    values of every shard for its owner, one at a time, and the hand-overs wait in the
    same queue: some owners wait longer than the 3 s hand-over timeout, and since the
    host they wait for answers their SYNCs "coming", none gives up and serves its own
    copy.  (Before 2026-11-26 some did here.)"""
    c, logs = train_through_a_join(make_cluster, monkeypatch, "slow_snapshot=0.5",
                                   totals_timeout=30.0)
    assert sum(t.count("failpoint slow_snapshot") for t in logs.values()) >= 9, c.describe()
    for text in logs.values():
        assert "did not run for" not in text, c.describe()
        assert "serving from this host's copy" not in text, c.describe()


def train_through_a_join(make_cluster, monkeypatch, failpoints: str, rounds: int = 200,
                         totals_timeout: float = 10.0) -> tuple[Cluster, dict]:
    """train_while_a_host_joins (after 0.3 s) with the bridges' ``failpoints``: both
    workers end well, the four hosts converge and hold the exact totals.  Returns the
    cluster and each host's log (at DEBUG: the per-shard lines of a hand-over)."""
    monkeypatch.setenv("SHMPS_BRIDGE_FAILPOINTS", failpoints)
    c, procs = train_while_a_host_joins(make_cluster, rounds, after=0.3, log_level="DEBUG")
    for p in procs:
        out, err = p.communicate(timeout=150)
        assert p.returncode == 0, err.decode() + c.describe()
    c.wait_converged(30, hosts=[0, 1, 2, 3])
    wait_totals(c, [0, 1, 2, 3], 2 * rounds, timeout=totals_timeout)
    return c, {i: c.logs[i].read_text(errors="replace") for i in range(4)}


def train_while_a_host_joins(make_cluster, rounds: int, after: float,
                             log_level: Optional[str] = None):
    """3 hosts; workers on hosts 0 and 2 push ``rounds`` rounds; after ``after`` s a fourth
    host is added to hosts.txt and started. Returns the cluster and the workers.

    The ring depends on the (random) ports; the addresses are drawn again until the
    fourth host owns at least one of the 9 shards, so that its join moves ownership."""
    keys = [shard_key("w", s) for s in range(8)] + [shard_key("emb", 0)]
    for _ in range(50):
        c = make_cluster(3, spare=1, log_level=log_level)
        ring = Ring(c.addrs[:4])
        if any(ring.owner(k) == c.addrs[3] for k in keys):
            break
    else:
        raise AssertionError("no draw of ports gave the fourth host a shard")
    c.start_all()
    create_everywhere(c, [0, 1, 2])
    procs = [c.worker(0, push_spec(rounds, sleep=0.01)), c.worker(2, push_spec(rounds, 0.01))]
    time.sleep(after)
    c.members.append(c.addrs[3])
    c.write_hosts()
    c.start(3)
    return c, procs


def test_host_added_and_removed_mid_training(make_cluster):
    rounds = 400
    c, procs = train_while_a_host_joins(make_cluster, rounds, after=0.5)
    c.wait_converged(30, hosts=[0, 1, 2, 3])   # host 3 is on every host's ring
    # host 1 is removed: it hands over and exits
    c.members.remove(c.addrs[1])
    c.write_hosts()
    c.procs[1].wait(30)
    assert c.procs[1].returncode == 0, c.describe()
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode() + c.describe()
    c.wait_converged(20, hosts=[0, 2, 3])
    wait_totals(c, [0, 2, 3], 2 * rounds)


# --------------------------------------------------------------------------- hostile peers

async def _ws_session(c: Cluster, i: int, secret: bytes, client: str, incarnation: int):
    import aiohttp
    session = aiohttp.ClientSession()
    ws = await session.ws_connect(c.url(i, "/v1/stream"), max_msg_size=64 << 20)
    hello = await ws.receive_bytes(timeout=5)
    hs = auth.ClientHandshake(secret, client, "data", sender=member_id(client),
                              store=c.store, incarnation=incarnation, server_id=c.addrs[i])
    await ws.send_bytes(hs.answer(hello))
    return session, ws, hs


def test_hostile_peers_are_refused(make_cluster):
    c = make_cluster(3)
    c.start_all()
    create_everywhere(c, [0, 1, 2])
    c.run_worker(0, {"create": {"table": {"emb4": [4, "int32", 1000, 4]}}})
    wait_forwarding(c, {"emb4"}, [0, 1, 2])
    secret = c.secret_file.read_bytes().strip()
    # attack a host that owns a shard of w, and of emb4 if one does (the ring depends on
    # the random ports)
    owns = [(any(k.startswith("w/") for k in c.health(i)["owned"]),
             any(k.startswith("emb4/") for k in c.health(i)["owned"])) for i in range(3)]
    target = max((i for i in range(3) if owns[i][0]), key=lambda i: owns[i][1])
    other = (target + 1) % 3
    h = c.health(target)
    key = next(k for k in h["owned"] if k.startswith("w/"))
    shard = int(key.split("/")[1])
    emb_keys = [k for k in h["owned"] if k.startswith("emb4/")]
    emb_shard = int(emb_keys[0].split("/")[1]) if emb_keys else None
    s = c.attach(target)
    try:
        keys = np.arange(1, 200, dtype=np.uint64)
        home = s["emb4"]._key_shard(keys)
        emb_attack = (np.array([keys[home == emb_shard][0], keys[home != emb_shard][0]])
                      if emb_shard is not None else keys[:2])
        emb_before = s["emb4"].pull(emb_attack)
    finally:
        s.close()
    before = pulled(c, target)[0]

    async def attack() -> dict:
        import aiohttp
        out: dict = {}
        # 1. wrong secret: the handshake fails, the connection is closed
        session, ws, hs = await _ws_session(c, target, b"x" * 32, c.addrs[other], 7)
        msg = await ws.receive(timeout=5)
        out["wrong_secret"] = msg.type
        await session.close()
        # 2. garbage after a valid handshake: refused, closed after 3
        session, ws, hs = await _ws_session(c, target, secret, c.addrs[other], 8)
        hs.check(await ws.receive_bytes(timeout=5))
        for _ in range(3):
            await ws.send_bytes(os.urandom(100))
        msg = await ws.receive(timeout=5)
        out["garbage"] = msg.type
        await session.close()
        # 3. an oversized message: the connection is closed, nothing read
        session, ws, hs = await _ws_session(c, target, secret, c.addrs[other], 9)
        hs.check(await ws.receive_bytes(timeout=5))
        try:
            await ws.send_bytes(b"\0" * (16 << 20))
            msg = await ws.receive(timeout=5)
            out["oversized"] = msg.type
        except (ConnectionError, aiohttp.ClientError):
            out["oversized"] = aiohttp.WSMsgType.CLOSED   # closed while we were sending
        await session.close()
        # 4. a batch replayed (same stream and seq, also on a new connection): applied once
        # (the first frame of a stream the owner does not know is answered GAP: the
        # sender is to resend from its oldest unacknowledged batch, here the same one)
        session, ws, hs = await _ws_session(c, target, secret, c.addrs[other], 10)
        hs.check(await ws.receive_bytes(timeout=5))
        epoch = c.health(target)["epoch"]
        batch = frames.encode_batch(epoch=epoch, sender=member_id(c.addrs[other]), incarnation=10,
                                    tensor=frames.tensor_id("w"), shard=shard, seq=1,
                                    values=np.ones((64, 8), np.int32), start=shard * 64)
        acks = []
        for _ in range(3):
            await ws.send_bytes(batch)
            acks.append(frames.decode(await ws.receive_bytes(timeout=5)))
        await session.close()
        session, ws, hs = await _ws_session(c, target, secret, c.addrs[other], 10)
        hs.check(await ws.receive_bytes(timeout=5))
        await ws.send_bytes(batch)
        acks.append(frames.decode(await ws.receive_bytes(timeout=5)))
        out["acks"] = [(a.status, a.seq) for a in acks]
        # 5. batches naming this shard with rows of another shard, or rows out of order
        # (a drain sends them sorted): refused before anything is applied
        wrong = []
        for seq, kw in ((2, {"start": ((shard + 1) % 8) * 64}),
                        (3, {"rows": np.arange(shard * 64, shard * 64 + 64)[::-1].copy()}),
                        (4, {"rows": np.array([shard * 64, (shard + 1) % 8 * 64])})):
            n = 64 if seq < 4 else 2
            await ws.send_bytes(frames.encode_batch(
                epoch=epoch, sender=member_id(c.addrs[other]), incarnation=10,
                tensor=frames.tensor_id("w"), shard=shard, seq=seq,
                values=np.full((n, 8), 5, np.int32), **kw))
            wrong.append(frames.decode(await ws.receive_bytes(timeout=5)).status)
        if emb_shard is not None:   # a table batch with a key of another shard
            # (BUSY while the owner copies emb4 from its origin; GAP first, the stream
            # new to the shard: sent again, as a sender resends from its oldest)
            for _ in range(50):
                await ws.send_bytes(frames.encode_batch(
                    epoch=epoch, sender=member_id(c.addrs[other]), incarnation=10,
                    tensor=frames.tensor_id("emb4"), shard=emb_shard, seq=1,
                    values=np.full((2, 4), 5, np.int32), keys=emb_attack))
                status = frames.decode(await ws.receive_bytes(timeout=5)).status
                if status not in (frames.Status.BUSY, frames.Status.GAP):
                    break
                await asyncio.sleep(0.1)
            wrong.append(status)
        out["wrong_shard"] = wrong
        await session.close()
        # 6. membership change without a MAC
        async with aiohttp.ClientSession() as s:
            async with s.post(c.url(target, "/v1/members"), data=b'{"remove": []}') as r:
                out["members_status"] = r.status
        return out

    out = asyncio.run(attack())
    import aiohttp
    closed = (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING,
              aiohttp.WSMsgType.ERROR)
    assert out["wrong_secret"] in closed
    assert out["garbage"] in closed
    assert out["oversized"] in closed
    assert out["members_status"] == 401
    assert out["acks"] == [(frames.Status.GAP, 1)] + [(frames.Status.OK, 1)] * 3, out["acks"]
    assert out["wrong_shard"] == [frames.Status.REJECTED] * len(out["wrong_shard"])
    assert rejected(c, target, "schema") >= len(out["wrong_shard"])
    assert rejected(c, target, "auth") >= 2
    assert rejected(c, target, "malformed") >= 3
    assert rejected(c, target, "oversized") >= 1
    after = pulled(c, target)[0]
    diff = after.astype(np.int64) - before
    rows = slice(shard * 64, shard * 64 + 64)
    assert (diff[rows] == 1).all(), "the replayed batch must be applied exactly once"
    diff[rows] = 0
    assert not diff.any()
    s = c.attach(target)
    try:
        assert np.array_equal(s["emb4"].pull(emb_attack), emb_before)
    finally:
        s.close()


def test_unauthenticated_clients_get_bounded_resources_and_change_nothing(make_cluster):
    """What a client without the secret can do to a bridge with --secret-file, each
    found by a review and each refused now (bridge-protocol.md section 11):
    a websocket that declares an 8 MiB message before its handshake is closed from the
    header (1009; the bridge made room for each such message: 8 MiB a connection); one
    that sends no AUTH is cut off after AUTH_WAIT (it was waited for 10 s);
    connections in their handshake are capped per IP address and in all for hosts that
    are not members' (then 503, logged once per host and 5 s), so that strangers cannot
    keep a member out (one global cap let 64 idle connections do that);
    a signed membership change replayed to another host than the one it was signed for
    is refused (it was applied there and sent to every host);
    a non-ASCII authentication header is a counted 401 (a 500 and a traceback before);
    and a process without the secret listening on a member's address, whose bridge is
    down, cannot make the bridge create tensors through its catalog answer."""
    import threading

    import aiohttp
    from aiohttp import web
    from shmps.bridge import node as bridge_node, wsstream

    c = make_cluster(3)
    secret = c.secret_file.read_bytes().strip()
    asked = []
    record = {"name": "evil", "kind": "dense", "dtype": "float32", "shape": [64, 4],
              "shard_rows": 64, "nshards": 1, "optimizer": {"type": "Sum"}, "mode": "exact",
              "allow_nonfinite": False, "id": 0, "bytes": 0}

    async def fake_catalog(request):
        asked.append(request.path)
        return web.json_response([record], headers={"ETag": '"fake"'})

    # host 2's address answered by an impostor (no secret) while its bridge is down
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict = {}

    def serve() -> None:
        asyncio.set_event_loop(loop)
        app = web.Application()
        app.router.add_get("/v1/catalog", fake_catalog)
        runner = web.AppRunner(app, handle_signals=False)
        loop.run_until_complete(runner.setup())
        host, port = c.addrs[2].rsplit(":", 1)
        loop.run_until_complete(web.TCPSite(runner, host, int(port)).start())
        holder["runner"] = runner
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    impostor = threading.Thread(target=serve, daemon=True)
    impostor.start()
    assert started.wait(10)
    try:
        c.start(0)
        c.start(1)
        c.wait(lambda: c.health(0) is not None and c.health(1) is not None, 20, "bridges up")
        c.wait(lambda: len(asked) >= 2, 20, "the impostor asked for its catalog")

        async def attack() -> dict:
            out: dict = {}
            host, port = c.addrs[0].rsplit(":", 1)

            async def upgrade(src: str = "127.0.0.1") -> tuple:
                """A websocket upgrade of /v1/stream from ``src``: (status line, reader,
                writer), the head read through when it is a 101."""
                hr, hw = await asyncio.open_connection(host, int(port), local_addr=(src, 0))
                hw.write(b"GET /v1/stream HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                         b"Connection: Upgrade\r\nSec-WebSocket-Key: "
                         b"dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
                status = (await hr.readuntil(b"\r\n"))[:12]
                if status == b"HTTP/1.1 101":
                    await hr.readuntil(b"\r\n\r\n")
                return status, hr, hw

            # 1. a large message declared before the handshake
            _, r, w = await upgrade()
            hello = await asyncio.wait_for(r.readexactly(2 + 40), 5)   # the server's HELLO
            out["hello"] = hello[:2]
            mask = b"\0\0\0\0"
            w.write(bytes((0x82, 0x80 | 127)) + (8 << 20).to_bytes(8, "big") + mask + b"x")
            out["declared_8MiB"] = await asyncio.wait_for(r.read(4), 5)
            w.close()
            # 1b. a client that never sends its AUTH is cut off after AUTH_WAIT
            _, r, w = await upgrade()
            t0 = time.monotonic()
            await asyncio.wait_for(r.read(), 10)          # the HELLO, then EOF
            out["silent_cut_after"] = time.monotonic() - t0
            w.close()
            # 2. handshakes held open: MAX_HANDSHAKES_PER_HOST from one address, then
            # 503; MAX_HANDSHAKES in all from hosts that are not members', then 503 for
            # them, while a member's host still gets through
            per, cap = bridge_node.MAX_HANDSHAKES_PER_HOST, bridge_node.MAX_HANDSHAKES
            held = [await upgrade("127.0.0.1") for _ in range(per + 1)]
            out["one_host"] = [h for h, _, _ in held]
            for _, _, hw in held:
                hw.close()
            await asyncio.sleep(0.3)
            strangers = [f"127.0.1.{k}" for k in range(1, cap // per + 2)]
            held = [await upgrade(src) for src in strangers[:-1] for _ in range(per)]
            out["strangers"] = {h for h, _, _ in held}
            out["one_more_stranger"] = (await upgrade(strangers[-1]))[0]
            member_ip = c.addrs[1].rsplit(":", 1)[0]
            out["member_host"] = (await upgrade(member_ip))[0]
            for _, _, hw in held:
                hw.close()
            await asyncio.sleep(0.3)
            async with aiohttp.ClientSession() as session:
                ws = await session.ws_connect(c.url(0, "/v1/stream"))   # a slot again
                out["after"] = (await ws.receive(timeout=5)).type
                await ws.close()
            # 3. a signed membership change for host 0, replayed to host 1
            body = json.dumps({"remove": [c.addrs[1]]}).encode()
            h = auth.sign_request(secret, "POST", "/v1/members", body, "operator",
                                  target=c.addrs[0], store=c.store)
            async with aiohttp.ClientSession() as session:
                async with session.post(c.url(1, "/v1/members"), data=body,
                                        headers=h) as resp:
                    out["replayed"] = resp.status
                # 4. a non-ASCII header
                bad = dict(auth.sign_request(secret, "GET", "/v1/catalog", b"", "operator",
                                             target=c.addrs[0], store=c.store))
            rr, ww = await asyncio.open_connection(host, int(port))
            ww.write(b"GET /v1/catalog HTTP/1.1\r\nHost: x\r\nX-Shmps-Id: \xff\r\n"
                     + "".join(f"{k}: {v}\r\n" for k, v in bad.items()
                               if k != auth.HEADER_ID).encode() + b"\r\n")
            out["non_ascii"] = (await asyncio.wait_for(rr.readuntil(b"\r\n"), 5))[:12]
            ww.close()
            return out

        auth_before = rejected(c, 0, "auth")
        out = asyncio.run(attack())
        assert out["hello"] == bytes((0x82, 40))
        assert out["declared_8MiB"] == bytes((0x88, 2)) + wsstream.CLOSE_TOO_BIG.to_bytes(2, "big")
        assert (bridge_node.AUTH_WAIT - 0.2 <= out["silent_cut_after"]
                < bridge_node.AUTH_WAIT + 1.5), out["silent_cut_after"]
        per = bridge_node.MAX_HANDSHAKES_PER_HOST
        assert out["one_host"] == [b"HTTP/1.1 101"] * per + [b"HTTP/1.1 503"]
        assert out["strangers"] == {b"HTTP/1.1 101"}
        assert out["one_more_stranger"] == b"HTTP/1.1 503"
        assert out["member_host"] == b"HTTP/1.1 101"
        refusals = [line for line in c.logs[0].read_text(errors="replace").splitlines()
                    if "too many connections in their handshake" in line]
        assert 1 <= len(refusals) <= 3, refusals     # one line per host and 5 s
        assert out["after"] == aiohttp.WSMsgType.BINARY       # the HELLO of a fresh slot
        assert out["replayed"] == 401
        assert any(m["address"] == c.addrs[1] for m in c.health(1)["members"])
        assert out["non_ascii"] == b"HTTP/1.1 401"
        assert rejected(c, 0, "auth") >= auth_before + 2
        assert rejected(c, 0, "oversized") >= 1
        assert "evil" not in c.health(0)["tensors"] and "evil" not in c.health(1)["tensors"]
        s = c.attach(0)
        try:
            assert "evil" not in s
        finally:
            s.close()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        impostor.join(10)


def test_a_stream_seen_first_in_the_middle_loses_nothing(make_cluster):
    """An owner that first sees batch 2 of a sender's stream (batch 1 refused or still on
    its way, as when it waited for a hand-over) asks for the stream again (GAP) instead
    of starting it at 2: batch 1, resent, and then batch 2 are both applied."""
    c = make_cluster(3)
    c.start_all()
    create_everywhere(c, [0, 1, 2])
    secret = c.secret_file.read_bytes().strip()
    target = next(i for i in range(3) if any(k.startswith("w/") for k in c.health(i)["owned"]))
    shard = int(next(k for k in c.health(target)["owned"] if k.startswith("w/")).split("/")[1])
    other = (target + 1) % 3
    before = pulled(c, target)[0]

    async def send() -> list:
        session, ws, hs = await _ws_session(c, target, secret, c.addrs[other], 21)
        hs.check(await ws.receive_bytes(timeout=5))
        epoch = c.health(target)["epoch"]
        acks = []
        for seq in (2, 1, 2):   # 2 overtook 1; the sender then resends from 1
            await ws.send_bytes(frames.encode_batch(
                epoch=epoch, sender=member_id(c.addrs[other]), incarnation=21,
                tensor=frames.tensor_id("w"), shard=shard, seq=seq,
                values=np.full((64, 8), seq, np.int32), start=shard * 64))
            a = frames.decode(await ws.receive_bytes(timeout=5))
            acks.append((a.status, a.seq))
        await session.close()
        return acks

    acks = asyncio.run(send())
    assert acks == [(frames.Status.GAP, 2), (frames.Status.OK, 1), (frames.Status.OK, 2)], acks
    diff = pulled(c, target)[0].astype(np.int64) - before
    rows = slice(shard * 64, shard * 64 + 64)
    assert (diff[rows] == 1 + 2).all()   # both applied, once each
    diff[rows] = 0
    assert not diff.any()


def test_bridge_cli_refuses_bad_setups(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("10.1.2.3:7070\n127.0.0.1:7071\n")
    env = dict(os.environ)
    r = subprocess.run(["shmps-bridge" if shutil.which("shmps-bridge") else sys.executable, *(
        [] if shutil.which("shmps-bridge") else ["-m", "shmps.bridge.cli"]), "--peers",
        str(hosts), "--store", "m", "--listen", "10.1.2.3:7070"], capture_output=True,
        text=True, timeout=30, env=env)
    assert r.returncode == 2
    assert "without --secret-file" in r.stderr and "Traceback" not in r.stderr
    # (the first run above is the console script in a fresh interpreter; the others run
    # `python -m shmps.bridge.cli` in a process forked with the imports done: cli_runner)
    r = cli_runner.run("shmps.bridge.cli", ["--peers", hosts, "--store", "m", "--listen",
                                            "127.0.0.1:9999"], timeout=30)
    assert r.returncode == 2 and "not listed" in r.stderr, r.stderr
    bad = tmp_path / "bad.txt"
    bad.write_text("127.0.0.1:+80\n")
    r = cli_runner.run("shmps.bridge.cli", ["--peers", bad, "--store", "m", "--listen",
                                            "127.0.0.1:80"], timeout=30)
    assert r.returncode == 2 and "line 1" in r.stderr, r.stderr
    sec = tmp_path / "secret"
    sec.write_text("s" * 32)
    os.chmod(sec, 0o644)
    r = cli_runner.run("shmps.bridge.cli", ["--peers", hosts, "--store", "m", "--listen",
                                            "10.1.2.3:7070", "--secret-file", sec], timeout=30)
    assert r.returncode == 2 and "chmod 600" in r.stderr, r.stderr
    # numbers out of range are refused by the parser, each naming its option, and every
    # message points a command-line user at --help (not at a docstring)
    for args, said in ((["--replicas", "0"], "argument --replicas: 0 must be an integer >= 1"),
                       (["--replicas", "two"], "argument --replicas: 'two' is not an integer"),
                       (["--flush-ms", "-1"], "argument --flush-ms: -1 must be a finite"),
                       (["--flush-ms", "nan"], "argument --flush-ms: nan must be a finite"),
                       (["--dead-after", "0"], "argument --dead-after: 0 must be a finite"),
                       # a period between two heartbeats counted every peer dead; 1e-300
                       # flooded the log, 4e-324 named an internal parameter, and 1e308
                       # was taken
                       (["--dead-after", "0.1"], "argument --dead-after: 0.1 must be a "
                                                 "finite number >= 0.2 and <= 86400"),
                       (["--dead-after", "4e-324"], "argument --dead-after: 4e-324 must be"),
                       (["--dead-after", "1e308"], "argument --dead-after: 1e308 must be"),
                       (["--flush-ms", "1e-300"], "argument --flush-ms: 1e-300 must be a "
                                                  "finite number >= 0.1 and <= 8.64e+07"),
                       (["--listen", "nonsense"], "'nonsense' is not host:port")):
        argv = ["--peers", str(hosts), "--store", "m", "--listen", "127.0.0.1:7071", *args]
        r = cli_runner.run("shmps.bridge.cli", argv, env=child_env(), cwd=tmp_path, timeout=30)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.startswith(f"shmps-bridge: {said}"), (args, r.stderr)
        assert r.stderr.rstrip().endswith("(see shmps-bridge --help)"), (args, r.stderr)
        assert "docstring" not in r.stderr and "Traceback" not in r.stderr, r.stderr


# --------------------------------------------------------------------------- network namespaces

def _netns_hosts(tag: str, n: int):
    """Create ``n`` network namespaces joined by a Linux bridge; yield their addresses.
    Returns None (with the reason) where the machine does not allow it."""
    if os.geteuid() != 0:
        return None, "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return None, "the `ip` command (iproute2) is not installed"
    br = f"br{tag}"
    cmds = [["ip", "link", "add", br, "type", "bridge"],
            ["ip", "addr", "add", "10.77.0.1/24", "dev", br], ["ip", "link", "set", br, "up"]]
    for i in range(n):
        ns, va, vb = f"ns{tag}{i}", f"va{tag}{i}", f"vb{tag}{i}"
        cmds += [["ip", "netns", "add", ns],
                 ["ip", "link", "add", va, "type", "veth", "peer", "name", vb],
                 ["ip", "link", "set", vb, "netns", ns],
                 ["ip", "link", "set", va, "master", br], ["ip", "link", "set", va, "up"],
                 ["ip", "-n", ns, "addr", "add", f"10.77.0.{i + 2}/24", "dev", vb],
                 ["ip", "-n", ns, "link", "set", vb, "up"],
                 ["ip", "-n", ns, "link", "set", "lo", "up"]]
    for cmd in cmds:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            _netns_cleanup(tag, n)
            return None, f"`{' '.join(cmd)}` failed: {r.stderr.strip()}"
    return [f"10.77.0.{i + 2}" for i in range(n)], ""


def _netns_cleanup(tag: str, n: int) -> None:
    for i in range(n):
        subprocess.run(["ip", "netns", "del", f"ns{tag}{i}"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"va{tag}{i}"], capture_output=True)
    subprocess.run(["ip", "link", "del", f"br{tag}"], capture_output=True)


@contextlib.contextmanager
def _netns_cluster(make_cluster, n: int):
    """``n`` bridges, each in a network namespace of its own (``_netns_hosts``), started
    and forwarding the test tensors: yields (cluster, tag); skips the test where the
    machine does not allow namespaces."""
    tag = f"{os.getpid() % 10000}"
    ips, why = _netns_hosts(tag, n)
    if ips is None:
        pytest.skip(f"network namespaces not available here: {why}")
    try:
        c = make_cluster(n, ip_base=ips,
                         wrap=lambda i, cmd: ["ip", "netns", "exec", f"ns{tag}{i}", *cmd])
        c.start_all(30)
        create_everywhere(c, list(range(n)))
        yield c, tag
        c.close()
    finally:
        _netns_cleanup(tag, n)


def test_network_namespace_hosts(make_cluster):
    """Three hosts in their own network namespaces with their own addresses (10.77.0.x),
    talking over veth pairs and a bridge, with a secret (they are not on loopback)."""
    with _netns_cluster(make_cluster, 3) as (c, _):
        procs = [c.worker(i, push_spec(20)) for i in range(3)]
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err.decode() + c.describe()
        wait_totals(c, [0, 1, 2], 3 * 20)
        # every peer address seen in /health is a namespace address, not loopback
        assert all(m["address"].startswith("10.77.0.") for m in c.health(0)["members"])


def _cut(tag: str, n: int, host: int, cut: bool) -> None:
    """Cut namespace host ``host`` off from the other hosts (blackhole routes both ways),
    or join it again; the test process (10.77.0.1, on the Linux bridge) still reaches
    every host."""
    verb = "add" if cut else "del"
    for i in range(n):
        if i == host:
            continue
        for ns, dst in ((f"ns{tag}{host}", f"10.77.0.{i + 2}"),
                        (f"ns{tag}{i}", f"10.77.0.{host + 2}")):
            r = subprocess.run(["ip", "-n", ns, "route", verb, "blackhole", f"{dst}/32"],
                               capture_output=True, text=True)
            assert r.returncode == 0, r.stderr


def test_a_host_cut_off_mid_training_holds_its_outboxes_and_rejoins(make_cluster):
    """Three namespace hosts train; one is cut off from the other two for 3 s (its
    packets to them and theirs to it are dropped; no process stops).  The majority counts
    it dead and takes its shards over with a new epoch; the cut-off host, a minority of
    one, mints no epoch, acts as owner of nothing and applies no batch, while its
    workers' pulls still answer from its copy.  Joined again, it takes the majority's
    ring, every host holds the same epoch, and every push of every host, the cut-off
    host's included, is applied exactly once on every copy."""
    with _netns_cluster(make_cluster, 3) as (c, tag):
        epoch0 = c.health(0)["epoch"]
        rounds = 250
        procs = [c.worker(i, push_spec(rounds, sleep=0.02)) for i in range(3)]
        time.sleep(1.0)
        cut_epoch = c.health(2)["epoch"]
        _cut(tag, 3, 2, True)
        try:
            def seen_dead() -> bool:
                h = c.health(0) or {}
                states = {m["address"]: m["state"] for m in h.get("members", [])}
                return states.get(c.addrs[2]) == "dead" and h.get("epoch", 0) > epoch0
            c.wait(seen_dead, 10, "the majority to count the cut-off host dead")
            c.wait(lambda: not (c.health(2) or {"acting": True})["acting"], 10,
                   "the cut-off host to stop acting")
            applied = c.health(2)["applied"]
            w, _, _ = pulled(c, 2)          # local pulls answer meanwhile
            assert w.shape == (512, 8)
            time.sleep(3.0)
            h2 = c.health(2)
            assert not h2["acting"] and not h2["owned"], h2
            assert h2["epoch"] == cut_epoch, (h2["epoch"], cut_epoch, c.describe())
            assert h2["applied"] == applied, (h2["applied"], applied, c.describe())
            assert c.health(0)["acting"] and c.health(1)["acting"]
        finally:
            _cut(tag, 3, 2, False)
        settled_exact(c, procs, rounds, epoch0, bumps=2, converge=30)


@pytest.mark.skipif(not os.environ.get("SHMPS_TEST_FLAPPING"),
                    reason="opt-in: it failed about 1 run in 30 until the epoch rules of "
                           "2026-11-26 evening, then once in 199 runs (an over-count, trace "
                           "K3-5, fixed since), then in none of 577 runs; bridge-protocol.md "
                           "section 9 keeps the record; set SHMPS_TEST_FLAPPING=1 to run it")
def test_a_flapping_network_loses_no_push(make_cluster):
    """Three namespace hosts train while the network flaps: a host is cut off for less
    than --dead-after (a blip) and again soon after it rejoined, and each host is cut
    at some point, the next cut often before the views of the last one settled.
    Whatever the cuts left in the TCP streams (heartbeats, ready flags, ROWS and
    hand-overs of an earlier epoch) is delivered late.  Afterwards every flush has
    returned, every host holds one epoch, and every host holds every push of every host
    exactly once.  (This schedule found twenty-six bugs, each of which lost acknowledged
    pushes, applied one twice, or left flushes stuck on GAP for good; bridge-protocol.md
    sections 3, 6, 9 and 13 name them.)"""
    cuts = [(2, 1.0, 0.5), (2, 0.8, 1.0), (1, 0.3, 0.5), (0, 1.2, 0.5), (1, 0.8, 1.0)]
    with _netns_cluster(make_cluster, 3) as (c, tag):
        epoch0 = c.health(0)["epoch"]
        rounds = 400
        procs = [c.worker(i, push_spec(rounds, sleep=0.02)) for i in range(3)]
        time.sleep(1.0)
        for host, cut_for, then in cuts:       # (host, seconds cut off, seconds after)
            _cut(tag, 3, host, True)
            try:
                time.sleep(cut_for)
            finally:
                _cut(tag, 3, host, False)
            time.sleep(then)
        # the four cuts longer than --dead-after moved the epoch on (to 6-8 in the probe runs)
        settled_exact(c, procs, rounds, epoch0, bumps=4, converge=30)


def test_leave_by_members_api_and_sigterm(make_cluster):
    c = make_cluster(4)
    c.start_all()
    create_everywhere(c, [0, 1, 2, 3])
    rounds = 300
    procs = [c.worker(0, push_spec(rounds, sleep=0.01)), c.worker(1, push_spec(rounds, 0.01))]
    time.sleep(0.5)
    # a signed POST /v1/members removes host 3 on every host; it hands over and exits
    secret = c.secret_file.read_bytes().strip()
    body = json.dumps({"remove": [c.addrs[3]]}).encode()
    req = urllib.request.Request(c.url(1, "/v1/members"), data=body, method="POST",
                                 headers=auth.sign_request(secret, "POST", "/v1/members",
                                                           body, c.addrs[1],
                                                           target=c.addrs[1],
                                                           store=c.store))
    with urllib.request.urlopen(req, timeout=5) as r:
        assert c.addrs[3] not in json.loads(r.read())["members"]
    assert c.wait_exit(3, 30) == 0, c.describe()
    # SIGTERM: host 2 forwards its pushes, hands over and exits
    c.signal(2, signal.SIGTERM)
    assert c.wait_exit(2, 30) == 0, c.describe()
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode() + c.describe()
    wait_totals(c, [0, 1], 2 * rounds)
    h = c.health(0)
    states = {m["address"]: m["state"] for m in h["members"]}
    assert c.addrs[3] not in states and states[c.addrs[2]] == "dead", states
    # the removed host's last frames (ACKs) were handled, not failed on
    for i in (0, 1):
        assert "is not a member" not in c.logs[i].read_text(errors="replace"), c.describe()


def test_sigterm_while_this_hosts_workers_push_loses_nothing(make_cluster):
    """SIGTERM to a bridge whose own host's worker keeps pushing: the bridge forwards
    what was pushed until then, stops draining, waits for its batches' acknowledgements
    and exits within a few seconds (a leave took its whole 10 s timeout in a cluster of
    three: it read the peers' rings from views it had edited).  The pushes made after it
    stopped draining stay in the outboxes; the bridge started again forwards them.  No
    push is lost or counted twice, and no flush raises PushesLost (before: it kept
    draining the newer pushes and exited with some unacknowledged, which the next bridge
    recorded lost: 114-178 of 1600 in the review's runs, found 2026-11-27)."""
    c = make_cluster(3)
    c.start_all()
    create_everywhere(c, [0, 1, 2])
    rounds = 800   # (the worker outlasts the leave: at 400 it did not once in CI, 2026-11-28)
    spec = dict(push_spec(rounds, sleep=0.005), flush_every=50)
    procs = [c.worker(0, spec), c.worker(1, spec)]
    time.sleep(1.0)
    t0 = time.monotonic()
    c.signal(1, signal.SIGTERM)
    assert c.wait_exit(1, 30) == 0, c.describe()
    took = time.monotonic() - t0
    assert procs[1].poll() is None, "the worker of host 1 ended before its bridge: too short"
    c.start(1)
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode() + c.describe()     # no PushesLost raised
        assert json.loads(out.decode().splitlines()[-1])["lost_flushes"] == 0
    wait_totals(c, [0, 1, 2], 2 * rounds, timeout=30)
    lost = [line for i in (0, 1, 2) for line in c.metrics(i).splitlines()
            if line.startswith("shmps_bridge_lost_pushes_total ")]
    assert all(float(line.split()[-1]) == 0 for line in lost), lost
    assert took < 5.0, f"the leave took {took:.1f} s"


MANY = {"m": [[256, 2], "int32", "sum", 4]}        # 64 shards of 4 rows


def owned_shards(c: Cluster, i: int) -> set:
    return set((c.health(i) or {}).get("owned", []))


def test_a_planned_leave_counts_hand_overs_and_a_kill_failovers(make_cluster):
    """The shards a leaving host hands over (SIGTERM) are counted as hand-overs
    (`shmps_bridge_handovers_total`, timed by `shmps_bridge_handover_seconds`), not as
    failovers: `shmps_bridge_failovers_total` and /health's `failovers` are the shards
    taken over from a host that died (a kill), which the bench's failover figures read.
    Before, a leave counted its 43-44 shards (of 128) as failovers, timed from the
    leaver's last heartbeat to the first push after."""
    c = make_cluster(3)
    c.start_all()
    for i in range(3):
        with c.attach(i) as s:
            create(s, {"dense": MANY})
    wait_forwarding(c, {"m"}, [0, 1, 2])
    spec = {"create": {"dense": MANY}, "pushes": 5000, "sleep": 0.01, "flush": True,
            "flush_timeout": 60.0}
    procs = [c.worker(0, spec)]
    time.sleep(0.5)
    left = owned_shards(c, 2)
    assert left, c.describe()

    def total(name: str) -> float:
        return sum(metric_value(c, i, name) for i in (0, 1))

    c.signal(2, signal.SIGTERM)
    assert c.wait_exit(2, 30) == 0, c.describe()
    time.sleep(0.5)
    assert total("shmps_bridge_failovers_total") == 0, c.describe()
    c.wait(lambda: total("shmps_bridge_handover_seconds_count") >= len(left), 10,
           f"the {len(left)} shards host 2 handed over to apply a batch each")
    assert total("shmps_bridge_failovers_total") == 0, c.describe()
    assert total("shmps_bridge_handovers_total") == len(left), c.describe()
    assert not any(c.health(i)["failovers"] for i in (0, 1)), c.describe()

    c.start(2)
    c.wait_converged(30)
    time.sleep(0.3)
    killed = owned_shards(c, 2)
    assert killed, c.describe()
    t_kill = c.kill(2)
    c.wait(lambda: total("shmps_bridge_failovers_total") >= len(killed), 10,
           f"the {len(killed)} shards of the killed host 2 to fail over")
    c.wait(lambda: {f["shard"] for i in (0, 1) for f in c.health(i)["failovers"]
                    if f["dead"] == c.addrs[2] and f["first_apply_wall"] >= t_kill} == killed,
           10, "a first batch applied by a successor of every shard of the killed host")
    assert total("shmps_bridge_failovers_total") == len(killed), c.describe()
    assert procs[0].poll() is None, "the worker ended before the kill: too short"


def info_lines(c: Cluster, i: int, since: int) -> list:
    """Host i's log lines at INFO or above after byte ``since``."""
    text = c.logs[i].read_bytes()[since:].decode(errors="replace")
    return [ln for ln in text.splitlines() if re.search(r" (INFO|WARNING|ERROR) ", ln)]


def test_a_leave_and_a_rejoin_log_lines_by_event_not_by_shard(make_cluster):
    """A member leaving (SIGTERM) and coming back logs a few lines an event at INFO and
    above, however many shards move: one per member change and per previous owner ("took
    ownership of N shards from H (epoch E): a by hand-over, b by failover"), the
    per-shard lines (a hand-over snapshot taken, one already here) summed up in one;
    each shard's own line is at DEBUG.  Before, one rejoin logged a line per shard moved:
    53 at 128 shards, 178 in an operator's cluster."""
    big = {"m": [[2048, 2], "int32", "sum", 4]}        # 512 shards
    c = make_cluster(3, log_level="DEBUG")
    c.start_all()
    for i in range(3):
        with c.attach(i) as s:
            create(s, {"dense": big})
    wait_forwarding(c, {"m"}, [0, 1, 2])
    procs = [c.worker(0, {"create": {"dense": big}, "pushes": 3000, "sleep": 0.01,
                          "flush": True, "flush_timeout": 60.0})]
    time.sleep(0.5)
    left = owned_shards(c, 2)
    assert len(left) > 100, c.describe()
    since = {i: c.logs[i].stat().st_size for i in range(3)}
    c.signal(2, signal.SIGTERM)
    assert c.wait_exit(2, 30) == 0, c.describe()
    time.sleep(1.5)   # (a summary is said a second after its first shard)
    said = {i: info_lines(c, i, since[i]) for i in range(3)}
    since = {i: c.logs[i].stat().st_size for i in range(3)}
    c.start(2)
    c.wait_converged(30)
    time.sleep(1.5)
    taken = owned_shards(c, 2)
    assert len(taken) > 100, c.describe()
    said.update({(i, "rejoin"): info_lines(c, i, since[i]) for i in range(3)})
    for who, lines in said.items():
        assert len(lines) <= 30, (who, len(lines), "\n".join(lines))   # (16-21 seen)
    took = [ln for i in (0, 1) for ln in said[i] if "took ownership of" in ln]
    assert sum(int(re.search(r"took ownership of (\d+) shards", ln).group(1))
               for ln in took) == len(left), took
    assert all(ln.endswith(" 0 by failover") for ln in took), took
    # each shard the rejoined host took over has its own line, at DEBUG
    text = c.logs[2].read_bytes()[since[2]:].decode(errors="replace")
    per_shard = set(re.findall(r" DEBUG shmps\.bridge: shard (\S+?):? (?:handed over by|"
                               r"hand-over snapshot from \S+ already here)", text))
    assert taken <= per_shard, sorted(taken - per_shard)[:10]
    procs[0].kill()
    procs[0].wait(10)


def test_a_bridge_that_cannot_listen_touches_no_outbox(make_cluster):
    """A bridge that cannot have its store's bridge lock or its address exits (status 2,
    one line saying what to do) before it touches an outbox: the same command run again
    while the bridge runs does not record the live bridge's batches in flight as lost
    (a worker's flush raised PushesLost for pushes that were applied), and one started
    on a store with no bridge, on a port taken, leaves it local (it switched forwarding
    on first, and every later push was held in an outbox that no bridge drained; found
    by a review, 2026-11-27)."""
    import socket

    c = make_cluster(2)
    c.start_all()
    create_everywhere(c, [0, 1])
    rounds = 300
    procs = [c.worker(1, dict(push_spec(rounds, sleep=0.005), flush_every=25))]
    time.sleep(0.5)
    again = [subprocess.run(c.bridge_cmd(1), capture_output=True, timeout=30,
                            env=dict(os.environ, SHMPS_BRIDGE_LOCK_WAIT="0.5"))
             for _ in range(3)]
    for r in again:
        assert r.returncode == 2, r.stderr.decode()
        assert (f"another shmps-bridge process (pid {c.procs[1].pid}) is running".encode()
                in r.stderr), r.stderr
        assert b"Traceback" not in r.stderr and b"Unclosed" not in r.stderr, r.stderr
    out, err = procs[0].communicate(timeout=120)
    assert procs[0].returncode == 0, err.decode() + c.describe()   # no PushesLost
    wait_totals(c, [0, 1], rounds)
    assert "pushes were taken by an earlier bridge" not in c.logs[1].read_text(errors="replace")

    # a store with no bridge: a bridge that cannot listen leaves it local
    ns = c.namespaces[1] + "solo"
    st = shmps.attach("solo", namespace=ns)
    try:
        w = st.dense("w", (4, 2), "float32", init=0.0, optimizer="sum")
        w.push(np.ones((4, 2), np.float32))
        blocker = socket.socket()
        blocker.bind(("127.0.0.2", 0))
        blocker.listen(1)
        addr = f"127.0.0.2:{blocker.getsockname()[1]}"
        hosts = c.dir / "solo_hosts.txt"
        hosts.write_text(addr + "\n")
        r = subprocess.run([sys.executable, "-m", "shmps.bridge.cli", "--peers", str(hosts),
                            "--store", "solo", "--namespace", ns, "--listen", addr],
                           capture_output=True, timeout=30)
        blocker.close()
        assert r.returncode == 2 and f"{addr} is in use".encode() in r.stderr, r.stderr
        assert not st._forwarding
        w.push(np.ones((4, 2), np.float32))
        assert np.array_equal(w.pull(), np.full((4, 2), 2, np.float32))
        st.flush(timeout=1)
    finally:
        st.destroy()


def test_a_bridge_whose_port_is_in_use_says_so_and_removes_the_store_it_made(tmp_path):
    """A bridge started on a store that does not exist yet, on an address whose port is
    taken, exits with status 2 and one line of its own (before: "cannot listen on ...:
    error while attempting to bind on address (...): address already in use", aiohttp's
    text inside ours), and leaves no store behind (before: the empty store its attach
    made, its manifest in /dev/shm and in `shmps-tool ls`)."""
    import secrets
    import socket

    from shmps import names
    ns = f"b{os.getpid()}x{secrets.token_hex(2)}nop"
    prefix = names.store_prefix("fresh", ns)[1:]

    def segments() -> list:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))

    blocker = socket.socket()
    try:
        blocker.bind(("127.0.0.2", 0))
        blocker.listen(1)
        addr = f"127.0.0.2:{blocker.getsockname()[1]}"
        hosts = tmp_path / "hosts.txt"
        hosts.write_text(addr + "\n")
        r = subprocess.run([sys.executable, "-m", "shmps.bridge.cli", "--peers", str(hosts),
                            "--store", "fresh", "--namespace", ns, "--listen", addr],
                           capture_output=True, timeout=30, env=child_env())
        said = [ln for ln in r.stderr.decode().splitlines() if ln.startswith("shmps-bridge:")]
        assert r.returncode == 2 and said == [
            f"shmps-bridge: {addr} is in use (another shmps-bridge?); pick another --listen "
            "or stop it"], r.stderr
        assert b"Traceback" not in r.stderr and b"attempting to bind" not in r.stderr, r.stderr
        assert segments() == [], segments()
    finally:
        blocker.close()
        with contextlib.suppress(shmps.Error):
            shmps.attach("fresh", namespace=ns, create=False).destroy()


def test_a_member_change_must_say_what_it_changes(make_cluster):
    """POST /v1/members takes {"add": [...], "remove": [...]} and nothing else: a body of
    another shape, an unknown key (a typo), a non-member to remove or a change that
    leaves no members is a 400 that says what was expected, and changes nothing (each
    was a 200 that did nothing, or a Python error message, before 2026-11-27); an
    unsigned request is a 401 that says how to sign.  /health reports --replicas, and
    a bridge warns when it exceeds the members."""
    c = make_cluster(2, replicas=3)
    c.start_all()
    secret = c.secret_file.read_bytes().strip()

    def post(body: bytes, sign: bool = True) -> tuple[int, dict]:
        headers = (auth.sign_request(secret, "POST", "/v1/members", body, "operator",
                                     target=c.addrs[0], store=c.store) if sign else {})
        req = urllib.request.Request(c.url(0, "/v1/members"), data=body, method="POST",
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    bad = [b"[]", b'{"ad": ["127.0.0.9:1"]}', b'{"add": "127.0.0.9:1"}', b'{"add": [7]}',
           b'{"add": ["nonsense"]}', b'{"remove": ["127.0.0.99:5"]}',
           json.dumps({"remove": c.addrs}).encode(), b"{not json"]
    for body in bad:
        status, answer = post(body)
        assert status == 400, (body, status, answer)
        assert answer["error"].startswith("bad request: "), answer
    assert "expected a JSON object" in post(b'{"ad": []}')[1]["error"]
    assert "not members" in post(b'{"remove": ["127.0.0.99:5"]}')[1]["error"]
    status, answer = post(b'{"add": []}', sign=False)
    assert status == 401 and "auth.sign_request" in answer["error"], answer
    for i in (0, 1):
        h = c.health(i)
        assert [m["address"] for m in h["members"]] == sorted(c.addrs) and h["replicas"] == 3
        assert "--replicas 3 with 2 members" in c.logs[i].read_text(errors="replace")
    assert post(b"{}") == (200, {"members": c.addrs, "epoch": c.health(0)["epoch"],
                                 "already": [], "dropped": []})
    assert post(b'{"add": ["%s"]}' % c.addrs[1].encode()) == (
        200, {"members": c.addrs, "epoch": c.health(0)["epoch"], "already": [c.addrs[1]],
              "dropped": []})


def _tool(*args: str, cwd) -> subprocess.CompletedProcess:
    """``python -m shmps.cli ARGS`` in a process of its own (forked with the imports
    done: cli_runner)."""
    return cli_runner.run("shmps.cli", args, env=child_env(), cwd=cwd, timeout=60)


def test_shmps_tool_members_shows_and_changes_the_member_list(make_cluster, tmp_path):
    """`shmps-tool members HOST:PORT` prints the members a bridge sees with their states;
    with --add / --remove it sends the signed POST /v1/members, checks the bridge's
    signed answer and prints the new list, which every member applies.  A wrong or
    missing secret, a non-member to remove, a malformed address, an address where no
    bridge listens and an answer without the bridge's MAC are one line and exit 2, and
    change nothing."""
    c = make_cluster(2, ip_base=["127.0.0.1", "127.0.0.3"])   # (localhost reaches host 0)
    c.start_all()
    a0 = c.addrs[0]

    def members(i: int) -> list:
        return [m["address"] for m in c.health(i)["members"]]

    r = _tool("members", a0, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"bridge {a0}: epoch ") and "has a majority" in lines[0]
    shown = {ln.split()[0]: ln.split()[1] for ln in lines[1:]}
    assert shown == {a: "alive" for a in c.addrs}, r.stdout
    assert [ln for ln in lines if "(this bridge)" in ln] == [
        ln for ln in lines[1:] if ln.split()[0] == a0]
    r = _tool("members", c.addrs[1], "--json", cwd=tmp_path)
    assert r.returncode == 0 and sorted(m["address"] for m in json.loads(r.stdout)["members"]
                                        ) == sorted(c.addrs), r.stdout

    new = f"127.0.0.9:{free_port('127.0.0.9')}"
    wrong = tmp_path / "wrong"
    wrong.write_bytes(b"w" * 32)
    os.chmod(wrong, 0o600)
    for extra, said in ((["--secret-file", str(wrong)], "check that --secret-file holds"),
                        ([], "pass --secret-file with the secret")):
        r = _tool("members", a0, "--add", new, "--store", c.store, *extra, cwd=tmp_path)
        assert r.returncode == 2, r
        assert r.stderr.startswith(f"shmps-tool: error: the bridge at {a0} refused the "
                                   "request's signature") and said in r.stderr, r.stderr
    sec = ["--secret-file", str(c.secret_file), "--store", c.store]
    # the right secret, the bridge reached by another name than hosts.txt's: the
    # signature names the address, and the tool says which one to use
    port0 = a0.rsplit(":", 1)[1]
    r = _tool("members", f"localhost:{port0}", "--add", new, *sec, cwd=tmp_path)
    assert r.returncode == 2 and f"it is {a0} in hosts.txt" in r.stderr and \
        f"shmps-tool members {a0} ..." in r.stderr, r.stderr
    for args, said in (([ "--remove", "127.0.0.99:5"], "refused the change: bad request: not "
                         "members, nothing to remove"),
                       (["--add", "nonsense"], "'nonsense' is not host:port")):
        r = _tool("members", a0, *args, *sec, cwd=tmp_path)
        assert r.returncode == 2 and said in r.stderr, r.stderr
        assert "docstring" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert members(0) == members(1) == sorted(c.addrs)

    epoch = c.health(0)["epoch"]
    r = _tool("members", a0, "--add", new, "--add", new, *sec, cwd=tmp_path)   # (once)
    assert r.returncode == 0 and "already" not in r.stderr, r.stderr
    assert r.stdout.startswith(f"members now: {', '.join(sorted(c.addrs + [new]))} "), r.stdout
    # the epoch moves once the new host has copied its shards (never, here: nobody runs
    # there): the tool says the change is in flight (it printed "(epoch E at ...)", E
    # the epoch from before the change, as if it were the change's)
    assert r.stdout.splitlines()[1] == (
        f"in flight: the ring is still that of epoch {epoch}; it moves to a new epoch "
        f"once {new} has copied every shard (its bridge must be running); `shmps-tool "
        f"members {a0}` shows each member's state"), r.stdout
    c.wait(lambda: members(0) == members(1) == sorted(c.addrs + [new]), 10,
           "both bridges list the added host")
    # (a new member is "joining" until --dead-after has passed without a word from it)
    c.wait(lambda: {m["address"]: m["state"] for m in c.health(1)["members"]}[new] == "dead",
           10, "the added host, where nobody listens, to be dead")
    r = _tool("members", c.addrs[1], cwd=tmp_path)
    assert f"{new} " in r.stdout and "dead" in r.stdout.split(new)[1].splitlines()[0], r.stdout
    # adding a member again changes nothing, and says so (it said "members now: ..." only)
    epoch = c.health(1)["epoch"]
    r = _tool("members", c.addrs[1], "--add", new, *sec, cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == (f"shmps-tool: {new}: a member already, "
                                              "nothing to add\n"), r.stderr
    assert r.stdout.splitlines()[1] == f"epoch {epoch}: nothing changed", r.stdout
    # and the other members, to which it is sent on (for one an earlier change missed),
    # log nothing of it at INFO (each logged "members unchanged" before)
    time.sleep(0.5)
    log0 = c.logs[0].read_text(errors="replace")
    assert f"members unchanged by {c.addrs[1]}" not in log0, log0
    # and the bridge's log says nothing changed (it said "members changed by operator:
    # +['<new>'] -[]", as for an addition)
    log1 = c.logs[1].read_text(errors="replace")
    assert f"members changed by operator: +['{new}']" not in log1, log1
    assert f"members unchanged by operator: ['{new}'] a member already (epoch " in log1, log1
    # removing it (dead): dropped at once, nothing to hand over (the tool said the
    # change waited for it to hand its shards over and its bridge to exit)
    epoch = c.health(1)["epoch"]
    r = _tool("members", c.addrs[1], "--remove", new, *sec, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.splitlines()[1] == (
        f"epoch {epoch}: {new} dropped at once (dead or never heard: it owns no shards "
        "to hand over)"), r
    c.wait(lambda: members(0) == members(1) == sorted(c.addrs), 10,
           "both bridges dropped the removed host")

    # nobody there; and an impostor on an address answers 200 without the bridge's MAC
    r = _tool("members", new, cwd=tmp_path)
    assert r.returncode == 2 and f"cannot reach a bridge at {new}" in r.stderr, r.stderr
    import http.server
    import threading

    class Impostor(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"members": [new], "epoch": 99}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    class Refuser(Impostor):   # passes the request on (say) and says "nothing changed"
        def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"error": "bad request: not members"}).encode()
            self.send_response(400)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            body = b"<html>not a bridge</html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    host, port = new.rsplit(":", 1)
    said = {}
    for handler in (Impostor, Refuser):
        srv = http.server.HTTPServer((host, int(port)), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        try:
            said[handler] = _tool("members", new, "--remove", a0, *sec, cwd=tmp_path)
            if handler is Refuser:
                said["get"] = _tool("members", new, cwd=tmp_path)
        finally:
            srv.shutdown()
            srv.server_close()
    for handler, status in ((Impostor, 200), (Refuser, 400)):
        r = said[handler]
        assert r.returncode == 2 and r.stdout == "", r
        assert r.stderr.startswith(f"shmps-tool: error: the answer from {new} ({status}) is "
                                   "not signed by a bridge holding this secret"), r.stderr
        assert "may or may not have been applied" in r.stderr, r.stderr
    r = said["get"]
    assert r.returncode == 2 and "is not a bridge's" in r.stderr, r.stderr
    # something that does not speak HTTP on the port; and timeouts a socket cannot take
    import socket
    with socket.socket() as banner:
        banner.bind((host, 0))
        banner.listen(1)

        def greet() -> None:
            conn, _ = banner.accept()
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.0\r\n")
                conn.recv(4096)
        threading.Thread(target=greet, daemon=True).start()
        other = f"{host}:{banner.getsockname()[1]}"
        r = _tool("members", other, cwd=tmp_path)
    assert r.returncode == 2 and f"{other} did not answer GET /health as an HTTP server" \
        in r.stderr, r.stderr
    for t in ("inf", "1e300", "0", "nan"):
        r = _tool("members", a0, "--timeout", t, cwd=tmp_path)
        assert r.returncode == 2 and "argument --timeout" in r.stderr, (t, r.stderr)


def test_shmps_tool_members_pointed_at_another_stores_bridge_is_refused(make_cluster,
                                                                       tmp_path):
    """`shmps-tool members HOST:PORT --store S --add/--remove ...` signs its request for
    store S; a bridge of another store refuses it (409, signed) and the tool says, in
    one line with exit 2, which store that bridge serves, that nothing was changed, and
    the --store to pass; nothing changes on any host.  Without --store a change is
    refused before it is sent; listing the members with --store checks the bridge's
    (/health).  Before, the tool named no store and any bridge it reached applied the
    change (a port mistyped changed another store's members)."""
    c = make_cluster(2)
    c.start_all()
    a0 = c.addrs[0]
    sec = ["--secret-file", str(c.secret_file)]

    def members(i: int) -> list:
        return [m["address"] for m in c.health(i)["members"]]

    epochs = [c.health(i)["epoch"] for i in (0, 1)]
    new = f"127.0.0.9:{free_port('127.0.0.9')}"
    for change in (["--add", new], ["--remove", c.addrs[1]]):
        r = _tool("members", a0, *change, "--store", "modle", *sec, cwd=tmp_path)
        assert r.returncode == 2 and r.stdout == "", r
        assert r.stderr == (
            f"shmps-tool: error: the bridge at {a0} serves store {c.store!r}, not 'modle' "
            f"(--store): nothing was changed (to change the members of store {c.store!r}, "
            f"pass `--store {c.store}` (`shmps-tool members {a0} --store {c.store} ...`); "
            "for store 'modle', ask one of its bridges)\n"), r.stderr
        r = _tool("members", a0, *change, *sec, cwd=tmp_path)   # (no --store)
        assert r.returncode == 2 and "--add and --remove need --store NAME" in r.stderr \
            and r.stderr.count("\n") == 1, r.stderr
    r = _tool("members", a0, "--store", "modle", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith(
        f"shmps-tool: error: the bridge at {a0} serves store {c.store!r}, not 'modle'"), r
    assert _tool("members", a0, "--store", c.store, cwd=tmp_path).returncode == 0
    time.sleep(0.5)   # (a change sent on would have reached host 1 by now)
    assert members(0) == members(1) == sorted(c.addrs)
    assert [c.health(i)["epoch"] for i in (0, 1)] == epochs
    log0 = c.logs[0].read_text(errors="replace")
    assert "members changed" not in log0, log0
    assert "refused a request from 127.0.0.1: 'operator' asks for store 'modle', and this " \
           f"host serves {c.store!r}" in log0, log0


def test_a_peer_missing_from_this_hosts_list_is_refused_with_a_useful_line(make_cluster):
    """A host with the secret that this host's hosts.txt does not list is refused at its
    handshake with a line that says to add it to hosts.txt (it said to check the secret
    and the clocks), and a peer that retries every few ms is one line per
    REFUSAL_LOG_EVERY (5 s) with a count, not a line per attempt."""
    c = make_cluster(2)
    c.start_all()
    secret = c.secret_file.read_bytes().strip()
    stranger = "127.0.0.99:4242"

    async def knock() -> None:
        for _ in range(20):
            session, ws, hs = await _ws_session(c, 0, secret, stranger, 5)
            await ws.receive(timeout=5)                 # closed
            await session.close()

    before = rejected(c, 0, "auth")
    asyncio.run(knock())
    c.wait(lambda: rejected(c, 0, "auth") >= before + 20, 10, "20 refusals counted")
    lines = [line for line in c.logs[0].read_text(errors="replace").splitlines()
             if "is not a member here" in line]
    assert len(lines) == 1, lines
    assert "add it to this host's hosts.txt" in lines[0], lines


def test_a_bridge_started_with_another_store_is_refused_and_the_others_train(make_cluster):
    """Three hosts started together, host 2's bridge with --store modle (the others
    model).  The handshakes refuse it both ways: hosts 0 and 1 converge on a ring of the
    two with host 2 dead, host 2 acts on nothing and owns no shard, and workers on 0 and
    1 push and flush to exact totals.  Each bridge's log says it once per peer (however
    often the links retried), /health lists it and the metric counts the refusals.
    Before, the catalog answer's store header only named it: host 2 was alive on the
    ring of epoch 0 with the others (a share of the shards, whose batches it could not
    apply), and the others never converged without it."""
    c = make_cluster(3)
    for i in range(3):
        c.store = "modle" if i == 2 else "model"     # (bridge_cmd reads it)
        c.start(i)
    c.store = "model"
    try:
        c.wait_converged(20, hosts=[0, 1])
        create_everywhere(c, [0, 1])
        procs = [c.worker(i, push_spec(10)) for i in (0, 1)]
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err.decode() + c.describe()
        wait_totals(c, [0, 1], 2 * 10)
        for i in (0, 1):
            h = c.health(i)
            assert {m["address"]: m["state"] for m in h["members"]}[c.addrs[2]] == "dead", h
            assert h["ring_digest"] == Ring(c.addrs[:2]).digest, h
            assert h["store_mismatch"] == {c.addrs[2]: "modle"}, h
            assert rejected(c, i, "store") >= 1
        h2 = c.health(2)
        assert not h2["acting"] and h2["owned"] == [] and h2["tensors"] == [], h2
        assert h2["store_mismatch"] == {c.addrs[0]: "model", c.addrs[1]: "model"}, h2
        for i, peers in ((0, [2]), (1, [2]), (2, [0, 1])):
            lines = [line for line in c.logs[i].read_text(errors="replace").splitlines()
                     if "serves store" in line]
            assert len(lines) == len(peers), (i, lines)
            ours, theirs = ("modle", "model") if i == 2 else ("model", "modle")
            for j in peers:
                assert any(f"peer {c.addrs[j]} serves store '{theirs}', this host '{ours}': "
                           f"start it with --store {ours}" in line for line in lines), lines
    finally:
        c.kill(2)
        with contextlib.suppress(shmps.Error):
            shmps.attach("modle", namespace=c.namespaces[2], create=False).destroy()


def test_a_bridge_stops_promptly_with_a_peer_connection_still_open(make_cluster):
    """SIGTERM ends a bridge in a few seconds even while connections it did not close
    itself are open: one still in its handshake, and one a member opened after the
    bridge began to close (a peer reconnects at once when its stream is closed).  aiohttp
    waits up to its shutdown timeout (60 s by default) for such handlers; CI once saw a
    leaving host still running 30 s after SIGTERM."""
    c = make_cluster(2)
    c.start_all()
    secret = c.secret_file.read_bytes().strip()

    async def hold_open() -> float:
        import aiohttp
        session = aiohttp.ClientSession()
        try:
            # a connection that never answers the hello (the handshake waits 10 s)
            mute = await session.ws_connect(c.url(0, "/v1/stream"))
            await mute.receive_bytes(timeout=5)
            # and a member's authenticated stream, opened again whenever it is closed
            async def member() -> None:
                while True:
                    try:
                        ws = await session.ws_connect(c.url(0, "/v1/stream"))
                        hs = auth.ClientHandshake(secret, c.addrs[1], "data",
                                                  sender=member_id(c.addrs[1]),
                                                  store=c.store, incarnation=77,
                                                  server_id=c.addrs[0])
                        await ws.send_bytes(hs.answer(await ws.receive_bytes(timeout=5)))
                        hs.check(await ws.receive_bytes(timeout=5))
                        while (await ws.receive()).type not in (
                                aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED,
                                aiohttp.WSMsgType.ERROR):
                            pass
                        await ws.close()
                    except (OSError, aiohttp.ClientError, asyncio.TimeoutError, TypeError):
                        await asyncio.sleep(0.01)

            task = asyncio.get_running_loop().create_task(member())
            await asyncio.sleep(0.5)
            t = time.monotonic()
            c.signal(0, signal.SIGTERM)
            while c.procs[0].poll() is None and time.monotonic() - t < 30:
                await asyncio.sleep(0.05)
            task.cancel()
            return time.monotonic() - t
        finally:
            await session.close()

    took = asyncio.run(hold_open())
    assert c.procs[0].poll() == 0, c.describe()
    assert took < 6.0, f"the bridge took {took:.1f} s to stop\n" + c.describe()


def test_sigterm_while_a_bridge_starts_ends_it_cleanly(make_cluster):
    """The bridge's SIGTERM handler is in place before it starts: a SIGTERM while it
    waits for its store's bridge lock ends it at once, status 0, the store untouched
    (forwarding off).  Before, the handlers came after the start, and a SIGTERM during
    it killed the process with the default action (status -15, no leave: found by the
    chaos review, 2026-11-27)."""
    import fcntl
    from shmps._native import lib

    c = make_cluster(1)
    st = shmps.attach(c.store, namespace=c.namespaces[0])
    fd = os.open("/dev/shm" + st._manifest.name, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)             # a bridge of the store still ending
        p = c.start(0)
        c.wait(lambda: "holds its bridge lock" in c.logs[0].read_text(), 10,
               "the bridge to wait for the lock")
        t0 = time.monotonic()
        os.killpg(p.pid, signal.SIGTERM)
        assert p.wait(10) == 0, c.describe()
        assert time.monotonic() - t0 < 2.0
        assert "stopped before it started" in c.logs[0].read_text(), c.describe()
        assert lib.shmps_forward_get(st._mptr) == 0
    finally:
        os.close(fd)
        st.close()


def test_with_replicas_1_a_leaving_owner_hands_over_what_it_acknowledged(make_cluster):
    """--replicas 1: an owner has no backup, so the host that owns a shard after it
    leaves must take its last changes first (bridge-protocol.md section 7): a leaving
    bridge waits for it like a backup and hands over only once it acknowledged the last
    ROWS.  Before, it announced 'handed over' at once and the next owner served a copy
    without the last batches acknowledged here: pushes lost without PushesLost, and the
    sender's stream refused GAP for good (the chaos review: 2 of 4 SIGTERMs, 2 of 9
    removals).  Here host 0 leaves twice while workers on hosts 1 and 2 push (SIGTERM,
    then removed from hosts.txt), comes back each time; totals are exact and no owner
    finds acknowledged batches missing."""
    c = make_cluster(3, replicas=1)
    # the ring's split follows the random ports: host 0 must own a shard, or its leaves
    # hand nothing over (CI drew such ports once: "owned" was empty)
    for _ in range(50):
        if any(Ring(c.addrs).owner(shard_key(n, s)) == c.addrs[0]
               for n, k in (("w", 8), ("emb", 1), ("X", 4)) for s in range(k)):
            break
        c.addrs[0] = c.members[0] = f"127.0.0.2:{free_port('127.0.0.2')}"
        c.write_hosts()
    c.start_all()
    create_everywhere(c, [0, 1, 2])
    assert c.health(0)["owned"], c.describe()
    rounds = 400
    spec = dict(push_spec(rounds, sleep=0.005), flush_every=10)
    procs = [c.worker(1, spec), c.worker(2, spec)]
    time.sleep(1.0)
    c.signal(0, signal.SIGTERM)
    assert c.wait_exit(0, 30) == 0, c.describe()
    c.start(0)
    c.wait_converged(30)
    time.sleep(0.5)
    c.members.remove(c.addrs[0])
    c.write_hosts()
    assert c.wait_exit(0, 30) == 0, c.describe()
    c.members.insert(0, c.addrs[0])
    c.write_hosts()
    c.start(0)
    for p in procs:
        out, err = p.communicate(timeout=150)
        assert p.returncode == 0, err.decode() + c.describe()
    c.wait_converged(30)
    wait_totals(c, [0, 1, 2], 2 * rounds, timeout=30)
    logs = "".join(c.logs[i].read_text(errors="replace") for i in range(3))
    assert "acknowledged by an earlier owner" not in logs, c.describe()
    assert "waiting for the next owners of" in c.logs[0].read_text(errors="replace")
