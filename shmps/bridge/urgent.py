"""One worker thread that runs the most urgent call first: the bridge's snapshot reads.

A bridge reads its shard copies off the event loop, one at a time (node.py,
``_send_snapshot_now``).  Two kinds queue there: copies for backups, which hold up
nothing but that shard's own batches while the read runs, and hand-overs (or a created
tensor's initial values) that a new owner waits for, refusing the shard's batches until
they arrive.  A first-in-first-out pool made a hand-over wait behind every backup copy
queued before it; :class:`UrgentWorker` takes the lowest ``priority`` first, in
submission order among equals.  Its shutdown is ThreadPoolExecutor's with
``cancel_futures=True``: the call under way ends, the queued ones are cancelled.
"""
from __future__ import annotations

import heapq
import itertools
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional

#: priorities of the bridge's snapshot reads: lower runs first
HANDOVER = 0
COPY = 1


class UrgentWorker:
    """A single thread (started at the first submit) running calls by priority."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cv = threading.Condition()
        self._queue: list[tuple[int, int, Future, Callable[..., Any], tuple]] = []
        self._order = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def submit(self, priority: int, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)``; its Future has the result.  RuntimeError once shut down."""
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("cannot submit after shutdown")
            heapq.heappush(self._queue, (priority, next(self._order), fut, fn, args))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name,
                                                daemon=True)
                self._thread.start()
            self._cv.notify()
        return fut

    def shutdown(self) -> None:
        """Cancel the queued calls, wait for the one under way, stop the thread."""
        with self._cv:
            self._closed = True
            queued, self._queue = self._queue, []
            self._cv.notify()
        for item in queued:
            item[2].cancel()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return   # closed, nothing left
                _, _, fut, fn, args = heapq.heappop(self._queue)
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:   # handed to the waiter, as an executor does
                fut.set_exception(exc)
