"""Task and queue definitions: the ``task`` decorator and ``queue`` factory."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import attrs

from runlane._limits import check_name
from runlane.errors import ConfigurationError
from runlane.flow import RateLimit, check_key_concurrency_limit
from runlane.retry import RetryPolicy
from runlane.toolkit import INT32_MAX, as_int_or_none, shown

if TYPE_CHECKING:
    from runlane.context import RunContext

__all__ = ["Queue", "Task", "queue", "task"]

P = TypeVar("P")
R = TypeVar("R")


@attrs.frozen
class Queue:
    """A logical queue. ``concurrency_limit`` caps live attempts across all workers;
    ``rate_limit`` caps attempt starts per window and ``key_concurrency_limit`` live attempts
    per ``concurrency_key`` (docs/flow-control.md)."""

    name: str
    default: bool = False
    concurrency_limit: int | None = None
    rate_limit: RateLimit | None = None
    key_concurrency_limit: int | None = None

    @property
    def limited(self) -> bool:
        """A rate limit or a per-key limit: claims of this queue count starts or keys."""
        return self.rate_limit is not None or self.key_concurrency_limit is not None

    @property
    def bounded(self) -> bool:
        """Any limit: claimed on its own, under the queue's claim lock."""
        return self.concurrency_limit is not None or self.limited

    @property
    def claims_ahead(self) -> bool:
        """Whether a worker may claim runs of this queue ahead of free slots: not when its
        concurrency or its rate is scarce (a run waiting in a worker would hold a slot of
        the queue, or a start); a per-key limit alone holds one key's slot at most."""
        return self.concurrency_limit is None and self.rate_limit is None


def queue(
    name: str,
    *,
    default: bool = False,
    concurrency_limit: int | None = None,
    rate_limit: RateLimit | None = None,
    key_concurrency_limit: int | None = None,
) -> Queue:
    """Define a logical queue; register it with ``create_runlane(queues=[...])``.

    ``rate_limit`` (a :class:`~runlane.RateLimit`) bounds how many attempts start per window;
    ``key_concurrency_limit=N`` lets at most N attempts with the same ``concurrency_key``
    (given to ``trigger``) run at once. Both hold across all workers, hosts and lanes.
    """
    check_name("queue name", name)
    if rate_limit is not None and not isinstance(rate_limit, RateLimit):
        raise ConfigurationError(
            f"queue {name!r}: rate_limit must be a runlane.RateLimit or None, got "
            f"{shown(rate_limit)}"
        )
    key_limit = check_key_concurrency_limit(name, key_concurrency_limit)
    # at most what the database counts it in (an integer column)
    as_int_or_none(f"queue {name!r}: concurrency_limit", concurrency_limit, 1, INT32_MAX)
    return Queue(
        name=name,
        default=default,
        concurrency_limit=concurrency_limit,
        rate_limit=rate_limit,
        key_concurrency_limit=key_limit,
    )


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
