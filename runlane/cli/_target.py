"""Which runtime an operator command acts on: an application's ``APP``, or a database URL
(``--database-url``, ``--schema``, ``--environment`` or their ``$RUNLANE_*`` variables).

With a URL the command builds a runtime with no tasks on the polling lane, so the
application's code need not be importable; on a RabbitMQ-lane schema the database's
triggers still write the outbox items of runs an operator queues again.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence

from runlane.errors import ConfigurationError
from runlane.postgres import postgres_polling_lane
from runlane.runtime import Runlane, create_runlane
from runlane.toolkit import shown

__all__ = ["LoadApp", "Target", "add_target_options", "split_targets", "target_runtime"]

LoadApp = Callable[[str], Runlane]

TARGET_HELP = (
    "APP (module:attribute naming a Runlane); or leave it out and give --database-url "
    "(or $RUNLANE_DATABASE_URL)"
)


def add_target_options(parser: argparse.ArgumentParser) -> None:
    """``--database-url``, ``--schema`` and ``--environment``: the runtime without ``APP``."""
    group = parser.add_argument_group("without APP")
    group.add_argument(
        "--database-url",
        default=None,
        metavar="URL",
        help="PostgreSQL URL of the runlane schema (default: $RUNLANE_DATABASE_URL)",
    )
    group.add_argument(
        "--schema",
        default=None,
        metavar="S",
        help="schema name (default: $RUNLANE_SCHEMA, then runlane)",
    )
    group.add_argument(
        "--environment",
        default=None,
        metavar="E",
        help="environment (default: $RUNLANE_ENVIRONMENT, then default)",
    )


class Target:
    """An ``APP`` spec or nothing, with the URL options: opened on demand, closed after."""

    def __init__(self, app: str | None, args: argparse.Namespace) -> None:
        self.app = app
        self.database_url: str | None = getattr(args, "database_url", None)
        self.schema: str | None = getattr(args, "schema", None)
        self.environment: str | None = getattr(args, "environment", None)


def split_targets(values: Sequence[str], *, want_run_ids: bool) -> tuple[str | None, list[str]]:
    """Tell ``APP`` from run ids among positional words: ``APP`` holds a colon, a run id
    (a UUID) does not; a word that is neither is refused by the run's lookup, naming it.
    Returns (APP or None, run ids)."""
    app: str | None = None
    run_ids: list[str] = []
    for value in values:
        if ":" in value:
            if app is not None:
                raise ConfigurationError(f"two APPs given: {shown(app)} and {shown(value)}")
            app = value
            continue
        if not want_run_ids:
            raise ConfigurationError(
                f"{value[:80]!r} is not an APP (module:attribute): give APP, or "
                "--database-url URL without APP"
            )
        run_ids.append(value)
    return app, run_ids


def target_runtime(target: Target, load_app: LoadApp) -> Runlane:
    """The runtime a command acts on. URL options given with ``APP`` are refused: the
    application's lane already names its database."""
    url_options = [
        name
        for name, value in (
            ("--database-url", target.database_url),
            ("--schema", target.schema),
            ("--environment", target.environment),
        )
        if value is not None
    ]
    if target.app is not None:
        if url_options:
            raise ConfigurationError(
                f"{', '.join(url_options)} and APP both given: APP's lane names its database "
                "and environment; give one or the other"
            )
        return load_app(target.app)
    url = target.database_url or os.environ.get("RUNLANE_DATABASE_URL")
    if not url:
        raise ConfigurationError(
            "no APP and no database URL: give APP (module:attribute naming a Runlane), or "
            "--database-url URL (or set RUNLANE_DATABASE_URL)"
        )
    schema = target.schema or os.environ.get("RUNLANE_SCHEMA") or "runlane"
    environment = target.environment or os.environ.get("RUNLANE_ENVIRONMENT") or "default"
    return create_runlane(
        lane=postgres_polling_lane(connection_string=url, schema=schema),
        environment=environment,
    )
