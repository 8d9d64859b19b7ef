"""The waits a process's main thread makes while it supervises (``wait_until_closed``): in
slices, so that a signal handler runs meanwhile.

The kernel hands a signal sent to the process to any of its threads, and Python runs the
handler on the main thread only once that thread runs Python code again. A main thread
blocked in ``Event.wait()`` without a timeout wakes for a signal delivered to itself, never
for one delivered to a slot, band or pool thread: the SIGTERM handler of a supervised worker
or maintenance process then never ran, and the process did not stop (CI: the maintenance
command and example still running 30 s after SIGTERM). Waiting in slices, the main thread
runs the handler within a slice whichever thread the kernel chose.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["wait_event", "wait_in_slices"]

# the longest the main thread waits at a time: how late a signal handler may run
_SLICE_SECONDS = 0.25


def wait_in_slices(wait: Callable[[float], bool], timeout: float | None = None) -> bool:
    """Call ``wait(seconds)`` (True once what it waits for happened) a slice at a time until
    it returns True, or until ``timeout`` seconds passed (None: no limit): then False. Between
    slices the main thread runs the handler of a signal delivered to any thread."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = _SLICE_SECONDS if deadline is None else deadline - time.monotonic()
        if left <= 0:
            return False
        if wait(min(_SLICE_SECONDS, left)):
            return True


def wait_event(event: threading.Event, timeout: float | None) -> bool:
    """``event.wait(timeout)`` (None: no limit); on the main thread, a slice at a time."""
    if threading.current_thread() is not threading.main_thread():
        return event.wait(timeout)
    return event.is_set() or wait_in_slices(event.wait, timeout)
