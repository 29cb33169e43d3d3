"""Several shmps-bridge processes on one machine, for the multi-host tests and benchmarks.

Each "host" is a bridge subprocess listening on its own loopback address (127.0.0.2,
127.0.0.3, ...) with its own shared-memory namespace, so hosts share nothing but the
network.  Workers are subprocesses too (tests/bridge_worker.py).  Everything started is
killed and every segment removed by :meth:`Cluster.close`.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Optional

import shmps

import cli_runner

HERE = Path(__file__).resolve().parent
WORKER = HERE / "bridge_worker.py"


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Cluster:
    """``n`` hosts of store ``store``; host i listens on 127.0.0.(i+2)."""

    def __init__(self, workdir: Path, n: int, *, store: str = "model", replicas: int = 2,
                 secret: bool = True, flush_ms: float = 5.0, dead_after: float = 0.5,
                 spare: int = 0, ip_base: Optional[list] = None,
                 wrap: Optional[Callable[[int, list], list]] = None,
                 forked: bool = False, log_level: Optional[str] = None) -> None:
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.store = store
        self.replicas = replicas
        self.flush_ms = flush_ms
        self.dead_after = dead_after
        self.wrap = wrap
        self.forked = forked   # start (unwrapped) bridges with cli_runner: see start()
        self.log_level = log_level   # --log-level (None: the default, INFO)
        total = n + spare
        ips = ip_base or [f"127.0.0.{i + 2}" for i in range(total)]
        self.addrs = [f"{ip}:{free_port(ip) if ip.startswith('127.') else 17000 + i}"
                      for i, ip in enumerate(ips)]
        tag = f"b{os.getpid()}x{secrets.token_hex(2)}"
        self.namespaces = [f"{tag}h{i}" for i in range(total)]
        self.hosts_file = self.dir / "hosts.txt"
        self.members = list(self.addrs[:n])
        self.write_hosts()
        self.secret_file: Optional[Path] = None
        if secret:
            self.secret_file = self.dir / "secret"
            self.secret_file.write_bytes(secrets.token_hex(32).encode())
            os.chmod(self.secret_file, 0o600)
        self.procs: dict[int, subprocess.Popen] = {}
        self.workers: list[subprocess.Popen] = []
        self.logs: dict[int, Path] = {}

    # ------------------------------------------------------------ membership
    def write_hosts(self) -> None:
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text("# shmps test cluster\n" + "".join(m + "\n" for m in self.members))
        os.replace(tmp, self.hosts_file)

    # ------------------------------------------------------------ bridges
    def bridge_cmd(self, i: int) -> list:
        cmd = [sys.executable, "-m", "shmps.bridge.cli", "--peers", str(self.hosts_file),
               "--store", self.store, "--listen", self.addrs[i], "--namespace",
               self.namespaces[i], "--replicas", str(self.replicas), "--flush-ms",
               str(self.flush_ms), "--dead-after", str(self.dead_after)]
        if self.secret_file is not None:
            cmd += ["--secret-file", str(self.secret_file)]
        if self.log_level is not None:
            cmd += ["--log-level", self.log_level]
        return cmd

    def start(self, i: int) -> subprocess.Popen:
        """Start host i's bridge, in a session of its own, its output appended to its
        log.  With ``forked`` (and no ``wrap``) it is forked with its imports done
        (cli_runner: a fresh interpreter spent 0.6-1 s importing the bridge, at every
        start and restart of every test), else a fresh interpreter."""
        log = self.dir / f"bridge{i}.log"
        self.logs[i] = log
        cmd = self.bridge_cmd(i)
        if self.wrap is not None or not self.forked:
            p = subprocess.Popen(self.wrap(i, cmd) if self.wrap else cmd,
                                 stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                 start_new_session=True)
        else:
            assert cmd[1:3] == ["-m", "shmps.bridge.cli"], cmd
            open(log, "ab").close()   # (there at once, as Popen's stdout file was)
            p = cli_runner.start("shmps.bridge.cli", cmd[3:], stdout=log, append=True,
                                 start_new_session=True)
        self.procs[i] = p
        return p

    def start_all(self, timeout: float = 20.0) -> None:
        for i, a in enumerate(self.addrs):
            if a in self.members:
                self.start(i)
        self.wait_converged(timeout)

    def url(self, i: int, path: str) -> str:
        host, port = self.addrs[i].rsplit(":", 1)
        return f"http://{host}:{port}{path}"

    def health(self, i: int, timeout: float = 2.0) -> Optional[dict]:
        try:
            with urllib.request.urlopen(self.url(i, "/health"), timeout=timeout) as r:
                return json.loads(r.read())
        except OSError:
            return None

    def metrics(self, i: int) -> str:
        with urllib.request.urlopen(self.url(i, "/metrics"), timeout=2.0) as r:
            return r.read().decode()

    def running(self) -> list[int]:
        return [i for i, p in self.procs.items() if p.poll() is None]

    def wait(self, pred: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}\n"
                             + self.describe())

    def wait_converged(self, timeout: float = 20.0, hosts: Optional[list] = None) -> None:
        """Every running host acting, on the same ring and epoch, all members alive."""
        def ok() -> bool:
            hs = [self.health(i) for i in (hosts if hosts is not None else self.running())]
            if any(h is None for h in hs):
                return False
            digests = {h["ring_digest"] for h in hs}
            epochs = {h["epoch"] for h in hs}
            return (len(digests) == 1 and len(epochs) == 1
                    and all(h["acting"] and h["state"] == "alive" for h in hs)
                    and all(len([m for m in h["members"] if m["state"] == "alive"])
                            == len(hs) for h in hs))
        self.wait(ok, timeout, "the bridges to converge")

    def describe(self) -> str:
        out = []
        for i in sorted(self.procs):
            h = self.health(i, 0.5)
            out.append(f"host {i} {self.addrs[i]} rc={self.procs[i].poll()}: "
                       + (json.dumps({k: h[k] for k in ("epoch", "state", "acting", "members",
                                                        "pending", "owner_waits") if k in h}) if h else "-"))
            if i in self.logs and self.logs[i].exists():
                out.append("  log tail: " + "  ".join(
                    self.logs[i].read_text(errors="replace").splitlines(True)[-15:]))
        return "\n".join(out)

    def wait_exit(self, i: int, timeout: float) -> int:
        """Host i's exit status; on timeout an AssertionError that shows every host."""
        try:
            return self.procs[i].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"host {i} still running after {timeout} s\n"
                                 + self.describe()) from None

    def signal(self, i: int, sig: int) -> None:
        self.procs[i].send_signal(sig)

    def kill(self, i: int) -> float:
        t = time.time()
        os.killpg(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].wait(10)
        return t

    # ------------------------------------------------------------ workers
    def worker(self, i: int, spec: dict) -> subprocess.Popen:
        spec = dict(spec, store=self.store, namespace=self.namespaces[i])
        p = subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.workers.append(p)
        return p

    def run_worker(self, i: int, spec: dict, timeout: float = 60.0) -> dict:
        p = self.worker(i, spec)
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise AssertionError(f"worker on host {i} failed ({p.returncode}):\n"
                                 f"{err.decode(errors='replace')}\n{self.describe()}")
        return json.loads(out.decode().strip().splitlines()[-1])

    def attach(self, i: int) -> Any:
        return shmps.attach(self.store, namespace=self.namespaces[i])

    # ------------------------------------------------------------ teardown
    def close(self) -> None:
        for p in self.workers:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        for i, p in self.procs.items():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGCONT)
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(10)
        for ns in self.namespaces:
            try:
                s = shmps.attach(self.store, namespace=ns, create=False)
            except shmps.Error:
                continue
            s.destroy()
