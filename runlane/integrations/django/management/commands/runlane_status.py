"""``manage.py runlane_status``: ``runlane status`` on ``RUNLANE_APP``, inside Django."""

from __future__ import annotations

from runlane.integrations.django._commands import RunlaneCommand


class Command(RunlaneCommand):
    help = "runlane's status report of RUNLANE_APP: `runlane status`'s options; exit 1 if unhealthy"
    command = "status"
