"""``shmps-bridge``: the per-host bridge process (see docs/bridge-protocol.md).

    shmps-bridge --peers hosts.txt --store model [--listen HOST:PORT] [--replicas 2]
                 [--secret-file F] [--namespace NS] [--flush-ms 5] [--allow-minority]

Every bad argument is one line on stderr and exit status 2, without a traceback.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import socket
import sys
from typing import Optional, Sequence

from ..cli_args import MAX_SECONDS, at_least_one, positive
from ..errors import Error
from .members import DEAD_AFTER, HEARTBEAT_INTERVAL, address_host, normalize_address, read_hosts


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"shmps-bridge: {message} (see shmps-bridge --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="shmps-bridge", description="Forward a store's pushes to the shard "
                "owners on other hosts and replicate shards (docs/bridge-protocol.md).")
    p.add_argument("--peers", required=True, metavar="HOSTS_TXT",
                   help="member list: one host:port a line, '#' comments; watched for edits")
    p.add_argument("--store", required=True, help="the store name (as in shmps.attach)")
    p.add_argument("--listen", metavar="HOST:PORT",
                   help="address to listen on; must be listed in HOSTS_TXT (default: the one "
                        "entry of HOSTS_TXT that is an address of this machine)")
    p.add_argument("--replicas", type=at_least_one, default=2,
                   help="copies of every shard that acknowledge a batch (default 2)")
    p.add_argument("--secret-file", metavar="F",
                   help="shared secret (16..4096 bytes, mode 0600); required to listen on "
                        "anything but loopback")
    p.add_argument("--namespace", default=os.environ.get("SHMPS_NAMESPACE") or None,
                   help="shared-memory namespace of the store (as shmps.attach(namespace=))")
    p.add_argument("--flush-ms", type=positive(MAX_SECONDS * 1e3, least=0.1), default=5.0,
                   help="how often outboxes are drained and sent (default 5 ms; 0.1 ms to "
                        "a day)")
    p.add_argument("--allow-minority", action="store_true",
                   help="own shards without a majority (two hosts that only fail by "
                        "crashing; a partition then splits the brain: see the docs)")
    p.add_argument("--dead-after", type=positive(MAX_SECONDS, least=2 * HEARTBEAT_INTERVAL),
                   default=DEAD_AFTER,
                   help=f"seconds of silence before a peer is dead (default {DEAD_AFTER}; "
                        f"at least two heartbeats, {2 * HEARTBEAT_INTERVAL:g} s)")
    p.add_argument("--log-level", default="INFO", type=str.upper,   # (debug as DEBUG)
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _local_addresses() -> set[str]:
    out = {"127.0.0.1", "::1", "localhost", socket.gethostname().lower()}
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None):
            out.add(str(info[4][0]))
    except OSError:
        pass
    return out


def _bindable(host: str) -> bool:
    """True if a socket of this machine can bind an address ``host`` resolves to: it is
    an address of this machine (EADDRNOTAVAIL otherwise).  The wildcard and multicast
    addresses, which bind but name no host, are not.  Catches what _local_addresses
    misses where the machine's name resolves to loopback only (Debian's 127.0.1.1 in
    /etc/hosts): its network interfaces' addresses.  O(addresses of ``host``); a name
    is resolved (a lookup)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        except ValueError:
            continue
        if ip.is_unspecified or ip.is_multicast:
            continue
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0, *sockaddr[2:]))   # (port 0: takes no port in use)
                return True
        except OSError:
            continue
    return False


def _pick_listen(members: list[str], peers: str) -> str:
    if not members:
        raise Error(f"hosts file {peers} lists no host",
                    "write one host:port a line in it, this host's among them")
    local = _local_addresses()
    mine = [m for m in members   # ("[::1]:7070" is ::1's)
            if address_host(m) in local or _bindable(address_host(m))]
    if not mine:
        raise Error(f"no entry of hosts file {peers} is an address of this host "
                    f"({len(members)} entries)",
                    "add this host's host:port to it, or pass --listen HOST:PORT")
    if len(mine) > 1:
        raise Error(f"cannot tell which entry of hosts file {peers} is this host ("
                    f"{len(mine)} match its addresses: {', '.join(mine[:4])})",
                    "pass --listen HOST:PORT")
    return mine[0]


def _fail(message: str) -> None:
    """``shmps-bridge: <message>`` on stderr, one line (a path given with a newline
    in it made two)."""
    print(f"shmps-bridge: {' '.join(message.split())}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from . import auth
    from .node import Config, serve
    try:
        members = read_hosts(args.peers)
        listen = (normalize_address(args.listen) if args.listen
                  else _pick_listen(members, args.peers))
        secret = auth.load_secret(args.secret_file) if args.secret_file else None
        cfg = Config(peers_file=args.peers, store=args.store, listen=listen,
                     replicas=args.replicas, secret=secret, namespace=args.namespace,
                     flush_ms=args.flush_ms, allow_minority=args.allow_minority,
                     dead_after=args.dead_after)
        asyncio.run(serve(cfg))
    except Error as e:
        _fail(e.told("see shmps-bridge --help"))
        return 2
    except OSError as e:
        _fail(str(e))
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
