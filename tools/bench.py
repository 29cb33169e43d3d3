#!/usr/bin/env python3
"""shmps benchmarks: each figure beside the baselines and memory limits of the same run.

Usage::

    python tools/bench.py dense --quick            # issue 2, under a minute
    python tools/bench.py table --json table.json  # issue 3
    python tools/bench.py training --quick         # issue 5: shmps vs torch Hogwild, 1/2/4 procs
    python tools/bench.py all --dir /var/tmp       # everything; files go under --dir
    python tools/bench.py bridge --quick --perf    # issue 6, and where each bridge's CPU goes

Method (docs/benchmarks.md): every workload runs in freshly spawned processes (1 and 2),
each repeating "barrier, run the operation for 0.4 s (at least 3 times), report";
1 warm-up + 5 measured repetitions (1 + 2 with --quick); median and min-max are printed;
a 2-process rate is the sum of each process's own rate.  numpy and torch are
single-threaded.  The report goes to stdout at the end, progress to stderr.
"""
from __future__ import annotations

import os

# Before numpy is imported here or in any spawned worker (they inherit the environment):
# the baselines run single-threaded, as in BASELINES.md.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from contextlib import ExitStack  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Optional, Sequence  # noqa: E402

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
# benchlib, and shmps as installed (pip install -e . points at this tree), else from this
# tree; spawned workers inherit sys.path.  The report says where shmps came from.
sys.path.insert(0, str(TOOLS))
if importlib.util.find_spec("shmps") is None:
    sys.path.insert(1, str(REPO))

from benchlib import bridge, dense, files, limits, table, training  # noqa: E402
from benchlib.context import RunContext, import_shmps  # noqa: E402
from benchlib.harness import Timing, progress  # noqa: E402
from benchlib.report import (Section, machine_info, render_limits, render_machine,  # noqa: E402
                             render_section, section_json)

SectionRunner = Callable[[RunContext, Section], None]
SECTIONS: dict[str, tuple[Callable[[], Section], SectionRunner, bool]] = {
    # name: (section factory, runner, needs the memory limits)
    "dense": (dense.section, dense.run, True),
    "table": (table.section, table.run, False),
    "files": (files.section, files.run, False),
    "training": (training.section, training.run, False),
    "bridge": (bridge.section, bridge.run, False),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: python tools/bench.py dense --quick --json /tmp/dense.json")
    p.add_argument("what", choices=[*SECTIONS, "all"], help="which benchmark to run")
    p.add_argument("--quick", action="store_true",
                   help="1 warm-up + 2 measured repetitions, short waits for a quiet machine")
    p.add_argument("--json", metavar="PATH", type=Path, help="also write every figure as JSON")
    p.add_argument("--dir", metavar="DIR", type=Path, default=None,
                   help="where 'files' writes (default: a new temporary directory under /tmp)")
    p.add_argument("--reps", type=int, default=None, help="measured repetitions (default 5, quick 2)")
    p.add_argument("--smoke", action="store_true",
                   help="for the test suite: --quick's steps with 1 short repetition, no warm-up, "
                        "no waiting for a quiet machine and fewer attach/row samples; checks that "
                        "everything runs, counts exactly and cleans up (its figures mean little)")
    p.add_argument("--perf", action="store_true",
                   help="bridge: also sample both bridges with `perf record` over each forwarded "
                        "row's windows and note where their CPU went (Python, kernel, C, libc)")
    return p


def timing_for(args: argparse.Namespace) -> Timing:
    if args.smoke:
        return Timing(window=0.1, warmup=0, reps=args.reps or 1, quiet_wait=0.0, quiet_budget=0.0)
    if args.quick:
        return Timing(warmup=1, reps=args.reps or 2, quiet_wait=0.5, quiet_budget=5.0)
    return Timing(reps=args.reps or 5)


def run_sections(ctx: RunContext, names: Sequence[str]) -> tuple[list[Section], Section]:
    """Run the named sections between limit measurements; return them and the limits section."""
    lim = limits.limits_section()
    need_limits = any(SECTIONS[n][2] for n in names)
    if need_limits:
        limits.measure_limits(ctx, lim, "start")
    done: list[Section] = []
    for name in names:
        factory, runner, _ = SECTIONS[name]
        sec = factory()
        done.append(sec)
        try:
            runner(ctx, sec)
        except Exception as exc:  # noqa: BLE001 - one broken section must not lose the others
            traceback.print_exc()
            sec.messages.append(f"error: {type(exc).__name__}: {exc}")
    if need_limits and not ctx.quick:
        limits.measure_limits(ctx, lim, "end")  # the better of start and end is kept
    for sec in [lim, *done]:
        sec.limits = ctx.limits
    return done, lim


def report(info: dict[str, Any], ctx: RunContext, lim: Section, sections: list[Section],
           elapsed: float) -> str:
    parts = [render_machine(info),
             f"Method: docs/benchmarks.md. {ctx.timing.warmup} warm-up + {ctx.timing.reps} measured "
             f"repetitions of >= {ctx.timing.window} s; waited {ctx.quiet.waited:.1f} s for other "
             f"load; run took {elapsed:.0f} s.\n"]
    if lim.rows:
        parts += [render_limits(ctx.limits, ctx.limit_history), render_section(lim)]
    parts += [render_section(s) for s in sections]
    return "\n".join(parts)


def write_json(path: Path, info: dict[str, Any], ctx: RunContext, lim: Section,
               sections: list[Section], elapsed: float) -> None:
    doc = {"machine": info, "elapsed_s": elapsed, "quick": ctx.quick,
           "timing": dataclasses.asdict(ctx.timing),
           "limits": ctx.limits, "limit_history": ctx.limit_history,
           "sections": {"limits": section_json(lim), **{s.name: section_json(s) for s in sections}}}
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


class _Terminated(BaseException):
    """SIGTERM: unwinds through every finally, so workers and segments go."""


def _terminate(signum: int, frame: Optional[object]) -> None:
    raise _Terminated()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    names = list(SECTIONS) if args.what == "all" else [args.what]
    shmps_mod, shmps_error = import_shmps()
    status = (f"{getattr(shmps_mod, '__version__', '?')} from {Path(str(shmps_mod.__file__)).parent}"
              if shmps_mod else f"not importable ({shmps_error})")
    info = machine_info(REPO, status)
    progress(render_machine(info))
    t0 = time.perf_counter()
    try:
        with ExitStack() as stack:
            ctx = RunContext(timing=timing_for(args), quick=args.quick or args.smoke,
                             smoke=args.smoke, stack=stack,
                             workdir=args.dir, shmps=shmps_mod, shmps_error=shmps_error,
                             perf=args.perf)
            sections, lim = run_sections(ctx, names)
            elapsed = time.perf_counter() - t0
            text = report(info, ctx, lim, sections, elapsed)
            if args.json:
                write_json(args.json, info, ctx, lim, sections, elapsed)
    except (KeyboardInterrupt, _Terminated) as exc:
        print("bench.py: interrupted; workers stopped and segments removed", file=sys.stderr)
        return 130 if isinstance(exc, KeyboardInterrupt) else 128 + signal.SIGTERM
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
