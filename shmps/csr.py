"""CSR tensors: a matrix with a fixed sparsity structure, sharded by row ranges.

The structure (``rowcnt`` row offsets, ``colidx`` columns, strictly increasing within
each row) is given at creation and never changes; pushes apply the updater to listed
entries of it, under one lock per row, with per-row step counts (native/csr.c).

Sample usage::

    m = store.csr("X", rowcnt, colidx, init=values, optimizer=shmps.Adagrad(lr=0.1))
    m.push(shmps.CSR(rowcnt_g, colidx_g, grad))   # entries must exist in the structure
    c = m.pull()                                   # shmps.CSR(rowcnt, colidx, value)
    s = m.to_scipy()                               # scipy.sparse.csr_matrix
"""
from __future__ import annotations

import hashlib
import threading
from typing import Any, Iterable, Optional

import numpy as np

from . import _native
from .checks import as_array, check_flag
from .errors import CorruptSegment, InvalidArgument, OutOfRange, SchemaError
from .files import CSR
from .tensor import (PushHandle, Tensor, cast_grad, cast_init, check_rows,
                     check_shard_count, grad_dtype)
from .updaters import Updater

lib = _native.lib
ffi = _native.ffi

#: default shard size: about this many bytes of values per shard segment
SHARD_BYTES = 16 << 20


# ---- structure ----------------------------------------------------------------------

def _ints(a: Any, what: str) -> np.ndarray:
    arr = as_array(a, what)
    if arr.ndim != 1:
        raise SchemaError(f"{what} must be a 1-d integer array, got shape {arr.shape}",
                          "pass rowcnt and colidx as 1-d integer arrays (scipy's indptr "
                          "and indices)")
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.dtype.kind not in "iu":
        raise SchemaError(f"{what} of dtype {arr.dtype}: must be integers",
                          "pass rowcnt and colidx as 1-d integer arrays (scipy's indptr "
                          "and indices)")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise OutOfRange(f"{what} holds {int(arr.max())}, beyond int64")
    return np.ascontiguousarray(arr, dtype=np.int64)


def check_rowcnt(rowcnt: Any, nnz: int, what: str = "rowcnt") -> np.ndarray:
    """Row offsets as int64: starting at 0, non-decreasing, ending at ``nnz``."""
    rc = _ints(rowcnt, what)
    if rc.size == 0:
        raise InvalidArgument(f"{what} is empty: it has rows + 1 entries, starting at 0",
                              "pass rows + 1 offsets (scipy's indptr; [0] for no rows)")
    if rc[0] != 0:
        raise InvalidArgument(f"{what}[0] is {int(rc[0])}, not 0",
                              "row offsets start at 0 (scipy's indptr)")
    bad = np.flatnonzero(rc[1:] < rc[:-1])
    if bad.size:
        i = int(bad[0])
        raise InvalidArgument(f"{what} is not monotone: row {i} ends at {int(rc[i + 1])} "
                              f"before it starts at {int(rc[i])}",
                              "rowcnt[i+1] - rowcnt[i] is the entry count of row i (>= 0)")
    if int(rc[-1]) != nnz:
        raise InvalidArgument(f"{what} ends at {int(rc[-1])} but there are {nnz} entries",
                              "rowcnt[-1] must equal len(colidx) == len(value)")
    return rc


def check_colidx(colidx: Any, ncols: Optional[int], what: str = "colidx") -> np.ndarray:
    """Columns as int64 within ``[0, ncols)`` (any bound if ncols is None)."""
    ci = _ints(colidx, what)
    if ci.size:
        lo, hi = int(ci.min()), int(ci.max())
        if lo < 0 or (ncols is not None and hi >= ncols):
            k = int(np.flatnonzero((ci < 0) | ((ci >= ncols) if ncols is not None else False))[0])
            raise OutOfRange(f"{what}[{k}] = {int(ci[k])} is out of range [0, "
                             f"{ncols if ncols is not None else 'inf'})",
                             "columns are 0-based and below the column count")
    return ci


def check_sorted(rc: np.ndarray, ci: np.ndarray) -> None:
    """Columns strictly increasing within each row (no duplicates)."""
    if ci.size < 2:
        return
    step_ok = ci[1:] > ci[:-1]
    starts = np.zeros(ci.size, bool)
    starts[rc[1:-1][rc[1:-1] < ci.size]] = True   # entries that begin a row
    bad = np.flatnonzero(~step_ok & ~starts[1:])
    if bad.size:
        k = int(bad[0]) + 1
        row = int(np.searchsorted(rc, k, side="right")) - 1
        kind = "repeated" if ci[k] == ci[k - 1] else "not increasing"
        raise InvalidArgument(f"row {row}: column {int(ci[k])} at entry {k} follows column "
                              f"{int(ci[k - 1])} ({kind})",
                              "sort each row's columns and merge duplicates "
                              "(scipy: m.sum_duplicates(); m.sort_indices())")


def structure_hash(rc: np.ndarray, ci: np.ndarray) -> str:
    """A digest of the structure, stored in the catalog for get-or-create."""
    return structure_digest((rc.astype("<i8", copy=False).tobytes(),
                             ci.astype("<i8", copy=False).tobytes()))


def structure_digest(pieces: Iterable[bytes]) -> str:
    """The digest of :func:`structure_hash` over the bytes of rowcnt then colidx as
    little-endian int64, given in pieces (a checkpoint's files read back in chunks)."""
    h = hashlib.blake2b(digest_size=16)
    for piece in pieces:
        h.update(piece)
    return h.hexdigest()


def default_shard_rows(nrows: int, nnz: int, itemsize: int) -> int:
    """Rows per shard: about SHARD_BYTES of values per shard on average."""
    if nrows == 0:
        return 1
    per_row = max(1.0, nnz / nrows)
    return int(max(1, min(nrows, (SHARD_BYTES // itemsize) // per_row)))


def shard_specs(rec: dict, upd: Updater, rc: np.ndarray) -> list[dict]:
    """Shard specs of a csr record; ``rc`` is the global rowcnt."""
    dt = np.dtype(rec["dtype"])
    nrows, per = rec["shape"][0], rec["shard_rows"]
    flags = lib.SHMPS_F_ALLOW_NONFINITE if rec.get("allow_nonfinite") else 0
    specs = []
    for s in range(rec["nshards"]):
        r0 = s * per
        r1 = min(nrows, r0 + per)
        specs.append({"kind": lib.SHMPS_CSR, "dtype": _native.DTYPE_CODES[dt.name],
                      "updater": upd.code, "flags": flags, "nrows": r1 - r0, "row_len": 0,
                      "nnz": int(rc[r1] - rc[r0]), "row_begin": r0, "ncols": rec["shape"][1],
                      "seed": 0, "params": upd.params(), "init": []})
    return specs


def as_csr(csr: Any) -> tuple:
    """``shmps.CSR`` or a 3-tuple (rowcnt, colidx, value) or a scipy sparse matrix."""
    if hasattr(csr, "tocsr") and hasattr(csr, "format"):
        c = csr.tocsr()
        return c.indptr, c.indices, c.data
    if isinstance(csr, (tuple, list)) and len(csr) == 3:
        return tuple(csr)
    raise InvalidArgument(f"expected shmps.CSR(rowcnt, colidx, value), got {type(csr).__name__}")


# ---- the tensor ---------------------------------------------------------------------

class CSRTensor(Tensor):
    """A sparse matrix with a fixed structure in shared memory.

    Sample usage::

        m = store.csr("X", rowcnt, colidx, init=1.0, optimizer=shmps.SGD(lr=0.1))
        m.push(shmps.CSR(rc, ci, g))   # a CSR of the same row count; entries must exist
        c = m.pull(rows=[0, 5])       # shmps.CSR of those rows
    """

    kind = "csr"

    def __init__(self, store: Any, record: dict, shards: list) -> None:
        super().__init__(store, record, shards)
        self.shape: tuple = tuple(record["shape"])
        self.nrows, self.ncols = int(self.shape[0]), int(self.shape[1])
        self.nnz: int = int(record["nnz"])
        self.shard_rows: int = int(record["shard_rows"])
        self._gdtype = grad_dtype(self.dtype)
        self._gcode = _native.DTYPE_CODES[self._gdtype.name]
        self._local = threading.local()
        # (rowcnt, colidx), built once: one attribute, so that a thread that sees it
        # sees both (two were set one after the other)
        self._structure: Optional[tuple[np.ndarray, np.ndarray]] = None
        try:
            self._check_shards()
            self._scratch_bytes = max(int(lib.shmps_csr_scratch_bytes(sh.ptr))
                                      for sh in self._shards)
        except BaseException:
            self.close()
            raise

    def _check_shards(self) -> None:
        per, nrows = self.shard_rows, self.nrows
        want_shards = max(1, -(-nrows // per)) if per >= 1 else -1
        if self.nshards != want_shards:
            raise CorruptSegment(f"csr {self.name!r}: {self.nshards} shards, its record needs "
                                 f"{want_shards}")
        total = 0
        for i, sh in enumerate(self._shards):
            rows = max(0, min(per, nrows - i * per))
            want = {"row_begin": i * per, "nrows": rows, "ncols": self.ncols,
                    "updater": self.optimizer.code,
                    "params": _native.params_of(self.optimizer)}
            got = {k: sh.spec[k] for k in want}
            if got != want:
                raise CorruptSegment(f"segment {sh.seg.name} holds {got}, the catalog record "
                                     f"of csr {self.name!r} says {want}")
            total += sh.spec["nnz"]
        if total != self.nnz:
            raise CorruptSegment(f"csr {self.name!r}: shards hold {total} entries, record {self.nnz}")

    def _bounds(self, s: int) -> tuple[int, int]:
        r0 = s * self.shard_rows
        return r0, min(self.nrows, r0 + self.shard_rows)

    # -- structure -------------------------------------------------------------------
    def structure(self) -> tuple[np.ndarray, np.ndarray]:
        """``(rowcnt, colidx)``: read-only int64 arrays, built once per process."""
        built = self._structure
        if built is None:
            self._shard(0)
            rcs, cis, base = [], [], 0
            for sh in self._shards:
                sp = sh.spec
                rc = sh.seg.array(np.int64, sp["rowcnt_off"], sp["nrows"] + 1)
                rcs.append(rc[:-1] + base)
                cis.append(np.array(sh.seg.array(np.int64, sp["colidx_off"], sp["nnz"])))
                base += int(rc[-1])
            rowcnt = np.concatenate(rcs + [np.array([base], np.int64)])
            colidx = np.concatenate(cis) if cis else np.zeros(0, np.int64)
            rowcnt.flags.writeable = False
            colidx.flags.writeable = False
            self._structure = built = (rowcnt, colidx)
        return built

    # -- push ------------------------------------------------------------------------
    def push(self, csr: Any, *, wait: bool = True) -> Optional[PushHandle]:
        """Apply the updater to the entries of ``csr`` (``shmps.CSR(rowcnt, colidx,
        value)`` with this matrix's row count, or a scipy sparse matrix of its shape:
        another shape is a SchemaError naming both, nothing applied).

        Every entry must exist in the structure, else InvalidArgument naming the first
        missing (row, col) and nothing is applied.  Repeated entries accumulate as
        gradients do.  Each pushed row's step advances by one; entries not listed are
        untouched (lazy).  Exact per row.  Cost: O(nnz of the push * log row length),
        one C call per shard, GIL released.  ``wait=False`` returns a PushHandle.

        While shmps-bridge runs (the store's forwarding switch), the push is checked the
        same way and summed into the tensor's outbox; the bridge forwards it to the
        owner of each shard (docs/bridge.md)."""
        wait = check_flag(wait, "wait")   # (wait="no" waited)
        rc, ci, g = self._prepare(csr)
        if self._fwd[0] and self._forwards():
            if wait:
                self._forward(rc, ci, g)
                return None
            return self._store._submit(self._forward, rc, ci, g)
        if wait:
            self._apply(rc, ci, g)
            return None
        return self._store._submit(self._apply, rc, ci, g)

    def _prepare(self, csr: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rowcnt, colidx, value = as_csr(csr)
        # a scipy matrix carries its shape: one of other columns (or rows) is another
        # matrix even when every entry it holds is in the structure (a 4 x 9 matrix was
        # applied to a 4 x 5 tensor); a shmps.CSR has no column count, its columns are
        # checked against this one's below
        shape = getattr(csr, "shape", None) if hasattr(csr, "tocsr") else None
        if shape is not None and tuple(int(n) for n in shape) != self.shape:
            raise SchemaError(f"the pushed matrix has shape {tuple(int(n) for n in shape)}, "
                              f"{self.name!r} has shape {self.shape}; nothing was applied",
                              "push a matrix of the tensor's shape (scipy: shape=x.shape)")
        g = cast_grad(value, self.dtype, "value")
        if g.ndim != 1:
            raise SchemaError(f"value must be 1-d, got shape {g.shape}",
                              "give one value per entry of colidx")
        ci = check_colidx(colidx, self.ncols)
        if ci.size != g.size:
            raise InvalidArgument(f"colidx has {ci.size} entries, value {g.size}",
                                  "give one value per entry of colidx")
        rc = check_rowcnt(rowcnt, g.size)
        if rc.size != self.nrows + 1:
            raise SchemaError(f"the pushed CSR has {rc.size - 1} rows, {self.name!r} has "
                              f"{self.nrows} (shape {self.shape}); nothing was applied",
                              "push a CSR with every row (empty rows are fine)")
        return rc, ci, g

    def _scratch(self) -> tuple[Any, int, Any]:
        loc = self._local
        buf = getattr(loc, "buf", None)
        if buf is None:
            arr = np.empty(self._scratch_bytes, np.uint8)
            loc.buf = buf = (ffi.from_buffer(arr), arr.size, arr)
            loc.bad = ffi.new("uint64_t[3]")
        return buf[0], buf[1], loc.bad

    def _apply(self, rc: np.ndarray, ci: np.ndarray, g: np.ndarray) -> None:
        self._require_finite(g)
        pos, parts = self._locate(rc, ci)
        scratch, nbytes, _ = self._scratch()
        tok = _native.token()
        pg = ffi.from_buffer(g)
        for _, sh, part, n in parts:
            code = lib.shmps_csr_push(sh.ptr, tok, _native.addr(part), n, _native.addr(pos), pg,
                                      self._gcode, scratch, nbytes)
            if code:
                _native.check(code, f"push to {self.name!r}")

    def _locate(self, rc: np.ndarray, ci: np.ndarray) -> tuple[np.ndarray, list]:
        """Each pushed entry's position in its shard (``pos``, local entry indices) and the
        shards touched as ``(shard, Shard, rowcnt slice, rows)``; InvalidArgument naming
        the first entry absent from the structure (nothing changed)."""
        _, _, bad = self._scratch()
        pos = np.empty(ci.size, np.int64)
        pci, ppos = _native.addr(ci), _native.addr(pos)
        parts = []
        for s, sh in enumerate(self._shards):  # locate everything before applying anything
            r0, r1 = self._bounds(s)
            part = rc[r0:r1 + 1]
            if part[0] == part[-1]:
                continue
            code = lib.shmps_csr_locate(sh.ptr, _native.addr(part), r1 - r0, pci, ppos, bad)
            if code == lib.SHMPS_E_NOTFOUND:
                raise InvalidArgument(
                    f"entry (row {r0 + int(bad[0])}, col {int(bad[1])}) (pushed entry "
                    f"{int(bad[2])}) is not in the structure of {self.name!r}; nothing was "
                    "applied", "push only entries the matrix was created with")
            if code:
                _native.check(code, f"push to {self.name!r}")
            parts.append((s, sh, part, r1 - r0))
        return pos, parts

    # -- the bridge's side (shmps/outbox.py; private API) -------------------------
    # Across hosts a csr tensor travels as its entries: "rows" of one value, numbered
    # 0..nnz-1 in structure order (shard s holds entries entry_bounds[s]..[s+1]), with
    # the step of each entry's row.  The outbox is a hidden dense tensor of nshards x
    # outbox_cap values: outbox row s * outbox_cap + k holds local entry k of shard s.
    row_shape: tuple = ()

    @property
    def _entry_bounds(self) -> np.ndarray:
        """Global index of each shard's first entry, and nnz (nshards + 1, int64)."""
        b = getattr(self, "_bounds_cache", None)
        if b is None:   # from the shards' nnz: no copy of the structure
            nnz = [int(self._shard(i).spec["nnz"]) for i in range(self.nshards)]
            b = self._bounds_cache = np.concatenate(([0], np.cumsum(nnz))).astype(np.int64)
        return b

    @property
    def _outbox_cap(self) -> int:
        """Entries of the fullest shard (>= 1): the outbox's rows per shard."""
        cap = getattr(self, "_cap_cache", None)
        if cap is None:
            cap = self._cap_cache = max(1, max(int(sh.spec["nnz"]) for sh in self._shards))
        return cap

    def _forward(self, rc: np.ndarray, ci: np.ndarray, g: np.ndarray) -> None:
        """A validated push while forwarding: NaN/Inf check (this tensor's rule), every
        entry located (an absent one raises, nothing changed), then summed into the
        outbox at its entry's row and counted there."""
        self._require_finite(g)
        pos, parts = self._locate(rc, ci)
        cap = self._outbox_cap
        rows = np.empty(ci.size, np.int64)
        for s, _, part, _ in parts:
            k0, k1 = int(part[0]), int(part[-1])
            rows[k0:k1] = s * cap + pos[k0:k1]
        self._outbox()._push_counted(np.ascontiguousarray(g, dtype=self._gdtype), rows)

    def _outbox_drain(self, shard: int, timeout: Optional[float] = None,
                      into: Any = None) -> Any:
        """Take what the outbox's ``shard`` holds: an ``outbox.Drained`` whose ``index``
        is global entries (sorted) and ``grads`` their summed gradients, or None.  As
        DenseTensor._outbox_drain."""
        from . import outbox
        first = int(self._entry_bounds[self._shard_index(shard)])
        return outbox.drain_dense(self, shard, timeout, into, first=first)

    def _shard_index(self, shard: Any) -> int:
        self._shard_checked(shard)
        return int(shard)

    def _entry_rows(self, entries: np.ndarray) -> np.ndarray:
        """The matrix row of each global entry (int64, non-decreasing for sorted
        ``entries``), from the structure."""
        return np.searchsorted(self.structure()[0], entries, side="right") - 1

    def _local_entries(self, shard: int, index: Any) -> np.ndarray:
        """Global entries ``index`` as local entries of ``shard``, strictly increasing,
        else InvalidArgument / OutOfRange."""
        from .errors import OutOfRange
        s = self._shard_index(shard)
        e = np.ascontiguousarray(np.asarray(index), dtype=np.int64).reshape(-1)
        if e.size > 1 and not bool(np.all(e[1:] > e[:-1])):
            raise InvalidArgument("entries must be strictly increasing")
        b = self._entry_bounds
        if e.size and (int(e[0]) < int(b[s]) or int(e[-1]) >= int(b[s + 1])):
            raise OutOfRange(f"entries of {self.name!r} outside shard {s} (entries "
                             f"{int(b[s])} to {int(b[s + 1]) - 1})")
        return e - int(b[s])

    def _apply_direct(self, index: Any, grads: Any, pushes: int = 1,
                      continues: bool = False) -> None:
        """The owner's bridge: apply ``grads`` (one value per entry) to the global
        entries ``index`` (strictly increasing, all in one shard) as one push: each row
        they touch steps once.  NaN/Inf and the entries are checked before anything
        changes; ``pushes``: how many pushes the batch stands for (statistics), counted
        unless ``continues`` (more entries of the batch the previous call began, cut
        between rows: :meth:`_entry_rows`)."""
        e = np.ascontiguousarray(np.asarray(index), dtype=np.int64).reshape(-1)
        if e.size == 0:
            return
        s = int(np.searchsorted(self._entry_bounds, e[0], side="right")) - 1
        if not 0 <= s < self.nshards:
            from .errors import OutOfRange
            raise OutOfRange(f"entry {int(e[0])} of {self.name!r} out of range [0, {self.nnz})")
        local = self._local_entries(s, e)
        g = cast_grad(np.asarray(grads).reshape(-1), self.dtype, "grads")
        if g.size != local.size:
            raise InvalidArgument(f"{g.size} gradient values for {local.size} entries")
        g = np.ascontiguousarray(g, dtype=self._gdtype)
        self._require_finite(g)
        sh = self._shard(s)
        nrows = int(sh.spec["nrows"])
        rc = sh.seg.array(np.int64, sh.spec["rowcnt_off"], nrows + 1)
        # where each row's entries start among ``local`` (strictly increasing): the
        # entries before the row's first
        part = np.searchsorted(local, rc).astype(np.int64, copy=False)
        scratch, nbytes, _ = self._scratch()
        code = lib.shmps_csr_push(sh.ptr, _native.token(), _native.addr(part), nrows,
                                  _native.addr(local), ffi.from_buffer(g), self._gcode,
                                  scratch, nbytes)
        if code:
            _native.check(code, f"push to {self.name!r}")
        self._count_batch(pushes, continues)

    def _state_arrays(self, s: int, n: int) -> list:
        sp = self._shard(s).spec
        sdt = _native.DTYPE_NAMES[sp["state_dtype"]]
        return [np.empty(n, sdt) for _ in range(sp["nstate"])]

    def _read_rows(self, shard: int, index: Any) -> Any:
        """Global entries ``index`` (strictly increasing, in ``shard``) with their values,
        optimizer state and the step of each one's row: an ``outbox.RowData`` (values
        ``(n,)``), copied under the shard's shared freeze."""
        from .outbox import RowData
        local = self._local_entries(shard, index)
        s = int(shard)
        n = local.size
        vals = np.empty(n, self.dtype)
        states = self._state_arrays(s, n)
        steps = np.empty(n, np.uint64)
        code = lib.shmps_csr_read_entries(self._shard(s).ptr, _native.token(),
                                          _native.addr(local), n, ffi.from_buffer(vals),
                                          _native.addrs(states), len(states),
                                          _native.addr(steps))
        if code:
            _native.check(code, f"read entries of {self.name!r} (shard {s})")
        return RowData(index=local + int(self._entry_bounds[s]), values=vals, states=states,
                       row_steps=steps, step=0)

    def _snapshot(self, shard: int) -> Any:
        """Every entry of ``shard``, as :meth:`_read_rows`."""
        b = self._entry_bounds
        s = self._shard_index(shard)
        return self._read_rows(s, np.arange(int(b[s]), int(b[s + 1]), dtype=np.int64))

    def _write_rows(self, shard: int, data: Any) -> None:
        """Write ``data`` (an ``outbox.RowData`` of entries of ``shard``) into this copy:
        absolute values, optimizer state and (``row_steps`` not None) each entry's row
        step, under the shard's exclusive freeze and each row's lock.  Never goes
        through the outbox."""
        from .dense import _as_rows
        local = self._local_entries(shard, data.index)
        s, n = int(shard), local.size
        vals = _as_rows(np.asarray(data.values).reshape(-1), self.dtype, (n,), "values")
        sp = self._shard(s).spec
        sdt = np.dtype(_native.DTYPE_NAMES[sp["state_dtype"]])
        if len(data.states) != sp["nstate"]:
            raise SchemaError(f"{len(data.states)} state arrays for {self.name!r}, its "
                              f"optimizer keeps {sp['nstate']}")
        states = [_as_rows(np.asarray(a).reshape(-1), sdt, (n,), "state") for a in data.states]
        steps = None
        if data.row_steps is not None:
            steps = _as_rows(data.row_steps, np.dtype(np.uint64), (n,), "row_steps")
        code = lib.shmps_csr_write_entries(self._shard(s).ptr, _native.token(),
                                           _native.addr(local), n, ffi.from_buffer(vals),
                                           _native.addrs(states), len(states),
                                           _native.addr(steps) if steps is not None
                                           else ffi.NULL)
        if code:
            _native.check(code, f"write entries of {self.name!r} (shard {s})")

    # -- pull ------------------------------------------------------------------------
    def pull(self, rows: Any = None, *, consistent: bool = True) -> CSR:
        """The matrix (or ``rows``, in the order given) as ``shmps.CSR(rowcnt, colidx,
        value)``; ``value`` is a private copy.  For the whole matrix ``rowcnt`` and
        ``colidx`` are the shared read-only structure arrays.  ``consistent=True``: each
        shard is copied while no push is inside it (a whole number of pushes per shard);
        False: each row is a whole number of pushes and pushers never wait."""
        c = int(check_flag(consistent, "consistent"))   # (consistent="no" was True)
        grc, gci = self.structure()
        tok = _native.token()
        if rows is None:
            out = np.empty(self.nnz, self.dtype)
            for s, sh in enumerate(self._shards):
                e0 = int(grc[self._bounds(s)[0]])
                ptr = ffi.cast("void *", out.ctypes.data + e0 * self.dtype.itemsize)
                code = lib.shmps_csr_pull(sh.ptr, tok, ffi.NULL, 0, ptr, c)
                if code:
                    _native.check(code, f"pull from {self.name!r}")
            return CSR(grc, gci, out)
        r = check_rows(rows, self.nrows)
        lens = grc[r + 1] - grc[r]
        rowcnt = np.zeros(r.size + 1, np.int64)
        np.cumsum(lens, out=rowcnt[1:])
        total = int(rowcnt[-1])
        starts = np.repeat(grc[r] - rowcnt[:-1], lens)
        colidx = gci[starts + np.arange(total)] if total else np.zeros(0, np.int64)
        out = np.empty(total, self.dtype)
        sid = r // self.shard_rows
        for s in np.unique(sid):
            s = int(s)
            sel = np.flatnonzero(sid == s)
            local = np.ascontiguousarray(r[sel] - s * self.shard_rows)
            if self.nshards == 1:
                buf = out
            else:
                buf = np.empty(int(lens[sel].sum()), self.dtype)
            code = lib.shmps_csr_pull(self._shards[s].ptr, tok, _native.addr(local), local.size,
                                      ffi.from_buffer(buf), c)
            if code:
                _native.check(code, f"pull from {self.name!r}")
            if buf is not out:
                dst = np.repeat(rowcnt[sel] - np.concatenate(([0], np.cumsum(lens[sel])[:-1])),
                                lens[sel]) + np.arange(buf.size)
                out[dst] = buf
        return CSR(rowcnt, colidx, out)

    def to_scipy(self, consistent: bool = True) -> Any:
        """The matrix as a ``scipy.sparse.csr_matrix`` of shape ``self.shape`` (needs
        scipy).  A copy of the values; the structure arrays are shared read-only."""
        c = self.pull(consistent=consistent)
        from .files import _scipy_sparse
        return _scipy_sparse().csr_matrix((c.value, c.colidx, c.rowcnt), shape=self.shape)

    def describe(self) -> dict:
        d = super().describe()
        d["nnz"] = self.nnz
        return d

    def __repr__(self) -> str:
        return (f"<shmps.CSRTensor {self.name!r} {self.dtype.name} {self.shape} nnz={self.nnz} "
                f"{type(self.optimizer).__name__}>")


def create_record(name: str, req: dict, rc: Optional[np.ndarray], ci: Optional[np.ndarray],
                  shard_rows: Optional[int]) -> dict:
    """The catalog record of a new csr tensor (arguments already validated)."""
    from .errors import NotFound
    from .updaters import as_updater, from_dict

    if rc is None or ci is None:
        raise NotFound(f"no csr tensor {name!r}", "pass rowcnt= and colidx= to create it")
    dt = np.dtype(req.get("dtype", "float32"))
    upd = from_dict(req["optimizer"]) if "optimizer" in req else as_updater(None)
    if upd.float_only and dt.kind != "f":
        raise SchemaError(f"optimizer {type(upd).__name__} needs a float dtype, not {dt}",
                          "use Sum/Assign/Max/Min for integer tensors")
    nrows = rc.size - 1
    shape = req.get("shape") or [nrows, int(ci.max()) + 1 if ci.size else 0]
    per = shard_rows or default_shard_rows(nrows, ci.size, dt.itemsize)
    per = max(1, min(per, max(nrows, 1)))
    nshards = check_shard_count(f"csr tensor {name!r}", nrows, per)
    return {"name": name, "kind": "csr", "dtype": dt.name, "shape": list(shape),
            "nnz": int(ci.size), "shard_rows": per, "nshards": nshards,
            "optimizer": upd.to_dict(), "mode": "exact",
            "allow_nonfinite": bool(req.get("allow_nonfinite", False)),
            "structure": req["structure"]}


def init_values(init: Any, nnz: int, dt: np.dtype, allow_nonfinite: bool = False) -> Any:
    """A scalar, or an array of ``nnz`` values, as ``dt``: checked value by value as a
    dense init is (tensor.cast_init)."""
    a = cast_init(init, dt, allow_nonfinite)
    if a.ndim == 0:
        return a[()]
    if a.shape != (nnz,):
        raise SchemaError(f"init values of shape {a.shape}, the structure has {nnz} entries",
                          "pass one value per entry, in colidx order, or a scalar")
    return a
