"""This repository's two lanes as conformance-suite harnesses (runlane.testing.conformance).

``test_conformance.py`` runs the suite once per lane; ``lane_factory`` gives the other files
of this folder (the close-timing property) a :class:`LaneRuntimes` on each lane in turn.
A lane of this repository adds its harness below, its class to ``test_conformance.py`` and
its name to ``HARNESSES``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest

from runlane.lanes import Lane
from runlane.postgres import postgres_polling_lane
from runlane.rabbitmq import rabbitmq_lane
from runlane.testing.conformance import LaneHarness, LaneRuntimes


class PollingHarness(LaneHarness):
    """The Postgres polling lane on the test's fresh migrated schema."""

    name = "postgres-polling"

    def __init__(self, database_url: str, schema: str) -> None:
        self.database_url = database_url
        self.schema = schema

    def build_lane(self, *, lease_duration: timedelta, poll_interval: timedelta) -> Lane:
        return postgres_polling_lane(
            connection_string=self.database_url,
            schema=self.schema,
            lease_duration=lease_duration,
            poll_interval=poll_interval,
        )


class RabbitMQHarness(LaneHarness):
    """The RabbitMQ lane on the test's fresh migrated schema and the session's broker (its
    queues are named after the schema, so they are the test's own)."""

    name = "rabbitmq"

    def __init__(self, database_url: str, schema: str, amqp_url: str) -> None:
        self.database_url = database_url
        self.schema = schema
        self.amqp_url = amqp_url

    def build_lane(self, *, lease_duration: timedelta, poll_interval: timedelta) -> Lane:
        return rabbitmq_lane(
            connection_string=self.database_url,
            schema=self.schema,
            amqp_url=self.amqp_url,
            lease_duration=lease_duration,
            poll_interval=poll_interval,
        )


def polling_harness(request: pytest.FixtureRequest) -> LaneHarness:
    return PollingHarness(
        request.getfixturevalue("database_url"), request.getfixturevalue("schema")
    )


def rabbitmq_harness(request: pytest.FixtureRequest) -> LaneHarness:
    return RabbitMQHarness(
        request.getfixturevalue("database_url"),
        request.getfixturevalue("schema"),
        request.getfixturevalue("rabbitmq_url"),
    )


HARNESSES: dict[str, Callable[[pytest.FixtureRequest], LaneHarness]] = {
    "postgres-polling": polling_harness,
    "rabbitmq": rabbitmq_harness,
}


@pytest.fixture(params=sorted(HARNESSES))
def lane_factory(request: pytest.FixtureRequest) -> Iterator[LaneRuntimes]:
    """Runtimes on each lane in turn (closed after the test)."""
    harness = HARNESSES[request.param](request)
    harness.start()
    runtimes = LaneRuntimes(harness)
    try:
        yield runtimes
    finally:
        try:
            runtimes.close()
        finally:
            harness.stop()
