"""Logistic regression trained on three "hosts" at once, through shmps-bridge.

Each host is a bridge on its own loopback address (127.0.0.2, .3, .4) with its own
shared-memory namespace, as three machines would be; each host runs one worker that
trains on its third of the data with the unchanged single-host API (attach, pull,
push, and flush at the end). The bridges forward every push to the owner of its shard
and keep every host's copy current; at the end all three copies are equal.

    python examples/multihost_logreg.py        # prints "OK: ..." on success

On real machines: the same worker code, one `shmps-bridge --peers hosts.txt --store
NAME --secret-file F` per host (docs/bridge.md).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

import shmps

HOSTS = 3
FEATURES, ROWS, STEPS, BATCH, LR = 64, 6000, 300, 64, 0.5
STORE = "logreg"


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    w_true = rng.normal(size=FEATURES).astype(np.float32)
    y = (x @ w_true + 0.3 * rng.normal(size=ROWS) > 0).astype(np.float32)
    return x, y


def worker(host: int, namespace: str) -> None:
    """One host's training process: plain shmps, no networking."""
    x, y = data()
    x, y = x[host::HOSTS], y[host::HOSTS]
    store = shmps.attach(STORE, namespace=namespace)
    w = store.dense("w", shape=(FEATURES, 1), optimizer=shmps.SGD(lr=LR), shard_rows=16)
    rng = np.random.default_rng(host)
    for step in range(STEPS):
        idx = rng.integers(0, len(x), BATCH)
        p = 1 / (1 + np.exp(-(x[idx] @ w.pull()[:, 0])))
        w.push((x[idx].T @ (p - y[idx]) / BATCH / HOSTS)[:, None].astype(np.float32))
        if step % 10 == 9:
            # pushes reach the owners every few ms; without this, a fast worker would
            # take hundreds of steps on weights that do not include its own pushes yet
            store.flush(timeout=60)
    store.flush(timeout=60)          # every push applied by its owner and backed up
    store.close()


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def health(addr: str) -> dict:
    try:
        with urllib.request.urlopen(f"http://{addr}/health", timeout=1) as r:
            return json.loads(r.read())
    except OSError:
        return {}


def bridge_logs(logs: list[Path]) -> str:
    """The last lines each bridge wrote to stderr (to show why one failed)."""
    out = []
    for i, log in enumerate(logs):
        lines = log.read_text(errors="replace").splitlines()[-20:]
        out += [f"--- bridge {i} ({log}):"] + (lines or ["(no output)"])
    return "\n".join(out)


def main() -> int:
    base = os.environ.get("SHMPS_NAMESPACE") or f"mh{os.getpid()}"
    namespaces = [f"{base}h{i}" for i in range(HOSTS)]
    addrs = [f"127.0.0.{i + 2}:{free_port(f'127.0.0.{i + 2}')}" for i in range(HOSTS)]
    tmp = Path(tempfile.mkdtemp(prefix="shmps-multihost-"))
    (tmp / "hosts.txt").write_text("".join(a + "\n" for a in addrs))
    (tmp / "secret").write_text(secrets.token_hex(32))
    os.chmod(tmp / "secret", 0o600)
    logs = [tmp / f"bridge{i}.log" for i in range(HOSTS)]
    # The bridges run in tmp: `python -m` puts the current directory first on sys.path,
    # and run from a checkout's root that would import the source tree's shmps/ (no
    # compiled module in a plain install) instead of the installed package.
    bridges = []
    for a, ns, log in zip(addrs, namespaces, logs):
        with open(log, "wb") as err:
            bridges.append(subprocess.Popen(
                [sys.executable, "-m", "shmps.bridge.cli", "--peers", str(tmp / "hosts.txt"),
                 "--store", STORE, "--listen", a, "--namespace", ns, "--secret-file",
                 str(tmp / "secret"), "--log-level", "WARNING"],
                cwd=tmp, stderr=err, start_new_session=True))
    failed = True
    try:
        deadline = time.monotonic() + 30
        while not all(health(a).get("acting") for a in addrs):
            ended = [(i, b.returncode) for i, b in enumerate(bridges) if b.poll() is not None]
            if ended:
                print("FAILED: " + "; ".join(f"bridge {i} exited (status {rc})"
                                             for i, rc in ended)
                      + "\n" + bridge_logs(logs), file=sys.stderr)
                return 1
            if time.monotonic() > deadline:
                print("FAILED: the bridges did not start in 30 s\n" + bridge_logs(logs),
                      file=sys.stderr)
                return 1
            time.sleep(0.1)
        print(f"{HOSTS} bridges up: {', '.join(addrs)}")
        t0 = time.monotonic()
        workers = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), ns])
                   for i, ns in enumerate(namespaces)]
        if any(p.wait(120) for p in workers):
            print("FAILED: a worker failed\n" + bridge_logs(logs), file=sys.stderr)
            return 1
        print(f"{HOSTS} workers x {STEPS} steps in {time.monotonic() - t0:.1f} s")
        # every host's copy converges to the same weights (remote shards within ms)
        stores = [shmps.attach(STORE, namespace=ns) for ns in namespaces]
        deadline = time.monotonic() + 10
        while True:
            ws = [s["w"].pull() for s in stores]
            spread = max(float(np.abs(w - ws[0]).max()) for w in ws)
            if spread == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        x, y = data()
        acc = float((((x @ ws[0][:, 0]) > 0) == (y > 0.5)).mean())
        owned = {a: len(health(a).get("owned", [])) for a in addrs}
        print(f"shards owned per host: {owned}; largest difference between hosts' copies "
              f"{spread:g}; accuracy {acc:.3f}")
        for s in stores:
            s.close()
        if spread != 0 or acc < 0.85:
            print("FAILED: copies differ or the model did not learn", file=sys.stderr)
            return 1
        print(f"OK: {HOSTS} hosts trained one model through shmps-bridge, accuracy {acc:.3f}")
        failed = False
        return 0
    finally:
        for b in bridges:
            b.send_signal(signal.SIGKILL)
            b.wait(10)
        if failed:
            print(f"(bridge logs kept in {tmp})", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        for ns in namespaces:
            try:
                shmps.attach(STORE, namespace=ns, create=False).destroy()
            except shmps.Error:
                pass


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":   # (how main() starts a worker)
        worker(int(sys.argv[2]), sys.argv[3])
        sys.exit(0)
    # no options, but --help says so and a mistyped one is refused, not ignored
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    sys.exit(main())
