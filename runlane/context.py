"""The context a handler receives with its payload."""

from __future__ import annotations

import threading
import uuid

import attrs

__all__ = ["RunContext"]


@attrs.define(eq=False)
class RunContext:
    """What a handler knows about the attempt it runs in.

    ``cancelled`` is set when the run is cancelled, the worker shuts down, or the attempt's
    lease could not be kept; long handlers should check it (or wait on it) and return.
    """

    run_id: uuid.UUID
    task_id: str
    queue: str
    attempt: int
    max_attempts: int
    environment: str
    cancelled: threading.Event = attrs.field(factory=threading.Event)
