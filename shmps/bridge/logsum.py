"""Per-shard log lines said once per event: :class:`ShardLog`.

An event of the cluster (a member joins, leaves, dies) touches every shard it moves,
and a line per shard at INFO or WARNING buried the event in its shards: one rejoin
logged 178 lines.  Each per-shard line is logged at DEBUG at once (with all its
detail), and counted under a summary (its level, message and arguments without the
shard); a summary is logged once, one ``window`` after its first shard, with the count
and the first shards: one line per event and kind, whatever the number of shards.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

#: shards a summary line names (the DEBUG lines name every one)
SAMPLE = 6
#: seconds from a summary's first shard to its line: a hand-over of a host's shards
#: takes 0.1-2 s, so an event is one line, two at most
WINDOW = 1.0


class ShardLog:
    """Summaries of per-shard lines, each logged once a ``window``.  Not thread-safe:
    the bridge's event loop only.  O(1) an :meth:`add`; :meth:`flush` O(summaries)."""

    def __init__(self, logger: logging.Logger, window: float = WINDOW) -> None:
        self._log = logger
        self.window = window
        # (level, message, args) -> [first add's time, count, the first SAMPLE shards]
        self._pending: dict[tuple, list] = {}

    def add(self, level: int, summary: str, args: tuple, shard: str, detail: str,
            *detail_args: object) -> None:
        """Log ``detail % detail_args`` (the per-shard line) at DEBUG, and count
        ``shard`` under the summary ``summary % args`` at ``level``: ``args`` must not
        vary by shard (else each shard is a summary of its own)."""
        self._log.debug(detail, *detail_args)
        key = (level, summary, args)
        entry = self._pending.get(key)
        if entry is None:
            entry = self._pending[key] = [time.monotonic(), 0, []]
        entry[1] += 1
        if len(entry[2]) < SAMPLE:
            entry[2].append(shard)

    def flush(self, now: Optional[float] = None, force: bool = False) -> None:
        """Log every summary whose window is over (all of them with ``force``)."""
        if not self._pending:
            return
        now = time.monotonic() if now is None else now
        for key, (first, count, shards) in list(self._pending.items()):
            if not force and now - first < self.window:
                continue
            del self._pending[key]
            level, summary, args = key
            more = ", ..." if count > len(shards) else ""
            self._log.log(level, summary + " (%d shard%s: %s%s)", *args, count,
                          "" if count == 1 else "s", ", ".join(shards), more)
