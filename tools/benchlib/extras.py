"""``bench.py training`` and ``bench.py bridge``: reported as not available until their code lands.

They will measure the Hogwild logistic-regression example (``examples/hogwild_logreg.py``)
and the multi-host bridge (issue 6: forwarded push throughput between 2 bridges on
loopback beside raw sockets and aiohttp websockets, failover time over 10 kills).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from .context import RunContext
from .report import Section

REPO = Path(__file__).resolve().parents[2]
TRAINING_EXAMPLE = REPO / "examples" / "hogwild_logreg.py"


def training_section() -> Section:
    return Section("training", "TRAINING: Hogwild logistic regression (examples/hogwild_logreg.py)")


def bridge_section() -> Section:
    return Section("bridge", "BRIDGE: forwarded pushes between 2 bridges on loopback, failover")


def run_training(ctx: RunContext, sec: Section) -> None:
    """Not implemented until the example exists: say why."""
    if not TRAINING_EXAMPLE.exists():
        sec.messages.append(f"not available yet: {TRAINING_EXAMPLE.relative_to(REPO)} does not exist")
        return
    sec.messages.append(f"not available yet: {TRAINING_EXAMPLE.relative_to(REPO)} exists, but its "
                        "benchmark is not written (tools/benchlib/extras.py)")


def run_bridge(ctx: RunContext, sec: Section) -> None:
    """Not implemented until shmps.bridge exists: say why."""
    if ctx.shmps is None:
        sec.messages.append(f"not available yet: shmps not importable ({ctx.shmps_error})")
        return
    if importlib.util.find_spec("shmps.bridge") is None:
        sec.messages.append("not available yet: shmps.bridge does not exist")
        return
    sec.messages.append("not available yet: shmps.bridge exists, but its benchmark is not written "
                        "(tools/benchlib/extras.py)")
