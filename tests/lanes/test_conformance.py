"""The lane conformance suite (runlane.testing.conformance) on this repository's lanes."""

from __future__ import annotations

import pytest

from runlane.testing.conformance import LaneConformance, LaneHarness
from tests.lanes.conftest import PollingHarness, RabbitMQHarness


class TestPostgresPollingLane(LaneConformance):
    @pytest.fixture
    def lane_harness(self, database_url: str, schema: str) -> LaneHarness:
        return PollingHarness(database_url, schema)


class TestRabbitMQLane(LaneConformance):
    @pytest.fixture
    def lane_harness(self, database_url: str, schema: str, rabbitmq_url: str) -> LaneHarness:
        return RabbitMQHarness(database_url, schema, rabbitmq_url)
