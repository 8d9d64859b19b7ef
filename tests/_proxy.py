"""A loopback TCP proxy between runlane and the test database, for outages on demand.

``down()`` refuses new connections and cuts the open ones (a database that is down);
``up()`` forwards again. Real sockets, a real server behind: nothing is mocked.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Iterator

from psycopg.conninfo import conninfo_to_dict, make_conninfo

__all__ = ["TcpProxy", "tcp_proxy"]


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, port: int = 0) -> None:
        """A proxy to the target on 127.0.0.1, on ``port`` (0: any free port); down until
        ``up()``."""
        # a host starting with "/" is libpq's unix-socket directory
        self._target = (target_host, target_port)
        self._lock = threading.Lock()
        self._up = False
        self._stalled = threading.Event()  # connections stay open, nothing is forwarded
        self._stop = threading.Event()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._server = socket.create_server(("127.0.0.1", port))
        self._server.settimeout(0.05)
        self.port = int(self._server.getsockname()[1])
        self._thread = threading.Thread(target=self._accept, name="test-proxy", daemon=True)
        self._thread.start()

    def url_for(self, database_url: str) -> str:
        """``database_url`` with its host and port replaced by the proxy's."""
        params = conninfo_to_dict(database_url)
        params.update(host="127.0.0.1", port=str(self.port))
        params.pop("hostaddr", None)
        return make_conninfo("", **params)

    def up(self) -> None:
        with self._lock:
            self._up = True

    def stall(self) -> None:
        """Keep every connection open but forward nothing more (a peer that never answers)."""
        self._stalled.set()

    def unstall(self) -> None:
        self._stalled.clear()

    def unanswered(self) -> int:
        """Connections with bytes the stalled proxy holds back (a request, or the answer
        to one that went through just before the stall): a statement or a connect waiting
        on a server that does not answer."""
        with self._lock:
            pairs = list(self._pairs)
        held = 0
        for pair in pairs:
            try:
                readable, _, _ = select.select(list(pair), [], [], 0)
            except (OSError, ValueError):  # closed meanwhile
                continue
            held += bool(readable)
        return held

    def refuse_new(self) -> None:
        """Refuse new connections and keep the open ones (a server out of connection slots
        for newcomers)."""
        with self._lock:
            self._up = False

    def down(self) -> None:
        """Refuse new connections and cut every open one."""
        with self._lock:
            self._up = False
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def close(self) -> None:
        self._stop.set()
        self.down()
        self._thread.join(5)
        self._server.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                up = self._up
            if not up:
                client.close()  # the database is "down": the connection is refused at once
                continue
            try:
                upstream = self._connect_upstream()
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, upstream))
            threading.Thread(
                target=self._pump, args=(client, upstream), name="test-proxy-pump", daemon=True
            ).start()

    def _connect_upstream(self) -> socket.socket:
        host, port = self._target
        if host.startswith("/"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(f"{host}/.s.PGSQL.{port}")
            return sock
        return socket.create_connection((host, port), timeout=5)

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while not self._stop.is_set():
                if self._stalled.is_set():
                    self._stop.wait(0.05)
                    continue
                readable, _, _ = select.select([a, b], [], [], 0.1)
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    peers[sock].sendall(data)
        except (OSError, ValueError):
            return
        finally:
            for sock in (a, b):
                with contextlib.suppress(OSError):
                    sock.close()


@contextlib.contextmanager
def tcp_proxy(database_url: str) -> Iterator[TcpProxy]:
    params = conninfo_to_dict(database_url)
    host = str(params.get("host") or "127.0.0.1")
    port = int(params.get("port") or 5432)
    proxy = TcpProxy(host, port)
    try:
        yield proxy
    finally:
        proxy.close()
