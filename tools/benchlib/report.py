"""Rows, ratios, checks and their markdown / JSON rendering.

A :class:`Section` collects :class:`Row` figures while it runs; ratios are resolved
only when the report is rendered, so they use the memory limits as finally kept
(start and end of the run: the better median, since other load only lowers a limit).
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

NOISY_FRACTION = 0.10  # other load or steal above this share of the machine marks a row


@dataclass(frozen=True)
class Ref:
    """What a row's median is divided by: a memory limit or another row (same procs).

    ``target`` is ``"limit:<name>"`` (looked up as ``<name>_<procs>p``) or
    ``"row:<key>"``; the reference value is multiplied by ``scale`` first (e.g. the
    triad limit in GB/s of 12 B/elem becomes GB/s of 4 B gradient with ``scale=1/3``).
    """

    target: str
    label: str
    scale: float = 1.0


@dataclass
class Row:
    """One workload at one process count: samples of its rate and what it is compared to."""

    key: str
    label: str
    procs: int
    unit: str
    samples: list[float] = field(default_factory=list)
    limit: Optional[Ref] = None
    baseline: Optional[Ref] = None
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None

    @property
    def median(self) -> Optional[float]:
        return statistics.median(self.samples) if self.samples else None

    def note(self, text: str) -> None:
        self.notes.append(text)

    @property
    def noisy(self) -> bool:
        return (self.data.get("other_load", 0.0) > NOISY_FRACTION
                or self.data.get("steal", 0.0) > NOISY_FRACTION)


@dataclass
class Check:
    """A target from an issue: ``value(section) op threshold``."""

    label: str
    value: "Metric"
    op: str  # ">=", "<", "=="
    threshold: float
    fmt: str = "{:.3f}"

    def evaluate(self, section: "Section") -> tuple[Optional[float], Optional[bool]]:
        v = self.value(section)
        if v is None:
            return None, None
        ok = {">=": v >= self.threshold, "<": v < self.threshold, "==": v == self.threshold}[self.op]
        return v, ok

    def noisy(self, section: "Section") -> bool:
        """Whether a row this check reads was measured under other load."""
        rows = [section.row(k, p) for k, p in self.value.inputs]
        return any(r is not None and r.noisy for r in rows)


@dataclass
class Section:
    """The figures of one subcommand (dense, table, ...)."""

    name: str
    title: str
    intro: str = ""
    rows: list[Row] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    limits: dict[str, float] = field(default_factory=dict)

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row

    def row(self, key: str, procs: int) -> Optional[Row]:
        for r in self.rows:
            if r.key == key and r.procs == procs and r.error is None:
                return r
        return None

    def median(self, key: str, procs: int) -> Optional[float]:
        r = self.row(key, procs)
        return r.median if r else None

    def ref_value(self, ref: Ref, procs: int) -> Optional[float]:
        kind, _, name = ref.target.partition(":")
        if kind == "limit":
            v = self.limits.get(f"{name}_{procs}p")
        else:
            v = self.median(name, procs)
        return None if v is None else v * ref.scale

    def ratio(self, row: Row, ref: Optional[Ref]) -> Optional[float]:
        if ref is None or row.median is None:
            return None
        base = self.ref_value(ref, row.procs)
        return row.median / base if base else None

    def quotient(self, key: str, ref_key: str, procs: int) -> Optional[float]:
        """median(key) / median(ref_key) at ``procs`` processes, or None if either is missing."""
        a, b = self.median(key, procs), self.median(ref_key, procs)
        return a / b if a is not None and b else None


Inputs = list[tuple[str, int]]


class Metric:
    """A check's value, computed from rows of a section; ``inputs`` names those rows."""

    def __init__(self, inputs: Inputs, compute: Callable[[Section], Optional[float]]) -> None:
        self.inputs = inputs
        self._compute = compute

    def __call__(self, section: Section) -> Optional[float]:
        return self._compute(section)


def quotient_of(key: str, ref_key: str, procs: int) -> Metric:
    """median(key) / median(ref_key) at ``procs`` processes."""
    return Metric([(key, procs), (ref_key, procs)], lambda s: s.quotient(key, ref_key, procs))


def median_of(key: str, procs: int) -> Metric:
    """A row's median."""
    return Metric([(key, procs)], lambda s: s.median(key, procs))


def data_sum_of(key: str, procs: int, *fields: str) -> Metric:
    """The sum of a row's ``data`` fields (e.g. lost updates), None if absent."""
    def value(section: Section) -> Optional[float]:
        row = section.row(key, procs)
        if row is None or any(f not in row.data for f in fields):
            return None
        return float(sum(row.data[f] for f in fields))
    return Metric([(key, procs)], value)


# ---------------------------------------------------------------- number formatting

def fmt_num(x: Optional[float]) -> str:
    """3 significant digits, or k/M/G suffixes with 1-2 decimals, like BASELINES.md."""
    if x is None:
        return "-"
    ax = abs(x)
    if ax >= 1e9:
        return f"{x / 1e9:.2f}G"
    if ax >= 1e6:
        return f"{x / 1e6:.2f}M"
    if ax >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.3g}"


def fmt_ratio(x: Optional[float], label: str) -> str:
    return "-" if x is None else f"{x:.3f} ({label})"


# ---------------------------------------------------------------- rendering

TABLE_HEAD = (
    "| workload | procs | median | min-max | unit | vs limit | vs baseline | notes |\n"
    "|---|---:|---:|---|---|---|---|---|"
)


def render_row(section: Section, row: Row) -> str:
    if row.error is not None:
        return f"| {row.label} | {row.procs} | - | - | {row.unit} | - | - | {row.error} |"
    lim = fmt_ratio(section.ratio(row, row.limit), row.limit.label) if row.limit else "-"
    base = fmt_ratio(section.ratio(row, row.baseline), row.baseline.label) if row.baseline else "-"
    lo, hi = min(row.samples), max(row.samples)
    notes = "; ".join(row.notes)
    return (f"| {row.label} | {row.procs} | {fmt_num(row.median)} | {fmt_num(lo)}-{fmt_num(hi)} "
            f"| {row.unit} | {lim} | {base} | {notes} |")


def render_checks(section: Section) -> list[str]:
    if not section.checks:
        return []
    out = ["", "Targets:", "", "| check | value | target | verdict |", "|---|---:|---|---|"]
    for c in section.checks:
        v, ok = c.evaluate(section)
        shown = "-" if v is None else c.fmt.format(v)
        verdict = "not measured" if ok is None else ("met" if ok else "MISSED")
        if ok is not None and c.noisy(section):
            verdict += " (an input row is NOISY)"
        out.append(f"| {c.label} | {shown} | {c.op} {c.fmt.format(c.threshold)} | {verdict} |")
    return out


def render_section(section: Section) -> str:
    out = [f"## {section.title}", ""]
    if section.intro:
        out += [section.intro, ""]
    for m in section.messages:
        out += [m, ""]
    if section.rows:
        out.append(TABLE_HEAD)
        out += [render_row(section, r) for r in section.rows]
    out += render_checks(section)
    return "\n".join(out) + "\n"


def render_limits(limits: dict[str, float], history: dict[str, list[float]]) -> str:
    out = ["## Memory-bandwidth limits measured in this run", "",
           "| limit | value | measured |", "|---|---:|---|"]
    for name, value in limits.items():
        seen = ", ".join(f"{v:.1f}" for v in history.get(name, []))
        out.append(f"| {name} | {value:.1f} GB/s | {seen} (the better median is kept) |")
    return "\n".join(out) + "\n"


def section_json(section: Section) -> dict[str, Any]:
    rows = []
    for r in section.rows:
        rows.append({
            "key": r.key, "label": r.label, "procs": r.procs, "unit": r.unit,
            "median": r.median, "min": min(r.samples) if r.samples else None,
            "max": max(r.samples) if r.samples else None, "samples": r.samples,
            "ratio_limit": section.ratio(r, r.limit), "limit": r.limit.label if r.limit else None,
            "ratio_baseline": section.ratio(r, r.baseline),
            "baseline": r.baseline.label if r.baseline else None,
            "notes": r.notes, "data": r.data, "error": r.error,
        })
    checks = []
    for c in section.checks:
        v, ok = c.evaluate(section)
        checks.append({"label": c.label, "value": v, "op": c.op, "threshold": c.threshold, "met": ok,
                       "noisy": c.noisy(section)})
    return {"title": section.title, "rows": rows, "checks": checks, "messages": section.messages}


# ---------------------------------------------------------------- machine description

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def _shm_huge() -> str:
    """The ``huge=`` option of /dev/shm's mount (transparent huge pages for shared memory:
    shmps segments ask for them, docs/deployment.md); "never" when it has none."""
    found = "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            f = line.split()
            if len(f) > 3 and f[1] == "/dev/shm":   # the last one is the mount in use
                huge = [o.split("=", 1)[1] for o in f[3].split(",") if o.startswith("huge=")]
                found = huge[-1] if huge else "never"
    except OSError:
        pass
    return found


def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except Exception as exc:  # noqa: BLE001 - any import failure is reported, not raised
        return f"not importable ({type(exc).__name__})"
    return str(getattr(mod, "__version__", "?"))


def _git_rev(repo: Path) -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, text=True,
                             capture_output=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               text=True, capture_output=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{rev}{' (dirty)' if dirty else ''}" if rev else "unknown"


def machine_info(repo: Path, shmps_status: str) -> dict[str, Any]:
    """CPU, cores, memory, OS, versions and date, for the top of the report."""
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": _cpu_model(), "cores": os.cpu_count(), "mem_gib": round(_mem_gib(), 1),
        "shm_huge": _shm_huge(),
        "platform": platform.platform(), "python": sys.version.split()[0],
        "numpy": _version("numpy"), "cffi": _version("cffi"), "torch": _version("torch"),
        "shmps": shmps_status, "repo": _git_rev(repo),
    }


def render_machine(info: dict[str, Any]) -> str:
    return (
        f"# shmps benchmark, {info['date']}\n\n"
        f"Machine: {info['cpu']} x {info['cores']} cores, {info['mem_gib']} GiB, {info['platform']}, "
        f"/dev/shm huge pages: {info.get('shm_huge', 'unknown')}; "
        f"Python {info['python']}, numpy {info['numpy']}, cffi {info['cffi']}, torch {info['torch']}; "
        f"shmps {info['shmps']}; repo {info['repo']}.\n"
    )
