"""Checks of public arguments that every module shares: integers, flags and timeouts.

An integer argument (a count, an id, a bound) takes what ``operator.index`` takes, as
numpy and PyTorch users expect: a Python int, a numpy or torch integer scalar, a 0-d
integer array (``np.array(3)``).  A bool (``operator.index(True)`` is 1), a float of
any kind, a string or a 1-d array is refused with :class:`InvalidArgument` naming the
argument and saying what to pass: ``int()`` took 2.7 as 2 and True as 1, and raised a
plain ValueError for "x".

A flag (a boolean keyword: ``consistent=``, ``wait=``, ``create=``, ...) takes True or
False (numpy's ``np.bool_`` too); anything else is refused the same way, where a truthy
test took ``consistent="no"`` as True.

A leaf module (errors and numpy only), so that updaters.py, tensor.py and the modules
above them all use these.  O(1) each.
"""
from __future__ import annotations

import numbers
import operator
from typing import Any, Optional

import numpy as np

from .errors import InvalidArgument, SchemaError


def _bound(n: int) -> str:
    """``n`` as a message gives it: 2^63-1 rather than 9223372036854775807."""
    if n >= 1 << 20:
        if (n + 1) & n == 0:
            return f"2^{(n + 1).bit_length() - 1}-1"
        if n & (n - 1) == 0:
            return f"2^{n.bit_length() - 1}"
    return str(n)


def check_int(value: object, name: str, lo: int, hi: Optional[int] = None, *,
              none: bool = False, hint: Optional[str] = None) -> Optional[int]:
    """``value`` of argument ``name`` as a Python int in ``[lo, hi]`` (``hi`` None: no
    upper bound), or None if it is None and ``none`` allows it; else InvalidArgument
    ("name=value must be [None or ]an integer from lo to hi", ``hint`` or one saying
    what to pass)."""
    if value is None and none:
        return None
    v: Optional[int] = None
    if not isinstance(value, (bool, np.bool_)):
        try:
            v = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            v = None
    if v is None or v < lo or (hi is not None and v > hi):
        span = f"from {lo} to {_bound(hi)}" if hi is not None else f">= {lo}"
        raise InvalidArgument(f"{name}={value!r} must be {'None or ' if none else ''}an "
                              f"integer {span}",
                              hint or f"pass {name} as an integer {span}")
    return v


def check_flag(value: object, name: str) -> bool:
    """``value`` of keyword ``name`` as a bool: True or False (numpy's too); anything
    else (a string, a number, None) is an InvalidArgument saying what to pass.  A push
    or pull calls it: True and False are told apart by identity first."""
    if value is True or value is False:
        return value
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgument(f"{name}={value!r} is not a bool ({type(value).__name__})",
                              f"pass {name}=True or {name}=False")
    return bool(value)


#: the hint of a wait whose default (None) is a bounded wait of its own, not "no limit"
BOUNDED_WAIT_HINT = ("pass e.g. timeout=60 (the default, None), or math.inf to wait as "
                     "long as it takes")


def check_seconds(timeout: Any, hint: str = "pass e.g. timeout=60, or None (or math.inf) "
                  "to wait as long as it takes") -> Optional[float]:
    """A ``timeout=`` argument as a float of seconds (None stays None, math.inf stays
    inf): a number >= 0, not a bool.  The waits below it read a negative timeout as "no
    limit" (the C core) or "do not wait" (a future), took True as 1 s and NaN as
    anything: every public wait (PushHandle.wait, Store.clock, Store.flush, an
    aggregated push and wait_round) refuses them here with the same InvalidArgument."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) \
            or not float(timeout) >= 0:
        raise InvalidArgument(f"timeout={timeout!r} must be None or a number of seconds >= 0",
                              hint)
    return float(timeout)


#: the hint of an input numpy cannot read as an array (as_array)
ARRAY_HINT = ("pass a numpy array of numbers (a torch tensor as t.detach().cpu().numpy(), "
              "a bfloat16 one cast to float32 first; a list of equal-length rows)")


def as_array(value: Any, what: str, exc: type = SchemaError) -> np.ndarray:
    """``np.asarray(value)``, or ``exc`` (SchemaError; OutOfRange for rows) when numpy
    cannot make an array of it: a ragged list (numpy's ValueError "inhomogeneous
    shape"), an object whose ``__array__`` raises (a torch tensor that requires grad:
    RuntimeError; one of bfloat16: TypeError).  Those escaped as the builtins, without a
    shmps.Error or a hint.  O(1) for an ndarray, else numpy's conversion."""
    if type(value) is np.ndarray:
        return value
    try:
        return np.asarray(value)
    except (TypeError, ValueError, RuntimeError) as e:
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        raise exc(f"{what} ({kind}) cannot be read as an array: {e}", ARRAY_HINT) from None
