"""``manage.py runlane_audit``: ``runlane audit`` on ``RUNLANE_APP``, inside Django."""

from __future__ import annotations

from runlane.integrations.django._commands import RunlaneCommand


class Command(RunlaneCommand):
    help = "runlane's audit trail of RUNLANE_APP, newest first: `runlane audit`'s options"
    command = "audit"
