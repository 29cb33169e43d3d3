"""Picklable descriptions of shmps tensors, opened the same way by the parent and workers.

Every process calls the get-or-create API with identical arguments (DESIGN.md: a
mismatch is a SchemaError), so a spec is all a worker needs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class OptimizerSpec:
    """``shmps.<name>(**kwargs)``, e.g. ``OptimizerSpec("SGD", {"lr": 1.0})``."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self, shmps: Any) -> Any:
        return getattr(shmps, self.name)(**self.kwargs)

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"


@dataclass(frozen=True)
class DenseSpec:
    """``store.dense(name, shape=, dtype=, init=, optimizer=, **extra)`` in store ``store``."""

    store: str
    name: str
    shape: tuple[int, ...]
    optimizer: OptimizerSpec
    dtype: str = "float32"
    init: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def open(self, shmps: Any, store: Any = None) -> tuple[Any, Any]:
        """Return (store, tensor); attaches the store unless one is given."""
        store = store if store is not None else shmps.attach(self.store)
        t = store.dense(self.name, shape=self.shape, dtype=self.dtype, init=self.init,
                        optimizer=self.optimizer.build(shmps), **self.extra)
        return store, t


@dataclass(frozen=True)
class TableSpec:
    """``store.table(name, dim=, capacity=, optimizer=)`` in store ``store``."""

    store: str
    name: str
    dim: int
    capacity: int
    optimizer: OptimizerSpec
    dtype: str = "float32"

    def open(self, shmps: Any, store: Any = None) -> tuple[Any, Any]:
        store = store if store is not None else shmps.attach(self.store)
        t = store.table(self.name, dim=self.dim, dtype=self.dtype, capacity=self.capacity,
                        optimizer=self.optimizer.build(shmps))
        return store, t


def close_quietly(store: Any) -> None:
    """``store.close()`` in a worker on its way out; errors do not matter there."""
    try:
        store.close()
    except Exception:  # noqa: BLE001
        pass
