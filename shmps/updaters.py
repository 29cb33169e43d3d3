"""Updaters ("optimizers"): what a push does to the stored values, run in C.

Each is a small immutable object naming a C updater and its hyper-parameters.
Formulas (docs/updaters.md) follow ``torch.optim`` defaults; FTRL follows McMahan
et al. 2013.  Stateful updaters keep their state arrays in the shard segment.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Union

import numpy as np

from ._native import lib
from .checks import check_flag
from .errors import InvalidArgument


def _is_real(value: object) -> bool:
    """A real number (int, float, numpy scalar, ...), not a bool: ``lr=True`` is a slip."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _finite(name: str, value: object, *, positive: bool = False,
            nonneg: bool = False) -> float:
    """``value`` as a float, checked: a real number (a str, list, bool or None is refused,
    not converted), finite, and > 0 or >= 0 as asked."""
    need = "> 0" if positive else ">= 0" if nonneg else "finite"
    if not _is_real(value):
        raise InvalidArgument(f"{name}={value!r} is not a number ({type(value).__name__})",
                              f"pass a float {need}, e.g. {name}=0.1")
    try:
        v = float(value)  # type: ignore[arg-type]
    except OverflowError:  # an int beyond the float range
        v = math.inf
    if not math.isfinite(v) or (positive and v <= 0) or (nonneg and v < 0):
        raise InvalidArgument(f"{name}={value!r} must be {need}", "fix the optimizer argument")
    return v


def _set_floats(obj: Any, **checks: dict) -> None:
    """Check each named float field of a frozen dataclass and store it as a float."""
    for name, how in checks.items():
        object.__setattr__(obj, name, _finite(name, getattr(obj, name), **how))


_NONNEG: dict = {"nonneg": True}


@dataclass(frozen=True)
class Updater:
    """Base class; ``code`` is the C updater, ``params()`` its parameter vector."""

    code: ClassVar[int] = 0
    float_only: ClassVar[bool] = True
    # duplicates in one push can be applied one by one (same result as summed)
    sequential_duplicates: ClassVar[bool] = False

    def params(self) -> list[float]:
        return []

    def to_dict(self) -> dict:
        return {"type": type(self).__name__, **asdict(self)}


@dataclass(frozen=True)
class Sum(Updater):
    """``w += g`` (all dtypes; integer sums wrap like numpy's)."""

    code: ClassVar[int] = lib.SHMPS_SUM
    float_only: ClassVar[bool] = False
    sequential_duplicates: ClassVar[bool] = True


@dataclass(frozen=True)
class Assign(Updater):
    """``w = g`` (all dtypes; with duplicate rows in one push, the last wins)."""

    code: ClassVar[int] = lib.SHMPS_ASSIGN
    float_only: ClassVar[bool] = False
    sequential_duplicates: ClassVar[bool] = True


@dataclass(frozen=True)
class Max(Updater):
    """``w = max(w, g)`` (all dtypes)."""

    code: ClassVar[int] = lib.SHMPS_MAX
    float_only: ClassVar[bool] = False
    sequential_duplicates: ClassVar[bool] = True


@dataclass(frozen=True)
class Min(Updater):
    """``w = min(w, g)`` (all dtypes)."""

    code: ClassVar[int] = lib.SHMPS_MIN
    float_only: ClassVar[bool] = False
    sequential_duplicates: ClassVar[bool] = True


@dataclass(frozen=True)
class SGD(Updater):
    """torch.optim.SGD without momentum: ``g += wd*w; w -= lr*g``."""

    lr: float = 0.01
    weight_decay: float = 0.0
    code: ClassVar[int] = lib.SHMPS_SGD

    def __post_init__(self) -> None:
        _set_floats(self, lr=_NONNEG, weight_decay=_NONNEG)

    @property
    def sequential_duplicates(self) -> bool:  # type: ignore[override]
        return self.weight_decay == 0.0

    def params(self) -> list[float]:
        return [self.lr, self.weight_decay]


@dataclass(frozen=True)
class Momentum(Updater):
    """torch.optim.SGD with momentum (dampening, nesterov, weight_decay)."""

    lr: float = 0.01
    momentum: float = 0.9
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    code: ClassVar[int] = lib.SHMPS_MOMENTUM

    def __post_init__(self) -> None:
        _set_floats(self, lr=_NONNEG, momentum=_NONNEG, dampening={},
                    weight_decay=_NONNEG)
        object.__setattr__(self, "nesterov", check_flag(self.nesterov, "nesterov"))
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise InvalidArgument("nesterov momentum requires momentum > 0 and dampening 0",
                                  "as in torch.optim.SGD")

    def params(self) -> list[float]:
        return [self.lr, self.momentum, self.dampening, float(self.nesterov), self.weight_decay]


@dataclass(frozen=True)
class Adagrad(Updater):
    """torch.optim.Adagrad."""

    lr: float = 0.01
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    code: ClassVar[int] = lib.SHMPS_ADAGRAD

    def __post_init__(self) -> None:
        _set_floats(self, lr=_NONNEG, lr_decay=_NONNEG, weight_decay=_NONNEG,
                    initial_accumulator_value=_NONNEG, eps=_NONNEG)

    def params(self) -> list[float]:
        return [self.lr, self.lr_decay, self.weight_decay, self.initial_accumulator_value,
                self.eps]


@dataclass(frozen=True)
class Adam(Updater):
    """torch.optim.Adam (L2 weight_decay, optional amsgrad)."""

    lr: float = 0.001
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    code: ClassVar[int] = lib.SHMPS_ADAM

    def __post_init__(self) -> None:
        _set_floats(self, lr=_NONNEG)
        b = self.betas
        if (isinstance(b, (str, bytes)) or not hasattr(b, "__len__") or len(b) != 2
                or not all(_is_real(x) and 0 <= float(x) < 1 for x in b)):
            raise InvalidArgument(f"betas={b!r} must be two numbers in [0, 1)",
                                  "as in torch.optim.Adam, e.g. betas=(0.9, 0.999)")
        object.__setattr__(self, "betas", (float(b[0]), float(b[1])))
        _set_floats(self, eps=_NONNEG, weight_decay=_NONNEG)
        object.__setattr__(self, "amsgrad", check_flag(self.amsgrad, "amsgrad"))

    def params(self) -> list[float]:
        return [self.lr, self.betas[0], self.betas[1], self.eps, self.weight_decay,
                float(self.amsgrad)]


@dataclass(frozen=True)
class FTRL(Updater):
    """FTRL-proximal (McMahan et al. 2013), per coordinate."""

    alpha: float = 0.1
    beta: float = 1.0
    l1: float = 1.0
    l2: float = 1.0
    code: ClassVar[int] = lib.SHMPS_FTRL

    def __post_init__(self) -> None:
        _set_floats(self, alpha={"positive": True}, beta=_NONNEG, l1=_NONNEG, l2=_NONNEG)

    def params(self) -> list[float]:
        return [self.alpha, self.beta, self.l1, self.l2]


_BY_NAME: dict[str, type[Updater]] = {
    c.__name__: c for c in (Sum, Assign, Max, Min, SGD, Momentum, Adagrad, Adam, FTRL)
}
_STRINGS = {"sum": Sum, "assign": Assign, "max": Max, "min": Min}

UpdaterLike = Union[Updater, str, None]


def as_updater(obj: UpdaterLike) -> Updater:
    """Accept an Updater, or one of the strings "sum", "assign", "max", "min"."""
    if obj is None:
        return Sum()
    if isinstance(obj, Updater):
        return obj
    if isinstance(obj, str) and obj.lower() in _STRINGS:
        return _STRINGS[obj.lower()]()
    raise InvalidArgument(f"unknown optimizer {obj!r}",
                          "pass shmps.SGD(...), shmps.Adam(...), ... or 'sum'/'assign'/'max'/'min'")


def from_dict(d: dict) -> Updater:
    """Inverse of ``Updater.to_dict``."""
    d = dict(d)
    cls = _BY_NAME.get(d.pop("type", ""))
    if cls is None:
        raise InvalidArgument(f"unknown optimizer record {d!r}")
    if "betas" in d:
        d["betas"] = tuple(d["betas"])
    return cls(**d)
