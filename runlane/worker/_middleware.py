"""Middleware (``create_runlane(middleware=[...])``): callables ``(context) ->
ContextManager``, each called with the attempt's context in the handler's thread and entered
around the handler (first listed outermost). An exception a middleware raises fails the
attempt as the handler's would; a middleware cannot turn a failed attempt into a completed
one (an ``__exit__`` returning True is ignored), nor see runlane's own control flow (a
suspended run exits it cleanly).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from typing import TYPE_CHECKING, Any

from runlane.errors import ConfigurationError
from runlane.toolkit import shown

if TYPE_CHECKING:
    from runlane.context import RunContext

__all__ = ["Middleware", "MiddlewareStack", "check_middleware"]

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
