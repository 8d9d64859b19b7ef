"""Queues and their flow control: a queue's rate limit and its per-key concurrency
(docs/flow-control.md).

``queue(name, rate_limit=RateLimit(100, timedelta(seconds=1)), key_concurrency_limit=1)``
and ``trigger(..., concurrency_key="customer-42")``. Both limits are counted in Postgres, at
the claim, under the queue's claim lock: every worker, host, lane and ``drain()`` obeys them.
"""

from __future__ import annotations

import math
from datetime import timedelta

import attrs

from runlane._limits import check_name
from runlane.errors import ConfigurationError
from runlane.toolkit import INT32_MAX, as_int, as_int_or_none, shown

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_RATE_PER",
    "MIN_RATE_PER",
    "Queue",
    "RateLimit",
    "check_concurrency_key",
    "check_key_concurrency_limit",
    "check_run_key",
    "queue",
]

#: a concurrency key's size in UTF-8: keys are compared and indexed in every keyed claim
MAX_KEY_BYTES = 200
#: a rate limit's window: from a millisecond to a day (a day's starts are counted from
#: rows kept for the window, so a longer window keeps more of them)
MIN_RATE_PER = timedelta(milliseconds=1)
MAX_RATE_PER = timedelta(days=1)


def _as_per(value: object) -> timedelta:
    if isinstance(value, bool) or not isinstance(value, timedelta | int | float):
        raise ConfigurationError(
            f"RateLimit per must be a timedelta or a number of seconds, got {shown(value)}"
        )
    if isinstance(value, int | float):
        if not math.isfinite(value) or not 0 < value <= MAX_RATE_PER.total_seconds():
            raise ConfigurationError(
                "RateLimit per must be a positive period of at most a day (86400 seconds), "
                f"got {shown(value)}"
            )
        value = timedelta(seconds=value)
    if not MIN_RATE_PER <= value <= MAX_RATE_PER:
        raise ConfigurationError(
            "RateLimit per must be from 1 millisecond to 1 day, got "
            f"{value.total_seconds():g} seconds"
        )
    return value


def _per_us(per: timedelta) -> int:
    return per // timedelta(microseconds=1)


@attrs.frozen(init=False)
class RateLimit:
    """At most ``count`` attempts of the queue start in any window of ``per`` (a timedelta
    or seconds), counted in Postgres at the claim across every worker, host and lane.

    Without ``burst`` the window slides: whenever a run starts, the starts of the ``per``
    before it, this one included, are at most ``count`` (they may all come at once). With
    ``burst`` the starts are spread evenly, one every ``per / count``, and up to ``burst``
    more may start ahead of that schedule (``burst + 1`` at once after a quiet spell); no
    window of ``per`` then sees more than ``count + burst``. ``burst`` is at most ``count``.
    """

    count: int
    per: timedelta
    burst: int | None

    def __init__(self, count: int, per: timedelta | float, *, burst: int | None = None) -> None:
        count = as_int("RateLimit count", count, 1, INT32_MAX)
        period = _as_per(per)
        if _per_us(period) < count:
            raise ConfigurationError(
                f"RateLimit({count}, {period.total_seconds():g} s) asks for more than one start "
                "a microsecond, the resolution of database time: use a longer period or a "
                "smaller count"
            )
        if burst is not None:
            burst = as_int(
                "RateLimit burst",
                burst,
                0,
                count,
                " (a burst above count would let one window start more than twice count)",
            )
        self.__attrs_init__(count, period, burst)

    @property
    def per_us(self) -> int:
        """The window in microseconds (what the claim counts in)."""
        return _per_us(self.per)

    def __repr__(self) -> str:
        burst = "" if self.burst is None else f", burst={self.burst}"
        return f"RateLimit({self.count}, {self.per.total_seconds():g}{burst})"


@attrs.frozen
class Queue:
    """A logical queue. ``concurrency_limit`` caps live attempts across all workers;
    ``rate_limit`` caps attempt starts per window and ``key_concurrency_limit`` live attempts
    per ``concurrency_key`` (docs/flow-control.md)."""

    name: str
    default: bool = False
    concurrency_limit: int | None = None
    rate_limit: RateLimit | None = None
    key_concurrency_limit: int | None = None

    @property
    def limited(self) -> bool:
        """A rate limit or a per-key limit: claims of this queue count starts or keys."""
        return self.rate_limit is not None or self.key_concurrency_limit is not None

    @property
    def bounded(self) -> bool:
        """Any limit: claimed on its own, under the queue's claim lock."""
        return self.concurrency_limit is not None or self.limited

    @property
    def claims_ahead(self) -> bool:
        """Whether a worker may claim runs of this queue ahead of free slots: not when its
        concurrency or its rate is scarce (a run waiting in a worker would hold a slot of
        the queue, or a start); a per-key limit alone holds one key's slot at most."""
        return self.concurrency_limit is None and self.rate_limit is None


def queue(
    name: str,
    *,
    default: bool = False,
    concurrency_limit: int | None = None,
    rate_limit: RateLimit | None = None,
    key_concurrency_limit: int | None = None,
) -> Queue:
    """Define a logical queue; register it with ``create_runlane(queues=[...])``.

    ``rate_limit`` (a :class:`~runlane.RateLimit`) bounds how many attempts start per window;
    ``key_concurrency_limit=N`` lets at most N attempts with the same ``concurrency_key``
    (given to ``trigger``) run at once. Both hold across all workers, hosts and lanes.
    """
    check_name("queue name", name)
    if rate_limit is not None and not isinstance(rate_limit, RateLimit):
        raise ConfigurationError(
            f"queue {name!r}: rate_limit must be a runlane.RateLimit or None, got "
            f"{shown(rate_limit)}"
        )
    key_limit = check_key_concurrency_limit(name, key_concurrency_limit)
    # at most what the database counts it in (an integer column)
    as_int_or_none(f"queue {name!r}: concurrency_limit", concurrency_limit, 1, INT32_MAX)
    return Queue(
        name=name,
        default=default,
        concurrency_limit=concurrency_limit,
        rate_limit=rate_limit,
        key_concurrency_limit=key_limit,
    )


def check_key_concurrency_limit(queue: str, value: object) -> int | None:
    """None, or a positive int32: a queue's ``key_concurrency_limit``."""
    if value is None:
        return None
    return as_int(f"queue {queue!r}: key_concurrency_limit", value, 1, INT32_MAX)


def check_concurrency_key(value: object) -> str:
    """A concurrency key: a non-empty string of at most 200 bytes in UTF-8, without NUL."""
    if not isinstance(value, str) or not value:
        raise ConfigurationError(
            f"concurrency_key must be a non-empty string or None, got {shown(value)}"
        )
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ConfigurationError(
            f"concurrency_key must be valid Unicode text; {shown(value)} holds "
            f"{value[exc.start]!r}, a lone surrogate"
        ) from None
    if size > MAX_KEY_BYTES:
        raise ConfigurationError(
            f"concurrency_key must be at most {MAX_KEY_BYTES} bytes in UTF-8, got "
            f"{size:,} bytes ({shown(value)})"
        )
    if "\x00" in value:
        raise ConfigurationError(
            "concurrency_key must not contain the NUL character (\\x00), which Postgres text "
            f"cannot hold: got {shown(value)}"
        )
    return value


def check_run_key(queue: Queue, key: object) -> str | None:
    """A trigger's ``concurrency_key`` for a run of ``queue``: None, or a valid key of a
    queue with a ``key_concurrency_limit`` (a key anywhere else is refused, not ignored)."""
    if key is None:
        return None
    checked = check_concurrency_key(key)
    if queue.key_concurrency_limit is None:
        raise ConfigurationError(
            f"concurrency_key was given for a run of queue {queue.name!r}, which has no "
            "key_concurrency_limit: define the queue with queue(..., key_concurrency_limit=N), "
            "or trigger without a key"
        )
    return checked
