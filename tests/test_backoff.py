"""The one back-off (runlane.toolkit.Backoff) every reconnecting loop and retry uses: its
delays grow by its factor from its first delay up to its cap, each spread over the lower
half of its step, and start over after reset()."""

from __future__ import annotations

import pytest

from runlane.toolkit import Backoff


@pytest.mark.parametrize(
    ("backoff", "steps"),
    [
        # the storage's retry of a statement whose connection broke
        (Backoff(first=0.05, cap=1.0, factor=5.0), [0.05, 0.25, 1.0, 1.0]),
        # the publisher's back-off after a failed publish (max_backoff 5 s)
        (Backoff(first=0.5, cap=5.0), [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]),
        # the default: the acquirers, the writer, the listener
        (Backoff(), [0.05, 0.1, 0.2, 0.4]),
    ],
)
def test_delays_grow_by_the_factor_up_to_the_cap_within_the_lower_half(
    backoff: Backoff, steps: list[float]
) -> None:
    for _ in range(3):  # reset() starts over
        for step in steps:
            delay = backoff.next()
            assert step / 2 <= delay <= step, (step, delay)
        backoff.reset()


def test_delays_are_jittered() -> None:
    """Replicas that lost the same server do not come back in step."""
    delays = {Backoff(first=1.0).next() for _ in range(50)}
    assert len(delays) > 40
