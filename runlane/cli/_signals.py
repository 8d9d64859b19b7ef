"""SIGTERM/SIGINT for the long-running commands (worker, maintenance): the first signal closes
gracefully, a second exits at once.

The kernel may hand the signal to any thread, and Python runs the handler only when the
main thread runs Python code again, so the main thread waits in slices
(``wait_in_slices``) rather than blocking without a timeout.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from runlane.cli._codes import EXIT_FORCED
from runlane.cli._logs import say, stop_logging
from runlane.toolkit import wait_in_slices

__all__ = ["Stopper", "stop_requested"]

# how long past --shutdown-timeout the main thread waits for the closer thread
_CLOSER_ALLOWANCE_SECONDS = 5.0


class Stopper:
    """SIGTERM/SIGINT handling for a long-running command: the first signal closes
    gracefully in a fresh thread, a second exits at once with ``EXIT_FORCED`` (runs still
    executing are left to lease expiry). Installed before the worker or services start, so
    no signal finds a gap, and kept after a signal: the process is on its way out."""

    def __init__(self) -> None:
        self.name = "runlane"
        self._close: Callable[[], None] | None = None
        self.requested = threading.Event()
        self.close_error: BaseException | None = None
        self._closer: threading.Thread | None = None
        self._exiting = threading.Lock()

    def attach(self, name: str, close: Callable[[], None]) -> None:
        self.name = name
        self._close = close
        if self.requested.is_set():
            self._start_closer()

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested.is_set():
            self._exiting.acquire()  # once, from the main thread or the late watcher
            closed = self._closer is not None and not self._closer.is_alive()
            left = "" if closed else "; runs still executing are left to lease expiry"
            say(
                f"{self.name}: second signal: exiting now{left}",
                logging.WARNING,
                signal=signal.Signals(signum).name,
                exit_code=EXIT_FORCED,
            )
            stop_logging()  # what was logged so far is written first
            os._exit(EXIT_FORCED)
        self.requested.set()
        say(
            f"{signal.Signals(signum).name} received; closing {self.name} "
            "(a second signal exits at once)",
            signal=signal.Signals(signum).name,
        )
        self._start_closer()

    def _start_closer(self) -> None:
        if self._close is None or self._closer is not None:
            return
        self._closer = threading.Thread(
            target=self._run_close, name="runlane-cli-closer", daemon=True
        )
        self._closer.start()

    def _run_close(self) -> None:
        assert self._close is not None
        try:
            self._close()
        except BaseException as exc:  # reported by the main thread
            self.close_error = exc

    def wait_for_closer(self, timeout: float) -> None:
        """Join the closer thread: its close keeps to ``timeout`` (--shutdown-timeout);
        past that and a short allowance the process exits without it. Joined in slices, so
        a second signal meanwhile exits at once."""
        closer = self._closer
        if closer is None:
            return

        def joined(seconds: float) -> bool:
            closer.join(seconds)
            return not closer.is_alive()

        wait_in_slices(joined, timeout + _CLOSER_ALLOWANCE_SECONDS)

    @contextmanager
    def installed(self) -> Iterator[None]:
        try:
            with _handling(self.handle, keep=self.requested.is_set):
                yield
        finally:
            if self.requested.is_set():
                _handle_from_any_thread(self.handle)


def _handle_from_any_thread(handler: Callable[[int, FrameType | None], None]) -> None:
    """Once the command returned after a stop signal, the main thread may block without a
    timeout (Python's exit joining a thread of the app's), where a signal the kernel hands
    to another thread never runs ``handler``. The signals' C handler also writes their
    numbers to a pipe (``set_wakeup_fd``): a daemon thread reading it calls ``handler``."""
    if threading.current_thread() is not threading.main_thread():
        return  # set_wakeup_fd is the main thread's (and so are signal handlers)
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def watch() -> None:
        while data := os.read(read, 64):
            for signum in data:
                if signum in (signal.SIGTERM, signal.SIGINT):
                    handler(signum, None)

    threading.Thread(target=watch, name="runlane-cli-signals", daemon=True).start()


@contextmanager
def _handling(
    handler: Callable[[int, FrameType | None], None], keep: Callable[[], bool] = lambda: False
) -> Iterator[None]:
    """``handler`` for SIGTERM and SIGINT while the block runs; the previous ones after it,
    unless ``keep()`` says then that ``handler`` stays."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        if not keep():
            for sig, former in previous.items():
                signal.signal(sig, former)


@contextmanager
def stop_requested() -> Iterator[threading.Event]:
    """For a command that repeats until stopped (``status --watch``): SIGTERM and SIGINT set
    the event it yields, so it stops between two rounds, never inside a query. Off the main
    thread no handler can be installed, and the event is never set by a signal."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    with _handling(lambda signum, frame: stop.set()):
        yield stop
