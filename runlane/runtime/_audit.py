"""The audit trail: who did which operator action, when, to how many runs and why
(``Runlane.list_audit``), and ``reschedule_run``.

Every operator action of the runtime records itself through :class:`AuditTrail`: the
storage writes the record in the transaction of the action (``Storage.audit_action``), so
an action never commits without its record, nor a record without its action. Who: the
database's ``current_user`` (written by the database), the process's OS user, and the
identity a caller gave with :func:`acting_as` (the console gives the identity its
``authorize`` returned; the CLI says it is the CLI).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import contextvars
import getpass
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any, TypeVar

import attrs

from runlane._validation import as_run_at, check_text, run_key
from runlane.errors import ConfigurationError, RunNotFound, RunStateConflict
from runlane.models import AuditRecord, BulkResult, Page, RunSnapshot, RunStatus
from runlane.runtime._backend import Opened
from runlane.storage import AuditEntry, BulkBatch, BulkFilter, Storage
from runlane.toolkit import as_int, shown

__all__ = ["MAX_REASON_CHARS", "AuditTrail", "acting_as", "check_reason"]

T = TypeVar("T")

# a reason is a note for other operators, not a document
MAX_REASON_CHARS = 500
_MAX_ACTOR_CHARS = 200
_VIA = ("api", "cli", "console")

# (via, the actor's identity, or a callable giving it when the action records itself)
_ACTING: contextvars.ContextVar[tuple[str, str | Callable[[], str | None] | None]] = (
    contextvars.ContextVar("runlane_acting", default=("api", None))
)


@contextlib.contextmanager
def acting_as(
    actor: str | Callable[[], str | None] | None, *, via: str = "console"
) -> Iterator[None]:
    """Operator actions taken in this context (this thread or task) are recorded as
    ``actor``'s, through ``via`` (``console``, ``cli`` or ``api``). ``actor`` may be a
    callable, asked when an action records itself (the console's identity is known once
    ``authorize`` has answered)."""
    if via not in _VIA:
        raise ConfigurationError(f"via must be one of {', '.join(_VIA)}, got {shown(via)}")
    if isinstance(actor, str):
        _check_actor(actor)
    elif actor is not None and not callable(actor):
        raise ConfigurationError(f"actor must be a string or a callable, got {shown(actor)}")
    token = _ACTING.set((via, actor))
    try:
        yield
    finally:
        _ACTING.reset(token)


def _check_actor(actor: str) -> str:
    if not actor.strip() or len(actor) > _MAX_ACTOR_CHARS or not actor.isprintable():
        raise ConfigurationError(
            f"an actor is a printable name of 1 to {_MAX_ACTOR_CHARS} characters, got "
            f"{shown(actor)}"
        )
    return actor


def check_reason(reason: object) -> str | None:
    """A reason is one line of printable text: a newline, an escape sequence or another
    control character would forge lines or move the cursor where the trail is shown."""
    if reason is None:
        return None
    text = check_text("reason", reason, MAX_REASON_CHARS)
    if not text.isprintable():
        bad = next(c for c in text if not c.isprintable())
        raise ConfigurationError(
            f"a reason is one line of printable text, got {shown(text)}, which holds "
            f"{bad!r} (U+{ord(bad):04X})"
        )
    return text


def _os_user() -> str | None:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's bare uid)
        return None


def _cursor(record: AuditRecord) -> str:
    text = f"{record.at.isoformat()}|{record.id}"
    return base64.urlsafe_b64encode(text.encode()).decode()


def _parse_cursor(cursor: object) -> tuple[datetime, uuid.UUID]:
    refused = ConfigurationError(
        f"cursor {shown(cursor)} is not one list_audit gave (pass its next_cursor)"
    )
    if not isinstance(cursor, str):
        raise refused
    try:
        at, _, key = base64.urlsafe_b64decode(cursor.encode()).decode().partition("|")
        moment, run = datetime.fromisoformat(at), uuid.UUID(key)
    except (ValueError, binascii.Error, UnicodeError) as exc:
        raise refused from exc
    if moment.tzinfo is None:
        raise refused
    return moment, run


def _changed_runs(changed: int) -> tuple[int | None, bool]:
    return changed, changed > 0


@attrs.define(eq=False)
class _AuditedBatches:
    """The storage a bulk action walks with: each batch commits with its record (part 1,
    2, ... of the action); its count is the storage's own."""

    _storage: Storage
    _head: AuditEntry
    parts: int = 0

    def run_bulk_count(self, runs: BulkFilter, limit: int) -> int:
        return self._storage.run_bulk_count(runs, limit)

    def run_bulk_batch(
        self,
        action: str,
        runs: BulkFilter,
        status: RunStatus,
        before: tuple[datetime, uuid.UUID] | None,
        size: int,
    ) -> BulkBatch:
        entry = attrs.evolve(self._head, id=uuid.uuid4(), part=self.parts)
        self.parts += 1
        return self._storage.audit_action(
            entry,
            lambda view: view.run_bulk_batch(action, runs, status, before, size),
            lambda batch: _changed_runs(batch.changed),
        )


@attrs.define(eq=False)
class AuditTrail:
    """The records of one environment's operator actions, and reschedule."""

    _environment: str
    _opened: Opened

    def entry(
        self, action: str, target: str | None, reason: object, details: dict[str, Any]
    ) -> AuditEntry:
        """A record of ``action`` by whoever acts in this context (see acting_as)."""
        via, actor = _ACTING.get()
        name = actor() if callable(actor) else actor
        action_id = uuid.uuid4()
        return AuditEntry(
            id=action_id,
            action_id=action_id,
            part=0,
            environment=self._environment,
            via=via,
            actor=None if name is None else _check_actor(name),
            os_user=_os_user(),
            action=action,
            target=target,
            reason=check_reason(reason),
            details=details,
        )

    def record(
        self,
        entry: AuditEntry,
        action: Callable[[Storage], T],
        counted: Callable[[T], tuple[int | None, bool] | None],
    ) -> T:
        """``action`` on the storage, committed with ``entry`` (and what ``counted`` says of
        its result; None: it did not happen, nothing is recorded)."""
        return self._opened().audit_action(entry, action, counted)

    def bulk(
        self,
        entry: AuditEntry,
        act: Callable[[Any], BulkResult],
    ) -> BulkResult:
        """A bulk action whose batches each commit with a part of its record; one that
        changed nothing in a batch (it matched none) is recorded alone."""
        batches = _AuditedBatches(self._opened(), entry)
        result = act(batches)
        if batches.parts == 0 and not result.dry_run:
            self._opened().audit_write(entry, 0, False)
        return result

    def list(self, since: object, limit: object, cursor: object) -> Page[AuditRecord]:
        if since is not None and (not isinstance(since, datetime) or since.tzinfo is None):
            raise ConfigurationError(f"since must be a timezone-aware datetime, got {shown(since)}")
        count = as_int("limit", limit, 1, 1000)
        before = None if cursor is None else _parse_cursor(cursor)
        records = self._opened().audit_list(self._environment, since, before, count + 1)
        more = len(records) > count
        records = records[:count]
        return Page(items=tuple(records), next_cursor=_cursor(records[-1]) if more else None)

    def reschedule(self, run_id: uuid.UUID | str, run_at: object, reason: object) -> RunSnapshot:
        key = run_key(run_id)
        due = None if run_at is None else as_run_at(run_at)
        when = "now" if due is None else due.isoformat()
        entry = self.entry("reschedule", str(key), reason, {"run_at": when})

        def moved(view: Storage) -> tuple[bool, RunSnapshot | None]:
            answer = view.run_reschedule(self._environment, key, due)
            if answer is None:
                raise RunNotFound(f"no run {key} in environment {self._environment!r}")
            if not answer.moved:
                raise RunStateConflict(
                    f"run {key} is {answer.previous.value}: only a queued (or delayed) or "
                    "retrying run can be rescheduled"
                    + (
                        "; retry_run queues a failed or cancelled run again"
                        if answer.previous.is_terminal
                        else ""
                    )
                )
            return True, view.run_get(self._environment, key)

        _, snapshot = self.record(entry, moved, lambda _: (1, True))
        if snapshot is None:  # pruned in between
            raise RunNotFound(f"run {key} disappeared from environment {self._environment!r}")
        return snapshot
