"""Shared fixtures: unique store names, and /dev/shm left as found."""
from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
import warnings

import pytest

SHM = "/dev/shm"


def _shmps_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM) if n.startswith("shmps.")}
    except FileNotFoundError:
        return set()


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session", autouse=True)
def run_outside_the_source_tree(tmp_path_factory):
    """Run the session (and every subprocess it starts) from a scratch directory.

    From the repository root, ``python -m shmps...`` and ``python -c`` would import the
    source tree's ``shmps/`` (which holds no compiled module in a plain install)
    instead of the installed package.  Tests name repository files through REPO."""
    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(old)


def _abandoned(names: set[str]) -> set[str]:
    """Those of ``names`` that belong to no store with a live attached process
    (another test session running at the same time keeps its stores attached)."""
    from shmps import inspect as shm_inspect

    stores, orphans = shm_inspect.scan(with_fill=False)
    live = {seg for st in stores if st.pids for seg in st.segments}
    return {n for n in names if "/" + n not in live}


SESSIONS = os.path.join(tempfile.gettempdir(), "shmps-test-sessions")


def _other_sessions() -> list[int]:
    """The pids of other live test sessions on this machine (each one registers itself
    in SESSIONS while it runs)."""
    out = []
    for name in os.listdir(SESSIONS):
        pid = int(name) if name.isdigit() else 0
        if pid and pid != os.getpid():
            try:
                os.kill(pid, 0)
                out.append(pid)
            except ProcessLookupError:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(SESSIONS, name))
            except PermissionError:
                out.append(pid)
    return out


@pytest.fixture(scope="session", autouse=True)
def dev_shm_left_as_found():
    """Fails the session if any test leaves a shmps segment behind.

    A segment does not say which session made it: while another test session runs on
    the machine (a developer's, a helper's), a new segment that no live process holds
    may be that session's, between two of its attaches.  Then this one reports what it
    found and deletes nothing (deleting another session's segments made its tests fail);
    alone (CI), it fails the session and cleans up.  SHMPS_TESTS_BESIDE=1 says other
    shmps programs (not test sessions: scripts, a training run) use /dev/shm meanwhile,
    and makes it report and delete nothing as well."""
    os.makedirs(SESSIONS, exist_ok=True)
    mine = os.path.join(SESSIONS, str(os.getpid()))
    open(mine, "w").close()
    before = _shmps_segments()
    try:
        yield
    finally:
        os.unlink(mine)
    leaked = _abandoned(_shmps_segments() - before)
    others = _other_sessions()
    if os.environ.get("SHMPS_TESTS_BESIDE"):   # other shmps programs run on this machine
        others.append(-1)
    if others and leaked:
        warnings.warn(f"new shared-memory segments no live process holds, left alone "
                      f"because test sessions {others} run beside this one: {sorted(leaked)}")
        return
    for name in leaked:  # clean up so one failure does not poison later runs
        try:
            os.unlink(os.path.join(SHM, name))
        except FileNotFoundError:
            pass
    assert not leaked, f"tests leaked shared-memory segments: {sorted(leaked)}"


@pytest.fixture
def store_name() -> str:
    """A store name no other test (or concurrent run) uses."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def store(store_name):
    """An attached fresh store, destroyed after the test."""
    import shmps

    s = shmps.attach(store_name)
    yield s
    s.destroy()
