"""Outboxes: where pushes go while the multi-host bridge runs (store side).

While the store's forwarding switch is on (``store._set_forwarding(True)``, set by
shmps-bridge), every push to a dense tensor, table or csr tensor is validated as usual
and then *summed into the tensor's outbox* instead of applying the tensor's updater;
the bridge drains each outbox shard, sends what it held to the shard's owner, and the
owner's bridge applies it with ``tensor._apply_direct`` (so while a bridge runs, it is
the only process that applies updaters).  docs/bridge-protocol.md section 12 has the
design; docs/concurrency.md "Outboxes" why the drain is exact; docs/segment-layout.md
the bytes.

An outbox is a hidden tensor named ``<name>#outbox`` (as synchronous aggregation's
``<name>#agg0``; listed by ``store.tensors()``), created on first need by any process
(get-or-create, race-safe):

- dense: the tensor's shape and ``shard_rows``, the gradient dtype (float32 for
  float16 tensors), updater Sum, exact, with a per-row pending count (flag
  SHMPS_F_OUTBOX: a uint64 per row at ``rowstep_off``);
- table: the table's dim, capacity and shard count (so key k is in the same shard of
  both), the gradient dtype, Sum, zeros; each row's push count is its pending count.
  A drain takes the rows pushed to since the last one (a list through their
  ``rowstep`` words) and keeps their keys, zeroed, so pushing them again creates
  nothing; once keys fill over a quarter of the outbox (or a pusher died inside it) a
  drain looks at every row and removes them all (native/table.c "Outbox drains");
- csr: one value per entry, a dense outbox of ``nshards * cap`` values with
  ``shard_rows = cap`` (the entry count of the fullest shard): local entry k of shard s
  is outbox row ``s * cap + k``.

Each outbox shard header counts ``ob_pushed`` (pushes landed) and ``ob_acked`` (the
highest ``pushed`` the bridge reported applied by the owner); ``store.flush()`` waits
for the second to reach the first.  A bridge that starts on a store first calls
:func:`recover` on every outbox shard: what an earlier bridge process drained and never
saw acknowledged is recorded as lost (``ob_lost_lo``/``ob_lost_hi``/``ob_lost``) and
acknowledged, and a ``flush()`` that waited for those pushes raises
:class:`~shmps.errors.PushesLost` instead of returning as if they had been applied.
A dense push holds a *landing slot* of each outbox shard it writes from before its
first write to after its count, so that the values of a push still landing, taken by
a drain of a bridge that then ended, are caught too (native/outbox.c, "Landing").
Names ending in ``#outbox`` are reserved.  An outbox's pages are not backed at its
creation, whoever creates it (docs/architecture.md): it is as large as its tensor (a
table's: its capacity) and holds only what is pushed.  A push backs the pages it is
about to write first (_Backing), so that /dev/shm without room refuses it.

What is not forwarded: the hidden tensors of synchronous aggregation (its rounds run
per host; the round's single update of the aggregated tensor is a push, so it is
forwarded: across hosts, each host's round result reaches the owner as one push), and
outboxes themselves.  Checkpoints
save outboxes as they save every tensor, but a restore skips them: pushes still
pending when the checkpoint was taken are not part of the model it holds.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from . import _native
from .checks import BOUNDED_WAIT_HINT, check_int, check_seconds
from .dense import DenseTensor
from .errors import CorruptSegment, InvalidArgument, PushesLost, Timeout
from .table import Table
from .tensor import NO_FWD, grad_dtype

lib = _native.lib
ffi = _native.ffi

SUFFIX = "#outbox"
#: store.flush(timeout=None) waits at most this long
FLUSH_TIMEOUT_S = 60.0
#: a drain waits at most this long for any one lock or freeze that a *live* process
#: holds (a dead holder is taken over in ~1 ms), so a stopped worker cannot stall the
#: bridge: then it takes what it could reach, or nothing (None), and the next drain
#: goes on
DRAIN_TIMEOUT_S = 0.1
#: store.flush() sleeps on the ack word at most this long at a time (ns).  The bridge
#: wakes it after every acknowledgement (shmps_ack_notify), so this only bounds what a
#: bridge that never does (an older build) costs.  It was 1 ms: in the bench's table
#: round (7 ms on a slow day) every flush then woke 5-7 times for nothing, and the
#: round took 9-20 % longer than with 20 ms (3 alternated pairs, docs/benchmarks.md)
ACK_POLL_NS = 20_000_000
FULL_RETRY_S = 0.25  #: how long a table push into a full outbox waits for drains to free it


def outbox_name(name: str) -> str:
    """The outbox tensor's name of tensor ``name``."""
    return name + SUFFIX


def is_outbox_name(name: str) -> bool:
    return name.endswith(SUFFIX)


@dataclass
class Drained:
    """What one drain of an outbox shard took (``tensor._outbox_drain(shard)``).

    ``pushed``: the shard's ``ob_pushed`` read before draining; every push it counts
    has landed and is in this drain or an earlier one, so once the owner applied this
    drain (and the earlier ones), ``tensor._outbox_ack(shard, pushed, ticket)``.
    ``index``: dense: sorted unique global rows (int64); table: keys (uint64).
    ``grads``: ``(n,) + row_shape`` (dense) or ``(n, dim)`` (table), gradient dtype:
    the sum of every push of those rows since the last drain.
    ``pushes``: pushes folded in (``pushed`` minus the previous drain's, at least 1).
    ``ticket``: this drain's number among the drains of the shard that took rows (the
    ack passes it: two such drains can read the same ``pushed``, native/outbox.c).
    ``prev``: the previous drain's ``pushed``: this drain holds the pushes counted in
    ``(prev, pushed]`` (and maybe values of one still landing: native/outbox.c)."""

    pushed: int
    index: np.ndarray
    grads: np.ndarray
    pushes: int
    ticket: int = 0
    prev: int = 0


@dataclass
class RowData:
    """Rows of one shard with everything a replica needs (``_read_rows``,
    ``_snapshot``; written by ``_write_rows``).

    ``index``: dense: global rows (int64); table: keys (uint64).  ``values``:
    ``(n,) + row_shape`` / ``(n, dim)`` in the tensor's dtype.  ``states``: the
    optimizer's state arrays for those rows (state dtype, the shape of ``values``).
    ``row_steps``: tables: each row's step (uint64); dense: None.  ``step``: dense:
    the tensor's step count (Adam's t, kept in shard 0); tables: 0."""

    index: np.ndarray
    values: np.ndarray
    states: list
    row_steps: Optional[np.ndarray]
    step: int


# ---- which tensors forward ------------------------------------------------------------

def forwardable(store: Any, rec: dict) -> bool:
    """Whether pushes to the tensor of record ``rec`` go to its outbox while forwarding
    is on: dense tensors, tables and csr tensors, except outboxes and the hidden tensors
    of synchronous aggregation (local bookkeeping of this host's rounds)."""
    if rec.get("outbox_of") is not None or rec["kind"] not in ("dense", "table", "csr"):
        return False
    name = rec["name"]
    if "#" in name:
        from .aggregate import hidden_names
        base = name.rsplit("#", 1)[0]
        if name in hidden_names(base):
            brec = store._record(base)
            if brec is not None and brec.get("aggregate"):
                return False
    return True


# ---- creation ---------------------------------------------------------------------------

def get_or_create(t: Any) -> Any:
    """The outbox of tensor ``t`` (created if absent; race-safe)."""
    store = t._store
    name = outbox_name(t.name)
    gdt = grad_dtype(t.dtype).name
    req: dict = {"kind": "dense" if t.kind == "csr" else t.kind, "dtype": gdt,
                 "outbox_of": t.name}
    if t.kind == "dense":
        req.update(shape=list(t.shape), shard_rows=t.shard_rows)
        make = lambda: _create_dense(store, t.name, name, gdt, list(t.shape),  # noqa: E731
                                     t.shard_rows, t.nshards)
    elif t.kind == "table":
        req.update(dim=t.dim, capacity=t.capacity)
        make = lambda: _create_table(store, t, name, gdt)  # noqa: E731
    elif t.kind == "csr":
        # one value per entry: shard s's entries at rows s * cap .. s * cap + nnz_s - 1
        cap = t._outbox_cap
        req.update(shape=[t.nshards * cap], shard_rows=cap)
        make = lambda: _create_dense(store, t.name, name, gdt, [t.nshards * cap],  # noqa: E731
                                     cap, t.nshards)
    else:
        raise InvalidArgument(f"{t.kind} tensor {t.name!r} has no outbox")
    ob = store._get_or_create(name, req, make)
    if not isinstance(ob, (DenseOutbox, TableOutbox)) or ob.nshards != t.nshards:
        raise CorruptSegment(f"tensor {name!r} is not the outbox of {t.name!r}")
    if name not in store._lost_seen:
        # this handle's pushes to the outbox all come after this: losses recorded before
        # cannot hold them (flush compares with these counts).  setdefault (one step
        # under the GIL): of threads that came here at once, the first one's counts, read
        # before any of them pushed, stay (a later thread's, read after a loss, would
        # hide that loss of the first one's pushes from flush)
        store._lost_seen.setdefault(name, [lost(ob, i)[2] for i in range(ob.nshards)])
    return ob


def _create_dense(store: Any, of: str, name: str, gdt: str, shape: list, shard_rows: int,
                  nshards: int) -> dict:
    from .store import _dense_specs
    from .updaters import Sum

    rec = {"name": name, "kind": "dense", "dtype": gdt, "shape": shape,
           "shard_rows": shard_rows, "nshards": nshards, "optimizer": Sum().to_dict(),
           "mode": "exact", "allow_nonfinite": True, "outbox_of": of}
    return store._create_tensor(rec, _dense_specs(rec), lambda s, seg, lay: None,
                                reserve=False)


def _create_table(store: Any, t: Any, name: str, gdt: str) -> dict:
    from . import table as tmod
    from .updaters import Sum

    upd = Sum()
    rec = {"name": name, "kind": "table", "dtype": gdt, "dim": t.dim, "capacity": t.capacity,
           "seed": 0, "init_spec": ["zeros"], "nshards": t.nshards,
           "shard_rows": t.shard_rows, "optimizer": upd.to_dict(), "mode": "exact",
           "allow_nonfinite": True, "shape": [t.capacity, t.dim], "outbox_of": t.name}

    def fill(s: int, seg: Any, lay: dict) -> None:
        _native.check(lib.shmps_table_setup(seg.ptr, rec["capacity"], rec["nshards"], s),
                      f"outbox {name!r} shard {s}")

    return store._create_tensor(rec, tmod.shard_specs(rec, upd), fill, reserve=False)


# ---- the outbox tensors ---------------------------------------------------------------

def _refuse(ob: Any) -> InvalidArgument:
    return InvalidArgument(f"{ob.name!r} is the outbox of {ob.record['outbox_of']!r}: only "
                           "forwarded pushes write it", f"push to {ob.record['outbox_of']!r}")


def _check_outbox_shards(ob: Any, shards: list) -> None:
    """An outbox never forwards, and every segment it opened must be an outbox shard
    (flag SHMPS_F_OUTBOX), else CorruptSegment (the tensor is closed)."""
    ob._fwd = NO_FWD
    if not all(sh.spec["flags"] & lib.SHMPS_F_OUTBOX for sh in shards):
        ob.close()
        raise CorruptSegment(f"tensor {ob.name!r}: its segments are not outbox shards")


#: the granule (bytes of a shard's segment) in which a pushing process backs an outbox's
#: pages before its pushes write them (_Backing): 16 pages, so that a push of a few
#: scattered rows backs little more than the pages it writes, and a run of pushes few
#: granules at a time
BACK_CHUNK = 64 << 10
#: a table outbox's push backs the rows past those handed out (ctl hwm) up to this many
#: more than it may take in each shard, so that a run of pushes backs a granule at a time
BACK_AHEAD_ROWS = 1024


class _Backing:
    """Which BACK_CHUNK granules of one outbox shard's segment this process backed
    (Segment._reserve: MADV_POPULATE_WRITE, or posix_fallocate).  An outbox is created
    without its pages (module docstring: it is as large as its tensor and holds only
    what is pushed), and a push's first write to a page that /dev/shm then has no room
    for killed the pusher with SIGBUS.  A push backs what it is about to write first, so
    it is refused with CapacityError instead, the outbox unchanged.  Per process: once
    a granule is backed here, it is not asked again (another process may have backed
    it: asked again, that costs a walk of its pages, nothing more)."""

    __slots__ = ("seg", "done", "left")

    def __init__(self, seg: Any) -> None:
        self.seg = seg
        self.done = np.zeros(-(-seg.size // BACK_CHUNK), np.bool_)
        self.left = self.done.size     #: granules not backed here yet

    def chunks(self, idx: np.ndarray) -> None:
        """Back the granules ``idx`` (sorted, unique) not yet backed; CapacityError if
        /dev/shm has no room (those backed before stay backed)."""
        todo = idx[~self.done[idx]]
        if not todo.size:
            return
        cut = np.flatnonzero(np.diff(todo) != 1) + 1
        for run in np.split(todo, cut):
            a, b = int(run[0]), int(run[-1]) + 1
            self.seg._reserve(None, a * BACK_CHUNK, (b - a) * BACK_CHUNK)
            self.done[a:b] = True
        self.left = _left(self.done)

    def span(self, lo: int, hi: int) -> None:
        """Back bytes [lo, hi) of the segment."""
        if self.left and hi > lo:
            self.chunks(np.arange(lo // BACK_CHUNK, -(-hi // BACK_CHUNK)))


def _left(done: np.ndarray) -> int:
    """What is left to back, counted from ``done`` (a backing's ``left``), lock-free:
    threads of one process pushing at once each back what they found not done (backed
    twice: a walk of its pages more), and each took it off ``left``, which fell below
    what was left (-192 for 32 of 64 groups left: review H11 of 2026-11-28); at 0,
    backing stopped, and a push writing an unbacked page with /dev/shm full was killed
    by SIGBUS.  An entry of ``done`` is set only after its pages are backed and never
    cleared, so a count from it is never below what is left when stored (a thread
    storing an older count only makes ``left`` higher: one more look)."""
    return int(done.size - np.count_nonzero(done))


def _backings(t: Any) -> list:
    """The outbox ``t``'s _Backing of each shard (made on first need)."""
    b = getattr(t, "_backing", None)
    if b is None:
        b = t._backing = [_Backing(t._shard(i).seg) for i in range(t.nshards)]
    return b


class _DenseBacking:
    """The row groups of a dense outbox this process backed: a group is the rows of
    about one BACK_CHUNK of values in one shard, backed whole (their values, their row
    words, and the shard's header and stripe words) the first time a push writes one of
    them.  A push of rows checks their groups (O(len(rows)): about 3 us for 64 rows);
    once every group is backed, nothing (O(1))."""

    def __init__(self, t: Any) -> None:
        self.t = t
        self.segs = _backings(t)
        sp = t._shard(0).spec
        self.rowbytes = max(1, sp["row_len"] * sp["itemsize"])
        self.per = max(1, min(t.shard_rows, BACK_CHUNK // self.rowbytes))   # rows a group
        self.groups = -(-t.shard_rows // self.per)                          # groups a shard
        #: groups of the shards' rows in one run over the tensor's rows (row // per)
        self.flat = t.nshards == 1 or t.shard_rows % self.per == 0
        self.done = np.zeros(t.nshards * self.groups, np.bool_)
        last = t.nrows - (t.nshards - 1) * t.shard_rows          # the last shard's rows
        self.done[(t.nshards - 1) * self.groups + -(-last // self.per):] = True
        self.left = int(self.done.size - np.count_nonzero(self.done))

    def whole(self) -> None:
        if self.left:
            for b in self.segs:
                b.span(0, b.seg.size)
            self.done[:] = True
            self.left = 0

    def rows(self, rows: np.ndarray) -> None:
        if not self.left:
            return
        t = self.t
        if self.flat:
            gid = rows // self.per
        else:
            shard = rows // t.shard_rows
            gid = shard * self.groups + (rows - shard * t.shard_rows) // self.per
        # (clipped: rows of an int64 array reach here unchecked, and the C push refuses
        # one out of range before it writes; backing a group more for it is harmless)
        done = self.done.take(gid, mode="clip")
        if done.all():
            return
        new = np.unique(np.clip(gid[~done], 0, self.done.size - 1))
        # runs of consecutive groups of one shard: one backing each
        cut = np.flatnonzero((np.diff(new) != 1) | (np.diff(new // self.groups) != 0)) + 1
        for run in np.split(new, cut):
            s, k0 = divmod(int(run[0]), self.groups)
            k1 = int(run[-1]) - s * self.groups + 1
            b, sp = self.segs[s], t._shard(s).spec
            lo, hi = k0 * self.per, min(sp["nrows"], k1 * self.per)
            b.span(0, sp["value_off"])                        # header, landing slots
            b.span(sp["stripes_off"], b.seg.size)             # stripe words
            b.span(sp["value_off"] + lo * self.rowbytes, sp["value_off"] + hi * self.rowbytes)
            b.span(sp["rowstep_off"] + lo * 8, sp["rowstep_off"] + hi * 8)
            self.done[run] = True
        self.left = _left(self.done)


def _back_dense(t: Any, rows: Optional[np.ndarray]) -> None:
    """Back what a push into the dense outbox ``t`` writes (_DenseBacking): every page
    for a whole push; for ``rows``, their groups.  Closed if ``t`` is."""
    t._shard(0)
    d = getattr(t, "_dense_backing", None)
    if d is None:
        d = t._dense_backing = _DenseBacking(t)
    if rows is None:
        d.whole()
    else:
        d.rows(rows)


def _back_table_rows(t: Any, shard: int, rows: int) -> None:
    """A push (or a pull that creates) into the table outbox ``t`` was refused for new
    rows of ``shard`` past those backed (SHMPS_E_UNBACKED: rows [0, ``rows``) must be):
    back its header, index and links (its first time: a key's slot is anywhere in the
    index, about a tenth of the shard) and its per-row arrays (keys, values, row steps,
    stripes) up to ``rows`` and BACK_AHEAD_ROWS more, then say so for every process
    (shmps_table_set_backed: the shard's ctl ``backed``, which the C creation checks
    under the creation lock: the push's other shards, and pushes without new rows, cost
    nothing).  CapacityError if /dev/shm has no room, nothing changed."""
    b, sp = _backings(t)[shard], t._shard(shard).spec
    b.span(0, sp["colidx_off"])                       # header
    b.span(sp["index_off"], b.seg.size)               # index, ctl, links
    upto = min(sp["nrows"], rows + BACK_AHEAD_ROWS)
    bounds = [sp["colidx_off"], sp["value_off"], sp["rowstep_off"], sp["stripes_off"],
              sp["index_off"]]
    for lo, hi in zip(bounds, bounds[1:]):            # the per-row arrays
        b.span(lo, lo + -(-(hi - lo) * upto // sp["nrows"]))
    _native.check(lib.shmps_table_set_backed(t._ptrs(), t.nshards, shard, upto),
                  f"push to {t.record['outbox_of']!r}")


class DenseOutbox(DenseTensor):
    """The outbox of a dense tensor (module docstring).  Pushes come from the
    tensor's forwarded pushes only; pull() shows what is pending."""

    def __init__(self, store: Any, record: dict, shards: list) -> None:
        super().__init__(store, record, shards)
        _check_outbox_shards(self, shards)

    def push(self, grad: Any, rows: Any = None, *, wait: bool = True) -> None:
        raise _refuse(self)

    def _push_counted(self, g: np.ndarray, r: Optional[np.ndarray]) -> None:
        """Sum a validated gradient (gradient dtype; ``r`` checked rows or None) into
        the outbox, then count the push in every shard it touched (after its values
        landed).  From before its first write to after its count the push holds a
        landing slot of each of those shards (native/outbox.c "Landing": a bridge that
        ends holding values of a landing push is then caught by the next bridge's
        recover): a push of rows in C (shmps_dense_push_sorted_rows, shard by shard),
        a push of the whole tensor, split over threads, here around it.  Last, the
        store-wide count of forwarded pushes moves (_count_forwarded)."""
        if r is None or r.size:
            _back_dense(self, r)   # (refused for want of room: nothing written nor counted)
        try:
            if r is not None:
                if r.size:
                    DenseTensor._apply(self, g, r)
                return
            touched = self._every_shard()
            # every entry SHMPS_LANDING_NONE before the claim: an interrupt anywhere after
            # this line still frees exactly the slots claimed
            slots = ffi.new("uint8_t[]", self._no_slots())
            counted = False
            try:
                self._land(touched, slots)
                DenseTensor._apply(self, g, r)
                counted = True
            finally:
                # a push that failed part way is not counted (as before): what it wrote
                # goes out with the next drain, and no flush waits for it
                self._landed(touched, slots, counted)
        finally:
            _count_forwarded(self)

    def _no_slots(self) -> list:
        none = getattr(self, "_none", None)
        if none is None:
            none = self._none = [lib.SHMPS_LANDING_NONE] * self.nshards
        return none

    def _every_shard(self) -> Any:
        """A ``uint8_t *`` mask of every shard (a whole-tensor push writes them all),
        built once, only ever read."""
        every = getattr(self, "_every_mask", None)
        if every is None:
            every = self._every_mask = ffi.from_buffer("uint8_t[]",
                                                       bytearray(b"\x01" * self.nshards))
        return every

    def _land(self, touched: Any, slots: Any = None) -> Any:
        """Claim a landing slot of every shard in ``touched`` (shmps_outbox_land) into
        ``slots`` (``uint8_t[nshards]``; a new one if None); returns it."""
        if slots is None:
            slots = ffi.new("uint8_t[]", self._no_slots())
        code = lib.shmps_outbox_land(self._busy_bases(), self.nshards, touched,
                                     _native.token(), slots)
        if code:
            _native.check(code, f"push to {self.record['outbox_of']!r}")
        return slots

    def _landed(self, touched: Any, slots: Any, count: bool) -> None:
        """Count the push in every shard in ``touched`` (``count``), then free its
        landing slots (shmps_outbox_landed)."""
        code = lib.shmps_outbox_landed(self._busy_bases(), self.nshards, touched,
                                       _native.token(), slots, int(count))
        if code:
            _native.check(code, f"push to {self.record['outbox_of']!r}")

    def _busy_bases(self) -> Any:
        """Every shard's base (``void *[]``) for shmps_outbox_busy (DenseTensor's)."""
        return self._shard_bases()

    def _pending(self, shard: int) -> np.ndarray:
        """Per-row pending counts of ``shard`` (tests, statistics): > 0 where a row
        holds pushes no drain took; a push counts 1 per stripe a row spans."""
        sh = self._shard_checked(shard)
        out = np.zeros(sh.spec["nrows"], np.uint64)
        _native.check(lib.shmps_outbox_pending(sh.ptr, _native.addr(out), out.size),
                      f"pending of {self.name!r}")
        return out


class TableOutbox(Table):
    """The outbox of a table (module docstring)."""

    def __init__(self, store: Any, record: dict, shards: list) -> None:
        super().__init__(store, record, shards)
        _check_outbox_shards(self, shards)

    def push(self, keys: Any, grads: Any, *, wait: bool = True) -> None:
        raise _refuse(self)

    def _pending(self) -> np.ndarray:
        """The keys holding pushes no drain took (tests, statistics).  A drain keeps the
        keys it takes (native/table.c "Outbox drains"), so ``len()`` counts those too."""
        keys = self.keys()
        return keys[self.row_stats(keys)["pushes"] > 0]

    def _busy_bases(self) -> Any:
        """Every shard's base (``void *[]``) for shmps_outbox_busy."""
        return self._ptrs()

    def _back_rows(self, shard: int, rows: int) -> None:
        """The C creation refused new rows of ``shard`` past those backed: back them
        (_back_table_rows)."""
        _back_table_rows(self, shard, rows)

    def _push_counted(self, k: np.ndarray, g: np.ndarray, check: bool) -> None:
        """Sum validated rows into the outbox; C counts the push in every shard it
        touched (shmps_table_push on an outbox shard).  ``check``: the table's NaN/Inf
        rule, applied here before anything changes.  Then the store-wide count of
        forwarded pushes moves (_count_forwarded), once, whatever the attempts: a push
        into a full outbox tries again, waking the bridge without counting."""
        scratch, nbytes, info = self._scratch(k.size)
        deadline = None
        code = None
        try:
            while True:
                code = None   # (a call that raised before C returned counts, as it did)
                code = lib.shmps_table_push(self._ptrs(), self.nshards, _native.token(),
                                            _native.addr(k), k.size, ffi.from_buffer(g),
                                            self._gcode, int(check), scratch, nbytes, info)
                if code == lib.SHMPS_E_UNBACKED:   # nothing changed: back the rows, again
                    self._back_rows(int(info[3]), int(info[0]))
                    continue
                # Full, with room for the new keys were the keys that drains keep gone:
                # the push (which changed nothing) asked the next drain of every shard it
                # viewed (the table full: of every shard) to remove them (native/table.c
                # "Outbox drains", ask_rescan): try again, for FULL_RETRY_S at most
                if code != lib.SHMPS_E_FULL or int(info[0]) > int(info[2]):
                    break
                now = time.monotonic()
                if deadline is None:
                    deadline = now + FULL_RETRY_S
                elif now >= deadline:
                    break
                # and wake the bridge to drain now, as a store.flush() does: its pass
                # then scans every outbox shard (not skipped for want of a counted push),
                # so it sees the shards asked.  Not by counting a push (each attempt
                # did): this push is counted once, below, after its last attempt
                _ask_drain(self._store)
                time.sleep(0.002)
        finally:
            # one count a push, after its last attempt: what it wrote (and its counts in
            # its shards) precede the count, as the bridge's scan skip needs
            # (shmps_forward_pushed).  A refusal to back the rows is not a push
            if code != lib.SHMPS_E_UNBACKED:
                _count_forwarded(self)
        if code == lib.SHMPS_E_NONFINITE:
            _native.check(code, f"push to {self.record['outbox_of']!r}")
        if code:
            try:
                self._fail(code, info, "forwarded push")
            except Exception as exc:
                if code == lib.SHMPS_E_FULL:
                    exc.hint = ("the outbox holds the pushes not yet sent by shmps-bridge: is "
                                "the bridge running (and draining) for this store?")
                raise


def _ask_drain(store: Any) -> None:
    """Wake ``store``'s bridge to drain now rather than at its next flush interval, and
    to scan every outbox shard (store.flush(); a table push that found its outbox full,
    before it tries again): its doorbell, else the futex word its waiting thread sleeps
    on (shmps/doorbell.py).  A hint that counts nothing: a bridge that misses it drains
    at its next full scan (FULL_SCAN_EVERY).  A closed store is left alone."""
    man = store._manifest
    if man is None or man.ptr is None:
        return
    if not store._bell.ring():
        _native.check(lib.shmps_flush_request(man.ptr), "flush request")


def _count_forwarded(ob: Any) -> None:
    """Add 1 to the store's count of forwarded pushes (shmps_forward_pushed), once a push
    into ``ob`` counted itself in its shards, or failed (part way: what it wrote goes out
    with a drain), after its last attempt: the bridge scans the outboxes only when the
    count moved (BusyScan), and the first push after it went to sleep with nothing to
    do wakes it.
    A store closed meanwhile is left alone (the push's own outcome is what its caller
    sees; the bridge's full scans find what it wrote)."""
    store = ob._store
    man = store._manifest
    if man is not None and man.ptr is not None and lib.shmps_forward_pushed(man.ptr):
        # the bridge sleeps with nothing to do, and this push is the one to wake it
        # (native/outbox.c "Sleeping until a push"): its doorbell, else the futex
        if not store._bell.ring(push=True):
            lib.shmps_forward_wake(man.ptr)


# ---- drains -----------------------------------------------------------------------------

class DrainBuffers:
    """Reusable drain buffers (the bridge keeps one per tensor): a drain into them returns
    views of them, valid until the next drain into the same buffers.  Without them every
    drain allocates a shard's worth and returns arrays of its own."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, np.ndarray] = {}

    def get(self, what: str, shape: tuple, dtype: Any) -> np.ndarray:
        dt = np.dtype(dtype)
        a = self._bufs.get((what, dt))
        need = math.prod(shape)
        if a is None or a.size < need:
            a = self._bufs[(what, dt)] = np.empty(need, dt)
        return a[:need].reshape(shape)


def _buffers(into: Optional[DrainBuffers], cap: int, row_shape: tuple, index_dtype: Any,
             dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    if into is None:
        return np.empty(cap, index_dtype), np.empty((cap,) + row_shape, dtype)
    return into.get("index", (cap,), index_dtype), into.get("values", (cap,) + row_shape, dtype)


def _drained(pushed: int, prev: int, index: np.ndarray, grads: np.ndarray, n: int,
             cap: int, into: Optional[DrainBuffers], ticket: int) -> Optional[Drained]:
    if n == 0:
        return None
    if into is None and 2 * n < cap:  # let the full-size buffers go
        index, grads = index[:n].copy(), grads[:n].copy()
    else:
        index, grads = index[:n], grads[:n]
    return Drained(pushed=pushed, index=index, grads=grads, pushes=max(1, pushed - prev),
                   ticket=ticket, prev=prev)


def busy(t: Any) -> list[int]:
    """The shards of ``t``'s outbox holding pushes no drain has counted yet (one C call
    for every shard): the ones worth draining.  A hint, read without ordering: a push
    landing meanwhile shows at the next call."""
    ob = t._outbox()
    bases = ob._busy_bases()
    flags = np.zeros(ob.nshards, np.uint8)
    n = ffi.new("uint32_t *")
    _native.check(lib.shmps_outbox_busy(bases, ob.nshards, ffi.from_buffer(flags), n),
                  f"state of {ob.name!r}")
    return np.flatnonzero(flags).tolist() if n[0] else []


class BusyScan:
    """``busy`` for many tensors at once: one C call over every outbox shard of all of
    them (the bridge's flush loop runs every few milliseconds; with hundreds of tensors,
    a call per tensor cost an idle bridge most of a core).  Build a new one when the
    tensors change (all of one store); :meth:`scan` raises Closed once the store is
    closed.

    The call is skipped while the store's count of forwarded pushes
    (shmps_forward_pushes) has not moved since a call that found no shard busy: then no
    push was counted since (native/outbox.c, shmps_forward_pushed).  Even so, one load
    per shard every pass was most of an idle bridge's C time with thousands of
    shards."""

    def __init__(self, tensors: Sequence[Any], store: Any = None) -> None:
        """``store``: the tensors' (needed when there are none: the count of forwarded
        pushes is read all the same)."""
        self._outboxes = [t._outbox() for t in tensors]
        if store is None and self._outboxes:
            store = self._outboxes[0]._store
        self._store = store
        ptrs = [ob._shard(i).ptr for ob in self._outboxes for i in range(ob.nshards)]
        counts = [ob.nshards for ob in self._outboxes]
        self._bases = ffi.new("void *[]", ptrs) if ptrs else None
        #: which tensor (its position in ``tensors``) and shard each base is
        self._tensor = np.repeat(np.arange(len(counts)), counts)
        self._shard = (np.concatenate([np.arange(c) for c in counts]) if counts
                       else np.zeros(0, np.int64))
        self._flags = np.zeros(len(ptrs), np.uint8)
        self._flags_ptr = ffi.from_buffer(self._flags)
        self._n = ffi.new("uint32_t *")
        #: the count of forwarded pushes read before the last call, if it found no shard
        #: busy (else None: the next scan calls)
        self.idle_at: Optional[int] = None
        #: calls made (the scans not skipped)
        self.calls = 0

    def scan(self, full: bool = False) -> list[tuple[int, int]]:
        """(tensor position, shard) of every outbox shard holding pushes no drain has
        counted yet; a hint, as ``busy``.  ``full``: call even if no push was counted
        since a call that found none busy (a push whose process died before it moved the
        store's count, or made by a build that does not move it, is found so)."""
        if self._store is None:
            return []
        # Closed once the store is: the bases would point at unmapped memory (the
        # bridge closes tensors only by closing its store; one check, not one a tensor)
        man = self._store._mptr
        # read before the call (acquire): a push counted in it is seen by the call
        pushes = int(lib.shmps_forward_pushes(man))
        if self._bases is None:
            self.idle_at = pushes       # no outbox: nothing busy
            return []
        if not full and pushes == self.idle_at:
            return []
        self.calls += 1
        _native.check(lib.shmps_outbox_busy(self._bases, len(self._flags), self._flags_ptr,
                                            self._n),
                      "state of the outboxes")
        if not self._n[0]:
            self.idle_at = pushes
            return []
        self.idle_at = None
        idx = np.flatnonzero(self._flags)
        return list(zip(self._tensor[idx].tolist(), self._shard[idx].tolist()))


def _timeout(timeout: Optional[float]) -> float:
    limit = DRAIN_TIMEOUT_S if timeout is None else float(timeout)
    if not limit >= 0:
        raise InvalidArgument(f"timeout={timeout!r} must be >= 0 (or None)")
    return limit


def _known_lost(t: Any, ob: Any, shard: int) -> None:
    """``t``'s handle (the bridge's) recorded the pushes lost in ``shard`` so far: its own
    flush() does not raise for them (_raise_lost)."""
    t._store._lost_seen[ob.name][int(shard)] = lost(ob, shard)[2]


def _settled(t: Any, ob: Any, shard: int, n: int) -> None:
    """A drain of ``shard`` ended a lost range that recover had left open, or (a table
    drain) failed after it took rows, recording ``n`` more pushes lost: the draining
    handle (the bridge's) knows of them, as of those recover recorded; the bridge reads
    them with :func:`take_lost`."""
    _known_lost(t, ob, shard)
    t._store._lost_settled.append((t.name, int(shard), int(n)))


def take_lost(store: Any) -> list[tuple[str, int, int]]:
    """``(tensor, shard, pushes)`` recorded lost by this handle's drains since the last
    call (a lost range recover left open, ended by a drain; a table drain that failed
    after it took rows, which raised CorruptSegment; the bridge logs and counts them as
    it does what ``recover`` returns)."""
    out, store._lost_settled = store._lost_settled, []
    return out


def drain_dense(t: Any, shard: int, timeout: Optional[float] = None,
                into: Optional[DrainBuffers] = None, *,
                first: Optional[int] = None) -> Optional[Drained]:
    """Drain shard ``shard`` of the dense outbox of ``t`` (a dense tensor; a csr tensor,
    whose row_shape is ``()``, passes ``first``, the global index of the shard's first
    entry): the rows taken, numbered from ``first`` (default shard * shard_rows)."""
    ob = t._outbox()
    sh = ob._shard_checked(shard)
    cap = sh.spec["nrows"]
    rows, vals = _buffers(into, cap, tuple(t.row_shape), np.int64, ob.dtype)
    n, pushed, prev = ffi.new("uint64_t *"), ffi.new("uint64_t *"), ffi.new("uint64_t *")
    ticket, nlost = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    code = lib.shmps_outbox_drain(sh.ptr, _native.token(), _timeout(timeout),
                                  _native.addr(rows), ffi.from_buffer(vals), cap, n, pushed,
                                  prev, ticket, nlost)
    if nlost[0]:
        _settled(t, ob, shard, nlost[0])
    if code == lib.SHMPS_E_TIMEOUT:
        return None  # a live process held the shard past the bound: nothing taken
    if code not in (0, lib.SHMPS_DRAIN_PARTIAL):
        _native.check(code, f"drain of the outbox of {t.name!r} (shard {shard})")
    got = int(n[0])
    rows[:got] += int(shard) * t.shard_rows if first is None else int(first)  # global
    return _drained(int(pushed[0]), int(prev[0]), rows, vals, got, cap, into, int(ticket[0]))


def drain_table(t: Any, shard: int, timeout: Optional[float] = None,
                into: Optional[DrainBuffers] = None) -> Optional[Drained]:
    ob = t._outbox()
    ob._shard_checked(shard)
    cap = ob.shard_rows
    keys, vals = _buffers(into, cap, (t.dim,), np.uint64, ob.dtype)
    n, pushed, prev = ffi.new("uint64_t *"), ffi.new("uint64_t *"), ffi.new("uint64_t *")
    ticket, nlost = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    code = lib.shmps_table_drain(ob._ptrs(), ob.nshards, int(shard), _native.token(),
                                 _timeout(timeout), _native.addr(keys), ffi.from_buffer(vals),
                                 cap, n, pushed, prev, ticket, nlost)
    if nlost[0]:
        _settled(t, ob, shard, nlost[0])
    if code == lib.SHMPS_E_TIMEOUT:
        return None  # a live process held the shard past the bound: nothing taken
    if code:
        _native.check(code, f"drain of the outbox of {t.name!r} (shard {shard})")
    return _drained(int(pushed[0]), int(prev[0]), keys, vals, int(n[0]), cap, into,
                    int(ticket[0]))


def _check_drained_fields(**fields: Any) -> None:
    """InvalidArgument unless each value is a non-negative integer (a Drained field)."""
    for what, v in fields.items():
        check_int(v, what, 0, hint=f"pass the Drained.{what} of the drain")


def ack(t: Any, shard: int, pushed: int, ticket: int) -> None:
    """The owner applied every drain of ``shard`` up to the one that returned ``pushed``
    and ``ticket`` (a ``Drained``'s; acks in drain order)."""
    ob = t._outbox()
    sh = ob._shard_checked(shard)
    _check_drained_fields(pushed=pushed, ticket=ticket)
    _native.check(lib.shmps_outbox_ack(sh.ptr, int(pushed), int(ticket)),
                  f"ack of {ob.name!r}")


def reject(t: Any, shard: int, prev: int, pushed: int) -> int:
    """The owner refused a drain of ``shard`` for good (REJECTED): record its pushes,
    ``(prev, pushed]`` of its ``Drained``, as lost (past any recorded already), before the
    drain is acknowledged as usual (:func:`ack`): ``store.flush()`` then raises
    PushesLost for them instead of returning as if they had been applied.  The handle
    that records them (the bridge's) knows of them.  Returns how many pushes."""
    ob = t._outbox()
    sh = ob._shard_checked(shard)
    _check_drained_fields(prev=prev, pushed=pushed)
    if prev > pushed:
        raise InvalidArgument(f"prev={prev} is past pushed={pushed}")
    n = ffi.new("uint64_t *")
    _native.check(lib.shmps_outbox_reject(sh.ptr, int(prev), int(pushed), n),
                  f"reject of {ob.name!r}")
    _known_lost(t, ob, shard)
    return int(n[0])


def recover(t: Any, shard: int) -> int:
    """A bridge starting on this store, before it drains ``shard``: record what an earlier
    bridge process drained and did not see acknowledged as lost, and acknowledge it
    (``store.flush()`` then raises PushesLost for it).  Returns how many pushes.

    If that process may have held values of a push still landing (or ended inside a
    drain), the range goes on to pushes counted once every push landing now is counted:
    at once, or at a later drain of ``shard``, which records the rest (see
    :func:`take_lost`; flushes wait for it meanwhile).  native/outbox.c, "Landing"."""
    ob = t._outbox()
    sh = ob._shard_checked(shard)
    n = ffi.new("uint64_t *")
    _native.check(lib.shmps_outbox_recover(sh.ptr, n), f"recover of {ob.name!r}")
    _known_lost(t, ob, shard)   # the recovering handle (the bridge) knows of this loss
    return int(n[0])


def lost(ob: Any, shard: int) -> tuple[int, int, int]:
    """``(lo, hi, count)``: the latest range (lo, hi] of ``ob_pushed`` values a bridge
    process took with it, and the pushes of every such range so far."""
    lo, hi, n = ffi.new("uint64_t *"), ffi.new("uint64_t *"), ffi.new("uint64_t *")
    _native.check(lib.shmps_outbox_lost(ob._shard(shard).ptr, lo, hi, n),
                  f"lost counters of {ob.name!r}")
    return int(lo[0]), int(hi[0]), int(n[0])


def lost_open(ob: Any, shard: int) -> bool:
    """Whether a lost range recover recorded in ``shard`` waits for pushes landing at
    recover to be counted (then a drain ends it: native/outbox.c, "Landing")."""
    o = ffi.new("uint32_t *")
    _native.check(lib.shmps_outbox_lost_open(ob._shard(shard).ptr, o),
                  f"lost counters of {ob.name!r}")
    return bool(o[0])


def counters(ob: Any, shard: int) -> tuple[int, int]:
    """``(pushed, acked)`` of an outbox shard."""
    p, a = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    _native.check(lib.shmps_outbox_counters(ob._shard(shard).ptr, p, a),
                  f"counters of {ob.name!r}")
    return int(p[0]), int(a[0])


# ---- flush -------------------------------------------------------------------------------

def unacknowledged(store: Any) -> list[tuple[Any, int, int]]:
    """``(outbox, shard, pushed)`` of every outbox shard of ``store`` holding pushes not
    acknowledged yet: what a flush now waits for (until ``counters(ob, shard)[1]``, the
    acknowledged count, reaches ``pushed``)."""
    store._refresh()
    waits = []
    for rec in list(store._record_list):
        if rec.get("outbox_of") is None:
            continue
        ob = store[rec["name"]]
        for i in range(ob.nshards):
            pushed, acked = counters(ob, i)
            if acked < pushed:
                waits.append((ob, i, pushed))
    return waits


def flush(store: Any, timeout: Optional[float]) -> None:
    """store.flush(): wait until every push counted in an outbox now is acknowledged."""
    # (a number: float() took "1" as 1 s and raised a plain ValueError for "x")
    t = check_seconds(timeout, BOUNDED_WAIT_HINT)
    limit = FLUSH_TIMEOUT_S if t is None else t
    deadline = time.monotonic() + limit
    waits = unacknowledged(store)
    if waits:
        _ask_drain(store)
    # sleep on the manifest's ack word, which the bridge bumps after acknowledgements
    # (native/outbox.c, shmps_ack_notify), registered first; at most ACK_POLL_NS at a
    # time, so a bridge that does not bump it (an older build) costs up to 20 ms
    man = store._mptr
    registered = False
    try:
        for ob, i, target in waits:
            while True:
                seen = lib.shmps_ack_seq(man)
                pushed, acked = counters(ob, i)
                if acked >= target:
                    break
                if time.monotonic() >= deadline:
                    raise _flush_timeout(store, ob, i, target, acked, limit)
                if not registered:
                    lib.shmps_ack_waiting(man, 1)
                    registered = True
                    continue            # read ack_seq and the counters again, registered
                left_ns = int((deadline - time.monotonic()) * 1e9)
                lib.shmps_ack_wait(man, seen, max(0, min(ACK_POLL_NS, left_ns)))
    finally:
        if registered:
            lib.shmps_ack_waiting(man, -1)
    _raise_lost(store)


def _flush_timeout(store: Any, ob: Any, shard: int, target: int, acked: int,
                   limit: float) -> Timeout:
    """The Timeout of a flush that waited ``limit`` s for shard ``shard`` of outbox ``ob``,
    saying why: a lost range waiting for a stopped pusher, or no bridge at work."""
    ns = f" namespace {store.namespace!r}" if store.namespace else ""
    head = (f"flush of store {store.name!r}{ns}: shard {shard} of tensor "
            f"{ob.record['outbox_of']!r} has {target} pushes to forward, {acked} "
            f"acknowledged after {limit} s")
    if lost_open(ob, shard):
        return Timeout(head + ": a bridge process ended holding pushes, and which of them "
                       "were lost is known only once every push landing in the outbox then "
                       "is counted; a process stopped in the middle of a push holds that up",
                       "resume or kill the stopped worker, or raise the timeout")
    # (a bridge that runs may be waiting itself: without a majority of its members it
    # owns nothing and forwards nothing; this hint said only to start one)
    return Timeout(head + "; is shmps-bridge running for this store and namespace?",
                   "start shmps-bridge for it; if one runs, its log says why it waits (no "
                   "majority of its members, say); or raise the timeout")


def _raise_lost(store: Any) -> None:
    """PushesLost if a bridge process took pushes with it since this handle first pushed
    to an outbox (or since its last flush that raised this): they may include its own.
    Called after the waits (their acquire loads of ob_acked order these reads after the
    recover that acknowledged the lost range)."""
    found = []
    # (a copy, taken in one step under the GIL: another thread's first push to a tensor
    # adds its outbox meanwhile (get_or_create), and iterating the dict itself raised
    # RuntimeError: dictionary changed size during iteration)
    for name, seen in list(store._lost_seen.items()):
        ob = store[name]
        for i in range(ob.nshards):
            count = lost(ob, i)[2]
            if count > seen[i]:
                found.append(f"{ob.record['outbox_of']!r} shard {i}: {count - seen[i]}")
                seen[i] = count
    if found:
        ns = f" namespace {store.namespace!r}" if store.namespace else ""
        raise PushesLost(
            f"flush of store {store.name!r}{ns}: pushes (of every process on this host) were "
            "taken by a bridge process that ended before their owner acknowledged them (or "
            "by a drain that failed part way, on a corrupt outbox shard, or refused for good "
            "by their owner: the bridge's log says why), so they may or may not have been "
            "applied; this process's pushes made before may be "
            f"among them. Pushes per tensor shard: {', '.join(found[:8])}"
            + (f" and {len(found) - 8} shards more" if len(found) > 8 else ""))
