"""The outbox publisher of one runtime: one thread owning one AMQP connection (pika's
connections belong to one thread; other threads only queue requests).

It serves its runtime's environment only: another environment's broker or virtual host may
be off limits. Work arrives as an eager trigger's items (claimed in the trigger's
transaction), an ``outbox|<queue>`` notification or due back-off (a sweep: claim a page and
publish it), maintenance's ``publish_pending``, and, while idle, ``outbox_next_due`` asked
every few seconds, so an item whose producer died is published as its claim expires.

Messages go out with publisher confirms and ``mandatory``; results are recorded fenced by
the item's claim token (a stale write changes nothing). Chunks are published only under
claims the database has just extended (``outbox_extend``), and nothing goes out under a
claim about to expire: a backlog larger than one claim is published once, not again by the
sweeps that take its expired claims (docs/deploying.md).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import attrs
import pika

from runlane.errors import ConfigurationError, RunlaneClosed, RunlaneError
from runlane.postgres import PostgresListener
from runlane.rabbitmq._amqp import describe
from runlane.rabbitmq._records import Claimed, OutboxRecords, OutboxStorage
from runlane.rabbitmq._sender import Sender
from runlane.storage import OutboxItem
from runlane.toolkit import Backoff, Closing, Deadline

__all__ = ["OutboxPublisher"]

log = logging.getLogger("runlane.rabbitmq.publisher")

_numbers = itertools.count(1)
_PAGES_PER_SWEEP = 10  # a sweep stops after this many full pages and asks again
_FIRST_BACKOFF = 0.5  # seconds: the first back-off after a failed publish (doubling)
_IDLE_SLICE = 5.0  # seconds: the connection's heartbeats are served at least this often
# after a sweep, the next one is due when the next item becomes publishable, within these
_RESWEEP_MIN = 0.05
_RESWEEP_MAX = 60.0
# while idle, the outbox is asked when its next item becomes publishable this often (at most
# half a claim apart, so an item claimed by a producer that died is seen before its claim
# expires, and swept as it does)
_IDLE_POLL = 5.0


@attrs.define(eq=False)
class _Request:
    limit: int
    done: threading.Event = attrs.Factory(threading.Event)
    published: int = 0
    error: BaseException | None = None


class OutboxPublisher:
    """The thread, what other threads hand it, and when it sweeps; its outbox writes are
    ``OutboxRecords``', its broker connection a ``Sender``'s."""

    def __init__(
        self,
        storage: OutboxStorage,
        *,
        params: pika.URLParameters,
        schema: str,
        claim: timedelta,
        publish_timeout: float,
        delivery_limit: int,
        queue_type: str = "quorum",
        page_size: int = 100,
        max_backoff: float = 5.0,
    ) -> None:
        self._environment: str | None = None  # the environment served (``serve``)
        self._page_size = page_size
        self.name = f"runlane-publisher-{next(_numbers)}"
        self._records = OutboxRecords(
            storage,
            self.name,
            schema=schema,
            claim=claim,
            publish_timeout=publish_timeout,
            on_sweep=self._ask_sweep,
        )
        self.stats = self._records.stats
        self._sender = Sender(
            self.name,
            params=params,
            schema=schema,
            publish_timeout=publish_timeout,
            delivery_limit=delivery_limit,
            queue_type=queue_type,
        )
        self.connected = self._sender.connected
        self._poll_interval = min(_IDLE_POLL, claim.total_seconds() / 2)
        self._next_poll = time.monotonic() + self._poll_interval
        self._cond = threading.Condition()
        self._eager: list[Claimed] = []
        self._requests: list[_Request] = []
        self._sweep = False
        self._next_sweep: float | None = None  # monotonic time of a sweep after a back-off
        # one back-off for a broker or an outbox that fails: the shared jittered doubling
        # (from half a second up to max_backoff), reset once a page publishes
        self._backoff = Backoff(first=_FIRST_BACKOFF, cap=max_backoff)
        self._closing = False
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None
        self._listeners: list[PostgresListener] = []

    # -- other threads -------------------------------------------------------------------

    @property
    def environment(self) -> str | None:
        """The environment served (None until ``serve``)."""
        return self._environment

    def serve(self, environment: str) -> None:
        """Publish ``environment``'s items only (the lane's ``prepare``, before its listener
        starts). A publisher serves one environment: another raises ConfigurationError."""
        with self._cond:
            if self._environment is not None and self._environment != environment:
                raise ConfigurationError(
                    f"{self.name} publishes environment {self._environment!r}; it cannot "
                    f"serve {environment!r} too (one publisher per runtime and environment)"
                )
            self._environment = environment

    def _ensure_thread(self) -> None:
        """Start the thread on first use (under the lock)."""
        if self._closing:
            raise RunlaneClosed(f"{self.name} is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
            self._thread.start()

    def submit(self, items: Sequence[OutboxItem], claimed_at: float | None = None) -> None:
        """Publish an eager trigger's items (asynchronously; the caller has committed).
        ``claimed_at`` (``time.monotonic()`` before the statement that claimed them) is not
        relied on: their claims are extended, and checked, in database time before they
        are published."""
        with self._cond:
            if self._closing:
                return  # their claim expires and another publisher takes them
            self._ensure_thread()
            self._eager.append(Claimed(list(items)))
            self._cond.notify_all()

    def wake(self) -> None:
        """Items were stored unclaimed: sweep the outbox soon."""
        with self._cond:
            if self._closing:
                return
            self._ensure_thread()
            self._sweep = True
            self._cond.notify_all()

    def on_notify(self, message: str | None) -> None:
        """A listener's callback: ``outbox|<queue>``, or None after a reconnect."""
        if message is None or message.startswith("outbox|"):
            self.wake()

    def add_listener(self, listener: PostgresListener) -> None:
        self._listeners.append(listener)

    def publish_pending(self, limit: int, timeout: float) -> int:
        """Claim and publish one page of up to ``limit`` items (maintenance); returns how
        many were published and recorded. Raises what stopped it."""
        request = _Request(limit)
        with self._cond:
            self._ensure_thread()
            self._requests.append(request)
            self._cond.notify_all()
        if not request.done.wait(timeout):
            raise RunlaneError(
                f"{self.name} did not finish publishing within {timeout:.0f}s "
                f"(broker {describe(self._sender.params)})"
            )
        if request.error is not None:
            raise request.error
        return request.published

    def close(self, timeout: float | None = 10.0) -> None:
        """Publish what eager triggers handed over (within ``timeout``), release what could
        not be published for another publisher, and close the connection. Every part runs
        even when one raises; the first error is raised at the end. The waits share
        ``timeout``: the whole close keeps to it."""
        deadline = Deadline(timeout)
        closing = Closing(self.name)
        for listener in self._listeners:
            with closing.part(f"{self.name}'s listener"):
                listener.close(deadline.left())
        with self._cond:
            if self._closing:
                thread = self._thread
            else:
                self._closing = True
                thread = self._thread
                self._deadline = None if timeout is None else time.monotonic() + timeout
                self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            with closing.part(f"{self.name}'s thread"):
                thread.join(deadline.left())
                if thread.is_alive():
                    log.warning("runlane: %s did not stop within %ss", self.name, timeout)
        with closing.part(f"{self.name}'s watchdog"):
            self._sender.stop_watchdog(deadline.left())
        closing.raise_first()

    # -- the thread ----------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._loop()
        except BaseException:
            log.exception("runlane: %s failed", self.name)
        finally:
            self._sender.disconnect()
            self._sender.stop_watchdog()

    def _loop(self) -> None:
        while True:
            eager, requests, sweep, closing = self._next_work()
            self._publish_eager(eager, closing)
            self._serve(requests)
            if sweep and not closing:
                self._sweep_pages()
            elif not closing and time.monotonic() >= self._next_poll:
                self._poll_due()
            if closing:
                self._finish_closing()
                return

    def _next_work(self) -> tuple[list[Claimed], list[_Request], bool, bool]:
        """Wait for work (serving heartbeats meanwhile), then take all of it; returns with
        none when the outbox is due to be asked when its next item is publishable."""
        with self._cond:
            while not (self._eager or self._requests or self._sweep or self._closing):
                now = time.monotonic()
                wait = min(_IDLE_SLICE, max(0.0, self._next_poll - now))
                if self._next_sweep is not None:
                    wait = min(wait, max(0.0, self._next_sweep - now))
                    if self._next_sweep <= now:
                        self._sweep, self._next_sweep = True, None
                        break
                if self._next_poll <= now:
                    break
                self._cond.wait(wait)
                if not (self._eager or self._requests or self._sweep or self._closing):
                    self._sender.serve_heartbeats()
            eager, self._eager = self._eager, []
            requests, self._requests = self._requests, []
            sweep, self._sweep = self._sweep, False
            return eager, requests, sweep, self._closing

    def _publish_eager(self, eager: list[Claimed], closing: bool) -> None:
        """Publish what eager triggers handed over, together (one claim extension per
        chunk, however many triggers they came from). While the broker is gone (see
        ``Sender.down``), their items wait with those that failed, released in one write with the
        same error and due at the next try, when a sweep is scheduled: a trigger made
        during an outage costs no connection attempt, and maintenance's request, served
        after these, is not held up by one attempt per trigger."""
        items = [item for claimed in eager for item in claimed.items]
        if not items:
            return
        if closing:
            self._flush_on_close(Claimed(items))
        elif (down := self._sender.down) is not None and time.monotonic() < down[0]:
            retry_at, error = down
            self._records.record_failure(items, error, max(0.0, retry_at - time.monotonic()))
        else:
            self._publish_and_record(Claimed(items))

    def _serve(self, requests: list[_Request]) -> None:
        for request in requests:
            try:
                request.published = self._publish_and_record(
                    self._records.claim_page(self._environment, request.limit)
                )
            except BaseException as exc:
                request.error = exc
            finally:
                request.done.set()

    def _finish_closing(self) -> None:
        with self._cond:
            rest, self._eager = self._eager, []
            waiting, self._requests = self._requests, []
        for request in waiting:
            request.error = RunlaneClosed(f"{self.name} is closed")
            request.done.set()
        items = [item for claimed in rest for item in claimed.items]
        if items:
            self._flush_on_close(Claimed(items))

    def _flush_on_close(self, claimed: Claimed) -> None:
        deadline = self._deadline
        if deadline is not None and time.monotonic() >= deadline:
            self._records.record_failure(
                claimed.items, "the publisher closed before publishing", 0.0
            )
            return
        self._publish_and_record(claimed)

    def _sweep_pages(self) -> None:
        """Publish pages until a short one; then sweep again when the next item becomes
        publishable (a deferred run, a back-off, a claim of a producer that died)."""
        for _ in range(_PAGES_PER_SWEEP):
            try:
                page = self._records.claim_page(self._environment, self._page_size)
            except RunlaneError as exc:
                log.warning("runlane: %s could not read the outbox (%s)", self.name, exc)
                self._schedule_sweep()
                return
            if page.items:
                self._publish_and_record(page)
            if len(page.items) < self._page_size:
                break
        else:
            self._ask_sweep()  # more to do: go on after serving other work
            return
        self._poll_due(sweep_now=False)

    def _poll_due(self, *, sweep_now: bool = True) -> None:
        """Ask the outbox when its next item becomes publishable and sweep then (at once,
        when ``sweep_now`` and one is publishable now): an item claimed by a producer that
        died after its trigger is swept as its claim expires."""
        self._next_poll = time.monotonic() + self._poll_interval
        if self._environment is None:
            return
        try:
            wait = self._records.next_due(self._environment)
        except RunlaneError:
            wait = _RESWEEP_MAX
        if wait is None:
            return
        with self._cond:
            if sweep_now and wait <= 0:
                self._sweep = True
                return
            due = time.monotonic() + min(_RESWEEP_MAX, max(_RESWEEP_MIN, wait))
            if self._next_sweep is None or due < self._next_sweep:
                self._next_sweep = due

    def _schedule_sweep(self, delay: float | None = None) -> None:
        """Sweep again after ``delay`` (None: the next back-off)."""
        wait = self._backoff.next() if delay is None else delay
        with self._cond:
            self._next_sweep = time.monotonic() + wait

    def _back_off(self, failed: list[OutboxItem], error: str) -> float:
        """Items that failed to publish: due again after the next back-off (returned), and
        a sweep then."""
        delay = self._backoff.next()
        self._records.record_failure(failed, error, delay)
        self._schedule_sweep(delay)
        return delay

    def _ask_sweep(self) -> None:
        with self._cond:
            self._sweep = True

    def _publish_and_record(self, claimed: Claimed) -> int:
        """Publish with confirms and record the results, a chunk (at most a page) at a time,
        each chunk only under claims the database has just extended (see the module
        docstring): an item whose claim was lost is not published; what is left when the
        claim is about to expire is released for a sweep, and what is left when the broker
        is gone is released with the failure. Returns the items recorded as published."""
        items = self._records.refuse_unnameable(self._records.own(claimed.items, self._environment))
        recorded = 0
        deadline = claimed.deadline  # a page just claimed: its first chunk needs no extension
        for start in range(0, len(items), self._page_size):
            chunk = items[start : start + self._page_size]
            rest = items[start + self._page_size :]
            if deadline is None:
                held = self._hold(chunk)
                if held is None:  # not known to be held: left to expire, and to a sweep
                    return recorded
                chunk, deadline = held
            sent = self._sender.publish(chunk, deadline)
            deadline = None  # the next chunk is extended first
            late = sent.late
            if sent.failed and not sent.done and not self._sender.is_connected and sent.cut is None:
                # the connection may have died since its last use: one fresh try, under the
                # claims extended again
                held = self._hold(sent.failed)
                if held is None:
                    return recorded
                sent = self._sender.publish(*held)
                late += sent.late
            recorded += self._records.record_success(sent.done)
            failed, error = sent.failed, sent.error
            if sent.cut is not None:
                # a queue the broker could not serve: its items fail (counted, backed off,
                # shown by status); the rest go back at once, for a sweep on a new connection
                self._back_off(failed, error)
                why = "not tried after a queue the broker could not serve"
                self._records.unclaim(late + rest, why)
                return recorded
            if late:
                self._records.unclaim(late + rest)
                return recorded
            if failed:
                if not self._sender.is_connected:  # the broker is gone: the rest waits too
                    failed += rest
                delay = self._back_off(failed, error)
                if not self._sender.is_connected:
                    self._sender.down = (time.monotonic() + delay, error)
                    return recorded
            else:
                self._backoff.reset()
        return recorded

    def _hold(self, items: list[OutboxItem]) -> tuple[list[OutboxItem], float] | None:
        """``OutboxRecords.hold``; when the database could not say, a sweep after the next
        back-off."""
        held = self._records.hold(items)
        if held is None:
            self._schedule_sweep()
        return held
