"""The one module that touches the compiled core (``shmps._shmps_native``).

Thin wrappers: validate nothing (callers did), call C once, map the return code to
a :mod:`shmps.errors` class.  cdata never leaves this module's callers in
``shmps``; the public API speaks numpy.  cffi releases the GIL around every call.
"""
from __future__ import annotations

import os
from typing import Any, Literal, Optional

import numpy as np

from . import errors
from ._shmps_native import ffi, lib

OK = lib.SHMPS_OK
RECOVERED = lib.SHMPS_RECOVERED

DTYPE_CODES: dict[str, int] = {
    "int8": lib.SHMPS_INT8,
    "int32": lib.SHMPS_INT32,
    "float16": lib.SHMPS_FLOAT16,
    "float32": lib.SHMPS_FLOAT32,
    "float64": lib.SHMPS_FLOAT64,
}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}
#: the same codes keyed by numpy dtype (``dtype.name`` is computed in Python each time:
#: ~4 us, more than a one-row push's C call)
DTYPE_CODES_BY_DTYPE: dict[np.dtype, int] = {np.dtype(k): v for k, v in DTYPE_CODES.items()}
KINDS = {"dense": lib.SHMPS_DENSE, "csr": lib.SHMPS_CSR, "table": lib.SHMPS_TABLE}

# specific codes first (argon2-cffi style): each maps to a class and a default text
_CODES: dict[int, tuple[type[errors.Error], str]] = {
    lib.SHMPS_E_CORRUPT: (errors.CorruptSegment, "segment header is not a valid shmps layout"),
    lib.SHMPS_E_VERSION: (errors.CorruptSegment, "segment has another layout version (made "
                          "by another shmps release: checkpoint the store with that release if "
                          "you need its values, end its processes, remove the store with "
                          "`shmps-tool gc --corrupt`, and restore the checkpoint with this "
                          "one)"),
    lib.SHMPS_E_BOUNDS: (errors.OutOfRange, "index or size out of range"),
    lib.SHMPS_E_UNBACKED: (errors.CapacityError, "an outbox's new rows are not backed yet "
                           "(its pushers back them first: outbox.py)"),
    lib.SHMPS_E_TIMEOUT: (errors.Timeout, "timed out waiting for a live process holding a "
                          "lock; a push stopped here applied the stripes it had reached"),
    lib.SHMPS_E_FULL: (errors.CapacityError, "capacity reached"),
    lib.SHMPS_E_NONFINITE: (errors.NonFinite, "gradient holds NaN or Inf"),
    lib.SHMPS_E_ARG: (errors.InvalidArgument, "invalid argument"),
    lib.SHMPS_E_NOTFOUND: (errors.NotFound, "not found"),
    lib.SHMPS_E_REMOVED: (errors.NotFound, "the store is being removed (shmps-tool gc)"),
    lib.SHMPS_E_BUSY: (errors.Error, "another process holds it"),
    # (SHMPS_E_PIDNS: InvalidArgument, worded by other_pid_namespace, as attach words it)
}


def check(code: int, what: str) -> int:
    """Return ``code`` if it is OK/informational, else raise the matching error."""
    if code >= 0 and code <= RECOVERED:
        return code
    if code == lib.SHMPS_E_PIDNS:
        # the one message of a store of another PID namespace, with attach's fix (the C
        # refusal of a manifest's claim: attach words it first, naming both namespaces,
        # store._check_pid_namespace; here the namespaces were not read)
        raise other_pid_namespace(what, None, "attach")
    if code in _CODES:
        cls, text = _CODES[code]
        raise cls(f"{what}: {text}")
    raise errors.Error(f"{what}: {os.strerror(code) if code > 0 else f'error {code}'}")


_token_cache: list[int] = []


def _reset_token() -> None:
    _token_cache.clear()


os.register_at_fork(after_in_child=_reset_token)


def token() -> int:
    """This process's token: pid and start time; recomputed after fork."""
    if not _token_cache:
        _token_cache.append(int(lib.shmps_self_token()))
    return _token_cache[0]


def foreign_pid_namespace(manifest: Any) -> Optional[tuple[int, int]]:
    """(the store's PID namespace, this process's) if the store at ``manifest`` was made
    in another than this process's, else None (the same, or either unknown): tokens are
    pids of one namespace (docs/concurrency.md, "Owners and tokens")."""
    theirs, ours = int(lib.shmps_manifest_pid_ns(manifest)), int(lib.shmps_self_pid_ns())
    return (theirs, ours) if theirs and ours and theirs != ours else None


#: what a process that met a store of another PID namespace can do, by what it was doing
_OTHER_PID_NS_FIX = {
    "attach": "attach from processes of one PID namespace (Kubernetes: "
              "shareProcessNamespace: true), or use another store name or namespace",
    "gc": "run `shmps-tool gc` in that PID namespace",
    "ls": "run `shmps-tool ls` in that PID namespace to see them",
}


def other_pid_namespace(subject: str, pid_ns: Optional[tuple[int, int]],
                        doing: Literal["attach", "gc", "ls"]) -> errors.InvalidArgument:
    """The one message for ``subject`` (a store, a restore's new manifest) made in another
    PID namespace than this process's (``pid_ns``: theirs and ours, as
    :func:`foreign_pid_namespace` gives them; None where only a C code, SHMPS_E_PIDNS,
    says so: :func:`check`): what happened, and what to do for what this process was
    ``doing``.  attach, gc's remove_idle and check raise it; ls and gc print it
    (``str()``: the message, then the fix in parentheses)."""
    which = ""
    if pid_ns is not None:
        theirs, ours = pid_ns
        which = f" (pid:[{theirs}]; this process is in pid:[{ours}])"
    return errors.InvalidArgument(
        f"{subject} was made (or is being made) in another PID namespace{which}: its "
        "processes cannot tell whether this one is alive, nor this one whether they are",
        _OTHER_PID_NS_FIX[doing])


def token_alive(tok: int) -> bool:
    return bool(lib.shmps_token_alive(tok))


def token_pid(tok: int) -> int:
    return tok >> 32


def pointer(buf: Any) -> Any:
    """A ``char *`` over a writable buffer (mmap, numpy array); release() it."""
    return ffi.from_buffer("char[]", buf, require_writable=False)


def release(ptr: Any) -> None:
    """Release a pointer() before its buffer goes: the C core first forgets the private
    spec it keeps for a shard mapped there (forget), so no later mapping at that address
    is read with it."""
    forget(ptr)
    ffi.release(ptr)


def forget(ptr: Any) -> None:
    """Drop the private spec kept for the shard mapped at ``ptr`` (none: nothing), as the
    mapping goes (docs/segment-layout.md, "The spec is private after attach")."""
    lib.shmps_shard_forget(ptr)


def addr(arr: np.ndarray) -> Any:
    """A pointer to a C-contiguous numpy array's data, typed for C (``int64_t *``
    for int64 and uint64 arrays, else ``char *``, accepted where C takes void *)."""
    kind = arr.dtype.char
    if kind in "qlQL" and arr.dtype.itemsize == 8:
        return ffi.from_buffer("uint64_t[]" if kind in "QL" else "int64_t[]", arr)
    return ffi.from_buffer(arr)


def addrs(arrays: list) -> Any:
    """A ``void *[]`` of the C-contiguous arrays' data (optimizer state arrays, as C
    takes them with their count), or NULL for none.  The arrays must outlive it."""
    return ffi.new("void *[]", [ffi.from_buffer(a) for a in arrays]) if arrays else ffi.NULL


# ---- shard layout ---------------------------------------------------------------

SPEC_INPUTS = ("kind", "dtype", "updater", "flags", "nrows", "row_len", "nnz",
               "row_begin", "ncols", "seed")
SPEC_DERIVED = ("total_size", "rowcnt_off", "colidx_off", "value_off", "rowstep_off",
                "stripes_off", "index_off", "nslots", "nstripes", "stripe_elems",
                "nstate", "state_dtype", "itemsize", "state_itemsize")


def _spec_to_dict(spec: Any) -> dict:
    d = {k: int(getattr(spec, k)) for k in SPEC_INPUTS + SPEC_DERIVED}
    d["params"] = [float(spec.params[i]) for i in range(lib.SHMPS_NPARAMS)]
    d["init"] = [float(spec.init[i]) for i in range(4)]
    d["state_off"] = [int(spec.state_off[i]) for i in range(lib.SHMPS_MAX_STATE)]
    return d


def params_of(upd: Any) -> list[float]:
    """An updater's ``params[]`` as a shard header holds them (zeros after its own), for
    comparing a header with the catalog record's optimizer."""
    p = [float(v) for v in upd.params()]
    return p + [0.0] * (lib.SHMPS_NPARAMS - len(p))


def layout(inputs: dict) -> dict:
    """Compute a shard's layout from its inputs (see shmps_spec_t)."""
    spec = ffi.new("shmps_spec_t *")
    for k in SPEC_INPUTS:
        setattr(spec, k, int(inputs.get(k, 0)))
    for i, v in enumerate(inputs.get("params", ())):
        spec.params[i] = float(v)
    for i, v in enumerate(inputs.get("init", ())):
        spec.init[i] = float(v)
    check(lib.shmps_layout(spec), "shard layout")
    return _spec_to_dict(spec)


def shard_init(ptr: Any, size: int, spec: dict) -> None:
    s = ffi.new("shmps_spec_t *")
    for k in SPEC_INPUTS:
        setattr(s, k, int(spec[k]))
    for i, v in enumerate(spec["params"]):
        s.params[i] = v
    for i, v in enumerate(spec["init"]):
        s.init[i] = v
    check(lib.shmps_shard_init(ptr, size, s), "shard init")


def shard_validate(ptr: Any, size: int, name: str) -> dict:
    spec = ffi.new("shmps_spec_t *")
    code = lib.shmps_shard_validate(ptr, size, spec)
    if code != OK:
        check(code, f"segment {name}")
    return _spec_to_dict(spec)


STATS_FIELDS = ("pushes", "pulls", "bytes_pushed", "bytes_pulled", "rows_pushed",
                "rows_pulled", "last_push_ns", "last_pull_ns", "step", "takeovers",
                "contended", "rows_used")


def stats(ptr: Any) -> dict:
    out = ffi.new("shmps_stats_t *")
    lib.shmps_stats(ptr, out)
    return {k: int(getattr(out, k)) for k in STATS_FIELDS}


def now_ns() -> int:
    return int(lib.shmps_now_ns())
