"""Read-only inspection of the stores on this host (for ``shmps-tool ls`` and ``gc``).

Opens manifests without attaching (no process slot is taken), so looking never
keeps a store alive.  Segments are grouped by store through the identity each
manifest records (store names may contain dots, so names alone are ambiguous).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Optional

from . import _native, names
from .checks import check_flag
from .errors import CorruptSegment, Error
from .files import pid_alive
from .segment import Segment, age_of, list_names, size_of

ffi, lib = _native.ffi, _native.lib
_SHARD = re.compile(r"t(\d+)\.s(\d+)")


@dataclass
class StoreInfo:
    """What ``shmps-tool ls`` shows of one store."""

    name: str
    namespace: Optional[str]
    manifest: str
    segments: list[str] = field(default_factory=list)
    bytes: int = 0
    pids: list[int] = field(default_factory=list)
    tensors: list[dict] = field(default_factory=list)
    error: Optional[str] = None
    age_s: float = 0.0
    #: "ready", or what a process is doing to it: "removing" (gc or destroy(), or a
    #: removal whose remover died, which the next attach or gc finishes), "restoring" (a
    #: checkpoint; its tensors are not all in yet), "gc deciding" (a gc looking whether
    #: it is idle); with the pid of that process (0 if none), alive or not
    state: str = "ready"
    state_pid: int = 0
    state_pid_alive: bool = False
    #: made in another PID namespace than this process's: (its namespace, this
    #: process's), else None.  Its pids mean nothing here (``pids`` is empty whoever is
    #: attached), so gc leaves it alone
    foreign: Optional[tuple[int, int]] = None
    #: its manifest is empty (size 0): its creator has not sized it yet, or died first
    unsized: bool = False

    @property
    def prefix(self) -> str:
        return names.store_prefix(self.name, self.namespace)


#: shmps_manifest_state's values (native/internal.h STATE_*) as ls shows them
STATES = {0: "being created", 1: "ready", 2: "removing", 3: "restoring", 4: "gc deciding"}


def _read_state(info: StoreInfo, seg: Segment, holder: Optional[int] = None) -> None:
    """The state, and who is at it: the remover or restorer (``retired_by``), or
    ``holder`` (the initialiser of a store being created)."""
    info.foreign = _native.foreign_pid_namespace(seg.ptr)
    info.state = STATES.get(int(lib.shmps_manifest_state(seg.ptr)), "unknown")
    if holder is None:
        holder = int(lib.shmps_manifest_retired_by(seg.ptr))
    info.state_pid = _native.token_pid(holder) if holder else 0
    info.state_pid_alive = bool(holder) and _native.token_alive(holder)


@dataclass
class Restorer:
    """The process making a forced restore's new manifest (``…manifest.restore-PID``)."""

    pid: int
    alive: bool
    #: of another PID namespace than this process's, (its namespace, this process's):
    #: ``pid`` and ``alive`` mean nothing here (gc leaves the manifest alone)
    foreign: Optional[tuple[int, int]] = None


def restorer(segment: str) -> Optional[Restorer]:
    """Who makes ``segment`` if it is a forced restore's new manifest (else None), judged
    by the token in it (``retired_by``: the restore's claim; ``init_owner`` while it is
    being initialised) in the PID namespace it records, not by the pid in its name: a
    pid reused by an unrelated process kept a dead restorer's manifest as long as that
    process lived, and one of another namespace was judged by a meaningless pid.  Only a
    manifest not sized yet, or not readable, is judged by the pid in its name."""
    pid = names.restore_manifest_pid(segment)
    if pid is None:
        return None
    try:
        seg = Segment.open(segment, expect_size=lib.SHMPS_MANIFEST_SIZE)
    except Error:   # gone, not sized yet (its maker is between shm_open and ftruncate)
        return Restorer(pid, pid_alive(pid))
    try:
        other = _native.foreign_pid_namespace(seg.ptr)
        tok = (int(lib.shmps_manifest_retired_by(seg.ptr))
               or int(lib.shmps_manifest_init_owner(seg.ptr)))
    finally:
        seg.close()
    if other is not None:
        return Restorer(_native.token_pid(tok) if tok else pid, False, foreign=other)
    if not tok:   # its maker has claimed nothing yet
        return Restorer(pid, pid_alive(pid))
    return Restorer(_native.token_pid(tok), _native.token_alive(tok))


def restore_in_progress(segment: str) -> Optional[Restorer]:
    """The verdict ls and gc share on ``segment``: its :func:`restorer` if it is a forced
    restore's new manifest to leave alone (its restorer alive, or of another PID
    namespace, whose liveness cannot be judged here: ``foreign``), else None (not a
    restore's manifest, or its restorer died: an orphan, which gc removes)."""
    r = restorer(segment)
    return r if r is not None and (r.alive or r.foreign is not None) else None


def _read_manifest(seg: Segment) -> tuple[str, Optional[str], list[dict], list[int]]:
    code = lib.shmps_manifest_validate(seg.ptr, seg.size)
    # (REMOVED: being removed or restored into; its fields are read bounds-checked below,
    # so gc can finish the removal of a store whose remover or restorer died)
    if code and code != lib.SHMPS_E_REMOVED:
        _native.check(code, f"manifest {seg.name}")
    buf = ffi.new("char[]", 256)
    n = ffi.new("uint32_t *")
    _native.check(lib.shmps_manifest_ident(seg.ptr, buf, 256, n), f"manifest {seg.name}")
    ns, _, store = ffi.unpack(buf, n[0]).decode().partition("\0")
    cat = bytearray(lib.SHMPS_CATALOG_BYTES)
    ln, gen = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    _native.check(lib.shmps_catalog_read(seg.ptr, ffi.from_buffer(cat), len(cat), ln, gen),
                  f"manifest {seg.name}")
    recs, pos, end = [], 0, int(ln[0])
    from .store import _check_record

    while pos + 4 <= end:
        k = int.from_bytes(cat[pos:pos + 4], "little")
        where = f"manifest {seg.name}: catalog record at {pos}"
        try:
            rec = json.loads(bytes(cat[pos + 4:pos + 4 + k]))
        except (ValueError, RecursionError):
            raise CorruptSegment(f"{where} is not JSON") from None
        # what attach checks (a record that is JSON but not an object, or without a
        # name, was an internal AttributeError / KeyError of shmps-tool ls)
        _check_record(rec, where)
        recs.append(rec)
        pos += 4 + k
    if len(recs) < int(gen[0]):   # as attach refuses it (store._refresh)
        from .store import _short_catalog
        raise CorruptSegment(f"manifest {seg.name}: " + _short_catalog(store, len(recs),
                                                                      int(gen[0])))
    toks = ffi.new("uint64_t[]", lib.SHMPS_MAX_PROCS)
    lib.shmps_proc_list(seg.ptr, toks, lib.SHMPS_MAX_PROCS, n)
    pids = sorted({_native.token_pid(int(toks[i])) for i in range(n[0])
                   if _native.token_alive(int(toks[i]))})
    return store, (ns or None), recs, pids


def _check_ident(mname: str, store: str, ns: Optional[str]) -> None:
    """CorruptSegment unless the manifest ``mname``'s ident (its store and namespace)
    names that very manifest.  The ident is what ls, gc and the table fill build segment
    names from: a NUL in it crashed posix_ipc (SIGSEGV in shm_open's name handling), and
    another valid name would make this manifest speak for another store's segments."""
    try:
        names.check_name(store)
        if ns is not None:
            names.check_name(ns, "namespace")
    except Error:
        ok = False
    else:
        ok = names.manifest_name(store, ns) == mname
    if not ok:
        raise CorruptSegment(f"manifest {mname}: its ident names store {store!r} of namespace "
                             f"{ns!r}, not this manifest's",
                             "the manifest is damaged: remove the store's segments "
                             "(shmps-tool gc --corrupt)")


def scan(namespace: Optional[str] = None, *, with_fill: bool = True
         ) -> tuple[list[StoreInfo], list[str]]:
    """All stores on the host (optionally of one namespace), and orphan segments
    (shmps segments that belong to no readable manifest)."""
    check_flag(with_fill, "with_fill")
    all_names = list_names("shmps.")
    stores: list[StoreInfo] = []
    for mname in [n for n in all_names if n.endswith(".manifest")]:
        info = StoreInfo(name=mname[len("/shmps."):-len(".manifest")], namespace=None,
                         manifest=mname, age_s=age_of(mname))
        if namespace is not None and mname.startswith(f"/shmps.{namespace}."):
            # (what names a store being created until its manifest says: a name
            # /shmps.a.b.manifest is store b of namespace a, or store a.b of none)
            info.namespace, info.name = namespace, mname[len(f"/shmps.{namespace}."):
                                                         -len(".manifest")]
        try:
            seg = Segment.open(mname)
        except Error as exc:
            if size_of(mname) == 0 and os.path.exists("/dev/shm" + mname):
                info.state, info.unsized = "being created", True   # as attach takes it
            else:
                info.error = str(exc)
            stores.append(info)
            continue
        try:
            if lib.shmps_manifest_state(seg.ptr) == 0:   # being initialised
                if lib.shmps_manifest_was_ready(seg.ptr):
                    # a catalog: it was READY once and its state word is damaged (attach
                    # refuses it, native/manifest.c shmps_manifest_init), not a creation
                    # cut off that gc would remove
                    raise CorruptSegment(f"manifest {seg.name}: its state says 'being "
                                         "created', but it has a catalog (the state word "
                                         "is damaged)")
                _read_state(info, seg, int(lib.shmps_manifest_init_owner(seg.ptr)))
            else:
                store, ns, recs, info.pids = _read_manifest(seg)
                if store:   # (empty: a creation gc removes, never initialised)
                    _check_ident(mname, store, ns)
                    info.name, info.namespace = store, ns
                info.tensors = recs
                _read_state(info, seg)
        except (Error, ValueError, UnicodeDecodeError) as exc:
            info.error = str(exc)
        finally:
            seg.close()
        stores.append(info)
    claimed: set[str] = set()
    for info in stores:
        prefix = (info.prefix if info.error is None else info.manifest[:-len("manifest")])
        for n in all_names:
            rest = n[len(prefix):] if n.startswith(prefix) else None
            if rest is not None and (rest == "manifest" or _SHARD.fullmatch(rest)):
                info.segments.append(n)
                info.bytes += size_of(n)
                claimed.add(n)
        if with_fill and info.error is None:
            _add_fill(info)
    if namespace is not None:
        stores = [s for s in stores if s.namespace == namespace]
    orphans = [n for n in all_names if n not in claimed]
    return stores, orphans


def _add_fill(info: StoreInfo) -> None:
    """Tables: rows used per capacity, read from the shard headers."""
    for rec in info.tensors:
        if rec.get("kind") != "table":
            continue
        used = 0
        for s in range(rec.get("nshards", 0)):
            try:
                seg = Segment.open(names.shard_name(info.name, info.namespace, rec["id"], s))
            except Error:
                continue
            try:
                if lib.shmps_shard_validate(seg.ptr, seg.size, ffi.NULL) == 0:
                    used += _native.stats(seg.ptr)["rows_used"]
            finally:
                seg.close()
        rec["rows_used"] = used
