"""The engine thread's way into the event loop: a request's events, delivered in order, one wake-up for all.

Each `loop.call_soon_threadsafe` writes to the loop's wake-up socket, and the send releases the GIL to the
HTTP thread for its turn while the engine's thread waits between two decodes. A step of N sequences sends
N events or more; the outbox wakes the loop once for whatever has gathered since it last ran, and not at all
while the scheduler holds it (`held()`, around a step's events): then once, when the step's last event is in.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from typing import Callable

MAX_BUFFERED = 4096  # text events a response may hold unsent; a client that far behind is cancelled


class Outbox:
    """Calls to run on `loop`, from any thread, in the order sent; n_wakeups counts the loop's wake-ups."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._calls: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._armed = False  # a drain is scheduled and has not started yet
        self._holds = 0
        self.n_sent = self.n_wakeups = 0

    @contextlib.contextmanager
    def held(self):
        """Events sent inside go out together at the end (one wake-up)."""
        with self._lock:
            self._holds += 1
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
            self._wake()

    def send(self, fn: Callable[[tuple], None], item: tuple) -> None:
        with self._lock:
            self._calls.append((fn, item))
            self.n_sent += 1
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            if self._armed or self._holds or not self._calls:
                return
            self._armed = True
            self.n_wakeups += 1
        with contextlib.suppress(RuntimeError):  # the loop has closed (shutdown): nobody is listening
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            calls, self._calls, self._armed = self._calls, collections.deque(), False
        for fn, item in calls:
            fn(item)


def emitter(outbox: Outbox, events: asyncio.Queue,
            on_overflow: Callable[[], None] | None = None) -> Callable[[tuple], None]:
    """A job's emit: its events into `events` through the outbox. A reader that falls MAX_BUFFERED events
    behind loses its generation (on_overflow) rather than holding memory or, with --parallel, anyone else's
    tokens."""

    def put(item: tuple) -> None:
        if item[0] == "text" and events.qsize() >= MAX_BUFFERED:
            if on_overflow is not None:
                on_overflow()
            return
        events.put_nowait(item)

    return lambda item: outbox.send(put, item)
