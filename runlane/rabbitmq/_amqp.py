"""AMQP plumbing shared by the publisher and the consumers: URL checks, names, topology.

Each logical queue of an environment is one durable quorum queue named
``runlane.<schema>.<environment>.<queue>``, with a delivery limit and a dead-letter exchange
(``runlane.<schema>.dead``, bound to the queue ``runlane.<schema>.dead``) for messages that
were redelivered too often (poison messages). Messages go through the default exchange, are
persistent and carry only the run's id (``message_id`` is the outbox item's id).
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any
from urllib.parse import urlsplit

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from runlane.errors import ConfigurationError

__all__ = [
    "AMQP_ERRORS",
    "check_amqp_url",
    "dead_letter_names",
    "declare_queue",
    "describe",
    "message_body",
    "parse_body",
    "queue_name",
]

log = logging.getLogger("runlane.rabbitmq")

# what a broken or refused broker connection raises in pika's blocking API
AMQP_ERRORS: tuple[type[BaseException], ...] = (
    pika.exceptions.AMQPError,
    OSError,
    ValueError,  # pika raises it for operations on a closed connection in some versions
)


def check_amqp_url(url: object) -> pika.URLParameters:
    """The parsed ``amqp://`` / ``amqps://`` URL, or :class:`ConfigurationError` saying what
    is wrong (the URL is never repeated: it may hold a password)."""
    hint = "pass amqp://user:password@host:5672/vhost (or amqps:// for TLS)"
    if not isinstance(url, str) or not url.strip():
        raise ConfigurationError(f"rabbitmq_lane needs an amqp_url: {hint}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ConfigurationError(
            f"amqp_url is not a valid URL (not repeated here: it may hold a password): {hint}"
        ) from None
    if parts.scheme not in ("amqp", "amqps"):
        raise ConfigurationError(
            f"amqp_url must start with amqp:// or amqps://, got {parts.scheme or 'no'} scheme: "
            f"{hint}"
        )
    if not parts.hostname:
        raise ConfigurationError(f"amqp_url names no host: {hint}")
    try:
        params = pika.URLParameters(url)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(
            f"amqp_url has an invalid option ({type(exc).__name__}): {hint}"
        ) from None
    if port is not None and not 0 < port < 65536:
        raise ConfigurationError(f"amqp_url's port {port} is out of range")
    return params


def describe(params: pika.URLParameters) -> str:
    """``host:port`` of the broker, for messages (never the credentials)."""
    return f"{params.host}:{params.port}"


def queue_name(schema: str, environment: str, queue: str) -> str:
    return f"runlane.{schema}.{environment}.{queue}"


def dead_letter_names(schema: str) -> str:
    """The dead-letter exchange and queue of a schema (one name for both)."""
    return f"runlane.{schema}.dead"


def declare_queue(channel: BlockingChannel, schema: str, name: str, delivery_limit: int) -> None:
    """Declare the dead-letter exchange and queue, and the durable quorum queue ``name``
    (idempotent: every publisher and consumer declares what it uses)."""
    dead = dead_letter_names(schema)
    channel.exchange_declare(exchange=dead, exchange_type="fanout", durable=True)
    channel.queue_declare(queue=dead, durable=True, arguments={"x-queue-type": "quorum"})
    channel.queue_bind(queue=dead, exchange=dead)
    channel.queue_declare(
        queue=name,
        durable=True,
        arguments={
            "x-queue-type": "quorum",
            "x-delivery-limit": delivery_limit,
            "x-dead-letter-exchange": dead,
        },
    )


def message_body(run_id: uuid.UUID, environment: str) -> bytes:
    return json.dumps({"run_id": str(run_id), "environment": environment}).encode()


def parse_body(body: bytes) -> uuid.UUID | None:
    """The run id a message names, or None when the body is not one of ours."""
    try:
        data: Any = json.loads(body)
        return uuid.UUID(str(data["run_id"]))
    except (ValueError, TypeError, KeyError):
        return None
