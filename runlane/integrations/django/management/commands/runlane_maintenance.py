"""``manage.py runlane_maintenance``: ``runlane maintenance`` on ``RUNLANE_APP``, inside Django."""

from __future__ import annotations

from runlane.integrations.django._commands import RunlaneCommand


class Command(RunlaneCommand):
    help = "runlane's maintenance services on RUNLANE_APP: `runlane maintenance`'s options"
    command = "maintenance"
