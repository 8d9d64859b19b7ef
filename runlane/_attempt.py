"""The engine's side of one attempt's :class:`~runlane.RunContext`: its control, its
progress and the middleware around it.

The worker makes an :class:`AttemptControl` for each attempt it starts and hands it to the
context; both then share it: the worker (through its lease tracker) asks the attempt to
stop, the context's durable operations record a database outage they met, and the executor
asks whether a handler's exception came from one. Neither reads the other's private state.

Progress (``RunContext.report_progress``) is checked and encoded here and written by the
worker's lifecycle writer, batched with its other fenced writes, at most once a second per
attempt: a report inside the second replaces the one pending (the last value wins) and is
written when the second has passed, or with the attempt's end, or at close. A write whose
attempt no longer holds its lease marks the attempt stale: its next report raises
StaleLease.

Middleware (``create_runlane(middleware=[...])``): callables ``(context) ->
ContextManager``, each called with the attempt's context in the handler's thread and entered
around the handler (first listed outermost). An exception a middleware raises fails the
attempt as the handler's would; a middleware cannot turn a failed attempt into a completed
one (an ``__exit__`` returning True is ignored), nor see runlane's own control flow (a
suspended run exits it cleanly).
"""

from __future__ import annotations

import inspect
import math
import threading
import typing
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from runlane._codec import OutputNotSerializable, dump_json, encode_plain
from runlane.errors import ConfigurationError, StopReason, StorageUnavailable
from runlane.storage import LeaseRef
from runlane.toolkit import shown

if TYPE_CHECKING:
    from runlane.context import RunContext

__all__ = [
    "MAX_MESSAGE_CHARS",
    "THROTTLE_SECONDS",
    "AttemptControl",
    "AttemptProgress",
    "Middleware",
    "MiddlewareStack",
    "ProgressSink",
    "check_middleware",
    "encode_progress",
]


class AttemptControl:
    """The stop asked of one attempt, the outage its durable operations met, and where its
    progress reports go. Thread-safe where it must be: ``request_stop`` comes from the
    worker's threads while the handler runs."""

    def __init__(
        self,
        cancelled: threading.Event | None = None,
        *,
        progress_sink: ProgressSink | None = None,
        lease_checked_at: float = 0.0,
    ) -> None:
        # the context's ``cancelled``: set with the first stop asked
        self.cancelled = threading.Event() if cancelled is None else cancelled
        self.stop_reason: StopReason | None = None
        self._lock = threading.Lock()
        # the last outage a durable operation of the context met (and raised)
        self.outage: StorageUnavailable | None = None
        # time.monotonic() when the worker last checked the claim's lease and started the
        # attempt (fault-injection tests tell a pause after that moment from a late start)
        self.lease_checked_at = lease_checked_at
        # report_progress: the worker's lifecycle writer (None: written at once)
        self.progress_sink = progress_sink

    def request_stop(self, reason: StopReason) -> None:
        """Ask the handler to stop; the first reason sticks."""
        with self._lock:
            if self.stop_reason is None:
                self.stop_reason = reason
        self.cancelled.set()

    def outage_behind(self, exc: BaseException) -> bool:
        """Whether ``exc`` is (or was caused by) the database outage a durable operation of
        the context met."""
        seen: set[int] = set()
        current: BaseException | None = exc
        while current is not None and id(current) not in seen:
            if current is self.outage:
                return True
            seen.add(id(current))
            current = current.__cause__ or current.__context__
        return False


# at most one progress write a second per attempt
THROTTLE_SECONDS = 1.0
MAX_MESSAGE_CHARS = 1_000


@attrs.define(eq=False)
class AttemptProgress:
    """One attempt's progress as its writer keeps it (guarded by the writer's lock)."""

    lease: LeaseRef
    pending: str | None = None  # JSON text not yet written: the last value reported
    last_written: float = -math.inf  # time.monotonic() of the last write
    stale: bool = False  # a write found the attempt no longer holds its lease


class ProgressSink(Protocol):
    """Where a context hands its progress (the worker's lifecycle writer)."""

    def progress(self, attempt: AttemptProgress, value: str) -> None: ...


def _fraction(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(
            f"report_progress(fraction=...) takes a number from 0 to 1 (0.25 for a quarter "
            f"done), got {shown(value)}; nothing was written"
        )
    try:
        number = float(value)
    except OverflowError:  # an int past a float's range: not from 0 to 1 either
        number = math.inf
    if not math.isfinite(number) or not 0.0 <= number <= 1.0:
        raise ConfigurationError(
            f"report_progress(fraction=...) must be from 0 to 1 (0.25 for a quarter done), "
            f"got {shown(value)}; nothing was written"
        )
    return number


def _message(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigurationError(
            f"report_progress(message=...) takes a string, got {shown(value)}; nothing was written"
        )
    if len(value) > MAX_MESSAGE_CHARS:
        raise ConfigurationError(
            f"report_progress(message=...) takes at most {MAX_MESSAGE_CHARS:,} characters, got "
            f"{len(value):,}; put details in data=, and keep the message a short line; "
            "nothing was written"
        )
    return value


def encode_progress(fraction: object, message: object, data: object, max_bytes: int) -> str:
    """The JSON text stored as the run's progress: ``{"fraction", "message", "data"}``; a
    ConfigurationError naming the fix for a value that cannot be stored."""
    checked_fraction = _fraction(fraction)
    checked_message = _message(message)
    try:
        data_text = encode_plain(data, max_bytes, what="report_progress(data=...)")
    except OutputNotSerializable as exc:
        raise ConfigurationError(f"{exc}; nothing was written") from exc
    head: dict[str, Any] = {"fraction": checked_fraction, "message": checked_message}
    # data is JSON text already: splice it in rather than decode and encode it again
    try:
        text = dump_json(head)
    except ValueError as exc:  # a NUL character or a lone surrogate in the message
        raise ConfigurationError(
            f"report_progress(message=...) cannot be stored ({exc}); nothing was written"
        ) from exc
    return f'{text[:-1]},"data":{data_text}}}'


Middleware = Callable[["RunContext"], AbstractContextManager[Any]]

_HINT = (
    "each middleware is a callable taking the attempt's RunContext and returning a context "
    "manager, e.g. lambda context: app.app_context(), or a function decorated with "
    "@contextlib.contextmanager"
)


def _name(item: object) -> str:
    return getattr(item, "__qualname__", None) or shown(item)


def _is_context_manager(value: object) -> bool:
    kind = value if isinstance(value, type) else type(value)
    return hasattr(kind, "__enter__") and hasattr(kind, "__exit__")


def _returns_non_context_manager(item: Callable[..., Any]) -> str | None:
    """What the return annotation says when it names something that is not a context
    manager (None: no annotation, one that cannot be resolved, or a context manager)."""
    if hasattr(item, "__wrapped__"):
        return None  # decorated (@contextmanager...): the annotations are the wrapped one's
    try:
        hints = typing.get_type_hints(item)
    except Exception:  # forward references to unknown names, user types: not checkable
        return None
    if "return" not in hints:
        return None
    hint = hints["return"]
    if hint is None or hint is type(None):
        return "None"
    origin = typing.get_origin(hint) or hint
    if not isinstance(origin, type):
        return None  # a Union, a TypeVar, Any: cannot tell
    if _is_context_manager(origin) or issubclass(origin, AbstractContextManager):
        return None
    return origin.__name__


def _check_one(index: int, item: object) -> Middleware:
    where = f"middleware[{index}]"
    if not isinstance(item, type) and _is_context_manager(item):
        raise ConfigurationError(
            f"{where} is a context manager ({shown(item)}), not a callable returning one: "
            f"{_HINT}; a new one is needed for every attempt"
        )
    if not callable(item):
        raise ConfigurationError(f"{where} must be callable, got {shown(item)}: {_HINT}")
    if isinstance(item, type) and not _is_context_manager(item):
        raise ConfigurationError(
            f"{where} is the class {item.__qualname__}, which is not a context manager "
            f"(no __enter__/__exit__): {_HINT}"
        )
    try:
        signature = inspect.signature(item)
    except (TypeError, ValueError):  # some builtins have none: checked when called
        signature = None
    if signature is not None:
        try:
            signature.bind(None)
        except TypeError:
            raise ConfigurationError(
                f"{where} ({_name(item)}) cannot be called with one argument (the "
                f"RunContext), its signature is {signature}: {_HINT}"
            ) from None
    if inspect.isgeneratorfunction(item) or inspect.isgeneratorfunction(
        getattr(item, "__call__", None)  # noqa: B004 - a callable object's method
    ):
        raise ConfigurationError(
            f"{where} ({_name(item)}) is a generator function; decorate it with "
            "@contextlib.contextmanager so that calling it returns a context manager"
        )
    if inspect.iscoroutinefunction(item):
        raise ConfigurationError(
            f"{where} ({_name(item)}) is an async function; runlane runs handlers in "
            f"threads and enters synchronous context managers only: {_HINT}"
        )
    if not isinstance(item, type):  # a class was checked above
        returned = _returns_non_context_manager(item)
        if returned is not None:
            raise ConfigurationError(
                f"{where} ({_name(item)}) is annotated to return {returned}, not a context "
                f"manager: {_HINT}"
            )
    return typing.cast(Middleware, item)


def check_middleware(middleware: Sequence[object]) -> tuple[Middleware, ...]:
    """The middleware list as given to ``create_runlane``, checked: anything that cannot be
    a ``(context) -> ContextManager`` callable is refused with a ConfigurationError."""
    if isinstance(middleware, str | bytes) or not isinstance(middleware, Sequence):
        raise ConfigurationError(
            f"middleware must be a list of callables, got {shown(middleware)}: {_HINT}"
        )
    return tuple(_check_one(i, item) for i, item in enumerate(middleware))


class MiddlewareStack:
    """The middleware of one attempt, entered in order and exited in reverse."""

    __slots__ = ("_stack",)

    def __init__(self) -> None:
        self._stack = ExitStack()

    def enter(self, middleware: Sequence[Middleware], context: RunContext) -> None:
        """Enter every middleware; on an exception, exit those entered (with it) and raise
        it."""
        try:
            for index, item in enumerate(middleware):
                manager = item(context)
                if not _is_context_manager(manager):
                    raise ConfigurationError(  # noqa: TRY301 - exits what was entered
                        f"middleware[{index}] ({_name(item)}) returned {shown(manager)}, not a "
                        f"context manager: {_HINT}"
                    )
                self._stack.enter_context(manager)
        except BaseException as exc:
            self.exit(exc)
            raise

    def exit(self, exc: BaseException | None) -> BaseException | None:
        """Exit the entered middleware, passing them ``exc`` (the attempt's exception, or
        None); returns a different exception one of them raised, else None."""
        try:
            if exc is None:
                self._stack.__exit__(None, None, None)
            else:
                self._stack.__exit__(type(exc), exc, exc.__traceback__)
        except BaseException as raised:
            if raised is exc:
                return None
            return raised
        return None
