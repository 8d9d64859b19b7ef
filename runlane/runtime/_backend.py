"""What a handler's context reaches the runtime through."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runlane._trigger_options import TriggerOptions
from runlane.models import RunHandle
from runlane.storage import Storage
from runlane.tasks import Task

if TYPE_CHECKING:
    from runlane.runtime import Runlane

__all__ = ["Backend"]


class Backend:
    """What a handler's context uses: a storage (a worker slot's own connection, or the
    runtime's pool) and the runtime for child triggers."""

    def __init__(self, runtime: Runlane, storage: Storage) -> None:
        self._runtime = runtime
        self.storage = storage

    @property
    def max_output_bytes(self) -> int:
        """The runtime's output limit, for steps and handlers' return values."""
        return self._runtime.max_output_bytes

    def trigger_child(
        self,
        task: Task[Any, Any] | str,
        payload: Any,
        *,
        idempotency_key: str,
        options: TriggerOptions,
    ) -> RunHandle:
        (handle,) = self._runtime._trigger(task, [payload], [idempotency_key], options)
        return handle
