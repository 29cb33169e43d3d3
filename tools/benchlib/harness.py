"""Run one workload in freshly spawned processes and time it, BASELINES.md's way.

Each of N spawned processes builds the workload (attaching shared memory, allocating
its private buffers), then repeats: barrier, run the operation until ``window``
seconds have passed (at least ``min_ops`` times), report its own rate.  The parent is a
party of the barrier, so it samples /proc/stat exactly around the measured windows and
can tell how much CPU other processes took meanwhile.  A group's rate for one
repetition is the sum of each process's own rate over its own window.

A workload is a class named ``"module:Class"`` constructed in the child as
``Class(rank=, nprocs=, **params)``; it has ``units`` (units of work per ``op()``),
``op()``, ``finish() -> dict`` (called once after the last repetition, while the other
processes are done too) and ``close()``.  ``prepare()``, if present, runs untimed
before each operation of a single-shot workload (``window == 0``).
"""
from __future__ import annotations

import ctypes
import importlib
import multiprocessing as mp
import os
import queue as _queue
import signal
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .report import fmt_num

BARRIER_TIMEOUT = 900.0   # a single repetition of the slowest workload (1 GiB checkpoint)
SETUP_TIMEOUT = 300.0     # spawn + import + allocate
JOIN_TIMEOUT = 30.0
QUIET_BUSY = 0.15         # start a workload once other load is below this share


class WorkloadError(RuntimeError):
    """A worker failed to build or run its workload; the message is the worker's error."""


@dataclass(frozen=True)
class Timing:
    """How long and how often each workload is timed."""

    window: float = 0.4
    min_ops: int = 3
    max_ops: int = 10_000_000
    warmup: int = 1
    reps: int = 5
    quiet_wait: float = 8.0      # wait at most this long per workload for other load to drop
    quiet_budget: float = 240.0  # and at most this long over the whole run


@dataclass
class GroupResult:
    """Rates of the measured repetitions (summed over processes) and what the workers reported."""

    rates: list[float]
    ops: list[int]                       # per rank, every repetition including warm-up
    extras: list[dict[str, Any]]         # per rank, from finish()
    other_load: float = 0.0              # share of the machine used by other processes
    steal: float = 0.0                   # hypervisor steal share
    cores: float = 0.0                   # CPU cores the workers used while measured

    def noise_note(self, threshold: float) -> Optional[str]:
        if self.other_load > threshold or self.steal > threshold:
            return f"[NOISY: other load {self.other_load:.0%}, steal {self.steal:.0%}]"
        return None


# ---------------------------------------------------------------- CPU accounting

@dataclass(frozen=True)
class CpuSample:
    busy: float   # seconds of non-idle, non-steal CPU, all CPUs
    steal: float
    total: float  # seconds of all CPU time, all CPUs
    own: float    # this (parent) process's CPU seconds


def cpu_sample() -> CpuSample:
    """Read the machine-wide counters of /proc/stat (zeros if unreadable)."""
    hz = os.sysconf("SC_CLK_TCK")
    own = time.process_time()
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return CpuSample(0.0, 0.0, 0.0, own)
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    busy = user + nice + system + irq + softirq
    return CpuSample(busy / hz, steal / hz, sum(fields) / hz, own)


class Quiet:
    """Waits for other load to drop before a workload, within a per-run budget."""

    def __init__(self, timing: Timing) -> None:
        self.timing = timing
        self.waited = 0.0

    def wait(self) -> None:
        limit = min(self.timing.quiet_wait, self.timing.quiet_budget - self.waited)
        start = time.perf_counter()
        while time.perf_counter() - start < limit:
            a = cpu_sample()
            time.sleep(0.2)
            b = cpu_sample()
            if b.total <= a.total or (b.busy - a.busy) / (b.total - a.total) < QUIET_BUSY:
                break
        self.waited += time.perf_counter() - start


# ---------------------------------------------------------------- child side

def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this worker if the parent dies (best effort)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _load(target: str) -> Any:
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def _describe(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" at {Path(last[0].filename).name}:{last[0].lineno}" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _cpu_seconds() -> float:
    """CPU time of this process, all its threads, and its finished subprocesses (cp)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _timed_window(wl: Any, timing: Timing) -> tuple[int, float, float]:
    """Run ``wl.op`` for one repetition; return (ops, seconds, CPU seconds)."""
    if timing.window <= 0:  # single shot: untimed preparation, one timed op
        if hasattr(wl, "prepare"):
            wl.prepare()
        c0 = _cpu_seconds()
        t0 = time.perf_counter()
        wl.op()
        return 1, time.perf_counter() - t0, _cpu_seconds() - c0
    c0 = _cpu_seconds()
    n = 0
    t0 = time.perf_counter()
    while True:
        wl.op()
        n += 1
        elapsed = time.perf_counter() - t0
        if (elapsed >= timing.window and n >= timing.min_ops) or n >= timing.max_ops:
            return n, elapsed, _cpu_seconds() - c0


def _child_main(target: str, params: dict[str, Any], rank: int, nprocs: int, timing: Timing,
                barrier: Any, results: Any) -> None:
    """Worker entry point: build the workload, time it ``warmup + reps`` times, report."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    _die_with_parent()
    wl = None
    try:
        wl = _load(target)(rank=rank, nprocs=nprocs, **params)
        results.put(("ready", rank, float(wl.units)))
        total = 0
        for _ in range(timing.warmup + timing.reps):
            barrier.wait(BARRIER_TIMEOUT)
            n, elapsed, cpu = _timed_window(wl, timing)
            total += n
            results.put(("rep", rank, (n * wl.units / elapsed, cpu, elapsed)))
        barrier.wait(BARRIER_TIMEOUT)
        extra = wl.finish() if hasattr(wl, "finish") else {}
        results.put(("done", rank, {"ops": total, **extra}))
    except threading.BrokenBarrierError:
        pass  # the parent gave up on this group
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        results.put(("error", rank, _describe(exc)))
        barrier.abort()
    finally:
        if wl is not None and hasattr(wl, "close"):
            try:
                wl.close()
            except Exception:  # noqa: BLE001 - closing is best effort on the way out
                pass


# ---------------------------------------------------------------- parent side

@dataclass
class _Group:
    procs: list[Any]
    barrier: Any
    results: Any
    finished: threading.Event = field(default_factory=threading.Event)

    def watch(self) -> None:
        """Break the barrier if a worker dies unexpectedly (crash, OOM kill)."""
        while not self.finished.wait(0.1):
            if any(p.exitcode not in (None, 0) for p in self.procs):
                self.barrier.abort()
                return

    def collect(self, kind: str, count: int, timeout: float) -> list[Any]:
        """Wait for ``count`` messages of ``kind`` (ordered by rank); raise on a worker error."""
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < count:
            try:
                msg, rank, payload = self.results.get(timeout=0.2)
            except _queue.Empty:
                self._check_alive(kind)
                if time.monotonic() > deadline:
                    raise WorkloadError(f"timed out after {timeout:.0f} s waiting for '{kind}'")
                continue
            if msg == "error":
                raise WorkloadError(payload)
            if msg == kind:
                got[rank] = payload
        return [got[r] for r in sorted(got)]

    def _check_alive(self, kind: str) -> None:
        for p in self.procs:
            if p.exitcode not in (None, 0):
                try:  # a last error message may still be in flight
                    msg, _, payload = self.results.get(timeout=0.5)
                    if msg == "error":
                        raise WorkloadError(payload)
                except _queue.Empty:
                    pass
                raise WorkloadError(f"worker exited with code {p.exitcode} while waiting for '{kind}'")

    def sync(self) -> None:
        try:
            self.barrier.wait(BARRIER_TIMEOUT)
        except threading.BrokenBarrierError:
            self._raise_worker_error()

    def _raise_worker_error(self) -> None:
        """The barrier broke: report the worker's own error if it sent one."""
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            try:
                msg, rank, payload = self.results.get(timeout=0.2)
            except _queue.Empty:
                continue
            if msg == "error":
                raise WorkloadError(payload)
        codes = [p.exitcode for p in self.procs]
        raise WorkloadError(f"a worker broke the barrier (exit codes {codes})")

    def reap(self) -> None:
        """Join the workers; terminate, then kill, any that do not exit."""
        self.finished.set()
        try:
            deadline = time.monotonic() + JOIN_TIMEOUT
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        finally:
            for p in self.procs:
                stop_process(p)
            self.results.close()


def stop_process(p: Any) -> None:
    """Terminate, then kill, a multiprocessing process that is still alive."""
    if p.is_alive():
        p.terminate()
        p.join(5)
    if p.is_alive():
        p.kill()
        p.join(5)


def run_group(target: str, params: dict[str, Any], nprocs: int, timing: Timing) -> GroupResult:
    """Time workload ``target`` in ``nprocs`` freshly spawned processes."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(nprocs + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=_child_main, name=f"bench-{target}-{r}", daemon=True,
                         args=(target, params, r, nprocs, timing, barrier, results))
             for r in range(nprocs)]
    group = _Group(procs, barrier, results)
    try:
        for p in procs:
            p.start()
        threading.Thread(target=group.watch, daemon=True).start()
        group.collect("ready", nprocs, SETUP_TIMEOUT)
        rates: list[float] = []
        busy = steal = total = worker_cpu = own = wall = 0.0
        for rep in range(timing.warmup + timing.reps):
            group.sync()
            a = cpu_sample()
            t0 = time.perf_counter()
            reports = group.collect("rep", nprocs, BARRIER_TIMEOUT)
            b = cpu_sample()
            if rep < timing.warmup:
                continue
            rates.append(sum(r[0] for r in reports))
            busy += b.busy - a.busy
            steal += b.steal - a.steal
            total += b.total - a.total
            own += b.own - a.own
            worker_cpu += sum(r[1] for r in reports)
            wall += time.perf_counter() - t0
        group.sync()
        done = group.collect("done", nprocs, BARRIER_TIMEOUT)
        group.finished.set()
        other = max(0.0, busy - worker_cpu - own) / total if total > 0 else 0.0
        return GroupResult(rates=rates, ops=[d.pop("ops") for d in done], extras=done,
                           other_load=other, steal=steal / total if total > 0 else 0.0,
                           cores=worker_cpu / wall if wall > 0 else 0.0)
    except BaseException:
        barrier.abort()
        raise
    finally:
        group.reap()


def summary(rates: list[float]) -> str:
    """'median (min-max)' for progress lines."""
    if not rates:
        return "-"
    return f"{fmt_num(statistics.median(rates))} ({fmt_num(min(rates))}-{fmt_num(max(rates))})"


def progress(text: str) -> None:
    """One progress line on stderr (the report itself goes to stdout at the end)."""
    print(text, file=sys.stderr, flush=True)
