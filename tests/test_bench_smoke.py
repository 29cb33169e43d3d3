"""tools/bench.py end to end: `dense --smoke --json` (--quick's steps, each workload timed
once and briefly) runs, measures, and checks exactness."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench.py"


def _segments(prefix: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def _shmps_usable() -> bool:
    if importlib.util.find_spec("shmps") is None:
        return False
    import shmps

    return hasattr(shmps, "attach")


@pytest.mark.slow
def test_dense_quick_json(tmp_path: Path) -> None:
    """dense --smoke reports positive figures, exact shmps pushes lose nothing, nothing leaks.

    --smoke runs --quick's steps on the same 64 MiB parameter (its 4 shards pushed by
    1 and 2 processes at once), only timed once for 0.1 s and without waiting for a quiet
    machine (--quick took 43 s of the suite for the same checks)."""
    out = tmp_path / "dense.json"
    proc = subprocess.Popen([sys.executable, str(BENCH), "dense", "--smoke", "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=280)  # under the suite's 300 s timeout
    except subprocess.TimeoutExpired:
        proc.terminate()  # bench.py unwinds on SIGTERM: workers stopped, segments removed
        proc.communicate(timeout=60)
        pytest.fail("bench.py dense --smoke took more than 280 s")
    assert proc.returncode == 0, stderr[-3000:]
    assert "## DENSE" in stdout
    doc = json.loads(out.read_text())
    assert all(doc["limits"][f"{k}_{p}p"] > 0 for k in ("copy", "triad") for p in (1, 2))
    rows = {(r["key"], r["procs"]): r for r in doc["sections"]["dense"]["rows"]}
    for procs in (1, 2):
        for key in ("np_push", "np_copyto"):
            assert rows[(key, procs)]["error"] is None
            assert rows[(key, procs)]["median"] > 0
    assert rows[("np_push", 1)]["data"]["lost"] == 0, "one process cannot lose its own updates"
    # bench.py names baseline segments bench_<pid>_<n> and stores bench<pid>...
    assert not _segments(f"bench_{proc.pid}_"), "the baselines' segments must be unlinked"
    if not _shmps_usable():
        assert any("shmps: not importable" in m for m in doc["sections"]["dense"]["messages"])
        return
    for procs in (1, 2):
        push = rows[("shmps_push_exact", procs)]
        assert push["error"] is None, push["error"]
        assert push["median"] > 0
        assert push["data"]["lost"] == 0, f"exact pushes lost updates, {procs}p: {push['notes']}"
        assert push["data"]["wrong_elements"] == 0, f"{procs}p: {push['notes']}"
        assert push["data"]["pushes"] > 0
        assert rows[("shmps_pull", procs)]["median"] > 0
    assert rows[("shmps_attach", 1)]["median"] > 0
    assert not _segments(f"shmps.bench{proc.pid}"), "the stores must be destroyed"


def test_perf_split_of_a_python_loop(tmp_path: Path) -> None:
    """bench.py --perf's recorder: a process spinning in the interpreter shows mostly
    "Python interpreter"; the split sums to about 100 %.  Skipped where perf cannot
    record (not installed, or perf_event_paranoid forbids it)."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        from benchlib.perfsplit import PerfRecorder
    finally:
        sys.path.remove(str(BENCH.parent))
    spin = subprocess.Popen([sys.executable, "-c",
                             "import time\nt = time.time()\n"
                             "while time.time() - t < 20: sum(i * i for i in range(1000))"])
    try:
        rec = PerfRecorder({"spin": spin.pid}, tmp_path / "perf")
        if rec.error:
            pytest.skip(rec.error)
        rec.start()
        time.sleep(1.5)
        split = rec.stop()
        if not split:
            pytest.skip(f"perf could not record here: {rec.error}")
    finally:
        spin.kill()
        spin.wait(10)
    s = split["spin"]
    # (at 1 kHz for 1.5 s; a spinner with its share of a loaded machine gave 72)
    assert s.samples > 30, s
    assert 95 <= sum(s.percent.values()) <= 100.5, s.percent
    assert s.percent.get("Python interpreter", 0) > 50, s.describe()
