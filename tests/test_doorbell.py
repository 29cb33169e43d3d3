"""The flush doorbell (shmps/doorbell.py): real sockets in the abstract namespace."""
from __future__ import annotations

import os
import select
import uuid

import pytest

from shmps import doorbell


def _store() -> str:
    return f"bell{os.getpid()}x{uuid.uuid4().hex[:8]}"


@pytest.fixture
def rung():
    """A bridge's listening socket and a worker's bell of one fresh store."""
    store = _store()
    sock = doorbell.listen(store, None)
    assert sock is not None
    bell = doorbell.Bell(store, None)
    yield sock, bell
    bell.close()
    sock.close()


def test_addresses_are_per_store_and_namespace_and_fit():
    a = doorbell.address("model", None)
    assert a == b"\0shmps.model.flush"
    assert doorbell.address("model", "ns1") == b"\0shmps.ns1.model.flush"
    assert len({a, doorbell.address("model", "ns1"), doorbell.address("model", "ns2"),
                doorbell.address("model2", None)}) == 4
    # names of 64 characters each would not fit: a digest, still distinct
    long1 = doorbell.address("s" * 64, "n" * 64)
    long2 = doorbell.address("s" * 64, "n" * 63 + "m")
    assert long1 != long2
    assert long1[0] == 0 and len(long1) <= 1 + doorbell.MAX_ADDRESS
    assert long1.startswith(b"\0shmps.flush.")


def test_a_ring_reaches_the_listener_and_wakes_its_poll(rung):
    sock, bell = rung
    p = select.poll()
    p.register(sock.fileno(), select.POLLIN)
    assert p.poll(0) == []
    assert bell.ring() and bell.ring() and bell.ring(push=True)
    assert p.poll(1000)                      # readable: an event loop wakes
    assert doorbell.take(sock) == (2, 1)     # every waiting ring, in one go, by kind
    assert doorbell.take(sock) == (0, 0)
    assert p.poll(0) == []


def test_without_a_listener_ring_says_so():
    bell = doorbell.Bell(_store(), None)
    try:
        assert bell.ring() is False              # the caller bumps the futex word
    finally:
        bell.close()


def test_one_listener_per_store_and_the_address_is_free_once_it_closes():
    store = _store()
    first = doorbell.listen(store, None)
    assert first is not None
    assert doorbell.listen(store, None) is None      # taken: that bridge uses the futex
    other_ns = doorbell.listen(store, "other")
    assert other_ns is not None                      # another namespace, another bell
    other_ns.close()
    first.close()
    again = doorbell.listen(store, None)              # no file left behind: free at once
    assert again is not None
    again.close()


def test_a_full_queue_still_counts_as_rung(rung):
    sock, bell = rung
    # nobody reads: the queue fills (net.unix.max_dgram_qlen, 10 by default: a flood of
    # rings holds no memory), and ringing goes on saying the bridge will wake
    assert all(bell.ring() for _ in range(5000))
    n = sum(doorbell.take(sock))
    assert 1 <= n <= doorbell.READ_BATCH
    if n < doorbell.READ_BATCH:
        assert doorbell.take(sock) == (0, 0)         # all of them were read


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_rings_with_a_socket_of_its_own(rung):
    sock, bell = rung
    assert bell.ring()
    parent_sock = bell._sock
    pid = os.fork()
    if pid == 0:
        ok = bell.ring() and bell._sock is not parent_sock
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert doorbell.take(sock) == (2, 0)
