"""The lane conformance suite (runlane.testing.conformance) on this repository's lanes."""

from __future__ import annotations

import pytest

from runlane.testing.conformance import LaneConformance, LaneHarness
from tests.lanes.conftest import polling_harness, rabbitmq_harness


class TestPostgresPollingLane(LaneConformance):
    @pytest.fixture
    def lane_harness(self, request: pytest.FixtureRequest) -> LaneHarness:
        return polling_harness(request)


class TestRabbitMQLane(LaneConformance):
    @pytest.fixture
    def lane_harness(self, request: pytest.FixtureRequest) -> LaneHarness:
        return rabbitmq_harness(request)
