"""An event-loop task's sleep that others may end sooner (the bridge's flush and tick
loops: a flush asked, a push waking a sleeping bridge, a membership change)."""
from __future__ import annotations

import asyncio
import math
import time
from typing import Optional


class Pause:
    """One task sleeps in it at a time (:meth:`sleep`); any code on the same event loop
    may end that sleep sooner (:meth:`end_by`).  Times are ``time.monotonic()``.

    Sample usage::

        pause = Pause()
        await pause.sleep(0.1)          # in the loop task
        pause.end_by(time.monotonic())  # elsewhere: end it now
    """

    def __init__(self) -> None:
        self._fut: Optional[asyncio.Future] = None
        self._timer: Optional[asyncio.TimerHandle] = None
        #: when the current sleep ends (``math.inf`` while nobody sleeps)
        self.until = math.inf

    @property
    def asleep(self) -> bool:
        return self._fut is not None and not self._fut.done()

    async def sleep(self, delay: float) -> None:
        """Sleep ``delay`` seconds, or until :meth:`end_by` ends it sooner."""
        loop = asyncio.get_running_loop()
        self._fut = loop.create_future()
        self.until = time.monotonic() + delay
        self._timer = loop.call_later(delay, self._end)
        try:
            await self._fut
        finally:
            self._timer.cancel()
            self._fut, self._timer, self.until = None, None, math.inf

    def end_by(self, when: float) -> None:
        """End the current sleep at ``when`` at the latest (at once if it is past); a
        no-op while nobody sleeps or the sleep ends sooner anyway.  O(1): one timer."""
        if not self.asleep or when >= self.until:
            return
        assert self._timer is not None and self._fut is not None
        self._timer.cancel()
        self.until = when
        delay = when - time.monotonic()
        if delay <= 0:
            self._end()
        else:
            self._timer = self._fut.get_loop().call_later(delay, self._end)

    def _end(self) -> None:
        if self._fut is not None and not self._fut.done():
            self._fut.set_result(None)
