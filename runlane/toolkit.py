"""What a lane (the shipped ones, and one written outside runlane) builds its threads and
checks with: one back-off for reconnecting loops, closing in parts within one deadline,
interruptible waits for a supervising main thread, bounds checks that name the option, the
range and the value, and ``shown``: a value's repr cut to a bound for messages.

A close runs every part even when one fails, and its waits share one :class:`Deadline`, so
several stalled parts cost one timeout, not one each. A main thread waits in slices:
Python runs a signal handler only when the main thread runs Python code again.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TypeGuard

from runlane.errors import ConfigurationError

__all__ = [
    "INT32_MAX",
    "MAX_DURATION",
    "MAX_SHOWN_CHARS",
    "MAX_WAIT_SECONDS",
    "Backoff",
    "Closing",
    "Deadline",
    "as_int",
    "as_int32",
    "as_int_or_none",
    "as_seconds",
    "as_timedelta",
    "as_wait_timeout",
    "clipped",
    "count_of",
    "noun_for",
    "shown",
    "wait_event",
    "wait_in_slices",
]

log = logging.getLogger("runlane")

# a private generator: the global one belongs to the application (and to test tools)
_random = random.Random()

# the largest number stored in a Postgres integer column or cast (priorities, attempts,
# queue concurrency limits)
INT32_MAX = 2**31 - 1
# delays, timeouts and sleeps (retry delays too): a due time must stay a datetime Python and
# Postgres agree on (Python's end at year 9999), and nothing waits a century on purpose
MAX_DURATION = timedelta(days=36_525)
# a wait for threads (close's timeout, wait_until_closed's): longer ones, float("inf")
# included, are cut to this, which every wait of threading, select and the drivers accepts
# (threading.TIMEOUT_MAX, about 292 years, is the hard ceiling)
MAX_WAIT_SECONDS = min(MAX_DURATION.total_seconds(), threading.TIMEOUT_MAX)

MAX_SHOWN_CHARS = 100

# the longest the main thread waits at a time: how late a signal handler may run
_SLICE_SECONDS = 0.25


class Backoff:
    """Delays from ``first`` (50 ms) growing ``factor`` times (doubling) up to ``cap``
    seconds, each spread over its lower half."""

    def __init__(self, first: float = 0.05, cap: float = 5.0, factor: float = 2.0) -> None:
        self._first = first
        self._cap = cap
        self._factor = factor
        self._delay = first
        self._lock = threading.Lock()

    def next(self) -> float:
        with self._lock:
            delay, self._delay = self._delay, min(self._delay * self._factor, self._cap)
        return delay * _random.uniform(0.5, 1.0)

    def reset(self) -> None:
        with self._lock:
            self._delay = self._first


class Closing:
    """The parts of one close: ``with closing.part("the writer"): ...`` for each, then
    ``closing.raise_first()``. A part's error (even a ``KeyboardInterrupt``) is kept, not
    raised, so the next parts still run; errors after the first are logged."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._first: BaseException | None = None

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        try:
            yield
        except BaseException as exc:
            if self._first is None:
                self._first = exc
            else:
                log.warning(
                    "runlane: closing %s: %s failed as well", self._what, name, exc_info=True
                )

    def raise_first(self) -> None:
        """Raise the first part's error, if any part failed."""
        first, self._first = self._first, None
        if first is not None:
            raise first


class Deadline:
    """One bound shared by every wait of a close: each wait gets what is left of it.
    ``None`` (no timeout) leaves every wait unbounded."""

    def __init__(self, timeout: float | None) -> None:
        self._end = None if timeout is None else time.monotonic() + timeout

    def left(self, floor: float = 0.0) -> float | None:
        """Seconds left (at least ``floor``), or None without a timeout."""
        return None if self._end is None else max(floor, self._end - time.monotonic())


def wait_in_slices(wait: Callable[[float], bool], timeout: float | None = None) -> bool:
    """Call ``wait(seconds)`` (True once what it waits for happened) a slice at a time until
    it returns True, or until ``timeout`` seconds passed (None: no limit): then False. Between
    slices the main thread runs the handler of a signal delivered to any thread."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = _SLICE_SECONDS if deadline is None else deadline - time.monotonic()
        if left <= 0:
            return False
        if wait(min(_SLICE_SECONDS, left)):
            return True


def wait_event(event: threading.Event, timeout: float | None) -> bool:
    """``event.wait(timeout)`` (None: no limit); on the main thread, a slice at a time."""
    if threading.current_thread() is not threading.main_thread():
        return event.wait(timeout)
    return event.is_set() or wait_in_slices(event.wait, timeout)


def as_int(
    name: str, value: object, minimum: int, maximum: int | None = None, hint: str = ""
) -> int:
    """An int (not a bool) from ``minimum`` to ``maximum`` (None: no upper bound): the one
    check of every count, limit and size given to runlane (arguments, options, CLI flags);
    ``hint`` ends the message."""
    if not _int_within(value, minimum, maximum):
        raise ConfigurationError(_int_message(name, value, minimum, maximum, hint))
    return value


def as_int_or_none(
    name: str, value: object, minimum: int, maximum: int | None = None, hint: str = ""
) -> int | None:
    """:func:`as_int`, or None (no limit): its message says None is allowed too."""
    if value is None:
        return None
    if not _int_within(value, minimum, maximum):
        raise ConfigurationError(_int_message(name, value, minimum, maximum, hint, or_none=True))
    return value


def _int_within(value: object, minimum: int, maximum: int | None) -> TypeGuard[int]:
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value >= minimum
        and (maximum is None or value <= maximum)
    )


def _int_message(
    name: str,
    value: object,
    minimum: int,
    maximum: int | None,
    hint: str,
    *,
    or_none: bool = False,
) -> str:
    allowed = f"of at least {minimum}" if maximum is None else f"from {minimum} to {maximum}"
    none = " or None" if or_none else ""
    return f"{name} must be an integer {allowed}{none}, got {shown(value)}{hint}"


def as_int32(name: str, value: object, minimum: int = -INT32_MAX - 1) -> int:
    """An int (not a bool) from ``minimum`` to 2**31 - 1: the range of the integer column."""
    return as_int(name, value, minimum, INT32_MAX)


def _span(delta: timedelta) -> str:
    """A bound or a value for a message: "0", "1 second", "1 day", "100 years", "2.5 seconds"."""
    if delta == MAX_DURATION:
        return "100 years"
    if delta.days and not delta.seconds and not delta.microseconds:
        return f"{delta.days} day{'s' if delta.days != 1 else ''}"
    seconds = delta.total_seconds()
    return "0" if seconds == 0 else "1 second" if seconds == 1 else f"{seconds:g} seconds"


def as_timedelta(name: str, value: object, minimum: timedelta, maximum: timedelta) -> timedelta:
    """A timedelta from ``minimum`` to ``maximum``: leases, poll intervals, retention."""
    if not isinstance(value, timedelta) or not minimum <= value <= maximum:
        got = _span(value) if isinstance(value, timedelta) else shown(value)
        raise ConfigurationError(
            f"{name} must be a timedelta from {_span(minimum)} to {_span(maximum)}, got {got}"
        )
    return value


def as_seconds(name: str, value: object, maximum: float) -> float:
    """A positive, finite number of seconds of at most ``maximum`` (a connect timeout)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value <= maximum  # False for NaN
    ):
        raise ConfigurationError(
            f"{name} must be a number of seconds above 0 and at most {maximum:g}, "
            f"got {shown(value)}"
        )
    return float(value)


def as_wait_timeout(name: str, value: object, *, unbounded: str = "None") -> float | None:
    """How long a close, or a wait for threads, may take: None (as long as it takes) or a
    number of seconds >= 0. Past 100 years (``float("inf")`` included) it is cut to 100
    years, which every wait accepts (threading refuses more than about 292): a longer wait
    is as good as none. The one rule of every close timeout, the CLI's --shutdown-timeout
    too (whose ``unbounded`` spelling is ``inf``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigurationError(
            f"{name} must be {unbounded} (wait as long as it takes) or a number of seconds "
            f">= 0 (not negative, not NaN), got {shown(value)}"
        )
    return float(min(value, MAX_WAIT_SECONDS))


def shown(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """``repr(value)``, or its start and a count when longer than ``limit`` characters; a
    description instead when ``repr()`` fails."""
    if isinstance(value, str) and len(value) > limit:  # no repr() of the whole string
        return f"a string of {len(value):,} characters starting {value[: limit // 2]!r}"
    try:
        text = repr(value)
    except Exception:  # a user type's __repr__, or an int too long to print
        if isinstance(value, int):
            return f"an integer of {value.bit_length():,} bits"
        return f"a {type(value).__name__} (its repr() failed)"
    if len(text) <= limit:
        return text
    if isinstance(value, int) and text.lstrip("-").isdigit():
        return f"an integer of {len(text.lstrip('-')):,} digits"
    return f"{text[:limit]}... ({len(text):,} characters)"


def clipped(text: str, limit: int = 300) -> str:
    """``text`` (a message, not a value: no quotes added), cut to ``limit`` characters."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


def count_of(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun`` agreeing in number, as the CLI and the console print counts:
    ``1 run``, ``0 runs``, ``20,000 runs`` (``plural`` when not ``noun + "s"``)."""
    return f"{n:,} {noun_for(n, noun, plural)}"


def noun_for(n: int, noun: str, plural: str | None = None) -> str:
    """``noun`` when ``n`` is 1, else its plural (``plural``, or ``noun + "s"``)."""
    return noun if n == 1 else plural or noun + "s"
