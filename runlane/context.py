"""The context a handler receives with its payload, and the durable operations on it.

Steps, waits, sleeps, releases and child runs are durable: their effects are stored under
the attempt's fence, so when the run is resumed or retried the handler re-runs from the top
and each operation answers from storage instead of acting again. A handler is therefore
replayed, and must reach its durable operations in the same order each time (name steps
and sleeps explicitly when that order could change).
"""

from __future__ import annotations

import functools
import threading
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, NoReturn, Protocol, TypeVar, Unpack, cast, overload

import attrs

from runlane._attempt import AttemptControl, AttemptProgress, encode_progress
from runlane._codec import OutputNotSerializable, converter, encode_output
from runlane._limits import output_limit
from runlane._validation import (
    RESERVED_PREFIX,
    ChildTriggerOptions,
    TriggerOptions,
    as_duration,
    check_idempotency_key,
    check_text,
    child_options,
)
from runlane.errors import (
    ChildRunFailed,
    ConfigurationError,
    RunInterrupted,
    RunNotFound,
    RunStateConflict,
    StaleLease,
    StopReason,
    StorageUnavailable,
    WaitTokenNotFound,
    WaitTokenTimedOut,
)
from runlane.models import RunHandle, RunStatus, WaitTokenStatus
from runlane.storage import LeaseRef, ProgressWrite, Storage

__all__ = ["RESERVED_PREFIX", "ContextBackend", "RunContext", "Suspended", "TaskRef"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def _outages_recorded(method: F) -> F:
    """A durable operation that could not reach the database raises
    :class:`~runlane.StorageUnavailable` saying what the handler should do, and the context
    remembers it: when it propagates out of the handler, the attempt is handed back unspent
    (the outage is not the handler's failure) instead of consuming an attempt."""

    @functools.wraps(method)
    def recorded(self: RunContext, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except StorageUnavailable as exc:
            if exc is self._control.outage:
                raise
            outage = StorageUnavailable(
                f"context.{method.__name__}() could not reach the database ({exc}). Let this "
                "error propagate out of the handler (re-raise it if you catch Exception): the "
                "attempt is then handed back without being spent, and the run re-runs from "
                "the top once the database is back, its stored steps answered from storage"
            )
            self._control.outage = outage
            raise outage from exc

    return cast(F, recorded)


class Suspended(BaseException):
    """Unwinds a handler whose run was suspended (waiting, sleeping or released).

    A ``BaseException``, so ``except Exception`` in user code lets it pass; do not catch it.
    """


class TaskRef(Protocol):
    """A task as a child trigger names it: a :class:`~runlane.Task`, by its ``id`` (a task
    defines its handler on a RunContext, so the context names tasks by what it reads)."""

    @property
    def id(self) -> str: ...


class ContextBackend(Protocol):
    """What a context needs from the runtime executing it."""

    @property
    def storage(self) -> Storage: ...

    def trigger_child(
        self,
        task: TaskRef | str,
        payload: Any,
        *,
        idempotency_key: str,
        options: TriggerOptions,
    ) -> RunHandle: ...


_MAX_NAME_CHARS = 500


def _check_step_name(name: object) -> str:
    checked = check_text("step name", name, max_chars=_MAX_NAME_CHARS)
    if checked.startswith(RESERVED_PREFIX):
        raise ConfigurationError(
            f"step names starting with {RESERVED_PREFIX!r} are reserved for runlane's own "
            f"steps: rename step {checked!r}"
        )
    return checked


@attrs.define(eq=False)
class RunContext:
    """What a handler knows about the attempt it runs in, and its durable operations.

    ``cancelled`` is set when the attempt should stop: the run was cancelled, the worker shuts
    down, the attempt's lease could not be kept, or its task timeout passed;
    ``stop_reason`` says which (:class:`runlane.StopReason`, None while no stop was asked).
    Long handlers should pass ``cancelled`` to their waits and call ``raise_if_stopped()``
    at safe points: the engine records the :class:`runlane.RunInterrupted` it raises by
    reason (shutdown hands the run back with its attempt unspent, cancel ends it
    ``cancelled``, timeout fails the attempt, a lost lease writes nothing). A handler that
    returns normally has completed its run, whatever stop was asked.
    """

    run_id: uuid.UUID
    task_id: str
    queue: str
    attempt: int
    max_attempts: int
    environment: str
    cancelled: threading.Event = attrs.field(factory=threading.Event)
    _backend: ContextBackend | None = attrs.field(default=None, alias="backend", repr=False)
    _lease_token: uuid.UUID | None = attrs.field(default=None, alias="lease_token", repr=False)
    # the engine's side (stop asked, outage met, progress sink); shares ``cancelled``
    _control: AttemptControl = attrs.field(
        default=attrs.Factory(lambda self: AttemptControl(self.cancelled), takes_self=True),
        alias="control",
        repr=False,
    )
    _sleeps: int = attrs.field(default=0, init=False, repr=False)
    _children: int = attrs.field(default=0, init=False, repr=False)
    # report_progress: this attempt's progress in the worker's lifecycle writer
    _progress: AttemptProgress | None = attrs.field(default=None, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self._control.cancelled is not self.cancelled:
            raise ConfigurationError(
                "RunContext(control=...) shares its cancelled event: pass "
                "cancelled=control.cancelled"
            )

    # -- stopping ------------------------------------------------------------------------

    @property
    def stop_reason(self) -> StopReason | None:
        """Why the attempt was asked to stop (the first reason given), or None."""
        return self._control.stop_reason

    @property
    def _lease_checked_at(self) -> float:
        # read by fault-injection tests (see AttemptControl.lease_checked_at)
        return self._control.lease_checked_at

    def raise_if_stopped(self) -> None:
        """Raise :class:`runlane.RunInterrupted` when the attempt was asked to stop; let it
        propagate out of the handler and the engine records it by ``stop_reason``."""
        if self._backend is None or self._lease_token is None:
            raise ConfigurationError(
                "raise_if_stopped() works only inside a handler run by a worker or drain: this "
                "RunContext is not attached to a run attempt"
            )
        reason = self._control.stop_reason
        if reason is None and self.cancelled.is_set():
            # set by the handler itself: it stops, and, with no stop asked of the attempt,
            # the engine records a failed attempt
            reason = StopReason.CANCEL_REQUESTED
        if reason is not None:
            raise RunInterrupted(
                reason,
                f"run {self.run_id} attempt {self.attempt} stopped: {reason.value}",
            )

    # -- progress ------------------------------------------------------------------------

    @_outages_recorded
    def report_progress(
        self, *, fraction: float | None = None, message: str | None = None, data: Any = None
    ) -> None:
        """Say how far the attempt got: ``fraction`` (0 to 1), a short ``message``, plain JSON
        ``data``; read back as ``RunSnapshot.progress``. Cheap to call often (the worker
        writes at most one report a second, the last one wins) and fenced: after a lost
        lease the next call raises ``StaleLease`` (docs/operating.md, Progress)."""
        backend, lease = self._attached()
        value = encode_progress(fraction, message, data, output_limit(backend))
        if self._progress is None:
            self._progress = AttemptProgress(lease)
        if self._progress.stale:
            self._stale("the progress")
        sink = self._control.progress_sink
        if sink is not None:
            sink.progress(self._progress, value)
            return
        # a context not run by a worker (built by hand): written at once
        if not backend.storage.run_progress_many([ProgressWrite(lease, value)]):
            self._progress.stale = True
            self._stale("the progress")

    # -- plumbing ------------------------------------------------------------------------

    def _attached(self) -> tuple[ContextBackend, LeaseRef]:
        if self._backend is None or self._lease_token is None:
            raise ConfigurationError(
                "this RunContext is not attached to a run attempt; durable operations work "
                "only inside a handler executed by a worker or drain"
            )
        return self._backend, LeaseRef(self.run_id, self.attempt, self._lease_token)

    def _stale(self, what: str) -> NoReturn:
        self._control.request_stop(StopReason.LEASE_LOST)
        raise StaleLease(
            f"run {self.run_id} attempt {self.attempt} no longer holds its lease; {what} was "
            "not recorded. Return from the handler: another attempt owns the run now."
        )

    def _store_step(self, name: str, encoded: str) -> Any:
        backend, lease = self._attached()
        stored = backend.storage.step_store(lease, name, encoded)
        if not stored.fenced:
            self._stale(f"step {name!r}")
        return stored.output

    # -- steps ---------------------------------------------------------------------------

    @overload
    def step(self, name: str, fn: Callable[[], Any]) -> Any: ...

    @overload
    def step(self, name: str, fn: Callable[[], Any], *, output_type: type[T]) -> T: ...

    @_outages_recorded
    def step(self, name: str, fn: Callable[[], Any], *, output_type: Any = None) -> Any:
        """Run ``fn`` once per run and store its output; on a later attempt or resume, return
        the stored output without calling ``fn``.

        The output is stored as JSON through cattrs; the step returns the stored form (the
        same on first run and replay), structured into ``output_type`` when given. The first
        attempt to store a step wins; a stale attempt cannot store (``StaleLease``).
        """
        _check_step_name(name)
        backend, _ = self._attached()
        found, output = backend.storage.step_get(self.run_id, name)
        if not found:
            value = fn()
            try:
                encoded = encode_output(
                    value, output_limit(backend), what=f"the output of step {name!r}"
                )
            except OutputNotSerializable as exc:
                raise ConfigurationError(f"{exc}; nothing was stored") from exc
            output = self._store_step(name, encoded)
        return output if output_type is None else converter.structure(output, output_type)

    # -- waits ---------------------------------------------------------------------------

    @_outages_recorded
    def wait_for_token(self, token_id: uuid.UUID | str, *, output_type: Any = None) -> Any:
        """The token's output once it is completed; raises ``WaitTokenTimedOut`` when it
        timed out. While it is pending the run is suspended (``waiting``) and the handler
        unwinds; the run re-runs from the top when the token is resolved."""
        backend, lease = self._attached()
        try:
            key = _uuid(token_id)
        except ValueError as exc:
            raise WaitTokenNotFound(f"{token_id!r} is not a wait token id (a UUID)") from exc
        while True:
            token = backend.storage.wait_token_get(self.environment, key)
            if token is None:
                raise WaitTokenNotFound(f"no wait token {key} in environment {self.environment!r}")
            if token.status is WaitTokenStatus.COMPLETED:
                out = token.output
                return out if output_type is None else converter.structure(out, output_type)
            if token.status is WaitTokenStatus.TIMED_OUT:
                raise WaitTokenTimedOut(key, f"wait token {key} timed out at {token.timeout_at}")
            result = backend.storage.run_suspend(lease, self.environment, token_id=key)
            if result.suspended:
                raise Suspended
            if result.target_open:
                self._stale("the wait")
            # resolved between the read and the suspension: read it again

    @_outages_recorded
    def wait_for_run(self, run_id: uuid.UUID | str, *, output_type: Any = None) -> Any:
        """The output of another run of this environment once it completed; raises
        ``ChildRunFailed`` when it failed or was cancelled. Until then the run waits."""
        backend, lease = self._attached()
        try:
            key = _uuid(run_id)
        except ValueError as exc:
            raise RunNotFound(f"{run_id!r} is not a run id (a UUID)") from exc
        if key == self.run_id:
            raise ConfigurationError("a run cannot wait for itself")
        while True:
            snap = backend.storage.run_get(self.environment, key)
            if snap is None:
                raise RunNotFound(f"no run {key} in environment {self.environment!r}")
            if snap.status is RunStatus.COMPLETED:
                out = snap.output
                return out if output_type is None else converter.structure(out, output_type)
            if snap.status in (RunStatus.FAILED, RunStatus.CANCELLED):
                detail = f": {snap.error.type}: {snap.error.message}" if snap.error else ""
                raise ChildRunFailed(
                    key, snap.status.value, snap.error, f"run {key} ended {snap.status}{detail}"
                )
            result = backend.storage.run_suspend(lease, self.environment, run_id=key)
            if result.suspended:
                raise Suspended
            if result.target_open:
                self._stale("the wait")

    @_outages_recorded
    def sleep(self, duration: timedelta | float, *, name: str | None = None) -> None:
        """Suspend the run for ``duration`` (database time); maintenance makes it runnable
        when due. On the re-run the sleep is already over and returns at once."""
        delta = as_duration("duration", duration)
        if name is not None:
            check_text("sleep name", name, max_chars=_MAX_NAME_CHARS)
        backend, lease = self._attached()
        self._sleeps += 1
        key = f"{RESERVED_PREFIX}sleep:{name if name is not None else self._sleeps}"
        found, stored = backend.storage.step_get(self.run_id, key)
        now = backend.storage.database_now()
        if not found:
            wake = now + delta
            stored = self._store_step(key, encode_output({"wake_at": wake.isoformat()}))
        wake_at = datetime.fromisoformat(stored["wake_at"])
        if wake_at <= now:
            return
        result = backend.storage.run_suspend(lease, self.environment, wake_at=wake_at)
        if not result.suspended:
            self._stale("the sleep")
        raise Suspended

    @_outages_recorded
    def release(self, delay: timedelta | float | None = None) -> NoReturn:
        """Hand the run back as ``released`` without consuming an attempt; it is delivered
        again after ``delay`` (by maintenance). Unwinds the handler."""
        delta = as_duration("delay", delay)
        backend, lease = self._attached()
        if not backend.storage.run_release(lease, delta):
            self._stale("the release")
        raise Suspended

    # -- child runs ----------------------------------------------------------------------

    @_outages_recorded
    def trigger_child(
        self, task: TaskRef | str, payload: Any, **options: Unpack[ChildTriggerOptions]
    ) -> RunHandle:
        """Trigger a run linked to this one as its parent; ``options`` are ``trigger``'s
        (``queue``, ``delay``, ``run_at``, ``idempotency_key``, ``priority``,
        ``max_attempts``, ``concurrency_key``), an unknown one raises ConfigurationError.
        Durable: on a re-run, the n-th call returns the child the first run created (its
        idempotency key defaults to one derived from this run and the call's position). A
        run that already holds the key but is not this run's child is never adopted
        (``RunStateConflict``)."""
        backend, _ = self._attached()
        given = options.pop("idempotency_key", None)
        if given is not None:
            check_idempotency_key(given)
        self._children += 1
        key = (
            given if given is not None else f"{RESERVED_PREFIX}child:{self.run_id}:{self._children}"
        )
        checked = child_options(options, self.run_id)
        handle = backend.trigger_child(task, payload, idempotency_key=key, options=checked)
        if not handle.created:
            self._check_adopted(backend, handle, key)
        return handle

    def _check_adopted(self, backend: ContextBackend, handle: RunHandle, key: str) -> None:
        """The run an idempotency key matched is this run's child (a re-run's call), not one
        someone else triggered with the key: a producer's run must not pose as a child."""
        found = backend.storage.run_get(self.environment, handle.id)
        parent = None if found is None else found.parent_run_id
        if parent == self.run_id and found is not None and found.task_id == handle.task_id:
            return
        parent_text = "no parent" if parent is None else f"parent run {parent}"
        raise RunStateConflict(
            f"trigger_child did not adopt run {handle.id} of task {handle.task_id!r}: it holds "
            f"the idempotency key {key[:100]!r} but was not triggered by this run "
            f"{self.run_id} ({parent_text}). Something else triggered it with that key (keys "
            f"starting with {RESERVED_PREFIX!r} are runlane's: producers cannot use them); "
            "give trigger_child an idempotency_key no other trigger uses"
        )


def _uuid(value: uuid.UUID | str) -> uuid.UUID:
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))
