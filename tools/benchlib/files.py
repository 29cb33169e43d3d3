"""``bench.py files`` (issue 4): write/read GB/s of a 1 GiB checkpoint beside np.save/np.load/cp.

Everything is written under one temporary directory (``--dir``, default /tmp), so the
baselines and the checkpoint use the same disk.  Writes include fsync (a checkpoint
fsyncs before its rename); each timed operation is one whole 1 GiB write or read, in a
freshly spawned process.  Reads are timed twice: straight after writing (page cache
warm) and "cold", after ``posix_fadvise(DONTNEED)`` has dropped the files' clean pages
(no root needed, nothing else on the machine is affected).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .context import RunContext
from .harness import Timing
from .report import Ref, Section
from .tensors import DenseSpec, OptimizerSpec, close_quietly

FILE_SHAPE = (262144, 1024)           # 256 Mi float32 = 1 GiB
FILE_BYTES = 4 * FILE_SHAPE[0] * FILE_SHAPE[1]
FREE_NEEDED = 5 * FILE_BYTES          # npy, its cp copy, a checkpoint and its temporary


def pattern() -> np.ndarray:
    """1 GiB of non-trivial float32 values (nothing a filesystem could skip as zeros)."""
    return np.arange(FILE_SHAPE[0] * FILE_SHAPE[1], dtype=np.float32).reshape(FILE_SHAPE)


def drop_cache(path: Path) -> None:
    """Drop ``path``'s pages (every file under it) from the page cache: fsync, then DONTNEED."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


# ---------------------------------------------------------------- workloads (one op = 1 GiB)

class NpSave:
    """``np.save`` of 1 GiB, then fsync."""

    def __init__(self, rank: int, nprocs: int, path: str) -> None:
        self.path = Path(path)
        self.a = pattern()
        self.units = FILE_BYTES

    def prepare(self) -> None:
        remove(self.path)

    def op(self) -> None:
        with open(self.path, "wb") as f:
            np.save(f, self.a)
            f.flush()
            os.fsync(f.fileno())


class NpLoad:
    """``np.load`` of the 1 GiB .npy into a new array."""

    def __init__(self, rank: int, nprocs: int, path: str, cold: bool) -> None:
        self.path = Path(path)
        self.cold = cold
        self.units = FILE_BYTES

    def prepare(self) -> None:
        if self.cold:
            drop_cache(self.path)

    def op(self) -> None:
        np.load(self.path)


class Cp:
    """``cp`` (subprocess) of the 1 GiB .npy, then fsync of the copy."""

    def __init__(self, rank: int, nprocs: int, src: str, dst: str) -> None:
        self.src, self.dst = Path(src), Path(dst)
        self.units = FILE_BYTES

    def prepare(self) -> None:
        remove(self.dst)

    def op(self) -> None:
        subprocess.run(["cp", str(self.src), str(self.dst)], check=True)
        fsync_file(self.dst)


class Checkpoint:
    """shmps ``store.checkpoint(path)`` of a store holding one 1 GiB dense tensor."""

    def __init__(self, rank: int, nprocs: int, spec: DenseSpec, path: str) -> None:
        import shmps

        self.store, _ = spec.open(shmps)
        self.path = Path(path)
        self.units = FILE_BYTES

    def prepare(self) -> None:
        remove(self.path)

    def op(self) -> None:
        self.store.checkpoint(str(self.path))

    def close(self) -> None:
        close_quietly(self.store)


class Restore:
    """``shmps.restore(path, name)`` into a new store (destroyed, untimed, before the next)."""

    def __init__(self, rank: int, nprocs: int, path: str, prefix: str, cold: bool) -> None:
        import shmps

        self.shmps = shmps
        self.path = Path(path)
        self.prefix = prefix
        self.cold = cold
        self.count = 0
        self.restored: Optional[Any] = None
        self.units = FILE_BYTES

    def prepare(self) -> None:
        self._destroy()
        if self.cold:
            drop_cache(self.path)

    def op(self) -> None:
        self.count += 1
        self.restored = self.shmps.restore(str(self.path), f"{self.prefix}{self.count}")

    def _destroy(self) -> None:
        if self.restored is not None:
            self.restored.destroy()
            self.restored = None

    def close(self) -> None:
        self._destroy()


# ---------------------------------------------------------------- the section

def section() -> Section:
    return Section(
        "files", "FILES: 1 GiB checkpoint write and read",
        f"One float32 tensor of {FILE_SHAPE[0]}x{FILE_SHAPE[1]} (1 GiB). GB/s = 1e9 bytes of "
        "tensor data per second. Writes include fsync; 'cold' reads first drop the files' "
        "pages with posix_fadvise(DONTNEED). Each repetition is one whole operation in a "
        "freshly spawned process. 'other load' here includes the kernel's writeback threads, "
        "so NOISY notes on writes are expected.")


def file_timing(ctx: RunContext) -> Timing:
    """One timed 1 GiB operation per repetition."""
    reps = 2 if ctx.quick else 3
    return dataclasses.replace(ctx.timing, window=0.0, min_ops=1, warmup=0 if ctx.quick else 1,
                               reps=reps)


def make_dir(ctx: RunContext) -> Path:
    """A new directory under --dir (default /tmp), removed at the end of the run."""
    base = ctx.workdir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="shmps-bench-files-", dir=base))
    ctx.stack.callback(shutil.rmtree, d, ignore_errors=True)
    return d


def run(ctx: RunContext, sec: Section) -> None:
    """np.save / cp / np.load, then shmps checkpoint / restore, in one directory."""
    d = make_dir(ctx)
    free = shutil.disk_usage(d).free
    if free < FREE_NEEDED:
        sec.messages.append(f"skipped: {d} has {free / 2**30:.1f} GiB free, "
                            f"{FREE_NEEDED / 2**30:.0f} GiB needed (use --dir)")
        return
    sec.messages.append(f"Directory: {d} ({_filesystem(d)}).")
    timing = file_timing(ctx)
    npy = d / "w.npy"

    def gbs(key: str, label: str, target: str, params: dict[str, Any],
            baseline: Optional[Ref] = None) -> None:
        ctx.measure(sec, key, label, 1, "GB/s", f"benchlib.files:{target}", params, scale=1e-9,
                    baseline=baseline, timing=timing)

    gbs("np_save", "write np.save(f, a) + fsync", "NpSave", {"path": str(npy)})
    gbs("cp", "write cp w.npy copy.npy (subprocess) + fsync", "Cp",
        {"src": str(npy), "dst": str(d / "copy.npy")}, Ref("row:np_save", "np.save"))
    gbs("np_load", "read np.load (page cache)", "NpLoad", {"path": str(npy), "cold": False})
    gbs("np_load_cold", "read np.load (cold)", "NpLoad", {"path": str(npy), "cold": True})
    remove(d / "copy.npy")
    if not _shmps_has_checkpoints(ctx, sec):
        return
    with ctx.temp_store("f") as (name, store):
        spec = DenseSpec(name, "w", FILE_SHAPE, OptimizerSpec("Sum"))
        _, t = spec.open(ctx.shmps, store)
        t.push(pattern())
        ckpt = d / "ckpt"
        gbs("shmps_checkpoint", "write shmps store.checkpoint(path)", "Checkpoint",
            {"spec": spec, "path": str(ckpt)}, Ref("row:np_save", "np.save"))
        if not ckpt.exists():
            return
        size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
        sec.messages.append(f"Checkpoint on disk: {size / 2**30:.3f} GiB in "
                            f"{sum(1 for p in ckpt.rglob('*') if p.is_file())} files.")
        for cold in (False, True):
            prefix = ctx.store_name("r")
            try:
                gbs(f"shmps_restore{'_cold' if cold else ''}",
                    f"read shmps.restore(path, name) ({'cold' if cold else 'page cache'})", "Restore",
                    {"path": str(ckpt), "prefix": prefix, "cold": cold},
                    Ref(f"row:np_load{'_cold' if cold else ''}", "np.load"))
            finally:
                _destroy_leftovers(ctx, prefix, timing.warmup + timing.reps + 1)


def _shmps_has_checkpoints(ctx: RunContext, sec: Section) -> bool:
    if ctx.shmps is None:
        sec.messages.append(f"shmps: not importable ({ctx.shmps_error})")
        return False
    missing = [] if hasattr(ctx.shmps, "restore") else ["shmps.restore"]
    if not hasattr(getattr(ctx.shmps, "Store", None), "checkpoint"):
        missing.insert(0, "Store.checkpoint")
    if missing:
        sec.messages.append(f"shmps: checkpoints not available yet (missing {', '.join(missing)})")
        return False
    return True


def _destroy_leftovers(ctx: RunContext, prefix: str, count: int) -> None:
    """Restored stores a worker could not destroy (it failed or was killed)."""
    assert ctx.shmps is not None
    for i in range(1, count + 1):
        try:
            ctx.shmps.attach(f"{prefix}{i}", create=False).destroy()
        except Exception:  # noqa: BLE001 - not there is the normal case
            pass


def _filesystem(path: Path) -> str:
    try:
        out = subprocess.run(["df", "--output=source,fstype", str(path)], capture_output=True,
                             text=True, timeout=5).stdout.split("\n")[1].split()
        return f"{out[0]}, {out[1]}"
    except (OSError, subprocess.SubprocessError, IndexError):
        return "filesystem unknown"
