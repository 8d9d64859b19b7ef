"""One RabbitMQ node for every xdist worker of a whole-suite run, booted by the controller.

Each worker used to boot a node of its own for ``rabbitmq_url`` (about 5 CPU-seconds a
boot, on the 2 cores the suite shares); tests on it name their queues after their schema,
which is unique across workers, so one node serves them all. The controller makes the node
(directory, ports, user) when it configures the first worker, hands every worker its URL and
directory through ``workerinput``, and boots it on a thread of its own while the workers
start; a worker's ``rabbitmq_url`` waits for the boot's outcome, a file in the directory.
The nodes tests stop, kill or cluster (``rabbitmq_node``, ``rabbitmq_cluster``) stay each
worker's own. A run without workers (``-n 0``, a selection) boots its node as before.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from runlane.cli._rabbit_host import RABBITMQ_START_TIMEOUT
from runlane.cli._rabbit_nodes import RabbitNode, create_rabbitmq_node
from tests.helpers import poll

__all__ = ["WORKERINPUT_KEY", "SharedBroker", "wait_for_shared_broker"]

WORKERINPUT_KEY = "runlane_shared_rabbitmq"  # (amqp_url, node directory)
_BOOTED = "booted"
_FAILED = "boot-failed"


class SharedBroker:
    """The controller's node: made on first use, booted on a named thread, cleaned up by
    ``close()`` (and at exit, by the node itself)."""

    def __init__(self) -> None:
        self._node: RabbitNode | None = None
        self._boot: threading.Thread | None = None

    def for_workers(self) -> tuple[str, str]:
        """The node's AMQP URL and directory, booting it the first time."""
        if self._node is None:
            self._node = create_rabbitmq_node()
            self._boot = threading.Thread(
                target=self._start, args=(self._node,), name="runlane-tests-shared-rabbitmq"
            )
            self._boot.start()
        return self._node.amqp_url, str(self._node.base)

    @staticmethod
    def _start(node: RabbitNode) -> None:
        try:
            node.start()
        except BaseException as exc:  # told to the workers, whose broker tests then fail
            (node.base / _FAILED).write_text(f"{type(exc).__name__}: {exc}")
        else:
            (node.base / _BOOTED).write_text("")

    def close(self) -> None:
        if self._boot is not None:
            self._boot.join(RABBITMQ_START_TIMEOUT * 2)
        if self._node is not None:
            self._node.cleanup()


def wait_for_shared_broker(workerinput: dict[str, Any]) -> str | None:
    """In a worker: the shared node's URL once the controller's boot of it succeeded; None
    when there is no shared node. Raises RuntimeError saying why when the boot failed or
    took longer than a boot may."""
    shared = workerinput.get(WORKERINPUT_KEY)
    if shared is None:
        return None
    url, directory = shared
    base = Path(directory)

    def booted() -> bool:  # the controller's files: another process's word, polled
        if (base / _BOOTED).exists():
            return True
        if (base / _FAILED).exists():
            raise RuntimeError(
                f"the shared RabbitMQ node failed to boot: {(base / _FAILED).read_text()}"
            )
        return False

    if not poll(booted, timeout=RABBITMQ_START_TIMEOUT * 2, interval=0.05):
        raise RuntimeError(f"the shared RabbitMQ node in {base} did not boot in time")
    return str(url)
