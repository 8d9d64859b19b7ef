"""The management commands' common part: ``manage.py runlane_COMMAND ARGS`` runs
``runlane COMMAND RUNLANE_APP ARGS`` in this process, inside Django."""

from __future__ import annotations

import sys
from argparse import REMAINDER, ArgumentParser
from collections.abc import Sequence
from typing import Any, ClassVar

from django.core.management.base import BaseCommand, CommandError

from runlane import cli
from runlane.integrations.django._settings import app_spec

__all__ = ["RunlaneCommand", "runlane_args"]

# options manage.py itself takes (already applied when a command runs): not runlane's
_DJANGO_VALUED = ("--settings", "--pythonpath")


def runlane_args(command: str, args: Sequence[str]) -> list[str]:
    """The runlane CLI's arguments for ``manage.py runlane_COMMAND args``: RUNLANE_APP as
    APP, manage.py's ``--settings``/``--pythonpath`` left out, its ``--traceback`` passed as
    runlane's."""
    rest: list[str] = []
    traceback = False
    given = iter(args)
    for arg in given:
        if arg in _DJANGO_VALUED:
            next(given, None)
        elif arg.startswith(tuple(f"{name}=" for name in _DJANGO_VALUED)):
            continue
        elif arg == "--traceback":
            traceback = True
        else:
            rest.append(arg)
    return [*(["--traceback"] if traceback else []), command, app_spec(), *rest]


class RunlaneCommand(BaseCommand):
    """``runlane COMMAND`` on ``RUNLANE_APP``; its options are ``runlane COMMAND``'s."""

    command: ClassVar[str]

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "runlane_args",
            nargs=REMAINDER,
            metavar="...",
            help=f"`runlane {self.command}`'s options (`runlane {self.command} --help`)",
        )

    def run_from_argv(self, argv: list[str]) -> None:
        # manage.py runlane_COMMAND ...: runlane's own parser reads the options (and answers
        # --help), and its exit code is manage.py's
        sys.exit(cli.main(runlane_args(self.command, argv[2:])))

    def handle(self, *args: Any, **options: Any) -> None:
        # call_command("runlane_status", "--", "--json"): the same, a failure a CommandError
        given = list(options.get("runlane_args") or [])
        code = cli.main(runlane_args(self.command, given[1:] if given[:1] == ["--"] else given))
        if code:
            raise CommandError(f"runlane {self.command} exited with code {code}", returncode=code)
