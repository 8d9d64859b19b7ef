"""``contract_defaults`` (SPEC section 6, the seeds' ``contractDefaults.lease.duration``)."""

from __future__ import annotations

from datetime import timedelta

import attrs
import pytest
from psycopg import sql

import runlane
from runlane import ContractDefaults, MaintenanceLimits, RunContext, contract_defaults, task
from tests.conftest import RabbitRuntimes
from tests.helpers import Conn


@task(id="contract.noop")
def noop(payload: object, context: RunContext) -> None:
    return None


def test_contract_defaults_are_exported_and_read_only() -> None:
    assert "contract_defaults" in runlane.__all__
    assert isinstance(contract_defaults, ContractDefaults)
    assert contract_defaults.lease.duration == timedelta(minutes=5)
    assert contract_defaults.maintenance_limits == MaintenanceLimits()
    assert contract_defaults.maintenance_limits.wait_token_timeout_limit == 100
    assert contract_defaults.maintenance_limits.wait_token_resume_limit == 100
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        contract_defaults.lease.duration = timedelta(seconds=1)  # type: ignore[misc]


def test_the_rabbitmq_lanes_outbox_claims_last_the_contract_lease(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str, db: Conn, schema: str
) -> None:
    """A runtime on the RabbitMQ lane built with default options records
    ``contract_defaults.lease.duration`` as its environment's outbox claim (what eager
    triggers' items and publishers' page claims last, in storage time)."""
    from runlane.rabbitmq import rabbitmq_lane  # noqa: PLC0415 - needs pika

    lane = rabbitmq_lane(connection_string="postgresql://h/db", amqp_url=rabbitmq_url)
    assert lane.claim_duration == contract_defaults.lease.duration
    rl = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[noop])
    rl.start()
    rl.trigger(noop, None, delay=timedelta(hours=1))
    (seconds,) = db.execute(
        sql.SQL("select claim_seconds from {}.outbox_environments where environment = %s").format(
            sql.Identifier(schema)
        ),
        (rl.environment,),
    ).fetchone() or (None,)
    assert seconds == contract_defaults.lease.duration.total_seconds()
