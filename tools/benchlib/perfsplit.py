"""Where a process spends its CPU, by the code it runs: ``perf record`` sampled over a
measurement, then split by binary (the Python interpreter, the kernel, shmps's C core,
libc's copies and allocation, numpy, the rest).

``bench.py bridge --perf`` notes this split beside each forwarded row, for both
bridges: it says how much of a bridge's time the per-frame Python takes against the
socket (kernel) and the copies, which is what decides whether a change to the data path
can reach the throughput targets (docs/benchmarks.md).

Sample usage::

    rec = PerfRecorder({"bridge A": pid_a}, workdir)
    rec.start()
    ...                                     # the measurement
    split = rec.stop()                      # {"bridge A": Split(...)}, or rec.error
"""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

FREQ_HZ = 499          #: samples a second: little overhead, a few thousand a measurement
STOP_TIMEOUT_S = 30.0  #: perf writes its file after SIGINT; a big one takes a moment

#: (label, pattern of the binary's name as perf reports it), first match wins
GROUPS = [
    ("Python interpreter", re.compile(r"^libpython|^python3?(\.\d+)?$")),
    ("kernel", re.compile(r"^\[kernel")),
    ("shmps C", re.compile(r"^_shmps_native")),
    ("libc (copies, allocation)", re.compile(r"^libc[.-]")),
    ("numpy", re.compile(r"^_multiarray|^_umath|^libopenblas|^libscipy_openblas")),
]
OTHER = "other"
_LINE = re.compile(r"^\s*([\d.]+)%\s+(\S.*?)\s*$")


@dataclass
class Split:
    """Percent of one process's samples in each group (summing to about 100)."""

    samples: int
    percent: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        parts = [f"{name} {pct:.0f}%" for name, pct in
                 sorted(self.percent.items(), key=lambda kv: -kv[1]) if pct >= 0.5]
        return ", ".join(parts) + f" ({self.samples} samples)"


def group_of(dso: str) -> str:
    for label, pattern in GROUPS:
        if pattern.search(dso):
            return label
    return OTHER


def parse_report(text: str) -> dict[str, float]:
    """``perf report --sort dso --stdio --no-children`` output -> percent per group."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m:
            g = group_of(m.group(2))
            out[g] = out.get(g, 0.0) + float(m.group(1))
    return out


def _sample_count(text: str) -> int:
    m = re.search(r"^# Samples: (\d+)(K?)", text, re.M)
    if not m:
        return 0
    return int(m.group(1)) * (1000 if m.group(2) else 1)


class PerfRecorder:
    """``perf record`` of some processes from :meth:`start` to :meth:`stop`;
    :attr:`error` says why there is no split (perf missing, not permitted, the process
    gone)."""

    def __init__(self, pids: dict[str, int], workdir: Path) -> None:
        self.pids = pids
        self.workdir = workdir
        self.perf = shutil.which("perf")
        self.procs: dict[str, tuple[subprocess.Popen, Path]] = {}
        self.error: Optional[str] = (None if self.perf else
                                     "perf is not installed (linux-tools / the perf package)")

    def start(self) -> None:
        if self.perf is None:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        for i, (role, pid) in enumerate(self.pids.items()):
            out = self.workdir / f"perf{i}.data"
            p = subprocess.Popen([self.perf, "record", "-F", str(FREQ_HZ), "-p", str(pid),
                                  "-o", str(out), "--quiet"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            self.procs[role] = (p, out)

    def stop(self) -> dict[str, Split]:
        """Stop recording and split each process's samples; {} (and :attr:`error`) if
        perf could not record (or :meth:`start` was not reached)."""
        if not self.procs and self.error is None:
            self.error = "the measurement ended before recording started"
        for p, _ in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        splits: dict[str, Split] = {}
        for role, (p, out) in self.procs.items():
            try:
                _, err = p.communicate(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                self.error = f"perf record of {role} did not stop within {STOP_TIMEOUT_S:.0f} s"
                continue
            if not out.exists() or out.stat().st_size == 0:
                why = (err or "").strip().splitlines()
                self.error = (f"perf record of {role} wrote nothing"
                              + (f": {why[-1]}" if why else "")
                              + " (perf_event_paranoid, or not permitted here)")
                continue
            assert self.perf is not None
            r = subprocess.run([self.perf, "report", "-i", str(out), "--sort", "dso", "--stdio",
                                "--no-children"], capture_output=True, text=True,
                               timeout=120)
            pct = parse_report(r.stdout)
            if r.returncode != 0 or not pct:
                self.error = f"perf report of {role} failed: {r.stderr.strip()[-200:]}"
                continue
            splits[role] = Split(_sample_count(r.stdout), pct)
        return splits


__all__ = ["GROUPS", "PerfRecorder", "Split", "group_of", "parse_report"]
