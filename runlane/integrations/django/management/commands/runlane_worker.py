"""``manage.py runlane_worker``: ``runlane worker`` on ``RUNLANE_APP``, inside Django."""

from __future__ import annotations

from runlane.integrations.django._commands import RunlaneCommand


class Command(RunlaneCommand):
    help = "A runlane worker on RUNLANE_APP: `runlane worker`'s options; SIGTERM stops it cleanly"
    command = "worker"
