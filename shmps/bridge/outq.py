"""Exactly-once delivery: the sender's queue of unacknowledged frames, the receiver's filter.

A *stream* is the sequence of frames one sender incarnation sends for one shard:
``(sender, incarnation, tensor, shard)``. Its frames carry sequence numbers 1, 2, 3...

- The sender keeps each frame in the stream's :class:`OutQueue` until the shard's owner
  acknowledges it (cumulatively: ``ack(seq)`` releases every frame up to ``seq``), so an
  owner that dies mid-stream loses nothing: after the failover the sender calls
  :meth:`OutQueue.rewind` and sends :meth:`OutQueue.unacked` to the new owner. Memory is
  bounded by a :class:`ByteBudget` shared by all of a bridge's queues: over budget,
  :meth:`OutQueue.put` raises :class:`Backpressure` and :meth:`OutQueue.put_wait` waits
  for acknowledgements (the store then keeps accumulating pushes in its outbox).
- The receiver applies a frame only if its :class:`Dedup` says it is new, so a resent or
  replayed frame is applied once. Per stream it keeps the highest seq below which every
  frame was applied (the *floor*) and the set of applied seqs above it (bounded by a
  window). The owner sends its streams' marks to the shard's backups with the new rows, so
  a backup that becomes owner filters resends the same way.

The stream is per shard, not per peer, because a shard's backups only learn of the
frames for the shards they back up: per peer, the seqs a backup sees would have gaps
that never fill. The bridge groups the streams of the shards a peer owns onto that peer's
connection, and a peer's pending count is the sum over those streams.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Hashable, Iterable, Iterator

from ..errors import CapacityError, InvalidArgument, Timeout

U64 = (1 << 64) - 1


class Backpressure(CapacityError):
    """The bridge's byte budget for unacknowledged frames is used up."""

    hint = ("the owner is not acknowledging (slow, dead or partitioned); pushes keep "
            "accumulating in the local outbox and are sent once frames are acknowledged")


class ByteBudget:
    """A byte limit shared by several queues. ``try_take``/``release`` are O(1).

    :meth:`take` waits (asyncio) until enough bytes are released; waiters are woken on
    every release and retry, so no wakeup is lost (the event loop runs one task at a time).
    """

    def __init__(self, limit: int) -> None:
        if not isinstance(limit, int) or limit < 1:
            raise InvalidArgument(f"a byte budget must be a positive integer, got {limit!r}")
        self.limit = limit
        self.used = 0
        self._released: asyncio.Event | None = None

    @property
    def available(self) -> int:
        """Bytes that can still be taken."""
        return self.limit - self.used

    def try_take(self, nbytes: int) -> bool:
        """Take ``nbytes`` if they fit; True if taken."""
        if nbytes > self.limit:
            raise InvalidArgument(f"{nbytes} bytes can never fit a budget of {self.limit}",
                                  hint="send smaller frames or raise the budget")
        if self.used + nbytes > self.limit:
            return False
        self.used += nbytes
        return True

    def admit(self, nbytes: int) -> bool:
        """Take ``nbytes`` if they fit, or whatever their size if nothing is taken (a send
        window: one frame larger than the window still goes out, alone); True if taken."""
        if self.used and self.used + nbytes > self.limit:
            return False
        self.used += nbytes
        return True

    def release(self, nbytes: int) -> None:
        """Give ``nbytes`` back and wake waiters."""
        if not 0 <= nbytes <= self.used:
            raise InvalidArgument(f"releasing {nbytes} bytes, only {self.used} are taken")
        self.used -= nbytes
        if self._released is not None and nbytes:
            self._released.set()

    async def take(self, nbytes: int, timeout: float | None = None) -> None:
        """Wait until ``nbytes`` fit, then take them; :class:`~shmps.errors.Timeout` after
        ``timeout`` seconds (``None``: wait for ever)."""
        if self.try_take(nbytes):
            return

        async def wait() -> None:
            while not self.try_take(nbytes):
                if self._released is None:
                    self._released = asyncio.Event()
                self._released.clear()
                await self._released.wait()

        try:
            await asyncio.wait_for(wait(), timeout)
        except asyncio.TimeoutError:
            raise Timeout(f"{nbytes} bytes did not fit the {self.limit}-byte budget within "
                          f"{timeout:g} s ({self.used} bytes unacknowledged)") from None


@dataclass
class _Entry:
    seq: int
    frame: bytes
    queued_at: float


class OutQueue:
    """One stream's frames from queued to acknowledged, in seq order.

    One producer per queue: take :meth:`next_seq`, encode the frame with it, then
    :meth:`put` it (a failed encode leaves no gap). All methods are O(1) amortized except
    :meth:`unacked` and :meth:`to_send`, O(frames returned).
    """

    def __init__(self, budget: ByteBudget | int, *, first_seq: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(first_seq, int) or not 1 <= first_seq <= U64:
            raise InvalidArgument(f"first_seq must be in [1, 2**64), got {first_seq!r}")
        self.budget = budget if isinstance(budget, ByteBudget) else ByteBudget(budget)
        self._clock = clock
        self._entries: deque[_Entry] = deque()
        self._acked = first_seq - 1     # every seq <= this is acknowledged
        self._sent = first_seq - 1      # every seq <= this was handed out by to_send()
        self._bytes = 0
        self._closed = False
        #: a send window shared by the queues sending to one peer (set_window): bytes
        #: handed out by to_send and not yet acknowledged or rewound are taken from it
        self.window: ByteBudget | None = None
        self._flight = 0                # bytes of the frames handed out, not acknowledged

    # ---------------------------------------------------------------- state
    @property
    def acked(self) -> int:
        """The highest seq acknowledged (all before it too)."""
        return self._acked

    @property
    def sent(self) -> int:
        """The highest seq handed out by :meth:`to_send` (since the last rewind)."""
        return self._sent

    @property
    def last_seq(self) -> int:
        """The highest seq queued so far."""
        return self.next_seq() - 1

    @property
    def in_flight(self) -> int:
        """Bytes of the frames handed out by :meth:`to_send` and not acknowledged since
        (nor rewound)."""
        return self._flight

    @property
    def pending_bytes(self) -> int:
        """Bytes of the unacknowledged frames."""
        return self._bytes

    def __len__(self) -> int:
        """Unacknowledged frames."""
        return len(self._entries)

    def next_seq(self) -> int:
        """The seq the next :meth:`put` must carry (does not reserve it)."""
        return (self._entries[-1].seq if self._entries else self._acked) + 1

    def oldest_age(self, now: float | None = None) -> float:
        """Seconds the oldest unacknowledged frame has waited (0 if none)."""
        if not self._entries:
            return 0.0
        return max(0.0, (self._clock() if now is None else now) - self._entries[0].queued_at)

    # ---------------------------------------------------------------- producer side
    def _check(self, seq: int, frame: bytes) -> int:
        if self._closed:
            raise InvalidArgument("the queue is closed")
        if seq != self.next_seq():
            raise InvalidArgument(f"frame seq {seq} out of order: the stream expects "
                                  f"{self.next_seq()}")
        if seq > U64:
            raise InvalidArgument("the stream ran out of sequence numbers")
        return len(frame)

    def _append(self, seq: int, frame: bytes, size: int, now: float | None) -> None:
        self._entries.append(_Entry(seq, frame, self._clock() if now is None else now))
        self._bytes += size

    def put(self, seq: int, frame: bytes, *, now: float | None = None) -> None:
        """Queue ``frame`` (which carries ``seq``); :class:`Backpressure` if over budget,
        in which case nothing was queued."""
        size = self._check(seq, frame)
        if not self.budget.try_take(size):
            raise Backpressure(f"{self.budget.used} of {self.budget.limit} bytes are "
                               f"unacknowledged; a {size}-byte frame does not fit")
        self._append(seq, frame, size, now)

    async def put_wait(self, seq: int, frame: bytes, *, timeout: float | None = None,
                       now: float | None = None) -> None:
        """Queue ``frame``, waiting for acknowledgements to free the budget first."""
        size = self._check(seq, frame)
        await self.budget.take(size, timeout)
        try:
            self._check(seq, frame)    # another task may have queued meanwhile
        except InvalidArgument:
            self.budget.release(size)
            raise
        self._append(seq, frame, size, now)

    # ---------------------------------------------------------------- acknowledgements
    def ack(self, seq: int) -> int:
        """Acknowledge ``seq`` and every seq before it; return frames released. An old
        (duplicate) ack releases nothing; acking a seq never queued is
        :class:`InvalidArgument` (a confused or lying peer)."""
        if seq > self.last_seq:
            raise InvalidArgument(f"ack for seq {seq}, but only {self.last_seq} were queued")
        released = 0
        freed = 0
        flown = 0
        while self._entries and self._entries[0].seq <= seq:
            e = self._entries.popleft()
            freed += len(e.frame)
            if e.seq <= self._sent:
                flown += len(e.frame)
            released += 1
        self._land(flown)
        if seq > self._acked:
            self._acked = seq
            self._sent = max(self._sent, seq)
        self._bytes -= freed
        self.budget.release(freed)
        return released

    # ---------------------------------------------------------------- sending
    def unacked(self) -> list[tuple[int, bytes]]:
        """Every unacknowledged (seq, frame), oldest first (for resending)."""
        return [(e.seq, e.frame) for e in self._entries]

    def to_send(self) -> list[tuple[int, bytes]]:
        """Frames queued but not handed out yet, oldest first; they count as handed out.
        With a :attr:`window`, only those that fit it (ByteBudget.admit): the rest wait
        for acknowledgements to free it, and the next call hands them out."""
        out: list[tuple[int, bytes]] = []
        entries = self._entries
        if not entries:
            return out
        # The seqs queued are consecutive from entries[0]: the first not handed out is
        # found by its index, without a walk over those in flight (at a few hundred
        # unacknowledged frames per stream, that walk on every flush pass and every ACK
        # took a tenth of a busy bridge's CPU).  A deque's items near its right end,
        # where the unsent ones are, are reached from that end.
        w = self.window
        for i in range(max(0, self._sent - entries[0].seq + 1), len(entries)):
            e = entries[i]
            if w is not None:
                if not w.admit(len(e.frame)):
                    break
                self._flight += len(e.frame)
            out.append((e.seq, e.frame))
        if out:
            self._sent = out[-1][0]
        return out

    @property
    def unsent(self) -> bool:
        """Some queued frame was not handed out since the last rewind."""
        return self._sent < self.last_seq

    def rewind(self) -> int:
        """After a reconnect or a failover: hand every unacknowledged frame out again with
        the next :meth:`to_send`. Returns how many."""
        self._sent = self._acked
        self._land(self._flight)
        return len(self._entries)

    def set_window(self, window: ByteBudget | None) -> None:
        """Send within ``window`` from now on (None: no limit); rewinds first (the frames
        in flight were counted in the old window)."""
        self.rewind()
        self.window = window

    def _land(self, nbytes: int) -> None:
        """``nbytes`` of the frames in flight were acknowledged or will be sent again."""
        if nbytes:
            self._flight -= nbytes
            if self.window is not None:
                self.window.release(nbytes)

    def close(self) -> None:
        """Drop every frame and give the bytes back (the stream is abandoned)."""
        self._land(self._flight)
        self.budget.release(self._bytes)
        self._entries.clear()
        self._bytes = 0
        self._closed = True


# --------------------------------------------------------------------------- receiver

class Verdict(Enum):
    """What the receiver should do with a frame."""

    NEW = "new"                #: apply it
    DUPLICATE = "duplicate"    #: applied before: acknowledge again, do not apply
    TOO_FAR = "too far"        #: beyond the window above the floor: refuse (BUSY/GAP)


@dataclass
class _Window:
    floor: int = 0
    above: set[int] = field(default_factory=set)


class Dedup:
    """Per stream: the floor (every seq <= floor applied) and the applied seqs above it.

    ``window`` bounds how far above the floor a seq may be (so each stream holds at most
    ``window`` seqs); ``max_streams`` bounds the streams. :meth:`check` is O(1);
    :meth:`record` O(1) amortized (the floor moves past each seq once).
    """

    def __init__(self, *, window: int = 1 << 16, max_streams: int = 1 << 18) -> None:
        if window < 1 or max_streams < 1:
            raise InvalidArgument("window and max_streams must be >= 1")
        self.window = int(window)
        self.max_streams = int(max_streams)
        self._streams: dict[Hashable, _Window] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, stream: object) -> bool:
        return stream in self._streams

    def streams(self) -> Iterator[Hashable]:
        """The streams tracked."""
        return iter(list(self._streams))

    @staticmethod
    def _seq(seq: int) -> int:
        if not isinstance(seq, int) or isinstance(seq, bool) or not 1 <= seq <= U64:
            raise InvalidArgument(f"seq must be an integer in [1, 2**64), got {seq!r}")
        return seq

    def check(self, stream: Hashable, seq: int) -> Verdict:
        """NEW, DUPLICATE or TOO_FAR for ``seq`` of ``stream``; changes nothing."""
        self._seq(seq)
        w = self._streams.get(stream)
        floor = w.floor if w else 0
        if seq <= floor or (w is not None and seq in w.above):
            return Verdict.DUPLICATE
        if seq - floor > self.window:
            return Verdict.TOO_FAR
        return Verdict.NEW

    def fits(self, streams: Iterable[Hashable]) -> bool:
        """True if seqs of ``streams`` can be recorded (:meth:`record`, :meth:`advance`)
        with no more than ``max_streams`` tracked; changes nothing.  A receiver checks a
        frame's streams with this before it applies the frame: past the bound, recording
        them raises :class:`CapacityError`, with the frame applied by then.
        O(len(streams))."""
        new = {s for s in streams if s not in self._streams}
        return len(self._streams) + len(new) <= self.max_streams

    def _window(self, stream: Hashable) -> _Window:
        w = self._streams.get(stream)
        if w is None:
            if len(self._streams) >= self.max_streams:
                raise CapacityError(f"tracking {len(self._streams)} streams already",
                                    hint="forget the streams of senders that are gone")
            w = self._streams[stream] = _Window()
        return w

    def record(self, stream: Hashable, seq: int) -> None:
        """Note ``seq`` as applied. Idempotent for a duplicate; :class:`CapacityError` for
        a seq beyond the window or a new stream over ``max_streams`` (nothing recorded)."""
        v = self.check(stream, seq)
        if v is Verdict.DUPLICATE:
            return
        if v is Verdict.TOO_FAR:
            raise CapacityError(f"seq {seq} is more than {self.window} above the applied "
                                f"floor {self.floor(stream)}",
                                hint="the sender must resend from the floor + 1")
        w = self._window(stream)
        if seq == w.floor + 1:
            w.floor = seq
            while w.floor + 1 in w.above:
                w.floor += 1
                w.above.discard(w.floor)
        else:
            w.above.add(seq)

    def admit(self, stream: Hashable, seq: int) -> Verdict:
        """:meth:`check`, and :meth:`record` when NEW: the caller applies iff NEW."""
        v = self.check(stream, seq)
        if v is Verdict.NEW:
            self.record(stream, seq)
        return v

    def advance(self, stream: Hashable, floor: int) -> None:
        """Merge a cumulative mark: every seq <= ``floor`` was applied (from a snapshot
        or a FLOOR_MARKS frame). O(size of the above-set)."""
        if not isinstance(floor, int) or not 0 <= floor <= U64:
            raise InvalidArgument(f"floor must be in [0, 2**64), got {floor!r}")
        w = self._window(stream)
        if floor <= w.floor:
            return
        w.floor = floor
        w.above = {s for s in w.above if s > floor}
        while w.floor + 1 in w.above:
            w.floor += 1
            w.above.discard(w.floor)

    def floor(self, stream: Hashable) -> int:
        """Every seq <= this was applied (0: none)."""
        w = self._streams.get(stream)
        return w.floor if w else 0

    def expected(self, stream: Hashable) -> int:
        """The lowest seq not applied yet (floor + 1)."""
        return self.floor(stream) + 1

    def above(self, stream: Hashable) -> tuple[int, ...]:
        """The applied seqs above the floor, sorted."""
        w = self._streams.get(stream)
        return tuple(sorted(w.above)) if w else ()

    def forget(self, stream: Hashable) -> None:
        """Drop a stream whose sender incarnation is gone (its frames can no longer come)."""
        self._streams.pop(stream, None)


__all__ = ["Backpressure", "ByteBudget", "Dedup", "OutQueue", "Verdict"]
