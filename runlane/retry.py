"""Retry policies and the pure backoff arithmetic behind them."""

from __future__ import annotations

import math
import random
from datetime import timedelta

import attrs

from runlane.errors import ConfigurationError
from runlane.toolkit import MAX_DURATION, as_int32

__all__ = ["RetryPolicy", "next_retry_delay"]

# a private generator: the global one belongs to the application (and to test tools)
_random = random.Random()


def _check_types(policy: RetryPolicy) -> None:
    # the attempts column is an integer: past 2**31 - 1 every run of the task (a schedule's
    # too, on every maintenance pass) would be refused by the database
    as_int32("RetryPolicy.max_attempts", policy.max_attempts, minimum=1)
    for name in ("initial_delay", "max_delay"):
        value = getattr(policy, name)
        if not isinstance(value, timedelta):
            raise ConfigurationError(f"RetryPolicy.{name} must be a timedelta, got {value!r}")
    for name in ("multiplier", "jitter"):
        value = getattr(policy, name)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ConfigurationError(f"RetryPolicy.{name} must be a finite number, got {value!r}")


def _check_policy(policy: RetryPolicy) -> None:
    _check_types(policy)
    if policy.initial_delay < timedelta(0):
        raise ConfigurationError(
            f"RetryPolicy.initial_delay must not be negative, got {policy.initial_delay}"
        )
    if policy.max_delay < policy.initial_delay:
        raise ConfigurationError(
            f"RetryPolicy.max_delay ({policy.max_delay}) must be at least initial_delay "
            f"({policy.initial_delay})"
        )
    if policy.multiplier < 1:
        raise ConfigurationError(
            f"RetryPolicy.multiplier must be at least 1, got {policy.multiplier}"
        )
    if not 0 <= policy.jitter <= 1:
        raise ConfigurationError(f"RetryPolicy.jitter must lie in [0, 1], got {policy.jitter}")


@attrs.frozen
class RetryPolicy:
    """How often a failing run is attempted and how long it waits between attempts.

    The wait before attempt ``n + 1`` is ``initial_delay * multiplier ** (n - 1)``, spread by
    ``± jitter`` (a fraction) and capped at ``max_delay`` (and at 100 years).
    """

    max_attempts: int = 3
    initial_delay: timedelta = timedelta(seconds=1)
    max_delay: timedelta = timedelta(minutes=10)
    multiplier: float = 2.0
    jitter: float = 0.2

    def __attrs_post_init__(self) -> None:
        _check_policy(self)

    def delay_after(self, attempt: int, rng: random.Random | None = None) -> timedelta:
        """The wait after failed attempt number ``attempt`` (1-based) before the next one."""
        if attempt < 1:
            raise ValueError(f"attempt numbers start at 1, got {attempt}")
        # beyond a century a due time leaves what Postgres (and Python) can hold: the
        # failure's write would be refused, and with it every write batched alongside
        cap = min(self.max_delay, MAX_DURATION).total_seconds()
        initial = self.initial_delay.total_seconds()
        # grow in log space so a huge multiplier or attempt number cannot overflow
        if initial <= 0:
            base = 0.0
        elif self.multiplier <= 1:
            base = initial
        else:
            log_base = math.log(initial) + (attempt - 1) * math.log(self.multiplier)
            base = cap if log_base >= math.log(cap) else math.exp(log_base)
        spread = (rng or _random).uniform(1 - self.jitter, 1 + self.jitter)
        seconds = min(base * spread, cap)
        return timedelta(seconds=max(seconds, 0.0))


def next_retry_delay(
    policy: RetryPolicy | None,
    attempts_consumed: int,
    max_attempts: int,
    rng: random.Random | None = None,
) -> timedelta | None:
    """The wait before the next attempt of a run whose attempt failed (a raised exception,
    a timeout, a lapsed lease), or None when there is none: ``policy`` None (the failure is
    not retryable) or the run's attempts are spent (``attempts_consumed``, this attempt
    included, has reached ``max_attempts``, the run's own budget).

    The one place where "attempts spent" is decided and the backoff computed; storage only
    applies the answer."""
    if policy is None or attempts_consumed >= max_attempts:
        return None
    return policy.delay_after(max(attempts_consumed, 1), rng)
