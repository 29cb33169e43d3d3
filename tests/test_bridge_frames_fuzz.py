"""Frames that decode but carry values the bridge cannot take: each must be refused as
malformed (BadFrame) before anything is applied, by the decoder, not fail half-way
through a handler.  Drives a Bridge, not started, on a real store, as
test_bridge_units does."""
from __future__ import annotations

import struct
import time
import types

import numpy as np
import pytest

from test_bridge_units import (ROWS_SEQ_BASE, BadFrame, Mark, Status, _owner_on_a_store,
                               _take_snapshot, _tensor_owned_by, frames, members)

pytestmark = pytest.mark.timeout(60)

STEP_AT = 48 + 24          # a data frame's step (header 48, then the data sub-header)


def _peer(addr: str, incarnation: int = 7) -> types.SimpleNamespace:
    """The authenticated peer ``addr`` as Bridge.on_message takes it."""
    return types.SimpleNamespace(sender=members.member_id(addr), incarnation=incarnation)


def _feed(node, peer: str, buf: bytes) -> tuple[int, list]:
    """``buf`` as a websocket message from ``peer`` (incarnation 7): (the count of
    malformed messages in a row on_message returns, the frames it answered)."""
    got: list = []
    bad = node.on_message(peer, _peer(peer), buf,
                          lambda d: got.extend(frames.iter_frames(bytes(d))), 0)
    return bad, got


def test_a_batch_step_past_2_63_is_malformed():
    """A BATCH's step (pushes folded in) the owner counts as an int64 (the C counter takes
    step - 1 more pushes): a step past 2**63 - 1 is refused by the decoder and the
    encoder; 2**63 - 1 is taken."""
    ok = dict(epoch=0, sender=1, incarnation=7, tensor=1, shard=0, seq=1,
              values=np.ones((1, 4), np.float32), keys=np.array([3], np.uint64))
    buf = bytearray(frames.encode_batch(step=frames.U63, **ok))
    assert frames.decode(bytes(buf)).step == frames.U63
    for step in (frames.U63 + 1, frames.U64):
        struct.pack_into("<Q", buf, STEP_AT, step)
        with pytest.raises(BadFrame, match="step in 1..2"):
            frames.decode(bytes(buf))
        with pytest.raises(frames.InvalidArgument):
            frames.encode_batch(step=step, **ok)


def test_a_table_batch_with_a_huge_step_is_refused_not_applied_twice(tmp_path):
    """A table's owner took a BATCH of step 2**64 - 1, applied it, and then counting its
    pushes raised OverflowError: no answer, nothing in the duplicate filter, no ROWS to
    the copies, and the sender's resend was applied again (keys 1 and 2 at 2.0 after
    one batch of 1.0).  Now the message is malformed and nothing changes."""
    from shmps.bridge.ring import shard_key

    me, a = "127.0.0.2:7001", "127.0.0.3:7001"
    with _owner_on_a_store(tmp_path, [me, a], "fzstep") as (node, _, _st):
        name = next(f"t{i}" for i in range(1000) if node.owner(shard_key(f"t{i}", 0)) == me)
        node.store.table(name, dim=4, capacity=256, shards=1, optimizer="sum")
        while node.refresh_tensors(budget=None):
            pass
        info = node.by_name[name]
        st = node.shards[(info.tid, 0)]
        keys = np.array([1, 2], np.uint64)
        buf = bytearray(frames.encode_batch(
            epoch=0, sender=members.member_id(a), incarnation=7, tensor=info.tid, shard=0,
            seq=1, values=np.ones((2, 4), np.float32), keys=keys))
        struct.pack_into("<Q", buf, STEP_AT, frames.U64)
        for _ in range(3):   # (the first is answered GAP by a shard new to the stream)
            bad, _got = _feed(node, a, bytes(buf))
            assert bad == 1
        assert len(st.dedup) == 0 and not st.first_seen
        np.testing.assert_array_equal(node.store[name].pull(keys), np.zeros((2, 4), np.float32))
        assert node.metrics.applied._value.get() == 0


def test_a_mark_of_seq_0_is_malformed():
    """A mark names a batch (a seq of a stream, from 1) or a floor (> 0: an owner sends
    none of 0): seq 0 is refused by the decoder and the encoders."""
    ok = dict(epoch=0, sender=1, incarnation=7, tensor=1, shard=0, seq=ROWS_SEQ_BASE + 1,
              values=np.ones((1, 4), np.float32), start=0)
    buf = frames.encode_rows(marks=[Mark(2, 3, 1), Mark(4, 5, 6)], **ok)
    assert [m.seq for m in frames.decode(buf).marks] == [1, 6]
    head = frames.HEADER.size + frames.DATA_HEAD.size   # (the marks follow)
    for at in (head + 8, head + 16 + 8):
        bad = bytearray(buf)
        struct.pack_into("<Q", bad, at, 0)
        with pytest.raises(BadFrame, match="seq is 0"):
            frames.decode(bytes(bad))
    with pytest.raises(frames.InvalidArgument, match="mark's seq must be >= 1"):
        frames.encode_rows(marks=[Mark(2, 3, 0)], **ok)
    with pytest.raises(frames.InvalidArgument, match="mark's seq must be >= 1"):
        frames.encode_snapshot(marks=[Mark(2, 3, 0)], **ok)


@pytest.mark.parametrize("floor", [False, True])
def test_rows_with_a_mark_of_seq_0_change_nothing(tmp_path, floor):
    """A copy took a ROWS whose second mark had seq 0: it wrote the rows and recorded the
    first mark, then the second raised InvalidArgument (Dedup: no seq below 1), logged
    as a handler's failure, with no answer to the owner and the copy changed.  Now the
    message is malformed: rows, filter and answers as before.  (A floor of 0, which no
    owner sends, was taken; malformed too now.)"""
    me, a, b = "127.0.0.2:7001", "127.0.0.3:7001", "127.0.0.4:7001"
    with _owner_on_a_store(tmp_path, [me, a, b], "fzmark") as (node, _, _st):
        name, info, st = _tensor_owned_by(node, a, [me, b], b, pushed=False)
        s = members.member_id(b)
        assert _take_snapshot(node, a, info.tid, 1, marks=[(s, 7, 10)]) is Status.OK
        buf = bytearray(frames.encode_rows(
            epoch=node.members.epoch, sender=members.member_id(a), incarnation=7,
            tensor=info.tid, shard=0, seq=ROWS_SEQ_BASE + 2,
            values=np.full((8, 4), 99, np.float32), start=0, floor_marks=floor,
            marks=[Mark(s, 7, 11), Mark(s, 9, 1)]))
        struct.pack_into("<Q", buf, frames.HEADER.size + frames.DATA_HEAD.size + 16 + 8,
                         0)                                   # the second mark's seq
        bad, got = _feed(node, a, bytes(buf))
        assert bad == 1 and got == []
        np.testing.assert_array_equal(node.store[name].pull(), np.zeros((8, 4), np.float32))
        assert st.dedup.floor((s, 7, info.tid, 0)) == 10
        assert (s, 9, info.tid, 0) not in st.dedup and st.copied_in == 1


def test_a_batch_of_seq_0_is_malformed_and_does_not_stall_its_stream(tmp_path):
    """A BATCH of seq 0 (a stream's seqs start at 1) was answered GAP by an owner new to
    the stream, which remembered 0 as where it starts: every later frame of the stream,
    seq 1 included, was answered GAP (the stream stalled), and a resend of seq 0 raised
    InvalidArgument from the duplicate filter (a traceback, no answer).  Now it is
    malformed, and the stream starts at its seq 1 as any other does."""
    ok = dict(epoch=0, sender=1, incarnation=7, tensor=1, shard=0,
              values=np.ones((1, 4), np.float32), start=0)
    buf = bytearray(frames.encode_batch(seq=1, **ok))
    struct.pack_into("<Q", buf, 32, 0)
    with pytest.raises(BadFrame, match="seq is 0"):
        frames.decode(bytes(buf))
    with pytest.raises(frames.InvalidArgument, match="seq is >= 1"):
        frames.encode_batch(seq=0, **ok)

    me, a = "127.0.0.2:7001", "127.0.0.3:7001"
    with _owner_on_a_store(tmp_path, [me, a], "fzseq") as (node, info, st):
        def batch(seq: int) -> bytes:
            buf = bytearray(frames.encode_batch(
                epoch=0, sender=members.member_id(a), incarnation=7, tensor=info.tid,
                shard=0, seq=max(seq, 1), values=np.ones((1, 4), np.float32), start=0))
            struct.pack_into("<Q", buf, 32, seq)
            return bytes(buf)

        for _ in range(2):
            assert _feed(node, a, batch(0)) == (1, [])
        assert not st.first_seen and len(st.dedup) == 0
        bad, got = _feed(node, a, batch(1))       # new to the owner: GAP, from seq 1
        assert bad == 0 and [g.status for g in got] == [Status.GAP]
        assert _feed(node, a, batch(1))[0] == 0   # applied (answered once a's copy has it)
        assert st.dedup.floor((members.member_id(a), 7, info.tid, 0)) == 1
        assert node.store[info.name].pull()[0].tolist() == [1.0] * 4


def test_an_answer_with_an_etag_that_is_not_utf8_fails_authentication():
    """Any process on a member's address can answer a request (check_response's
    docstring).  An ETag header of bytes that are not UTF-8 reaches check_response as
    lone surrogates (aiohttp decodes headers with surrogateescape), and computing the
    MAC raised UnicodeEncodeError, which the bridge does not count or log as a failed
    authentication (_ask_peer catches AuthError); now it is AuthError."""
    import asyncio

    import aiohttp

    from shmps.bridge import auth

    secret = b"k" * 16

    async def answer(reader, writer) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 2\r\nETag: "\xff\xfe"\r\n'
                     b"X-Shmps-Response-Mac: " + b"a" * 64 + b"\r\n\r\nok")
        await writer.drain()
        writer.close()

    async def ask() -> Exception:
        srv = await asyncio.start_server(answer, "127.0.0.1", 0)
        peer = f"127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        signed = auth.sign_request(secret, "GET", "/v1/catalog", b"", "127.0.0.1:1",
                                   target=peer, store="m")
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://{peer}/v1/catalog", headers=signed,
                                 timeout=aiohttp.ClientTimeout(total=5)) as r:
                    data = await r.read()
                    try:
                        auth.check_response(secret, signed, peer, r.status, r.headers, data)
                    except Exception as e:
                        return e
        finally:
            srv.close()
        raise AssertionError("the answer passed")

    e = asyncio.run(ask())
    assert isinstance(e, auth.AuthError), repr(e)
    assert "malformed ETag" in str(e)


def test_a_strided_buffer_is_bad_frame_not_buffer_error():
    """decode, iter_frames and restamp_epoch raise BadFrame for any malformed input,
    "never another exception": a strided view of bytes (format B, so no cast was tried)
    raised BufferError from struct."""
    whole = frames.encode_sync(epoch=1, sender=2, incarnation=3, tensor=4, shard=5)
    doubled = bytes(b for b in whole for _ in range(2))
    strided = memoryview(doubled)[::2]
    assert bytes(strided) == whole
    for call in (frames.decode, lambda b: list(frames.iter_frames(b)),
                 lambda b: frames.restamp_epoch(b, 9)):
        with pytest.raises(BadFrame, match="C-contiguous"):
            call(strided)
    assert frames.decode(memoryview(whole + b"x")[:len(whole)]).type == frames.FrameType.SYNC


EPOCH_AT = 8               # the header's epoch


def test_an_epoch_past_the_bound_is_malformed():
    """Every frame carries its sender's epoch, a u64: one past MAX_EPOCH (2**62) is
    refused by the decoder, whatever the frame's type, and by the encoders; MAX_EPOCH
    itself is taken."""
    ok = dict(epoch=0, sender=1, incarnation=7, tensor=1, shard=0)
    every = [frames.encode_batch(seq=1, values=np.ones((1, 4), np.float32), start=0, **ok),
             frames.encode_rows(seq=ROWS_SEQ_BASE + 1, values=np.ones((1, 4), np.float32),
                                start=0, **ok),
             frames.encode_snapshot(seq=ROWS_SEQ_BASE + 1, values=np.ones((1, 4), np.float32),
                                    start=0, last=True, **ok),
             frames.encode_ack(seq=1, **ok), frames.encode_sync(**ok),
             frames.encode_init_query(**ok),
             frames.encode_heartbeat(epoch=0, sender=1, incarnation=7, seq=1, digest=0,
                                     sent_ms=0, members=[(1, 1)])]
    for whole in every:
        buf = bytearray(whole)
        struct.pack_into("<Q", buf, EPOCH_AT, frames.MAX_EPOCH)
        assert frames.decode(bytes(buf)).epoch == frames.MAX_EPOCH
        for epoch in (frames.MAX_EPOCH + 1, frames.U64 - 1, frames.U64):
            struct.pack_into("<Q", buf, EPOCH_AT, epoch)
            for call in (frames.decode, lambda b: list(frames.iter_frames(b))):
                with pytest.raises(BadFrame, match="epoch"):
                    call(bytes(buf))
    with pytest.raises(frames.InvalidArgument, match="epoch must be"):
        frames.encode_sync(**{**ok, "epoch": frames.MAX_EPOCH + 1})
    with pytest.raises(frames.InvalidArgument, match="epoch must be"):
        frames.restamp_epoch(every[0], frames.MAX_EPOCH + 1)
    assert frames.epoch_of(frames.restamp_epoch(every[0], frames.MAX_EPOCH)) == frames.MAX_EPOCH


def test_a_heartbeat_of_an_epoch_past_the_bound_changes_nothing(tmp_path, caplog):
    """A host that hears a majority member with a higher epoch takes its view over
    (members.py, E3): a heartbeat of epoch 2**64 - 1 was taken, and the next epoch this
    host minted, 2**64, did not fit the header: every frame it encoded after that raised.
    Now a heartbeat of an epoch past MAX_EPOCH is malformed, logged with the reason, and
    changes nothing (epoch, member states, ring); one of MAX_EPOCH is taken as any newer
    epoch is, and no epoch is minted past it (logged)."""
    from test_bridge_units import State, _host_c_of_three, ring

    node, a, b, c = _host_c_of_three(tmp_path)
    node.members.tick(now=time.monotonic() + 10 * node.cfg.dead_after)   # cut off
    before = (node.members.epoch, node.members.states(), node.ring.digest)
    majority = [(members.member_id(a), State.ALIVE.code), (members.member_id(b), State.ALIVE.code),
                (members.member_id(c), State.DEAD.code)]

    def heartbeat(epoch: int, seq: int) -> bytes:
        buf = bytearray(frames.encode_heartbeat(
            epoch=0, sender=members.member_id(b), incarnation=7, seq=seq,
            digest=ring.Ring([a, b]).digest, sent_ms=0, hb_flags=frames.HB_QUORUM,
            members=majority))
        struct.pack_into("<Q", buf, EPOCH_AT, epoch)
        return bytes(buf)

    with caplog.at_level("WARNING", logger="shmps.bridge"):
        for seq, epoch in enumerate((frames.U64, frames.U64 - 1, frames.MAX_EPOCH + 1), 2):
            assert _feed(node, b, heartbeat(epoch, seq)) == (1, [])
    assert (node.members.epoch, node.members.states(), node.ring.digest) == before
    assert node.metrics.rejected_c.labels("malformed")._value.get() == 3
    assert caplog.text.count(f"epoch {frames.U64} past the bound") == 1, caplog.text
    assert _feed(node, b, heartbeat(frames.MAX_EPOCH, 5)) == (0, [])
    assert node.members.epoch == frames.MAX_EPOCH and node.members.state(c) is State.JOINING
    m = members.Membership([a, b, c], a, now=0.0)
    m.heartbeat(b, 0.1)
    m.heartbeat(c, 0.1)
    m.adopt({a: State.ALIVE, b: State.ALIVE, c: State.ALIVE}, frames.MAX_EPOCH, now=0.1)
    with caplog.at_level("ERROR", logger="shmps.bridge"):
        m.mark_dead(c)                          # a majority (a, b): a change that mints
    assert m.live() == (a, b) and m.epoch == frames.MAX_EPOCH
    assert "no epoch is minted" in caplog.text
