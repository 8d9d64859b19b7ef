"""The RabbitMQ lane's delivery path for one worker: a consumer thread and fenced claims.

``runlane-worker-N-consumer`` owns the worker's AMQP connection and buffers deliveries
(prefetch: the claim batch, more while claiming ahead); it never touches the database. The
acquiring slot claims the runs they name by id with the polling lane's fenced claim, so
queue limits are still enforced in storage. Claims commit asynchronously; deliveries are
acknowledged only once the WAL is flushed past them (``_acks``), so a crash that loses a
claim leaves its message to be delivered again. A delivery whose run is not claimable is
acknowledged and, where the run still should go out (not due, held by limits), deferred
through the outbox; a database error requeues. Cancellations come from Postgres's listener.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from datetime import timedelta

import attrs
import pika
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection
from pika.spec import Basic, BasicProperties

from runlane.errors import StorageUnavailable
from runlane.lanes import AcquirerOptions
from runlane.models import RunStatus
from runlane.postgres import Outbox, PostgresListener
from runlane.rabbitmq._acks import AckAfterFlush
from runlane.rabbitmq._amqp import (
    AMQP_ERRORS,
    Watchdog,
    declare_queue,
    describe,
    parse_body,
    queue_name,
    queue_type_mismatch,
)
from runlane.storage import ClaimedRun, QueueLimits
from runlane.toolkit import Backoff, Closing, Deadline

__all__ = ["ConsumerStats", "RabbitAcquirer"]

log = logging.getLogger("runlane.rabbitmq.consumer")

_SETUP_SECONDS = 15.0  # declaring and consuming the worker's queues may take this long
_MAX_PREFETCH = 1000  # the most unacknowledged deliveries of a queue a worker asks for
# claim batches a worker claiming ahead may hold unacknowledged: acknowledgements wait for the
# claims' WAL flush, and with two batches the buffer ran dry every cycle (benchmarks/README.md)
_AHEAD_BATCHES = 6
# a worker that asked for more runs than its slots counts as claiming ahead this long after
# (a claim for free slots in between, after a short claim, does not stop it)
_AHEAD_SECONDS = 1.0


@attrs.define
class ConsumerStats:
    """Deliveries a worker's consumer did not turn into an attempt, by reason."""

    claimed: int = 0
    duplicates: int = 0  # the run was no longer queued: acked, not executed
    unknown: int = 0  # no such run in this environment: acked
    malformed: int = 0  # not a runlane message: acked
    deferred: int = 0  # not due yet, or held back by its queue's limits: re-published later
    paused: int = 0  # its queue is paused: acked, the run waits in Postgres until resumed
    requeued: int = 0  # a database error: nacked with requeue
    connections: int = 0  # broker connections made (more than one: it reconnected)


@attrs.frozen
class _Delivery:
    tag: int
    generation: int
    queue: str  # the logical queue
    body: bytes
    message_id: str | None


class RabbitAcquirer:
    def __init__(
        self,
        storage: Outbox,
        options: AcquirerOptions,
        on_cancel: Callable[[uuid.UUID | None], None],
        *,
        params: pika.URLParameters,
        schema: str,
        delivery_limit: int,
        poll_interval: timedelta,
        queue_type: str = "quorum",
        defer_delay: timedelta,
        make_listener: Callable[[Callable[[str | None], None], str], PostgresListener],
    ) -> None:
        self._environment = options.environment
        self._lease = options.lease
        self._worker_id = options.worker_id
        self._queues = {q.name: q for q in options.queues}
        # the prefetch: the claim batch (at most 4 x concurrency; prefetch = concurrency
        # halved throughput) while claiming for free slots only; while claiming ahead, a
        # second consumer per queue at _AHEAD_BATCHES claim batches (_pace): RabbitMQ
        # applies a prefetch only to consumers made after it is set
        self._concurrency = max(1, options.concurrency)
        self._prefetch = max(
            1, options.concurrency, min(options.claim_batch, 4 * options.concurrency)
        )
        self._prefetch_ahead = (
            min(_AHEAD_BATCHES * options.claim_batch, _MAX_PREFETCH) - self._prefetch
        )
        self._ahead_until = 0.0  # monotonic time until which the worker counts as ahead
        self._ahead_asked = False  # the consumer thread was asked to consume ahead
        self._ahead_tags: list[str] = []  # consumer tags of the ahead consumers (its thread)
        self._params = params
        self._schema = schema
        self._delivery_limit = delivery_limit
        self._queue_type = queue_type
        self._poll = poll_interval.total_seconds()
        self._defer_delay = defer_delay
        self._on_cancel = on_cancel
        self._name = options.name
        # claims commit asynchronously (their handlers start at once); their deliveries are
        # acknowledged once a synchronous flush on the pool has made them durable (_acks)
        self._claims = storage.dedicated(f"{options.name}-claims", durable_commits=False)
        self._acks: AckAfterFlush[_Delivery] = AckAfterFlush(
            options.name, storage.wal_flush, self._settle_flushed
        )
        self._lock = threading.Lock()
        self._buffer: deque[_Delivery] = deque()
        self._arrived = threading.Event()
        self._stop = threading.Event()
        self._generation = 0
        # delivery tags of the current connection not settled yet (consumer thread only)
        self._unsettled: set[int] = set()
        # why the last connection could not consume: a queue the broker holds with another
        # type (consumer thread only)
        self._mismatch: str | None = None
        self._conn: BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self._thread = threading.Thread(
            target=self._consume, name=f"{options.name}-consumer", daemon=True
        )
        self._listener = make_listener(self._on_notify, f"{options.name}-listener")
        self.stats = ConsumerStats()
        self.consuming = threading.Event()  # set while consuming (tests, status)
        self._watchdog = Watchdog(f"{options.name}-consumer-watchdog")

    @property
    def listener(self) -> PostgresListener:
        """The LISTEN connection that carries cancellations to this worker."""
        return self._listener

    def start(self) -> None:
        self._thread.start()
        self._listener.start()

    def acquire(self, want: int, for_bounded: int) -> list[ClaimedRun]:
        self._pace(want)
        self._arrived.clear()
        taken = self._take(want, for_bounded)
        if not taken:
            return []
        by_run: dict[uuid.UUID, list[_Delivery]] = {}
        for delivery in taken:
            run_id = parse_body(delivery.body)
            if run_id is None:
                self.stats.malformed += 1
                log.warning(
                    "runlane: %s: acknowledging a message that names no run (message id %s, "
                    "queue %s)",
                    self._name,
                    delivery.message_id,
                    delivery.queue,
                )
                self._settle([delivery], ack=True)
                continue
            by_run.setdefault(run_id, []).append(delivery)
        if not by_run:
            return []
        try:
            claimed = self._claim(by_run)
        except StorageUnavailable:
            self.stats.requeued += sum(len(d) for d in by_run.values())
            self._settle([d for ds in by_run.values() for d in ds], ack=False)
            raise
        # acknowledged once the WAL is flushed past the claims and deferrals just committed
        self._acks.add([d for ds in by_run.values() for d in ds])
        return claimed

    def _claim(self, by_run: dict[uuid.UUID, list[_Delivery]]) -> list[ClaimedRun]:
        """Claim the named runs by queue; settle why the others were not claimed."""
        per_queue: dict[str, list[uuid.UUID]] = {}
        for run_id, deliveries in by_run.items():
            per_queue.setdefault(deliveries[0].queue, []).append(run_id)
        claimed: list[ClaimedRun] = []
        for name, ids in per_queue.items():
            definition = self._queues[name]
            if definition.limited:  # a rate or per-key limit: the flow-control claim
                claimed += self._claims.run_claim_limited(
                    self._environment,
                    name,
                    QueueLimits.of(definition),
                    len(ids),
                    self._lease,
                    worker_id=self._worker_id,
                    run_ids=ids,
                ).runs
                continue
            limit = definition.concurrency_limit
            claimed += self._claims.run_claim_ids(
                self._environment,
                ids,
                self._lease,
                queue=name if limit is not None else None,
                concurrency_limit=limit,
                worker_id=self._worker_id,
            )
        self.stats.claimed += len(claimed)
        taken = {c.id for c in claimed}
        rest = [run_id for run_id in by_run if run_id not in taken]
        if not rest:
            return claimed
        states = self._claims.run_delivery_state(self._environment, rest)
        later: list[uuid.UUID] = []  # queued and due: capacity, or claimed elsewhere now
        not_due: list[uuid.UUID] = []
        for run_id in rest:
            state = states.get(run_id)
            if state is None:
                self.stats.unknown += 1
                log.warning(
                    "runlane: %s: a message names run %s, which environment %r does not "
                    "have (pruned, or another environment's); acknowledged",
                    self._name,
                    run_id,
                    self._environment,
                )
            elif state.status is not RunStatus.QUEUED:
                self.stats.duplicates += 1
                log.debug("run %s is %s: duplicate delivery acknowledged", run_id, state.status)
            elif state.paused:  # it waits in Postgres; resume_queue announces it again
                self.stats.paused += 1
                log.debug("run %s: queue %r is paused; delivery acknowledged", run_id, state.queue)
            elif state.due_now:
                later.append(run_id)
            else:
                not_due.append(run_id)
        self.stats.deferred += self._claims.outbox_defer(
            self._environment, later, self._defer_delay
        )
        self.stats.deferred += self._claims.outbox_defer(self._environment, not_due, timedelta(0))
        return claimed

    def wait_for_work(self) -> None:
        self._arrived.wait(self._poll)

    def wait_ready(self, timeout: float) -> bool:
        """Ready once the consumer is consuming and the listener (cancellations) connected."""
        deadline = Deadline(timeout)
        return self.consuming.wait(timeout) and self._listener.connected.wait(deadline.left())

    @property
    def rate_wait(self) -> float | None:
        """None: the lane has no drain(), and a delivery held back by a rate limit is
        deferred through the outbox, not waited for here."""
        return None

    def interrupt(self) -> None:
        self._arrived.set()

    def abort(self) -> None:
        self._claims.interrupt()

    def close(self, timeout: float | None) -> None:
        """Every part runs even when one raises; the first error is raised at the end. The
        waits share ``timeout``: the whole close keeps to it."""
        deadline = Deadline(timeout)
        self._arrived.set()
        closing = Closing(self._thread.name)
        with closing.part("the acknowledgements"):
            # while the consumer still runs: what waits is flushed and acknowledged
            self._acks.close(deadline.left())
        self._stop.set()
        with closing.part("the listener"):
            self._listener.close(deadline.left())
        with closing.part("the consumer thread"):
            self._thread.join(deadline.left())
            if self._thread.is_alive():
                log.warning("runlane: %s did not stop in time; giving up on it", self._thread.name)
        with closing.part("the watchdog"):
            self._watchdog.stop(deadline.left())
        with closing.part("the claims' connection"):
            self._claims.close()
        closing.raise_first()

    def _on_notify(self, message: str | None) -> None:
        if message is None:  # reconnected: a cancellation may have been missed
            self._on_cancel(None)
            return
        kind, _, subject = message.partition("|")
        if kind == "cancel":
            try:
                run_id = uuid.UUID(subject)
            except ValueError:
                return
            self._on_cancel(run_id)

    def _pace(self, want: int) -> None:
        """Consume ahead while the worker claims ahead of its slots (it wants more runs
        than it has slots: quick handlers and a backlog); the consumer thread stops the
        ahead consumers once it has not for ``_AHEAD_SECONDS``, so that messages do not
        wait in this buffer behind long handlers while another worker is idle."""
        if want <= self._concurrency or self._prefetch_ahead <= 0:
            return
        self._ahead_until = time.monotonic() + _AHEAD_SECONDS
        if self._ahead_asked:
            return
        with self._lock:
            conn, channel = self._conn, self._channel
        if conn is None or channel is None:
            return
        self._ahead_asked = True
        try:
            conn.add_callback_threadsafe(lambda: self._consume_ahead(channel))
        except AMQP_ERRORS as exc:
            self._ahead_asked = False
            log.info("runlane: %s: consuming ahead failed (%s)", self._name, exc)

    def _consume_ahead(self, channel: BlockingChannel) -> None:
        """On the consumer thread: a second consumer of each queue (prefetch: the rest of
        _AHEAD_BATCHES claim batches) while the worker claims ahead, and none once it has stopped.
        Cancelling one returns the deliveries pika holds for it and has not dispatched
        (rejected with requeue: the broker delivers them again, to any consumer); those
        already buffered here stay and are claimed as any other."""
        if self._channel is not channel:  # that connection is gone
            return
        ahead = time.monotonic() < self._ahead_until
        if ahead and not self._ahead_tags:
            channel.basic_qos(prefetch_count=self._prefetch_ahead)
            for name in self._queues:
                self._ahead_tags.append(self._consume_queue(channel, name))
            log.debug("runlane: %s consumes ahead", self._name)
        elif not ahead and self._ahead_tags:
            tags, self._ahead_tags = self._ahead_tags, []
            for tag in tags:
                channel.basic_cancel(tag)
            log.debug("runlane: %s stopped consuming ahead", self._name)
        self._ahead_asked = bool(self._ahead_tags)

    def _take(self, want: int, for_bounded: int) -> list[_Delivery]:
        taken: list[_Delivery] = []
        kept: deque[_Delivery] = deque()
        bounded = 0
        with self._lock:
            while self._buffer and len(taken) < want:
                delivery = self._buffer.popleft()
                if delivery.generation != self._generation:
                    continue  # its connection is gone: the broker redelivers it
                if self._queues[delivery.queue].bounded:
                    if bounded >= for_bounded:
                        kept.append(delivery)
                        continue
                    bounded += 1
                taken.append(delivery)
            kept.extend(self._buffer)
            self._buffer = kept
        return taken

    def _settle_flushed(self, deliveries: list[_Delivery], ack: bool) -> None:
        """The acknowledgements' thread: the WAL flush made the claims durable (ack), or
        failed (nack with requeue: a surviving claim makes the redelivery a duplicate)."""
        if not ack:
            self.stats.requeued += len(deliveries)
        self._settle(deliveries, ack=ack)

    def _settle(self, deliveries: list[_Delivery], *, ack: bool) -> None:
        """Ack (or nack with requeue) on the consumer thread; deliveries of an older
        connection are left to the broker, which redelivers them."""
        with self._lock:
            conn, channel = self._conn, self._channel
            generation = self._generation
        live = [d for d in deliveries if d.generation == generation]
        if conn is None or channel is None or not live:
            return

        def settle() -> None:
            if self._channel is not channel:  # that connection is gone (tags start over)
                return
            tags = sorted(d.tag for d in live)
            self._unsettled.difference_update(tags)
            if not ack:
                for tag in tags:
                    channel.basic_nack(delivery_tag=tag, requeue=True)
                return
            # one frame acknowledges every tag up to the lowest one still unsettled (each
            # basic_ack of pika's blocking channel also flushes and polls the connection:
            # a frame per delivery was a fifth of the worker's GIL time); later tags, taken
            # out of order around deliveries still buffered, one by one
            first_open = min(self._unsettled, default=None)
            upto = [t for t in tags if first_open is None or t < first_open]
            if upto:
                channel.basic_ack(delivery_tag=upto[-1], multiple=True)
            for tag in tags[len(upto) :]:
                channel.basic_ack(delivery_tag=tag)

        try:
            conn.add_callback_threadsafe(settle)
        except AMQP_ERRORS as exc:
            log.info("runlane: %s: settling deliveries failed (%s)", self._name, exc)

    def _consume(self) -> None:
        backoff = Backoff(first=0.1, cap=5.0)
        while not self._stop.is_set():
            try:
                self._run_connection(backoff)
            except AMQP_ERRORS as exc:
                if not self._stop.is_set():
                    self._log_unavailable(exc)
            except BaseException:
                log.exception("runlane: %s: the consumer failed; restarting it", self._name)
            finally:
                self._drop_connection()
            self._stop.wait(backoff.next())

    def _log_unavailable(self, exc: BaseException) -> None:
        if self._mismatch is not None:  # needs the operator: an error, not a broker blip
            log.error("runlane: %s cannot consume: %s; retrying", self._name, self._mismatch)
            return
        log.warning(
            "runlane: %s: broker %s unavailable (%s: %s); retrying",
            self._name,
            describe(self._params),
            type(exc).__name__,
            exc,
        )

    def _run_connection(self, backoff: Backoff) -> None:
        conn = pika.BlockingConnection(self._params)
        self._unsettled = set()
        self._ahead_tags = []
        self._ahead_asked = False
        self._mismatch = None
        try:
            channel = self._set_up(conn)
        except BaseException:
            # not ours yet (_drop_connection closes only the current one): close it here
            with contextlib.suppress(*AMQP_ERRORS):
                conn.close()
            raise
        cancelled = threading.Event()
        # the broker cancels a consumer whose queue was deleted: reconnect, which declares
        # the queue again and consumes it anew
        channel.add_on_cancel_callback(lambda _frame: cancelled.set())
        with self._lock:
            self._generation += 1
            self._conn, self._channel = conn, channel
        self.stats.connections += 1
        self.consuming.set()
        backoff.reset()
        log.info(
            "runlane: %s consuming %d queue(s) from %s",
            self._name,
            len(self._queues),
            describe(self._params),
        )
        while not self._stop.is_set() and not cancelled.is_set():
            conn.process_data_events(time_limit=0.2)
            if self._ahead_tags and time.monotonic() >= self._ahead_until:
                self._consume_ahead(channel)
        if self._stop.is_set():  # the acknowledgements settled before closing
            conn.process_data_events(time_limit=0)
        if cancelled.is_set():
            log.warning(
                "runlane: %s: the broker cancelled consuming (a queue was deleted?); "
                "declaring and consuming again",
                self._name,
            )

    def _set_up(self, conn: BlockingConnection) -> BlockingChannel:
        """Declare and consume the worker's queues on a new connection; returns the channel."""
        # a broker that accepts the connection but never answers (a quorum queue that lost
        # its members) would block these calls for good: bound them
        with self._watchdog.bound(conn, _SETUP_SECONDS):
            channel = conn.channel()
            channel.basic_qos(prefetch_count=self._prefetch)
            for name in self._queues:
                amqp_name = queue_name(self._schema, self._environment, name)
                try:
                    declare_queue(
                        channel, self._schema, amqp_name, self._delivery_limit, self._queue_type
                    )
                except AMQP_ERRORS as exc:
                    self._mismatch = queue_type_mismatch(exc, amqp_name, self._queue_type)
                    raise
                self._consume_queue(channel, name)
        return channel

    def _consume_queue(self, channel: BlockingChannel, name: str) -> str:
        """Consume the logical queue ``name`` (with the channel's prefetch as set now);
        returns the consumer tag."""
        return channel.basic_consume(
            queue=queue_name(self._schema, self._environment, name),
            on_message_callback=self._receiver(name),
            auto_ack=False,
        )

    def _receiver(
        self, queue: str
    ) -> Callable[[BlockingChannel, Basic.Deliver, BasicProperties, bytes], None]:
        def received(
            channel: BlockingChannel,
            method: Basic.Deliver,
            properties: BasicProperties,
            body: bytes,
        ) -> None:
            assert method.delivery_tag is not None  # set on every delivery
            self._unsettled.add(method.delivery_tag)
            with self._lock:
                self._buffer.append(
                    _Delivery(
                        tag=method.delivery_tag,
                        generation=self._generation,
                        queue=queue,
                        body=body,
                        message_id=properties.message_id,
                    )
                )
            if not self._arrived.is_set():  # set: a lock and a notify, once per delivery
                self._arrived.set()

        return received

    def _drop_connection(self) -> None:
        self.consuming.clear()
        with self._lock:
            conn, self._conn, self._channel = self._conn, None, None
            self._generation += 1  # buffered deliveries of that connection are void
            self._buffer.clear()
        if conn is not None:
            try:
                conn.close()
            except AMQP_ERRORS:
                log.debug("closing a broken broker connection failed", exc_info=True)
