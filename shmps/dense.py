"""Dense tensors: n-d arrays sharded by row ranges, pushed stripe by stripe in C."""
from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import numpy as np

from . import _native
from .checks import check_flag
from .errors import CorruptSegment, InvalidArgument, OutOfRange, SchemaError
from .tensor import PushHandle, SplitParts, Tensor, cast_grad, check_rows, rows_for_c

lib = _native.lib

SPLIT_BYTES = 8 << 20  # a push this large is split across the process's cores
NCPU = os.cpu_count() or 1
STRIPE = lib.SHMPS_STRIPE_BYTES
NO_SLOT = 0xFFFFFFFF  # no active slot claimed (DenseTensor._entered)
ENTER_TIMEOUT_S = 60.0  # as the C core's own waits (SHMPS_LOCK_TIMEOUT_S)


def default_shard_rows(shape: tuple, itemsize: int, shard_bytes: int = 16 << 20) -> int:
    """Rows per shard: about ``shard_bytes`` of values, and a whole number of pages
    (so view() can map the shards back to back)."""
    nrows = shape[0] if shape else 1
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * itemsize) if shape else itemsize
    page = 4096
    align = page // math.gcd(page, row_bytes)  # rows per whole number of pages
    rows = max(align, (shard_bytes // row_bytes) // align * align)
    return max(1, min(nrows, rows))


class DenseTensor(Tensor):
    """An n-d array in shared memory; rows are the first axis.

    Sample usage::

        w = store.dense("fc.w", shape=(1024, 256), optimizer=shmps.SGD(lr=0.1))
        w.push(grad)                 # exact, lock-free in practice
        a = w.pull()                 # private copy, each shard a consistent snapshot
    """

    kind = "dense"

    def __init__(self, store: Any, record: dict, shards: list) -> None:
        super().__init__(store, record, shards)
        self.shape: tuple = tuple(record["shape"])
        self.nrows: int = self.shape[0] if self.shape else 1
        self.row_shape: tuple = self.shape[1:]
        self.row_len: int = int(np.prod(self.row_shape, dtype=np.int64)) if self.shape else 1
        self.shard_rows: int = record["shard_rows"]
        self.size = self.nrows * self.row_len
        self._gdtype = np.dtype("float32") if self.dtype == np.float16 else self.dtype
        self._gcode = _native.DTYPE_CODES[self._gdtype.name]
        self._view: Optional[np.ndarray] = None
        self._others_until = 0.0  # another process pushed recently: don't split
        # element offset of each shard within the whole tensor
        self._elem0 = [i * self.shard_rows * self.row_len for i in range(self.nshards)]
        # one C call per push/pull for one-shard tensors below the split size
        self._fast = self.nshards == 1 and self.size * self._gdtype.itemsize < SPLIT_BYTES
        try:
            self._check_shards()
        except BaseException:
            self.close()
            raise

    def _check_shards(self) -> None:
        """The catalog record and the shard headers must describe the same rows: a
        record that disagrees (corrupt manifest) would make C copy past our arrays."""
        nrows, per = self.nrows, self.shard_rows
        want_shards = max(1, -(-nrows // per)) if per >= 1 else -1
        if self.nshards != want_shards:
            raise CorruptSegment(f"tensor {self.name!r}: {self.nshards} shard segments, its "
                                 f"catalog record (shape {self.shape}, shard_rows {per}) "
                                 f"needs {want_shards}")
        for i, sh in enumerate(self._shards):
            rows = max(0, min(per, nrows - i * per))
            want = {"row_begin": i * per, "nrows": rows, "row_len": self.row_len,
                    "nnz": rows * self.row_len, "updater": self.optimizer.code,
                    "params": _native.params_of(self.optimizer)}
            got = {k: sh.spec[k] for k in want}
            if got != want or bool(sh.spec["flags"] & lib.SHMPS_F_HOGWILD) != (
                    self.mode == "hogwild"):
                raise CorruptSegment(f"segment {sh.seg.name} holds {got}, the catalog record "
                                     f"of tensor {self.name!r} says {want}")

    # -- push --------------------------------------------------------------------
    def push(self, grad: Any, rows: Any = None, *, wait: bool = True) -> Optional[PushHandle]:
        """Apply the tensor's updater to ``grad`` (whole tensor) or to ``rows``.

        ``grad`` has the tensor's shape, or ``(len(rows),) + shape[1:]`` with
        ``rows``.  Cast with numpy's same_kind rule; non-contiguous arrays are copied.
        Duplicate rows accumulate as gradients do.  Exact: concurrent pushes from
        any processes give the result of applying each whole, in some order.

        Cost: one pass over the gradient to reject NaN/Inf (skipped with
        allow_nonfinite), one fused pass over the values; large pushes are split
        across this process's cores.  The GIL is released while C runs.
        ``wait=False`` returns a :class:`PushHandle` at once; the gradient array must
        not be modified until the handle is waited on.

        While shmps-bridge runs (the store's forwarding switch), the push is checked
        the same way and then summed into the tensor's outbox for the bridge to send
        to the shard's owner (shmps/outbox.py); it shows in pull() once the owner's
        update comes back."""
        if (self._fast and rows is None and wait is True and type(grad) is np.ndarray
                and grad.dtype == self._gdtype and grad.shape == self.shape
                and grad.flags.c_contiguous):
            code = lib.shmps_dense_push_all(self._shard(0).ptr, self._fwd, _native.token(),
                                            _native.ffi.from_buffer(grad), self._gcode,
                                            int(self._check_finite))
            if not code:
                return None
            if code != lib.SHMPS_FORWARDING:
                _native.check(code, f"push to {self.name!r}")
            # forwarding: C tested the switch (and did nothing); on below
        return self._push(grad, rows, wait, True)

    def _push(self, grad: Any, rows: Any, wait: Any, check: bool) -> Optional[PushHandle]:
        """:meth:`push` past its fast path: validated, then summed into the outbox
        (forwarding) or applied, now or on the push thread.  ``check`` False: the caller
        checked ``grad`` for NaN/Inf already (:meth:`_push_prechecked`)."""
        wait = check_flag(wait, "wait")   # (wait="no" waited)
        if self._fwd[0] and self._forwards():
            g, r = self._prepare(grad, rows, c_checks_rows=wait)
            if wait:
                self._forward(g, r, check)
                return None
            return self._store._submit(self._forward, g, r, check)
        g, r = self._prepare(grad, rows, c_checks_rows=wait)
        if wait:
            self._apply(g, r, check=check)
            return None
        return self._store._submit(self._apply, g, r, 1, True, check)

    def _push_prechecked(self, grad: np.ndarray, rows: Optional[np.ndarray],
                         wait: bool) -> Optional[PushHandle]:
        """:meth:`push` of a gradient the caller has checked for NaN/Inf already with
        this tensor's :meth:`_require_finite` (shmps.torch's Pusher.step checks every
        gradient before it pushes any): the same push without a second read of the
        gradient for it.  Only where the push takes ``grad`` in its own dtype: a cast
        may make a finite value inf, so a cast gradient is checked as push checks it."""
        if grad.dtype != self.dtype or type(self).push is not DenseTensor.push:
            # (a subclass's push, AggregateDense's, does more than this one: its own)
            return self.push(grad, rows, wait=wait)
        return self._push(grad, rows, wait, False)

    def _prepare(self, grad: Any, rows: Any,
                 c_checks_rows: bool = False) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """(gradient, rows) validated for a push; ``c_checks_rows``: the rows go straight
        to shmps_dense_push_sorted_rows, which checks their range before anything
        changes (rows_for_c), else they are checked here (a push with wait=False
        raises a bad row at once, not at its wait)."""
        g = cast_grad(grad, self.dtype)
        if rows is None:
            if g.shape != self.shape:
                raise SchemaError(f"gradient shape {g.shape} != tensor {self.name!r} shape "
                                  f"{self.shape}", "pass rows= to push only some rows")
            return g, None
        r = rows_for_c(rows, self.nrows) if c_checks_rows else check_rows(rows, self.nrows)
        if g.shape != (r.size,) + self.row_shape:
            raise SchemaError(f"gradient shape {g.shape} != {(r.size,) + self.row_shape} "
                              f"(len(rows),) + row shape of {self.name!r}",
                              "give one gradient row per entry of rows=")
        return g, r

    def _forward(self, g: np.ndarray, r: Optional[np.ndarray], check: bool = True) -> None:
        """A validated push while forwarding: NaN/Inf check (this tensor's rule; not
        with ``check`` False: the caller made it), then summed into the outbox and
        counted there."""
        if check:
            self._require_finite(g)
        self._outbox()._push_counted(g, r)

    def _apply(self, g: np.ndarray, r: Optional[np.ndarray], pushes: int = 1,
               new_step: bool = True, check: bool = True) -> None:
        """Push ``g`` (validated) into rows ``r`` (None: all).
        ``new_step`` False: apply at the tensor's current step without advancing it (a
        later frame of one forwarded drain); ``pushes``: how many the call counts as;
        ``check`` False: ``g`` was checked for NaN/Inf by the caller (_push_prechecked)."""
        if r is not None:
            self._apply_rows(g, r, pushes, new_step, check)
            return
        nthreads = self._threads_for(g.nbytes)
        if check:
            self._require_finite(g, nthreads)
        # the ticket (flagged when each stripe counts its own steps), or the step of the
        # push under way: dense.c "Stripe steps"; passed to the C push as it is
        step = _native.ffi.new("uint64_t *")
        if new_step:
            lib.shmps_dense_next_step(self._shard(0).ptr, step)
        else:
            lib.shmps_dense_step_again(self._shard(0).ptr, step)
        self._push_all(g, int(step[0]), nthreads)
        lib.shmps_count_push(self._shard(0).ptr, pushes, g.nbytes, self.nrows)

    def _apply_rows(self, g: np.ndarray, r: np.ndarray, pushes: int, new_step: bool,
                    check_finite: bool = True) -> None:
        """_apply of rows ``r``: repeated rows summed where the updater needs it, then one
        C call (:meth:`_push_sorted`) that checks the rows and the gradient, takes the
        step, pushes each shard's run of rows and counts the push; rows out of order
        come back SHMPS_UNSORTED, and are sorted (stably: assign's last duplicate still
        wins) for a second call."""
        check = self._check_finite and check_finite
        rs, gs = self._aggregate_duplicates(r, g)
        if rs.size < r.size and check:
            self._require_finite(g)   # the gradient pushed, not its sums, is checked
            check = False
        if self._push_sorted(rs, gs, check, new_step, pushes) == lib.SHMPS_UNSORTED:
            order = np.argsort(rs, kind="stable")
            self._push_sorted(rs[order], gs[order], check, new_step, pushes)

    def _push_sorted(self, rows: np.ndarray, g: np.ndarray, check: bool, new_step: bool,
                     pushes: int) -> int:
        """shmps_dense_push_sorted_rows of ``rows`` (int64, C-contiguous) and their
        gradient rows ``g``: 0, or SHMPS_UNSORTED (rows not ascending: nothing done);
        any error raised, a row out of range as OutOfRange naming it."""
        code = lib.shmps_dense_push_sorted_rows(
            self._shard_bases(), self.nshards, self.shard_rows, _native.token(),
            _native.addr(rows), rows.size, _native.addr(g), self._gcode, int(check),
            int(new_step), pushes)
        if code == lib.SHMPS_E_BOUNDS:
            check_rows(rows, self.nrows)   # raises OutOfRange naming the row
        if code and code != lib.SHMPS_UNSORTED:
            _native.check(code, f"push to {self.name!r}")
        return code

    def _shard_bases(self) -> Any:
        """Every shard's base (``void *[]``), built once; Closed after close() (the bases
        would point at unmapped memory)."""
        self._shard(0)
        bases = getattr(self, "_bases_arr", None)
        if bases is None:
            bases = self._bases_arr = _native.ffi.new("void *[]",
                                                     [sh.ptr for sh in self._shards])
        return bases

    def _threads_for(self, nbytes: int) -> int:
        """Split a large push over this process's cores, unless another process has
        pushed to the tensor in the last 100 ms (then the cores are shared already,
        and more threads than cores only thrash)."""
        nthreads = min(NCPU, nbytes // SPLIT_BYTES)
        others = _native.ffi.new("uint32_t *")
        lib.shmps_note_pusher(self._shard(0).ptr, _native.token(), 100_000_000, others)
        if others[0] or (self._others_until > time.monotonic()):
            if others[0]:
                self._others_until = time.monotonic() + 0.1
            return 1
        return max(1, nthreads)

    def _push_all(self, g: np.ndarray, step: int, nthreads: int) -> None:
        """Push ``g`` into every shard: one C call per shard, or, split over ``nthreads``
        threads (parts that may cut a shard), under an active slot of every shard that
        this thread takes first, in increasing shard order, and lets go of after the
        last part has returned (:meth:`_entered`).  Each shard then holds the whole push
        or none of it for a consistent pull, a checkpoint or the bridge's snapshot."""
        gbase = g.ctypes.data
        gsz = g.itemsize
        units = [(i, 0, sh.spec["nstripes"]) for i, sh in enumerate(self._shards)]
        if nthreads <= 1:
            self._run_units(units, gbase, gsz, step)
            return
        parts = self._split(units, nthreads)
        with self._entered() as slots:
            # the slots are let go of, and an aggregated round's claim released for
            # another process to finish, only once no thread of this push writes, an
            # interrupt anywhere in here included (a round resumed while a helper thread
            # was still in its stripes landed twice on some: review H5 F3); on an error
            # of any part, or an interrupt, the parts not started yet do not start
            # (SplitParts)
            helpers = SplitParts(len(parts))
            try:
                for j in range(1, len(parts)):
                    helpers.submit(j, self._run_units, parts[j], gbase, gsz, step, slots)
                helpers.run_here(0, self._run_units, parts[0], gbase, gsz, step, slots)
                helpers.wait()
            except BaseException:
                helpers.close()
                raise
        helpers.raise_first(lambda j: self._span(parts[j]), "values",
                            f"flat indices into {self.name!r}")

    @contextmanager
    def _entered(self) -> Iterator[list[int]]:
        """An active slot of every shard (``slots[i]`` of shard ``i``), claimed in
        increasing shard order (as a table batch does: a freeze waits for one shard's
        pushers at a time, so no cycle), held until the block ends; each is let go of
        whatever happens, an interrupt included (a slot not yet claimed is NO_SLOT)."""
        tok = _native.token()
        out = _native.ffi.new("uint32_t *")
        slots = [NO_SLOT] * self.nshards
        try:
            for i, sh in enumerate(self._shards):
                out[0] = NO_SLOT
                try:
                    code = lib.shmps_enter(sh.ptr, tok, ENTER_TIMEOUT_S, out)
                finally:
                    slots[i] = int(out[0])  # claimed even if Ctrl-C comes as it returns
                if code < 0:
                    _native.check(code, f"push to {self.name!r} (shard {i})")
            yield slots
        finally:
            for i, slot in enumerate(slots):
                if slot != NO_SLOT:
                    lib.shmps_leave(self._shards[i].ptr, tok, slot)

    def _run_units(self, part: list, gbase: int, gsz: int, step: int,
                   slots: Optional[list[int]] = None) -> None:
        for i, lo, hi in part:
            self._call_push(i, gbase, gsz, lo, hi, step, slots)

    def _call_push(self, i: int, gbase: int, gsz: int, lo: int, hi: int, step: int,
                   slots: Optional[list[int]] = None) -> None:
        """Stripes ``[lo, hi)`` of shard ``i``; ``slots``: the shards' active slots this
        process holds for the push (:meth:`_entered`), else the call takes its own."""
        ptr = _native.ffi.cast("void *", gbase + self._elem0[i] * gsz)
        base0 = self._shards[0].ptr   # its step word: the tensor's count (Stripe steps)
        if slots is None:
            code = lib.shmps_dense_push(self._shards[i].ptr, base0, _native.token(), ptr,
                                        self._gcode, lo, hi, step, 0)
        else:
            code = lib.shmps_dense_push_entered(self._shards[i].ptr, base0, _native.token(),
                                                slots[i], ptr, self._gcode, lo, hi, step)
        if code:
            _native.check(code, f"push to {self.name!r}")

    def _span(self, part: list) -> tuple[int, int]:
        """The flat indices ``[start, end)`` of the tensor's values that ``part`` (a
        run of :meth:`_split`: consecutive stripe ranges) covers."""
        i, lo, _ = part[0]
        j, _, hi = part[-1]
        per = self._shards[i].spec["stripe_elems"]
        return (self._elem0[i] + lo * per,
                self._elem0[j] + min(hi * per, self._shards[j].spec["nnz"]))

    @staticmethod
    def _split(units: list, k: int) -> list:
        total = sum(hi - lo for _, lo, hi in units)
        per = -(-total // k)
        parts, cur, room = [], [], per
        for i, lo, hi in units:
            while lo < hi:
                take = min(room, hi - lo)
                cur.append((i, lo, lo + take))
                lo += take
                room -= take
                if room == 0:
                    parts.append(cur)
                    cur, room = [], per
        if cur:
            parts.append(cur)
        return parts

    # -- the bridge's side (shmps/outbox.py; private API) -------------------------
    def _outbox_drain(self, shard: int, timeout: Optional[float] = None,
                      into: Any = None) -> Any:
        """Take what the outbox's ``shard`` holds: an ``outbox.Drained``, or None when no
        row is pending.  Exact against concurrent pushers (docs/concurrency.md).  Waits
        at most ``timeout`` (default outbox.DRAIN_TIMEOUT_S, 0.1 s) for a lock a live
        process holds: then returns what it took so far, or None.
        ``into``: an ``outbox.DrainBuffers`` to drain into (the result holds views of
        it, valid until its next use)."""
        from . import outbox
        return outbox.drain_dense(self, shard, timeout, into)

    def _apply_direct(self, index: Any, grads: Any, pushes: int = 1,
                      continues: bool = False) -> None:
        """Apply the updater as a push with forwarding off would, whatever the switch
        says (the owner's bridge): ``index`` global rows (None: the whole tensor).
        Same validation as push; one call is one step of a per-tensor step (Adam's t),
        unless ``continues``: more rows of the drain the previous call began, applied at
        the current step (and counted as no further push).  ``pushes`` is how many
        pushes the batch stands for (statistics)."""
        g, r = self._prepare(grads, index)
        self._apply(g, r, pushes=0 if continues else max(1, int(pushes)),
                    new_step=not continues)

    def _apply_shard(self, shard: int, rows: np.ndarray, grads: np.ndarray, pushes: int = 1,
                     continues: bool = False) -> None:
        """The owner's bridge: :meth:`_apply_direct` of a batch whose rows ``rows``
        (int64, global) the caller checked strictly increasing (a BATCH frame:
        Bridge._check_in_shard), ``grads`` ``(n, row_len)``: the C push of sorted rows,
        without the sorting and duplicate work a push of any rows needs, after a check
        that every row lies in ``shard`` (the owner of one shard changes no other).
        Same NaN/Inf rule, step and counts."""
        sh = self._shard_checked(shard)
        n = rows.size
        first = int(shard) * self.shard_rows
        rows = np.ascontiguousarray(rows)   # a frame's rows are: no copy then
        if rows.dtype != np.int64 or (n and (int(rows[0]) < first
                                             or int(rows[-1]) >= first + sh.spec["nrows"])):
            raise OutOfRange(f"rows of {self.name!r} outside shard {shard}")
        g = cast_grad(grads, self.dtype)
        if g.shape[:1] != (n,) or g.size != n * self.row_len:
            raise SchemaError(f"gradient shape {g.shape} for {n} rows of {self.name!r}")
        if self._push_sorted(rows, g, self._check_finite, not continues,
                             0 if continues else max(1, int(pushes))) == lib.SHMPS_UNSORTED:
            raise SchemaError(f"rows of {self.name!r} not increasing")

    def _rows_of(self, shard: int, index: Any) -> tuple[Any, np.ndarray, np.ndarray]:
        """(shard, global rows, local rows) with every row inside ``shard``."""
        sh = self._shard_checked(shard)
        r = check_rows(index, self.nrows)
        local = r - int(shard) * self.shard_rows
        if local.size and (int(local.min()) < 0 or int(local.max()) >= sh.spec["nrows"]):
            raise OutOfRange(f"rows of {self.name!r} outside shard {shard} (rows "
                             f"{int(shard) * self.shard_rows} to "
                             f"{int(shard) * self.shard_rows + sh.spec['nrows'] - 1})")
        return sh, r, local

    @contextmanager
    def _frozen_shared(self, shard: int) -> Iterator[list[np.ndarray]]:
        """``shard``'s values and optimizer state arrays, each ``(nrows, row_len)``, while
        the shard's shared freeze keeps pushes out (each row whole, state and values
        together)."""
        sh = self._shard(int(shard))
        tok = _native.token()
        _native.check(lib.shmps_freeze_shared(sh.ptr, tok, 60.0),
                      f"read rows of {self.name!r} (shard {shard})")
        try:
            arrays = [sh.values(self.dtype)] + [sh.state(k) for k in range(sh.spec["nstate"])]
            yield [a.reshape(sh.spec["nrows"], self.row_len) for a in arrays]
        finally:
            lib.shmps_thaw_shared(sh.ptr, tok)

    def _copy_rows(self, shard: int, r: np.ndarray, local: Optional[np.ndarray]) -> Any:
        from .outbox import RowData
        with self._frozen_shared(shard) as arrays:
            n = arrays[0].shape[0] if local is None else local.size
            out = [(np.array(a) if local is None else a[local]).reshape((n,) + self.row_shape)
                   for a in arrays]
            step = self._step()
        return RowData(index=r, values=out[0], states=out[1:], row_steps=None, step=step)

    def _step(self) -> int:
        """The tensor's step count (kept in shard 0: Adam's t)."""
        st = _native.ffi.new("shmps_stats_t *")
        lib.shmps_stats(self._shard(0).ptr, st)
        return int(st.step)

    def _read_rows_into(self, shard: int, local: np.ndarray, out: list[np.ndarray]) -> int:
        """The owner's bridge: the values, then each optimizer state array, of the
        strictly increasing ``local`` rows (int64) of ``shard``, copied into ``out``
        (``(n, row_len)`` arrays: the frame being built, frames.RowsBuilder) under the
        shard's shared freeze, as :meth:`_read_rows`.  Returns the tensor's step.  The
        caller checked the rows (a BATCH just applied to them); numpy checks them again."""
        with self._frozen_shared(shard) as arrays:
            if len(out) != len(arrays):
                raise SchemaError(f"{len(out)} arrays to read {len(arrays)} into")
            n = local.size
            run = n and int(local[-1]) - int(local[0]) == n - 1   # a contiguous range
            for a, o in zip(arrays, out):
                if run:
                    o[...] = a[int(local[0]):int(local[0]) + n]
                else:
                    np.take(a, local, axis=0, out=o)
            return self._step()

    def _read_rows(self, shard: int, index: Any) -> Any:
        """Rows ``index`` (global, all in ``shard``) with their optimizer state and the
        tensor's step: an ``outbox.RowData``, copied under the shard's shared freeze
        (no push inside meanwhile: each row whole, state and values together)."""
        _, r, local = self._rows_of(shard, index)
        return self._copy_rows(shard, r, local)

    def _snapshot(self, shard: int) -> Any:
        """Every row of ``shard``, as :meth:`_read_rows`."""
        sh = self._shard_checked(shard)
        r0 = int(shard) * self.shard_rows
        return self._copy_rows(shard, np.arange(r0, r0 + sh.spec["nrows"], dtype=np.int64),
                               None)

    def _write_rows(self, shard: int, data: Any) -> None:
        """Write ``data`` (an ``outbox.RowData`` of rows of ``shard``) into this copy:
        absolute values and optimizer state, under the shard's exclusive freeze and
        each stripe's lock (no pull sees a half-written row); the tensor's step is
        raised to ``data.step``.  Never goes through the outbox."""
        sh, r, local = self._rows_of(shard, data.index)
        shape = (r.size,) + self.row_shape
        vals = _as_rows(data.values, self.dtype, shape, "values")
        sdt = _native.DTYPE_NAMES[sh.spec["state_dtype"]]
        if len(data.states) != sh.spec["nstate"]:
            raise SchemaError(f"{len(data.states)} state arrays for {self.name!r}, its "
                              f"optimizer keeps {sh.spec['nstate']}")
        states = [_as_rows(a, np.dtype(sdt), shape, "state") for a in data.states]
        code = lib.shmps_dense_write_rows(sh.ptr, _native.token(), _native.addr(local),
                                          local.size, _native.ffi.from_buffer(vals),
                                          _native.addrs(states), len(states))
        if code:
            _native.check(code, f"write rows of {self.name!r} (shard {shard})")
        # (also when 0: the copy's stripes no longer count their own steps, dense.c
        # "Stripe steps")
        lib.shmps_raise_step(self._shard(0).ptr, int(data.step))

    # -- pull --------------------------------------------------------------------
    def pull(self, rows: Any = None, *, out: Optional[np.ndarray] = None,
             consistent: bool = True) -> np.ndarray:
        """Copy values out: the whole tensor, or ``rows`` (shape ``(len(rows),)+row shape``).

        ``consistent=True`` (default): each shard is copied while no push is inside
        it, so it reflects a whole number of pushes (pushers wait for the copy, about
        a memcpy of the shard).  ``consistent=False``: each 16 KiB stripe is a
        whole number of pushes (seqlock; with ``rows``, each row's part of a stripe),
        and pushers never wait.  ``out=`` (C
        contiguous, the tensor's dtype and the result's shape) avoids allocating."""
        self._shard(0)  # Closed after close()
        c = int(check_flag(consistent, "consistent"))   # (consistent="no" was True)
        if rows is None:
            want = self.shape
            r = None
        else:
            r = rows_for_c(rows, self.nrows)
            want = (r.size,) + self.row_shape
        if out is None:
            out = np.empty(want, self.dtype)
        elif (not isinstance(out, np.ndarray) or out.shape != want or out.dtype != self.dtype
              or not out.flags.c_contiguous or not out.flags.writeable):
            raise SchemaError(f"out= must be a writable C-contiguous {self.dtype} array of "
                              f"shape {want}",
                              "allocate it with np.empty(shape, dtype)")
        tok = _native.token()
        if r is None and self.nshards == 1:
            code = lib.shmps_dense_pull_all(self._shard(0).ptr, tok,
                                            _native.ffi.from_buffer(out), c)
            if code:
                _native.check(code, f"pull from {self.name!r}")
            return out
        if r is None:
            base = out.ctypes.data
            for i, sh in enumerate(self._shards):
                ptr = _native.ffi.cast("void *", base + self._elem0[i] * self.dtype.itemsize)
                code = lib.shmps_dense_pull(sh.ptr, tok, ptr, 0, sh.spec["nnz"], c)
                if code:
                    _native.check(code, f"pull from {self.name!r}")
            self._count(True, out.nbytes, self.nrows)
            return out
        bases, rp = self._shard_bases(), _native.addr(r)
        code = lib.shmps_dense_pull_rows(bases, self.nshards, self.shard_rows, tok, rp,
                                         _native.ffi.NULL, r.size, _native.addr(out), c)
        if code == lib.SHMPS_UNSORTED:
            # many rows, not in shard order: sorted by shard, each row's place in `out`
            pos = np.argsort(r // self.shard_rows, kind="stable")
            sr = r[pos]
            code = lib.shmps_dense_pull_rows(bases, self.nshards, self.shard_rows, tok,
                                             _native.addr(sr), _native.addr(pos), r.size,
                                             _native.addr(out), c)
        if code == lib.SHMPS_E_BOUNDS:
            check_rows(r, self.nrows)   # raises OutOfRange naming the row
        if code:
            _native.check(code, f"pull from {self.name!r}")
        return out

    def __array__(self, dtype: Any = None, copy: Optional[bool] = None) -> np.ndarray:
        """``np.asarray(w)``: :meth:`pull`, a consistent private copy, in ``dtype`` if
        given.  ``copy=False`` is refused (InvalidArgument, the ValueError numpy raises
        for what it cannot give without a copy): :meth:`view` is the zero-copy array,
        racy by design, not a default to fall into.  (torch reads no ``__array__``:
        torch.as_tensor(w) raises; use ``torch.from_numpy(w.pull())``.)"""
        if copy is False:
            # (InvalidArgument is the ValueError numpy's protocol asks for, and a
            # shmps.Error with its hint, as the README promises)
            raise InvalidArgument(f"{self.name!r}: a shmps tensor's values cannot be "
                                  "given without a copy",
                                  "use w.view() for a zero-copy, racy, read-only array, "
                                  "or w.pull()")
        out = self.pull()
        return out if dtype is None else out.astype(dtype, copy=False)

    def __len__(self) -> int:
        """The first dimension, as for a numpy array (a 0-d tensor has none:
        TypeError, as numpy's)."""
        if not self.shape:
            raise TypeError(f"len() of the 0-d tensor {self.name!r}")
        return int(self.shape[0])

    def __bool__(self) -> bool:
        """True unless the tensor has no rows: without this, bool() falls back on
        __len__, and `if w:` or `w or other` on a 0-d tensor (one value, no first
        dimension) raised len()'s TypeError."""
        return not self.shape or self.shape[0] > 0

    def view(self, writable: bool = False) -> np.ndarray:
        """A zero-copy, read-only numpy array over the live values.

        Racy by design: it changes under you as pushes land (an element may be read
        between two pushes, or mid-push in hogwild mode).  It stays valid after
        ``close()`` until it is garbage-collected; use ``pull()`` for a snapshot.

        ``writable=True`` (used by ``shmps.torch`` for ``param.data``): the same
        memory, read-write.  Danger: a write through it bypasses the stripe locks,
        the updater and the NaN check: it races with pushes (an update can be lost
        or half-overwritten, like plain Hogwild) and every process sees it at once.
        Write only when no push runs (e.g. to initialise), or push instead."""
        if check_flag(writable, "writable"):
            if getattr(self, "_wview", None) is None:
                self._wview = self._map_view(True)
            return self._wview
        if self._view is None:
            self._view = self._map_view()
        return self._view

    def _map_view(self, writable: bool = False) -> np.ndarray:
        self._shard(0)  # Closed after close()
        ffi = _native.ffi
        n = self.nshards
        fds = ffi.new("int[]", n)
        offs = ffi.new("uint64_t[]", n)
        lens = ffi.new("uint64_t[]", n)
        opened = []
        try:
            for i, sh in enumerate(self._shards):
                fd = sh.seg.fd()
                opened.append(fd)
                fds[i] = fd
                offs[i] = sh.spec["value_off"]
                lens[i] = sh.spec["nnz"] * self.dtype.itemsize
            addr = ffi.new("void **")
            total = ffi.new("uint64_t *")
            mapper = lib.shmps_view_map_rw if writable else lib.shmps_view_map
            code = mapper(fds, offs, lens, n, addr, total)
            if code:
                _native.check(code, f"view of {self.name!r} (shard_rows must be a whole "
                                    "number of pages)")
        finally:
            for fd in opened:
                os.close(fd)
        span = int(total[0])
        mapped = ffi.gc(ffi.cast("char *", addr[0]), lambda p: lib.shmps_view_unmap(p, span))
        buf = ffi.buffer(mapped, self.size * self.dtype.itemsize)
        arr = np.frombuffer(buf, dtype=self.dtype).reshape(self.shape)
        arr.flags.writeable = writable
        return arr


def _as_rows(a: Any, dtype: np.dtype, shape: tuple, what: str) -> np.ndarray:
    """``a`` as a C-contiguous array of ``dtype`` and ``shape`` (same_kind casting)."""
    arr = np.asarray(a)
    if arr.shape != shape:
        raise SchemaError(f"{what} of shape {arr.shape}, expected {shape}")
    if arr.dtype != dtype and not np.can_cast(arr.dtype, dtype, "same_kind"):
        raise SchemaError(f"{what} of dtype {arr.dtype} cannot be cast to {dtype}")
    return np.ascontiguousarray(arr, dtype=dtype)
