"""PgBouncer in front of a test server: Debian's ``pgbouncer`` package, started on a port,
config and directory of its own, in transaction mode, and removed afterwards (as the RabbitMQ
nodes are). Without the package a test asking for one is skipped with a one-line reason,
except under CI=true (``.ci/run`` installs it), where it fails."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import attrs
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.helpers import closed_port, poll

__all__ = ["PGBOUNCER", "PgBouncer", "require_pgbouncer", "start_pgbouncer"]

PGBOUNCER = "/usr/sbin/pgbouncer"
_READY_SECONDS = 10.0


@attrs.frozen
class PgBouncer:
    """A running PgBouncer: ``url`` reaches the server's database through it; ``admin_url``
    its console (``SHOW POOLS``, ``SHOW STATS``); ``log`` its log file."""

    url: str
    admin_url: str
    log: Path
    process: subprocess.Popen[bytes]

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def require_pgbouncer() -> None:
    """Skip the test when PgBouncer is not installed (fail under CI=true)."""
    if os.access(PGBOUNCER, os.X_OK):
        return
    reason = f"PgBouncer is not installed ({PGBOUNCER}): sudo apt-get install pgbouncer"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI must run these tests; .ci/run installs it)", pytrace=False)
    pytest.skip(reason)


@contextlib.contextmanager
def start_pgbouncer(
    database_url: str,
    *,
    pool_size: int = 10,
    max_client_conn: int = 500,
    query_wait_timeout: int = 120,
) -> Iterator[PgBouncer]:
    """PgBouncer in transaction mode in front of ``database_url``'s server (trust auth for
    its user, ``pool_size`` server connections per database and user), stopped and its
    directory removed on exit."""
    params = conninfo_to_dict(database_url)
    host = str(params.get("host") or "127.0.0.1")
    port = str(params.get("port") or 5432)
    user = str(params.get("user") or pwd.getpwuid(os.getuid()).pw_name)
    dbname = str(params.get("dbname") or user)
    listen_port = closed_port()
    base = Path(tempfile.mkdtemp(prefix="runlane-pgbouncer-"))
    (base / "users.txt").write_text(f'"{user}" ""\n')
    (base / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={host} port={port}\n"
        "[pgbouncer]\n"
        "listen_addr = 127.0.0.1\n"
        f"listen_port = {listen_port}\n"
        "unix_socket_dir =\n"
        "auth_type = trust\n"
        f"auth_file = {base / 'users.txt'}\n"
        f"admin_users = {user}\n"
        "pool_mode = transaction\n"
        f"default_pool_size = {pool_size}\n"
        "min_pool_size = 0\n"
        "reserve_pool_size = 0\n"
        f"max_client_conn = {max_client_conn}\n"
        f"query_wait_timeout = {query_wait_timeout}\n"
        f"logfile = {base / 'pgbouncer.log'}\n"
        f"pidfile = {base / 'pgbouncer.pid'}\n"
    )
    command = [PGBOUNCER, str(base / "pgbouncer.ini")]
    if os.geteuid() == 0:
        # PgBouncer refuses to run as root: it runs as the owner of the server's socket
        # directory (the embedded server's user), which may reach that socket
        owner = os.stat(host).st_uid if host.startswith("/") else 65534
        entry = pwd.getpwuid(owner)
        for path in (base, *base.iterdir()):
            os.chown(path, entry.pw_uid, entry.pw_gid)
        command[1:1] = ["-u", entry.pw_name]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = make_conninfo(database_url, host="127.0.0.1", port=str(listen_port), dbname=dbname)
    admin = make_conninfo(url, dbname="pgbouncer")
    bouncer = PgBouncer(url=url, admin_url=admin, log=base / "pgbouncer.log", process=process)
    try:
        _wait_ready(bouncer)
        yield bouncer
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        shutil.rmtree(base, ignore_errors=True)


def _accepts(bouncer: PgBouncer) -> bool:
    if bouncer.process.poll() is not None:
        raise RuntimeError(f"pgbouncer exited at start: {bouncer.log_text()[-2000:]}")
    try:
        with psycopg.connect(bouncer.url, autocommit=True, connect_timeout=2) as conn:
            conn.execute("select 1")
    except psycopg.OperationalError:
        return False
    return True


def _wait_ready(bouncer: PgBouncer) -> None:
    if not poll(lambda: _accepts(bouncer), timeout=_READY_SECONDS, interval=0.05):
        raise RuntimeError(f"pgbouncer did not accept connections: {bouncer.log_text()[-2000:]}")
