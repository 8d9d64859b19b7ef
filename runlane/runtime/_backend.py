"""What a handler's context reaches the runtime through, and what the runtime's rooms
reach its storage through."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from runlane._validation import TriggerOptions
from runlane.context import TaskRef
from runlane.models import RunHandle
from runlane.storage import Storage

__all__ = ["Backend", "Opened", "TriggerRuns"]

# the runtime's storage, opened on first use (RunlaneClosed once the runtime is closed)
Opened = Callable[[], Storage]
# the runtime's trigger path: a task, its payloads and their idempotency keys, the options
TriggerRuns = Callable[
    [TaskRef | str, list[Any], Sequence[str | None], TriggerOptions],
    list[RunHandle],
]


class Backend:
    """What a handler's context uses: a storage (a worker slot's own connection, or the
    runtime's pool), the runtime's trigger path for child runs, and its output limit."""

    def __init__(self, storage: Storage, *, trigger: TriggerRuns, max_output_bytes: int) -> None:
        self.storage = storage
        self._trigger = trigger
        self.max_output_bytes = max_output_bytes

    def trigger_child(
        self,
        task: TaskRef | str,
        payload: Any,
        *,
        idempotency_key: str,
        options: TriggerOptions,
    ) -> RunHandle:
        (handle,) = self._trigger(task, [payload], [idempotency_key], options)
        return handle
