"""The outbox publisher of one runtime: one thread owning one AMQP connection.

A publisher serves its runtime's environment only (``serve``): it claims, publishes and
records that environment's items and no other's, whose broker or virtual host it may not be
allowed to use (SPEC section 2: an environment never sees another's runs).

Work reaches it four ways: an eager trigger hands over its items (already claimed by the
trigger's transaction) right after commit; a notification ``outbox|<queue>`` (items stored
unclaimed, e.g. by ``trigger(connection=...)`` or a hand-back) or a due back-off asks it to
sweep, that is to claim a bounded page (fresh token per item, expiry by the database) and
publish it; maintenance asks for one page synchronously (``publish_pending``); and while
idle it asks the outbox, every few seconds, when its next item becomes publishable
(``outbox_next_due``, which counts an item claimed by a producer that died after its
trigger as publishable once that claim expires) and sweeps then, so a stalled item is
published as its claim expires rather than at maintenance's recovery threshold. Every
message is published with publisher confirms and ``mandatory`` (an unroutable message is a
failure), then its result is recorded fenced by the item's claim token: success deletes
the item, failure releases it with a back-off. A result written under a lost claim changes
nothing and is counted as stale. While the broker is gone (no connection could be made),
eager items are not tried one by one until the back-off has passed: they wait with the
failed ones, due at the next try.

Items are published and recorded in chunks of at most a page, each under a claim the
database says is still held: before a chunk is published its claims are extended, fenced
by their tokens and in database time (``outbox_extend``), and an item whose claim was lost
(expired, or taken by another publisher) is not published at all; only the first chunk of
a page this thread has just claimed goes without, its claim being that fresh. Within a
chunk, none is published once its claim is about to expire (less than ``publish_timeout``
plus a recording allowance left, told by this process's monotonic clock from before the
statement that claimed or extended it): those are released for a sweep to claim afresh. A
backlog larger than one claim can cover is therefore published once, not once by this
thread and again by the sweeps that take its expired claims, and neither a process clock
nor a claim length this process assumes decides alone whether a claim is still held.

A connection belongs to one thread (pika); other threads only queue requests.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol

import attrs
import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection

from runlane.errors import ConfigurationError, RunlaneClosed, RunlaneError
from runlane.postgres import PostgresListener
from runlane.rabbitmq._amqp import (
    AMQP_ERRORS,
    Watchdog,
    declare_queue,
    describe,
    message_body,
    name_too_long,
    queue_name,
    queue_type_mismatch,
)
from runlane.storage import OutboxItem
from runlane.toolkit import Backoff, Closing, Deadline

__all__ = ["OutboxPublisher", "OutboxStorage", "PublisherStats"]


class OutboxStorage(Protocol):
    """The part of :class:`runlane.postgres.Outbox` a publisher uses."""

    def outbox_claim_page(
        self, environment: str, limit: int, claim: timedelta
    ) -> list[OutboxItem]: ...

    def outbox_extend(self, items: Sequence[OutboxItem], claim: timedelta) -> set[uuid.UUID]: ...

    def outbox_published(self, items: Sequence[OutboxItem]) -> set[uuid.UUID]: ...

    def outbox_failed(
        self, items: Sequence[OutboxItem], error: str, delay: timedelta
    ) -> set[uuid.UUID]: ...

    def outbox_unclaim(self, items: Sequence[OutboxItem]) -> set[uuid.UUID]: ...

    def outbox_next_due(self, environment: str) -> float | None: ...


log = logging.getLogger("runlane.rabbitmq.publisher")

_numbers = itertools.count(1)
_PAGES_PER_SWEEP = 10  # a sweep stops after this many full pages and asks again
_FIRST_BACKOFF = 0.5  # seconds: the first back-off after a failed publish (doubling)
_IDLE_SLICE = 5.0  # seconds: the connection's heartbeats are served at least this often
# after a sweep, the next one is due when the next item becomes publishable, within these
_RESWEEP_MIN = 0.05
_RESWEEP_MAX = 60.0
# an item whose broker queue name is longer than AMQP allows (written by a producer that
# never checked it: an older runlane, a polling-lane runtime of the environment) is tried
# again this late, with that reason as its error: the broker is not asked and not blamed
_REFUSED_DELAY = 60.0
# while idle, the outbox is asked when its next item becomes publishable this often (at most
# half a claim apart, so an item claimed by a producer that died is seen before its claim
# expires, and swept as it does)
_IDLE_POLL = 5.0
# what a claim must still have left, past one publish's timeout, for an item to be published
# under it: time to record the chunk's results (at most half of what the claim leaves past
# the publish timeout, so that a short claim still publishes)
_RECORD_ALLOWANCE = 5.0


@attrs.define
class PublisherStats:
    published: int = 0  # confirmed and recorded
    failed: int = 0  # not confirmed (broker down, unroutable, nacked); released to retry
    stale: int = 0  # results written under a lost claim: changed nothing
    unclaimed: int = 0  # not published under a claim about to expire: left to a sweep
    lost: int = 0  # not published: their claim was lost (expired or taken) before their chunk
    foreign: int = 0  # eager items of another environment: released, never published here


@attrs.frozen
class _Claimed:
    """Items under a claim. ``deadline``: for a page this thread has just claimed, the
    monotonic time after which none of its first chunk is published; None for items
    claimed elsewhere (an eager trigger's), whose every chunk is extended first."""

    items: list[OutboxItem]
    deadline: float | None = None


@attrs.define(eq=False)
class _Request:
    limit: int
    done: threading.Event = attrs.Factory(threading.Event)
    published: int = 0
    error: BaseException | None = None


class OutboxPublisher:
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
        self._storage = storage
        self._environment: str | None = None  # the environment served (``serve``)
        self._params = params
        self._schema = schema
        self._claim = claim
        self._publish_timeout = publish_timeout
        self._delivery_limit = delivery_limit
        self._queue_type = queue_type
        self._page_size = page_size
        self.name = f"runlane-publisher-{next(_numbers)}"
        self.stats = PublisherStats()
        claim_s = claim.total_seconds()
        # a claim with less than this left publishes nothing more (see the module docstring)
        self._margin = publish_timeout + min(
            _RECORD_ALLOWANCE, max(0.0, claim_s - publish_timeout) / 2
        )
        self._poll_interval = min(_IDLE_POLL, claim_s / 2)
        self._next_poll = time.monotonic() + self._poll_interval
        self._cond = threading.Condition()
        self._eager: list[_Claimed] = []
        self._requests: list[_Request] = []
        self._sweep = False
        self._next_sweep: float | None = None  # monotonic time of a sweep after a back-off
        # one back-off for a broker or an outbox that fails: the shared jittered doubling
        # (from half a second up to max_backoff), reset once a page publishes
        self._backoff = Backoff(first=_FIRST_BACKOFF, cap=max_backoff)
        self._closing = False
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None
        self._conn: BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self._declared: set[str] = set()
        # the broker queue whose publish the last _publish cut off (no confirm in time)
        self._cut_queue: str | None = None
        # the broker is gone (a publish found no connection and none could be made): the
        # monotonic time of the next try and the error; until then eager items wait untried
        self._down: tuple[float, str] | None = None
        self._listeners: list[PostgresListener] = []
        self.connected = threading.Event()
        # bounds each publish and its confirm, which pika does not (a broker that accepts
        # the connection but never answers would otherwise block this thread for good)
        self._watchdog = Watchdog(f"{self.name}-watchdog")

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
            self._eager.append(_Claimed(list(items)))
            self._cond.notify_all()

    def _deadline_of(self, claimed_at: float) -> float:
        return claimed_at + self._claim.total_seconds() - self._margin

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
                f"(broker {describe(self._params)})"
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
            self._watchdog.stop(deadline.left())
        closing.raise_first()

    # -- the thread ----------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._loop()
        except BaseException:
            log.exception("runlane: %s failed", self.name)
        finally:
            self._disconnect()
            self._watchdog.stop()

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

    def _next_work(self) -> tuple[list[_Claimed], list[_Request], bool, bool]:
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
                    self._serve_heartbeats()
            eager, self._eager = self._eager, []
            requests, self._requests = self._requests, []
            sweep, self._sweep = self._sweep, False
            return eager, requests, sweep, self._closing

    def _publish_eager(self, eager: list[_Claimed], closing: bool) -> None:
        """Publish what eager triggers handed over, together (one claim extension per
        chunk, however many triggers they came from). While the broker is gone (see
        ``_down``), their items wait with those that failed, released in one write with the
        same error and due at the next try, when a sweep is scheduled: a trigger made
        during an outage costs no connection attempt, and maintenance's request, served
        after these, is not held up by one attempt per trigger."""
        items = [item for claimed in eager for item in claimed.items]
        if not items:
            return
        if closing:
            self._flush_on_close(_Claimed(items))
        elif self._down is not None and time.monotonic() < self._down[0]:
            retry_at, error = self._down
            self._record_failure(items, error, max(0.0, retry_at - time.monotonic()))
        else:
            self._publish_and_record(_Claimed(items))

    def _serve(self, requests: list[_Request]) -> None:
        for request in requests:
            try:
                request.published = self._publish_and_record(self._claim_page(request.limit))
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
            self._flush_on_close(_Claimed(items))

    def _serve_heartbeats(self) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            conn.process_data_events(0)
        except AMQP_ERRORS as exc:
            log.info("runlane: %s lost its broker connection (%s)", self.name, exc)
            self._disconnect()

    def _flush_on_close(self, claimed: _Claimed) -> None:
        deadline = self._deadline
        if deadline is not None and time.monotonic() >= deadline:
            self._record_failure(claimed.items, "the publisher closed before publishing", 0.0)
            return
        self._publish_and_record(claimed)

    def _sweep_pages(self) -> None:
        """Publish pages until a short one; then sweep again when the next item becomes
        publishable (a deferred run, a back-off, a claim of a producer that died)."""
        for _ in range(_PAGES_PER_SWEEP):
            try:
                page = self._claim_page(self._page_size)
            except RunlaneError as exc:
                log.warning("runlane: %s could not read the outbox (%s)", self.name, exc)
                self._schedule_sweep()
                return
            if page.items:
                self._publish_and_record(page)
            if len(page.items) < self._page_size:
                break
        else:
            with self._cond:
                self._sweep = True  # more to do: go on after serving other work
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
            wait = self._storage.outbox_next_due(self._environment)
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

    def _claim_page(self, limit: int) -> _Claimed:
        environment = self._environment
        if environment is None:  # not prepared yet: nothing of any environment is taken
            return _Claimed([], time.monotonic())
        start = time.monotonic()  # the claims start after this
        items = self._storage.outbox_claim_page(environment, limit, self._claim)
        return _Claimed(items, self._deadline_of(start))

    def _schedule_sweep(self, delay: float | None = None) -> None:
        """Sweep again after ``delay`` (None: the next back-off)."""
        wait = self._backoff.next() if delay is None else delay
        with self._cond:
            self._next_sweep = time.monotonic() + wait

    def _back_off(self, failed: list[OutboxItem], error: str) -> float:
        """Items that failed to publish: due again after the next back-off (returned), and
        a sweep then."""
        delay = self._backoff.next()
        self._record_failure(failed, error, delay)
        self._schedule_sweep(delay)
        return delay

    # -- publishing ----------------------------------------------------------------------

    def _connect(self) -> BlockingChannel:
        if self._channel is not None and self._channel.is_open:
            return self._channel
        self._disconnect()
        params = self._params
        params.blocked_connection_timeout = self._publish_timeout
        params.socket_timeout = self._publish_timeout
        params.stack_timeout = self._publish_timeout
        conn = pika.BlockingConnection(params)
        channel = conn.channel()
        channel.confirm_delivery()
        self._conn, self._channel = conn, channel
        self._declared.clear()
        self._down = None
        self.connected.set()
        log.info("runlane: %s connected to %s", self.name, describe(params))
        return channel

    def _disconnect(self) -> None:
        conn, self._conn, self._channel = self._conn, None, None
        self.connected.clear()
        if conn is not None:
            try:
                conn.close()
            except AMQP_ERRORS:
                log.debug("closing a broken broker connection failed", exc_info=True)

    def _publish_and_record(self, claimed: _Claimed) -> int:
        """Publish with confirms and record the results, a chunk (at most a page) at a time,
        each chunk only under claims the database has just extended (see the module
        docstring): an item whose claim was lost is not published; what is left when the
        claim is about to expire is released for a sweep, and what is left when the broker
        is gone is released with the failure. Returns the items recorded as published."""
        items = self._refuse_unnameable(self._own(claimed.items))
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
            done, failed, error, late = self._publish(chunk, deadline)
            deadline = None  # the next chunk is extended first
            if failed and not done and self._conn is None and self._cut_queue is None:
                # the connection may have died since its last use: one fresh try, under the
                # claims extended again
                held = self._hold(failed)
                if held is None:
                    return recorded
                done, failed, error, later = self._publish(*held)
                late += later
            recorded += self._record_success(done)
            if self._cut_queue is not None:
                # a queue the broker could not serve: its items fail (counted, backed off,
                # shown by status); the rest go back at once, for a sweep on a new connection
                self._back_off(failed, error)
                self._unclaim(late + rest, "not tried after a queue the broker could not serve")
                return recorded
            if late:
                self._unclaim(late + rest)
                return recorded
            if failed:
                if self._conn is None:  # the broker is gone: the rest waits with these
                    failed += rest
                delay = self._back_off(failed, error)
                if self._conn is None:
                    self._down = (time.monotonic() + delay, error)
                    return recorded
            else:
                self._backoff.reset()
        return recorded

    def _own(self, items: list[OutboxItem]) -> list[OutboxItem]:
        """The items of the environment served. Another environment's (never claimed by
        this publisher; an eager trigger of a storage shared across environments) are
        released at once for that environment's publishers, never published here: its
        runs may belong to a broker or virtual host this one may not use."""
        environment = self._environment
        if environment is None:
            return items
        foreign = [item for item in items if item.environment != environment]
        if not foreign:
            return items
        self.stats.foreign += len(foreign)
        log.error(
            "runlane: %s publishes environment %r and was handed %d item(s) of another; "
            "released for that environment's publishers",
            self.name,
            environment,
            len(foreign),
        )
        try:
            self._storage.outbox_unclaim(foreign)
        except RunlaneError as exc:
            log.warning("runlane: %s could not release them (%s)", self.name, exc)
        return [item for item in items if item.environment == environment]

    def _hold(self, items: list[OutboxItem]) -> tuple[list[OutboxItem], float] | None:
        """Extend the items' claims in database time, fenced by their tokens: the items
        still held and the monotonic time after which none of them is published; None when
        the database could not say (nothing is published: the claims expire and a sweep
        takes them). Items whose claim was lost are dropped, and a sweep is asked for:
        a claim that expired unclaimed is taken afresh there."""
        start = time.monotonic()  # the extended claims start after this
        try:
            kept = self._storage.outbox_extend(items, self._claim)
        except RunlaneError as exc:
            log.warning(
                "runlane: %s could not extend the claims of %d item(s) (%s); they are "
                "published after their claims expire",
                self.name,
                len(items),
                exc,
            )
            self._schedule_sweep()
            return None
        held = [item for item in items if item.id in kept]
        lost = len(items) - len(held)
        if lost:
            self.stats.lost += lost
            log.info(
                "runlane: %s: %d item(s) had lost their claim before publishing; not published "
                "under it",
                self.name,
                lost,
            )
            with self._cond:
                self._sweep = True
        return held, self._deadline_of(start)

    def _refuse_unnameable(self, items: list[OutboxItem]) -> list[OutboxItem]:
        """The items whose broker queue can exist; the others are released for a late try
        with the reason, so they neither break the connection nor hold up the rest."""
        kept: list[OutboxItem] = []
        for item in items:
            problem = name_too_long(self._schema, item.environment, item.queue)
            if problem is None:
                kept.append(item)
                continue
            log.error("runlane: %s cannot publish run %s: %s", self.name, item.run_id, problem)
            self._record_failure([item], problem, _REFUSED_DELAY)
        return kept

    def _publish(
        self, items: list[OutboxItem], deadline: float
    ) -> tuple[list[OutboxItem], list[OutboxItem], str, list[OutboxItem]]:
        """Publish ``items`` until ``deadline``: (confirmed, failed, the error, not tried
        because their claim is about to expire)."""
        done: list[OutboxItem] = []
        failed: list[OutboxItem] = []
        error = ""
        self._cut_queue = None
        if time.monotonic() >= deadline:
            return [], [], "", list(items)
        try:
            channel = self._connect()
        except AMQP_ERRORS as exc:
            error = f"broker {describe(self._params)} unreachable: {type(exc).__name__}: {exc}"
            log.warning("runlane: %s: %s", self.name, error)
            return [], list(items), error, []
        for index, item in enumerate(items):
            if time.monotonic() >= deadline:
                return done, failed, error, items[index:]
            name = self._queue_of(item)
            fired = self._watchdog.fired
            try:
                with self._watchdog.bound(self._conn, self._publish_timeout):
                    self._publish_one(channel, name, item)
                done.append(item)
            except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
                error = f"the broker refused run {item.run_id}: {type(exc).__name__}"
                failed.append(item)
                self._declared.discard(name)  # deleted meanwhile? declare it again next time
            except AMQP_ERRORS as exc:
                cut = self._watchdog.fired != fired
                self._disconnect()
                if cut:
                    self._cut_queue = name
                    # no confirm within publish_timeout: this queue cannot be served (a quorum
                    # queue without a leader). Its items fail (counted, backed off, shown by
                    # status); the other queues' items go back unclaimed and are not held up.
                    error = (
                        f"queue {name}: the broker gave no confirm within "
                        f"{self._publish_timeout:g}s (it cannot serve this queue)"
                    )
                    log.warning("runlane: %s: publishing failed (%s)", self.name, error)
                    later = items[index:]
                    failed += [it for it in later if self._queue_of(it) == name]
                    return done, failed, error, [it for it in later if self._queue_of(it) != name]
                error = queue_type_mismatch(exc, name, self._queue_type) or (
                    f"broker {describe(self._params)}: {type(exc).__name__}: {exc}"
                )
                log.warning("runlane: %s: publishing failed (%s)", self.name, error)
                failed.extend(items[index:])
                break
        return done, failed, error, []

    def _queue_of(self, item: OutboxItem) -> str:
        return queue_name(self._schema, item.environment, item.queue)

    def _publish_one(self, channel: BlockingChannel, name: str, item: OutboxItem) -> None:
        """Declare the queue once per connection, publish, and wait for the confirm."""
        if name not in self._declared:
            declare_queue(channel, self._schema, name, self._delivery_limit, self._queue_type)
            self._declared.add(name)
        channel.basic_publish(
            exchange="",
            routing_key=name,
            body=message_body(item.run_id, item.environment),
            properties=pika.BasicProperties(
                message_id=str(item.id),
                delivery_mode=pika.DeliveryMode.Persistent,
                content_type="application/json",
            ),
            mandatory=True,
        )

    def _record_success(self, items: list[OutboxItem]) -> int:
        if not items:
            return 0
        try:
            applied = self._storage.outbox_published(items)
        except RunlaneError as exc:
            log.warning(
                "runlane: %s published %d messages but could not record it (%s); their "
                "items are published again after their claims expire (consumers drop the "
                "duplicates)",
                self.name,
                len(items),
                exc,
            )
            return 0
        stale = len(items) - len(applied)
        self.stats.published += len(applied)
        if stale:
            self.stats.stale += stale
            log.warning(
                "runlane: %s: %d published item(s) had lost their claim; nothing recorded",
                self.name,
                stale,
            )
        return len(applied)

    def _unclaim(
        self,
        items: list[OutboxItem],
        why: str = "the claim is about to expire before they are published",
    ) -> None:
        """Release items not published (their claim is about to expire, or they were not
        tried after a queue the broker could not serve), and sweep for them."""
        if not items:
            return
        self.stats.unclaimed += len(items)
        log.info("runlane: %s: %d item(s) released for a sweep: %s", self.name, len(items), why)
        try:
            self._storage.outbox_unclaim(items)
        except RunlaneError as exc:
            log.warning(
                "runlane: %s could not release %d item(s) (%s); they are published after "
                "their claims expire",
                self.name,
                len(items),
                exc,
            )
        with self._cond:
            self._sweep = True

    def _record_failure(self, items: list[OutboxItem], error: str, delay: float) -> None:
        self.stats.failed += len(items)
        try:
            applied = self._storage.outbox_failed(items, error, timedelta(seconds=delay))
        except RunlaneError as exc:
            log.warning(
                "runlane: %s could not release %d unpublished item(s) (%s); they are "
                "published after their claims expire",
                self.name,
                len(items),
                exc,
            )
            return
        stale = len(items) - len(applied)
        if stale:
            self.stats.stale += stale
