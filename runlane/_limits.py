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

from datetime import timedelta

from runlane.errors import ConfigurationError

__all__ = [
    "DEFAULT_MAX_OUTPUT_BYTES",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "INT32_MAX",
    "MAX_DURATION",
    "MAX_ERROR_MESSAGE_CHARS",
    "MAX_LIMIT_BYTES",
    "MAX_TEXT_BYTES",
    "MAX_TEXT_CHARS",
    "MAX_TRACEBACK_CHARS",
    "check_limit",
    "describe_size",
    "output_limit",
    "truncate_message",
    "truncate_traceback",
]

# the largest number stored in a Postgres integer column or cast (priorities, attempts,
# queue concurrency limits)
INT32_MAX = 2**31 - 1

DEFAULT_MAX_PAYLOAD_BYTES = 1_048_576
DEFAULT_MAX_OUTPUT_BYTES = 1_048_576
# the largest limit one may configure: well under Postgres's 255 MiB jsonb ceiling, which
# counts jsonb's own overhead on top of the JSON text
MAX_LIMIT_BYTES = 64 * 1_048_576

MAX_ERROR_MESSAGE_CHARS = 4_000
MAX_TRACEBACK_CHARS = 16_000
_TRACEBACK_HEAD = 4_000

# delays, timeouts and sleeps (retry delays too): a due time must stay a datetime Python and
# Postgres agree on (Python's end at year 9999), and nothing waits a century on purpose
MAX_DURATION = timedelta(days=36_525)

# idempotency keys and other caller-chosen text stored as a column; in bytes too, since a
# key's index row (with the environment and task id, 200 characters each) holds at most
# 2,704 bytes
MAX_TEXT_CHARS = 1_000
MAX_TEXT_BYTES = 2_000


def check_limit(name: str, value: object) -> int:
    """A byte limit given to ``create_runlane``: an integer from 1 to 64 MiB."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT_BYTES:
        raise ConfigurationError(
            f"{name} must be an integer number of bytes from 1 to {MAX_LIMIT_BYTES:,} (64 MiB), "
            f"got {value!r}; store larger values elsewhere and pass a reference"
        )
    return value


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
