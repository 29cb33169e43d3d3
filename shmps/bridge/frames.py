"""Binary frames exchanged by bridges over websockets.

A frame is a fixed 48-byte little-endian header followed by ``payload_len`` bytes::

    off size field         meaning
      0   4 magic          b"SHPB"
      4   2 version        2 (VERSION)
      6   2 type           FrameType (BATCH, ACK, ROWS, SNAPSHOT, HEARTBEAT, SYNC,
                               INIT_QUERY)
      8   8 epoch          the sender's membership epoch, at most MAX_EPOCH (2**62)
     16   4 sender         the sender's member id (members.member_id of its address)
     20   4 incarnation    random per sender process start
     24   4 tensor         tensor id (tensor_id(name))
     28   4 shard          shard index within the tensor
     32   8 seq            sequence number in the stream (sender, incarnation, tensor, shard)
     40   2 flags          Flag bits
     42   2 layout         Layout of the rows (data frames), else 0
     44   4 payload_len    bytes after the header

BATCH, ROWS and SNAPSHOT ("data frames") share one payload: a 48-byte sub-header (its
last field: a ROWS's or SNAPSHOT's ``ring``, the digest of the ring by which its sender
sent it, owner of the shard at the header's epoch), then
``nmarks`` 16-byte marks, the row index, optional per-row steps, the values and the
optimizer state arrays, with no padding (see ``docs/bridge-protocol.md`` for the table).
ACK carries a status; HEARTBEAT the ring digest and member states; SYNC and INIT_QUERY
nothing.

:func:`decode` checks every declared size against the buffer and against
:class:`Limits` before looking at (or allocating for) the data, and raises
:class:`BadFrame` (an :class:`~shmps.errors.InvalidArgument`) with the reason for any
malformed input; arrays in the result are zero-copy numpy views of the buffer.
"""
from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from typing import Any, Iterator, Sequence, Union

import numpy as np

from ..errors import InvalidArgument

MAGIC = b"SHPB"
#: 2 since 2026-11-28: the data sub-header grew a ``ring`` field (48 bytes, was 40), so a
#: bridge of an earlier build is told "frame version 1, this host speaks 2", not that every
#: data frame it sends has the wrong size
VERSION = 2
MAX_FRAME_BYTES = 8 << 20
MAX_STATE = 4
U32 = (1 << 32) - 1
U63 = (1 << 63) - 1
U64 = (1 << 64) - 1
#: A ROWS or SNAPSHOT frame's seq is its sender's ROW seq for the shard plus this; a
#: BATCH's is its stream's seq, below it: an ACK's seq tells which of the two it answers
ROWS_SEQ_BASE = 1 << 63
#: The highest epoch a frame may carry (the field is a u64): a host that takes a majority
#: member's newer epoch over mints the next one from it, and a peer's 2**64 - 1 made that
#: 2**64, which no frame could carry: every frame encoded after it raised.  A cluster
#: minting 1000 epochs a second reaches 2**62 in ~146 million years.  A frame past it is
#: malformed (_read_header), no encoder writes one, and Membership mints none past it
MAX_EPOCH = 1 << 62
#: The seq of every INIT_QUERY, and so of the ACK that answers it (no BATCH stream's, no
#: ROWS's, not a SYNC's: node.SYNC_SEQ is ROWS_SEQ_BASE - 1): the decoder refuses another,
#: so that an answer can be told from the ACK of a stream's frame by its seq alone
INIT_QUERY_SEQ = ROWS_SEQ_BASE - 2

HEADER = struct.Struct("<4sHHQIIIIQHHI")
DATA_HEAD = struct.Struct("<HHHHIIQQIIQ")
#: where a data frame's ``ring`` field lies (restamp: a resent frame's epoch and ring)
RING_OFFSET = 48 + 40
MARK = struct.Struct("<IIQ")
ACK_BODY = struct.Struct("<HHI")
HEARTBEAT_HEAD = struct.Struct("<QQIHH")
MEMBER = struct.Struct("<IB3s")
assert HEADER.size == 48 and DATA_HEAD.size == 48 and MARK.size == 16
assert RING_OFFSET + 8 == HEADER.size + DATA_HEAD.size
assert ACK_BODY.size == 8 and HEARTBEAT_HEAD.size == 24 and MEMBER.size == 8


class FrameType(IntEnum):
    """What a frame is."""

    BATCH = 1       #: gradients, sender -> owner
    ACK = 2         #: acknowledgement or refusal of one stream's frames up to ``seq``
    ROWS = 3        #: new values of changed rows, owner -> every replica
    SNAPSHOT = 4    #: a chunk of a whole shard, for a joining or new backup host
    HEARTBEAT = 5   #: liveness, epoch, ring digest and member states, every 0.1 s
    SYNC = 6        #: "send me a snapshot of this shard, then its ROWS"
    INIT_QUERY = 7  #: a leaving creator to a shard's owner: "do you still wait for my
    #:                 initial values of this shard?" (answered by an ACK)


class Layout(IntEnum):
    """How the rows of a data frame are addressed."""

    NONE = 0        #: not a data frame
    RANGE = 1       #: rows ``start .. start + n - 1`` of a dense/csr tensor
    INDEXED = 2     #: ``n`` int64 row numbers (``rows=`` pushes)
    KEYED = 3       #: ``n`` uint64 table keys


class Flag(IntFlag):
    """Header flag bits; any other bit set is a malformed frame."""

    LAST = 1            #: SNAPSHOT: the last chunk of the shard
    ROW_STEPS = 2       #: ROWS/SNAPSHOT: a uint64 step count per row follows the index
    FLOOR_MARKS = 4     #: ROWS/SNAPSHOT: marks mean "every seq <= mark applied"
    HANDOVER = 8        #: SNAPSHOT: from the previous owner, which no longer applies batches
    CONTINUES = 16      #: BATCH: a later frame of the drain the previous seq began: the
    #:                     owner applies it at the tensor's current step, not a new one
    REFUSED = 32        #: ROWS of no rows: its marks are batches the owner refused for
    #:                     good (REJECTED), which a copy made owner refuses again if resent


class Status(IntEnum):
    """ACK status: OK acknowledges ``seq`` and all before it; others refuse ``seq``."""

    OK = 0
    STALE_EPOCH = 1     #: the frame's epoch is not the receiver's (header: receiver's)
    NOT_OWNER = 2       #: the receiver does not own this shard in its epoch
    NO_QUORUM = 3       #: the receiver does not reach a majority; retry later
    REJECTED = 4        #: schema mismatch or invalid data: never applied, but counts as
    #:                     acknowledged (sent in stream order, after OK for seq - 1)
    BUSY = 5            #: over a memory bound; resend later
    GAP = 6             #: a seq is missing before this one; resend from ack + 1


DTYPE_CODES: dict[str, int] = {"int8": 1, "int32": 2, "float16": 3, "float32": 4, "float64": 5}
"""Frame dtype codes, the same numbers as the segment layout's (native/shmps.h)."""
CODE_DTYPES: dict[int, np.dtype] = {v: np.dtype(k) for k, v in DTYPE_CODES.items()}
#: the code of each dtype (as shmps._native.DTYPE_CODES_BY_DTYPE: this module imports no
#: native code); a lookup here takes 0.09 us, np.dtype(x).name took 5.6 (_dtype_code)
DTYPE_CODE_OF: dict[np.dtype, int] = {v: k for k, v in CODE_DTYPES.items()}
FLOAT_CODES = frozenset({3, 4, 5})

_DATA_TYPES = (FrameType.BATCH, FrameType.ROWS, FrameType.SNAPSHOT)
_ALLOWED_FLAGS = {
    FrameType.BATCH: Flag.CONTINUES,
    FrameType.ACK: Flag(0),
    FrameType.ROWS: Flag.ROW_STEPS | Flag.FLOOR_MARKS | Flag.REFUSED,
    FrameType.SNAPSHOT: Flag.LAST | Flag.ROW_STEPS | Flag.FLOOR_MARKS | Flag.HANDOVER,
    FrameType.HEARTBEAT: Flag(0),
    FrameType.SYNC: Flag(0),
    FrameType.INIT_QUERY: Flag(0),
}

HB_QUORUM = 1       #: heartbeat flag: the sender reaches a majority
HB_READY = 2        #: heartbeat flag: a joining sender has copied its shards
HB_HANDED_OVER = 4  #: heartbeat flag: a leaving sender has handed its shards over
HB_ACTING = 8       #: heartbeat flag: the sender owns shards at this epoch on this ring
_HB_FLAGS = HB_QUORUM | HB_READY | HB_HANDED_OVER | HB_ACTING

# the members of each enum by value: a dict lookup per decoded field, where calling the
# enum (FrameType(x)) took ~0.8 us each, three to four times a frame
_FRAME_TYPES = {int(t): t for t in FrameType}
_LAYOUTS = {int(x): x for x in Layout}
_STATUSES = {int(x): x for x in Status}
_FLAGS = {v: Flag(v) for v in range(int(Flag.LAST | Flag.ROW_STEPS | Flag.FLOOR_MARKS
                                          | Flag.HANDOVER | Flag.CONTINUES | Flag.REFUSED)
                                      + 1)}
_ALLOWED_BITS = {t: int(f) for t, f in _ALLOWED_FLAGS.items()}


REFUSED_RULE = "a REFUSED ROWS carries marks (not floors) and no rows or row steps"


def _refused_malformed(flags: int, n: int, nmarks: int) -> bool:
    """A ROWS with ``flags`` breaks REFUSED_RULE (encoders and the decoder alike)."""
    return bool(flags & Flag.REFUSED) and bool(
        n or not nmarks or flags & (Flag.FLOOR_MARKS | Flag.ROW_STEPS))


class BadFrame(InvalidArgument):
    """A received frame is malformed or exceeds the limits; it was dropped unapplied."""

    hint = ("the peer runs another shmps version, is misconfigured or is hostile; the frame "
            "was dropped and nothing was applied")


@dataclass(frozen=True)
class Limits:
    """Bounds every received frame is checked against before anything is allocated."""

    max_frame_bytes: int = MAX_FRAME_BYTES   #: header included
    max_rows: int = 1 << 20                  #: rows or keys per frame
    max_dim: int = 1 << 21                   #: values per row
    max_marks: int = 4096                    #: dedup marks per frame
    max_members: int = 1024                  #: member entries per heartbeat
    dtypes: frozenset[int] = frozenset(DTYPE_CODES.values())   #: value dtype codes allowed


DEFAULT_LIMITS = Limits()


def tensor_id(name: str) -> int:
    """A tensor's 32-bit id in frames: the first 4 bytes of BLAKE2b(name), big-endian. O(len)."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8")).digest()[:4], "big")


# --------------------------------------------------------------------------- frame objects

@dataclass(frozen=True)
class Mark:
    """A batch of stream (sender, incarnation) applied to this frame's shard: ``seq`` itself,
    or every seq up to ``seq`` when the frame has :attr:`Flag.FLOOR_MARKS`."""

    sender: int
    incarnation: int
    seq: int


@dataclass(frozen=True)
class FrameHeader:
    """Fields every frame has."""

    type: FrameType
    epoch: int
    sender: int
    incarnation: int
    tensor: int
    shard: int
    seq: int
    flags: Flag
    layout: Layout


@dataclass(frozen=True, eq=False)
class Data(FrameHeader):
    """BATCH, ROWS or SNAPSHOT. Arrays are read-only views into the decoded buffer (the
    buffer must outlive them) unless the buffer was writable."""

    dtype: np.dtype
    cols: int
    start: int                      #: first row (RANGE), else 0
    step: int                       #: BATCH: pushes folded in (>= 1); else the shard's step
    ring: int                       #: ROWS/SNAPSHOT: the digest of the sender's ring at
    #:                                 ``epoch`` (what it sent the frame by); BATCH: 0
    marks: tuple[Mark, ...]
    index: np.ndarray | None        #: int64 rows (INDEXED) or uint64 keys (KEYED), shape (n,)
    row_steps: np.ndarray | None    #: uint64 (n,), when Flag.ROW_STEPS
    values: np.ndarray              #: (n, cols) of dtype
    state: tuple[np.ndarray, ...]   #: optimizer state arrays, each (n, cols)

    __eq__ = object.__eq__      # arrays: compare fields explicitly
    __hash__ = object.__hash__

    @property
    def n(self) -> int:
        """Rows (or keys) in the frame."""
        return int(self.values.shape[0])


@dataclass(frozen=True)
class Ack(FrameHeader):
    """Acknowledges (OK) or refuses ``seq`` of the stream (receiver, incarnation, tensor,
    shard) the receiver of this ACK sent; ``epoch`` is the acknowledger's epoch."""

    status: Status


@dataclass(frozen=True)
class Heartbeat(FrameHeader):
    """Liveness and view of the sender; ``seq`` counts the sender's heartbeats."""

    digest: int                                 #: ring digest of the sender's live set
    sent_ms: int                                #: sender's wall clock, ms since 1970
    hb_flags: int                               #: HB_QUORUM | HB_READY | HB_HANDED_OVER | HB_ACTING
    members: tuple[tuple[int, int], ...]        #: (member id, state code 1..5)


@dataclass(frozen=True)
class Sync(FrameHeader):
    """Request for a snapshot of (tensor, shard) followed by its ROWS stream."""


@dataclass(frozen=True)
class InitQuery(FrameHeader):
    """A leaving creator asks the owner of (tensor, shard) whether it still waits for the
    creator's initial values of it; ``seq`` is INIT_QUERY_SEQ."""


Frame = Union[Data, Ack, Heartbeat, Sync, InitQuery]


# --------------------------------------------------------------------------- sizes

def _dtype_code(dtype: object, what: str) -> int:
    code = DTYPE_CODE_OF.get(dtype) if isinstance(dtype, np.dtype) else None
    if code is not None:   # (every frame built asks: the common case by a lookup)
        return code
    try:
        name = np.dtype(dtype).name  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgument(f"{what}: {dtype!r} is not a dtype") from None
    code = DTYPE_CODES.get(name)
    if code is None:
        raise InvalidArgument(f"{what}: dtype {name} is not one of {', '.join(DTYPE_CODES)}")
    return code


def frame_cuts(n: int, per: int, groups: np.ndarray | None = None) -> list[tuple[int, int]]:
    """Split ``n`` rows into consecutive slices ``[i, j)`` of at most ``per`` rows each.
    With ``groups`` (non-decreasing, one label per row: a csr entry's matrix row) a cut
    falls between two groups wherever the group at the cut fits in a slice of its own,
    so each frame steps the rows it touches once; a group larger than ``per`` is split.
    O(slices * log n)."""
    if per < 1:
        raise InvalidArgument(f"per must be >= 1, got {per}")
    cuts, i = [], 0
    while i < n:
        j = min(n, i + per)
        if groups is not None and j < n and groups[j] == groups[j - 1]:
            first = int(np.searchsorted(groups, groups[j], side="left"))
            if first > i:
                j = first
        cuts.append((i, j))
        i = j
    return cuts


def data_payload_bytes(layout: Layout, n: int, cols: int, itemsize: int, *, nmarks: int = 0,
                       nstate: int = 0, state_itemsize: int = 0, row_steps: bool = False) -> int:
    """Payload bytes of a data frame with these sizes (header excluded). O(1)."""
    per_row = (8 if layout in (Layout.INDEXED, Layout.KEYED) else 0) + (8 if row_steps else 0)
    return (DATA_HEAD.size + MARK.size * nmarks + n * per_row + n * cols * itemsize
            + nstate * n * cols * state_itemsize)


def max_rows_per_frame(cols: int, dtype: object, layout: Layout = Layout.RANGE, *,
                       nmarks: int = 0, nstate: int = 0, state_dtype: object = None,
                       row_steps: bool = False, limits: Limits = DEFAULT_LIMITS) -> int:
    """The most rows of ``cols`` values one data frame can carry within ``limits``
    (0 if not even one row fits: such a tensor cannot cross the bridge). O(1)."""
    if cols < 1:
        raise InvalidArgument(f"cols must be >= 1, got {cols}")
    itemsize = np.dtype(dtype).itemsize  # type: ignore[call-overload]
    ssize = np.dtype(state_dtype).itemsize if nstate else 0  # type: ignore[call-overload]
    fixed = HEADER.size + data_payload_bytes(layout, 0, cols, itemsize, nmarks=nmarks)
    per_row = data_payload_bytes(layout, 1, cols, itemsize, nstate=nstate, state_itemsize=ssize,
                                 row_steps=row_steps) - DATA_HEAD.size
    if cols > limits.max_dim or fixed > limits.max_frame_bytes:
        return 0
    return max(0, min(limits.max_rows, (limits.max_frame_bytes - fixed) // per_row))


# --------------------------------------------------------------------------- encoding

def _u(name: str, v: int, top: int) -> int:
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not 0 <= int(v) <= top:
        raise InvalidArgument(f"{name} must be an integer in [0, {top}], got {v!r}")
    return int(v)


def _header(ftype: FrameType, *, epoch: int, sender: int, incarnation: int, tensor: int,
            shard: int, seq: int, flags: int, layout: Layout, payload_len: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, int(ftype), _u("epoch", epoch, MAX_EPOCH),
                       _u("sender", sender, U32), _u("incarnation", incarnation, U32),
                       _u("tensor", tensor, U32), _u("shard", shard, U32),
                       _u("seq", seq, U64), int(flags), int(layout), payload_len)


class Pieces:
    """A frame kept as two pieces, sent one after the other: :attr:`head` (of a BATCH,
    the header and the row index or keys, bytes) and :attr:`body` (the values: a view of
    the sender's drain buffers, not copied; of a ROWS, :meth:`RowsBuilder.finish`, no
    head and the whole frame).  ``len()`` is the frame's size, :meth:`tobytes`
    the frame itself.  A websocket sends :attr:`pieces` without joining them
    (``wsstream.WsStream.send``); the caller keeps the buffers unchanged while the frame
    may still be sent.  :func:`encode_batch` with ``copy=False``."""

    __slots__ = ("head", "body", "_n")

    def __init__(self, head: bytes, body: memoryview) -> None:
        self.head = head
        self.body = body
        self._n = len(head) + body.nbytes

    def __len__(self) -> int:
        return self._n

    @property
    def pieces(self) -> tuple[bytes, memoryview]:
        return self.head, self.body

    def tobytes(self) -> bytes:
        return b"".join((self.head, self.body))


def as_bytes(frame: "bytes | bytearray | Pieces") -> "bytes | bytearray":
    """The frame as one buffer (:class:`Pieces` joined: a copy)."""
    return frame.tobytes() if isinstance(frame, Pieces) else frame


def epoch_of(frame: "bytes | bytearray | Pieces") -> int:
    """The epoch field of an encoded frame (bytes 8..16, little-endian)."""
    head = frame.head if isinstance(frame, Pieces) else frame
    return int.from_bytes(head[8:16], "little")


def _finish(parts: list[object], total: int) -> bytes:
    out = b"".join(parts)  # type: ignore[arg-type]   # one copy of the arrays, no more
    assert len(out) == total
    return out


def _bytes_of(a: np.ndarray) -> memoryview:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).data


def _layout(n: int, start: int | None, rows: np.ndarray | None,
            keys: np.ndarray | None) -> tuple[Layout, int, np.ndarray | None]:
    """How ``n`` rows are addressed (exactly one of ``start``, ``rows``, ``keys``): the
    layout, the first row of a range (else 0), and the index as little-endian int64
    (rows) or uint64 (keys).  InvalidArgument for anything else."""
    if sum(x is not None for x in (start, rows, keys)) != 1:
        raise InvalidArgument("pass exactly one of start= (a row range), rows= or keys=")
    if start is not None:
        first = _u("start", start, U63)
        if first + n > U63:
            raise InvalidArgument("start + rows exceeds 2**63 - 1")
        return Layout.RANGE, first, None
    if rows is not None:
        index = np.asarray(rows)
        if index.dtype.kind not in "iu" or index.shape != (n,):
            raise InvalidArgument(f"rows must be {n} integers, got {index.dtype} {index.shape}")
        if n and (int(index.min()) < 0 or int(index.max()) > U63):
            raise InvalidArgument("rows must be in [0, 2**63)")
        return Layout.INDEXED, 0, index.astype("<i8", copy=False)
    index = np.asarray(keys)
    if index.dtype.kind not in "iu" or index.shape != (n,):
        raise InvalidArgument(f"keys must be {n} integers, got {index.dtype} {index.shape}")
    if index.dtype.kind == "i" and n and int(index.min()) < 0:
        raise InvalidArgument("keys must be non-negative (uint64)")
    return Layout.KEYED, 0, index.astype("<u8", copy=False)


def _state_code(dtype: np.dtype, nstate: int) -> int:
    """The frame code of the optimizer state's dtype (0 without state); InvalidArgument
    unless it is a float type and there are at most MAX_STATE arrays."""
    if not 0 <= nstate <= MAX_STATE:
        raise InvalidArgument(f"at most {MAX_STATE} state arrays")
    if not nstate:
        return 0
    code = _dtype_code(dtype, "state")
    if code not in FLOAT_CODES:
        raise InvalidArgument("optimizer state must be float16/32/64")
    return code


def _pack_marks(marks: Sequence[Mark]) -> bytes:
    if len(marks) > U32:
        raise InvalidArgument("too many marks")
    return b"".join(MARK.pack(_u("mark sender", m.sender, U32),
                              _u("mark incarnation", m.incarnation, U32),
                              _mark_seq(m.seq)) for m in marks)


def _mark_seq(seq: int) -> int:
    if not _u("mark seq", seq, U64):
        raise InvalidArgument("a mark's seq must be >= 1 (a stream's seqs start at 1; a "
                              "floor of 0 names nothing)")
    return int(seq)


def _check_size(payload: int, limits: Limits | None) -> None:
    if payload > U32:
        raise InvalidArgument(f"frame payload of {payload} bytes does not fit a frame")
    total = HEADER.size + payload
    if limits is not None and total > limits.max_frame_bytes:
        raise InvalidArgument(f"frame of {total} bytes exceeds the {limits.max_frame_bytes}"
                              "-byte limit", hint="split the rows over several frames "
                                                  "(frames.max_rows_per_frame)")


def _encode_data(ftype: FrameType, *, epoch: int, sender: int, incarnation: int, tensor: int,
                 shard: int, seq: int, values: np.ndarray, start: int | None,
                 rows: np.ndarray | None, keys: np.ndarray | None, step: int,
                 marks: Sequence[Mark], state: Sequence[np.ndarray],
                 row_steps: np.ndarray | None, flags: Flag, limits: Limits | None,
                 copy: bool = True, ring: int = 0) -> "bytes | Pieces":
    v = np.asarray(values)
    if v.ndim == 0:
        raise InvalidArgument("values must have a row axis (shape (n, ...))")
    n = int(v.shape[0])
    cols = math.prod(v.shape[1:])   # (np.prod: 9 us a call here; math.prod 0.4)
    v = v.reshape(n, cols)
    code = _dtype_code(v.dtype, "values")
    if cols < 1:
        raise InvalidArgument("rows must hold at least one value")
    layout, first, index = _layout(n, start, rows, keys)
    if ftype is FrameType.BATCH:
        if n == 0:
            raise InvalidArgument("a BATCH carries at least one row")
        if isinstance(seq, (int, np.integer)) and seq == 0:
            raise InvalidArgument("a BATCH's seq is >= 1 (a stream's seqs start at 1)")
        if marks or state or row_steps is not None or flags & ~Flag.CONTINUES or ring:
            raise InvalidArgument("a BATCH carries no marks, state, row steps, ring or "
                                  "flags other than CONTINUES")
        _u("step", step, U63)   # (the owner counts step - 1 more pushes as an int64)
        if step < 1:
            raise InvalidArgument("a BATCH folds step >= 1 pushes")
    else:
        _u("step", step, U64)
    ring = _u("ring", ring, U64)
    st = [np.asarray(x) for x in state]
    scode = _state_code(st[0].dtype, len(st)) if st else 0
    for x in st:
        if x.dtype != st[0].dtype or x.size != n * cols:
            raise InvalidArgument(f"each state array must be {n} x {cols} of {st[0].dtype}")
    ssize = st[0].dtype.itemsize if st else 0
    if row_steps is not None:
        rs = np.asarray(row_steps)
        if rs.dtype.kind not in "iu" or rs.shape != (n,) or (n and int(rs.min()) < 0):
            raise InvalidArgument(f"row_steps must be {n} non-negative integers")
        row_steps = rs.astype("<u8", copy=False)
        flags |= Flag.ROW_STEPS
    marks_bytes = _pack_marks(marks)
    payload = data_payload_bytes(layout, n, cols, v.dtype.itemsize, nmarks=len(marks),
                                 nstate=len(st), state_itemsize=ssize,
                                 row_steps=row_steps is not None)
    if n > U32 or cols > U32:
        raise InvalidArgument(f"{n} rows of {cols} values: a frame counts at most {U32} of "
                              "each", hint="split the rows over several frames "
                                           "(frames.max_rows_per_frame)")
    _check_size(payload, limits)
    parts: list[object] = [
        _header(ftype, epoch=epoch, sender=sender, incarnation=incarnation, tensor=tensor,
                shard=shard, seq=seq, flags=flags, layout=layout, payload_len=payload),
        DATA_HEAD.pack(code, len(st), scode, 0, cols, n, first, int(step), len(marks), 0,
                       ring),
        marks_bytes]
    if index is not None:
        parts.append(_bytes_of(index))
    if row_steps is not None:
        parts.append(_bytes_of(row_steps))
    parts.append(_bytes_of(v.astype(v.dtype.newbyteorder("<"), copy=False)))
    if not copy and not st:   # the values last: everything before them is the head
        out = Pieces(b"".join(parts[:-1]), parts[-1])  # type: ignore[arg-type]
        assert len(out) == HEADER.size + payload
        return out
    for x in st:
        parts.append(_bytes_of(x.astype(x.dtype.newbyteorder("<"), copy=False)))
    return _finish(parts, HEADER.size + payload)


def encode_batch(*, epoch: int, sender: int, incarnation: int, tensor: int, shard: int,
                 seq: int, values: np.ndarray, start: int | None = None,
                 rows: np.ndarray | None = None, keys: np.ndarray | None = None,
                 step: int = 1, continues: bool = False,
                 limits: Limits | None = DEFAULT_LIMITS, copy: bool = True) -> "bytes | Pieces":
    """A BATCH of gradients: ``values`` (n rows, any trailing shape) for rows ``start..``,
    for ``rows``, or for table ``keys`` (exactly one). ``step`` = pushes folded in;
    ``continues``: this frame carries more rows of the drain the previous seq began
    (Flag.CONTINUES: one drain is one step of a dense tensor, however many frames).
    Raises :class:`InvalidArgument` for bad arguments or a frame over ``limits``.
    O(frame bytes): the arrays are copied once, into the result.  ``copy=False``: the
    values are not copied (C-contiguous little-endian ones): a :class:`Pieces` whose
    body is a view of ``values``, which must not change while the frame may be sent."""
    return _encode_data(FrameType.BATCH, epoch=epoch, sender=sender, incarnation=incarnation,
                        tensor=tensor, shard=shard, seq=seq, values=values, start=start,
                        rows=rows, keys=keys, step=step, marks=(), state=(), row_steps=None,
                        flags=Flag.CONTINUES if continues else Flag(0), limits=limits,
                        copy=copy)


def encode_rows(*, epoch: int, sender: int, incarnation: int, tensor: int, shard: int,
                seq: int, values: np.ndarray, start: int | None = None,
                rows: np.ndarray | None = None, keys: np.ndarray | None = None, step: int = 0,
                marks: Sequence[Mark] = (), floor_marks: bool = False,
                state: Sequence[np.ndarray] = (), row_steps: np.ndarray | None = None,
                refused: bool = False, ring: int = 0,
                limits: Limits | None = DEFAULT_LIMITS) -> bytes:
    """A ROWS frame: new values (and optimizer ``state``) of changed rows, with the
    batches applied since the previous ROWS as ``marks`` (``refused``: no rows, and the
    marks are batches refused for good); ``ring``: the digest of the ring by which the
    sender owns the shard at ``epoch``. O(frame bytes)."""
    flags = ((Flag.FLOOR_MARKS if floor_marks else Flag(0))
             | (Flag.ROW_STEPS if row_steps is not None else Flag(0))
             | (Flag.REFUSED if refused else Flag(0)))
    if _refused_malformed(flags, (np.shape(values) or (1,))[0], len(marks)):
        raise InvalidArgument(REFUSED_RULE)
    return _encode_data(FrameType.ROWS, epoch=epoch, sender=sender, incarnation=incarnation,
                        tensor=tensor, shard=shard, seq=seq, values=values, start=start,
                        rows=rows, keys=keys, step=step, marks=marks, state=state,
                        row_steps=row_steps, flags=flags & ~Flag.ROW_STEPS, limits=limits,
                        ring=ring)


def encode_snapshot(*, epoch: int, sender: int, incarnation: int, tensor: int, shard: int,
                    seq: int, values: np.ndarray, start: int | None = None,
                    keys: np.ndarray | None = None, step: int = 0, marks: Sequence[Mark] = (),
                    floor_marks: bool = True, state: Sequence[np.ndarray] = (),
                    row_steps: np.ndarray | None = None, last: bool = False,
                    handover: bool = False, ring: int = 0,
                    limits: Limits | None = DEFAULT_LIMITS) -> bytes:
    """A SNAPSHOT chunk of a shard (rows ``start..`` or table ``keys``); ``last`` marks
    the final chunk. Marks default to floors (the shard's dedup state); ``ring``: the
    digest of the sender's ring at ``epoch``. O(frame bytes)."""
    flags = ((Flag.LAST if last else Flag(0)) | (Flag.FLOOR_MARKS if floor_marks else Flag(0))
             | (Flag.HANDOVER if handover else Flag(0)))
    return _encode_data(FrameType.SNAPSHOT, epoch=epoch, sender=sender,
                        incarnation=incarnation, tensor=tensor, shard=shard, seq=seq,
                        values=values, start=start, rows=None, keys=keys, step=step,
                        marks=marks, state=state, row_steps=row_steps, flags=flags,
                        limits=limits, ring=ring)


def _frame_buffer(total: int) -> memoryview:
    """A writable buffer of ``total`` bytes for a frame written in place, not zeroed:
    the writer fills every byte (RowsBuilder; the tests poison this buffer to check).
    A zero fill first was a memset of each 2 MiB frame, 4-6 % of an owner's CPU."""
    return memoryview(np.empty(total, np.uint8))


class RowsBuilder:
    """A ROWS frame written in place: fill :attr:`values` (and :attr:`state`, and
    :attr:`row_steps` with ``row_steps=True``), numpy views into the frame, then
    :meth:`finish` with the step; the ``rows`` or table ``keys`` are copied in at once
    (or ``start``, a range).  The owner reads the rows it applied
    straight into the frame it sends, sparing the copy :func:`encode_rows` makes of
    arrays read first.  The bytes are those :func:`encode_rows` makes of the same rows.

    Sample usage::

        b = RowsBuilder(epoch=e, sender=m, incarnation=i, tensor=t, shard=s, seq=q,
                        n=len(rows), cols=8, dtype="float32", rows=rows, marks=marks,
                        ring=digest)
        step = read_rows_into(b.values, b.state)
        frame = b.finish(step)     # every byte of the frame written: it is not zeroed
    """

    def __init__(self, *, epoch: int, sender: int, incarnation: int, tensor: int,
                 shard: int, seq: int, n: int, cols: int, dtype: object,
                 start: int | None = None, rows: np.ndarray | None = None,
                 keys: np.ndarray | None = None, row_steps: bool = False,
                 marks: Sequence[Mark] = (), nstate: int = 0, state_dtype: object = None,
                 refused: bool = False, ring: int = 0,
                 limits: Limits | None = DEFAULT_LIMITS) -> None:
        dt = np.dtype(dtype).newbyteorder("<")  # type: ignore[call-overload]
        self._code = _dtype_code(dt, "values")
        n, cols = _u("n", n, U32), _u("cols", cols, U32)
        if cols < 1:
            raise InvalidArgument("rows must hold at least one value")
        if sum(x is not None for x in (start, rows, keys)) != 1:
            raise InvalidArgument("pass exactly one of start= (a row range), rows= or keys=")
        flags = ((Flag.ROW_STEPS if row_steps else Flag(0))
                 | (Flag.REFUSED if refused else Flag(0)))
        if _refused_malformed(flags, n, len(marks)):
            raise InvalidArgument(REFUSED_RULE)
        layout, self._first, index = _layout(n, start, rows, keys)
        sdt = np.dtype(state_dtype if nstate else dt).newbyteorder("<")  # type: ignore
        self._scode = _state_code(sdt, nstate)
        marks_bytes = _pack_marks(marks)
        self._ring = _u("ring", ring, U64)
        payload = data_payload_bytes(layout, n, cols, dt.itemsize, nmarks=len(marks),
                                     nstate=nstate, state_itemsize=sdt.itemsize if nstate else 0,
                                     row_steps=row_steps)
        _check_size(payload, limits)
        total = HEADER.size + payload
        self.buf = _frame_buffer(total)
        self.buf[:HEADER.size] = _header(FrameType.ROWS, epoch=epoch, sender=sender,
                                         incarnation=incarnation, tensor=tensor, shard=shard,
                                         seq=seq, flags=flags,
                                         layout=layout, payload_len=payload)
        off = HEADER.size + DATA_HEAD.size
        self.buf[off:off + len(marks_bytes)] = marks_bytes
        off += len(marks_bytes)
        self._n, self._cols, self._nstate, self._nmarks = n, cols, nstate, len(marks)
        #: the rows (int64) or keys (uint64) the frame names, written in already
        self.index: np.ndarray | None = None
        if index is not None:
            self.index = np.frombuffer(self.buf, "<u8" if keys is not None else "<i8", n, off)
            self.index[:] = index
            off += 8 * n
        #: each row's step (row_steps=True), to be filled in
        self.row_steps: np.ndarray | None = None
        if row_steps:
            self.row_steps = np.frombuffer(self.buf, "<u8", n, off)
            off += 8 * n
        self.values: np.ndarray = np.frombuffer(self.buf, dt, n * cols, off).reshape(n, cols)
        off += n * cols * dt.itemsize
        self.state: list[np.ndarray] = []
        for _ in range(nstate):
            self.state.append(np.frombuffer(self.buf, sdt, n * cols, off).reshape(n, cols))
            off += n * cols * sdt.itemsize
        assert off == total

    def finish(self, step: int) -> "Pieces":
        """The frame, with the shard's ``step`` written in: a :class:`Pieces` of no head
        and the frame's buffer as its body, which a websocket sends without a copy (a
        plain memoryview it would copy: ``wsstream.WsStream._encode``).  The views stay
        valid, and must not be written any more."""
        DATA_HEAD.pack_into(self.buf, HEADER.size, self._code, self._nstate, self._scode, 0,
                            self._cols, self._n, self._first, _u("step", step, U64),
                            self._nmarks, 0, self._ring)
        return Pieces(b"", self.buf)


def encode_ack(*, epoch: int, sender: int, incarnation: int, tensor: int, shard: int,
               seq: int, status: Status = Status.OK) -> bytes:
    """An ACK (56 bytes). O(1)."""
    st = _STATUSES.get(status) if isinstance(status, int) else None
    if st is None:
        st = Status(status)
    return (_header(FrameType.ACK, epoch=epoch, sender=sender, incarnation=incarnation,
                    tensor=tensor, shard=shard, seq=seq, flags=0, layout=Layout.NONE,
                    payload_len=ACK_BODY.size) + ACK_BODY.pack(int(st), 0, 0))


def encode_heartbeat(*, epoch: int, sender: int, incarnation: int, seq: int, digest: int,
                     sent_ms: int, members: Sequence[tuple[int, int]], hb_flags: int = 0,
                     limits: Limits | None = DEFAULT_LIMITS) -> bytes:
    """A HEARTBEAT with the sender's view: (member id, state code) pairs. O(members)."""
    if hb_flags & ~_HB_FLAGS:
        raise InvalidArgument(f"unknown heartbeat flags {hb_flags:#x}")
    if limits is not None and len(members) > limits.max_members:
        raise InvalidArgument(f"{len(members)} members exceed the limit {limits.max_members}")
    body = [HEARTBEAT_HEAD.pack(_u("digest", digest, U64), _u("sent_ms", sent_ms, U64),
                                len(members), hb_flags, 0)]
    for mid, code in members:
        if not 1 <= code <= 5:
            raise InvalidArgument(f"member state code must be 1..5, got {code!r}")
        body.append(MEMBER.pack(_u("member id", mid, U32), code, b"\0\0\0"))
    payload = b"".join(body)
    _check_size(len(payload), limits)
    return _finish([_header(FrameType.HEARTBEAT, epoch=epoch, sender=sender,
                            incarnation=incarnation, tensor=0, shard=0, seq=seq, flags=0,
                            layout=Layout.NONE, payload_len=len(payload)), payload],
                   HEADER.size + len(payload))


def encode_sync(*, epoch: int, sender: int, incarnation: int, tensor: int, shard: int,
                seq: int = 0) -> bytes:
    """A SYNC request (48 bytes, no payload). O(1)."""
    return _header(FrameType.SYNC, epoch=epoch, sender=sender, incarnation=incarnation,
                   tensor=tensor, shard=shard, seq=seq, flags=0, layout=Layout.NONE,
                   payload_len=0)


def encode_init_query(*, epoch: int, sender: int, incarnation: int, tensor: int,
                      shard: int) -> bytes:
    """An INIT_QUERY (48 bytes, no payload, seq INIT_QUERY_SEQ). O(1)."""
    return _header(FrameType.INIT_QUERY, epoch=epoch, sender=sender, incarnation=incarnation,
                   tensor=tensor, shard=shard, seq=INIT_QUERY_SEQ, flags=0,
                   layout=Layout.NONE, payload_len=0)


def restamp_epoch(buf: "bytes | Pieces", epoch: int,
                  ring: int | None = None) -> "bytes | Pieces":
    """A copy of the encoded frame ``buf`` with its epoch field set to ``epoch`` (for
    resending unacknowledged frames after an epoch change; seq and payload unchanged),
    and, with ``ring``, the ring field of a ROWS or SNAPSHOT set to it (a snapshot read
    at one (epoch, ring) and sent at another: the pair it is sent by).  Raises
    :class:`BadFrame` if ``buf`` has no valid header, or ``ring`` is given for another
    frame. O(len(buf)) (one copy); of a :class:`Pieces`, the head is copied and the body
    shared (no ring then: a ROWS's Pieces holds its sub-header in its body)."""
    if isinstance(buf, Pieces):
        if ring is not None:
            raise BadFrame("a ring is restamped in a frame of one piece only")
        return Pieces(restamp_epoch(buf.head, epoch), buf.body)  # type: ignore[arg-type]
    mv = _as_bytes_view(buf)
    hdr, _ = _read_header(mv, Limits(max_frame_bytes=U64))
    if ring is not None and (hdr["type"] not in (FrameType.ROWS, FrameType.SNAPSHOT)
                             or len(mv) < RING_OFFSET + 8):
        raise _bad(hdr["type"], "no ring field to restamp (a ROWS or SNAPSHOT has one)")
    out = bytearray(mv)
    struct.pack_into("<Q", out, 8, _u("epoch", epoch, MAX_EPOCH))
    if ring is not None:
        struct.pack_into("<Q", out, RING_OFFSET, _u("ring", ring, U64))
    return bytes(out)


# --------------------------------------------------------------------------- decoding

def _bad(kind: object, reason: str) -> BadFrame:
    name = kind.name if isinstance(kind, FrameType) else str(kind)
    return BadFrame(f"malformed {name} frame: {reason}")


def _as_bytes_view(buf: object) -> memoryview:
    try:
        mv = memoryview(buf)  # type: ignore[arg-type]
    except TypeError:
        raise BadFrame(f"a frame must be bytes-like, got {type(buf).__name__}") from None
    if not mv.c_contiguous:   # (a strided 1-d view of bytes passed the cast: BufferError)
        raise BadFrame("a frame buffer must be C-contiguous bytes")
    if mv.ndim != 1 or mv.format not in ("B", "b", "c"):
        try:
            mv = mv.cast("B")
        except TypeError:
            raise BadFrame("a frame buffer must be C-contiguous bytes") from None
    elif mv.format != "B":
        mv = mv.cast("B")
    return mv


def _read_header(mv: memoryview, limits: Limits) -> tuple[dict[str, Any], int]:
    """The fields of the header at the start of ``mv`` (checked) and its payload length."""
    if len(mv) < HEADER.size:
        raise BadFrame(f"truncated frame: {len(mv)} bytes, the header alone is {HEADER.size}")
    (magic, version, ftype, epoch, sender, inc, tensor, shard, seq, flags, layout,
     payload_len) = HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise BadFrame(f"not a bridge frame: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise BadFrame(f"frame version {version}, this host speaks {VERSION}",
                       hint="run the same shmps version on every host")
    ft = _FRAME_TYPES.get(ftype)
    if ft is None:
        raise BadFrame(f"unknown frame type {ftype}")
    if HEADER.size + payload_len > limits.max_frame_bytes:
        raise _bad(ft, f"declares {HEADER.size + payload_len} bytes, over the "
                       f"{limits.max_frame_bytes}-byte limit")
    if flags & ~_ALLOWED_BITS[ft]:
        raise _bad(ft, f"flags {flags:#x} not allowed")
    if epoch > MAX_EPOCH:
        raise _bad(ft, f"epoch {epoch} past the bound {MAX_EPOCH} (2**62)")
    if ft in _DATA_TYPES:
        if layout not in (Layout.RANGE, Layout.INDEXED, Layout.KEYED) or (
                ft is FrameType.SNAPSHOT and layout == Layout.INDEXED):
            raise _bad(ft, f"layout {layout} not allowed")
    elif layout != Layout.NONE:
        raise _bad(ft, f"layout {layout} not allowed")
    hdr = {"type": ft, "epoch": epoch, "sender": sender, "incarnation": inc, "tensor": tensor,
           "shard": shard, "seq": seq, "flags": _FLAGS[flags], "layout": _LAYOUTS[layout]}
    return hdr, payload_len


def _new(cls: type, fields: dict[str, Any]) -> Any:
    """A frame object of ``cls`` with ``fields`` (every field, checked already): set
    straight into its ``__dict__``.  The frozen dataclass's ``__init__`` sets each of up
    to 18 fields through ``object.__setattr__``: 4.7 us a data frame against 0.9 us
    (timeit), for every frame a bridge receives."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def decode(buf: object, limits: Limits = DEFAULT_LIMITS) -> Frame:
    """Decode exactly one frame from ``buf`` (bytes, bytearray, memoryview...).

    Every size is checked against ``len(buf)`` and ``limits`` before use; malformed input
    raises :class:`BadFrame` (never another exception). Arrays are zero-copy views.
    O(1) for the checks plus O(nmarks + nmembers) to build the small tuples.
    """
    mv = _as_bytes_view(buf)
    hdr, payload_len = _read_header(mv, limits)
    if len(mv) != HEADER.size + payload_len:
        raise _bad(hdr["type"], f"header declares {payload_len} payload bytes, the buffer "
                                f"holds {len(mv) - HEADER.size}")
    return _decode_body(hdr, mv[HEADER.size:], limits)


def _decode_body(hdr: dict[str, Any], body: memoryview, limits: Limits) -> Frame:
    """The frame of header fields ``hdr`` (_read_header) and payload ``body``."""
    ft = hdr["type"]
    if ft in _DATA_TYPES:
        return _decode_data(hdr, body, limits)
    if ft is FrameType.ACK:
        if len(body) != ACK_BODY.size:
            raise _bad(ft, f"payload is {len(body)} bytes, expected {ACK_BODY.size}")
        status, r1, r2 = ACK_BODY.unpack_from(body, 0)
        if r1 or r2:
            raise _bad(ft, "reserved fields are not zero")
        st = _STATUSES.get(status)
        if st is None:
            raise _bad(ft, f"unknown status {status}")
        hdr["status"] = st
        return _new(Ack, hdr)
    if ft is FrameType.HEARTBEAT:
        return _decode_heartbeat(hdr, body, limits)
    if len(body):
        raise _bad(ft, f"payload is {len(body)} bytes, expected 0")
    if ft is FrameType.INIT_QUERY:
        if hdr["seq"] != INIT_QUERY_SEQ:
            raise _bad(ft, f"seq {hdr['seq']}, expected INIT_QUERY_SEQ ({INIT_QUERY_SEQ})")
        return _new(InitQuery, hdr)
    return _new(Sync, hdr)


def _decode_heartbeat(hdr: dict[str, Any], body: memoryview, limits: Limits) -> Heartbeat:
    ft = hdr["type"]
    if len(body) < HEARTBEAT_HEAD.size:
        raise _bad(ft, f"payload is {len(body)} bytes, at least {HEARTBEAT_HEAD.size} "
                             "expected")
    digest, sent_ms, nmembers, hb_flags, reserved = HEARTBEAT_HEAD.unpack_from(body, 0)
    if reserved:
        raise _bad(ft, "reserved field is not zero")
    if hb_flags & ~_HB_FLAGS:
        raise _bad(ft, f"unknown heartbeat flags {hb_flags:#x}")
    if nmembers > limits.max_members:
        raise _bad(ft, f"{nmembers} members, over the limit {limits.max_members}")
    if len(body) != HEARTBEAT_HEAD.size + MEMBER.size * nmembers:
        raise _bad(ft, f"{nmembers} members need {HEARTBEAT_HEAD.size + MEMBER.size * nmembers}"
                             f" payload bytes, the frame has {len(body)}")
    members = []
    for i in range(nmembers):
        mid, code, pad = MEMBER.unpack_from(body, HEARTBEAT_HEAD.size + MEMBER.size * i)
        if not 1 <= code <= 5 or pad != b"\0\0\0":
            raise _bad(ft, f"member entry {i}: state code {code} or padding invalid")
        members.append((mid, code))
    hdr.update(digest=digest, sent_ms=sent_ms, hb_flags=hb_flags, members=tuple(members))
    return _new(Heartbeat, hdr)


def _decode_data(hdr: dict[str, Any], body: memoryview, limits: Limits) -> Data:
    ft, layout = hdr["type"], hdr["layout"]
    if len(body) < DATA_HEAD.size:
        raise _bad(ft, f"payload is {len(body)} bytes, the data header alone is {DATA_HEAD.size}")
    (code, nstate, scode, r1, cols, n, start, step, nmarks, r2,
     ring) = DATA_HEAD.unpack_from(body, 0)
    if r1 or r2:
        raise _bad(ft, "reserved fields are not zero")
    if code not in CODE_DTYPES or code not in limits.dtypes:
        raise _bad(ft, f"dtype code {code} not allowed")
    if not 1 <= cols <= limits.max_dim:
        raise _bad(ft, f"{cols} values per row, allowed 1..{limits.max_dim}")
    if n > limits.max_rows:
        raise _bad(ft, f"{n} rows, over the limit {limits.max_rows}")
    if nmarks > limits.max_marks:
        raise _bad(ft, f"{nmarks} marks, over the limit {limits.max_marks}")
    if nstate > MAX_STATE:
        raise _bad(ft, f"{nstate} state arrays, at most {MAX_STATE}")
    if (nstate == 0) != (scode == 0) or (nstate and scode not in FLOAT_CODES):
        raise _bad(ft, f"state dtype code {scode} does not fit {nstate} state arrays")
    if layout != Layout.RANGE and start != 0:
        raise _bad(ft, "start must be 0 unless the layout is RANGE")
    if start + n > U63:
        raise _bad(ft, "row range exceeds 2**63 - 1")
    if ft is FrameType.BATCH and hdr["seq"] == 0:
        # (a stream's seqs start at 1: the owner answered GAP and remembered 0 as the
        # stream's first seq, then GAP for every later frame of it; a resend raised
        # InvalidArgument from its duplicate filter)
        raise _bad(ft, "a BATCH's seq is 0")
    if ft is FrameType.BATCH and (n == 0 or not 1 <= step <= U63 or nmarks or nstate or ring):
        # (step: the owner counts the pushes it stands for as an int64: a larger one was
        # applied, then raised OverflowError, unacknowledged, and applied again when resent.
        # ring: a sender's ring says nothing of a batch; 0, as a reserved field)
        raise _bad(ft, "a BATCH needs >= 1 row, step in 1..2**63 - 1, and no marks, state "
                       "or ring")
    if _refused_malformed(hdr["flags"], n, nmarks):
        raise _bad(ft, REFUSED_RULE)
    dt = CODE_DTYPES[code]
    sdt = CODE_DTYPES[scode] if nstate else None
    has_steps = bool(hdr["flags"] & Flag.ROW_STEPS)
    expected = data_payload_bytes(layout, n, cols, dt.itemsize, nmarks=nmarks,
                                  nstate=nstate, state_itemsize=sdt.itemsize if sdt else 0,
                                  row_steps=has_steps)
    if len(body) != expected:
        raise _bad(ft, f"{n} rows x {cols} of {dt.name}, {nmarks} marks, {nstate} state arrays "
                       f"need {expected} payload bytes, the frame has {len(body)}")
    off = DATA_HEAD.size
    marks = tuple(Mark(*MARK.unpack_from(body, off + MARK.size * i)) for i in range(nmarks))
    if nmarks and any(m.seq == 0 for m in marks):
        # (a stream's seqs start at 1: the duplicate filter takes none below; on_rows
        # wrote the rows of such a ROWS, then its marks raised InvalidArgument: no answer,
        # the marks before it recorded, those after it not)
        raise _bad(ft, "a mark's seq is 0")
    off += MARK.size * nmarks
    index: np.ndarray | None = None
    if layout is Layout.INDEXED or layout is Layout.KEYED:
        index = np.frombuffer(body, dtype="<i8" if layout is Layout.INDEXED else "<u8",
                              count=n, offset=off)
        off += 8 * n
    row_steps: np.ndarray | None = None
    if has_steps:
        row_steps = np.frombuffer(body, dtype="<u8", count=n, offset=off)
        off += 8 * n
    values = np.frombuffer(body, dtype=dt.newbyteorder("<"), count=n * cols,
                           offset=off).reshape(n, cols)
    off += n * cols * dt.itemsize
    state = []
    for _ in range(nstate):
        assert sdt is not None
        state.append(np.frombuffer(body, dtype=sdt.newbyteorder("<"), count=n * cols,
                                   offset=off).reshape(n, cols))
        off += n * cols * sdt.itemsize
    hdr.update(dtype=dt, cols=cols, start=start, step=step, ring=ring, marks=marks, index=index,
               row_steps=row_steps, values=values, state=tuple(state))
    return _new(Data, hdr)


def iter_frames(buf: object, limits: Limits = DEFAULT_LIMITS) -> Iterator[Frame]:
    """Decode frames laid back to back in one message (several small frames share a
    websocket message). A truncated last frame raises :class:`BadFrame` when reached.
    O(number of frames) plus each frame's decode."""
    mv = _as_bytes_view(buf)
    off, size = 0, len(mv)
    while off < size:
        hdr, payload_len = _read_header(mv[off:] if off else mv, limits)
        end = off + HEADER.size + payload_len
        if end > size:
            raise BadFrame(f"truncated frame at offset {off}: declares {HEADER.size + payload_len}"
                           f" bytes, {size - off} left")
        yield _decode_body(hdr, mv[off + HEADER.size:end], limits)
        off = end


def check_schema(frame: Data, *, dtype: object, cols: int, nrows: int | None = None) -> None:
    """Check a decoded data frame against the tensor it targets, before applying it.

    ``dtype`` is what the frame must carry (a BATCH: the tensor's gradient dtype; ROWS and
    SNAPSHOT: its value dtype), ``cols`` the values per row, ``nrows`` the row count of a
    dense/csr tensor (``None`` for a table: any key is valid, and KEYED is required).
    Raises :class:`BadFrame`. O(n) for INDEXED (min/max of the rows), else O(1).
    """
    want = np.dtype(dtype)  # type: ignore[call-overload]
    ft = frame.type
    if frame.dtype != want:
        raise _bad(ft, f"carries {frame.dtype.name}, the tensor expects {want.name}")
    if frame.cols != cols:
        raise _bad(ft, f"carries {frame.cols} values per row, the tensor has {cols}")
    if nrows is None:
        if frame.layout != Layout.KEYED:
            raise _bad(ft, "a table takes keyed rows only")
        return
    if frame.layout == Layout.KEYED:
        raise _bad(ft, "keyed rows sent to a tensor that is not a table")
    if frame.layout == Layout.RANGE:
        if frame.start + frame.n > nrows:
            raise _bad(ft, f"rows {frame.start}..{frame.start + frame.n - 1} out of range for "
                           f"{nrows} rows")
    elif frame.n:
        assert frame.index is not None
        lo, hi = int(frame.index.min()), int(frame.index.max())
        if lo < 0 or hi >= nrows:
            raise _bad(ft, f"row {lo if lo < 0 else hi} out of range for {nrows} rows")


__all__ = ["Ack", "BadFrame", "CODE_DTYPES", "DEFAULT_LIMITS", "DTYPE_CODES", "Data", "Flag",
           "Frame", "FrameHeader", "FrameType", "HB_ACTING", "HB_HANDED_OVER", "HB_QUORUM", "HB_READY",
           "HEADER", "Heartbeat", "Layout", "Limits", "MAGIC", "MAX_FRAME_BYTES", "Mark",
           "RowsBuilder", "Status", "Sync", "VERSION", "check_schema", "data_payload_bytes", "decode",
           "encode_ack", "encode_batch", "encode_heartbeat", "encode_rows", "encode_snapshot",
           "encode_sync", "iter_frames", "max_rows_per_frame", "restamp_epoch", "tensor_id",
           "Pieces", "as_bytes", "epoch_of", "MAX_EPOCH", "INIT_QUERY_SEQ", "InitQuery",
           "encode_init_query", "RING_OFFSET"]
