"""``drain(stop=...)``: turning the caller's ``stop`` event into a stop of the drain."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["StopWatcher"]

# how often the stop event is looked at while a handler runs
_STOP_POLL_SECONDS = 0.02


class StopWatcher:
    """A thread that turns ``stop`` being set into ``on_stop()`` (the worker's
    ``stop_acquiring``: the running handler is asked to stop) while drain executes in the
    caller's thread. A ``threading.Event`` offers no callback, so the thread looks at it
    every ``_STOP_POLL_SECONDS``; it ends when drain does."""

    def __init__(self, name: str, stop: threading.Event, on_stop: Callable[[], None]) -> None:
        self._stop = stop
        self._on_stop = on_stop
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"{name}-stop-watch", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        while not self._done.is_set():
            if self._stop.wait(_STOP_POLL_SECONDS):
                if not self._done.is_set():
                    self._on_stop()
                return

    def close(self) -> None:
        self._done.set()
        self._thread.join(_STOP_POLL_SECONDS + 1.0)
