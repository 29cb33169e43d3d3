"""Value types for the command lines' options (``argparse`` ``type=``), shared by
``shmps-tool`` and ``shmps-bridge``: each refuses what its option cannot take with a
line saying why (argparse prefixes the option's name)."""
from __future__ import annotations

import argparse
import math
from typing import Callable

#: the longest wait an option may ask for (a day): a socket's timeout overflows past a
#: few days, and time.sleep past time_t
MAX_SECONDS = 86400.0


def at_least(least: int) -> Callable[[str], int]:
    """A type for an integer >= ``least`` (a count)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"{n} must be an integer >= {least}")
        return n
    return parse


#: a count of at least one (--replicas)
at_least_one = at_least(1)
#: a count where 0 means no limit (stats --count)
at_least_zero = at_least(0)


def positive(limit: float = math.inf, least: float = 0.0) -> Callable[[str], float]:
    """A type for a finite number > 0 (with ``least``: >= it) and <= ``limit`` (seconds,
    milliseconds): nan, inf, 0 and negatives are refused, as are values past ``limit``
    (a socket's timeout overflows past a few days) or below ``least`` (a period too
    short to mean anything: a busy loop, peers dead between two heartbeats)."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (0 < x <= limit and x >= least and math.isfinite(x)):
            raise argparse.ArgumentTypeError(
                f"{text} must be a finite number " + (f">= {least:g}" if least else "> 0")
                + (f" and <= {limit:g}" if math.isfinite(limit) else ""))
        return x
    return parse


def non_negative(text: str) -> float:
    """A type for a finite number >= 0 (a learning rate, a penalty of the examples):
    nan, inf and negatives are refused."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (0 <= x and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0")
    return x
