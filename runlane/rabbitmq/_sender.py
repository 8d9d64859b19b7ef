"""The publisher thread's broker connection: one AMQP connection with publisher confirms,
each publish and its confirm bounded by a watchdog (pika bounds neither), every queue
declared once per connection. Used by that thread only (pika)."""

from __future__ import annotations

import logging
import threading
import time

import attrs
import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection

from runlane.rabbitmq._amqp import (
    AMQP_ERRORS,
    Watchdog,
    declare_queue,
    describe,
    message_body,
    queue_name,
    queue_type_mismatch,
)
from runlane.storage import OutboxItem

__all__ = ["Sender", "Sent"]

log = logging.getLogger("runlane.rabbitmq.publisher")


@attrs.frozen
class Sent:
    """What publishing a chunk did. ``late``: not tried, their claim about to expire (or,
    with ``cut``, of another queue than the one the broker could not serve)."""

    done: list[OutboxItem]
    failed: list[OutboxItem]
    error: str = ""
    late: list[OutboxItem] = attrs.Factory(list)
    # the broker queue whose publish got no confirm in time (it cannot serve it)
    cut: str | None = None


class Sender:
    def __init__(
        self,
        name: str,
        *,
        params: pika.URLParameters,
        schema: str,
        publish_timeout: float,
        delivery_limit: int,
        queue_type: str,
    ) -> None:
        self.name = name
        self.params = params
        self._schema = schema
        self._publish_timeout = publish_timeout
        self._delivery_limit = delivery_limit
        self._queue_type = queue_type
        self._conn: BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self._declared: set[str] = set()
        self.connected = threading.Event()
        # the broker is gone (a publish found no connection and none could be made): the
        # monotonic time of the next try and the error; until then eager items wait untried
        self.down: tuple[float, str] | None = None
        # bounds each publish and its confirm, which pika does not (a broker that accepts
        # the connection but never answers would otherwise block this thread for good)
        self._watchdog = Watchdog(f"{name}-watchdog")

    @property
    def is_connected(self) -> bool:
        return self._conn is not None

    def publish(self, items: list[OutboxItem], deadline: float) -> Sent:
        """Publish ``items`` with confirms until ``deadline`` (monotonic)."""
        done: list[OutboxItem] = []
        failed: list[OutboxItem] = []
        error = ""
        if time.monotonic() >= deadline:
            return Sent([], [], late=list(items))
        try:
            channel = self._connect()
        except AMQP_ERRORS as exc:
            error = f"broker {describe(self.params)} unreachable: {type(exc).__name__}: {exc}"
            log.warning("runlane: %s: %s", self.name, error)
            return Sent([], list(items), error)
        for index, item in enumerate(items):
            if time.monotonic() >= deadline:
                return Sent(done, failed, error, items[index:])
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
                self.disconnect()
                if cut:
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
                    late = [it for it in later if self._queue_of(it) != name]
                    return Sent(done, failed, error, late, cut=name)
                error = queue_type_mismatch(exc, name, self._queue_type) or (
                    f"broker {describe(self.params)}: {type(exc).__name__}: {exc}"
                )
                log.warning("runlane: %s: publishing failed (%s)", self.name, error)
                failed.extend(items[index:])
                break
        return Sent(done, failed, error)

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

    def _connect(self) -> BlockingChannel:
        if self._channel is not None and self._channel.is_open:
            return self._channel
        self.disconnect()
        params = self.params
        params.blocked_connection_timeout = self._publish_timeout
        params.socket_timeout = self._publish_timeout
        params.stack_timeout = self._publish_timeout
        conn = pika.BlockingConnection(params)
        channel = conn.channel()
        channel.confirm_delivery()
        self._conn, self._channel = conn, channel
        self._declared.clear()
        self.down = None
        self.connected.set()
        log.info("runlane: %s connected to %s", self.name, describe(params))
        return channel

    def disconnect(self) -> None:
        conn, self._conn, self._channel = self._conn, None, None
        self.connected.clear()
        if conn is not None:
            try:
                conn.close()
            except AMQP_ERRORS:
                log.debug("closing a broken broker connection failed", exc_info=True)

    def serve_heartbeats(self) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            conn.process_data_events(0)
        except AMQP_ERRORS as exc:
            log.info("runlane: %s lost its broker connection (%s)", self.name, exc)
            self.disconnect()

    def stop_watchdog(self, timeout: float | None = 2.0) -> None:
        self._watchdog.stop(timeout)
