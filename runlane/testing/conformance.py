"""The lane conformance suite: what every lane must do, through the public API only.

A lane, this package's or one kept elsewhere, subclasses :class:`LaneConformance` as a
``Test...`` class with a ``lane_harness`` fixture returning its :class:`LaneHarness`
(docs/lanes.md shows one). The tests cover delivery, hand-back at shutdown, cancel wake-up,
timeouts, bounded and paused queues, drain support, the runtime's ownership of its workers
and a property test (hypothesis, skipped without it). Needs pytest (the ``testing`` extra).
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
