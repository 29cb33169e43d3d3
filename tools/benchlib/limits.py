"""Memory-bandwidth limits: np.copyto and a fused C triad on private 256 MiB arrays."""
from __future__ import annotations

from typing import Any

import numpy as np

from .context import PROCS, RunContext
from .report import Ref, Section
from .shm import KernelSpec, load_kernels

LIMIT_BYTES = 256 * 2**20
SMOKE_LIMIT_BYTES = 32 * 2**20   # bench.py --smoke: a figure, not a measurement


class CopyLimit:
    """np.copyto between two private 256 MiB arrays; read+write bytes (STREAM convention)."""

    def __init__(self, rank: int, nprocs: int, nbytes: int) -> None:
        n = nbytes // 4
        self.src = np.ones(n, dtype=np.float32)
        self.dst = np.zeros(n, dtype=np.float32)
        self.units = 2.0 * nbytes

    def op(self) -> None:
        np.copyto(self.dst, self.src)


class TriadLimit:
    """C fused ``w -= lr*g`` over private 256 MiB arrays; 12 B per element counted."""

    def __init__(self, rank: int, nprocs: int, nbytes: int, kernels: KernelSpec) -> None:
        n = nbytes // 4
        self.w = np.zeros(n, dtype=np.float32)
        self.g = np.ones(n, dtype=np.float32)
        mod = load_kernels(kernels)
        self._lib = mod.lib
        self._w = mod.ffi.from_buffer("float[]", self.w)
        self._g = mod.ffi.from_buffer("float[]", self.g)
        self.n = n
        self.units = 12.0 * n

    def op(self) -> None:
        self._lib.bench_triad(self._w, self._g, 1e-3, self.n)


def measure_limits(ctx: RunContext, section: Section, when: str) -> None:
    """Measure copy_Np and triad_Np (GB/s) and keep the better of start/end medians."""
    suffix = "" if when == "start" else f" ({when} of run)"
    nbytes = SMOKE_LIMIT_BYTES if ctx.smoke else LIMIT_BYTES
    params: dict[str, Any] = {"nbytes": nbytes}
    for procs in PROCS:
        row, _ = ctx.measure(section, f"copy_{when}",
                             f"np.copyto {nbytes >> 20} MiB (read+write bytes){suffix}", procs, "GB/s", "benchlib.limits:CopyLimit", params, scale=1e-9,
                             limit=Ref("limit:copy", "copy"))
        if row.median:
            ctx.record_limit(f"copy_{procs}p", row.median)
        row, _ = ctx.measure(section, f"triad_{when}", f"triad w-=lr*g, C fused (12 B/elem){suffix}",
                             procs, "GB/s", "benchlib.limits:TriadLimit",
                             {**params, "kernels": ctx.kernels()}, scale=1e-9,
                             limit=Ref("limit:triad", "triad"))
        if row.median:
            ctx.record_limit(f"triad_{procs}p", row.median)


def limits_section() -> Section:
    return Section(
        "limits", "LIMIT: memory bandwidth",
        "Each process owns private 256 MiB float32 arrays (2 processes = 2 independent "
        "streams, rates summed). Copy counts read+write bytes; the fused C triad "
        "(cffi, -O3 -march=native) counts 12 B per element. Pushes are compared with the "
        "triad, pulls with the copy, at the same process count.")

