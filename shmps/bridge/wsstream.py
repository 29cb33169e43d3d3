"""A websocket connection read straight into one reusable buffer (RFC 6455, binary only).

The bridges talk websocket (``GET /v1/stream``), but aiohttp's message reader copies
every received byte twice after the kernel did (a slice per read, a join per message):
at 1 MiB data frames that was a sixth of an owner's CPU.  :class:`WsStream` is an
:class:`asyncio.BufferedProtocol` that takes over the connection once the HTTP upgrade
is done (the server: :func:`take_over` after aiohttp's ``WebSocketResponse.prepare``;
the client: :func:`connect`, which sends the upgrade request itself), so the kernel
copies each message into :attr:`WsStream._buf` and the message handler gets a
memoryview of it, valid until the handler returns (the bridge applies or writes every
frame before it returns; a handler that keeps data must copy it).

On the wire it is plain RFC 6455: a client masks what it sends, a server does not,
control frames (ping, pong, close) are answered, and a standard websocket client
(aiohttp's ``ws_connect``, used by the tests' hostile peers) talks to a bridge as
before.  What this end refuses closes the connection with the RFC's status code:
text and fragmented messages (1003: the bridge protocol uses neither), a message over
``max_msg`` bytes (1009, before its payload is read), a client frame without a mask
or a server frame with one, reserved bits set, unknown opcodes (1002).

Sending: :meth:`WsStream.send` writes the frame header and then the payload object to
the transport, which sends it without copying unless the socket is full (then asyncio
keeps the rest, a copy up to Python 3.11, a reference from 3.12, and pauses us).
While paused, messages wait in our own queue as references (asyncio 3.11 would append
each to one growing bytearray: a copy of everything queued, and at a few hundred MiB
an event loop stalled for most of a second moving it); :attr:`WsStream.backlog` says
how much waits, and past MAX_BACKLOG a send is refused.  Only the server side sends large messages in the bridge (data frames take
the connection the peer opened: ``Bridge._out``), so the masking copy of a client (a
fresh XOR per message, RFC 6455 5.3) applies to ACKs and heartbeats.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import struct
from collections import deque
from typing import Any, Callable, Optional

import numpy as np
from aiohttp import WSCloseCode
from aiohttp.http import WS_KEY

log = logging.getLogger("shmps.bridge")

OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
CLOSE_NORMAL, CLOSE_PROTOCOL, CLOSE_UNSUPPORTED, CLOSE_POLICY, CLOSE_TOO_BIG = (
    int(WSCloseCode.OK), int(WSCloseCode.PROTOCOL_ERROR), int(WSCloseCode.UNSUPPORTED_DATA),
    int(WSCloseCode.POLICY_VIOLATION), int(WSCloseCode.MESSAGE_TOO_BIG))
READ_CHUNK = 256 << 10        #: read size between messages (dozens of small ones per read:
                              #: at 16 KiB, ROWS of small shards came faster than a
                              #: bridge read them, one read per connection a loop pass)
ONE_WRITE = 16 << 10          #: a message below this goes out with its header in one write
MAX_HTTP_HEAD = 16 << 10      #: the client's limit on the server's 101 response head
# the buffer, at least max_msg + READ_CHUNK (_make_room), holds a whole 101 response head
assert READ_CHUNK >= MAX_HTTP_HEAD
MAX_BACKLOG = 64 << 20        #: bytes queued for a slow peer before send() refuses
MAX_INBOX = 1 << 30           #: default bytes of messages held before start() (see limit())
CLOSE_LINGER = 2.0            #: seconds a closing connection may take to send its last bytes
SMALL_MASK = 512              #: (un)mask messages up to this size with Python ints
LEN16 = struct.Struct("!H")
LEN64 = struct.Struct("!Q")

Handler = Callable[[memoryview], bool]
"""Called with each binary message; returns False to close the connection."""


class WsClosed(ConnectionError):
    """The websocket closed (or never opened) before the awaited message."""


def accept_key(key: bytes) -> bytes:
    """``Sec-WebSocket-Accept`` for the client's ``Sec-WebSocket-Key`` (RFC 6455 4.2.2)."""
    return base64.b64encode(hashlib.sha1(key + WS_KEY).digest())


def frame_header(opcode: int, n: int, mask: Optional[bytes] = None) -> bytes:
    """The header of one final (FIN) frame of ``n`` payload bytes, masked with ``mask``."""
    first = 0x80 | opcode
    bit = 0x80 if mask is not None else 0
    if n < 126:
        head = bytes((first, bit | n))
    elif n < 65536:
        head = bytes((first, bit | 126)) + LEN16.pack(n)
    else:
        head = bytes((first, bit | 127)) + LEN64.pack(n)
    return head + mask if mask is not None else head


def apply_mask(data: memoryview, mask: bytes) -> None:
    """XOR ``data`` in place with the 4-byte ``mask`` repeated (RFC 6455 5.3). O(n)."""
    n = len(data)
    if not n:
        return
    if n <= SMALL_MASK:   # ACKs, heartbeats: one big-int XOR beats numpy's set-up
        m = int.from_bytes((mask * (n // 4 + 1))[:n], "little")
        data[:] = (int.from_bytes(data, "little") ^ m).to_bytes(n, "little")
        return
    a = np.frombuffer(data, dtype=np.uint8)
    words = n // 4
    if words:
        w = a[:words * 4].view(np.uint32)
        w ^= np.frombuffer(mask, dtype=np.uint32)[0]
    for i in range(words * 4, n):
        a[i] ^= mask[i & 3]


class WsStream(asyncio.BufferedProtocol):
    """One websocket connection after the upgrade; see the module docstring.

    Messages that arrive before :meth:`start` (the handshake) are copied into an inbox
    and read with :meth:`receive`; from :meth:`start` on, each one is passed to the
    handler as a view of the receive buffer, in order, on the event loop."""

    def __init__(self, *, client: bool, max_msg: int, peer: str = "",
                 request: Optional[tuple[str, str]] = None) -> None:
        self.client = client
        self.max_msg = max_msg
        #: bytes of messages the inbox holds before start(); over it, closed (1008)
        self.max_inbox = MAX_INBOX
        self.peer = peer
        self.transport: Optional[asyncio.Transport] = None
        self.orig: Optional[asyncio.BaseProtocol] = None  # aiohttp's, told when we close
        self._buf = bytearray(2 * self._chunk())
        self._mv = memoryview(self._buf)
        self._pos = 0            # first byte not yet parsed
        self._end = 0            # end of the bytes received
        self._need = 0           # bytes of the message at _pos, once its header is read
        self._handler: Optional[Handler] = None
        self._inbox: deque = deque()
        self._inbox_bytes = 0
        self._waiter: Optional[asyncio.Future] = None
        self._close_sent = False
        #: told why, when this end closes the connection for a protocol violation:
        #: "oversized" (1009) or "malformed" (1002, 1003)
        self.on_refused: Optional[Callable[[str], None]] = None
        self._paused = False     # the transport's buffer is over its high-water mark
        self._backlog: deque = deque()   # messages waiting for resume_writing
        self._backlog_bytes = 0
        self._pong_queued = False        # a PONG waits in the backlog (at most one does)
        loop = asyncio.get_running_loop()
        self.closed: asyncio.Future = loop.create_future()
        self.opened: asyncio.Future = loop.create_future()
        self._request = request  # client: (host header, path) of the upgrade request
        self._key = base64.b64encode(os.urandom(16)) if client else b""
        self._http = client      # client: reading the server's 101 response
        if not client:
            self.opened.set_result(None)

    # ------------------------------------------------------------ asyncio protocol
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        if self._request is not None:
            host, path = self._request
            transport.write(
                f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {self._key.decode()}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n".encode())

    def limit(self, max_msg: int, max_inbox: int = MAX_INBOX) -> None:
        """Set the largest message taken (over it: closed with 1009, from its header,
        before its payload is read or room made for it) and the bytes of messages held
        before :meth:`start` (over them: closed with 1008).  A server keeps both small
        until the peer has authenticated (the bridge: a handshake message), so that an
        unauthenticated client gets no large buffer and no queue."""
        self.max_msg, self.max_inbox = max_msg, max_inbox

    def _chunk(self) -> int:
        """Bytes asked of the kernel per read between messages: READ_CHUNK, or a
        message's largest frame while messages are small (before authentication)."""
        return min(READ_CHUNK, self.max_msg + 14)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._pos == self._end:
            self._pos = self._end = 0
        have = self._end - self._pos
        left = self._need - have          # bytes still missing of the message at _pos
        # a large message is read to its end exactly, so the next one starts a read (and
        # usually the buffer); else read a chunk, which may hold several small messages
        chunk = self._chunk()
        size = left if left >= chunk else chunk
        if self._end + size > len(self._buf):
            self._make_room(have + size)
        return self._mv[self._end:self._end + size]

    def _make_room(self, size: int) -> None:
        """Move the unparsed bytes to the buffer's start, in a bigger buffer if ``size``
        (those bytes plus the next read) does not fit."""
        have = self._end - self._pos
        if size > len(self._buf):   # at most one message (max_msg) plus a read
            buf = bytearray(min(max(size, 2 * len(self._buf)),
                                self.max_msg + 14 + READ_CHUNK))
            buf[:have] = self._mv[self._pos:self._end]
            self._buf, self._mv = buf, memoryview(buf)
        elif have:
            self._mv[:have] = bytes(self._mv[self._pos:self._end])
        self._pos, self._end = 0, have

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes
        try:
            if self._http and not self._read_http():
                return
            self._parse()
        except Exception:   # a handler bug must not leave the connection half-read
            log.exception("websocket from %s: message handling failed", self.peer)
            self.close(CLOSE_PROTOCOL)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        while self._backlog and not self._paused and not self.is_closed:
            head, data, pong = self._backlog.popleft()
            self._backlog_bytes -= len(head) + memoryview(data).nbytes
            if pong:
                self._pong_queued = False
            self._write(head, data)

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self._close_sent = True
        if not self.closed.done():
            self.closed.set_result(None)
        if not self.opened.done():
            self.opened.set_exception(WsClosed(f"connection to {self.peer} closed during the "
                                               f"upgrade{': ' + str(exc) if exc else ''}"))
        self._wake()
        self._backlog.clear()
        self._pong_queued = False
        self._backlog_bytes = 0
        if self.orig is not None:
            orig, self.orig = self.orig, None
            orig.connection_lost(exc)

    # ------------------------------------------------------------ reading
    def _read_http(self) -> bool:
        """Client: parse the server's response to the upgrade request; True once the
        websocket is open (bytes after the head are its first frames)."""
        head_end = self._buf.find(b"\r\n\r\n", 0, self._end)
        if head_end < 0:
            if self._end > MAX_HTTP_HEAD:
                return self._fail_upgrade("the upgrade response head is too long")
            return False
        lines = bytes(self._mv[:head_end]).decode("latin-1").split("\r\n")
        status = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        if len(status) < 2 or status[1] != "101":
            return self._fail_upgrade(f"the server answered {lines[0]!r}")
        if (headers.get("upgrade", "").lower() != "websocket"
                or "upgrade" not in headers.get("connection", "").lower()
                or headers.get("sec-websocket-accept", "").encode() != accept_key(self._key)):
            return self._fail_upgrade("the server's 101 response is not a websocket upgrade")
        self._http = False
        self._pos = head_end + 4
        self.opened.set_result(None)
        return True

    def _fail_upgrade(self, why: str) -> bool:
        if not self.opened.done():
            self.opened.set_exception(WsClosed(f"websocket to {self.peer}: {why}"))
        assert self.transport is not None
        self.transport.close()
        return False

    def _parse(self) -> None:
        buf, mv = self._buf, self._mv
        while not self._close_sent:
            pos, avail = self._pos, self._end - self._pos
            if avail < 2:
                return
            b0, b1 = buf[pos], buf[pos + 1]
            n, hlen = b1 & 0x7F, 2
            if n == 126:
                hlen = 4
                if avail < hlen:
                    return
                n = LEN16.unpack_from(buf, pos + 2)[0]
            elif n == 127:
                hlen = 10
                if avail < hlen:
                    return
                n = LEN64.unpack_from(buf, pos + 2)[0]
            masked = bool(b1 & 0x80)
            if masked:
                hlen += 4
            opcode = b0 & 0x0F
            if b0 & 0x70:
                return self._protocol_error(CLOSE_PROTOCOL, "reserved bits set")
            if masked == self.client:
                return self._protocol_error(CLOSE_PROTOCOL, "a client must mask its frames "
                                            "and a server must not (RFC 6455 5.1)")
            if opcode not in (OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG):
                return self._protocol_error(CLOSE_PROTOCOL, f"unknown opcode {opcode:#x}")
            if opcode >= OP_CLOSE and (n > 125 or not b0 & 0x80):
                return self._protocol_error(CLOSE_PROTOCOL, "a control frame over 125 bytes "
                                            "or fragmented")
            if opcode in (OP_TEXT, OP_CONT) or not b0 & 0x80:
                return self._protocol_error(CLOSE_UNSUPPORTED, "only unfragmented binary "
                                            "messages are used")
            if n > self.max_msg:
                return self._protocol_error(CLOSE_TOO_BIG, f"a message of {n} bytes, over "
                                            f"the {self.max_msg}-byte limit")
            total = hlen + n
            if avail < total:
                self._need = total
                return
            self._need = 0
            payload = mv[pos + hlen:pos + total]
            if masked:
                apply_mask(payload, bytes(mv[pos + hlen - 4:pos + hlen]))
            self._pos = pos + total
            if opcode == OP_BINARY:
                self._message(payload)
            elif opcode == OP_PING:
                self._send_frame(OP_PONG, bytes(payload))
            elif opcode == OP_CLOSE:
                if len(payload) == 1:
                    return self._protocol_error(CLOSE_PROTOCOL, "a close frame of 1 byte")
                self.close(CLOSE_NORMAL if not len(payload) else LEN16.unpack_from(payload)[0])

    def _message(self, payload: memoryview) -> None:
        if self._handler is None:
            self._inbox_bytes += len(payload)
            if self._inbox_bytes > self.max_inbox:
                return self._protocol_error(CLOSE_POLICY, f"{self._inbox_bytes} bytes of "
                                            "messages not yet read (before start()), over "
                                            f"the {self.max_inbox}-byte limit")
            self._inbox.append(bytes(payload))
            self._wake()
        elif not self._handler(payload):
            self.close(CLOSE_PROTOCOL)

    def _protocol_error(self, code: int, why: str) -> None:
        log.warning("websocket from %s: %s; closing it (%d)", self.peer, why, code)
        if self.on_refused is not None:
            self.on_refused("oversized" if code == CLOSE_TOO_BIG else "malformed")
        self.close(code)

    def _wake(self) -> None:
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    # ------------------------------------------------------------ API
    async def receive(self, timeout: float) -> bytes:
        """The next binary message (before :meth:`start`); WsClosed if the connection
        closes first, TimeoutError after ``timeout`` seconds."""
        async def wait() -> bytes:
            while not self._inbox:
                if self.closed.done():
                    raise WsClosed(f"the websocket with {self.peer} closed")
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter
            data = self._inbox.popleft()
            self._inbox_bytes -= len(data)
            return data
        return await asyncio.wait_for(wait(), timeout)

    def start(self, handler: Handler) -> None:
        """Pass every message from now on (the ones waiting first) to ``handler``."""
        self._handler = handler
        while self._inbox and not self._close_sent:
            data = self._inbox.popleft()
            self._inbox_bytes -= len(data)
            if not handler(memoryview(data)):
                self.close(CLOSE_PROTOCOL)

    @property
    def is_closed(self) -> bool:
        return self._close_sent or self.transport is None or self.transport.is_closing()

    @property
    def backlog(self) -> int:
        """Bytes given to :meth:`send` and not yet taken by the socket."""
        t = self.transport
        return self._backlog_bytes + (t.get_write_buffer_size() if t is not None else 0)

    def refuses(self, n: int) -> bool:
        """Whether :meth:`send` would refuse a message of ``n`` bytes now."""
        return (self._paused or bool(self._backlog)) and self._backlog_bytes + n > MAX_BACKLOG

    def send(self, data: Any, bulk: bool = False) -> bool:
        """Send ``data`` (bytes-like) as one binary message; False if the connection is
        closed, or if, while the transport is paused, the queued bytes plus this message
        would exceed MAX_BACKLOG (the caller treats it as lost).  Never waits: while the
        transport is over its high-water mark, messages wait in a queue (references: the
        caller must not change ``data`` after this; a memoryview, such as a handler's
        view of the receive buffer, is copied first).  Control frames are never refused.
        ``bulk``: queued whatever the backlog: a snapshot larger than MAX_BACKLOG (the
        bridge starts one only below SNAPSHOT_START_BACKLOG) and the ROWS that follow it
        while it is acknowledged, which are not bounded here."""
        return self._send_frame(OP_BINARY, data, bulk)

    def _send_frame(self, opcode: int, data: Any, bulk: bool = False) -> bool:
        if self.is_closed:
            return False
        n = len(data) if hasattr(data, "pieces") else memoryview(data).nbytes
        head, data = self._encode(opcode, data)
        if self._paused or self._backlog:
            if opcode == OP_BINARY and not bulk and self.refuses(n):
                return False
            if opcode == OP_PONG and self._pong_queued:
                # a peer that pings and does not read gets one answer, to its latest ping
                # (RFC 6455 5.5.3), not a queue without bound
                for i in range(len(self._backlog) - 1, -1, -1):
                    if self._backlog[i][2]:
                        old_head, old_data, _ = self._backlog[i]
                        self._backlog_bytes -= len(old_head) + memoryview(old_data).nbytes
                        del self._backlog[i]
                        break
            self._backlog.append((head, data, opcode == OP_PONG))
            self._pong_queued = self._pong_queued or opcode == OP_PONG
            self._backlog_bytes += len(head) + memoryview(data).nbytes
            return True
        self._write(head, data)
        return True

    def _encode(self, opcode: int, data: Any) -> tuple[bytes, Any]:
        """(header, payload) of one final frame: masked by a client; a small message is
        all in the header (one write, one segment).  A message in pieces (an object with
        ``pieces``: (head bytes, body), e.g. ``frames.Pieces``) goes out as the frame
        header and head in one write, the body in the next, not joined (a client, which
        masks, and a small message join them)."""
        pieces = getattr(data, "pieces", None)
        if pieces is not None:
            first, body = pieces
            if not self.client and len(data) >= ONE_WRITE:
                return frame_header(opcode, len(data)) + first, body
            data = b"".join(pieces)
        if isinstance(data, memoryview):
            # e.g. a view of the receive buffer a handler got, which the next read reuses
            # (and asyncio >= 3.12 keeps references to what it could not send yet)
            data = bytes(data)
        n = memoryview(data).nbytes
        if self.client:
            mask = os.urandom(4)
            body = bytearray(data)
            apply_mask(memoryview(body), mask)
            head, data = frame_header(opcode, n, mask), body
            if n < ONE_WRITE:    # ACKs, heartbeats: one write, one segment
                head, data = head + body, b""
        elif n < ONE_WRITE:
            head, data = frame_header(opcode, n) + bytes(data), b""
        else:
            head = frame_header(opcode, n)
        return head, data

    def _write(self, head: bytes, data: Any) -> None:
        assert self.transport is not None
        self.transport.write(head)
        if len(data):
            # asyncio sends what the socket takes now and copies the rest (at most one
            # message: then it pauses us)
            self.transport.write(data)

    def close(self, code: int = CLOSE_NORMAL) -> None:
        """Drop the queue, send a close frame and close the connection; idempotent.

        The queued messages are dropped, not sent: a connection that closes loses what
        it did not deliver (the bridge resends unacknowledged batches and copies shards
        again on the next connection), and writing a queue of up to MAX_BACKLOG plus a
        bulk snapshot into the transport would be one large copy, then a wait, without
        limit, for a peer that may be stopped.  asyncio sends what the transport already
        holds (at most one message past its high-water mark) and the close frame before
        it closes the socket; a peer that does not take them within CLOSE_LINGER seconds
        has the connection aborted."""
        t = self.transport
        if t is None or t.is_closing():
            self._close_sent = True
            return
        if not self._close_sent:
            self._backlog.clear()
            self._pong_queued = False
            self._backlog_bytes = 0
            if not self._http:   # straight to the transport: never behind the queue
                self._write(*self._encode(OP_CLOSE, LEN16.pack(code)))
            self._close_sent = True
        t.close()
        if t.get_write_buffer_size():
            try:
                asyncio.get_running_loop().call_later(CLOSE_LINGER, _abort_if_open, t)
            except RuntimeError:   # no loop runs to finish the close: drop it now
                t.abort()

    async def wait_closed(self) -> None:
        await asyncio.shield(self.closed)


def _abort_if_open(transport: asyncio.Transport) -> None:
    """The end of a closing connection's linger: drop what the peer did not take."""
    if transport.get_write_buffer_size():
        transport.abort()


def take_over(request: Any, *, max_msg: int, peer: str = "") -> WsStream:
    """Server: the connection of ``request``, upgraded by aiohttp's
    ``WebSocketResponse.prepare`` a moment ago, read and written by a :class:`WsStream`
    from now on.  Call it before the client can send anything (the bridge's server
    speaks first); aiohttp's protocol is told when the connection closes."""
    transport = request.transport
    if transport is None or transport.is_closing():
        raise WsClosed(f"the connection from {peer} closed during the upgrade")
    stream = WsStream(client=False, max_msg=max_msg, peer=peer)
    stream.orig = request.protocol
    stream.transport = transport
    transport.set_protocol(stream)
    transport.resume_reading()
    return stream


async def connect(host: str, port: int, path: str, *, max_msg: int,
                  timeout: float) -> WsStream:
    """Client: open a websocket to ``http://host:port/path``; WsClosed or TimeoutError
    if the server refuses the upgrade or does not answer within ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    hosthdr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    transport, stream = await asyncio.wait_for(loop.create_connection(
        lambda: WsStream(client=True, max_msg=max_msg, peer=hosthdr,
                         request=(hosthdr, path)), host, port), timeout)
    try:
        await asyncio.wait_for(asyncio.shield(stream.opened), timeout)
    except BaseException:
        transport.close()
        raise
    return stream
