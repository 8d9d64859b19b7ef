"""The command line's rough edges: help without a command, the database URL's sources,
drain's counts and progress, a closed pipe, a bad log format, maintenance beside a worker."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runlane import RunStatus
from runlane.cli import DATABASE_URL_HELP, EXIT_PIPE, main
from tests.helpers import SchemaDb, fresh_app_runtime, importable_app, job_app, wait_until

APP = job_app("polish.job")


@pytest.fixture
def app(tmp_path: Path, database_url: str, schema: str) -> Iterator[dict[str, str]]:
    """``cliapp:runlane`` importable here (fresh for each ``run``) and in subprocesses."""
    with importable_app(tmp_path, APP, database_url, schema) as env:
        yield env


def run(*argv: str) -> int:
    sys.modules.pop("cliapp", None)
    return main(list(argv))


def test_runlane_alone_prints_help_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: runlane")
    for command in ("migrate", "worker", "maintenance", "drain", "status", "demo"):
        assert command in out


def test_every_help_says_where_the_database_url_comes_from(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def help_of(*argv: str) -> str:
        with pytest.raises(SystemExit) as exited:
            main([*argv, "--help"])
        assert exited.value.code == 0
        return " ".join(capsys.readouterr().out.split())

    said = " ".join(DATABASE_URL_HELP[:-1].split())
    assert "$RUNLANE_DATABASE_URL, then $DATABASE_URL" in said
    assert said in help_of("migrate")
    assert said in help_of("demo")
    assert "--database-url, then $RUNLANE_DATABASE_URL, then $DATABASE_URL" in help_of()


def test_the_database_url_falls_back_to_database_url(
    database_url: str, fresh_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RUNLANE_DATABASE_URL", raising=False)
    monkeypatch.setenv("DATABASE_URL", database_url)
    assert main(["migrate", "--schema", fresh_schema]) == 0
    monkeypatch.setenv("RUNLANE_DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    # RUNLANE_DATABASE_URL comes first: that server does not exist
    assert main(["migrate", "--schema", fresh_schema]) == 1


def test_an_unknown_log_format_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["--log-format", "xml", "worker", "m:a"],
        ["worker", "m:a", "--log-format", "xml"],
    ):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "argument --log-format: invalid choice: 'xml'" in err
        assert "Traceback" not in err


def test_drain_reports_counts_and_progress_on_a_terminal(
    app: dict[str, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = fresh_app_runtime()
    runtime.trigger_many("polish.job", ["ok", "ok", "retry", "fatal"])
    runtime.close()
    assert run("drain", "cliapp:runlane") == 0
    out = capsys.readouterr().out
    assert "Executed 4 runs: 2 completed, 1 failed, 1 retried" in out

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    runtime = fresh_app_runtime()
    runtime.trigger("polish.job", "ok")
    runtime.close()
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert run("drain", "cliapp:runlane") == 0
    assert "\rrunlane: drain: 1 run (1 completed, 0 failed, 0 retried)\n" in terminal.getvalue()


@pytest.mark.parametrize("watch", [False, True])
def test_no_traceback_on_a_closed_pipe(app: dict[str, str], watch: bool) -> None:
    argv = [sys.executable, "-m", "runlane.cli", "status", "cliapp:runlane"]
    if watch:
        argv += ["--watch", "0.05"]
    with subprocess.Popen(
        argv, env=app, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        if watch:
            proc.stdout.readline()  # `| head -1`
        proc.stdout.close()  # before the first write when not watching (imports take longer)
        assert proc.wait(timeout=30) == EXIT_PIPE
        assert proc.stderr is not None
        err = proc.stderr.read()
    assert "Traceback" not in err
    assert "BrokenPipe" not in err
    assert "Exception ignored" not in err


def test_worker_with_maintenance_delivers_due_retries(
    app: dict[str, str], db: Any, schema: str
) -> None:
    runtime = fresh_app_runtime()
    handle = runtime.trigger("polish.job", "ok", delay=3600)
    SchemaDb(db, schema).run(
        "update {schema}.runs set status = 'retrying', due_at = now() - interval '1 second' "
        "where id = %s",
        handle.id,
    )
    argv = [sys.executable, "-m", "runlane.cli", "worker", "cliapp:runlane", "--with-maintenance"]
    with subprocess.Popen(
        argv, env=app, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            wait_until(
                lambda: runtime.get_run(handle.id).status is RunStatus.COMPLETED,
                timeout=30,
                what="the retry delivered by the worker's maintenance",
            )
            bands = SchemaDb(db, schema).one(
                "select count(*) from {schema}.maintenance_leases where expires_at > now()"
            )
            assert bands[0] > 0
        finally:
            runtime.close()
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert proc.stderr is not None
        err = proc.stderr.read()
    assert "with maintenance" in err
    assert "Traceback" not in err
