"""The delivery worker (see ``_worker.py`` for its threads)."""

from runlane.worker._execution import Outcome
from runlane.worker._lifecycle import LifecycleStats
from runlane.worker._middleware import Middleware, check_middleware
from runlane.worker._worker import Worker, WorkerOptions, check_worker_arguments

__all__ = [
    "LifecycleStats",
    "Middleware",
    "Outcome",
    "Worker",
    "WorkerOptions",
    "check_middleware",
    "check_worker_arguments",
]
