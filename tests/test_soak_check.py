"""The chaos soak's invariant checks on records made up here (the soak itself runs in
tests/test_soak.py, marked slow)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tests.soak.check import _lease_ending_outages, _overlap
from tests.soak.faults import Event


def test_the_bounded_queue_check_stops_counting_a_handler_once_an_outage_lapsed_its_lease() -> None:
    """The soak's bounded-queue check counts a handler only while it can hold its slot: one
    blocked through an outage at least as long as a lease (no lease can be extended through
    it) stops counting at the outage's start plus one lease, when the next claim may take
    the slot; a shorter outage, or another worker's stall, does not end its lease."""
    at = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    lease = timedelta(seconds=4)

    def second(s: float) -> datetime:
        return at + timedelta(seconds=s)

    def peak(events: list[Event]) -> tuple[int, int]:
        rows = [
            ("w1.0", second(-1), second(12), 0.0),  # blocked through the outage, ends late
            ("w2.0", second(9), second(11), 0.0),  # claimed after the outage ended
        ]
        return _overlap(rows, {}, {}, {}, second(20), outages=_lease_ending_outages(events, lease))

    restart = Event("postgres-restart", at, second(8))
    assert peak([restart]) == (1, 2)
    assert peak([Event("postgres-restart", at, second(3))]) == (2, 2)  # shorter than a lease
    stall = Event("proxy-stall", at, second(8), {"proc": "w1.0"})
    assert peak([stall]) == (1, 2)
    other = Event("proxy-stall", at, second(8), {"proc": "w3.0"})
    assert peak([other]) == (2, 2)
    assert peak([]) == (2, 2)


def test_the_bounded_queue_check_stops_counting_a_handler_when_its_lease_lapsed() -> None:
    """A handler whose attempt maintenance found expired stops holding its slot when its
    lease lapsed (the moment the attempt's error names), which can be before its process's
    stall plus one lease: a stalled worker's last extension came before the stall (a CI run
    of the soak counted 4 of 3 here, the other worker's claims 11 ms after the lapse)."""
    at = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    lease = timedelta(seconds=4)

    def second(s: float) -> datetime:
        return at + timedelta(seconds=s)

    stall = Event("proxy-stall", second(1), second(9), {"proc": "w4.0"})
    outages = _lease_ending_outages([stall], lease)  # the stall ends its leases by second 5
    stalled = ("w4.0", second(1.5), second(9), 0.0)
    others = [(f"w1.{n}", second(4.1), second(4.2), 0.0) for n in range(2)]
    assert _overlap([stalled, *others], {}, {}, {}, second(20), outages=outages) == (3, 3)
    lapsed = (*stalled, second(4))  # its lease lapsed at second 4 (claimed at 0, not extended)
    assert _overlap([lapsed, *others], {}, {}, {}, second(20), outages=outages) == (2, 3)
    unexpired = (*stalled, None)  # an attempt not found expired: as before
    assert _overlap([unexpired, *others], {}, {}, {}, second(20), outages=outages) == (3, 3)
