"""Binary matrix file sets: ``name.rowcnt``, ``name.colidx``, ``name.value`` (+ ``name.meta``).

The row-major sparse layout of the original parameter server, little-endian, no header:

* ``name.rowcnt``: row offsets, ``rows + 1`` integers (int64 by default, or int32), the
  first 0, never decreasing, the last equal to the number of values;
* ``name.colidx``: the column of each value (int32 by default, or int64);
* ``name.value``: the values (float32 by default; int8, int32, float16, float64);
* ``name.meta`` (optional): JSON ``{"version": 1, "kind": "csr", "rows": R, "cols": C,
  "nnz": N, "dtypes": {"rowcnt": ..., "colidx": ..., "value": ...}, ...}``; unknown keys
  (a checkpoint's ``"optimizer"``, ``"state"``, ...) are kept.

Without a ``.meta`` the dtypes are inferred from the file sizes and rowcnt's first and last
entries (see docs/file-format.md); every inference is recorded with its reason in
:attr:`MatrixSet.inferred`.  Arrays are read through ``np.memmap``: nothing is loaded
whole unless ``mmap=False``; validation walks the files in chunks of :data:`CHUNK`
elements, so it needs O(CHUNK) memory whatever the file size.

Every defect raises :class:`shmps.errors.CorruptFile` (a missing file raises
:class:`shmps.errors.NotFound`) with a one-line message naming the file, the position
and what is wrong.  This module does not import the native core.
"""
from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from .errors import CorruptFile, InvalidArgument, NotFound

FORMAT_VERSION = 1
ARRAYS: tuple[str, str, str] = ("rowcnt", "colidx", "value")
INDEX_DTYPES: tuple[str, ...] = ("int32", "int64")
VALUE_DTYPES: tuple[str, ...] = ("int8", "int32", "float16", "float32", "float64")
DEFAULT_DTYPES: dict[str, str] = {"rowcnt": "int64", "colidx": "int32", "value": "float32"}
#: Meta keys computed by :func:`write_csr`; a caller's ``meta`` may repeat them only
#: with the same value.
RESERVED_META_KEYS: tuple[str, ...] = ("version", "kind", "rows", "cols", "nnz", "dtypes")
#: Elements per chunk of every streaming pass (validation, copying, writing).
CHUNK = 1 << 22

_SET_HINT = ("a file set is PREFIX.rowcnt, PREFIX.colidx and PREFIX.value, "
             "plus an optional PREFIX.meta")
_META_HINT = "fix or delete the .meta file; the --*-dtype and --cols flags override it"
_WRITE_HINT = ("rowcnt: rows+1 non-decreasing offsets from 0 to nnz; colidx and value: "
               "nnz entries each; 0 <= colidx < cols")


def _le(dtype: str | np.dtype) -> np.dtype:
    """The little-endian numpy dtype of a dtype name (the on-disk byte order)."""
    return np.dtype(dtype).newbyteorder("<")


class CSR(NamedTuple):
    """A row-major sparse matrix: ``rowcnt`` (row offsets), ``colidx``, ``value``.

    There is no shape: ``rows`` is ``len(rowcnt) - 1`` and the column count travels
    separately (a :class:`MatrixSet`, a ``.meta`` or the caller), because the structure
    alone only bounds it from below (:meth:`min_cols`).
    """

    rowcnt: np.ndarray
    colidx: np.ndarray
    value: np.ndarray

    @property
    def rows(self) -> int:
        """Number of rows, ``len(rowcnt) - 1``.  O(1)."""
        return max(len(self.rowcnt) - 1, 0)

    @property
    def nnz(self) -> int:
        """Number of stored entries (explicit zeros included).  O(1)."""
        return len(self.value)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """``(colidx, value)`` views of row ``i`` (no copy).  O(1)."""
        if not 0 <= i < self.rows:
            raise InvalidArgument(f"row {i} is out of range [0, {self.rows})")
        a, b = int(self.rowcnt[i]), int(self.rowcnt[i + 1])
        return self.colidx[a:b], self.value[a:b]

    def row_nnz(self) -> np.ndarray:
        """Entries per row as int64, ``np.diff(rowcnt)``.  O(rows) time and memory."""
        return np.diff(np.asarray(self.rowcnt, dtype=np.int64))

    def min_cols(self) -> int:
        """Largest column index + 1 (0 without entries).  One chunked pass over colidx."""
        best = -1
        for s in range(0, len(self.colidx), CHUNK):
            best = max(best, int(np.max(self.colidx[s:s + CHUNK])))
        return best + 1

    def to_dense(self, cols: int | None = None) -> np.ndarray:
        """A dense ``rows x cols`` array; duplicate entries are summed (as scipy does).

        O(rows * cols) memory; ``cols`` defaults to :meth:`min_cols`.
        """
        ncols = self.min_cols() if cols is None else int(cols)
        out = np.zeros((self.rows, ncols), dtype=self.value.dtype)
        rows = np.repeat(np.arange(self.rows), self.row_nnz())
        np.add.at(out, (rows, np.asarray(self.colidx)), np.asarray(self.value))
        return out

    @classmethod
    def from_dense(cls, a: np.ndarray, *, keep_zeros: bool = False,
                   rowcnt_dtype: str = "int64", colidx_dtype: str | None = None) -> CSR:
        """The CSR of a 2-d array: its nonzeros (NaN counts as nonzero), or every entry
        with ``keep_zeros``.  O(rows * cols) time, O(nnz) memory for the result."""
        arr = np.asarray(a)
        if arr.ndim != 2:
            raise InvalidArgument(f"from_dense needs a 2-d array, got {arr.ndim}-d")
        rows, cols = arr.shape
        cdt = colidx_dtype or ("int32" if cols <= np.iinfo(np.int32).max else "int64")
        if keep_zeros:
            counts = np.full(rows, cols, dtype=np.int64)
            colidx = np.tile(np.arange(cols, dtype=cdt), rows)
            value = arr.reshape(-1).copy()
        else:
            mask = arr != 0
            counts = mask.sum(axis=1, dtype=np.int64)
            colidx = np.nonzero(mask)[1].astype(cdt)
            value = arr[mask]
        rowcnt = np.zeros(rows + 1, dtype=rowcnt_dtype)
        np.cumsum(counts, out=rowcnt[1:])
        return cls(rowcnt, colidx, value)

    @classmethod
    def from_scipy(cls, m: Any) -> CSR:
        """The structure of any scipy sparse matrix/array (converted to CSR, duplicates
        and explicit zeros kept; no copy when it already is CSR).  O(nnz) at most."""
        c = m.tocsr() if m.format != "csr" else m
        return cls(c.indptr, c.indices, c.data)

    def to_scipy(self, cols: int | None = None) -> Any:
        """A ``scipy.sparse.csr_matrix`` sharing these arrays where scipy allows.
        Needs scipy (imported here, lazily).  O(1) to O(nnz)."""
        sparse = _scipy_sparse()
        ncols = self.min_cols() if cols is None else int(cols)
        return sparse.csr_matrix((self.value, self.colidx, self.rowcnt),
                                 shape=(self.rows, ncols))


@dataclass
class MatrixSet:
    """A matrix file set as read (or as about to be written).

    ``dtypes`` maps each array to its dtype name; ``sources`` says where each of
    ``rowcnt``, ``colidx``, ``value`` and ``cols`` came from (``"argument"``, ``"meta"``,
    ``"inferred"``, or ``"array"`` for in-memory arrays and the cols their owner gave);
    ``inferred`` holds, for the inferred ones only, why.
    ``meta`` is the parsed ``.meta`` (``{}`` without one), unknown keys included.
    """

    csr: CSR
    rows: int
    cols: int
    dtypes: dict[str, str]
    inferred: dict[str, str] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    prefix: str | None = None
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def nnz(self) -> int:
        """Number of stored entries.  O(1)."""
        return self.csr.nnz

    @classmethod
    def from_csr(cls, csr: CSR | Sequence[np.ndarray], *, cols: int | None = None,
                 meta: Mapping[str, Any] | None = None) -> MatrixSet:
        """Validate in-memory arrays and describe them (used by ``dump --store``).

        Raises :class:`InvalidArgument` naming the array and position of a defect.
        Cost: one chunked pass over rowcnt and colidx.
        """
        c = CSR(*(np.asarray(x) for x in csr))
        for name, arr in zip(ARRAYS, c):
            if arr.ndim != 1:
                raise InvalidArgument(f"{name}: must be 1-d, got shape {arr.shape}")
        ncols, how = _check_structure(
            c, cols=cols, names={k: k for k in ARRAYS}, exc=InvalidArgument,
            cols_note="as given" if cols is not None else "", full=True)
        sources = {k: "array" for k in ARRAYS}
        sources["cols"] = "array" if cols is not None else "inferred"
        inferred = {} if cols is not None else {"cols": how}
        return cls(c, c.rows, ncols, {k: np.dtype(a.dtype).name for k, a in zip(ARRAYS, c)},
                   inferred, dict(meta or {}), None, sources)


def paths(prefix: str | os.PathLike[str]) -> dict[str, str]:
    """The four paths of a file set: ``{"rowcnt", "colidx", "value", "meta"}``.  O(1)."""
    p = os.fspath(prefix)
    return {k: f"{p}.{k}" for k in (*ARRAYS, "meta")}


def normalize_prefix(prefix: str | os.PathLike[str]) -> str:
    """Accept ``X`` or the path of one member (``X.rowcnt``, ``X.meta``, ...) and return
    ``X``.  O(1) stat calls."""
    p = os.fspath(prefix)
    if not os.path.exists(f"{p}.rowcnt"):
        for ext in (*ARRAYS, "meta"):
            if p.endswith("." + ext) and os.path.exists(p):
                return p[: -len(ext) - 1]
    return p


# ----------------------------------------------------------------------------- reading


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse and sanity-check a ``.meta`` file (keys of known meaning only; unknown keys
    are kept).  Raises :class:`CorruptFile` naming the file and the field.  O(size)."""
    p = os.fspath(path)
    try:
        with open(p, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        raise NotFound(f"missing file {p}", hint=_SET_HINT) from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CorruptFile(f"{p}: unparsable JSON at line {exc.lineno} column {exc.colno}: "
                          f"{exc.msg}", hint=_META_HINT) from None
    except UnicodeDecodeError as exc:
        raise CorruptFile(f"{p}: unparsable JSON: not UTF-8 text at byte {exc.start}",
                          hint=_META_HINT) from None
    if not isinstance(meta, dict):
        raise CorruptFile(f"{p}: expected a JSON object, found {type(meta).__name__}",
                          hint=_META_HINT)

    def bad(fieldname: str, why: str) -> CorruptFile:
        return CorruptFile(f'{p}: field "{fieldname}" = {json.dumps(meta_get(fieldname))} '
                           f"{why}", hint=_META_HINT)

    def meta_get(fieldname: str) -> Any:
        obj: Any = meta
        for part in fieldname.split("."):
            obj = obj.get(part) if isinstance(obj, dict) else None
        return obj

    if "version" in meta and (not _is_int(meta["version"]) or meta["version"] < 1):
        raise bad("version", "is not a format version (a positive integer)")
    if "version" in meta and meta["version"] > FORMAT_VERSION:
        raise bad("version", f"is newer than this reader (version {FORMAT_VERSION}); "
                             "upgrade shmps")
    if "kind" in meta and meta["kind"] != "csr":
        raise bad("kind", 'is not "csr": only csr file sets are matrices')
    for key in ("rows", "cols", "nnz"):
        if key in meta and (not _is_int(meta[key]) or meta[key] < 0):
            raise bad(key, "is not a non-negative integer")
    dtypes = meta.get("dtypes", {})
    if not isinstance(dtypes, dict):
        raise bad("dtypes", "is not an object of dtype names")
    for key, allowed in (("rowcnt", INDEX_DTYPES), ("colidx", INDEX_DTYPES),
                         ("value", VALUE_DTYPES)):
        if key in dtypes and dtypes[key] not in allowed:
            raise bad(f"dtypes.{key}", f"is not one of {', '.join(allowed)}")
    return meta


def _n(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _open_array(path: str, dtype: str, size: int, mmap: bool) -> np.ndarray:
    """``size // itemsize`` elements of ``path``: a read-only memmap, or a private copy
    with ``mmap=False``; an empty array for a 0-byte file (np.memmap cannot map 0 bytes)."""
    dt = _le(dtype)
    n = size // dt.itemsize
    if n == 0:
        return np.empty(0, dtype=dt)
    if mmap:
        return np.memmap(path, dtype=dt, mode="r", shape=(n,))
    return np.fromfile(path, dtype=dt, count=n)


def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


def _truncated(path: str, size: int, dtypes: Sequence[str], note: str) -> CorruptFile:
    which = " or ".join(f"the {d} itemsize {_itemsize(d)} (partial entry at position "
                        f"{size // _itemsize(d)})" for d in dtypes)
    return CorruptFile(f"{path}: truncated: size {size} bytes is not a multiple of {which}"
                       f" ({note})")


def _count_fits(size: int, options: Sequence[str], target: int) -> bool:
    return any(size % _itemsize(d) == 0 and size // _itemsize(d) == target for d in options)


def _first_decrease(a: np.ndarray, chunk: int = CHUNK) -> int | None:
    """First ``i`` with ``a[i + 1] < a[i]``, or None.  Chunked, O(chunk) memory."""
    n = len(a)
    for s in range(0, max(n - 1, 0), chunk):
        seg = np.asarray(a[s:min(s + chunk + 1, n)])
        bad = np.flatnonzero(seg[1:] < seg[:-1])
        if bad.size:
            return s + int(bad[0])
    return None


def _scan_columns(c: np.ndarray, cols: int | None, chunk: int = CHUNK
                  ) -> tuple[int, int | None]:
    """``(max column, first bad position)``: bad is < 0, or >= cols when cols is given.
    Chunked, O(chunk) memory; stops at the first bad chunk."""
    best = -1
    for s in range(0, len(c), chunk):
        seg = np.asarray(c[s:s + chunk])
        lo, hi = int(seg.min()), int(seg.max())
        if lo < 0 or (cols is not None and hi >= cols):
            badmask = seg < 0 if cols is None else (seg < 0) | (seg >= cols)
            return max(best, hi), s + int(np.flatnonzero(badmask)[0])
        best = max(best, hi)
    return best, None


def _check_structure(c: CSR, *, cols: int | None, names: Mapping[str, str],
                     exc: type[Exception], cols_note: str, full: bool,
                     chunk: int = CHUNK) -> tuple[int, str]:
    """Check the CSR invariants; return ``(cols, how cols was found)``.

    Cheap checks (O(1)): rowcnt non-empty, starts at 0, colidx and value of equal
    length, rowcnt[-1] == nnz.  With ``full``: rowcnt non-decreasing and every column in
    [0, cols), one chunked pass each.  Without ``full`` and without ``cols`` the column
    pass still runs (to find cols).  Raises ``exc`` with ``names`` in the message.
    """
    rn, cn, vn = names["rowcnt"], names["colidx"], names["value"]
    rowcnt, colidx, value = c
    if len(rowcnt) == 0:
        raise exc(f"{rn}: position 0: rowcnt is empty; it needs rows + 1 >= 1 entries "
                  "(a 0 x 0 matrix has rowcnt [0])")
    first = int(rowcnt[0])
    if first != 0:
        raise exc(f"{rn}: position 0: rowcnt starts at {first}, must start at 0")
    nc, nv = len(colidx), len(value)
    if nc < nv:
        raise exc(f"{cn}: position {nc}: colidx ends after {nc} entries but {vn} holds "
                  f"{nv} values (colidx and value must have equal length)")
    if nv < nc:
        raise exc(f"{vn}: position {nv}: value ends after {nv} entries but {cn} holds "
                  f"{nc} column indices (colidx and value must have equal length)")
    rows = len(rowcnt) - 1
    last = int(rowcnt[-1])
    if last != nv:
        raise exc(f"{rn}: position {rows}: last rowcnt entry is {last} but {vn} holds "
                  f"{nv} values (rowcnt[-1] must equal the number of values)")
    if full:
        i = _first_decrease(rowcnt, chunk)
        if i is not None:
            raise exc(f"{rn}: position {i}: rowcnt[{i + 1}] = {int(rowcnt[i + 1])} is less "
                      f"than rowcnt[{i}] = {int(rowcnt[i])} (offsets must not decrease)")
    if cols is None or full:
        top, bad = _scan_columns(colidx, cols, chunk)
        if bad is not None:
            v = int(colidx[bad])
            if cols is None:
                raise exc(f"{cn}: position {bad}: column {v} is negative")
            raise exc(f"{cn}: position {bad}: column {v} is out of range [0, {cols}) "
                      f"(cols = {cols} {cols_note})")
        if cols is None:
            how = (f"{top + 1} = largest column index {top} + 1" if top >= 0
                   else "0 (no entries)")
            return top + 1, how
    return int(cols), cols_note  # type: ignore[arg-type]


def read_csr(prefix: str | os.PathLike[str], *, rowcnt_dtype: str | None = None,
             colidx_dtype: str | None = None, value_dtype: str | None = None,
             cols: int | None = None, mmap: bool = True, check: bool = True) -> MatrixSet:
    """Read the file set ``prefix.{rowcnt,colidx,value}`` (and ``prefix.meta`` if any).

    Dtypes come from the arguments, else the ``.meta``, else inference from the file
    sizes (docs/file-format.md, "Inference"); ``cols`` likewise, else largest column + 1.
    ``prefix`` may also name one member file (``X.rowcnt``).

    Cost: O(1) memory beyond the maps (``mmap=True``, read-only memmaps) or the whole set
    (``mmap=False``); with ``check`` (default) one chunked pass over rowcnt (non-decreasing)
    and colidx (range); without it only the O(1) checks, plus the colidx pass when cols
    must be inferred.  Raises :class:`NotFound` for a missing file and
    :class:`CorruptFile` for anything wrong, naming file, position and defect.
    """
    prefix = normalize_prefix(prefix)
    p = paths(prefix)
    given = {"rowcnt": rowcnt_dtype, "colidx": colidx_dtype, "value": value_dtype}
    for k, allowed in (("rowcnt", INDEX_DTYPES), ("colidx", INDEX_DTYPES),
                       ("value", VALUE_DTYPES)):
        if given[k] is not None and given[k] not in allowed:
            raise InvalidArgument(f"{k} dtype {given[k]!r} is not one of {', '.join(allowed)}")
    if cols is not None and (not _is_int(cols) or cols < 0):
        raise InvalidArgument(f"cols must be a non-negative integer, got {cols!r}")

    missing = [p[k] for k in ARRAYS if not os.path.exists(p[k])]
    if missing:
        raise NotFound(f"missing file {', '.join(missing)}", hint=_SET_HINT)
    sizes: dict[str, int] = {}
    for k in ARRAYS:
        if not os.path.isfile(p[k]):
            raise CorruptFile(f"{p[k]}: not a regular file", hint=_SET_HINT)
        sizes[k] = os.path.getsize(p[k])
    meta = read_meta(p["meta"]) if os.path.exists(p["meta"]) else {}
    meta_dtypes: dict[str, str] = meta.get("dtypes", {}) if meta else {}

    dtypes: dict[str, str] = {}
    sources: dict[str, str] = {}
    notes: dict[str, str] = {}
    inferred: dict[str, str] = {}
    for k in ARRAYS:
        if given[k] is not None:
            dtypes[k], sources[k] = str(given[k]), "argument"
            notes[k] = f"{k} dtype {given[k]} as given"
        elif k in meta_dtypes:
            dtypes[k], sources[k] = meta_dtypes[k], "meta"
            notes[k] = f"{k} dtype {meta_dtypes[k]} from {p['meta']}"
    options: dict[str, tuple[str, ...]] = {"rowcnt": ("int64", "int32"),
                                           "colidx": ("int32", "int64"),
                                           "value": ("float32", "float64")}
    for k in ARRAYS:
        if k in dtypes:
            options[k] = (dtypes[k],)

    # rowcnt: the candidate dtype whose size divides, first entry is 0 and last entry
    # matches the colidx/value counts; ties broken by monotonicity, then int64.
    rsize = sizes["rowcnt"]
    if rsize == 0:
        raise CorruptFile(f"{p['rowcnt']}: position 0: empty file; rowcnt needs rows + 1 >= 1 "
                          "entries (a 0 x 0 matrix has rowcnt [0])")
    if "rowcnt" not in dtypes:
        cands: list[tuple[int, str, np.ndarray, int]] = []
        for d in options["rowcnt"]:
            if rsize % _itemsize(d):
                continue
            a = _open_array(p["rowcnt"], d, rsize, True)
            first, last = int(a[0]), int(a[-1])
            counts_fit = (_count_fits(sizes["colidx"], options["colidx"], last)
                          and _count_fits(sizes["value"], options["value"], last))
            cands.append((int(first == 0) + int(counts_fit), d, a, last))
        if not cands:
            raise _truncated(p["rowcnt"], rsize, options["rowcnt"],
                             "rowcnt dtype inferred; pass --rowcnt-dtype")
        top = max(c[0] for c in cands)
        best = [c for c in cands if c[0] == top]
        if top == 2 and len(best) > 1:
            mono = [c for c in best if _first_decrease(c[2]) is None]
            best = mono or best
        chosen = best[0]
        d = chosen[1]
        n = rsize // _itemsize(d)
        why = (f"{d}: {rsize} bytes = {_n(n, 'entry', 'entries')}, starting at 0 and ending "
               f"at {chosen[3]}"
               f" = the number of values" if top == 2 else
               f"{d}: no candidate dtype gives offsets from 0 to the number of values; "
               f"read as {d}")
        if len(best) > 1:
            alt = best[1][1]
            why += (f"; ambiguous: {alt} fits too "
                    f"({_n(rsize // _itemsize(alt) - 1, 'row', 'rows')}), "
                    f"pass --rowcnt-dtype {alt} if that is meant")
        dtypes["rowcnt"], sources["rowcnt"], inferred["rowcnt"] = d, "inferred", why
        notes["rowcnt"] = f"rowcnt dtype {d} inferred; pass --rowcnt-dtype to override"
    elif rsize % _itemsize(dtypes["rowcnt"]):
        raise _truncated(p["rowcnt"], rsize, (dtypes["rowcnt"],), notes["rowcnt"])
    rowcnt = _open_array(p["rowcnt"], dtypes["rowcnt"], rsize, mmap)
    target = int(rowcnt[-1])

    for k in ("colidx", "value"):
        size = sizes[k]
        if k in dtypes:
            if size % _itemsize(dtypes[k]):
                raise _truncated(p[k], size, (dtypes[k],), notes[k])
            continue
        dividing = [d for d in options[k] if size % _itemsize(d) == 0]
        if not dividing:
            extra = ", e.g. for int8/int32/float16 values" if k == "value" else ""
            raise _truncated(p[k], size, options[k],
                             f"{k} dtype inferred; pass --{k}-dtype{extra}")
        matching = [d for d in dividing if size // _itemsize(d) == target]
        d = (matching or dividing)[0]
        n = size // _itemsize(d)
        why = (f"{d}: {size} bytes = {_n(n, 'entry', 'entries')} of {_itemsize(d)} bytes"
               + (f" = rowcnt's last entry" if matching else
                  f"; no candidate gives rowcnt's last entry {target}"))
        dtypes[k], sources[k], inferred[k] = d, "inferred", why
        notes[k] = f"{k} dtype {d} inferred; pass --{k}-dtype to override"

    colidx = _open_array(p["colidx"], dtypes["colidx"], sizes["colidx"], mmap)
    value = _open_array(p["value"], dtypes["value"], sizes["value"], mmap)
    csr = CSR(rowcnt, colidx, value)
    rows = len(rowcnt) - 1
    nc, nv = len(colidx), len(value)

    # A .meta dtype that makes the counts disagree while another dtype would not:
    # blame the .meta field, not the data.
    want: dict[str, int | None] = {"rowcnt": None, "colidx": target, "value": target}
    if meta and "rows" in meta:
        want["rowcnt"] = meta["rows"] + 1
    for k in ARRAYS:
        expected = want[k]
        if sources[k] != "meta" or expected is None:
            continue
        count = sizes[k] // _itemsize(dtypes[k])
        if count == want[k]:
            continue
        allowed = INDEX_DTYPES if k != "value" else VALUE_DTYPES
        alts = [a for a in allowed
                if a != dtypes[k] and _count_fits(sizes[k], (a,), expected)]
        if alts:
            raise CorruptFile(
                f'{p["meta"]}: field "dtypes.{k}" = "{dtypes[k]}" disagrees with '
                f"{p[k]}: {sizes[k]} bytes = {count} {dtypes[k]} entries, but "
                f"{want[k]} are expected ({' or '.join(alts)} would fit)", hint=_META_HINT)

    if nv != target and nc == target and sources["value"] == "inferred" and target > 0 \
            and sizes["value"] % target == 0:
        per = sizes["value"] // target
        fits = [d for d in VALUE_DTYPES if _itemsize(d) == per]
        if fits:
            raise CorruptFile(
                f"{p['rowcnt']}: position {rows}: last rowcnt entry is {target} but "
                f"{p['value']} holds {nv} values read as {dtypes['value']} (inferred); "
                f"{sizes['value']} bytes = {target} values of {per} "
                f"byte{'s' if per != 1 else ''}: pass --value-dtype {' or '.join(fits)}")

    if meta:
        if "rows" in meta and meta["rows"] != rows:
            raise CorruptFile(f'{p["meta"]}: field "rows" = {meta["rows"]} disagrees with '
                              f"{p['rowcnt']}: {rows + 1} entries = {rows} rows",
                              hint=_META_HINT)

    if cols is not None:
        ncols, sources["cols"], cols_note = cols, "argument", "as given"
    elif meta and "cols" in meta:
        ncols, sources["cols"] = meta["cols"], "meta"
        cols_note = f'from field "cols" of {p["meta"]}'
    else:
        ncols, sources["cols"], cols_note = None, "inferred", ""
    found, how = _check_structure(csr, cols=ncols, names=p, exc=CorruptFile,
                                  cols_note=cols_note, full=check)
    if ncols is None:
        inferred["cols"] = how
    if meta and "nnz" in meta and meta["nnz"] != nv:
        raise CorruptFile(f'{p["meta"]}: field "nnz" = {meta["nnz"]} disagrees with '
                          f"{p['value']}: {nv} values", hint=_META_HINT)
    return MatrixSet(csr, rows, found, dtypes, inferred, meta, prefix, sources)


def validate(prefix: str | os.PathLike[str], *, rowcnt_dtype: str | None = None,
             colidx_dtype: str | None = None, value_dtype: str | None = None,
             cols: int | None = None) -> MatrixSet:
    """Fully validate a file set; return it (memory-mapped) or raise :class:`CorruptFile`
    / :class:`NotFound` with a one-line message naming file, position and defect.

    Cost: one chunked pass over rowcnt and one over colidx, O(CHUNK) memory.
    """
    return read_csr(prefix, rowcnt_dtype=rowcnt_dtype, colidx_dtype=colidx_dtype,
                    value_dtype=value_dtype, cols=cols, mmap=True, check=True)


# ----------------------------------------------------------------------------- writing


class SetWriter:
    """Streams the three arrays of a file set to hidden temporary files beside
    ``prefix``, then :meth:`commit` fsyncs and renames each over its final name and
    writes the ``.meta`` last.  Every file is replaced atomically (old or new, never
    half); the set as a whole is not (checkpoints get that from a directory rename).
    On an exception inside ``with`` (Ctrl-C included) the temporaries are removed.

    Cost: the bytes written plus four fsyncs; O(CHUNK) memory per :meth:`append`.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtypes: Mapping[str, str]) -> None:
        self.prefix = os.fspath(prefix)
        self.dtypes = {k: _le(dtypes[k]) for k in ARRAYS}
        self.counts = {k: 0 for k in ARRAYS}
        directory = os.path.dirname(self.prefix) or "."
        if not os.path.isdir(directory):
            raise NotFound(f"{directory}: no such directory",
                           hint="create the directory first")
        base = os.path.basename(self.prefix)
        token = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._tmp = {k: os.path.join(directory, f".{base}.{k}.tmp-{token}")
                     for k in (*ARRAYS, "meta")}
        self._dir = directory
        self._files: dict[str, Any] = {}
        try:
            for k in ARRAYS:
                self._files[k] = open(self._tmp[k], "xb")
        except BaseException:
            self.abort()
            raise

    def __enter__(self) -> SetWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()

    def append(self, kind: str, arr: np.ndarray) -> int:
        """Append ``arr`` (cast to the file dtype) to array ``kind``; return bytes
        written.  O(len(arr)) time, O(CHUNK) extra memory."""
        dt = self.dtypes[kind]
        f = self._files[kind]
        n = len(arr)
        for s in range(0, n, CHUNK):
            f.write(np.ascontiguousarray(arr[s:s + CHUNK], dtype=dt).data)
        self.counts[kind] += n
        return n * dt.itemsize

    def commit(self, meta: Mapping[str, Any]) -> None:
        """fsync and rename the three arrays, then write ``.meta``; fsync the directory."""
        final = paths(self.prefix)
        try:
            for k in ARRAYS:
                f = self._files.pop(k)
                f.flush()
                os.fsync(f.fileno())
                f.close()
            for k in ARRAYS:
                os.replace(self._tmp[k], final[k])
            with open(self._tmp["meta"], "x", encoding="utf-8") as f:
                json.dump(meta, f, indent=1, sort_keys=False)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(self._tmp["meta"], final["meta"])
            fd = os.open(self._dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Close and delete whatever temporaries exist.  Idempotent."""
        for f in self._files.values():
            f.close()
        self._files.clear()
        for path in self._tmp.values():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def build_meta(rows: int, cols: int, nnz: int, dtypes: Mapping[str, str],
               extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``.meta`` dict of a set: the computed keys, then ``extra`` (unknown keys are
    kept; a reserved key in ``extra`` must carry the same value or
    :class:`InvalidArgument` is raised).  O(len(extra))."""
    meta: dict[str, Any] = {"version": FORMAT_VERSION, "kind": "csr", "rows": int(rows),
                            "cols": int(cols), "nnz": int(nnz),
                            "dtypes": {k: str(dtypes[k]) for k in ARRAYS}}
    for k, v in (extra or {}).items():
        if k in RESERVED_META_KEYS:
            if v != meta[k]:
                raise InvalidArgument(f'meta key "{k}" = {v!r} disagrees with the arrays '
                                      f"({meta[k]!r})")
            continue
        meta[k] = v
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"meta is not JSON-serialisable: {exc}") from None
    return meta


def _write_dtype(name: str, arr: np.ndarray, allowed: Sequence[str], fallback: str) -> str:
    dt = np.dtype(arr.dtype)
    if dt.name in allowed:
        return dt.name
    if dt.kind in "iu":
        return "int32" if np.can_cast(dt, np.int32) and "int32" in allowed else fallback
    if arr.size == 0:
        return fallback
    raise InvalidArgument(f"{name}: dtype {dt} is not an integer dtype")


def write_csr(prefix: str | os.PathLike[str], csr: CSR | Sequence[np.ndarray], *,
              cols: int | None = None, meta: Mapping[str, Any] | None = None,
              value_dtype: str | None = None) -> dict[str, Any]:
    """Write ``csr`` as ``prefix.{rowcnt,colidx,value,meta}``; return the meta written.

    rowcnt and colidx keep an int32/int64 dtype (other integers become int64 / the
    narrowest of int32, int64); values keep their dtype, which must be a file dtype,
    unless ``value_dtype`` casts them (numpy ``same_kind`` rule).  ``cols`` defaults to
    the largest column + 1.  Each file goes to a temporary name, is fsynced and renamed
    (atomic per file); ``.meta`` is written last.  The arrays are validated first:
    :class:`InvalidArgument` names the array and position of a defect.

    Cost: one chunked validation pass, then the bytes written; O(CHUNK) extra memory,
    so memmapped inputs of any size are fine.
    """
    if not isinstance(csr, CSR):
        if len(csr) != 3:
            raise InvalidArgument("csr must be shmps.CSR(rowcnt, colidx, value) or a 3-tuple")
    arrs = [np.asarray(a) for a in csr]
    for name, a in zip(ARRAYS, arrs):
        if a.ndim != 1:
            raise InvalidArgument(f"{name}: must be 1-d, got shape {a.shape}")
    rdt = _write_dtype("rowcnt", arrs[0], INDEX_DTYPES, "int64")
    cdt = _write_dtype("colidx", arrs[1], INDEX_DTYPES, "int64")
    src = np.dtype(arrs[2].dtype)
    if value_dtype is not None:
        if value_dtype not in VALUE_DTYPES:
            raise InvalidArgument(f"value_dtype {value_dtype!r} is not one of "
                                  f"{', '.join(VALUE_DTYPES)}")
        if not np.can_cast(src, value_dtype, casting="same_kind"):
            raise InvalidArgument(f"value: cannot cast {src} to {value_dtype} "
                                  "(numpy same_kind rule)")
        vdt = value_dtype
    elif src.name in VALUE_DTYPES:
        vdt = src.name
    else:
        raise InvalidArgument(f"value: dtype {src} is not a file dtype "
                              f"({', '.join(VALUE_DTYPES)}); pass value_dtype=")
    if cols is not None and (not _is_int(cols) or cols < 0):
        raise InvalidArgument(f"cols must be a non-negative integer, got {cols!r}")
    c = CSR(arrs[0], arrs[1], arrs[2])
    ncols, _ = _check_structure(c, cols=cols, names={k: k for k in ARRAYS},
                                exc=InvalidArgument, cols_note="as given", full=True)
    dtypes = {"rowcnt": rdt, "colidx": cdt, "value": vdt}
    full_meta = build_meta(c.rows, ncols, c.nnz, dtypes, meta)
    with SetWriter(prefix, dtypes) as w:
        for k, a in zip(ARRAYS, c):
            w.append(k, a)
        w.commit(full_meta)
    return full_meta


def iter_chunks(n: int, chunk: int = CHUNK) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` pairs covering ``range(n)`` in steps of ``chunk``.  O(1) memory."""
    for s in range(0, n, chunk):
        yield s, min(s + chunk, n)


def _scipy_sparse() -> Any:
    """``scipy.sparse``, imported lazily; a clear error without scipy."""
    try:
        import scipy.sparse as sparse
    except ImportError:
        raise InvalidArgument("scipy is needed for .npz files and sparse conversions",
                              hint="pip install scipy") from None
    return sparse


__all__ = [
    "CSR", "MatrixSet", "SetWriter", "read_csr", "write_csr", "validate", "read_meta",
    "build_meta", "paths", "normalize_prefix", "iter_chunks", "FORMAT_VERSION", "ARRAYS",
    "INDEX_DTYPES", "VALUE_DTYPES", "DEFAULT_DTYPES", "CHUNK",
]
