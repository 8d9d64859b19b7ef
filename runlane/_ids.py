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
# random bits read ahead from the OS, a read per _NOISE_BYTES rather than per id (a system
# call cost more than the rest of making an id); dropped in a forked child, which must not
# make its parent's ids
_NOISE_BYTES = 4096
_noise = b""
_noise_at = 0
_MS_MASK = (1 << 48) - 1
_VERSION = 0x7 << 76
_VARIANT = 0b10 << 62
_RAND_MASK = (1 << 62) - 1


def _forget_noise() -> None:
    global _noise, _noise_at
    _noise, _noise_at = b"", 0


os.register_at_fork(after_in_child=_forget_noise)


def _take_noise(size: int) -> bytes:
    """``size`` random bytes from the read-ahead; call with _lock."""
    global _noise, _noise_at  # noqa: PLW0603 - the process's read-ahead
    if _noise_at + size > len(_noise):
        _noise, _noise_at = os.urandom(max(_NOISE_BYTES, size)), 0
    taken = _noise[_noise_at : _noise_at + size]
    _noise_at += size
    return taken


def _next_stamp(now_ms: int) -> int:
    """The time and counter bits of the next id (version and variant set); call with _lock."""
    global _last_ms, _counter  # noqa: PLW0603 - one process-wide monotonic counter
    if now_ms > _last_ms:
        _last_ms, _counter = now_ms, int.from_bytes(_take_noise(2)) & 0x1FF
    else:
        _counter += 1
        if _counter > 0xFFF:  # counter spent: borrow the next millisecond
            _last_ms, _counter = _last_ms + 1, 0
    return (_last_ms & _MS_MASK) << 80 | _VERSION | _counter << 64 | _VARIANT


_make = uuid.UUID.__new__
_set = object.__setattr__
_UNKNOWN = uuid.SafeUUID.unknown


def _uuid(value: int) -> uuid.UUID:
    """``uuid.UUID(int=value)`` for a 128-bit ``value``, without the checks of its
    ``__init__`` (a third of the cost of a trigger's id): the attributes it would set."""
    made = _make(uuid.UUID)
    _set(made, "int", value)
    _set(made, "is_safe", _UNKNOWN)
    return made


def new_run_id() -> uuid.UUID:
    """A UUIDv7 (RFC 9562): 48-bit Unix milliseconds, then a 12-bit counter, then random bits.

    The counter keeps ids from one process increasing within a millisecond. The process clock
    only shapes the id; it is never compared with a stored time.
    """
    with _lock:
        stamp = _next_stamp(time.time_ns() // 1_000_000)
        noise = _take_noise(8)
    return _uuid(stamp | int.from_bytes(noise) & _RAND_MASK)


def new_run_ids(count: int) -> list[uuid.UUID]:
    """``count`` increasing UUIDv7s (see new_run_id), made under one lock and from one read
    of the random source."""
    with _lock:
        now_ms = time.time_ns() // 1_000_000
        if count == 1:  # trigger()'s
            stamp = _next_stamp(now_ms)
            noise = _take_noise(8)
        else:
            stamps = [_next_stamp(now_ms) for _ in range(count)]
            noise = _take_noise(8 * count)
    if count == 1:
        return [_uuid(stamp | int.from_bytes(noise) & _RAND_MASK)]
    return [
        _uuid(stamp | int.from_bytes(noise[8 * i : 8 * i + 8]) & _RAND_MASK)
        for i, stamp in enumerate(stamps)
    ]
