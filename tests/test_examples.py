"""The examples run with no arguments, finish in time, and reach their printed bars
("OK: ..."); one without its optional package says so and exits 0.

Each runs in a subprocess (its own session, killed with its workers on timeout)
under a namespace of its own, whose segments are removed afterwards whatever
happened."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import shmps

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TIMEOUT = 120.0  # each example takes < 60 s on 2 idle cores; headroom for a busy machine


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def run_example(script: str, *args: str, env_extra: dict | None = None) -> str:
    """Run examples/<script>; returns stdout; fails on a non-zero exit or timeout.
    The example's segments (namespace unique to this run) are removed afterwards."""
    ns = f"ex{uuid.uuid4().hex[:10]}"
    env = dict(os.environ, SHMPS_NAMESPACE=ns, OMP_NUM_THREADS="1", **(env_extra or {}))
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / script), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the example and its worker processes
        proc.communicate()
        pytest.fail(f"{script} did not finish in {TIMEOUT:.0f} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for seg in os.listdir("/dev/shm"):
            if seg.startswith(f"shmps.{ns}"):   # multihost_logreg.py uses <ns>h0, <ns>h1...
                os.unlink(os.path.join("/dev/shm", seg))
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{out}\n{err[-3000:]}"
    return out


def ok_line(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith(("OK", "FAIL"))]
    assert lines and lines[-1].startswith("OK"), out
    return lines[-1]


@pytest.mark.slow
@pytest.mark.skipif(not has("sklearn"), reason="needs scikit-learn")
def test_hogwild_logreg():
    """examples/hogwild_logreg.py: 4 processes reach scikit-learn's accuracy - 1 point."""
    out = run_example("hogwild_logreg.py")
    ok_line(out)
    assert "held-out accuracy" in out


@pytest.mark.slow
@pytest.mark.skipif(not has("sklearn"), reason="needs scikit-learn")
def test_sync_sgd():
    """examples/sync_sgd.py: aggregate="mean" over 4 processes equals full-batch
    gradient descent to 1e-9."""
    out = run_example("sync_sgd.py")
    ok_line(out)
    diff = float(out.split("largest difference between the two weight matrices:")[1].split()[0])
    assert diff <= 1e-9


@pytest.mark.slow
@pytest.mark.skipif(not (has("sklearn") and has("torch")), reason="needs scikit-learn and torch")
def test_torch_mlp():
    """examples/torch_mlp.py: 4 processes through shmps.torch with staleness 2 reach
    single-process torch.optim.Adam's accuracy - 2 points."""
    out = run_example("torch_mlp.py")
    ok_line(out)
    assert "staleness 2" in out


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(shmps.Store, "table"), reason="tables are not in this build")
def test_sparse_ftrl():
    """examples/sparse_ftrl.py: FTRL on a hashed click log (2**20 features) from 4
    processes gets within 0.03 AUC of the true weights, correlation >= 0.9, and
    prints a line per epoch."""
    out = run_example("sparse_ftrl.py")
    ok_line(out)
    assert sum(ln.startswith("epoch ") for ln in out.splitlines()) == 3


@pytest.mark.slow
@pytest.mark.skipif(not has("aiohttp") or not has("prometheus_client"),
                    reason="needs the bridge extras: pip install '.[bridge]'")
def test_multihost_logreg():
    """examples/multihost_logreg.py: three bridges on loopback, one worker per host; the
    hosts' copies end equal and the model learns."""
    out = run_example("multihost_logreg.py")
    ok_line(out)
    assert "largest difference between hosts' copies 0;" in out


def test_missing_optional_package_exits_0(tmp_path):
    """An example whose optional package cannot be imported prints what to install
    and exits 0 (torch shadowed by a module that raises ImportError)."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no torch here')\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    out = run_example("torch_mlp.py", env_extra={"PYTHONPATH": path})
    assert "this example needs torch: pip install torch" in out
