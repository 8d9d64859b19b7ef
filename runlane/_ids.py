"""Run ids: UUIDv7, so ids made close in time sit close in the primary-key index."""

from __future__ import annotations

import os
import threading
import time
import uuid

__all__ = ["new_run_id"]

_lock = threading.Lock()
_last_ms = 0
_counter = 0


def new_run_id() -> uuid.UUID:
    """A UUIDv7 (RFC 9562): 48-bit Unix milliseconds, then a 12-bit counter, then random bits.

    The counter keeps ids from one process increasing within a millisecond. The process clock
    only shapes the id; it is never compared with a stored time.
    """
    global _last_ms, _counter  # noqa: PLW0603 - one process-wide monotonic counter
    with _lock:
        now_ms = time.time_ns() // 1_000_000
        if now_ms > _last_ms:
            _last_ms, _counter = now_ms, int.from_bytes(os.urandom(2)) & 0x1FF
        else:
            _counter += 1
            if _counter > 0xFFF:  # counter spent: borrow the next millisecond
                _last_ms, _counter = _last_ms + 1, 0
        ms, counter = _last_ms, _counter
    rand = int.from_bytes(os.urandom(8)) & ((1 << 62) - 1)
    value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | counter << 64 | 0b10 << 62 | rand
    return uuid.UUID(int=value)
