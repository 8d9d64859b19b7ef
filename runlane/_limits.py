"""Size limits on what runlane stores from user code.

Payloads and outputs are measured on their encoded JSON in UTF-8 (the bytes sent to
Postgres), so the check costs nothing beyond the encoding the write needs anyway. The
defaults (1 MiB each) are far above what a task's arguments or result should be (a reference
to a blob, not the blob) and far below Postgres's own ``jsonb`` ceiling (255 MiB), which a
runaway value would otherwise reach only after bloating the table and every read of it.

Error text that the engine stores from user code (an exception's message and traceback) is
never refused: it is cut to a bound, keeping the start of a message and both ends of a
traceback (where the raising frame and the exception line are).
"""

from __future__ import annotations

import re
from datetime import timedelta

from runlane.errors import ConfigurationError
from runlane.toolkit import as_int, shown

__all__ = [
    "DEFAULT_MAX_OUTPUT_BYTES",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MAX_CLAIM_BATCH",
    "MAX_CONCURRENCY",
    "MAX_CONNECT_TIMEOUT",
    "MAX_ERROR_MESSAGE_CHARS",
    "MAX_LEASE",
    "MAX_LIMIT_BYTES",
    "MAX_POLL_INTERVAL",
    "MAX_POOL_SIZE",
    "MAX_TEXT_BYTES",
    "MAX_TEXT_CHARS",
    "MAX_TRACEBACK_CHARS",
    "MIN_LEASE",
    "NAME_PATTERN",
    "check_limit",
    "check_name",
    "describe_size",
    "output_limit",
    "truncate_message",
    "truncate_traceback",
]

# what a queue name, task id, schedule id or environment may be
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-/]{0,199}$")


def check_name(kind: str, value: object) -> str:
    """``value`` when it is a valid name (``NAME_PATTERN``); otherwise a ConfigurationError
    naming ``kind`` ("queue name", "task id", ...)."""
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise ConfigurationError(
            f"{kind} {shown(value)} is not valid: use 1-200 characters from letters, digits and "
            "'_.:-/', starting with a letter or digit"
        )
    return value


DEFAULT_MAX_PAYLOAD_BYTES = 1_048_576
DEFAULT_MAX_OUTPUT_BYTES = 1_048_576
# the largest limit one may configure: well under Postgres's 255 MiB jsonb ceiling, which
# counts jsonb's own overhead on top of the JSON text
MAX_LIMIT_BYTES = 64 * 1_048_576

MAX_ERROR_MESSAGE_CHARS = 4_000
MAX_TRACEBACK_CHARS = 16_000
_TRACEBACK_HEAD = 4_000

# the bounds of the lane and worker options, checked where they are given: past them the
# value fails later (a lease's due time beyond Postgres's dates, a wait threading refuses, a
# process out of threads or a server out of connections)
MIN_LEASE = timedelta(seconds=1)
MAX_LEASE = timedelta(days=1)
MAX_POLL_INTERVAL = timedelta(days=1)
MAX_CONNECT_TIMEOUT = 3_600.0
MAX_POOL_SIZE = 1_000
MAX_CONCURRENCY = 1_024
MAX_CLAIM_BATCH = 10_000

# idempotency keys and other caller-chosen text stored as a column; in bytes too, since a
# key's index row (with the environment and task id, 200 characters each) holds at most
# 2,704 bytes
MAX_TEXT_CHARS = 1_000
MAX_TEXT_BYTES = 2_000


def check_limit(name: str, value: object) -> int:
    """A byte limit given to ``create_runlane``: an integer from 1 to 64 MiB."""
    return as_int(
        name,
        value,
        1,
        MAX_LIMIT_BYTES,
        hint=" (a number of bytes, at most 64 MiB); store larger values elsewhere and pass "
        "a reference",
    )


def describe_size(what: str, size: int, name: str, limit: int) -> str:
    """The message for a value over its limit: its size, the limit and what to do."""
    return (
        f"{what} is {size:,} bytes as JSON, over the limit of {limit:,} bytes ({name}); store "
        f"large data elsewhere (object storage, a table of your own) and pass a reference, or "
        f"raise create_runlane({name}=...)"
    )


def output_limit(backend: object) -> int:
    """The output limit of the runtime behind a handler's context backend (the default for a
    backend that does not say, such as one built by hand in a test)."""
    value = getattr(backend, "max_output_bytes", None)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return DEFAULT_MAX_OUTPUT_BYTES


def truncate_message(text: str, limit: int = MAX_ERROR_MESSAGE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [cut by runlane: {len(text):,} characters in all]"


def truncate_traceback(text: str, limit: int = MAX_TRACEBACK_CHARS) -> str:
    """``text`` cut to about ``limit`` characters: its start and its end, which names the
    exception and the frame that raised it."""
    if len(text) <= limit:
        return text
    tail = limit - _TRACEBACK_HEAD
    cut = len(text) - _TRACEBACK_HEAD - tail
    return (
        f"{text[:_TRACEBACK_HEAD]}\n... [cut by runlane: {cut:,} characters of "
        f"{len(text):,}] ...\n{text[-tail:]}"
    )
