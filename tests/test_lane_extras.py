"""Typed lane extras: a lane reports its own status and maintenance fields as frozen attrs
classes (``LaneStatus``, ``LaneMaintenance``) carried by ``StatusReport.lane`` and
``MaintenanceResult.lane``; the names SPEC gives the engine types keep working, and a lane's
own subclass reaches ``runlane status`` (its text, its unhealthy checks, ``--json``)."""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import pytest

from runlane import MaintenanceResult, RunContext, Runlane, create_runlane, task
from runlane._operator.status import format_report, report_document, unhealthy
from runlane.lanes import NOT_RECORDS, LaneMaintenance, LaneStatus
from runlane.maintenance import MaintenanceLimits
from runlane.postgres import PostgresPollingLane, postgres_polling_lane
from runlane.storage import MaintenanceFence, Storage
from tests.conftest import RunlaneFactory


@attrs.frozen
class SpoolStatus(LaneStatus):
    """A lane's own status: a spool with a depth, unhealthy past 10."""

    spool_depth: int = 0

    def problems(self) -> list[str]:
        found = super().problems()
        if self.spool_depth > 10:
            found.append(f"the spool holds {self.spool_depth} items: start a spooler")
        return found

    def rows(self) -> list[tuple[str, str]]:
        return [("spool depth", str(self.spool_depth))]


@attrs.frozen
class SpoolMaintenance(LaneMaintenance):
    spooled: int = 0  # records
    pinged: int = attrs.field(default=0, metadata=NOT_RECORDS)  # notifications


@attrs.frozen
class SpoolLane(PostgresPollingLane):
    """The polling lane, reporting a spool of its own."""

    @property
    def name(self) -> str:
        return "spool"

    def status(self, storage: Storage, environment: str) -> SpoolStatus:
        return SpoolStatus(outbox_pending=3, outbox_oldest_age_seconds=90.0, spool_depth=12)

    def recover_delivery(
        self,
        storage: Storage,
        environment: str,
        limits: MaintenanceLimits,
        fence: MaintenanceFence | None,
    ) -> SpoolMaintenance:
        return SpoolMaintenance(spooled=2, pinged=5, deliveries_recovered=1)


@task(id="extras.noop")
def noop(payload: None, context: RunContext) -> None:
    return None


@pytest.fixture
def spool_runtime(database_url: str, schema: str) -> Iterator[Runlane]:
    base = postgres_polling_lane(connection_string=database_url, schema=schema)
    runtime = create_runlane(lane=SpoolLane(**attrs.asdict(base, recurse=False)), tasks=[noop])
    yield runtime
    runtime.close(timeout=10)


def test_maintenance_results_add_and_total_with_their_lane_part() -> None:
    one = MaintenanceResult(attempts_expired=2, lane=LaneMaintenance(queues_woken=4))
    two = MaintenanceResult(runs_pruned=1, lane=LaneMaintenance(outbox_published=3))
    both = one + two
    assert both == MaintenanceResult(
        attempts_expired=2,
        runs_pruned=1,
        lane=LaneMaintenance(queues_woken=4, outbox_published=3),
    )
    # the names SPEC gives MaintenanceResult read the lane's part
    assert (both.queues_woken, both.outbox_published, both.deliveries_recovered) == (4, 3, 0)
    assert both.total == 6  # queues woken are notifications, not records
    assert both.counts()["outbox_published"] == 3
    assert both.counts()["attempts_expired"] == 2
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        both.lane.outbox_published = 0  # type: ignore[misc]


def test_a_lane_subclass_adds_its_own_counts() -> None:
    empty = MaintenanceResult()
    spool = MaintenanceResult(lane=SpoolMaintenance(spooled=2, pinged=5))
    # a pass's phases start from the base's empty result: it adds to any lane's
    assert empty + spool == spool
    assert spool + empty == spool
    twice = spool + spool
    assert twice.lane == SpoolMaintenance(spooled=4, pinged=10)
    assert twice.total == 4  # pinged is marked NOT_RECORDS
    assert twice.counts()["spooled"] == 4
    with pytest.raises(TypeError, match="different lanes"):
        _ = spool + MaintenanceResult(lane=LaneMaintenance(outbox_published=1))


def test_status_report_reads_the_outbox_through_its_lane_part() -> None:
    assert LaneStatus().problems() == []
    assert LaneStatus(outbox_pending=1, outbox_oldest_age_seconds=61.0).problems() == [
        "the oldest pending outbox item is 61s old (is a publisher running, and can it reach "
        "the transport?)"
    ]
    assert LaneStatus(outbox_pending=1, outbox_oldest_age_seconds=59.0).problems() == []


def test_the_polling_lane_reports_an_empty_outbox(make_runlane: RunlaneFactory) -> None:
    rl = make_runlane(tasks=[noop])
    report = rl.status()
    assert report.lane == LaneStatus(outbox_pending=0)
    assert report.outbox_pending == 0
    assert report.outbox_oldest_age_seconds is None
    result = rl.run_maintenance_once()
    assert type(result.lane) is LaneMaintenance
    assert result.outbox_published == 0


def test_a_lanes_own_fields_reach_status_and_maintenance(spool_runtime: Runlane) -> None:
    report = spool_runtime.status()
    assert report.lane == SpoolStatus(
        outbox_pending=3, outbox_oldest_age_seconds=90.0, spool_depth=12
    )
    assert report.outbox_pending == 3
    result = spool_runtime.run_maintenance_once()
    assert result.lane == SpoolMaintenance(spooled=2, pinged=5, deliveries_recovered=1)
    assert result.deliveries_recovered == 1
    assert result.total == 3  # spooled 2 + recovered 1; pinged is not a record


def test_runlane_status_shows_a_lanes_own_fields(spool_runtime: Runlane) -> None:
    report = spool_runtime.status()
    problems = unhealthy(report)
    assert "the spool holds 12 items: start a spooler" in problems
    assert any("oldest pending outbox item is 90s old" in p for p in problems)
    text = "\n".join(format_report(report))
    assert "spool depth" in text
    assert "pending outbox items" in text
    document = report_document(report)
    assert document["spool_depth"] == 12
    assert document["outbox_pending"] == 3
    assert "lane" not in document  # the lane's fields sit beside the engine's, as before
    assert document["environment"] == "default"


def test_lane_extras_are_frozen_and_typed() -> None:
    assert attrs.fields(LaneMaintenance).queues_woken.metadata == NOT_RECORDS
    assert {f.name for f in attrs.fields(LaneStatus)} == {
        "outbox_pending",
        "outbox_oldest_age_seconds",
    }
