"""A connection's socket, shut down from another thread: ends a wait on it (a notifies()
wait, a statement a stalled server never answers) at once."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import psycopg

__all__ = ["dup_socket", "shut_down", "shut_down_socket"]

log = logging.getLogger("runlane.postgres")


def shut_down(conn: psycopg.Connection[Any]) -> None:
    """End a wait on ``conn`` in another thread now (a notifies() wait, a statement that a
    stalled server never answers): shut its socket down under it. The connection is then
    broken; its owner closes it. Nothing happens when it is already closed."""
    sock = dup_socket(conn)
    if sock is not None:
        with sock:
            shut_down_socket(sock)


def dup_socket(conn: psycopg.Connection[Any]) -> socket.socket | None:
    """The connection's socket through a descriptor of its own (None when it is closed):
    it keeps the socket open even if the owner closes the connection meanwhile, so a
    shutdown through it never reaches another socket that reused the number."""
    try:
        fd = os.dup(conn.fileno())
    except (OSError, psycopg.Error):
        return None
    try:
        return socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        return None


def shut_down_socket(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        log.debug("shutting a connection's socket down failed", exc_info=True)
