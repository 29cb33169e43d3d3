"""The examples run with no arguments, finish in time, and reach their printed bars
("OK: ..."); one without its optional package says so and exits 0.

Each runs in a subprocess (its own session, killed with its workers on timeout)
under a namespace of its own, whose segments are removed afterwards whatever
happened. They run from the repository root, as the README runs them
(``python examples/X.py``)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import shmps

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TIMEOUT = 120.0  # each example takes < 60 s on 2 idle cores; headroom for a busy machine


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def run_example(script: str, *args: str, env_extra: dict | None = None,
                root: Path = REPO, status: int = 0) -> str:
    """Run ``python examples/<script>`` from ``root`` (the repository root, as the README
    does); returns stdout (with stderr after it when ``status`` is not 0); fails on
    another exit status or a timeout. The example's segments (namespace unique to this
    run, unless env_extra sets one) are removed afterwards."""
    ns = f"ex{uuid.uuid4().hex[:10]}"
    env = {**os.environ, "SHMPS_NAMESPACE": ns, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    proc = subprocess.Popen([sys.executable, os.path.join("examples", script), *args],
                            env=env, cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
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
    assert proc.returncode == status, (
        f"{script} exited {proc.returncode}:\n{out}\n{err[-3000:]}")
    return out if status == 0 else out + err


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


@pytest.mark.slow
@pytest.mark.skipif(not has("aiohttp") or not has("prometheus_client"),
                    reason="needs the bridge extras: pip install '.[bridge]'")
def test_multihost_logreg_from_a_source_tree_without_the_compiled_module(tmp_path):
    """Run from the root of a plain (non-editable) install's checkout, whose ``shmps/``
    holds no compiled module (simulated: a ``shmps/`` that cannot be imported beside a
    copy of examples/), the example's bridges still use the installed package: `-m`
    would put the cwd, the source tree, first on their sys.path."""
    (tmp_path / "examples").mkdir()
    shutil.copy(EXAMPLES / "multihost_logreg.py", tmp_path / "examples")
    (tmp_path / "shmps").mkdir()
    (tmp_path / "shmps" / "__init__.py").write_text(
        "raise ImportError('the source tree, not the installed shmps')\n")
    out = run_example("multihost_logreg.py", root=tmp_path)
    ok_line(out)


@pytest.mark.skipif(not has("aiohttp") or not has("prometheus_client"),
                    reason="needs the bridge extras: pip install '.[bridge]'")
def test_multihost_logreg_reports_bridges_that_exit(tmp_path):
    """Bridges that cannot start (here: an invalid namespace) are reported at once with
    their error output and exit status 1, instead of after the 30 s start timeout."""
    t0 = time.monotonic()
    out = run_example("multihost_logreg.py", status=1,   # TMPDIR: its bridge logs, kept
                      env_extra={"SHMPS_NAMESPACE": "bad/ns", "TMPDIR": str(tmp_path)})
    assert time.monotonic() - t0 < 20, out
    assert "FAILED: bridge" in out and "invalid namespace 'bad/nsh" in out, out


def test_missing_optional_package_exits_0(tmp_path):
    """An example whose optional package cannot be imported prints what to install
    and exits 0 (torch shadowed by a module that raises ImportError)."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no torch here')\n")
    # (no empty entry: PYTHONPATH's "" is the working directory, the repository root
    # here, whose shmps/ holds no compiled module in a plain install)
    path = os.pathsep.join(p for p in [str(tmp_path), os.environ.get("PYTHONPATH", "")] if p)
    out = run_example("torch_mlp.py", env_extra={"PYTHONPATH": path})
    assert "this example needs torch: pip install torch" in out


@pytest.mark.parametrize("script,args,says", [
    ("hogwild_logreg.py", ["--workers", "0"], "--workers: 0 must be an integer >= 1"),
    ("hogwild_logreg.py", ["--batch", "0"], "--batch: 0 must be an integer >= 1"),
    ("sync_sgd.py", ["--workers", "0"], "--workers: 0 must be an integer >= 1"),
    ("sync_sgd.py", ["--steps", "0"], "--steps: 0 must be an integer >= 1"),
    ("sync_sgd.py", ["--lr", "nan"], "--lr: nan must be a finite number >= 0"),
    ("sparse_ftrl.py", ["--batch", "-1"], "--batch: -1 must be an integer >= 1"),
    ("torch_mlp.py", ["--staleness", "-1"], "--staleness: -1 must be an integer >= 0"),
    ("multihost_logreg.py", ["--hosts", "4"], "unrecognized arguments: --hosts 4"),
], ids=["hogwild-workers", "hogwild-batch", "sync-workers", "sync-steps", "sync-lr",
        "ftrl-batch", "torch-staleness", "multihost-unknown"])
@pytest.mark.timeout(60)
def test_an_example_refuses_a_meaningless_option(script, args, says):
    """An option that cannot work is refused by the option parser (exit status 2, the
    usage line and what is wrong) before anything starts.  Before, --workers 0 trained
    nothing and printed FAIL (hogwild) or divided by zero (sync_sgd), --steps 0 printed
    "OK: equal to full-batch gradient descent" with accuracy 0.10, --batch 0 raised
    range()'s ValueError in every worker, and multihost_logreg.py ignored every argument
    (--help included) and ran."""
    out = run_example(script, *args, status=2)
    assert says in out and "usage:" in out, out


@pytest.mark.timeout(60)
def test_multihost_logreg_help_lists_its_options_and_starts_nothing():
    """docs/examples.md: `--help` lists each example's options; multihost_logreg.py has
    none, and says so instead of starting three bridges."""
    out = run_example("multihost_logreg.py", "--help")
    assert out.startswith("usage: multihost_logreg.py [-h]") and "bridges up" not in out, out
