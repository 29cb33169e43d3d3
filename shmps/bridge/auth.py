"""Shared-secret authentication between bridges.

Every host reads the same secret from ``--secret-file`` (:func:`load_secret`, which
refuses files that group or others can read). Two mechanisms use it:

**Websocket handshake** (:class:`ServerHandshake`, :class:`ClientHandshake`), three
binary messages before any frame::

    server -> client  HELLO  server nonce (32 random bytes)
    client -> server  AUTH   client id, purpose, store, sender id, incarnation, client
                             nonce, MAC_c = HMAC-SHA256(secret, "shmps-bridge/2 client\\0"
                                     || server nonce || client nonce || fields)
    server -> client  OK     server sender id, incarnation, store,
                             MAC_s = HMAC-SHA256(secret, "shmps-bridge/2 server\\0" || ...)

The server's fresh nonce makes every AUTH single-use (a recorded one fails on another
connection); the client's nonce lets the client check the server too (a host without
the secret could otherwise acknowledge batches and make senders drop them). Variable
fields are length-prefixed so no two field lists give the same MAC input.

Both ends name the store they serve (``--store``), under the MAC: the bridge refuses a
peer that serves another one (a mistyped ``--store``) right after the handshake, on
either end, so such a peer is never heard and never a member of its ring.  The handshake
only carries the names; the bridge compares them.  The namespace is not sent: it is a
host's own (several "hosts" on one machine each have one).  Without a secret the MACs
still bind the names to the nonces, and the names are compared all the same.

**Per-request MAC** for HTTP requests (:func:`sign_request`, :class:`RequestVerifier`):
headers carry a client id, the store the request is for, a timestamp (ms), a 16-byte
nonce and ``HMAC-SHA256(secret, "shmps-bridge/3 request\\0" || method || path || client
id || target host || store || timestamp || nonce || SHA-256(body))``
(docs/bridge-protocol.md has the exact layout). The verifier compares in constant time,
refuses timestamps outside a window (default 30 s) and remembers the nonces it accepted
inside the window (a bounded cache; when full it refuses rather than forget), so a
captured request cannot be replayed.  A request that passes and is for another store
than the verifier's is refused as well (:class:`StoreMismatch`: the server answers 409).
The answer's MAC (:func:`sign_response`) covers the answering bridge's store, which
:func:`check_response` compares with the request's: the store is checked in these two
places for every signed request, with or without a secret.

Without ``--secret-file`` the same code runs with an empty key: the bridge then listens
on loopback only (:func:`check_bind`), and a peer configured with a secret is refused.
The byte layouts are in ``docs/bridge-protocol.md``.
"""
from __future__ import annotations

import errno
import hashlib
import heapq
import hmac
import ipaddress
import os
import secrets
import stat
import struct
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from ..errors import Error, InvalidArgument
from ..names import check_name

NONCE_BYTES = 32
"""Size of handshake nonces."""

REQUEST_NONCE_BYTES = 16
"""Size of per-request nonces (sent as 32 hex digits)."""

MAC_BYTES = 32
SECRET_MIN_BYTES = 16
SECRET_MAX_BYTES = 4096
_SECRET_READ = SECRET_MAX_BYTES + 4096   #: bytes of a secret file load_secret reads at most
HANDSHAKE_VERSION = 3
"""3 since the evening of 2026-11-28: the HTTP requests and answers sign the store (their
MAC tags "/3"); a bridge of version 2 passed this handshake and then had every request
refused (401), catalogs and member changes never crossing.  2 since that morning: AUTH
and OK carry the store (1 did not)."""
HANDSHAKE_TIMEOUT = 10.0
REQUEST_WINDOW = 30.0
MAX_ID_BYTES = 255
MAX_PURPOSE_BYTES = 64
MAX_STORE_BYTES = 64           #: a store name's limit (names.check_name)

HEADER_ID = "X-Shmps-Id"
HEADER_TIME = "X-Shmps-Time"
HEADER_NONCE = "X-Shmps-Nonce"
HEADER_MAC = "X-Shmps-Mac"
HEADER_RESPONSE_MAC = "X-Shmps-Response-Mac"
#: the store a request is for (the client's), and in the answer the store the answering
#: bridge serves; under the request's and the answer's MAC
HEADER_STORE = "X-Shmps-Store"

_TAG_CLIENT = b"shmps-bridge/2 client\0"   # /2: the fields name the store
_TAG_SERVER = b"shmps-bridge/2 server\0"
_TAG_REQUEST = b"shmps-bridge/3 request\0"    # /2: the target host; /3: the store
_TAG_RESPONSE = b"shmps-bridge/3 response\0"  # /3: the answering bridge's store

_HELLO = struct.Struct("<4sHH32s")          # magic, version, reserved, server nonce
_AUTH = struct.Struct("<4sHBBBBII32s32s")   # magic, version, id len, purpose len, store len,
#                                             reserved, sender, incarnation, client nonce,
#                                             MAC_c; then id, purpose, store
_OK = struct.Struct("<4sHBBII32s")          # magic, version, store len, reserved, sender,
#                                             incarnation, MAC_s; then store
MAGIC_HELLO, MAGIC_AUTH, MAGIC_OK = b"SHPH", b"SHPA", b"SHPK"
#: the largest handshake message (an AUTH with the longest id, purpose and store): the
#: bound on what a connection may send before it has authenticated (WsStream.limit)
MAX_HANDSHAKE_MSG = _AUTH.size + MAX_ID_BYTES + MAX_PURPOSE_BYTES + MAX_STORE_BYTES


class AuthError(Error, PermissionError):
    """A peer or request failed authentication; the message says which check failed."""

    hint = ("every host must use the same --secret-file, and host clocks must agree within "
            "the request window (30 s)")


class StoreMismatch(Error, ValueError):
    """An authenticated request, or its authenticated answer, is for another store than
    the bridge it reached serves: its --store, or the asker's, is another one.  Nothing
    was done.  ``asked`` is the store of the request, ``serves`` the bridge's."""

    hint = ("every host must run shmps-bridge with the same --store, and `shmps-tool "
            "members` be given that store with --store")

    def __init__(self, message: str, *, asked: str, serves: str,
                 hint: str | None = None) -> None:
        super().__init__(message, hint)
        self.asked = asked      #: the store the request named (the asker's)
        self.serves = serves    #: the store the answering bridge serves


#: the hint of a handshake of another version: no secret or clock fixes that
VERSION_HINT = "every host's bridge must run the same shmps release: upgrade the older one"


# --------------------------------------------------------------------------- secrets

def load_secret(path: str | os.PathLike[str]) -> bytes:
    """Read the shared secret from ``path``; refuse it if group or others may read it.

    Surrounding whitespace (a trailing newline) is stripped; the rest must be 16..4096
    bytes. The mode is checked on the opened file (no race with a rename), which is
    opened non-blocking: a FIFO is refused as not a regular file instead of blocking
    until a writer comes. O(size).
    """
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InvalidArgument(
                f"secret file {name} is a symbolic link, which is refused (one could be "
                "pointed at another file between the check and the read)",
                hint=f"pass the file it points to, {os.path.realpath(name)}, with mode "
                     "600") from None
        raise InvalidArgument(f"cannot open secret file {name}: {e.strerror}",
                              hint="pass --secret-file with a readable regular file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"secret file {name} is not a regular file",
                                  hint="pass --secret-file with a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise InvalidArgument(
                f"secret file {name} has mode {mode:04o}: group or others can access it",
                hint=f"run `chmod 600 {name}` (the secret lets anyone overwrite parameters)")
        # up to _SECRET_READ bytes: room for surrounding whitespace (blank lines an editor
        # added), and a file larger than that is refused without reading it whole
        data = os.read(fd, _SECRET_READ + 1)
    finally:
        os.close(fd)
    secret = data.strip()
    # (the size the operator's file or secret has: it was "4098 bytes", the old read's
    # limit, for any larger file, and a secret of 4097 bytes passed)
    said = (f"secret file {name} holds more than {_SECRET_READ} bytes"
            if len(data) > _SECRET_READ else f"secret in {name} is {len(secret)} bytes")
    if len(data) > _SECRET_READ or not SECRET_MIN_BYTES <= len(secret) <= SECRET_MAX_BYTES:
        raise InvalidArgument(
            f"{said}; it must be {SECRET_MIN_BYTES}..{SECRET_MAX_BYTES} bytes",
            hint=f"e.g. `head -c 32 /dev/urandom | base64 > {name}; chmod 600 {name}`")
    return secret


def is_loopback(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8, ``::1`` (bracketed or not); False for anything
    else, including ``0.0.0.0``, ``::`` and other names (not resolved). O(len(host))."""
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if h.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(h.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def check_bind(host: str, secret: bytes | None) -> None:
    """Refuse to listen on a non-loopback ``host`` without a secret. O(len(host)).

    Raises :class:`InvalidArgument` ``"refusing to listen on <host> without --secret-file:
    ..."``.
    """
    if secret:
        return
    if not is_loopback(host):
        shown = host if host else "all interfaces"
        raise InvalidArgument(
            f"refusing to listen on {shown} without --secret-file: any host that can reach "
            "it could read and overwrite parameters",
            hint="pass --secret-file F (a file of mode 0600 holding at least 16 random bytes, "
                 "the same on every host) or listen on 127.0.0.1")


def new_nonce(size: int = NONCE_BYTES) -> bytes:
    """``size`` bytes from the OS's CSPRNG. O(size)."""
    return secrets.token_bytes(size)


def _key(secret: bytes | None) -> bytes:
    return secret or b""


def _lp(data: bytes) -> bytes:
    return struct.pack("<H", len(data)) + data


# --------------------------------------------------------------------------- handshake

@dataclass(frozen=True)
class Peer:
    """Who is on the other end of an authenticated connection."""

    client_id: str      #: the peer's member address (``host:port``)
    purpose: str        #: what the connection is for (``"data"``, ``"sync"``, ...)
    sender: int         #: the peer's 32-bit member id (the frame header's sender field)
    incarnation: int    #: random per process start; distinguishes restarts
    store: str          #: the store the peer's bridge serves (its ``--store``)


def _fields(client_id: bytes, purpose: bytes, store: bytes, sender: int,
            incarnation: int) -> bytes:
    return _lp(client_id) + _lp(purpose) + _lp(store) + struct.pack("<II", sender, incarnation)


def _client_mac(key: bytes, snonce: bytes, cnonce: bytes, fields: bytes) -> bytes:
    return hmac.new(key, _TAG_CLIENT + snonce + cnonce + fields, hashlib.sha256).digest()


def _server_mac(key: bytes, snonce: bytes, cnonce: bytes, fields: bytes, sender: int,
                incarnation: int, store: bytes) -> bytes:
    return hmac.new(key, _TAG_SERVER + snonce + cnonce + fields
                    + struct.pack("<II", sender, incarnation) + _lp(store),
                    hashlib.sha256).digest()


def _check_u32(name: str, v: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 32:
        raise InvalidArgument(f"{name} must be an integer in [0, 2**32), got {v!r}")
    return v


def _text(name: str, value: str, limit: int) -> bytes:
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a string, got {type(value).__name__}")
    raw = value.encode("utf-8")
    if not 1 <= len(raw) <= limit:
        raise InvalidArgument(f"{name} must be 1..{limit} bytes of UTF-8, got {len(raw)}")
    return raw


class ServerHandshake:
    """The accepting side of one connection's handshake; single use.

    ``hello()`` gives the first message; ``verify(auth)`` checks the client's answer
    (within ``timeout`` seconds of ``hello()``) and returns the :class:`Peer` and the OK
    message to send back. Any failure raises :class:`AuthError`, and the handshake cannot
    be retried. ``store`` is the store this host serves, sent in OK; a peer's that
    differs is not a failure here (the caller compares ``Peer.store``, and may send OK
    before it refuses: the client learns this host's store from it). O(len(message))
    each.
    """

    def __init__(self, secret: bytes | None, *, sender: int, incarnation: int, store: str,
                 timeout: float = HANDSHAKE_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._key = _key(secret)
        self._store = _text("store", store, MAX_STORE_BYTES)
        self._sender = _check_u32("sender", sender)
        self._incarnation = _check_u32("incarnation", incarnation)
        self._timeout = float(timeout)
        self._clock = clock
        self._nonce = new_nonce()
        self._started: float | None = None
        self._used = False

    def hello(self, now: float | None = None) -> bytes:
        """The HELLO message (40 bytes) carrying this connection's fresh nonce."""
        self._started = self._clock() if now is None else now
        return _HELLO.pack(MAGIC_HELLO, HANDSHAKE_VERSION, 0, self._nonce)

    def verify(self, message: bytes, now: float | None = None) -> tuple[Peer, bytes]:
        """Check the client's AUTH ``message``; return the peer and the OK message."""
        if self._used:
            raise AuthError("handshake already used: open a new connection")
        self._used = True
        if self._started is None:
            raise AuthError("AUTH received before HELLO was sent")
        t = self._clock() if now is None else now
        if t - self._started > self._timeout:
            raise AuthError(f"handshake expired: no valid AUTH within {self._timeout:g} s")
        peer, cnonce, fields, mac = _parse_auth(message)
        expected = _client_mac(self._key, self._nonce, cnonce, fields)
        if not hmac.compare_digest(mac, expected):
            raise AuthError(f"peer {peer.client_id!r} failed authentication (wrong secret, "
                            "or the message was altered)")
        ok_mac = _server_mac(self._key, self._nonce, cnonce, fields, self._sender,
                             self._incarnation, self._store)
        return peer, _OK.pack(MAGIC_OK, HANDSHAKE_VERSION, len(self._store), 0, self._sender,
                              self._incarnation, ok_mac) + self._store


def _parse_auth(message: bytes) -> tuple[Peer, bytes, bytes, bytes]:
    mv = memoryview(message).cast("B") if not isinstance(message, bytes) else message
    if len(mv) < _AUTH.size:
        raise AuthError(f"malformed AUTH: {len(mv)} bytes, need at least {_AUTH.size}")
    (magic, version, id_len, purpose_len, store_len, reserved, sender, inc, cnonce,
     mac) = _AUTH.unpack_from(mv, 0)
    if magic != MAGIC_AUTH:
        raise AuthError(f"malformed AUTH: magic {bytes(magic)!r}, expected {MAGIC_AUTH!r}")
    if version != HANDSHAKE_VERSION:
        raise AuthError(f"peer speaks handshake version {version}, this host {HANDSHAKE_VERSION}",
                        hint=VERSION_HINT)
    if (id_len == 0 or not 1 <= purpose_len <= MAX_PURPOSE_BYTES
            or not 1 <= store_len <= MAX_STORE_BYTES or reserved):
        raise AuthError("malformed AUTH: empty client id, purpose or store, purpose or "
                        "store too long, or reserved field not zero")
    if len(mv) != _AUTH.size + id_len + purpose_len + store_len:
        raise AuthError(f"malformed AUTH: {len(mv)} bytes, fields declare "
                        f"{_AUTH.size + id_len + purpose_len + store_len}")
    at = _AUTH.size
    raw_id = bytes(mv[at:at + id_len])
    raw_purpose = bytes(mv[at + id_len:at + id_len + purpose_len])
    raw_store = bytes(mv[at + id_len + purpose_len:])
    try:
        client_id, purpose = raw_id.decode("utf-8"), raw_purpose.decode("utf-8")
        store = raw_store.decode("utf-8")
    except UnicodeDecodeError:
        raise AuthError("malformed AUTH: client id, purpose or store is not UTF-8") from None
    fields = _fields(raw_id, raw_purpose, raw_store, sender, inc)
    return Peer(client_id, purpose, sender, inc, store), bytes(cnonce), fields, bytes(mac)


class ClientHandshake:
    """The connecting side: ``answer(hello)`` gives AUTH; ``check(ok)`` authenticates the
    server and returns it as a :class:`Peer` (its ``client_id`` is ``server_id``, its
    ``store`` the one it serves: the caller compares it with ``store``, this host's).
    O(len)."""

    def __init__(self, secret: bytes | None, client_id: str, purpose: str, *, sender: int,
                 incarnation: int, store: str, server_id: str = "") -> None:
        self._key = _key(secret)
        self._id = _text("client_id", client_id, MAX_ID_BYTES)
        self._purpose = _text("purpose", purpose, MAX_PURPOSE_BYTES)
        self._store = _text("store", store, MAX_STORE_BYTES)
        self._sender = _check_u32("sender", sender)
        self._incarnation = _check_u32("incarnation", incarnation)
        self._server_id = server_id
        self._cnonce = new_nonce()
        self._snonce: bytes | None = None

    def answer(self, hello: bytes) -> bytes:
        """The AUTH message answering the server's HELLO."""
        if self._snonce is not None:
            raise AuthError("handshake already answered: open a new connection")
        if len(hello) != _HELLO.size:
            raise AuthError(f"malformed HELLO: {len(hello)} bytes, expected {_HELLO.size}")
        magic, version, reserved, snonce = _HELLO.unpack(bytes(hello))
        if magic != MAGIC_HELLO or reserved:
            raise AuthError(f"malformed HELLO: magic {magic!r} (expected {MAGIC_HELLO!r}) or "
                            "reserved field not zero")
        if version != HANDSHAKE_VERSION:
            raise AuthError(f"server speaks handshake version {version}, this host "
                            f"{HANDSHAKE_VERSION}", hint=VERSION_HINT)
        self._snonce = snonce
        mac = _client_mac(self._key, snonce, self._cnonce, self._fields())
        return (_AUTH.pack(MAGIC_AUTH, HANDSHAKE_VERSION, len(self._id), len(self._purpose),
                           len(self._store), 0, self._sender, self._incarnation,
                           self._cnonce, mac)
                + self._id + self._purpose + self._store)

    def _fields(self) -> bytes:
        return _fields(self._id, self._purpose, self._store, self._sender, self._incarnation)

    def check(self, ok: bytes) -> Peer:
        """Verify the server's OK; return the server as a :class:`Peer`."""
        if self._snonce is None:
            raise AuthError("OK received before HELLO was answered")
        ok = bytes(ok)
        if len(ok) < _OK.size:
            raise AuthError(f"malformed OK: {len(ok)} bytes, need at least {_OK.size}")
        magic, version, store_len, reserved, sender, inc, mac = _OK.unpack_from(ok, 0)
        if magic != MAGIC_OK or version != HANDSHAKE_VERSION or reserved:
            raise AuthError("malformed OK: wrong magic, version or reserved field")
        if not 1 <= store_len <= MAX_STORE_BYTES or len(ok) != _OK.size + store_len:
            raise AuthError(f"malformed OK: {len(ok)} bytes with a store of {store_len}")
        raw_store = ok[_OK.size:]
        expected = _server_mac(self._key, self._snonce, self._cnonce, self._fields(), sender,
                               inc, raw_store)
        if not hmac.compare_digest(mac, expected):
            raise AuthError("the server failed authentication (it does not hold this "
                            "host's secret, or the message was altered)")
        try:
            store = raw_store.decode("utf-8")
        except UnicodeDecodeError:   # (MAC'd: a peer holding the secret sent it so)
            raise AuthError("malformed OK: the store is not UTF-8") from None
        return Peer(self._server_id, self._purpose.decode("utf-8"), sender, inc, store)


# --------------------------------------------------------------------------- requests

def _request_mac(key: bytes, method: str, path: str, client_id: str, target: str,
                 store: str, ts_ms: int, nonce: bytes, body: bytes) -> bytes:
    msg = (_TAG_REQUEST + _lp(method.upper().encode("utf-8")) + _lp(path.encode("utf-8"))
           + _lp(client_id.encode("utf-8")) + _lp(target.encode("utf-8"))
           + _lp(store.encode("utf-8"))
           + struct.pack("<Q", ts_ms) + nonce + hashlib.sha256(body).digest())
    return hmac.new(key, msg, hashlib.sha256).digest()


def sign_request(secret: bytes | None, method: str, path: str, body: bytes, client_id: str,
                 *, target: str, store: str, now: float | None = None,
                 nonce: bytes | None = None) -> dict[str, str]:
    """The five authentication headers for an HTTP request to the bridge at ``target``
    (its member address as in hosts.txt, ``host:port``: the MAC names it, so the request
    is refused by every other host) for store ``store`` (the asker's --store, or the one
    an operator means: the MAC names it, and a bridge serving another refuses the
    request, :class:`StoreMismatch`). ``path`` includes the query string; ``now`` is
    wall-clock seconds (default ``time.time()``). O(len(body))."""
    _text("client_id", client_id, MAX_ID_BYTES)
    _text("target", target, MAX_ID_BYTES)
    _store_name(store)
    ts_ms = int(round((time.time() if now is None else now) * 1000))
    if nonce is None:
        nonce = new_nonce(REQUEST_NONCE_BYTES)
    if len(nonce) != REQUEST_NONCE_BYTES:
        raise InvalidArgument(f"nonce must be {REQUEST_NONCE_BYTES} bytes")
    mac = _request_mac(_key(secret), method, path, client_id, target, store, ts_ms, nonce,
                       body)
    return {HEADER_ID: client_id, HEADER_STORE: store, HEADER_TIME: str(ts_ms),
            HEADER_NONCE: nonce.hex(), HEADER_MAC: mac.hex()}


def _store_name(store: str) -> str:
    """``store`` if it is a store name (names.check_name: ASCII, so it passes in a
    header as it is); InvalidArgument otherwise."""
    return check_name(store)


def _response_mac(key: bytes, nonce: bytes, server_id: str, store: str, status: int,
                  etag: str, body: bytes) -> bytes:
    msg = (_TAG_RESPONSE + nonce + _lp(server_id.encode("utf-8"))
           + _lp(store.encode("utf-8")) + struct.pack("<H", status)
           + _lp(etag.encode("utf-8")) + hashlib.sha256(body).digest())
    return hmac.new(key, msg, hashlib.sha256).digest()


def sign_response(secret: bytes | None, request_headers: Mapping[str, str], server_id: str,
                  status: int, body: bytes, etag: str = "", *,
                  store: str) -> dict[str, str]:
    """The headers that authenticate the answer to a verified request: the store the
    answering bridge serves (``store``, its --store) and a MAC of the request's nonce (so
    it answers that request and no other), the answering host, that store, the status,
    the ``ETag`` (or "") and the body. O(len(body))."""
    nonce = _hex(_header(request_headers, HEADER_NONCE, 64), REQUEST_NONCE_BYTES,
                 HEADER_NONCE)
    mac = _response_mac(_key(secret), nonce, server_id, _store_name(store), status, etag,
                        body)
    return {HEADER_STORE: store, HEADER_RESPONSE_MAC: mac.hex()}


def check_response(secret: bytes | None, request_headers: Mapping[str, str], server_id: str,
                   status: int, response_headers: Mapping[str, str], body: bytes) -> None:
    """Raise :class:`AuthError` unless the response to the request signed with
    ``request_headers`` (sign_request) carries the MAC that ``server_id``, holding the
    secret, gives it (sign_response); then :class:`StoreMismatch` if the store that
    answer names (under its MAC) is not the one the request named: the answer is of a
    bridge of another store (a 409 refusal, or any answer at all).  Check it before
    using anything of the response: any process listening on a member's address can
    answer. O(len(body))."""
    nonce = bytes.fromhex(request_headers[HEADER_NONCE])
    asked = request_headers[HEADER_STORE]
    etag = response_headers.get("ETag", "")
    mac = _hex(_header(response_headers, HEADER_RESPONSE_MAC, 128), MAC_BYTES,
               HEADER_RESPONSE_MAC)
    if not isinstance(etag, str) or len(etag) > 1024 or not etag.isascii():
        # (aiohttp hands header bytes that are not UTF-8 on as lone surrogates, which
        # raised UnicodeEncodeError in the MAC; every ETag a bridge gives is ASCII)
        raise AuthError(f"the answer of {server_id} has a malformed ETag header")
    serves = _store_header(response_headers)
    expected = _response_mac(_key(secret), nonce, server_id, serves, status, etag, body)
    if not hmac.compare_digest(mac, expected):
        raise AuthError(f"the answer of {server_id} failed authentication (it does not hold "
                        "this host's secret, or the answer was altered)")
    if serves != asked:   # (authentic: the MAC covers the store the answer names)
        raise StoreMismatch(f"the bridge at {server_id} serves store {serves!r}, not "
                            f"{asked!r}: it refused the request (or answered for another "
                            "store)", asked=asked, serves=serves)


def _lookup(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:  # plain dicts are case-sensitive; aiohttp's CIMultiDict is not
        low = name.lower()
        for k, v in headers.items():
            if k.lower() == low:
                return v
    return value


def _header(headers: Mapping[str, str], name: str, limit: int) -> str:
    value = _lookup(headers, name)
    if value is None:
        raise AuthError(f"request has no {name} header (unauthenticated)")
    if not isinstance(value, str) or len(value) > limit or not value.isascii():
        raise AuthError(f"malformed {name} header")
    return value


def _store_header(headers: Mapping[str, str]) -> str:
    """The X-Shmps-Store header of a request or an answer: a store name (check_name), or
    AuthError.  (Under the MAC, but the MAC only says who sent it: a signer that does
    not check it, with the empty key anyone on loopback, could name store '' or a
    terminal escape, which a 409 and the logs then repeated.)"""
    store = _header(headers, HEADER_STORE, MAX_STORE_BYTES)
    try:
        return check_name(store)
    except InvalidArgument:
        raise AuthError(f"malformed {HEADER_STORE} header: {store!r} is not a store name "
                        "(1 to 64 characters from A-Z a-z 0-9 _ . -)") from None


def _hex(value: str, nbytes: int, name: str) -> bytes:
    if len(value) != 2 * nbytes or any(c not in "0123456789abcdefABCDEF" for c in value):
        raise AuthError(f"malformed {name} header: expected {2 * nbytes} hex digits")
    return bytes.fromhex(value)


class RequestVerifier:
    """Checks per-request MACs, the timestamp window and nonce replays.

    Memory is bounded by ``max_nonces`` remembered nonces; nonces are forgotten once their
    timestamp leaves the window (after which the timestamp check refuses them anyway).
    When the cache is full of in-window nonces, new requests are refused (fail closed).
    ``verify`` is O(len(body) + log(max_nonces)) amortized.
    """

    def __init__(self, secret: bytes | None, address: str, *, store: str,
                 window: float = REQUEST_WINDOW, max_nonces: int = 65536,
                 clock: Callable[[], float] = time.time) -> None:
        if not window > 0:
            raise InvalidArgument(f"window must be > 0, got {window!r}")
        if max_nonces < 1:
            raise InvalidArgument(f"max_nonces must be >= 1, got {max_nonces!r}")
        self._key = _key(secret)
        self.address = address    #: this host's member address: the target requests sign
        self.store = _store_name(store)   #: the store this host serves: requests sign it
        self.window = float(window)
        self.max_nonces = int(max_nonces)
        self._clock = clock
        self._seen: set[bytes] = set()
        self._expiry: list[tuple[float, bytes]] = []   # heap of (forget-at, nonce)

    def __len__(self) -> int:
        """Nonces currently remembered."""
        return len(self._seen)

    def _forget(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] < now:
            _, nonce = heapq.heappop(self._expiry)
            self._seen.discard(nonce)

    def verify(self, method: str, path: str, headers: Mapping[str, str], body: bytes, *,
               now: float | None = None) -> str:
        """Return the authenticated client id, or raise :class:`AuthError` naming the check
        that failed (missing/malformed header, bad MAC, expired, replayed, cache full);
        or, for a request that passes them all and is for another store than this
        host's, :class:`StoreMismatch` (its nonce is remembered: it is not taken later
        either)."""
        t = self._clock() if now is None else now
        client_id = _header(headers, HEADER_ID, 4 * MAX_ID_BYTES)
        ts_text = _header(headers, HEADER_TIME, 20)
        if not ts_text.isascii() or not ts_text.isdigit():
            raise AuthError(f"malformed {HEADER_TIME} header: expected milliseconds since 1970")
        ts_ms = int(ts_text)
        if ts_ms >= 1 << 64:
            raise AuthError(f"malformed {HEADER_TIME} header: out of range")
        if _lookup(headers, HEADER_STORE) is None:
            # (the other headers there and this one not: what a bridge or tool of the
            # release before the store was signed sends, each catalog pass, for good)
            raise AuthError(f"request {method} {path} from {client_id!r} names no store "
                            f"(no {HEADER_STORE} header), as a bridge or tool of an older "
                            "shmps release does", hint=VERSION_HINT)
        store = _store_header(headers)
        nonce = _hex(_header(headers, HEADER_NONCE, 64), REQUEST_NONCE_BYTES, HEADER_NONCE)
        mac = _hex(_header(headers, HEADER_MAC, 128), MAC_BYTES, HEADER_MAC)
        expected = _request_mac(self._key, method, path, client_id, self.address, store,
                                ts_ms, nonce, body)
        if not hmac.compare_digest(mac, expected):
            raise AuthError(f"request {method} {path} from {client_id!r} failed authentication "
                            "(wrong secret, signed for another host than "
                            f"{self.address}, or the request was altered)")
        ts = ts_ms / 1000.0
        if abs(t - ts) > self.window:
            raise AuthError(f"request {method} {path} from {client_id!r} expired: its "
                            f"timestamp is {t - ts:+.1f} s from this host's clock (window "
                            f"{self.window:g} s)")
        self._forget(t)
        if nonce in self._seen:
            raise AuthError(f"request {method} {path} from {client_id!r} replayed (nonce seen "
                            "before)")
        if len(self._seen) >= self.max_nonces:
            raise AuthError(f"too many requests within {self.window:g} s "
                            f"({self.max_nonces} remembered); refusing rather than forgetting")
        self._seen.add(nonce)
        heapq.heappush(self._expiry, (ts + self.window, nonce))
        if store != self.store:
            # (after the MAC: the store is the asker's own claim, so the refusal can name
            # it and be signed; the caller answers 409 before it does anything)
            raise StoreMismatch(f"request {method} {path} from {client_id!r} is for store "
                                f"{store!r}; this host serves {self.store!r}",
                                asked=store, serves=self.store)
        return client_id


__all__ = ["AuthError", "ClientHandshake", "HEADER_ID", "HEADER_MAC", "HEADER_NONCE",
           "HEADER_STORE", "HEADER_TIME", "NONCE_BYTES", "Peer", "RequestVerifier",
           "SECRET_MIN_BYTES", "ServerHandshake", "StoreMismatch", "check_bind",
           "check_response", "is_loopback", "load_secret",
           "new_nonce", "sign_request", "sign_response"]
