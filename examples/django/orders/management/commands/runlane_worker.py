"""``python manage.py runlane_worker [--concurrency N] [--queues a,b] [--with-maintenance]``:
runlane's worker on the shop's runtime, inside Django (settings, app registry, logging);
SIGTERM or Ctrl-C closes it gracefully, as ``runlane worker`` does."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from runlane import cli


class Command(BaseCommand):
    help = "Run a runlane worker for the shop's tasks"

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--concurrency", type=int, default=4, help="handler threads")
        parser.add_argument("--queues", default=None, help="comma-separated queue names")
        parser.add_argument(
            "--with-maintenance",
            action="store_true",
            help="also run runlane's maintenance services in this process",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        argv = [
            "worker",
            "orders.runlane_app:runlane",
            "--concurrency",
            str(options["concurrency"]),
        ]
        if options["queues"]:
            argv += ["--queues", options["queues"]]
        if options["with_maintenance"]:
            argv.append("--with-maintenance")
        code = cli.main(argv)
        if code:
            raise CommandError(f"the runlane worker exited with code {code}", returncode=code)
