"""A runtime's lifetime: its storage opened on first use (and the lane prepared), closed by
``close()`` after what the runtime started (workers, services, the run-end listener), and
opened again, on a fresh storage, by ``start()``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from runlane import _telemetry
from runlane.errors import RunlaneClosed
from runlane.lanes import Lane, RunEndWatcher
from runlane.maintenance import Services
from runlane.runtime._database_wait import DatabaseWait
from runlane.storage import Storage
from runlane.toolkit import Closing, as_wait_timeout
from runlane.worker import Worker

__all__ = ["Lifetime"]

_end_watchers = iter(range(1, 1 << 62))


class Lifetime:
    """Open or closed, and what to close. ``connect()`` makes a fresh storage and hands it
    to ``on_connect`` (what works through one storage); ``opened()`` is the storage, opened
    on first use, and raises RunlaneClosed once closed. ``runtime`` is what telemetry reads
    queue depths from while it is open."""

    def __init__(
        self,
        lane: Lane,
        environment: str,
        runtime: _telemetry.StatusSource,
        on_connect: Callable[[Storage], None],
    ) -> None:
        self._lane = lane
        self._environment = environment
        self._runtime = runtime
        self._on_connect = on_connect
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._owned: list[Worker | Services] = []
        # wait_for_run's wake-ups, made by the first wait (False: not made yet)
        self._run_ends: RunEndWatcher | bool | None = False

    def connect(self) -> None:
        """A fresh storage (and what works through it) for a new or reopened runtime."""
        storage = self._lane.create_storage()
        self.storage = storage
        # a service's start waits for the database; close() ends the wait
        self._database_wait = DatabaseWait(self.opened, storage, self.closed_error)
        self._on_connect(storage)

    def start(self) -> None:
        with self._lock:
            if self._closed:
                self.connect()
                self._closed = False
            self._open_locked()

    def _open_locked(self) -> None:
        """Open the storage and prepare the lane once; the caller holds the lock."""
        if self._started:
            return
        self.storage.open()
        self._lane.prepare(self.storage, self._environment)
        self._started = True
        _telemetry.register_runtime(self._runtime)  # its queue depths, while it is open

    def opened(self) -> Storage:
        if self._closed:
            raise self.closed_error()
        if not self._started:
            with self._lock:
                if self._closed:
                    raise self.closed_error()
                self._open_locked()
        return self.storage

    def check_open(self) -> None:
        if self._closed:
            raise self.closed_error()

    def closed_error(self) -> RunlaneClosed:
        return RunlaneClosed(
            f"this Runlane (environment {self._environment!r}) was closed: call start() to "
            "open it again, or build a new runtime with create_runlane()"
        )

    def wait_for_database(self, seconds: object, what: str) -> None:
        self._database_wait.until_ready(seconds, what)

    def close(self, timeout: float | None) -> None:
        limit = as_wait_timeout("timeout", timeout)
        deadline = None if limit is None else time.monotonic() + limit
        # first, before the lock an open under way holds: a wait for the database then ends
        # when that attempt does, as closed
        self._database_wait.end()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._started = False
            _telemetry.unregister_runtime(self._runtime)
            owned, self._owned = self._owned, []
            run_ends, self._run_ends = self._run_ends, False
        # every part runs even when one raises; the first error is raised at the end
        closing = Closing(f"the runtime of environment {self._environment!r}")
        for item in owned:
            if isinstance(item, Worker):
                with closing.part(item.name):
                    item.stop_acquiring()  # first everywhere: none takes another's hand-back
        for item in owned:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            with closing.part(item.name):
                item.close(remaining)
        if not isinstance(run_ends, bool) and run_ends is not None:
            with closing.part("its run-end listener"):
                run_ends.close(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with closing.part("its connections"):
            self.storage.close(None if deadline is None else max(0.0, deadline - time.monotonic()))
        closing.raise_first()

    def own(self, item: Worker | Services) -> None:
        """Register a worker or services for close(); refuses once closed."""
        with self._lock:
            if self._closed:
                raise self.closed_error()
            self._owned = [o for o in self._owned if not o.closed]
            self._owned.append(item)

    def disown(self, item: Worker | Services) -> None:
        with self._lock:
            if item in self._owned:
                self._owned.remove(item)

    def end_watcher(self) -> RunEndWatcher | None:
        """The runtime's run-end wake-ups, made on first use; None when the lane has none."""
        with self._lock:
            if self._closed:
                raise self.closed_error()
            if isinstance(self._run_ends, bool):
                self._run_ends = self._lane.watch_run_ends(
                    self._environment, f"runlane-run-ends-{next(_end_watchers)}"
                )
            return self._run_ends
