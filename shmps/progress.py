"""Progress bars of long operations (checkpoint, restore; file sets' checks and writes,
shmps-tool convert and dump's summary, from files.PROGRESS_MIN_BYTES): tqdm on a
terminal, nothing otherwise.

tqdm's own lock is a multiprocessing lock (a POSIX semaphore) shared by every process
forked after the first bar, taken by every bar's creation and close and by its monitor
thread: a process SIGKILLed while holding it (inside its own bar, or checkpoint()'s)
left every other process of the family blocked for ever in its next checkpoint() or
restore() (test_a_process_killed_inside_a_progress_bar_blocks_no_checkpoint).  So the
bar here is a tqdm with a lock of this process only, renewed in a forked child (the
parent's may have been held by another thread at the fork), and no monitor thread (it
takes the lock too)."""
from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any


class _NoBar:
    """The progress bar when none is shown (stderr not a terminal, or too little work)."""

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def update(self, n: int = 1) -> None:
        return None

    def close(self) -> None:
        return None


_BAR_CLASS: Any = None


def _bar_class() -> Any:
    """tqdm with a lock of this process only and no monitor thread (module docstring)."""
    global _BAR_CLASS
    if _BAR_CLASS is None:
        from tqdm import tqdm

        class Bar(tqdm):  # type: ignore[misc]
            _lock = threading.RLock()
            _instances: Any = weakref.WeakSet()
            monitor_interval = 0

        def fresh_lock() -> None:
            Bar._lock = threading.RLock()

        os.register_at_fork(after_in_child=fresh_lock)
        _BAR_CLASS = Bar
    return _BAR_CLASS


def bar(total: int, desc: str, min_total: int = 0, divisor: int = 1000) -> Any:
    """A bar of ``total`` bytes named ``desc`` on stderr if it is a terminal and
    ``total`` is at least ``min_total``; else one that shows nothing.  ``update(n)``,
    ``close()``, and a context manager."""
    if not sys.stderr.isatty() or total < min_total:
        return _NoBar()
    return _bar_class()(total=total, unit="B", unit_scale=True, unit_divisor=divisor,
                        desc=desc, file=sys.stderr, leave=False)
