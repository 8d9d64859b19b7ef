"""A clock a test moves instead of sleeping (docs/testing.md)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

__all__ = ["MovableClock"]


class MovableClock:
    """The time a lane's statements read as now, given as ``postgres_polling_lane(clock=...)``:
    the wall clock plus how far the test moved it. ``advance(seconds)`` makes due times,
    leases and timeouts that far ahead come due at once, for every storage the lane builds
    (the runtime's, its workers' and maintenance's)."""

    def __init__(self) -> None:
        self._moved = timedelta(0)

    def __call__(self) -> datetime:
        return datetime.now(UTC) + self._moved

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` ahead (time never runs back)."""
        if seconds < 0:
            raise ValueError(f"a clock moves ahead only, not by {seconds} seconds")
        self._moved += timedelta(seconds=seconds)
