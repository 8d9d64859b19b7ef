"""The delivery worker (see ``_worker.py`` for its threads)."""

from runlane.worker._lifecycle import LifecycleStats
from runlane.worker._worker import Worker

__all__ = ["LifecycleStats", "Worker"]
