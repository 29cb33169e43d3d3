"""Synchronous aggregation: dense tensors whose pushes are grouped by worker clock.

``store.dense(name, ..., aggregate="mean"|"sum", workers=N)`` makes a tensor whose
pushes are not applied one by one: the pushes of one clock (a *round*) from every
live worker are summed exactly into an accumulator, and the tensor's updater is
applied once, with the sum or the mean (sum / number of contributors), by the
last pusher of the round.  Pulls see the tensor before or after a whole round,
never a part of one.  It is the parameter server's synchronous push (d2l's
"aggregate over workers, then update") on top of the worker clocks of
:meth:`shmps.Store.clock`.

Rules (docs/consistency.md has the diagram):

- A pusher must have joined (``store.join()``); its push belongs to round c, its
  current clock.  One push per worker per round (``rows=`` allowed); the second
  raises InvalidArgument: sum your gradients locally, or call ``store.clock()``.
- Round c is applied once every live joined worker has pushed for c, or moved
  past c without pushing; a dead worker counts as left at once (its process is
  gone), so it never stalls a round.
- Until ``workers`` workers have joined the store, a push waits for them (so an
  early starter neither makes a round alone nor runs ahead: the others join at
  its clock).  Join every worker before its first push; no other start barrier
  is needed.
- Rounds are applied in order.  Double buffering by clock parity: pushes for
  c + 1 go to the other buffer while round c is open; a push for c + 2 waits until
  round c is applied (at most two rounds in flight, whatever the store's
  staleness).  A push for a round already applied raises InvalidArgument; so does
  one for a round claimed for applying (a worker that joined after the claim), once
  the round is applied.
- ``pull()`` first applies any round that is complete but not yet applied (e.g.
  one whose last worker died after every other pushed), and waits for a round
  another process is applying; ``wait_round()`` blocks until a round is applied.
- In a store restored from a checkpoint the rounds start afresh (round numbers are
  the clocks of the store's workers); a round left unfinished in the checkpoint is
  dropped (its accumulated pushes are cleared by the first push).

Storage: three hidden tensors per aggregated tensor, listed by ``store.tensors()``:
``<name>#agg0`` and ``<name>#agg1`` (the two accumulators: the tensor's shape and
gradient dtype, updater Sum, so accumulation is the ordinary exact push) and
``<name>#aggctl`` (int32, the round control block of native/aggregate.c).  Their
names are reserved (Store refuses to create them): only add_request makes them.
``store[<name>#agg0]`` gives a :class:`HiddenDense`: read like any dense tensor (a
checkpoint, ``shmps-tool dump``), it refuses pushes and writable views (an addition to
an accumulator behind the round bookkeeping went into some round's sum).
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Iterator, Optional

import numpy as np

from . import _native
from .checks import BOUNDED_WAIT_HINT, check_flag, check_int, check_seconds
from .dense import DenseTensor
from .errors import (Busy, CorruptSegment, Error, InvalidArgument, NonFinite, SchemaError,
                     Timeout)
from .tensor import PushHandle, cast_grad, grad_dtype
from .updaters import Sum

#: (store, namespace, tensor id) -> the lock one thread of this process holds while it
#: claims and applies a round of that tensor (AggregatedTensor._settle); new ones in a
#: forked child (a parent's thread may have held one at the fork)
_APPLY_LOCKS: dict[tuple, threading.RLock] = {}
_APPLY_LOCKS_GUARD = threading.Lock()


def _fresh_apply_locks() -> None:
    global _APPLY_LOCKS_GUARD
    _APPLY_LOCKS.clear()
    _APPLY_LOCKS_GUARD = threading.Lock()


os.register_at_fork(after_in_child=_fresh_apply_locks)


def _apply_lock(t: Any) -> threading.RLock:
    key = (t._store.name, t._store.namespace, t.record["id"])
    with _APPLY_LOCKS_GUARD:
        lock = _APPLY_LOCKS.get(key)
        if lock is None:
            lock = _APPLY_LOCKS[key] = threading.RLock()
        return lock

lib = _native.lib
ffi = _native.ffi

AGGREGATES = ("sum", "mean")
CTL_WORDS = lib.SHMPS_AGG_CTL_BYTES // 4
WAIT_TIMEOUT_S = 60.0
#: the longest wait a timeout asks for (about 31 years): math.inf is taken as this, so
#: that the deadlines in ns (int(timeout * 1e9), the C core's uint64) stay numbers
LONGEST_WAIT_S = 1e9


def _round_timeout(timeout: Optional[float]) -> float:
    """``push(timeout=)`` and ``wait_round(timeout=)`` in seconds: None is the default
    (60 s), math.inf waits as long as it takes.  A negative or NaN timeout is refused:
    the C core reads a negative one as no limit (a push waiting for the team hung for
    ever) and int(NaN * 1e9) or int(inf * 1e9) raised a plain ValueError/OverflowError."""
    t = check_seconds(timeout, BOUNDED_WAIT_HINT)
    return WAIT_TIMEOUT_S if t is None else min(t, LONGEST_WAIT_S)


#: The suffixes of the hidden tensors' names: reserved (store._check_not_reserved), so
#: only add_request creates tensors of these names.
HIDDEN_SUFFIXES = ("#agg0", "#agg1", "#aggctl")


def hidden_names(name: str) -> tuple[str, str, str]:
    """The accumulator (two) and control tensor names of aggregated tensor ``name``."""
    acc0, acc1, ctl = (name + x for x in HIDDEN_SUFFIXES)
    return acc0, acc1, ctl


def hidden_of(store: Any, rec: dict) -> Optional[str]:
    """The aggregated tensor whose hidden tensor ``rec`` is (its name), else None: a
    dense record named ``<base>#agg0``, ``#agg1`` or ``#aggctl`` whose base is aggregated,
    or not recorded yet (add_request makes the hidden tensors first).  A base that is a
    plain tensor leaves the name to a user tensor made before the names were reserved."""
    name = rec.get("name", "")
    if rec.get("kind") != "dense" or not name.endswith(HIDDEN_SUFFIXES):
        return None
    base = name[:name.rindex("#")]
    brec = store._record(base)
    return base if brec is None or brec.get("aggregate") else None


class HiddenDense(DenseTensor):
    """A hidden tensor of aggregated tensor ``base`` (an accumulator, or the round control
    block): pulls and read-only views as any dense tensor; pushes and writable views
    raise InvalidArgument (AggregateDense pushes into its accumulators with
    DenseTensor.push)."""

    def __init__(self, store: Any, record: dict, shards: list, base: str) -> None:
        super().__init__(store, record, shards)
        self.base = base

    def _hidden_now(self) -> bool:
        """Whether the name is still an aggregation's (hidden_of, looked up again): a
        plain tensor of the base's name made since this handle was opened leaves it to a
        user tensor of an older build, as a handle opened now would (without the look,
        this process refused its pushes for ever while another process pushed)."""
        return hidden_of(self._store, self.record) is not None

    def _refuse(self, what: str) -> InvalidArgument:
        if self._store._record(self.base) is None:   # a creation under way, or legacy
            return InvalidArgument(
                f"{what} tensor {self.name!r}: there is no tensor {self.base!r}, and "
                f"{self.name!r} is taken for a round accumulator of an aggregated tensor "
                f"{self.base!r} being created (names ending in "
                f"{', '.join(repr(x) for x in HIDDEN_SUFFIXES)} are reserved)",
                f"if it is a tensor of your own made by an older shmps, copy it to a name "
                f"of your own: store.dense(NEW, shape=..., dtype=..., "
                f"init=store[{self.name!r}].pull())")
        role = ("round control block" if self.name.endswith("#aggctl")
                else "round accumulator")
        return InvalidArgument(
            f"{what} tensor {self.name!r}: it is the {role} of aggregated tensor "
            f"{self.base!r} (synchronous aggregation), which alone writes it; a gradient "
            f"added here would land in some round's sum, behind the round bookkeeping",
            f"push to {self.base!r} instead (after store.join()): its push adds to the "
            "round of this worker's clock")

    def push(self, grad: Any, rows: Any = None, *, wait: bool = True) -> Optional[PushHandle]:
        """Refused (InvalidArgument): push to the aggregated tensor.  (Pushed as any
        dense tensor's if the name is no longer hidden: _hidden_now.)"""
        if not self._hidden_now():
            return DenseTensor.push(self, grad, rows, wait=wait)
        raise self._refuse("push to")

    def view(self, writable: bool = False) -> np.ndarray:
        """As DenseTensor.view, read-only only (``writable=True``: InvalidArgument,
        unless the name is no longer hidden: _hidden_now)."""
        if check_flag(writable, "writable") and self._hidden_now():
            raise self._refuse("writable view of")
        return super().view(writable)


def _hidden(store: Any, name: str, req: dict) -> None:
    """Get or create hidden tensor ``name`` (its name is reserved: store.dense refuses
    to create it, so this goes to the store's get-or-create directly, as outboxes do)."""
    store._get_or_create(name, req, lambda: store._create_dense(name, req, 0, hidden_ok=True))


def add_request(store: Any, name: str, req: dict, aggregate: Optional[str],
                workers: Optional[int]) -> None:
    """Validate ``aggregate=``/``workers=`` of ``Store.dense`` into ``req``; when the
    tensor does not exist yet, get-or-create its hidden tensors first (race-safe:
    each is an ordinary get-or-create, and the tensor's record comes last)."""
    if aggregate is None or workers is None:
        raise InvalidArgument(f"aggregate={aggregate!r}, workers={workers!r}",
                              "pass both: aggregate='mean' or 'sum', and workers=N")
    if aggregate not in AGGREGATES:
        raise InvalidArgument(f"aggregate={aggregate!r}", "use 'mean' or 'sum'")
    req["aggregate"] = aggregate
    req["workers"] = check_int(workers, "workers", 1, lib.SHMPS_MAX_WORKERS)
    if name in store:
        return  # the existing record is matched against req by the caller
    if "shape" not in req:
        return  # the caller raises NotFound
    dt = np.dtype(req.get("dtype", "float32"))
    if aggregate == "mean" and dt.kind != "f":
        raise SchemaError(f"aggregate='mean' needs a float dtype, not {dt}",
                          "use aggregate='sum' for integer tensors")
    acc_dt = grad_dtype(dt).name
    acc0, acc1, ctl = hidden_names(name)
    upd = Sum().to_dict()
    for acc in (acc0, acc1):
        areq = {"kind": "dense", "shape": list(req["shape"]), "dtype": acc_dt,
                "optimizer": upd, "allow_nonfinite": True}
        if req.get("shard_rows") is not None:
            areq["shard_rows"] = req["shard_rows"]
        _hidden(store, acc, areq)
    _hidden(store, ctl, {"kind": "dense", "shape": [CTL_WORDS], "dtype": "int32",
                         "optimizer": upd})


class AggregateDense(DenseTensor):
    """A dense tensor with synchronous aggregation (see the module docstring).

    Sample usage (every worker)::

        store = shmps.attach("job", staleness=0)
        store.join()
        w = store.dense("w", shape=(65, 10), dtype="float64", optimizer=shmps.SGD(lr=0.5),
                        aggregate="mean", workers=4)
        for step in range(100):
            w.push(grad(w.pull(), my_part))   # round = my clock
            store.clock()                     # k=0: after this, every push is applied
    """

    def __init__(self, store: Any, record: dict, shards: list) -> None:
        super().__init__(store, record, shards)
        try:
            self.aggregate: str = record["aggregate"]
            self.workers: int = record.get("workers")  # type: ignore[assignment]
            if (self.aggregate not in AGGREGATES or not isinstance(self.workers, int)
                    or not 1 <= self.workers <= lib.SHMPS_MAX_WORKERS):
                raise CorruptSegment(f"tensor {self.name!r}: aggregate={self.aggregate!r}, "
                                     f"workers={self.workers!r} in its catalog record")
            acc0, acc1, ctl = hidden_names(self.name)
            self._acc = [store[acc0], store[acc1]]
            self._ctl = store[ctl]
            for acc in self._acc:
                if acc.shape != self.shape or acc.dtype != self._gdtype:
                    raise SchemaError(f"accumulator {acc.name!r} is {acc.dtype} {acc.shape}, "
                                      f"tensor {self.name!r} needs {self._gdtype} {self.shape}")
            self._last_round: Optional[int] = None
        except BaseException:
            self.close()
            raise

    # -- plumbing ----------------------------------------------------------------
    def _cptr(self) -> Any:
        return self._ctl._shard(0).ptr

    def _slot(self) -> int:
        slot = self._store._worker
        if slot is None:
            raise InvalidArgument(f"push to aggregated tensor {self.name!r} from a process "
                                  "that is not a worker",
                                  "call store.join() first: a push belongs to the round "
                                  "of the pusher's clock")
        return int(slot)

    def _timeout_error(self, rnd: int, behind: int, timeout: float) -> Timeout:
        if behind == -2:
            who = "another process is still applying it"
        elif behind < 0:
            who = (f"fewer than workers={self.workers} workers have joined "
                   f"({len(self._store.workers())} now)")
        else:
            w = {x["worker"]: x for x in self._store.workers()}.get(behind, {})
            who = (f"worker {behind} (pid {w.get('pid')}) at clock {w.get('clock')} "
                   "has not pushed")
        return Timeout(f"round {rnd} of {self.name!r} not applied after {timeout} s: {who}",
                       "that worker is slow or stuck; raise the timeout, or make it "
                       "push or call store.clock()")

    # -- push --------------------------------------------------------------------
    def push(self, grad: Any, rows: Any = None, *, wait: bool = True,
             timeout: Optional[float] = None) -> Optional[PushHandle]:
        """Contribute ``grad`` (whole, or ``rows``) to the round of this worker's clock.

        The gradient is checked (shape, dtype, NaN/Inf) and then added exactly to
        the round's accumulator; the pusher that completes the round applies the
        updater once with the sum or mean, before returning.  Blocks only if this
        worker is two rounds ahead of the oldest unapplied round (until it is
        applied; Timeout after ``timeout`` s, default 60, naming who is behind).
        ``wait=False`` returns a handle once the round is fixed (the accumulation
        runs on the store's push thread; ``store.clock()`` waits for it).  The pusher
        that applies a round raises NonFinite if the round's sum is not finite (the
        round is dropped), and any other error of the apply (a Timeout on a lock a
        stuck process holds) with the round left for the next process to finish.  Cost:
        one exact push into the accumulator, and for the last pusher a pull, a push
        and a clear of the tensor; the bookkeeping is a few C calls."""
        limit = _round_timeout(timeout)
        wait = check_flag(wait, "wait")   # (before the push joins or takes a round)
        slot = self._slot()
        g, r = self._prepare(grad, rows)
        self._require_finite(g)
        rnd = self._begin(slot, limit)
        if wait:
            self._contribute(slot, rnd, g, r)
            return None
        return self._store._submit(self._contribute, slot, rnd, g, r)

    def _begin(self, slot: int, timeout: float) -> int:
        rnd = ffi.new("uint64_t *")
        man, tok = self._store._mptr, _native.token()
        while True:
            code = lib.shmps_agg_begin(self._cptr(), man, tok, slot, self.workers, rnd)
            if code == lib.SHMPS_AGG_E_AHEAD:
                self._settle(True, timeout)
                self._wait(int(rnd[0]) - 2, timeout)
                continue
            if code == lib.SHMPS_AGG_E_CLAIMED:
                # a worker that joined after round rnd was claimed: the round goes on
                # without it; once applied, the push is refused as CLOSED just below
                self._wait(int(rnd[0]), timeout)
                continue
            if code == lib.SHMPS_AGG_E_ASSEMBLING:
                self._assemble(timeout)
                continue
            if code == lib.SHMPS_AGG_E_STALE:
                self._reset(timeout)
                continue
            if code == lib.SHMPS_AGG_E_CLOSED:
                raise InvalidArgument(f"round {int(rnd[0])} of {self.name!r} (worker {slot}'s "
                                      "clock) was already applied without this worker",
                                      "call store.clock() to move to the current round")
            if code == lib.SHMPS_AGG_E_TWICE:
                # (or the process that held this slot before: a worker that joined
                # into a dead worker's slot finds that one's push in the round)
                raise InvalidArgument(f"worker {slot} already pushed to {self.name!r} for "
                                      f"clock {int(rnd[0])} (this process, or the one that "
                                      f"held slot {slot} before it)",
                                      "an aggregated tensor takes one push per worker per "
                                      "clock: sum gradients locally, or call store.clock()")
            if code == lib.SHMPS_E_ARG:
                raise InvalidArgument(f"worker {slot} was dropped from store "
                                      f"{self._store.name!r}", "call store.join() again")
            _native.check(code, f"push to {self.name!r}")
            self._last_round = int(rnd[0])
            return int(rnd[0])

    def _assemble(self, timeout: float) -> None:
        """Wait until ``workers`` workers have joined (the first pushes only)."""
        n = ffi.new("uint32_t *")
        code = lib.shmps_agg_assemble(self._cptr(), self._store._mptr, _native.token(),
                                      self.workers, timeout, n)
        if code == lib.SHMPS_E_TIMEOUT:
            raise Timeout(f"push to {self.name!r}: only {int(n[0])} of workers={self.workers} "
                          f"workers have joined store {self._store.name!r} after {timeout} s",
                          "start the other workers (each calls store.join()), or create the "
                          "tensor with fewer workers")
        _native.check(code, f"push to {self.name!r}")

    def _reset(self, timeout: float) -> None:
        """The rounds belong to another manifest (this store was restored from a
        checkpoint): one process clears the accumulators and restarts the rounds."""
        state = ffi.new("uint32_t *")
        man, tok = self._store._mptr, _native.token()
        deadline = _native.now_ns() + int(timeout * 1e9)
        while True:
            _native.check(lib.shmps_agg_reset(self._cptr(), man, tok, 0, state),
                          f"reset rounds of {self.name!r}")
            if state[0] == lib.SHMPS_AGG_RESET_DONE:
                return
            if state[0] == lib.SHMPS_AGG_RESET_CLAIMED:
                for acc in self._acc:
                    for sh in acc._shards:
                        sh.values(acc.dtype)[...] = 0  # nobody pushes into a stale block
                _native.check(lib.shmps_agg_reset(self._cptr(), man, tok, 1, state),
                              f"reset rounds of {self.name!r}")
                return
            if _native.now_ns() > deadline:
                raise Timeout(f"resetting the rounds of {self.name!r} (restored store) took "
                              f"more than {timeout} s")
            time.sleep(0.001)  # another process is clearing the accumulators

    def _contribute(self, slot: int, rnd: int, g: np.ndarray, r: Optional[np.ndarray]) -> None:
        tok = _native.token()
        try:
            DenseTensor.push(self._acc[rnd % 2], g, rows=r)   # (HiddenDense refuses)
        except BaseException:
            lib.shmps_agg_abort(self._cptr(), tok, slot, rnd)
            raise
        _native.check(lib.shmps_agg_commit(self._cptr(), tok, slot, rnd, self.workers),
                      f"push to {self.name!r}")
        self._settle(False, WAIT_TIMEOUT_S)

    # -- rounds ------------------------------------------------------------------
    def _settle(self, wait_busy: bool, timeout: float, wait_foreign: bool = True) -> None:
        """Apply every complete round (in order); with ``wait_busy``, also wait for
        one another process is applying.  Without ``wait_foreign``, a round that would
        wait for a push by another path to take its ticket raises Busy at once instead
        (its claim released: :meth:`_apply_round`)."""
        what, rnd = ffi.new("uint32_t *"), ffi.new("uint64_t *")
        count, phase, behind = ffi.new("uint32_t *"), ffi.new("uint32_t *"), ffi.new("int32_t *")
        man, tok = self._store._mptr, _native.token()
        while True:
            # one thread of this process at a time from the claim to the round's end:
            # the threads share the process's token, and the C side hands a claim of
            # this token out again as one left by an exception, so a second thread (a
            # pull() beside a push(wait=False)) took the round another thread was
            # applying and applied it again (twice on every stripe; a cut push's resume
            # tore it across stripes)
            with _apply_lock(self):
                _native.check(lib.shmps_agg_next(self._cptr(), man, tok, self.workers, what,
                                                 rnd, count, phase, behind),
                              f"round of {self.name!r}")
                if what[0] == lib.SHMPS_AGG_APPLY:
                    self._apply_round(int(rnd[0]), int(count[0]), int(phase[0]),
                                      wait_foreign)
                    continue
            if what[0] == lib.SHMPS_AGG_BUSY and wait_busy:
                self._wait(int(rnd[0]), timeout)
            else:
                return

    def _apply_round(self, rnd: int, count: int, phase: int, wait_foreign: bool = True
                     ) -> None:
        """Apply round ``rnd`` (claimed by us): aggregate, push once, clear.  Phase
        PUSHING: a claim taken over from a process that died pushing the aggregate (or
        released on an error); the push is finished on the stripes it did not reach
        (native/aggregate.c).  A sum that is not finite (NonFinite, found before anything
        is written) drops the round and is raised.  Any other exception (a Timeout on a
        lock or a freeze another process holds, an interrupt: possibly after some shards
        were written) releases the claim as it stands (shmps_agg_release) and is raised:
        the next process to look finishes the round as a dead applier's, by its phase,
        never twice on a stripe nor without one.  ``wait_foreign``: as :meth:`_settle`."""
        ctl, tok = self._cptr(), _native.token()
        acc = self._acc[rnd % 2]
        what = f"round {rnd} of {self.name!r}"
        dropped: Optional[Error] = None
        try:
            if phase in (lib.SHMPS_AGG_PH_SUM, lib.SHMPS_AGG_PH_PUSHING):
                dropped = self._push_aggregate(rnd, count, phase, acc, wait_foreign)
            if phase == lib.SHMPS_AGG_PH_ZEROING or dropped is not None:
                # (a round pushed moved to ZEROING as its push ended)
                _native.check(lib.shmps_agg_phase(ctl, tok, rnd, lib.SHMPS_AGG_PH_ZEROING),
                              what)
            for sh in acc._shards:
                sh.values(acc.dtype)[...] = 0  # nobody else writes this buffer now
            _native.check(lib.shmps_agg_finish(ctl, tok, rnd), what)
        except BaseException:
            lib.shmps_agg_release(ctl, tok, rnd)   # (a claim no longer ours: left alone)
            raise
        if dropped is not None:
            raise dropped

    def _push_aggregate(self, rnd: int, count: int, phase: int, acc: DenseTensor,
                        wait_foreign: bool) -> Optional[Error]:
        """Push the aggregate of round ``rnd`` (our claim, phase SUM or PUSHING) to the
        tensor; the round is then in phase ZEROING.  Returns the NonFinite of a sum that
        is not finite, the round's push not begun (the caller drops the round)."""
        ctl, tok = self._cptr(), _native.token()
        what = f"round {rnd} of {self.name!r}"
        total = acc.pull()
        if self.aggregate == "mean":
            np.divide(total, count, out=total)
        if not (phase == lib.SHMPS_AGG_PH_PUSHING or self._resumable()):
            # pushed without a ticket (hogwild, or forwarded to a bridge): an error after
            # this cannot be finished stripe by stripe; the round is cleared by whoever
            # takes it over, as a dead applier's (consistency.md)
            _native.check(lib.shmps_agg_phase(ctl, tok, rnd, lib.SHMPS_AGG_PH_PUSHING), what)
            try:
                DenseTensor.push(self, total)
            except NonFinite as exc:   # its check, before anything is written
                return exc
            _native.check(lib.shmps_agg_phase(ctl, tok, rnd, lib.SHMPS_AGG_PH_ZEROING), what)
            return None
        g = cast_grad(total, self.dtype)
        nthreads = self._threads_for(g.nbytes)
        if phase == lib.SHMPS_AGG_PH_PUSHING:
            # resumed: the sum the first applier checked before taking the ticket (the
            # accumulator is closed to pushes from the claim on)
            got = ffi.new("uint64_t *")
            _native.check(lib.shmps_agg_push_step(ctl, tok, rnd, got), what)
            step = int(got[0]) | lib.SHMPS_STEP_RESUME
        else:
            try:
                self._require_finite(g, nthreads)
            except NonFinite as exc:   # e.g. the sum overflowed to Inf
                return exc
            step = self._pushing(rnd, wait_foreign)
        self._push_round(g, step, nthreads)
        # one push in the statistics per round, whoever finished it (a dead applier's
        # cut push counted none); it moves the round to phase ZEROING
        _native.check(lib.shmps_agg_pushed(ctl, tok, rnd, self._shard(0).ptr, g.nbytes,
                                           self.nrows), what)
        return None

    def _resumable(self) -> bool:
        """A push of a round that a dead applier cut can be finished: the tensor's
        stripes keep their steps (not hogwild) and the push is applied here (not
        forwarded to a bridge, where it goes to the outbox)."""
        return self.mode != "hogwild" and not (self._fwd[0] and self._forwards())

    def _pushing(self, rnd: int, wait: bool = True) -> int:
        """Phase PUSHING of our claim of round ``rnd``; returns the push's ticket
        (shmps_agg_pushing takes it), once no push by another path is in flight.  While
        one is, sleeps on the control block's futex (GIL released), woken as it ends;
        Timeout after WAIT_TIMEOUT_S.  Without ``wait``: Busy at once."""
        got = ffi.new("uint64_t *")
        code = lib.shmps_agg_pushing(self._cptr(), _native.token(), rnd, self._shard(0).ptr,
                                     WAIT_TIMEOUT_S if wait else 0.0, got)
        if code == lib.SHMPS_AGG_E_FOREIGN and not wait:
            raise Busy(f"round {rnd} of {self.name!r}: a push by another path (a bridge's) "
                       "is in flight")
        if code == lib.SHMPS_AGG_E_FOREIGN:
            raise Timeout(f"round {rnd} of {self.name!r}: a push by another path (a "
                          f"bridge's) has been in flight for {WAIT_TIMEOUT_S} s",
                          "is the process applying it stuck?")
        _native.check(code, f"round {rnd} of {self.name!r}")
        return int(got[0])

    def _push_round(self, g: np.ndarray, step: int, nthreads: int) -> None:
        """Push the round's gradient ``g`` (checked) at ticket ``step`` (taken for the
        round; with SHMPS_STEP_RESUME: only to the stripes that do not have it yet), over
        ``nthreads`` threads.  Counted by the caller (shmps_agg_pushed).  (Its own
        method: the crash tests of test_aggregate.py kill an applier inside it.)"""
        self._push_all(g, step, nthreads)

    # -- pushes by another path (the bridge) --------------------------------------
    def _apply_direct(self, index: Any, grads: Any, pushes: int = 1,
                      continues: bool = False) -> None:
        """As DenseTensor._apply_direct, bracketed by the rounds (:meth:`_foreign`)."""
        with self._foreign():
            super()._apply_direct(index, grads, pushes, continues)

    def _apply_shard(self, shard: int, rows: np.ndarray, grads: np.ndarray, pushes: int = 1,
                     continues: bool = False) -> None:
        """As DenseTensor._apply_shard, bracketed by the rounds (:meth:`_foreign`)."""
        with self._foreign():
            super()._apply_shard(shard, rows, grads, pushes, continues)

    @contextlib.contextmanager
    def _foreign(self) -> Iterator[None]:
        """A push to the tensor by another path than the rounds (the bridge applying
        to it directly): a round a dead applier left in phase PUSHING is finished
        first; the push is then registered in the control block, and a round does not
        start pushing until it is done (shmps_agg_foreign).  Without this, the push
        could move stripes that a dead applier had not reached past the round's
        ticket, and the resume took them for having the round (review F3 of ca12e65).
        It never waits for another process: its caller is a bridge's event loop, whose
        heartbeats a wait stops (a paused worker's round held it up to 60 s, then the
        batch was refused for good: review H2 F3).  A round a live process is pushing
        by ticket, or one waiting to take its ticket (it would wait for ever if new
        pushes by another path kept starting), or a full table of such pushes, raises
        :class:`Busy` with nothing done, and the bridge refuses the batch BUSY: its sender
        sends it again.  So does a round this call finishes for a dead applier, or
        applies after it, that would wait for another process's push by another path
        (before, it waited up to WAIT_TIMEOUT_S on the event loop).  One
        thread of this process at a time, as the rounds' applier (_apply_lock)."""
        what, rnd = ffi.new("uint32_t *"), ffi.new("uint64_t *")
        man, tok = self._store._mptr, _native.token()
        with _apply_lock(self):
            for _ in range(4):   # (each pass finishes a dead applier's round)
                code = lib.shmps_agg_foreign(self._cptr(), man, tok, 0, what, rnd)
                if code == lib.SHMPS_AGG_E_FOREIGN:
                    raise Busy(f"push to {self.name!r}: as many processes as the control "
                               "block holds push to it by another path at once")
                _native.check(code, f"push to {self.name!r}")
                if what[0] == lib.SHMPS_AGG_NOTHING:
                    break
                if what[0] != lib.SHMPS_AGG_APPLY:
                    raise Busy(f"push to {self.name!r}: round {int(rnd[0])} is being "
                               "pushed by another process, or waits to be")
                # finish the dead applier's round, and any complete after it, waiting for
                # nobody: one that would wait for another process's push by another path
                # (begun since) raises Busy, its claim released for the workers
                self._settle(False, WAIT_TIMEOUT_S, wait_foreign=False)
            else:
                raise Busy(f"push to {self.name!r}: rounds left by dead appliers are "
                           "still being finished")
            try:
                yield
            finally:
                _native.check(lib.shmps_agg_foreign(self._cptr(), man, tok, 1, what, rnd),
                              f"push to {self.name!r}")

    def _wait(self, rnd: int, timeout: float) -> None:
        """Block until round ``rnd`` is applied (applying it, or earlier ones, when
        they become complete and nobody else does)."""
        done, behind = ffi.new("uint32_t *"), ffi.new("int32_t *")
        man, tok = self._store._mptr, _native.token()
        deadline = _native.now_ns() + int(timeout * 1e9)
        while True:
            left = max(0.0, (deadline - _native.now_ns()) / 1e9)
            code = lib.shmps_agg_wait(self._cptr(), man, tok, self.workers, rnd, left, done,
                                      behind)
            if code == lib.SHMPS_E_TIMEOUT:
                raise self._timeout_error(rnd, int(behind[0]), timeout)
            _native.check(code, f"wait for round {rnd} of {self.name!r}")
            if done[0]:
                return
            self._settle(False, timeout)

    def wait_round(self, round: Optional[int] = None, timeout: Optional[float] = None) -> None:
        """Block until ``round`` (default: this process's last push's round) is
        applied; Timeout after ``timeout`` s (default 60) naming the worker behind.
        Sleeps on a futex (GIL released); re-checks liveness every 2 ms."""
        limit = _round_timeout(timeout)
        # (int() took 2.5 as round 2)
        rnd = self._last_round if round is None else check_int(round, "round", 0)
        if rnd is None:
            return
        self._wait(rnd, limit)

    def rounds(self) -> dict:
        """Round bookkeeping: next_round (oldest not applied), applied, skipped
        (rounds nobody pushed to), takeovers, assembled, and per buffer its round,
        contributors and pushes in flight."""
        info = ffi.new("shmps_agg_info_t *")
        _native.check(lib.shmps_agg_info(self._cptr(), info), f"rounds of {self.name!r}")
        return {"next_round": int(info.next_round), "applied": int(info.applied),
                "skipped": int(info.skipped), "takeovers": int(info.takeovers),
                "assembled": bool(info.assembled), "applier_pid": int(info.applier_pid),
                "buffers": [{"round": int(info.rounds[k]), "contributed": int(info.contributed[k]),
                             "in_flight": int(info.in_flight[k])} for k in range(2)]}

    # -- pull --------------------------------------------------------------------
    def pull(self, rows: Any = None, *, out: Optional[np.ndarray] = None,
             consistent: bool = True) -> np.ndarray:
        """As :meth:`DenseTensor.pull`, after applying any complete round (and waiting
        for one another process is applying).  A round applied while the shards were
        being copied makes it copy again (shmps_agg_mark before and after): the copy
        is of one whole round, never some shards of the next."""
        busy, man = 2**64 - 1, self._store._mptr
        consistent = check_flag(consistent, "consistent")   # (before a round is applied)
        while True:
            self._settle(True, WAIT_TIMEOUT_S)
            before = int(lib.shmps_agg_mark(self._cptr(), man))
            if before == busy:
                continue                # claimed since: _settle waits for it or takes it
            got = super().pull(rows, out=out, consistent=consistent)
            if int(lib.shmps_agg_mark(self._cptr(), man)) == before:
                return got

    def view(self, writable: bool = False) -> np.ndarray:
        """As :meth:`DenseTensor.view`, after applying any complete round."""
        writable = check_flag(writable, "writable")   # (before a round is applied)
        self._settle(True, WAIT_TIMEOUT_S)
        return super().view(writable)
