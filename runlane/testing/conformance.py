"""The lane conformance suite: what every lane must do, through the public API only.

A lane, this package's or one kept elsewhere, runs the suite from its own tests: subclass
:class:`LaneConformance` in a test module (a class whose name starts with ``Test``) and
give it a ``lane_harness`` fixture returning your :class:`LaneHarness`::

    import pytest
    from runlane.testing.conformance import LaneConformance, LaneHarness

    class MyLaneHarness(LaneHarness):
        name = "my-lane"

        def build_lane(self, *, lease_duration, poll_interval):
            return my_lane(..., lease_duration=lease_duration, poll_interval=poll_interval)

    class TestMyLane(LaneConformance):
        @pytest.fixture
        def lane_harness(self) -> MyLaneHarness:
            return MyLaneHarness()

Each test starts the harness, builds runtimes on lanes it makes, closes them and stops the
harness. The tests cover delivery (exactly once, promptly when idle), hand-back at
shutdown, cancel wake-up, task timeouts, bounded queues, paused queues, shutdown, drain
support (or its refusal), the runtime's ownership of its workers, and a property test
(hypothesis, skipped without it): random close timings never strand a run. What a test needs from
a lane beyond the public API is declared on :class:`runlane.lanes.Acquirer` (readiness);
the records a test checks are read through ``Runlane.list_runs`` and
``Runlane.get_run_history``. See docs/lanes.md. Needs pytest (the ``testing`` extra).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from runlane.testing._delivery import DeliveryConformance
from runlane.testing._harness import LaneHarness, LaneRuntimes
from runlane.testing._shutdown import ShutdownConformance

__all__ = ["LaneConformance", "LaneHarness", "LaneRuntimes"]


class LaneConformance(DeliveryConformance, ShutdownConformance):
    """The suite. Subclass it as ``Test...`` with a ``lane_harness`` fixture (see the
    module docstring); every test gets a :class:`LaneRuntimes` on that harness."""

    @pytest.fixture
    def lanes(self, lane_harness: LaneHarness) -> Iterator[LaneRuntimes]:
        lane_harness.start()
        runtimes = LaneRuntimes(lane_harness)
        try:
            yield runtimes
        finally:
            try:
                runtimes.close()
            finally:
                lane_harness.stop()
