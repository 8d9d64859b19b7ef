"""Queues the broker cannot serve, for ``status()`` and the console's health list.

A publisher whose publish gets no confirm within ``publish_timeout`` fails that queue's
outbox items alone (``_publisher.py``); an item that failed ``FAILING_AFTER`` times or more
marks its queue unhealthy here. The usual cause is a quorum queue without a leader:
RabbitMQ 3.10 loses a quorum queue's leader for good when its node is killed within about
0.5 s of the queue's declaration (its member registry is saved every 0.5 s), and from then on
every publish to it times out while the queue still shows as running.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from runlane.rabbitmq._amqp import queue_name

__all__ = ["FAILING_AFTER", "queue_problems"]

# failures of one item before its queue is reported (one can be a broker restart
# mid-publish); the outbox_failing_queues statement and the outbox_failing index (migration
# 11) spell it out
FAILING_AFTER = 2


def queue_problems(schema: str, environment: str, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per failing queue (rows of ``outbox_failing_queues``): what is wrong, with
    the broker's queue named, and what to do."""
    problems = []
    for row in rows:
        name = queue_name(schema, environment, str(row["queue"]))
        problems.append(
            f"RabbitMQ queue {name} (runlane queue {row['queue']!r}) cannot be served: "
            f"{row['items']} runs wait to be published, one failed {row['failures']} times "
            f"(last error: {row['last_error']}); its runs are safe in Postgres. Check it with "
            f"`rabbitmq-queues quorum_status {name}`; a quorum queue with no leader (RabbitMQ "
            "3.10 loses it for good when its node is killed within about 0.5 s of the queue's "
            f"declaration) does not recover: delete it (`rabbitmqctl delete_queue {name}`), "
            "runlane declares it again and publishes the runs (docs/deploying.md, 'A queue the "
            "broker cannot serve')"
        )
    return problems
