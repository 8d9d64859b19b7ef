"""``runlane --log-format json worker APP``: every line the process writes (stdout and stderr)
is one JSON object, and each event is logged once, through start, runs, a failure, SIGTERM
and exit, and through a second signal's forced exit."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runlane import RetryPolicy, RunContext, RunStatus, task
from runlane import queue as runlane_queue
from runlane.cli import EXIT_FORCED, main
from tests.conftest import RunlaneFactory

APP = textwrap.dedent(
    """
    import os
    import threading
    from runlane import RetryPolicy, create_runlane, queue, task
    from runlane.postgres import postgres_polling_lane

    @task(id="json.ok")
    def ok(payload, context):
        return payload

    @task(id="json.bad", retry=RetryPolicy(max_attempts=1))
    def bad(payload, context):
        raise ValueError("no good")

    @task(id="json.stuck")
    def stuck(payload, context):
        threading.Event().wait(60)  # ignores every stop request

    runlane = create_runlane(
        lane=postgres_polling_lane(
            connection_string=os.environ["APP_DATABASE_URL"], schema=os.environ["APP_SCHEMA"]
        ),
        queues=[queue("default", default=True)],
        tasks=[ok, bad, stuck],
    )
    """
)


@task(id="json.ok")
def ok(payload: Any, context: RunContext) -> Any:
    return payload


@task(id="json.bad", retry=RetryPolicy(max_attempts=1))
def bad(payload: Any, context: RunContext) -> None:
    raise ValueError("no good")


@task(id="json.stuck")
def stuck(payload: Any, context: RunContext) -> None:
    raise AssertionError("runs in the worker process only")


COMMAND = [sys.executable, "-m", "runlane.cli", "--log-format", "json"]


class Worker:
    """``runlane --log-format json worker jsonapp:runlane`` with both streams read line by
    line in threads; ``lines`` keeps every line of either stream, in order of arrival."""

    def __init__(self, directory: Path, database_url: str, schema: str) -> None:
        (directory / "jsonapp.py").write_text(APP)
        env = {**os.environ, "APP_DATABASE_URL": database_url, "APP_SCHEMA": schema}
        self.proc = subprocess.Popen(
            [*COMMAND, "worker", "jsonapp:runlane", "--concurrency", "2"],
            cwd=directory,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[tuple[str, str]] = []
        self._arrived: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self._readers = [
            threading.Thread(target=self._read, args=(name, stream), daemon=True)
            for name, stream in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr))
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, name: str, stream: Any) -> None:
        for line in stream:
            self._arrived.put((name, line))

    def wait_for(self, needle: str, timeout: float = 30) -> dict[str, Any]:
        """The first record whose message contains ``needle``, read as it arrives."""
        deadline = time.monotonic() + timeout
        for _, line in self.lines:
            record = json.loads(line)
            if needle in record["message"]:
                return record  # type: ignore[no-any-return]
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no line with {needle!r} in {self.lines}"
            try:
                stream, line = self._arrived.get(timeout=remaining)
            except queue.Empty:
                continue
            self.lines.append((stream, line))
            record = json.loads(line)
            if needle in record["message"]:
                return record  # type: ignore[no-any-return]

    def finish(self, timeout: float = 60) -> tuple[int, list[dict[str, Any]]]:
        """Wait for the exit; every line of both streams parsed as one JSON object each."""
        code = self.proc.wait(timeout)
        for reader in self._readers:
            reader.join(10)
        while True:
            try:
                self.lines.append(self._arrived.get_nowait())
            except queue.Empty:
                break
        records = []
        for stream, line in self.lines:
            assert line.endswith("\n"), (stream, line)
            record = json.loads(line)  # fails the test on any line that is not JSON
            assert isinstance(record, dict), (stream, line)
            assert {"time", "level", "logger", "message"} <= record.keys(), record
            records.append(record)
        return code, records

    def kill(self) -> None:
        """Kill the process if it still runs; close both pipes once their readers ended."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for reader in self._readers:
            reader.join(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def worker(tmp_path: Path, database_url: str, schema: str) -> Iterator[Worker]:
    started = Worker(tmp_path, database_url, schema)
    try:
        yield started
    finally:
        started.kill()


@pytest.fixture
def producer(make_runlane: RunlaneFactory) -> Any:
    return make_runlane(queues=[runlane_queue("default", default=True)], tasks=[ok, bad, stuck])


def _once(records: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    found = [r for r in records if all(r.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (match, found)
    return found[0]


def test_every_line_is_json_and_each_event_is_logged_once(worker: Worker, producer: Any) -> None:
    start = worker.wait_for("running 2 slots")
    assert (start["logger"], start["level"], start["concurrency"]) == ("runlane.cli", "INFO", 2)

    good = producer.trigger(ok, {"n": 1})
    failing = producer.trigger(bad, None)
    assert producer.wait_for_run(good.id, timeout=30).status is RunStatus.COMPLETED
    assert producer.wait_for_run(failing.id, timeout=30).status is RunStatus.FAILED
    worker.wait_for(f"run {failing.id} failed")

    worker.proc.send_signal(signal.SIGTERM)
    code, records = worker.finish()
    assert code == 0

    assert all(stream == "stderr" for stream, _ in worker.lines)  # nothing on stdout
    # no record is written twice, and each event is one record
    repeated = Counter(json.dumps(r, sort_keys=True) for r in records)
    assert [line for line, n in repeated.items() if n > 1] == []
    _once(records, logger="runlane.cli", worker=start["worker"], concurrency=2)
    for run, outcome in ((good, "completed"), (failing, "failed")):
        # two records per run: its start, and its end
        about = [r for r in records if r.get("run_id") == str(run.id)]
        assert len(about) == 2, about
        assert about[0]["message"].startswith(f"run {run.id} started")
        assert about[1]["outcome"] == outcome
    failure = _once(records, run_id=str(failing.id), outcome="failed")
    assert failure["level"] == "ERROR"
    assert "ValueError: no good" in failure["message"] + failure.get("exception", "")
    _once(records, logger="runlane.cli", signal="SIGTERM")
    stopped = _once(records, logger="runlane.cli", exit_code=0)
    assert stopped["message"] == f"{start['worker']} stopped"
    assert records[-1] == stopped


def test_a_second_signal_exits_3_with_one_json_line(worker: Worker, producer: Any) -> None:
    worker.wait_for("running 2 slots")
    held = producer.trigger(stuck, None)
    worker.wait_for(f"run {held.id} started")

    worker.proc.send_signal(signal.SIGTERM)
    worker.wait_for("SIGTERM received")
    worker.proc.send_signal(signal.SIGTERM)
    code, records = worker.finish()
    assert code == EXIT_FORCED

    forced = [r for r in records if "second signal: exiting now" in r["message"]]
    assert len(forced) == 1, records
    assert (forced[0]["level"], forced[0]["exit_code"]) == ("WARNING", EXIT_FORCED)
    assert records[-1] == forced[0]


def test_an_error_is_one_json_line(tmp_path: Path) -> None:
    """A command that fails (here: an APP whose import raises) writes its error as JSON."""
    (tmp_path / "broken.py").write_text("raise RuntimeError('config missing')\n")
    result = subprocess.run(
        [*COMMAND, "drain", "broken:x"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    record = json.loads(line)
    assert (record["level"], record["exit_code"]) == ("ERROR", 2)
    assert "importing 'broken' failed: RuntimeError: config missing" in record["message"]
    assert "exception" not in record  # the traceback only with --traceback


def test_a_later_command_in_the_same_process_writes_plain_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """After a command that ran with --log-format json, the next command of the same process
    (main() called again, as tests and embedding scripts do) writes its lines as plain text
    unless it asks for JSON too."""
    (tmp_path / "broken_app.py").write_text("raise RuntimeError('config missing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["drain", "broken_app:x", "--log-format", "json"]) == 2
    capsys.readouterr()  # its own lines (test_an_error_is_one_json_line checks them)
    assert main(["status", "broken_app:x"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("runlane: error: importing 'broken_app' failed: RuntimeError"), line
