"""AMQP plumbing shared by the publisher and the consumers: URL checks, names, topology.

Each logical queue of an environment is one durable queue named
``runlane.<schema>.<environment>.<queue>`` (see :func:`queue_name` for the escaping that
keeps distinct pairs apart), of the lane's ``queue_type``: a quorum queue (the default:
replicated, with a delivery limit) or a classic one (one node, delivered before its disk
write), with a dead-letter exchange (``runlane.<schema>.dead``, bound to the queue
``runlane.<schema>.dead``) for messages that were redelivered too often (poison messages).
Messages go through the default exchange, are persistent and carry only the run's id
(``message_id`` is the outbox item's id).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel
from pika.adapters.utils.connection_workflow import AMQPConnectorException

from runlane.errors import ConfigurationError

__all__ = [
    "AMQP_ERRORS",
    "MAX_QUEUE_NAME_BYTES",
    "QUEUE_TYPES",
    "Watchdog",
    "check_amqp_url",
    "check_queue_names",
    "dead_letter_names",
    "declare_queue",
    "describe",
    "message_body",
    "name_too_long",
    "parse_body",
    "queue_name",
    "queue_type_mismatch",
    "refusal",
    "refused_for_its_type",
]

log = logging.getLogger("runlane.rabbitmq")

# what a broken or refused broker connection raises in pika's blocking API
AMQP_ERRORS: tuple[type[BaseException], ...] = (
    pika.exceptions.AMQPError,
    # a handshake that timed out (a broker that accepts TCP and never answers) is raised as
    # the connection workflow's own error, which is not an AMQPError
    AMQPConnectorException,
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


def refusal(exc: BaseException, params: pika.URLParameters) -> str | None:
    """What to tell the user when the broker answered and refused the connection for good:
    the credentials (wrong user or password) or the virtual host (missing, or the user may
    not use it). None for every other failure (a broker down or unreachable, which may
    pass). Never repeats the password."""
    where = f"the RabbitMQ broker at {describe(params)}"
    user = getattr(params.credentials, "username", None)  # PlainCredentials has one
    if isinstance(
        exc,
        pika.exceptions.ProbableAuthenticationError | pika.exceptions.AuthenticationError,
    ):
        return (
            f"{where} refused the credentials of amqp_url (user {user!r}, "
            f"{type(exc).__name__}): check the user and password in amqp_url"
        )
    if isinstance(exc, pika.exceptions.ProbableAccessDeniedError):
        return (
            f"{where} refused access to virtual host {params.virtual_host!r} for user "
            f"{user!r} ({type(exc).__name__}): create the virtual host, "
            "grant the user permissions on it (rabbitmqctl set_permissions), or fix the "
            "/vhost part of amqp_url"
        )
    return None


# AMQP queue names are short strings: at most 255 bytes of UTF-8
MAX_QUEUE_NAME_BYTES = 255


def _escape(component: str) -> str:
    """``component`` with ``%`` and ``.`` percent-escaped (``%25``, ``%2E``): it then holds
    no dot, and a name without either character is unchanged."""
    return component.replace("%", "%25").replace(".", "%2E")


def queue_name(schema: str, environment: str, queue: str) -> str:
    """The broker queue of a logical queue: ``runlane.<schema>.<environment>.<queue>``.

    The schema and the environment are percent-escaped (``%`` -> ``%25``, ``.`` -> ``%2E``),
    so the first three dots end ``runlane``, the schema and the environment: distinct
    triples never share a broker queue, and none is the dead-letter ``runlane.<schema>.dead``.
    """
    return f"runlane.{_escape(schema)}.{_escape(environment)}.{queue}"


def name_too_long(schema: str, environment: str, queue: str) -> str | None:
    """Why the broker queue of the triple cannot exist (it is longer than AMQP allows),
    or None when it can."""
    size = len(queue_name(schema, environment, queue).encode("utf-8", "surrogatepass"))
    if size <= MAX_QUEUE_NAME_BYTES:
        return None
    return (
        f"the RabbitMQ queue name for environment {_shown(environment)} and queue "
        f"{_shown(queue)} (schema {schema!r}) is {size} bytes, over AMQP's limit of "
        f"{MAX_QUEUE_NAME_BYTES} (runlane.<schema>.<environment>.<queue>, with '.' and '%' "
        "in the schema and environment written as %2E and %25): use a shorter environment "
        "or queue name"
    )


def _shown(name: str, limit: int = 60) -> str:
    """A name for a message: whole when short, else its start, end and length."""
    if len(name) <= limit:
        return repr(name)
    return f"{name[: limit // 2]!r}...{name[-limit // 4 :]!r} ({len(name)} characters)"


def check_queue_names(schema: str, environment: str, queues: Sequence[str]) -> None:
    """Raise :class:`ConfigurationError` for the first queue whose broker queue name would
    be longer than AMQP allows."""
    for queue in queues:
        problem = name_too_long(schema, environment, queue)
        if problem is not None:
            raise ConfigurationError(problem)


def dead_letter_names(schema: str) -> str:
    """The dead-letter exchange and queue of a schema (one name for both)."""
    return f"runlane.{schema}.dead"


# the broker queue types the lane can declare (``rabbitmq_lane(queue_type=...)``)
QUEUE_TYPES = ("quorum", "classic")


def declare_queue(
    channel: BlockingChannel,
    schema: str,
    name: str,
    delivery_limit: int,
    queue_type: str = "quorum",
) -> None:
    """Declare the dead-letter exchange and queue, and the durable queue ``name`` of
    ``queue_type`` (idempotent). Quorum queues get ``x-delivery-limit``. The type is always
    named, so the broker refuses a queue of the other type (:func:`queue_type_mismatch`)."""
    dead = dead_letter_names(schema)
    channel.exchange_declare(exchange=dead, exchange_type="fanout", durable=True)
    channel.queue_declare(queue=dead, durable=True, arguments={"x-queue-type": "quorum"})
    channel.queue_bind(queue=dead, exchange=dead)
    arguments: dict[str, Any] = {"x-queue-type": queue_type, "x-dead-letter-exchange": dead}
    if queue_type == "quorum":
        arguments["x-delivery-limit"] = delivery_limit
    channel.queue_declare(queue=name, durable=True, arguments=arguments)


# how queue_type_mismatch's error begins: an outbox item's last_error starting so was
# refused for the queue's type (refused_for_its_type)
_MISMATCH = "the broker already holds queue "


def queue_type_mismatch(exc: BaseException, name: str, queue_type: str) -> str | None:
    """What to do when declaring ``name`` failed because the broker holds it with another
    type or other arguments (406 PRECONDITION_FAILED, "inequivalent arg"), else None."""
    if not isinstance(exc, pika.exceptions.ChannelClosedByBroker):
        return None
    if exc.reply_code != 406 or "inequivalent arg" not in str(exc.reply_text):
        return None
    return (
        f"{_MISMATCH}{name} with other arguments than this lane declares "
        f"(queue_type={queue_type!r}; broker: {exc.reply_text}). A queue's type cannot change: "
        "give every runtime of the schema the same queue_type, or move the queue over by "
        "draining it, deleting it (`rabbitmqctl delete_queue NAME`) and letting the lane "
        "declare it again (docs/deploying.md, 'Quorum or classic queues')"
    )


def refused_for_its_type(error: str | None) -> bool:
    """Whether an outbox item's recorded error is a :func:`queue_type_mismatch`."""
    return error is not None and error.startswith(_MISMATCH)


def message_body(run_id: uuid.UUID, environment: str) -> bytes:
    return json.dumps({"run_id": str(run_id), "environment": environment}).encode()


# a body exactly as message_body writes it, with a run id as str(uuid) writes it and an
# environment of printable ASCII without a quote or a backslash (JSON reads every such string
# as it is written)
_OUR_BODY = re.compile(rb'\{"run_id": "([0-9a-f-]{36})", "environment": "[ !#-\[\]-~]*"\}')


def parse_body(body: bytes) -> uuid.UUID | None:
    """The run id a message names, or None when the body is not one of ours (a body as
    :func:`message_body` writes it is read with one match, a third of a JSON decode)."""
    ours = _OUR_BODY.fullmatch(body)
    if ours is not None:
        try:
            return uuid.UUID(ours.group(1).decode("ascii"))
        except ValueError:
            return None
    try:
        data: Any = json.loads(body)
        return uuid.UUID(str(data["run_id"]))
    except (ValueError, TypeError, KeyError, RecursionError):  # nested too deep to parse
        return None


class Watchdog:
    """Bounds a blocking broker call that pika cannot bound (a publisher confirm, a queue
    declaration on a broker that accepts the connection but never answers): when an armed
    deadline passes, it shuts the connection's socket down from its own thread, which ends
    the blocked call with a connection error in the owning thread. Shutting a socket down
    touches no pika state, so it is safe across threads; the owner then drops the connection.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._deadline: float | None = None
        self._conn: Any = None
        self._stopped = False
        self.fired = 0
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def bound(self, conn: Any, seconds: float) -> Iterator[None]:
        """Within the block, the connection's socket is shut down after ``seconds``."""
        with self._lock:
            if self._thread is None and not self._stopped:  # started on first use
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._conn, self._deadline = conn, time.monotonic() + seconds
            self._wake.notify()
        try:
            yield
        finally:
            with self._lock:
                self._conn, self._deadline = None, None

    def stop(self, timeout: float | None = 2.0) -> None:
        """Stop the thread, waiting at most ``timeout`` seconds for it (it only ever waits
        on its condition or shuts a socket down, so it ends at once). A call still bound
        is cut off now: its owner is closing and will not wait for it, and once the
        watchdog is gone nothing else would end it."""
        with self._lock:
            self._stopped = True
            self._wake.notify()
            thread = self._thread
            bound, self._conn, self._deadline = self._conn, None, None
        if bound is not None:
            log.debug("runlane: %s: cutting off a broker call at close", self._name)
            _shut_down(bound)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        with self._lock:
            while not self._stopped:
                deadline = self._deadline
                if deadline is None:
                    self._wake.wait()
                    continue
                left = deadline - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                conn, self._deadline = self._conn, None
                self.fired += 1
                log.warning(
                    "runlane: %s: a broker call passed its deadline; cutting it off", self._name
                )
                _shut_down(conn)


def _shut_down(conn: Any) -> None:
    """Shut the socket of a pika BlockingConnection down (it has no public handle on it)."""
    sock = getattr(getattr(getattr(conn, "_impl", None), "_transport", None), "_sock", None)
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        log.debug("shutting a broker socket down failed", exc_info=True)
