"""``runlane runs list|show|retry|cancel`` and ``runlane trigger``, run in-process through
``runlane.cli.main`` against a real database: output, exit codes, and one-line errors that
write nothing."""

from __future__ import annotations

import json
import textwrap
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import pytest

from runlane import RetryPolicy, RunContext, RunStatus, queue, task
from runlane.cli import EXIT_CONFIGURATION, EXIT_FAILURE
from runlane.testing import run_until_idle
from tests.conftest import RunlaneFactory
from tests.helpers import Cli, Conn, SchemaDb, count_runs, importable_app, in_process_cli

APP = textwrap.dedent(
    """
    import os
    from datetime import timedelta
    import attrs
    from runlane import RetryPolicy, RunContext, create_runlane, queue, task
    from runlane.postgres import postgres_polling_lane

    @attrs.frozen
    class Order:
        sku: str
        quantity: int

    @task(id="cli.order", schema=Order)
    def order(payload, context: RunContext):
        context.step("reserve", lambda: {"reserved": payload.quantity})
        return "shipped"

    @task(id="cli.fails", retry=RetryPolicy(max_attempts=1), queue="slow")
    def fails(payload, context: RunContext):
        raise RuntimeError("always")

    runlane = create_runlane(
        lane=postgres_polling_lane(
            connection_string=os.environ["APP_DATABASE_URL"], schema=os.environ["APP_SCHEMA"]
        ),
        queues=[queue("default", default=True), queue("slow")],
        tasks=[order, fails],
    )
    """
)


@attrs.frozen
class Order:
    sku: str
    quantity: int


@task(id="cli.order", schema=Order)
def order(payload: Order, context: RunContext) -> str:
    context.step("reserve", lambda: {"reserved": payload.quantity})
    return "shipped"


@task(id="cli.fails", retry=RetryPolicy(max_attempts=1), queue="slow")
def fails(payload: Any, context: RunContext) -> None:
    raise RuntimeError("always")


@task(id="cli.handback", retry=RetryPolicy(max_attempts=2, initial_delay=timedelta(0)))
def hands_back_then_fails(payload: Any, context: RunContext) -> None:
    if context.attempt == 1:
        context.release()  # spends nothing of the budget
    raise RuntimeError(f"attempt {context.attempt} failed")


@pytest.fixture
def cli(
    tmp_path: Path, database_url: str, schema: str, capsys: pytest.CaptureFixture[str]
) -> Iterator[Cli]:
    """``cli(*argv)`` runs ``runlane *argv`` in-process on a fresh import of the test APP;
    returns (exit code, stdout, stderr)."""
    with importable_app(tmp_path, APP, database_url, schema):
        yield in_process_cli(capsys)


@pytest.fixture
def producer(make_runlane: RunlaneFactory) -> Any:
    return make_runlane(
        queues=[queue("default", default=True), queue("slow")],
        tasks=[order, fails, hands_back_then_fails],
    )


APP_SPEC = "cliapp:runlane"


def _one_error_line(err: str, needle: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("runlane: error: "), err
    assert needle in lines[0], err
    assert "Traceback" not in err


def test_runs_list_pages_in_json_and_as_a_table(cli: Cli, producer: Any) -> None:
    handles = [producer.trigger(order, {"sku": f"s{i}", "quantity": i}) for i in range(3)]
    failing = producer.trigger(fails, None)
    newest_first = [str(failing.id), *(str(h.id) for h in reversed(handles))]

    code, out, _ = cli("runs", "list", APP_SPEC, "--json")
    assert code == 0
    page = json.loads(out)
    assert [r["id"] for r in page["runs"]] == newest_first
    assert page["next_cursor"] is None
    first = page["runs"][0]
    assert (first["task_id"], first["queue"], first["status"]) == ("cli.fails", "slow", "queued")
    assert first["created_at"].startswith("20")
    assert "T" in first["created_at"]

    code, out, _ = cli("runs", "list", APP_SPEC, "--limit", "3", "--json")
    page = json.loads(out)
    assert [r["id"] for r in page["runs"]] == newest_first[:3]
    code, out, _ = cli("runs", "list", APP_SPEC, "--cursor", page["next_cursor"], "--json")
    assert [r["id"] for r in json.loads(out)["runs"]] == newest_first[3:]

    code, out, _ = cli("runs", "list", APP_SPEC, "--limit", "2")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["RUN", "ID", "TASK", "QUEUE", "STATUS", "ATTEMPTS", "CREATED"]
    assert lines[1].split()[:5] == [str(failing.id), "cli.fails", "slow", "queued", "0/1"]
    assert len(lines) == 4
    assert lines[3].startswith("more: --cursor r1.")

    code, out, _ = cli("runs", "list", APP_SPEC, "--task", "cli.order", "--status", "queued")
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()[1:]] == newest_first[1:]
    code, out, _ = cli("runs", "list", APP_SPEC, "--queue", "nope")
    assert (code, out) == (0, "no runs\n")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--limit", "0"], "limit must be an integer from 1 to 1000, got 0"),
        (["--limit", "5000"], "limit must be an integer from 1 to 1000, got 5000"),
        (["--status", "done"], "status 'done' is not a run status; use one of: queued"),
        (["--cursor", "abc"], "cursor 'abc' is not a runs cursor"),
    ],
)
def test_runs_list_bad_input_is_one_line_and_exit_2(
    cli: Cli, db: Conn, schema: str, argv: list[str], needle: str
) -> None:
    before = count_runs(db, schema)
    code, out, err = cli("runs", "list", APP_SPEC, *argv)
    assert code == EXIT_CONFIGURATION
    assert out == ""
    _one_error_line(err, needle)
    assert count_runs(db, schema) == before


def test_runs_show_prints_the_run_its_attempts_and_steps(cli: Cli, producer: Any) -> None:
    handle = producer.trigger(order, {"sku": "a", "quantity": 2})
    failing = producer.trigger(fails, None)
    producer.drain()

    code, out, _ = cli("runs", "show", APP_SPEC, str(handle.id))
    assert code == 0
    assert f"run              {handle.id}" in out
    assert "status           completed" in out
    assert 'output           "shipped"' in out
    assert "#1   completed" in out
    assert "reserve  (attempt 1, " in out
    assert '{"reserved": 2}' in out

    code, out, _ = cli("runs", "show", APP_SPEC, str(failing.id), "--json")
    assert code == 0
    shown = json.loads(out)
    assert shown["run"]["id"] == str(failing.id)
    assert shown["run"]["status"] == "failed"
    assert shown["run"]["error"]["message"] == "always"
    (attempt,) = shown["attempts"]
    assert (attempt["number"], attempt["outcome"]) == (1, "failed")
    assert attempt["error"]["type"].endswith("RuntimeError")
    assert shown["steps"] == []

    code, _, err = cli("runs", "show", APP_SPEC, str(uuid.uuid4()))
    assert code == EXIT_FAILURE
    _one_error_line(err, "no run")
    code, _, err = cli("runs", "show", APP_SPEC, "not-a-uuid")
    assert code == EXIT_FAILURE
    _one_error_line(err, "'not-a-uuid' is not a run id")


def test_runs_retry_and_cancel(cli: Cli, producer: Any, db: Conn, schema: str) -> None:
    failing = producer.trigger(fails, None)
    producer.drain()
    assert producer.get_run(failing.id).status is RunStatus.FAILED

    code, out, _ = cli("runs", "retry", APP_SPEC, str(failing.id))
    assert code == 0
    assert out == (
        f"run {failing.id} is queued again with a fresh budget: attempts 0/1 "
        "(its next attempt is numbered #2)\n"
    )
    assert producer.get_run(failing.id).status is RunStatus.QUEUED

    # a queued run cannot be retried: one line, exit 1, the row untouched
    dbx = SchemaDb(db, schema)
    row = dbx.one("select * from {schema}.runs where id = %s", failing.id)
    code, out, err = cli("runs", "retry", APP_SPEC, str(failing.id))
    assert (code, out) == (EXIT_FAILURE, "")
    _one_error_line(err, "cannot retry run")
    assert "it is queued" in err
    assert dbx.one("select * from {schema}.runs where id = %s", failing.id) == row

    code, out, _ = cli("runs", "cancel", APP_SPEC, str(failing.id))
    assert code == 0
    assert out == f"run {failing.id}: queued -> cancelled\n"
    code, out, _ = cli("runs", "cancel", APP_SPEC, str(failing.id))
    assert out == f"run {failing.id} is cancelled: nothing to cancel\n"
    code, out, _ = cli("runs", "retry", APP_SPEC, str(failing.id))
    assert code == 0
    producer.drain()
    history = producer.get_run_history(failing.id)
    assert [(a.number, a.outcome) for a in history.attempts] == [(1, "failed"), (2, "failed")]

    code, _, err = cli("runs", "cancel", APP_SPEC, str(uuid.uuid4()))
    assert code == EXIT_FAILURE
    _one_error_line(err, "no run")


def test_trigger_validates_like_trigger_and_writes(
    cli: Cli, producer: Any, db: Conn, schema: str
) -> None:
    code, out, _ = cli("trigger", APP_SPEC, "cli.order", "--payload", '{"sku": "x", "quantity": 3}')
    assert code == 0
    run_id = uuid.UUID(out.split()[1])
    assert out.endswith("triggered (cli.order on queue default)\n")
    snapshot = producer.get_run(run_id)
    assert snapshot.payload == {"sku": "x", "quantity": 3}
    assert snapshot.due_at <= snapshot.created_at + timedelta(seconds=1)

    code, out, _ = cli(
        "trigger",
        APP_SPEC,
        "cli.fails",
        "--payload",
        "null",
        "--delay",
        "90",
        "--queue",
        "default",
    )
    assert code == 0
    delayed = producer.get_run(uuid.UUID(out.split()[1]))
    assert delayed.queue == "default"
    assert delayed.due_at - delayed.created_at >= timedelta(seconds=89)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["cli.order", "--payload", "{sku: 1}"], "--payload is not valid JSON: Expecting"),
        (["cli.order", "--payload", ""], "--payload is not valid JSON"),
        (["cli.order", "--payload", '{"sku": "x"}'], "required field missing @ payload.quantity"),
        (
            ["cli.order", "--payload", '{"sku": "x", "quantity": "3"}'],
            "invalid payload for task 'cli.order'",
        ),
        (
            ["cli.order", "--payload", "[1, 2]"],
            "expected an object with the fields of Order, got a list",
        ),
        (
            ["cli.order", "--payload", "null"],
            "expected an object with the fields of Order, got null",
        ),
        (["no.such", "--payload", "{}"], "task 'no.such' is not registered"),
        (
            ["cli.order", "--payload", '{"sku": "x", "quantity": 1}', "--delay", "-5"],
            "delay must not be negative, got -5 seconds",
        ),
        (
            ["cli.order", "--payload", '{"sku": "x", "quantity": 1}', "--queue", "nope"],
            "queue 'nope' is not registered",
        ),
    ],
)
def test_trigger_bad_input_is_one_line_exit_2_and_writes_nothing(
    cli: Cli, db: Conn, schema: str, argv: list[str], needle: str
) -> None:
    before = count_runs(db, schema)
    code, out, err = cli("trigger", APP_SPEC, *argv)
    assert code == EXIT_CONFIGURATION
    assert out == ""
    _one_error_line(err, needle)
    assert count_runs(db, schema) == before


def test_one_attempt_count_in_list_show_retry_and_get_run(cli: Cli, producer: Any) -> None:
    """A hand-back spends nothing and a retry grants a fresh budget: runs list, runs show,
    runs retry and get_run all count attempts spent against max_attempts (attempt numbers
    keep growing beside them)."""
    handle = producer.trigger(hands_back_then_fails, None)
    run_until_idle(producer)  # #1 released, #2 failed (retried), #3 failed for good
    run = producer.get_run(handle.id)
    assert (run.status, run.attempt, run.attempts_spent, run.max_attempts) == (
        RunStatus.FAILED,
        3,
        2,
        2,
    )
    code, out, _ = cli("runs", "list", APP_SPEC)
    assert code == 0
    header, row = out.splitlines()
    assert "ATTEMPTS" in header
    assert row.split()[4] == "2/2"

    code, out, _ = cli("runs", "show", APP_SPEC, str(handle.id))
    assert code == 0
    assert "attempts         2 of 2 spent (0 left); latest #3; 1 handed back unspent\n" in out
    (error_line,) = [line for line in out.splitlines() if line.startswith("error ")]
    assert error_line.endswith("RuntimeError: attempt 3 failed"), error_line
    # the traceback, indented under its heading, down to the raise in the handler
    traceback = out.split("\ntraceback\n", 1)[1].split("\nattempts\n", 1)[0].splitlines()
    assert traceback[0] == "  Traceback (most recent call last):"
    assert 'raise RuntimeError(f"attempt {context.attempt} failed")' in "\n".join(traceback)
    assert traceback[-1] == "  RuntimeError: attempt 3 failed"
    assert "#1   released" in out
    assert "#2   retrying" in out

    code, out, _ = cli("runs", "retry", APP_SPEC, str(handle.id))
    assert code == 0
    assert out == (
        f"run {handle.id} is queued again with a fresh budget: attempts 0/2 "
        "(its next attempt is numbered #4)\n"
    )
    run = producer.get_run(handle.id)
    assert (run.attempt, run.attempts_spent) == (3, 0)
    code, out, _ = cli("runs", "list", APP_SPEC)
    assert out.splitlines()[1].split()[4] == "0/2"
    code, out, _ = cli("runs", "show", APP_SPEC, str(handle.id))
    assert "attempts         0 of 2 spent (2 left); latest #3; 1 handed back unspent\n" in out
    assert "\ntraceback\n" not in out  # the retry cleared the error
