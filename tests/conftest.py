"""Shared fixtures: unique store names, and /dev/shm left as found."""
from __future__ import annotations

import os
import uuid

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


@pytest.fixture(scope="session", autouse=True)
def dev_shm_left_as_found():
    """Fails the session if any test leaves a shmps segment behind."""
    before = _shmps_segments()
    yield
    leaked = _abandoned(_shmps_segments() - before)
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
