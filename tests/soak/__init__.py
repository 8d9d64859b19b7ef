"""The chaos soak: ``python -m tests.soak --runs 50000 --lane polling`` (see docs/soak.md).

Worker, maintenance and producer *processes* run against a Postgres server of the soak's own
while a schedule of faults hits them (SIGKILL, SIGSTOP, Postgres restarts, terminated
backends, a stalled TCP proxy, a killed maintenance replica, skewed process clocks). At the
end every run must be terminal, and the database and the handlers' own records are checked
for lost runs, runs out of attempts, double completions, stale writes, a bounded queue above
its limit and repeated step side effects.
"""

import os
import threading
import time


def _sleep_without_clock_nanosleep(seconds: float) -> None:
    """``time.sleep`` for processes under ``faketime`` with a true monotonic clock.

    libfaketime 0.9.10 (Debian) with ``FAKETIME_DONT_FAKE_MONOTONIC=1`` fails every
    ``clock_nanosleep`` with EINVAL, so ``time.sleep`` raises ``OSError`` (a real skewed clock
    never does); a condition wait on the monotonic clock is unaffected. Without that setting
    it fakes the monotonic clock too and a 0.2 s ``Event.wait`` lasts an hour."""
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    threading.Event().wait(seconds)


if os.environ.get("RUNLANE_SOAK_FAKETIME"):
    time.sleep = _sleep_without_clock_nanosleep  # type: ignore[assignment]
