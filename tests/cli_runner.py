"""``python -m MODULE ARGS`` for the command-line tests, without paying Python's and
shmps's start-up on every run.

:func:`run` gives what ``subprocess.run([sys.executable, "-m", module, *args],
capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)`` gives, and runs the
command in a process of its own as that does: a child forked, for each run, from one
server process of the session that has imported ``shmps`` and its CLI modules and
what they import (no store attached, no thread).  The child takes the run's environment,
working directory, stdin (/dev/null), stdout and stderr (files, real file descriptors:
what C code writes is captured too), executes MODULE as ``__main__`` (runpy, as
``-m`` does) and exits through the interpreter's own shutdown (atexit handlers, stdio
flushed; an exception escaping is printed and exits 1).  Only the imports are done
before the run: environment variables a module reads when it is imported are those of
the session (the CLI modules read theirs when they run; shmps.bridge.node reads
SHMPS_BRIDGE_LOCK_WAIT on import: run a bridge that needs it as a real subprocess).  A fresh interpreter took
0.25-0.6 s a run; the fork about 50 ms.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional, Sequence

SERVER = r"""
import gc, json, os, runpy, sys
# what every run would import again (not the CLI modules themselves: runpy executes
# those as __main__, and warns if they were imported before)
import shmps, shmps.cli_args, shmps.cli_bridge, shmps.cli_files, shmps.cli_store
import shmps.bridge.members, shmps.bridge.node   # (shmps-bridge's main imports node)


def child(req):
    fds = [os.open(os.devnull, os.O_RDONLY), os.open(req["out"], os.O_WRONLY | os.O_TRUNC),
           os.open(req["err"], os.O_WRONLY | os.O_TRUNC)]
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
    sys.argv = [req["module"], *req["args"]]
    runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


def serve():
    gc.freeze()   # (the children's collections then skip, and do not copy, these pages)
    while True:
        line = sys.stdin.buffer.readline()
        if not line:
            return
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(req)   # never returns: SystemExit ends the interpreter
        os.write(1, b"%d\n" % pid)
        status = os.waitpid(pid, 0)[1]
        os.write(1, b"%d\n" % os.waitstatus_to_exitcode(status))


serve()
"""


class _Server:
    def __init__(self) -> None:
        from helpers import child_env

        self.dir = tempfile.mkdtemp(prefix="shmps-cli-runner-")
        self.log = os.path.join(self.dir, "server.log")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=child_env(),
                                         cwd=self.dir)
        self.buf = b""
        self.runs = 0

    def _line(self, deadline: Optional[float]) -> Optional[bytes]:
        """The server's next line; None if ``deadline`` passes first."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                with open(self.log, errors="replace") as f:
                    raise RuntimeError(f"the CLI runner's server ended: {f.read()[-3000:]}")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line

    def run(self, module: str, args: list, env: dict, cwd: str,
            timeout: Optional[float]) -> subprocess.CompletedProcess:
        self.runs += 1
        out = os.path.join(self.dir, f"{self.runs}.out")
        err = os.path.join(self.dir, f"{self.runs}.err")
        for path in (out, err):
            open(path, "wb").close()
        req = {"module": module, "args": args, "env": env, "cwd": cwd, "out": out, "err": err}
        self.proc.stdin.write(json.dumps(req).encode() + b"\n")
        self.proc.stdin.flush()
        pid = int(self._line(None))
        deadline = None if timeout is None else time.monotonic() + timeout
        line = self._line(deadline)
        timed_out = line is None
        if timed_out:
            os.kill(pid, signal.SIGKILL)
            line = self._line(None)
        code = int(line)
        texts = []
        for path in (out, err):
            with open(path, "rb") as f:
                data = f.read()
            os.unlink(path)
            # as subprocess.run(text=True): the locale's encoding, universal newlines
            texts.append(data.decode(_encoding()).replace("\r\n", "\n").replace("\r", "\n"))
        cmd = [sys.executable, "-m", module, *args]
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout, texts[0], texts[1])
        return subprocess.CompletedProcess(cmd, code, texts[0], texts[1])

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


def run(module: str, args: Sequence[object], *, env: Optional[dict] = None,
        cwd: Optional[os.PathLike | str] = None,
        timeout: Optional[float] = 120.0) -> subprocess.CompletedProcess:
    """``python -m module args`` (``str()`` of each) in a process of its own, with
    ``env`` (default: this process's) and ``cwd`` (default: this process's); its stdout
    and stderr as text, its exit status (negative: the signal that ended it)."""
    global _server
    with _lock:
        if _server is None or _server.proc.poll() is not None:
            _server = _Server()
            atexit.register(_server.close)
        return _server.run(module, [str(a) for a in args],
                           dict(os.environ if env is None else env),
                           os.fspath(cwd) if cwd is not None else os.getcwd(), timeout)
