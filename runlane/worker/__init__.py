"""The delivery worker (see ``_worker.py`` for its threads)."""

from runlane.worker._execution import Outcome
from runlane.worker._lifecycle import LifecycleStats
from runlane.worker._worker import Worker, WorkerOptions, check_worker_arguments

__all__ = ["LifecycleStats", "Outcome", "Worker", "WorkerOptions", "check_worker_arguments"]
