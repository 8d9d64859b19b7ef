"""This repository's two lanes as conformance-suite harnesses (runlane.testing.conformance).

``test_conformance.py`` runs the suite once per lane; a lane of this repository adds its
harness below and its class there.
"""

from __future__ import annotations

from datetime import timedelta

from runlane.lanes import Lane
from runlane.postgres import postgres_polling_lane
from runlane.rabbitmq import rabbitmq_lane
from runlane.testing.conformance import LaneHarness


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
            # a run held back by its queue's limits is published again after 0.1 s, not the
            # default 1 s: the same deferral through the outbox, waited for less (the suite's
            # bounded-queue test defers most of its runs several times)
            defer_delay=timedelta(milliseconds=100),
        )
