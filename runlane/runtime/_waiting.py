"""Waiting: for a run's end (``wait_for_run``), and the wait tokens a handler waits on."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import attrs

from runlane._codec import OutputNotSerializable, encode_output
from runlane._ids import new_run_id
from runlane._validation import as_duration, check_idempotency_key, run_key, token_key
from runlane.errors import ConfigurationError, WaitTokenNotFound
from runlane.lanes import RunEndWatcher
from runlane.models import RunSnapshot, WaitToken
from runlane.runtime._backend import Opened

__all__ = ["Waits"]

log = logging.getLogger("runlane")

_EAGER_RESUME_LIMIT = 100
# wait_for_run: while run ends are announced, how often it still looks (a lost announcement)
_ENDS_FALLBACK_POLL_SECONDS = 1.0
# wait_for_run without announcements (the lane has none, its listener is reconnecting, or
# it found a transaction pooler and gave up): it reads the run after 10 ms, doubling the
# pause up to this (docs/deployment.md)
_POLL_SECONDS = 0.25


@attrs.define(eq=False)
class Waits:
    """``wait_for_run`` wakes on the run-end announcements of ``end_watcher()`` (None: the
    lane announces nothing, so it polls) and reads through ``get_run``; tokens go through
    the storage ``opened()`` returns."""

    _environment: str
    _max_output_bytes: int
    _opened: Opened
    _get_run: Callable[[uuid.UUID], RunSnapshot]
    _end_watcher: Callable[[], RunEndWatcher | None]

    def for_run(self, run_id: uuid.UUID | str, timeout: timedelta | float | None) -> RunSnapshot:
        limit = None if timeout is None else as_duration("timeout", timeout).total_seconds()
        deadline = None if limit is None else time.monotonic() + limit
        key = run_key(run_id)
        snapshot = self._get_run(key)  # RunNotFound before any listener is started
        if snapshot.is_terminal:
            return snapshot
        watcher = self._end_watcher()
        if watcher is None:
            return self._poll_for_run(key, snapshot, deadline, timeout)
        with watcher.watch(key) as ended:
            pause = 0.01
            while True:
                ended.clear()
                snapshot = self._get_run(key)
                if snapshot.is_terminal:
                    return snapshot
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"run {snapshot.id} is still {snapshot.status} after {timeout}"
                    )
                wait = _ENDS_FALLBACK_POLL_SECONDS if watcher.connected else pause
                pause = min(pause * 2, _POLL_SECONDS)
                ended.wait(wait if remaining is None else min(wait, remaining))

    def _poll_for_run(
        self,
        key: uuid.UUID,
        snapshot: RunSnapshot,
        deadline: float | None,
        timeout: timedelta | float | None,
    ) -> RunSnapshot:
        pause = 0.01
        while not snapshot.is_terminal:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {snapshot.id} is still {snapshot.status} after {timeout}")
            wait = pause if deadline is None else min(pause, max(0.0, deadline - time.monotonic()))
            time.sleep(wait)
            pause = min(pause * 2, _POLL_SECONDS)
            snapshot = self._get_run(key)
        return snapshot

    def create_token(
        self, timeout: timedelta | float | None, idempotency_key: str | None
    ) -> WaitToken:
        delta = None if timeout is None else as_duration("timeout", timeout)
        if idempotency_key is not None:
            check_idempotency_key(idempotency_key)
        return self._opened().wait_token_create(
            self._environment, new_run_id(), delta, idempotency_key
        )

    def get_token(self, token_id: uuid.UUID | str) -> WaitToken:
        key = token_key(token_id)
        token = self._opened().wait_token_get(self._environment, key)
        if token is None:
            raise WaitTokenNotFound(f"no wait token {key} in environment {self._environment!r}")
        return token

    def complete_token(self, token_id: uuid.UUID | str, output: Any) -> WaitToken:
        key = token_key(token_id)
        try:
            encoded = encode_output(output, self._max_output_bytes, what="the wait token's output")
        except OutputNotSerializable as exc:
            raise ConfigurationError(f"{exc}; nothing was written") from exc
        storage = self._opened()
        if storage.wait_token_complete(self._environment, key, encoded):
            try:
                storage.run_resume_waiters(
                    self._environment, _EAGER_RESUME_LIMIT, token_ids=[key], run_ids=[]
                )
            except Exception:
                log.warning(
                    "runlane: resuming runs waiting on token %s failed; the completion stands "
                    "and maintenance will resume them",
                    key,
                    exc_info=True,
                )
        return self.get_token(key)
