"""Embedding tables: ``uint64`` keys -> rows of ``dim`` values, created on first touch.

A table is sharded by a hash of the key (splitmix64; the high bits choose the shard).
Each shard segment holds a lock-free open-addressing hash index, the rows, their
optimizer state, per-row step counts and per-row lock words; native/table.c has the
protocol and docs/tables.md the whole story (layout, hashing, init, capacity,
eviction).  Every method makes one C call per batch (``delete``/``evict``/``keys``: one
per shard) with the GIL released.

Sample usage::

    emb = store.table("emb", dim=64, capacity=10_000_000,
                      optimizer=shmps.Adagrad(lr=0.05), init=("normal", 0.0, 0.01))
    rows = emb.pull(keys)          # (len(keys), 64); new keys are created from their init
    emb.push(keys, grads)          # duplicate keys accumulate, exact per row
"""
from __future__ import annotations

import math
import threading
from typing import Any, Optional, Union

import numpy as np

from . import _native
from .checks import as_array, check_flag, check_int
from .errors import CapacityError, CorruptSegment, InvalidArgument, SchemaError
from .tensor import PushHandle, Tensor, bool_at, cast_grad, grad_dtype
from .updaters import Updater

lib = _native.lib
ffi = _native.ffi

MAX_SHARDS = int(lib.SHMPS_TABLE_MAX_SHARDS)
MAX_BATCH = int(lib.SHMPS_TABLE_MAX_BATCH)
#: default shard size: about this many bytes of values per shard segment
SHARD_BYTES = 64 << 20
INIT_KINDS = {"zeros": int(lib.SHMPS_INIT_ZEROS), "constant": int(lib.SHMPS_INIT_CONSTANT),
              "uniform": int(lib.SHMPS_INIT_UNIFORM), "normal": int(lib.SHMPS_INIT_NORMAL)}
_UINT64 = np.dtype(np.uint64)

InitLike = Union[None, float, int, str, tuple, list, dict]


# ---- creation helpers ----------------------------------------------------------------

def init_spec(init: InitLike, dtype: np.dtype) -> list:
    """Normalise ``init`` to ``[kind, *params]`` as stored in the catalog record.

    Accepted: ``None``/``"zeros"``, a number (constant), ``("constant", c)``,
    ``("uniform", a, b)``, ``("normal", mean, std)``, or the same as a dict
    ``{"kind": "normal", "mean": 0, "std": 0.01}``."""
    if init is None:
        return ["zeros"]
    if isinstance(init, dict):
        d = dict(init)
        kind = d.pop("kind", None)
        order = {"zeros": (), "constant": ("value",), "uniform": ("low", "high"),
                 "normal": ("mean", "std")}.get(str(kind))
        if order is None or set(d) != set(order):
            raise InvalidArgument(f"init={init!r}", "use {'kind': 'uniform', 'low': a, "
                                  "'high': b}, {'kind': 'normal', 'mean': m, 'std': s}, ...")
        init = (kind, *(d[k] for k in order))
    if isinstance(init, str):
        init = (init,)
    if isinstance(init, (bool, np.bool_)):
        raise InvalidArgument(f"init={init!r} is not a number")
    if isinstance(init, (int, float, np.integer, np.floating)):
        init = ("constant", init)
    if not isinstance(init, (tuple, list)) or not init or init[0] not in INIT_KINDS:
        raise InvalidArgument(f"init={init!r}", "use 'zeros', a number, ('constant', c), "
                              "('uniform', a, b) or ('normal', mean, std)")
    kind, params = init[0], list(init[1:])
    nparams = {"zeros": 0, "constant": 1, "uniform": 2, "normal": 2}[kind]
    if len(params) != nparams:
        raise InvalidArgument(f"init {kind!r} takes {nparams} parameter(s), got {params!r}")
    try:
        vals = [float(p) for p in params]
    except (TypeError, ValueError):
        raise InvalidArgument(f"init parameters {params!r} are not numbers") from None
    if not all(math.isfinite(v) for v in vals):
        raise InvalidArgument(f"init parameters {params!r} are not finite")
    if kind == "normal" and vals[1] < 0:
        raise InvalidArgument(f"init normal std={vals[1]} must be >= 0")
    if kind == "uniform" and vals[0] > vals[1]:
        raise InvalidArgument(f"init uniform({vals[0]}, {vals[1]}): low > high")
    if dtype.kind != "f":
        if kind in ("uniform", "normal"):
            raise SchemaError(f"init {kind!r} needs a float dtype, not {dtype}",
                              "use 'zeros' or an integer constant for integer tables")
        if kind == "constant":
            c = vals[0]
            info = np.iinfo(dtype)
            if c != int(c) or not info.min <= c <= info.max:
                raise SchemaError(f"init {c!r} cannot be stored in {dtype}",
                                  f"pass an integer within the range of {dtype}")
            vals = [float(int(c))]
    else:
        top = float(np.finfo(dtype).max)
        if any(abs(v) > top for v in vals):   # finite, but past the dtype's range
            raise InvalidArgument(f"init parameters {params!r} cannot be stored in {dtype} "
                                  f"(largest {top:g})", f"pass values within the range of {dtype}")
    if kind == "constant" and vals[0] == 0.0:
        return ["zeros"]  # the same rows: one spelling, so get-or-create matches
    return [kind, *vals]


def _init_array(spec: list) -> list:
    """The C ``init[4]`` of a normalised init spec."""
    vals = list(spec[1:]) + [0.0] * (3 - len(spec[1:]))
    return [float(INIT_KINDS[spec[0]])] + vals


def default_shards(capacity: int, dim: int, itemsize: int) -> int:
    """About SHARD_BYTES of values per shard, at most MAX_SHARDS."""
    total = capacity * dim * itemsize
    return max(1, min(MAX_SHARDS, -(-total // SHARD_BYTES), capacity))


def rows_per_shard(capacity: int, nshards: int) -> int:
    """Row slots in each shard's segment.

    The table holds exactly ``capacity`` keys in all (checked in C); keys spread over
    shards by hash, so each shard gets ``capacity / nshards`` rows plus 8 standard
    deviations of the binomial spread and 16 (never more than ``capacity``).  Only
    keys chosen to collide in one shard can fill a shard before the table is full."""
    if nshards == 1:
        return capacity
    mean = capacity / nshards
    return int(min(capacity, math.ceil(mean + 8 * math.sqrt(mean) + 16)))


def shard_specs(rec: dict, upd: Updater) -> list[dict]:
    """The shard specs (shmps_spec_t inputs) of a table record."""
    dt = np.dtype(rec["dtype"])
    flags = lib.SHMPS_F_ALLOW_NONFINITE if rec.get("allow_nonfinite") else 0
    if rec.get("outbox_of") is not None:  # shmps/outbox.py
        flags |= lib.SHMPS_F_OUTBOX
    rows = rec["shard_rows"]
    init = _init_array(rec["init_spec"])
    return [{"kind": lib.SHMPS_TABLE, "dtype": _native.DTYPE_CODES[dt.name],
             "updater": upd.code, "flags": flags, "nrows": rows, "row_len": rec["dim"],
             "nnz": rows * rec["dim"], "row_begin": 0, "ncols": 0, "seed": rec["seed"],
             "params": upd.params(), "init": init}
            for _ in range(rec["nshards"])]


# ---- keys ---------------------------------------------------------------------------

def as_keys(keys: Any) -> np.ndarray:
    """``keys`` as a C-contiguous 1-d uint64 array (a no-op for such an array).

    Accepted: unsigned integers, or signed integers without negatives (Python ints up
    to 2**64 - 1 included).  Floats, bools, negatives and other shapes raise."""
    if (type(keys) is np.ndarray and keys.dtype == _UINT64 and keys.ndim == 1
            and keys.flags.c_contiguous):
        return keys
    if isinstance(keys, (list, tuple)) and all(
            isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
            for x in keys):
        # Python ints: numpy would pick float64 for a mix beyond int64 (losing bits)
        if any(int(x) < 0 for x in keys):
            raise InvalidArgument(f"negative key {min(int(x) for x in keys)}: table keys "
                                  "are uint64", "pass integers in [0, 2**64)")
        try:
            return np.array([int(x) for x in keys], dtype=np.uint64)
        except OverflowError:
            raise InvalidArgument("keys must be integers in [0, 2**64)",
                                  "pass a uint64 numpy array") from None
    if (hasattr(keys, "__iter__") and not hasattr(keys, "__array__")
            and not (hasattr(keys, "__len__") and hasattr(keys, "__getitem__"))):
        # a generator, a set, an iterator, a dict view: numpy makes a 0-d object array
        # of it, and the keys, integers, were refused as "not integers"
        raise SchemaError(f"keys given as a {type(keys).__name__}: pass them as a list "
                          "or a 1-d numpy array", "e.g. np.fromiter(keys, np.uint64) or "
                          "sorted(keys)")
    at = bool_at(keys)   # (a list of ints without bools returned above)
    if at is not None:   # as a bool array is (numpy would make [5, True] keys 5 and 1)
        raise SchemaError(f"keys hold a bool ({keys[at]!r}) at position {at}: table keys "
                          "are integers",
                          "pass a uint64 array (or signed integers without negatives)")
    a = as_array(keys, "keys")
    if a.dtype == object:
        try:
            a = np.array(keys, dtype=np.uint64)
        except (OverflowError, TypeError, ValueError):
            raise InvalidArgument("keys must be integers in [0, 2**64)",
                                  "pass a uint64 numpy array") from None
    if a.ndim != 1:
        raise SchemaError(f"keys must be a 1-d array, got shape {a.shape}",
                          "pass keys.ravel() (and grads reshaped to (n, dim))")
    if a.dtype.kind == "u":
        return np.ascontiguousarray(a, dtype=np.uint64)
    if a.dtype.kind == "i":
        if a.size and int(a.min()) < 0:
            raise InvalidArgument(f"negative key {int(a.min())}: table keys are uint64",
                                  "hash or offset your ids to non-negative integers, or "
                                  "view them as uint64 (keys.view(np.uint64))")
        return np.ascontiguousarray(a, dtype=np.uint64)
    if a.size == 0:
        return np.zeros(0, np.uint64)
    raise SchemaError(f"keys of dtype {a.dtype}: table keys are integers",
                      "pass a uint64 array (or signed integers without negatives)")


def key_hash(keys: Any) -> np.ndarray:
    """The 64-bit hash of each key (splitmix64 of key + 0x9e3779b97f4a7c15)."""
    k = as_keys(keys)
    return np.array([int(lib.shmps_key_hash(int(x))) for x in k], dtype=np.uint64)


def key_shards(keys: Any, nshards: int) -> np.ndarray:
    """The shard of each key in a table of ``nshards`` shards (one C call)."""
    k = as_keys(keys)
    out = np.empty(k.size, np.uint32)
    if k.size:
        _native.check(lib.shmps_key_shards(_native.addr(k), k.size, int(nshards),
                                           ffi.from_buffer("uint32_t[]", out)), "key_shards")
    return out


def init_values(init: InitLike, seed: int, keys: Any, dim: int,
                dtype: Any = "float32") -> np.ndarray:
    """The initial rows a table with this ``init`` and ``seed`` gives ``keys``: the
    same in every process and on every host (docs/tables.md has the generator)."""
    dt = np.dtype(dtype)
    spec = _init_array(init_spec(init, dt))
    k = as_keys(keys)
    out = np.empty((k.size, int(dim)), dt)
    cinit = ffi.new("double[4]", spec)
    for i, key in enumerate(k):
        _native.check(lib.shmps_table_init_values(cinit, int(seed), int(key),
                                                  _native.DTYPE_CODES[dt.name], int(dim),
                                                  ffi.from_buffer(out[i])), "init_values")
    return out


# ---- the tensor ---------------------------------------------------------------------

class Table(Tensor):
    """An embedding / key-value table in shared memory.

    Keys are any ``uint64`` (0 and 2**64 - 1 included); rows are created on first
    touch (``pull`` or ``push``) from the table's deterministic init; the table holds at
    most ``capacity`` keys.  Exact: concurrent pushes from any processes give the
    result of applying each push to each row whole, in some order.  Steps are per row
    (Adam's bias correction and Adagrad's lr decay count the pushes that touched the
    row: "lazy" Adam).

    Sample usage::

        emb = store.table("emb", dim=64, capacity=1_000_000, optimizer=shmps.SGD(lr=0.1))
        v = emb.pull(keys)                  # creates missing rows
        emb.push(keys, grads)               # grads: (len(keys), 64)
        emb.evict(idle_steps=10_000)        # drop rows not pushed in 10k table pushes
    """

    kind = "table"

    def __init__(self, store: Any, record: dict, shards: list) -> None:
        super().__init__(store, record, shards)
        self.dim: int = int(record["dim"])
        self.capacity: int = int(record["capacity"])
        self.seed: int = int(record["seed"])
        self.init_spec: list = list(record["init_spec"])
        self.shard_rows: int = int(record["shard_rows"])
        self._gdtype = grad_dtype(self.dtype)
        self._gcode = _native.DTYPE_CODES[self._gdtype.name]
        self._local = threading.local()
        self._bases: Any = None
        try:
            bases = ffi.new("void *[]", [sh.ptr for sh in shards])
            self._check_shards(bases)
            self._bases = bases
        except BaseException:
            self.close()
            raise

    def _check_shards(self, bases: Any) -> None:
        """Catalog record and shard segments (``bases``: their bases) must describe the
        same table."""
        rec = self.record
        if not (isinstance(rec.get("dim"), int) and rec["dim"] >= 1
                and isinstance(rec.get("capacity"), int) and rec["capacity"] >= 1
                and 1 <= self.nshards <= MAX_SHARDS):
            raise CorruptSegment(f"table {self.name!r}: bad catalog record {rec!r}")
        # what every shard's spec must hold, built once
        want = {"nrows": self.shard_rows, "row_len": self.dim, "updater": self.optimizer.code,
                "seed": self.seed, "params": _native.params_of(self.optimizer),
                "init": _init_array(self.init_spec)}
        for i, sh in enumerate(self._shards):
            sp = sh.spec
            got = {k: sp[k] for k in want}
            code = lib.shmps_table_attach_check(sh.ptr, self.capacity, self.nshards, i)
            if got != want or code != 0:
                raise CorruptSegment(f"segment {sh.seg.name} holds {got}, the catalog record "
                                     f"of table {self.name!r} says {want} (or its control "
                                     "block is damaged)")
        # the counters that must agree across shards (skipped while a creator is inside)
        checked = ffi.new("uint32_t *")
        code = lib.shmps_table_attach_counts(bases, self.nshards, _native.token(), checked)
        if code == lib.SHMPS_E_CORRUPT:
            raise CorruptSegment(f"table {self.name!r}: its row counts disagree (rows in use "
                                 "above the rows handed out, or the table's key count not "
                                 "the sum of its shards')",
                                 "the table's control blocks are damaged: restore it from "
                                 "a checkpoint")
        _native.check(code, f"attach of table {self.name!r}")

    # -- plumbing --------------------------------------------------------------------
    def _ptrs(self) -> Any:
        self._shard(0)  # Closed after close()
        return self._bases

    def _scratch(self, n: int, hashes_only: bool = False) -> tuple[Any, int, Any]:
        """This thread's scratch buffer (grown as needed) and its info[] array: room
        for a batch of ``n`` keys, or (``hashes_only``: contains, row_stats) for their
        hashes only."""
        need = int(lib.shmps_table_hash_scratch_bytes(n) if hashes_only
                   else lib.shmps_table_scratch_bytes(n, self.dim))
        loc = self._local
        buf = getattr(loc, "buf", None)
        if buf is None or buf[1] < need:
            size = max(need, 2 * buf[1] if buf else 0)
            arr = np.empty(size, np.uint8)
            loc.buf = buf = (ffi.from_buffer(arr), size, arr)
            loc.info = ffi.new("uint64_t[4]")
        return buf[0], buf[1], loc.info

    def _fail(self, code: int, info: Any, verb: str) -> None:
        if code == lib.SHMPS_E_FULL and info is not None:
            need, used, cap, shard = (int(info[i]) for i in range(4))
            if shard == 2**64 - 1:
                raise CapacityError(
                    f"table {self.name!r} is full: this {verb} needs {need} new key(s), "
                    f"{used} of its capacity {cap} are in use; nothing was changed",
                    "create the table with a larger capacity= (under a new name), or free "
                    "rows with table.evict(min_pushes=..., idle_steps=...) or table.delete(keys)")
            raise CapacityError(
                f"shard {shard} of table {self.name!r} (capacity {self.capacity}) has no free "
                f"row: {used} of its {cap} rows in use, this {verb} needs {need} more; its keys "
                "hash unevenly; nothing was changed",
                "create the table with fewer shards (shards=1 holds exactly capacity keys "
                "whatever they are) or a larger capacity, or evict/delete rows")
        _native.check(code, f"{verb} of table {self.name!r}")

    # -- push ------------------------------------------------------------------------
    def push(self, keys: Any, grads: Any, *, wait: bool = True) -> Optional[PushHandle]:
        """Apply the table's updater to the rows of ``keys`` with ``grads`` ``(n, dim)``.

        Missing keys are created first (from their init), all or none: if the table
        cannot hold them, CapacityError and nothing changes.  Duplicate keys
        accumulate as gradients do: a key's gradients are combined first (summed;
        max/min for Max/Min; the last for Assign) and its row updated once.  Each row's
        step advances by one per push that touches it, its push count (row_stats) by
        one per occurrence.  NaN/Inf gradients raise
        NonFinite unless the table allows them.  Cost: O(n * dim), one C call, GIL
        released; a row being pushed by another process is waited for (per-row lock),
        no other row is.  ``wait=False`` returns a PushHandle; keys and grads must then
        stay unmodified until it is waited on.

        While shmps-bridge runs (the store's forwarding switch), the push is checked the
        same way and summed into the table's outbox for the bridge to send to each
        key's owner (shmps/outbox.py)."""
        wait = check_flag(wait, "wait")   # (wait="no" waited)
        k, g = self._prepare(keys, grads)
        if self._fwd[0] and self._forwards():
            if wait:
                self._forward(k, g)
                return None
            return self._store._submit(self._forward, k, g)
        if wait:
            self._push(k, g)
            return None
        return self._store._submit(self._push, k, g)

    def _prepare(self, keys: Any, grads: Any) -> tuple[np.ndarray, np.ndarray]:
        k = as_keys(keys)
        g = cast_grad(grads, self.dtype)
        if g.shape != (k.size, self.dim):
            raise SchemaError(f"grads shape {g.shape} != (len(keys), dim) = "
                              f"{(k.size, self.dim)} for table {self.name!r}",
                              "give one gradient row of dim values per key")
        if k.size > MAX_BATCH:
            raise InvalidArgument(f"{k.size} keys in one push; at most {MAX_BATCH}",
                                  "split the batch")
        return k, g

    def _forward(self, k: np.ndarray, g: np.ndarray) -> None:
        """A validated push while forwarding: into the outbox (NaN/Inf checked there
        by this table's rule, before anything changes)."""
        if k.size:
            self._outbox()._push_counted(k, g, self._check_finite)

    def _push(self, k: np.ndarray, g: np.ndarray, out: Optional[tuple] = None) -> None:
        """The C push of validated keys and grads; ``out``: see _apply_direct."""
        scratch, nbytes, info = self._scratch(k.size)
        if out is None:
            code = lib.shmps_table_push(self._ptrs(), self.nshards, _native.token(),
                                        _native.addr(k), k.size, ffi.from_buffer(g), self._gcode,
                                        int(self._check_finite), scratch, nbytes, info)
        else:
            vals, states, steps = out
            self._check_row_buffers(k.size, vals, states, steps)
            code = lib.shmps_table_push_read(self._ptrs(), self.nshards, _native.token(),
                                             _native.addr(k), k.size, ffi.from_buffer(g),
                                             self._gcode, int(self._check_finite), scratch,
                                             nbytes, info, ffi.from_buffer(vals),
                                             _native.addrs(states), len(states),
                                             _native.addr(steps))
        if code:
            self._fail(code, info, "push")

    # -- pull ------------------------------------------------------------------------
    def pull(self, keys: Any, *, out: Optional[np.ndarray] = None, create: bool = True,
             found: Optional[np.ndarray] = None) -> np.ndarray:
        """Copy the rows of ``keys`` out: an ``(n, dim)`` array of the table's dtype.

        ``create=True``: missing keys are created from their init first (all or none:
        CapacityError if they do not fit, nothing changed).  ``create=False``: missing
        keys give zero rows and create nothing.  ``found=`` (a writable bool array of
        ``n``) receives which keys existed before this call.  ``out=`` (C-contiguous, the
        table's dtype, ``(n, dim)``) avoids allocating.  Each row is a whole number of
        pushes (per-row seqlock); pushers never wait for a pull.  Cost: O(n * dim), one
        C call, GIL released."""
        create = check_flag(create, "create")   # (create="no" created the rows)
        k = as_keys(keys)
        want = (k.size, self.dim)
        if out is None:
            out = np.empty(want, self.dtype)
        elif (type(out) is not np.ndarray or out.shape != want or out.dtype != self.dtype
              or not out.flags.c_contiguous or not out.flags.writeable):
            raise SchemaError(f"out= must be a writable C-contiguous {self.dtype} array of "
                              f"shape {want}", "allocate it with np.empty((n, dim), dtype)")
        fptr = ffi.NULL
        if found is not None:
            if (type(found) is not np.ndarray or found.shape != (k.size,)
                    or found.dtype != np.bool_ or not found.flags.c_contiguous
                    or not found.flags.writeable):
                raise SchemaError(f"found= must be a writable bool array of shape ({k.size},)",
                                  "allocate it with np.empty(len(keys), bool)")
            fptr = ffi.from_buffer("uint8_t[]", found)
        if k.size > MAX_BATCH:
            raise InvalidArgument(f"{k.size} keys in one pull; at most {MAX_BATCH}",
                                  "split the batch")
        scratch, nbytes, info = self._scratch(k.size)
        while True:
            code = lib.shmps_table_pull(self._ptrs(), self.nshards, _native.token(),
                                        _native.addr(k), k.size, ffi.from_buffer(out),
                                        int(create), fptr, scratch, nbytes, info)
            if code != lib.SHMPS_E_UNBACKED:   # (an outbox's: nothing done, back and again)
                break
            self._back_rows(int(info[3]), int(info[0]))
        if code:
            self._fail(code, info, "pull")
        return out

    def _back_rows(self, shard: int, rows: int) -> None:
        """Back new rows of ``shard`` before the C creation writes them: an outbox's
        (outbox.TableOutbox); a table's pages are backed at its creation, so its
        creation never asks."""
        raise CorruptSegment(f"table {self.name!r} asked for its rows to be backed, which "
                             "only an outbox does (its segment's flags are damaged?)")

    # -- keys ------------------------------------------------------------------------
    def contains(self, keys: Any) -> np.ndarray:
        """A bool array: which ``keys`` are in the table.  Lock-free; O(n), each key
        hashed once (into this thread's scratch)."""
        k = as_keys(keys)
        out = np.zeros(k.size, np.bool_)
        if k.size:
            scratch, nbytes, _ = self._scratch(k.size, hashes_only=True)
            code = lib.shmps_table_contains(self._ptrs(), self.nshards, _native.token(),
                                            _native.addr(k), k.size,
                                            ffi.from_buffer("uint8_t[]", out), scratch, nbytes)
            if code:
                self._fail(code, None, "contains")
        return out

    def __contains__(self, key: object) -> bool:
        try:
            return bool(self.contains([key])[0])
        except InvalidArgument:
            return False

    def row_stats(self, keys: Any) -> dict:
        """Per key: ``found`` (bool), ``pushes`` (how many times the key was pushed since
        its row was created, every occurrence in a batch counting; saturates at
        2**24 - 1) and ``last_push_step`` (the table's push count at its last push, or
        at its creation).  What ``evict`` looks at.  O(n), each key hashed once (into
        this thread's scratch)."""
        k = as_keys(keys)
        found = np.zeros(k.size, np.bool_)
        pushes = np.zeros(k.size, np.uint64)
        last = np.zeros(k.size, np.uint64)
        if k.size:
            scratch, nbytes, _ = self._scratch(k.size, hashes_only=True)
            code = lib.shmps_table_row_stats(self._ptrs(), self.nshards, _native.token(),
                                             _native.addr(k), k.size, _native.addr(pushes),
                                             _native.addr(last), ffi.from_buffer("uint8_t[]", found),
                                             scratch, nbytes)
            if code:
                self._fail(code, None, "row_stats")
        return {"found": found, "pushes": pushes, "last_push_step": last}

    def __len__(self) -> int:
        """Keys in the table now.  O(1)."""
        n = ffi.new("uint64_t *")
        _native.check(lib.shmps_table_len(self._ptrs(), self.nshards, n), f"len({self.name!r})")
        return int(n[0])

    def keys(self) -> np.ndarray:
        """Every key in the table (uint64, in no particular order).  Each shard is
        listed while its rows cannot be deleted; O(capacity)."""
        parts = []
        n = ffi.new("uint64_t *")
        tok = _native.token()
        for s in range(self.nshards):
            buf = np.empty(self.shard_rows, np.uint64)
            code = lib.shmps_table_keys(self._ptrs(), self.nshards, s, tok, _native.addr(buf),
                                        buf.size, n)
            if code:
                self._fail(code, None, "keys")
            parts.append(buf[: int(n[0])])
        return np.concatenate(parts) if parts else np.zeros(0, np.uint64)

    def _by_shard(self, k: np.ndarray) -> list[tuple[int, np.ndarray]]:
        sid = key_shards(k, self.nshards)
        order = np.argsort(sid, kind="stable")
        counts = np.bincount(sid, minlength=self.nshards)
        out, pos = [], 0
        for s, c in enumerate(counts):
            if c:
                out.append((s, np.ascontiguousarray(k[order[pos:pos + c]])))
            pos += c
        return out

    def delete(self, keys: Any) -> int:
        """Remove ``keys`` (missing ones are ignored); returns how many were removed.
        A deleted key pulled or pushed again is re-created from its init.  Each shard
        involved is frozen while its keys are removed (pushers to it wait, about one
        push's time plus O(len(keys))); one C call per shard."""
        k = as_keys(keys)
        total = 0
        n = ffi.new("uint64_t *")
        tok = _native.token()
        for s, part in self._by_shard(k):
            code = lib.shmps_table_delete(self._ptrs(), self.nshards, s, tok, _native.addr(part),
                                          part.size, n)
            if code:
                self._fail(code, None, "delete")
            total += int(n[0])
        return total

    def evict(self, min_pushes: Optional[int] = None, idle_steps: Optional[int] = None) -> int:
        """Remove cold rows; returns how many.  A row is cold if its key was pushed fewer
        than ``min_pushes`` times since its creation (a frequency filter: every
        occurrence in a batch counts), or if none of the last ``idle_steps`` pushes to
        the table touched it (a row counts as touched when created).  Give one or both.  Shard by shard, each frozen while it is scanned
        (pushers to it wait about O(rows in the shard)); the table stays usable."""
        which = 0
        vals = []
        for name, v, bit in (("min_pushes", min_pushes, lib.SHMPS_EVICT_MIN_PUSHES),
                             ("idle_steps", idle_steps, lib.SHMPS_EVICT_IDLE)):
            if v is None:
                vals.append(0)
                continue
            which |= bit
            vals.append(min(check_int(v, name, 0), 2**64 - 1))
        if not which:
            raise InvalidArgument("evict() needs min_pushes= or idle_steps=",
                                  "e.g. table.evict(idle_steps=100_000)")
        total = 0
        n = ffi.new("uint64_t *")
        tok = _native.token()
        for s in range(self.nshards):
            code = lib.shmps_table_evict(self._ptrs(), self.nshards, s, tok, which, vals[0],
                                         vals[1], n)
            if code:
                self._fail(code, None, "evict")
            total += int(n[0])
        return total

    def check(self) -> None:
        """Verify the table's invariants (index, rows, free lists, counters); raise
        CorruptSegment naming the first problem.  Takes the creation lock; O(capacity).
        For tests and debugging."""
        info = ffi.new("uint64_t[4]")
        code = lib.shmps_table_check(self._ptrs(), self.nshards, _native.token(), info)
        if code == lib.SHMPS_E_CORRUPT:
            raise CorruptSegment(f"table {self.name!r}: invariant {int(info[0])} broken in "
                                 f"shard {int(info[1])} at {int(info[2])} (see table.c)")
        _native.check(code, f"check of table {self.name!r}")

    # -- the bridge's side (shmps/outbox.py; private API) ------------------------------
    def _key_shard(self, keys: Any) -> np.ndarray:
        """The shard of each key (uint32)."""
        return key_shards(keys, self.nshards)

    def _outbox_drain(self, shard: int, timeout: Optional[float] = None,
                      into: Any = None) -> Any:
        """Take every row of the outbox's ``shard`` pushed to since the last drain (their
        keys stay, zeroed; all are removed once keys fill over a quarter of the outbox:
        native/table.c "Outbox drains"): an ``outbox.Drained`` (keys, summed
        gradients), or None when none is pending.  The outbox shard is frozen meanwhile
        (its pushers wait, O(rows taken)).  Waits
        at most ``timeout`` (default outbox.DRAIN_TIMEOUT_S, 0.1 s) for the pushers
        inside to leave: then takes nothing and returns None.
        ``into``: an ``outbox.DrainBuffers`` to drain into (the result holds views of
        it, valid until its next use)."""
        from . import outbox
        return outbox.drain_table(self, shard, timeout, into)

    def _apply_direct(self, index: Any, grads: Any, pushes: int = 1,
                      continues: bool = False, out: Optional[tuple] = None) -> None:
        """Apply the updater to keys ``index`` as a push with forwarding off would,
        whatever the switch says (the owner's bridge).  Same validation as push;
        ``pushes``: how many pushes the batch stands for (statistics), counted unless
        ``continues`` (more keys of the batch the previous call began: rows step per
        key, so nothing else changes).

        ``out``: ``(values, states, row_steps)`` arrays of ``len(index)`` rows
        (C-contiguous; the table's dtype, the optimizer's state arrays as
        ``_state_arrays`` makes them, uint64): each key's row as this push left it is
        copied there, under the row's lock, in the order of ``index`` (views into the
        ROWS frame the owner sends: no second lookup of the keys)."""
        k, g = self._prepare(index, grads)
        self._push(k, g, out)
        if k.size:
            self._count_batch(pushes, continues)

    def _check_row_buffers(self, n: int, vals: np.ndarray, states: list,
                           steps: np.ndarray) -> None:
        """``vals``, ``states`` and ``steps`` can take ``n`` rows as C writes them: the
        table's dtype, the optimizer's state arrays (``_state_arrays``), uint64 steps,
        C-contiguous and writable; else InvalidArgument."""
        sp = self._shard(0).spec
        sdt = np.dtype(_native.DTYPE_NAMES[sp["state_dtype"]])
        if vals.shape != (n, self.dim) or vals.dtype != self.dtype or \
                steps.shape != (n,) or steps.dtype != np.uint64 or \
                len(states) != sp["nstate"] or \
                any(a.shape != (n, self.dim) or a.dtype != sdt for a in states) or \
                not all(a.flags.c_contiguous and a.flags.writeable
                        for a in (vals, steps, *states)):
            raise InvalidArgument("row buffers of the wrong shape, dtype or layout")

    def _state_arrays(self, n: int) -> list:
        sp = self._shard(0).spec
        sdt = _native.DTYPE_NAMES[sp["state_dtype"]]
        return [np.empty((n, self.dim), sdt) for _ in range(sp["nstate"])]

    def _rows_out(self, shard: int, keys: Optional[np.ndarray]) -> Any:
        from .outbox import RowData
        self._shard_checked(shard)
        cap = self.shard_rows if keys is None else keys.size
        kout = np.empty(cap, np.uint64)
        vals = np.empty((cap, self.dim), self.dtype)
        states = self._state_arrays(cap)
        steps = np.empty(cap, np.uint64)
        k = self._rows_into(shard, keys, kout, vals, states, steps)
        return RowData(index=kout[:k], values=vals[:k], states=[a[:k] for a in states],
                       row_steps=steps[:k], step=0)

    def _rows_into(self, shard: int, keys: Optional[np.ndarray], kout: np.ndarray,
                   vals: np.ndarray, states: list, steps: np.ndarray) -> int:
        """Read the rows of ``keys`` of ``shard`` (None: every key) into the given
        arrays, C-contiguous, of room for as many rows as ``kout`` (states as the
        optimizer keeps: ``_state_arrays``): how many were found, in the first rows,
        under the shard's shared freeze."""
        cap = kout.size
        if kout.dtype != np.uint64 or not kout.flags.c_contiguous or not kout.flags.writeable:
            raise InvalidArgument("row buffers of the wrong shape, dtype or layout")
        self._check_row_buffers(cap, vals, states, steps)
        if keys is not None and keys.size > cap:
            raise InvalidArgument(f"{keys.size} keys, room for {cap} rows")
        n = ffi.new("uint64_t *")
        kptr = _native.addr(keys) if keys is not None else ffi.NULL
        code = lib.shmps_table_read_rows(self._ptrs(), self.nshards, int(shard), _native.token(),
                                         kptr, 0 if keys is None else keys.size,
                                         _native.addr(kout), ffi.from_buffer(vals),
                                         _native.addrs(states), _native.addr(steps), cap, n)
        if code == lib.SHMPS_E_ARG and keys is not None:
            self._check_keys_in(shard, keys)   # C checked every key's shard: name the one
        if code:
            self._fail(code, None, "read rows")
        return int(n[0])

    def _check_keys_in(self, shard: int, k: np.ndarray) -> None:
        self._shard_checked(shard)
        if k.size:
            bad = np.flatnonzero(self._key_shard(k) != int(shard))
            if bad.size:
                raise InvalidArgument(f"key {int(k[bad[0]])} belongs to shard "
                                      f"{int(self._key_shard(k[bad[:1]])[0])} of {self.name!r}, "
                                      f"not {shard}")

    def _read_rows(self, shard: int, index: Any) -> Any:
        """The rows of keys ``index`` (all of ``shard``; missing keys are left out) with
        their optimizer state and per-row steps: an ``outbox.RowData``, copied under the
        shard's shared freeze (no push inside meanwhile: each row whole)."""
        return self._rows_out(shard, as_keys(index))   # C checks each key's shard

    def _snapshot(self, shard: int) -> Any:
        """Every key of ``shard``, as :meth:`_read_rows`."""
        return self._rows_out(shard, None)

    def _write_rows(self, shard: int, data: Any) -> None:
        """Write ``data`` (an ``outbox.RowData`` of keys of ``shard``) into this copy:
        absolute values, optimizer state and (``row_steps`` not None) per-row steps,
        creating missing keys first, all or none (CapacityError: nothing written).
        Under the shard's exclusive freeze, so no pull sees a half-written row; a
        repeated key's last row wins.  Never goes through the outbox."""
        from .dense import _as_rows
        k = as_keys(data.index)
        self._shard_checked(shard)
        n = k.size
        vals = _as_rows(data.values, self.dtype, (n, self.dim), "values")
        sp = self._shard(0).spec
        sdt = np.dtype(_native.DTYPE_NAMES[sp["state_dtype"]])
        if len(data.states) != sp["nstate"]:
            raise SchemaError(f"{len(data.states)} state arrays for {self.name!r}, its "
                              f"optimizer keeps {sp['nstate']}")
        states = [_as_rows(a, sdt, (n, self.dim), "state") for a in data.states]
        steps = None
        if data.row_steps is not None:
            steps = _as_rows(data.row_steps, np.dtype(np.uint64), (n,), "row_steps")
        info = ffi.new("uint64_t[4]")

        def write() -> int:
            return lib.shmps_table_write_rows(
                self._ptrs(), self.nshards, int(shard), _native.token(), _native.addr(k),
                k.size, ffi.from_buffer(vals), _native.addrs(states), len(states),
                _native.addr(steps) if steps is not None else ffi.NULL, info)

        # The C writes the rows in order, so a repeated key's last row wins as it is;
        # only its capacity check counts a missing key once per occurrence.  So the keys
        # are made distinct (a sort) only when that check failed: then the exact count
        # decides (nothing was written).  What an owner sends has distinct keys.
        code = write()
        if code == lib.SHMPS_E_FULL and n > 1:
            _, first_rev = np.unique(k[::-1], return_index=True)
            keep = np.sort(n - 1 - first_rev)
            if keep.size < n:
                k, vals = k[keep], vals[keep]
                states = [a[keep] for a in states]
                steps = steps[keep] if steps is not None else None
                code = write()
        if code == lib.SHMPS_E_ARG:
            # the C checks every key's shard before it writes (not numpy first, for every
            # frame of rows a replica takes): name the key that is not of this shard
            self._check_keys_in(shard, k)
        if code:
            self._fail(code, info, "write rows")

    # -- description -----------------------------------------------------------------
    @property
    def shape(self) -> tuple:
        """``(len(table), dim)``: the rows there are now."""
        return (len(self), self.dim)

    def stats(self) -> dict:
        """Tensor.stats() plus ``len`` and ``capacity``; ``step`` is the table's push
        count, ``rows_used`` the keys in the table."""
        out = super().stats()
        out["len"] = len(self)
        out["capacity"] = self.capacity
        return out

    def describe(self) -> dict:
        d = super().describe()
        d.update(dim=self.dim, capacity=self.capacity, rows_used=len(self), seed=self.seed,
                 init=self.init_spec)
        return d

    def close(self) -> None:
        self._bases = None
        super().close()

    def __repr__(self) -> str:
        return (f"<shmps.Table {self.name!r} {self.dtype.name} dim={self.dim} "
                f"capacity={self.capacity} {type(self.optimizer).__name__}>")


def create_record(name: str, req: dict, init: InitLike, nshards: Optional[int]) -> dict:
    """The catalog record of a new table (validates the creation arguments)."""
    from .errors import NotFound
    from .updaters import as_updater, from_dict

    if "dim" not in req or "capacity" not in req:
        raise NotFound(f"no table {name!r}", "pass dim= and capacity= (and dtype=, "
                       "optimizer=, init=) to create it")
    dt = np.dtype(req.get("dtype", "float32"))
    upd = from_dict(req["optimizer"]) if "optimizer" in req else as_updater(None)
    if upd.float_only and dt.kind != "f":
        raise SchemaError(f"optimizer {type(upd).__name__} needs a float dtype, not {dt}",
                          "use Sum/Assign/Max/Min for integer tables")
    dim, cap = req["dim"], req["capacity"]
    shards = nshards or default_shards(cap, dim, dt.itemsize)
    return {"name": name, "kind": "table", "dtype": dt.name, "dim": dim, "capacity": cap,
            "seed": req.get("seed", 0), "init_spec": req.get("init_spec", init_spec(init, dt)),
            "nshards": shards, "shard_rows": rows_per_shard(cap, shards),
            "optimizer": upd.to_dict(), "mode": "exact",
            "allow_nonfinite": bool(req.get("allow_nonfinite", False)), "shape": [cap, dim]}


def check_args(dim: Any, capacity: Any, seed: Any,
               shards: Any) -> tuple[Optional[int], ...]:
    """Creation arguments as ints in range, None where not given (checks.check_int:
    else InvalidArgument)."""
    return tuple(check_int(v, name, lo, hi, none=True)
                 for name, v, lo, hi in (("dim", dim, 1, 2**31), ("capacity", capacity, 1, 2**40),
                                         ("seed", seed, 0, 2**64 - 1),
                                         ("shards", shards, 1, MAX_SHARDS)))
