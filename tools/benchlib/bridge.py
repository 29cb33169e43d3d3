"""``bench.py bridge`` (issue 6): forwarded pushes between bridges on loopback, failover.

Every throughput figure is a rate over fixed windows (1 s each, ``reps`` of them after a
warm-up), read from a byte counter before and after each window, beside loopback
baselines measured in the same run:

- **baselines**, two processes on 127.0.0.1 spawned here, the receiver counting bytes:
  raw TCP (``sendall`` of 1 MiB, ``recv_into``: the rows' "limit"), an aiohttp websocket
  client sending 1 MiB binary messages to a server (``ws_connect`` /
  ``WebSocketResponse`` as the bridge calls them), the same with glibc's malloc
  thresholds raised, and the server -> client direction (servers do not mask; the
  direction the bridge's data frames take since c100b87: the rows' "baseline").
- **forwarded dense push**: 2 bridges (``tests/bridge_harness.Cluster``: one
  ``shmps.bridge.cli`` process per host on 127.0.0.2 / .3, one shared-memory namespace
  each, flush every 5 ms, replicas 1: an owner acknowledges without waiting for a
  backup, but still sends ROWS to every other host, which keeps a copy for local pulls).
  A (16384, 1024) float32 SGD tensor (64 MiB; the library's default shards, 4 of 16 MiB,
  each drain of one cut into frames of node.DATA_FRAME_BYTES) is created on A; 1 or 2
  worker processes on A loop over ``push`` of a gradient for the rows of the shards host
  B owns (``rows=``: every pushed byte is forwarded; the ring's split depends on the
  ports, so that row count varies between runs) and ``store.flush()``; the figure is
  ``shmps_bridge_gradient_bytes_applied_total`` of host B, which has no workers: the
  gradient bytes of shards owned by the other host applied per second.  The full run adds
  the loop without ``flush()`` (the outbox sums pushes until the bridge drains it), a
  loop pushing every row (A's bridge also applies the shards A owns, on the same 2
  cores: the definition of the figure before 2026-11-23 14:30), replicas 2, and the
  tensor of these rows before 2026-11-25: (4096, 1024) in 16 shards of 1 MiB (a frame a
  shard: more per-frame work per byte).
- **table rows**: the same cluster, a 64-dim float32 SGD table of capacity 2**20 (the
  library's default shards for it, 4 of 64 MiB; 16 before 2026-11-25), workers
  pushing batches of 4096 uniform keys, out of 1,000,000, of the shards B owns
  (+ ``flush()``); rows/s and row payload GB/s applied on host B.
- **failover**: 3 bridges, replicas 2, one worker pushing a 256 KiB tensor (32 shards)
  every ~10 ms on host 0; kill -9 of the bridge owning most shards (never host 0); the
  time from the kill until every shard it owned had a batch applied by a successor (the
  survivors' ``/health`` ``failovers`` entries: each shard's ``first_apply_wall`` - kill
  time, the largest; the checks' row), and until the first of them did (the row before
  2026-11-26); restart it, wait until the bridges converge, repeat (10 kills, 3 with
  ``--quick``).

CPU use of every process involved (workers, bridges, both ends of a baseline) is read
from ``/proc/<pid>/stat`` around each window; whatever else the machine did is "other
load" and marks a row NOISY, as in the other sections.  A bridge that does not do what a
measurement needs (no convergence, nothing applied, no successor, no rejoin) ends that
measurement with a message saying what was seen instead of a figure.
"""
from __future__ import annotations

import asyncio
import importlib.util
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from .context import RunContext
from .harness import _die_with_parent, cpu_sample, progress, stop_process, summary
from .perfsplit import PerfRecorder
from .report import NOISY_FRACTION, Check, Metric, Ref, Row, Section, fmt_num, median_of

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
HZ = float(os.sysconf("SC_CLK_TCK"))
MSG = 1 << 20                      # baseline message / send size

STORE = "benchbridge"
FLUSH_MS = 5.0
DEAD_AFTER = 0.5
DENSE = "w"
DENSE_SHAPE = (16384, 1024)        # 64 MiB float32
DENSE_SHARD_ROWS = 4096            # the default for it (dense.default_shard_rows): 4 of 16 MiB
SMALL = "w1m"                      # the full run's comparison: the tensor of before 2026-11-25
SMALL_SHAPE = (4096, 1024)         # 16 MiB float32
SMALL_SHARD_ROWS = 256             # 16 shards of 1 MiB
DENSES = {DENSE: (DENSE_SHAPE, DENSE_SHARD_ROWS), SMALL: (SMALL_SHAPE, SMALL_SHARD_ROWS)}
TABLE = "emb"
TABLE_DIM = 64
TABLE_KEYS = 1_000_000
TABLE_CAPACITY = 1 << 20
TABLE_SHARDS = 4                   # the default for it (table.default_shards): 4 of 64 MiB
TABLE_BATCH = 4096
KEY_MUL = 0x9E3779B97F4A7C15       # odd: id -> key is a bijection (keys look hashed)
MANY_TENSORS = 500                 # a model's parameter tensors, created at once
MANY_SHARDS = 4
MANY_SHARD_ROWS = 16
BIG_COPY_SHAPE = (16384, 1024)     # one 64 MiB float32 shard; with Adam a 192 MiB copy
BIG_COPY_REPS = 3
FO_NAME = "fo"
FO_SHAPE = (1024, 64)              # 256 KiB, 32 shards: every host owns some
FO_SHARD_ROWS = 32
FO_SLEEP = 0.01                    # the failover worker pushes every ~10 ms (~25 MB/s)
FO_TIMEOUT = 10.0                  # a kill without a successor's apply by then is a failure
REJOIN_TIMEOUT = 20.0              # a restarted bridge converges in 1-2 s when all is well
RTT_ROUNDS = 100                   # push + flush + pull rounds per sample (read your writes)
FLUSH_TIMEOUT = 20.0               # a push + flush of 32 MiB takes ~40 ms when all is well

# glibc returns freed 1 MiB buffers to the kernel (trim / mmap thresholds), so a sender
# that allocates a fresh 1 MiB message copy per frame (aiohttp's client masking) page-faults
# on every message; these raise both thresholds for one baseline row.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}

TCP = Ref("row:tcp", "raw TCP")
WS = Ref("row:ws_down", "aiohttp ws server -> client")


class BridgeSection(Section):
    """A section whose ``row:`` references ignore the process count: the baselines are one
    sender and one receiver, compared with every worker count."""

    def ref_value(self, ref: Ref, procs: int) -> Optional[float]:
        kind, _, name = ref.target.partition(":")
        if kind != "row":
            return super().ref_value(ref, procs)
        for r in self.rows:
            if r.key == name and r.error is None and r.median is not None:
                return r.median * ref.scale
        return None


def section() -> Section:
    return BridgeSection(
        "bridge", "BRIDGE: forwarded pushes between bridges on loopback, failover",
        intro=("GB/s = 1e9 B/s of payload (gradient values; table rows: 64 float32 = 256 B). "
               "procs = pushing worker processes on host A (baselines: one sender, one receiver). "
               "vs limit = raw TCP socket, vs baseline = aiohttp websocket server -> client "
               "(the direction of the bridge's data frames), both on loopback between two "
               "processes in this run."))


# ------------------------------------------------------------------ CPU and windows

def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) of a live process; 0 once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / HZ


def roles_cpu(roles: dict[str, list[int]]) -> dict[str, float]:
    return {r: sum(proc_cpu(p) for p in pids) for r, pids in roles.items()}


@dataclass
class Windows:
    """Counter rates over the measured windows, and who used the CPU meanwhile."""

    rates: dict[str, list[float]] = field(default_factory=dict)
    cores: dict[str, float] = field(default_factory=dict)
    other_load: float = 0.0
    steal: float = 0.0


def measure_windows(read: Callable[[], dict[str, float]], roles: dict[str, list[int]],
                    warmup: float, window: float, reps: int,
                    after_warmup: Optional[Callable[[], None]] = None) -> Windows:
    """Sleep ``warmup``, then ``reps`` windows of ``window`` s: rate of every counter
    ``read()`` returns, CPU cores of each role, and the rest of the machine's load.
    ``after_warmup`` is called once the warm-up is over (bench.py --perf starts
    recording there)."""
    time.sleep(warmup)
    if after_warmup is not None:
        after_warmup()
    out = Windows()
    cpu = {r: 0.0 for r in roles}
    busy = steal = total = own = wall = 0.0
    for _ in range(reps):
        a, p0, c0 = cpu_sample(), roles_cpu(roles), read()
        t0 = time.perf_counter()
        time.sleep(window)
        c1 = read()
        t1 = time.perf_counter()
        b, p1 = cpu_sample(), roles_cpu(roles)
        for k in c1:
            out.rates.setdefault(k, []).append((c1[k] - c0.get(k, 0.0)) / (t1 - t0))
        for r in roles:
            cpu[r] += p1[r] - p0[r]
        busy += b.busy - a.busy
        steal += b.steal - a.steal
        total += b.total - a.total
        own += b.own - a.own
        wall += t1 - t0
    ours = sum(cpu.values())
    out.cores = {r: v / wall for r, v in cpu.items()} if wall > 0 else {}
    if total > 0:
        out.other_load = max(0.0, busy - ours - own) / total
        out.steal = steal / total
    return out


class LoadMeter:
    """Other load over intervals in which processes come and go (a killed bridge, its
    restart): ours = CPU of the processes alive at the end minus, for those alive at the
    start, their CPU then (a process killed meanwhile used next to nothing after it)."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self.pids = pids
        self.busy = self.steal_s = self.total = self.ours = self.own = 0.0
        self._a: Any = None
        self._p0: dict[int, float] = {}

    def start(self) -> None:
        self._a, self._p0 = cpu_sample(), {p: proc_cpu(p) for p in self.pids()}

    def stop(self) -> None:
        b, p1 = cpu_sample(), {p: proc_cpu(p) for p in self.pids()}
        self.ours += sum(p1.values()) - sum(v for p, v in self._p0.items() if p in p1)
        self.busy += b.busy - self._a.busy
        self.steal_s += b.steal - self._a.steal
        self.total += b.total - self._a.total
        self.own += b.own - self._a.own

    @property
    def other_load(self) -> float:
        return max(0.0, self.busy - self.ours - self.own) / self.total if self.total > 0 else 0.0

    @property
    def steal(self) -> float:
        return self.steal_s / self.total if self.total > 0 else 0.0


def add_row(sec: Section, key: str, label: str, procs: int, unit: str, samples: list[float],
            w: Windows, *, limit: Optional[Ref] = TCP, baseline: Optional[Ref] = WS) -> Row:
    row = sec.add(Row(key=key, label=label, procs=procs, unit=unit, samples=samples,
                      limit=limit, baseline=baseline))
    row.data.update(cores={r: round(v, 2) for r, v in w.cores.items()},
                    other_load=round(w.other_load, 3), steal=round(w.steal, 3))
    if w.cores:
        row.note("cores: " + ", ".join(f"{r} {v:.2f}" for r, v in w.cores.items()))
    if w.other_load > NOISY_FRACTION or w.steal > NOISY_FRACTION:
        row.note(f"[NOISY: other load {w.other_load:.0%}, steal {w.steal:.0%}]")
    progress(f"[bridge] {label} {procs}p: {summary(samples)} {unit}")
    return row


@dataclass(frozen=True)
class Plan:
    warmup: float
    window: float
    reps: int


def plans(ctx: RunContext) -> tuple[Plan, Plan]:
    """(baselines, bridge rows): warm-up, window length and measured windows."""
    reps = ctx.timing.reps
    if ctx.quick:
        return Plan(0.5, 1.0, reps), Plan(1.5, 1.0, reps)
    return Plan(1.0, 1.0, reps), Plan(3.0, 1.0, reps)


# ------------------------------------------------------------------ processes

def _spawn(stack: ExitStack, target: Callable[..., None], *args: Any) -> Any:
    """A spawned daemon process, terminated (then killed) when ``stack`` closes."""
    p = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    p.start()
    stack.callback(stop_process, p)
    return p


def _payload() -> bytes:
    import numpy as np
    return np.random.default_rng(0).integers(0, 256, MSG, dtype=np.uint8).tobytes()


async def _pump(ws: Any, send: bool, counter: Any) -> None:
    """One end of a websocket baseline: send 1 MiB messages for ever, or count the bytes
    received into ``counter`` (a shared value the parent samples)."""
    import aiohttp

    if send:
        data = _payload()
        while True:
            await ws.send_bytes(data)
    total = 0
    async for msg in ws:
        if msg.type == aiohttp.WSMsgType.BINARY:
            total += len(msg.data)
            counter.value = total


def _tcp_server(port_q: Any, counter: Any) -> None:
    """Count the bytes one connection sends."""
    _die_with_parent()
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = memoryview(bytearray(MSG))
    total = 0
    while True:
        n = conn.recv_into(buf)
        if n == 0:
            return
        total += n
        counter.value = total


def _tcp_client(port: int, counter: Any) -> None:
    """Send 1 MiB buffers for ever."""
    _die_with_parent()
    s = socket.create_connection(("127.0.0.1", port))
    data = _payload()
    while True:
        s.sendall(data)


def _ws_server(port_q: Any, counter: Any, server_sends: bool) -> None:
    """A websocket server counting the binary bytes it receives, or sending 1 MiB messages."""
    _die_with_parent()
    from aiohttp import web

    async def handler(request: Any) -> Any:
        ws = web.WebSocketResponse(max_msg_size=8 * MSG, autoping=True)
        await ws.prepare(request)
        await _pump(ws, server_sends, counter)
        return ws

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/ws", handler)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        sock = socket.create_server(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        port_q.put(sock.getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(main())


def _ws_client(port: int, counter: Any, server_sends: bool) -> None:
    """A websocket client sending 1 MiB binary messages, or counting what it receives."""
    _die_with_parent()
    import aiohttp

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"http://127.0.0.1:{port}/ws", max_msg_size=8 * MSG,
                                          autoping=True) as ws:
                await _pump(ws, not server_sends, counter)

    asyncio.run(main())


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``env`` added while processes are spawned (they inherit it)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def tcp_core_s_per_gb(sec: Section) -> Optional[float]:
    """Core-seconds (client + server) the raw TCP baseline of this run spent per GB it
    moved: what loopback costs before any bridge work; None if it did not run."""
    row = sec.row("tcp", 1)
    rate = row.median if row is not None else None
    cores = row.data.get("cores") if row is not None else None
    if not rate or not cores:
        return None
    return sum(cores.values()) / rate


def measure_baseline(ctx: RunContext, sec: Section, key: str, label: str, server: Callable[..., None],
                     client: Callable[..., None], plan: Plan, *args: Any,
                     limit: Optional[Ref] = None, env: Optional[dict[str, str]] = None) -> None:
    """A server and a client process on 127.0.0.1; the receiving side counts bytes."""
    spawn = mp.get_context("spawn")
    port_q = spawn.Queue()
    counter = spawn.RawValue("q", 0)
    ctx.quiet.wait()
    with ExitStack() as stack:
        with environment(env or {}):
            srv = _spawn(stack, server, port_q, counter, *args)
            port = port_q.get(timeout=60)
            cli = _spawn(stack, client, port, counter, *args)
        w = measure_windows(lambda: {"b": float(counter.value)},
                            {"client": [cli.pid], "server": [srv.pid]},
                            plan.warmup, plan.window, plan.reps)
        if not cli.is_alive() or not srv.is_alive() or not any(w.rates["b"]):
            row = sec.add(Row(key=key, label=label, procs=1, unit="GB/s"))
            row.error = (f"error: nothing received (client exit code {cli.exitcode}, "
                         f"server {srv.exitcode})")
            return
    add_row(sec, key, label, 1, "GB/s", [r / 1e9 for r in w.rates["b"]], w,
            limit=limit, baseline=None)


def baselines(ctx: RunContext, sec: Section, plan: Plan) -> None:
    measure_baseline(ctx, sec, "tcp", "raw TCP socket, client sendall(1 MiB) -> server recv_into",
                     _tcp_server, _tcp_client, plan)
    measure_baseline(ctx, sec, "ws", "aiohttp websocket, client -> server, 1 MiB binary messages",
                     _ws_server, _ws_client, plan, False, limit=TCP)
    measure_baseline(ctx, sec, "ws_malloc", "aiohttp websocket, client -> server, glibc malloc "
                     "thresholds raised (MALLOC_MMAP_THRESHOLD_=32 MiB, MALLOC_TRIM_THRESHOLD_="
                     "256 MiB)", _ws_server, _ws_client, plan, False, limit=TCP, env=MALLOC_ENV)
    measure_baseline(ctx, sec, "ws_down", "aiohttp websocket, server -> client (no masking; the "
                     "direction of the bridge's data frames)", _ws_server, _ws_client, plan, True,
                     limit=TCP)


# ------------------------------------------------------------------ workers on a host

def _pusher(spec: dict, stop: Any, status: Any, count: Any) -> None:
    """Push into one host's store until ``stop`` is set (spawned; reports to ``status``)."""
    _die_with_parent()
    try:
        import numpy as np

        import shmps
        store = shmps.attach(spec["store"], namespace=spec["namespace"])
        rng = np.random.default_rng(spec["seed"])
        shards = spec.get("shards")   # only rows/keys of these shards (None: all)
        if spec["kind"] == "dense":
            t = store[spec["name"]]
            if shards is None:
                g = (rng.standard_normal(t.shape, dtype=np.float32) * 1e-3)

                def push(i: int) -> None:
                    t.push(g)
            else:
                rows = np.concatenate([np.arange(s * t.shard_rows,
                                                 min(t.nrows, (s + 1) * t.shard_rows))
                                       for s in shards])
                g = (rng.standard_normal((rows.size,) + t.shape[1:], dtype=np.float32) * 1e-3)

                def push(i: int) -> None:
                    t.push(g, rows=rows)
        else:
            t = store[spec["name"]]
            pool = rng.integers(0, TABLE_KEYS, 64 * TABLE_BATCH, dtype=np.uint64)
            pool = pool * np.uint64(KEY_MUL)
            if shards is not None:
                pool = pool[np.isin(t._key_shard(pool), np.asarray(shards, np.uint32))]
            n_batches = min(16, pool.size // TABLE_BATCH)
            if n_batches < 1:
                raise RuntimeError(f"only {pool.size} keys of the shards {shards}")
            keys = pool[:n_batches * TABLE_BATCH].reshape(n_batches, TABLE_BATCH)
            gs = rng.standard_normal((n_batches, TABLE_BATCH, TABLE_DIM),
                                     dtype=np.float32) * 1e-3

            def push(i: int) -> None:
                t.push(keys[i % n_batches], gs[i % n_batches])
        status.put(("ready", spec["rank"], ""))
        n = 0
        sleep, flush = spec.get("sleep", 0.0), spec.get("flush", False)
        while not stop.is_set():
            push(n)
            if flush:
                store.flush(timeout=FLUSH_TIMEOUT)
            n += 1
            count.value = n
            if sleep:
                time.sleep(sleep)
        store.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        status.put(("error", spec["rank"], f"{type(exc).__name__}: {exc}"))


class WorkerFailed(RuntimeError):
    """A pusher raised (e.g. store.flush timed out) or died."""


class Pushers:
    """``n`` spawned pushers on host ``i`` of a cluster; stopped when the block ends."""

    def __init__(self, stack: ExitStack, cluster: Any, host: int, n: int, kind: str, name: str,
                 sleep: float = 0.0, flush: bool = False,
                 shards: Optional[list[int]] = None) -> None:
        spawn = mp.get_context("spawn")
        self.stop = spawn.Event()
        self.status = spawn.Queue()
        self.counts = [spawn.RawValue("q", 0) for _ in range(n)]
        self.procs = []
        for r in range(n):
            spec = {"store": cluster.store, "namespace": cluster.namespaces[host], "kind": kind,
                    "name": name, "seed": 1000 + r, "rank": r, "sleep": sleep, "flush": flush,
                    "shards": shards}
            self.procs.append(_spawn(stack, _pusher, spec, self.stop, self.status,
                                     self.counts[r]))
        stack.callback(self.stop.set)   # runs before the terminations registered above
        ready = 0
        while ready < n:
            msg, rank, text = self.status.get(timeout=120)
            if msg == "error":
                raise WorkerFailed(f"worker {rank}: {text}")
            ready += 1

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def pushes(self) -> float:
        return float(sum(c.value for c in self.counts))

    def check(self) -> None:
        while not self.status.empty():
            msg, rank, text = self.status.get_nowait()
            if msg == "error":
                raise WorkerFailed(f"worker {rank}: {text}")
        for p in self.procs:
            if not p.is_alive():
                raise WorkerFailed(f"a worker exited with code {p.exitcode}")

    def finish(self) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(30)
        while not self.status.empty():
            msg, rank, text = self.status.get_nowait()
            if msg == "error":
                raise WorkerFailed(f"worker {rank}: {text}")


# ------------------------------------------------------------------ cluster helpers

APPLIED = "shmps_bridge_gradient_bytes_applied_total"
SENT_BATCH = 'shmps_bridge_bytes_sent_total{type="batch"}'
SENT_ROWS = 'shmps_bridge_bytes_sent_total{type="rows"}'


def metrics(cluster: Any, i: int) -> dict[str, float]:
    """Host i's /metrics samples by name (with labels), e.g. ``APPLIED``."""
    with urllib.request.urlopen(cluster.url(i, "/metrics"), timeout=5.0) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def owned(cluster: Any, i: int, name: str) -> list[str]:
    h = cluster.health(i) or {}
    return [k for k in h.get("owned", []) if k.rsplit("/", 1)[0] == name]


def wait_tensor(cluster: Any, hosts: list[int], name: str, timeout: float = 20.0) -> None:
    try:
        cluster.wait(lambda: all(name in ((cluster.health(i) or {}).get("tensors") or [])
                                 for i in hosts), timeout, f"every bridge to forward {name!r}")
    except AssertionError as exc:
        raise BridgeUnusable(f"the bridges never all listed the tensor {name!r} in /health "
                             f"'tensors' ({timeout:.0f} s)\n{exc}") from None


class BridgeUnusable(RuntimeError):
    """The bridge did not do what the benchmark needs; the message says what was seen."""


BALANCED = tuple((name, shape[0] // rows) for name, (shape, rows) in DENSES.items()) + (
    (TABLE, TABLE_SHARDS),)
BALANCE_TRIES = 2000


def balance_ports(c: Any) -> int:
    """Pick the 2 bridges' ports again until host B (1) owns half the shards of each
    tensor in BALANCED (the ring is a hash of the addresses: with the ports the kernel
    gives, B owned 3 to 12 of 16, and the figures moved with it, runs apart); returns
    the tries it took, 0 if none of BALANCE_TRIES did (then the ports are kept)."""
    from bridge_harness import free_port
    from shmps.bridge.ring import Ring, shard_key

    def b_owns(addrs: list, name: str, nshards: int) -> int:
        ring = Ring(addrs)
        return sum(ring.owners(shard_key(name, s), 1)[0] == addrs[1] for s in range(nshards))

    for tries in range(1, BALANCE_TRIES + 1):
        addrs = [f"{a.rsplit(':', 1)[0]}:{free_port(a.rsplit(':', 1)[0])}" for a in c.addrs]
        if all(2 * b_owns(addrs, name, k) == k for name, k in BALANCED):
            c.addrs = addrs
            c.members = list(addrs)
            c.write_hosts()
            return tries
    return 0


def start_cluster(stack: ExitStack, sec: Section, workdir: Path, n: int, replicas: int,
                  balanced: bool = False) -> Any:
    """``n`` converged bridges (tests/bridge_harness.Cluster), closed when ``stack`` closes:
    every bridge killed and every store of the cluster destroyed.  A start that does not
    converge in 30 s is retried once, and the section says so.  ``balanced`` (2 bridges):
    ports chosen so that host B owns half of each benchmark tensor's shards
    (balance_ports)."""
    from bridge_harness import Cluster  # tests/ is on sys.path (see run())
    for attempt in (1, 2):
        c = Cluster(workdir / f"try{attempt}", n, store=STORE, replicas=replicas,
                    flush_ms=FLUSH_MS, dead_after=DEAD_AFTER)
        stack.callback(c.close)
        if balanced and not balance_ports(c):
            sec.messages.append(f"bridge start-up: no ports in {BALANCE_TRIES} tries gave "
                                "host B half the shards; the kernel's ports kept")
        t0 = time.perf_counter()
        try:
            c.start_all(30.0)
        except AssertionError as exc:
            progress(f"[bridge] start {attempt} of {n} bridges did not converge:\n{exc}")
            states = [[m["state"] for m in (c.health(i) or {}).get("members", [])]
                      for i in range(n)]
            c.close()
            if attempt == 2:
                raise BridgeUnusable(f"{n} bridges did not converge in 30 s, twice (member "
                                     f"states seen by each: {states})") from None
            sec.messages.append(f"bridge start-up: {n} fresh bridges did not converge in 30 s "
                                f"(member states seen by each: {states}); started again")
            continue
        progress(f"[bridge] {n} bridges up and converged in {time.perf_counter() - t0:.1f} s "
                 f"(replicas {replicas})")
        return c
    raise AssertionError("unreachable")


def create(c: Any, host: int, what: str) -> None:
    """Create a benchmark tensor in host ``host``'s store (the bridges copy its schema)."""
    import shmps
    s = c.attach(host)
    try:
        if what == DENSE:   # the library's default shards, which the figures assume
            t = s.dense(DENSE, DENSE_SHAPE, "float32", init=0.0, optimizer=shmps.SGD(lr=1e-3))
            if t.shard_rows != DENSE_SHARD_ROWS:
                raise BridgeUnusable(f"{DENSE!r} has shards of {t.shard_rows} rows by default "
                                     f"now, not {DENSE_SHARD_ROWS}: update DENSE_SHARD_ROWS")
        elif what == SMALL:
            s.dense(SMALL, SMALL_SHAPE, "float32", init=0.0, optimizer=shmps.SGD(lr=1e-3),
                    shard_rows=SMALL_SHARD_ROWS)
        elif what == TABLE:
            t = s.table(TABLE, dim=TABLE_DIM, dtype="float32", capacity=TABLE_CAPACITY,
                        optimizer=shmps.SGD(lr=1e-3))
            if t.nshards != TABLE_SHARDS:
                raise BridgeUnusable(f"{TABLE!r} has {t.nshards} shards by default now, not "
                                     f"{TABLE_SHARDS}: update TABLE_SHARDS")
        else:
            s.dense(FO_NAME, FO_SHAPE, "float32", init=0.0, optimizer=shmps.SGD(lr=1e-3),
                    shard_rows=FO_SHARD_ROWS)
    finally:
        s.close()


def wait_drained(c: Any, host: int, timeout: float = FLUSH_TIMEOUT) -> None:
    """Every push made on ``host`` so far is applied by its owner (``store.flush``)."""
    s = c.attach(host)
    try:
        s.flush(timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - a Timeout here is the bridge's, reported
        raise BridgeUnusable(f"store.flush({timeout:.0f}) on host {host} after the workers "
                             f"stopped: {type(exc).__name__}: {exc}\n{describe(c)}") from None
    finally:
        s.close()


def describe(cluster: Any) -> str:
    try:
        return str(cluster.describe())
    except Exception as exc:  # noqa: BLE001 - diagnostics only
        return f"(could not describe the cluster: {exc})"


# ------------------------------------------------------------------ forwarded pushes

def _forward(c: Any, plan: Plan, what: str, workers: int, flush: bool,
             shards: Optional[list[int]], perf_dir: Optional[Path] = None,
             ) -> tuple[Windows, dict[str, float], Optional[str]]:
    """Run the pushers on host A (0) over the windows; counters of both bridges, and
    with ``perf_dir`` (bench.py --perf) where each bridge's CPU went (a note)."""
    rec = (PerfRecorder({"bridge A": c.procs[0].pid, "bridge B": c.procs[1].pid}, perf_dir)
           if perf_dir is not None else None)
    with ExitStack() as stack:
        ps = Pushers(stack, c, 0, workers, "dense" if what in DENSES else "table", what,
                     flush=flush, shards=shards)

        def read() -> dict[str, float]:
            a, b = metrics(c, 0), metrics(c, 1)
            return {"b": b.get(APPLIED, 0.0), "a": a.get(APPLIED, 0.0),
                    "a_batch": a.get(SENT_BATCH, 0.0), "b_rows": b.get(SENT_ROWS, 0.0),
                    "pushes": ps.pushes()}

        try:
            w = measure_windows(read, {"workers": ps.pids, "bridge A": [c.procs[0].pid],
                                       "bridge B": [c.procs[1].pid]},
                                plan.warmup, plan.window, plan.reps,
                                after_warmup=rec.start if rec is not None else None)
        finally:
            splits = rec.stop() if rec is not None else {}
        ps.check()
        ps.finish()
    note = None
    if rec is not None:
        note = ("CPU by the code it ran (perf record, " +
                ("; ".join(f"{role}: {s.describe()}" for role, s in splits.items())
                 if splits else f"no figures: {rec.error}") + ")")
    return w, {k: statistics.median(v) for k, v in w.rates.items()}, note


def forwarded(ctx: RunContext, sec: Section, c: Any, plan: Plan, *, key: str, label: str,
              what: str, workers: int, flush: bool = True, remote_only: bool = True) -> None:
    """Workers on host A (0) push ``what`` (only rows/keys of the shards host B owns when
    ``remote_only``: every pushed byte is forwarded); host B's (1) applied gradient bytes
    per second."""
    ctx.quiet.wait()
    b_shards = sorted(int(k.rsplit("/", 1)[1]) for k in owned(c, 1, what))
    if remote_only and not b_shards:
        raise BridgeUnusable(f"{label}: host B owns no shard of {what!r}")
    perf_dir = None
    if ctx.perf:
        perf_dir = Path(tempfile.mkdtemp(prefix="shmps-perf-"))
        ctx.stack.callback(shutil.rmtree, perf_dir, True)
    try:
        w, med, perf_note = _forward(c, plan, what, workers, flush,
                                     b_shards if remote_only else None, perf_dir)
    except WorkerFailed as exc:
        raise BridgeUnusable(f"{label}, {workers} worker(s): {exc}\n{describe(c)}") from None
    wait_drained(c, 0)
    if not any(w.rates["b"]):
        raise BridgeUnusable(f"{label}: host B applied nothing in {plan.reps} windows of "
                             f"{plan.window:.0f} s (workers pushed {med['pushes']:.0f}/s)")
    nb = len(b_shards)
    if what in DENSES:
        shape, shard_rows = DENSES[what]
        total = shape[0] // shard_rows
    else:
        total = TABLE_SHARDS
    loop = "push + store.flush()" if flush else "push in a loop, no flush"
    scope = (f"pushes to the {nb} of {total} shards B owns only" if remote_only else
             f"pushes to every shard (B owns {nb} of {total})")
    wire = (f"on the wire: A->B BATCH {fmt_num(med['a_batch'] / 1e9)} GB/s, B->A ROWS "
            f"{fmt_num(med['b_rows'] / 1e9)} GB/s")
    if what in DENSES:
        row = add_row(sec, key, label, workers, "GB/s", [x / 1e9 for x in w.rates["b"]], w)
        floor = tcp_core_s_per_gb(sec)
        if floor is not None and med["b"] > 0:
            per_gb = sum(w.cores.values()) / (med["b"] / 1e9)
            row.note(f"core-s per GB applied on B, workers and both bridges: {per_gb:.2f} "
                     f"(1 GB/s needs at most {os.cpu_count()}, the cores here); loopback TCP "
                     f"alone: {floor:.2f} core-s per GB moved (raw TCP row), twice that "
                     f"= {2 * floor:.2f} as each forwarded byte crosses twice (BATCH, then "
                     "ROWS back)")
        per_push = (nb if remote_only else total) * shard_rows * shape[1] * 4
        pushed = med["pushes"] * per_push
        row.note(f"{scope}; {loop}: {fmt_num(med['pushes'])} pushes/s of "
                 f"{per_push / 2**20:.0f} MiB = {fmt_num(pushed / 1e9)} GB/s "
                 f"{'pushed and flushed' if flush else 'into the outboxes (summed there)'}; "
                 f"A applied its own {fmt_num(med['a'] / 1e9)} GB/s; {wire}")
    else:
        rb = TABLE_DIM * 4
        rows = add_row(sec, key + "_rows", label + ": rows", workers, "rows/s",
                       [x / rb for x in w.rates["b"]], w, limit=None, baseline=None)
        rows.note(f"{scope}; {loop}: {fmt_num(med['pushes'] * TABLE_BATCH)} rows/s pushed on "
                  f"A; A applied its own {fmt_num(med['a'] / rb)} rows/s; {wire}")
        row = add_row(sec, key, label + ": row payload", workers, "GB/s",
                      [x / 1e9 for x in w.rates["b"]], w)
    if perf_note:
        row.note(perf_note)
    row.data.update({k: v for k, v in w.rates.items() if k != "b"}, owned_by_b=nb)


def flush_round_trip(ctx: RunContext, sec: Section, c: Any, plan: Plan) -> None:
    """A process on host A pushes one row of a shard host B owns, calls store.flush()
    and pulls the row: the round's wall time (push to the pull's return; the median of
    RTT_ROUNDS rounds is one sample), and how many pulls did not show the push (read
    your writes: none may)."""
    import numpy as np

    ctx.quiet.wait()
    b_shards = sorted(int(k.rsplit("/", 1)[1]) for k in owned(c, 1, DENSE))
    if not b_shards:
        raise BridgeUnusable(f"host B owns no shard of {DENSE!r}")
    rows = np.array([b_shards[0] * DENSE_SHARD_ROWS], np.int64)
    g = np.ones((1, DENSE_SHAPE[1]), np.float32)
    samples: list[float] = []
    stale = rounds = 0
    with c.attach(0) as s:
        t = s[DENSE]
        for _ in range(20):                                   # warm-up
            t.push(g, rows=rows)
            s.flush(timeout=FLUSH_TIMEOUT)
        for _ in range(plan.reps):
            took = []
            for _ in range(RTT_ROUNDS):
                before = t.pull(rows=rows)
                t0 = time.perf_counter()
                t.push(g, rows=rows)
                s.flush(timeout=FLUSH_TIMEOUT)
                after = t.pull(rows=rows)
                took.append(time.perf_counter() - t0)
                stale += int(np.array_equal(after, before))
                rounds += 1
            samples.append(1e3 * statistics.median(took))
    row = add_row(sec, "rtt", "one-row push + store.flush() + pull() on host A, of a row host "
                  "B owns (4 KiB, SGD), replicas 1", 1, "ms", samples, Windows(),
                  limit=None, baseline=None)
    row.note(f"each sample the median of {RTT_ROUNDS} rounds; {stale} of {rounds} pulls "
             f"after flush() did not show the push (read your writes: must be 0); "
             f"--flush-ms {FLUSH_MS:g}, flush() wakes the bridge at once")
    row.data.update(stale=stale, rounds=rounds)


def throughput(ctx: RunContext, sec: Section, workdir: Path, plan: Plan) -> None:
    """2 bridges: dense and table pushes from host A forwarded to host B."""
    dense_label = ("forwarded dense push, the rows of B's shards of a 64 MiB float32 SGD "
                   "tensor (default shards: 16 MiB), replicas 1")
    table_label = (f"forwarded table push, {TABLE_BATCH} uniform keys of B's shards x "
                   f"{TABLE_DIM} float32 SGD (default shards: 64 MiB), replicas 1")
    with ExitStack() as stack:
        c = start_cluster(stack, sec, workdir / "r1", 2, replicas=1, balanced=True)
        create(c, 0, DENSE)
        create(c, 0, TABLE)
        wait_tensor(c, [0, 1], DENSE)
        wait_tensor(c, [0, 1], TABLE)
        if not ctx.quick:
            create(c, 0, SMALL)
            wait_tensor(c, [0, 1], SMALL)
        progress(f"[bridge] host B owns {len(owned(c, 1, DENSE))} of "
                 f"{DENSE_SHAPE[0] // DENSE_SHARD_ROWS} dense shards, "
                 f"{len(owned(c, 1, TABLE))} of {TABLE_SHARDS} table shards")
        for n in (1, 2):
            forwarded(ctx, sec, c, plan, key="dense_r1", label=dense_label, what=DENSE,
                      workers=n)
        if not ctx.quick:
            forwarded(ctx, sec, c, plan, key="dense_r1_noflush", what=DENSE, workers=1,
                      label=dense_label + ", no flush", flush=False)
            forwarded(ctx, sec, c, plan, key="dense_r1_all", what=DENSE, workers=2,
                      label="forwarded dense push, every row of a 64 MiB float32 SGD tensor "
                            "(A applies the shards it owns), replicas 1", remote_only=False)
            forwarded(ctx, sec, c, plan, key="dense_r1_1mib", what=SMALL, workers=1,
                      label="forwarded dense push, the rows of B's shards of a 16 MiB "
                            "float32 SGD tensor in 1 MiB shards (a frame a shard), replicas 1")
        for n in (1, 2):
            forwarded(ctx, sec, c, plan, key="table_r1", label=table_label, what=TABLE,
                      workers=n)
        flush_round_trip(ctx, sec, c, plan)


def throughput_r2(ctx: RunContext, sec: Section, workdir: Path, plan: Plan) -> None:
    """2 bridges, replicas 2: the owner waits for the other host's acknowledgement."""
    if ctx.quick:
        return
    with ExitStack() as stack:
        c = start_cluster(stack, sec, workdir / "r2", 2, replicas=2, balanced=True)
        create(c, 0, DENSE)
        wait_tensor(c, [0, 1], DENSE)
        forwarded(ctx, sec, c, plan, key="dense_r2", what=DENSE, workers=2,
                  label="forwarded dense push, the rows of B's shards of a 64 MiB float32 "
                        "SGD tensor (default shards: 16 MiB), replicas 2")


# ------------------------------------------------------------------ many tensors

def loop_lag_ms(healths: list[dict]) -> float:
    """The largest ``loop_lag_ms`` of the bridges' /health answers (a missing one: 0)."""
    return max([0.0] + [float(h.get("loop_lag_ms", 0.0)) for h in healths])


def many_tensors(ctx: RunContext, sec: Section, workdir: Path, plan: Plan) -> None:
    """2 bridges, replicas 2; a worker on host A creates a model of MANY_TENSORS small
    dense tensors at once (MANY_SHARDS shards each): how long until both bridges forward
    them all, the event loops' worst lag and the stalls meanwhile; then the CPU each
    idle bridge uses with that many shards."""
    import shmps
    n = MANY_TENSORS // 2 if ctx.quick else MANY_TENSORS
    rows = MANY_SHARDS * MANY_SHARD_ROWS
    with ExitStack() as stack:
        c = start_cluster(stack, sec, workdir / "many", 2, replicas=2)
        names = {f"m{k}" for k in range(n)}
        s = c.attach(0)
        t0 = time.perf_counter()
        try:
            for name in sorted(names):
                s.dense(name, (rows, 64), "float32", optimizer=shmps.SGD(lr=1e-3),
                        shard_rows=MANY_SHARD_ROWS)
        finally:
            s.close()
        created = time.perf_counter() - t0
        lag = 0.0
        while True:
            hs = [c.health(i) or {} for i in (0, 1)]
            lag = max(lag, loop_lag_ms(hs))
            if all(names <= set(h.get("tensors") or []) for h in hs):
                break
            if time.perf_counter() - t0 > 120:
                raise BridgeUnusable(f"the bridges did not take up {n} tensors in 120 s\n"
                                     f"{describe(c)}")
            time.sleep(0.05)
        took = time.perf_counter() - t0
        stalls = [metrics(c, i).get("shmps_bridge_stalls_total", 0.0) for i in (0, 1)]
        epochs = [(c.health(i) or {}).get("epoch") for i in (0, 1)]
        label = f"a model of {n} dense tensors x {MANY_SHARDS} shards created at once"
        row = add_row(sec, "many_takeup", f"{label}: until both bridges forward all", 1,
                      "s", [took], Windows(), limit=None, baseline=None)
        row.note(f"the worker created them in {created:.2f} s; the bridges' event loops "
                 f"were late by at most {lag:.0f} ms meanwhile (a bridge counts itself "
                 f"stalled from {1000 * DEAD_AFTER / 2:.0f} ms); stalls {stalls[0]:.0f} / "
                 f"{stalls[1]:.0f}; epochs {epochs[0]} / {epochs[1]} (0: the ring never "
                 "moved)")
        row.data.update(lag_ms=lag, stalls=stalls, epochs=epochs)
        pids = {"bridge A": [c.procs[0].pid], "bridge B": [c.procs[1].pid]}

        def read() -> dict[str, float]:
            return {"cpu": sum(proc_cpu(p[0]) for p in pids.values()) / 2}

        w = measure_windows(read, pids, plan.warmup, plan.window, plan.reps)
        idle = add_row(sec, "many_idle", f"{label}: CPU of an idle bridge", 1,
                       "cores", w.rates["cpu"], w, limit=None, baseline=None)
        idle.note(f"{n * MANY_SHARDS} shards of {n} tensors on each host, no pushes; the "
                  "figure is the mean of the two bridges")


def big_copy(ctx: RunContext, sec: Section, workdir: Path, plan: Plan) -> None:
    """2 bridges, replicas 2; host A creates a tensor of one 64 MiB float32 shard with
    Adam (its copy, values and state, is 192 MiB), and its owner copies it to the other
    host (a snapshot, as for a joining host or a new backup): how long until host B holds
    the copy, and how late each bridge's event loop was meanwhile (heartbeats run on it:
    a bridge counts itself stalled from half of --dead-after).  BIG_COPY_REPS tensors,
    one after the other, each after the loop-lag window (10 s) of the one before.  (When
    host B owns the shard, A first sends it the initial values, also a 192 MiB copy.)"""
    import shmps
    from shmps.bridge.node import LAG_WINDOW
    if ctx.quick:
        return
    took: list[float] = []
    lags: list[float] = []
    with ExitStack() as stack:
        c = start_cluster(stack, sec, workdir / "copy", 2, replicas=2)
        for k in range(BIG_COPY_REPS):
            time.sleep(LAG_WINDOW)     # the last lags (start-up, the copy before) forgotten
            before = [(c.health(i) or {}).get("copied", 0) for i in (0, 1)]
            t0 = time.perf_counter()
            with c.attach(0) as s:
                s.dense(f"copy{k}", BIG_COPY_SHAPE, "float32", shard_rows=BIG_COPY_SHAPE[0],
                        init=0.5, optimizer=shmps.Adam(lr=1e-3))
            lag = 0.0
            while True:
                hs = [c.health(i) or {} for i in (0, 1)]
                lag = max(lag, loop_lag_ms(hs))
                owner = [i for i in (0, 1) if f"copy{k}/0" in (hs[i].get("owned") or [])]
                if len(owner) == 1 and hs[1 - owner[0]].get("copied", 0) > before[1 - owner[0]]:
                    break   # the other host holds the owner's copy
                if time.perf_counter() - t0 > 60:
                    raise BridgeUnusable(f"big copy: no copy of copy{k} reached the host not "
                                         f"owning it in 60 s\n{describe(c)}")
                time.sleep(0.05)
            took.append(time.perf_counter() - t0)
            time.sleep(0.3)
            lags.append(max(lag, loop_lag_ms([c.health(i) or {} for i in (0, 1)])))
            progress(f"[bridge] big copy {k + 1}/{BIG_COPY_REPS}: {took[-1]:.2f} s, event "
                     f"loops late by at most {lags[-1]:.0f} ms")
        stalls = [metrics(c, i).get("shmps_bridge_stalls_total", 0.0) for i in (0, 1)]
        epochs = [(c.health(i) or {}).get("epoch") for i in (0, 1)]
    mib = BIG_COPY_SHAPE[0] * BIG_COPY_SHAPE[1] * 4 * 3 / 2**20
    row = add_row(sec, "big_copy", f"a {mib:.0f} MiB shard copy (64 MiB float32 + Adam state) "
                  "to the other host: create -> the host not owning it holds the owner's copy",
                  1, "s", took, Windows(), limit=None, baseline=None)
    row.note(f"{len(took)} tensors; the bridges' event loops late by at most "
             f"{', '.join(f'{x:.0f}' for x in lags)} ms (each copy: both bridges, from the "
             f"create to 0.3 s after; a bridge counts itself stalled from "
             f"{1000 * DEAD_AFTER / 2:.0f} ms); stalls {stalls[0]:.0f} / {stalls[1]:.0f}; "
             f"epochs {epochs[0]} / {epochs[1]} (0: the ring never moved)")
    row.data.update(lag_ms=lags, largest_lag_ms=max(lags), stalls=stalls, epochs=epochs)


# ------------------------------------------------------------------ failover

@dataclass
class Kill:
    """One kill -9: whom, and what the survivors' /health said about its shards."""

    victim: int
    owned: int                        # failover shards the victim owned
    #: each of them a successor applied a batch to: shard -> (successor host, kill ->
    #: that first apply, s)
    by_shard: dict = field(default_factory=dict)
    since_hb: Optional[float] = None  # the first apply - the victim's last heartbeat (s)

    @property
    def taken(self) -> int:
        return len(self.by_shard)

    @property
    def took(self) -> Optional[float]:
        """Kill -> the first shard's first apply by a successor (s)."""
        return min((t for _, t in self.by_shard.values()), default=None)

    @property
    def took_all(self) -> Optional[float]:
        """Kill -> the last shard's (None unless every shard it owned had one)."""
        if not self.by_shard or self.taken < self.owned:
            return None
        return max(t for _, t in self.by_shard.values())


def kill_once(c: Any) -> Kill:
    """Kill -9 the bridge (not host 0) owning most failover shards and wait (at most
    ``FO_TIMEOUT``) until the survivors' /health ``failovers`` entries name every shard it
    owned: the first apply by a successor of each.  (Before 2026-11-26 the wait ended at
    the first entry, and 0.3 s later the figure was the earliest: a shard held for
    seconds by its successor did not show.)"""
    counts = {i: owned(c, i, FO_NAME) for i in range(1, len(c.addrs))}
    victim = max(counts, key=lambda i: len(counts[i]))
    shards = set(counts[victim])
    k = Kill(victim, len(shards))
    survivors = [i for i in c.running() if i != victim]
    dead = c.addrs[victim]
    t_kill = c.kill(victim)

    def seen() -> dict[str, dict]:
        """The earliest entry of each of the victim's shards, by shard."""
        first: dict[str, dict] = {}
        for i in survivors:
            for f in (c.health(i) or {}).get("failovers", []):
                if (f.get("dead") == dead and f.get("shard") in shards
                        and f.get("first_apply_wall", 0.0) >= t_kill
                        and (f["shard"] not in first
                             or f["first_apply_wall"] < first[f["shard"]]["first_apply_wall"])):
                    first[f["shard"]] = dict(f, by=i)
        return first

    entries: dict[str, dict] = {}
    while len(entries) < len(shards) and time.time() < t_kill + FO_TIMEOUT:
        time.sleep(0.02)
        entries = seen()
    k.by_shard = {sh: (f["by"], f["first_apply_wall"] - t_kill)
                  for sh, f in sorted(entries.items())}
    if entries:
        first = min(entries.values(), key=lambda f: f["first_apply_wall"])
        k.since_hb = float(first["since_last_heartbeat_s"])
    return k


def keep_logs(cluster: Any, kill: int) -> Path:
    """Copy the cluster's directory (each bridge's log, hosts.txt) out of the run's
    temporary directory, which goes with the run: a failover that misses shards is rare
    and needs the bridges' own account."""
    import tempfile
    dest = Path(tempfile.gettempdir()) / f"shmps-bench-failover-{int(time.time())}-kill{kill}"
    shutil.copytree(cluster.dir, dest, dirs_exist_ok=True)
    return dest


def failover(ctx: RunContext, sec: Section, workdir: Path, plan: Plan) -> None:
    """3 bridges, replicas 2, a worker pushing on host 0; kill, measure, restart, repeat."""
    total = 3 if ctx.quick else 10
    kills: list[Kill] = []
    with ExitStack() as stack:
        c = start_cluster(stack, sec, workdir / "fo", 3, replicas=2)
        create(c, 0, FO_NAME)
        wait_tensor(c, [0, 1, 2], FO_NAME)
        ps = Pushers(stack, c, 0, 1, "dense", FO_NAME, sleep=FO_SLEEP)
        time.sleep(1.0)
        # the first kill comes mid-stream too: the worker may take longer than that to
        # start on a loaded machine, and a kill before its first push measures its start
        deadline = time.monotonic() + FO_TIMEOUT
        while ps.pushes() < 10 and time.monotonic() < deadline:
            ps.check()
            time.sleep(0.05)
        load = LoadMeter(lambda: [c.procs[i].pid for i in c.running()] + ps.pids)
        for n in range(1, total + 1):
            ps.check()
            load.start()
            k = kill_once(c)
            kills.append(k)
            if k.took is None:
                progress(f"[bridge] kill {n}/{total}: host {k.victim} (owned {k.owned} shards): "
                         f"no successor applied a batch of its shards within {FO_TIMEOUT:.0f} s "
                         f"(the bridges' logs kept in {keep_logs(c, n)})\n{describe(c)}")
            else:
                every = (f"the last of them after {k.took_all * 1000:.0f} ms"
                         if k.took_all is not None else
                         f"only {k.taken} of them taken over within {FO_TIMEOUT:.0f} s; "
                         f"the bridges' logs kept in {keep_logs(c, n)}")
                progress(f"[bridge] kill {n}/{total}: host {k.victim} (owned {k.owned} shards) -> "
                         f"first batch applied by a successor after {k.took * 1000:.0f} ms "
                         f"({k.since_hb * 1000:.0f} ms after its last heartbeat), {every}")
            c.start(k.victim)
            rejoin = REJOIN_TIMEOUT / 2 if ctx.quick else REJOIN_TIMEOUT
            try:
                c.wait_converged(rejoin)
            except AssertionError as exc:
                done = ", ".join("none" if x.took is None else f"{x.took * 1000:.0f} ms"
                                 for x in kills)
                views = {i: [m["state"] for m in (c.health(i) or {}).get("members", [])]
                         for i in range(3)}
                raise BridgeUnusable(
                    f"failover: after kill {n} of {total}, the restarted bridge (host "
                    f"{k.victim}) did not rejoin within {rejoin:.0f} s (member states seen by "
                    f"hosts 0, 1, 2: {views}; failover times measured until then: {done})\n"
                    f"{exc}") from None
            load.stop()
            time.sleep(0.5)
        ps.check()
    took = [k.took for k in kills if k.took is not None]
    # a kill after which some shard of the dead bridge had no successor's apply within
    # FO_TIMEOUT counts as FO_TIMEOUT (in the median and the max alike)
    took_all = [k.took_all if k.took_all is not None else FO_TIMEOUT for k in kills]
    missing = sum(k.took_all is None for k in kills)
    if missing:
        sec.messages.append(f"failover: after {missing} of {len(kills)} kills not every shard "
                            f"of the dead bridge had a successor's apply within "
                            f"{FO_TIMEOUT:.0f} s ({len(kills) - len(took)} without any); "
                            f"each counts as {FO_TIMEOUT:.0f} s")
    if not kills:
        return
    data = dict(kills=len(kills), not_all_failed_over=missing,
                victims=[k.victim for k in kills], shards_owned=[k.owned for k in kills],
                shards_taken=[k.taken for k in kills],
                by_shard=[{sh: (by, round(t, 3)) for sh, (by, t) in k.by_shard.items()}
                          for k in kills],   # shard -> (successor, kill -> apply s)
                other_load=round(load.other_load, 3), steal=round(load.steal, 3))
    noisy = f"[NOISY: other load {load.other_load:.0%}, steal {load.steal:.0%}]"
    shards = f"shards per kill {min(k.owned for k in kills)}-{max(k.owned for k in kills)} (of 32)"
    # the checks' row: a shard is written again only once its successor applies to it
    row = sec.add(Row(key="failover", label="failover: kill -9 of the bridge owning most "
                      "shards -> every shard it owned applied a batch by a successor",
                      procs=1, unit="s", samples=took_all))
    row.note(f"{len(kills) - missing} of {len(kills)} kills failed over entirely (any other "
             f"counts as {FO_TIMEOUT:.0f} s); 3 bridges, replicas 2, --dead-after "
             f"{DEAD_AFTER} s; {shards}; each shard's time is its first apply by a successor "
             "(the worker pushes every shard every ~10 ms); before 2026-11-26 this row was "
             "the first shard's (the next row)")
    row.data.update(data)
    if row.noisy:
        row.note(noisy)
    if not took:
        return
    first = sec.add(Row(key="failover_first", label="failover: kill -9 -> the first of its "
                        "shards applied a batch by a successor", procs=1, unit="s",
                        samples=took))
    first.note(f"{len(took)} of {len(kills)} kills had one; {shards}")
    first.data.update(data)
    if first.noisy:
        first.note(noisy)
    hb_row = sec.add(Row(key="failover_hb", label="failover: the dead owner's last heartbeat -> "
                         "that first apply", procs=1, unit="s",
                         samples=[k.since_hb for k in kills if k.since_hb is not None]))
    hb_row.note("the bridge's own measure (since_last_heartbeat_s, the "
                "shmps_bridge_failover_seconds histogram)")
    hb_row.data.update(other_load=data["other_load"], steal=data["steal"])
    if hb_row.noisy:
        hb_row.note(noisy)
    progress(f"[bridge] failover over {len(kills)} kills: first shard {summary(took)} s, "
             f"every shard {summary(took_all) if took_all else 'never'} s")


# ------------------------------------------------------------------ section

def failover_max() -> Metric:
    """The slowest kill's every-shard failover (a kill not failed over entirely within
    FO_TIMEOUT is a sample of FO_TIMEOUT)."""
    def value(s: Section) -> Optional[float]:
        r = s.row("failover", 1)
        return max(r.samples) if r is not None and r.samples else None
    return Metric([("failover", 1)], value)


def data_of(key: str, procs: int, name: str) -> Metric:
    def value(s: Section) -> Optional[float]:
        r = s.row(key, procs)
        return float(r.data[name]) if r and name in r.data else None
    return Metric([(key, procs)], value)


def add_checks(sec: Section) -> None:
    for n in (1, 2):
        if sec.row("dense_r1", n):
            sec.checks.append(Check(f"forwarded dense push GB/s, replicas 1, {n} worker(s)",
                                    median_of("dense_r1", n), ">=", 1.0, "{:.2f}"))
    for n in (1, 2):
        if sec.row("table_r1", n):
            sec.checks.append(Check(f"forwarded table row payload GB/s, {n} worker(s)",
                                    median_of("table_r1", n), ">=", 0.5, "{:.2f}"))
    if sec.row("rtt", 1):
        sec.checks.append(Check("pulls on the pushing host after flush() that missed the push",
                                data_of("rtt", 1, "stale"), "==", 0, "{:.0f}"))
    if sec.row("failover", 1):
        sec.checks.append(Check("failover, median s", median_of("failover", 1), "<", 0.5,
                                "{:.3f}"))
        sec.checks.append(Check(f"failover, max s (a kill not failed over in {FO_TIMEOUT:.0f} s "
                                f"counts as {FO_TIMEOUT:.0f} s)", failover_max(), "<", 1.0,
                                "{:.3f}"))
        sec.checks.append(Check(f"failover: kills with a shard not applied to by a successor "
                                f"within {FO_TIMEOUT:.0f} s", data_of("failover", 1,
                                                                      "not_all_failed_over"),
                                "==", 0, "{:.0f}"))
    if sec.row("big_copy", 1):
        sec.checks.append(Check("largest event-loop lag while a 192 MiB shard is copied, ms "
                                "(a bridge counts itself stalled from half of --dead-after)",
                                data_of("big_copy", 1, "largest_lag_ms"), "<",
                                1000 * DEAD_AFTER / 2, "{:.0f}"))


def bridge_missing(ctx: RunContext) -> Optional[str]:
    """Why the bridge rows cannot run (None if they can)."""
    if ctx.shmps is None:
        return f"shmps not importable ({ctx.shmps_error})"
    for mod in ("shmps.bridge.node", "shmps.bridge.cli", "prometheus_client"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} does not exist"
    if not (TESTS / "bridge_harness.py").exists():
        return "tests/bridge_harness.py (the cluster launcher) does not exist"
    from shmps.store import Store
    missing = [m for m in ("_set_forwarding", "flush") if not hasattr(Store, m)]
    if missing:
        return ("the store side of the bridge is missing (Store has no "
                + ", ".join(missing) + ")")
    return None


def run(ctx: RunContext, sec: Section) -> None:
    if importlib.util.find_spec("aiohttp") is None:
        sec.messages.append("not available: needs aiohttp (pip install '.[bridge]' or aiohttp)")
        return
    base, plan = plans(ctx)
    sec.messages.append(f"Each figure: the median (min-max) of {plan.reps} windows of "
                        f"{plan.window:.0f} s after a warm-up of {base.warmup:.1f} s "
                        f"(baselines) or {plan.warmup:.1f} s (bridges); failover: one "
                        "sample per kill.")
    baselines(ctx, sec, base)
    why = bridge_missing(ctx)
    if why:
        sec.messages.append(f"bridge rows not measured: {why}")
        return
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    with tempfile.TemporaryDirectory(prefix="bench-bridge-") as tmp:
        for step in (throughput, throughput_r2, many_tensors, big_copy, failover):
            try:
                step(ctx, sec, Path(tmp), plan)
            except (BridgeUnusable, WorkerFailed) as exc:
                progress(f"[bridge] {exc}")
                sec.messages.append(f"bridge misbehaved, no figure: {str(exc).splitlines()[0]}")
    add_checks(sec)
