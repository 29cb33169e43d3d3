"""Checkpoints: a store saved as a directory of binary matrix file sets, and restored.

Layout of a checkpoint directory (docs/checkpoints.md)::

    PATH/checkpoint.json        {"format": "shmps-checkpoint", "version": 1, "store": ...,
                                 "tensors": [{"prefix": "t0", "record": {...}, ...}]}
    PATH/t0.meta                file-set meta (kind, rows, cols, dtypes, optimizer, step)
    PATH/t0.value               the values, row-major, every shard in row order
    PATH/t0.state0 ...          optimizer state arrays (same layout as the values)
    PATH/t0.rowstep             per-row step counts (tables, csr)
    PATH/t0.rowcnt, t0.colidx   csr structure (dense tensors have none: implicit)

Each shard is copied while frozen (no push half in it; pushes to other shards go on),
then written; files are fsynced into a temporary directory beside PATH, which then
replaces PATH atomically (renameat2 RENAME_EXCHANGE): a checkpoint on disk is the old
one or the new one, never half.  Interrupting (Ctrl-C, SIGKILL) leaves at most a
``PATH.tmp-*`` directory, removed by the next checkpoint to the same PATH on the same
host (boot and PID namespace: :func:`files.host_id`).

Restore checks the whole checkpoint (checkpoint.json, every file's size, every
``.meta`` against its record) before it creates or replaces anything, so a corrupt
checkpoint raises :class:`CorruptFile` and leaves no store behind.
"""
from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import re
import secrets
import shutil
import stat
import time
from typing import Any, BinaryIO, Callable, Optional

import numpy as np

from . import _native, files, names, progress
from .checks import check_flag
from .errors import CorruptFile, CorruptSegment, Error, InvalidArgument, NotFound
from .segment import Segment, Wait
from .tensor import MAX_ROW_SHARDS, Shard, Tensor

FORMAT = files.CHECKPOINT_FORMAT
VERSION = files.CHECKPOINT_VERSION
#: How long one shard's freeze may wait for the pushers inside it (seconds).
FREEZE_TIMEOUT_S = 60.0
lib, ffi = _native.lib, _native.ffi


def _frozen_copy(t: Tensor, i: int, fields: Callable[[Shard], dict]) -> dict:
    """Copy arrays of shard ``i`` while it is frozen (a whole number of pushes)."""
    sh = t._shard(i)
    tok = _native.token()
    code = None
    try:
        # ``code`` stays None if Ctrl-C is raised as the call returns (the freeze may
        # be ours then): thaw anyway, thaw only releases a freeze this process holds
        code = lib.shmps_freeze_shared(sh.ptr, tok, FREEZE_TIMEOUT_S)
        _native.check(code, f"checkpoint of {t.name!r} (shard {i})")
        out: dict[str, Any] = {k: np.array(v, copy=True) for k, v in fields(sh).items()}
        out["_stats"] = _native.stats(sh.ptr)
    finally:
        if code is None or code == 0:
            lib.shmps_thaw_shared(sh.ptr, tok)
    return out


def _dense_fields(sh: Shard) -> dict:
    dt = _native.DTYPE_NAMES[sh.spec["dtype"]]
    d = {"value": sh.values(np.dtype(dt))}
    for k in range(sh.spec["nstate"]):
        d[f"state{k}"] = sh.state(k)
    return d


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2); False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err), b)


def _check_target(path: str) -> None:
    """Refuse a PATH that exists and is neither a checkpoint nor an empty directory."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path) and (
            os.path.exists(os.path.join(path, files.CHECKPOINT_JSON)) or not os.listdir(path)):
        return
    raise InvalidArgument(f"{path} exists and is not a shmps checkpoint (no "
                          f"{files.CHECKPOINT_JSON}); refusing to replace it",
                          "choose another path, or remove it")


def _install(tmp: str, path: str) -> None:
    """Make ``tmp`` the checkpoint at ``path``, replacing any old one atomically."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.lexists(path):
        _check_target(path)
        if _exchange(tmp, path):
            files.fsync_dir(parent)
            shutil.rmtree(tmp, ignore_errors=True)  # now the old checkpoint
            return
        # fallback without renameat2: a short window with no PATH, the old one kept
        # aside as PATH.old-HOST-PID-HEX (put back by the next checkpoint here if we die)
        old = _aside_name(path, "old")
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            if not os.path.lexists(path):
                os.rename(old, path)
            raise
        files.fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    os.rename(tmp, path)
    files.fsync_dir(parent)


def _aside_name(path: str, what: str) -> str:
    """``PATH.tmp-HOST-PID-HEX`` / ``PATH.old-HOST-PID-HEX`` (``what`` "tmp" or "old";
    HOST :func:`files.host_id`, HEX 6 random hex digits): where this process writes a
    checkpoint, or sets the old one aside; only names of this exact form are ever taken
    for debris (:func:`_clean_debris`)."""
    return f"{path}.{what}-{files.host_id()}-{os.getpid()}-{secrets.token_hex(3)}"


def _clean_debris(path: str) -> None:
    """Remove what interrupted checkpoints to ``path`` on this host left beside it:
    directories named exactly ``PATH.tmp-HOST-PID-HEX`` (:func:`_aside_name`) whose HOST
    is this one and whose PID is dead.  An old checkpoint set aside by the no-renameat2
    fallback (``PATH.old-HOST-PID-HEX``) is put back when PATH is missing, else removed.
    Anything else beside PATH (another host's, whatever its pid: PATH on a filesystem
    several hosts share; the names without a host part earlier versions made;
    ``PATH.old-2023``, a file, a symlink, another user's directory) is left alone."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    base = os.path.basename(os.path.abspath(path))
    ours = re.compile(re.escape(base)
                      + r"\.(tmp|old)-([0-9a-f]{8})-([1-9][0-9]*)-[0-9a-f]{6}")
    here = files.host_id()
    try:
        entries = sorted(os.listdir(parent))
    except FileNotFoundError:
        return
    for n in entries:
        m = ours.fullmatch(n)
        if m is None or m.group(2) != here:
            continue  # not a checkpoint's name, or another host's (its pid means nothing)
        pid = int(m.group(3))
        if pid != os.getpid() and files.pid_alive(pid):
            continue  # another process's checkpoint in progress
        full = os.path.join(parent, n)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        if (m.group(1) == "old" and not os.path.lexists(path)
                and os.path.exists(os.path.join(full, files.CHECKPOINT_JSON))):
            os.rename(full, path)
            continue
        shutil.rmtree(full, ignore_errors=True)


def save(store: Any, path: str | os.PathLike) -> str:
    """Write every tensor of ``store`` to the checkpoint directory ``path``.

    Pushes continue meanwhile; each shard is copied consistently.  Replaces an
    existing checkpoint at ``path`` atomically.  Returns the path."""
    path = os.fspath(path)
    if not path or os.path.basename(os.path.abspath(path)) in ("", ".", ".."):
        raise InvalidArgument(f"checkpoint path {path!r} names no directory",
                              "pass a path such as ckpt/model-0001")
    _check_target(path)
    tensors = [store[d["name"]] for d in store.tensors()]
    unsupported = sorted({t.kind for t in tensors if t.kind not in _SAVERS})
    if unsupported:
        raise InvalidArgument(f"store {store.name!r} holds {', '.join(unsupported)} tensors, "
                              f"which this version cannot checkpoint yet (only "
                              f"{', '.join(sorted(_SAVERS))})", "nothing was written")
    parent = os.path.dirname(os.path.abspath(path))
    tmp = _aside_name(os.path.join(parent, os.path.basename(os.path.abspath(path))), "tmp")
    phase = "create"  # then "write", then "install"
    try:
        os.makedirs(parent, exist_ok=True)
        _clean_debris(path)
        os.mkdir(tmp, 0o700)  # in the try: a Ctrl-C as it returns removes it too
        phase = "write"
        total = sum(sum(sh.seg.size for sh in t._shards) for t in tensors)
        entries = []
        with progress.bar(total, f"checkpoint {store.name}") as bar:
            for t in tensors:
                entries.append(_SAVERS[t.kind](t, tmp, f"t{t.record['id']}", bar))
        doc = {"format": FORMAT, "version": VERSION, "store": store.name,
               "namespace": store.namespace, "staleness": store.staleness,
               "created_unix": time.time(), "tensors": entries}
        with open(os.path.join(tmp, "checkpoint.json"), "w") as f:
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        files.fsync_dir(tmp)
        phase = "install"
        _install(tmp, path)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        # every OSError of making or writing the temporary directory (write() and
        # fsync() errors such as ENOSPC carry no filename), not a shmps error (Timeout
        # is an OSError)
        if isinstance(exc, OSError) and not isinstance(exc, Error) and (
                phase != "install" or str(exc.filename or "").startswith(tmp)):
            raise _named_by_path(exc, path, (
                f"cannot create the checkpoint's temporary directory in {parent}, where it "
                "is written before being renamed to this path; choose a path in a writable "
                "directory") if phase == "create" else (
                f"while writing the checkpoint into a temporary directory in {parent}; the "
                "checkpoint at this path, if any, is unchanged: free space there, or choose "
                "a path on another disk")) from None
        raise
    return path


def _named_by_path(exc: OSError, path: str, what: str) -> OSError:
    """``exc`` named by the user's ``path`` (not the internal ``PATH.tmp-*``), its message
    followed by ``what`` (where it happened and what to do)."""
    return OSError(exc.errno, f"{exc.strerror or exc} ({what})", path)


class _Writer:
    """Appends arrays to ``dir/prefix.<kind>`` files, fsyncs them on close."""

    def __init__(self, directory: str, prefix: str) -> None:
        self.dir, self.prefix = directory, prefix
        self.files: dict[str, BinaryIO] = {}

    def append(self, kind: str, arr: np.ndarray) -> None:
        f = self.files.get(kind)
        if f is None:
            f = self.files[kind] = open(os.path.join(self.dir, f"{self.prefix}.{kind}"), "wb")
        a = np.ascontiguousarray(arr)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        f.write(a.data.cast("B"))

    def close(self, meta: dict) -> None:
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        with open(os.path.join(self.dir, f"{self.prefix}.meta"), "w") as mf:
            json.dump(meta, mf, indent=1)
            mf.flush()
            os.fsync(mf.fileno())


def _save_dense(t: Any, directory: str, prefix: str, bar: Any) -> dict:
    w = _Writer(directory, prefix)
    step = 0
    nstate = t._shards[0].spec["nstate"]
    state_dtype = _native.DTYPE_NAMES[t._shards[0].spec["state_dtype"]]
    for i in range(t.nshards):
        snap = _frozen_copy(t, i, _dense_fields)
        if i == 0:
            step = snap["_stats"]["step"]
        w.append("value", snap["value"])
        for k in range(nstate):
            w.append(f"state{k}", snap[f"state{k}"])
        bar.update(t._shards[i].seg.size)
    rows = t.nrows
    meta = {"version": 1, "kind": "dense", "rows": rows, "cols": t.row_len,
            "nnz": t.size, "shape": list(t.shape), "dtypes": {"value": t.dtype.name},
            "name": t.name, "optimizer": t.optimizer.to_dict(), "step": step,
            "state": {"count": nstate, "dtype": state_dtype}}
    w.close(meta)
    return {"prefix": prefix, "record": t.record, "step": step}


# ---- restore -------------------------------------------------------------------


def _load_doc(path: str) -> dict:
    """checkpoint.json of ``path``, checked (:func:`shmps.files.read_checkpoint_manifest`)."""
    return files.read_checkpoint_manifest(path)


def load_manifest(path: str | os.PathLike) -> dict:
    """The parsed, checked ``checkpoint.json`` of the checkpoint directory ``path``."""
    return files.read_checkpoint_manifest(path)


def restore(path: str | os.PathLike, name: Optional[str] = None, *,
            namespace: Optional[str] = None, force: bool = False) -> Any:
    """Recreate store ``name`` (default: the checkpointed store's name, as
    ``shmps-tool restore`` without ``--as``) from the checkpoint at ``path``; returns it
    attached.

    The whole checkpoint is checked first (every file's size and ``.meta`` against
    checkpoint.json, each table's saved index, the per-row statistics of tables and csr
    tensors: ``_stats_problem``): a corrupt one raises
    :class:`CorruptFile` (a missing directory :class:`NotFound`) and creates, replaces or
    changes nothing.  Every file is read from the directory ``path`` named when restore
    began (opened once): a checkpoint written to ``path`` meanwhile is not mixed in.  Refuses
    (InvalidArgument) to overwrite an existing store that has tensors or other live
    processes, unless ``force=True`` (then the old store is destroyed first).  If
    restoring fails midway the new store is destroyed.

    Until it is complete the store is marked as being restored (native/manifest.c,
    shmps_manifest_restore_begin): other processes' attach waits (a Timeout naming this
    process after its ``timeout``), and if this process is killed midway the next attach
    (or gc) removes the partial store, so no process ever uses a half-restored one."""
    force = check_flag(force, "force")   # (a truthy "no" destroyed the old store)
    shown = os.fspath(path)
    if name is not None:
        # ("" is refused as a name, not taken for "the checkpoint's": a name from an
        # unset variable must not restore over the checkpointed store)
        names.check_name(name)
    try:
        dfd = os.open(shown, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return _restore_from(shown, name, namespace, force)   # it says what is wrong
    # every file through the directory opened now, whatever `shown` names later (a
    # checkpoint to the same path swaps a new directory in: restore read some tensors
    # from each, 60 of 116 restores racing a checkpoint loop)
    at = f"/proc/self/fd/{dfd}"
    try:
        return _restore_from(at, name, namespace, force)
    except Error as exc:
        exc.message = exc.message.replace(at, shown)   # the user's path in messages
        exc.args = (exc.message,)
        raise
    except FileNotFoundError as exc:
        # a file of the opened directory went between a check and its opening: a
        # checkpoint written to the same path swapped it out and deleted it
        what = str(exc.filename or "a file").replace(at, shown)
        raise NotFound(f"checkpoint {shown}: {what} disappeared while it was restored (a "
                       "checkpoint written to the same path replaced it)",
                       "restore again") from None
    finally:
        os.close(dfd)


def _restore_from(path: str, name: Optional[str], namespace: Optional[str],
                  force: bool) -> Any:
    """restore(), reading the checkpoint at ``path`` (``name`` None: its store's)."""
    doc = _load_doc(path)
    if name is None:
        name = doc["store"]
    plans = []
    for e in doc["tensors"]:
        kind = e["record"]["kind"]
        planner = _PLANNERS.get(kind)
        if planner is None:
            raise CorruptFile(f"{os.path.join(path, files.CHECKPOINT_JSON)}: tensor "
                              f"{e['record']['name']!r} is of kind {kind!r}, which this "
                              f"version cannot restore (only {', '.join(sorted(_PLANNERS))})",
                              "restore it with the shmps version that wrote it")
        plans.append(planner(path, e))
    store = _begin_restore(name, namespace)
    try:
        # (after the mark: a process that attaches from now on waits; one attached
        # before is listed here: the Dekker pair of shmps_manifest_restore_begin)
        others = [p for p in store.processes() if p != os.getpid()]
        ntensors = len(store.tensors())
    except BaseException:
        _end_restore(store)
        store.close()
        raise
    if ntensors or others:
        if not force:
            _end_restore(store)
            store.close()
            raise InvalidArgument(
                f"store {name!r} exists ({ntensors} tensors, live processes "
                f"{', '.join(map(str, others)) or 'none'}); refusing to replace it",
                "replace it with --force (force=True), or restore under another name "
                "with --as NEWNAME")
        try:
            store = store._renew_for_restore()
        except BaseException:
            # failed before it changed anything (the new manifest could not be made):
            # the old store is given back as it was; after, the renewal removed both
            if store._manifest is not None:
                _end_restore(store)
                store.close()
            raise
    try:
        with progress.bar(sum(p.nbytes for p in plans), f"restore {name}") as bar:
            for e, p in zip(doc["tensors"], plans):
                try:
                    p.run(store, bar)
                except CorruptFile as exc:
                    raise _table_check_error(exc, path, e) from None
        # the store's consistency too: an aggregated job resumed without it (eventual)
        # pulled parameters a round behind and trained to other values
        if doc.get("staleness") is not None:
            store.set_consistency(doc["staleness"])
        _native.check(lib.shmps_manifest_restore_end(store._mptr, _native.token()),
                      f"restore of store {name!r}")
    except BaseException:
        store.destroy()
        raise
    return store


RESTORE_WAIT = 10.0   #: restore waits at most this long for a gc deciding about the store (s)


def _begin_restore(name: str, namespace: Optional[str]) -> Any:
    """Attach store ``name`` (creating it if absent) and mark it as being restored by
    this process (shmps_manifest_restore_begin).  Another process holding the store's
    removal (a gc deciding whether it is idle) is waited for, at most RESTORE_WAIT s;
    one restoring or removing it makes attach() itself wait and time out."""
    from .store import attach, removal_held

    wait = Wait(RESTORE_WAIT, poll=0.01)
    while True:
        store = attach(name, namespace=namespace, _restoring=True)
        code = lib.shmps_manifest_restore_begin(store._mptr, _native.token())
        if code == 0:
            return store
        holder = int(lib.shmps_manifest_retired_by(store._mptr))
        store.close()
        if code != lib.SHMPS_E_BUSY:
            _native.check(code, f"restore of store {name!r}")
        wait.again(lambda: removal_held(name, holder, RESTORE_WAIT,
                                        "retry the restore once it is done"))


def _end_restore(store: Any) -> None:
    """Give a store marked for restoring back unchanged (a refused restore)."""
    lib.shmps_manifest_restore_end(store._mptr, _native.token())


#: What each problem code of the C table check (``shmps_table_check``, native/table.c)
#: means for a restored table.
_TABLE_PROBLEMS = {
    1: "an index entry names a row past the rows in use",
    2: "an index entry's key differs from the key of its row",
    3: "a row the index uses is not marked in use",
    4: "the rows marked in use do not match the index entries",
    5: "a key is stored in a shard its hash does not lead to",
    6: "a key cannot be found from its hash",
    7: "the list of free rows is broken",
    8: "the counts of rows in use and free rows disagree with the index",
    9: "the table's count of rows in use disagrees with its shards'",
    10: "an index entry was left half created",
    11: "the count of deleted index entries disagrees with the index",
}


def _table_problem(exc: CorruptFile) -> Optional[tuple[int, int, str]]:
    """(shard, entry, what is wrong) of a failed table check (its ``table_problem``:
    native code, shard, entry), None for any other error."""
    problem = getattr(exc, "table_problem", None)
    if problem is None:
        return None
    code, shard, at = problem
    return shard, at, _TABLE_PROBLEMS.get(code, f"problem {code}")


def _table_check_error(exc: CorruptFile, path: str, entry: dict) -> CorruptFile:
    """The table check's failure (``table_problem``, set by Store._restore_raw while the
    restored table is created) in the terms of the checkpoint's files, with the
    checkpoint hint; any other error as it is."""
    problem = _table_problem(exc)
    if problem is None or entry["record"].get("kind") != "table":
        return exc
    shard, at, what = problem
    stem = os.path.join(path, f"{entry['prefix']}.s{shard}")
    return CorruptFile(f"checkpoint {path}: table {entry['record']['name']!r}, shard {shard}: "
                       f"its saved index is inconsistent: {what} (at entry {at}; files "
                       f"{stem}.index, .keys, .links, .ctl)", hint=files._CKPT_HINT)


class _Plan:
    """One tensor to restore: checked arrays (memory-mapped) and how to create it."""

    def __init__(self, nbytes: int, run: Callable[[Any, Any], None]) -> None:
        self.nbytes = nbytes
        self.run = run


_RECORD_KEYS = ("name", "kind", "dtype", "shape", "shard_rows", "nshards", "optimizer",
                "mode", "allow_nonfinite", "aggregate", "workers")
#: Rows, columns and values of a tensor: what numpy (and a file) can address.
_MAX_EXTENT = (1 << 63) - 1


def _check_sharding(rows: int, shard_rows: Any, nshards: Any) -> None:
    """``shard_rows`` rows per shard over ``nshards`` shards split ``rows`` rows as the
    store splits them (1 <= shard_rows <= rows, nshards = ceil(rows / shard_rows)), else
    ValueError.  Checked before any per-shard spec is built: O(1)."""
    if not (files._is_int(shard_rows) and 1 <= shard_rows <= max(rows, 1)
            and files._is_int(nshards) and nshards == max(1, -(-rows // shard_rows))):
        raise ValueError(f"shard_rows {shard_rows!r} and nshards {nshards!r} do not "
                         f"split {rows} rows")


def _validate_sets(where: str, rec: dict, path: str) -> list:
    """``files.validate_all(where)`` for a restore: a missing file, or a defect whose hint
    is the file verbs' ("pass --rowcnt-dtype/--colidx-dtype/--value-dtype/--cols", flags
    restore does not have: a truncated t0.value told a user restoring to pass them), is
    a CorruptFile with the checkpoint hint; a hint of its own (fix a .meta) stays."""
    try:
        return files.validate_all(where)
    except NotFound as exc:
        raise CorruptFile(f"{exc.message} (tensor {rec['name']!r} of checkpoint {path})",
                          files._CKPT_HINT) from None
    except CorruptFile as exc:
        if exc.hint != CorruptFile.hint:
            raise
        raise CorruptFile(exc.message, files._CKPT_HINT) from None


def _plan_dense(path: str, entry: dict) -> _Plan:
    """Check a dense tensor's files against its record; nothing is created here."""
    from .store import _dense_specs
    from .updaters import from_dict

    rec = entry["record"]
    where = os.path.join(path, entry["prefix"])
    cj = os.path.join(path, files.CHECKPOINT_JSON)
    try:
        rows, cols = files.dense_dims(rec["shape"])
        if max(rows, cols, rows * cols) > _MAX_EXTENT:
            raise ValueError(f"shape {rec['shape']} is too large (more than 2**63 - 1 rows, "
                             "columns or values)")
        _check_sharding(rows, rec["shard_rows"], rec["nshards"])
        if rec.get("mode", "exact") not in ("exact", "hogwild"):
            raise ValueError(f"mode {rec.get('mode')!r}")
        upd = from_dict(rec["optimizer"])
        if upd.float_only and np.dtype(rec["dtype"]).kind != "f":
            raise ValueError(f"optimizer {type(upd).__name__} needs a float dtype")
        clean = {k: rec[k] for k in _RECORD_KEYS if k in rec}
        # shard 0's spec only (the shards differ in nrows alone): the record's shard
        # count is checked against the files below, before restore builds one per shard
        lay = _native.layout(_dense_specs({**clean, "nshards": 1})[0])
    except (KeyError, TypeError, ValueError, ArithmeticError, Error) as exc:
        raise CorruptFile(f"{cj}: tensor {rec['name']!r}: invalid record: {exc}",
                          files._CKPT_HINT) from None
    sets = _validate_sets(where, rec, path)
    ms = sets[0]
    mp = f"{where}.meta"
    if ms.kind != "dense":
        raise CorruptFile(f"{mp}: kind {ms.kind!r}, but {cj} records tensor {rec['name']!r} "
                          "as dense", files._CKPT_HINT)
    if (ms.rows, ms.cols) != (rows, cols) or ms.dtypes["value"] != rec["dtype"]:
        raise CorruptFile(f"{mp}: a {ms.rows} x {ms.cols} {ms.dtypes['value']} set, but {cj} "
                          f"records tensor {rec['name']!r} as {rec['dtype']} of shape "
                          f"{tuple(rec['shape'])} ({rows} x {cols})", files._CKPT_HINT)
    if rec["nshards"] > MAX_ROW_SHARDS:   # (a shape the files hold, in too many shards)
        raise CorruptFile(f"{cj}: tensor {rec['name']!r}: {rec['nshards']:,} shards, more "
                          f"than a tensor has ({MAX_ROW_SHARDS:,})", files._CKPT_HINT)
    want_state = _native.DTYPE_NAMES[lay["state_dtype"]]
    if len(sets) - 1 != lay["nstate"] or any(x.dtypes["value"] != want_state
                                             for x in sets[1:]):
        have = ", ".join(f"{x.array} {x.dtypes['value']}" for x in sets[1:]) or "none"
        raise CorruptFile(f"{mp}: state arrays {have}, but optimizer "
                          f"{type(upd).__name__} of a {rec['dtype']} tensor keeps "
                          f"{lay['nstate']} {want_state} arrays", files._CKPT_HINT)
    step = int(entry.get("step", 0))
    values = ms.csr.value
    states = [x.csr.value for x in sets[1:]]
    nbytes = sum(int(np.asarray(a[:0]).itemsize) * len(a) for a in [values, *states])

    def run(store: Any, bar: Any) -> None:
        store._restore_dense(clean, values, states, step, bar)

    return _Plan(nbytes, run)



# ---- tables and csr tensors: the shard's data regions, exactly ----------------------
#
# A table or csr shard is saved as its arrays, copied while the shard is frozen: the
# values and optimizer state as one readable file set ``tN.value``/``tN.stateK`` (a
# dense set of nshards * shard_rows rows x dim for a table, a csr set with
# ``tN.rowcnt``/``tN.colidx`` for a csr tensor), and every other region of shard S as a
# raw little-endian uint64 file ``tN.sS.<region>`` (``_raw_regions``).  Header words
# kept: each shard's step and table_used (in checkpoint.json).  Lock words: a row
# stripe's or the creation lock's owner held by a live process is cleared (it could
# never be released in the restored store); one held by a dead process is kept, so the
# restored store runs the same takeover/repair the original would have.

_CTL_WORDS = 32        # SHMPS_TABLE_CTL_BYTES / 8 (tctl_t, native/table.c)
_CTL_CREATE_OWNER = 8  # tctl_t.create.owner (offset 64)
_CTL_TABLE_LIVE = 10   # tctl_t.table_live (offset 80), shard 0: keys in the whole table
_CTL_HWM = 11          # tctl_t.hwm (offset 88): rows of the shard handed out at least once
_CTL_MAGIC = 0x4c54435453504d48
_AUX_STEP_MASK = (1 << 40) - 1


def _raw_regions(lay: dict) -> list[tuple[str, int, int]]:
    """(region, byte offset, uint64 words) of a table/csr shard's raw regions."""
    table = lay["kind"] == lib.SHMPS_TABLE
    regs = []
    if table:
        regs.append(("keys", lay["colidx_off"], lay["nrows"]))
    regs.append(("rowstep", lay["rowstep_off"], lay["nrows"]))
    regs.append(("stripes", lay["stripes_off"], 2 * lay["nstripes"]))
    if table:
        ctl = lay["index_off"] + 16 * lay["nslots"]
        regs += [("index", lay["index_off"], 2 * lay["nslots"]), ("ctl", ctl, _CTL_WORDS),
                 ("links", ctl + 8 * _CTL_WORDS, lay["nrows"])]
    return regs


#: Updaters whose pushes count a table row's step (native/table.c, uses_step); a table
#: of any other updater never writes its rows' steps (0 from creation).
_TABLE_ROW_STEP = (lib.SHMPS_MOMENTUM, lib.SHMPS_ADAGRAD, lib.SHMPS_ADAM)
#: A row's step counts its pushes one by one (here, or on the owner a bridge copy takes
#: it from): 2**63 of them take 292 years at one a nanosecond.  A word near 2**64 wraps
#: to 0 at the row's next push, which restarts Momentum's buffer and Adam's bias
#: correction.
_MAX_ROW_STEP = (1 << 63) - 1


def _stats_problem(lay: dict, d: dict, updater: str, whose: str
                   ) -> Optional[tuple[str, str]]:
    """(region, what is wrong) of the first per-row statistic of ``whose`` (a table/csr
    shard) in its saved regions ``d`` that the C core could not have written, else None.
    A row never handed out (a table's at or past its control block's hwm, which only
    grows) or without entries (a csr's: no push, pull or write locks it) keeps the zeros
    it was created with, step and stripe words; a table whose updater keeps no per-row
    step has none; no step passes _MAX_ROW_STEP; a csr stripe's second word is a 32-bit
    seqlock counter (dense stripes alone use its high half)."""
    rs, st = d["rowstep"], d["stripes"].reshape(-1, 2)
    table = lay["kind"] == lib.SHMPS_TABLE
    if table:
        hwm = int(d["ctl"][_CTL_HWM])
        unused = np.arange(hwm, lay["nrows"])
        why = f"was never handed out (its .ctl counts {hwm} rows that were)"
    else:
        rc = d["_rowcnt"]
        unused = np.flatnonzero(rc[1:] == rc[:-1])
        why = "has no entries"
    if (r := _first(unused[rs[unused] != 0])) is not None:
        return "rowstep", f"row {r} of {whose} {why}, but a step of {int(rs[r])}"
    if (r := _first(unused[(st[unused] != 0).any(axis=1)])) is not None:
        return "stripes", (f"row {r} of {whose} {why}, but stripe words {int(st[r, 0]):#x}, "
                           f"{int(st[r, 1]):#x}")
    if table and lay["updater"] not in _TABLE_ROW_STEP:
        if (r := _first(np.flatnonzero(rs))) is not None:
            return "rowstep", (f"row {r} of {whose} has step {int(rs[r])}, but its updater "
                               f"{updater} keeps no per-row step (Momentum, Adagrad and Adam "
                               "do)")
    if (r := _first(np.flatnonzero(rs > np.uint64(_MAX_ROW_STEP)))) is not None:
        return "rowstep", (f"row {r} of {whose} has step {int(rs[r])}: more pushes than a row "
                           "can have (at most 2**63 - 1)")
    if not table and (r := _first(np.flatnonzero(st[:, 1] >> np.uint64(32)))) is not None:
        return "stripes", (f"row {r} of {whose} has {int(st[r, 1]) >> 32:#x} in bits 63-32 of "
                           "its seqlock word, which a csr row never uses (0)")
    return None


def _live_lock(lay: dict, d: dict, whose: str) -> Optional[tuple[str, str]]:
    """(region, what is wrong) of a lock word in the saved regions ``d`` of ``whose`` (a
    table/csr shard) that names a live process, else None.  Saving clears those (and
    keeps dead holders', which the restored store takes over); one alive now was not
    written by shmps, and its lock would never be released: every push to the row, or
    every key creation and the restore's own table check, would time out."""
    st = d["stripes"].reshape(-1, 2)
    for tok in np.unique(st[:, 0][st[:, 0] != 0]):
        if _native.token_alive(int(tok)):
            r = int(np.flatnonzero(st[:, 0] == tok)[0])
            return "stripes", (f"row {r} of {whose} is locked by live process "
                               f"{_native.token_pid(int(tok))} (token {int(tok):#x}); a "
                               "checkpoint keeps only dead holders' locks")
    if lay["kind"] == lib.SHMPS_TABLE:
        tok = int(d["ctl"][_CTL_CREATE_OWNER])
        if tok and _native.token_alive(tok):
            return "ctl", (f"word {_CTL_CREATE_OWNER} of {whose}, the table's creation lock, "
                           f"is held by live process {_native.token_pid(tok)} (token "
                           f"{tok:#x}); a checkpoint keeps only dead holders' locks")
    return None


def _first(rows: np.ndarray) -> Optional[int]:
    """The first of ``rows`` (row numbers), None if there are none."""
    return int(rows[0]) if rows.size else None


def _open_regions(where: str, lays: list, name: str) -> list[dict]:
    """The raw region files ``where.sS.<region>`` of each shard (laid out as ``lays``) of
    tensor ``name``, memory-mapped read-only as little-endian uint64 words: region ->
    array, one dict a shard.  A file missing or not of its region's size raises
    CorruptFile (checkpoint hint) naming it."""
    raw = []
    for s, ly in enumerate(lays):
        d = {}
        for region, _, n in _raw_regions(ly):
            fn = f"{where}.s{s}.{region}"
            try:
                size = os.path.getsize(fn)
            except OSError:
                raise CorruptFile(f"{fn}: missing (tensor {name!r})", files._CKPT_HINT) from None
            if size != 8 * n:
                raise CorruptFile(f"{fn}: {size} bytes, shard {s} of {name!r} needs {8 * n} "
                                  f"({n} uint64)", files._CKPT_HINT)
            # (np.memmap cannot map an empty file)
            d[region] = np.memmap(fn, dtype="<u8", mode="r", shape=(n,)) if n else \
                np.zeros(0, np.uint64)
        raw.append(d)
    return raw


def _write_regions(seg: Segment, lay: dict, d: dict, table_used: int, table_live: int,
                   first: bool) -> None:
    """Write a table/csr shard's raw regions into ``seg`` from its checkpoint files
    (``d``: region -> uint64 words); for a table also its count of rows in use and, in
    shard ``first`` (0), the count of keys in the whole table."""
    for region, off, words in _raw_regions(lay):
        seg.array(np.uint64, off, words)[...] = d[region]
    if lay["kind"] == lib.SHMPS_TABLE:
        _native.check(lib.shmps_set_table_used(seg.ptr, int(table_used)), "restore of a table")
        if first:
            ctl = seg.array(np.uint64, lay["index_off"] + 16 * lay["nslots"],
                            _CTL_TABLE_LIVE + 1)
            ctl[_CTL_TABLE_LIVE] = table_live


def _table_check(name: str, bases: list, shard: Optional[int] = None) -> None:
    """The C table check over a restored table's shards (mapped at ``bases``; with
    ``shard``, that shard's only, the others' bases but shard 0's may be None); a broken
    invariant raises CorruptFile with ``table_problem`` (problem code, shard, entry)."""
    info = ffi.new("uint64_t[4]")
    ptrs = ffi.new("void *[]", [ffi.NULL if b is None else b for b in bases])
    if shard is None:
        code = lib.shmps_table_check(ptrs, len(bases), _native.token(), info)
    else:
        want = ffi.new("uint64_t[]", (len(bases) + 63) // 64)
        want[shard // 64] = 1 << (shard % 64)
        code = lib.shmps_table_check_some(ptrs, len(bases), want, _native.token(), info)
    if code == lib.SHMPS_E_CORRUPT:
        err = CorruptFile(f"checkpoint of table {name!r}: invariant {int(info[0])} "
                          f"broken in shard {int(info[1])} at {int(info[2])}")
        # (problem code, shard, entry): restore words it for the files (_table_check_error)
        err.table_problem = (int(info[0]), int(info[1]), int(info[2]))
        raise err
    _native.check(code, f"check of table {name!r}")


def _check_saved_index(name: str, specs: list, raw: list, shards: list) -> None:
    """Run the C table check (``shmps_table_check``) on the saved index of table ``name``
    before anything is created or destroyed, so that ``restore --force`` refuses a bad
    index while the old store still exists.  The shards are laid out in private
    anonymous memory and only their index regions are written: the values' and state's
    pages are never touched, so this costs the index's size, not the table's.  One
    shard at a time beside shard 0 (whose control block holds the lock and the total):
    the whole index at once took about 140 B a key (the last note's left item).  The
    shards' counts of keys add up to the total written into shard 0 by construction
    (each shard's count is checked against its index), so the total is checked
    against the capacity only.  Raises CorruptFile with ``table_problem`` (problem
    code, shard, entry) set."""
    live = sum(x["table_used"] for x in shards)
    n = len(specs)

    def image(s: int) -> Segment:
        lay = _native.layout(specs[s])
        img = Segment(f"(private copy of shard {s} of {name!r})",
                      mmap.mmap(-1, lay["total_size"]), lay["total_size"])
        try:
            # Adagrad's initial accumulator (params[3]) would be written over the whole
            # state region; it does not shape the layout and the check does not read it
            params = list(specs[s]["params"])
            if specs[s]["updater"] == lib.SHMPS_ADAGRAD:
                params[3] = 0.0
            _native.shard_init(img.ptr, img.size, dict(specs[s], params=params))
            _write_regions(img, lay, raw[s], shards[s]["table_used"], live, s == 0)
        except BaseException:
            img.close()
            raise
        return img

    first = image(0)
    try:
        bases: list = [first.ptr] + [None] * (n - 1)
        _table_check(name, bases, 0)
        for s in range(1, n):
            img = image(s)
            try:
                bases[s] = img.ptr
                _table_check(name, bases, s)
            finally:
                bases[s] = None
                img.close()
    finally:
        first.close()


def _sparse_fields(sh: Shard) -> dict:
    d = _dense_fields(sh)
    sp = sh.spec
    if sp["kind"] == lib.SHMPS_CSR:
        d["rowcnt"] = sh.seg.array(np.int64, sp["rowcnt_off"], sp["nrows"] + 1)
        d["colidx"] = sh.seg.array(np.int64, sp["colidx_off"], sp["nnz"])
    for name, off, n in _raw_regions(sp):
        d[name] = sh.seg.array(np.uint64, off, n)
    return d


def _free_live_locks(owners: np.ndarray) -> None:
    """Zero (in place, a copy) the owner words held by live processes."""
    for tok in np.unique(owners[owners != 0]):
        if _native.token_alive(int(tok)):
            owners[owners == tok] = 0


def _save_sparse(t: Any, directory: str, prefix: str, bar: Any) -> dict:
    w = _Writer(directory, prefix)
    sp0 = t._shards[0].spec
    nstate = sp0["nstate"]
    state_dtype = _native.DTYPE_NAMES[sp0["state_dtype"]]
    table = t.kind == "table"
    shards = []
    base = 0  # csr: entries before this shard
    for i in range(t.nshards):
        snap = _frozen_copy(t, i, _sparse_fields)
        _free_live_locks(snap["stripes"][0::2])
        if table:
            ctl = snap["ctl"]
            _free_live_locks(ctl[_CTL_CREATE_OWNER:_CTL_CREATE_OWNER + 1])
        else:
            rc = snap["rowcnt"] + base
            w.append("rowcnt", rc if i == t.nshards - 1 else rc[:-1])
            w.append("colidx", snap["colidx"])
            base = int(rc[-1])
        w.append("value", snap["value"])
        for k in range(nstate):
            w.append(f"state{k}", snap[f"state{k}"])
        for name, _, _ in _raw_regions(t._shards[i].spec):
            w.append(f"s{i}.{name}", snap[name])
        st = snap["_stats"]
        shards.append({"step": int(st["step"]), "table_used": int(st["rows_used"]) if table
                       else 0})
        bar.update(t._shards[i].seg.size)
    step = shards[0]["step"]
    common = {"name": t.name, "optimizer": t.optimizer.to_dict(), "step": step,
              "state": {"count": nstate, "dtype": state_dtype}, "tensor_kind": t.kind}
    if table:
        rows = t.nshards * t.shard_rows
        meta = {"version": 1, "kind": "dense", "rows": rows, "cols": t.dim,
                "nnz": rows * t.dim, "shape": [rows, t.dim],
                "dtypes": {"value": t.dtype.name}, **common}
    else:
        meta = {"version": 1, "kind": "csr", "rows": t.nrows, "cols": t.ncols, "nnz": t.nnz,
                "dtypes": {"rowcnt": "int64", "colidx": "int64", "value": t.dtype.name},
                **common}
    w.close(meta)
    entry = {"prefix": prefix, "record": t.record, "step": step, "shards": shards}
    _check_written(t, directory, entry)
    return entry


def _check_written(t: Any, directory: str, entry: dict) -> None:
    """Restore's checks of a table or csr tensor (``_plan_sparse``: its record, structure,
    control blocks, per-row statistics, lock words, a table's index) on the files just
    written: a tensor damaged in shared memory gives a checkpoint restore refuses, which
    must not replace a good checkpoint at the path.  Raises CorruptSegment (save() then
    removes the temporary directory)."""
    try:
        _plan_sparse(directory, entry)
    except CorruptFile as exc:
        # (the files named are the temporary directory's, which save() removes)
        what = exc.message.replace(f"checkpoint {directory}: ", "").replace(
            directory + os.sep, "")
        raise CorruptSegment(
            f"store {t._store.name!r}: {t.kind} tensor {t.name!r} in shared memory is not "
            f"what shmps writes ({what}); a checkpoint of it would not restore, so none "
            "was written (a checkpoint at this path, if any, is unchanged)") from None


def _plan_sparse(path: str, entry: dict) -> _Plan:
    """Check a table's / csr tensor's files against its record; creates nothing."""
    from . import csr as cmod
    from . import table as tmod
    from .store import _is_outbox
    from .updaters import from_dict

    rec = entry["record"]
    kind = rec["kind"]
    where = os.path.join(path, entry["prefix"])
    cj = os.path.join(path, files.CHECKPOINT_JSON)
    mp = f"{where}.meta"

    def corrupt(msg: str) -> CorruptFile:
        return CorruptFile(msg, files._CKPT_HINT)

    sets = _validate_sets(where, rec, path)
    ms = sets[0]
    try:
        # (not "origin": the restored tensor is this store's own, the checkpoint's values
        # its initial ones, not a copy of a peer's; a dense record keeps _RECORD_KEYS)
        clean = {k: v for k, v in rec.items() if k not in ("id", "bytes", "origin")}
        upd = from_dict(rec["optimizer"])
        if upd.float_only and np.dtype(rec["dtype"]).kind != "f":
            raise ValueError(f"optimizer {type(upd).__name__} needs a float dtype")
        if rec.get("mode", "exact") != "exact":
            raise ValueError(f"mode {rec.get('mode')!r}")
        if kind == "table":
            tmod.check_args(rec["dim"], rec["capacity"], rec["seed"], rec["nshards"])
            if rec["shard_rows"] != tmod.rows_per_shard(rec["capacity"], rec["nshards"]):
                raise ValueError(f"shard_rows {rec['shard_rows']!r}")
            tmod.init_spec(tuple(rec["init_spec"]), np.dtype(rec["dtype"]))
            specs = tmod.shard_specs(clean, upd)
            rows, cols = rec["nshards"] * rec["shard_rows"], rec["dim"]
        else:
            rows, cols = rec["shape"]
            if ms.kind != "csr" or ms.rows != rows:
                raise ValueError(f"{mp} is not a csr set of {rows} rows")
            if not (files._is_int(cols) and 0 <= cols <= _MAX_EXTENT):
                raise ValueError(f"shape {rec['shape']} is too large (more than 2**63 - 1 "
                                 "columns)")
            rc = np.asarray(ms.csr.rowcnt, dtype=np.int64)
            ci = np.asarray(ms.csr.colidx, dtype=np.int64)
            if cmod.structure_hash(rc, ci) != rec["structure"]:
                raise ValueError("the structure differs from the record's")
            _check_sharding(rows, rec["shard_rows"], rec["nshards"])
            if rec["nnz"] != ms.nnz:
                raise ValueError(f"nnz {rec['nnz']!r}, but {mp} holds {ms.nnz}")
            specs = cmod.shard_specs(clean, upd, rc)
        lays = [_native.layout(s) for s in specs]
    except (KeyError, TypeError, ValueError, IndexError, ArithmeticError, Error) as exc:
        raise corrupt(f"{cj}: tensor {rec['name']!r}: invalid record or structure: "
                      f"{exc}") from None
    want_kind = "dense" if kind == "table" else "csr"
    if ms.kind != want_kind or (ms.rows, ms.cols) != (rows, cols) \
            or ms.dtypes["value"] != rec["dtype"]:
        raise corrupt(f"{mp}: a {ms.kind} {ms.rows} x {ms.cols} {ms.dtypes['value']} set, but "
                      f"{cj} records {kind} {rec['name']!r} as {rec['dtype']} {rows} x {cols}")
    lay = lays[0]
    want_state = _native.DTYPE_NAMES[lay["state_dtype"]]
    if len(sets) - 1 != lay["nstate"] or any(x.dtypes["value"] != want_state
                                             for x in sets[1:]):
        raise corrupt(f"{mp}: {len(sets) - 1} state arrays, but optimizer "
                      f"{type(upd).__name__} keeps {lay['nstate']} {want_state} arrays")
    shards = entry.get("shards")
    if not (isinstance(shards, list) and len(shards) == len(specs)
            and all(isinstance(x, dict) for x in shards)):
        raise corrupt(f"{cj}: tensor {rec['name']!r}: field \"shards\" is not a list of "
                      f"{len(specs)} {{step, table_used}} objects")
    for s, x in enumerate(shards):  # header words restore hands to C
        for k in ("step", "table_used"):
            if not files.is_u64(x.get(k)):
                raise corrupt(f"{cj}: tensor {rec['name']!r}: field \"shards[{s}].{k}\" = "
                              f"{json.dumps(x.get(k))[:80]} {files.NOT_U64}")
    raw = _open_regions(where, lays, rec["name"])
    for s, (ly, d) in enumerate(zip(lays, raw)):
        if kind == "table":
            c = d["ctl"]
            if (int(c[0]) != _CTL_MAGIC or int(c[1]) != rec["capacity"]
                    or int(c[2]) != (rec["nshards"] | (s << 32))
                    or int(c[_CTL_HWM]) > ly["nrows"] or int(c[12]) > ly["nrows"]
                    or shards[s]["table_used"] > ly["nrows"]):
                raise corrupt(f"{where}.s{s}.ctl: not the control block of shard {s} of "
                              f"table {rec['name']!r}")
        if kind == "csr":
            r0, n = specs[s]["row_begin"], specs[s]["nrows"]
            e0 = int(rc[r0])
            d["_rowcnt"] = rc[r0:r0 + n + 1] - e0
            d["_colidx"] = ci[e0:int(rc[r0 + n])]
        # (an outbox's rowstep words link its pushed rows; restore leaves outboxes out)
        whose = f"shard {s} of {kind} {rec['name']!r}"
        problem = None if _is_outbox(rec) else (
            _stats_problem(ly, d, type(upd).__name__, whose) or _live_lock(ly, d, whose))
        if problem is not None:
            region, what = problem
            raise corrupt(f"{where}.s{s}.{region}: {what}")
    if kind == "table":
        try:
            _check_saved_index(rec["name"], specs, raw, shards)
        except CorruptFile as exc:
            raise _table_check_error(exc, path, entry) from None
    values = ms.csr.value
    states = [x.csr.value for x in sets[1:]]
    nbytes = sum(ly["total_size"] for ly in lays)

    def run(store: Any, bar: Any) -> None:
        store._restore_raw(clean, specs, values, states, raw, shards, bar)

    return _Plan(nbytes, run)


_SAVERS: dict[str, Callable] = {"dense": _save_dense, "table": _save_sparse,
                                "csr": _save_sparse}
_PLANNERS: dict[str, Callable[[str, dict], _Plan]] = {"dense": _plan_dense,
                                                       "table": _plan_sparse,
                                                       "csr": _plan_sparse}
