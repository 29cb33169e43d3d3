"""Store verbs of ``shmps-tool``: ls, gc, stats (checkpoint and restore: see
:mod:`shmps.checkpoint`)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from typing import Any, Optional

import numpy as np

from . import _native, names
from . import inspect as shm_inspect
from .cli_args import MAX_SECONDS, at_least_zero, positive
from .errors import Error, InvalidArgument
from .segment import age_of, unlink
from .store import remove_idle


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _namespace(given: Optional[str]) -> Optional[str]:
    """The namespace ``ls``/``gc`` cover: ``--namespace``, else ``$SHMPS_NAMESPACE``,
    else None (every namespace). An empty ``--namespace`` is refused: for attach it means
    "no namespace", which these verbs cannot select, and covering every namespace
    instead would surprise a ``gc --namespace "$NS"`` with NS unset."""
    if given == "":
        raise InvalidArgument("--namespace '' is empty",
                              hint="name a namespace, or leave --namespace out (with "
                                   "$SHMPS_NAMESPACE unset) to cover every namespace")
    return names.resolve_namespace(given)


def cmd_ls(args: argparse.Namespace) -> int:
    """List stores on this host: tensors, dtypes, shapes, sizes, live processes."""
    namespace = _namespace(args.namespace)
    stores, orphans = shm_inspect.scan(namespace)
    if namespace is not None:
        orphans = [o for o in orphans if o.startswith(f"/shmps.{namespace}.")]
    if args.json:
        out = [{"store": s.name, "namespace": s.namespace, "bytes": s.bytes, "pids": s.pids,
                "segments": len(s.segments), "error": s.error, "state": s.state,
                "other_pid_namespace": s.foreign is not None,
                "state_pid": s.state_pid or None,
                "tensors": [{k: t.get(k) for k in ("name", "kind", "dtype", "shape", "nshards",
                                                   "bytes", "capacity", "dim", "rows_used")
                             if k in t} | {"optimizer": t["optimizer"]["type"]}
                            for t in s.tensors]} for s in stores]
        json.dump({"stores": out, "orphans": orphans}, sys.stdout, indent=1)
        print()
        return 0
    if not stores and not orphans:
        print("no shmps stores on this host"
              + (f" in namespace {namespace}" if namespace else ""))
        return 0
    for s in stores:
        ns = f" (namespace {s.namespace})" if s.namespace else ""
        live = (", ".join(map(str, s.pids)) if s.pids else
                "unknown (made in another PID namespace)" if s.foreign else "none")
        print(f"{s.name}{ns}: {len(s.tensors)} tensors, {_fmt_bytes(s.bytes)} in "
              f"{len(s.segments)} segments, live processes: {live}")
        if s.error:
            print(f"  unreadable: {s.error}")
        elif s.state != "ready":
            print(f"  {_state_line(s)}")
        if s.foreign is not None:
            print(f"  {_native.other_pid_namespace(f'store {s.name!r}', s.foreign, 'ls')}")
        for t in s.tensors:
            shape = "x".join(map(str, t.get("shape") or [])) or "-"
            extra = ""
            if t.get("kind") == "table":
                cap = t.get("capacity", 0)
                used = t.get("rows_used", 0)
                extra = f"  rows {used}/{cap} ({100.0 * used / cap if cap else 0:.1f}% full)"
                shape = f"dim {t.get('dim')}"
            print(f"  {t['name']:<24} {t['kind']:<6} {t['dtype']:<8} {shape:<16} "
                  f"{t['optimizer']['type']:<9} {_fmt_bytes(t.get('bytes', 0)):>10}{extra}")
    for o in orphans:
        r = shm_inspect.restore_in_progress(o)   # (gc keeps what this does not call orphan)
        if r is None:
            print(f"orphan segment (no store): {o}")
        elif r.foreign is not None:
            print(f"restore in another PID namespace, its new manifest: {o}\n"
                  f"  {_native.other_pid_namespace(RESTORE_MANIFEST, r.foreign, 'ls')}")
        else:
            print(f"restore in progress (pid {r.pid}), its new manifest: {o}")
    return 0


#: what a forced restore's new manifest (``…manifest.restore-PID``) is called in messages
RESTORE_MANIFEST = "a forced restore's new manifest"


def _state_line(s: shm_inspect.StoreInfo) -> str:
    """What a process is doing to a store that is not ready, for ls."""
    if s.state == "being created" and not s.state_pid:
        what = "sized" if s.unsized else "initialised"
        return (f"being created: its manifest is not {what} yet; if it stays so, its "
                "creator died (`shmps-tool gc` removes it)")
    if s.state == "being created" and not s.state_pid_alive:
        return (f"a creation cut off (pid {s.state_pid} died): the next attach takes it "
                "over; gc removes it")
    if s.state_pid and s.state_pid_alive:
        by = f" by pid {s.state_pid}"
        if s.state == "restoring":
            return f"being restored{by}: its tensors are not all in yet; attaches wait"
        if s.state == "removing":
            return f"being removed{by}; attaches wait, then make a new store"
        return s.state + by
    dead = f" (pid {s.state_pid} died)" if s.state_pid else ""
    if s.state in ("restoring", "removing"):
        what = "a restore" if s.state == "restoring" else "a removal"
        return f"{what} cut off{dead}: the next attach or gc removes the store"
    if s.state == "gc deciding":
        return f"a gc cut off while deciding{dead}: the next attach or gc decides again"
    return s.state + dead


#: gc leaves alone stores (and orphan segments) younger than this, in seconds: a
#: store that young may be mid-attach by a process not yet in its process table.
#: The environment variable SHMPS_GC_MIN_AGE overrides it (tests set 0).
GC_MIN_AGE_S = 5.0
GC_MIN_AGE_ENV = "SHMPS_GC_MIN_AGE"


def gc_min_age() -> float:
    """:data:`GC_MIN_AGE_S`, or ``$SHMPS_GC_MIN_AGE`` (seconds, >= 0) when set."""
    text = os.environ.get(GC_MIN_AGE_ENV)
    if text is None or not text.strip():
        return GC_MIN_AGE_S
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not (v >= 0 and v != float("inf")):
        raise InvalidArgument(f"{GC_MIN_AGE_ENV}={text!r} is not a number of seconds >= 0",
                              f"unset it (default {GC_MIN_AGE_S:g} s) or set e.g. 0")
    return v


def _restore_in_progress(segment: str) -> bool:
    """A forced restore's new manifest, not yet renamed over the store's, of a restorer
    still alive (it may wait up to a minute for creations in the old store to end), or
    of another PID namespace, whose processes gc cannot judge (it says so): ls's verdict
    (shm_inspect.restore_in_progress)."""
    r = shm_inspect.restore_in_progress(segment)
    if r is not None and r.foreign is not None:
        print(f"skipped {segment}: "
              f"{_native.other_pid_namespace(RESTORE_MANIFEST, r.foreign, 'gc')}",
              file=sys.stderr)
    return r is not None


def cmd_gc(args: argparse.Namespace) -> int:
    """Remove segments of stores no live process has attached, and orphan segments."""
    min_age = gc_min_age()
    namespace = _namespace(args.namespace)
    stores, orphans = shm_inspect.scan(namespace, with_fill=False)
    if namespace is not None:
        mine = f"/shmps.{namespace}."
        orphans = [o for o in orphans if o.startswith(mine)]
    doomed: list[tuple[str, list[str], Optional[tuple[str, Optional[str]]]]] = []
    for s in stores:
        if s.pids:
            continue
        what = f"store {s.name}" + (f" (namespace {s.namespace})" if s.namespace else "")
        if s.foreign is not None:   # its processes' pids mean nothing here: all look dead
            # (as remove_idle refuses a store made there since this scan)
            print(f"skipped {what}: "
                  f"{_native.other_pid_namespace(f'store {s.name!r}', s.foreign, 'gc')}",
                  file=sys.stderr)
            continue
        if s.error is not None and not args.corrupt:
            print(f"skipped {s.manifest}: {s.error} (pass --corrupt to remove)", file=sys.stderr)
            continue
        if s.age_s < min_age:  # may be mid-attach by a process not yet registered
            # said, on stderr as "skipped" is: a user who just saw `ls` show the store
            # with no live process, and gc print "nothing to remove", was left guessing
            # (the command names the store's namespace: without --namespace a gc covers
            # every namespace, and would remove the young idle stores of all of them)
            scope = f" --namespace {shlex.quote(s.namespace)}" if s.namespace else ""
            print(f"spared {what}: no live process, but younger than {min_age:g} s (a "
                  f"process may be attaching it; {GC_MIN_AGE_ENV}=0 shmps-tool gc{scope} "
                  "removes it now)", file=sys.stderr)
            continue
        doomed.append((what, s.segments, None if s.error is not None else (s.name, s.namespace)))
    if orphans:
        doomed.append(("orphan segments", [o for o in orphans
                                           if age_of(o) >= min_age
                                           and not _restore_in_progress(o)], None))
    removed = 0
    for what, segs, store in doomed:
        if not segs:
            continue
        verb = "would remove" if args.dry_run else "removed"
        if args.dry_run:
            n = len(segs)
        elif store is not None:
            # the store found idle: retired, then removed, unless a process attached
            # since the scan (store.remove_idle), where unlinking the scan's list would
            # have pulled its segments from under it
            try:
                gone = remove_idle(*store, unborn_age=min_age)
            except Error as exc:   # one store's trouble does not stop the others' removal
                # (among them a store remade since the scan in another PID namespace)
                print(f"skipped {what}: {exc}", file=sys.stderr)
                continue
            if gone is None:
                print(f"kept {what}: in use since the scan (a process attached to it, "
                      "or one is still creating it)")
                continue
            n = len(gone)
        else:
            n = sum(unlink(x) for x in segs)
        removed += n
        print(f"{verb} {what}: {n} segments")
    if not removed:
        print("nothing to remove")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    """Push/pull rates per tensor from the counters in shared memory, like `top`."""
    from .store import attach

    store = attach(args.store, create=False, namespace=args.namespace)
    try:
        prev: dict[str, dict] = {}
        prev_t = time.monotonic()
        first = True
        while True:
            snap = {}
            for desc in store.tensors():
                snap[desc["name"]] = store[desc["name"]].stats()
            now = time.monotonic()
            if args.once:
                json.dump({"store": store.name, "tensors": snap}, sys.stdout, indent=1)
                print()
                return 0
            dt = max(now - prev_t, 1e-9)
            lines = [f"shmps stats {store.name}  (every {args.interval:g} s, Ctrl-C to quit)",
                     f"{'tensor':<24} {'push/s':>10} {'pull/s':>10} {'MB/s in':>10} "
                     f"{'MB/s out':>10} {'pushes':>12} {'step':>10}"]
            for name, st in snap.items():
                p = prev.get(name, st)
                rate = (lambda k: 0.0 if first else (st[k] - p[k]) / dt)
                lines.append(f"{name:<24} {rate('pushes'):>10.1f} {rate('pulls'):>10.1f} "
                             f"{rate('bytes_pushed') / 1e6:>10.1f} "
                             f"{rate('bytes_pulled') / 1e6:>10.1f} {st['pushes']:>12} "
                             f"{st['step']:>10}")
            if sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")
            print("\n".join(lines), flush=True)
            if args.count and args.count > 0:
                args.count -= 1
                if args.count == 0:
                    return 0
            prev, prev_t, first = snap, now, False
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        store.close()


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """Save a live store to a checkpoint directory (atomic replace)."""
    from .store import attach

    store = attach(args.store, create=False, namespace=args.namespace)
    try:
        path = store.checkpoint(args.path)
        n = len(store.tensors())
    finally:
        store.close()
    print(f"checkpoint of {args.store}: {n} tensors written to {path}")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    """Recreate a store from a checkpoint directory."""
    from .checkpoint import restore

    # (--as '' is refused as a name, not taken for "the checkpoint's": a `--as "$NAME"`
    # with NAME unset must not restore over the checkpointed store)
    store = restore(args.path, args.as_name, namespace=args.namespace, force=args.force)
    n, name = len(store.tensors()), store.name
    store.close()
    print(f"restored {n} tensors from {args.path} into store {name}")
    return 0


def tensor_as_matrix(store_name: str, tensor: str, namespace: Optional[str],
                     array: str = "value") -> Any:
    """A live tensor as a matrix file set (for ``shmps-tool dump --store``).

    A dense tensor is a dense set (implicit structure, nothing materialised but the
    pulled values); ``array="state0"`` ... gives an optimizer state array instead,
    each shard copied while frozen (a whole number of pushes, like a checkpoint)."""
    from .checkpoint import _dense_fields, _frozen_copy
    from .files import MatrixSet, _check_array_name
    from .store import attach

    _check_array_name(array)
    store = attach(store_name, create=False, namespace=namespace)
    try:
        t: Any = store[tensor]
        if hasattr(t, "as_matrix"):
            if array != "value":
                return t.as_matrix(array=array)
            return t.as_matrix()
        if t.kind != "dense":
            ns = f" --namespace {shlex.quote(namespace)}" if namespace else ""
            raise InvalidArgument(
                f"dump --store: tensor {tensor!r} is a {t.kind} tensor, which dump --store "
                "cannot print (only dense tensors)",
                hint=f"print a checkpoint of it: `shmps-tool checkpoint "
                     f"{shlex.quote(store_name)}{ns} DIR` then `shmps-tool dump DIR --tensor "
                     f"{shlex.quote(tensor)}`"
                     + (" (the table's rows by slot; their keys: docs/checkpoints.md)"
                        if t.kind == "table" else ""))
        nstate = t._shard(0).spec["nstate"]
        arrays = ("value",) + tuple(f"state{k}" for k in range(nstate))
        meta = {"name": t.name, "optimizer": t.optimizer.to_dict(),
                "step": t.stats()["step"]}
        if array == "value":
            vals = t.pull()
        else:
            if array not in arrays:
                raise InvalidArgument(f"tensor {tensor!r} has no array {array!r}: its arrays "
                                      f"are {', '.join(arrays)} (optimizer "
                                      f"{type(t.optimizer).__name__})",
                                      hint="pick one of those with --array")
            vals = np.concatenate([_frozen_copy(t, i, _dense_fields)[array]
                                   for i in range(t.nshards)]) if t.nshards else np.zeros(0)
        ms = MatrixSet.from_dense(vals, shape=t.shape, meta=meta)
        ms.array, ms.arrays = array, arrays
        return ms
    finally:
        store.close()


def register(sub: Any) -> None:
    p = sub.add_parser("ls", help="list stores, tensors and attached processes",
                       description="List the shmps stores on this host.",
                       epilog="example: shmps-tool ls --namespace hostA")
    p.add_argument("--namespace", metavar="NS",
                   help="only stores of this namespace (default: $SHMPS_NAMESPACE; "
                        "unset or empty: every namespace)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("gc", help="remove segments of stores with no live process",
                       description="Remove the segments of stores that no live process has "
                                   "attached (and orphan shmps segments). Stores younger "
                                   f"than {GC_MIN_AGE_S:g} s (${GC_MIN_AGE_ENV} to change) "
                                   "are left alone.",
                       epilog="example: shmps-tool gc --dry-run")
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    p.add_argument("--namespace", metavar="NS",
                   help="only stores (and orphan segments) of this namespace (default: "
                        "$SHMPS_NAMESPACE; unset or empty: every namespace)")
    p.add_argument("--corrupt", action="store_true",
                   help="also remove stores whose manifest is unreadable")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("stats", help="live push/pull rates per tensor",
                       description="Show push/pull rates per tensor, refreshed like top.",
                       epilog="example: shmps-tool stats model --once")
    p.add_argument("store")
    p.add_argument("--namespace")
    p.add_argument("--once", action="store_true", help="print one JSON snapshot and exit")
    p.add_argument("--interval", type=positive(MAX_SECONDS), default=1.0,
                   help="seconds between refreshes (at most a day)")
    p.add_argument("--count", type=at_least_zero, default=0,
                   help="stop after N refreshes (0: never)")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("checkpoint", help="save a store to a checkpoint directory",
                       description="Save every tensor of a live store (values, optimizer "
                                   "state, steps) to PATH, replacing it atomically.",
                       epilog="example: shmps-tool checkpoint model ckpt/model-0001")
    p.add_argument("store")
    p.add_argument("path")
    p.add_argument("--namespace")
    p.set_defaults(func=cmd_checkpoint)

    p = sub.add_parser("restore", help="recreate a store from a checkpoint",
                       description="Recreate a store from a checkpoint directory. Refuses to "
                                   "replace an existing store unless --force.",
                       epilog="example: shmps-tool restore ckpt/model-0001 --as model2")
    p.add_argument("path")
    p.add_argument("--as", dest="as_name", metavar="NAME",
                   help="store name (default: the checkpointed store's)")
    p.add_argument("--namespace")
    p.add_argument("--force", action="store_true", help="replace an existing store")
    p.set_defaults(func=cmd_restore)


if __name__ == "__main__":  # pragma: no cover (run in a subprocess by the tests)
    # `python -m shmps.<this module> --help` printed nothing and exited 0: the module
    # only defines verbs of shmps-tool, so it runs shmps-tool
    from .cli import main
    raise SystemExit(main())
