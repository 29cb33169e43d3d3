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
and what is wrong.  This module uses the native core for one constant only
(``SHMPS_MAX_STATE``, the most optimizer state arrays a ``.meta`` may declare).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl as _fcntl
import hashlib
import json
import os
import re
import secrets
import socket
import stat
import struct
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence, cast

import numpy as np

from . import _native, progress
from ._native import lib as _lib
from .checks import check_flag, check_int
from .errors import CorruptFile, InvalidArgument, NotFound, Timeout

FORMAT_VERSION = 1
#: The most optimizer state arrays a set may have (``"state": {"count": N}``): as many as
#: a shard keeps (``SHMPS_MAX_STATE``, native/shmps.h).
MAX_STATE = int(_lib.SHMPS_MAX_STATE)
ARRAYS: tuple[str, str, str] = ("rowcnt", "colidx", "value")
INDEX_DTYPES: tuple[str, ...] = ("int32", "int64")
VALUE_DTYPES: tuple[str, ...] = ("int8", "int32", "float16", "float32", "float64")
DEFAULT_DTYPES: dict[str, str] = {"rowcnt": "int64", "colidx": "int32", "value": "float32"}
#: Meta keys computed by :func:`write_csr`; a caller's ``meta`` may repeat them only
#: with the same value.
RESERVED_META_KEYS: tuple[str, ...] = ("version", "kind", "rows", "cols", "nnz", "dtypes")
#: Elements per chunk of every streaming pass (validation, copying, writing).
CHUNK = 1 << 22
#: A pass over a set (validation, a write, shmps-tool's conversions and summary) of at
#: least this many bytes shows a progress bar when stderr is a terminal
#: (:func:`progress_bar`): a smaller one ends before a bar would tell anything.
PROGRESS_MIN_BYTES = 64 << 20
#: The most entries an array (and an axis, a row or column count) can have: what numpy
#: and a file offset address.
_MAX_EXTENT = (1 << 63) - 1
#: What a ``.meta`` may say a set is: ``csr`` (explicit structure) or ``dense``
#: (``rows x cols`` values row-major; no ``.rowcnt``/``.colidx``, the structure is implicit).
KINDS: tuple[str, ...] = ("csr", "dense")
#: Names of the arrays that can supply a set's values: ``value`` and the optimizer
#: state arrays ``state0``, ``state1``, ... (same structure, ``.meta`` field ``state``).
_ARRAY_NAME = re.compile(r"value|state(0|[1-9][0-9]*)")

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
        i = check_int(i, "i", 0)   # (True and 1.5 raised numpy's TypeError and IndexError)
        if not i < self.rows:
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
        # (int() took 3.5 as 3 columns)
        ncols = self.min_cols() if cols is None else check_int(cols, "cols", 0)
        out = np.zeros((self.rows, ncols), dtype=self.value.dtype)
        rows = np.repeat(np.arange(self.rows), self.row_nnz())
        np.add.at(out, (rows, np.asarray(self.colidx)), np.asarray(self.value))
        return out

    @classmethod
    def from_dense(cls, a: np.ndarray, *, keep_zeros: bool = False,
                   rowcnt_dtype: str = "int64", colidx_dtype: str | None = None) -> CSR:
        """The CSR of a 2-d array: its nonzeros (NaN counts as nonzero), or every entry
        with ``keep_zeros``.  O(rows * cols) time, O(nnz) memory for the result."""
        keep_zeros = check_flag(keep_zeros, "keep_zeros")
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
        # (int() took 3.5 as 3 columns)
        ncols = self.min_cols() if cols is None else check_int(cols, "cols", 0)
        return sparse.csr_matrix((self.value, self.colidx, self.rowcnt),
                                 shape=(self.rows, ncols))


class ImplicitIndex:
    """A structure array of a dense set, computed on demand instead of stored.

    ``ImplicitIndex("rowcnt", rows, cols)`` reads as ``[0, cols, 2 * cols, ..., rows *
    cols]`` (``rows + 1`` entries); ``ImplicitIndex("colidx", rows, cols)`` as ``[0, 1,
    ..., cols - 1]`` repeated ``rows`` times (``rows * cols`` entries).  It behaves like
    a read-only 1-d numpy array for what file-set readers do: ``len()``, ``dtype``,
    ``shape``, ``ndim``, ``size``, an integer index (a numpy scalar, O(1)), a slice or an
    integer array (an ndarray of just those entries, O(len)), and ``np.asarray()`` (the
    whole array, O(len) memory -- which is what this class exists to avoid for a large
    set: stream it in slices instead).
    """

    ndim = 1

    def __init__(self, which: str, rows: int, cols: int, dtype: str | np.dtype) -> None:
        if which not in ("rowcnt", "colidx"):
            raise InvalidArgument(f"ImplicitIndex: which={which!r} is not rowcnt or colidx")
        self.which, self.rows, self.cols = which, int(rows), int(cols)
        self.dtype = np.dtype(dtype)
        self._n = self.rows + 1 if which == "rowcnt" else self.rows * self.cols

    def __len__(self) -> int:
        return self._n

    @property
    def shape(self) -> tuple[int]:
        return (self._n,)

    @property
    def size(self) -> int:
        return self._n

    @property
    def nbytes(self) -> int:
        """Bytes the array would take if materialised (it is not)."""
        return self._n * self.dtype.itemsize

    def _at(self, idx: np.ndarray) -> np.ndarray:
        idx = np.asarray(idx, dtype=np.int64)
        out = idx * self.cols if self.which == "rowcnt" else idx % max(self.cols, 1)
        return out.astype(self.dtype, copy=False)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return self._at(np.arange(*key.indices(self._n), dtype=np.int64))
        if isinstance(key, (int, np.integer)):
            i = int(key) + (self._n if int(key) < 0 else 0)
            if not 0 <= i < self._n:
                raise IndexError(f"index {int(key)} is out of bounds for axis 0 with size "
                                 f"{self._n}")
            return self.dtype.type(i * self.cols if self.which == "rowcnt"
                                   else i % self.cols)
        idx = np.asarray(key)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"ImplicitIndex indices must be integers or slices, not "
                            f"{idx.dtype}")
        idx = np.where(idx < 0, idx + self._n, idx)
        if idx.size and (idx.min() < 0 or idx.max() >= self._n):
            raise IndexError(f"index out of bounds for axis 0 with size {self._n}")
        return self._at(idx)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self[:]
        return a if dtype is None else a.astype(dtype, copy=False)

    def __iter__(self) -> Iterator[Any]:
        for s in range(0, self._n, CHUNK):
            yield from self[s:s + CHUNK]

    def __repr__(self) -> str:
        return (f"ImplicitIndex({self.which!r}, rows={self.rows}, cols={self.cols}, "
                f"dtype={self.dtype.name})")


def implicit_structure(rows: int, cols: int) -> tuple[ImplicitIndex, ImplicitIndex]:
    """``(rowcnt, colidx)`` of a dense ``rows x cols`` matrix, computed on demand:
    rowcnt int64, colidx int32 (int64 beyond 2**31 - 1 columns).  O(1)."""
    cdt = "int32" if cols <= np.iinfo(np.int32).max else "int64"
    return (ImplicitIndex("rowcnt", rows, cols, "int64"),
            ImplicitIndex("colidx", rows, cols, cdt))


@dataclass
class MatrixSet:
    """A matrix file set as read (or as about to be written).

    ``dtypes`` maps each array to its dtype name; ``sources`` says where each of
    ``rowcnt``, ``colidx``, ``value`` and ``cols`` came from (``"argument"``, ``"meta"``,
    ``"inferred"``, or ``"array"`` for in-memory arrays and the cols their owner gave);
    ``inferred`` holds, for the inferred ones only, why.
    ``meta`` is the parsed ``.meta`` (``{}`` without one), unknown keys included.

    ``kind`` is ``"csr"`` or ``"dense"``; a dense set's ``csr.rowcnt`` and ``csr.colidx``
    are :class:`ImplicitIndex` objects (computed on demand, ``sources`` ``"implicit"``)
    and ``shape`` is the tensor shape its ``.meta`` gives (else ``(rows, cols)``).
    ``array`` names the array read as the values (``"value"``, or an optimizer state
    array ``"state0"``, ...) and ``arrays`` lists every such array the set declares.
    """

    csr: CSR
    rows: int
    cols: int
    dtypes: dict[str, str]
    inferred: dict[str, str] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    prefix: str | None = None
    sources: dict[str, str] = field(default_factory=dict)
    kind: str = "csr"
    shape: tuple[int, ...] | None = None
    array: str = "value"
    arrays: tuple[str, ...] = ("value",)

    @property
    def nnz(self) -> int:
        """Number of stored entries.  O(1)."""
        return self.csr.nnz

    def to_numpy(self) -> np.ndarray:
        """The matrix as a numpy array: a dense set's values reshaped to ``shape`` (a
        view of the memmap, no copy), a csr set's :meth:`CSR.to_dense` (``rows x cols``,
        O(rows * cols) memory, repeats summed)."""
        if self.kind == "dense":
            shape = self.shape if self.shape is not None else (self.rows, self.cols)
            return np.asarray(self.csr.value).reshape(shape)
        return self.csr.to_dense(self.cols)

    @classmethod
    def from_dense(cls, values: np.ndarray, *, shape: Sequence[int] | None = None,
                   meta: Mapping[str, Any] | None = None) -> MatrixSet:
        """Describe an in-memory dense array as a dense set (:func:`dense_dims`: rows =
        first axis, cols = product of the others).  The structure is implicit; nothing
        is copied when ``values`` is C-contiguous.  ``shape`` defaults to
        ``values.shape``.  O(1)."""
        a = np.asarray(values)
        shp = tuple(int(x) for x in (a.shape if shape is None else shape))
        rows, cols = dense_dims(shp)
        flat = np.ascontiguousarray(a).reshape(-1)
        if flat.size != rows * cols:
            raise InvalidArgument(f"{flat.size} values do not fill shape {shp}")
        rowcnt, colidx = implicit_structure(rows, cols)
        dtypes = {"rowcnt": rowcnt.dtype.name, "colidx": colidx.dtype.name,
                  "value": flat.dtype.name}
        sources = {"rowcnt": "implicit", "colidx": "implicit", "value": "array",
                   "cols": "array"}
        return cls(CSR(cast(Any, rowcnt), cast(Any, colidx), flat), rows, cols, dtypes, {},
                   dict(meta or {}), None, sources, "dense", shp)

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


def dense_dims(shape: Sequence[int]) -> tuple[int, int]:
    """``(rows, cols)`` of a dense tensor shape: rows = first axis, cols = product of
    the others; ``()`` is 1 x 1 and ``(n,)`` is n x 1 (as the store shards them).  O(ndim)."""
    shp = tuple(int(x) for x in shape)
    if not shp:
        return 1, 1
    cols = 1
    for x in shp[1:]:
        cols *= x
    return shp[0], cols


def paths(prefix: str | os.PathLike[str]) -> dict[str, str]:
    """The four paths of a file set: ``{"rowcnt", "colidx", "value", "meta"}``.  O(1)."""
    p = os.fspath(prefix)
    return {k: f"{p}.{k}" for k in (*ARRAYS, "meta")}


def normalize_prefix(prefix: str | os.PathLike[str]) -> str:
    """Accept ``X`` or the path of one member (``X.rowcnt``, ``X.meta``, ``X.state0``,
    ...) and return ``X``.  O(1) stat calls."""
    return split_member(prefix)[0]


def split_member(prefix: str | os.PathLike[str]) -> tuple[str, str | None]:
    """``(X, array)`` for the path of a value-like member (``X.value`` -> ``"value"``,
    ``X.state0`` -> ``"state0"``), ``(X, None)`` for ``X`` itself or another member
    (``X.rowcnt``, ``X.meta``).  A path is taken as a member only if it exists and ``X``
    is not itself a set (no ``X.rowcnt`` / ``X.meta`` beside it); ``X.stateN`` also when
    it does not exist but ``X.meta`` does, so that reading it says which arrays ``X``
    has (or that its declared file is missing) instead of taking it for the prefix of
    another set ("missing file X.state9.rowcnt, ...").  O(1) stat calls."""
    p = os.fspath(prefix)
    if os.path.exists(f"{p}.rowcnt") or os.path.exists(f"{p}.meta"):
        return p, None
    head, dot, ext = p.rpartition(".")
    if dot and head and os.path.exists(p):
        if ext in ("rowcnt", "colidx", "meta"):
            return head, None
        if _ARRAY_NAME.fullmatch(ext):
            return head, (ext if ext != "value" else None)
    if (dot and head and ext.startswith("state") and _ARRAY_NAME.fullmatch(ext)
            and os.path.exists(f"{head}.meta")):
        return head, ext
    return p, None


def _check_array_name(array: str) -> None:
    if not isinstance(array, str) or not _ARRAY_NAME.fullmatch(array):
        raise InvalidArgument(f"array {array!r} is not value or stateN (N = 0, 1, ...)",
                              hint="--array value (default) or --array state0, state1, ...")


def declared_arrays(meta: Mapping[str, Any]) -> tuple[str, ...]:
    """The value-like arrays a ``.meta`` declares: ``("value", "state0", ...)`` for
    ``"state": {"count": N, "dtype": D}``; ``meta`` as :func:`read_meta` returns it
    (N at most :data:`MAX_STATE`).  O(N)."""
    st = meta.get("state") if meta else None
    n = st.get("count", 0) if isinstance(st, dict) else 0
    return ("value",) + tuple(f"state{k}" for k in range(n if _is_int(n) else 0))


def _peek_kind(meta_path: str) -> Any:
    """The ``kind`` a ``.meta`` states, or None when it is absent or unreadable (the
    full read reports that in its place).  O(size)."""
    try:
        meta = load_json(meta_path, "")
    except (OSError, CorruptFile):
        return None
    return meta.get("kind") if isinstance(meta, dict) else None


def load_json(path: str, hint: str) -> Any:
    """The parsed JSON of the regular file ``path`` (a ``.meta``, ``checkpoint.json``).

    Raises :class:`CorruptFile` (with ``hint``) for what is not a regular file (a
    directory, or a FIFO, whose opening would block until a writer came: it is opened
    non-blocking and refused), unparsable JSON, text that is not UTF-8, nesting too deep
    for the parser (RecursionError) and an integer of more digits than Python converts
    (ValueError); FileNotFoundError and other OSErrors as they are.  O(size)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptFile(f"{path}: not a regular file", hint=hint)
        with os.fdopen(fd, "rb", closefd=False) as f:
            text = f.read()
    finally:
        os.close(fd)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CorruptFile(f"{path}: unparsable JSON at line {exc.lineno} column {exc.colno}: "
                          f"{exc.msg}", hint=hint) from None
    except UnicodeDecodeError as exc:
        raise CorruptFile(f"{path}: unparsable JSON: not UTF-8 text at byte {exc.start}",
                          hint=hint) from None
    except RecursionError:
        raise CorruptFile(f"{path}: unparsable JSON: nested too deeply", hint=hint) from None
    except ValueError:   # an integer of more than sys.get_int_max_str_digits() digits
        raise CorruptFile(f"{path}: unparsable JSON: a number with more digits than this "
                          "reader converts", hint=hint) from None


# ----------------------------------------------------------------------------- reading


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse and sanity-check a ``.meta`` file (keys of known meaning only; unknown keys
    are kept).  Raises :class:`CorruptFile` naming the file and the field.  O(size)."""
    p = os.fspath(path)
    try:
        meta = load_json(p, _META_HINT)
    except FileNotFoundError:
        raise NotFound(f"missing file {p}", hint=_SET_HINT) from None
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
    if "kind" in meta and meta["kind"] not in KINDS:
        raise bad("kind", 'is not "csr" or "dense": the file set kinds this reader knows')
    for key in ("rows", "cols", "nnz"):
        if key in meta and (not _is_int(meta[key]) or meta[key] < 0):
            raise bad(key, "is not a non-negative integer")
    if "shape" in meta and (not isinstance(meta["shape"], list)
                            or not all(_is_int(x) and x >= 0 for x in meta["shape"])):
        raise bad("shape", "is not a list of non-negative integers")
    st = meta.get("state")
    if isinstance(st, dict) and "count" in st:  # {"count": N, "dtype": D}: state arrays
        # (any other "state" value is an unknown key, kept as is)
        if not _is_int(st["count"]) or st["count"] < 0:
            raise bad("state.count", "is not a non-negative integer")
        if st["count"] > MAX_STATE:
            raise bad("state.count", f"is more than {MAX_STATE}, the most optimizer state "
                                     "arrays a set has")
        if st.get("count", 0) and st.get("dtype") not in VALUE_DTYPES:
            raise bad("state.dtype", f"is not one of {', '.join(VALUE_DTYPES)}")
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


#: What :func:`is_u64` refuses, in a message naming the field.
NOT_U64 = "is not an integer in 0 .. 2**64-1"


def is_u64(x: Any) -> bool:
    """``x`` is an integer the C core holds in a uint64 (a checkpoint's steps and
    counts): ``0 <= x < 2**64``, not a bool.  O(1)."""
    return _is_int(x) and 0 <= x < 1 << 64


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


def _axes_bytes(shape: Sequence[int], dtype: str) -> int:
    """The size numpy checks an array of ``shape`` against: the product of its non-zero
    axes times the itemsize (``np.zeros((0, 2**62), "float32")`` is "array is too big").
    O(ndim)."""
    n = _itemsize(dtype)
    for x in shape:
        n *= max(int(x), 1)
    return n


def _truncated(path: str, size: int, dtypes: Sequence[str], note: str) -> CorruptFile:
    which = " or ".join(f"the {d} itemsize {_itemsize(d)} (partial entry at position "
                        f"{size // _itemsize(d)})" for d in dtypes)
    return CorruptFile(f"{path}: truncated: size {size} bytes is not a multiple of {which}"
                       f" ({note})")


def _count_fits(size: int, options: Sequence[str], target: int) -> bool:
    return any(size % _itemsize(d) == 0 and size // _itemsize(d) == target for d in options)


def progress_bar(total: int, desc: str) -> Any:
    """The progress bar of a pass of ``total`` bytes over a set (:mod:`shmps.progress`):
    shown on stderr when it is a terminal and ``total`` is at least
    :data:`PROGRESS_MIN_BYTES` (read at each call), else one that shows nothing."""
    return progress.bar(total, desc, min_total=PROGRESS_MIN_BYTES, divisor=1024)


def _nbytes(a: Any) -> int:
    """The bytes of 1-d array ``a`` (a memmap, an ndarray, an :class:`ImplicitIndex`)."""
    return len(a) * np.asarray(a[:0]).dtype.itemsize


def _first_decrease(a: np.ndarray, chunk: int = CHUNK, bar: Any = None) -> int | None:
    """First ``i`` with ``a[i + 1] < a[i]``, or None.  Chunked, O(chunk) memory.  A
    ``bar`` is advanced by the bytes of ``a`` read, :func:`_nbytes` of it in all when
    none decreases."""
    n = len(a)
    size = np.asarray(a[:0]).dtype.itemsize
    done = 0
    for s in range(0, max(n - 1, 0), chunk):
        seg = np.asarray(a[s:min(s + chunk + 1, n)])
        bad = np.flatnonzero(seg[1:] < seg[:-1])
        if bad.size:
            return s + int(bad[0])
        if bar is not None:   # (chunks overlap by one element: each counted once)
            bar.update((min(s + chunk + 1, n) - done) * size)
            done = min(s + chunk + 1, n)
    if bar is not None and n > done:   # (a 1-element array: no chunk)
        bar.update((n - done) * size)
    return None


def _scan_columns(c: np.ndarray, cols: int | None, chunk: int = CHUNK, bar: Any = None
                  ) -> tuple[int, int | None]:
    """``(max column, first bad position)``: bad is < 0, or >= cols when cols is given.
    Chunked, O(chunk) memory; stops at the first bad chunk.  A ``bar`` is advanced by
    the bytes of ``c`` read (all of them when none is bad)."""
    best = -1
    for s in range(0, len(c), chunk):
        seg = np.asarray(c[s:s + chunk])
        lo, hi = int(seg.min()), int(seg.max())
        if lo < 0 or (cols is not None and hi >= cols):
            badmask = seg < 0 if cols is None else (seg < 0) | (seg >= cols)
            return max(best, hi), s + int(np.flatnonzero(badmask)[0])
        best = max(best, hi)
        if bar is not None:
            bar.update(seg.nbytes)
    return best, None


def _check_structure(c: CSR, *, cols: int | None, names: Mapping[str, str],
                     exc: type[Exception], cols_note: str, full: bool,
                     chunk: int = CHUNK, vlabel: str = "value",
                     desc: str | None = None) -> tuple[int, str]:
    """Check the CSR invariants; return ``(cols, how cols was found)``.

    Cheap checks (O(1)): rowcnt non-empty, starts at 0, colidx and value of equal
    length, rowcnt[-1] == nnz.  With ``full``: rowcnt non-decreasing and every column in
    [0, cols), one chunked pass each.  Without ``full`` and without ``cols`` the column
    pass still runs (to find cols).  Raises ``exc`` with ``names`` in the message.
    With ``desc`` the passes show a progress bar of that name (:func:`progress_bar`)
    counting the bytes they read.
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
                  f"{nv} values (colidx and {vlabel} must have equal length)")
    if nv < nc:
        raise exc(f"{vn}: position {nv}: {vlabel} ends after {nv} entries but {cn} holds "
                  f"{nc} column indices (colidx and {vlabel} must have equal length)")
    rows = len(rowcnt) - 1
    last = int(rowcnt[-1])
    if last != nv:
        raise exc(f"{rn}: position {rows}: last rowcnt entry is {last} but {vn} holds "
                  f"{nv} values (rowcnt[-1] must equal the number of values)")
    total = (_nbytes(rowcnt) if full else 0) + (_nbytes(colidx) if cols is None or full else 0)
    with (progress_bar(total, desc) if desc is not None
          else contextlib.nullcontext()) as bar:
        return _check_passes(rowcnt, colidx, cols=cols, names=names, exc=exc,
                             cols_note=cols_note, full=full, chunk=chunk, bar=bar)


def _check_passes(rowcnt: np.ndarray, colidx: np.ndarray, *, cols: int | None,
                  names: Mapping[str, str], exc: type[Exception], cols_note: str,
                  full: bool, chunk: int, bar: Any) -> tuple[int, str]:
    """The chunked passes of :func:`_check_structure` (``bar``: None, or a progress bar
    they advance)."""
    rn, cn = names["rowcnt"], names["colidx"]
    if full:
        i = _first_decrease(rowcnt, chunk, bar)
        if i is not None:
            raise exc(f"{rn}: position {i}: rowcnt[{i + 1}] = {int(rowcnt[i + 1])} is less "
                      f"than rowcnt[{i}] = {int(rowcnt[i])} (offsets must not decrease)")
    if cols is None or full:
        top, bad = _scan_columns(colidx, cols, chunk, bar)
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
             cols: int | None = None, mmap: bool = True, check: bool = True,
             array: str | None = None) -> MatrixSet:
    """Read the file set ``prefix.{rowcnt,colidx,value}`` (and ``prefix.meta`` if any).

    Dtypes come from the arguments, else the ``.meta``, else inference from the file
    sizes (docs/file-format.md, "Inference"); ``cols`` likewise, else largest column + 1.
    ``prefix`` may also name one member file (``X.rowcnt``, ``X.state0``).

    A ``.meta`` with ``"kind": "dense"`` makes it a dense set: only ``prefix.value``
    (``rows * cols`` values, row-major), the structure implicit (:class:`ImplicitIndex`,
    nothing materialised); see :func:`read_dense`.  ``array="state0"`` (``state1``, ...)
    reads that optimizer state array, declared by the ``.meta`` field ``state``, in
    place of ``value`` (same structure; dtype ``state.dtype``); default ``value``, or the
    array a member path names.

    Cost: O(1) memory beyond the maps (``mmap=True``, read-only memmaps) or the whole set
    (``mmap=False``); with ``check`` (default) one chunked pass over rowcnt (non-decreasing)
    and colidx (range); without it only the O(1) checks, plus the colidx pass when cols
    must be inferred; a pass of at least :data:`PROGRESS_MIN_BYTES` shows a progress bar
    (``check PREFIX``) on a terminal.  Raises :class:`NotFound` for a missing file and
    :class:`CorruptFile` for anything wrong, naming file, position and defect.
    """
    mmap, check = check_flag(mmap, "mmap"), check_flag(check, "check")
    cols = check_int(cols, "cols", 0, none=True)   # (np.int64(4) was refused)
    prefix, member = split_member(prefix)
    array = array if array is not None else (member or "value")
    _check_array_name(array)

    def once() -> MatrixSet:
        p = paths(prefix)
        given = {"rowcnt": rowcnt_dtype, "colidx": colidx_dtype, "value": value_dtype}
        for k, allowed in (("rowcnt", INDEX_DTYPES), ("colidx", INDEX_DTYPES),
                           ("value", VALUE_DTYPES)):
            if given[k] is not None and given[k] not in allowed:
                raise InvalidArgument(f"{k} dtype {given[k]!r} is not one of "
                                      f"{', '.join(allowed)}")
        kind = _peek_kind(p["meta"])
        if kind == "dense":
            return _read_dense(prefix, given, cols, mmap, array)
        if kind is not None and kind != "csr":
            read_meta(p["meta"])  # names the bad "kind" field (before any missing file)
        vfield = "dtypes.value"
        if array != "value":
            declared = declared_arrays(read_meta(p["meta"]) if os.path.exists(p["meta"]) else {})
            if array not in declared:
                raise _no_array(p["meta"], array, declared)
            p["value"], vfield = f"{prefix}.{array}", "state.dtype"

        missing = [p[k] for k in ARRAYS if not os.path.exists(p[k])]
        if missing:
            if kind is None and os.path.exists(p["meta"]):
                # a .meta that cannot be read may be a dense set's (no .rowcnt/.colidx):
                # its own defect is the error, not the structure files it would not need
                read_meta(p["meta"])
            raise NotFound(f"missing file {', '.join(missing)}", hint=_SET_HINT)
        sizes: dict[str, int] = {}
        for k in ARRAYS:
            if not os.path.isfile(p[k]):
                raise CorruptFile(f"{p[k]}: not a regular file", hint=_SET_HINT)
            sizes[k] = os.path.getsize(p[k])
        meta = read_meta(p["meta"]) if os.path.exists(p["meta"]) else {}
        meta_dtypes: dict[str, str] = dict(meta.get("dtypes", {})) if meta else {}
        if array != "value":
            meta_dtypes["value"] = meta["state"]["dtype"]

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
                   + (" = rowcnt's last entry" if matching else
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
                    f'{p["meta"]}: field "{vfield if k == "value" else "dtypes." + k}" = '
                    f'"{dtypes[k]}" disagrees with '
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
                                      cols_note=cols_note, full=check, vlabel=array,
                                      desc=f"check {prefix}")
        if ncols is None:
            inferred["cols"] = how
        if meta and "nnz" in meta and meta["nnz"] != nv:
            raise CorruptFile(f'{p["meta"]}: field "nnz" = {meta["nnz"]} disagrees with '
                              f"{p['value']}: {nv} values", hint=_META_HINT)
        return MatrixSet(csr, rows, found, dtypes, inferred, meta, prefix, sources, "csr", None,
                         array, declared_arrays(meta))

    return _consistent_read(prefix, array, once)


def _no_array(meta_path: str, array: str, declared: Sequence[str]) -> InvalidArgument:
    return InvalidArgument(f"{meta_path}: the set has no array {array!r}: its arrays are "
                           f"{', '.join(declared)} (the .meta field \"state\" declares the "
                           "optimizer state arrays)", hint="pick one of those with --array")


def read_dense(prefix: str | os.PathLike[str], *, value_dtype: str | None = None,
               mmap: bool = True, array: str | None = None) -> MatrixSet:
    """Read a dense file set: ``prefix.value`` (or ``prefix.<array>``, an optimizer
    state array) holding ``rows * cols`` values row-major, and ``prefix.meta`` with
    ``"kind": "dense"``, ``rows`` and ``cols`` (or ``shape``), ``dtypes.value``
    (``state.dtype`` for state arrays).  There are no ``.rowcnt``/``.colidx`` files:
    the returned set's ``csr.rowcnt``/``csr.colidx`` are :class:`ImplicitIndex` objects,
    computed on demand.  Without ``dtypes.value`` the dtype is inferred (float32 or
    float64, whichever gives ``rows * cols`` values).

    Cost: O(1): a few stat calls and the ``.meta`` parse; the values are memory-mapped
    (``mmap=False`` loads them).  Raises :class:`NotFound` for a missing file,
    :class:`CorruptFile` naming the file, position and defect otherwise (a set that is
    not dense included)."""
    mmap = check_flag(mmap, "mmap")
    prefix, member = split_member(prefix)
    array = array if array is not None else (member or "value")
    _check_array_name(array)
    if value_dtype is not None and value_dtype not in VALUE_DTYPES:
        raise InvalidArgument(f"value dtype {value_dtype!r} is not one of "
                              f"{', '.join(VALUE_DTYPES)}")
    def once() -> MatrixSet:
        mp = paths(prefix)["meta"]
        if not os.path.exists(mp):
            raise NotFound(f"missing file {mp}", hint="a dense set is PREFIX.value and "
                           'PREFIX.meta with "kind": "dense", "rows" and "cols"')
        return _read_dense(prefix, {"rowcnt": None, "colidx": None, "value": value_dtype},
                           None, mmap, array)

    return _consistent_read(prefix, array, once)


#: a read whose set was replaced under it is done again, at most this many times
READ_ATTEMPTS = 20


def _inodes(names: Sequence[str]) -> tuple:
    """The inode under each name (None: none there).  O(len(names)) stat calls."""
    out = []
    for n in names:
        try:
            out.append(os.stat(n).st_ino)
        except OSError:
            out.append(None)
    return tuple(out)


def _pinned(names: Sequence[str]) -> tuple[list[int], tuple]:
    """Each name opened (read-only, non-blocking: a FIFO there does not hang), and the
    inode under it (None: none there, or it cannot be opened).  While the descriptors
    are open their inodes stay allocated, so no file made meanwhile gets one of their
    numbers: ext4 gives a set's new files the numbers its replaced files freed (a set
    rewritten twice, B then A again, had the same four inode numbers in 200 of 200
    tries here), and an inode compared without this passed an A-B-A replacement during
    a read for no replacement at all."""
    fds: list[int] = []
    inodes = []
    for n in names:
        try:
            fd = os.open(n, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            inodes.append(None)
            continue
        fds.append(fd)
        inodes.append(os.fstat(fd).st_ino)
    return fds, tuple(inodes)


def _consistent_read(prefix: str, array: str, read: Callable[[], MatrixSet]) -> MatrixSet:
    """``read()`` set ``prefix`` with every file of one version: a replacement that
    finished, or a half-done one finished (:func:`settle_replacement`), before it, and
    none under way while it reads (no journal before or after it, and the same inode
    under each name before and after it, the inodes from before held open meanwhile:
    a replacement renames new files, with new inodes, over every name, and removes its
    journal only after; held open, no new file can take an old one's number,
    :func:`_pinned`).  A read that met one is done again (its error too: a mix fails
    the size checks), at most READ_ATTEMPTS times.  Cost: an open, a close and two
    stats of each of the set's names, and two of its journal, a read."""
    names = [*paths(prefix).values(), f"{prefix}.{array}"]
    jp = journal_path(prefix)
    for _ in range(READ_ATTEMPTS):
        settle_replacement(prefix)   # (waits for a live writer's renames)
        fds, before = _pinned(names)
        try:
            if os.path.lexists(jp):
                continue   # a writer began since: settle waits for it
            try:
                ms = read()
            except (CorruptFile, NotFound):
                if _inodes(names) == before and not os.path.lexists(jp):
                    raise   # (the set as it is)
                continue
            if _inodes(names) == before and not os.path.lexists(jp):
                return ms
        finally:
            for fd in fds:
                os.close(fd)
    raise CorruptFile(f"{prefix}: its files were replaced {READ_ATTEMPTS} times while it "
                      "was read", hint="read it again once its writers have ended")


def _read_dense(prefix: str, given: Mapping[str, str | None], cols_arg: int | None,
                mmap: bool, array: str) -> MatrixSet:
    p = paths(prefix)
    mp = p["meta"]
    meta = read_meta(mp)
    if meta.get("kind") != "dense":
        raise CorruptFile(f'{mp}: field "kind" = {json.dumps(meta.get("kind"))} is not '
                          '"dense"', hint="read it with read_csr")
    flags = [f"--{k}-dtype" for k in ("rowcnt", "colidx") if given.get(k) is not None]
    if flags:
        raise InvalidArgument(f"{' and '.join(flags)}: {mp} says this is a dense set, whose "
                              "structure is implicit (no .rowcnt/.colidx files)",
                              hint="leave out the structure flags for a dense set")
    hint = _META_HINT
    shape = meta.get("shape")
    if shape is not None:
        rows, ncols = dense_dims(shape)
        for key, val in (("rows", rows), ("cols", ncols)):
            if key in meta and meta[key] != val:
                raise CorruptFile(f'{mp}: field "{key}" = {meta[key]} disagrees with field '
                                  f'"shape" = {json.dumps(shape)} (rows = shape[0], cols = the '
                                  f"product of shape[1:]: {rows} x {ncols})", hint=hint)
        dims_note = f'rows and cols from field "shape" of {mp}'
    else:
        lacking = [k for k in ("rows", "cols") if k not in meta]
        if lacking:
            raise CorruptFile(f'{mp}: field "{lacking[0]}" is missing: a dense set needs '
                              '"rows" and "cols" (or "shape")', hint=hint)
        rows, ncols = int(meta["rows"]), int(meta["cols"])
        shape = [rows, ncols]
        dims_note = f'rows and cols from {mp}'
    if cols_arg is not None and cols_arg != ncols:
        raise InvalidArgument(f"--cols {cols_arg}: {mp} says this dense set has {ncols} "
                              "columns", hint="leave out --cols for a dense set")
    declared = declared_arrays(meta)
    if array not in declared:
        raise _no_array(mp, array, declared)
    vp = f"{prefix}.{array}"
    vfield = "dtypes.value" if array == "value" else "state.dtype"
    if not os.path.exists(vp):
        raise NotFound(f"missing file {vp}", hint="a dense set is PREFIX.value (plus "
                       "PREFIX.state0, ... as its .meta declares) and PREFIX.meta")
    if not os.path.isfile(vp):
        raise CorruptFile(f"{vp}: not a regular file")
    size = os.path.getsize(vp)
    want = rows * ncols
    meta_dt = (meta.get("dtypes") or {}).get("value") if array == "value" \
        else meta["state"].get("dtype")
    inferred: dict[str, str] = {}
    if given.get("value") is not None:
        vdt, vsrc, note = str(given["value"]), "argument", f"{array} dtype {given['value']} as given"
    elif meta_dt is not None:
        vdt, vsrc, note = meta_dt, "meta", f"{array} dtype {meta_dt} from {mp}"
    else:
        dividing = [d for d in ("float32", "float64") if size % _itemsize(d) == 0]
        if not dividing:
            raise _truncated(vp, size, ("float32", "float64"),
                             f"{array} dtype inferred; pass --value-dtype, e.g. for "
                             "int8/int32/float16 values")
        matching = [d for d in dividing if size // _itemsize(d) == want]
        vdt, vsrc = (matching or dividing)[0], "inferred"
        n = size // _itemsize(vdt)
        inferred["value"] = (f"{vdt}: {size} bytes = {_n(n, 'entry', 'entries')} of "
                             f"{_itemsize(vdt)} bytes"
                             + (" = rows * cols" if matching else
                                f"; no candidate gives rows * cols = {want}"))
        note = f"{array} dtype {vdt} inferred; pass --value-dtype to override"
    # what numpy can address: rowcnt's rows + 1 entries (len() of its ImplicitIndex), and
    # the array of the tensor shape (to_numpy) and of rows x cols (a .npy): numpy leaves a
    # 0 axis out of its size check, so with one an empty .value fits any other axes (a
    # dense 2**70 x 0 set read "ok", then dump --format summary, convert to .npy and
    # to_numpy() raised OverflowError / ValueError)
    extent = max(_axes_bytes(shape, vdt), _axes_bytes((rows, ncols), vdt))
    if rows + 1 > _MAX_EXTENT or extent > _MAX_EXTENT:
        raise CorruptFile(f"{mp}: a dense {rows} x {ncols} set (shape "
                          f"{json.dumps(list(shape))[:200]}) of {vdt} is larger than an array "
                          f"can be ({extent} bytes with its empty axes left out, and rows + 1 "
                          f"entries of rowcnt; numpy addresses at most 2**63 - 1)", hint=hint)
    if size % _itemsize(vdt):
        raise _truncated(vp, size, (vdt,), note)
    count = size // _itemsize(vdt)
    if count != want:
        alts = [a for a in VALUE_DTYPES if a != vdt and _count_fits(size, (a,), want)]
        other = ""
        if vsrc == "meta" and alts:
            if count < want:  # a truncated file, or a .meta naming too wide a dtype
                other = (f"; or, if {vp} is whole, its values are {' or '.join(alts)} and "
                         f'field "{vfield}" of {mp} is wrong')
            else:  # a file cannot grow by truncation: the .meta is wrong
                raise CorruptFile(
                    f'{mp}: field "{vfield}" = "{vdt}" disagrees with {vp}: {size} bytes = '
                    f"{count} {vdt} entries, but {want} are expected "
                    f"({' or '.join(alts)} would fit)", hint=hint)
        if vsrc == "inferred" and want > 0 and size % want == 0:
            fits = [d for d in VALUE_DTYPES if _itemsize(d) == size // want]
            if fits:
                raise CorruptFile(
                    f"{vp}: position {min(count, want)}: {count} values read as {vdt} "
                    f"(inferred), but a dense {rows} x {ncols} set has rows * cols = {want}; "
                    f"{size} bytes = {want} values of {size // want} "
                    f"byte{'s' if size // want != 1 else ''}: pass --value-dtype "
                    f"{' or '.join(fits)}")
        raise CorruptFile(f"{vp}: position {min(count, want)}: {count} {vdt} values, but a "
                          f"dense {rows} x {ncols} set has rows * cols = {want} "
                          f"({dims_note}){other}",
                          hint="rewrite the set, or fix rows/cols/shape in its .meta")
    if "nnz" in meta and meta["nnz"] != want:
        raise CorruptFile(f'{mp}: field "nnz" = {meta["nnz"]} disagrees with rows * cols = '
                          f"{rows} x {ncols} = {want}", hint=hint)
    value = _open_array(vp, vdt, size, mmap)
    rowcnt, colidx = implicit_structure(rows, ncols)
    dtypes = {"rowcnt": rowcnt.dtype.name, "colidx": colidx.dtype.name, "value": vdt}
    sources = {"rowcnt": "implicit", "colidx": "implicit", "value": vsrc, "cols": "meta"}
    return MatrixSet(CSR(cast(Any, rowcnt), cast(Any, colidx), value), rows, ncols, dtypes,
                     inferred, meta, prefix, sources, "dense", tuple(int(x) for x in shape),
                     array, declared)


def validate(prefix: str | os.PathLike[str], *, rowcnt_dtype: str | None = None,
             colidx_dtype: str | None = None, value_dtype: str | None = None,
             cols: int | None = None, array: str | None = None) -> MatrixSet:
    """Fully validate a file set; return it (memory-mapped) or raise :class:`CorruptFile`
    / :class:`NotFound` with a one-line message naming file, position and defect.

    Cost: one chunked pass over rowcnt and one over colidx, O(CHUNK) memory (a dense
    set: O(1), its structure is implicit).  See :func:`validate_all` for the state
    arrays too.
    """
    return read_csr(prefix, rowcnt_dtype=rowcnt_dtype, colidx_dtype=colidx_dtype,
                    value_dtype=value_dtype, cols=cols, mmap=True, check=True, array=array)


def validate_all(prefix: str | os.PathLike[str], **flags: Any) -> list[MatrixSet]:
    """Validate the values and every optimizer state array the ``.meta`` declares
    (``state0``, ...); return one :class:`MatrixSet` per array, values first.
    ``flags`` are :func:`read_csr`'s dtype/cols arguments; ``value_dtype`` applies to
    the values only.  Cost: :func:`validate` of the values, then O(1) checks per state
    array (the structure is shared)."""
    first = validate(prefix, **flags)
    out = [first]
    rest = {k: v for k, v in flags.items() if k != "value_dtype"}
    for name in first.arrays[1:]:
        out.append(read_csr(first.prefix or prefix, array=name, check=False,
                            **{**rest, "cols": first.cols}))
    return out


# ----------------------------------------------------------------------------- writing

def host_id() -> str:
    """8 hex digits naming where this process's pids mean something: this machine's boot
    (``/proc/sys/kernel/random/boot_id``) and PID namespace (the inode of
    ``/proc/self/ns/pid``), hashed; the host name stands in for either when it cannot
    be read.  Writers put it in their temporary names, so that a directory shared by
    several hosts or containers (NFS, a shared volume) tells whose temporary is whose:
    only this host's are judged dead or alive, by their pid.  Another boot of this
    machine is another host (its pids are gone, but nothing here says so).  O(1): one
    small read and one stat."""
    parts: list[str] = []
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            parts.append(f.read().strip())
    except (OSError, ValueError):
        parts.append("")
    try:
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        parts.append("")
    if not all(parts):
        parts.append(socket.gethostname())
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:8]


#: What :func:`_tmp_name` writes, read back: NAME, the writer's host, its PID, 8 hex
#: digits.
_TMP_NAME = re.compile(r"\.(.+)\.tmp-([0-9a-f]{8})-([1-9][0-9]*)-([0-9a-f]{8})",
                       re.DOTALL)   # (a NAME may hold any character but "/")


def _tmp_name(name: str, host: str, pid: int, token: str) -> str:
    """``.NAME.tmp-HOST-PID-TOKEN``: the one form of every hidden temporary file a
    writer makes beside ``NAME`` before renaming it there (:func:`temporary_path`), and
    the only form :func:`remove_dead_temporaries` ever removes."""
    return f".{name}.tmp-{host}-{pid}-{token}"


def temporary_path(final: str) -> str:
    """Where this process writes ``final`` before renaming it there: the hidden
    ``.NAME.tmp-HOST-PID-HEX`` beside it (NAME = ``final``'s file name, HOST =
    :func:`host_id`, HEX = 8 random hex digits).  O(1)."""
    directory, name = os.path.split(final)
    return os.path.join(directory,
                        _tmp_name(name, host_id(), os.getpid(), secrets.token_hex(4)))


def remove_dead_temporaries(directory: str, owns: Callable[[str], bool]) -> None:
    """Remove the temporary files that writers of this host killed before they could
    clean up (SIGKILL) left in ``directory``: names exactly of :func:`temporary_path`'s
    form whose NAME ``owns(NAME)`` accepts, whose HOST is this one (:func:`host_id`),
    whose PID is no live process (nor this one: another thread may be writing), and
    that are regular files owned by this user.  Anything else (a look-alike name, the
    name without a host part that earlier versions wrote, another host's file whatever
    its pid, a live writer's file, a directory, a symlink, another user's file) is left
    alone, and so is any error (best effort: the caller's own write is what matters).
    O(entries in ``directory``)."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    here = host_id()
    for n in entries:
        m = _TMP_NAME.fullmatch(n)
        # only what _tmp_name writes, for a NAME the caller writes
        if (m is None or _tmp_name(m[1], m[2], int(m[3]), m[4]) != n or not owns(m[1])
                or m[2] != here):  # another host's: its pid means nothing here
            continue
        pid = int(m[3])
        if pid == os.getpid() or pid_alive(pid):
            continue
        full = os.path.join(directory, n)
        try:
            st = os.lstat(full)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(full)
        except OSError:
            pass


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this PID namespace may exist: ``kill(pid, 0)``, any
    answer but ESRCH taken for alive (EPERM: another user's; a pid too large for a
    pid_t: no writer's, left alone).  Meaningful only for a pid this host wrote
    (:func:`host_id`).  O(1)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        pass
    return True


def _set_member(base: str) -> Callable[[str], bool]:
    """Whether a file name is ``base.A`` for an array or ``.meta`` of a file set, or
    its replacement journal ``.base.replacing``."""
    def owns(name: str) -> bool:
        if name == f".{base}.replacing":
            return True
        head, dot, array = name.rpartition(".")
        return head == base and bool(dot) and (array in ("rowcnt", "colidx", "meta")
                                               or _ARRAY_NAME.fullmatch(array) is not None)
    return owns


#: a reader (or writer) of a set that a live writer is replacing waits this long for
#: it to finish its renames (milliseconds, normally) before it gives up (s)
REPLACE_WAIT_S = 10.0
#: a journal is a few hundred bytes; a larger file under its name is not one
_JOURNAL_MAX_BYTES = 1 << 16
#: the journals this process is committing (SetWriter.commit), by absolute path, and
#: how many of its threads are (two may write one set): a reader thread of this
#: process must wait for them, not finish them under the writer
_COMMITTING: dict[str, int] = {}
_COMMITTING_LOCK = threading.Lock()


def journal_path(prefix: str | os.PathLike[str]) -> str:
    """The replacement journal of set ``prefix``: ``.BASE.replacing`` beside its files.
    It exists only while a writer renames the set's new files over the old ones
    (:meth:`SetWriter.commit`), or after one was killed doing so."""
    directory, base = os.path.split(os.fspath(prefix))
    return os.path.join(directory, f".{base}.replacing")


def lock_path(prefix: str | os.PathLike[str]) -> str:
    """The lock file of set ``prefix``: ``.BASE.lock`` beside its files, empty.  A
    writer holds a write lock on it (an open file description lock, ``F_OFD_SETLK``)
    from before it puts its journal in place until after it removed it, so writers of
    the set on any hosts that share the directory take turns at their renames, and a
    reader that finds another host's journal waits for a read lock: once it has one,
    that journal's writer is gone.  Made by the first writer, and kept (removing a
    lock file some process may hold or wait for would let a third one lock a new file
    of that name meanwhile)."""
    directory, base = os.path.split(os.fspath(prefix))
    return os.path.join(directory, f".{base}.lock")


#: whether this process said that file locks do not work where it wrote a set
_LOCKS_WARNED = False
#: errors of a lock request that mean the filesystem (or the system) has no working
#: locks, not that another process holds it
_NO_LOCKS = frozenset({errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP,
                       errno.ENOSYS})


def _no_locks(path: str, exc: OSError) -> None:
    global _LOCKS_WARNED
    if not _LOCKS_WARNED:
        _LOCKS_WARNED = True
        warnings.warn(f"{path}: file locks do not work here ({exc}): writers of a set "
                      "on different hosts sharing this directory are not kept apart "
                      "(see docs/file-format.md, Writing)", RuntimeWarning, stacklevel=4)


def _holder(prefix: str) -> str:
    """Who the set's journal says is replacing it, for a message.  O(1)."""
    try:
        j = _read_journal(journal_path(prefix), os.path.basename(prefix))
    except (OSError, CorruptFile):
        return "another writer of this set (its journal is gone)"
    if j.host != host_id():
        return f"a writer on another host ({j.host}, pid {j.token >> 32})"
    return f"a writer of this host (pid {j.token >> 32})"


def _lock_set(prefix: str, exclusive: bool, deadline: float) -> int | None:
    """A descriptor holding the lock of set ``prefix`` (:func:`lock_path`): a write lock
    (``exclusive``, the file made if missing) or a read lock, waited for until
    ``deadline`` (polled every 1 to 20 ms), then :class:`Timeout`.  None where locks do
    not work (the lock file cannot be made or opened, or the filesystem refuses locks:
    NFS without lockd): a writer warns once per process (:data:`_LOCKS_WARNED`), a
    reader goes on as it would without locks.  Closing the descriptor unlocks; the
    kernel does when the process dies.  O(1) but the wait."""
    path = lock_path(prefix)
    try:
        fd = os.open(path, (os.O_RDWR | os.O_CREAT if exclusive else os.O_RDONLY)
                     | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exclusive:
            _no_locks(path, exc)
        return None
    # struct flock of 64-bit Linux: type, whence, start, len (0: the whole file), pid
    # (0: required for open file description locks), padding
    lk = struct.pack("@hhqqi4x", _fcntl.F_WRLCK if exclusive else _fcntl.F_RDLCK,
                     os.SEEK_SET, 0, 0, 0)
    delay = 0.001
    try:
        cmd = getattr(_fcntl, "F_OFD_SETLK", None) if struct.calcsize("P") == 8 else None
        while True:
            if cmd is None:
                raise OSError(errno.ENOSYS, "no open file description locks on this "
                                            "platform (64-bit Linux has them)")
            try:
                _fcntl.fcntl(fd, cmd, lk)
                return fd
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() > deadline:
                raise Timeout(
                    f"{prefix}: {_holder(prefix)} has held {path} for more than "
                    f"{REPLACE_WAIT_S:g} s (a writer holds it while it renames the "
                    "set's new files: milliseconds)",
                    hint="wait for the write of this set to end, then try again; if no "
                         "writer of it runs on any host sharing the directory, a stuck "
                         "process or a lost NFS client holds the lock: end it")
            time.sleep(delay)
            delay = min(2 * delay, 0.02)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in _NO_LOCKS:
            raise
        if exclusive:
            _no_locks(path, exc)
        return None
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def _set_lock(prefix: str, *, exclusive: bool, deadline: float) -> Iterator[bool]:
    """Hold set ``prefix``'s lock (:func:`_lock_set`) inside ``with``; the value is
    whether it is held (False: locks do not work here)."""
    fd = _lock_set(prefix, exclusive, deadline)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)


def _machine_boot() -> tuple[str, str]:
    """(this machine's id, this boot's id), "" where unreadable: a journal of this
    machine from another boot is a dead writer's, whatever its host id says."""
    out = []
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(path, encoding="ascii") as f:
                out.append(f.read(64).strip())
        except (OSError, ValueError):
            out.append("")
    return out[0], out[1]


@dataclass
class _Journal:
    host: str          # host_id() of the writer
    machine: str       # its machine id and boot id ("" unknown)
    boot: str
    token: int         # the writer process's token (pid and start time: _native.token)
    renames: list      # [(temporary, final, inode of the temporary)], in rename order
    stamp: tuple       # (inode, mtime_ns, size) of the journal file read
    uid: int           # its owner


def _read_journal(path: str, base: str) -> _Journal:
    """The journal at ``path`` for set ``base``, every name checked to be one of that
    set's (a journal cannot rename anything else).  FileNotFoundError if it is gone;
    CorruptFile if it is not such a journal.  O(size)."""
    hint = ("it is not one this library wrote: remove it, then check the set (its files "
            "may be a mix of two versions) or write it again")
    st = os.lstat(path)
    if stat.S_ISREG(st.st_mode) and st.st_size > _JOURNAL_MAX_BYTES:
        raise CorruptFile(f"{path}: {st.st_size:,} bytes, too large for a replacement "
                          "journal", hint=hint)
    j = load_json(path, hint)   # (not a regular file, unparsable: CorruptFile)
    try:
        host, machine, boot, token, pairs = (j["host"], j["machine"], j["boot"], j["token"],
                                             j["renames"])
        if (not isinstance(host, str) or not isinstance(machine, str)
                or not isinstance(boot, str) or not _is_int(token)
                or not 0 < token < 2**64 or not isinstance(pairs, list)
                or not 0 < len(pairs) <= 64):
            raise ValueError
        owns = _set_member(base)
        renames = []
        for tmp, final, ino in pairs:
            m = _TMP_NAME.fullmatch(tmp) if isinstance(tmp, str) else None
            if (m is None or m[1] != final or not owns(final) or not _is_int(ino)
                    or final == f".{base}.replacing" or os.sep in tmp):
                raise ValueError
            renames.append((tmp, final, int(ino)))
    except (ValueError, TypeError, KeyError):
        raise CorruptFile(f"{path}: not a replacement journal of {base}", hint=hint) from None
    return _Journal(host, machine, boot, int(token), renames,
                    (st.st_ino, st.st_mtime_ns, st.st_size), st.st_uid)


def _same_file(path: str, stamp: tuple) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return (st.st_ino, st.st_mtime_ns, st.st_size) == stamp


def finish_replacement(prefix: str | os.PathLike[str], *, any_host: bool = False,
                       writer_gone: bool = False) -> str:
    """Finish the replacement of set ``prefix`` that a writer left half done: rename
    the new files its journal lists that are still under their temporary names over
    the final ones, in the journal's order, then remove the journal.  The new files
    were complete and fsynced before the journal was written (:meth:`SetWriter.commit`),
    so the set becomes the new one, whole.

    Returns ``"none"`` (no journal), ``"finished"`` (or nothing was left to rename),
    ``"live"`` (the writer is a live process of this host, or a thread of this one,
    renaming now or about to remove its journal: nothing done), ``"other-host"`` (the writer is of another host, whose
    processes cannot be judged from here, or of another user: nothing done unless
    ``any_host``, for ``shmps-tool check --finish`` once no writer of the set runs
    anywhere), or ``"lost"`` (a new file the journal lists is neither under its
    temporary name nor under its final one: something removed it, and the set may be a
    mix; the journal stays, and a writer of the set replaces it).  ``writer_gone``: the
    caller holds the set's lock (:func:`lock_path`), so another host's writer of this
    user that left the journal is not running (a writer holds the lock from before its
    journal is there until after it is gone): its replacement is finished too.
    Several processes may finish one replacement at once.  CorruptFile for a journal
    that is not one, or a rename refused (a directory this user cannot write).
    O(files)."""
    check_flag(any_host, "any_host")
    check_flag(writer_gone, "writer_gone")
    prefix = os.fspath(prefix)
    directory, base = os.path.split(prefix)
    d = directory or "."
    jp = journal_path(prefix)
    try:
        j = _read_journal(jp, base)
    except FileNotFoundError:
        return "none"   # (none, or finished meanwhile by the writer or another reader)
    pending = [t for t, _, _ in j.renames if os.path.lexists(os.path.join(d, t))]
    if not any_host:
        if j.host == host_id():
            if j.token == _native.token():
                with _COMMITTING_LOCK:
                    live = _COMMITTING.get(os.path.abspath(jp), 0) > 0
            else:
                live = _native.token_alive(j.token)
            if live:   # (renaming, or done and about to remove its journal)
                return "live"
        elif pending and not writer_gone:
            machine, boot = _machine_boot()
            if not (j.machine and j.machine == machine and j.boot != boot):
                return "other-host"   # (of this machine's earlier boot: dead, finished)
        if pending and j.uid != os.geteuid():
            return "other-host"
    euid = os.geteuid()
    lost = []
    try:
        for tmp, final, ino in j.renames:
            tp, fp = os.path.join(d, tmp), os.path.join(d, final)
            try:
                st = os.lstat(tp)
            except FileNotFoundError:
                try:   # renamed already, by the writer or another finisher, or gone
                    if os.lstat(fp).st_ino != ino:
                        lost.append(final)
                except FileNotFoundError:
                    lost.append(final)
                continue
            if not (stat.S_ISREG(st.st_mode) and st.st_ino == ino and st.st_uid == euid):
                lost.append(final)
                continue
            try:
                os.replace(tp, fp)
            except FileNotFoundError:
                pass   # (another finisher took it meanwhile)
        if lost:
            # (a journal finished and removed meanwhile by another process, the set
            # written again since, is no loss)
            return "lost" if _same_file(jp, j.stamp) else "none"
        fsync_dir(d)
        if _same_file(jp, j.stamp):   # (not a newer writer's journal)
            try:
                os.unlink(jp)
            except FileNotFoundError:
                pass
    except OSError as exc:
        raise CorruptFile(f"{prefix}: a writer (pid {j.token >> 32}) was killed while it "
                          f"replaced this set's files, and finishing it failed: {exc}",
                          hint=f"finish it as a user who can write {d}: "
                               f"shmps-tool check --finish {prefix}") from None
    return "finished"


def _await_writer(prefix: str | os.PathLike[str], deadline: float) -> str:
    """:func:`finish_replacement` of ``prefix`` again every 5 ms while a live writer of
    this host holds its journal, and its last answer; CorruptFile past ``deadline``.
    The one wait of readers and writers for another writer's renames."""
    while True:
        how = finish_replacement(prefix)
        if how != "live":
            return how
        if time.monotonic() > deadline:
            raise CorruptFile(
                f"{prefix}: a writer of this host is still replacing this set's files "
                f"after {REPLACE_WAIT_S:g} s ({journal_path(prefix)})",
                hint="wait for the conversion or write of this set to end; if none is "
                     f"running, finish it: shmps-tool check --finish {prefix}")
        time.sleep(0.005)


def settle_replacement(prefix: str | os.PathLike[str]) -> None:
    """Before reading set ``prefix``: if a writer left it half replaced (killed between
    two renames), finish that (:func:`finish_replacement`); if a live one is renaming,
    wait for it (up to REPLACE_WAIT_S, then CorruptFile, or :class:`Timeout` for the
    set's lock).  Another host's writer is waited for by a read lock of the set
    (:func:`lock_path`), which it holds while renaming: once it is had, a journal still
    there is a killed writer's, finished.  A set that another host's writer is
    replacing where locks do not work (or another user's), or whose replacement lost a
    file, raises CorruptFile saying what to do.  O(1) (one stat) when no replacement is
    under way.  A read that overlaps a writer that starts
    after this is caught and done again by :func:`_consistent_read`."""
    deadline = time.monotonic() + REPLACE_WAIT_S
    how = _await_writer(prefix, deadline)
    if how == "other-host":
        # another host's writer: renaming now if it holds the set's lock, else gone
        with _set_lock(os.fspath(prefix), exclusive=False, deadline=deadline) as locked:
            if locked:
                how = finish_replacement(prefix, writer_gone=True)
        if how == "live":   # (a writer of this host that does not lock came meanwhile)
            how = _await_writer(prefix, deadline)
    jp = journal_path(prefix)
    if how == "other-host":
        raise CorruptFile(
            f"{prefix}: a writer on another host (or of another user) is replacing this "
            f"set or was killed while it did ({jp}); its files may be a mix of old and "
            "new ones",
            hint=f"once no writer of {prefix} runs on the hosts sharing this directory, "
                 f"finish the replacement: shmps-tool check --finish {prefix}")
    if how == "lost":
        raise CorruptFile(
            f"{prefix}: a replacement of this set was interrupted and one of its new "
            f"files is gone ({jp} lists it): the set may be a mix of two versions",
            hint=f"write the set again (that replaces {jp})")


def fsync_dir(directory: str) -> None:
    """fsync ``directory`` itself: the names created, renamed or removed in it are
    durable (a file's own fsync covers its bytes, not its name).  O(1)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: the hint of an integer that the dtype it is written in cannot hold (check_held)
HELD_HINT = ("write it in a wider dtype (shmps-tool convert --dtype, value_dtype=), or fix "
             "the value")


def check_held(a: np.ndarray, dtype: Any, what: str, offset: int = 0,
               where: Callable[[int], str] | None = None, hint: str = HELD_HINT) -> None:
    """Raise InvalidArgument if integer array ``a`` holds a value that integer ``dtype``
    cannot: numpy's cast wraps it (300 into int8 is 44, 2**40 into int32 is 0), and a
    file written so holds another number than the one given.  ``what`` names the array
    (a file, an argument); the message gives ``where(i)`` for the flat index ``i`` of
    the first such value, by default ``position offset + i``.  Any other cast (one that
    is safe, a float one: a float beyond the dtype is inf, as documented) passes.
    Cost: one comparison pass over ``a`` when the cast narrows an integer dtype."""
    dt = np.dtype(dtype)
    a = np.asarray(a)
    if (dt.kind not in "iu" or a.dtype.kind not in "iu" or a.size == 0
            or np.can_cast(a.dtype, dt, casting="safe")):
        return
    info = np.iinfo(dt)
    bad = (a < info.min) | (a > info.max)
    if not bad.any():
        return
    i = int(np.argmax(bad.reshape(-1)))
    place = where(i) if where is not None else f"position {offset + i}"
    raise InvalidArgument(f"{what}: {place}: value {int(a.reshape(-1)[i])} cannot be stored "
                          f"in {dt.name} (range {info.min} .. {info.max}; a cast would wrap "
                          f"it to {int(a.reshape(-1)[i:i + 1].astype(dt)[0])})", hint=hint)


class SetWriter:
    """Streams the three arrays of a file set to hidden temporary files beside
    ``prefix`` (``.X.value.tmp-HOST-PID-HEX``, :func:`temporary_path`), then :meth:`commit`
    replaces the set as a whole: it fsyncs every new file, ``.meta`` included, writes a
    journal listing the renames (:func:`journal_path`), renames each new file over its
    final name, and removes the journal.  A writer killed between two renames leaves the
    journal: the next reader or writer of ``prefix`` finishes the renames
    (:func:`settle_replacement`), so no one reads a mix of old and new files.  Writers
    of ``prefix`` on different hosts sharing the directory take turns at their renames
    by the set's lock (:func:`lock_path`).  On an exception inside ``with`` before the
    journal (Ctrl-C included) the temporaries are removed (after it, the renames are
    finished); those of a writer of ``prefix`` killed outright (SIGKILL) before its
    journal are removed by the next SetWriter of ``prefix`` on the same host
    (:func:`remove_dead_temporaries`, :func:`host_id`).

    Cost: the bytes written plus six fsyncs, and one listing of the directory;
    O(CHUNK) memory per :meth:`append`.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtypes: Mapping[str, str]) -> None:
        self.prefix = os.fspath(prefix)
        # the arrays written are dtypes' keys: rowcnt/colidx/value for a csr set,
        # value (+ state0, ...) for a dense one
        self.dtypes = {k: _le(v) for k, v in dtypes.items()}
        self.counts = {k: 0 for k in self.dtypes}
        directory = os.path.dirname(self.prefix) or "."
        if not os.path.isdir(directory):
            raise NotFound(f"{directory}: no such directory",
                           hint="create the directory first")
        # a replacement a writer of this host left half done is finished first (its
        # new files are temporaries of a dead writer, which the removal below would
        # take, leaving the mix); another host's journal this commit's replaces
        # (another host's or a lost replacement's journal: this commit's replaces it)
        _await_writer(self.prefix, time.monotonic() + REPLACE_WAIT_S)
        remove_dead_temporaries(directory, _set_member(os.path.basename(self.prefix)))
        self._tmp = {k: temporary_path(f"{self.prefix}.{k}")
                     for k in (*self.dtypes, "meta")}
        self._dir = directory
        self._files: dict[str, Any] = {}
        try:
            for k in self.dtypes:
                self._files[k] = open(self._tmp[k], "xb")
        except BaseException:
            self.abort()
            raise

    def __enter__(self) -> SetWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()

    def append(self, kind: str, arr: np.ndarray, source: str | None = None) -> int:
        """Append ``arr`` (cast to the file dtype) to array ``kind``; return bytes
        written.  An integer the file dtype cannot hold raises InvalidArgument naming
        ``source`` (default ``kind``) and its position (:func:`check_held`), and the
        writer's context then removes its temporaries: nothing is replaced.
        O(len(arr)) time, O(CHUNK) extra memory."""
        dt = self.dtypes[kind]
        f = self._files[kind]
        n = len(arr)
        for s in range(0, n, CHUNK):
            part = arr[s:s + CHUNK]
            check_held(part, dt, source or kind, self.counts[kind] + s)
            f.write(np.ascontiguousarray(part, dtype=dt).data)
        self.counts[kind] += n
        return n * dt.itemsize

    def commit(self, meta: Mapping[str, Any]) -> None:
        """Write ``.meta`` beside the arrays, fsync every new file, write the journal
        (fsynced, with the directory), rename the arrays then ``.meta`` over their final
        names, fsync the directory and remove the journal.  Once the journal is in
        place the replacement is finished whatever happens: here if an exception
        interrupts the renames, else by the next reader or writer
        (:func:`settle_replacement`).  From before the journal is in place until after
        it is removed the writer holds the set's lock (:func:`lock_path`; waited for up
        to REPLACE_WAIT_S, then :class:`Timeout`): writers of the set on every host
        sharing the directory take turns at their renames instead of interleaving them,
        and a journal found meanwhile is a killed writer's, finished first.  The journal
        is made with a hard link, which fails while another writer's is there: writers
        of this host take turns so even where locks do not work."""
        final = {k: f"{self.prefix}.{k}" for k in (*self.dtypes, "meta")}
        journal = journal_path(self.prefix)
        key = os.path.abspath(journal)
        journaled = counted = False
        jtmp = None
        held = contextlib.ExitStack()   # (the set's lock: released last)
        try:
            for k in self.dtypes:
                f = self._files.pop(k)
                f.flush()
                os.fsync(f.fileno())
                f.close()
            with open(self._tmp["meta"], "x", encoding="utf-8") as f:
                json.dump(meta, f, indent=1, sort_keys=False)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            machine, boot = _machine_boot()
            jtmp = temporary_path(journal)
            with open(jtmp, "x", encoding="utf-8") as f:
                json.dump({"host": host_id(), "machine": machine, "boot": boot,
                           "token": _native.token(),
                           "renames": [[os.path.basename(self._tmp[k]),
                                        os.path.basename(final[k]),
                                        os.stat(self._tmp[k]).st_ino] for k in final]}, f)
                f.flush()
                os.fsync(f.fileno())
            # writers of the set on every host take turns from here until the journal
            # is gone (a live one holds the lock; a killed one's journal is finished)
            locked = held.enter_context(_set_lock(
                self.prefix, exclusive=True, deadline=time.monotonic() + REPLACE_WAIT_S))
            with _COMMITTING_LOCK:
                _COMMITTING[key] = _COMMITTING.get(key, 0) + 1
                counted = True
            self._place_journal(jtmp, journal, locked)
            jtmp = None
            st = os.lstat(journal)
            fsync_dir(self._dir)
            journaled = True
            for k in final:
                os.replace(self._tmp[k], final[k])
            fsync_dir(self._dir)
            if _same_file(journal, (st.st_ino, st.st_mtime_ns, st.st_size)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(journal)
        except BaseException:
            if jtmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(jtmp)
            if journaled:
                # the new files are whole: finish the renames rather than leave a mix
                # (if that fails too, the journal stays for the next reader or writer)
                with contextlib.suppress(OSError, CorruptFile):
                    finish_replacement(self.prefix, any_host=True)
            else:
                self.abort()
            raise
        finally:
            if counted:
                with _COMMITTING_LOCK:
                    if _COMMITTING[key] > 1:
                        _COMMITTING[key] -= 1
                    else:
                        del _COMMITTING[key]
            held.close()

    def _place_journal(self, jtmp: str, journal: str, locked: bool) -> None:
        """Give the written journal ``jtmp`` its name ``journal``: a hard link, refused
        while a journal is there; then that one is finished or waited for (another
        writer's renames), or replaced (a lost replacement's, or another host's when
        the set's lock is not ``locked``: no working locks here).  Holding the lock,
        another host's journal is a killed writer's: it is finished."""
        deadline = time.monotonic() + REPLACE_WAIT_S
        while True:
            try:
                os.link(jtmp, journal)
            except FileExistsError:   # (waits for a live writer's renames)
                how = _await_writer(self.prefix, deadline)
                if how == "other-host" and locked:
                    how = finish_replacement(self.prefix, writer_gone=True)
                if how in ("other-host", "lost"):
                    os.replace(jtmp, journal)
                    return
                continue
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP,
                                     errno.EXDEV, errno.EMLINK):
                    raise
                os.replace(jtmp, journal)   # (no hard links here: the rename, unguarded)
                return
            os.unlink(jtmp)
            return

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
    so memmapped inputs of any size are fine.  On a terminal each pass of at least
    :data:`PROGRESS_MIN_BYTES` shows a progress bar (``check PREFIX``, ``write PREFIX``).
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
    cols = check_int(cols, "cols", 0, none=True)   # (np.int64(4) was refused)
    c = CSR(arrs[0], arrs[1], arrs[2])
    name = os.fspath(prefix)
    ncols, _ = _check_structure(c, cols=cols, names={k: k for k in ARRAYS},
                                exc=InvalidArgument, cols_note="as given", full=True,
                                desc=f"check {name}")
    dtypes = {"rowcnt": rdt, "colidx": cdt, "value": vdt}
    full_meta = build_meta(c.rows, ncols, c.nnz, dtypes, meta)
    _write_arrays(prefix, dtypes, dict(zip(ARRAYS, c)), full_meta, f"write {name}")
    return full_meta


def _write_arrays(prefix: str | os.PathLike[str], dtypes: Mapping[str, str],
                  arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any],
                  desc: str) -> None:
    """Write ``arrays`` (by name, 1-d) as the set ``prefix`` with ``meta``
    (:class:`SetWriter`), in chunks, under a progress bar ``desc`` of the bytes written
    (:func:`progress_bar`; the commit's fsyncs and renames come after it is full)."""
    total = sum(len(a) * np.dtype(dtypes[k]).itemsize for k, a in arrays.items())
    with progress_bar(total, desc) as bar, SetWriter(prefix, dtypes) as w:
        for k, a in arrays.items():
            for s in range(0, len(a), CHUNK):
                bar.update(w.append(k, a[s:s + CHUNK]))
        w.commit(meta)


def write_dense(prefix: str | os.PathLike[str], values: np.ndarray, *,
                states: Sequence[np.ndarray] = (), meta: Mapping[str, Any] | None = None,
                value_dtype: str | None = None) -> dict[str, Any]:
    """Write ``values`` as a dense set: ``prefix.value`` (row-major, ``rows * cols``
    values; rows = first axis, cols = product of the others), ``prefix.state0``, ...
    for ``states`` (each of ``values``' size; float32 or float64, the dtype of the
    first), and ``prefix.meta`` (``kind`` ``"dense"``, ``rows``, ``cols``, ``nnz``,
    ``shape``, ``dtypes.value``, and ``state`` when there are states; then ``meta``'s
    other keys).  No ``.rowcnt``/``.colidx`` (the structure is implicit).  Each file is
    written to a temporary name, fsynced and renamed; ``.meta`` last.  Returns the meta.

    Cost: the bytes written, O(CHUNK) extra memory; a progress bar (``write PREFIX``)
    on a terminal from :data:`PROGRESS_MIN_BYTES` written."""
    a = np.asarray(values)
    shape = [int(x) for x in a.shape]
    rows, cols = dense_dims(shape)
    src = np.dtype(a.dtype)
    vdt = value_dtype or src.name
    if vdt not in VALUE_DTYPES:
        raise InvalidArgument(f"value: dtype {vdt} is not a file dtype "
                              f"({', '.join(VALUE_DTYPES)}); pass value_dtype=")
    if not np.can_cast(src, vdt, casting="same_kind"):
        raise InvalidArgument(f"value: cannot cast {src} to {vdt} (numpy same_kind rule)")
    sts = [np.asarray(x) for x in states]
    sdt = sts[0].dtype.name if sts else None
    for k, x in enumerate(sts):
        if x.size != a.size:
            raise InvalidArgument(f"state{k}: {x.size} values, the tensor has {a.size}")
        if x.dtype.name not in ("float32", "float64") or x.dtype.name != sdt:
            raise InvalidArgument(f"state{k}: dtype {x.dtype} (states are float32 or "
                                  f"float64, all of one dtype: {sdt})")
    full: dict[str, Any] = {"version": FORMAT_VERSION, "kind": "dense", "rows": rows,
                            "cols": cols, "nnz": rows * cols, "shape": shape,
                            "dtypes": {"value": vdt}}
    if sts:
        full["state"] = {"count": len(sts), "dtype": sdt}
    for key, val in (meta or {}).items():
        if key in full and val != full[key]:
            raise InvalidArgument(f'meta key "{key}" = {val!r} disagrees with the arrays '
                                  f"({full[key]!r})")
        full.setdefault(key, val)
    try:
        json.dumps(full, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"meta is not JSON-serialisable: {exc}") from None
    dtypes = {"value": vdt, **{f"state{k}": str(sdt) for k in range(len(sts))}}
    arrays = {name: np.ascontiguousarray(x).reshape(-1)
              for name, x in (("value", a), *((f"state{i}", x) for i, x in enumerate(sts)))}
    _write_arrays(prefix, dtypes, arrays, full, f"write {os.fspath(prefix)}")
    return full


# ----------------------------------------------------------------------------- checkpoints

#: ``checkpoint.json``'s ``format`` and the newest ``version`` this reader knows.
CHECKPOINT_FORMAT = "shmps-checkpoint"
CHECKPOINT_VERSION = 1
CHECKPOINT_JSON = "checkpoint.json"
_CKPT_PREFIX = re.compile(r"t(0|[1-9][0-9]*)")
_CKPT_HINT = ("the checkpoint is damaged or was not written by shmps; use another "
              "checkpoint, or write a new one with shmps-tool checkpoint")


def read_checkpoint_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check ``path/checkpoint.json``, a checkpoint directory's table of
    contents (docs/checkpoints.md): ``{"format": "shmps-checkpoint", "version": 1,
    "store": NAME, "staleness": k or null (optional), "tensors": [{"prefix": "t0",
    "record": {...}, "step": N}, ...]}``.

    Checks the structure only (each tensor's files are checked when read): format and
    version, a valid store name, and per tensor a prefix ``tN`` (a plain file name,
    never a path), a record with a unique ``name``, a ``kind``, a file ``dtype`` and a
    ``shape`` of non-negative integers (dense) and an ``optimizer`` object.
    Raises :class:`NotFound` (no such directory) or :class:`CorruptFile` naming the
    field.  O(size of the JSON)."""
    from .names import check_name

    d = os.fspath(path)
    if not os.path.isdir(d):
        raise NotFound(f"no checkpoint directory {d}",
                       hint="pass the PATH given to shmps-tool checkpoint / store.checkpoint")
    fn = os.path.join(d, CHECKPOINT_JSON)
    try:
        doc = load_json(fn, _CKPT_HINT)
    except FileNotFoundError:
        raise CorruptFile(f"{fn}: missing: {d} is not a shmps checkpoint (an interrupted "
                          "checkpoint leaves only PATH.tmp-* directories, never PATH)",
                          hint=_CKPT_HINT) from None

    def bad(where: str, value: Any, why: str) -> CorruptFile:
        return CorruptFile(f'{fn}: field "{where}" = {json.dumps(value)[:80]} {why}',
                           hint=_CKPT_HINT)

    if not isinstance(doc, dict):
        raise CorruptFile(f"{fn}: expected a JSON object, found {type(doc).__name__}",
                          hint=_CKPT_HINT)
    if doc.get("format") != CHECKPOINT_FORMAT:
        raise bad("format", doc.get("format"), f'is not "{CHECKPOINT_FORMAT}"')
    ver: Any = doc.get("version")
    if not _is_int(ver) or ver < 1:
        raise bad("version", ver, "is not a format version (a positive integer)")
    if ver > CHECKPOINT_VERSION:
        raise bad("version", ver, f"is newer than this reader (version "
                                  f"{CHECKPOINT_VERSION}); upgrade shmps")
    try:
        check_name(doc.get("store"))
    except InvalidArgument:
        raise bad("store", doc.get("store"), "is not a store name") from None
    k = doc.get("staleness")
    if k is not None and (not _is_int(k) or not 0 <= k < 2**63):
        raise bad("staleness", k, "is not a staleness (null or an integer from 0 to 2^63-1)")
    tensors = doc.get("tensors")
    if not isinstance(tensors, list):
        raise bad("tensors", tensors, "is not a list")
    seen_prefix: set[str] = set()
    seen_name: set[str] = set()
    for i, e in enumerate(tensors):
        at = f"tensors[{i}]"
        if not isinstance(e, dict):
            raise bad(at, e, "is not an object")
        pre = e.get("prefix")
        if not isinstance(pre, str) or not _CKPT_PREFIX.fullmatch(pre) or pre in seen_prefix:
            raise bad(f"{at}.prefix", pre, "is not a unique file-set prefix tN")
        seen_prefix.add(pre)
        rec = e.get("record")
        if not isinstance(rec, dict):
            raise bad(f"{at}.record", rec, "is not an object")
        name = rec.get("name")
        if not isinstance(name, str) or not name or name in seen_name:
            raise bad(f"{at}.record.name", name, "is not a unique tensor name")
        seen_name.add(name)
        if not isinstance(rec.get("kind"), str):
            raise bad(f"{at}.record.kind", rec.get("kind"), "is not a tensor kind")
        if rec.get("dtype") not in VALUE_DTYPES:
            raise bad(f"{at}.record.dtype", rec.get("dtype"),
                      f"is not one of {', '.join(VALUE_DTYPES)}")
        shape = rec.get("shape")
        if rec["kind"] == "dense" and (not isinstance(shape, list) or
                                       not all(_is_int(x) and x >= 0 for x in shape)):
            raise bad(f"{at}.record.shape", shape, "is not a list of non-negative integers")
        if not isinstance(rec.get("optimizer"), dict):
            raise bad(f"{at}.record.optimizer", rec.get("optimizer"), "is not an object")
        step = e.get("step", 0)
        if not is_u64(step):
            raise bad(f"{at}.step", step, NOT_U64)
    return doc


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
    "ImplicitIndex", "implicit_structure", "read_dense", "write_dense", "validate_all",
    "dense_dims", "split_member", "declared_arrays", "KINDS", "read_checkpoint_manifest",
    "CHECKPOINT_FORMAT", "CHECKPOINT_VERSION", "CHECKPOINT_JSON",
    "build_meta", "paths", "normalize_prefix", "iter_chunks", "FORMAT_VERSION", "ARRAYS",
    "INDEX_DTYPES", "VALUE_DTYPES", "DEFAULT_DTYPES", "CHUNK", "MAX_STATE", "is_u64",
    "temporary_path", "remove_dead_temporaries", "host_id",
]
