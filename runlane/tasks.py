"""Task definitions: the ``task`` decorator (queues, defined with ``queue``, live in
``runlane.flow`` beside their limits and are importable from here too)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import attrs

from runlane._limits import check_name
from runlane.errors import ConfigurationError
from runlane.flow import Queue, queue
from runlane.retry import RetryPolicy

if TYPE_CHECKING:
    from runlane.context import RunContext

__all__ = ["Queue", "Task", "queue", "task"]

P = TypeVar("P")
R = TypeVar("R")


@attrs.frozen(eq=False)
class Task(Generic[P, R]):
    """A registered unit of work. Calling it runs the handler directly (useful in tests)."""

    id: str
    fn: Callable[[P, RunContext], R]
    schema: type[P] | None
    queue: str | None
    retry: RetryPolicy
    timeout: timedelta | None

    def __call__(self, payload: P, context: RunContext) -> R:
        return self.fn(payload, context)

    def __repr__(self) -> str:
        return f"<Task {self.id!r}>"


@overload
def task(
    fn: Callable[[P, RunContext], R],
) -> Task[P, R]: ...


@overload
def task(
    *,
    id: str | None = None,
    schema: type[P] | None = None,
    queue: str | None = None,
    retry: RetryPolicy | None = None,
    timeout: timedelta | None = None,
) -> Callable[[Callable[[P, RunContext], R]], Task[P, R]]: ...


def task(
    fn: Callable[[Any, RunContext], Any] | None = None,
    *,
    id: str | None = None,
    schema: type[Any] | None = None,
    queue: str | None = None,
    retry: RetryPolicy | None = None,
    timeout: timedelta | None = None,
) -> Any:
    """Declare a task: ``@task(id="email.send", schema=SendEmail, queue="email")``.

    ``schema`` is an attrs class (payloads are validated and structured with cattrs) or None
    for a payload of plain JSON values. ``id`` defaults to ``module.function``.
    """
    if schema is not None and not attrs.has(schema):
        raise ConfigurationError(f"task schema must be an attrs class, got {schema!r}")
    if queue is not None:
        check_name("queue name", queue)
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise ConfigurationError(f"retry must be a RetryPolicy, got {retry!r}")
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout <= timedelta(0)):
        raise ConfigurationError(f"task timeout must be a positive timedelta, got {timeout!r}")

    def wrap(handler: Callable[[Any, RunContext], Any]) -> Task[Any, Any]:
        if not callable(handler):
            raise ConfigurationError(f"@task decorates a function, got {handler!r}")
        task_id = id if id is not None else f"{handler.__module__}.{handler.__qualname__}"
        check_name("task id", task_id)
        return Task(
            id=task_id,
            fn=handler,
            schema=schema,
            queue=queue,
            retry=retry or RetryPolicy(),
            timeout=timeout,
        )

    if fn is not None:
        return wrap(fn)
    return wrap
