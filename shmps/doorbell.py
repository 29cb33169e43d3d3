"""The flush doorbell: how ``store.flush()`` wakes the store's bridge at once.

A flush asks the bridge to drain the outboxes now rather than at its next ``--flush-ms``
interval.  The bridge listens on a Unix datagram socket in the abstract namespace (no
file: nothing to clean up after a SIGKILL), named after the store's segment prefix, and
its event loop reads it directly: a worker's ``sendto`` wakes the loop.  The older way,
kept as the fallback, is a futex word in the manifest (``flush_req``), which a thread of
the bridge sleeps on and forwards to the loop (``loop.call_soon_threadsafe``): two
wake-ups and a hand-over of the GIL per flush.  Measured in the bench's table round on a
slow day (3 alternated pairs of 300 rounds), from the flush request to the start of the
bridge's drain: 316 / 338 / 380 us median and 1.7-1.9 ms at the 90th percentile through
the thread (its hop to the loop alone 0.1 ms median), 263 / 337 / 291 us and 0.5-0.7 ms
with the doorbell (docs/benchmarks.md).

The worker rings the doorbell; if no bridge listens on it (none runs, an older build,
or the bridge is in another network namespace: abstract sockets are per network
namespace) it bumps the futex word instead.  A push rings it too, with a different
datagram, when it is the first after the bridge went to sleep with nothing to do
(native/outbox.c "Sleeping until a push"); where nobody listens, that push bumps the
manifest's ``fwd_wakes`` and wakes the same futex without bumping ``flush_req``.  A
table push that finds its outbox full rings as a flush does before each new attempt
(shmps/outbox.py, _ask_drain: the bridge's pass then scans every outbox shard).  A
full socket buffer means the bridge has unread rings, so the wake is on its way.

Anyone in the host's network namespace can ring (abstract sockets have no file
permissions): a ring only makes the bridge look at its outboxes now (one C call when
they are empty), and the bridge reads every waiting datagram with one wake-up.
"""
from __future__ import annotations

import hashlib
import os
import socket
from typing import Optional

from . import names

#: the longest abstract socket name Linux takes (sun_path: 108 bytes, the first 0)
MAX_ADDRESS = 107
#: datagrams read per wake-up of the bridge at most (the rest wake it again)
READ_BATCH = 64
#: the datagrams: a store.flush() (or a retry into a full table outbox), or the first push
#: to a bridge asleep with nothing to do
FLUSH, PUSH = b"f", b"p"


def address(store: str, namespace: Optional[str]) -> bytes:
    """The doorbell's abstract socket address for a store: ``\\0shmps.[ns.]store.flush``,
    or a digest of that when it would not fit (names of up to 64 characters each)."""
    name = names.store_prefix(store, namespace)[1:] + "flush"
    raw = name.encode()
    if len(raw) > MAX_ADDRESS:
        raw = b"shmps.flush." + hashlib.sha256(raw).hexdigest().encode()
    return b"\0" + raw


def _socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX,
                         socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)


class Bell:
    """A worker's side: one non-blocking datagram socket, made on first use (per
    process: a socket inherited across fork would do too, but costs nothing to
    remake)."""

    def __init__(self, store: str, namespace: Optional[str]) -> None:
        self.address = address(store, namespace)
        # pid -> this process's socket: one entry but in a forked child, whose first
        # ring drops (closes its copy of) the parent's.  Threads ringing at once make
        # one socket: setdefault is one step under the GIL; the threads that lose close
        # theirs.  (A check and a store of one attribute made one socket per thread
        # (socket() releases the GIL), all but the last left to the garbage collector:
        # review H11 of 2026-11-28.)  No lock: none is held across a fork.
        self._socks: dict[int, socket.socket] = {}

    def ring(self, push: bool = False) -> bool:
        """True if the bridge will wake (a datagram sent, or its queue full of them);
        False if nobody listens: the caller falls back to the futex word.  ``push``: the
        ring of a push waking a bridge that sleeps with nothing to do (native/outbox.c
        "Sleeping until a push"), not of a store.flush()."""
        pid = os.getpid()
        sock = self._socks.get(pid)
        if sock is None:
            sock = self._new_socket(pid)
        try:
            sock.sendto(PUSH if push else FLUSH, self.address)
        except BlockingIOError:
            return True    # the bridge's queue is full: it has rings to read
        except OSError:
            return False   # ECONNREFUSED: no bridge bound to the address (EBADF: closed)
        return True

    def _new_socket(self, pid: int) -> socket.socket:
        new = _socket()
        sock = self._socks.setdefault(pid, new)
        if sock is not new:
            new.close()    # another thread's came first
        for other in [p for p in list(self._socks) if p != pid]:
            old = self._socks.pop(other, None)   # (a parent's, inherited by this child)
            if old is not None:
                old.close()
        return sock

    def close(self) -> None:
        for pid in list(self._socks):
            sock = self._socks.pop(pid, None)
            if sock is not None:
                sock.close()


def listen(store: str, namespace: Optional[str]) -> Optional[socket.socket]:
    """The bridge's side: a non-blocking socket bound to the store's doorbell, or None
    if the address is taken (another bridge process of the same store, say one still
    ending).  The bridge then logs it and tries again every second; meanwhile the rings
    go to the other process, and a flush waits for this bridge's next --flush-ms
    interval (or, once that process is gone and before the doorbell is bound again,
    wakes it through the futex word)."""
    sock = _socket()
    try:
        sock.bind(address(store, namespace))
    except OSError:
        sock.close()
        return None
    return sock


def take(sock: socket.socket) -> tuple[int, int]:
    """Read the waiting rings (at most READ_BATCH): how many were store.flush() calls'
    and how many pushes' (Bell.ring)."""
    flushes = pushes = 0
    while flushes + pushes < READ_BATCH:
        try:
            data = sock.recv(16)
        except BlockingIOError:
            break
        if data == PUSH:
            pushes += 1
        else:
            flushes += 1
    return flushes, pushes
