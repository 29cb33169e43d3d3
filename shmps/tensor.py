"""What every tensor kind shares: its catalog record, its shard segments, stats.

A tensor is described by one catalog record in the store's manifest (JSON, written
once by its creator) and stored in ``nshards`` segments named
``/shmps.[ns.]store.t<id>.s<shard>``.  Subclasses (dense, table, csr) add push/pull.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from . import _native, names
from .checks import as_array, check_seconds
from .errors import (Closed, CorruptSegment, Error, InvalidArgument, OutOfRange, SchemaError,
                     Timeout)
from .segment import Segment
from .updaters import Updater, from_dict

if TYPE_CHECKING:
    from .store import Store

FLOAT_DTYPES = ("float16", "float32", "float64")

#: The forwarding word of a tensor that never forwards (outboxes, aggregation
#: helpers, closed tensors): always 0.  See Tensor._fwd.
NO_FWD = _native.ffi.new("uint32_t[1]")


@dataclass
class Shard:
    """One mapped shard segment and its validated layout."""

    seg: Segment
    spec: dict

    @property
    def ptr(self) -> Any:
        if self.seg.ptr is None:
            raise Closed(f"segment {self.seg.name} is closed")
        return self.seg.ptr

    def values(self, dtype: np.dtype) -> np.ndarray:
        return self.seg.array(dtype, self.spec["value_off"], self.spec["nnz"])

    def state(self, k: int) -> np.ndarray:
        dt = _native.DTYPE_NAMES[self.spec["state_dtype"]]
        return self.seg.array(dt, self.spec["state_off"][k], self.spec["nnz"])


def grad_dtype(dtype: np.dtype) -> np.dtype:
    """Gradients for float16 tensors are taken as float32 (computed in float32)."""
    return np.dtype("float32") if dtype == np.float16 else dtype


def cast_grad(arr: Any, dtype: np.dtype, what: str = "gradient") -> np.ndarray:
    """``arr`` as a C-contiguous array of ``grad_dtype(dtype)`` (same_kind casting).

    Copies only when the dtype or the memory order differs."""
    a = as_array(arr, what)
    target = grad_dtype(dtype)
    if a.dtype != target:
        if not np.can_cast(a.dtype, target, casting="same_kind"):
            raise SchemaError(f"{what} of dtype {a.dtype} cannot be cast to {target}",
                              f"pass a {target} array (numpy 'same_kind' casting rule)")
        a = a.astype(target)
    # (np.ascontiguousarray would turn a 0-d gradient of a shape-() tensor into 1-d)
    return a if a.flags.c_contiguous else np.array(a, order="C")


def cast_init(init: Any, dtype: np.dtype, allow_nonfinite: bool = False) -> np.ndarray:
    """``init`` (a number or an array) as ``dtype``, checked value by value: a number
    (a bool is not one: SchemaError); for an integer dtype, integral and within its
    range (SchemaError: never wrapped, as astype would: 300 -> 44 in int8); for a float
    dtype, finite unless ``allow_nonfinite`` and finite after the cast when finite
    before (InvalidArgument: 1e5 is inf in float16).  An array must also cast with
    numpy's same_kind rule (a float array into an integer tensor is a SchemaError,
    where an integral float scalar is taken).  Returns a 0-d array for a scalar, else
    a C-contiguous array of ``init``'s shape (the caller checks the shape).  O(n)."""
    a = as_array(init, "init")
    if a.dtype.kind not in "iuf":
        raise SchemaError(f"{_init_at(init, a, None)} is not a number",
                          f"pass numbers of a dtype that casts to {dtype}")
    if a.ndim and not np.can_cast(a.dtype, dtype, "same_kind"):
        raise SchemaError(f"init of dtype {a.dtype} cannot be cast to {dtype}",
                          f"pass a {dtype} array (numpy 'same_kind' casting rule)")
    if dtype.kind != "f":
        info = np.iinfo(dtype)
        if a.dtype.kind == "f":   # (a scalar: a float array was refused above)
            bad = ~np.isfinite(a) | (np.trunc(np.nan_to_num(a)) != a)
            if not bad.any():
                bad = (a < info.min) | (a > info.max)
        elif a.size:
            bad = (a < info.min) | (a > info.max)   # numpy compares int64/uint64 exactly
        else:
            bad = np.zeros(a.shape, bool)
        if bad.any():
            raise SchemaError(f"{_init_at(init, a, bad)} cannot be stored in {dtype}",
                              f"pass integers within the range of {dtype} "
                              f"({info.min} to {info.max})")
        return a.astype(dtype) if a.ndim == 0 else np.ascontiguousarray(a, dtype=dtype)
    finite = np.isfinite(a) if a.dtype.kind == "f" else np.ones(a.shape, bool)
    if not allow_nonfinite and not finite.all():
        raise InvalidArgument(f"{_init_at(init, a, ~finite)} is not finite",
                              "pass finite values, or create the tensor with "
                              "allow_nonfinite=True")
    with np.errstate(over="ignore", invalid="ignore"):
        v = a.astype(dtype) if a.ndim == 0 else np.ascontiguousarray(a, dtype=dtype)
    past = finite & ~np.isfinite(v)
    if past.any():
        raise InvalidArgument(f"{_init_at(init, a, past)} cannot be stored in {dtype} "
                              f"(largest {float(np.finfo(dtype).max):g})",
                              f"pass values within the range of {dtype}")
    return v


#: values of an init checked at a time where the init is not used (init_is_valid): the
#: check's temporaries (a cast chunk, its masks) stay a few MiB whatever the init's size
INIT_CHECK_CHUNK = 1 << 18


def init_is_valid(init: Any, shape: tuple, dtype: np.dtype, allow_nonfinite: bool) -> bool:
    """Whether ``cast_init(init, dtype, allow_nonfinite)`` takes ``init`` and, for an
    array, whether it has ``shape``: for a get-or-create that finds the tensor made,
    which uses no init but refuses a bad one as its creator does.  cast_init's checks,
    made a chunk at a time (numpy's buffered iterator: chunks of a contiguous init are
    views of it), so that a good init costs no copy: cast_init's whole cast copy and
    masks took 1.5 times a 256 MiB float64 init (into float32) in every such worker.
    O(n) time, O(INIT_CHECK_CHUNK) memory.  False: the caller runs the whole check for
    its error, which names the first bad element."""
    a = as_array(init, "init")
    if a.ndim == 0 or a.size <= INIT_CHECK_CHUNK:
        try:
            v = cast_init(a, dtype, allow_nonfinite)
        except Error:
            return False
        return v.ndim == 0 or v.shape == tuple(shape)
    # (what cast_init refuses for the whole array, before any value: a chunk of it
    # would be refused the same way)
    if a.shape != tuple(shape) or a.dtype.kind not in "iuf" \
            or not np.can_cast(a.dtype, dtype, "same_kind"):
        return False
    # each value's verdict depends on that value alone (integral and in range, finite,
    # finite after the cast), so the chunks pass exactly when the whole array does
    for chunk in np.nditer(a, flags=["external_loop", "buffered", "zerosize_ok"],
                           op_flags=[["readonly"]], order="K",
                           buffersize=INIT_CHECK_CHUNK):
        try:
            cast_init(chunk, dtype, allow_nonfinite)
        except Error:
            return False
    return True


def _init_at(init: Any, a: np.ndarray, bad: Optional[np.ndarray]) -> str:
    """The init named in a message: the scalar itself, or its first bad element."""
    if a.ndim == 0:
        return f"init {init!r}"
    if bad is None or not bad.any():
        return f"init of dtype {a.dtype}"
    at = np.unravel_index(int(np.argmax(bad)), a.shape)
    return f"init[{', '.join(str(int(i)) for i in at)}] = {a[at].item()!r}"


def bool_at(seq: Any) -> Optional[int]:
    """For a list or tuple, the position of its first bool element (``bool``,
    ``np.bool_`` or a bool array), else None.  numpy converts ``[5, True]`` to the
    integers ``[5, 1]``, so indices and keys given as a list are checked for bools
    before the conversion.  O(len) for a list or tuple, O(1) otherwise."""
    if not isinstance(seq, (list, tuple)):
        return None
    for i, x in enumerate(seq):
        if isinstance(x, (bool, np.bool_)) or (isinstance(x, np.ndarray) and x.dtype == bool):
            return i
    return None


def rows_for_c(rows: Any, nrows: int) -> np.ndarray:
    """Row indices for a C call that checks each row's range itself before it changes
    or copies anything (shmps_dense_push_sorted_rows, shmps_dense_pull_rows): a
    C-contiguous 1-d int64 array as it is, anything else through check_rows.  On the
    call's SHMPS_E_BOUNDS the caller runs check_rows, which names the row."""
    if (type(rows) is np.ndarray and rows.dtype == np.int64 and rows.ndim == 1
            and rows.flags.c_contiguous):
        return rows
    return check_rows(rows, nrows)


def check_rows(rows: Any, nrows: int) -> np.ndarray:
    """Row indices as C-contiguous int64, all in [0, nrows)."""
    at = bool_at(rows)
    if at is not None:   # as a bool array is (numpy would make [0, True] rows 0 and 1)
        raise OutOfRange(f"rows must be a 1-d integer array, got a bool ({rows[at]!r}) at "
                         f"position {at} of a {type(rows).__name__}",
                         "pass integer row indices")
    r = as_array(rows, "rows", OutOfRange)
    if r.ndim != 1 or r.dtype.kind not in "iu":
        if r.ndim == 1 and r.size == 0:
            return np.zeros(0, np.int64)
        raise OutOfRange(f"rows must be a 1-d integer array, got {r.dtype} with shape {r.shape}")
    if r.size:
        if r.size <= 16:   # a few rows: two numpy reductions cost more than the list
            small = r.tolist()
            lo, hi = min(small), max(small)
        else:
            lo, hi = int(r.min()), int(r.max())
        if lo < 0 or hi >= nrows:
            bad = lo if lo < 0 else hi
            raise OutOfRange(f"row {bad} out of range for {nrows} rows")
    return np.ascontiguousarray(r, dtype=np.int64)


#: a handle's wait past this many seconds (about 31 years) waits as long as it takes:
#: the future's lock takes at most threading.TIMEOUT_MAX (~292 years) and raised a plain
#: OverflowError for math.inf
_LONGEST_HANDLE_WAIT_S = 1e9


def _handle_wait_limit(timeout: Optional[float]) -> Optional[float]:
    """``PushHandle.wait(timeout=)`` as the future takes it (None: no limit; a longer
    wait than _LONGEST_HANDLE_WAIT_S is none: the future's OverflowError for math.inf)."""
    t = check_seconds(timeout)
    return None if t is None or t > _LONGEST_HANDLE_WAIT_S else t


class PushHandle:
    """Returned by ``push(..., wait=False)``; ``store.wait(handle)`` or ``handle.wait()``."""

    def __init__(self, future: "Future[None]") -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until the push is applied; re-raises its error.  ``timeout`` seconds
        (None or math.inf: as long as it takes), then :class:`shmps.Timeout`; the push
        goes on.  A negative, NaN or non-number timeout is an InvalidArgument, as for
        store.flush() and store.clock()."""
        limit = _handle_wait_limit(timeout)
        try:
            self._future.result(limit)
        except FutureTimeout as exc:
            # the future's own timeout is a plain TimeoutError, which `except
            # shmps.Timeout` misses; the push's error (a shmps.Timeout too, on a stuck
            # stripe lock) is re-raised as it is
            if isinstance(exc, Error) or self._future.done():
                raise
            raise Timeout(f"the push is not applied after {timeout} s; it goes on in the "
                          "background",
                          "wait again (handle.wait()), or find the process holding the "
                          "tensor's locks (a stopped one?)") from None


#: shards of a dense or csr tensor at most: each is a mapping in every process that uses
#: it, and Linux allows a process 65530 (vm.max_map_count).  An explicit shard_rows that
#: would make more is refused (the default makes about 16 MiB shards).
MAX_ROW_SHARDS = 1 << 15


def check_shard_count(what: str, nrows: int, shard_rows: int) -> int:
    """The shard count of ``nrows`` rows in ``shard_rows``-row shards; SchemaError
    above MAX_ROW_SHARDS."""
    nshards = max(1, -(-nrows // shard_rows))
    if nshards > MAX_ROW_SHARDS:
        raise SchemaError(f"{what}: shard_rows={shard_rows} makes {nshards:,} shards of "
                          f"its {nrows:,} rows; at most {MAX_ROW_SHARDS:,}",
                          "pass a larger shard_rows, or none (about 16 MiB a shard)")
    return nshards


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _new_pools_lock() -> None:
    """In a forked child: a new lock (a parent thread may have held the old one)."""
    global _pools_lock
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_pools_lock)


def split_pool() -> ThreadPoolExecutor:
    """Per-process pool that splits large pushes (recreated after fork)."""
    pid = os.getpid()
    with _pools_lock:
        pool = _pools.get(pid)
        if pool is None:
            _pools.clear()
            pool = _pools[pid] = ThreadPoolExecutor(max_workers=os.cpu_count() or 1,
                                                    thread_name_prefix="shmps-split")
        return pool


def submit_or_none(executor: ThreadPoolExecutor, fn: Any, *args: Any) -> Optional[Future]:
    """``executor.submit(fn, *args)``, or None when the pool takes no more work: at
    interpreter exit concurrent.futures shuts every pool down (its exit hook runs before
    atexit handlers, and the threads then run what was queued and end), and a submit
    raises RuntimeError from then on.  The caller does the work itself instead (the
    split pool's parts, a push with wait=False in an atexit handler) or joins the pool
    (a wait for the pushes queued on it)."""
    try:
        return executor.submit(fn, *args)
    except RuntimeError:
        return None


def pool_submit(fn: Any, *args: Any) -> Optional[Future]:
    """``split_pool().submit(fn, *args)``, or None when the pool takes no more work
    (:func:`submit_or_none`): the store's push thread, which Python joins at exit, still
    applies the pushes queued with wait=False, and each of those of 16 MiB or more raised
    "cannot schedule new futures after shutdown" there, unseen: lost, with a step taken."""
    return submit_or_none(split_pool(), fn, *args)


class SplitParts:
    """The parts of one split push (numbered from 0), run by helper threads of
    :func:`split_pool` (:meth:`submit`) and by the pushing thread (:meth:`run_here`),
    and the wait for them (:meth:`wait`, :meth:`close`) that holds through an interrupt
    wherever it lands in the pushing thread.

    A part either runs whole or does not start: the first part to raise (in any
    thread) closes the push, so no part starts after it, and the parts running then
    run to their end; :meth:`raise_first` then raises the first error in time, its
    message saying which values were applied whole, which were in a part an error
    stopped, and which were not started.  (Before 2026-11-28 only an error in the
    pushing thread stopped the parts not started: a helper's let the others run, and
    a helper's error that came first was passed over for a later one of the pushing
    thread.)

    A signal's exception (Ctrl-C's KeyboardInterrupt) is raised in the main thread only,
    between any two of its bytecodes, a call into ThreadPoolExecutor.submit included: a
    part may be queued and its future never returned.  So the parts are counted here,
    not by their futures: a part starts only while the push is not closed, and
    :meth:`close` (the pushing thread's way out on an interrupt) stops any part from
    starting and returns once none runs.  The push's slots, and an aggregated round's
    claim, are let go of after it, with no thread of the push still writing (a SIGINT
    during the parts' submission let the slots go while a queued part then wrote: review
    H2 of 2026-11-28).

    No threading.Condition: its ``__enter__`` is Python code, and an interrupt handled
    there right after its lock was taken (at the check that follows a C call) leaves
    the lock held with no ``with`` block to let it go: :meth:`close` then waited for it
    forever, and so did each helper thread at its part's end (review H4 of 2026-11-28).
    The pushing thread takes ``_lock``, a plain lock, only in ``with`` statements
    (entered in C: nothing runs between the lock taken and the block begun) and never
    holds it while it waits; it waits on ``_bell``, a lock held while no part ended
    since it last looked, that a helper thread lets go of (under ``_lock``) as its part
    ends.  An interrupt of that wait loses nothing: the counts are looked at again,
    under ``_lock``, before each wait."""

    def __init__(self, nparts: int) -> None:
        self._lock = threading.Lock()   # the counts, _closed, outcomes, errors
        self._bell = threading.Lock()   # held: no part ended since the pusher's last look
        self._bell.acquire()
        self._closed = False
        self._running = 0      # parts a helper thread runs now
        self._submitted = 0    # parts submitted (counted after submit returned)
        self._ended = 0        # parts that ran to their end, raised, or never started
        #: each part's outcome: None (not started), True (applied whole), or the
        #: exception it raised
        self.outcomes: list[Any] = [None] * nparts
        #: (part, exception) in the order they were raised: appended under ``_lock``,
        #: after the part's call returned, so the first is the first error in time
        self.errors: list[tuple[int, BaseException]] = []

    def submit(self, i: int, fn: Any, *args: Any) -> None:
        """Part ``i``, ``fn(*args)``, queued for a helper thread; run here, in the
        pushing thread, when the pool takes no more work (:func:`pool_submit`)."""
        if pool_submit(self._run, i, fn, args) is None:
            self.run_here(i, fn, *args)
            return
        self._submitted += 1   # (only the pushing thread writes it)

    def _ended_as(self, i: int, err: Optional[BaseException]) -> None:
        """Under ``_lock``: part ``i`` ran to its end (``err`` None) or raised ``err``,
        which closes the push: no part starts after it."""
        if err is None:
            self.outcomes[i] = True
            return
        self.outcomes[i] = err
        self.errors.append((i, err))
        self._closed = True

    def _run(self, i: int, fn: Any, args: tuple) -> None:
        with self._lock:
            if self._closed:
                # (the push ended on an interrupt, or a part raised, before this part
                # started: counted as ended, for the wait)
                self._ended += 1
                if self._bell.locked():
                    self._bell.release()
                return
            self._running += 1
        err: Optional[BaseException] = None
        try:
            fn(*args)
        except BaseException as exc:
            err = exc
        finally:
            with self._lock:
                self._ended_as(i, err)
                self._running -= 1
                self._ended += 1
                # (only helpers let the bell go, each under _lock: it is held here, so
                # this release cannot meet a bell let go of already)
                if self._bell.locked():
                    self._bell.release()

    def run_here(self, i: int, fn: Any, *args: Any) -> None:
        """Part ``i`` in the pushing thread, unless a helper's part raised already: its
        error (an Exception) is recorded as a helper's is and closes the push.  An
        interrupt (a BaseException that is no Exception) is raised as it is: the
        caller's way out is :meth:`close`."""
        with self._lock:
            if self._closed:
                return
        try:
            fn(*args)
        except Exception as exc:
            with self._lock:
                self._ended_as(i, exc)
            return
        with self._lock:
            self._ended_as(i, None)

    def wait(self) -> None:
        """Until every submitted part ended (interruptible: then :meth:`close`)."""
        while True:
            with self._lock:
                if self._ended >= self._submitted:
                    return
            self._bell.acquire()   # (a part that ended since the look let it go)

    def close(self) -> None:
        """No part starts from now on; returns once none runs, however often it is
        interrupted meanwhile (the first interrupt is raised after)."""
        err: Optional[BaseException] = None
        while True:
            try:
                with self._lock:
                    self._closed = True
                    if not self._running:
                        break
                self._bell.acquire()
            except BaseException as exc:
                err = err or exc
        if err is not None:
            raise err

    def raise_first(self, span: Any, what: str, note: str) -> None:
        """After :meth:`wait`: raise the first error in time of any part, if one
        raised.  A shmps :class:`Error`'s message is extended with what became of every
        part: ``span(i)`` is part ``i``'s ``(start, end)`` in ``what`` (e.g. "values"),
        adjacent parts of one outcome given as one range, ``note`` after them.  (Only
        the pushing thread reads outcomes and errors here, every part ended: each was
        written under ``_lock``, which the wait took after.)"""
        if not self.errors:
            return
        first, exc = self.errors[0]
        if not isinstance(exc, Error):
            raise exc
        runs: list[list[Any]] = []     # [start, end, outcome text]
        for i, outcome in enumerate(self.outcomes):
            text = ("applied whole" if outcome is True else "not started" if outcome is None
                    else "stopped by this error" if i == first
                    else f"stopped by another error ({type(outcome).__name__})")
            lo, hi = span(i)
            if runs and runs[-1][2] == text and runs[-1][1] == lo:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi, text])
        told = ", ".join(f"[{lo}, {hi}) {text}" for lo, hi, text in runs)
        exc.message = (f"{exc.message}; split into {len(self.outcomes)} parts: {what} "
                       f"{told} ({note})")
        exc.args = (exc.message,)
        raise exc


class Tensor:
    """Base class of DenseTensor, Table and CSRTensor."""

    kind = ""

    def __init__(self, store: "Store", record: dict, shards: list[Shard]) -> None:
        self._store = store
        self.record = record
        self.name: str = record["name"]
        self.dtype = np.dtype(record["dtype"])
        self.optimizer: Updater = from_dict(record["optimizer"])
        self.mode: str = record.get("mode", "exact")
        self.allow_nonfinite: bool = bool(record.get("allow_nonfinite", False))
        self._shards = shards
        self._check_finite = self.dtype.kind == "f" and not self.allow_nonfinite
        # The store's forwarding switch (a uint32_t * into the manifest), read on every
        # push: one aligned load, ~25 ns.  Non-zero while shmps-bridge runs: pushes go to
        # the tensor's outbox (shmps/outbox.py).  NO_FWD once the tensor is known never
        # to forward, or is closed (the manifest may be unmapped then).
        self._fwd: Any = getattr(store, "_fwd_word", NO_FWD)
        self._fwd_ok: Optional[bool] = None
        self._ob: Any = None

    # -- shared plumbing ---------------------------------------------------------
    @property
    def nshards(self) -> int:
        return int(self.record["nshards"])

    @property
    def _nshards(self) -> int:
        """Shard count (the bridge's ring key of shard i is ``"<name>/<i>"``)."""
        return self.nshards

    @property
    def _forwardable(self) -> bool:
        """Whether pushes to this tensor go to its outbox while forwarding is on
        (False for outboxes and the hidden tensors of synchronous aggregation)."""
        if self._fwd_ok is None:
            from .outbox import forwardable
            self._fwd_ok = forwardable(self._store, self.record)
        return self._fwd_ok

    def _forwards(self) -> bool:
        """Called by push when the forwarding word is set: True if this push must go
        to the outbox.  A tensor that never forwards stops reading the word."""
        if self._forwardable:
            return True
        self._fwd = NO_FWD
        return False

    def _shard_checked(self, shard: Any) -> Shard:
        """Shard ``shard`` (an int in range, else OutOfRange)."""
        if isinstance(shard, bool) or not isinstance(shard, (int, np.integer)) \
                or not 0 <= int(shard) < self.nshards:
            raise OutOfRange(f"shard {shard!r} of {self.name!r}: it has {self.nshards} shards")
        return self._shard(int(shard))

    def _shard(self, i: int) -> Shard:
        if self._shards is None:
            raise Closed(f"tensor {self.name!r} is closed")
        return self._shards[i]

    # -- the bridge's side (shmps/outbox.py; private API): dense, table and csr ---------
    def _outbox(self) -> Any:
        """This tensor's outbox (``<name>#outbox``), created on first need."""
        if self._ob is None:
            from . import outbox
            self._ob = outbox.get_or_create(self)
        return self._ob

    def _count_batch(self, pushes: int, continues: bool) -> None:
        """After an owner's apply that the C push counted as one push: count it as the
        ``pushes`` the batch stands for, or as none if it ``continues`` the batch the
        previous call began (statistics; dense counts in DenseTensor._apply instead)."""
        delta = -1 if continues else max(1, int(pushes)) - 1
        if delta:
            _native.lib.shmps_count_pushes(self._shard(0).ptr, delta)

    def _outbox_ack(self, shard: int, pushed: int, ticket: int) -> None:
        """The owner has applied every drain of ``shard`` up to the one that returned
        ``Drained.pushed`` and ``Drained.ticket``."""
        from . import outbox
        outbox.ack(self, shard, pushed, ticket)

    def _outbox_reject(self, shard: int, prev: int, pushed: int) -> int:
        """The owner refused a drain of ``shard`` for good: record its pushes, ``(prev,
        pushed]``, as lost before its ack (``outbox.reject``); returns how many."""
        from . import outbox
        return outbox.reject(self, shard, prev, pushed)

    def _outbox_recover(self, shard: int) -> int:
        """A bridge starting on this store: record the pushes an
        earlier bridge process drained from the outbox's ``shard`` and never saw
        acknowledged as lost (``outbox.recover``); returns how many."""
        from . import outbox
        return outbox.recover(self, shard)

    def _outbox_busy(self) -> list[int]:
        """The bridge's flush loop: the outbox shards holding
        pushes no drain has counted yet, the ones worth draining (``outbox.busy``)."""
        from . import outbox
        return outbox.busy(self)

    def _require_finite(self, g: np.ndarray, nthreads: int = 1) -> None:
        """Raise NonFinite if a float gradient holds NaN/Inf (unless allowed).

        One read of the gradient, split over ``nthreads`` of the split pool."""
        if not (self._check_finite and g.size):
            return
        code_dt = _native.DTYPE_CODES_BY_DTYPE[g.dtype]
        flat = g.reshape(-1)

        def scan(part: np.ndarray) -> int:
            return int(_native.lib.shmps_check_finite(_native.addr(part), code_dt, part.size))

        if nthreads <= 1:
            code = scan(flat)
            if code:
                _native.check(code, f"push to {self.name!r}")
            return
        parts = np.array_split(flat, nthreads)
        futures = [pool_submit(scan, p) for p in parts[1:]]
        codes = [scan(parts[0])] + [scan(p) if f is None else f.result()
                                    for p, f in zip(parts[1:], futures)]
        for code in codes:
            if code:
                _native.check(code, f"push to {self.name!r}")

    def _count(self, pull: bool, nbytes: int, rows: int) -> None:
        _native.lib.shmps_count(self._shard(0).ptr, int(pull), nbytes, rows)

    def _aggregate_duplicates(self, keys: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sum the gradients of repeated keys (rows) so a stateful updater sees one.
        What it returns is in ascending order whenever it had to sort (the C push of
        rows wants them so, and would otherwise send them back to be sorted again);
        keys already ascending and distinct come back as they are."""
        if self.optimizer.sequential_duplicates or keys.size < 2:
            return keys, g
        order = np.argsort(keys, kind="stable")
        sk = keys[order]
        first = np.ones(sk.size, bool)
        first[1:] = sk[1:] != sk[:-1]
        if first.all():
            if np.array_equal(sk, keys):
                return keys, g
            return sk, g[order]
        starts = np.flatnonzero(first)
        # (a sum past the dtype's range is inf, as the C apply makes it, without a
        # numpy RuntimeWarning the C path would not give: docs/api.md, allow_nonfinite)
        with np.errstate(over="ignore"):
            return sk[starts], np.add.reduceat(g[order], starts, axis=0)

    def stats(self) -> dict:
        """Push/pull counters kept in shared memory (any process sees the same).

        Keys: pushes, pulls, bytes_pushed, bytes_pulled, rows_pushed, rows_pulled,
        last_push_ns, last_pull_ns (CLOCK_MONOTONIC), step, takeovers, contended."""
        out = _native.stats(self._shard(0).ptr)
        for sh in self._shards[1:]:
            s = _native.stats(sh.ptr)
            for k in ("takeovers", "contended", "rows_used"):
                out[k] += s[k]
        return out

    def describe(self) -> dict:
        """Schema and size, as listed by ``store.tensors()``."""
        nbytes = sum(sh.seg.size for sh in self._shards) if self._shards else 0
        return {"name": self.name, "kind": self.kind, "dtype": self.dtype.name,
                "shape": tuple(self.record.get("shape", ())),
                "optimizer": self.optimizer.to_dict(), "mode": self.mode,
                "nshards": self.nshards, "bytes": nbytes}

    def close(self) -> None:
        """Unmap this tensor's segments in this process (idempotent)."""
        self._fwd = NO_FWD  # the store's manifest is unmapped next
        if self._shards is not None:
            for sh in self._shards:
                sh.seg.close()
            self._shards = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple:
        """Pickled, a tensor is its store's name and its own: the other process attaches
        the store again (see Store.__reduce__) and gets the tensor from it."""
        from .store import _tensor_pickled
        st = self._store
        st._mptr  # Closed after the store's close()
        return (_tensor_pickled, (st.name, st.namespace or "", self.name))

    def __repr__(self) -> str:
        return (f"<shmps.{type(self).__name__} {self.name!r} {self.dtype.name} "
                f"{tuple(self.record.get('shape', ()))} {type(self.optimizer).__name__}>")


def open_shards(store: "Store", record: dict) -> list[Shard]:
    """Map and validate every shard of a catalog record."""
    shards: list[Shard] = []
    try:
        for s in range(record["nshards"]):
            name = names.shard_name(store.name, store.namespace, record["id"], s)
            seg = Segment.open(name)
            seg.ask_huge_pages()
            shards.append(Shard(seg, _native.shard_validate(seg.ptr, seg.size, name)))
            spec = shards[-1].spec
            if (spec["kind"] != _native.KINDS[record["kind"]]
                    or spec["dtype"] != _native.DTYPE_CODES[record["dtype"]]):
                raise CorruptSegment(f"segment {name} does not hold tensor {record['name']!r}")
    except BaseException:
        for sh in shards:
            sh.seg.close()
        raise
    return shards
