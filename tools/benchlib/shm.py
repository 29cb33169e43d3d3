"""Shared numpy arrays for the baselines (multiprocessing.shared_memory), and the C kernel.

The parent creates each segment and unlinks it at the end of the run (registered on
the run's ExitStack, so also on Ctrl-C or error); workers only attach.  Names start
with ``bench_`` so they are never mistaken for a shmps store's segments.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

_counter = 0


@dataclass(frozen=True)
class ShmSpec:
    """How a worker finds a shared array: segment name, shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def create_array(stack: ExitStack, shape: tuple[int, ...], dtype: str) -> tuple[ShmSpec, np.ndarray]:
    """Create a zeroed shared array owned by the parent; unlinked when ``stack`` closes."""
    global _counter
    _counter += 1
    name = f"bench_{os.getpid()}_{_counter}"
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    seg = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    stack.callback(_release, seg)
    arr: np.ndarray = np.ndarray(shape, dtype=dtype, buffer=seg.buf)
    arr[...] = 0
    return ShmSpec(name, tuple(shape), dtype), arr


def _release(seg: shared_memory.SharedMemory) -> None:
    try:
        seg.close()
    except BufferError:  # an array still views it: unlinking is what matters
        pass
    try:
        seg.unlink()
    except FileNotFoundError:
        pass


class Attached:
    """A worker's view of a parent-owned shared array; ``close()`` drops the mapping."""

    def __init__(self, spec: ShmSpec) -> None:
        self._seg = shared_memory.SharedMemory(name=spec.name)
        self.array: np.ndarray = np.ndarray(spec.shape, dtype=spec.dtype, buffer=self._seg.buf)

    def close(self) -> None:
        del self.array
        try:
            self._seg.close()
        except BufferError:  # a torch tensor may still hold the buffer until exit
            pass


def single_threaded_torch() -> Any:
    """Import torch limited to one thread (numpy's BLAS threads are set by the CLI's env)."""
    import torch

    torch.set_num_threads(1)
    return torch


# ---------------------------------------------------------------- C kernels (cffi, API mode)

KERNEL_SOURCE = r"""
#include <stddef.h>
/* w -= lr * g: the fused triad, 12 bytes of memory traffic per element. */
void bench_triad(float *restrict w, const float *restrict g, float lr, size_t n)
{
    for (size_t i = 0; i < n; i++)
        w[i] -= lr * g[i];
}
"""
KERNEL_CDEF = "void bench_triad(float *w, const float *g, float lr, size_t n);"
KERNEL_FLAGS = ["-O3", "-march=native", "-fno-math-errno"]


@dataclass(frozen=True)
class KernelSpec:
    """Where the compiled kernel module lives, so workers can load it."""

    module: str
    path: str


def build_kernels(stack: ExitStack) -> KernelSpec:
    """Compile the C kernels with cffi into a temporary directory removed at the end."""
    import cffi

    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="shmps-bench-cffi-"))
    module = f"_bench_kernels_{os.getpid()}"
    ffi = cffi.FFI()
    ffi.cdef(KERNEL_CDEF)
    ffi.set_source(module, KERNEL_SOURCE, extra_compile_args=KERNEL_FLAGS)
    path = ffi.compile(tmpdir=tmp, verbose=False)
    return KernelSpec(module, str(path))


def load_kernels(spec: KernelSpec) -> Any:
    """Import the compiled module in a worker; returns it (``.ffi``, ``.lib``)."""
    loader = importlib.machinery.ExtensionFileLoader(spec.module, spec.path)
    mod_spec = importlib.util.spec_from_file_location(spec.module, spec.path, loader=loader)
    assert mod_spec is not None
    module = importlib.util.module_from_spec(mod_spec)
    loader.exec_module(module)
    return module
