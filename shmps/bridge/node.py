"""The bridge process: one per host, forwarding pushes to shard owners and replicating.

A :class:`Bridge` attaches to the local store, turns forwarding on (every push lands in
its tensor's outbox instead of being applied), and then, on an asyncio loop:

- **membership**: heartbeats to every peer every 0.1 s over an authenticated websocket
  (:mod:`.auth`), member states and epochs (:mod:`.members`), the ring of live members
  (:mod:`.ring`), ``hosts.txt`` watched and ``POST /v1/members``;
- **sending**: every ``flush_ms`` it drains each outbox shard into BATCH frames
  (:mod:`.frames`), queues them per stream (:class:`.outq.OutQueue`) and sends them to
  the shard's owner (itself included: then they are applied in-process), resending
  what is unacknowledged after an ownership change; an acknowledged drain is published
  to the outbox so ``store.flush()`` in the workers returns;
- **owning**: a BATCH for a shard it owns (with quorum, in the same epoch) is checked,
  filtered for duplicates (:class:`.outq.Dedup`), applied through the store's C push
  path, and its changed rows go to every other host as ROWS; the sender is acknowledged
  once every backup acknowledged those rows;
- **replicating**: ROWS and SNAPSHOT frames from a shard's owner are written into the
  local copy, with the duplicate marks they carry, so a backup can take over;
- **failover, join, leave**: on every change of the live set the ring is recomputed; a
  new owner waits for the previous owner's hand-over snapshot when that owner is still
  alive, new replicas get snapshots, senders resend.

docs/bridge-protocol.md describes the protocol; this module is its implementation.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import fcntl
import math
import os
import random
import signal
import socket
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional

import numpy as np

from ..errors import Busy, CapacityError, Error, InvalidArgument
from .. import _native, doorbell, names, segment
from .._native import lib
from ..outbox import BusyScan, DrainBuffers, RowData, take_lost
from ..outbox import counters as outbox_counters, unacknowledged
from . import auth, frames, urgent, wsstream
from .frames import ROWS_SEQ_BASE, FrameType, Layout, Mark, Status
from .members import (DEAD_AFTER, HEARTBEAT_INTERVAL, ON_RING, Membership, State,
                      address_host, http_url, member_id, normalize_address, parse_address,
                      parse_hosts, read_hosts, socket_address, watch_file)
from .logsum import ShardLog
from .outq import Backpressure, ByteBudget, Dedup, OutQueue, Verdict
from .pause import Pause
from .ring import Ring, shard_key

log = logging.getLogger("shmps.bridge")

#: the seq of every SYNC, and so of its answer (an ACK): not a BATCH stream's, not a ROWS's
SYNC_SEQ = ROWS_SEQ_BASE - 1
TICK = 0.02                      #: maintenance interval while anything is in motion (s)
TICK_SETTLED = 0.1               #: ... and at most while everything is settled (_tick_delay)
SETTLE_AFTER = 1.0               #: s after anything moved (_poke_tick) before the tick slows
DOORBELL_RETRY = 1.0             #: s between tries to bind a flush doorbell another holds
#: s a starting bridge waits for its store's bridge lock, held by another bridge process
#: of the store (running, or ending: a leave takes up to about 14 s); the environment's
#: SHMPS_BRIDGE_LOCK_WAIT overrides it (tests)
BRIDGE_LOCK_WAIT = float(os.environ.get("SHMPS_BRIDGE_LOCK_WAIT", "20"))
RETRY = 0.05                     #: resend delay after a refusal (s)
GAP_LOSS_REFUSALS = 3            #: an owner answers GAP to the same oldest batch this often...
GAP_LOSS_AFTER = 0.5             #: ...over this long (s) before it counts the batches before
                                 #: it acknowledged elsewhere and lost (_missing_acknowledged)
BUSY_RETRY = 0.02                #: resend delay after a BUSY (s), doubled for each BUSY in a row...
BUSY_RETRY_MAX = 0.08            #: ...up to this: each resend is the stream's whole window again
SWEEP_EVERY = 1.0                #: how often the sweep drains SWEEP_SHARDS shards, busy or not (s)
SWEEP_SHARDS = 64                #: shards per sweep, in turn: a 16-shard store is swept whole every second
REFUSED_KEEP = 256               #: batches an owner remembers it refused for good, a shard
FULL_SCAN_EVERY = 0.1            #: the outboxes are scanned at least this often, pushes counted or not (s)
DRAIN_FAILURE_LOG_S = 60.0       #: a failing outbox shard is logged at most this often (s)
DRAIN_RETRY_S = 1.0              #: a shard whose drain failed is tried again after this (s)
RESEND_AFTER = 2.0                #: resend a stream's unacknowledged frames after this silence
HANDOVER_TIMEOUT = 3.0           #: a new owner waits this long for the old owner's snapshot
CATALOG_INTERVAL = 0.5           #: how often tensor catalogs are compared with peers (s)
MAX_MSG = frames.MAX_FRAME_BYTES + 4096
MAX_BAD_FRAMES = 3               #: malformed frames in a row before a connection is closed
REFUSAL_LOG_EVERY = 5.0          #: s between log lines of one refused connection's reason
HOSTS_SETTLE = 0.5               #: s an edit of hosts.txt must stay the same before it counts
MAX_HANDSHAKES = 64              #: connections in their handshake at once from hosts that are
                                 #: not members' (503 over it); members' hosts have their own
MAX_HANDSHAKES_PER_HOST = 8      #: connections in their handshake at once from one IP address
AUTH_WAIT = 3.0                  #: s a server waits for the client's AUTH after its HELLO
MAX_PRESTART = 2 * MAX_MSG        #: bytes a link holds from its peer before it starts reading them
MAX_CATALOG_BYTES = 64 << 20     #: the largest catalog answer a peer's bridge may give
#: the largest refusal of another store (409, _verify's signed JSON: two store names
#: and an address in a few hundred bytes) a structure request reads
MAX_REFUSAL_BYTES = 4096
SNAPSHOT_FRAME_BYTES = 1 << 20   #: values per snapshot chunk
#: shards of tensors not taken up yet whose refused snapshot chunks are remembered
#: (Bridge._unknown_snap_broken), the oldest dropped past it
UNKNOWN_SNAP_KEEP = 1 << 16
#: a leaving creator sends the initial values unasked of the shards it took up this
#: recently and has not given their owner yet (_give_initial_values): an owner waits
#: for them from its own take-up, HANDOVER_TIMEOUT after the creator's last news
INIT_GIVE_S = 30.0
#: a leaving creator's hand-over of initial values that its owner has not answered this
#: long after it was queued is sent again (its connection reset, say)
INIT_RESEND_S = 1.0
#: s between a link's attempts to a peer whose handshake named another --store (a
#: typo fixed by a restart is met this late at most; every 0.05 s was pointless work)
STORE_RETRY = 1.0
#: a leaving creator first asks each such owner whether it still waits for them
#: (INIT_QUERY); one that has not answered this long after it was asked (the question or
#: the answer lost with a connection, or a bridge of an earlier build, which drops the
#: frame as malformed) is sent them all the same
INIT_ASK_S = 1.0
MAX_MARKS = frames.DEFAULT_LIMITS.max_marks  #: duplicate-filter marks a snapshot carries at most
SPARE_DRAIN_BUFFERS = 2          #: a tensor's drain buffers kept for reuse (TInfo.spare)
#: gradient bytes per BATCH frame (and so per ROWS frame answering it): a drain of a
#: larger shard goes out in frames of this much.  2 MiB, not 1: each frame costs both
#: bridges the same Python work whatever its size, and with 16 MiB shards 2 MiB frames
#: forwarded 0.96-1.1 GB/s where 1 MiB ones did 0.68-0.93 (alternating runs, 2026-11-25);
#: 4 frames fit the send window
DATA_FRAME_BYTES = 2 << 20
SNAPSHOT_START_BACKLOG = 32 << 20  #: a snapshot starts only while its connection holds less unsent
#: a dense or csr shard of at most this many value bytes is read for a snapshot on the
#: event loop (0.1-0.3 ms; with Adam's two state arrays about 3 times the bytes), not in
#: the snapshot thread: the hop there and back took
#: milliseconds, and the shard refused batches (BUSY, resent 20-80 ms later) meanwhile, so
#: a failover's new owner, which copies its backups first, took its last small shards
#: 0.1-0.2 s after its first (the failover bench, 2026-11-26)
INLINE_SNAPSHOT_BYTES = 256 << 10
SLOW_SNAPSHOT_S = 2.0            #: failpoint slow_snapshot[=s]: each snapshot's read takes this much longer (s)
ROWS_AHEAD = 16 << 20            #: an owner refuses batches (BUSY) while a copy's connection holds this much
LAG_WINDOW = 10.0                #: /health loop_lag_ms is the largest lag over this many s
DRAIN_SLICE = 0.02               #: a drain pass yields to the event loop after this long (s)
ADOPT_SLICE = 0.02               #: picking up or creating new tensors yields after this long (s)
MAINTAIN_SETTLED = 0.25          #: the shard pass's period while nothing is under way (s)
CORK_MAX = 256 << 10             #: frames below this size may share a message (Cork)
CORK_FLUSH = 128 << 10           #: a corked connection sends what waits at this much (the peer starts on it)
SEND_AHEAD = 4 << 20             #: a peer connection's unsent bytes above which no more is drained for it
#: a peer's sent, unacknowledged BATCH bytes above which no more are sent to it until
#: ACKs come (a window per owner, OutQueue.set_window): below ROWS_AHEAD, so an owner's
#: ROWS back to this host never reach the backlog at which it refuses batches (BUSY, and
#: a resend 20 ms later).  Without it a 16 MiB shard went out as 16 frames at once and
#: the owner refused the later ones while this host, busy sending, left its ROWS unread
SEND_WINDOW = 8 << 20
assert DATA_FRAME_BYTES < SEND_WINDOW < ROWS_AHEAD
ACK_AHEAD = 32 << 20             #: a peer's sent, unacknowledged batch bytes above which no more is drained for it
CLOSE_STEP_TIMEOUT = 5.0         #: each step of Bridge.close() at most this long (s)
SHUTDOWN_TIMEOUT = 2.0          #: closing, the web server waits this long for a handler still running (s)


def _flock_holder(fd: int) -> Optional[int]:
    """The pid holding a flock of ``fd``'s file, from /proc/locks (None if not found:
    the lock was just released, or /proc is not readable)."""
    st = os.fstat(fd)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF" ("->" marks waiters)
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == dev:
                    return int(parts[4])
    except (OSError, ValueError):
        return None
    return None


@dataclass
class Config:
    """What ``shmps-bridge`` was started with (see :func:`shmps.bridge.cli.main`)."""

    peers_file: str
    store: str
    listen: str
    replicas: int = 2
    secret: Optional[bytes] = None
    namespace: Optional[str] = None
    flush_ms: float = 5.0
    allow_minority: bool = False
    dead_after: float = DEAD_AFTER
    heartbeat: float = HEARTBEAT_INTERVAL
    budget_bytes: int = 256 << 20
    startup_grace: Optional[float] = None   #: default: 2 * dead_after


# --------------------------------------------------------------------------- tensors

@dataclass
class TInfo:
    """A tensor the bridge forwards: its id in frames and how its rows look."""

    name: str
    tid: int
    kind: str                 #: "dense", "table" or "csr"
    t: Any                    #: the store's tensor object
    nshards: int
    dtype: np.dtype           #: value dtype
    gdtype: np.dtype          #: gradient dtype (BATCH)
    cols: int                 #: values per row
    row_shape: tuple
    nrows: Optional[int]      #: dense rows, csr entries; None for tables
    shard_rows: int
    record: dict
    #: drain buffers no frame refers to any more, for the next drains: a set comes back
    #: once its drain is encoded (table, csr: the frames are copies) or acknowledged
    #: (dense: the frames are views of it, frames.Pieces)
    spare: list = field(default_factory=list)
    #: csr: each shard's first entry, and nnz (a csr tensor crosses as its entries)
    bounds: Optional[list] = None

    def buffers(self) -> DrainBuffers:
        """Buffers for the next drain (see :attr:`spare`)."""
        return self.spare.pop() if self.spare else DrainBuffers()

    def give_back(self, bufs: DrainBuffers) -> None:
        """``bufs`` is no longer referenced by a frame that may be sent."""
        if len(self.spare) < SPARE_DRAIN_BUFFERS:
            self.spare.append(bufs)

    def shard_range(self, s: int) -> tuple[int, int]:
        """Rows (csr: entries) [lo, hi) of shard ``s``."""
        if self.bounds is not None:
            return self.bounds[s], self.bounds[s + 1]
        lo = s * self.shard_rows
        return lo, min(self.nrows or 0, lo + self.shard_rows)


def _user_record(rec: dict) -> bool:
    """Tensors the bridge forwards: dense (not aggregated), tables and csr tensors, not
    hidden ones."""
    return ("#" not in rec["name"] and rec["kind"] in ("dense", "table", "csr")
            and not rec.get("aggregate"))


# --------------------------------------------------------------------------- per shard

@dataclass
class Pending:
    """A batch applied by this owner, waiting for its backups before it is acknowledged."""

    rseq: int
    reply: Callable[[bytes], None]
    ack: bytes


class FedBase(NamedTuple):
    """The owner's SNAPSHOT a copy is, plus that owner's ROWS since (on_rows, _unsynced)."""

    sender: int          # the owner's member id
    incarnation: int     # its process
    epoch: int           # the snapshot's frame epoch
    rseq: int            # the ROW seq of its LAST chunk
    peer: str            # the owner's address


@dataclass
class ShardState:
    """What this host knows about one shard, in every role."""

    key: str
    dedup: Dedup = field(default_factory=Dedup)
    first_seen: dict = field(default_factory=dict)       # unknown stream -> first seq seen
    gapped: dict = field(default_factory=dict)           # stream -> [lowest seq answered GAP
                                                         # above the filter, times, since]
    leave_to: Optional[str] = None                       # leaving: the shard's next owner,
                                                         # no backup now, waited for (leave)
    # owner side
    refused: dict = field(default_factory=dict)          # (stream, seq) -> (sender, incarnation)
                                                         # of the owner that refused it for
                                                         # good, the last REFUSED_KEEP (this
                                                         # host's or an owner's it copies):
                                                         # a resent one is refused again
    rseq: int = 0                                        # ROWS/SNAPSHOT counter
    rows_rseq: int = 0                                   # rseq of the last ROWS (to all copies)
    epoch_rows: tuple = ((-1, 0), 0)                     # ((epoch, ring digest), rseq) of the
                                                         # first ROWS sent by that view (_release
                                                         # waits for it)
    epoch_mark_at: float = float("-inf")                 # when _send_epoch_rows last sent one
    acked: dict = field(default_factory=dict)            # member -> highest rseq acked
    synced: set = field(default_factory=set)             # members holding a full copy
    joiners_copied: set = field(default_factory=set)     # joining members sent one in this
                                                         # tenure (_required)
    snapshotting: dict = field(default_factory=dict)     # member -> last rseq of its snapshot
    copy_first: dict = field(default_factory=dict)       # member -> first rseq of the last copy
                                                         # queued to it (on_ack: refusals of
                                                         # frames before it change nothing)
    reading: Optional[str] = None                        # the member whose snapshot is being read
    copied_in: int = 0                                   # ROWS/SNAPSHOT frames written into this copy
    pending: deque = field(default_factory=deque)
    handover_from: Optional[str] = None
    handover_prev: Optional[str] = None                  # the previous owner (its last ROWS
                                                         # count as the hand-over's)
    handover_since: int = 0                              # the epoch handover_from became
                                                         # the owner in this host's view
    handover_until: float = 0.0
    handover_next: list = field(default_factory=list)    # asked in turn if handover_from's
                                                         # does not come: the previous
                                                         # owner's backups (_role_change)
    handover_hold_until: float = 0.0                     # until then, one of those cut off
                                                         # is waited for to come back
    handover_init: bool = False                          # the wait is for the creator's
                                                         # initial values (refresh_tensors),
                                                         # not a previous owner's copy
    init_served: Optional[str] = None                    # the owner this process, the
                                                         # tensor's creator, sent its copy
                                                         # to as a hand-over (leave)
    init_seqs: tuple = (0, 0)                            # the ROW seqs of that hand-over's
                                                         # first and LAST chunks (on_ack)
    init_sent_at: float = 0.0                            # when it was queued (a leave
                                                         # sends it again, unanswered
                                                         # INIT_RESEND_S after)
    init_given: Optional[str] = None                     # the owner that answered its LAST
                                                         # (took it, or waits for none), no
                                                         # chunk of it refused BUSY (leave)
    init_asked: Optional[str] = None                     # the owner asked whether it waits
                                                         # for them (INIT_QUERY; None again
                                                         # on a BUSY answer: asked again)
    init_asked_at: float = 0.0                           # when (sent unasked INIT_ASK_S after)
    init_waits: Optional[tuple] = None                   # (owner, its incarnation, whether
                                                         # it waits for them): its answer
    taken_up_at: float = field(default_factory=time.monotonic)   # when this process took
                                                         # the shard up
    handover_incs: dict = field(default_factory=dict)    # host -> its incarnation when the
                                                         # wait began (_role_change): a
                                                         # process started since is no
                                                         # hand-over (_waited_restarted)
    failover_from: Optional[str] = None                  # the dead owner, until first apply
    failover_dead_seen: float = 0.0
    handover_took_at: float = 0.0                        # taken by hand-over then, until
                                                         # the first apply (0: not)
    undecided_apply: tuple = ()                          # (monotonic, wall) of the first
                                                         # apply while failover_from was
                                                         # undecided (_decide_takeovers)
    # replica side
    snap_epoch_seen: int = -1                            # a LAST snapshot chunk arrived
    handover_done: tuple = ("", 0.0, 0)                  # (previous owner, when, epoch) its
                                                         # hand-over snapshot arrived
    sync_sent_at: float = 0.0                            # joining: last SYNC request
    snap_retry: dict = field(default_factory=dict)       # member -> no snapshot before
    snapshots_received: int = 0
    owner_since: int = 0                                 # epoch its owner last changed in this
                                                         # host's view (ROWS of older ones are stale)
    fed_owners: list = field(default_factory=list)       # the shard's owners in this host's ring
                                                         # when it last took ROWS from the owner
    fed_epoch: int = -1                                  # the epoch of that ROWS or SNAPSHOT
    fed_base: Optional[FedBase] = None                   # the owner's SNAPSHOT this copy is,
                                                         # plus its ROWS since (_unsynced)
    snap_open: Optional[tuple] = None                    # (sender, incarnation, ROW seq) of the
                                                         # last SNAPSHOT chunk written, while its
                                                         # LAST (and marks) is not
    snap_broken: dict = field(default_factory=dict)      # (sender, incarnation) -> ROW seq of
                                                         # a chunk of its snapshot refused, or
                                                         # the last taken before another's was
                                                         # written: the next chunk is refused
    acked_as_owner: bool = False                         # this host acknowledged batches of
                                                         # the shard as its owner (a SYNC of
                                                         # a later owner gets its copy)

    @property
    def snap_partial(self) -> bool:
        """Chunks of a SNAPSHOT are written into this copy, its LAST (and marks) not yet:
        its rows are ahead of its marks (no hand-over of it then)."""
        return self.snap_open is not None


class QueuedDrain(NamedTuple):
    """One drain of an outbox shard, queued as BATCH frames up to seq ``last_seq``."""

    last_seq: int
    pushed: int                        #: its Drained.pushed, .ticket, .prev
    ticket: int
    bufs: Optional[DrainBuffers]       #: the buffers its frames are views of (dense, table), or None
    prev: int


@dataclass
class SendStream:
    """This host's stream of BATCH frames for one shard."""

    q: OutQueue
    drains: deque = field(default_factory=deque)   #: QueuedDrain, oldest first
    target: Optional[str] = None
    retry_at: float = 0.0
    progress_at: float = 0.0          # last acknowledgement (or first send after idle)
    gap_resent_at: float = -1e9       # when a GAP for the oldest frame resent the stream
    gap_upto: int = 0                 # the highest seq sent before that resend
    busy: int = 0                     # resends answered BUSY in a row (the backoff's step)
    #: the last refusal was of the owner's view (NO_QUORUM, STALE_EPOCH, NOT_OWNER): the
    #: owner's heartbeat saying it acts by this host's view resends it at once
    #: (Bridge._resend_view_waits), not at retry_at
    view_wait: bool = False


# --------------------------------------------------------------------------- connections

class Cork:
    """While a unit of the bridge's work runs (one incoming message, one pass of the flush
    loop: ``with cork:``), frames smaller than CORK_MAX that it sends to one peer wait on
    their connection and go out together, as one websocket message of frames laid back
    to back (frames.iter_frames), when the unit ends or CORK_FLUSH bytes wait.  A table
    push spread over many shards makes a small frame per shard, each answered by ROWS
    and an ACK (after them, on the same connection: on_batch); one message each cost a
    send, a wake-up and a dispatch on both ends.  Larger frames and bulk sends go at
    once, after what waits (order is kept)."""

    def __init__(self) -> None:
        self.depth = 0
        self.dirty: list["Conn"] = []

    def __enter__(self) -> "Cork":
        self.depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self.depth -= 1
        if not self.depth:
            dirty, self.dirty = self.dirty, []
            if len(dirty) > 1:
                dirty.sort(key=Conn.pending_bytes)
            for c in dirty:
                c.flush()


async def _read_at_most(response: Any, limit: int, what: str) -> bytes:
    """The body of aiohttp ``response``, refused (InvalidArgument) once it passes ``limit``
    bytes, before more is read: a peer's answer is bounded before it is checked."""
    n = response.content_length
    if n is not None and n > limit:
        raise InvalidArgument(f"{what}: {n} bytes, over the {limit}-byte limit")
    parts, got = [], 0
    async for chunk in response.content.iter_chunked(1 << 16):
        got += len(chunk)
        if got > limit:
            raise InvalidArgument(f"{what}: over the {limit}-byte limit")
        parts.append(chunk)
    return b"".join(parts)


class Conn:
    """One established websocket (:class:`.wsstream.WsStream`) to or from a peer."""

    def __init__(self, stream: wsstream.WsStream, peer: str, incarnation: int = 0,
                 cork: Optional[Cork] = None) -> None:
        self.stream = stream
        self.peer = peer
        self.incarnation = incarnation
        self.opened = time.monotonic()
        self.cork = cork
        self._pending: list = []        # corked frames, in order
        self._pending_bytes = 0

    def pending_bytes(self) -> int:
        return self._pending_bytes

    @property
    def closed(self) -> bool:
        return self.stream.is_closed

    def send(self, data: bytes | bytearray, bulk: bool = False) -> bool:
        """Send ``data`` (one or more frames, not to be changed afterwards) on the
        connection; False if it is closed or wsstream.MAX_BACKLOG bytes already wait for
        the socket (the caller treats the frames as lost; ``bulk``: queued anyway, see
        WsStream.send). Never waits; while corked, a small frame waits for the others
        (Cork)."""
        n = len(data)
        cork = self.cork
        if cork is not None and cork.depth and not bulk and n < CORK_MAX:
            if self.stream.is_closed or self.stream.refuses(self._pending_bytes + n):
                return False
            data = frames.as_bytes(data)   # joined with the others (Flush)
            if not self._pending:
                cork.dirty.append(self)
            self._pending.append(data)
            self._pending_bytes += n
            if self._pending_bytes >= CORK_FLUSH:
                self.flush()
            return True
        self.flush()
        return self.stream.send(data, bulk)

    def reply(self, data: bytes | bytearray) -> bool:
        """Send an answer (an ACK or a refusal: 56 bytes) as :meth:`send`, but never
        refused for the backlog: a bulk snapshot queued ahead of it may hold more than
        wsstream.MAX_BACKLOG, and a dropped ACK only makes the sender resend
        RESEND_AFTER later.  False only if the connection is closed."""
        return self.send(data) or self.send(data, bulk=True)

    def flush(self) -> None:
        """Send the corked frames as one message (admitted when they were corked)."""
        if not self._pending:
            return
        parts, self._pending, self._pending_bytes = self._pending, [], 0
        self.stream.send(parts[0] if len(parts) == 1 else b"".join(parts), bulk=True)

    async def close(self) -> None:
        self.stream.close()


class Link:
    """This host's outgoing connection to one peer: frames it sends, ACKs it receives."""

    def __init__(self, node: "Bridge", addr: str) -> None:
        self.node = node
        self.addr = addr
        self.conn: Optional[Conn] = None
        self.up_since = 0.0
        self.down_since = 0.0     # when an established connection last broke (0: never)
        self.refused_at = 0.0     # when a dial was last refused (ECONNREFUSED; 0: never)
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"link {addr}")

    @property
    def up(self) -> bool:
        return self.conn is not None and not self.conn.closed

    def send(self, data: bytes) -> bool:
        c = self.conn
        return c.send(data) if c is not None else False

    async def _run(self) -> None:
        host, port = socket_address(self.addr)
        while True:
            stream: Optional[wsstream.WsStream] = None
            try:
                # The data-frame limit from the start: the server's data frames may follow
                # its OK in the same read, before this task has checked the OK.  (This
                # end dials configured members only, one connection each at a time, so
                # what a stranger on a member's address can make it hold is bounded:
                # until start(), at most a message being read and MAX_PRESTART queued.)
                stream = await wsstream.connect(host, port, "/v1/stream", max_msg=MAX_MSG,
                                                timeout=2.0)
                self.refused_at = 0.0   # something listens there again
                stream.limit(MAX_MSG, MAX_PRESTART)
                stream.on_refused = self.node.metrics.rejected
                hello = await stream.receive(2.0)
                hs = auth.ClientHandshake(self.node.cfg.secret, self.node.addr, "data",
                                          sender=self.node.mid,
                                          incarnation=self.node.incarnation,
                                          store=self.node.cfg.store, server_id=self.addr)
                stream.send(hs.answer(hello))
                server = hs.check(await stream.receive(2.0))
                if server.sender != member_id(self.addr):
                    raise auth.AuthError(f"member id {server.sender:08x} does not match "
                                         f"the address {self.addr}")
                if not self.node._store_agrees(self.addr, server.store):
                    # (the server refuses this host too, and closes: see _serve_stream)
                    stream.close()
                    stream = None
                    await asyncio.sleep(STORE_RETRY)
                    continue
                self.conn = conn = Conn(stream, self.addr, cork=self.node.cork)
                self.up_since = time.monotonic()
                bad = 0

                def on_message(data: memoryview) -> bool:
                    # the peer's data frames (it sends them on this host's connection,
                    # server to client: unmasked) and ACKs of this host's frames
                    nonlocal bad
                    bad = self.node.on_message(self.addr, server, data, conn.send, bad)
                    return bad < MAX_BAD_FRAMES

                stream.start(on_message)
                await stream.wait_closed()
            except asyncio.CancelledError:
                if stream is not None:
                    stream.close()
                raise
            except auth.AuthError as e:
                # (counted each time; logged once per REFUSAL_LOG_EVERY: the link retries
                # every 0.05 s, and a peer of another release fails every try)
                self.node.metrics.rejected("auth")
                self.node._log_refusal(self.addr, str(e),
                                       "peer %s failed authentication: %s%s")
            except Exception as e:
                log.debug("link to %s: %s", self.addr, e)
                if not (isinstance(e, OSError) and e.errno == errno.ECONNREFUSED):
                    # a refusal counts only while every dial since is refused: one that
                    # got further (a handshake that failed, a timeout) says the process
                    # may be there (review H19: one heard on its own connection was
                    # dead when that connection blinked, by a refusal from before)
                    self.refused_at = 0.0
                else:
                    # nothing listens on the peer's address: its bridge process is gone
                    # (a stopped or cut-off one keeps its socket, which its kernel, or no
                    # one, answers): with its connections closed it is dead at once
                    # (_closed_and_silent), not half of dead_after after its last word
                    self.refused_at = time.monotonic()
                    if self.down_since:
                        self.node._look_at_closed()
            if stream is not None:
                stream.close()
            broke = self.conn is not None
            if broke:
                self.conn = None
                self.down_since = time.monotonic()
                self.node._look_when_silent(self.addr)
            if self.addr not in self.node.members.states():
                # no longer a member (taken out of the list: never heard, dead, or gone
                # after handing its shards over), and its connection is down: this link
                # ends (it dialled it every 0.05 s as long as the bridge ran).  Not
                # while up: a leaving host's last batches come on it.  Added again, it
                # gets a new one (_set_members).
                if self.node.links.get(self.addr) is self:
                    del self.node.links[self.addr]
                return
            # dialled again at once after a break (a peer that died refuses it: dead
            # then, _closed_and_silent), then every 0.05 s; and at most every 0.05 s if
            # its connections break as soon as they are made (a peer that closes each
            # one after its handshake was dialled in a loop)
            quick = broke and time.monotonic() - self.up_since >= 0.05
            await asyncio.sleep(0.0 if quick else 0.05)


# --------------------------------------------------------------------------- metrics

class Metrics:
    """Prometheus counters and gauges of one bridge (its own registry)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.frames_sent = Counter("shmps_bridge_frames_sent", "frames sent", ["type"], registry=r)
        self.bytes_sent = Counter("shmps_bridge_bytes_sent", "frame bytes sent", ["type"],
                                  registry=r)
        self.frames_recv = Counter("shmps_bridge_frames_received", "frames received", ["type"],
                                   registry=r)
        # (what the receive path knows cheaply: a decoded BATCH's values; other frames'
        # sizes are not kept, so only "batch" is counted, unlike bytes_sent's frames)
        self.bytes_recv = Counter("shmps_bridge_bytes_received", "gradient bytes of the "
                                  "BATCH frames received (their values; no other type)",
                                  ["type"], registry=r)
        self.applied = Counter("shmps_bridge_batches_applied", "batches applied as owner",
                               registry=r)
        self.applied_bytes = Counter("shmps_bridge_gradient_bytes_applied",
                                     "gradient bytes applied as owner", registry=r)
        self.acked_missing = Counter(
            "shmps_bridge_acknowledged_batches_missing", "batches an earlier owner "
            "acknowledged that this owner's copy lacks: lost (Bridge._missing_acknowledged)",
            registry=r)
        self.duplicates = Counter("shmps_bridge_duplicate_batches",
                                  "batches received again and not applied", registry=r)
        self.rejected_c = Counter("shmps_bridge_rejected_frames", "frames refused", ["reason"],
                                  registry=r)
        self.failovers = Counter("shmps_bridge_failovers", "shards taken over from a dead "
                                 "owner", registry=r)
        self.snapshots_behind = Counter(
            "shmps_bridge_snapshots_behind_copy", "owner snapshots taken that lacked batches "
            "this host's copy had applied (lost if they were acknowledged)", registry=r)
        self.failover_s = Histogram("shmps_bridge_failover_seconds", "owner's last heartbeat"
                                    " to the first batch applied by its successor", registry=r,
                                    buckets=(0.1, 0.2, 0.3, 0.5, 0.75, 1, 2, 5))
        # (a planned hand-over is no failover: counted and timed apart, so the failover
        # figures are those of deaths and cuts only)
        self.handovers = Counter("shmps_bridge_handovers", "shards taken over from an owner "
                                 "that handed them over (a member joined or left on purpose)",
                                 registry=r)
        self.handover_s = Histogram("shmps_bridge_handover_seconds", "a hand-over's ownership "
                                    "change on the new owner to the first batch it applied",
                                    registry=r, buckets=(0.01, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
        self.epoch = Gauge("shmps_bridge_epoch", "membership epoch", registry=r)
        self.pending = Gauge("shmps_bridge_pending_bytes", "unacknowledged batch bytes",
                             registry=r)
        self.staleness = Gauge("shmps_bridge_staleness_seconds", "age of the oldest "
                               "unacknowledged batch", registry=r)
        self.owned = Gauge("shmps_bridge_shards_owned", "shards this host owns", registry=r)
        self.lost = Counter("shmps_bridge_lost_pushes", "pushes an earlier bridge process "
                            "on this store drained and never saw acknowledged, a drain "
                            "that failed part way took, or an owner refused for good",
                            registry=r)
        self.drain_failures = Counter("shmps_bridge_drain_failures", "outbox drains that "
                                      "raised (a corrupt outbox shard); logged",
                                      registry=r)
        self.stalls = Counter("shmps_bridge_stalls", "times this process did not run for "
                              "half of dead_after and listened before acting again",
                              registry=r)
        wakes = Counter("shmps_bridge_flush_wakes", "store.flush() calls (and retries of a "
                        "push into a full table outbox) that woke this bridge, by the way they came: the doorbell socket, or the "
                        "manifest's futex word (workers that cannot reach the doorbell: "
                        "another network namespace, an older build)", ["via"], registry=r)
        self.wakes_doorbell = wakes.labels(via="doorbell")
        self.wakes_futex = wakes.labels(via="futex")
        self.push_wakes = Counter("shmps_bridge_push_wakes", "times the first push after "
                                  "this bridge went to sleep with nothing to do woke it "
                                  "(its doorbell, or the manifest's futex)", registry=r)

        # the children of each label value, looked up once: labels() costs several us,
        # and these count every frame
        self._sent: dict[str, tuple[Any, Any]] = {}
        self._received: dict[str, Any] = {}
        self._received_bytes: dict[str, Any] = {}

    def rejected(self, reason: str) -> None:
        self.rejected_c.labels(reason).inc()

    def sent(self, ftype: str, n: int) -> None:
        """A frame of type ``ftype`` and ``n`` bytes sent."""
        c = self._sent.get(ftype)
        if c is None:
            c = self._sent[ftype] = (self.frames_sent.labels(ftype),
                                     self.bytes_sent.labels(ftype))
        c[0].inc()
        c[1].inc(n)

    def received(self, ftype: str, n: int = 0) -> None:
        """A frame of type ``ftype`` received; ``n``: bytes counted in bytes_recv."""
        c = self._received.get(ftype)
        if c is None:
            c = self._received[ftype] = self.frames_recv.labels(ftype)
        c.inc()
        if n:
            c = self._received_bytes.get(ftype)
            if c is None:
                c = self._received_bytes[ftype] = self.bytes_recv.labels(ftype)
            c.inc(n)


# --------------------------------------------------------------------------- the bridge

class Bridge:
    """One host's bridge. ``await start()``, then ``await run_until_stopped()``."""

    def __init__(self, cfg: Config) -> None:
        if cfg.replicas < 1:
            raise InvalidArgument(f"--replicas {cfg.replicas} must be >= 1")
        if not cfg.flush_ms > 0:
            raise InvalidArgument(f"--flush-ms {cfg.flush_ms} must be > 0")
        self.cfg = cfg
        self.cork = Cork()   # small frames of one unit of work share a message
        self.addr = normalize_address(cfg.listen)
        auth.check_bind(parse_address(self.addr)[0], cfg.secret)
        self.mid = member_id(self.addr)
        self.incarnation = random.SystemRandom().randrange(1, 1 << 32)
        configured = read_hosts(cfg.peers_file)
        if self.addr not in configured:
            raise InvalidArgument(f"this bridge listens on {self.addr}, which is not listed in "
                                  f"{cfg.peers_file}",
                                  hint="add it to the file, or pass the --listen address "
                                       "that the file lists for this host")
        self.members = Membership(configured, self.addr, dead_after=cfg.dead_after,
                                  allow_minority=cfg.allow_minority)
        self.ring = Ring(self.members.live())
        self.prev_ring: Optional[Ring] = None
        self.metrics = Metrics()
        self.started = time.monotonic()
        self.grace_until = self.started + (cfg.startup_grace if cfg.startup_grace is not None
                                           else 2 * cfg.dead_after)
        self.ready_flag = False        # joining and every shard copied
        self.leaving = False
        self.handed_over = False
        self._drains_stopped = False   # leaving: what the outboxes hold now stays there
        self._hurry = False            # a second SIGTERM/SIGINT: leave without waiting
        self._signals = 0              # SIGTERM/SIGINT received (request_stop)
        self._set_forwarding_here = False   # start() switched the store's forwarding on
        self._made_store = False            # start()'s attach made the store
        self._lock_fd: Optional[int] = None    # the store's bridge lock (_lock_store)
        self.tensors: dict[int, TInfo] = {}
        self.by_name: dict[str, TInfo] = {}
        self._records_seen = 0             # store catalog records refresh_tensors looked at
        self._adopt_deadline: Optional[float] = None   # this loop turn's (refresh_tensors)
        # tensors this bridge created from a peer's catalog record: name -> the address of
        # the host where a worker created it (its "origin"), whose copy holds the initial
        # values (init= arrays or scalars are not in the record)
        self.adopted: dict[str, str] = {}
        self.shards: dict[tuple[int, int], ShardState] = {}
        # (tid, shard) of a tensor not taken up yet -> {(sender, incarnation): ROW seq}
        # of a SNAPSHOT chunk refused for it (unknown tensor): its ShardState starts with
        # them as snap_broken (refresh_tensors), so the rest of that snapshot is refused
        self._unknown_snap_broken: dict[tuple[int, int], dict] = {}
        self.streams: dict[tuple[int, int], SendStream] = {}
        self._sweep_at = 0.0               # next sweep (_drain_all)
        self._drain_round = 0              # rotates where a drain pass starts
        self._full_scan_at = 0.0           # next scan of every outbox, pushed or not
        self._scan_asked = False           # a worker asked for a drain: scan every outbox
        self._asleep = False               # the flush loop sleeps until a push (_until_a_push)
        self._asleep_since = 0.0           # the start of the pass after which it fell asleep
        self._drain_failed_at: dict[tuple, float] = {}   # (tid, shard) -> last logged
        self._drain_retry_at: dict[tuple, float] = {}    # (tid, shard) -> next try
        self._sweep_pos = 0                # the next shard a sweep starts with
        self._sweep_due: list = []         # what the current sweep has left to drain
        self._index: tuple = (-1, [], None, [])   # _shard_index's cache
        self._maint_sig: tuple = ()        # what the last _maintain shard pass saw
        self._catalog_tags: dict[str, str] = {}   # peer -> ETag of its catalog taken whole
        self.store_mismatch: dict[str, str] = {}  # peer -> the other --store it serves
        self._maint_due = 0.0              # when the next one is due at the latest
        self._tick_sleep = Pause()         # the tick loop's (_poke_tick ends it sooner)
        self._moved_at = 0.0               # the latest _poke_tick
        self._tick_at = 0.0                # when the latest tick began
        self._maint_busy = True            # the last shard pass found work under way
        self._sending: set = set()         # streams with frames not yet acknowledged
        self._unacked_to: dict = {}        # owner -> unacknowledged batch bytes (_drain_all)
        self._windows: dict[str, ByteBudget] = {}   # owner -> its send window (SEND_WINDOW)
        self._window_waits: dict[str, set] = {}     # owner -> streams (tid, s) waiting for it
        self._lags: deque = deque()        # (when, how late) of each tick (_tick_loop)
        self._flush_sleep = Pause()        # the flush loop's (_wake_flush, _woken_by_push)
        self._flush_asked = False          # a worker asked for a drain (_wake_flush)
        self._waiter_stop = False
        self._waiter: Optional[threading.Thread] = None
        self._doorbell: Optional[socket.socket] = None
        self._doorbell_tried = 0.0                 # the last try to bind it
        self.budget = ByteBudget(cfg.budget_bytes)
        self.links: dict[str, Link] = {}
        self.incoming: dict[tuple, Conn] = {}   # (peer address, incarnation) -> its stream
        self._streams: set[wsstream.WsStream] = set()   # every incoming one, handshake too
        self._closing = False     # close() began: no new incoming connection is served
        self._acks_new = False    # some ob_acked may have risen since flushers were told
        self.data_out: dict[str, Conn] = {}     # peer -> the connection this host's data
                                                # frames to it take (see _out)
        self.ids: dict[int, str] = {member_id(m): m for m in configured}
        self.hb_seq = 0
        self.failover_log: list[dict] = []
        # members heard saying they handed their shards over (HB_HANDED_OVER), until they
        # are heard again as members (a restarted one joins): _takeover_kind
        self._handed_over: set[str] = set()
        # previous owner -> (shards taken by hand-over, undecided, since, epoch): the
        # take-overs from an owner gone without a word here, until _decide_takeovers
        self._took_undecided: dict[str, tuple[int, int, float, int]] = {}
        self.joined_at_epoch: Optional[int] = None
        self.catalog_seen_from: set[str] = set()
        self.store: Any = None
        self.session: Any = None
        self.runner: Any = None
        self._site: Any = None
        self._tasks: list[asyncio.Task] = []
        self._verifier = auth.RequestVerifier(cfg.secret, self.addr, store=cfg.store)
        #: incoming connections not yet authenticated, per remote IP address (h_stream)
        self._handshaking: Counter = Counter()
        self._refusals_logged: dict[tuple, tuple] = {}   # (remote, why) -> (logged at, since)
        self._stop_event: Optional[asyncio.Event] = None
        self._owner_cache: dict[str, list[str]] = {}
        self._owned: tuple = (None, 0, [])   # (ring, shard count, owned keys): _owned_keys
        self._peer_rings: dict[str, set] = {}   # the ring each peer's last heartbeat shows
        self._incarnations: dict[str, int] = {}
        self._hb_seq: dict[str, int] = {}   # peer -> the newest heartbeat counter heard of
                                             # its incarnation (self._incarnations)
        #: SHMPS_BRIDGE_DEBUG=1 at start: log every GAP, refused ROWS/SNAPSHOT, ACK taken
        #: and the marks of every ROWS/SNAPSHOT (docs/bridge.md)
        self.debug = bool(os.environ.get("SHMPS_BRIDGE_DEBUG"))
        # per-shard lines of an event: each at DEBUG, one summary at INFO/WARNING
        self.shard_log = ShardLog(log)
        self._initial = set(configured)
        self._ever_acted = False                 # this host has owned shards at some time
        self._had_quorum = self.members.has_quorum()   # at the last membership change
        self._last_run = time.monotonic()        # see _check_stall
        self._join_progress_at = 0.0             # joining: next progress line (0: first)
        #: fault injection for tests (SHMPS_BRIDGE_FAILPOINTS, comma-separated names, each
        #: with an optional =argument): name -> argument ("" without one)
        self._failpoints = {k: v for k, _, v in (
            x.partition("=") for x in os.environ.get("SHMPS_BRIDGE_FAILPOINTS", "").split(",")
            if x)}
        self._dropped: set[tuple] = set()
        #: reads and encodes snapshots off the event loop, one at a time, the hand-overs
        #: that new owners wait for first (_send_snapshot_now)
        self._snap_reader = urgent.UrgentWorker("shmps-snapshot")
        #: backs the pages of this host's copies of peers' tensors off the event loop
        #: (_back_pages): the segments (name, size, inode) of each copy not yet known
        #: backed, from its creation on (Store.unbacked_bytes counts what they still
        #: need), and the names of those whose backing is under way
        self._backer = urgent.UrgentWorker("shmps-backing")
        self._unbacked: dict[str, list[tuple[str, int, int]]] = {}
        self._backing: set[str] = set()
        #: tensors this host has no room for and stays on the ring without, as the others
        #: would have no majority without it (_no_room): name -> why, in /health
        self.no_room: dict[str, str] = {}
        self._no_room_logged: dict[str, float] = {}
        #: why this bridge left on its own (_no_room): serve raises it once it has left
        self.fatal: Optional[Error] = None
        self._gone: set[tuple[int, int]] = set()  # (member id, incarnation) of processes
                                                  # that restarted since: filters forgotten
        #: member -> incarnation of its process that left on purpose (its heartbeat said
        #: handed over, and it was removed): that process exits and gives no hand-over
        #: (_left_for_good)
        self._left: dict[str, int] = {}
        self._says_joining: dict[str, int] = {}  # peer -> epoch at which it has us joining
        self._peer_view: dict[str, tuple[int, int]] = {}   # peer -> (epoch, ring digest)
        #: peers whose last heartbeat said they act (HB_ACTING) by its (epoch, ring)
        self._peer_acting: set[str] = set()
        #: peer -> ((epoch, ring digest) of this host's ring, when) it last took that
        #: peer's ROWS as the shard's owner, stamped with that epoch: the owner applied
        #: batches by that ring, and counted this host's copy for their acknowledgement
        self._fed_on: dict[str, tuple[tuple[int, int], float]] = {}
        self._kept_ring_logged: tuple[int, int, int] | None = None
        #: this host's (epoch, ring digest), and when it took it (monotonic): E3c's hold
        self._epoch_ring_since: tuple[tuple[int, int], float] = ((-1, 0), float("-inf"))
        self._hb_epoch: tuple[int, int] = (-1, 0)   # (epoch, digest) last sent
        self._hb_acting = False   # the last heartbeat sent said this host acts (HB_ACTING)
        self._view_waits: set[tuple] = set()   # streams that may wait on view_wait
        self._hb_wake: Optional[asyncio.Event] = None   # set: send a heartbeat now

    # ------------------------------------------------------------ life cycle
    async def start(self) -> None:
        import aiohttp
        from aiohttp import web

        import shmps

        if self._stop_event is None:   # (serve() makes it first, for its signal handlers)
            self._stop_event = asyncio.Event()
        try:
            await self._start(aiohttp, web, shmps)
        except BaseException:
            # a bridge that could not start leaves nothing behind: the listener, the
            # session, and the store's forwarding switch (off again unless it was set)
            if self.store is not None and self._set_forwarding_here:
                self.store._set_forwarding(False)
            # and the store, if its attach made it and it is still empty (a port in use
            # left an empty store that `shmps-tool ls` listed): one a worker made, or
            # has tensors in, or is attached to, is kept
            made = (self._made_store and self.store is not None
                    and not self.store.tensors())
            await self.close()
            if made:
                self._remove_made_store()
            raise

    def _remove_made_store(self) -> None:
        """Remove the empty store this bridge's start made, unless a process is
        attached to it (a worker that attached since: remove_idle keeps it) or it has a
        tensor now (a worker made one and went while this bridge closed: looked at again
        just before the removal's claim; a worker that attaches, makes a tensor and goes
        within those microseconds is the one case left)."""
        from ..store import remove_idle
        try:
            removed = remove_idle(self.cfg.store, self.cfg.namespace, only_empty=True)
        except (Error, OSError) as e:   # (the start's own error is the one to report)
            log.warning("could not remove the empty store %r this bridge made: %s",
                        self.cfg.store, e)
            return
        if removed:
            log.info("removed the empty store %r this bridge made at its start",
                     self.cfg.store)

    async def _start(self, aiohttp: Any, web: Any, shmps: Any) -> None:
        app = web.Application(client_max_size=64 << 10)
        app.router.add_get("/health", self.h_health)
        app.router.add_get("/metrics", self.h_metrics)
        app.router.add_get("/v1/stream", self.h_stream)
        app.router.add_get("/v1/catalog", self.h_catalog)
        app.router.add_post("/v1/members", self.h_members)
        app.router.add_post("/v1/structure", self.h_structure)
        # close() closes every incoming stream itself; the shutdown timeout only bounds
        # a handler that is still busy (aiohttp's default would wait 60 s)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                    shutdown_timeout=SHUTDOWN_TIMEOUT)
        await self.runner.setup()
        # One bridge process per store, and its address, before anything touches an
        # outbox: a bridge that cannot have them (the same command run twice, a second
        # bridge of the store on another address, a port taken) leaves the store as it
        # was.  (It switched forwarding on and recovered the outboxes first: a second
        # bridge of a store recorded the live one's batches in flight as lost, and a
        # failed start left the store forwarding with no bridge, every later push held.)
        # (whether the attach below makes the store: a start that fails removes it again.
        # A worker making it in between is kept: it has tensors or is attached)
        self._made_store = not os.path.exists(
            "/dev/shm" + names.manifest_name(self.cfg.store, self.cfg.namespace))
        self.store = shmps.attach(self.cfg.store, namespace=self.cfg.namespace)
        # the copies of peers' tensors and the outboxes this bridge creates are not backed
        # page by page at creation (Store.reserve_memory): that is a pass over all their
        # memory on the event loop (a 192 MiB Adam shard and its outbox: 250-300 ms late
        # heartbeats, a bridge counts itself stalled from half of --dead-after); a thread
        # backs them right after (_back_pages), and creation refuses a tensor larger than
        # the free space (segment.check_room)
        self.store.reserve_memory = False
        self.store.unbacked_bytes = self._still_unbacked
        await self._lock_store()
        host, port = socket_address(self.addr)
        self._site = web.TCPSite(self.runner, host, port, reuse_address=True)
        try:
            await self._site.start()
        except OSError as e:
            # one line of ours, not aiohttp's "error while attempting to bind on address
            # (...): address already in use" inside it
            if e.errno == errno.EADDRINUSE:
                raise Error(f"{self.addr} is in use (another shmps-bridge?); pick another "
                            "--listen or stop it") from None
            why = os.strerror(e.errno) if e.errno else str(e)
            raise Error(f"cannot listen on {self.addr}: {why}", "is it an address of "
                        "this machine, as hosts.txt lists it? pass --listen") from None
        # no await from here to the tasks: no request is served before the store is ready
        self._set_forwarding_here = not self.store._forwarding
        self.store._set_forwarding(True)
        self.refresh_tensors(budget=None)   # before serving anything: no peer waits yet
        self.session = aiohttp.ClientSession()
        for m in self.members.configured:
            if m != self.addr:
                self.links[m] = Link(self, m)
        loop = asyncio.get_running_loop()
        self._waiter = threading.Thread(target=self._flush_waiter, args=(loop,),
                                        name="shmps-flush-waiter", daemon=True)
        self._waiter.start()
        # store.flush() rings this (shmps/doorbell.py); the waiter above is the fallback
        if not self._listen_doorbell():
            log.warning("the flush doorbell of store %r is taken (another bridge process "
                        "of it still ending?): until it is free (tried again every %g s) "
                        "store.flush() wakes this bridge through the manifest's futex word, "
                        "or not at all while the other process holds the doorbell",
                        self.store.name, DOORBELL_RETRY)
        self._tasks += [loop.create_task(self._heartbeat_loop(), name="heartbeat"),
                        loop.create_task(self._tick_loop(), name="tick"),
                        loop.create_task(self._flush_loop(), name="flush"),
                        loop.create_task(self._catalog_loop(), name="catalog"),
                        watch_file(self.cfg.peers_file, self._on_hosts_file, 0.25,
                                   settle=HOSTS_SETTLE)]
        log.info("bridge %s up (store %r, namespace %r, incarnation %08x, %d members, "
                 "replicas %d)", self.addr, self.cfg.store, self.cfg.namespace,
                 self.incarnation, len(self.members.configured), self.cfg.replicas)
        if self.cfg.replicas > len(self.members.configured):
            log.warning("--replicas %d with %d members: each shard has a copy on every "
                        "host, %d in all, until more hosts join", self.cfg.replicas,
                        len(self.members.configured), len(self.members.configured))

    async def _lock_store(self) -> None:
        """Take the store's bridge lock: an exclusive flock of its manifest file, which
        the kernel drops when this process ends (only bridges take it; workers never
        do).  Another bridge process of the store holding it (running, or still
        ending), wait up to BRIDGE_LOCK_WAIT s, then a typed error saying so."""
        path = "/dev/shm" + names.manifest_name(self.cfg.store, self.cfg.namespace)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        deadline = time.monotonic() + BRIDGE_LOCK_WAIT
        said = False
        ns = f" namespace {self.cfg.namespace!r}" if self.cfg.namespace else ""
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    pass
                if self._stop_event is not None and self._stop_event.is_set():
                    raise StoppedBeforeStart("SIGTERM while waiting for the bridge lock")
                if time.monotonic() >= deadline or not said:   # (for the messages only)
                    holder = _flock_holder(fd)
                    who = f" (pid {holder})" if holder else ""
                if time.monotonic() >= deadline:
                    raise InvalidArgument(
                        f"another shmps-bridge process{who} is running for store "
                        f"{self.cfg.store!r}{ns} (it holds the store's bridge lock, still "
                        f"after {BRIDGE_LOCK_WAIT:g} s)",
                        hint="stop it first (SIGTERM), or wait until it has ended: one "
                             "bridge process per store and namespace")
                if not said:
                    said = True
                    log.warning("another bridge process%s of store %r%s holds its bridge lock: "
                                "waiting up to %g s for it to end (one still leaving after a "
                                "SIGTERM does) before touching the store", who,
                                self.cfg.store, ns, BRIDGE_LOCK_WAIT)
                await asyncio.sleep(0.1)
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd
        if said:
            log.info("the other bridge process of store %r has ended: starting",
                     self.cfg.store)

    def request_stop(self, signalled: bool = False) -> None:
        """Leave (serve calls leave()): on SIGTERM or SIGINT (``signalled``), or when this
        host was removed from the members.  A second signal while leaving makes it leave
        at once (its waits end; what was drained and not yet acknowledged is recorded
        lost by the next bridge on the store); a removal is no signal, so the first
        SIGTERM after one does not hurry the leave it started."""
        if self._stop_event is not None:
            if signalled:
                self._signals += 1
                if self._signals == 2:
                    self._hurry = True
                    log.warning("asked to stop again: leaving without waiting for "
                                "acknowledgements or the hand-over")
            self._stop_event.set()

    def _on_signal(self) -> None:
        self.request_stop(signalled=True)

    async def run_until_stopped(self) -> None:
        assert self._stop_event is not None
        await self._stop_event.wait()

    async def leave(self, timeout: float = 10.0) -> None:
        """Leave on purpose: stop owning after the others took over, forward what this
        host's workers pushed, then hand over."""
        self.leaving = True
        self.members.mark_leaving(self.addr)
        self._poke_tick()
        deadline = time.monotonic() + timeout

        async def wait_while(cond: Callable[[], bool], until: float) -> None:
            while cond() and time.monotonic() < until and not self._hurry:
                await asyncio.sleep(0.02)

        # a tensor a worker created a moment ago: taken up, so that its initial values
        # are given too (_init_not_given, below)
        await self.refresh_all_tensors()
        self._give_initial_values()
        give_at = [time.monotonic() + 0.25]

        def give_again() -> None:
            # every 0.25 s from here on, the wait for this host's pushes included: the
            # owners asked whether they wait for the initial values that have not
            # answered INIT_ASK_S on are sent them, those that answered BUSY asked
            # again.  (Looked at only after that wait, an unanswered question's values
            # went up to the leave's deadline less 2 s late, where before the question
            # they went at its start: review H4 of 2026-11-28)
            if time.monotonic() >= give_at[0]:
                give_at[0] = time.monotonic() + 0.25
                self._give_initial_values()

        # this host's own pushes reach their owners first: what store.flush would wait
        # for now, waited for on this loop (which keeps draining and sending meanwhile,
        # and a second signal ends the wait)
        waits = unacknowledged(self.store)
        self._wake_flush()

        def unacked() -> bool:
            give_again()
            return any(outbox_counters(ob, s)[1] < pushed for ob, s, pushed in waits)
        await wait_while(unacked, deadline - 2.0)
        if unacked():
            log.warning("leaving with pushes not yet acknowledged by their owners")
        # the shards this host owns with no backup (--replicas 1): their next owner must
        # hold every batch acknowledged here before the others drop this host and it
        # takes over, or its copy lacks them (section 7 of bridge-protocol.md)
        # And the owners of the shards of a tensor created here just now hold its initial
        # values: an owner that had not taken the tensor up refused them (BUSY), and one
        # that takes it up once this host is counted gone (handed_over, below) waits for
        # nothing and serves the schema's init (a creator stopped as soon as its bridge
        # forwarded the tensor left every shard so in 3 of 8 runs: its leave, owning no
        # shard of it, ended before its peers' catalog passes)
        nexts = self._leave_targets()

        def not_given() -> list:
            give_again()   # (again: those refused BUSY, those unanswered)
            return self._init_not_given()
        # (both looked at on every poll: not_given sends again, and ran only once no next
        # owner lacked this host's changes when the two were or-ed: review H5 F1)
        await wait_while(lambda: bool(not_given()) | bool(self._not_left(nexts)),
                         deadline - 1.5)
        behind = self._not_left(nexts)
        if behind:
            log.warning("leaving before the next owners of %d shards took this host's last "
                        "changes: acknowledged pushes to them may be lost", len(behind))
        if self._init_not_given():
            log.warning("leaving before the owners of %d shards of tensors created here "
                        "took their initial values", len(self._init_not_given()))
        held = sum(self._init_answer(st, owner) is False
                   for _, st, owner in self._fresh_shards_of_others(time.monotonic()))
        if held:
            # (no snapshot, no refusal to count: without this line nothing told that
            # those values were not sent)
            log.info("leaving: the owners of %d shards of tensors created here wait for "
                     "none of their initial values (INIT_QUERY: they hold them): not sent",
                     held)
        # then no more drains: pushes made from now on stay in the outboxes, counted, for
        # the next bridge on this store, and what was drained is acknowledged before this
        # process ends (it kept draining the workers' newer pushes, and ended with some
        # of them unacknowledged: the next bridge recorded them lost, PushesLost)
        self._drains_stopped = True
        await wait_while(lambda: any(len(st.q) for st in self.streams.values()),
                         deadline - 1.0)
        in_flight = sum(len(st.q) for st in self.streams.values())
        if in_flight:
            log.warning("leaving with %d batches not yet acknowledged by their owners: the "
                        "next bridge on this store records their pushes lost", in_flight)
        self.handed_over = True
        log.info("leaving: this host's pushes are acknowledged; handed over")
        # wait until the others dropped this host from the ring, and hand its shards over
        await wait_while(self._others_still_see_me, deadline)
        if self._others_still_see_me() and not self._hurry:
            log.warning("leaving: %s still count this host in after %g s", ", ".join(
                p for p, r in self._peer_rings.items() if self.addr in r), timeout)
        # the hand-over snapshots are read in the snapshot thread: queued before closing
        await wait_while(lambda: any(st.reading is not None for st in self.shards.values()),
                         deadline)
        if not self._hurry:
            await asyncio.sleep(0.1)

    def _give_initial_values(self) -> None:
        """Leaving: send the initial values of the shards of tensors this host created,
        which this process took up less than INIT_GIVE_S ago, as hand-overs to each such
        shard's owner (a reachable peer) that may still wait for them: its SYNC may come
        after this process is gone, and it then served its own copy, the schema's init
        instead of the init= array (review 24 F7: 5 to 7 of 16 shards in 2 of 3 runs of
        a creator SIGTERMed once every bridge took the tensor up).

        Each owner is asked first (INIT_QUERY; the questions to one owner corked into
        one message) and answers from its own state (_on_init_query).  One that waits
        for them gets them (at once: _on_init_answer).  One that does not, and never
        will (its own worker created the tensor too, or it took them, or served its own
        copy), gets nothing and is not waited for: it refused them as no hand-over of
        its own (on_rows), and before the question a leave from a store whose every
        host created its tensors read and sent every shard its peers own, and waited for
        the refusals (one outlasted the SIGTERM-while-pushing cluster test's worker).
        One that has not taken the tensor up answers BUSY and is asked again on the next
        call (every 0.25 s: it may wait for them once it has).  One that has not
        answered INIT_ASK_S after the question, or that there is no link to ask on, is
        sent them as before there was a question.  A hand-over is sent again when its
        owner has not answered it INIT_RESEND_S after it was queued (the connection
        reset, the chunks or the answer lost with it: review H5 F2).  The leave waits
        for every owner's answer (_init_not_given) until its deadline."""
        now = time.monotonic()
        with self.cork:   # (the questions to one owner go as one message)
            for key, st, owner in self._fresh_shards_of_others(now):
                if st.init_given == owner:
                    continue
                waits = self._init_answer(st, owner)
                if waits is False:
                    continue
                if st.init_served == owner:
                    if (st.reading is None and now - st.init_sent_at > INIT_RESEND_S):
                        self._hand_over(key, owner)
                    continue
                if waits is None:
                    if st.init_waits is not None and st.init_waits[0] == owner:
                        # the answer of the owner's earlier process: its new one is asked
                        st.init_waits, st.init_asked = None, None
                    if st.init_asked != owner:
                        if self._ask_init(key, owner):
                            st.init_asked, st.init_asked_at = owner, now
                            continue
                    elif now - st.init_asked_at <= INIT_ASK_S:
                        continue   # (its answer may come)
                self._hand_over(key, owner)

    def _ask_init(self, key: tuple, owner: str) -> bool:
        """Leaving: ask ``owner`` whether it still waits for this host's initial values
        of shard ``key`` (INIT_QUERY, on this host's link to it, as its SYNCs come the
        other way); False if there is no connection to ask on."""
        link = self.links.get(owner)
        if link is None or not link.send(frames.encode_init_query(
                epoch=self.members.epoch, sender=self.mid, incarnation=self.incarnation,
                tensor=key[0], shard=key[1])):
            return False
        self.metrics.sent("init_query", frames.HEADER.size)
        return True

    def _init_answer(self, st: ShardState, owner: str) -> Optional[bool]:
        """Whether ``owner``'s bridge process said it waits for this host's initial
        values of ``st`` (INIT_QUERY), None without an answer from its current process
        (a restarted one is asked again: its answer is its own)."""
        ans = st.init_waits
        if ans is None or ans[0] != owner or self._incarnations.get(owner, ans[1]) != ans[1]:
            return None
        return bool(ans[2])

    def _init_not_given(self) -> list:
        """Leaving: the shards of tensors created here and taken up less than INIT_GIVE_S
        ago whose owner, a reachable peer, has not answered a hand-over of their initial
        values from this process (ShardState.init_given; one refused BUSY, the tensor
        not taken up there yet, is sent again: _give_initial_values) and has not said
        it waits for none (ShardState.init_waits)."""
        return [key for key, st, owner in self._fresh_shards_of_others(time.monotonic())
                if st.init_given != owner and self._init_answer(st, owner) is not False]

    def _fresh_shards_of_others(self, now: float) -> Iterator[tuple]:
        """(key, ShardState, owner) of each shard of a tensor created here and taken up
        less than INIT_GIVE_S before ``now`` (_fresh_origin) that a reachable peer owns."""
        reach = self.members.reachable()
        for key, st in self.shards.items():
            owner = self.owner(st.key)
            if (owner and owner != self.addr and owner in reach
                    and self._fresh_origin(key, now)):
                yield key, st, owner

    def _fresh_origin(self, key: tuple, now: float) -> bool:
        """Shard ``key`` is of a tensor created here that this process took up less than
        INIT_GIVE_S before ``now``: its owners and backups may lack its initial values
        (a leave gives them: _give_initial_values, _leave_targets)."""
        return now - self.shards[key].taken_up_at < INIT_GIVE_S and self._is_origin(key)

    def _leave_targets(self) -> dict:
        """Leaving: for each shard this host owns whose owner on the ring without it is
        not one of its backups now (no backup: --replicas 1), that next owner, recorded
        in ``ShardState.leave_to``: an owner waits for it like a backup from now on
        (_required), so every batch acknowledged here is in its copy.  (With backups the
        next owner is the first of them, which holds every acknowledged batch already.)"""
        rest = [m for m, s in self.members.states().items()
                if s in ON_RING and m != self.addr]
        if not rest:
            return {}
        future = Ring(rest)
        out = {}
        now = time.monotonic()
        for key, st in self.shards.items():
            if self.owner(st.key) != self.addr:
                continue
            nxt = future.owner(st.key)
            # (a shard of a tensor created here and taken up just now: its backups may
            # not hold its initial values yet, and the next owner takes over from its
            # backup copy: waited for like a next owner without a backup.  A creator
            # SIGTERMed as every bridge took its tensor up left those shards with the
            # schema's init everywhere: review 24 F7)
            if nxt in self._required(st) and not self._fresh_origin(key, now):
                continue
            st.leave_to = nxt
            out[key] = nxt
        if out:
            log.info("leaving: waiting for the next owners of %d shards with no backup (or "
                     "none with a copy yet) to "
                     "take this host's last changes", len(out))
        self._unsettle()      # (the maintenance pass copies a next owner without a copy)
        return out

    def _not_left(self, nexts: dict) -> list:
        """The shards of ``nexts`` (_leave_targets) still this host's whose next owner
        holds no copy yet or has not acknowledged the last ROWS this host sent of it."""
        behind = []
        for key, nxt in nexts.items():
            st = self.shards.get(key)
            if st is None or self.owner(st.key) != self.addr:
                continue      # (no longer this host's to hand over)
            if nxt not in st.synced or st.acked.get(nxt, 0) < st.rows_rseq:
                behind.append(key)
        return behind

    async def close(self) -> None:
        # stop accepting first: a peer whose stream is closed below connects again at
        # once, and a handler started after the streams were closed would hold the
        # runner's cleanup until its shutdown timeout
        self._closing = True
        self.shard_log.flush(force=True)
        if self._site is not None:
            await self._bounded(self._site.stop(), "stopping the listener")
        for t in self._tasks:
            t.cancel()
        for link in self.links.values():
            link.task.cancel()
        for c in list(self.incoming.values()):
            await c.close()
        for stream in list(self._streams):   # the ones still in their handshake
            stream.close()
        await self._bounded(asyncio.gather(*self._tasks, *(ln.task for ln in self.links.values()),
                                           return_exceptions=True), "ending its tasks")
        if self.session is not None:
            await self._bounded(self.session.close(), "closing its client session")
        if self.runner is not None:
            await self._bounded(self.runner.cleanup(), "cleaning up the web server")
        if self._doorbell is not None:
            asyncio.get_running_loop().remove_reader(self._doorbell.fileno())
            self._doorbell.close()
            self._doorbell = None
        if self._waiter is not None:
            self._waiter_stop = True
            lib.shmps_flush_request(self.store._mptr)   # wakes it
            self._waiter.join(5)
        # a snapshot read under way ends before the store it reads is unmapped (the
        # ones queued behind it are dropped)
        self._snap_reader.shutdown()
        self._backer.shutdown()
        if self.store is not None:
            self.store.close()
        if self._lock_fd is not None:   # the next bridge of the store may start
            os.close(self._lock_fd)
            self._lock_fd = None
        # (what the ended tasks added since the first look: their summaries were lost)
        self.shard_log.flush(force=True)

    @staticmethod
    async def _bounded(step: Any, what: str) -> None:
        """Await one step of close() for at most CLOSE_STEP_TIMEOUT seconds: a bridge
        told to stop exits even if a step hangs (one did once in CI, after a leave on
        SIGTERM: the bridge never logged "stopped"), and the log says which."""
        try:
            await asyncio.wait_for(step, CLOSE_STEP_TIMEOUT)
        except asyncio.TimeoutError:
            log.warning("closing: %s took over %g s; going on without it", what,
                        CLOSE_STEP_TIMEOUT)

    # ------------------------------------------------------------ tensors
    def refresh_tensors(self, budget: Optional[float] = ADOPT_SLICE) -> bool:
        """Pick up tensors created since the last look (workers create them, or the
        catalog sync): True if some are left for the next call, which happens once
        ``budget`` seconds were spent (None: no limit).  A model of hundreds of tensors
        is picked up a slice at a time, the event loop running between slices
        (heartbeats), not in one stall that peers would take for a dead host.

        Every call in one turn of the event loop shares one ``budget``, counted from the
        turn's first call: one socket read can carry the frames of hundreds of tensors
        not taken up yet, each frame calling this (_tensor_for), and a slice each kept
        the loop for seconds (a stall counted in CI, 2026-11-27: 290 ms between two
        ticks).  A call that finds the turn's slice spent does nothing and returns True
        (the frame is refused BUSY and resent; the catalog sync takes up the rest)."""
        deadline: Optional[float] = None
        if budget is not None:
            now = time.monotonic()
            # (a slice ended over a second ago is a turn whose end never ran: the loop
            # stopped before its call_soon; review 15 F11)
            if self._adopt_deadline is None or now > self._adopt_deadline + 1.0:
                self._adopt_deadline = now + budget
                asyncio.get_running_loop().call_soon(self._end_adopt_turn)
            deadline = self._adopt_deadline
            if now > deadline:
                return True
        self.store._refresh()
        records = self.store._record_list
        while self._records_seen < len(records):
            if deadline is not None and time.monotonic() > deadline:
                return True
            rec = records[self._records_seen]
            self._records_seen += 1   # looked at once: a refused one is not logged again
            if not _user_record(rec) or rec["name"] in self.by_name:
                continue
            tid = frames.tensor_id(rec["name"])
            if tid in self.tensors:
                log.error("tensors %r and %r have the same 32-bit id; %r is not forwarded",
                          self.tensors[tid].name, rec["name"], rec["name"])
                continue
            # Opening a tensor (mapping its segments) and creating or opening its outbox
            # take ~0.1 ms a shard each: a tensor of thousands of shards is taken up in
            # three steps, one a slice, so no single step keeps the loop for long.
            opened = rec["name"] in self.store._tensors
            try:
                t = self.store[rec["name"]]
            except Error:
                self._records_seen -= 1   # not openable yet: looked at again next time
                raise
            if budget is not None and (not opened or t._ob is None):
                if opened:
                    t._outbox()
                self._records_seen -= 1   # the next step of this record comes next slice
                return True
            dt = np.dtype(rec["dtype"])
            gdt = np.dtype("float32") if dt == np.float16 else dt
            bounds = None
            if rec["kind"] == "dense":
                shape = tuple(rec["shape"])
                row_shape = shape[1:]
                cols = int(np.prod(row_shape, dtype=np.int64)) if shape else 1
                nrows: Optional[int] = shape[0] if shape else 1
            elif rec["kind"] == "csr":
                # entries cross as rows of one value (CSRTensor's bridge side)
                row_shape, cols, nrows = (), 1, int(rec["nnz"])
                bounds = [int(b) for b in t._entry_bounds]
            else:
                row_shape = (int(rec["dim"]),)
                cols = int(rec["dim"])
                nrows = None
            if cols * gdt.itemsize + 4096 > frames.MAX_FRAME_BYTES:
                log.error("tensor %r: one row (%d bytes) does not fit in a frame; it is not "
                          "forwarded", rec["name"], cols * gdt.itemsize)
                continue
            info = TInfo(rec["name"], tid, rec["kind"], t, int(rec["nshards"]), dt, gdt, cols,
                         row_shape, nrows, int(rec.get("shard_rows", 1)), rec, bounds=bounds)
            # what an earlier bridge process on this store drained and took with it: one
            # ERROR line a tensor, each shard's at DEBUG (a line a shard was 512 ERROR
            # lines for a tensor of 512 shards at each restart after a kill)
            lost_of = [(s, n) for s in range(info.nshards) if (n := t._outbox_recover(s))]
            if lost_of:
                self._acks_new = True   # recover acknowledged the lost ranges: the
                self._tell_acks()       # flushes waiting past them raise PushesLost now
                total = sum(n for _, n in lost_of)
                self.metrics.lost.inc(total)
                for s, n in lost_of:
                    log.debug("tensor %r shard %d: %d pushes were taken by an earlier bridge "
                              "process that ended before their owner acknowledged them",
                              rec["name"], s, n)
                log.error("tensor %r: %d pushes of %d shards (%s%s) were taken by an earlier "
                          "bridge process that ended before their owner acknowledged them; "
                          "store.flush() raises PushesLost for them", rec["name"], total,
                          len(lost_of), ", ".join(str(s) for s, _ in lost_of[:6]),
                          ", ..." if len(lost_of) > 6 else "")
            self.tensors[tid] = info
            self.by_name[info.name] = info
            self._back_pages(info.name)
            origin = self.adopted.get(info.name)
            if (origin is None and isinstance(rec.get("origin"), str)
                    and rec["origin"] != self.addr):
                # a copy an earlier bridge process on this store made of a peer's tensor
                # (create_from_record): not created here, though this process did not
                # adopt it (_is_origin; a restarted bridge took every copy it had adopted
                # for its own creation, and its leave sent each as initial values: review
                # H1 F1).  No wait for the origin's copy: this one is a copy already.
                self.adopted[info.name] = rec["origin"]
            self._poke_tick()   # (a shard pass for the new shards)
            for s in range(info.nshards):
                self.shards[(tid, s)] = ShardState(
                    shard_key(info.name, s),
                    snap_broken=self._unknown_snap_broken.pop((tid, s), None) or {})
                self.streams[(tid, s)] = SendStream(OutQueue(self.budget))
                self._role_change((tid, s), None, self.owners(shard_key(info.name, s)))
                if (origin is not None and self.owner(shard_key(info.name, s)) == self.addr
                        and origin in self.members.reachable()
                        and self.members.state(self.addr) in (State.ALIVE, State.SUSPECT,
                                                              State.LEAVING)):
                    # an owner of a tensor created elsewhere starts from the origin's
                    # copy (its initial values), asked for as a hand-over snapshot;
                    # batches wait (BUSY) until it is here.  (A joining host copies
                    # every shard from its owner before it owns any.)
                    st = self.shards[(tid, s)]
                    st.handover_from = origin
                    st.handover_init = True
                    st.handover_since = 0
                    st.handover_until = time.monotonic() + HANDOVER_TIMEOUT
            log.info("forwarding tensor %r (%s, %d shards)", info.name, info.kind, info.nshards)
        return False

    def _back_pages(self, name: str) -> None:
        """Back every page of this host's copy of tensor ``name`` not backed yet (one this
        bridge created, or an earlier bridge process of the store did and ended first)
        in the ``shmps-backing`` thread: posix_fallocate runs without the GIL, so the
        event loop goes on meanwhile (at creation it was a pass of ~1 ms a MiB on the
        loop).  A copy is written whole by its snapshot anyway, so this costs no memory
        it would not take.  Outboxes are not backed: one is as large as its tensor (a
        table's: its capacity) and holds only what is pushed, and backing every outbox
        on every host doubled the model's resident memory (an idle table's outbox
        included).  Until it is done, a touch of a page that /dev/shm then has no room
        for (a write, or a read of a page never written) kills the toucher with SIGBUS:
        creation refused a copy that does not fit beside what the copies not yet backed
        still need (Store.unbacked_bytes), and a backing that fails all the same
        (another process took the room meanwhile) makes this host leave (_no_room)."""
        info = self.by_name.get(name)
        if info is None or self._closing or name in self._backing:
            return
        segs = [(sh.seg.name, sh.seg.size, sh.seg.ino) for sh in (info.t._shards or ())]
        segs = [x for x in segs if segment.unbacked_bytes(*x)]
        if not segs:
            self._unbacked.pop(name, None)
            return

        def back() -> None:
            for n, size, ino in segs:
                segment.allocate(n, size, ino)

        self._unbacked[name] = segs
        self._backing.add(name)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:              # not started (tests drive a Node by hand)
            try:
                back()
            except Error as exc:
                return self._backed(name, exc)
            return self._backed(name, None)
        try:
            fut = self._backer.submit(0, back)
        except RuntimeError:   # shut down: closing
            return
        fut.add_done_callback(lambda f: f.cancelled() or loop.call_soon_threadsafe(
            self._backed, name, f.exception()))

    def _still_unbacked(self) -> int:
        """Bytes of /dev/shm this host's copies not yet backed still need (their pages
        not allocated yet): Store.unbacked_bytes, for the room check of a new copy.
        O(segments of those copies): a stat each."""
        return sum(segment.unbacked_bytes(*x) for segs in self._unbacked.values()
                   for x in segs)

    def _backed(self, name: str, exc: Optional[BaseException]) -> None:
        self._backing.discard(name)
        if exc is None:
            self._unbacked.pop(name, None)
            return
        if isinstance(exc, Error):
            self._no_room(name, exc, backing=True)
        else:
            log.error("tensor %r: backing this host's copy failed: %r", name, exc)

    def _others_go_on(self) -> bool:
        """The other hosts on the ring (alive, suspect or joining) hold a majority of the
        members without this one (or, with --allow-minority, there is one)."""
        others = {m for m in self.members.reachable() - {self.addr}
                  if self.members.state(m) != State.LEAVING}
        return bool(others) and self.members.has_quorum(others)

    def _no_room(self, name: str, exc: Error, backing: bool = False) -> None:
        """This host's /dev/shm has no room for its copy of a peer's tensor ``name``
        (creating it, or backing it, failed with ``exc``).  A host on the ring without a
        copy stalls every shard of the tensor it owns or backs (owners wait for their
        backups, senders for their owner), and so every flush() of it; a copy with
        pages missing kills whoever touches one with SIGBUS.  So it leaves the cluster,
        as on SIGTERM, and serve ends with the error once it has left: the other hosts
        own and back its shards, and training goes on without it.  A copy whose backing
        failed is left at once (the leave's waits skipped, as on a second SIGTERM: they
        touch the copy).  A copy never created is not left for when the other hosts
        would have no majority without this one (two hosts, another one down): they
        would stop owning every tensor, not only this one's shards; this host logs it
        (once a minute), reports it in /health (``no_room``), and tries again at every
        catalog pass."""
        if self.fatal is not None:
            return
        why, hint = exc.message, exc.hint or segment.NO_ROOM_HINT
        if not backing and not self._others_go_on():
            self.no_room[name] = why
            now = time.monotonic()
            if now - self._no_room_logged.get(name, -math.inf) >= 60.0:
                self._no_room_logged[name] = now
                log.error("this host's /dev/shm has no room for its copy of tensor %r (%s); "
                          "it stays in the cluster, whose other hosts would have no "
                          "majority without it, and every shard of the tensor it owns or "
                          "backs waits. To do: %s", name, why, hint)
            return
        self.fatal = CapacityError(
            f"this host's /dev/shm has no room for its copy of tensor {name!r} ({why}); "
            "it left the cluster, whose other hosts took its shards over",
            f"{hint}; then start shmps-bridge again")
        log.error("this host's /dev/shm has no room for its copy of tensor %r (%s): "
                  "leaving the cluster%s (a host without a copy would stall every shard of "
                  "it that it owns or backs; a copy not backed whole, kill whoever touches a "
                  "missing page with SIGBUS). The other hosts take its shards over. To do: "
                  "%s; then start shmps-bridge again", name, why,
                  " at once" if backing else ", as on SIGTERM", hint)
        if backing:
            self._hurry = True
        self.request_stop()

    def _end_adopt_turn(self) -> None:
        """The event loop turned: the next refresh_tensors starts a new slice."""
        self._adopt_deadline = None

    async def refresh_all_tensors(self) -> None:
        """refresh_tensors until none is left, letting the loop run between slices."""
        while self.refresh_tensors():
            await asyncio.sleep(0)

    def create_from_record(self, rec: dict, peer: Optional[str] = None,
                           structure: Optional[tuple] = None) -> None:
        """Create a tensor a peer has (same schema), so this host can own and replicate it;
        its initial values come from the host where it was created (``rec["origin"]``,
        else ``peer``), which this host's record of it names too: see refresh_tensors."""
        name = rec["name"]
        origin = rec.get("origin") if isinstance(rec.get("origin"), str) else peer
        if origin is not None and origin != self.addr:
            self.adopted[name] = origin
        else:
            origin = None
        with self.store._adopting(origin):
            self._create_like(rec, structure)
        # counted as not backed from now on (Store.unbacked_bytes), before the next copy
        # made in this catalog pass checks its room; backed once refresh_tensors takes it
        # up (_back_pages)
        self._unbacked[name] = [(sh.seg.name, sh.seg.size, sh.seg.ino)
                                for sh in self.store[name]._shards or ()]
        self.no_room.pop(name, None)

    def _create_like(self, rec: dict, structure: Optional[tuple]) -> None:
        """Create tensor ``rec["name"]`` in this host's store with the schema of ``rec``."""
        from ..updaters import from_dict

        name = rec["name"]
        if rec["kind"] == "dense":
            self.store.dense(name, tuple(rec["shape"]), rec["dtype"],
                             optimizer=from_dict(rec["optimizer"]), mode=rec.get("mode"),
                             shard_rows=int(rec["shard_rows"]),
                             allow_nonfinite=bool(rec.get("allow_nonfinite", False)))
        elif rec["kind"] == "csr":
            if structure is None:
                raise InvalidArgument(f"csr tensor {name!r}: no structure to create it with")
            rc, ci = structure
            self.store.csr(name, rc, ci, rec["dtype"], optimizer=from_dict(rec["optimizer"]),
                           shape=tuple(rec["shape"]), shard_rows=int(rec["shard_rows"]),
                           allow_nonfinite=bool(rec.get("allow_nonfinite", False)))
        elif rec["kind"] == "table":
            spec = rec.get("init_spec") or ["zeros"]
            self.store.table(name, dim=int(rec["dim"]), dtype=rec["dtype"],
                             capacity=int(rec["capacity"]),
                             optimizer=from_dict(rec["optimizer"]), init=tuple(spec),
                             seed=int(rec.get("seed", 0)), shards=int(rec["nshards"]),
                             allow_nonfinite=bool(rec.get("allow_nonfinite", False)))

    # ------------------------------------------------------------ ring and roles
    def owners(self, key: str) -> list[str]:
        o = self._owner_cache.get(key)
        if o is None:
            o = self.ring.owners(key, self.cfg.replicas) if len(self.ring) else []
            self._owner_cache[key] = o
        return o

    def owner(self, key: str) -> Optional[str]:
        o = self.owners(key)
        return o[0] if o else None

    def speaks_for_majority(self) -> bool:
        """This host has quorum, is on the ring, and its start-up grace (listening for a
        running cluster's epoch) is over: its heartbeats carry HB_QUORUM, and peers at an
        older epoch take its view over."""
        self._check_stall()
        return (time.monotonic() >= self.grace_until and self.members.has_quorum()
                and self.members.state(self.addr) in (State.ALIVE, State.SUSPECT,
                                                      State.LEAVING))

    def acting(self) -> bool:
        """This host may own shards (apply batches, acknowledge) now: it speaks for a
        majority, and a majority of the members, itself included, last said (heartbeats)
        they are at this host's epoch on this host's ring.  Hosts mint epochs on their
        own, so two could mint the same number for different rings (a host back from a
        partition, hearing one peer first); the agreement keeps either from owning a
        shard by a ring that no majority holds."""
        ok = self.speaks_for_majority() and self._ring_agreed()
        self._ever_acted = self._ever_acted or ok
        return ok

    @property
    def _epoch_ring(self) -> tuple[int, int]:
        """This host's (epoch, ring digest): what heartbeats carry and peers agree to."""
        return (self.members.epoch, self.ring.digest)

    def _ring_agreed(self) -> bool:
        if self.members.allow_minority:
            return True   # a lone host may act by its own ring (DESIGN: two-host trade-off)
        return 2 * (1 + self._peers_on_this_ring()) > len(self.members.configured)

    def _peers_on_this_ring(self, acting: bool = False) -> int:
        """How many reachable peers last said (heartbeat) that they are at this host's
        epoch and ring; with ``acting``, and that they act (own shards) by it, which a
        majority agreed to."""
        mine = self._epoch_ring
        return sum(1 for p in self.members.reachable()
                   if p != self.addr and self._peer_view.get(p) == mine
                   and (not acting or p in self._peer_acting or self._fed_by_on(p, mine)))

    def _fed_by_on(self, peer: str, view: tuple[int, int]) -> bool:
        """This host took ``peer``'s ROWS as the owner, sent (the frame says: on_rows) by
        ``view`` (epoch, ring digest), within dead_after: the owner acts by it (its
        heartbeat saying so may come later).  Not for longer: an owner that stopped acting
        on the same view (cut off one way, say) would keep a joiner on it for good."""
        fed = self._fed_on.get(peer)
        return (fed is not None and fed[0] == view
                and time.monotonic() - fed[1] < self.cfg.dead_after)

    def _keeps_its_ring(self) -> bool:
        """Joining, this host does not follow another ring of its epoch number (E3c): a peer
        owns shards by its ring, so a majority agreed to it, this host among them (its
        heartbeat says so, or this host took its ROWS as the owner sent by this epoch and
        ring, as the frame says: that owner counted this copy when it acknowledged the
        batches, and its heartbeat saying it acts may come much later, after the backlog
        it applies first; trace B2-12); or it took the ring less than three heartbeat intervals ago
        and a peer holds it (that peer acts by it with this host's agreement a round trip
        later, and says so in its next heartbeat). Followed, the same joiner agreed to two
        rings of one number a few ms apart, each owner acted by its ring with it and
        acknowledged batches once the joiner's copy held them, and then the joiner copied
        the other owner's shards over those batches (the flapping network test, traces T4
        and Y2: two hosts had each minted one number on a ring of itself; the joiner
        followed one, then the other, five times in 0.7 s). The other ring's owner takes
        this ring over (E3b) once it hears that a peer acts by it."""
        taken_at = self._epoch_ring_since[1]
        return bool(self._peers_on_this_ring(acting=True)
                    or (time.monotonic() - taken_at < 3 * self.cfg.heartbeat
                        and self._peers_on_this_ring()))

    def _copy_to_give(self, key: tuple) -> bool:
        """This host answers the owner's SYNC for shard ``key`` with a hand-over of its
        copy: it owned the shard in its previous ring, created the tensor, is on the
        ring, acknowledged batches of the shard as its owner once, or was a backup by
        the ring its last ROWS came by (the new owner may lack batches those copies
        hold, and refuses one behind its own by the marks: _behind); a joining host's
        copy may be behind otherwise.  Never while a snapshot into the copy is half
        written (its rows ahead of its marks: _send_snapshot_now)."""
        st = self.shards[key]
        return not st.snap_partial and (
            self._was_owner(key) or self._is_origin(key) or st.acked_as_owner
            or self.addr in st.fed_owners[1:] or self.members.state(self.addr) in ON_RING)

    def _on_changes(self, changes: list) -> None:
        # the epoch can move with no member changing state (adopt: a newer epoch of the
        # same ring): it is published and goes out in a heartbeat at once all the same
        self.metrics.epoch.set(self.members.epoch)
        if changes or (self._maint_sig and self.members.epoch != self._maint_sig[0]):
            self._poke_tick()   # (the next shard pass: _maintain)
        if not changes:
            self._heartbeat_if_new()
            return
        quorum = self.members.has_quorum()
        if quorum and not self._had_quorum and self._ever_acted:
            # Back in a majority after being cut off from it.  The first heartbeats heard
            # may be ones the peers sent early in the cut, which TCP delivers now, with an
            # epoch and a ring they have left since: counted, they revived the peers on
            # the old ring and agreed to it, so this host owned its old shards by its
            # stale copy for the few ms until the newer heartbeats came (it applied its
            # own workers' held pushes to that copy and acknowledged them; the hand-over
            # that followed replaced the copy, and those pushes were gone: the network
            # cut test, 2026-11-26).  Like a process back from a stall, it listens for
            # dead_after before acting, and a newer view makes it copy its shards first
            log.warning("back in a majority (epoch %d): listening for the cluster's view "
                        "for %.0f ms before acting", self.members.epoch,
                        self.cfg.dead_after * 1e3)
            self.grace_until = max(self.grace_until, time.monotonic() + self.cfg.dead_after)
        if not quorum and self._had_quorum and not self.leaving:
            # (said once a loss: it was silent, and training stopped with every flush
            # timing out, asking whether a bridge runs; hosts added to hosts.txt before
            # their bridges ran, as many as were running, did that)
            configured = list(self.members.configured)
            reached = len(self.members.reachable() & set(configured))
            log.warning("no majority of the members reachable (%d of %d, epoch %d): this "
                        "host owns no shards, and its workers' pushes wait in the outboxes, "
                        "until a majority is back (`shmps-tool members %s` shows who is "
                        "dead)", reached, len(configured), self.members.epoch, self.addr)
        self._had_quorum = quorum
        live = self.members.live()
        if tuple(self.ring.members) != tuple(live):
            old = self.ring
            self.prev_ring = old
            self.ring = old.with_members(live) if len(live) else Ring([])
            self._owner_cache.clear()
            prev_owners = {}
            for key, st in self.shards.items():
                prev_owners[key] = old.owners(st.key, self.cfg.replicas) if len(old) else []
            took: Counter = Counter()   # (previous owner, how) -> shards this host took
            gave: Counter = Counter()   # new owner -> shards this host had
            for key, st in self.shards.items():
                new = self.owners(st.key)
                self._role_change(key, prev_owners[key], new)
                prev = prev_owners[key][0] if prev_owners[key] else None
                if new and new[0] == self.addr and prev and prev != self.addr:
                    took[(prev, self._takeover_kind(prev))] += 1
                elif prev == self.addr and new and new[0] != self.addr:
                    gave[new[0]] += 1
            for sk, stream in self.streams.items():
                stream.q.rewind()
                stream.target = None
            log.info("epoch %d: ring %s", self.members.epoch, ", ".join(live) or "(empty)")
            # one line per previous (or next) owner, not per shard (DEBUG has the shards:
            # the hand-over's and the failover's own lines)
            for prev in dict.fromkeys(p for p, _ in took):
                n_ho, n_un = took[(prev, "hand-over")], took[(prev, "undecided")]
                if n_un:   # (said once decided: _decide_takeovers)
                    t = self._took_undecided.get(prev)
                    self._took_undecided[prev] = (
                        (n_ho, n_un, time.monotonic(), self.members.epoch) if t is None else
                        (t[0] + n_ho, t[1] + n_un, t[2], self.members.epoch))
                else:
                    log.info("took ownership of %d shards from %s (epoch %d): %d by "
                             "hand-over, 0 by failover", n_ho, prev, self.members.epoch, n_ho)
            for nxt, n in gave.items() if self._ever_acted else ():
                # (a host that never acted owned nothing: a joiner's first ring counted
                # it in before it heard the cluster's view)
                log.info("gave ownership of %d shards to %s (epoch %d)", n, nxt,
                         self.members.epoch)
        self._heartbeat_if_new()
        if not self.acting():
            for st in self.shards.values():
                st.pending.clear()   # see _release: only an acting owner acknowledges
        for c in changes:
            if c.old is State.JOINING:
                # waited for only while joining (_required): a member on the ring is a
                # backup or not by the ring, and an empty set keeps _required's scan of
                # the members off every acknowledgement once the join is over
                for st in self.shards.values():
                    st.joiners_copied.discard(c.member)
            if c.new is State.DEAD or c.new is None:
                for st in self.shards.values():
                    st.synced.discard(c.member)
                    st.snapshotting.pop(c.member, None)
                    st.acked.pop(c.member, None)
                self._unsettle()
            if c.new is State.JOINING or c.new is State.ALIVE:
                # back (restarted, or added again): a later death is a failover.  (Not on
                # -> leaving: the heartbeat that says "handed over" may say "leaving" too)
                self._handed_over.discard(c.member)
            if c.member == self.addr and c.new is State.JOINING:
                self.joined_at_epoch = self.members.epoch
                self._join_progress_at = 0.0
                self.ready_flag = False
                for st in self.shards.values():
                    st.snap_epoch_seen = -1
                    st.sync_sent_at = 0.0

    def _heartbeat_if_new(self) -> None:
        """Wake the heartbeat loop if this host's (epoch, ring) is not the one its last
        heartbeat carried: peers take the view over, or agree with it, a round trip after
        the change rather than an interval (acting waits for a majority's agreement);
        and if whether this host acts is not what its last heartbeat said (HB_ACTING:
        senders whose batches it refused meanwhile resend on it, _resend_view_waits).
        Also notes when that pair changed (_epoch_ring_since: E3c's hold counts from when
        this host took its epoch, not from when the ring's members last changed: a joiner
        that took a newer epoch of its ring followed another ring of that number 0.2 s
        later, its hold long over; the flapping network test, trace E3-1)."""
        now = self._epoch_ring
        if now != self._epoch_ring_since[0]:
            self._epoch_ring_since = (now, time.monotonic())
            self._resend_view_waits()   # (owners that act by this new view already)
        if self._hb_wake is not None and (self._hb_epoch != now
                                          or self._hb_acting != self.acting()):
            self._hb_wake.set()

    def _role_change(self, key: tuple, old: Optional[list], new: list) -> None:
        st = self.shards[key]
        st.first_seen.clear()   # (on_batch) a probe of an earlier role could stall a stream
        st.gapped.clear()
        prev_since = st.owner_since
        if (old[0] if old else None) != (new[0] if new else None):
            st.owner_since = self.members.epoch   # (on_rows) a new owner's tenure
            if self.members.state(self.addr) is State.JOINING and not self.ready_flag:
                # joining: the copy counts once the new owner's snapshot is here (the
                # previous owner's may lack its last ROWS, refused or cut off, which the
                # new owner holds: a joiner counted ready by it lacked acknowledged
                # pushes; the flapping network probe, 2026-11-26)
                st.snap_epoch_seen = -1
                st.sync_sent_at = 0.0
        was = bool(old) and old[0] == self.addr
        now = bool(new) and new[0] == self.addr
        if was and not now:
            # lost the shard: drop unacknowledged replies (senders resend to the new owner)
            # and hand the shard over to its new owner if it is reachable
            st.pending.clear()
            st.synced.clear()
            st.snapshotting.clear()
            st.copy_first.clear()
            st.handover_from = None   # only an owner waits for a hand-over
            st.handover_init = False
            st.handover_next = []
            # (a host that never acted owned nothing: a joiner's first ring counted it
            # in before it heard the cluster's view; nor does one listening after a stall
            # or a cut (grace): the ring it leaves is one it took from buffered
            # heartbeats, and its copy is from before the cut.  Such a hand-over of a
            # stale copy reached a host that had since made the sender the owner, which
            # took it as the owner's copy, dropped its own, and handed that over in
            # turn: pushes applied during the cut were gone, and the new owner's
            # duplicate filter, from before the cut, asked for seqs long acknowledged,
            # GAP after GAP, for good: the network cut test, 2026-11-26)
            if (new and new[0] in self.members.reachable() and self._ever_acted
                    and time.monotonic() >= self.grace_until):
                self._hand_over(key, new[0])
        elif now and not was:
            st.handover_init = False   # (refresh_tensors sets it after, for a creator's)
            st.synced = set()
            st.joiners_copied = set()
            st.snapshotting = {}
            st.copy_first = {}
            st.acked = {}
            prev = old[0] if old else None
            st.handover_since = prev_since   # (on_rows: the previous owner's ROWS)
            st.handover_prev = prev
            # The previous owner acknowledged a batch only once its backups had its rows,
            # so their copies hold every acknowledged push.  This host's copy does if it
            # was one of them; otherwise (a joiner that became owner, which the views of
            # a flapping network can make before the owner waited for it) it may be
            # behind, and if the previous owner's hand-over does not come, a backup's
            # copy is taken instead (_handover_given_up).  (Serving its own copy, a
            # joiner cut off from its rows' stream, then made owner as the previous
            # owner was cut off in turn, lacked batches that owner had acknowledged; it
            # copied that over the backup's complete copy, and the senders' filters
            # were ahead of it: GAP for good.  The flapping network test, 2026-11-26.)
            # Its backups are the shard's owners after the first in the ring by which this
            # host last took the owner's ROWS, and in the ring before this one; this
            # host's copy is complete if it is one of them in both.  (The ring before
            # may be one the previous owner never acted by: that owner, cut off, never
            # reached it.  This host, back from a cut of its own and a backup in it,
            # served a copy that had missed the rows its last ROWS' ring's backup got.)
            # When this host's copy may be incomplete, the owner whose ROWS it last took
            # is asked after those backups: it held every batch it acknowledged, and
            # may be reachable while they are not (joining: in the flapping network
            # test a host made owner on a ring of itself, its previous owner dead, that
            # owner's backup gone, served a copy that lacked the batches the owner
            # before had acknowledged, while that owner, back and joining, held them).
            # The hand-over's marks decide (_behind): one behind this copy is refused.
            # And only if that ROWS (or SNAPSHOT: an owner copies every member at the
            # start of its tenure) came in the previous owner's last tenure: one of an
            # earlier one says nothing of the batches it acknowledged since.  (Trace Y1:
            # a host took its last ROWS of a shard as the backup of A; B owned the shard
            # for an epoch and acknowledged batches with A; A owned it again, cut off
            # before it copied this host; made owner, this host served its copy
            # without B's batches.)
            # Nor while a snapshot into this copy is half written (st.snap_partial): its
            # rows are partly the sender's, with batches this copy's duplicate filter does
            # not hold (that filter comes with the LAST), partly this copy's own.  The
            # first chunk set fed_owners like any frame of the owner; made owner, this
            # host applied again, on the rows of that chunk, a batch its sender resent,
            # which the dead owner had applied and acknowledged to nobody (review H20).
            old_bk, fed_bk = (old or [])[1:], (st.fed_owners or old or [])[1:]
            complete = (self.addr in old_bk and self.addr in fed_bk
                        and (not st.fed_owners or st.fed_epoch >= prev_since)
                        and not st.snap_partial)
            backups = [] if complete else list(
                dict.fromkeys(b for b in fed_bk + old_bk + st.fed_owners[:1]
                              if b != self.addr and b != prev))
            st.handover_next = []
            # With this host's copy incomplete, a host of those cut off before its copy
            # came is waited for to come back until the hold ends, and so is the previous
            # owner if it is gone at the change (it held every batch it acknowledged):
            # a cut in a flapping network lasts about a second.  (The flapping network
            # test, trace V25: the one host asked was cut off on the way, the previous
            # owner, which held the batches, was back 0.4 s after the change, and this
            # host served its copy without them.)  A copy that is complete waits for
            # nobody who is gone (a failover: the new owner was the first backup).
            st.handover_hold_until = (time.monotonic() + HANDOVER_TIMEOUT
                                      if not complete and prev and prev != self.addr else 0.0)
            if prev and prev != self.addr and prev in self.members.reachable():
                hd_from, hd_when, hd_epoch = st.handover_done
                if (hd_from == prev and hd_when > time.monotonic() - 5
                        and hd_epoch >= self.members.epoch - 1):
                    # (an older one would be from before prev owned the shard again)
                    self.shard_log.add(
                        logging.INFO, "hand-over snapshots from %s already here at the "
                        "change of owner (epoch %d)", (prev, self.members.epoch), st.key,
                        "shard %s: hand-over snapshot from %s already here", st.key, prev)
                    st.handover_done = ("", 0.0, 0)
                else:
                    st.handover_from = prev
                    st.handover_until = time.monotonic() + HANDOVER_TIMEOUT
                    st.handover_next = backups
                    st.handover_incs = self._incarnations_of([prev] + backups)
            elif prev and prev != self.addr:
                cands = backups + ([prev] if self.cfg.replicas > 1 else [])
                st.handover_incs = self._incarnations_of(cands)
                if not complete and cands:   # the owner is gone: its backups' copy (in turn)
                    st.handover_next = cands
                    st.handover_until = 0.0
                    self._handover_given_up(st, time.monotonic())
            # What the take-over counts as (the metrics; _on_changes logs the counts).  A
            # shard a leaving host handed over is no failover, though that host is gone
            # by now: it was 43-44 failovers a planned leave, timed to the first push
            # after, and the failover figures mixed them with kills.  From an owner gone
            # without a word here it is undecided (_decide_takeovers): both are noted
            # and the first apply times the one it turned out to be.
            kind = self._takeover_kind(prev)
            st.failover_from, st.handover_took_at, st.undecided_apply = None, 0.0, ()
            if kind:
                st.handover_took_at = time.monotonic()
            if kind == "hand-over":
                self.metrics.handovers.inc()
            elif kind == "undecided":
                st.failover_from = prev
                try:
                    st.failover_dead_seen = self.members.last_seen(prev)
                except InvalidArgument:
                    st.failover_dead_seen = time.monotonic()

    def _takeover_kind(self, prev: Optional[str]) -> str:
        """What this host taking a shard over from its previous owner ``prev`` is:
        "hand-over" when ``prev`` is reachable (a member joined or left, or the ring
        moved) or it said it handed its shards over (a planned leave: SIGTERM, removed
        from the members; it is gone at the change); "undecided" when it is unreachable
        otherwise: a failover (dead, cut off), unless its "handed over" comes within
        ``dead_after`` (_decide_takeovers: this host may take the others' view of it
        gone before its own heartbeat saying so, 2 leaves in 3 in a test); "" when the
        shard had no owner (new, or a ring of nobody)."""
        if not prev or prev == self.addr:
            return ""
        if prev in self.members.reachable() or prev in self._handed_over:
            return "hand-over"
        return "undecided"

    def _decide_takeovers(self, now: float) -> None:
        """Count and log the take-overs from owners gone without a word here
        (_takeover_kind "undecided"): hand-overs once the owner's "handed over" is heard,
        failovers once ``dead_after`` has passed since the change without it.  (A dead
        owner says nothing more; a leaving one said it to every member at once.)  The
        shards that applied a batch meanwhile are timed as what it turned out to be
        (ShardState.undecided_apply); the others are by their first apply (on_batch)."""
        for prev, (n_ho, n_un, since, epoch) in list(self._took_undecided.items()):
            if prev in self._handed_over:
                n_ho, n_fo = n_ho + n_un, 0
                self.metrics.handovers.inc(n_un)
            elif now - since >= self.cfg.dead_after:
                n_fo = n_un
                self.metrics.failovers.inc(n_un)
            else:
                continue
            del self._took_undecided[prev]
            for st in self.shards.values():   # (once an event: O(shards))
                if st.failover_from != prev:
                    continue
                if n_fo == 0:
                    st.failover_from = None
                    if st.undecided_apply and st.handover_took_at:
                        self.metrics.handover_s.observe(
                            st.undecided_apply[0] - st.handover_took_at)
                        st.handover_took_at = 0.0
                elif st.undecided_apply:
                    self._time_takeover(st, *st.undecided_apply)
                st.undecided_apply = ()
            log.info("took ownership of %d shards from %s (epoch %d): %d by hand-over, "
                     "%d by failover", n_ho + n_fo, prev, epoch, n_ho, n_fo)

    def _time_takeover(self, st: ShardState, applied: float, wall: float) -> None:
        """A failover of ``st`` (from ``st.failover_from``) applied its first batch at
        ``applied`` (monotonic; ``wall``, time.time()): timed from the dead owner's last
        heartbeat here, and listed in /health's failovers."""
        took = applied - st.failover_dead_seen
        self.metrics.failover_s.observe(took)
        self.failover_log.append({"shard": st.key, "dead": st.failover_from,
                                  "first_apply_wall": wall,
                                  "since_last_heartbeat_s": round(took, 4)})
        del self.failover_log[:-100]
        st.failover_from = None
        st.handover_took_at = 0.0

    def _check_stall(self) -> None:
        """A process that did not run for half of ``dead_after`` (SIGSTOP, a starved CPU)
        may have been counted dead meanwhile: the epoch may have moved on without it, and
        what it hears first are heartbeats buffered while it was stopped. Like a process
        that just started, it listens for the cluster's view before it acts again (and a
        newer majority view makes it copy its shards before owning any); replies it held
        for its backups are dropped (senders resend)."""
        now = time.monotonic()
        gap = now - self._last_run
        self._last_run = now
        if gap > self.cfg.dead_after / 2 and now >= self.grace_until:
            log.warning("this process did not run for %.0f ms (stopped or starved): listening "
                        "for the cluster's view for %.0f ms before acting (epoch %d)",
                        gap * 1e3, self.cfg.dead_after * 1e3, self.members.epoch)
            self.metrics.stalls.inc()
            self.grace_until = now + self.cfg.dead_after
            for st in self.shards.values():
                st.pending.clear()

    def _notice_silence(self) -> None:
        """Members silent too long become suspect or dead (none during the start-up
        grace: peers are still starting)."""
        self._check_stall()
        if time.monotonic() >= self.grace_until:
            self._on_changes(self.members.tick())
            self._closed_and_silent()

    def _look_when_silent(self, member: str) -> None:
        """A connection of ``member`` closed: run _closed_and_silent (after the start-up
        grace, as _notice_silence does) once it has been silent for half of
        ``dead_after``, not at the next TICK only (a flush pass with nothing to do does
        not look: _flush_pass).  Not the whole _notice_silence: its stall check counts
        from the last look, and this timer is no measure of the event loop's pace."""
        if member not in self.members.states():
            return
        link = self.links.get(member)
        if link is not None and link.refused_at > link.down_since > 0:
            self._look_at_closed()   # its address refused a dial already: look now
        delay = self.members.last_seen(member) + self.cfg.dead_after / 2 - time.monotonic()
        asyncio.get_running_loop().call_later(max(0.0, delay) + 0.001, self._look_at_closed)

    def _look_at_closed(self) -> None:
        if time.monotonic() >= self.grace_until:
            self._closed_and_silent()

    def _closed_and_silent(self) -> None:
        """A peer whose connections both closed (its kernel closes them when the process
        dies) and that has been silent for half of ``dead_after``, or whose address
        refused this host's dial since (nothing listens there: the process is gone), is
        dead now, once a majority was heard since its link broke (_majority_heard_since:
        a host cut off by a REJECT sees the same of every peer, and is left to silence
        and E1): a killed bridge fails over sooner than a stopped or cut-off one, whose
        connections stay, and whose kernel (or no one) still answers a dial.  (Half of
        dead_after alone: a killed owner's shards were taken 0.3-0.5 s after the kill,
        the failover bench, 2026-11-28.)"""
        now = time.monotonic()
        for m, st in self.members.states().items():
            if m == self.addr or st in (State.DEAD, State.JOINING):
                continue
            link = self.links.get(m)
            if link is None or link.up or link.down_since == 0.0:
                continue
            if any(who[0] == m for who in self.incoming):
                continue
            if (now - link.down_since >= 5 * self.cfg.dead_after
                    or not self._majority_heard_since(link.down_since, m)):
                continue   # (this host may be the one cut off: dead by silence, E1)
            silent = now - self.members.last_seen(m)
            refused = link.refused_at > link.down_since
            if silent >= self.cfg.dead_after / 2 or refused:
                log.info("member %s: connections closed%s, silent %.0f ms: dead", m,
                         ", its address refuses" if refused else "", silent * 1e3)
                self._on_changes(self.members.mark_dead(m))

    def _majority_heard_since(self, t: float, but: str) -> bool:
        """A majority of the configured members, this host included and ``but`` not, was
        heard after ``t`` (monotonic): this host is not the one cut off.  The early rules
        of _closed_and_silent (half of dead_after of silence, a refused dial) need it.  A
        firewall that REJECTs (a TCP reset; ICMP port unreachable answers a dial with
        ECONNREFUSED too) closes a cut-off host's connections to every peer and refuses
        its dials alike: counted dead early, the first peer made a majority of this host
        and another peer still heard within suspect_after, and the cut-off host minted
        the epoch number the real majority mints for its own ring, which E1
        (Membership.can_mint) is there to prevent
        (test_a_host_whose_peers_all_close_and_refuse_mints_no_epoch: epoch 1 minted by
        the refusal).  When a process dies the survivors speak on: their next heartbeat
        (within a heartbeat interval; a refused link looks again at each dial, every
        0.05 s) says this host still hears a majority."""
        if self.members.allow_minority:
            return True
        states = self.members.states()
        heard = {self.addr} | {p for p, s in states.items()
                               if p not in (self.addr, but) and s is not State.DEAD
                               and self.members.last_seen(p) > t}
        return 2 * len(heard & set(self.members.configured)) > len(self.members.configured)

    def _is_origin(self, key: tuple) -> bool:
        """A worker of this host created the tensor of shard ``key`` (the bridge did not
        adopt it from a peer's catalog): this host's copy has its initial values."""
        info = self.tensors.get(key[0])
        return info is not None and info.name not in self.adopted

    def _was_owner(self, key: tuple) -> bool:
        """This host owned shard ``key`` in the ring before the current one."""
        ring = self.prev_ring
        return ring is not None and len(ring) > 0 and ring.owner(self.shards[key].key) == self.addr

    def _others_still_see_me(self) -> bool:
        reach = self.members.reachable()
        return any(self.addr in ring for p, ring in self._peer_rings.items() if p in reach)

    # ------------------------------------------------------------ membership I/O
    async def _heartbeat_loop(self) -> None:
        self._hb_wake = asyncio.Event()
        while True:
            self.hb_seq += 1
            st = self.members.states()
            flags = 0
            if self.speaks_for_majority():
                # only a host on the majority's ring speaks for it (a joining or cut-off
                # host's view must not be adopted); not "acting": a host that has just
                # minted an epoch acts once a majority says it is at that epoch, which it
                # does after taking this host's view over
                flags |= frames.HB_QUORUM
            if self.ready_flag:
                flags |= frames.HB_READY
            if self.handed_over:
                flags |= frames.HB_HANDED_OVER
            if self.acting():
                flags |= frames.HB_ACTING   # a majority agrees to this ring at this epoch
            hb = frames.encode_heartbeat(
                epoch=self.members.epoch, sender=self.mid, incarnation=self.incarnation,
                seq=self.hb_seq, digest=self.ring.digest, sent_ms=int(time.time() * 1000),
                members=[(member_id(m), s.code) for m, s in sorted(st.items())], hb_flags=flags)
            for link in self.links.values():
                if link.send(hb):
                    self.metrics.sent("heartbeat", len(hb))
            self._hb_epoch = self._epoch_ring
            self._hb_acting = bool(flags & frames.HB_ACTING)
            # the next one after the interval, or at once when the epoch or ring changes
            # (_on_changes): peers adopt or agree, and so this host acts, a round trip
            # after the change rather than a heartbeat interval
            self._hb_wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._hb_wake.wait(), self.cfg.heartbeat)

    async def _tick_loop(self) -> None:
        due = time.monotonic()
        while True:
            now = self._tick_at = time.monotonic()
            # how late this tick woke: the longest the event loop was kept from its
            # timers and sockets (heartbeats!) by synchronous work, or starved of CPU
            # (a block shorter than the pause it began in shows less: the tick pauses
            # TICK while anything moves, up to dead_after / 8 when settled)
            self._lags.append((now, max(0.0, now - due)))
            while self._lags and self._lags[0][0] < now - LAG_WINDOW:
                self._lags.popleft()
            delay = TICK
            try:
                self._notice_silence()
                self._maintain()
                self._decide_takeovers(now)
                self.shard_log.flush(now)
                if (self._doorbell is None and not self._closing
                        and now - self._doorbell_tried >= DOORBELL_RETRY
                        and self._listen_doorbell()):
                    log.info("the flush doorbell of store %r is free: listening on it",
                             self.store.name)
                delay = self._tick_delay(time.monotonic())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("maintenance failed")
            due = now + delay
            await self._tick_sleep.sleep(delay)

    def _tick_delay(self, now: float) -> float:
        """Seconds until the next tick: TICK while anything is in motion (a member
        suspect, joining or leaving, this host not alive, the start-up or a stall's
        grace, a mint held, a shard pass under way, acting since the last pass or not,
        anything moved in the last SETTLE_AFTER); else until the first member could
        turn suspect, at most TICK_SETTLED and dead_after / 8.  (The stall check counts
        the time since it last ran, a pause included: a synchronous block of more than
        dead_after / 2 less the pause counts as a stall, 3/8 of dead_after at the least,
        where it was dead_after / 2 less TICK.)  Whatever moves a settled bridge
        brings the tick forward to TICK after the last one (_poke_tick).  An idle bridge
        ticked 50 times a second: a third of its CPU."""
        m = self.members
        if (now < self.grace_until or now < m.mint_held_until
                or now - self._moved_at < SETTLE_AFTER
                or self._maint_busy
                or not self._maint_sig or self._maint_sig[2] != self.acting()):
            return TICK
        first = math.inf
        for a, state in m.states().items():
            if a == self.addr:
                if state is not State.ALIVE:
                    return TICK
            elif state is State.ALIVE:
                first = min(first, m.last_seen(a) + m.suspect_after)
            elif state is not State.DEAD:
                return TICK
        return max(TICK, min(TICK_SETTLED, self.cfg.dead_after / 8, first - now + 0.001,
                             self._maint_due - now))

    def _poke_tick(self) -> None:
        """Something a tick acts on moved (the members, the tensors, a copy lost): tick
        TICK after the last one, as a bridge in motion does, not after a settled
        bridge's longer pause (_tick_delay).  (Not at once: hundreds of new tensors,
        taken up a slice at a time, each poke a shard pass over all of them, made the
        take-up of 500 tensors 1.5 s slower.)"""
        self._moved_at = time.monotonic()
        self._tick_sleep.end_by(self._tick_at + TICK)

    def on_heartbeat(self, peer: str, hb: frames.Heartbeat) -> None:
        self._on_heartbeat(peer, hb)
        self._resend_view_waits()
        # (a majority may agree to this host's view now: it says so at once, and the
        # senders its refusals held back resend then)
        self._heartbeat_if_new()

    def _resend_view_waits(self) -> None:
        """The streams whose owner refused them for its view (it did not act yet, or not
        by this host's epoch and ring: SendStream.view_wait) go again now, not RETRY
        later, once the owner's last heartbeat says it acts by this host's view.  (At a
        failover the new owner acts once the other survivor's heartbeat of the new epoch
        comes, and the batches it refused before waited RETRY more: its shards' first
        applies came 50-100 ms after the others'.)  Only these streams are looked at
        (``_view_waits``); a stream's owner is its target, or after a change of ring
        (target None) the owner by this host's ring."""
        if not self._view_waits:
            return
        now = time.monotonic()
        mine = self._epoch_ring
        woke = False
        for key in list(self._view_waits):
            stream = self.streams.get(key)
            if stream is None or not stream.view_wait or stream.retry_at <= now:
                self._view_waits.discard(key)
                continue
            owner = stream.target
            if owner is None:
                info = self.tensors.get(key[0])
                owner = self.owner(shard_key(info.name, key[1])) if info is not None else None
            if owner in self._peer_acting and self._peer_view.get(owner) == mine:
                stream.view_wait = False
                stream.retry_at = 0.0
                self._view_waits.discard(key)
                woke = True
        if woke:
            self._wake_flush()

    def _on_heartbeat(self, peer: str, hb: frames.Heartbeat) -> None:
        if peer not in self.members.states():
            return
        if hb.hb_flags & frames.HB_HANDED_OVER and (hb.sender, hb.incarnation) not in self._gone:
            # (_takeover_kind: its shards are no failovers.  Not the word of a process
            # gone, buffered in its connection: its host's new process may own shards
            # by now, and their take-over at its death was counted a hand-over)
            self._handed_over.add(peer)
        if hb.hb_flags & frames.HB_HANDED_OVER and self.members.state(peer) is State.DEAD:
            # it left on purpose and is about to exit: not a rejoin.  Counted out here by
            # a peer's view before this heartbeat came (the peer removed it on its own
            # copy of it), it left all the same: no wait holds for it (_left_for_good).
            # It stays dead here for good (this return), so a hold for it could only end
            # in vain; that was 2 leaves in 3 in a cluster test (_takeover_kind), each
            # such shard refused BUSY for HANDOVER_TIMEOUT when this host's copy seemed
            # incomplete.  (A restarted process is another incarnation: _left_for_good.)
            if self._incarnations.get(peer) == hb.incarnation:   # (not one buffered)
                self._left[peer] = hb.incarnation
            return
        if (hb.sender, hb.incarnation) in self._gone:
            return  # buffered in a connection of a process that has restarted since
        known = self._incarnations.get(peer)
        if known == hb.incarnation and hb.seq < self._hb_seq.get(peer, 0):
            # Older than one already heard from this process: buffered in a connection
            # during a cut and delivered after the newer ones of the connection that
            # replaced it.  Counted, such heartbeats, interleaved with the fresh ones,
            # turned a peer joining, ready, joining again within 100 ms, and each turn
            # moved this host's ring and roles (the flapping network test, 2026-11-26)
            self.metrics.rejected("stale_heartbeat")
            return
        self._hb_seq[peer] = hb.seq
        before = (self._peer_view.get(peer), peer in self._peer_acting)
        self._peer_view[peer] = (hb.epoch, hb.digest)
        if hb.hb_flags & frames.HB_ACTING:
            self._peer_acting.add(peer)
        else:
            self._peer_acting.discard(peer)
        if before != ((hb.epoch, hb.digest), peer in self._peer_acting):
            self._poke_tick()   # (whether this host acts may follow: _maintain)
        self._incarnations[peer] = hb.incarnation
        if known is not None and known != hb.incarnation:
            log.info("member %s restarted (incarnation %08x -> %08x): it copies its shards "
                     "again", peer, known, hb.incarnation)
            # the old process is gone and its frames are refused from now on (on_frame):
            # its duplicate filters are no longer needed
            self._gone.add((hb.sender, known))
            now = time.monotonic()
            for st in self.shards.values():
                st.synced.discard(peer)
                st.snapshotting.pop(peer, None)
                for stream in st.dedup.streams():
                    if stream[0] == hb.sender and stream[1] == known:
                        st.dedup.forget(stream)
            self._unsettle()
            # joining even if it was dead: its new process copies its shards (its
            # duplicate filters are gone), whether or not its death moved any
            self._on_changes(self.members.mark_joining(peer))
            # (after the role changes that makes: a wait they begin for this host is
            # for its old process's copy, which is gone, not for its new process's)
            self._stop_waiting_for_restarted(peer, known, hb.incarnation, now)
        elif known is None:
            # first heard: a wait that began before is for this process (a restart
            # later is one: _waited_restarted)
            for st in self.shards.values():
                if peer in st.handover_incs and st.handover_incs[peer] is None:
                    st.handover_incs[peer] = hb.incarnation
        if known != hb.incarnation:
            self._rebind_data(peer)   # prefer the connection of the current incarnation
        view = {}
        for mid, code in hb.members:
            a = self.ids.get(mid)
            if a is not None:
                view[a] = State.from_code(code)
        heard = dict(view)   # the peer's view as it sent it (view is edited below)
        adopted = False
        if (hb.hb_flags & frames.HB_QUORUM) and hb.epoch > self.members.epoch:
            # The majority's newer view first, before this heartbeat counts the peer
            # alive: a host that counted every peer dead without a majority (no epoch
            # minted) would otherwise count this one alive again on its own epoch's ring,
            # have a majority with it, and mint the next epoch itself, on a ring the
            # majority does not hold (3 hosts: {B, C} while A and B hold {A, B}) and with
            # the majority's epoch number, so the peer's epoch would no longer be newer.
            mine = view.get(self.addr)
            if self.leaving:
                view[self.addr] = State.LEAVING
            elif (mine not in (State.ALIVE, State.SUSPECT)
                    or time.monotonic() < self.grace_until):
                # a running cluster that does not count this host in, or this process has
                # just started (its copy may be old): copy the shards before owning any
                view[self.addr] = State.JOINING
            self._on_changes(self.members.adopt(view, hb.epoch))
            self.grace_until = min(self.grace_until, time.monotonic())
            adopted = True
        elif ((hb.hb_flags & frames.HB_ACTING) and hb.epoch == self.members.epoch
              and hb.digest != self.ring.digest and not self.acting()):
            # E3b: the peer owns shards at this host's epoch on another ring, so a majority
            # agreed to that ring at this number; this host does not own by its own ring,
            # which it minted or changed without one (back from a cut, say).  Its view
            # is taken over as a newer epoch's would be, before this heartbeat counts the
            # peer: counted joining on this host's ring, the peer made a majority with it,
            # and this host minted the next epoch on a ring of itself, which the majority
            # then took over (E3): every other host joining, this host's stale copies
            # owning every shard (the network-cut test, 2026-11-26)
            if self.leaving:
                view[self.addr] = State.LEAVING
            elif (view.get(self.addr) not in (State.ALIVE, State.SUSPECT)
                    or time.monotonic() < self.grace_until):
                view[self.addr] = State.JOINING
            log.info("taking over %s's ring at epoch %d: it owns shards by it, this host "
                     "does not by its own", peer, hb.epoch)
            self._on_changes(self.members.adopt(view, hb.epoch, same_epoch=True))
            adopted = True
        if not adopted and view.get(self.addr) in (State.DEAD, State.JOINING):
            # A heartbeat counts this host out (a joiner's: no quorum flag, so not taken
            # over); of a newer epoch, this host is behind: it mints nothing for dead_after,
            # meanwhile a majority member's heartbeat brings the newer view (E3).  (In
            # the flapping network test's traces C2-9, E3-1 and E3-4 a host minted the
            # epoch number another host had minted for its own ring, in C2-9 on such a
            # heartbeat, in the two others most likely; each time its copy, which
            # lacked batches the other ring's owner had acknowledged, replaced the
            # copies that held them.)  Once for each newer epoch number (hold_mints).
            self.members.hold_mints(hb.epoch)
        self._on_changes(self.members.heartbeat(peer))
        if (self.members.epoch == 0 and not self._ever_acted and peer in self._initial
                and self.members.state(peer) is State.JOINING):
            # epoch 0 and this host never acted: the cluster has not formed yet (nothing
            # was applied anywhere), so a peer of the original list that started late is
            # simply alive
            self._on_changes(self.members.mark_ready(peer))
        # what the peer counts in, as it sent it: a leaving host adopts views with itself
        # set to LEAVING, and read from that copy a peer that had dropped it still
        # seemed to count it in (every leave waited its whole timeout, 10 s)
        self._peer_rings[peer] = {m for m, s in heard.items()
                                  if s in (State.ALIVE, State.SUSPECT, State.LEAVING)}
        # a majority's member at this host's epoch (not one just taken over)
        same_epoch = (not adopted and bool(hb.hb_flags & frames.HB_QUORUM)
                      and hb.epoch == self.members.epoch)
        if (same_epoch and self.members.state(self.addr) is State.JOINING
                and hb.digest != self.ring.digest):
            if self._keeps_its_ring():
                seen = (hb.epoch, hb.digest, self.ring.digest)
                if self._kept_ring_logged != seen:
                    self._kept_ring_logged = seen
                    log.info("joining at epoch %d: keeping this host's ring (a peer acts "
                             "by it, or holds it and it was taken just now); %s's ring of "
                             "that number is not followed", hb.epoch, peer)
            else:
                # joining: follow the view of the majority this host copies from (a view
                # this host built while cut off may still count members dead or joining)
                if view.get(self.addr) not in (State.ALIVE, State.SUSPECT):
                    view[self.addr] = State.JOINING
                self._on_changes(self.members.adopt(view, hb.epoch, same_epoch=True))
        elif (same_epoch and view.get(self.addr) is State.JOINING and not self.leaving
              and self.members.state(self.addr) in (State.ALIVE, State.SUSPECT)):
            # a peer at this host's epoch counts it as joining (it was added, or came
            # back). When a majority of the members says so, copy the shards before owning
            # any; one peer alone may be the confused one.
            self._says_joining[peer] = hb.epoch
            n = sum(1 for p, e in self._says_joining.items()
                    if e == self.members.epoch and p in self.members.configured)
            if 2 * n > len(self.members.configured):
                self._says_joining.clear()
                self._on_changes(self.members.rejoin())
        if view.get(self.addr) is not State.JOINING:
            self._says_joining.pop(peer, None)
        s_peer = view.get(peer)
        state = self.members.state(peer)
        if s_peer is State.LEAVING and state in (State.ALIVE, State.SUSPECT):
            self._on_changes(self.members.mark_leaving(peer))
        elif (s_peer is State.JOINING and state in (State.ALIVE, State.SUSPECT)
              and hb.epoch == self.members.epoch):
            # it says it must copy its shards again (it restarted or was cut off).  Only
            # at this host's epoch: one of a newer epoch says this host is behind, and
            # counted here it would move this host's ring at its old epoch, so that it
            # minted the next number, which the cluster may have minted for another
            # ring; this host takes the newer view from a majority member (E3), in which
            # the peer is joining.  (In trace C2-9 of the flapping network test a host
            # minted 5 by this clause at its own epoch 4, a number it had minted from a
            # joiner's ready flag of a newer epoch, which no longer counts.  Its ring then
            # differs from the joiner's, as it always does here: the joiner's ring leaves
            # it out.)
            for st in self.shards.values():
                st.synced.discard(peer)
                st.snapshotting.pop(peer, None)
            self._unsettle()
            self._on_changes(self.members.mark_joining(peer))
        if (hb.hb_flags & frames.HB_HANDED_OVER) and self.members.state(peer) is State.LEAVING:
            self._left[peer] = hb.incarnation   # (before the role changes the removal makes)
            self._on_changes(self.members.remove(peer))
            return   # (no longer a member: a rejoined host's heartbeat also says READY)
        if ((hb.hb_flags & frames.HB_READY) and self.members.state(peer) is State.JOINING
                and hb.epoch == self.members.epoch and hb.digest == self.ring.digest):
            # (not one of an older epoch, or of this epoch's number on another ring: a
            # host cut off again after it joined sent it before that cut, TCP delivered
            # it after, and the host was counted ready, alive on the ring with copies it
            # had not taken again since: the flapping network test, 2026-11-26.  A
            # joiner takes the majority's epoch and ring first.  Nor one of a newer
            # epoch: this host is behind, and counted, the flag minted the next epoch
            # number on this host's ring, which the majority had minted for its own, a
            # ring without this host (trace C2-9: a host whose inbound frames ran 0.9 s
            # late owned a shard by that epoch and copied its stale copy over the
            # others).  This host takes the newer epoch from a majority member first.)
            self._on_changes(self.members.mark_ready(peer))

    def _on_hosts_file(self, data: bytes) -> None:
        members = parse_hosts(data.decode("utf-8", "replace"), self.cfg.peers_file)
        before = list(self.members.configured)
        self._set_members(members)   # (an InvalidArgument is logged by the watcher)
        # one line an edit, as for POST /v1/members (a typo that dropped a host showed
        # only as that host leaving)
        added = [m for m in members if m not in before]
        removed = [m for m in before if m not in members]
        if added or removed:
            log.info("members changed by %s: +%s -%s (epoch %d)", self.cfg.peers_file,
                     added, removed, self.members.epoch)

    def _set_members(self, members: list[str]) -> None:
        """Take ``members`` (hosts.txt edited, or POST /v1/members) as the member list;
        InvalidArgument, and nothing changed, for a list of nobody: every host would take
        it for its own removal and leave (the whole cluster stopped on a hosts.txt
        emptied for a moment)."""
        if not members:
            raise InvalidArgument(
                f"a member list of nobody; the members stay {list(self.members.configured)}",
                hint="to stop a host, remove it from the list or send it SIGTERM")
        if self.addr not in members and not self.leaving:
            log.info("this host was removed from the member list: leaving")
            self.members.set_members(list(members) + [self.addr])
            self._poke_tick()
            self.request_stop()
            return
        self.ids.update({member_id(m): m for m in members})
        self._on_changes(self.members.set_members(members))
        for m in members:
            if m != self.addr and m not in self.links:
                self.links[m] = Link(self, m)

    # ------------------------------------------------------------ links
    def _out(self, peer: str) -> Optional[Conn]:
        """The connection this host's data frames (BATCH, ROWS, SNAPSHOT) to ``peer``
        take: the one ``peer`` opened to this host, on which this host is the websocket
        server and sends unmasked (a client masks every byte, RFC 6455 5.3: two more
        copies of each frame on both ends). One connection per peer at a time, so
        a snapshot and the ROWS after it arrive in order; when it changes, what was sent
        on the old one counts as lost (see _data_path_changed)."""
        c = self.data_out.get(peer)
        return c if c is not None and not c.closed else None

    def _rebind_data(self, peer: str) -> None:
        """Choose the connection for data frames to ``peer`` among the open ones it opened
        to this host: the newest of its current incarnation (the one its heartbeats
        carry), else the newest. Called when one opens or closes, and on a restart."""
        inc = self._incarnations.get(peer)
        best: Optional[Conn] = None
        for (addr, _), c in self.incoming.items():
            if addr != peer or c.closed:
                continue
            if best is None or ((c.incarnation == inc, c.opened)
                                > (best.incarnation == inc, best.opened)):
                best = c
        if best is not self.data_out.get(peer):
            if best is None:
                del self.data_out[peer]
            else:
                self.data_out[peer] = best
            self._data_path_changed(peer)

    def _data_path_changed(self, peer: str) -> None:
        """The connection for data frames to ``peer`` opened, closed or was replaced:
        resend what it did not acknowledge, and copy the shards to it again (ROWS and
        snapshots on the old connection may be lost)."""
        for key, stream in self.streams.items():
            if stream.target == peer:
                stream.q.rewind()
        for st in self.shards.values():
            st.synced.discard(peer)
            st.snapshotting.pop(peer, None)
        self._unsettle()

    def on_message(self, peer: str, auth_peer: Any, data: bytes,
                   reply: Callable[[bytes], None], bad: int) -> int:
        """One websocket message from authenticated ``peer`` (on either connection):
        its frames, each checked to come from that peer's process. Returns the count of
        malformed messages in a row (``bad`` before this one).  What its frames make this
        host send (ACKs, ROWS) is corked until all are handled (Cork)."""
        try:
            with self._unit():
                for f in frames.iter_frames(data):
                    if f.sender != auth_peer.sender or f.incarnation != auth_peer.incarnation:
                        raise frames.BadFrame(f"sender {f.sender:08x}/{f.incarnation:08x} is "
                                              "not the authenticated peer")
                    try:
                        self.on_frame(peer, f, reply)
                    except (frames.BadFrame, asyncio.CancelledError):
                        raise
                    except Exception:
                        log.exception("handling %s from %s failed", type(f).__name__, peer)
            return 0
        except frames.BadFrame as e:
            self.metrics.rejected("malformed")
            log.warning("malformed frame from %s: %s", peer, e)
            if bad + 1 >= MAX_BAD_FRAMES:
                log.warning("closing the connection with %s after %d malformed frames",
                            peer, bad + 1)
            return bad + 1

    def on_ack(self, peer: str, ack: frames.Ack) -> None:
        key = (ack.tensor, ack.shard)
        if ack.seq == SYNC_SEQ:
            return self._on_sync_answer(peer, key, ack.status)
        if ack.seq == frames.INIT_QUERY_SEQ:
            return self._on_init_answer(peer, key, ack)
        if ack.seq >= ROWS_SEQ_BASE:
            st = self.shards.get(key)
            if st is None:
                return
            r = ack.seq - ROWS_SEQ_BASE
            if st.init_served == peer and st.init_seqs[0] <= r <= st.init_seqs[1]:
                # an answer to this origin's hand-over of the initial values (leave:
                # _init_not_given): BUSY, the owner has not taken the tensor up (it is
                # sent again); else its LAST's, taken or not waited for
                if ack.status == Status.BUSY:
                    st.init_served = None
                elif r == st.init_seqs[1]:
                    st.init_given = peer
            if ack.status == Status.OK:
                if r > st.acked.get(peer, 0):
                    st.acked[peer] = r
                if (ack.epoch < self.members.epoch and r >= st.epoch_rows[1]
                        and st.epoch_rows[0][0] == self.members.epoch):
                    # taken by a member still at an older epoch: it holds the rows, but
                    # it has not taken this epoch's view, so it is no member of this
                    # owner's ring at it yet (it may take another ring of the number).
                    # The epoch's mark goes again (at most every RETRY) until one is
                    # answered at this epoch (_release)
                    st.epoch_rows = ((-1, 0), 0)
                snap = st.snapshotting.get(peer)
                if snap is not None and r >= snap:
                    del st.snapshotting[peer]
                    st.synced.add(peer)
                    if self.members.states().get(peer) is State.JOINING:
                        st.joiners_copied.add(peer)   # (_required; one sent it as a backup)
                self._release(key)
            else:
                if r < st.copy_first.get(peer, 0):
                    # a frame sent before the copy queued to it since (on_rows refuses a
                    # ROWS once it refused one before it): that copy replaces what it
                    # missed.  (Dropped from the copy under way by such late refusals, a
                    # member on a slow link was sent a third copy.)
                    return
                # the replica refused (views differ, or it lacks the tensor): copy it again,
                # once the views had time to converge
                st.synced.discard(peer)
                st.snapshotting.pop(peer, None)
                st.snap_retry[peer] = time.monotonic() + 0.2
                self._unsettle()
            return
        stream = self.streams.get(key)
        if stream is None:
            return
        if self.debug:
            log.warning("ACK %s/%d seq %d %s from %s (frame epoch %d, epoch %d, acked %d)",
                        self.tensors[ack.tensor].name if ack.tensor in self.tensors else
                        ack.tensor, ack.shard, ack.seq, ack.status.name, peer, ack.epoch,
                        self.members.epoch, stream.q.acked)
        if ack.status in (Status.OK, Status.REJECTED):
            if ack.seq > stream.q.last_seq:
                return
            if ack.status == Status.REJECTED and ack.seq > stream.q.acked:
                # (a late one, of a frame acknowledged since, would name a later drain)
                self._rejected(peer, stream, ack)
            stream.q.ack(ack.seq)
            stream.progress_at = time.monotonic()
            stream.busy = 0
            t = self.tensors.get(ack.tensor)
            last = None
            while stream.drains and stream.drains[0].last_seq <= ack.seq:
                last = stream.drains.popleft()
                if last.bufs is not None and t is not None:
                    t.give_back(last.bufs)   # its frames are acknowledged: reusable
            if last is not None and t is not None:
                # with the drain's ticket: two drains can read the same pushed value, and
                # only the ticket says which of them this ack covers (native/outbox.c)
                t.t._outbox_ack(ack.shard, last.pushed, last.ticket)
                self._acks_new = True
            self._send_waiting(stream.target)
        else:
            now = time.monotonic()
            if ack.status == Status.GAP and peer != self.addr:
                if ack.seq == stream.q.acked + 1 and now - stream.gap_resent_at > RETRY:
                    # An owner that does not know the stream (its first batch, after a
                    # restart of this bridge or a move of the shard) asks for it from
                    # the oldest unacknowledged frame, which this is: resend now, not
                    # after RETRY (the first flush of every stream waited ~60 ms)
                    stream.gap_upto = stream.q.sent
                    stream.gap_resent_at = now
                    stream.q.rewind()
                    stream.retry_at = 0.0
                    self._wake_flush()
                    return
                if (stream.q.acked + 1 < ack.seq <= stream.gap_upto
                        and now - stream.gap_resent_at < RETRY):
                    return   # the answer to a frame sent before that resend: resent too
            # any other refusal (STALE_EPOCH: heartbeats bring the newer view; NOT_OWNER,
            # NO_QUORUM, BUSY, GAP): resend everything unacknowledged a little later, or
            # for one of the owner's view, once its heartbeat says it acts by this host's
            stream.q.rewind()
            stream.view_wait = ack.status in (Status.NO_QUORUM, Status.STALE_EPOCH,
                                              Status.NOT_OWNER)
            if stream.view_wait:
                self._view_waits.add(key)
            if ack.status == Status.BUSY:
                # BUSY answers the resend that followed the last one (not another frame
                # of that resend): wait twice as long, up to BUSY_RETRY_MAX.  A snapshot
                # read of the shard lasts up to a second, and every 20 ms a 2 MiB-frame
                # stream would send its whole window (8 MiB) again to be refused
                if now >= stream.retry_at:
                    stream.busy += 1
                delay = min(BUSY_RETRY * 2 ** max(0, stream.busy - 1), BUSY_RETRY_MAX)
            else:
                delay = RETRY
            stream.retry_at = now + delay
            # the flush loop sleeps past the retry (a long --flush-ms, or asleep with
            # nothing else to do): it passes then
            self._flush_sleep.end_by(stream.retry_at)

    def _rejected(self, peer: str, stream: SendStream, ack: frames.Ack) -> None:
        """The owner refused batch ``ack.seq`` for good (REJECTED: it cannot apply it,
        and says why in its log); it is dropped, and answered as done (on_ack goes on as
        for OK).  The pushes of the drain it came from are recorded lost in the outbox
        first (outbox.reject): the drain's ack, or a later one, would otherwise make
        store.flush() return as if they had been applied; it raises PushesLost.  (Before,
        a later drain's ack covered them, and flush() returned.)  A REJECTED lost with its
        connection or with its owner comes again with the resend (the owner, and its
        copies, remember what it refused: ShardState.refused).  Best effort: not once a
        snapshot from another host replaced the filter of the host that answers, nor
        past the last REFUSED_KEEP refusals of the shard (then the resend is answered OK
        as a duplicate)."""
        info = self.tensors.get(ack.tensor)
        name = info.name if info is not None else ack.tensor
        drain = next((d for d in stream.drains if d.last_seq >= ack.seq), None)
        lost = 0
        if info is not None and drain is not None:
            try:
                lost = info.t._outbox_reject(ack.shard, drain.prev, drain.pushed)
            except Error as e:   # (a corrupt outbox shard): the stream goes on regardless
                log.error("owner %s rejected batch %d of %s/%d, and its pushes could not be "
                          "recorded lost: %s", peer, ack.seq, name, ack.shard, e)
                return
            self.metrics.lost.inc(lost)
        if lost:
            log.error("owner %s rejected batch %d of %s/%d: dropped; %d pushes recorded lost "
                      "(store.flush() raises PushesLost for them)", peer, ack.seq, name,
                      ack.shard, lost)
        else:   # another frame of a drain recorded already, or a range left open counts them
            log.error("owner %s rejected batch %d of %s/%d: dropped; its pushes are in a lost "
                      "range already", peer, ack.seq, name, ack.shard)

    # ------------------------------------------------------------ sender side
    def _flush_waiter(self, loop: asyncio.AbstractEventLoop) -> None:
        """A thread: sleeps on the store's flush-request word (a futex in the manifest)
        and wakes the flush loop when a worker's store.flush() asks for a drain, so that
        flush() does not wait for the next flush interval.  The fallback of the doorbell
        (_on_doorbell), for a store.flush() that cannot reach it: the hop from this
        thread to the event loop (the GIL) took 0.1-0.16 ms at the median and about 1 ms
        at the 90th percentile (shmps/doorbell.py).  The same for a push that wakes this
        bridge asleep with nothing to do (the manifest's fwd_wakes: _woken_by_push).
        Costs nothing otherwise (it wakes once a second to look at the stop flag)."""
        man = self.store._mptr
        seen = lib.shmps_flush_wait(man, 0, 0)
        woke = lib.shmps_forward_wakes(man)
        while not self._waiter_stop:
            now = lib.shmps_flush_wait(man, seen, 1_000_000_000)
            wakes = lib.shmps_forward_wakes(man)
            if self._waiter_stop:
                return
            try:
                if now != seen:
                    asked, seen = (now - seen) & 0xFFFFFFFF, now   # flush() calls since
                    loop.call_soon_threadsafe(self._on_flush_word, asked)
                if wakes != woke:   # a push that could not ring the doorbell woke us
                    woke = wakes
                    loop.call_soon_threadsafe(self._woken_by_push)
            except RuntimeError:   # the loop closed
                return

    def _on_flush_word(self, asked: int) -> None:
        """``asked`` store.flush() calls bumped the manifest's flush_req word (the
        waiting thread's hand-over): drain now."""
        self.metrics.wakes_futex.inc(asked)
        self._wake_flush()

    @contextlib.contextmanager
    def _unit(self) -> Iterator[None]:
        """One unit of the bridge's work (an incoming message, a flush-loop pass): what it
        sends is corked until it ends (Cork), and then the flushes waiting on
        acknowledgements it made are woken (_tell_acks), whether it ended well or not."""
        try:
            with self.cork:
                yield
        finally:
            self._tell_acks()

    def _tell_acks(self) -> None:
        """Wake the store.flush() calls sleeping on the store's ack word, if some
        ob_acked may have risen since they were last told (an ACK handled, a drain that
        may have acknowledged, a recover): an atomic add, and a futex wake only while
        some flush waits."""
        if self._acks_new and self.store is not None:
            self._acks_new = False
            lib.shmps_ack_notify(self.store._mptr)

    def _listen_doorbell(self) -> bool:
        """Bind the store's doorbell and read it on the event loop; False if another
        process holds it (the tick loop tries again every DOORBELL_RETRY s)."""
        self._doorbell_tried = time.monotonic()
        self._doorbell = doorbell.listen(self.store.name, self.store.namespace)
        if self._doorbell is None:
            return False
        asyncio.get_running_loop().add_reader(self._doorbell.fileno(), self._on_doorbell)
        return True

    def _on_doorbell(self) -> None:
        """A store.flush() rang (shmps/doorbell.py): drain now; or the first push to this
        bridge asleep with nothing to do (_woken_by_push)."""
        if self._doorbell is None:
            return
        flushes, pushes = doorbell.take(self._doorbell)
        if flushes:
            self.metrics.wakes_doorbell.inc(flushes)
            self._wake_flush()
        if pushes:
            self._woken_by_push()

    def _wake_flush(self) -> None:
        self._flush_asked = True
        self._scan_asked = True
        self._flush_sleep.end_by(0.0)

    async def _flush_pause(self, delay: float) -> None:
        """Sleep ``delay`` s, or less if a worker asks for a flush meanwhile (or did while
        this loop was draining), or a refused stream's retry falls due (on_ack)."""
        if self._flush_asked:
            self._flush_asked = False
            await asyncio.sleep(0)   # the event loop's turn (I/O, timers) all the same
            return
        try:
            await self._flush_sleep.sleep(delay)
        finally:
            self._flush_asked = False

    async def _flush_loop(self) -> None:
        interval = self.cfg.flush_ms / 1000.0
        try:
            while True:
                t0 = time.monotonic()
                due = t0 + interval
                try:
                    if self._flush_pass():
                        due = self._until_a_push(t0, interval)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("flush failed")
                await self._flush_pause(max(0.0, due - time.monotonic()))
                self._awake()
        finally:
            with contextlib.suppress(Error):
                self._awake()

    def _until_a_push(self, t0: float, interval: float) -> float:
        """After a pass (begun at ``t0``) with nothing to do: until when the flush loop
        may pause.  If no push was counted since the scan that found no shard busy, the
        bridge sleeps until the next full scan or sweep is due, a store.flush() rings,
        or the first push wakes it (native/outbox.c "Sleeping until a push"; then it
        passes when it would have had it polled: _woken_by_push); else one flush
        interval.  An idle bridge made 200 passes a second, most of its CPU."""
        idle_at = self._shard_index()[1].idle_at
        if idle_at is None or self._flush_asked:
            return t0 + interval
        if not lib.shmps_forward_idle(self.store._mptr, idle_at):
            return t0 + interval   # a push came meanwhile
        self._asleep, self._asleep_since = True, t0
        return max(t0 + interval, min(self._full_scan_at, self._sweep_at))

    def _awake(self) -> None:
        """The flush loop is awake again: pushes need not wake it."""
        if self._asleep:
            self._asleep = False
            lib.shmps_forward_awake(self.store._mptr)

    def _woken_by_push(self) -> None:
        """The first push to this bridge asleep with nothing to do rang (its doorbell, or
        the futex through the waiting thread): the next pass comes when the flush loop
        would have made it had it kept passing every flush interval, so that the pushes
        of a burst are drained together, as --flush-ms asks, and none waits longer."""
        self.metrics.push_wakes.inc()
        if not self._asleep:
            return
        interval = self.cfg.flush_ms / 1000.0
        now = time.monotonic()
        self._flush_sleep.end_by(
            self._asleep_since + math.ceil((now - self._asleep_since) / interval) * interval)

    def _flush_pass(self) -> bool:
        """One pass of the flush loop: drain the outbox shards that hold pushes (and the
        sweep's), send what the streams have not sent.  A pass with none of that to do
        ends after the scan (or without it: outbox.BusyScan), without looking at the
        members (that look was half of an idle pass's cost), and returns True."""
        now = time.monotonic()
        work = self._busy_shards(now)
        if not (work or self._sweep_due or now >= self._sweep_at or self._sending):
            self._tell_acks()   # (a recover may have acknowledged: PushesLost at once)
            return True
        # first notice who went silent (this process may have been stopped): never drain
        # or apply on a view older than one flush interval
        self._notice_silence()
        with self._unit():
            try:
                if not self._drains_stopped:
                    self._drain_all(work)
            finally:
                # a drain that failed part way (a corrupt outbox) recorded what it took
                # as lost: counted even when it raises every pass
                self._note_lost()
            self._send_all()
        return False

    def _busy_shards(self, now: float) -> list:
        """(tid, TInfo, shard) of every outbox shard holding pushes no drain counted yet,
        by one C call over every tensor's outbox shards (outbox.BusyScan), and not even
        that while the store's count of forwarded pushes stays where it was at a call
        that found none (except every FULL_SCAN_EVERY, and when a store.flush() asks);
        starting at a rotating place, so that a pass cut short (_drain_all) does not
        always leave the same ones."""
        infos, scan, _ = self._shard_index()
        full = self._scan_asked or now >= self._full_scan_at
        if full:
            self._scan_asked = False
            self._full_scan_at = now + FULL_SCAN_EVERY
        work = [(infos[i].tid, infos[i], s) for i, s in scan.scan(full)]
        if work:
            r = self._drain_round % len(work)
            work = work[r:] + work[:r]
            self._drain_round += 1
        return work

    def _note_lost(self) -> None:
        """Pushes recorded lost by this bridge's drains: a range that recover (at start)
        left open, because pushes were landing in the outbox then, ended by a drain once
        they were counted (native/outbox.c "Landing"), or the pushes of rows a table
        drain took before it failed (a corrupt outbox shard; shmps_outbox_drain_lost).
        Logged and counted as recover's."""
        if not self.store._lost_settled:
            return
        for name, s, lost in take_lost(self.store):
            self.metrics.lost.inc(lost)
            log.error("tensor %r shard %d: %d more pushes may have been lost, taken by an "
                      "earlier bridge process that ended while they were landing in the "
                      "outbox or by a drain that failed part way; store.flush() raises "
                      "PushesLost for them", name, s, lost)

    def _drain_all(self, busy: list) -> None:
        """Drain the outbox shards ``busy`` (_busy_shards) and the sweep's, and send each
        drain on its way at once."""
        if not self.members.has_quorum():
            return  # a minority holds its outboxes
        now = time.monotonic()
        quorum = now >= self.grace_until
        every = self._shard_index()[2]
        work = list(busy)
        nbusy = len(work)
        if now >= self._sweep_at and not self._sweep_due:
            # now and then some shards, busy or not, in turn (SWEEP_SHARDS a second): what
            # a pusher that died between writing its values and counting its push left
            # behind goes out too
            self._sweep_at = now + SWEEP_EVERY
            n = min(SWEEP_SHARDS, len(every))
            self._sweep_due = [every[(self._sweep_pos + i) % len(every)] for i in range(n)]
            self._sweep_pos += n
        work += self._sweep_due
        if work:
            self._unacked_to = self._unacked_by_owner()
        for k, (tid, info, s) in enumerate(work):
            over_budget = self.budget.available < (8 << 20)
            if over_budget or (k and time.monotonic() - now > DRAIN_SLICE):
                # let the event loop run (heartbeats, acknowledgements, the owner's frames)
                # and come back, at once unless over budget (then after the interval, the
                # acknowledgements freeing it): the busy shards left are still busy, the
                # sweep goes on where it stopped
                self._sweep_due = work[max(k, nbusy):]
                if not over_budget:
                    self._flush_asked = True
                return
            if self._backed_up(info, s):
                continue   # the pushes keep summing in the outbox meanwhile
            if self._drain_retry_at and self._drain_retry_at.get((tid, s), 0.0) > now:
                continue   # its last drain failed: not every pass (each takes its freeze)
            bufs = info.buffers()
            try:
                d = info.t._outbox_drain(s, into=bufs)
            except Error as e:
                # this shard only (a corrupt outbox shard fails again and again): the
                # other shards and tensors go on, and what it took is recorded lost
                # (which acknowledges it: native/outbox.c, shmps_outbox_drain_lost)
                self._acks_new = True
                info.give_back(bufs)
                self._drain_failed(info, s, e)
                continue
            self._drain_retry_at.pop((tid, s), None)
            if d is None or self.store._lost_settled:
                # An empty drain may acknowledge (native/outbox.c), and so does one that
                # ended a lost range.  One that took rows does not (its ack will): waking
                # the flushers for it cost a futex wake and a needless wake-up of every
                # waiting store.flush() per pass
                self._acks_new = True
            if d is None:
                info.give_back(bufs)
            else:
                stream = self.streams[(tid, s)]
                self._queue_drain(info, s, stream, d, bufs)
                # on its way before the next shard is drained: the owner applies this
                # one meanwhile
                self._send_stream(tid, s, stream, now, quorum)
        self._sweep_due = []

    def _drain_failed(self, info: TInfo, s: int, e: Exception) -> None:
        """Count a drain of shard ``s`` that raised, try it again DRAIN_RETRY_S later, and
        log it (once a minute a shard)."""
        self.metrics.drain_failures.inc()
        now = time.monotonic()
        self._drain_retry_at[(info.tid, s)] = now + DRAIN_RETRY_S
        if now - self._drain_failed_at.get((info.tid, s), -DRAIN_FAILURE_LOG_S) >= \
                DRAIN_FAILURE_LOG_S:
            self._drain_failed_at[(info.tid, s)] = now
            log.error("tensor %r shard %d: the outbox drain failed: %s (the other shards "
                      "go on; this one is tried again every %.0f s, logged once a minute; "
                      "to repair this host, rebuild its copy of the store: docs/bridge.md, "
                      "'A corrupt outbox shard')", info.name, s, e, DRAIN_RETRY_S)

    def _shard_index(self) -> tuple[list, Any, list]:
        """The forwarded tensors (TInfo, in order), one outbox.BusyScan over all of them,
        and (tid, info, shard) of every shard, for the sweep (cached; tensors are only
        ever added)."""
        if self._index[0] != len(self.tensors):
            infos = list(self.tensors.values())
            every = [(i.tid, i, s) for i in infos for s in range(i.nshards)]
            self._index = (len(infos), infos, BusyScan([i.t for i in infos], self.store),
                           every)
        return self._index[1], self._index[2], self._index[3]

    def _backed_up(self, info: TInfo, s: int) -> bool:
        """A connection this shard's next batch would load still holds SEND_AHEAD bytes
        the socket has not taken: the owner's (it applies slower than this host drains),
        or, for a shard this host owns, one to a live host its ROWS go to.  Draining more
        would only queue frames (and, RESEND_AFTER later, resend them); left in the
        outbox, the pushes are summed instead and go out as one batch once the peer
        catches up."""
        owner = self.owner(shard_key(info.name, s))
        if owner is None:
            return False
        if owner == self.addr:
            return self._copy_backed_up(SEND_AHEAD)
        c = self._out(owner)
        if c is not None and c.stream.backlog > SEND_AHEAD:
            return True
        # the owner's ACKs come behind the ROWS it sends this host (on_batch): a host
        # slow to take those would otherwise be sent batches up to the byte budget
        return self._unacked_to.get(owner, 0) > ACK_AHEAD

    def _unacked_by_owner(self) -> dict:
        """Unacknowledged batch bytes per owner they were sent to, over the sending
        streams (once per drain pass: within one, what it drains is not added)."""
        by: dict = {}
        for key in self._sending:
            stream = self.streams[key]
            if stream.target is not None:
                by[stream.target] = by.get(stream.target, 0) + stream.q.pending_bytes
        return by

    def _copy_backed_up(self, limit: int, st: Optional[ShardState] = None) -> bool:
        """A live (ALIVE) host that gets this host's ROWS (of shard ``st``: the ones it is
        synced or being copied for) has more than ``limit`` bytes waiting for its socket.
        A suspect one (stopped, cut off) does not hold this host back: its queue grows to
        wsstream.MAX_BACKLOG, then its copy is dropped and sent again as a snapshot if it
        comes back (_send_to_copies)."""
        states = self.members.states()
        for m in self._targets():
            if states.get(m) is not State.ALIVE:
                continue
            if st is not None and m not in st.synced and m not in st.snapshotting:
                continue
            c = self._out(m)
            if c is not None and c.stream.backlog > limit:
                return True
        return False

    def _queue_drain(self, info: TInfo, s: int, stream: SendStream, d: Any,
                     bufs: DrainBuffers) -> None:
        """Encode drain ``d`` (views of ``bufs``) of shard ``s`` into BATCH frames queued
        on ``stream``: a dense tensor's and a table's frames are views of ``bufs``
        (frames.Pieces: the sender's copy of each frame's values, 1.85 ms per 16 MiB
        shard, was a tenth of a forwarding bridge; a table's 0.5 MiB frame 0.07 ms, on
        the path of every flush), given back to the tensor once all are acknowledged; a
        csr tensor's frames are copies, and ``bufs`` goes back at once (TInfo.spare)."""
        views = info.kind in ("dense", "table")
        if (info.tid, s) not in self._sending:
            # a stream coming back from idle: its silence counts from now (RESEND_AFTER)
            self._sending.add((info.tid, s))
            stream.progress_at = time.monotonic()
        n = len(d.index)
        grads = d.grads.reshape(n, info.cols)
        if info.kind == "table":
            per = frames.max_rows_per_frame(info.cols, info.gdtype, Layout.KEYED)
        else:
            per = frames.max_rows_per_frame(info.cols, info.gdtype, Layout.RANGE)
        per = max(1, min(per, DATA_FRAME_BYTES // max(1, info.cols * info.gdtype.itemsize)))
        idx = np.asarray(d.index)
        # a csr row's entries go in one frame where the row fits (each frame steps the
        # rows it touches once)
        csr_rows = info.t._entry_rows(idx) if info.kind == "csr" and n > per else None
        for i, j in frames.frame_cuts(n, per, csr_rows):
            kw: dict = {}
            if info.kind == "table":
                kw["keys"] = idx[i:j].astype(np.uint64, copy=False)
            else:
                rows = idx[i:j]
                # a contiguous run of rows is sent as a range (no index bytes)
                if int(rows[-1]) - int(rows[0]) == j - i - 1:
                    kw["start"] = int(rows[0])
                else:
                    kw["rows"] = rows.astype(np.int64, copy=False)
            seq = stream.q.next_seq()
            # the later frames of a drain continue it (Flag.CONTINUES): a dense tensor's
            # step (Adam's t) advances once per drain, and the owner counts the drain's
            # pushes once
            frame = frames.encode_batch(epoch=self.members.epoch, sender=self.mid,
                                        incarnation=self.incarnation, tensor=info.tid, shard=s,
                                        seq=seq, values=grads[i:j], step=max(1, d.pushes),
                                        continues=i > 0, copy=not views, **kw)
            try:
                stream.q.put(seq, frame)
            except Backpressure:
                # over budget: keep it anyway (the rows left the outbox); the drain loop
                # stops taking more until acknowledgements free the budget
                self.budget.used += len(frame)
                stream.q._append(seq, frame, len(frame), None)
        stream.drains.append(QueuedDrain(stream.q.last_seq, d.pushed, d.ticket,
                                         bufs if views else None, d.prev))
        if not views:
            info.give_back(bufs)   # the frames are copies

    def _send_all(self) -> None:
        now = time.monotonic()
        quorum = self.members.has_quorum() and now >= self.grace_until
        for key in list(self._sending):
            stream = self.streams[key]
            if not len(stream.q):
                self._sending.discard(key)   # every frame acknowledged: idle
                continue
            self._send_stream(key[0], key[1], stream, now, quorum)

    def _send_stream(self, tid: int, s: int, stream: SendStream, now: float,
                     quorum: bool) -> None:
        """Send what stream (tid, s) has not sent yet to the shard's owner (rewinding first
        after a silence or an owner change), unless it waits for a retry."""
        if not len(stream.q) or now < stream.retry_at or not quorum:
            return
        if now - stream.progress_at > RESEND_AFTER:
            # nothing acknowledged for a while: a reply may have been lost with a
            # connection or a role change the owner saw and this host did not; the
            # owner's duplicate filter makes resending safe
            stream.q.rewind()
            stream.progress_at = now
        info = self.tensors[tid]
        owner = self.owner(shard_key(info.name, s))
        if owner is None:
            return
        if owner != stream.target:
            # (rewinds) what was in flight to the previous owner counted in its window
            stream.q.set_window(None if owner == self.addr else self._window(owner))
            stream.target = owner
        out = stream.q.to_send()
        if stream.q.unsent and owner != self.addr:
            self._window_waits.setdefault(owner, set()).add((tid, s))
        if not out:
            return
        epoch = self.members.epoch
        for seq, frame in out:
            if frames.epoch_of(frame) != epoch:
                frame = frames.restamp_epoch(frame, epoch)
            if owner == self.addr:
                f = frames.decode(frames.as_bytes(frame))
                assert isinstance(f, frames.Data)
                self.on_batch(self.addr, f, self._local_reply)
                if stream.retry_at > now:
                    break   # refused (hand-over in progress, ...): resend later
                continue
            link = self._out(owner)
            if link is None or not link.send(frame):
                stream.q.rewind()
                stream.retry_at = now + RETRY
                break
            self.metrics.sent("batch", len(frame))

    def _window(self, owner: str) -> ByteBudget:
        w = self._windows.get(owner)
        if w is None:
            w = self._windows[owner] = ByteBudget(SEND_WINDOW)
        return w

    def _send_waiting(self, owner: Optional[str]) -> None:
        """Send the frames that waited for room in the window to ``owner`` (an ACK from it
        just made some), instead of at the next flush pass."""
        keys = self._window_waits.pop(owner, None) if owner is not None else None
        if not keys:
            return
        now = time.monotonic()
        quorum = self.members.has_quorum() and now >= self.grace_until
        for key in keys:
            stream = self.streams.get(key)
            if stream is not None:
                self._send_stream(key[0], key[1], stream, now, quorum)

    def _local_reply(self, data: bytes) -> None:
        for f in frames.iter_frames(data):
            if isinstance(f, frames.Ack):
                self.on_ack(self.addr, f)

    def _unacked(self) -> int:
        return sum(len(s.q) for s in self.streams.values())

    # ------------------------------------------------------------ owner side
    def _ack(self, f: frames.FrameHeader, status: Status, seq: Optional[int] = None) -> bytes:
        return frames.encode_ack(epoch=self.members.epoch, sender=self.mid,
                                 incarnation=self.incarnation, tensor=f.tensor, shard=f.shard,
                                 seq=f.seq if seq is None else seq, status=status)

    def _refuse(self, f: frames.FrameHeader, reply: Callable[[bytes], None], status: Status,
                reason: str) -> None:
        """Answer ``f`` with ``status`` (not OK), counted by ``reason``.

        A BATCH of a stream its shard does not know yet is answered GAP, and the stream
        starts at the first frame at or below that one (on_batch): the sender's oldest
        unacknowledged, which its resend after the GAP begins with.  A refusal of
        another kind in the middle of that resend breaks this (a snapshot read or a
        hand-over wait that ends there: the frames before it are refused, and the first
        after it is not the oldest), so any other refusal asks for the GAP again.  (A
        read that ended mid-resend started a stream at seq 86; its 85 earlier batches
        were then acknowledged as duplicates and never applied.)

        A refused ROWS or SNAPSHOT chunk makes this copy incomplete for its sender: its
        later ROWS are refused until it copies this host again (on_rows: _unsynced), and
        so are the rest of that snapshot's chunks (snapshot_incomplete)."""
        if status is not Status.GAP and f.type == FrameType.BATCH:
            st = self.shards.get((f.tensor, f.shard))
            if st is not None:
                st.first_seen.pop((f.sender, f.incarnation, f.tensor, f.shard), None)
        elif f.type in (FrameType.ROWS, FrameType.SNAPSHOT):
            # (on_rows: _unsynced) the sender's frames after this one may be lost: its
            # ROWS are taken again only on top of a new snapshot of it.  Not for a frame
            # numbered before the snapshot this copy is (an owner numbers its ROWS and
            # snapshot chunks in the order it builds them): that snapshot holds its rows
            st = self.shards.get((f.tensor, f.shard))
            base = st.fed_base if st is not None else None
            if base is not None and (base.sender, base.incarnation) == (f.sender, f.incarnation) \
                    and f.seq - ROWS_SEQ_BASE > base.rseq:
                st.fed_base = None
            if f.type == FrameType.SNAPSHOT:
                # A chunk refused, the chunk numbered next (a snapshot's chunks are
                # numbered in a row) is refused too, and so on through the LAST: taken,
                # the LAST would make this copy the sender's snapshot, its marks and all,
                # with the refused chunk's rows missing (found by review, 2026-11-26).
                # Also for a tensor not taken up yet (BUSY, unknown_tensor): taken up
                # before the next chunk (the catalog pass), an owner waiting for its
                # creator's initial values took the rest of a hand-over the creator sent
                # unasked (_give_initial_values) and served the first chunk's rows as the
                # schema's init
                who = (f.sender, f.incarnation)
                broken = (st.snap_broken if st is not None else
                          self._unknown_snap_broken.setdefault((f.tensor, f.shard), {}))
                if f.flags & frames.Flag.LAST:
                    broken.pop(who, None)
                else:
                    broken[who] = f.seq - ROWS_SEQ_BASE
                if st is None:
                    if not broken:
                        self._unknown_snap_broken.pop((f.tensor, f.shard), None)
                    while len(self._unknown_snap_broken) > UNKNOWN_SNAP_KEEP:
                        del self._unknown_snap_broken[next(iter(self._unknown_snap_broken))]
        self.metrics.rejected(reason)
        if self.debug and f.type != FrameType.BATCH:
            info = self.tensors.get(f.tensor)
            log.warning("%s %s/%d from %08x refused %s: %s (frame epoch %d, epoch %d)",
                        f.type.name, info.name if info else f.tensor, f.shard, f.sender,
                        status.name, reason, f.epoch, self.members.epoch)
        reply(self._ack(f, status))

    def _refuse_over_streams(self, st: ShardState, f: frames.Data, streams: list,
                             peer: str, reply: Callable[[bytes], None]) -> bool:
        """Refuse ``f`` BUSY (reason ``capacity``) if recording ``streams``, the streams
        of its seq or marks, would take the duplicate filter of ``st`` past its bound
        (Dedup.fits): before anything of it is applied or written.  True if refused.
        (A copy wrote a ROWS's rows, then its new stream's mark raised CapacityError:
        no answer, and rows its filter lacked the batch of.)  A copy refused is copied
        again by the owner (on_ack), whose snapshot's filter replaces its own; a sender
        resends later."""
        if st.dedup.fits(streams):
            return False
        log.warning("%s %d of shard %s from %s refused: its duplicate filter tracks %d "
                    "streams, the most it may", f.type.name, f.seq, st.key, peer,
                    len(st.dedup))
        self._refuse(f, reply, Status.BUSY, "capacity")
        return True

    def _marked(self, f: frames.Data, marks: Iterable[Mark]) -> Iterator[tuple[tuple, int]]:
        """(stream, seq) of each of ``marks`` of data frame ``f``, but those of a
        restarted sender's old process (its filter is forgotten)."""
        for m in marks:
            if (m.sender, m.incarnation) not in self._gone:
                yield (m.sender, m.incarnation, f.tensor, f.shard), m.seq

    def _tensor_for(self, f: frames.FrameHeader) -> Optional[TInfo]:
        """The tensor a data frame names (looking again for tensors created since), or
        None if this host does not have it yet (the catalog sync creates it soon)."""
        info = self.tensors.get(f.tensor)
        if info is None or f.shard >= info.nshards:
            self.refresh_tensors()
            info = self.tensors.get(f.tensor)
        return info if info is not None and f.shard < info.nshards else None

    def on_batch(self, peer: str, f: frames.Data, reply: Callable[[bytes], None]) -> None:
        out = self._out(peer)
        if out is not None and out.incarnation == f.incarnation:
            # answer on the connection the ROWS to the sender take (the one its process
            # opened), after them: the sender writes the rows into its copy before it
            # takes the ACK, so once its flush() returns its pull shows the push (read
            # your writes); the connection the BATCH came on would let the ACK overtake
            # them
            reply = out.reply
        info = self._tensor_for(f)
        if info is None:
            return self._refuse(f, reply, Status.BUSY, "unknown_tensor")
        if f.epoch != self.members.epoch:
            return self._refuse(f, reply, Status.STALE_EPOCH, "stale_epoch")
        if not self.acting():
            return self._refuse(f, reply, Status.NO_QUORUM, "no_quorum")
        key = (f.tensor, f.shard)
        st = self.shards[key]
        if self.owner(st.key) != self.addr:
            return self._refuse(f, reply, Status.NOT_OWNER, "not_owner")
        if st.handover_from is not None and not self._handover_given_up(st, time.monotonic()):
            return self._refuse(f, reply, Status.BUSY, "handover")
        if st.reading is not None:
            # a snapshot of this shard is being read off the event loop: a batch applied
            # now would change the shard under the copy, and its ROWS would reach the
            # member ahead of the snapshot they follow.  The sender resends 20-80 ms
            # later (BUSY); the other shards go on
            return self._refuse(f, reply, Status.BUSY, "snapshot")
        stream = (f.sender, f.incarnation, f.tensor, f.shard)
        if stream not in st.dedup:
            if self._refuse_over_streams(st, f, [stream], peer, reply):
                return
            # A stream this host's filter does not know: nothing of it was applied to the
            # shard (its copies all carry the marks of what was), but this frame may be
            # one of several the sender has in flight, the earlier ones refused (BUSY
            # while a hand-over or the tensor was awaited) or still on their way.  Ask
            # for the stream again (GAP): the sender resends from its oldest
            # unacknowledged batch, which has a seq <= this one, and that is where the
            # stream starts here.
            first = st.first_seen.get(stream)
            if first is None or f.seq > first:
                st.first_seen[stream] = f.seq if first is None else first
                return self._refuse(f, reply, Status.GAP, "gap")
            del st.first_seen[stream]
            st.dedup.advance(stream, f.seq - 1)
        v = st.dedup.check(stream, f.seq)
        if v is Verdict.DUPLICATE:
            self.metrics.duplicates.inc()
            if (stream, f.seq) in st.refused and st.dedup.floor(stream) >= f.seq:
                # refused for good by this host: a sender that resends it did not get
                # that answer (lost with its connection), and answered OK it would count
                # the batch's pushes applied (store.flush() returned without PushesLost).
                # (An answer covers the seqs below it: only with every one of them done.)
                self._wait_backups(key, st, reply, self._ack(f, Status.REJECTED))
                return
            self._wait_backups(key, st, reply, self._ack(f, Status.OK,
                                                         min(f.seq, st.dedup.floor(stream))
                                                         or f.seq))
            return
        if (v is Verdict.TOO_FAR or f.seq != st.dedup.expected(stream)) \
                and not self._missing_acknowledged(st, stream, f, peer):
            if self.debug:
                log.warning("GAP %s from %s seq %d expected %d (epoch %d)", st.key, peer, f.seq,
                            st.dedup.expected(stream), self.members.epoch)
            return self._refuse(f, reply, Status.GAP, "gap")
        if st.gapped:                 # (a stream answered GAP: it goes on now)
            st.gapped.pop(stream, None)
        try:
            frames.check_schema(f, dtype=info.gdtype, cols=info.cols, nrows=info.nrows)
            self._check_in_shard(info, f)
        except frames.BadFrame as e:
            # checked here, the stream's next frame (as every batch is: the sender
            # releases its frames by the highest seq answered): a malformed frame that
            # started an unknown stream, or one past a gap, counted the frames before
            # it, still on their way, as done, never applied
            log.warning("batch %d from %s refused: %s", f.seq, peer, e)
            return self._reject_recorded(key, st, f, reply, "schema")
        if self._copy_backed_up(ROWS_AHEAD, st):
            # the copies do not take the changed rows as fast as batches come: the sender
            # retries shortly, its pushes summing in its outbox meanwhile
            return self._refuse(f, reply, Status.BUSY, "backlog")
        # apply
        continues = bool(f.flags & frames.Flag.CONTINUES)
        if f.layout == Layout.RANGE:
            index = np.arange(f.start, f.start + f.n, dtype=np.int64)
        else:
            index = f.index
        mark = [Mark(f.sender, f.incarnation, f.seq)]
        rows_out = None   # a table's ROWS frame, filled by the push itself
        try:
            if info.kind == "dense":   # rows in the shard and increasing (checked above)
                info.t._apply_shard(f.shard, index, f.values, pushes=f.step,
                                    continues=continues)
            elif info.kind == "table":
                rows_out = self._rows_builder(info, f.shard, st.rseq + 1, f.n, mark,
                                              keys=index, row_steps=True)
                info.t._apply_direct(index, f.values.reshape((f.n,) + info.row_shape),
                                     pushes=f.step, continues=continues,
                                     out=(rows_out.values, rows_out.state, rows_out.row_steps))
            else:
                info.t._apply_direct(index, f.values.reshape((f.n,) + info.row_shape),
                                     pushes=f.step, continues=continues)
        except Busy as e:
            # (an aggregated tensor whose round a worker is pushing: nothing was applied,
            # and the event loop does not wait for the worker; its sender sends it again)
            log.debug("batch %d from %s for %s: %s", f.seq, peer, st.key, e)
            return self._refuse(f, reply, Status.BUSY, "round_pushing")
        except CapacityError as e:
            log.error("batch %d from %s for %s: %s", f.seq, peer, st.key, e)
            return self._refuse(f, reply, Status.BUSY, "capacity")
        except Error as e:
            log.warning("batch %d from %s for %s refused: %s", f.seq, peer, st.key, e)
            return self._reject_recorded(key, st, f, reply, "invalid")
        self._record_as_owner(st, f)
        self.metrics.applied.inc()
        self.metrics.applied_bytes.inc(f.values.nbytes)
        if st.failover_from is not None and st.failover_from in self._handed_over:
            # (an owner gone without a word here said "handed over" since: _takeover_kind)
            st.failover_from = None
        if st.failover_from is not None and st.failover_from in self._took_undecided:
            # still undecided: timed as what it turns out to be (_decide_takeovers).  (Timed
            # as a failover here, a leave seen first in a peer's view, its "handed over"
            # a few ms behind, had a shard or two in the failover figures and /health's
            # failovers, and none of its hand-over timing)
            if not st.undecided_apply:
                st.undecided_apply = (time.monotonic(), time.time())
        elif st.failover_from is not None:
            self._time_takeover(st, time.monotonic(), time.time())
        elif st.handover_took_at:
            self.metrics.handover_s.observe(time.monotonic() - st.handover_took_at)
            st.handover_took_at = 0.0
        if info.kind == "dense":
            rseq = self._send_dense_rows(key, info, f.shard, index, f, mark)
        elif info.kind == "table":   # the rows as the push left them, filled in by it
            assert rows_out is not None
            st.rseq += 1
            self._send_to_copies(st, rows_out.finish(0))
            rseq = st.rseq
        else:
            rd = info.t._read_rows(f.shard, index)
            rseq = self._send_csr_rows(key, info, f.shard, rd, mark)
        self._wait_backups(key, st, reply, self._ack(f, Status.OK), rseq)

    def _missing_acknowledged(self, st: ShardState, stream: tuple, f: frames.Data,
                              peer: str) -> bool:
        """True if the batches of ``stream`` before ``f`` that this owner's copy lacks
        were acknowledged by an earlier owner, so that the sender will never send them
        again: the stream then goes on from ``f`` (its filter moved past them), the loss
        logged and counted.  A sender answered GAP resends from its oldest unacknowledged
        batch; one whose resends start, again and again, above what this copy expects has
        nothing older left.  That happens only when an owner acknowledged batches whose
        effect did not reach the copy that now owns the shard: with --replicas 1, when
        its previous owner left, was stopped or was cut off without handing it over
        (bridge.md, "Replicas 1").  Without this the stream was refused for good: every
        store.flush() of its host timed out, on a cluster up and converged.  To rule out
        a frame merely overtaken by a resend, the same lowest seq must be refused
        GAP_LOSS_REFUSALS times over GAP_LOSS_AFTER s."""
        exp = st.dedup.expected(stream)
        if f.seq <= exp:
            return False
        now = time.monotonic()
        g = st.gapped.get(stream)
        if g is None or f.seq < g[0]:
            st.gapped[stream] = [f.seq, 1, now]
            return False
        if f.seq > g[0]:
            return False           # a later frame of the same flight
        g[1] += 1
        if g[1] < GAP_LOSS_REFUSALS or now - g[2] < GAP_LOSS_AFTER:
            return False
        del st.gapped[stream]
        missing = f.seq - exp
        log.error("shard %s: batches %d..%d of %s (sender %08x) were acknowledged by an "
                  "earlier owner of the shard but are not in this host's copy: their pushes "
                  "are lost (with --replicas 1 an owner that leaves, stops or is cut off "
                  "takes what it alone applied); the stream goes on from batch %d", st.key,
                  exp, f.seq - 1, peer, f.sender, f.seq)
        self.metrics.acked_missing.inc(missing)
        st.dedup.advance(stream, f.seq - 1)
        return True

    @staticmethod
    def _record_as_owner(st: ShardState, f: frames.Data) -> None:
        """Record BATCH ``f`` as done in this owner's filter of ``st`` (applied or refused
        for good).  The copy is this owner's own from here on, no longer an owner's
        snapshot plus its ROWS: the ROWS of a later owner need its snapshot first
        (on_rows: _unsynced)."""
        st.fed_base = None
        st.dedup.record((f.sender, f.incarnation, f.tensor, f.shard), f.seq)

    def _reject_recorded(self, key: tuple, st: ShardState, f: frames.Data,
                         reply: Callable[[bytes], None], reason: str) -> None:
        """Refuse BATCH ``f``, the next of its stream, for good (REJECTED: the sender drops
        it), counted done in the shard's duplicate filter so that the stream goes on past
        it.  Its mark goes to every copy in a ROWS of no rows (a copy refuses a mark that
        skips a seq: on_rows, _unsynced), and the answer waits for the copies as an
        acknowledgement does: a new owner whose filter lacked the seq would answer the
        sender's next batch GAP for good."""
        self._record_as_owner(st, f)
        self._remember_refusal(st, (f.sender, f.incarnation, f.tensor, f.shard), f.seq,
                               (self.mid, self.incarnation))
        self._send_marks(key, st, [Mark(f.sender, f.incarnation, f.seq)], refused=True)
        self.metrics.rejected(reason)
        self._wait_backups(key, st, reply, self._ack(f, Status.REJECTED))

    @staticmethod
    def _remember_refusal(st: ShardState, stream: tuple, seq: int, by: tuple) -> None:
        """Record batch ``seq`` of ``stream`` as refused for good in ``st`` by the owner
        ``by`` (sender id, incarnation), among the shard's last REFUSED_KEEP refusals, so
        that a resend of it is refused again (on_batch)."""
        st.refused[(stream, seq)] = by
        if len(st.refused) > REFUSED_KEEP:
            del st.refused[next(iter(st.refused))]         # the oldest

    @staticmethod
    def _check_in_shard(info: TInfo, f: frames.Data) -> None:
        """Every row (key; csr: entry) of BATCH ``f`` lies in the shard the frame names, and
        a dense or csr batch's rows are strictly increasing (what a drain sends): else
        BadFrame, before anything is applied.  The owner of one shard never changes
        another, which may be owned elsewhere.  O(n)."""
        if not f.n:
            return
        if info.kind == "table":
            assert f.index is not None
            wrong = np.flatnonzero(info.t._key_shard(f.index) != f.shard)
            if wrong.size:
                raise frames.BadFrame(f"malformed BATCH frame: key {int(f.index[wrong[0]])} "
                                      f"is not in shard {f.shard}")
            return
        lo, hi = info.shard_range(f.shard)
        if f.layout == Layout.RANGE:
            first, last = f.start, f.start + f.n - 1
        else:
            assert f.index is not None
            if f.n > 1 and not bool(np.all(f.index[1:] > f.index[:-1])):
                raise frames.BadFrame("malformed BATCH frame: rows not strictly increasing")
            first, last = int(f.index[0]), int(f.index[-1])
        if first < lo or last >= hi:
            raise frames.BadFrame(f"malformed BATCH frame: rows {first}..{last} are not all "
                                  f"in shard {f.shard} (rows {lo}..{hi - 1})")

    def _targets(self) -> list[str]:
        """Every other member that keeps a copy: on the ring or joining."""
        return [m for m, s in self.members.states().items()
                if m != self.addr and s in (State.ALIVE, State.SUSPECT, State.LEAVING,
                                            State.JOINING)]

    def _rows_builder(self, info: TInfo, shard: int, seq: int, n: int, marks: list,
                      **where: Any) -> frames.RowsBuilder:
        """A ROWS frame of ``n`` rows of ``shard`` to read into (frames.RowsBuilder), with
        the tensor's optimizer state; ``where``: start=, rows= or keys= (and row_steps=,
        refused=).  Stamped with this host's epoch and ring (the frame is sent as it is
        built, in this turn of the event loop: _send_to_copies): a copy counts itself
        this owner's backup by them (on_rows)."""
        spec = info.t._shard(shard).spec
        nstate = int(spec["nstate"])
        return frames.RowsBuilder(
            epoch=self.members.epoch, ring=self.ring.digest, sender=self.mid,
            incarnation=self.incarnation,
            tensor=info.tid, shard=shard, seq=ROWS_SEQ_BASE + seq, n=n, cols=info.cols,
            dtype=info.dtype, marks=marks, nstate=nstate,
            state_dtype=_native.DTYPE_NAMES[spec["state_dtype"]] if nstate else None,
            **where)

    def _send_dense_rows(self, key: tuple, info: TInfo, shard: int, index: np.ndarray,
                         f: frames.Data, marks: list) -> int:
        """ROWS of the dense rows ``index`` (global, in ``shard``, increasing) that BATCH
        ``f`` just applied, addressed as ``f`` addressed them: read under the shard's
        freeze straight into the frame, and sent to every copy."""
        st = self.shards[key]
        st.rseq += 1
        if f.layout == Layout.RANGE:
            b = self._rows_builder(info, shard, st.rseq, f.n, marks, start=f.start)
        else:
            b = self._rows_builder(info, shard, st.rseq, f.n, marks, rows=f.index)
        local = index - info.shard_range(shard)[0]
        step = info.t._read_rows_into(shard, local, [b.values] + b.state)
        self._send_to_copies(st, b.finish(step))
        return st.rseq

    def _send_csr_rows(self, key: tuple, info: TInfo, shard: int, rd: Any,
                       marks: list) -> int:
        """ROWS of a csr tensor's entries (``rd``, read after the apply), with each
        entry's step; dense rows go by _send_dense_rows, a table's ROWS are filled by
        the push that applied them (on_batch)."""
        st = self.shards[key]
        st.rseq += 1
        n = len(rd.index)
        frame = frames.encode_rows(epoch=self.members.epoch, ring=self.ring.digest,
                                   sender=self.mid,
                                   incarnation=self.incarnation, tensor=info.tid, shard=shard,
                                   seq=ROWS_SEQ_BASE + st.rseq,
                                   values=np.asarray(rd.values).reshape(n, info.cols),
                                   step=int(rd.step), marks=marks,
                                   state=[np.asarray(a).reshape(n, info.cols) for a in rd.states],
                                   rows=np.asarray(rd.index, dtype=np.int64),
                                   row_steps=np.asarray(rd.row_steps, dtype=np.uint64))
        self._send_to_copies(st, frame)
        return st.rseq

    def _send_to_copies(self, st: ShardState, frame: bytes | bytearray) -> None:
        """Send a ROWS frame (numbered ``st.rseq``) to every other host that keeps a copy
        of the shard."""
        st.rows_rseq = st.rseq
        view = self._epoch_ring   # (the frame was built just now)
        if st.epoch_rows[0] != view:
            st.epoch_rows = (view, st.rseq)
        for m in self._targets():
            if m not in st.synced and m not in st.snapshotting:
                continue  # the snapshot it will get is taken later: it covers these rows
            # (a member being sent a snapshot gets these rows after it, on the same link:
            # the snapshot was read before this batch was applied)
            link = self._out(m)
            # rows for a member whose snapshot is on its way follow it whatever the
            # backlog (the snapshot itself may exceed MAX_BACKLOG: _send_snapshot_now)
            if link is not None and link.send(frame, bulk=m in st.snapshotting):
                self.metrics.sent("rows", len(frame))
            else:
                # these rows are lost to m: copy the shard to it again (a snapshot under
                # way would end in a copy without them, and count m synced)
                st.synced.discard(m)
                st.snapshotting.pop(m, None)
                self._unsettle()

    def _required(self, st: ShardState) -> list[str]:
        """The members whose acknowledgement of a ROWS an owner waits for before it
        acknowledges the batch (``_release``; one not in ``st.synced`` holds it back
        until it is copied): the shard's reachable backups in the ring and, with
        ``--replicas`` above 1, the reachable joining members this owner sent a full
        copy of the shard in its tenure (``st.joiners_copied``, from the moment the
        copy is queued), so that a joiner holds every acknowledged batch when its
        join's epoch switches; with no backup in the ring (a ring of this host), every
        reachable joining member, copied yet or not.  So no push is acknowledged while the owner's copy is its only one,
        unless no other member is reachable at all (a lone host by --allow-minority).

        The flapping-network probe (2026-11-26) lost acknowledged pushes each time this
        was looser: with joiners never waited for, an owner on a ring of itself
        acknowledged pushes held nowhere else and lost them when the other two went on
        without it, and a joiner made owner served a copy that lacked acknowledged
        batches; with a joiner counted only while in ``st.synced``, one that refused a
        ROWS (its view had moved on) dropped out and the owner acknowledged alone; with
        only copied joiners, a host back from a cut that minted an epoch on a ring of
        itself with a joiner it heard first acknowledged its own pushes alone for 0.2 s,
        then took over the majority's ring of the same epoch number; with a joiner
        counted from its copy's acknowledgement, the owner acknowledged batches whose
        ROWS were queued to the joiner behind the copy (a slow connection, 0.5 s behind)
        and lost with it in a cut, while the joiner's acknowledgement was on the way:
        the joiner, made owner on the next ring, served its copy without them."""
        reach = self.members.reachable()
        req = [b for b in self.owners(st.key)[1:] if b in reach and b != self.addr]
        if st.leave_to is not None and st.leave_to in reach and st.leave_to not in req:
            req.append(st.leave_to)     # (leave: the next owner, which is no backup)
        if self.cfg.replicas > 1 and (st.joiners_copied or not req):
            alone = not req
            req += sorted(m for m, s in self.members.states().items()
                          if s is State.JOINING and m in reach and m != self.addr
                          and (alone or m in st.joiners_copied))
        return req

    def _wait_backups(self, key: tuple, st: ShardState, reply: Callable[[bytes], None],
                      ack: bytes, rseq: Optional[int] = None) -> None:
        """Send ``ack`` once every backup acknowledged ROW seq ``rseq``: the ROWS of the
        batch it answers, or (None: a duplicate) the last ROWS sent, which every copy
        gets.  Not st.rseq: that may be a snapshot chunk sent to one member only, which
        the others never acknowledge (a duplicate waiting for one waited for ever once
        no new batch came)."""
        st.pending.append(Pending(st.rows_rseq if rseq is None else rseq, reply, ack))
        self._release(key)

    def _release(self, key: tuple) -> None:
        st = self.shards[key]
        if not st.pending:
            return
        if not self.acting() or self.owner(st.key) != self.addr:
            # no longer an owner that may acknowledge (a stopped host that wakes up alone,
            # without quorum, must not count its dead backups out and acknowledge): drop
            # the replies; senders resend to the owner of the current view, whose copy
            # and duplicate filter decide whether the batch is applied there
            st.pending.clear()
            return
        req = self._required(st)
        floor = 0   # (the ROW seq every member waited for must have answered: the mark)
        if req:
            if (st.epoch_rows[0] != self._epoch_ring and st.reading is None
                    and time.monotonic() - st.epoch_mark_at >= RETRY):
                # (not while a snapshot of the shard is read: its chunks are numbered
                # from the ROW seq it had then; a later pass sends the mark)
                self._send_epoch_rows(key, st)
            if st.epoch_rows[0] != self._epoch_ring:
                return
            floor = st.epoch_rows[1]
        while st.pending:
            p = st.pending[0]
            need = max(p.rseq, floor)
            if any(b not in st.synced or st.acked.get(b, 0) < need for b in req):
                break
            st.pending.popleft()
            p.reply(p.ack)
            st.acked_as_owner = True

    def _send_epoch_rows(self, key: tuple, st: ShardState) -> None:
        """Send every copy of shard ``key`` a ROWS of no rows stamped with this host's
        epoch: an owner acknowledges nothing at an epoch (and ring: one can change at the
        same number) until every member it waits for has taken a frame of the shard sent
        by it (_release).  A ROWS taken at the receiver's epoch from the owner by its ring
        also keeps a joining receiver on that ring (E3c, _keeps_its_ring).  Without it, an
        owner whose tenure went on into a new epoch acknowledged resent batches
        (duplicates) by its backups' answers to ROWS of the epoch before, while the joiner
        that held them followed another ring of the new number, whose owner copied its
        shard over them (the flapping network test, trace E3-1)."""
        st.epoch_mark_at = time.monotonic()
        self._send_marks(key, st, [])

    def _send_marks(self, key: tuple, st: ShardState, marks: list,
                    refused: bool = False) -> None:
        """Send every copy of shard ``key`` a ROWS of no rows with ``marks``: none, an
        epoch's mark (_send_epoch_rows); or (``refused``, flag REFUSED) a batch refused
        for good (_reject_recorded), which the owner's filter records as done, so that the
        copies' filters expect the seq after it (on_rows: _unsynced), and which a copy
        made owner refuses again if its sender resends it (its answer lost with this
        owner)."""
        info = self.tensors.get(key[0])
        if info is None:
            return   # (the tensor is gone: nothing to acknowledge for it)
        where: dict[str, Any] = ({"keys": np.empty(0, np.uint64)} if info.kind == "table"
                                 else {"start": info.shard_range(key[1])[0]})
        st.rseq += 1
        self._send_to_copies(st, self._rows_builder(info, key[1], st.rseq, 0, marks,
                                                    refused=refused, **where).finish(0))

    # ------------------------------------------------------------ replica side
    def on_rows(self, peer: str, f: frames.Data, reply: Callable[[bytes], None]) -> None:
        info = self._tensor_for(f)
        if info is None:
            return self._refuse(f, reply, Status.BUSY, "unknown_tensor")
        key = (f.tensor, f.shard)
        st = self.shards[key]
        if (f.type == FrameType.SNAPSHOT and st.snap_broken.get((f.sender, f.incarnation))
                == f.seq - ROWS_SEQ_BASE - 1):
            return self._refuse(f, reply, Status.NOT_OWNER, "snapshot_incomplete")
        owner = self.owner(st.key)
        # rows come from the shard's owner in this host's ring, or, while this host waits
        # to take the shard over, from its previous owner (its last ROWS, then its
        # hand-over snapshot)
        # (from the process waited for: one restarted since holds the old one's copy
        # without its duplicate filter, and its frames may come before its heartbeat)
        # (and from the process the wait began with: one started since, while the hold
        # waited for its host to come back, served the old one's copy under an empty
        # filter, which replaced this host's: chaos seed 2004, a table shard 19 over)
        handover = st.handover_from == peer and (
            st.handover_init or self._handover_incarnation(st, peer, f.incarnation)
            == f.incarnation)
        if handover and f.type == FrameType.ROWS and peer != st.handover_prev:
            # Only the previous owner's last ROWS belong to a hand-over; a host asked
            # instead (a backup, the owner of the last ROWS, one waited for while cut
            # off) gives its copy as a SNAPSHOT, whose marks are checked (_behind).
            # ROWS from it are of another tenure or view of its own: written, they
            # replaced rows of this copy with another history's under this copy's marks
            handover = False
        if (peer != owner or owner == self.addr) and not handover:
            return self._refuse(f, reply, Status.NOT_OWNER, "not_owner")
        since = st.handover_since if handover else st.owner_since
        if f.epoch < since and (f.type == FrameType.ROWS or not handover):
            # Sent by the owner (or, waited for as the previous owner, its last ROWS) in
            # an earlier tenure: it owned the shard, lost it, and owns it again in this
            # host's view since that epoch.  Its frames from back then (buffered while it
            # was cut off, and delivered by TCP once the cut healed) would write its copy
            # of then over the rows the owner in between applied to (pushes lost on
            # every copy, after this host handed its copy on: the network cut test); so
            # would a hand-over it read back then for the ring that took the shard from
            # it.  The owner copies this host again.  The previous owner's ROWS are
            # checked against the tenure before this host's (ShardState.handover_since):
            # a host whose ring gave the shard to a peer for 6 ms took that peer's ROWS
            # of three epochs before as its last ones (the flapping network test,
            # 2026-11-26: the one misstep in a run that ended every copy 113 pushes
            # short).  A hand-over snapshot is checked by its marks instead (_behind)
            return self._refuse(f, reply, Status.NOT_OWNER, "stale_owner")
        if f.type == FrameType.ROWS:
            unsynced = self._unsynced(st, f, since)
            if unsynced is not None:
                return self._refuse(f, reply, Status.NOT_OWNER, unsynced)
            # (a SNAPSHOT's marks go into a new filter, its LAST's: at most max_marks
            # streams; the other chunks' are not recorded)
            if self._refuse_over_streams(st, f, [s for s, _ in self._marked(f, f.marks)],
                                         peer, reply):
                return
        fed_on: Optional[tuple[int, int]] = None
        if not handover:
            # (_role_change: whose copies are complete) The shard's owners in this host's
            # ring are the owner's only for a frame the owner sent by this host's epoch
            # and ring: the frame says which (its epoch, and the data sub-header's ring),
            # under the same authentication as the rows it carries.  By that ring the
            # owner waits for this host, its backup there, before it acknowledges a batch
            # (_required), and its later frames come after this one on the same
            # connection.  Otherwise this host does not know whom the owner waits for: it
            # counts itself no backup, and keeps the backups it knew.  (A host whose ring
            # had lost a member without a majority counted itself the owner's backup;
            # the owner had acknowledged batches with that member, whose ROWS this host
            # got only after a cut, refused by then; made owner, it served its copy
            # without them: the flapping network test, 2026-11-26, trace V33.)  (Until
            # 2026-11-28 the owner's last heartbeat said which ring it was on, and had to
            # come first: an owner restarted and ready again copies its backups at once,
            # on the other connection, and those snapshots often came before its
            # heartbeat of that epoch; with nothing pushed to the shard after them, the
            # backup counted itself none, and when that owner was killed it held
            # HANDOVER_TIMEOUT for it, "cut off", every batch refused BUSY: 3 s of
            # failover.  And a heartbeat, from a moment other than the frame's, could
            # vouch for a frame sent by another ring of the same epoch number.)
            owners = self.owners(st.key)
            st.fed_epoch = f.epoch
            by_this_ring = (f.epoch, f.ring) == self._epoch_ring
            if by_this_ring and f.type == FrameType.ROWS:
                # (_keeps_its_ring counts it while the owner's heartbeat holds this ring:
                # the ROWS may come before that heartbeat, on the other connection.  Only
                # a ROWS the owner sent by this ring, as the frame says: one of another
                # ring of this epoch number, E3, is no sign that the owner acts by this
                # one; it was recorded as if it were until review H20)
                fed_on = self._epoch_ring
            if by_this_ring:
                st.fed_owners = owners
            else:
                st.fed_owners = [peer] + list(dict.fromkeys(
                    b for b in st.fed_owners[1:] + owners[1:] if b not in (peer, self.addr)))
            behind = (self._behind(st, f) if f.type == FrameType.SNAPSHOT and f.marks
                      and f.flags & frames.Flag.LAST else None)   # (its marks: the last chunk)
            if behind is not None:
                # The owner's copy lacks a batch this one applied.  It replaces this copy
                # as every owner's snapshot does: the batch may be one no owner
                # acknowledged (a previous owner's last ROWS, which reached this host and
                # not the new owner), which its sender sends again.  If it was
                # acknowledged, it is lost here, and this line is where a trace starts
                # (the flapping network test's traces B2-12 and C2-9 would have shown it)
                stream, mine, theirs = behind
                self.shard_log.add(
                    logging.WARNING, "the owner %s's snapshots lack batches this copy "
                    "applied; taken, as the owner's copy; lost if they were acknowledged "
                    "(the senders and seqs: DEBUG)", (peer,), st.key, "shard %s: the owner "
                    "%s's snapshot lacks batches this copy applied (sender %08x: up to %d "
                    "here, %d there); taken, as the owner's copy; lost if they were "
                    "acknowledged", st.key, peer, stream[0], mine, theirs)
                self.metrics.snapshots_behind.inc()
        elif f.type == FrameType.SNAPSHOT and (f.marks or not st.handover_init and (
                f.flags & frames.Flag.LAST or st.snap_open != (
                    f.sender, f.incarnation, f.seq - ROWS_SEQ_BASE - 1))):
            # (checked on the chunks with marks, the first and the last, and on those
            # chunks when they carry none: its sender's filter held no batch, which this
            # copy may be ahead of.  A restarted process's copy, of an empty filter, was
            # taken so, and resent batches were applied again: chaos seed 2004.  A first
            # chunk is one that does not follow the open snapshot's last chunk: a
            # snapshot's chunks are numbered in a row, and one cut off leaves
            # st.snap_open behind, which a later one does not follow (review H2 F5).  A
            # creator's initial values carry none and replace nothing applied)
            behind = self._behind(st, f)
            if behind is not None:
                # The copy handed over lacks batches this host's copy holds: the sender
                # never had the owner's copy (it lost the shard again while it still
                # waited for its own hand-over, back from a cut with a copy from before
                # it).  Taken, it replaced this copy and its duplicate filter, and the
                # senders' acknowledged seqs were past the filter: GAP for good (the
                # flapping network test, 2026-11-26).  The chunk that carries the marks
                # comes first (_snapshot_chunks), before any row is written.
                stream, mine, theirs = behind
                self.shard_log.add(
                    logging.WARNING, "hand-overs from %s behind this host's copy; refused "
                    "(the senders and seqs: DEBUG)", (peer,), st.key, "shard %s: the "
                    "hand-over from %s is behind this host's copy (sender %08x: applied up "
                    "to %d here, %d there); refused", st.key, peer, stream[0], mine, theirs)
                st.handover_until = 0.0
                self._handover_given_up(st, time.monotonic())
                return self._refuse(f, reply, Status.NOT_OWNER, "stale_handover")
        if f.type == FrameType.SNAPSHOT:
            self._before_chunk(st, f)
        try:
            frames.check_schema(f, dtype=info.dtype, cols=info.cols, nrows=info.nrows)
            if f.n:
                index = (np.arange(f.start, f.start + f.n, dtype=np.int64)
                         if f.layout == Layout.RANGE else f.index)
                shape = (f.n,) + info.row_shape
                rd = RowData(index=index, values=f.values.reshape(shape),
                             states=[a.reshape(shape) for a in f.state],
                             row_steps=f.row_steps, step=f.step)
                info.t._write_rows(f.shard, rd)
                st.copied_in += 1
        except (frames.BadFrame, Error) as e:
            log.warning("%s %d from %s refused: %s", f.type.name, f.seq, peer, e)
            return self._refuse(f, reply, Status.REJECTED, "schema")
        if f.type == FrameType.SNAPSHOT:
            # between a snapshot's first chunk and its LAST the copy holds rows of the
            # sender's copy under this host's older marks: no hand-over of it then
            st.snap_open = (None if f.flags & frames.Flag.LAST
                            else (f.sender, f.incarnation, f.seq - ROWS_SEQ_BASE))
        if handover:
            # the previous owner is sending (its last ROWS, its snapshot's chunks): wait
            # on.  Giving up mid-snapshot served a copy of which only the chunks before
            # the deadline were the previous owner's, and refused the rest (seen under
            # load with a 128 MiB snapshot: a mix of the origin's init and zeros)
            st.handover_until = max(st.handover_until, time.monotonic() + HANDOVER_TIMEOUT)
        if self.debug and f.marks:
            log.warning("%s %s from %s marks %s", f.type.name, st.key, peer,
                        [(m.sender, m.seq) for m in f.marks][:6])
        if f.type == FrameType.SNAPSHOT and f.flags & frames.Flag.LAST:
            # the owner's filter replaces this host's: marks this host recorded itself
            # (say, while it applied batches cut off from the majority) are not the shard's
            st.dedup = Dedup()
            st.first_seen.clear()
            st.gapped.clear()
            # what was refused under the filter it replaces goes too; what the snapshot's
            # sender refused (its REFUSED ROWS, taken before) is in its filter: it stays
            by = (f.sender, f.incarnation)
            st.refused = {k: v for k, v in st.refused.items() if v == by}
            st.fed_base = FedBase(f.sender, f.incarnation, f.epoch, f.seq - ROWS_SEQ_BASE, peer)
        if f.type == FrameType.SNAPSHOT and not f.flags & frames.Flag.LAST:
            marks = ()   # (the first chunk's: to check, above; they count with the last)
        else:
            marks = f.marks
        for stream, seq in self._marked(f, marks):
            try:
                if f.flags & frames.Flag.FLOOR_MARKS:
                    st.dedup.advance(stream, seq)
                else:
                    if stream not in st.dedup:
                        st.dedup.advance(stream, seq - 1)
                    st.dedup.record(stream, seq)
            except CapacityError:   # (beyond the window: the streams fit, checked above)
                st.dedup.advance(stream, seq)
            if f.flags & frames.Flag.REFUSED:
                # the owner refused it for good: made owner, this host refuses a resend
                # of it again (its sender may not have had the answer)
                self._remember_refusal(st, stream, seq, (f.sender, f.incarnation))
        if f.type == FrameType.SNAPSHOT and f.flags & frames.Flag.LAST:
            st.snap_epoch_seen = self.members.epoch
            st.snapshots_received += 1
            if f.flags & frames.Flag.HANDOVER:
                if handover:
                    st.handover_from = None
                    st.handover_init = False   # (a later wait is a previous owner's)
                    self.shard_log.add(logging.INFO, "hand-over snapshots taken from %s",
                                       (peer,), st.key, "shard %s handed over by %s",
                                       st.key, peer)
                else:   # it came before this host saw the new ring
                    st.handover_done = (peer, time.monotonic(), f.epoch)
        if fed_on is not None:
            self._fed_on[peer] = (fed_on, time.monotonic())
        self.metrics.received(f.type.name.lower())
        reply(self._ack(f, Status.OK))

    def _unsynced(self, st: ShardState, f: frames.Data, since: int) -> Optional[str]:
        """Why ROWS ``f`` must not be written into this copy of ``st``, or None.  A ROWS
        carries the rows its batch changed as the owner's copy holds them
        after it (absolute values), so it is right only on top of the owner's copy as it
        was just before: the owner's SNAPSHOT and every ROWS of that owner since, none
        missed.  An owner sends ROWS only to members it copied the shard to in its tenure
        (_send_to_copies), and copies a member again when it refuses one (on_ack); this
        is the copy's half of that rule:

        - "unsynced": this copy is not the sender's snapshot (``st.fed_base``) of its
          tenure in this host's view (``since``) plus its ROWS since: it took no
          snapshot of this sender, or a frame of another (a snapshot, this host's own
          applies as owner) changed it since, or it refused a frame of this sender since
          (_refuse), and the ROWS behind that one may be lost.  (A joiner refused an
          owner's snapshot during 60 ms in which its view counted the owner dead, then
          wrote the ROWS queued behind it: its rows held 96 of the owner's batches its
          duplicate filter did not, and the host that owned the shard next applied
          them again: the flapping network test, trace K3-5.)
        - "before_snapshot": the sender numbered it before that snapshot (it came late,
          on a connection since replaced): the snapshot holds its rows, and written, it
          would put older values back.
        - "rows_skipped": a mark (S, q) of a stream this copy knows, past the next seq
          it expects: the ROWS of the batches between were lost (an owner applies each
          stream in order, and sends a ROWS for each, of no rows but the mark for one it
          refused for good: _reject_recorded).

        An empty ROWS (an epoch's mark) is checked too: the owner counts an answer to it
        as this copy holding its rows at the epoch (_release), which a copy that is not
        its snapshot plus its ROWS does not.  Refused, the owner copies this host again."""
        base = st.fed_base
        if base is None or (base.sender, base.incarnation) != (f.sender, f.incarnation) \
                or base.epoch < since:
            return "unsynced"
        if f.seq - ROWS_SEQ_BASE <= base.rseq:
            return "before_snapshot"
        if not f.flags & frames.Flag.FLOOR_MARKS:
            for m in f.marks:
                stream = (m.sender, m.incarnation, f.tensor, f.shard)
                if (m.sender, m.incarnation) not in self._gone and stream in st.dedup \
                        and m.seq > st.dedup.expected(stream):
                    self.shard_log.add(
                        logging.WARNING, "ROWS from %08x skip batches of their senders: "
                        "refused, the owner copies this host again", (f.sender,), st.key,
                        "ROWS of shard %s from %08x skip batches of sender %08x (seq %d, "
                        "expected %d): refused, the owner copies this host again", st.key,
                        f.sender, m.sender, m.seq, st.dedup.expected(stream))
                    return "rows_skipped"
        return None

    def _before_chunk(self, st: ShardState, f: frames.Data) -> None:
        """SNAPSHOT chunk ``f`` is about to be written into this copy of ``st``:

        - The copy is no longer the snapshot it was plus its owner's ROWS
          (``st.fed_base``; the LAST sets it again).  If another sender's chunk replaces
          it, that owner is told: a NOT_OWNER answer to that snapshot's LAST, as if this
          host had refused it, on this host's link to it.  It counted this copy synced,
          and would acknowledge resent batches (duplicates) by this host's earlier
          answers while the copy no longer held them, until its next ROWS was refused
          (found by review, 2026-11-26).  It drops this host from its synced copies and
          copies it again (on_ack), unless it queued it a copy since (copy_first),
          whichever of this answer and the LAST's own comes first.
        - A snapshot of another sender open here (chunks written, not its LAST) is
          broken: its next chunk, and so through its LAST, is refused (a chunk of a
          snapshot of another host written between two of its chunks left this copy a mix
          of both under the LAST's marks).  Unless a chunk after the one written was
          refused already, which _refuse recorded."""
        who = (f.sender, f.incarnation)
        base = st.fed_base
        st.fed_base = None
        if (base is not None and (base.sender, base.incarnation) != who
                and (base.sender, base.incarnation) not in self._gone):
            link = self.links.get(base.peer)
            frame = self._ack(f, Status.NOT_OWNER, ROWS_SEQ_BASE + base.rseq)
            if link is not None and link.send(frame):
                self.metrics.sent("ack", len(frame))
        if st.snap_open is not None and st.snap_open[:2] != who:
            other, written = st.snap_open[:2], st.snap_open[2]
            st.snap_broken[other] = max(st.snap_broken.get(other, written), written)

    def _behind(self, st: ShardState, f: frames.Data) -> Optional[tuple]:
        """Whether hand-over chunk ``f``'s marks (floors) lack a batch this host's copy
        of ``st`` applied: (stream, floor here, floor there) of the first such stream,
        else None.  A stream the marks do not name counts as 0 there unless they are
        cut at their limit."""
        theirs = {(m.sender, m.incarnation): m.seq for m in f.marks}
        whole = len(f.marks) < MAX_MARKS
        for stream in st.dedup.streams():
            who = (stream[0], stream[1])
            if who in self._gone or (who not in theirs and not whole):
                continue
            mine = st.dedup.floor(stream)
            if mine > theirs.get(who, 0):
                return stream, mine, theirs.get(who, 0)
        return None

    def _stop_waiting_for_restarted(self, peer: str, old: int, new: int, now: float) -> None:
        """``peer``'s bridge restarted: no hand-over wait takes its copy any more.  Its
        new process holds the old one's copy (the shard's segment outlives it) but not
        its duplicate filter: taken as the hand-over, the batches the old one applied
        and nobody acknowledged were applied again when resent (a bridge killed as a new
        owner and restarted within the hold: a chaos run, 2026-11-28).  The wait goes on
        to the previous owner's backups, or this host's copy; nor is ``peer`` asked
        later in the wait.  A wait for a creator's initial values keeps it: they are in
        its copy whichever process serves it.  A wait the restart itself began (its
        new heartbeat made ``peer`` joining, which moved the shard) recorded the new
        incarnation ``new``: it is for the old process ``old`` (review H2 F2)."""
        for st in self.shards.values():
            if st.handover_init:
                continue
            if st.handover_incs.get(peer) == new:
                st.handover_incs[peer] = old
            st.handover_next = [b for b in st.handover_next if b != peer]
            if st.handover_from == peer:
                st.handover_until = 0.0
                self._handover_given_up(st, now)

    def _incarnations_of(self, hosts: list) -> dict:
        """Each of ``hosts``' incarnation as last heard (None: not heard of yet): what a
        hand-over wait beginning now is for (ShardState.handover_incs)."""
        return {m: self._incarnations.get(m) for m in hosts}

    def _handover_incarnation(self, st: ShardState, member: str, default: int) -> int:
        """The incarnation of ``member`` whose copy the wait for ``st``'s hand-over is
        for: its process when the wait began (``st.handover_incs``), else (not heard of
        then) its current one, else ``default``."""
        began = st.handover_incs.get(member)
        return began if began is not None else self._incarnations.get(member, default)

    def _waited_restarted(self, st: ShardState, member: str) -> bool:
        """Whether ``member``'s bridge restarted since the wait for ``st``'s hand-over
        began: its new process can give no hand-over (on_heartbeat)."""
        began = st.handover_incs.get(member)
        return began is not None and self._incarnations.get(member, began) != began

    def _left_for_good(self, member: str) -> bool:
        """Whether ``member``'s current process left on purpose: its heartbeat said handed
        over and this host removed it, or had counted it dead already (a peer's view
        came first: ``_left``).  It gives no hand-over: it sends none
        (its own ring keeps it, leaving, to its end), answers no SYNC as a previous owner
        would, and its heartbeats revive nobody dead (on_heartbeat); it exits.  Its
        next process is another incarnation, which a wait begun before does not take
        (_waited_restarted)."""
        left = self._left.get(member)
        return left is not None and self._incarnations.get(member) == left

    def _handover_given_up(self, st: ShardState, now: float) -> bool:
        """Whether this owner stops waiting for the hand-over of ``st`` (it is waiting):
        HANDOVER_TIMEOUT passed since the last frame or "coming" answer from the host it
        waits for, or that host is unreachable.  Then the next reachable host of
        ``st.handover_next`` (a backup of the previous owner) is asked for its copy as
        the hand-over, and the wait goes on; with none left, this host's own copy serves:
        the wait ends (logged), and the shard's copies are maintained from it.  Asked by
        every batch and every maintenance pass (a wait that only a batch ended lasted
        for good when none came, and no copy was repaired meanwhile: a copy that missed
        the previous owner's last ROWS stayed behind)."""
        reach = self.members.reachable()
        if now < st.handover_until and st.handover_from in reach:
            return False
        waited = st.handover_from
        hold = now < st.handover_hold_until
        # one that did not deliver while reachable has nothing to give; one cut off
        # before it did is asked again if it is back before the hold ends, unless its
        # bridge restarted meanwhile (its new process holds the old one's copy without
        # its duplicate filter: on_heartbeat; the hold waited for it again, and took
        # that copy under an empty filter: chaos seed 2004), or it left on purpose: it
        # is not cut off but gone, and no copy of it can come (_left_for_good).  (A new
        # owner whose copy seemed incomplete held for the host that had just handed
        # over and left, HANDOVER_TIMEOUT in vain, with every batch of the shard
        # refused BUSY meanwhile: an owner restarted since took it up again with a
        # snapshot, which came before its heartbeat of that epoch, so the backup did
        # not count itself one (on_rows, until the frames said their ring).  The
        # walk-through of 2026-11-28: pushes stalled up to 3 s on the other hosts at
        # the leave of a host restarted 8 s before.)
        st.handover_next = [b for b in st.handover_next
                            if (b != waited or (hold and b not in reach))
                            and not self._waited_restarted(st, b)
                            and not self._left_for_good(b)]
        if (waited is not None and hold and waited not in reach
                and waited not in st.handover_next and not self._waited_restarted(st, waited)
                and not self._left_for_good(waited)):
            st.handover_next.append(waited)
        nxt = next((b for b in st.handover_next if b in reach), None)
        if nxt is not None:
            st.handover_next.remove(nxt)
            st.handover_from = nxt
            st.handover_until = now + HANDOVER_TIMEOUT
            st.sync_sent_at = 0.0   # (_maintain_shards asks it at once)
            self._unsettle()
            self.shard_log.add(
                logging.WARNING, "no hand-over snapshot from %s; asking %s, a backup of the "
                "previous owner, for its copy", (waited or "a dead owner", st.handover_from),
                st.key, "shard %s: no hand-over snapshot from %s; asking %s, a backup of "
                "the previous owner, for its copy", st.key, waited or "a dead owner",
                st.handover_from)
            return False
        if st.handover_next and hold:
            # nobody to ask is reachable now: wait for the first of them until the hold ends
            st.handover_from = st.handover_next[0]
            st.handover_until = st.handover_hold_until
            if waited != st.handover_from:
                self.shard_log.add(
                    logging.WARNING, "no hand-over snapshot from %s; waiting up to %.1f s "
                    "from the change of owner for %s, cut off, which may hold acknowledged "
                    "batches", (waited or "a dead owner", HANDOVER_TIMEOUT,
                                ", ".join(st.handover_next)), st.key,
                    "shard %s: no hand-over snapshot from %s; waiting up to %.1f s for %s, "
                    "cut off, which may hold acknowledged batches", st.key,
                    waited or "a dead owner", st.handover_hold_until - now,
                    ", ".join(st.handover_next))
            return False
        if waited is not None:
            self.shard_log.add(
                logging.WARNING, "no hand-over snapshot from %s; serving from this host's "
                "copy", (waited,), st.key, "shard %s: no hand-over snapshot from %s; serving "
                "from this host's copy", st.key, waited)
        if st.snap_open is not None:
            # A snapshot into this copy was half written when its sender went (the hold
            # waited for it, 637e620): its first rows are ahead of the copy's duplicate
            # filter, which only its LAST brings, so a batch in them that its sender had
            # acknowledged to nobody is applied again when resent.  Nobody holds a better
            # copy (or it would have been taken).  From here the copy is this owner's
            # own: it is no longer "half written" (a later owner's SYNC gets it as a
            # hand-over; it was refused for good, and that owner waited HANDOVER_TIMEOUT
            # and took a backup's copy, which this owner's ROWS feed from now on).
            sender = self.ids.get(st.snap_open[0], f"{st.snap_open[0]:08x}")
            self.shard_log.add(
                logging.WARNING, "serving copies into which a snapshot from %s was half "
                "written: batches in their first rows that it had not acknowledged may be "
                "applied again", (sender,), st.key, "shard %s: serving a copy into which a "
                "snapshot from %s was half written", st.key, sender)
            st.snap_open = None
        st.handover_from = None
        st.handover_init = False
        return True

    def _on_sync_answer(self, peer: str, key: tuple, status: Status) -> None:
        """The answer to a SYNC this host sent: BUSY from the host whose hand-over (or
        initial values) this owner waits for means it is coming (queued for, or in, that
        host's snapshot thread): wait another HANDOVER_TIMEOUT from now.  The SYNC goes
        again every 0.5 s, so the wait lasts while that host keeps saying so; it ends
        HANDOVER_TIMEOUT after its last answer or frame, or when it is unreachable."""
        st = self.shards.get(key)
        if st is None or st.handover_from != peer or status != Status.BUSY:
            return
        st.handover_until = max(st.handover_until, time.monotonic() + HANDOVER_TIMEOUT)

    def _on_init_answer(self, peer: str, key: tuple, ack: frames.Ack) -> None:
        """``peer``'s answer to this host's INIT_QUERY for shard ``key`` (leaving:
        _give_initial_values): NOT_OWNER, its process does not wait for this host's
        initial values and would refuse them; BUSY, it has not taken the tensor up (asked
        again); anything else (OK: it waits for them), they are sent.  An answer from a
        host this one no longer asks is dropped."""
        st = self.shards.get(key)
        if st is None or st.init_asked != peer:
            return
        if ack.status == Status.BUSY:
            st.init_asked = None
            return
        st.init_waits = (peer, ack.incarnation, ack.status != Status.NOT_OWNER)
        if (st.init_waits[2] and st.init_served != peer and self.owner(st.key) == peer
                and self._fresh_origin(key, time.monotonic())):
            # sent now, not at the leave's next look (every 0.25 s), as it was unasked
            self._hand_over(key, peer)

    def _on_init_query(self, peer: str, f: frames.InitQuery,
                       reply: Callable[[bytes], None]) -> None:
        """A leaving creator ``peer`` asks whether this host still waits for its initial
        values of shard (f.tensor, f.shard) (_give_initial_values).  Answered from what a
        hand-over of them from ``peer`` would meet here now (on_rows): BUSY while the
        tensor is not taken up (this host may wait for them once it is); OK while this
        host would take it (it waits for ``peer``'s copy, or ``peer`` owns the shard in
        this host's view); else NOT_OWNER, "it waits for none": a host waits for a
        creator's copy only from its take-up of the tensor on (refresh_tensors), so one
        that knows the tensor and does not wait now never will in this process (a
        restarted one is asked again: the asker keeps the answering incarnation)."""
        st = self.shards.get((f.tensor, f.shard))
        if st is None:
            reply(self._ack(f, Status.BUSY))
            return
        waits = st.handover_from == peer or self.owner(st.key) == peer
        reply(self._ack(f, Status.OK if waits else Status.NOT_OWNER))

    def _hand_over(self, key: tuple, member: str) -> None:
        """Queue a hand-over snapshot of shard ``key`` to ``member`` (its owner, which
        takes it only while it waits for one from this host: on_rows)."""
        asyncio.get_running_loop().create_task(self._send_snapshot(key, member,
                                                                   handover=True))

    async def _send_snapshot(self, key: tuple, member: str, handover: bool = False) -> None:
        """Send a consistent copy of shard ``key`` to ``member`` (chunks, then LAST)."""
        try:
            await self._send_snapshot_now(key, member, handover)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("snapshot of %s to %s failed", self.shards[key].key, member)
            self.shards[key].snapshotting.pop(member, None)
            self.shards[key].snap_retry[member] = time.monotonic() + 1.0
            self._unsettle()

    async def _send_snapshot_now(self, key: tuple, member: str, handover: bool) -> None:
        st = self.shards[key]
        info = self.tensors[key[0]]
        link = self._out(member)
        if link is None:
            return
        if st.reading is not None:
            # one read of a shard at a time, so that its ROW seqs follow the shard's last
            # ROWS (below): this copy waits for the one under way (a hand-over is asked
            # for again by the new owner's SYNC, every 0.5 s)
            if not handover:
                st.snap_retry[member] = time.monotonic() + RETRY
                self._unsettle()
            return
        # test failpoints: every hand-over is lost on the way (and no SYNC is answered
        # "coming": the new owner serves its own copy after HANDOVER_TIMEOUT), or the
        # first of each shard is (the new owner must ask again with SYNC)
        drop = ("drop_handovers" if "drop_handovers" in self._failpoints else
                "drop_first_handover" if ("drop_first_handover" in self._failpoints
                                          and key not in self._dropped) else None)
        if handover and st.snap_partial:
            # a snapshot into this copy is half written: its rows are ahead of its marks,
            # and a new owner taking it would apply again batches they already hold
            # (the new owner asks again, or another host: SYNC)
            self.shard_log.add(
                logging.INFO, "hand-overs to %s not sent: a snapshot into this copy is half "
                "written (it asks again)", (member,), st.key, "hand-over of %s to %s not "
                "sent: a snapshot into this copy is half written", st.key, member)
            return
        if handover and drop:
            self._dropped.add(key)
            log.warning("failpoint %s: hand-over of %s to %s dropped", drop, st.key, member)
            return
        if link.stream.backlog > SNAPSHOT_START_BACKLOG:
            # the connection is busy: start later (a snapshot is queued whole, whatever
            # its size, so that one of a shard larger than wsstream.MAX_BACKLOG goes
            # through; the backlog it starts from bounds what waits in memory)
            if not handover:
                st.snap_retry[member] = time.monotonic() + RETRY
                self._unsettle()
            return
        # Read and encode the copy in the snapshot thread (unless it is small:
        # _small_snapshot), so that the event loop goes on meanwhile (heartbeats above
        # all: a 192 MiB copy took 0.5-0.7 s, longer than --dead-after).  While it
        # reads, this shard refuses batches (on_batch: BUSY) and
        # no other read of it starts (above), so the bridge applies nothing to it and its
        # ROW seqs stay where they are.  A ROWS or SNAPSHOT from another host written into
        # this copy meanwhile (st.copied_in), or a change of roles that leaves the copy
        # unwanted, voids the read (a copy still missing is read again).
        marks = [Mark(s[0], s[1], st.dedup.floor(s)) for s in st.dedup.streams()
                 if st.dedup.floor(s) > 0][:MAX_MARKS]
        (epoch, ring), rseq, copied_in = self._epoch_ring, st.rseq, st.copied_in
        st.reading = member
        try:
            if self._small_snapshot(info, key[1]):
                chunks = self._snapshot_chunks(info, key[1], marks, (epoch, ring), rseq,
                                               handover)
            else:
                chunks = await asyncio.wrap_future(self._snap_reader.submit(
                    urgent.HANDOVER if handover else urgent.COPY, self._snapshot_chunks,
                    info, key[1], marks, (epoch, ring), rseq, handover))
        finally:
            st.reading = None
        link = self._out(member)
        if handover:
            still = self.owner(st.key) == member
        else:
            still = (self.acting() and self.owner(st.key) == self.addr
                     and st.handover_from is None and member in self._targets()
                     and member not in st.synced)
        changed = st.copied_in != copied_in
        if changed or link is None or not still:
            # the copy is out of date or no longer wanted: a copy still missing is sent
            # again (_maintain_shards; a hand-over is asked for again by its SYNC)
            why = "the shard changed meanwhile" if changed else "no longer wanted"
            self.shard_log.add(
                logging.INFO, "snapshots for %s dropped after their read: %s (epoch %d)",
                (member, why, self.members.epoch), st.key, "snapshot of %s for %s dropped "
                "after its read: %s (epoch %d)", st.key, member, why, self.members.epoch)
            if not handover:
                st.snap_retry[member] = time.monotonic() + RETRY
                self._unsettle()
            return
        assert st.rseq == rseq   # (nothing numbered a ROWS meanwhile: see above)
        st.rseq += len(chunks)
        if self._epoch_ring != (epoch, ring):
            # sent by this host's (epoch, ring) now, as an owner (still, above) or a
            # previous owner: a copy counts itself a backup by the pair its frame carries
            # (on_rows), and this owner waits for its backups by its ring now (_required)
            chunks = [frames.restamp_epoch(c, *self._epoch_ring) for c in chunks]
        if handover and self._is_origin(key):
            st.init_served = member   # (_give_initial_values)
            st.init_seqs = (rseq + 1, st.rseq)
            st.init_given = None      # (its answer: on_ack)
            st.init_sent_at = time.monotonic()
        if not handover:
            st.snapshotting[member] = st.rseq
            st.copy_first[member] = rseq + 1
            if self.members.states().get(member) is State.JOINING:
                # waited for from now on (_required): the ROWS of the batches acknowledged
                # from now on are queued to it behind this copy
                st.joiners_copied.add(member)
        # Queued whole in this step, whatever the backlog (bulk), so that a snapshot
        # larger than wsstream.MAX_BACKLOG goes through: the ROWS of later changes are
        # queued after it on the same connection and arrive after it.  (Streaming the
        # chunks with the loop running between them, ROWS held meanwhile, was tried and
        # once ended with copies that differed: not kept.)
        for c in chunks:
            if not link.send(c, bulk=True):   # closed
                st.snapshotting.pop(member, None)
                if handover and st.init_served == member:
                    st.init_served = None     # (not given: sent again by a leave)
                self._unsettle()
                return
            self.metrics.sent("snapshot", len(c))
        await asyncio.sleep(0)

    def _small_snapshot(self, info: TInfo, shard: int) -> bool:
        """Whether a snapshot of ``shard`` is read on the event loop: a dense or csr shard
        of at most INLINE_SNAPSHOT_BYTES of values (a table's size is its live keys,
        unknown before the read)."""
        if info.kind == "table" or "slow_snapshot" in self._failpoints:
            return False
        lo, hi = info.shard_range(shard)
        return (hi - lo) * info.cols * info.dtype.itemsize <= INLINE_SNAPSHOT_BYTES

    def _snapshot_chunks(self, info: TInfo, shard: int, marks: list,
                         view: tuple[int, int], rseq: int, handover: bool) -> list[bytes]:
        """The snapshot thread (the event loop for a small shard: _small_snapshot): one
        consistent copy of ``shard`` (read under its shared freeze) as SNAPSHOT chunks of
        about SNAPSHOT_FRAME_BYTES, ROW seqs from ``rseq + 1`` on, the last one with
        ``marks``, stamped with ``view`` (epoch, ring digest: this host's at the read).
        Touches no state of the event loop."""
        epoch, ring = view
        if "slow_snapshot" in self._failpoints:
            # test failpoint: a slow machine's copy of a large shard
            delay = float(self._failpoints["slow_snapshot"] or SLOW_SNAPSHOT_S)
            log.warning("failpoint slow_snapshot: reading shard %d of %r %.1f s later",
                        shard, info.name, delay)
            time.sleep(delay)
        rd = info.t._snapshot(shard)
        n = len(rd.index)
        row_bytes = info.cols * info.dtype.itemsize * (1 + len(rd.states)) + 16
        per = max(1, SNAPSHOT_FRAME_BYTES // row_bytes)
        chunks = []
        i = 0
        while True:
            j = min(n, i + per)
            rseq += 1
            kw: dict = {}
            if info.kind == "table":
                kw["keys"] = np.asarray(rd.index[i:j], dtype=np.uint64)
                kw["row_steps"] = np.asarray(rd.row_steps[i:j], dtype=np.uint64)
            else:
                kw["start"] = int(rd.index[i]) if j > i else info.shard_range(shard)[0]
                if info.kind == "csr":
                    kw["row_steps"] = np.asarray(rd.row_steps[i:j], dtype=np.uint64)
            vals = np.asarray(rd.values[i:j]).reshape(j - i, info.cols)
            # the marks go with the last chunk, and with the first of a hand-over too:
            # its receiver checks them before it writes a row (on_rows: _behind)
            chunks.append(frames.encode_snapshot(
                epoch=epoch, ring=ring, sender=self.mid, incarnation=self.incarnation,
                tensor=info.tid, shard=shard, seq=ROWS_SEQ_BASE + rseq, values=vals,
                step=int(rd.step), marks=marks if j >= n or (handover and i == 0) else (),
                state=[np.asarray(a[i:j]).reshape(j - i, info.cols) for a in rd.states],
                last=j >= n, handover=handover, **kw))
            i = j
            if i >= n:
                break
        return chunks

    def _maintain(self) -> None:
        """Periodic: copies to members that lack them, releases, joining progress.

        The pass over every shard runs each TICK while something is under way (a copy
        missing or being sent, a hand-over awaited) or right after anything changed
        (the member states, the epoch, quorum, the tensors; a copy lost: _unsettle), and
        every MAINTAIN_SETTLED otherwise: with thousands of shards, a pass every TICK
        cost an idle bridge a sizeable share of a core."""
        if time.monotonic() < self.grace_until:
            return
        now = time.monotonic()
        acting = self.acting()
        sig = (self.members.epoch, tuple(sorted(self.members.states().items())), acting,
               len(self.shards))
        if sig != self._maint_sig or now >= self._maint_due:
            self._maint_sig = sig
            self._maint_busy = self._maintain_shards(acting, now)
            self._maint_due = now + (TICK if self._maint_busy else MAINTAIN_SETTLED)
        self.metrics.pending.set(self.budget.used)
        self.metrics.staleness.set(self._staleness())
        if (self.members.state(self.addr) is State.JOINING and not self.ready_flag
                and self.joined_at_epoch is not None):
            self._request_copies(now)
            if self.shards and all(st.snap_epoch_seen >= 0 for st in self.shards.values()) \
                    and self.catalog_seen_from:
                self.ready_flag = True
                log.info("joined: every shard copied; ready (epoch %d)", self.members.epoch)
            elif not self.shards and self.catalog_seen_from:
                self.ready_flag = True

    def _unsettle(self) -> None:
        """Something a _maintain pass acts on changed (a copy was lost): pass at once."""
        self._maint_due = 0.0
        self._poke_tick()

    def _maintain_shards(self, acting: bool, now: float) -> bool:
        """One pass over the shards this host owns: ask again for hand-overs, send
        snapshots to members that lack a copy, release replies.  True while something
        is under way (the next pass comes a TICK later).  A settled shard (every target
        holds a copy, no reply waits) costs a set comparison: with thousands of shards,
        the whole pass had cost an idle bridge more than its flush loop."""
        targets = self._targets()
        owned = self._owned_keys() if acting else []
        busy = False
        for key in owned:
            st = self.shards[key]
            if st.handover_from is not None and not self._handover_given_up(st, now):
                busy = True
                if st.sync_sent_at < now - 0.5:
                    # ask the previous owner (again) for its hand-over snapshot
                    link = self.links.get(st.handover_from)
                    if link is not None and link.send(frames.encode_sync(
                            epoch=self.members.epoch, sender=self.mid,
                            incarnation=self.incarnation, tensor=key[0], shard=key[1],
                            seq=SYNC_SEQ)):
                        st.sync_sent_at = now
                continue
            if not st.synced.issuperset(targets):
                for m in targets:
                    if m in st.synced:
                        continue
                    busy = True
                    if (m in st.snapshotting or st.reading is not None
                            or st.snap_retry.get(m, 0) > now):
                        continue
                    if self._out(m) is None:
                        continue
                    asyncio.get_running_loop().create_task(self._send_snapshot(key, m))
            if st.pending:
                # replies waiting for backups: released by their acknowledgements
                # (on_ack), and here after a change of the member states (a backup gone)
                self._release(key)
        self.metrics.owned.set(len(owned))
        return busy

    def _owned_keys(self) -> list:
        """The keys of the shards this host owns on the current ring (cached until the
        ring or the shards change: the ring is replaced, never changed in place, and
        shards are only ever added)."""
        ring, n, keys = self._owned
        if ring is not self.ring or n != len(self.shards):
            keys = [key for key, st in self.shards.items() if self.owner(st.key) == self.addr]
            self._owned = (self.ring, len(self.shards), keys)
        return keys

    def _request_copies(self, now: float) -> None:
        """Joining: ask each shard's owner for a snapshot (SYNC) until one arrived; say how
        far the copy got every 2 s (a large store takes a while)."""
        if now >= self._join_progress_at:
            if self._join_progress_at:
                done = sum(st.snap_epoch_seen >= 0 for st in self.shards.values())
                log.info("joining: %d of %d shards copied (epoch %d)", done, len(self.shards),
                         self.members.epoch)
            self._join_progress_at = now + 2.0
        for (tid, s), st in self.shards.items():
            if st.snap_epoch_seen >= 0 or st.sync_sent_at > now - 1.0:
                continue
            owner = self.owner(st.key)
            link = self.links.get(owner) if owner else None
            if link is not None and link.send(frames.encode_sync(
                    epoch=self.members.epoch, sender=self.mid, incarnation=self.incarnation,
                    tensor=tid, shard=s, seq=SYNC_SEQ)):
                st.sync_sent_at = now
                self.metrics.sent("sync", frames.HEADER.size)

    def _staleness(self) -> float:
        # an idle stream (every frame acknowledged) is not stale: only the sending ones
        return max((self.streams[k].q.oldest_age() for k in self._sending), default=0.0)

    # ------------------------------------------------------------ catalog sync
    async def _catalog_loop(self) -> None:
        while True:
            try:
                await self.refresh_all_tensors()
                for m in list(self.members.reachable()):
                    if m == self.addr:
                        continue
                    await self._pull_catalog(m)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.debug("catalog sync: %s", e)
            await asyncio.sleep(CATALOG_INTERVAL)

    async def _ask_peer(self, peer: str, method: str, path: str, body: bytes = b"", *,
                        timeout: float, limit: int = 0, ok: tuple = (200,),
                        headers: Optional[dict] = None) -> tuple[int, Any, bytes]:
        """A request to ``peer``'s bridge, signed for it (auth.sign_request names the
        target); returns (status, response headers, body).  An answer whose status is in
        ``ok`` is read up to ``limit`` bytes and its MAC checked (auth.check_response)
        before anything of it is returned: any process listening on a member's address
        can answer.  A MAC that fails is counted and raised (AuthError); an answer of
        another status comes back with no body.  The request names this host's --store
        (under its MAC), and the answer the peer's: a peer of another store answers
        409, and check_response raises StoreMismatch for it (409 in ``ok``) or for any
        answer of such a peer."""
        import aiohttp
        signed = auth.sign_request(self.cfg.secret, method, path, body, self.addr,
                                   target=peer, store=self.cfg.store)
        async with self.session.request(method, http_url(peer, path), data=body or None,
                                        headers={**signed, **(headers or {})},
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status not in ok:
                return r.status, r.headers, b""
            data = await _read_at_most(r, limit, f"the answer of {peer} to {method} {path}")
            try:
                auth.check_response(self.cfg.secret, signed, peer, r.status, r.headers, data)
            except auth.AuthError:
                self.metrics.rejected("auth")
                raise
            return r.status, r.headers, data

    async def _pull_catalog(self, peer: str) -> None:
        known = self._catalog_tags.get(peer)
        try:
            status, answer, body = await self._ask_peer(
                peer, "GET", "/v1/catalog", timeout=1.0, limit=MAX_CATALOG_BYTES,
                ok=(200, 304, 409), headers={"If-None-Match": known} if known else None)
        except auth.AuthError as e:
            log.warning("refused the catalog answer of %s: %s", peer, e)
            return
        except auth.StoreMismatch as e:
            # A mistyped --store is refused at the handshake, and such a peer is never
            # reachable; but every configured member counts reachable, unheard, for
            # dead_after from this bridge's start, and a catalog pass then would copy
            # the other store's tensors into this one.  The request names this host's
            # store, the peer refuses it (409), and its signed refusal names the peer's:
            # reported as the handshake's refusal is, and nothing of it is copied.
            self._store_agrees(peer, e.serves)
            return
        if status == 304:   # nothing new there since every record was taken
            self.catalog_seen_from.add(peer)
            return
        if status != 200:
            return
        recs = json.loads(body)
        tag = answer.get("ETag")
        t0 = time.monotonic()
        complete = True
        for rec in recs:
            if not isinstance(rec, dict) or not _user_record(rec):
                continue
            if rec["name"] not in self.by_name and rec["name"] not in self.store._records:
                if time.monotonic() - t0 > ADOPT_SLICE:
                    # creating hundreds of tensors takes a while: let the loop run
                    # (heartbeats, batches) between slices
                    await asyncio.sleep(0)
                    t0 = time.monotonic()
                if self.fatal is not None:
                    complete = False    # (leaving: no more copies)
                    break
                try:
                    structure = (await self._fetch_structure(peer, rec)
                                 if rec["kind"] == "csr" else None)
                    self.create_from_record(rec, peer, structure)
                except auth.StoreMismatch:
                    return   # (reported: _fetch_structure; nothing more of that peer)
                except segment.NoRoom as e:
                    complete = False
                    self._no_room(rec["name"], e)
                except Error as e:
                    complete = False   # asked for again (and logged) next time
                    log.error("cannot create tensor %r like %s has it: %s", rec["name"], peer, e)
        await self.refresh_all_tensors()
        if complete and tag:
            self._catalog_tags[peer] = tag
        self.catalog_seen_from.add(peer)

    async def _fetch_structure(self, peer: str, rec: dict) -> tuple[np.ndarray, np.ndarray]:
        """The structure (rowcnt, colidx) of csr tensor ``rec`` from ``peer``
        (``POST /v1/structure``, request MAC), checked against the record's digest."""
        from ..csr import check_colidx, check_rowcnt, check_sorted, structure_hash
        rows, nnz = int(rec["shape"][0]), int(rec["nnz"])
        try:
            # (409: a peer of another store refuses the request, signed, as it refuses
            # a catalog request: taken in, so that check_response names its store)
            status, _, data = await self._ask_peer(
                peer, "POST", "/v1/structure", json.dumps({"name": rec["name"]}).encode(),
                timeout=60.0, limit=max(8 * (rows + 1 + nnz), MAX_REFUSAL_BYTES),
                ok=(200, 409))
        except auth.AuthError as e:
            raise InvalidArgument(f"structure of {rec['name']!r}: {e}") from None
        except auth.StoreMismatch as e:
            # reported as the catalog fetch reports it (a peer restarted with another
            # --store between its catalog answer and this request): raised on, so that
            # the catalog pass takes nothing more of that peer (it was "HTTP 409", an
            # ERROR each pass that said nothing of the store)
            self._store_agrees(peer, e.serves)
            raise
        if status != 200:
            raise InvalidArgument(f"structure of {rec['name']!r} from {peer}: HTTP {status}")
        if len(data) != 8 * (rows + 1 + nnz):
            raise InvalidArgument(f"structure of {rec['name']!r} from {peer}: {len(data)} "
                                  f"bytes, expected {8 * (rows + 1 + nnz)}")
        arr = np.frombuffer(data, "<i8")
        ci = check_colidx(arr[rows + 1:], int(rec["shape"][1]))
        rc = check_rowcnt(arr[:rows + 1], ci.size)
        check_sorted(rc, ci)
        if structure_hash(rc, ci) != rec.get("structure"):
            raise InvalidArgument(f"structure of {rec['name']!r} from {peer} does not match "
                                  "its record's digest")
        return rc, ci

    # ------------------------------------------------------------ HTTP
    def health(self) -> dict:
        snap = dict(self.members.snapshot())
        pending: dict[str, int] = {}
        for (tid, s), stream in self.streams.items():
            if len(stream.q):
                tgt = stream.target or "(no owner)"
                pending[tgt] = pending.get(tgt, 0) + len(stream.q)
        owned = sorted(st.key for st in self.shards.values()
                       if self.owner(st.key) == self.addr and self.acting())
        snap.update({"address": self.addr, "incarnation": self.incarnation,
                     # (peers serving another --store: refused at the handshake,
                     # logged as an ERROR once and listed here while they are members:
                     # _store_agrees; one taken out of hosts.txt is no longer news)
                     "store": self.cfg.store, "namespace": self.cfg.namespace,
                     "store_mismatch": {p: s for p, s in self.store_mismatch.items()
                                        if p in self.members.configured},
                     "replicas": self.cfg.replicas,
                     "state": self.members.state(self.addr).value,
                     "acting": self.acting(), "owned": owned, "pending": pending,
                     "staleness_ms": round(self._staleness() * 1000, 3),
                     "tensors": sorted(self.by_name), "failovers": self.failover_log[-64:],
                     # tensors this host has no room for and stays without (_no_room)
                     "no_room": dict(self.no_room),
                     "ring_digest": self.ring.digest, "ready": self.ready_flag,
                     "owner_waits": {st.key: {"pending": len(st.pending),
                                              "backups": self._required(st),
                                              "synced": sorted(st.synced),
                                              "snapshotting": sorted(st.snapshotting),
                                              "handover_from": st.handover_from,
                                              "rows_seq": st.rseq,
                                              "first_waits_for": st.pending[0].rseq,
                                              "acked": dict(st.acked)}
                                     for st in self.shards.values() if st.pending},
                     "copied": sum(st.snap_epoch_seen >= 0 for st in self.shards.values()),
                     # sender processes (member id/incarnation) with duplicate filters here
                     "filters": sorted({f"{s[0]:08x}/{s[1]:08x}" for st in self.shards.values()
                                        for s in st.dedup.streams()}),
                     "shards": len(self.shards),
                     # the event loop's longest delay of a 20 ms timer in the last 10 s
                     "loop_lag_ms": round(1e3 * max((lag for _, lag in self._lags),
                                                    default=0.0), 3),
                     # bytes handed to each peer connection and not yet taken by its
                     # socket: "data" (this host's data frames), "link" (heartbeats, ACKs)
                     "send_backlog": {m: {"data": c.stream.backlog if c else None,
                                          "link": (ln.conn.stream.backlog
                                                   if ln.conn is not None else None)}
                                      for m, ln in self.links.items()
                                      for c in (self._out(m),)},
                     "applied": int(self.metrics.applied._value.get())})
        return snap

    async def h_health(self, request: Any) -> Any:
        from aiohttp import web
        return web.json_response(self.health())

    async def h_metrics(self, request: Any) -> Any:
        from aiohttp import web
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _verify(self, request: Any, body: bytes, refused: Optional[dict] = None) -> Any:
        """The authenticated client id of ``request`` (a str), or the answer to send
        instead: 401 (``refused``, or "authentication failed") when its MAC, time or
        nonce fails; 409, signed, when it is authentic and for another store than this
        host's (auth.StoreMismatch), before anything else is done with it.  A member
        that asks for another store is reported as its handshake's refusal is
        (_store_agrees: one ERROR, /health's store_mismatch)."""
        from aiohttp import web
        try:
            return self._verifier.verify(request.method, request.path_qs, request.headers, body)
        except auth.AuthError as e:
            # (counted each; logged once per REFUSAL_LOG_EVERY per remote and reason: a
            # peer whose every request fails, one of an older release say, asks each
            # catalog pass, every 0.5 s for good, and was a WARNING each time)
            self.metrics.rejected("auth")
            self._log_refusal(str(request.remote),
                              f"{request.method} {request.path_qs}: {e}",
                              "a request from %s failed authentication: %s%s")
            return web.json_response(refused or {"error": "authentication failed"},
                                     status=401)
        except auth.StoreMismatch as e:
            who = request.headers.get(auth.HEADER_ID, "")   # (authenticated: verify passed)
            if who in self.members.configured:
                self._store_agrees(who, e.asked)
            else:   # an operator's tool given another store: once per 5 s per remote
                self.metrics.rejected("store")
                self._log_refusal(str(request.remote), f"{who!r} asks for store "
                                  f"{e.asked!r}, and this host serves {self.cfg.store!r}",
                                  "refused a request from %s: %s%s")
            return self._signed_json(request, {
                "error": f"refused: {request.method} {request.path_qs} is for store "
                         f"{e.asked!r}, and this bridge ({self.addr}) serves store "
                         f"{self.cfg.store!r}: nothing was done (ask a bridge of store "
                         f"{e.asked!r}; or, to ask this one, `shmps-tool members "
                         f"{self.addr} --store {self.cfg.store} ...`; a bridge sending "
                         "this runs with another --store than this host's: every host "
                         "must run shmps-bridge with the same --store)",
                "store": self.cfg.store, "asked": e.asked, "address": self.addr}, 409)

    async def h_catalog(self, request: Any) -> Any:
        from aiohttp import web
        who = self._verify(request, b"")
        if not isinstance(who, str):
            return who
        self.store._refresh()
        # The catalog only grows, and a record's origin is set with it: this tag changes
        # whenever the answer does.  A peer that has taken every record of this answer
        # sends it back (If-None-Match) and gets 304, not hundreds of records again.
        tag = f'"{self.incarnation}-{len(self.store._record_list)}-{len(self.adopted)}"'
        # (the answer's MAC covers this host's --store: the asker checks it is its own)
        if request.headers.get("If-None-Match") == tag:
            return web.Response(status=304, headers={
                "ETag": tag, **auth.sign_response(self.cfg.secret, request.headers,
                                                  self.addr, 304, b"", tag,
                                                  store=self.cfg.store)})
        # each record says where its tensor was created: the copy with its initial values
        # (a record not taken up yet by this process names its origin itself: a copy an
        # earlier bridge process on this store made: review H5 F6)
        recs = [dict(r, origin=self.adopted.get(r["name"]) or r.get("origin") or self.addr)
                for r in self.store._record_list if _user_record(r)]
        body = json.dumps(recs).encode()
        return web.Response(body=body, content_type="application/json", headers={
            "ETag": tag, **auth.sign_response(self.cfg.secret, request.headers, self.addr,
                                              200, body, tag, store=self.cfg.store)})

    async def h_structure(self, request: Any) -> Any:
        """``POST /v1/structure`` ``{"name": N}``: csr tensor N's rowcnt then colidx
        (little-endian int64), for a peer creating it (request MAC)."""
        from aiohttp import web
        body = await request.read()
        who = self._verify(request, body)
        if not isinstance(who, str):
            return who
        try:
            name = json.loads(body)["name"]
            if isinstance(name, str) and name not in self.by_name:
                await self.refresh_all_tensors()   # a worker may have created it a moment ago
            info = self.by_name[name] if isinstance(name, str) else None
        except (ValueError, KeyError, TypeError):
            info = None
        if info is None or info.kind != "csr":
            return web.json_response({"error": "no such csr tensor"}, status=404)
        rc, ci = info.t.structure()
        data = rc.astype("<i8").tobytes() + ci.astype("<i8").tobytes()
        return web.Response(body=data, content_type="application/octet-stream",
                            headers=auth.sign_response(self.cfg.secret, request.headers,
                                                       self.addr, 200, data,
                                                       store=self.cfg.store))

    async def h_members(self, request: Any) -> Any:
        body = await request.read()
        who = self._verify(request, body, {
            "error": "authentication failed: sign the request with the cluster's secret for "
                     f"this host (`shmps-tool members {self.addr} --store {self.cfg.store} "
                     "--secret-file F ...`, or "
                     f"auth.sign_request(..., target={self.addr!r}, store=...)); this "
                     "bridge's log says what failed", "address": self.addr})
        if not isinstance(who, str):
            return who
        shape = ('expected a JSON object {"add": ["host:port", ...], "remove": '
                 '["host:port", ...]} (either may be left out)')
        try:
            req = json.loads(body or b"{}")
            if not isinstance(req, dict):
                raise InvalidArgument(f"not an object; {shape}")
            # (a member change a bridge of another --store sends on was refused by
            # _verify: the request names its store under the MAC, 409)
            unknown = set(req) - {"add", "remove", "forwarded"}
            if unknown:
                raise InvalidArgument(f"unknown keys {sorted(unknown)}; {shape}")
            for k in ("add", "remove"):
                v = req.get(k, [])
                if not isinstance(v, list) or not all(isinstance(a, str) for a in v):
                    raise InvalidArgument(f"{k!r} is not a list of strings; {shape}")
            # (each once: an address given twice is one change, not "listed twice")
            add = list(dict.fromkeys(normalize_address(a) for a in req.get("add", [])))
            remove = list(dict.fromkeys(normalize_address(a) for a in req.get("remove", [])))
            strangers = [a for a in remove if a not in self.members.configured]
            if strangers and not req.get("forwarded"):
                raise InvalidArgument(f"not members, nothing to remove: {strangers} (the "
                                      f"members: {list(self.members.configured)})")
            before = list(self.members.configured)
            # (removed members dead or never heard are dropped at once: nothing to hand
            # over, no exit to wait for; shmps-tool members says so: cli_bridge.py)
            states = self.members.states()
            dropped = [a for a in remove if states.get(a) in (State.DEAD, State.JOINING)]
            already = [a for a in add if a in before and a not in remove]
            members = [m for m in before if m not in remove]
            members += [a for a in add if a not in members]
            # A change that changes nothing here (every address to add a member already)
            # is not applied here; it is still sent on: a member whose earlier copy of
            # it was lost (cut off, its forward not retried) catches up by asking again
            # (review H13).  Members it changes nothing for log it at DEBUG only.
            unchanged = members == before
            if not unchanged:
                self._set_members(members)
        except (ValueError, Error) as e:
            said = e.told(None) if isinstance(e, Error) else e
            return self._signed_json(request, {"error": f"bad request: {said}"}, 400)
        if not req.get("forwarded"):
            # every other member applies the same change, the removed ones included (they
            # hand over and exit); added ones read it from their own member list
            for m in before:
                if m == self.addr:
                    continue
                asyncio.get_running_loop().create_task(
                    self._post_members(m, {"add": add, "remove": remove, "forwarded": True}))
        # what changed: an address to add that was a member already is no change (it was
        # logged as one), nor, in a forwarded request, one to remove that was none here
        added = [a for a in add if a not in before]
        removed = [a for a in remove if a in before]
        if added or removed:
            log.info("members changed by %s: +%s -%s (epoch %d)", who, added, removed,
                     self.members.epoch)
        else:   # (at INFO on the host asked; sent on, DEBUG: one line per request)
            log.log(logging.DEBUG if req.get("forwarded") else logging.INFO,
                    "members unchanged by %s%s (epoch %d)", who,
                    f": {already} a member already" if already else "", self.members.epoch)
        # (an address to add that is a member already changes nothing, as a set's add:
        # named in "already", for the tool to say so)
        return self._signed_json(request, {"members": list(self.members.configured),
                                           "epoch": self.members.epoch,
                                           "already": already,
                                           "dropped": dropped}, 200)

    def _signed_json(self, request: Any, answer: dict, status: int) -> Any:
        """A JSON answer to a verified request, with its MAC (auth.sign_response): the
        sender (`shmps-tool members`) checks it came from this host."""
        from aiohttp import web
        body = json.dumps(answer).encode()
        return web.Response(body=body, status=status, content_type="application/json",
                            headers=auth.sign_response(self.cfg.secret, request.headers,
                                                       self.addr, status, body,
                                                       store=self.cfg.store))

    async def _post_members(self, peer: str, req: dict) -> None:
        try:   # (its answer is not used: not read, not signed)
            await self._ask_peer(peer, "POST", "/v1/members", json.dumps(req).encode(),
                                 timeout=2.0, ok=())
        except Exception as e:
            log.warning("could not forward the member change to %s: %s", peer, e)

    async def h_stream(self, request: Any) -> Any:
        """A peer's incoming websocket: aiohttp upgrades it, a WsStream reads it from then
        on (handshake, then the peer's frames)."""
        from aiohttp import web
        if self._closing:
            return web.Response(status=503, text="this bridge is stopping\n")
        # Unauthenticated connections are bounded (each may wait AUTH_WAIT for its
        # AUTH): per IP address, and in all for hosts that are not members', so that a
        # stranger holding its slots cannot keep a member's link out (one global cap
        # did: a member restarted did not rejoin while 64 idle connections held it).
        remote = str(request.remote)
        member_hosts = {address_host(m) for m in self.members.configured}
        strangers = sum(n for ip, n in self._handshaking.items() if ip not in member_hosts)
        if self._handshaking[remote] >= MAX_HANDSHAKES_PER_HOST or (
                remote not in member_hosts and strangers >= MAX_HANDSHAKES):
            self.metrics.rejected("auth")
            self._log_refusal(remote, "too many connections in their handshake")
            return web.Response(status=503, text="too many connections in their "
                                                 "handshake; try again\n")
        self._handshaking[remote] += 1
        handshaking = True

        def authenticated() -> None:
            """The client authenticated, or its attempt ended: its handshake slot is free."""
            nonlocal handshaking
            if handshaking:
                handshaking = False
                self._handshaking[remote] -= 1
                if not self._handshaking[remote]:
                    del self._handshaking[remote]
        try:
            ws = web.WebSocketResponse(max_msg_size=auth.MAX_HANDSHAKE_MSG)
            await ws.prepare(request)
            try:
                stream = wsstream.take_over(request, max_msg=auth.MAX_HANDSHAKE_MSG,
                                            peer=str(request.remote))
            except wsstream.WsClosed:
                return ws
            # until the client has authenticated: one handshake message, no more
            stream.limit(auth.MAX_HANDSHAKE_MSG, auth.MAX_HANDSHAKE_MSG)
            stream.on_refused = self.metrics.rejected
            self._streams.add(stream)
            try:
                if not self._closing:   # close() may have run while the upgrade was sent
                    await self._serve_stream(stream, request, authenticated)
            finally:
                self._streams.discard(stream)
                stream.close()
                # aiohttp's side of it: the transport is closing, so this only marks it
                # closed
                with contextlib.suppress(Exception):
                    await ws.close()
        finally:
            authenticated()
        return ws

    def _store_agrees(self, peer: str, theirs: str) -> bool:
        """Whether member ``peer``, whose handshake (or signed request, or signed answer)
        says it serves store ``theirs``, serves this host's.  If not, it is refused: its
        connection closes before any frame of it is read, so it is never heard, never
        reachable and on no ring here (a mistyped --store: its workers' pushes and this
        host's would never meet, and before the handshake named the store it joined the
        ring and owned shards it could not apply).  Logged once as long as it serves
        that store (each end of each connection, every retry, would otherwise log it),
        listed in /health's store_mismatch.  The namespace is not compared: it is a
        host's own."""
        if theirs == self.cfg.store:
            self.store_mismatch.pop(peer, None)
            return True
        self.metrics.rejected("store")
        if self.store_mismatch.get(peer) != theirs:
            log.error("peer %s serves store %r, this host %r: start it with --store %s "
                      "(or this host with --store %s: every host must run shmps-bridge "
                      "with the same --store); refused until then, it is no member of "
                      "this host's ring", peer, theirs, self.cfg.store, self.cfg.store,
                      theirs)
        self.store_mismatch[peer] = theirs
        return False

    def _log_refusal(self, remote: str, why: str,
                     form: str = "refused a connection from %s: %s%s") -> None:
        """Log a refused connection once per REFUSAL_LOG_EVERY s per remote host and
        reason: a peer that retries every 0.1 s, or a stranger's flood, is one line with
        a count (the metric counts each).  ``form`` takes the remote, the reason and the
        count; Link._run's refusals by the server it dials have their own."""
        key = (remote, why)
        now = time.monotonic()
        last, skipped = self._refusals_logged.get(key, (-math.inf, 0))
        if now - last >= REFUSAL_LOG_EVERY:
            log.warning(form, remote, why,
                        f" ({skipped} more like it since)" if skipped else "")
            if len(self._refusals_logged) > 1024:
                self._refusals_logged.clear()
            self._refusals_logged[key] = (now, 0)
        else:
            self._refusals_logged[key] = (last, skipped + 1)

    async def _serve_stream(self, stream: wsstream.WsStream, request: Any,
                            authenticated: Callable[[], None]) -> None:
        hs = auth.ServerHandshake(self.cfg.secret, sender=self.mid,
                                  incarnation=self.incarnation, store=self.cfg.store)
        stream.send(hs.hello())
        peer: Optional[auth.Peer] = None
        try:
            peer, ok = hs.verify(await stream.receive(min(AUTH_WAIT, auth.HANDSHAKE_TIMEOUT)))
            if peer.client_id not in self.members.states():
                raise auth.AuthError(f"{peer.client_id} is not a member here",
                                     hint="if it should be, add it to this host's hosts.txt "
                                          "(every host's list must name the same members)")
            if member_id(peer.client_id) != peer.sender:
                raise auth.AuthError(f"{peer.client_id}: member id {peer.sender:08x} does not "
                                     "match its address")
            if not self._store_agrees(peer.client_id, peer.store):
                # OK all the same, with the stream's small limit: it tells the client
                # this host's store (under the MAC), so its log names it too; then the
                # connection closes before any frame of it is read
                stream.send(ok)
                return
            stream.limit(MAX_MSG)   # a member: data frames from now on
            authenticated()
            stream.send(ok)
        except (auth.AuthError, asyncio.TimeoutError, wsstream.WsClosed) as e:
            why = str(e) or type(e).__name__
            if isinstance(e, wsstream.WsClosed) and peer is None:
                # a bridge of an older release closes right here, its version check
                # refusing this HELLO, and says why in its own log only (before, this
                # end logged "the websocket with H closed", nothing more)
                why += (" before its AUTH (a bridge of an older shmps release, of another "
                        f"handshake version than {auth.HANDSHAKE_VERSION}, closes here: "
                        "if that host runs one, upgrade it)")
            self.metrics.rejected("auth")
            self._log_refusal(str(request.remote), why)
            return
        assert peer is not None   # (verify returned it, or raised)
        stream.peer = peer.client_id
        conn = Conn(stream, peer.client_id, peer.incarnation, cork=self.cork)
        # a reconnect of the same process replaces its old stream; another process using
        # the same address (a restart) has its own
        who = (peer.client_id, peer.incarnation)
        old = self.incoming.get(who)
        self.incoming[who] = conn
        if old is not None:
            await old.close()
        self._rebind_data(peer.client_id)
        bad = 0

        def on_message(data: memoryview) -> bool:
            nonlocal bad
            bad = self.on_message(peer.client_id, peer, data, conn.send, bad)
            return bad < MAX_BAD_FRAMES

        try:
            stream.start(on_message)
            await stream.wait_closed()
        finally:
            stream.close()
            if self.incoming.get(who) is conn:
                del self.incoming[who]
                self._look_when_silent(peer.client_id)
            self._rebind_data(peer.client_id)

    def on_frame(self, peer: str, f: Any, reply: Callable[[bytes], None]) -> None:
        if isinstance(f, frames.Heartbeat):
            self.metrics.received("heartbeat")
            self.on_heartbeat(peer, f)
            return
        if (f.sender, f.incarnation) in self._gone and not isinstance(f, frames.Ack):
            # a frame of a process that has restarted since (still buffered in its old
            # connection): that process is gone, and its duplicate filters are forgotten
            self.metrics.rejected("old_incarnation")
            if isinstance(f, (frames.Data, frames.Sync)):
                reply(self._ack(f, Status.STALE_EPOCH))
            return
        # any authenticated frame keeps a peer alive; a dead one comes back only by its
        # heartbeat, which carries its view and epoch (see on_heartbeat: a majority's
        # newer epoch is taken over before the peer counts alive again)
        try:
            counts = self.members.state(peer) is not State.DEAD
        except InvalidArgument:
            # removed from the member list (it is leaving): its frames (ACKs of the ROWS
            # it still got) are handled, but it is no member to keep alive.  This raised,
            # and logged a traceback for each such frame
            counts = False
        if counts:
            self._on_changes(self.members.heartbeat(peer))
        if isinstance(f, frames.Data):
            if f.type == FrameType.BATCH:
                self.metrics.received("batch", f.values.nbytes)
                self.on_batch(peer, f, reply)
            else:
                self.on_rows(peer, f, reply)
        elif isinstance(f, frames.Sync):
            key = (f.tensor, f.shard)
            if key in self.shards and self.owner(self.shards[key].key) == self.addr:
                st = self.shards[key]
                if peer not in st.snapshotting and peer != st.reading:
                    st.synced.discard(peer)
                    st.snap_retry.pop(peer, None)
                    self._unsettle()
            elif (key in self.shards and self.owner(self.shards[key].key) == peer
                    and self._copy_to_give(key)):
                # the new owner still waits for this host's hand-over (the first one was
                # refused or lost): this host no longer applies batches, send it again;
                # or the owner of a tensor created here asks for its initial values
                # (it accepts them only while it waits for them: refresh_tensors); or,
                # the previous owner's hand-over not coming, it asks this host, one of
                # that owner's backups, for its copy (_handover_given_up, _copy_to_give)
                self._hand_over(key, peer)
                # Answered BUSY, "coming" (_on_sync_answer), while this host has the data
                # connection to send it on (the one the new owner opened, which its SYNCs
                # come on too): the snapshot thread reads one shard at a time, so the
                # origin of a large model reads the initial values of its many shards one
                # after the other, and an owner waiting for the last of them gave up after
                # HANDOVER_TIMEOUT and served its own copy (zeros where the origin's init=
                # was an array).  A read already queued or under way is not queued again
                # (_send_snapshot_now: one read of a shard at a time)
                if "drop_handovers" not in self._failpoints and self._out(peer) is not None:
                    reply(self._ack(f, Status.BUSY))
            else:
                reply(self._ack(f, Status.NOT_OWNER))
        elif isinstance(f, frames.Ack):
            self.metrics.received("ack")
            self.on_ack(peer, f)
        elif isinstance(f, frames.InitQuery):
            self.metrics.received("init_query")
            self._on_init_query(peer, f, reply)


# --------------------------------------------------------------------------- running

class StoppedBeforeStart(Exception):
    """A SIGTERM/SIGINT came while the bridge waited to start (for its store's bridge
    lock): it ends without having touched the store (serve returns)."""


async def serve(cfg: Config, ready: Optional[Callable[[Bridge], None]] = None) -> None:
    """Run a bridge until SIGTERM/SIGINT (then leave: hand over and exit).  The signal
    handlers come first: a SIGTERM while the bridge starts (taking the store's lock,
    switching forwarding on, recovering outboxes) makes it leave once started, or end
    at once while it still waits for the lock; before, it killed the process mid-start
    (no leave: what it had drained was recorded lost by the next bridge)."""
    node = Bridge(cfg)
    node._stop_event = asyncio.Event()
    loop = asyncio.get_running_loop()
    if os.name == "posix" and threading.current_thread() is threading.main_thread():
        # asyncio installs signal handlers only there; elsewhere (a bridge run in a
        # thread, as some tests do) the caller stops it with request_stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, node._on_signal)
    else:
        log.debug("no SIGTERM/SIGINT handler here: stop with request_stop()")
    try:
        await node.start()
    except StoppedBeforeStart as e:
        log.info("bridge %s stopped before it started (%s): nothing touched", node.addr, e)
        return
    if ready is not None:
        ready(node)
    try:
        await node.run_until_stopped()
        log.info("leaving: forwarding this host's pushes and handing shards over")
        await node.leave()
    finally:
        await node.close()
        log.info("bridge %s stopped", node.addr)
    if node.fatal is not None:     # (left on its own: shmps-bridge exits with status 2)
        raise node.fatal


__all__ = ["Bridge", "Config", "serve"]
