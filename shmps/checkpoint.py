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
``PATH.tmp-*`` directory, removed by the next checkpoint to the same PATH.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import secrets
import shutil
import sys
import time
from typing import Any, BinaryIO, Callable, Optional

import numpy as np

from . import _native
from .errors import CorruptFile, InvalidArgument, NotFound
from .tensor import Shard, Tensor

FORMAT = "shmps-checkpoint"
VERSION = 1
lib, ffi = _native.lib, _native.ffi


def _progress(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr,
                disable=not sys.stderr.isatty(), leave=False)


def _frozen_copy(t: Tensor, i: int, fields: Callable[[Shard], dict]) -> dict:
    """Copy arrays of shard ``i`` while it is frozen (a whole number of pushes)."""
    sh = t._shard(i)
    tok = _native.token()
    _native.check(lib.shmps_freeze(sh.ptr, tok, 60.0), f"checkpoint of {t.name!r}")
    try:
        out = {k: np.array(v, copy=True) for k, v in fields(sh).items()}
        out["_stats"] = _native.stats(sh.ptr)
    finally:
        lib.shmps_thaw(sh.ptr, tok)
    return out


def _dense_fields(sh: Shard) -> dict:
    dt = _native.DTYPE_NAMES[sh.spec["dtype"]]
    d = {"value": sh.values(np.dtype(dt))}
    for k in range(sh.spec["nstate"]):
        d[f"state{k}"] = sh.state(k)
    return d


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _install(tmp: str, path: str) -> None:
    """Make ``tmp`` the checkpoint at ``path``, replacing any old one atomically."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.lexists(path):
        if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "checkpoint.json")):
            if not (os.path.isdir(path) and not os.listdir(path)):
                raise InvalidArgument(f"{path} exists and is not a shmps checkpoint",
                                      "choose another path, or remove it")
        if _exchange(tmp, path):
            _fsync_dir(parent)
            shutil.rmtree(tmp, ignore_errors=True)  # now the old checkpoint
            return
        old = f"{path}.old-{secrets.token_hex(4)}"
        os.rename(path, old)  # fallback: a short window with no PATH, old kept aside
        os.rename(tmp, path)
        _fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    os.rename(tmp, path)
    _fsync_dir(parent)


def _clean_debris(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path)) or "."
    base = os.path.basename(os.path.abspath(path))
    for n in os.listdir(parent):
        if n.startswith(base + ".tmp-") or n.startswith(base + ".old-"):
            pid = n.rsplit("-", 2)[-2] if n.count("-") >= 2 else ""
            if pid.isdigit() and int(pid) != os.getpid() and _pid_alive(int(pid)):
                continue  # another process's checkpoint in progress
            shutil.rmtree(os.path.join(parent, n), ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def save(store: Any, path: str | os.PathLike) -> str:
    """Write every tensor of ``store`` to the checkpoint directory ``path``.

    Pushes continue meanwhile; each shard is copied consistently.  Replaces an
    existing checkpoint at ``path`` atomically.  Returns the path."""
    path = os.fspath(path)
    _clean_debris(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f"{os.path.basename(os.path.abspath(path))}.tmp-{os.getpid()}-"
                               f"{secrets.token_hex(3)}")
    os.mkdir(tmp, 0o700)
    try:
        tensors = [store[d["name"]] for d in store.tensors()]
        total = sum(sum(sh.seg.size for sh in t._shards) for t in tensors)
        entries = []
        with _progress(total, f"checkpoint {store.name}") as bar:
            for t in tensors:
                entries.append(_SAVERS[t.kind](t, tmp, f"t{t.record['id']}", bar))
        doc = {"format": FORMAT, "version": VERSION, "store": store.name,
               "namespace": store.namespace, "created_unix": time.time(), "tensors": entries}
        with open(os.path.join(tmp, "checkpoint.json"), "w") as f:
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        _install(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


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
        f.write(memoryview(a).cast("B"))

    def close(self, meta: dict) -> None:
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        with open(os.path.join(self.dir, f"{self.prefix}.meta"), "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())


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
    fn = os.path.join(path, "checkpoint.json")
    if not os.path.isdir(path):
        raise NotFound(f"no checkpoint directory {path}")
    try:
        with open(fn) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise CorruptFile(f"{fn}: missing (not a shmps checkpoint)") from None
    except ValueError as exc:
        raise CorruptFile(f"{fn}: not JSON ({exc})") from None
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise CorruptFile(f"{fn}: format {doc.get('format')!r} version {doc.get('version')!r}, "
                          f"expected {FORMAT!r} version {VERSION}")
    return doc


def _file_array(path: str, prefix: str, kind: str, dtype: str, count: int) -> np.ndarray:
    fn = os.path.join(path, f"{prefix}.{kind}")
    dt = np.dtype(dtype).newbyteorder("<")
    try:
        size = os.path.getsize(fn)
    except FileNotFoundError:
        raise CorruptFile(f"{fn}: missing") from None
    if size != count * dt.itemsize:
        raise CorruptFile(f"{fn}: {size} bytes, expected {count} x {dt.itemsize} = "
                          f"{count * dt.itemsize}")
    if count == 0:
        return np.zeros(0, dt)
    return np.memmap(fn, dtype=dt, mode="r", shape=(count,))


def restore(path: str | os.PathLike, name: str, *, namespace: Optional[str] = None,
            force: bool = False) -> Any:
    """Recreate store ``name`` from the checkpoint at ``path``; returns it attached.

    Refuses (InvalidArgument) to overwrite an existing store that has tensors or other
    live processes, unless ``force=True`` (then the old store is destroyed first)."""
    from .store import attach

    path = os.fspath(path)
    doc = _load_doc(path)
    store = attach(name, namespace=namespace)
    others = [p for p in store.processes() if p != os.getpid()]
    ntensors = len(store.tensors())
    if ntensors or others:
        if not force:
            store.close()
            raise InvalidArgument(
                f"store {name!r} exists ({ntensors} tensors, live processes {others or 'none'})",
                "pass force=True (shmps-tool restore --force) to replace it, or --as NEWNAME")
        store.destroy()
        store = attach(name, namespace=namespace)
    try:
        entries = doc["tensors"]
        total = 0
        for e in entries:
            for fn in os.listdir(path):
                if fn.startswith(e["prefix"] + "."):
                    total += os.path.getsize(os.path.join(path, fn))
        with _progress(total, f"restore {name}") as bar:
            for e in entries:
                _RESTORERS[e["record"]["kind"]](store, path, e, bar)
    except BaseException:
        store.destroy()
        raise
    return store


def _restore_dense(store: Any, path: str, entry: dict, bar: Any) -> None:
    rec = dict(entry["record"])
    prefix = entry["prefix"]
    shape = tuple(rec["shape"])
    nrows = shape[0] if shape else 1
    row_len = int(np.prod(shape[1:], dtype=np.int64)) if shape else 1
    values = _file_array(path, prefix, "value", rec["dtype"], nrows * row_len)
    meta_path = os.path.join(path, f"{prefix}.meta")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise CorruptFile(f"{meta_path}: {exc}") from None
    st = meta.get("state", {"count": 0, "dtype": "float32"})
    states = [_file_array(path, prefix, f"state{k}", st["dtype"], nrows * row_len)
              for k in range(int(st["count"]))]
    store._restore_dense(rec, values, states, int(entry.get("step", 0)), bar)


_SAVERS: dict[str, Callable] = {"dense": _save_dense}
_RESTORERS: dict[str, Callable] = {"dense": _restore_dense}
