"""A store: a named set of tensors in shared memory, shared by every process on the host.

The store's manifest segment (``/shmps.[ns.]<store>.manifest``) holds a robust
process-shared mutex (taken only to create tensors), the list of attached
processes, and an append-only catalog of tensor records (JSON).  Attaching reads the
catalog without the lock; tensors are mapped lazily on first use.
"""
from __future__ import annotations

import contextlib
import json
import math
import operator
import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Literal, Optional, Sequence

import numpy as np

from . import _native, doorbell, names
from .checks import check_flag, check_int, check_seconds
from .aggregate import HIDDEN_SUFFIXES
from .dense import DenseTensor, default_shard_rows
from .files import CSR
from .errors import (CapacityError, Closed, CorruptFile, CorruptSegment, InvalidArgument,
                     NotFound, SchemaError, Timeout)
from .segment import (NoRoom, Segment, Wait, age_of, check_room, list_names, shm_free,
                      size_of, unlink)
from .tensor import (MAX_ROW_SHARDS, PushHandle, Tensor, cast_init, check_shard_count,
                     init_is_valid, open_shards, submit_or_none)
from .updaters import UpdaterLike, as_updater, from_dict

lib = _native.lib
ffi = _native.ffi

MANIFEST_SIZE = lib.SHMPS_MANIFEST_SIZE
#: bytes of a new manifest backed at once: the header, attached processes and worker
#: clocks; the catalog after them is backed as records reach it (Store._append)
MANIFEST_RESERVED = lib.SHMPS_CATALOG_OFF
DESTROY_WAIT = 10.0   #: destroy() waits at most this long for a gc at the same store (s)
LOCK_TIMEOUT_S = 60.0
DTYPES = tuple(_native.DTYPE_CODES)
MODES = ("exact", "hogwild")


def _dtype(dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in DTYPES:
        raise SchemaError(f"unsupported dtype {dtype!r}", f"use one of {', '.join(DTYPES)}")
    return dt


def _clock_timeout(timeout: Optional[float]) -> float:
    """``clock(timeout=)`` as the C core takes it: seconds, or -1.0 for no limit.

    The core reads any negative value as "no limit" and turns the rest into a uint64
    deadline in ns, so a negative or NaN timeout (a typo, a computed value gone wrong)
    must be refused here, not waited out for ever, and ``math.inf`` (or a value whose ns
    overflow the deadline: past 292 years) is passed as -1.0, not converted."""
    t = check_seconds(timeout)
    return -1.0 if t is None or t > 9e9 else t


def _staleness_word(staleness: Optional[int]) -> int:
    """The manifest's staleness word for ``staleness`` (-1: None, eventual): an integer
    as every count here is (checks.check_int)."""
    k = check_int(staleness, "staleness", 0, 2**63 - 1, none=True,
                  hint="pass None (eventual), 0 (sequential) or k > 0 (bounded delay of k "
                       "clocks)")
    return -1 if k is None else k


def attach(name: str, *, create: bool = True, namespace: Optional[str] = None,
           timeout: float = 2.0, staleness: Optional[int] = None,
           _restoring: bool = False) -> "Store":
    """Attach to store ``name``, creating it if needed (``create=True``).

    Safe to race from any number of processes: exactly one initialises the store,
    the others wait (at most ``timeout`` s after an initialiser died).  ``namespace``
    (default ``$SHMPS_NAMESPACE``) prefixes every segment name, so several
    independent "hosts" can share one machine.  ``staleness=k`` sets the store's
    consistency for worker clocks (see :meth:`Store.clock`): k = 0 sequential (a
    barrier per clock), k > 0 bounded delay; by default it stays as it is (eventual
    for a new store).  Cost: one segment open and the
    catalog parse (~0.1 ms for 100 tensors); tensors are mapped when first used.

    Sample usage::

        store = shmps.attach("model")
        w = store.dense("w", shape=(1000, 10), optimizer=shmps.SGD(lr=0.1))

    (``_restoring``, internal: shmps.restore's attach; a store this call creates is born
    being restored by this process, so no other process ever finds it empty.)
    """
    names.check_name(name)
    ns = names.resolve_namespace(namespace)
    mname = names.manifest_name(name, ns)
    _staleness_word(staleness)   # refused before anything is attached (or created)
    create = check_flag(create, "create")   # (create="no" created the store)
    try:
        timeout = float(timeout)
    except (TypeError, ValueError):
        timeout = float("nan")
    if not timeout >= 0:
        raise InvalidArgument(f"timeout={timeout!r} must be a number of seconds >= 0",
                              "pass e.g. timeout=2.0, or math.inf to wait as long as it takes")
    c_timeout = -1.0 if math.isinf(timeout) else timeout      # (the C core: < 0 = no limit)
    wait = Wait(timeout, poll=0.001)
    while True:
        if create:
            seg, _ = Segment.open_or_create(mname, MANIFEST_SIZE, reserve=MANIFEST_RESERVED)
        else:
            try:
                seg = Segment.open(mname, expect_size=MANIFEST_SIZE)
            except NotFound:
                raise NotFound(f"no store {name!r}" + (f" in namespace {ns!r}" if ns else ""),
                               "create it with shmps.attach(name) or check `shmps-tool ls`"
                               ) from None
            except CorruptSegment:
                # size 0: a store being created (its creator between shm_open and
                # ftruncate), or whose creator died there; wait for it as for an
                # initialiser.  (An attach that may create sizes it and goes on.)  Sized
                # since the open looked (its creator's ftruncate came in between): open
                # it again.  (Only another size is a damaged manifest: this raised
                # "has size 0" once in CI, the creator a thread of the test.)
                if size_of(mname) not in (0, MANIFEST_SIZE):
                    raise
                wait.again(lambda: NotFound(
                    f"store {name!r}" + (f" in namespace {ns!r}" if ns else "")
                    + f" is being created, or its creator died before it was made "
                    f"(its manifest {mname} has been empty for {timeout:g} s)",
                    "retry later or with a longer timeout; if it stays so, `shmps-tool "
                    "gc` removes it, or shmps.attach(name) with create=True makes the "
                    "store"))
                continue
        try:
            ident = names.manifest_ident(name, ns)
            code = lib.shmps_manifest_init(seg.ptr, seg.size, _native.token(), c_timeout,
                                           ident, len(ident), int(_restoring))
            if code == lib.SHMPS_E_REMOVED:
                raise _Removed()
            if code == lib.SHMPS_E_PIDNS:   # made, or being made, in another: refused
                _check_pid_namespace(name, seg)
            if code:
                _native.check(code, f"store {name!r} manifest {mname}")
            _check_ident(name, ns, seg)
            store = Store(name, ns, seg)
            if staleness is not None:
                store.set_consistency(staleness)
            return store
        except _Removed:
            # `shmps-tool gc` is removing this (idle) store, or looking whether it may (it
            # backs off if it finds a process attached): look again until the store is
            # back, or its manifest is gone (create: then make a new one; else NotFound);
            # finish the removal if the remover died
            try:
                # (a store of another PID namespace: its remover's pid means nothing
                # here, and would look dead; refused as Store() refuses a ready one)
                _check_pid_namespace(name, seg)
                # the remover or restorer died (a gc, a destroy() or a restore killed
                # midway): finish the removal (of a partial restore too), if this
                # process is the one that takes it over (others wait for it)
                holder = int(lib.shmps_manifest_retired_by(seg.ptr))
                # (retire, as gc: a gc that died deciding is decided again, and a live
                # attached process keeps the store.  No holder and READY again: a gc
                # saw this process registered and kept the store; just look again,
                # or this process, unregistered, would remove what gc kept)
                if (not _native.token_alive(holder)
                        and not (holder == 0 and lib.shmps_manifest_usable(seg.ptr, 0))
                        and lib.shmps_manifest_retire(seg.ptr, _native.token()) == 0):
                    # claimed: the name, if still this manifest, cannot change until
                    # the removal ends; if not, the store is gone and another is there
                    if seg.is_named():
                        _unlink_store(name, ns)
                    continue
            finally:
                seg.close()
            wait.again(lambda: removal_held(name, holder, timeout, "retry the attach once "
                                            "it is done, or give attach() a longer timeout"))
        except BaseException:
            seg.close()
            raise


def _check_ident(name: str, ns: Optional[str], manifest: Segment) -> None:
    """InvalidArgument unless the manifest was made for store ``name`` of namespace
    ``ns``.  Segment names join namespace and store with a dot, and both may hold dots:
    store "a.b" of no namespace and store "b" of namespace "a" are both /shmps.a.b.*, and
    the second to attach opened the first's store as its own, across the namespace
    boundary.  The manifest records its store's (namespace, store) (ident, set by its
    initialiser), so the second is refused.  O(1)."""
    buf = ffi.new("char[]", 256)
    n = ffi.new("uint32_t *")
    _native.check(lib.shmps_manifest_ident(manifest.ptr, buf, 256, n),
                  f"manifest {manifest.name}")
    have = ffi.unpack(buf, n[0])
    if not have or have == names.manifest_ident(name, ns):
        return
    hns, _, hstore = have.decode("utf-8", "replace").partition("\0")

    def who(store: str, namespace: Optional[str]) -> str:
        return f"store {store!r} " + (f"of namespace {namespace!r}" if namespace
                                      else "of no namespace")

    raise InvalidArgument(
        f"{who(name, ns)}: its segments {names.store_prefix(name, ns)}* hold "
        f"{who(hstore, hns or None)} (segment names join namespace and store with a dot, "
        "so the two names are one)",
        "use another store name or namespace; keep dots out of one of them")


def _check_pid_namespace(name: str, manifest: Segment,
                         doing: Literal["attach", "gc"] = "attach") -> None:
    """Every process of a store must see the others' pids: liveness (who holds a lock,
    a freeze, a removal) is a pid and start time read from /proc.  A process of another
    PID namespace sharing /dev/shm (the containers of one pod, by default) looked dead
    to them and they to it: live holders' locks were taken over (lost updates, torn
    consistent pulls; review 13).  Raises InvalidArgument for such a store, saying what
    to do for what this process was ``doing``."""
    other = _native.foreign_pid_namespace(manifest.ptr)
    if other is not None:
        raise _native.other_pid_namespace(f"store {name!r}", other, doing)


def removal_held(name: str, holder: int, waited: float, retry: str) -> Timeout:
    """The Timeout of every wait for the process holding store ``name``'s removal claim
    (``retired_by``: ``holder``, a token; 0 if it let go meanwhile) to be done: attach,
    destroy() and restore waited ``waited`` s; ``retry`` says what to do."""
    who = f"process {_native.token_pid(holder)}" if holder else "another process"
    return Timeout(f"store {name!r}: {who} has been removing it (`shmps-tool gc`, "
                   f"destroy()) or restoring a checkpoint into it for {waited:g} s", retry)


class _Removed(Exception):
    """The manifest attach found is being removed (`shmps-tool gc`, destroy()) or
    restored into (internal)."""


class Store:
    """An attached store.  Get tensors with ``dense()``, ``table()``, ``csr()`` or
    ``store[name]``; ``close()`` detaches this process, ``destroy()`` removes the store."""

    #: back every page of a tensor this handle creates at once (Segment.create): a
    #: tensor /dev/shm has no room for is a CapacityError, not a SIGBUS at a later write.
    #: shmps-bridge turns it off for its handle (Bridge.start): backing a 256 MiB copy of
    #: a peer's tensor held its event loop, where heartbeats run, for 250-300 ms
    reserve_memory: bool = True
    #: with reserve_memory off: the bytes of /dev/shm that the tensors created without
    #: backing and not yet backed still need (shmps-bridge's copies, which its thread
    #: backs right after: Bridge._still_unbacked).  A new such tensor is refused unless
    #: /dev/shm has room for its segments beside them (_create_segments), so copies made
    #: in a row do not each count the same free space as theirs
    unbacked_bytes: Callable[[], int] = staticmethod(lambda: 0)

    def __init__(self, name: str, namespace: Optional[str], manifest: Segment) -> None:
        self.name = name
        self.namespace = namespace
        self._manifest: Optional[Segment] = manifest
        self._manifest_ino = manifest.ino   #: which store this handle had, once closed
        self._records: dict[str, dict] = {}
        self._record_list: list[dict] = []
        self._catalog_len = 0
        self._generation = -1
        self._tensors: dict[str, Tensor] = {}
        # outbox name -> per shard, the pushes lost with a bridge process as this handle
        # first used the outbox (outbox.get_or_create; flush raises for later losses)
        self._lost_seen: dict[str, list[int]] = {}
        # (tensor, shard, pushes) recorded lost by this handle's drains (outbox.take_lost)
        self._lost_settled: list[tuple[str, int, int]] = []
        self._lock = threading.RLock()
        self._catalog_lock = threading.Lock()   # (_refresh's reads; a leaf lock)
        self._executor: Optional[ThreadPoolExecutor] = None
        self._executor_pid = 0
        # the host whose copy a tensor created now takes its initial values from, recorded
        # in its catalog record as "origin" (the bridge's copies of a peer's tensors:
        # _adopting)
        self._adopting_from: Optional[str] = None
        _check_pid_namespace(name, manifest)
        slot = ffi.new("uint32_t *")
        code = lib.shmps_proc_register(manifest.ptr, _native.token(), slot)
        if code == lib.SHMPS_E_FULL:
            # (the generic CapacityError hint is a hash table's: a larger capacity,
            # table.evict(); neither exists for this table)
            raise CapacityError(
                f"store {name!r}: its attached-process table is full "
                f"({lib.SHMPS_MAX_PROCS} slots: one per attach() handle not closed yet, "
                "in any process)",
                "close() the handles a process no longer uses (each attach() takes a "
                "slot, also in one process), or use one handle per process")
        _native.check(code, f"store {name!r}: attached-process table")
        if not lib.shmps_manifest_attached(manifest.ptr, _native.token()):
            # `shmps-tool gc` retired the store before it could see us (remove_idle):
            # attach() goes on to the store made after it
            lib.shmps_proc_unregister(manifest.ptr, _native.token(), slot[0])
            raise _Removed()
        self._proc_slot = int(slot[0])
        self._proc_token = _native.token()
        self._worker: Optional[int] = None
        _OPEN_STORES.add(self)
        # the forwarding switch, read by every push (Tensor._fwd; shmps/outbox.py)
        self._fwd_word = lib.shmps_forward_word(manifest.ptr)
        # what flush() rings to wake the bridge (shmps/doorbell.py)
        self._bell = doorbell.Bell(name, namespace)
        self._refresh()

    # -- catalog -----------------------------------------------------------------
    @property
    def _mptr(self) -> Any:
        if self._manifest is None or self._manifest.ptr is None:
            raise Closed(f"store {self.name!r} is closed")
        return self._manifest.ptr

    def _refresh(self) -> None:
        """Read catalog records appended since the last look: lock-free when there are
        none, else under ``_catalog_lock``, a leaf lock (nothing is taken while it is
        held): threads that each read from the same last position appended the same
        records, each once per thread (8 threads: a tensor listed 8 times, and the next
        id, the list's length, wrong)."""
        ptr = self._mptr
        if int(lib.shmps_catalog_generation(ptr)) == self._generation:
            return
        with self._catalog_lock:
            if int(lib.shmps_catalog_generation(ptr)) != self._generation:
                self._read_catalog(ptr)

    def _read_catalog(self, ptr: Any) -> None:
        buf = bytearray(lib.SHMPS_CATALOG_BYTES)
        n = ffi.new("uint64_t *")
        g = ffi.new("uint64_t *")
        _native.check(lib.shmps_catalog_read(ptr, ffi.from_buffer(buf), len(buf), n, g),
                      f"store {self.name!r} catalog")
        data = memoryview(buf)[: int(n[0])]
        pos = self._catalog_len
        while pos + 4 <= len(data):
            ln = int.from_bytes(data[pos:pos + 4], "little")
            if pos + 4 + ln > len(data):
                raise CorruptSegment(f"store {self.name!r}: catalog record at {pos} overruns")
            try:
                rec = json.loads(bytes(data[pos + 4:pos + 4 + ln]))
            except (ValueError, RecursionError):   # (nested past json's recursion limit)
                raise CorruptSegment(f"store {self.name!r}: catalog record at {pos} is not JSON")
            _check_record(rec, f"store {self.name!r}: catalog record at {pos}")
            self._records[rec["name"]] = rec
            self._record_list.append(rec)
            pos += 4 + ln
        if len(self._record_list) < int(g[0]):
            # the catalog is append-only and each append bumps the generation once, after
            # the length (shmps_catalog_append): fewer records than that is a damaged
            # length word, which hid tensors (a get-or-create made a new empty one)
            raise CorruptSegment(_short_catalog(self.name, len(self._record_list), int(g[0])))
        self._catalog_len = pos
        self._generation = int(g[0])

    def _record(self, name: str) -> Optional[dict]:
        self._mptr  # Closed after close()
        rec = self._records.get(name)
        if rec is None:
            self._refresh()
            rec = self._records.get(name)
        return rec

    # -- tensors -----------------------------------------------------------------
    def __getitem__(self, name: str) -> Tensor:
        """The existing tensor ``name``; raises NotFound (a KeyError) if absent."""
        with self._lock:
            self._mptr  # Closed after close()
            t = self._tensors.get(name)
            if t is not None:
                return t
            rec = self._record(name)
            if rec is None:
                raise NotFound(f"no tensor {name!r} in store {self.name!r}",
                               f"existing: {', '.join(sorted(self._records)) or 'none'}")
            return self._open(rec)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._record(name) is not None

    def __iter__(self) -> Iterator[str]:
        self._refresh()
        return iter(list(self._records))

    def __len__(self) -> int:
        """How many names iteration gives: every tensor of the store, hidden ones
        (outboxes, an aggregated tensor's) included, as store.tensors() lists them.
        One load when no tensor was added since the last look."""
        self._refresh()
        return len(self._records)

    def __bool__(self) -> bool:
        """Always true: a store is a handle first (``store or shmps.attach(...)``).
        Without this, bool() falls back on __len__: an empty store would be false, and
        a closed one would raise Closed."""
        return True

    def _open(self, rec: dict) -> Tensor:
        cls = _KIND_CLASSES.get(rec["kind"])
        if rec.get("aggregate") and rec["kind"] == "dense":
            from .aggregate import AggregateDense  # synchronous aggregation
            cls = AggregateDense
        elif rec["name"].endswith(HIDDEN_SUFFIXES):
            from .aggregate import HiddenDense, hidden_of  # its accumulators: no pushes
            base = hidden_of(self, rec)
            if base is not None:
                t = HiddenDense(self, rec, open_shards(self, rec), base)
                self._tensors[rec["name"]] = t
                return t
        if rec.get("outbox_of") is not None:
            from .outbox import DenseOutbox, TableOutbox  # the bridge's outboxes
            cls = {"dense": DenseOutbox, "table": TableOutbox}.get(rec["kind"])
        if cls is None:
            raise CorruptSegment(f"tensor {rec['name']!r} of store {self.name!r} has kind "
                                 f"{rec['kind']!r}, which this shmps version does not know",
                                 "upgrade shmps, or remove the store")
        t = cls(self, rec, open_shards(self, rec))
        self._tensors[rec["name"]] = t
        return t

    def tensors(self) -> list[dict]:
        """Describe every tensor: name, kind, dtype, shape, optimizer, nshards, bytes."""
        self._refresh()
        out = []
        for rec in self._record_list:
            out.append({"name": rec["name"], "kind": rec["kind"], "dtype": rec["dtype"],
                        "shape": tuple(rec.get("shape", ())),
                        "optimizer": rec["optimizer"], "mode": rec.get("mode", "exact"),
                        "nshards": rec["nshards"], "bytes": rec.get("bytes", 0)})
        return out

    def dense(self, name: str, shape: Optional[Sequence[int]] = None, dtype: Any = None,
              init: Any = 0.0, optimizer: UpdaterLike = None, *, mode: Optional[str] = None,
              allow_nonfinite: Optional[bool] = None,
              shard_rows: Optional[int] = None, aggregate: Optional[str] = None,
              workers: Optional[int] = None) -> DenseTensor:
        """Get or create the dense tensor ``name``.

        On creation: ``shape`` is required; ``dtype`` defaults to float32,
        ``optimizer`` to Sum(), ``mode`` to "exact" ("hogwild": plain racy updates),
        ``init`` is a scalar or an array of ``shape``.  When the tensor exists, every
        argument given must match it (else SchemaError); arguments left out accept
        what exists.  Safe to race from many processes: one creates, all get it.
        ``aggregate="mean"|"sum"`` with ``workers=N``: synchronous aggregation, one
        update per worker clock from every worker's push (shmps/aggregate.py)."""
        names.check_name(name, "tensor name") if not _loose_name(name) else None
        req: dict[str, Any] = {"kind": "dense"}
        if shape is not None:
            shp = _shape(shape)
            if any(x < 0 for x in shp) or (shp and shp[0] == 0 and len(shp) > 8):
                raise SchemaError(f"invalid shape {shape!r}",
                                  "give each dimension as an integer >= 0")
            if len(shp) > 8:
                raise SchemaError(f"shape {shp} has more than 8 dimensions",
                                  "reshape to at most 8 dimensions")
            if shp and shp[0] > 0 and 0 in shp[1:]:
                raise SchemaError(f"shape {shp}: rows of zero values are not supported",
                                  "give every dimension after the first a size >= 1")
            req["shape"] = list(shp)
        if dtype is not None:
            req["dtype"] = _dtype(dtype).name
        if optimizer is not None:
            req["optimizer"] = as_updater(optimizer).to_dict()
        if mode is not None:
            if mode not in MODES:
                raise InvalidArgument(f"mode={mode!r}", "use 'exact' or 'hogwild'")
            req["mode"] = mode
        if allow_nonfinite is not None:
            req["allow_nonfinite"] = check_flag(allow_nonfinite, "allow_nonfinite")
        if shard_rows is not None:
            req["shard_rows"] = check_int(shard_rows, "shard_rows", 1)
        if aggregate is not None or workers is not None:
            from .aggregate import add_request
            add_request(self, name, req, aggregate, workers)

        def check_init(rec: dict) -> None:
            shp, dt = tuple(rec["shape"]), np.dtype(rec["dtype"])
            anf = bool(rec.get("allow_nonfinite", False))
            # (unused here: checked a chunk at a time, no copy; a bad one is checked
            # again whole, for the creator's error naming the first bad element)
            if not init_is_valid(init, shp, dt, anf):
                _init_array(init, shp, dt, anf)

        return self._get_or_create(name, req, lambda: self._create_dense(name, req, init),
                                   check_init)

    def table(self, name: str, dim: Optional[int] = None, dtype: Any = None,
              capacity: Optional[int] = None, optimizer: UpdaterLike = None,
              init: Any = None, seed: Optional[int] = None, shards: Optional[int] = None,
              *, allow_nonfinite: Optional[bool] = None) -> "Table":
        """Get or create the embedding table ``name``: uint64 keys -> rows of ``dim``.

        On creation ``dim`` and ``capacity`` (keys the table holds, >= 1) are required;
        ``dtype`` defaults to float32, ``optimizer`` to Sum(), ``init`` to zeros (or a
        number, ``("uniform", a, b)``, ``("normal", mean, std)``), ``seed`` to 0,
        ``shards`` to about one per 64 MiB of values.  When the table exists, every
        argument given must match it (SchemaError); omitted ones accept it.  Safe to
        race from many processes: one creates, all get it.  docs/tables.md."""
        from . import table as tmod

        names.check_name(name, "tensor name") if not _loose_name(name) else None
        # (ints from here: a 0-d array or a numpy integer would not go into the JSON record)
        dim, capacity, seed, shards = tmod.check_args(dim, capacity, seed, shards)
        req: dict[str, Any] = {"kind": "table"}
        dt = _dtype(dtype) if dtype is not None else None
        if dt is not None:
            req["dtype"] = dt.name
        for key, v in (("dim", dim), ("capacity", capacity), ("seed", seed)):
            if v is not None:
                req[key] = v
        if optimizer is not None:
            req["optimizer"] = as_updater(optimizer).to_dict()
        if init is not None:
            req["init_spec"] = tmod.init_spec(init, dt if dt is not None else np.dtype("float32"))
        if allow_nonfinite is not None:
            req["allow_nonfinite"] = check_flag(allow_nonfinite, "allow_nonfinite")
        nshards = shards

        def create() -> dict:
            _check_not_reserved(name)
            rec = tmod.create_record(name, req, init, nshards)
            check_room(f"table {name!r} of capacity {rec['capacity']:,} x {rec['dim']}",
                       rec["capacity"] * rec["dim"] * np.dtype(rec["dtype"]).itemsize)
            upd = from_dict(rec["optimizer"])
            specs = tmod.shard_specs(rec, upd)

            def fill(s: int, seg: Segment, lay: dict) -> None:
                _native.check(lib.shmps_table_setup(seg.ptr, rec["capacity"], rec["nshards"], s),
                              f"table {name!r} shard {s}")

            return self._create_tensor(rec, specs, fill)

        t = self._get_or_create(name, req, create)
        if nshards is not None and t.nshards != nshards:
            raise SchemaError(f"table {name!r} exists with {t.nshards} shards, requested "
                              f"{nshards}", "omit shards= to accept the existing table")
        return t

    def csr(self, name: str, rowcnt: Any = None, colidx: Any = None, dtype: Any = None,
            init: Any = 0.0, optimizer: UpdaterLike = None, shape: Optional[Sequence[int]] = None,
            *, allow_nonfinite: Optional[bool] = None,
            shard_rows: Optional[int] = None) -> "CSRTensor":
        """Get or create the csr tensor ``name``: a matrix with the fixed structure
        ``rowcnt`` (row offsets, rows + 1 entries from 0) and ``colidx`` (columns,
        strictly increasing within each row).

        On creation: ``init`` is a scalar or one value per entry; ``shape`` defaults to
        (rows, largest column + 1); ``dtype`` float32, ``optimizer`` Sum().  When the
        tensor exists, the structure and every argument given must match (SchemaError).
        Validating the structure is O(nnz)."""
        from . import csr as cmod

        names.check_name(name, "tensor name") if not _loose_name(name) else None
        req: dict[str, Any] = {"kind": "csr"}
        dt = _dtype(dtype) if dtype is not None else None
        if dt is not None:
            req["dtype"] = dt.name
        if optimizer is not None:
            req["optimizer"] = as_updater(optimizer).to_dict()
        if allow_nonfinite is not None:
            req["allow_nonfinite"] = check_flag(allow_nonfinite, "allow_nonfinite")
        shard_rows = check_int(shard_rows, "shard_rows", 1, none=True)
        rc = ci = None
        if colidx is None and (isinstance(rowcnt, CSR) or hasattr(rowcnt, "indptr")):
            # (push takes a matrix, so csr(name, m) is what a user tries: it was told
            # "pass both rowcnt and colidx, or neither")
            raise InvalidArgument(
                f"store.csr({name!r}, ...): a {type(rowcnt).__name__} matrix given as "
                "rowcnt; csr takes the structure and the values apart",
                "scipy: store.csr(name, m.indptr, m.indices, init=m.data, shape=m.shape); "
                "shmps.CSR: store.csr(name, c.rowcnt, c.colidx, init=c.value)")
        if (rowcnt is None) != (colidx is None):
            raise InvalidArgument("pass both rowcnt and colidx, or neither")
        if shape is not None:
            shp = list(_shape(shape))   # (int() took 2.5 as 2)
            if len(shp) != 2 or min(shp) < 0:
                raise SchemaError(f"shape {tuple(shape)!r} must be (rows, cols)",
                                  "give shape as two integers >= 0, or leave it out")
            req["shape"] = shp
        if rowcnt is not None:
            ci = cmod.check_colidx(colidx, req["shape"][1] if "shape" in req else None)
            rc = cmod.check_rowcnt(rowcnt, ci.size)
            if "shape" in req and req["shape"][0] != rc.size - 1:
                raise SchemaError(f"shape {tuple(req['shape'])} but rowcnt has {rc.size - 1} rows",
                                  "rowcnt holds rows + 1 offsets: pass shape=(rows, cols) of "
                                  "that many rows, or leave shape out")
            cmod.check_sorted(rc, ci)
            req["structure"] = cmod.structure_hash(rc, ci)

        def create() -> dict:
            _check_not_reserved(name)
            rec = cmod.create_record(name, req, rc, ci, shard_rows)
            assert rc is not None and ci is not None
            dt_ = np.dtype(rec["dtype"])
            values = cmod.init_values(init, ci.size, dt_, rec["allow_nonfinite"])
            upd = from_dict(rec["optimizer"])
            specs = cmod.shard_specs(rec, upd, rc)

            def fill(s: int, seg: Segment, lay: dict) -> None:
                sp = specs[s]
                r0, n = sp["row_begin"], sp["nrows"]
                e0, e1 = int(rc[r0]), int(rc[r0 + n])
                seg.array(np.int64, lay["rowcnt_off"], n + 1)[...] = rc[r0:r0 + n + 1] - e0
                seg.array(np.int64, lay["colidx_off"], e1 - e0)[...] = ci[e0:e1]
                vals = seg.array(dt_, lay["value_off"], e1 - e0)
                if np.ndim(values) == 0:
                    if values != 0:
                        vals[...] = values
                else:
                    vals[...] = values[e0:e1]
                # the structure was written after shmps_shard_init: check it as attach will
                _native.shard_validate(seg.ptr, seg.size, seg.name)

            return self._create_tensor(rec, specs, fill)

        def check_init(rec: dict) -> None:
            nnz, dt = int(rec["nnz"]), np.dtype(rec["dtype"])
            anf = bool(rec.get("allow_nonfinite", False))
            if not init_is_valid(init, (nnz,), dt, anf):   # (as for a dense tensor's)
                cmod.init_values(init, nnz, dt, anf)

        return self._get_or_create(name, req, create, check_init)

    def _get_or_create(self, name: str, req: dict, create: Any,
                       check_init: Any = None) -> Any:
        """The tensor ``name``: created by ``create()`` if absent, else its record must
        match ``req`` (_match); ``check_init(rec)``, if given, then checks the caller's
        init against the existing record (it is not used, but a bad one is refused in
        every worker, not only in the one that happened to create the tensor)."""
        with self._lock:
            self._mptr  # Closed after close()
            t = self._tensors.get(name)
            rec = t.record if t is not None else self._record(name)
            created = False
            if rec is None:
                self._lock_manifest()
                try:
                    rec = self._record(name)
                    if rec is None:
                        rec, created = create(), True
                finally:
                    lib.shmps_manifest_unlock(self._mptr)
            _match(rec, req)
            if check_init is not None and not created:
                check_init(rec)
            return t if t is not None else self._open(rec)

    def _lock_manifest(self) -> None:
        code = lib.shmps_manifest_lock(self._mptr, LOCK_TIMEOUT_S)
        if code < 0 or code > 1:
            _native.check(code, f"store {self.name!r}: manifest lock")
        # RECOVERED: a creator died holding the lock; its segments are not in the
        # catalog (records are appended last) and are replaced by _create_segments.

    def _creations_done(self) -> None:
        """For a removal, once the store is marked REMOVED: a tensor creation under way
        in an attached process (it checked the state before the mark) ends before the
        caller lists the shards; later ones see REMOVED and refuse (_create_tensor).
        Creations hold the manifest lock throughout, so taking it is the wait."""
        self._lock_manifest()
        lib.shmps_manifest_unlock(self._mptr)

    def _next_id(self) -> int:
        self._refresh()
        return len(self._record_list)

    def _create_segments(self, tid: int, what: str, specs: list[dict], fill: Any,
                         check: Any = None, reserve: bool = True) -> int:
        """Create, lay out and fill one segment per spec of tensor ``what`` (its name,
        for messages), then run ``check(segments)`` (if given) while they are all
        mapped; returns total bytes.  Removes what it made if anything fails."""
        made: list[Segment] = []
        total = 0
        lays = [_native.layout(spec) for spec in specs]
        if reserve and not self.reserve_memory:
            # created unbacked, backed later (shmps-bridge): the reservation that refuses
            # a tensor /dev/shm has no room for comes after it is in use, so refuse one
            # now that would not fit whole, its optimizer state included, beside the
            # ones still being backed (a copy that fits only in part is a SIGBUS later)
            need = sum(lay["total_size"] for lay in lays)
            unbacked = self.unbacked_bytes()
            pending = f" beside {unbacked:,} bytes of tensors still being backed" \
                if unbacked else ""
            check_room(f"tensor {what} ({len(specs)} segments of {need:,} bytes in "
                       f"all{pending})", need + unbacked)
        try:
            for s, (spec, lay) in enumerate(zip(specs, lays)):
                name = names.shard_name(self.name, self.namespace, tid, s)
                unlink(name)  # debris of a creator that died before registering
                seg = Segment.create(name, lay["total_size"], huge=True,
                                     reserve=reserve and self.reserve_memory)
                made.append(seg)
                if not (reserve and self.reserve_memory):
                    _reserve_written_at_creation(seg, spec, lay)
                _native.shard_init(seg.ptr, seg.size, spec)
                fill(s, seg, lay)
                total += seg.size
            if check is not None:
                check(made)
        except BaseException:
            for seg in made:
                seg.close()
                unlink(seg.name)
            raise
        for seg in made:
            seg.close()
        return total

    @contextlib.contextmanager
    def _adopting(self, origin: Optional[str]) -> Iterator[None]:
        """Tensors this handle creates in this block are copies of a tensor made on host
        ``origin`` (the bridge's event loop, the one thread of its process that creates
        tensors, is the caller): their records say so ("origin"), so a
        bridge process started later on this store knows it did not create them (its
        initial values are the origin's, not this host's: bridge Bridge._is_origin)."""
        self._adopting_from = origin
        try:
            yield
        finally:
            self._adopting_from = None

    def _create_tensor(self, rec: dict, specs: list[dict], fill: Any,
                       check: Any = None, reserve: bool = True) -> dict:
        """Give ``rec`` the next tensor id, create its segments (:meth:`_create_segments`)
        and append it to the catalog (under the manifest lock); returns the record.  If
        the append fails (the catalog's next page finds /dev/shm full, the catalog is
        full) the segments are removed: nothing is left behind."""
        # (under the manifest lock) a handle whose store another process destroyed, or
        # replaced with a restored one, must not create: its "debris" unlink of the
        # shard names would take the new store's shards, and what it made would be
        # orphans (destroy() takes this lock before it lists the shards)
        if not (lib.shmps_manifest_usable(self._mptr, _native.token())
                and self._manifest.is_named()):  # type: ignore[union-attr]
            raise Closed(f"store {self.name!r} was destroyed or replaced by another "
                         f"process; tensor {rec['name']!r} was not created",
                         "attach the store again")
        if self._adopting_from is not None:
            rec["origin"] = self._adopting_from   # (Store._adopting)
        rec["id"] = tid = self._next_id()
        rec["bytes"] = self._create_segments(tid, repr(rec["name"]), specs, fill, check,
                                             reserve)
        try:
            return self._append(rec)
        except BaseException:
            for s in range(len(specs)):
                unlink(names.shard_name(self.name, self.namespace, tid, s))
            raise

    def _append(self, rec: dict) -> dict:
        data = json.dumps(rec, separators=(",", ":")).encode()
        # the catalog's pages are backed as records reach them (see Segment.create); under
        # the manifest lock only this process appends, so its last read length is current
        self._refresh()
        end = self._catalog_len
        if end + 4 + len(data) <= lib.SHMPS_CATALOG_BYTES:
            try:
                self._manifest.reserve(lib.SHMPS_CATALOG_OFF + end,  # type: ignore
                                       4 + len(data))
            except CapacityError as exc:
                raise NoRoom(f"store {self.name!r}: /dev/shm has no room for the "
                                    f"catalog page of tensor {rec['name']!r}'s record "
                                    f"({shm_free():,} bytes free)", exc.hint) from None
        _native.check(lib.shmps_catalog_append(self._mptr, data, len(data)),
                      f"store {self.name!r}: catalog (too many tensors)")
        self._refresh()
        return self._records[rec["name"]]

    def _create_dense(self, name: str, req: dict, init: Any, hidden_ok: bool = False) -> dict:
        """Create dense tensor ``name`` of request ``req`` (under the manifest lock);
        ``hidden_ok``: shmps/aggregate.py creating an aggregated tensor's hidden tensors."""
        _check_not_reserved(name, hidden_ok)
        if "shape" not in req:
            raise NotFound(f"no tensor {name!r} in store {self.name!r}",
                           "pass shape= (and dtype=, optimizer=) to create it")
        shape = tuple(req["shape"])
        dt = np.dtype(req.get("dtype", "float32"))
        upd = from_dict(req["optimizer"]) if "optimizer" in req else as_updater(None)
        if upd.float_only and dt.kind != "f":
            raise SchemaError(f"optimizer {type(upd).__name__} needs a float dtype, not {dt}",
                              "use Sum/Assign/Max/Min for integer tensors")
        mode = req.get("mode", "exact")
        nrows = shape[0] if shape else 1
        row_len = int(np.prod(shape[1:], dtype=np.int64)) if shape else 1
        shard_rows = req.get("shard_rows") or default_shard_rows(shape, dt.itemsize)
        shard_rows = max(1, min(shard_rows, max(nrows, 1)))
        init_arr = _init_array(init, shape, dt, bool(req.get("allow_nonfinite", False)))
        check_room(f"tensor {name!r} {shape} of {dt}", nrows * row_len * dt.itemsize)
        nshards = check_shard_count(f"tensor {name!r}", nrows, shard_rows)
        rec = {"name": name, "kind": "dense", "dtype": dt.name, "shape": list(shape),
               "shard_rows": shard_rows, "nshards": nshards, "optimizer": upd.to_dict(),
               "mode": mode, "allow_nonfinite": bool(req.get("allow_nonfinite", False))}
        rec.update({k: req[k] for k in ("aggregate", "workers") if k in req})
        specs = _dense_specs(rec)

        def fill(s: int, seg: Segment, lay: dict) -> None:
            vals = seg.array(dt, lay["value_off"], lay["nnz"])
            if np.ndim(init_arr) == 0:
                if init_arr != 0:
                    vals[...] = init_arr
            else:
                r0 = s * shard_rows
                vals[...] = init_arr.reshape(nrows, row_len)[r0:r0 + specs[s]["nrows"]].ravel()

        return self._create_tensor(rec, specs, fill)

    def _restore_dense(self, rec: dict, values: np.ndarray, states: list, step: int,
                       bar: Any) -> None:
        """Create a dense tensor from checkpointed arrays (flat, row-major)."""
        if _is_outbox(rec):
            return  # pushes pending in an outbox are not part of the model (outbox.py)
        rec = dict(rec)
        dt = np.dtype(rec["dtype"])
        specs = _dense_specs(rec)
        if len(states) != _native.layout(specs[0])["nstate"]:
            raise CorruptSegment(f"checkpoint of {rec['name']!r}: {len(states)} state arrays, "
                                 f"its optimizer needs {_native.layout(specs[0])['nstate']}")

        def fill(s: int, seg: Segment, lay: dict) -> None:
            e0 = specs[s]["row_begin"] * specs[s]["row_len"]
            e1 = e0 + lay["nnz"]
            _copy_in(seg.array(dt, lay["value_off"], lay["nnz"]), values, e0, e1)
            sdt = _native.DTYPE_NAMES[lay["state_dtype"]]
            for k, st in enumerate(states):
                _copy_in(seg.array(sdt, lay["state_off"][k], lay["nnz"]), st, e0, e1)
            if s == 0:
                lib.shmps_set_step(seg.ptr, step)
            _native.check(lib.shmps_dense_set_stripe_steps(seg.ptr, step),
                          f"restore {rec['name']!r} (shard {s})")
            # the bytes read from the files (the plan's total, checkpoint._plan_dense):
            # the segment's size (header, stripe words, pages) ran the bar past it
            bar.update(lay["nnz"] * (dt.itemsize + len(states) * np.dtype(sdt).itemsize))

        with self._lock:
            self._lock_manifest()
            try:
                if self._record(rec["name"]) is not None:
                    raise SchemaError(f"tensor {rec['name']!r} already exists in {self.name!r}")
                self._create_tensor(rec, specs, fill)
            finally:
                lib.shmps_manifest_unlock(self._mptr)

    def _restore_raw(self, rec: dict, specs: list, values: Any, states: list, raw: list,
                     shards: list, bar: Any) -> None:
        """Create a table or csr tensor from checkpointed shard regions (checkpoint.py:
        ``_save_sparse``): every segment is filled and checked before the record is
        appended, so no process sees a half-restored tensor."""
        from .checkpoint import _AUX_STEP_MASK, _table_check, _write_regions

        if _is_outbox(rec):
            return  # pushes pending in an outbox are not part of the model (outbox.py)
        rec = dict(rec)
        dt = np.dtype(rec["dtype"])
        table = rec["kind"] == "table"
        live = sum(x["table_used"] for x in shards)
        # a checkpoint taken during pushes: no row's last push after the table step
        # (shard 0's, restored below)
        last = max((int((np.asarray(r["stripes"][1::2]) & np.uint64(_AUX_STEP_MASK))
                        .max(initial=0)) for r in raw), default=0) if table else 0
        starts = np.concatenate([[0], np.cumsum([sp["nnz"] for sp in specs])]).astype(int)

        def fill(s: int, seg: Segment, lay: dict) -> None:
            n, d, e0 = lay["nnz"], raw[s], int(starts[s])
            _copy_in(seg.array(dt, lay["value_off"], n), values, e0, e0 + n)
            sdt = _native.DTYPE_NAMES[lay["state_dtype"]]
            for k, st in enumerate(states):
                _copy_in(seg.array(sdt, lay["state_off"][k], n), st, e0, e0 + n)
            if not table:
                seg.array(np.int64, lay["rowcnt_off"], lay["nrows"] + 1)[...] = d["_rowcnt"]
                seg.array(np.int64, lay["colidx_off"], n)[...] = d["_colidx"]
            _write_regions(seg, lay, d, shards[s]["table_used"], live, s == 0)
            step = shards[s]["step"]
            if table and s == 0:
                step = max(step, last)
            lib.shmps_set_step(seg.ptr, step)
            if not table:  # as attach will: the structure
                _native.shard_validate(seg.ptr, seg.size, seg.name)
            bar.update(seg.size)

        def check(made: list) -> None:
            if table:
                _table_check(rec["name"], [seg.ptr for seg in made])

        with self._lock:
            self._lock_manifest()
            try:
                if self._record(rec["name"]) is not None:
                    raise SchemaError(f"tensor {rec['name']!r} already exists in {self.name!r}")
                self._create_tensor(rec, specs, fill, check)
            finally:
                lib.shmps_manifest_unlock(self._mptr)

    def checkpoint(self, path: Any) -> str:
        """Save every tensor (values, optimizer state, steps) to directory ``path``.

        Each shard is copied while no push is inside it; pushes go on meanwhile.
        The directory is written beside ``path`` and swapped in atomically, so
        ``path`` always holds a whole checkpoint (old or new).  Shows a progress bar
        on a terminal.  Cost: one copy of every shard plus the file writes.

        This process's ``push(..., wait=False)`` calls are waited for first, as
        :meth:`flush` and :meth:`clock` wait for them: a checkpoint at the end of an
        epoch of non-blocking pushes missed the last ones, still queued."""
        from .checkpoint import save

        self._wait_own_pushes()   # pushes made with wait=False land first
        return save(self, path)

    # -- the multi-host bridge (shmps/outbox.py) -----------------------------------
    def _set_forwarding(self, on: bool) -> None:
        """Turn forwarding on or off for every process of the store (shmps-bridge):
        while on, pushes to every tensor (dense, table, csr) go to their outboxes."""
        _native.check(lib.shmps_forward_set(self._mptr, int(bool(on))), "set forwarding")

    @property
    def _forwarding(self) -> bool:
        """Whether pushes go to outboxes now (read from shared memory each time)."""
        return bool(lib.shmps_forward_get(self._mptr))

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait until every push made so far to this store has reached the owner of
        its shard, while shmps-bridge forwards pushes to other hosts.

        Reads, for every outbox shard, how many pushes it holds now, and waits until
        the bridge reports each of those applied by the shard's owner (so pulls on
        the owner see them; here, once its updated rows come back).  Pushes this
        process made with ``wait=False`` are waited for first.  Returns at once when
        nothing was forwarded (no bridge, or everything acknowledged).  ``timeout``
        (seconds, default 60; ``math.inf`` to wait indefinitely): then raises
        :class:`shmps.Timeout` naming the tensor and shard that lag.  Wakes the bridge
        (it drains at once instead of at its next flush interval), then sleeps until
        the bridge says acknowledgements came (a futex word; at most 20 ms at a time)."""
        self._wait_own_pushes()   # pushes made with wait=False land first
        from .outbox import flush
        flush(self, timeout)

    # -- non-blocking pushes -----------------------------------------------------
    def _wait_own_pushes(self) -> None:
        """Until every push this process made with wait=False has been applied (the push
        thread runs them in order: a no-op queued after them ends after them).

        At interpreter exit concurrent.futures shuts every ThreadPoolExecutor down
        (threading's exit hooks, before atexit handlers run) and its threads then run
        what was queued and end: a submit raises RuntimeError from then on, and
        checkpoint() or clock() in an atexit handler raised it.  Then the thread is
        joined instead (shutdown(wait=True): it returns once the queued pushes ran)."""
        ex = self._executor
        if ex is None or self._executor_pid != os.getpid():
            return
        fut = submit_or_none(ex, int)
        if fut is None:
            ex.shutdown(wait=True)
            return
        fut.result()

    def _submit(self, fn: Any, *args: Any) -> PushHandle:
        with self._lock:
            if self._executor is None or self._executor_pid != os.getpid():
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shmps-push")
                self._executor_pid = os.getpid()
            ex = self._executor
            queued = submit_or_none(ex, fn, *args)
            if queued is not None:
                return PushHandle(queued)
        # The pool takes no more work: concurrent.futures refuses it from every pool once
        # its exit hook ran (interpreter exit, before atexit handlers), and a push with
        # wait=False in an atexit handler raised RuntimeError, unapplied.  It is applied
        # here, now, after the pushes queued before it (shutdown(wait=True) returns once
        # the push thread ran them, as _wait_own_pushes): the handle is done, its error
        # raised by its wait as a push thread's would be.
        ex.shutdown(wait=True)
        fut: Future[None] = Future()
        try:
            fn(*args)
        except Exception as exc:
            fut.set_exception(exc)
        else:
            fut.set_result(None)
        return PushHandle(fut)

    def wait(self, handle: PushHandle, timeout: Optional[float] = None) -> None:
        """Block until a ``push(..., wait=False)`` is applied (re-raises its error);
        ``timeout`` as :meth:`PushHandle.wait` takes it.  Anything but a PushHandle is
        an InvalidArgument (None, which a push with wait=True returns, raised
        AttributeError)."""
        if not isinstance(handle, PushHandle):
            raise InvalidArgument(
                f"store.wait({handle!r}): wait takes the PushHandle that "
                "push(..., wait=False) returns",
                "a push with wait=True (the default) returns None, applied already: "
                "there is nothing to wait for")
        handle.wait(timeout)

    # -- worker clocks (consistency) ---------------------------------------------
    def set_consistency(self, staleness: Optional[int]) -> None:
        """Choose the consistency of worker clocks for every process of the store:
        ``None`` eventual (clock() never waits), ``0`` sequential (a barrier per
        clock), ``k > 0`` bounded delay (no worker more than k clocks ahead of the
        slowest live one)."""
        k = _staleness_word(staleness)
        _native.check(lib.shmps_set_staleness(self._mptr, k), "set_consistency")

    @property
    def staleness(self) -> Optional[int]:
        """The store's bound (None = eventual)."""
        k = int(lib.shmps_get_staleness(self._mptr))
        return None if k < 0 else k

    def join(self, worker: Optional[int] = None) -> int:
        """Become a worker of the store's job; returns the worker id (slot).

        ``worker=`` asks for a given id (free, or left by a dead process).  The new
        worker's clock starts at the slowest live worker's clock."""
        # (int() would take -5 as "any id", 2.5 as 2, True as 1; the C core's bound
        # error would speak of rows)
        wid = check_int(worker, "worker", 0, lib.SHMPS_MAX_WORKERS - 1, none=True,
                        hint="join() without an id picks a free one")
        with self._lock:
            if self._worker is not None:
                if wid is not None and wid != self._worker:
                    raise InvalidArgument(f"this process is already worker {self._worker} of "
                                          f"store {self.name!r}; it cannot also be worker "
                                          f"{wid}",
                                          "call store.leave() first to change its id")
                return self._worker
            slot, clock = ffi.new("uint32_t *"), ffi.new("uint64_t *")
            want = -1 if wid is None else wid
            code = lib.shmps_worker_join(self._mptr, _native.token(), want, slot, clock)
            if code == lib.SHMPS_E_ARG and wid is not None:
                raise InvalidArgument(f"worker id {wid} is held by a live process",
                                      "join() without an id picks a free one")
            _native.check(code, f"join store {self.name!r}")
            self._worker = int(slot[0])
            return self._worker

    def leave(self) -> None:
        """Stop being a worker: the others no longer wait for this one."""
        with self._lock:
            if self._worker is not None and self._manifest is not None:
                lib.shmps_worker_leave(self._mptr, _native.token(), self._worker)
            self._worker = None

    def clock(self, timeout: Optional[float] = None) -> int:
        """Advance this worker's clock; returns the new value.

        With ``staleness=k`` it blocks (sleeping on a futex, GIL released) until no
        live worker is more than k clocks behind; a dead worker is dropped within a
        few ms.  Raises :class:`shmps.Timeout` naming the slowest worker after
        ``timeout`` seconds (default: wait forever).  Joins first if needed."""
        c_timeout = _clock_timeout(timeout)
        if self._worker is None:
            self.join()
        self._wait_own_pushes()   # pushes made with wait=False land first
        clock, behind = ffi.new("uint64_t *"), ffi.new("int32_t *")
        code = lib.shmps_worker_clock(self._mptr, _native.token(), self._worker,
                                      c_timeout, clock, behind)
        if code == lib.SHMPS_E_TIMEOUT:
            w = {x["worker"]: x for x in self.workers()}.get(int(behind[0]), {})
            from .errors import Timeout
            raise Timeout(f"clock {int(clock[0])} of worker {self._worker}: worker "
                          f"{behind[0]} (pid {w.get('pid')}) is at clock {w.get('clock')}, "
                          f"more than {self.staleness} behind after {timeout} s",
                          "that worker is slow, stopped or stuck; raise the timeout")
        if code == lib.SHMPS_E_ARG:
            self._worker = None
            raise InvalidArgument("this worker was dropped from the store (declared dead)",
                                  "call store.join() again")
        _native.check(code, "clock")
        return int(clock[0])

    def workers(self) -> list[dict]:
        """Live workers: ``{"worker", "pid", "clock"}`` each."""
        n = lib.SHMPS_MAX_WORKERS
        toks, clocks = ffi.new("uint64_t[]", n), ffi.new("uint64_t[]", n)
        lib.shmps_worker_list(self._mptr, toks, clocks, n)
        return [{"worker": i, "pid": _native.token_pid(int(toks[i])), "clock": int(clocks[i])}
                for i in range(n) if toks[i] and _native.token_alive(int(toks[i]))]

    # -- processes and lifecycle -------------------------------------------------
    def processes(self) -> list[int]:
        """Pids of live processes attached to this store."""
        n = ffi.new("uint32_t *")
        toks = ffi.new("uint64_t[]", lib.SHMPS_MAX_PROCS)
        lib.shmps_proc_list(self._mptr, toks, lib.SHMPS_MAX_PROCS, n)
        return sorted({_native.token_pid(int(toks[i])) for i in range(n[0])
                       if _native.token_alive(int(toks[i]))})

    def _lease_for_fork(self) -> Optional[int]:
        """Before a fork: a second slot in the attached-process table under this
        process's token, which the child takes over (_forked).  The store thus has a
        live attached process at every instant from the fork to the child's close():
        the child registering only once forked left a gap in which the parent's close()
        and a gc removed the store under the child (review 12, F6: 428 of 429 forks
        beside a gc loop).  The parent frees it only once it knows that no child took
        it: freed before the child took it, the gap was back.  A fork that failed (RLIMIT_NPROC, EAGAIN) has no child to
        take it: the parent gives it back once it knows (_Fork.settle), or each failed
        fork left a slot counted as the parent's until it exited (gc kept the store the
        parent had closed; a loop of failed forks filled the table).  A child killed
        before its fork handler ran leaves it too, given back as for a failed fork if the
        parent still has the store open then, else counted as the parent's until the
        parent exits.  None if the table is full (the child registers anew)."""
        # under the lock: another thread's close() must not unmap the manifest meanwhile
        # (reentrant: the forking thread may hold it; bounded: a fork never hangs on it)
        if not self._lock.acquire(timeout=5.0):
            return None
        try:
            m = self._manifest
            if m is None or m.ptr is None or self._proc_token != _native.token():
                return None
            slot = ffi.new("uint32_t *")
            if lib.shmps_proc_register(m.ptr, self._proc_token, slot) != 0:
                return None
            return int(slot[0])
        finally:
            self._lock.release()

    def _forked(self, lease: Optional[int]) -> bool:
        """In a child forked while this store was open: the child maps the same memory
        and may push, so it counts as attached too (its own slot in the attached-process
        table, which its close() frees), or `shmps-tool ls` saw nobody once the parent
        ended and `shmps-tool gc` removed the store under the training child.  The slot
        is the one the parent took for it before the fork (``lease``, moved from the
        parent's token to the child's), so the store is never without a live attached
        process meanwhile.  It is not the parent's clock worker (it joins as its own).
        Runs in the fork handler, without the lock: another thread of the parent may
        have held it at the fork, and that thread does not exist here, so the child gets
        a new lock (with the old one it hung at its first store call).  True if the
        child took ``lease``."""
        self._lock = threading.RLock()
        self._catalog_lock = threading.Lock()   # (_refresh's reads; a leaf lock)
        m = self._manifest
        self._worker = None
        if m is None or m.ptr is None:
            return False
        parent, child = self._proc_token, _native.token()
        self._proc_token = child
        if lease is not None and lib.shmps_proc_handover(m.ptr, lease, parent, child) == 0:
            self._proc_slot = lease
            return True
        slot = ffi.new("uint32_t *")
        if lib.shmps_proc_register(m.ptr, child, slot) == 0:
            self._proc_slot = int(slot[0])
        else:
            # a full table leaves the child unlisted (a fork handler cannot raise)
            self._proc_token = 0
        return False

    def _give_back(self, lease: int) -> None:
        """A slot taken for a child (_lease_for_fork) that no child took: free it, if it
        still holds this process's token (CAS).  Called under _FORKS_LOCK, under which
        close() unmaps the manifest."""
        m = self._manifest
        if m is not None and m.ptr is not None and self._proc_token == _native.token():
            lib.shmps_proc_unregister(m.ptr, self._proc_token, lease)

    def close(self) -> None:
        """Detach this process (local, idempotent); tensors and views become unusable
        except arrays already returned by view(), which stay mapped until collected."""
        with self._lock:
            if self._executor is not None and self._executor_pid == os.getpid():
                self._executor.shutdown(wait=True)
            self._executor = None
            if self._worker is not None and self._manifest is not None \
                    and self._proc_token == _native.token():
                self.leave()
            for t in self._tensors.values():
                t.close()
            self._tensors.clear()
            if self._manifest is not None:
                # (under _FORKS_LOCK: a fork settled meanwhile gives a lease back into a
                # mapped manifest, or finds it gone)
                with _FORKS_LOCK:
                    _settle_forks_locked(self)
                    if self._manifest.ptr is not None and self._proc_token == _native.token():
                        lib.shmps_proc_unregister(self._manifest.ptr, self._proc_token,
                                                  self._proc_slot)
                    self._manifest.close()
                    self._manifest = None
            self._bell.close()

    def destroy(self) -> None:
        """Remove every segment of the store (global).  Processes still attached
        keep their mappings until they close; a later attach makes a new store.

        The manifest is marked "being removed" first (native/manifest.c,
        shmps_manifest_take_removal): an attach meanwhile waits for the removal, and if
        this process is killed midway the next attach finishes it, instead of finding a
        store whose catalog names tensors some of whose shards are gone."""
        m = self._manifest
        if m is None or m.ptr is None:
            self._destroy_closed()
            return
        wait = Wait(DESTROY_WAIT, poll=0.001)
        # until it holds the removal, or the name no longer names this store (another
        # process removed it, or replaced it: nothing of this store is left to remove;
        # holding the claim, no one else can remove or replace it meanwhile)
        while (lib.shmps_manifest_take_removal(m.ptr, _native.token()) != 0
               and m.is_named()):
            # `shmps-tool gc` is deciding about this store, or removing it
            wait.again(lambda: removal_held(self.name, int(lib.shmps_manifest_retired_by(m.ptr)),
                                            DESTROY_WAIT, "retry destroy() once it is done"))
        if not m.is_named():
            self.close()
            return
        try:
            self._creations_done()
            # unlinked while this process is still attached: mapped, its claim stays
            # readable, and a takeover never finds the removal unclaimed by the living
            _unlink_store(self.name, self.namespace)
        except BaseException:
            # (Ctrl-C, a failed unlink) the removal is decided (REMOVED stays) but not
            # finished: the next attach or gc finishes it, as a dead remover's, instead
            # of waiting for this process to exit (review 12, F8)
            lib.shmps_manifest_let_go(m.ptr, _native.token())
            self.close()
            raise
        self.close()

    def _destroy_closed(self) -> None:
        """destroy() through a closed handle: the store under the name, if it is still
        the one this handle had (the same manifest inode), removed as destroy() does;
        a store made under the name since is not this handle's to remove."""
        try:
            again = attach(self.name, create=False, namespace=self.namespace or "")
        except NotFound:
            return
        if again._manifest is not None and again._manifest.ino == self._manifest_ino:
            again.destroy()
        else:
            again.close()

    def _renew_for_restore(self) -> "Store":
        """``restore --force``: replace this store, which this process is restoring into
        (RESTORING, claimed by it), by a new empty one born RESTORING and claimed,
        without the name ever being free: a free name let a waiting attacher make an
        empty store of its own first and watch the restored tensors appear one by one.
        Returns the new handle; this one is closed.

        In order: the new manifest is made under a temporary name (a failure there
        changes nothing: the caller gives the old store back); the old store is marked
        REMOVED under this process's claim (killed from here on, the next attach or gc
        finishes the removal; RESTORING, it put the half-unlinked store back READY when
        another process was attached); creations under way in attached processes end
        (they checked the state before; their shards would be the new store's names);
        the old shards go while the old manifest stays (attachers keep waiting); the new
        manifest is renamed over the old one.  A failure after the mark removes both."""
        name, ns = self.name, self.namespace
        mname = names.manifest_name(name, ns)
        tmp = names.restore_manifest_name(name, ns, os.getpid())
        unlink(tmp)
        seg, _ = Segment.open_or_create(tmp, MANIFEST_SIZE, reserve=MANIFEST_RESERVED)
        try:
            ident = names.manifest_ident(name, ns)
            _native.check(lib.shmps_manifest_init(seg.ptr, seg.size, _native.token(), 2.0,
                                                  ident, len(ident), 1),
                          f"store {name!r} new manifest {tmp}")
        except BaseException:
            seg.close()
            unlink(tmp)
            raise
        try:
            _native.check(lib.shmps_manifest_take_removal(self._mptr, _native.token()),
                          f"store {name!r}: its removal")
            self._creations_done()
            prefix = names.store_prefix(name, ns)
            for n in list_names(prefix[1:]):
                if _is_own_segment(n, prefix) and n != mname:
                    unlink(n)
            os.rename("/dev/shm" + tmp, "/dev/shm" + mname)
        except BaseException:
            seg.close()
            unlink(tmp)
            self.destroy()   # the old one: still named, REMOVED and claimed by this process
            raise
        seg.name = mname
        self.close()
        return Store(name, ns, seg)

    def __reduce__(self) -> tuple:
        """Pickled (an argument of a spawned process, say), a store is its name: the
        other process attaches the same store (``create=False``: NotFound if it is gone
        by then) and must close it as its own."""
        self._mptr  # Closed after close()
        return (_attach_pickled, (self.name, self.namespace or ""))

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        ns = f" namespace={self.namespace!r}" if self.namespace else ""
        return f"<shmps.Store {self.name!r}{ns}>"


def _copy_in(dst: np.ndarray, src: np.ndarray, e0: int, e1: int) -> None:
    """``dst[...] = src[e0:e1]``; from a file-backed memmap, read the bytes straight
    into ``dst`` (one kernel copy, instead of faulting in the file's pages one by one:
    about 3x faster for large restores)."""
    if isinstance(src, np.memmap) and getattr(src, "filename", None) and src.base is not None \
            and dst.dtype == src.dtype and dst.size == e1 - e0:
        try:
            f = open(src.filename, "rb", buffering=0)
        except FileNotFoundError:   # removed since it was mapped: the mapping still reads it
            dst[...] = src[e0:e1]
            return
        with f:
            f.seek(src.offset + e0 * src.itemsize)
            view = memoryview(dst).cast("B")
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise CorruptFile(f"{src.filename}: shorter than expected")
                got += n
        return
    dst[...] = src[e0:e1]


def _dense_specs(rec: dict) -> list[dict]:
    """The shard specs of a dense tensor record (see shmps_spec_t)."""
    shape = tuple(rec["shape"])
    dt = np.dtype(rec["dtype"])
    upd = from_dict(rec["optimizer"])
    nrows = shape[0] if shape else 1
    row_len = int(np.prod(shape[1:], dtype=np.int64)) if shape else 1
    shard_rows = rec["shard_rows"]
    flags = lib.SHMPS_F_IMPLICIT | (lib.SHMPS_F_HOGWILD if rec.get("mode") == "hogwild" else 0)
    if rec.get("allow_nonfinite"):
        flags |= lib.SHMPS_F_ALLOW_NONFINITE
    if rec.get("outbox_of") is not None:  # shmps/outbox.py: per-row pending counts
        flags |= lib.SHMPS_F_OUTBOX
    specs = []
    for s in range(rec["nshards"]):
        r0 = s * shard_rows
        rows = max(0, min(shard_rows, nrows - r0))
        specs.append({"kind": lib.SHMPS_DENSE, "dtype": _native.DTYPE_CODES[dt.name],
                      "updater": upd.code, "flags": flags, "nrows": rows, "row_len": row_len,
                      "nnz": rows * row_len, "row_begin": r0, "ncols": 0, "seed": 0,
                      "params": upd.params(), "init": []})
    return specs


def remove_idle(name: str, namespace: Optional[str], unborn_age: Optional[float] = None,
                *, only_empty: bool = False) -> Optional[list[str]]:
    """Remove store ``name`` if no live process is attached (``shmps-tool gc``): the
    names of the segments removed, or None if a process is attached (or attaches while
    this looks: native/manifest.c, shmps_manifest_retire) or another remover is at it.
    The shards go first and the manifest last, so an attach that waits for the removal
    (attach()) makes a new store whose shards no part of this removal can touch.
    Raises InvalidArgument for a store of another PID namespace (made there since gc's
    scan): its processes' pids mean nothing here, all would look dead.

    A store whose creation never finished (its manifest empty, its creator killed
    between shm_open and ftruncate, or not initialised, its initialiser dead) goes too
    if its manifest is at least ``unborn_age`` s old (gc's minimum age; None: kept):
    sized as any opener does, then marked removed under this process's claim of the
    initialisation (shmps_manifest_remove_unborn), so an attach meanwhile waits and
    makes a new store.

    ``only_empty``: keep (None) a store whose catalog has a tensor, looked at just
    before the claim (a failed bridge start's own store: a worker may have made a
    tensor in it and gone while the bridge closed; one attached is kept anyway)."""
    mname = names.manifest_name(name, namespace)
    old_enough = unborn_age is not None and age_of(mname) >= unborn_age
    try:
        seg = Segment.open(mname, expect_size=MANIFEST_SIZE, size_if_empty=old_enough)
    except NotFound:
        return []
    except CorruptSegment:
        if size_of(mname) == 0:   # a new store's, being made since the scan: kept
            return None
        raise
    try:
        _check_pid_namespace(name, seg, "gc")   # its live processes would look dead here
        if lib.shmps_manifest_state(seg.ptr) == 0:   # being created
            if not old_enough:
                return None
            code = lib.shmps_manifest_remove_unborn(seg.ptr, _native.token())
        else:
            if only_empty and int(lib.shmps_catalog_generation(seg.ptr)) != 0:
                return None
            code = lib.shmps_manifest_retire(seg.ptr, _native.token())
        if code == lib.SHMPS_E_BUSY:
            return None
        _native.check(code, f"store {name!r} manifest {mname}")
        # (claimed: the name, if still this manifest, stays so until the removal ends;
        # if not, this store was removed since the scan, and a new one may be there)
        return _unlink_store(name, namespace) if seg.is_named() else []
    finally:
        seg.close()


def _unlink_store(name: str, namespace: Optional[str]) -> list[str]:
    """Unlink every segment of a store, the shards first and the manifest last (an attach
    meanwhile finds the old store or none, and a new store made under the name never
    loses a shard to this removal); returns the names unlinked.  The prefix ends with
    '.', so store "a" never matches store "a.b"'s segments unless the suffix parses as
    one of ours (_is_own_segment)."""
    prefix = names.store_prefix(name, namespace)
    mname = names.manifest_name(name, namespace)
    shards = [n for n in list_names(prefix[1:]) if _is_own_segment(n, prefix) and n != mname]
    return [n for n in shards + [mname] if unlink(n)]


def _short_catalog(store: str, records: int, generation: int) -> str:
    """The CorruptSegment message of a catalog holding fewer records than appended."""
    return (f"store {store!r}: its catalog holds {records} records, but {generation} were "
            "appended (its length or generation word is damaged: tensors would be hidden)")


def _is_own_segment(seg: str, prefix: str) -> bool:
    """True if ``seg`` is ``prefix`` + "manifest" or + "t<id>.s<shard>"."""
    import re
    if not seg.startswith(prefix):
        return False
    rest = seg[len(prefix):]
    return rest == "manifest" or re.fullmatch(r"t\d+\.s\d+", rest) is not None


def _reserve_written_at_creation(seg: Segment, spec: dict, lay: dict) -> None:
    """A segment created without its pages backed (an outbox, the bridge's copies): back
    those its creation writes, the header and a table's control block (after its index,
    native/table.c ctl_of), so that creating it on a nearly full /dev/shm raises
    CapacityError instead of killing the creator with SIGBUS (review 13)."""
    seg.reserve(0, lib.SHMPS_HEADER_SIZE)
    if spec["kind"] == lib.SHMPS_TABLE:
        seg.reserve(lay["index_off"] + 16 * lay["nslots"], lib.SHMPS_TABLE_CTL_BYTES)


def _check_not_reserved(name: str, hidden_ok: bool = False) -> None:
    """Names ending in '#outbox' belong to the bridge's outboxes (shmps/outbox.py), those
    ending in '#agg0', '#agg1' or '#aggctl' to synchronous aggregation (shmps/aggregate.py,
    which alone creates them, passing ``hidden_ok``): a user tensor of such a name would
    be taken for the aggregated tensor's accumulator."""
    if name.endswith("#outbox"):
        raise InvalidArgument(f"tensor name {name!r}: names ending in '#outbox' are "
                              "reserved for the outboxes of shmps-bridge", "pick another name")
    if name.endswith(HIDDEN_SUFFIXES) and not hidden_ok:
        raise InvalidArgument(f"tensor name {name!r}: names ending in "
                              f"{', '.join(repr(x) for x in HIDDEN_SUFFIXES)} are reserved "
                              "for the hidden tensors of synchronous aggregation",
                              "pick another name")


def _is_outbox(rec: dict) -> bool:
    """A record of an outbox (a checkpoint drops the marker; the name is reserved)."""
    return rec.get("outbox_of") is not None or str(rec.get("name", "")).endswith("#outbox")


def _loose_name(name: object) -> bool:
    """Tensor names are free text (e.g. "fc.w", "layer/0"); they never reach a
    segment name.  Only non-strings and empty names are rejected."""
    if not isinstance(name, str) or not name or len(name) > 256:
        raise InvalidArgument(f"invalid tensor name {name!r}", "use a non-empty string "
                              "of at most 256 characters")
    return True


def _shape(shape: Any) -> tuple:
    """A tensor shape as a tuple of ints: every dimension an integer (a float, a bool
    or a string is refused, where int() would round 2.5 to 2 and take True for 1)."""
    # (a 1-d array, as np.zeros takes it: it was taken for one dimension and refused)
    dims = (shape if isinstance(shape, (tuple, list)) else
            shape.tolist() if isinstance(shape, np.ndarray) and shape.ndim == 1 else (shape,))
    out = []
    for x in dims:
        if isinstance(x, (bool, np.bool_)):
            raise SchemaError(f"invalid shape {shape!r}: {x!r} is not a size",
                              "give each dimension as an integer")
        try:
            out.append(operator.index(x))
        except TypeError:
            raise SchemaError(f"invalid shape {shape!r}: {x!r} is not an integer",
                              "give each dimension as an integer") from None
    return tuple(out)


_OPEN_STORES: "weakref.WeakSet[Store]" = weakref.WeakSet()   # for the fork handler


class _Fork:
    """One fork's leases (Store._lease_for_fork): ``(store, slot)`` for each open store
    (slot None where none was taken), and a pipe (close-on-exec, non-blocking) by which
    the child says which it took: one byte per lease, in order, as its handler moves
    each (b"1" taken, b"0" not).  The parent reads it once its own write end is closed:
    end of file means no process holds a write end any more, i.e. the child's handler
    has finished (or died), or there was no child (fork() failed).  A lease the child
    never reached still holds the parent's token, untouched since it was taken (no
    other process frees a live token's slot): the parent gives it back.  Without a
    pipe (no lease taken, or no fd left) nothing is given back (as before)."""

    def __init__(self, leases: list[tuple["Store", Optional[int]]]) -> None:
        self.leases = leases
        self.told = b""
        self.rfd = self.wfd = -1
        if any(slot is not None for _, slot in leases):
            try:
                self.rfd, self.wfd = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError:
                pass

    def tell(self, took: bool) -> None:
        """In the child: one lease handled."""
        if self.wfd >= 0:
            try:
                os.write(self.wfd, b"1" if took else b"0")
            except OSError:
                pass

    def close_fds(self) -> None:
        for fd in (self.rfd, self.wfd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.rfd = self.wfd = -1

    def settle(self) -> bool:
        """In the parent, under _FORKS_LOCK, its write end closed: True once the child
        has said all it will (end of file), the leases it never reached given back;
        False while a child holds the write end without having finished its handler."""
        if self.rfd < 0:
            return True
        try:
            while True:
                data = os.read(self.rfd, 256)
                if not data:
                    break
                self.told += data
        except BlockingIOError:
            return False
        except OSError:   # unreadable (not expected): keep the leases, as before pipes
            self.close_fds()
            return True
        for i, (st, slot) in enumerate(self.leases):
            if slot is not None and i >= len(self.told):
                st._give_back(slot)
        self.close_fds()
        return True


#: each thread's forks under way (thread id -> a stack: a fork made inside another's
#: handlers, by a hook registered before shmps's, nests), from the before-fork handler
#: to the after-fork ones; None for a fork that took no lease (_FORK_SERIAL not had)
_FORK_LEASES: dict[int, list[Optional[_Fork]]] = {}
#: held by a forking thread from its before-fork handler to its after-fork-in-parent
#: one, so a fork's pipe is made, forked and its write end closed (in the parent) with
#: no other thread forking meanwhile: a child inherits no other fork's write end.
#: Without it (review 15 F6) a thread whose os.pipe2 released the GIL came back to it
#: after another thread had forked: that child held the pipe unknown to its handler
#: (the pipe was not yet in _FORK_LEASES), and the fork stayed pending while that child
#: lived (a lease its own child never took kept until then).  Reentrant and released by
#: ownership, not by a _FORK_LEASES entry: a signal handler raising between the acquire
#: and the entry (Ctrl-C; CPython prints it and forks on) left it held for ever, and
#: every later fork waited FORK_SERIAL_TIMEOUT_S and took no lease (review 16 F1).  A
#: new one in a child.
_FORK_SERIAL = threading.RLock()
#: how long a fork waits for another thread's (seconds); past it, it takes no lease
#: (its child registers anew), so a fork never hangs on it
FORK_SERIAL_TIMEOUT_S = 10.0
#: forks whose child had not finished its handler when the parent looked
_PENDING_FORKS: list[_Fork] = []
#: taken to settle forks (give leases back) and by close() before it unmaps a manifest;
#: a new one in a child (another thread may have held it at the fork)
_FORKS_LOCK = threading.Lock()


def _settle_forks_locked(closing: Optional["Store"] = None) -> None:
    """Under _FORKS_LOCK: settle the pending forks; ``closing``, a store being closed, is
    then dropped from those still pending (their child takes its lease; a child that
    dies before its handler leaves it counted as this process's until it exits).  Its
    entries become "no lease", not removed: the child's bytes answer the leases by
    position (removed, a later store's lease was judged by the closed one's byte, and
    never given back: review 15 F5)."""
    _PENDING_FORKS[:] = [f for f in _PENDING_FORKS if not f.settle()]
    if closing is not None:
        for f in _PENDING_FORKS:
            f.leases = [(st, None if st is closing else slot) for st, slot in f.leases]


def _open_stores() -> list["Store"]:
    """The open stores' handles, listed in one step: list() of the WeakSet's set of
    references is one C call under the GIL.  list(_OPEN_STORES) iterates in Python (a
    generator), and another thread's attach adding to it meanwhile raised RuntimeError
    (Set changed size during iteration) in the before-fork handler: CPython printed it
    and that fork took no lease (review H11 of 2026-11-28)."""
    refs = list(_OPEN_STORES.data)
    return [st for st in (r() for r in refs) if st is not None]


def _before_fork() -> None:
    stack = _FORK_LEASES.setdefault(threading.get_ident(), [])
    # Held by this thread already: a fork nested in this thread's fork, or a hold left
    # by an earlier fork of this thread cut off between its acquire and its entry; it
    # serves this fork, and the outermost after-fork handler lets it go.
    if not (_FORK_SERIAL._is_owned()   # type: ignore[attr-defined]
            or _FORK_SERIAL.acquire(timeout=FORK_SERIAL_TIMEOUT_S)):
        stack.append(None)           # no leases, no pipe: the child registers anew
        return
    fork = _Fork([])
    try:
        if _PENDING_FORKS:
            with _FORKS_LOCK:
                _settle_forks_locked()
        fork = _Fork([(st, st._lease_for_fork()) for st in _open_stores()])
    finally:
        stack.append(fork)


def _after_fork_in_parent() -> None:
    # (CPython runs this after a failed fork() too, before os.fork raises)
    stack = _FORK_LEASES.get(threading.get_ident())
    try:
        fork = stack.pop() if stack else None
        if fork is None or fork.rfd < 0:
            return
        os.close(fork.wfd)
        fork.wfd = -1
        with _FORKS_LOCK:
            if not fork.settle():
                _PENDING_FORKS.append(fork)
    finally:
        if not stack:                # this thread's outermost fork: the others may fork
            _FORK_LEASES.pop(threading.get_ident(), None)
            while _FORK_SERIAL._is_owned():   # type: ignore[attr-defined]
                _FORK_SERIAL.release()


def _after_fork_in_child() -> None:
    global _FORKS_LOCK, _FORK_SERIAL
    _FORKS_LOCK = threading.Lock()
    _FORK_SERIAL = threading.RLock()
    stack = _FORK_LEASES.pop(threading.get_ident(), None)
    fork = stack.pop() if stack else None
    # the parent's pending forks, and the forks this one is nested in, are its to
    # settle: their fds closed here, or the parent took this child for one that has not
    # finished (no other thread's fork is under way: _FORK_SERIAL)
    for other in [f for st in _FORK_LEASES.values() for f in st] + (stack or []) \
            + _PENDING_FORKS:
        if other is not None:
            other.close_fds()
    _FORK_LEASES.clear()
    _PENDING_FORKS.clear()
    if fork is None:
        return
    # (its read end stays open until it has written: a write to a pipe without a
    # reader, the parent gone, raises SIGPIPE, which may kill)
    for st, slot in fork.leases:
        fork.tell(st._forked(slot))
    fork.close_fds()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


def _attach_pickled(name: str, namespace: str) -> "Store":
    """Store.__reduce__'s other half (``""``: no namespace, whatever the environment)."""
    return attach(name, create=False, namespace=namespace)


def _tensor_pickled(store: str, namespace: str, tensor: str) -> Tensor:
    """Tensor.__reduce__'s other half: the tensor of the store attached again."""
    return _attach_pickled(store, namespace)[tensor]


def _init_array(init: Any, shape: tuple, dt: np.dtype, allow_nonfinite: bool) -> Any:
    """A dense tensor's init: a scalar (numpy scalar of ``dt``) or a C-contiguous array
    of ``shape``, checked value by value (tensor.cast_init)."""
    a = cast_init(init, dt, allow_nonfinite)
    if a.ndim == 0:
        return a[()]
    if a.shape != tuple(shape):
        raise SchemaError(f"init array shape {a.shape} != tensor shape {tuple(shape)}",
                          "pass init as a scalar or an array of the tensor's shape")
    return a


def _check_record(rec: Any, where: str) -> None:
    """A catalog record must carry the fields every reader relies on (a damaged or
    foreign manifest is CorruptSegment, never a KeyError or a wild copy)."""
    def bad(what: str) -> CorruptSegment:
        return CorruptSegment(f"{where}: {what}")

    if not isinstance(rec, dict):
        raise bad("not an object")
    for key, typ in (("name", str), ("kind", str), ("dtype", str), ("id", int),
                     ("nshards", int), ("optimizer", dict)):
        if not isinstance(rec.get(key), typ) or isinstance(rec.get(key), bool):
            raise bad(f"field {key!r} missing or not a {typ.__name__}")
    # (a table has at most SHMPS_TABLE_MAX_SHARDS shards, any other tensor MAX_ROW_SHARDS:
    # a damaged count sent shmps-tool ls opening 10**12 shard names, for good)
    most = int(lib.SHMPS_TABLE_MAX_SHARDS) if rec["kind"] == "table" else MAX_ROW_SHARDS
    if (rec["dtype"] not in DTYPES or rec["id"] < 0 or not 1 <= rec["nshards"] <= most):
        raise bad(f"dtype {rec['dtype']!r}, id {rec['id']}, nshards {rec['nshards']}")
    if rec["kind"] == "dense":
        shape, per = rec.get("shape"), rec.get("shard_rows")
        if (not isinstance(shape, list) or len(shape) > 8
                or not all(isinstance(x, int) and x >= 0 for x in shape)
                or not isinstance(per, int) or per < 1):
            raise bad(f"shape {shape!r} / shard_rows {per!r}")


_SCHEMA_KEYS = ("kind", "shape", "dtype", "optimizer", "mode", "allow_nonfinite",
                "shard_rows", "dim", "capacity", "ncols", "seed", "init_spec", "structure",
                "aggregate", "workers", "outbox_of")


def _match(rec: dict, req: dict) -> None:
    """Raise SchemaError naming each field of ``req`` that differs from ``rec``."""
    diffs = []
    for k in _SCHEMA_KEYS:
        want = req.get(k)
        if k == "shard_rows" and want is not None and rec.get("kind") == "dense":
            # a dense tensor's shards hold at most its rows: creation clamps the
            # request to them, and so does the comparison
            want = max(1, min(int(want), max((rec.get("shape") or [1])[0], 1)))
        if k in req and json.loads(json.dumps(want)) != rec.get(k):  # as stored (JSON)
            diffs.append(f"{k}: existing {rec.get(k)!r}, requested {req[k]!r}")
    if diffs:
        raise SchemaError(f"tensor {rec['name']!r} exists with another schema: "
                          + "; ".join(diffs),
                          "pass the same arguments as its creator, or omit them to accept "
                          "the existing tensor")


from .csr import CSRTensor  # noqa: E402  (they import this module's siblings only)
from .table import Table  # noqa: E402

_KIND_CLASSES: dict[str, type] = {"dense": DenseTensor, "table": Table, "csr": CSRTensor}
