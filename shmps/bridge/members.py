"""Membership: ``hosts.txt``, member states from heartbeats, epochs, majority, file watch.

``hosts.txt`` lists the configured members, one ``host:port`` a line (``#`` starts a
comment; IPv6 as ``[::1]:7070``). :class:`Membership` is pure logic: it is fed heartbeat
times and clock ticks and answers which members are alive, which are on the ring, the
epoch, and whether this host reaches a majority. It does no I/O and reads no clock unless
``now`` is omitted (then its injectable ``clock`` is used), so it is tested with exact
timelines.

Member states and what moves them:

==========  ==========================================  =========
from        event                                       to
==========  ==========================================  =========
alive       silent for ``suspect_after``                suspect
suspect     heartbeat                                   alive
any         silent for ``dead_after`` (not self)        dead
dead        heartbeat                                   joining
joining     :meth:`Membership.mark_ready`               alive
alive       :meth:`Membership.mark_leaving` / removed   leaving
leaving     :meth:`Membership.remove`                   dead (or dropped)
==========  ==========================================  =========

- ``alive``: heard from within ``suspect_after``.
- ``suspect``: silent for ``suspect_after`` (default ``dead_after / 2``); still owns its
  shards (a late heartbeat must not cause a failover).
- ``dead``: silent for ``dead_after`` (default 0.5 s, so the ring changes and the next
  host takes over well within 1 s of a death).
- ``joining``: newly configured, or back from ``dead`` when its death changed the ring
  of an epoch (or its process restarted): it copies its shards first and is not on the
  ring until :meth:`Membership.mark_ready`.  A member this host counted dead while it
  had no majority (no epoch was minted, so no shard moved) is ``alive`` again when heard.
- ``leaving``: handing its shards over; still on the ring until :meth:`Membership.remove`
  (or until it dies).

The **live set** (members on the ring) is alive + suspect + leaving. The **epoch** bumps
by one whenever the live set differs from the one the current epoch stands for
(:attr:`Membership.epoch_live`) while a majority of the members was heard from within
``suspect_after`` (:meth:`Membership.can_mint`: suspects do not count) and this host is
on the ring itself (a host cut off from the majority, or a joining one, changes its view
but mints no epoch, so it cannot come back with an epoch that overrides the majority's;
nor does one for ``dead_after`` after it got a majority back, while the heartbeats TCP
delivers first may be stale: :attr:`Membership.mint_held_until`; nor for ``dead_after``
after a heartbeat of a newer epoch that counts it out: :meth:`Membership.hold_mints`), and
never goes down, nor past ``frames.MAX_EPOCH``, the highest a frame carries.
A host that hears a majority member with a higher epoch takes over that member's view
with :meth:`Membership.adopt`.
"""
from __future__ import annotations

import asyncio
import hashlib
import inspect
import ipaddress
import logging
import os
import re
import stat
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Awaitable, Callable, Iterable, Mapping, Union

from ..errors import Error, InvalidArgument
from .frames import MAX_EPOCH
from .ring import stable_hash64

log = logging.getLogger("shmps.bridge")

DEAD_AFTER = 0.5
"""Seconds of silence after which a member is dead (failover then fits in 1 s)."""

HEARTBEAT_INTERVAL = 0.1
"""Recommended heartbeat period: a fifth of :data:`DEAD_AFTER`."""

MAX_HOSTS_BYTES = 1 << 20
"""A hosts file larger than this is refused (it is a list of addresses)."""

_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")
_PORT = re.compile(r"[0-9]{1,5}\Z")


class State(str, Enum):
    """A member's state, as seen by this host."""

    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    JOINING = "joining"
    LEAVING = "leaving"

    @property
    def code(self) -> int:
        """The one-byte code used in heartbeat frames (1..5)."""
        return _STATE_CODES[self]

    @classmethod
    def from_code(cls, code: int) -> State:
        """The state of a heartbeat code; :class:`InvalidArgument` if unknown."""
        try:
            return _CODE_STATES[code]
        except KeyError:
            raise InvalidArgument(f"unknown member state code {code}") from None


_STATE_CODES = {State.ALIVE: 1, State.SUSPECT: 2, State.DEAD: 3, State.JOINING: 4,
                State.LEAVING: 5}
_CODE_STATES = {v: k for k, v in _STATE_CODES.items()}
ON_RING = frozenset({State.ALIVE, State.SUSPECT, State.LEAVING})


# --------------------------------------------------------------------------- addresses

def parse_address(text: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6) into a normalized host and a port.

    Hostnames are lower-cased; IP addresses take their canonical form (``[::1]``).
    Raises :class:`InvalidArgument` saying what is wrong. O(len(text)).
    """
    if not isinstance(text, str):
        raise InvalidArgument(f"an address must be a string, got {type(text).__name__}")
    if len(text) > 300:
        raise InvalidArgument("address is longer than 300 characters")
    if "://" in text:
        # (a URL pasted from a browser or `curl http://...`: it was told to write IPv6
        # addresses in brackets, the scheme's colon taken for an IPv6 address's)
        raise InvalidArgument(f"{text!r} is a URL; write host:port: "
                              f"{text.split('://', 1)[1].split('/', 1)[0]!r}")
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1:end + 2] != ":":
            raise InvalidArgument(f"{text!r} is not [ipv6]:port")
        host_part, port_part = text[1:end], text[end + 2:]
        try:
            host = str(ipaddress.IPv6Address(host_part))
        except ValueError:
            raise InvalidArgument(f"{host_part!r} in {text!r} is not an IPv6 address") from None
        host = f"[{host}]"
    else:
        host_part, sep, port_part = text.rpartition(":")
        if not sep or not host_part:
            raise InvalidArgument(f"{text!r} is not host:port")
        if ":" in host_part:
            raise InvalidArgument(f"{text!r}: write IPv6 addresses in brackets, e.g. [::1]:7070")
        host = _normalize_host(host_part, text)
    if not _PORT.match(port_part) or not 1 <= int(port_part) <= 65535:
        raise InvalidArgument(f"port {port_part!r} in {text!r} is not a number in 1..65535")
    return host, int(port_part)


def _normalize_host(host: str, text: str) -> str:
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", host):
        raise InvalidArgument(f"{host!r} in {text!r} is not an IPv4 address")
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253 or not all(_LABEL.match(label) for label in name.split(".")):
        raise InvalidArgument(f"{host!r} in {text!r} is not a valid host name")
    return name.lower()


def normalize_address(text: str) -> str:
    """``host:port`` in canonical form (see :func:`parse_address`). O(len(text))."""
    host, port = parse_address(text)
    return f"{host}:{port}"


def address_host(address: str) -> str:
    """The host of ``address`` without brackets (what a socket binds to). O(len)."""
    return socket_address(address)[0]


def socket_address(address: str) -> tuple[str, int]:
    """(host, port) of ``address`` for a socket to bind or dial: an IPv6 host without
    its brackets ("[::1]:7070" is ("::1", 7070)). O(len)."""
    host, port = parse_address(address)
    return (host[1:-1] if host.startswith("[") else host), port


def http_url(address: str, path: str) -> str:
    """The URL of ``path`` on the bridge at ``address`` (an IPv6 host keeps its
    brackets, as URLs write it). O(len)."""
    host, port = parse_address(address)
    return f"http://{host}:{port}{path}"


def member_id(address: str) -> int:
    """A member's 32-bit id in frames: the top 32 bits of ``stable_hash64(address)``. O(len)."""
    return stable_hash64(address) >> 32


def parse_hosts(text: str, source: str = "hosts.txt") -> list[str]:
    """The members listed in ``text`` (hosts.txt syntax), normalized, in file order.

    Raises :class:`InvalidArgument` naming ``source`` and the line number for a malformed
    line or a duplicate (after normalization, so ``Host:80`` repeats ``host:80``).
    O(len(text)).
    """
    found: dict[str, int] = {}
    ids: dict[int, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if any(c.isspace() for c in line):
            raise InvalidArgument(f"{source} line {lineno}: {line!r} holds more than one "
                                  "address; write one host:port a line",
                                  hint="one host:port a line; # starts a comment")
        try:
            addr = normalize_address(line)
        except InvalidArgument as e:
            raise InvalidArgument(f"{source} line {lineno}: {e.message}",
                                  hint="one host:port a line; # starts a comment") from None
        if addr in found:
            raise InvalidArgument(f"{source} line {lineno}: {addr} is already listed on line "
                                  f"{found[addr]}", hint="list each member once")
        mid = member_id(addr)
        if mid in ids:  # two addresses with one 32-bit id: frames could not tell them apart
            raise InvalidArgument(f"{source} line {lineno}: {addr} has the same member id as "
                                  f"{ids[mid]}", hint="use another port for one of them")
        found[addr] = lineno
        ids[mid] = addr
    return list(found)


def _read_regular(path: str, limit: int) -> bytes:
    """Up to ``limit`` bytes of ``path``, which must be a regular file: it is opened
    non-blocking, so a FIFO is refused (:class:`InvalidArgument`) instead of blocking
    the caller until a writer comes (the bridge's event loop, for the watch).  OSError
    as it is. O(limit)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidArgument(f"hosts file {path} is not a regular file",
                                  hint="pass --peers with a regular file, one host:port a line")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit)
    finally:
        os.close(fd)


def read_hosts(path: str | os.PathLike[str]) -> list[str]:
    """Read and parse a hosts file (at most :data:`MAX_HOSTS_BYTES`), a regular file.
    O(file size)."""
    name = os.fspath(path)
    try:
        data = _read_regular(name, MAX_HOSTS_BYTES + 1)
    except OSError as e:
        raise InvalidArgument(f"cannot read hosts file {name}: {e.strerror}",
                              hint="pass --peers with a readable file") from None
    if len(data) > MAX_HOSTS_BYTES:
        raise InvalidArgument(f"hosts file {name} is larger than {MAX_HOSTS_BYTES} bytes",
                              hint="hosts.txt holds one host:port a line")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise InvalidArgument(f"{name} line {line}: not UTF-8 text",
                              hint="hosts.txt holds one host:port a line") from None
    return parse_hosts(text, source=name)


# --------------------------------------------------------------------------- membership

@dataclass(frozen=True)
class Change:
    """One member's state change; ``None`` means "not a member" (added or dropped)."""

    member: str
    old: State | None
    new: State | None


class Membership:
    """Member states driven by heartbeat times; epoch; majority test. No I/O.

    Every method that may change states returns the list of :class:`Change` it made, and
    bumps :attr:`epoch` by one if the live set changed. Costs are O(n) per call for n
    members unless noted.
    """

    def __init__(self, members: Iterable[str], self_addr: str | None = None, *,
                 dead_after: float = DEAD_AFTER, suspect_after: float | None = None,
                 allow_minority: bool = False, joining: bool = False,
                 now: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        configured = list(members)
        if len(set(configured)) != len(configured):
            raise InvalidArgument("a member is listed twice", hint="list each member once")
        if not dead_after > 0:
            raise InvalidArgument(f"dead_after must be > 0, got {dead_after!r}")
        if suspect_after is None:
            suspect_after = dead_after / 2
        if not 0 < suspect_after <= dead_after:
            raise InvalidArgument(f"suspect_after must be in (0, dead_after], got {suspect_after!r}")
        if self_addr is not None and self_addr not in configured:
            raise InvalidArgument(f"this host ({self_addr}) is not in the member list",
                                  hint="add this host's --listen address to hosts.txt")
        self._clock = clock
        t = self._now(now)
        self._t = t                      # the latest time an operation was given (can_mint)
        self.dead_after = float(dead_after)
        self.suspect_after = float(suspect_after)
        self.allow_minority = bool(allow_minority)
        self.self_addr = self_addr
        self._configured: tuple[str, ...] = tuple(configured)
        self._state: dict[str, State] = {m: State.ALIVE for m in configured}
        # live(), reachable() and has_quorum() of the current states and configured
        # list, kept until one changes (_set, set_members): the bridge asks for them for
        # every frame it handles
        self._views: dict[str, Any] = {}
        self._seen: dict[str, float] = {m: t for m in configured}
        if joining and self_addr is not None:
            self._state[self_addr] = State.JOINING
        self.epoch = 0
        #: no epoch is minted before this time (clock units): this host got its majority
        #: back then, and the first heartbeats heard may be stale (_apply)
        self.mint_held_until = float("-inf")
        #: the newest epoch whose heartbeat held this host's mints (hold_mints)
        self._mints_held_for = -1
        #: the live set the current epoch stands for: the ring a majority agreed on, as
        #: this host knows it.  A member counted dead without a majority is still in it.
        self.epoch_live: frozenset[str] = frozenset(self.live())

    # ---------------------------------------------------------------- queries
    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else float(now)

    def _time(self, now: float | None) -> float:
        """``now`` (or the clock's), kept as the latest time an operation was given."""
        t = self._now(now)
        self._t = max(self._t, t)
        return t

    @property
    def configured(self) -> tuple[str, ...]:
        """The configured members (hosts.txt), the base of the majority. O(1)."""
        return self._configured

    def state(self, member: str) -> State:
        """``member``'s state; :class:`InvalidArgument` if it is not a member. O(1)."""
        try:
            return self._state[member]
        except KeyError:
            raise InvalidArgument(f"{member} is not a member") from None

    def states(self) -> dict[str, State]:
        """Every tracked member (configured, plus leaving ones) and its state. O(n)."""
        return dict(self._state)

    def live(self) -> tuple[str, ...]:
        """The members on the ring (alive, suspect, leaving), sorted. O(n log n)."""
        v = self._views.get("live")
        if v is None:
            v = self._views["live"] = tuple(sorted(m for m, s in self._state.items()
                                                   if s in ON_RING))
        return v

    def reachable(self) -> frozenset[str]:
        """Members heard from within ``dead_after`` (every state but dead), self included.
        O(1) while no state changed, else O(n)."""
        v = self._views.get("reachable")
        if v is None:
            v = self._views["reachable"] = frozenset(m for m, s in self._state.items()
                                                     if s is not State.DEAD)
        return v

    def last_seen(self, member: str) -> float:
        """When ``member`` was last heard from (clock units). O(1)."""
        self.state(member)
        return self._seen[member]

    def has_quorum(self, reachable: Iterable[str] | None = None) -> bool:
        """True if ``reachable`` (default :meth:`reachable`) holds a strict majority of the
        configured members, or ``allow_minority`` is set. O(n)."""
        if self.allow_minority:
            return True
        if reachable is None:
            v = self._views.get("quorum")
            if v is None:
                v = self._views["quorum"] = self._majority(self.reachable())
            return bool(v)
        return self._majority(reachable)

    def can_mint(self) -> bool:
        """True if the members heard from within ``suspect_after`` (every state but dead
        and suspect, self included) hold a strict majority of the configured members, or
        ``allow_minority`` is set: the majority an epoch is minted with.  Stricter than
        :meth:`has_quorum` (which counts suspects), so that a host cut off from the
        others, which counts them dead one at a time, mints nothing: when the first
        goes dead the second has been silent almost as long, so it is suspect, not a
        member of a majority with this host.  (Counted in, it made a majority of 3 with
        the cut-off host, which minted the epoch number the real majority minted too,
        for another ring; back, it minted the next one with a peer it counted joining
        and the majority took that ring over: every host but it joining, its stale
        copies owning every shard, flushes that never returned.  A network cut test,
        2026-11-26.)  Heard means by time too, not only by state: a joining member is
        never made suspect, and one silent since counted for a cut-off host's mint in
        the flapping network test.  The time is the latest one an operation was given
        (``now``, or the clock's). O(n)."""
        if self.allow_minority:
            return True
        return self._majority(
            m for m, s in self._state.items()
            if s not in (State.DEAD, State.SUSPECT)
            and (m == self.self_addr or self._t - self._seen[m] < self.suspect_after))

    def _majority(self, reachable: Iterable[str]) -> bool:
        base = set(self._configured)
        return 2 * len(set(reachable) & base) > len(base)

    # ---------------------------------------------------------------- transitions
    def _apply(self, changes: list[Change]) -> list[Change]:
        # Against the epoch's live set, not the one before this change: a ring changed
        # without a majority (a member counted dead alone) was never the epoch's, so
        # when the majority is back the epoch bumps for it, unless the members came back
        # and the ring is the epoch's again (then nothing moved: no bump).
        live = self._views.get("live_set")
        if live is None:
            live = self._views["live_set"] = frozenset(self.live())
        # Only a host on the ring mints: a joining one (copying its shards, owning none)
        # that counted a slow peer dead minted an epoch the majority never takes over (its
        # heartbeats carry no quorum flag), and then ignored the majority's heartbeats of
        # the lower epoch it should follow: it copied from a ring of its own for good
        if (live != self.epoch_live and self.can_mint() and self._t >= self.mint_held_until
                and (self.self_addr is None or self.self_addr in live)):
            if self.epoch < MAX_EPOCH:
                self.epoch += 1
                self.epoch_live = live
            elif changes:   # (logged with the change, not at every tick after it)
                # no frame carries a higher one (frames.MAX_EPOCH): minted, every frame
                # encoded after it would raise.  Reached only by taking over a peer's
                # epoch at the bound (1000 mints a second take 146 million years)
                log.error("epoch %d is the last a frame can carry (frames.MAX_EPOCH): no "
                          "epoch is minted for this change; restart every bridge of the "
                          "cluster to start again from epoch 0", self.epoch)
        for c in changes:
            log.info("member %s: %s -> %s (epoch %d)", c.member,
                     c.old.value if c.old else "none", c.new.value if c.new else "none",
                     self.epoch)
        return changes

    def _set(self, changes: list[Change], member: str, new: State | None) -> None:
        old = self._state.get(member)
        if old is new:
            return
        self._views.clear()
        if new is None:
            del self._state[member]
            del self._seen[member]
        else:
            self._state[member] = new
        changes.append(Change(member, old, new))

    def heartbeat(self, member: str, now: float | None = None) -> list[Change]:
        """Record a heartbeat from ``member`` at ``now``.

        suspect -> alive; dead -> joining (it must copy its shards again), or -> alive if
        it is on the epoch's ring (:attr:`epoch_live`): this host counted it dead without
        a majority, so no epoch was minted and no shard moved.  (Made joining, a member
        of a two-host cluster that the other took for dead under load stayed joining
        for good: it does not copy its shards unless a majority of the members says
        so, and one peer of two is not; meanwhile the other, its quorum back through
        the joining member, owned every shard on a ring of itself, with no backup to
        wait for, and when both did, both owned.) A heartbeat from a non-member is
        ignored (``[]``). O(n) (the live-set comparison).
        """
        if member not in self._state:
            return []
        t = self._time(now)
        self._seen[member] = max(self._seen[member], t)
        changes: list[Change] = []
        s = self._state[member]
        if s is State.SUSPECT:
            self._set(changes, member, State.ALIVE)
        elif s is State.DEAD:
            quorum = self.has_quorum()
            self._set(changes, member,
                      State.ALIVE if member in self.epoch_live else State.JOINING)
            if not quorum and self.has_quorum():
                # A host that gets its majority back this way mints nothing for
                # dead_after: the first heartbeat heard after a cut may be one the peer
                # sent early in it, which TCP delivers now.  Counted joining, the peer
                # made a majority with this host, which minted the next epoch on a ring
                # of itself at once, before the peer's newer heartbeats (its ring, of
                # this host's epoch number, which a majority held) could be taken over;
                # the majority took this host's ring over instead, and its copies, from
                # before the cut, owned every shard (the flapping network test,
                # 2026-11-26).  A mint still due is made by a later call (tick).
                self.mint_held_until = t + self.dead_after
        return self._apply(changes)

    def tick(self, now: float | None = None) -> list[Change]:
        """Advance time to ``now``: silent members become suspect, then dead.

        A dead member that is no longer configured (it was leaving) is dropped. This host
        itself never goes silent. O(n).
        """
        t = self._time(now)
        changes: list[Change] = []
        for m, s in list(self._state.items()):
            if m == self.self_addr or s is State.DEAD:
                continue
            silence = t - self._seen[m]
            if silence >= self.dead_after:
                self._set(changes, m, State.DEAD if m in self._configured else None)
            elif silence >= self.suspect_after and s is State.ALIVE:
                self._set(changes, m, State.SUSPECT)
        return self._apply(changes)

    def hold_mints(self, epoch: int, now: float | None = None) -> None:
        """Mint no epoch for ``dead_after`` from ``now``: a peer's heartbeat of the newer
        ``epoch`` counts this host dead or joining, so the cluster moved on without it,
        and an epoch minted here would be on this host's stale view, with a number the
        others may have minted for their own ring.  Once for each such epoch number: held
        again by every heartbeat, a host behind a joiner whose ring's owner then died
        never minted, and two live hosts of three never acted again.  A mint still due
        after that is made by a later call (tick). O(1)."""
        if epoch <= max(self.epoch, self._mints_held_for):
            return
        self._mints_held_for = epoch
        self.mint_held_until = max(self.mint_held_until, self._time(now) + self.dead_after)

    def mark_dead(self, member: str) -> list[Change]:
        """``member`` is gone before ``dead_after`` (its connections were closed by its
        kernel: the process died): dead now, as :meth:`tick` would make it later. O(n)."""
        changes: list[Change] = []
        if member != self.self_addr and self.state(member) is not State.DEAD:
            self._set(changes, member, State.DEAD if member in self._configured else None)
        return self._apply(changes)

    def mark_ready(self, member: str) -> list[Change]:
        """``member`` finished copying its shards: joining -> alive (it joins the ring).
        No change in any other state. O(n)."""
        changes: list[Change] = []
        if self.state(member) is State.JOINING:
            self._set(changes, member, State.ALIVE)
        return self._apply(changes)

    def mark_joining(self, member: str) -> list[Change]:
        """``member`` must (re)copy its shards before owning any: it leaves the ring (a
        dead one is joining at once: call this only when hearing from it, e.g. a new
        incarnation's heartbeat), so it counts as heard at the latest time this
        Membership was given (:meth:`can_mint`). O(n)."""
        changes: list[Change] = []
        self.state(member)   # InvalidArgument unless a member
        self._seen[member] = max(self._seen[member], self._t)
        self._set(changes, member, State.JOINING)
        return self._apply(changes)

    def mark_leaving(self, member: str) -> list[Change]:
        """``member`` hands its shards over (stays on the ring until :meth:`remove`). O(n)."""
        changes: list[Change] = []
        if self.state(member) in (State.ALIVE, State.SUSPECT):
            self._set(changes, member, State.LEAVING)
        elif self.state(member) is State.JOINING:  # owns nothing yet: just stop tracking it
            self._set(changes, member, State.DEAD if member in self._configured else None)
        return self._apply(changes)

    def remove(self, member: str) -> list[Change]:
        """``member`` finished leaving: off the ring (dead if still configured). O(n)."""
        changes: list[Change] = []
        self.state(member)
        self._set(changes, member, State.DEAD if member in self._configured else None)
        return self._apply(changes)

    def set_members(self, members: Iterable[str], now: float | None = None) -> list[Change]:
        """Adopt a new configured list (hosts.txt edited, or a join/leave request).

        New members start ``joining`` (with ``dead_after`` of grace to be heard from);
        removed ones on the ring start ``leaving``, the others are dropped; a re-added
        leaving member is ``alive`` again. O(n).
        """
        new = list(members)
        if len(set(new)) != len(new):
            raise InvalidArgument("a member is listed twice", hint="list each member once")
        t = self._time(now)
        changes: list[Change] = []
        old_cfg = set(self._configured)
        self._configured = tuple(new)
        self._views.clear()
        for m in new:
            if m not in self._state:
                self._seen[m] = t
                self._set(changes, m, State.JOINING)
            elif m not in old_cfg and self._state[m] is State.LEAVING:
                self._set(changes, m, State.ALIVE)
        for m in old_cfg - set(new):
            s = self._state.get(m)
            if s in (State.ALIVE, State.SUSPECT):
                self._set(changes, m, State.LEAVING)
            elif s in (State.DEAD, State.JOINING):
                self._set(changes, m, None)
        return self._apply(changes)

    def adopt(self, view: Mapping[str, State], epoch: int,
              now: float | None = None, *, same_epoch: bool = False) -> list[Change]:
        """Take over a majority peer's ``view`` (member -> state, from its heartbeat) and
        its ``epoch``, if that epoch is higher than this host's; else change nothing.

        Used by a host that was cut off (paused, partitioned): members the view has alive
        count as just heard from; this host itself becomes ``joining`` if the view has it
        dead or joining (it must copy its shards again), and ``alive`` if the view has it
        suspect (it is never suspect to itself). Members this host does not track
        are ignored. The epoch becomes ``epoch`` (no bump of its own). With ``same_epoch``
        a view of this host's own epoch is adopted too (a joining host follows the
        majority it is copying from). O(n).
        """
        if epoch < self.epoch or (epoch == self.epoch and not same_epoch):
            return []
        t = self._time(now)
        changes: list[Change] = []
        for m, s in view.items():
            if m not in self._state:
                continue
            if m == self.self_addr:
                if s in (State.DEAD, State.JOINING):
                    s = State.JOINING
                elif s is State.SUSPECT:
                    # the peer had not heard from this host for a while (it was cut off
                    # for less than dead_after); this host hears itself.  Taken over as
                    # is, it stayed suspect to itself for good: no heartbeat of its own
                    # ever made it alive (the flapping network test, 2026-11-26)
                    s = State.ALIVE
            elif s is not State.DEAD:
                self._seen[m] = max(self._seen[m], t)
            self._set(changes, m, s)
        self.epoch = int(epoch)
        self.epoch_live = frozenset(self.live())   # the view that epoch stands for
        return self._apply(changes)

    def rejoin(self) -> list[Change]:
        """This host must copy its shards again (the majority's view, at this host's epoch,
        has it joining): it leaves the ring without minting an epoch. O(n)."""
        if self.self_addr is None:
            return []
        changes: list[Change] = []
        if self._state.get(self.self_addr) in (State.ALIVE, State.SUSPECT):
            self._set(changes, self.self_addr, State.JOINING)
            self.epoch_live = frozenset(self.live())   # the majority's ring at this epoch
        for c in changes:
            log.info("member %s: %s -> %s (epoch %d)", c.member, c.old.value if c.old else
                     "none", c.new.value if c.new else "none", self.epoch)
        return changes

    def observe_epoch(self, epoch: int) -> bool:
        """Raise the epoch to a peer's ``epoch`` if higher; True if it was raised. O(1)."""
        if epoch > self.epoch:
            self.epoch = int(epoch)
            return True
        return False

    def snapshot(self) -> Mapping[str, object]:
        """A JSON-ready view for ``/health``: epoch, quorum, and each member's state. O(n)."""
        return {"epoch": self.epoch, "quorum": self.has_quorum(),
                "members": [{"address": m, "state": s.value} for m, s in sorted(self._state.items())]}


# --------------------------------------------------------------------------- file watch

FileCallback = Callable[[bytes], Union[None, Awaitable[None]]]


def _signature(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)


async def _watch(path: str, callback: FileCallback, interval: float, racy: float,
                 settle: float) -> None:
    sig = _signature(path)
    digest: bytes | None = None
    read_at = 0.0
    pending: tuple[bytes, float] | None = None   # (digest, first seen) of unsettled content
    refused: tuple[int, int, int, int] | None = None   # a non-regular file, said once
    if sig is not None:
        try:
            digest = hashlib.blake2b(_read_regular(path, MAX_HOSTS_BYTES + 1)).digest()
            read_at = time.time()
        except (OSError, InvalidArgument):
            sig = None
    while True:
        await asyncio.sleep(interval)
        new_sig = _signature(path)
        if new_sig is None:
            sig = None
            continue
        # Racy-clean rule (as git's index): a file modified within `racy` seconds of our
        # last read may have changed again within the mtime granularity, so re-read it.
        if pending is None and new_sig == sig and new_sig[0] / 1e9 < read_at - racy:
            continue
        if new_sig == refused:
            continue
        try:
            data = _read_regular(path, MAX_HOSTS_BYTES + 1)
        except OSError:
            continue
        except InvalidArgument as e:   # (a FIFO: opening it blocked the event loop)
            refused = new_sig
            log.error("%s; keeping the previous configuration", e)
            continue
        read_at = time.time()
        sig = new_sig
        new_digest = hashlib.blake2b(data).digest()
        if new_digest == digest:
            pending = None   # back to what was applied
            continue
        # a change counts once it has stayed the same for `settle` s: an editor or a
        # script that truncates the file and then writes it is not seen half way
        now = time.monotonic()
        if pending is None or pending[0] != new_digest:
            pending = (new_digest, now)
            if settle > 0:
                continue
        elif now - pending[1] < settle:
            continue
        pending = None
        digest = new_digest
        try:
            result = callback(data)
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except Error as e:  # a bad edit must not stop the watch: say why, keep the old config
            log.error("%s: %s; keeping the previous configuration", path, e)
        except Exception:
            log.exception("callback for %s failed; keeping the previous configuration", path)


def watch_file(path: str | os.PathLike[str], callback: FileCallback, interval: float = 1.0,
               *, racy: float = 2.0, settle: float = 0.0) -> asyncio.Task[None]:
    """Poll ``path`` every ``interval`` seconds; call ``callback(content)`` when it changes
    and the new content has stayed the same for ``settle`` seconds (read again each
    poll meanwhile: a file truncated and then rewritten is not reported half way).

    Returns the asyncio task (cancel it to stop); must be called with a running loop.
    A change is detected by (mtime, size, inode) and confirmed by a BLAKE2b content hash,
    so touching the file without changing it calls nothing, while a same-size rewrite
    within the mtime granularity is still seen (the file is re-read while its mtime is
    within ``racy`` seconds of the last read). The callback (sync or async) runs for
    changes after the start, not for the initial content; its exceptions are logged and
    watching goes on. A missing file is waited for. O(file size) per read, O(1) per poll.
    """
    if not interval > 0:
        raise InvalidArgument(f"interval must be > 0, got {interval!r}")
    name = os.fspath(path)
    return asyncio.get_running_loop().create_task(
        _watch(name, callback, float(interval), float(racy), float(settle)),
        name=f"watch {name}")


__all__ = ["Change", "DEAD_AFTER", "HEARTBEAT_INTERVAL", "MAX_HOSTS_BYTES", "Membership",
           "ON_RING", "State", "address_host", "member_id", "normalize_address",
           "parse_address", "parse_hosts", "read_hosts", "watch_file"]
