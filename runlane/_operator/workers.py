"""Delivery workers in the ``workers`` table: what a worker registers, and the operator's
list.

Every delivery worker (``create_delivery_worker``, on every lane) writes a row when it
starts: a fresh ``worker_id``, its host, pid, runlane version, queues, concurrency and
heartbeat interval. Its lifecycle writer sends the heartbeat with the lease extensions it
makes anyway (see ``worker/_lifecycle.py``); the row says ``stopping`` once close begins and
``stopped`` when it ends. A running row unseen for three heartbeat intervals (database
time) reads as ``lost``, a stopping one unseen for two (a process gone while stopping does
not stay ``stopping``). ``drain()`` is not a delivery worker and registers
nothing; its attempts record no worker. Cleanup deletes stopped and lost rows after
``RetentionPolicy.workers``; an attempt of a worker whose row is gone keeps its
``worker_id`` and loses its host.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
import uuid
from collections.abc import Sequence
from functools import cache

from runlane.errors import ConfigurationError
from runlane.models import WorkerInfo
from runlane.storage import Storage, WorkerBeat

__all__ = ["list_workers", "new_beat", "runlane_version"]


@cache
def runlane_version() -> str:
    """The installed runlane distribution's version ("unknown" when not installed)."""
    try:
        return importlib.metadata.version("runlane")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def new_beat(
    environment: str, queues: Sequence[str], concurrency: int, heartbeat_seconds: float
) -> WorkerBeat:
    """A new delivery worker's registration, with a fresh ``worker_id``."""
    return WorkerBeat(
        worker_id=uuid.uuid4(),
        environment=environment,
        host=socket.gethostname(),
        pid=os.getpid(),
        runlane_version=runlane_version(),
        queues=tuple(queues),
        concurrency=concurrency,
        heartbeat_seconds=heartbeat_seconds,
    )


def list_workers(storage: Storage, environment: str, include_stopped: object) -> list[WorkerInfo]:
    if not isinstance(include_stopped, bool):
        raise ConfigurationError(
            f"include_stopped must be True or False, got {type(include_stopped).__name__}"
        )
    return storage.worker_list(environment, include_stopped=include_stopped)
