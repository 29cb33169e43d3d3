"""``python -m MODULE ARGS`` (or ``python SCRIPT ARGS``) for the tests, without paying
Python's and shmps's start-up on every run.

:func:`run` gives what ``subprocess.run([sys.executable, "-m", module, *args],
capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)`` gives, and
:func:`start` a :class:`Proc` that acts as the ``subprocess.Popen`` of such a command
(pid, poll, wait, send_signal, kill, communicate).  Each runs the command in a process of
its own: a child forked, per command, from one server process of the session that has
imported ``shmps``, its CLI and bridge modules and what they import (no store attached,
no thread, no event loop).  The child takes the command's environment, working
directory, stdin (/dev/null), stdout and stderr (files, real file descriptors: what C
code writes is captured too), optionally a session of its own (``start_new_session``),
executes MODULE as ``__main__`` (runpy, as ``-m`` does) or SCRIPT (as ``python SCRIPT``
does) and exits through the interpreter's own shutdown (atexit handlers, stdio flushed;
an exception escaping is printed and exits 1).  The server reaps it when it ends and
reports its status.  Only the imports are done before the command: environment
variables a module reads when it is imported are those of the session (the CLI modules
and the bridge read theirs when they run, but shmps.bridge.node reads
SHMPS_BRIDGE_LOCK_WAIT on import: run a bridge that needs it as a real subprocess).  A
fresh interpreter took 0.25-0.6 s to start shmps-tool, 0.6-1 s shmps-bridge; the fork
about 50 ms.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Optional, Sequence

SERVER = r"""
import gc, json, os, runpy, select, signal, sys
# what every command would import again (not the CLI modules themselves: runpy executes
# those as __main__, and warns if they were imported before)
import numpy, shmps, shmps.cli_args, shmps.cli_bridge, shmps.cli_files, shmps.cli_store
import shmps.bridge.members, shmps.bridge.node   # (shmps-bridge's main imports node)


def child(req, wake):
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in wake:
        os.close(fd)
    if req["session"]:
        os.setsid()
    mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if req["append"] else os.O_TRUNC)
    fds = [os.open(os.devnull, os.O_RDONLY), os.open(req["out"], mode, 0o644)]
    fds.append(os.open(req["err"], mode, 0o644) if req["err"] else os.dup(fds[1]))
    for target, fd in enumerate(fds):   # (the server's pipes on 0 and 1 go)
        os.dup2(fd, target)
        os.close(fd)
    enc = sys.stdout.encoding
    sys.stdin = sys.__stdin__ = open(0, "r", encoding=enc, closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", encoding=enc, errors=sys.stdout.errors,
                                       closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", encoding=enc, errors="backslashreplace",
                                       buffering=1, closefd=False)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    if req["module"]:
        sys.argv = [req["module"], *req["args"]]
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    else:
        sys.argv = [req["script"], *req["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(req["script"]))
        runpy.run_path(req["script"], run_name="__main__")
    sys.exit(0)


def serve():
    wake = os.pipe()
    for fd in wake:
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    signal.set_wakeup_fd(wake[1])
    gc.freeze()   # (the children's collections then skip, and do not copy, these pages)
    buf = b""
    while True:
        ready = select.select([0, wake[0]], [], [])[0]
        if wake[0] in ready:
            try:
                os.read(wake[0], 4096)
            except BlockingIOError:
                pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            os.write(1, b"X %d %d\n" % (pid, os.waitstatus_to_exitcode(status)))
        if 0 in ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    child(req, wake)   # never returns: SystemExit ends the interpreter
                os.write(1, b"S %d %d\n" % (req["id"], pid))


serve()
"""


class Proc:
    """A command the server started: what ``subprocess.Popen`` offers of it."""

    stdin = stdout = stderr = None

    def __init__(self, args: list, out: Optional[str], err: Optional[str],
                 text: bool) -> None:
        self.args = args
        self.pid = 0
        self.returncode: Optional[int] = None
        self._files = (out, err)   # captured output, read (and removed) by communicate
        self._text = text
        self._started = threading.Event()
        self._ended = threading.Event()

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:   # (as Popen: not to a pid the server reaped)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: None = None, timeout: Optional[float] = None) -> tuple:
        assert input is None
        self.wait(timeout)
        got = []
        for path in self._files:
            if path is None:
                got.append(None)
                continue
            with open(path, "rb") as f:
                data = f.read()
            os.unlink(path)
            # as subprocess's text mode: the locale's encoding, universal newlines
            got.append(data.decode(_encoding()).replace("\r\n", "\n").replace("\r", "\n")
                       if self._text else data)
        self._files = (None, None)
        return tuple(got)


class _Server:
    def __init__(self) -> None:
        from helpers import child_env

        self.dir = tempfile.mkdtemp(prefix="shmps-cli-runner-")
        self.log = os.path.join(self.dir, "server.log")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=child_env(),
                                         cwd=self.dir)
        self.lock = threading.Lock()
        self.n = 0
        self.starting: dict[int, Proc] = {}
        self.running: dict[int, Proc] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        """Take the server's reports: started (request, pid) and ended (pid, status)."""
        for line in self.proc.stdout:
            kind, a, b = line.split()
            with self.lock:
                if kind == b"S":
                    p = self.starting.pop(int(a))
                    p.pid = int(b)
                    self.running[p.pid] = p
                    p._started.set()
                else:
                    p = self.running.pop(int(a))
                    p.returncode = int(b)
                    p._ended.set()
        with self.lock:   # the server ended: nothing it started is reported any more
            for p in [*self.starting.values(), *self.running.values()]:
                p._started.set()
                if p.returncode is None:
                    p.returncode = -signal.SIGKILL
                    p._ended.set()

    def start(self, module: Optional[str], script: Optional[str], args: list, env: dict,
              cwd: str, out: Optional[str], err: Optional[str], append: bool,
              session: bool, text: bool) -> Proc:
        cmd = [sys.executable, *(["-m", module] if module else [script]), *args]
        capture = out is None
        with self.lock:
            self.n += 1
            n = self.n
        if capture:
            out = os.path.join(self.dir, f"{n}.out")
            err = os.path.join(self.dir, f"{n}.err")
        p = Proc(cmd, out if capture else None, err if capture else None, text)
        req = {"id": n, "module": module, "script": script, "args": args, "env": env,
               "cwd": cwd, "out": out, "err": err, "append": append, "session": session}
        with self.lock:
            self.starting[n] = p
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
        if not p._started.wait(60) or not p.pid:
            with open(self.log, errors="replace") as f:
                raise RuntimeError(f"the CLI runner's server did not start {cmd}: "
                                   f"{f.read()[-3000:]}")
        return p

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)


def _encoding() -> str:
    import locale

    return locale.getpreferredencoding(False)


_server: Optional[_Server] = None
_lock = threading.Lock()


def _the_server() -> _Server:
    global _server
    with _lock:
        if _server is None or _server.proc.poll() is not None:
            _server = _Server()
            atexit.register(_server.close)
        return _server


def start(module: Optional[str], args: Sequence[object], *, script: Optional[str] = None,
          env: Optional[dict] = None, cwd: Optional[os.PathLike | str] = None,
          stdout: Optional[os.PathLike | str] = None, append: bool = False,
          start_new_session: bool = False, text: bool = False) -> Proc:
    """``python -m module args`` (or ``python script args``; ``str()`` of each) in a
    process of its own, with ``env`` (default: this process's) and ``cwd`` (default:
    this process's).  Its stdout and stderr go to the file ``stdout`` (appended to with
    ``append``), else are captured for ``communicate()`` (text with ``text``)."""
    return _the_server().start(module, os.fspath(script) if script else None,
                               [str(a) for a in args], dict(os.environ if env is None else env),
                               os.fspath(cwd) if cwd is not None else os.getcwd(),
                               os.fspath(stdout) if stdout is not None else None, None,
                               append, start_new_session, text)


def run(module: str, args: Sequence[object], *, env: Optional[dict] = None,
        cwd: Optional[os.PathLike | str] = None,
        timeout: Optional[float] = 120.0) -> subprocess.CompletedProcess:
    """``python -m module args`` run to its end: its exit status (negative: the signal
    that ended it), stdout and stderr as text; TimeoutExpired (the process killed) if it
    takes longer than ``timeout``."""
    p = start(module, args, env=env, cwd=cwd, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        out, err = p.communicate()
        raise subprocess.TimeoutExpired(p.args, timeout, out, err) from None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)
