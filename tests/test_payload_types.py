"""Payload fields typed uuid.UUID and datetime travel through a run and back."""

from __future__ import annotations

import datetime
import uuid

import attrs
import pytest

from runlane import PayloadValidationError, RunContext, task
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, count_runs


@attrs.frozen
class Order:
    order_id: uuid.UUID
    placed_at: datetime.datetime


def test_uuid_and_datetime_fields_reach_the_handler(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    seen: list[Order] = []

    @task(id="orders.ship", schema=Order)
    def ship(payload: Order, context: RunContext) -> str:
        seen.append(payload)
        return str(payload.order_id)

    rl = make_runlane(tasks=[ship])
    order = Order(uuid.uuid4(), datetime.datetime.now(datetime.UTC))
    run = rl.trigger(ship, order)
    by_mapping = rl.trigger(
        ship, {"order_id": str(order.order_id), "placed_at": order.placed_at.isoformat()}
    )
    assert rl.drain().runs_executed == 2
    assert seen == [order, order]
    assert rl.get_run(run.id).output == str(order.order_id)
    assert rl.get_run(by_mapping.id).payload["order_id"] == str(order.order_id)
    for bad in (5, "not-a-uuid"):
        with pytest.raises(PayloadValidationError, match="order_id"):
            rl.trigger(ship, {"order_id": bad, "placed_at": order.placed_at.isoformat()})
    assert count_runs(db, schema) == 2
