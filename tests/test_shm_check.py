"""The test session's /dev/shm check (conftest.dev_shm_left_as_found), run in a child
pytest session over one test that leaks a store's segments: alone, the session fails
and deletes them; beside another live session (this one), it warns and deletes nothing,
since a segment does not say which session made it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import shmps

from conftest import REPO, SHM

pytestmark = [pytest.mark.timeout(240)]

LEAKY = '''
import shmps


def test_leaks():
    s = shmps.attach("{name}")
    s.dense("w", (4,))
    s.close()   # the segments stay (a store outlives its handles): a leak
'''


def child_session(tmp_path, name: str, env: dict) -> subprocess.CompletedProcess:
    d = tmp_path / "child"
    d.mkdir()
    shutil.copy(os.path.join(REPO, "tests", "conftest.py"), d / "conftest.py")
    (d / "test_leaky.py").write_text(LEAKY.format(name=name))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(d)], cwd=d, env=env, capture_output=True, text=True,
                          timeout=180)


def segments_of(name: str) -> list[str]:
    return [n for n in os.listdir(SHM) if n.startswith("shmps.") and name in n]


def test_a_session_alone_fails_on_a_leak_and_cleans_it_up(tmp_path, store_name):
    alone = tmp_path / "tmp"     # its own TMPDIR: no other session registered there
    alone.mkdir()
    try:
        env = {k: v for k, v in os.environ.items() if k != "SHMPS_TESTS_BESIDE"}
        r = child_session(tmp_path, store_name, {**env, "TMPDIR": str(alone)})
        out = r.stdout + r.stderr
        assert r.returncode != 0 and "tests leaked shared-memory segments" in out, out
        assert segments_of(store_name) == []
    finally:
        if segments_of(store_name):
            shmps.attach(store_name, create=False).destroy()


def test_a_session_told_other_programs_run_beside_it_deletes_nothing(tmp_path, store_name):
    """SHMPS_TESTS_BESIDE=1 (scripts, not test sessions, use /dev/shm meanwhile): a
    session alone reports new segments nobody holds and deletes none."""
    alone = tmp_path / "tmp"
    alone.mkdir()
    try:
        r = child_session(tmp_path, store_name, {**os.environ, "TMPDIR": str(alone),
                                                 "SHMPS_TESTS_BESIDE": "1"})
        out = r.stdout + r.stderr
        assert r.returncode == 0 and "left alone" in out, out
        assert segments_of(store_name), "the check deleted them"
    finally:
        if segments_of(store_name):
            shmps.attach(store_name, create=False).destroy()


def test_a_session_beside_another_warns_and_deletes_nothing(tmp_path, store_name):
    try:
        # the same TMPDIR as this session, which is registered there while it runs
        r = child_session(tmp_path, store_name, dict(os.environ))
        out = r.stdout + r.stderr
        assert r.returncode == 0 and "left alone" in out, out
        assert segments_of(store_name), "the other session's check deleted them"
    finally:
        if segments_of(store_name):
            shmps.attach(store_name, create=False).destroy()
