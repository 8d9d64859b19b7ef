"""The log plumbing of the ``runlane`` command: ``--log-level``/``--log-format``, the handler
and the ``runlane-cli-log`` thread that writes records, and the CLI's own lines (``say``),
which under ``--log-format json`` are log records too."""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import queue
import sys
import threading
from typing import Any

from runlane.logging import JsonFormatter

__all__ = [
    "configure_logging",
    "flush_logging",
    "json_lines",
    "logged_parent",
    "logging_options",
    "one_line",
    "say",
    "stop_logging",
]

log = logging.getLogger("runlane.cli")

# how long the log thread may take to write the records still queued at exit
_LOG_DRAIN_SECONDS = 5.0


def logging_options(parser: argparse.ArgumentParser, *, argparse_default: bool) -> None:
    """``--log-level`` and ``--log-format``; on subcommands they default to SUPPRESS so that
    an option given before the command is not overwritten by the subcommand's default."""
    level_default: Any = argparse.SUPPRESS if argparse_default else "INFO"
    format_default: Any = argparse.SUPPRESS if argparse_default else "text"
    parser.add_argument(
        "--log-level",
        default=level_default,
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level of worker, maintenance and drain (default INFO)",
    )
    parser.add_argument(
        "--log-format",
        default=format_default,
        choices=["text", "json"],
        help="text lines or one JSON object per line (default text)",
    )


def logged_parent() -> argparse.ArgumentParser:
    """A parent parser for a command that logs: the same options after the command too
    (``runlane worker APP --log-level DEBUG``)."""
    parser = argparse.ArgumentParser(add_help=False)
    logging_options(parser, argparse_default=True)
    return parser


class _CliHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler ``runlane`` installs; replaced, not stacked, when main() runs again.

    It writes to whatever ``sys.stderr`` is when a record is emitted, so a thread that logs
    after ``main()`` returned (or after a test swapped stderr) never hits a closed stream."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        """The stream is always the current sys.stderr."""


class _CliQueueHandler(logging.handlers.QueueHandler):
    """What the CLI puts on the root logger: the logging thread only enqueues the record.

    ``runlane-cli-log`` formats and writes it. A worker logs two records per run at INFO;
    written in the slots' threads, they cut one process's throughput from about 12,100 to
    4,500 runs/s on 2 cores; enqueued, to about 8,300 (20,000 no-op runs, concurrency 8)."""


class _Flush(logging.LogRecord):
    """Not a record: a marker the log thread answers once everything before it is written."""

    def __init__(self) -> None:
        super().__init__("runlane.cli", logging.DEBUG, __file__, 0, "", None, None)
        self.done = threading.Event()


class _CliLogListener(logging.handlers.QueueListener):
    def handle(self, record: logging.LogRecord) -> None:
        if isinstance(record, _Flush):
            record.done.set()
            return
        super().handle(record)

    def start(self) -> None:
        """Like QueueListener.start, with a named thread."""
        monitor = self._monitor  # type: ignore[attr-defined]
        thread = threading.Thread(target=monitor, name="runlane-cli-log", daemon=True)
        self._thread = thread
        thread.start()

    def stop(self) -> None:
        """Like QueueListener.stop, with a bounded join: the queued records get
        ``_LOG_DRAIN_SECONDS`` to be written (a stderr nobody reads must not hold the exit)."""
        thread: threading.Thread | None = self._thread
        self.enqueue_sentinel()
        if thread is not None:
            thread.join(_LOG_DRAIN_SECONDS)
        self._thread = None


_log_listener: _CliLogListener | None = None
# --log-format json is in effect: the CLI's own lines are log records too (see _print)
_json_lines = False
# --log-format json was in effect until stop_logging: a line said later (a second stop
# signal while the process exits) is still one JSON object
_json_ended = False
_previous_thread_hook = threading.excepthook


def _log_thread_exception(hook: threading.ExceptHookArgs) -> None:
    """Under --log-format json, an exception escaping a thread is a JSON record too."""
    if hook.exc_type is SystemExit:
        return
    exc_info = (hook.exc_type, hook.exc_value, hook.exc_traceback)
    name = hook.thread.name if hook.thread is not None else "?"
    log.error("uncaught exception in thread %s", name, exc_info=exc_info)  # type: ignore[arg-type]


def flush_logging(timeout: float = 1.0) -> None:
    """Wait (bounded) until the records logged so far are written."""
    listener = _log_listener
    if listener is None:
        return
    marker = _Flush()
    listener.queue.put_nowait(marker)
    marker.done.wait(timeout)


def stop_logging() -> None:
    """Write every queued record, stop the log thread and take the CLI's handler off."""
    global _log_listener, _json_lines, _json_ended
    listener, _log_listener = _log_listener, None
    if _json_lines:
        _json_lines, _json_ended = False, True
        logging.captureWarnings(False)
        threading.excepthook = _previous_thread_hook
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _CliHandler | _CliQueueHandler)]:
        root.removeHandler(handler)
    if listener is not None:
        listener.stop()


def begin_command() -> None:
    """A command starts in this process: an earlier command's --log-format json no longer
    shapes its lines (``main`` may run several commands in one process, as tests do)."""
    global _json_ended  # noqa: PLW0603 - see configure_logging
    _json_ended = False


def configure_logging(level: str, fmt: str) -> None:
    global _log_listener, _json_lines, _json_ended  # noqa: PLW0603 - one per process
    stop_logging()
    _json_ended = False
    handler = _CliHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
        _json_lines = True
        logging.captureWarnings(True)  # warnings.warn(): a py.warnings record, not a plain line
        threading.excepthook = _log_thread_exception
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    _log_listener = _CliLogListener(records, handler)
    _log_listener.start()
    root = logging.getLogger()
    root.addHandler(_CliQueueHandler(records))
    root.setLevel(level)


def json_lines() -> bool:
    """Whether ``--log-format json`` is in effect (every line the process writes is JSON)."""
    return _json_lines


def say(message: str, level: int = logging.INFO, **fields: Any) -> None:
    """One line of the CLI's own on stderr: ``runlane: <message>``, or, under
    ``--log-format json``, a log record of ``runlane.cli`` (one JSON object, with ``fields``)
    so that every line the process writes is JSON."""
    if _json_lines:
        log.log(level, message, extra=fields)
        return
    if _json_ended:  # logging stopped: formatted here, as its thread would have
        record = log.makeRecord(log.name, level, __file__, 0, message, (), None, extra=fields)
        print(JsonFormatter().format(record), file=sys.stderr, flush=True)
        return
    print(f"runlane: {message}", file=sys.stderr, flush=True)


def one_line(exc: BaseException) -> str:
    """An error as one line of text (its type's name when it has no message)."""
    return " ".join(str(exc).split()) or type(exc).__name__
