"""Run ids: UUIDv7, so ids made close in time sit close in the primary-key index."""

from __future__ import annotations

import os
import threading
import time
import uuid

__all__ = ["new_run_id", "new_run_ids"]

_lock = threading.Lock()
_last_ms = 0
_counter = 0
_MS_MASK = (1 << 48) - 1
_VERSION = 0x7 << 76
_VARIANT = 0b10 << 62
_RAND_MASK = (1 << 62) - 1


def _next_stamp(now_ms: int) -> int:
    """The time and counter bits of the next id (version and variant set); call with _lock."""
    global _last_ms, _counter  # noqa: PLW0603 - one process-wide monotonic counter
    if now_ms > _last_ms:
        _last_ms, _counter = now_ms, int.from_bytes(os.urandom(2)) & 0x1FF
    else:
        _counter += 1
        if _counter > 0xFFF:  # counter spent: borrow the next millisecond
            _last_ms, _counter = _last_ms + 1, 0
    return (_last_ms & _MS_MASK) << 80 | _VERSION | _counter << 64 | _VARIANT


def new_run_id() -> uuid.UUID:
    """A UUIDv7 (RFC 9562): 48-bit Unix milliseconds, then a 12-bit counter, then random bits.

    The counter keeps ids from one process increasing within a millisecond. The process clock
    only shapes the id; it is never compared with a stored time.
    """
    with _lock:
        stamp = _next_stamp(time.time_ns() // 1_000_000)
    return uuid.UUID(int=stamp | int.from_bytes(os.urandom(8)) & _RAND_MASK)


def new_run_ids(count: int) -> list[uuid.UUID]:
    """``count`` increasing UUIDv7s (see new_run_id), made under one lock and from one read
    of the random source."""
    with _lock:
        now_ms = time.time_ns() // 1_000_000
        stamps = [_next_stamp(now_ms) for _ in range(count)]
    noise = os.urandom(8 * count)
    return [
        uuid.UUID(int=stamp | int.from_bytes(noise[8 * i : 8 * i + 8]) & _RAND_MASK)
        for i, stamp in enumerate(stamps)
    ]
