"""Option values shared by several commands: seconds, queue lists, --wait-for-database."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from runlane.errors import ConfigurationError
from runlane.runtime import DEFAULT_WAIT_FOR_DATABASE
from runlane.toolkit import as_wait_timeout

__all__ = ["add_wait_option", "positive_seconds", "queue_names", "seconds", "timeout_seconds"]


def seconds(value: str) -> float:
    """The type of a seconds option: any number (the API judges its range)."""
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None


def positive_seconds(value: str) -> float:
    number = seconds(value)
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value!r}")
    return number


def timeout_seconds(option: str) -> Callable[[str], float]:
    """The type of a timeout option: the close timeout's one rule (``as_wait_timeout``),
    seconds >= 0, ``inf`` for as long as it takes (its 100 years). -1 and nan are refused
    before the command starts, not at the stop signal (where the process hung until
    SIGKILL)."""

    def parse(value: str) -> float:
        try:
            limit = as_wait_timeout(option, seconds(value), unbounded="inf")
        except ConfigurationError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        assert limit is not None  # a float is never None
        return limit

    return parse


def add_wait_option(parser: argparse.ArgumentParser, default: float | None) -> None:
    parser.add_argument(
        "--wait-for-database",
        type=timeout_seconds("--wait-for-database"),
        default=default,
        metavar="SECONDS",
        help="how long the start waits for a database that is restarting, starting up, "
        "refusing connections or out of connection slots, logging a line per retry "
        f"(default {DEFAULT_WAIT_FOR_DATABASE:g}; 0 fails at once; inf waits as long as it "
        "takes); a host that does not resolve, a refused password, a missing database or "
        "schema fail at once",
    )


def queue_names(value: str | None) -> list[str] | None:
    """``--queues a,b``: the names (None: every queue)."""
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]
