"""Reading a StatusReport: which checks are unhealthy, and the text ``runlane status`` prints."""

from __future__ import annotations

from typing import Any

import attrs

from runlane.models import StatusReport
from runlane.toolkit import count_of

__all__ = ["format_report", "report_document", "unhealthy"]


def unhealthy(report: StatusReport) -> list[str]:
    """One line per failing check (empty when every check passes)."""
    problems: list[str] = []
    if report.expired_leases:
        problems.append(
            f"{count_of(report.expired_leases, 'running attempt')} "
            f"{_verb(report.expired_leases, 'holds an expired lease', 'hold expired leases')} "
            "(their workers died or stalled; maintenance recovers them)"
        )
    if report.deferred_past_due:
        problems.append(
            f"{count_of(report.deferred_past_due, 'retrying or released run')} "
            f"{_verb(report.deferred_past_due, 'is', 'are')} past due "
            "(maintenance makes them queued again)"
        )
    if report.tokens_past_timeout:
        problems.append(
            f"{count_of(report.tokens_past_timeout, 'pending wait token')} "
            f"{_verb(report.tokens_past_timeout, 'is', 'are')} past "
            f"{_verb(report.tokens_past_timeout, 'its', 'their')} timeout"
        )
    if report.resolved_tokens_with_waiting_runs:
        most = report.resolved_tokens[0] if report.resolved_tokens else None
        problems.append(
            f"{count_of(report.resolved_tokens_with_waiting_runs, 'resolved wait token')} still "
            f"{_verb(report.resolved_tokens_with_waiting_runs, 'has', 'have')} "
            f"{count_of(report.runs_waiting_on_resolved_tokens, 'waiting run')}"
            + (
                ""
                if most is None
                else f" (most: token {most.token_id}, {count_of(most.waiting_runs, 'run')}, "
                f"resolved {most.resolved_age_seconds:.0f}s ago)"
            )
            + "; maintenance resumes them (wait_token_resume_limit a pass): a count that "
            "does not fall between looks is stuck"
        )
    if report.stuck_cancellations:
        problems.append(
            f"{count_of(report.stuck_cancellations, 'run')} "
            f"{_verb(report.stuck_cancellations, 'is', 'are')} stuck in cancellation_requested"
        )
    deferred = sum(q.retrying for q in report.queues) + report.waiting
    if deferred and not any(lease.live for lease in report.maintenance_leases):
        problems.append(
            f"{count_of(deferred, 'run')} {_verb(deferred, 'waits', 'wait')} for maintenance "
            "(retries, releases, sleeps, tokens) and "
            "no maintenance band has a live owner: run `runlane maintenance APP` or "
            "`runlane worker APP --with-maintenance`"
        )
    problems.extend(report.lane.problems())
    if report.late_schedules:
        problems.append(
            f"{count_of(len(report.late_schedules), 'schedule')} "
            f"{_verb(len(report.late_schedules), 'is', 'are')} late, "
            f"{_verb(len(report.late_schedules), 'its', 'their')} next fire time long past "
            f"({_listed(report.late_schedules)}): is maintenance running with the application "
            "that defines them? A schedule no application defines any more stays late until "
            "paused (`runlane schedules pause ID`)"
        )
    return problems


def _verb(n: int, one: str, more: str) -> str:
    return one if n == 1 else more


def _listed(names: tuple[str, ...], shown: int = 5) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def format_report(report: StatusReport) -> list[str]:
    """The lines ``runlane status`` prints."""
    rows: list[tuple[str, object]] = [
        ("queued and due", report.queued_due),
        ("running", report.running),
        ("  of which claimed, not started", report.claimed_not_started),
        ("waiting", report.waiting),
        ("retrying/released past due", report.deferred_past_due),
        ("expired active leases", report.expired_leases),
        ("stuck in cancellation_requested", report.stuck_cancellations),
        ("tombstones with children", report.tombstones_with_children),
        ("tombstones' remaining children", report.tombstone_remaining_children),
        ("pending tokens past timeout", report.tokens_past_timeout),
        ("resolved tokens with waiting runs", report.resolved_tokens_with_waiting_runs),
        ("runs waiting on resolved tokens", report.runs_waiting_on_resolved_tokens),
        ("pending outbox items", "n/a" if report.outbox_pending is None else report.outbox_pending),
    ]
    if report.outbox_oldest_age_seconds is not None:
        rows.append(("oldest pending outbox item", f"{report.outbox_oldest_age_seconds:.1f}s old"))
    rows.extend(report.lane.rows())
    rows.append(("late schedules", _listed(report.late_schedules) or 0))
    lines = [f"environment {report.environment!r}"]
    lines += [f"  {label:<34} {value}" for label, value in rows]
    if report.oldest_deferred_due_at is not None:
        lines.append(
            f"  {'oldest deferred due at':<34} {report.oldest_deferred_due_at.isoformat()}"
        )
    lines.append("queues")
    lines.append(
        f"  {'name':<20} {'queued':>8} {'running':>8} {'claimed':>8} {'retrying':>9} "
        f"{'waiting':>8} {'leases/limit':>13}"
    )
    for q in report.queues:
        limit = "-" if q.concurrency_limit is None else str(q.concurrency_limit)
        lines.append(
            f"  {q.name:<20} {q.queued:>8} {q.running:>8} {q.claimed:>8} {q.retrying:>9} "
            f"{q.waiting:>8} {f'{q.live_leases}/{limit}':>13}" + ("  PAUSED" if q.paused else "")
        )
    if report.resolved_tokens:
        lines.append("resolved tokens with waiting runs (most first)")
        lines += [
            f"  {t.token_id}  {t.waiting_runs:>6} runs  resolved {t.resolved_age_seconds:.0f}s ago"
            for t in report.resolved_tokens
        ]
    lines.append("maintenance bands")
    if not report.maintenance_leases:
        lines.append("  (no band has been owned yet: is `runlane maintenance` running?)")
    for lease in report.maintenance_leases:
        state = "live" if lease.live else "EXPIRED"
        lines.append(
            f"  {lease.band:<12} fencing {lease.fencing:<6} {state:<8} "
            f"until {lease.expires_at.isoformat()}  owner {lease.owner}"
        )
    return lines


def report_document(report: StatusReport) -> dict[str, Any]:
    """The report as ``runlane status --json`` writes it: its fields, with the lane's (the
    outbox's, a transport lane's broker) at the top level beside them."""
    document = attrs.asdict(report, filter=lambda a, _: a.name != "lane")
    document.update(attrs.asdict(report.lane))
    return document
