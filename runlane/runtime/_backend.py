"""What a handler's context reaches the runtime through."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from runlane.errors import ConfigurationError
from runlane.models import RunHandle
from runlane.storage import Storage
from runlane.tasks import Task

if TYPE_CHECKING:
    from runlane.runtime import Runlane

__all__ = ["Backend"]

_CHILD_OPTIONS = frozenset(
    {"queue", "delay", "run_at", "priority", "max_attempts", "concurrency_key"}
)


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
        parent_run_id: uuid.UUID,
        idempotency_key: str,
        options: dict[str, Any],
    ) -> RunHandle:
        unknown = sorted(set(options) - _CHILD_OPTIONS)
        if unknown:
            raise ConfigurationError(
                f"trigger_child got unknown options {unknown}; it takes {sorted(_CHILD_OPTIONS)}"
            )
        (handle,) = self._runtime._trigger(
            task,
            [payload],
            [idempotency_key],
            parent_run_id=parent_run_id,
            queue=options.pop("queue", None),
            delay=options.pop("delay", None),
            run_at=options.pop("run_at", None),
            priority=options.pop("priority", 0),
            max_attempts=options.pop("max_attempts", None),
            connection=None,
            concurrency_key=options.pop("concurrency_key", None),
        )
        return handle
