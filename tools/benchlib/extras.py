"""``bench.py bridge`` (not available yet); ``bench.py training`` lives in training.py.

bridge: will measure forwarded push throughput between 2 bridges on loopback beside raw
sockets and aiohttp websockets, and failover time over 10 kills (issue 6).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from .context import RunContext
from .report import Section

REPO = Path(__file__).resolve().parents[2]


def bridge_section() -> Section:
    return Section("bridge", "BRIDGE: forwarded pushes between 2 bridges on loopback, failover")


def run_bridge(ctx: RunContext, sec: Section) -> None:
    """Not implemented until a runnable bridge exists: say why."""
    if ctx.shmps is None:
        sec.messages.append(f"not available yet: shmps not importable ({ctx.shmps_error})")
        return
    if importlib.util.find_spec("shmps.bridge") is None:
        sec.messages.append("not available yet: shmps.bridge does not exist")
        return
    pyproject = (REPO / "pyproject.toml").read_text()
    if "shmps-bridge" not in pyproject:
        sec.messages.append("not available yet: shmps.bridge exists but has no `shmps-bridge` "
                            "entry point in pyproject.toml to start bridges with")
        return
    sec.messages.append("not available yet: shmps-bridge exists, but its benchmark is not "
                        "written (tools/benchlib/extras.py)")
