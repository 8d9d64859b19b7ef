"""The RabbitMQ lane's status (:class:`RabbitMQStatus`) and the queues the broker cannot
serve, for ``status()`` and the console's health list.

An item that failed to publish ``FAILING_AFTER`` times or more marks its queue unhealthy.
The usual cause: a quorum queue that lost its leader for good (RabbitMQ 3.10, its node
killed within about 0.5 s of the declaration), to which every publish times out while the
queue still shows as running.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from runlane.errors import ConfigurationError
from runlane.lanes import LaneStatus
from runlane.models import StatusReport
from runlane.rabbitmq._amqp import queue_name, refused_for_its_type
from runlane.storage import FailingQueue
from runlane.toolkit import count_of

__all__ = ["FAILING_AFTER", "RabbitMQStatus", "queue_problems"]

# failures of one item before its queue is reported (one can be a broker restart
# mid-publish); the outbox_failing_queues statement and the outbox_failing index (migration
# 11) spell it out
FAILING_AFTER = 2


def queue_problems(schema: str, environment: str, rows: Sequence[FailingQueue]) -> list[str]:
    """One line per failing queue (``Outbox.outbox_failing_queues``): what is wrong, with
    the broker's queue named, and what to do."""
    problems = []
    for row in rows:
        name = queue_name(schema, environment, row.queue)
        if refused_for_its_type(row.last_error):
            cause = "the broker holds it with another type than this runtime's queue_type; "
            remedy = (
                "Give every runtime of the schema the same queue_type, or switch the queue "
                "over (docs/deploying.md, 'Quorum or classic queues')"
            )
        else:
            cause = ""
            remedy = (
                f"Check it with `rabbitmq-queues quorum_status {name}`; a quorum queue with no "
                "leader (RabbitMQ 3.10 loses it for good when its node is killed within about "
                "0.5 s of the queue's declaration) does not recover: delete it (`rabbitmqctl "
                f"delete_queue {name}`), runlane declares it again and publishes the runs "
                "(docs/deploying.md, 'A queue the broker cannot serve')"
            )
        problems.append(
            f"RabbitMQ queue {name} (runlane queue {row.queue!r}) cannot be served: {cause}"
            f"{count_of(row.items, 'run')} {'waits' if row.items == 1 else 'wait'} to be "
            f"published, one failed {count_of(row.failures, 'time')} "
            f"(last error: {row.last_error}); its runs are safe in Postgres. {remedy}"
        )
    return problems


@attrs.frozen
class RabbitMQStatus(LaneStatus):
    """The RabbitMQ lane's part of a status report (``StatusReport.lane``): the outbox's
    pending items (``LaneStatus``), whether the broker answers, and the broker queues it
    cannot serve."""

    broker: str | None = None  # "reachable at host:port" or "unreachable at host:port (...)"
    # the broker queues that cannot be served (publishes of their runs keep timing out), one
    # line each naming the queue and what to do
    broker_problems: tuple[str, ...] = ()

    @classmethod
    def of(cls, report: StatusReport) -> RabbitMQStatus:
        """``report.lane``, typed: the RabbitMQ lane's part of a status report (e.g.
        ``RabbitMQStatus.of(runlane.status()).broker``). Raises
        :class:`~runlane.ConfigurationError` for the report of a runtime on another lane."""
        if not isinstance(report.lane, cls):
            raise ConfigurationError(
                f"this status report is not the RabbitMQ lane's (its lane part is "
                f"{type(report.lane).__name__}): the runtime was built on another lane"
            )
        return report.lane

    def problems(self) -> list[str]:
        found = super().problems()
        if self.broker is not None and self.broker.startswith("unreachable"):
            found.append(f"broker {self.broker}")
        return found + list(self.broker_problems)

    def rows(self) -> list[tuple[str, str]]:
        return [] if self.broker is None else [("broker", self.broker)]
