"""Store and namespace names, and the POSIX shared-memory names derived from them.

Every segment of a store is ``/shmps.<store>.<suffix>`` or, with a namespace,
``/shmps.<namespace>.<store>.<suffix>``; names are validated so they cannot
escape that prefix (no ``/``, not ``.`` or ``..``).
"""
from __future__ import annotations

import os
import re
from typing import Optional

from .errors import InvalidArgument

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
PREFIX = "shmps"


def check_name(name: object, what: str = "store name") -> str:
    """Return ``name`` if it matches ``[A-Za-z0-9_.-]{1,64}`` and is not ``.``/``..``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise InvalidArgument(
            f"invalid {what} {name!r}",
            "use 1 to 64 characters from A-Z a-z 0-9 _ . - (not '.' or '..')")
    return name


def resolve_namespace(namespace: Optional[str]) -> Optional[str]:
    """The explicit namespace, else ``$SHMPS_NAMESPACE``, else None; ``""`` is none,
    whatever the environment says."""
    if namespace == "":
        return None
    if namespace is None:
        namespace = os.environ.get("SHMPS_NAMESPACE") or None
        if namespace is not None:
            check_name(namespace, "namespace (from $SHMPS_NAMESPACE)")
        return namespace
    return check_name(namespace, "namespace")


def store_prefix(store: str, namespace: Optional[str]) -> str:
    """``/shmps.[ns.]store.`` — every segment of the store starts with this."""
    return f"/{PREFIX}.{namespace}.{store}." if namespace else f"/{PREFIX}.{store}."


def manifest_ident(store: str, namespace: Optional[str]) -> bytes:
    """What a manifest records of its store: ``namespace\0store`` (inspect.py reads it)."""
    return f"{namespace or ''}\0{store}".encode()


def manifest_name(store: str, namespace: Optional[str]) -> str:
    return store_prefix(store, namespace) + "manifest"


def restore_manifest_name(store: str, namespace: Optional[str], pid: int) -> str:
    """The manifest a forced restore by process ``pid`` makes before renaming it over the
    store's (Store._renew_for_restore)."""
    return f"{manifest_name(store, namespace)}.restore-{pid}"


def restore_manifest_pid(segment: str) -> Optional[int]:
    """The restorer's pid if ``segment`` is a restore_manifest_name, else None."""
    head, sep, pid = segment.rpartition(".manifest.restore-")
    return int(pid) if sep and head and pid.isdigit() else None


def shard_name(store: str, namespace: Optional[str], tensor_id: int, shard: int) -> str:
    return store_prefix(store, namespace) + f"t{tensor_id}.s{shard}"
