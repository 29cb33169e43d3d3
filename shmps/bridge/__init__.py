"""shmps.bridge: the multi-host bridge (one aiohttp process per host).

Building blocks, each usable and tested on its own, none touching shared memory:

- :mod:`shmps.bridge.ring`: consistent-hash ring of member addresses (owner and backups
  of each shard).
- :mod:`shmps.bridge.members`: ``hosts.txt`` parsing, member states from heartbeats,
  epochs, the majority test, and a file watcher.
- :mod:`shmps.bridge.auth`: shared-secret handshake, per-request MACs with replay
  protection, and the refusal to listen on a network address without a secret.
- :mod:`shmps.bridge.frames`: the binary frame codec (bounds-checked, zero-copy decode).
- :mod:`shmps.bridge.wsstream`: the peer websockets after the upgrade (RFC 6455, read
  into one reusable buffer per connection, a send queue with flow control).
- :mod:`shmps.bridge.outq`: the sender's queue of unacknowledged batches and the
  receiver's duplicate filter (exactly-once delivery).

The protocol they implement is described in ``docs/bridge-protocol.md``; the data path
(draining the store's per-shard outboxes, applying batches, the ``shmps-bridge`` command)
is built on top of them.
"""
