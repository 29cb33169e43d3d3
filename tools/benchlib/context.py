"""What every section of a run shares: timing, cleanup stack, limits, shmps, ``measure()``."""
from __future__ import annotations

import os
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator, Optional

from .harness import GroupResult, Quiet, Timing, WorkloadError, progress, run_group, summary
from .report import NOISY_FRACTION, Ref, Row, Section
from .shm import KernelSpec, build_kernels

PROCS = (1, 2)


@dataclass
class RunContext:
    """State of one ``bench.py`` run; ``stack`` undoes everything the run created."""

    timing: Timing
    quick: bool
    stack: ExitStack
    workdir: Optional[Path] = None
    perf: bool = False   #: bench.py --perf (the bridge section samples its bridges)
    smoke: bool = False  #: bench.py --smoke (quick, and fewer samples where a section counts them)
    shmps: Optional[ModuleType] = None
    shmps_error: str = ""
    limits: dict[str, float] = field(default_factory=dict)
    limit_history: dict[str, list[float]] = field(default_factory=dict)
    quiet: Quiet = field(init=False)
    _kernels: Optional[KernelSpec] = None
    _names: int = 0

    def __post_init__(self) -> None:
        self.quiet = Quiet(self.timing)

    def kernels(self) -> KernelSpec:
        """The C kernels, compiled on first use."""
        if self._kernels is None:
            t0 = time.perf_counter()
            self._kernels = build_kernels(self.stack)
            progress(f"compiled C kernels in {time.perf_counter() - t0:.1f} s")
        return self._kernels

    def store_name(self, tag: str) -> str:
        """A store name unique to this run (pid) and call."""
        self._names += 1
        return f"bench{os.getpid()}{tag}{self._names}"

    @contextmanager
    def temp_store(self, tag: str) -> Iterator[tuple[str, Any]]:
        """A fresh shmps store, destroyed on leaving the block (also on error or Ctrl-C)."""
        assert self.shmps is not None
        name = self.store_name(tag)
        store = self.shmps.attach(name)
        try:
            yield name, store
        finally:
            _destroy_quietly(store)

    def record_limit(self, name: str, value: float) -> None:
        """Keep the better of the limit's medians (other load only lowers a limit)."""
        self.limit_history.setdefault(name, []).append(value)
        self.limits[name] = max(value, self.limits.get(name, 0.0))

    def measure(self, section: Section, key: str, label: str, procs: int, unit: str,
                target: str, params: dict[str, Any], *, scale: float = 1.0,
                limit: Optional[Ref] = None, baseline: Optional[Ref] = None,
                timing: Optional[Timing] = None) -> tuple[Row, Optional[GroupResult]]:
        """Run one workload at ``procs`` processes and add its row to ``section``.

        ``scale`` converts the workers' units/s into the row's unit (e.g. 1e-9 for GB/s).
        A failing workload becomes a row carrying its error; the run goes on.
        """
        row = section.add(Row(key=key, label=label, procs=procs, unit=unit, limit=limit,
                              baseline=baseline))
        self.quiet.wait()
        t0 = time.perf_counter()
        try:
            res = run_group(target, params, procs, timing or self.timing)
        except WorkloadError as exc:
            row.error = f"error: {exc}"
            progress(f"[{section.name}] {label} {procs}p: {row.error}")
            return row, None
        row.samples = [r * scale for r in res.rates]
        row.data["cores"] = round(res.cores, 2)
        row.data["other_load"] = round(res.other_load, 3)
        row.data["steal"] = round(res.steal, 3)
        noisy = res.noise_note(NOISY_FRACTION)
        if noisy:
            row.note(noisy)
        progress(f"[{section.name}] {label} {procs}p: {summary(row.samples)} {unit} "
                 f"({time.perf_counter() - t0:.1f} s, {res.cores:.2f} cores)")
        return row, res


def _destroy_quietly(store: Any) -> None:
    try:
        store.destroy()
    except Exception as exc:  # noqa: BLE001 - cleanup must not mask the run's own error
        progress(f"warning: could not destroy store: {type(exc).__name__}: {exc}")


def import_shmps() -> tuple[Optional[ModuleType], str]:
    """Import shmps; return (module, "") or (None, "<error>")."""
    try:
        import shmps

        shmps.attach  # noqa: B018 - the store API, not just the package skeleton
    except Exception as exc:  # noqa: BLE001 - any failure means "not importable"
        return None, f"{type(exc).__name__}: {exc}"
    return shmps, ""
