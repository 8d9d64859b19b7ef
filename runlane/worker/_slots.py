"""A worker's slots: the threads that run handlers, each with its own connection, and the
pool that keeps ``concurrency`` of them.

A slot whose handler passed its timeout is abandoned (its thread finishes the handler, whose
result is discarded; its connection closes when it does) and a fresh slot takes its place;
past ``concurrency`` abandoned slots still running, none is replaced until one returns, so
handlers that ignore their timeout cannot exhaust the process's threads and the server's
connections.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

from runlane.context import ContextBackend
from runlane.storage import ClaimedRun, LeaseRef, Storage

__all__ = ["Slot", "SlotPool"]

log = logging.getLogger("runlane.worker")


class Slot:
    """One handler thread and its connection (the caller's thread and the worker's pool for
    an ``inline`` slot: drain)."""

    def __init__(
        self,
        name: str,
        storage: Storage,
        backend: ContextBackend,
        *,
        inline: bool,
        target: Callable[[Slot], None],
    ) -> None:
        self.name = name
        self.inline = inline
        self.storage = storage
        self.backend = backend
        self.abandoned = False
        self.thread = threading.Thread(target=target, args=(self,), name=name)
        self.thread.daemon = True

    def close_storage(self) -> None:
        if not self.inline:
            self.storage.close()


class SlotPool:
    """The slots of one worker, and which run each executes.

    Its lists are guarded by the worker's condition ``cond`` (which the hand-off shares);
    methods named ``*_locked`` expect it held, the others take it."""

    def __init__(
        self,
        *,
        name: str,
        storage: Storage,
        make_backend: Callable[[Storage], ContextBackend],
        inline: bool,
        concurrency: int,
        cond: threading.Condition,
        stopping: threading.Event,
        run_slot: Callable[[Slot], None],
    ) -> None:
        self._name = name
        self._storage = storage
        self._make_backend = make_backend
        self._inline = inline
        self._concurrency = concurrency
        self._cond = cond
        self._stopping = stopping
        self._run_slot = run_slot
        self._numbers = itertools.count(1)
        self.slots: list[Slot] = []
        self.abandoned: list[Slot] = []
        # the runs executing now: their slot and time.perf_counter() at their start
        self.running: dict[LeaseRef, tuple[ClaimedRun, Slot, float]] = {}

    def new_slot(self, index: int) -> Slot:
        """A slot not started yet (drain runs one in the caller's thread)."""
        name = f"{self._name}-slot-{index}"
        storage = self._storage if self._inline else self._storage.dedicated(name)
        return Slot(
            name, storage, self._make_backend(storage), inline=self._inline, target=self._run_slot
        )

    def start_slot_locked(self) -> None:
        slot = self.new_slot(next(self._numbers))
        try:
            slot.thread.start()  # RuntimeError when the process is out of threads
        except BaseException:
            slot.close_storage()
            raise
        self.slots.append(slot)  # only a started thread: close() joins every slot

    def oldest_start_locked(self) -> float | None:
        """time.perf_counter() when the longest-running handler began; None when none runs."""
        return min((started for _, _, started in self.running.values()), default=None)

    def abandon(self, ref: LeaseRef) -> None:
        """The attempt under ``ref`` passed its timeout (and was failed): abandon its slot and
        start another in its place."""
        with self._cond:
            entry = self.running.get(ref)
            if entry is None or self._stopping.is_set() or self._inline:
                return
            slot = entry[1]
            slot.abandoned = True
            self.slots.remove(slot)
            self.abandoned.append(slot)
            if len(self.abandoned) <= self._concurrency:
                self.start_slot_locked()
                return
            # each abandoned slot holds a thread and a connection until its handler
            # returns: past one per slot, capacity shrinks rather than exhaust the server
            log.error(
                "runlane: %s: %d handlers are still running past their timeout (they ignore "
                "context.cancelled); %s is not replaced until one of them returns",
                self._name,
                len(self.abandoned),
                slot.name,
            )

    def abandoned_returned(self, slot: Slot) -> None:
        """An abandoned slot's handler returned: its connection goes, and a slot withheld
        for it starts."""
        with self._cond:
            if slot not in self.abandoned:
                return  # close() took it
            self.abandoned.remove(slot)
            # a slot withheld while too many were abandoned starts now
            if len(self.slots) < self._concurrency and not self._stopping.is_set():
                self.start_slot_locked()
        slot.close_storage()

    @staticmethod
    def join(slots: list[Slot], deadline: float | None) -> list[Slot]:
        """Join ``slots`` until ``deadline`` (time.monotonic()); the ones still alive."""
        for slot in slots:
            slot.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return [slot for slot in slots if slot.thread.is_alive()]
