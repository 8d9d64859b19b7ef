"""Hostile input that used to escape as a raw Python error, a misleading one or a
10,000-character message (issue 26, "Unclear"): each is now a runlane error that says what
to do, with nothing written. Against a real Postgres; the CLI runs in-process through
``runlane.cli.main`` as in test_cli_runs.py. docs/bad-input.md lists the same cases."""

from __future__ import annotations

import base64
import textwrap
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, tzinfo
from pathlib import Path
from typing import Any

import psycopg
import pytest

from runlane import (
    ConfigurationError,
    PayloadValidationError,
    RunContext,
    Runlane,
    RunlaneError,
    StorageUnavailable,
    TaskNotFound,
    create_runlane,
    queue,
    task,
)
from runlane.cli import EXIT_CONFIGURATION
from runlane.postgres import postgres_grant_sql, postgres_polling_lane
from tests.conftest import RunlaneFactory
from tests.helpers import Cli, Conn, count_runs, importable_app, in_process_cli, q


@task(id="hostile.free")
def free(payload: Any, context: RunContext) -> Any:
    return payload


APP = textwrap.dedent(
    """
    import os
    from runlane import RunContext, create_runlane, task
    from runlane.postgres import postgres_polling_lane

    @task(id="hostile.free")
    def free(payload, context: RunContext):
        return payload

    runlane = create_runlane(
        lane=postgres_polling_lane(
            connection_string=os.environ["APP_DATABASE_URL"],
            schema=os.environ["APP_SCHEMA"],
        ),
        tasks=[free],
    )
    """
)
APP_SPEC = "cliapp:runlane"

# no message repeats a caller's value whole: a bound well above any message's own words
MESSAGE_BOUND = 700


@pytest.fixture
def rl(make_runlane: RunlaneFactory) -> Runlane:
    return make_runlane(tasks=[free])


@pytest.fixture
def cli(
    tmp_path: Path, database_url: str, schema: str, capsys: pytest.CaptureFixture[str]
) -> Iterator[Cli]:
    """``cli(*argv)`` runs ``runlane *argv`` in-process on a fresh import of the test APP;
    returns (exit code, stdout, stderr)."""
    with importable_app(tmp_path, APP, database_url, schema):
        yield in_process_cli(capsys)


def _refused(
    db: Conn, schema: str, call: Callable[[], object], error: type[RunlaneError], needle: str
) -> str:
    """``call`` raises ``error`` naming ``needle`` in a bounded message, writing no run."""
    before = count_runs(db, schema)
    with pytest.raises(error) as raised:
        call()
    message = str(raised.value)
    assert needle in message
    assert len(message) < MESSAGE_BOUND, message
    assert count_runs(db, schema) == before
    return message


def _cli_refused(cli: Cli, db: Conn, schema: str, argv: list[str], needle: str) -> None:
    """The command exits 2 with one line on stderr naming ``needle``, writing no run."""
    before = count_runs(db, schema)
    code, out, err = cli(*argv)
    assert (code, out) == (EXIT_CONFIGURATION, "")
    assert err.startswith("runlane: error: "), err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    assert needle in err
    assert len(err) < MESSAGE_BOUND, err
    assert count_runs(db, schema) == before


# -- durations and due times --------------------------------------------------------------


@pytest.mark.parametrize(
    ("delay", "needle"),
    [
        (10**400, "delay must be at most 100 years (3155760000 seconds), got an integer of 401"),
        (-(10**400), "delay must not be negative"),
        (10**5000, "an integer of 16,610 bits"),  # repr() itself refuses it
    ],
    ids=["10**400", "-10**400", "10**5000"],
)
def test_a_huge_integer_delay_is_refused(
    rl: Runlane, db: Conn, schema: str, delay: int, needle: str
) -> None:
    _refused(db, schema, lambda: rl.trigger(free, {}, delay=delay), ConfigurationError, needle)


class _Zone(tzinfo):
    def tzname(self, dt: datetime | None) -> str:
        return "hostile"

    def dst(self, dt: datetime | None) -> timedelta:
        return timedelta(0)


class _RaisingZone(_Zone):
    def utcoffset(self, dt: datetime | None) -> timedelta:
        raise KeyError("no such zone")


class _StringZone(_Zone):
    def utcoffset(self, dt: datetime | None) -> Any:
        return "+01:00"


@pytest.mark.parametrize(
    ("zone", "needle"),
    [
        (_RaisingZone(), "run_at's tzinfo (_RaisingZone) failed to give its offset from UTC"),
        (_StringZone(), "run_at's tzinfo (_StringZone) failed to give its offset from UTC"),
    ],
)
def test_a_run_at_whose_tzinfo_fails_is_refused(
    rl: Runlane, db: Conn, schema: str, zone: tzinfo, needle: str
) -> None:
    run_at = datetime(2030, 1, 1, tzinfo=zone)
    message = _refused(
        db, schema, lambda: rl.trigger(free, {}, run_at=run_at), ConfigurationError, needle
    )
    assert "zoneinfo.ZoneInfo" in message


# -- the CLI --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        ("9" * 5_000, "--payload holds an integer of more than 4300 digits"),
        ('{"n": ' + "9" * 5_000 + "}", "send such a number as a string"),
        ("[" * 50_000 + "]" * 50_000, "--payload is nested too deeply to parse"),
    ],
)
def test_cli_trigger_refuses_a_payload_json_cannot_parse(
    cli: Cli, db: Conn, schema: str, payload: str, needle: str
) -> None:
    _cli_refused(
        cli, db, schema, ["trigger", APP_SPEC, "hostile.free", "--payload", payload], needle
    )


@pytest.mark.parametrize("spec", ["../../x:y", ".mod:app", "mod:", "mod:a..b", "a/b:c"])
def test_cli_refuses_an_app_that_is_no_module_name(
    cli: Cli, db: Conn, schema: str, spec: str
) -> None:
    _cli_refused(cli, db, schema, ["status", spec], "APP must look like module:attribute")


def _nested_cursor(depth: int) -> str:
    body = ("[" * depth + "]" * depth).encode()
    return "r1." + base64.urlsafe_b64encode(body).decode().rstrip("=")


def test_a_crafted_cursor_is_refused_in_the_api_and_the_cli(
    rl: Runlane, cli: Cli, db: Conn, schema: str
) -> None:
    cursor = _nested_cursor(100_000)
    message = _refused(
        db, schema, lambda: rl.list_runs(cursor=cursor), ConfigurationError, "not a runs cursor"
    )
    assert "a string of 266,670 characters starting 'r1.W1tb" in message
    _cli_refused(
        cli, db, schema, ["runs", "list", APP_SPEC, "--cursor", cursor], "not a runs cursor"
    )
    # the cursors runlane makes still page
    rl.trigger(free, 1)
    rl.trigger(free, 2)
    page = rl.list_runs(limit=1)
    assert page.next_cursor is not None
    assert len(rl.list_runs(limit=1, cursor=page.next_cursor).runs) == 1


# -- payloads and outputs -----------------------------------------------------------------


class _IntKeys(dict[str, Any]):
    """A dict whose items() (what the JSON encoder reads) holds a key its iteration hides."""

    def items(self) -> Any:
        return [(1, "one"), *super().items()]


class _Flipping(dict[str, Any]):
    """items() answers string keys on one call and an int key on the next."""

    calls = 0

    def items(self) -> Any:
        _Flipping.calls += 1
        return [("a", 1)] if _Flipping.calls % 2 else [(1, "a")]


class _HiddenList(list[Any]):
    """Iteration hides what the JSON encoder reads (the list's own items)."""

    def __iter__(self) -> Any:
        return iter([])


@pytest.mark.parametrize(
    "payload",
    [_IntKeys(a=1), {"nested": _IntKeys(a=1)}, [_HiddenList([{2: "two"}])]],
    ids=["top", "nested", "in-a-list-subclass"],
)
def test_a_container_subclass_cannot_smuggle_a_non_string_key(
    rl: Runlane, db: Conn, schema: str, payload: Any
) -> None:
    _refused(
        db,
        schema,
        lambda: rl.trigger(free, payload),
        PayloadValidationError,
        "object keys must be strings",
    )
    token = rl.create_wait_token()
    _refused(
        db,
        schema,
        lambda: rl.complete_wait_token(token.id, payload),
        ConfigurationError,
        "object keys must be strings",
    )
    assert rl.get_wait_token(token.id).status == "pending"


def test_what_items_gives_is_read_once_checked_and_stored(
    rl: Runlane, db: Conn, schema: str
) -> None:
    _Flipping.calls = 0
    handle = rl.trigger(free, {"x": _Flipping()})  # items() gives string keys
    assert rl.get_run(handle.id).payload == {"x": {"a": 1}}
    _refused(  # items() gives an int key: refused, not stored as {"1": "a"}
        db,
        schema,
        lambda: rl.trigger(free, {"x": _Flipping()}),
        PayloadValidationError,
        "object keys must be strings",
    )


def test_jsonb_normalises_large_floats_and_negative_zero(rl: Runlane) -> None:
    """Documented, not preserved: Postgres jsonb stores numbers as numeric, which has no
    float type and no negative zero. A float Python writes with an exponent (abs >= 1e16:
    "1e+16", "1.5e+300") reads back as the int of the same decimal digits, so float() of it
    gives the float sent; -0.0 reads back as 0.0. Other floats keep their value and type."""
    sent = {"big": 1e16, "huge": -1.5e300, "neg_zero": -0.0, "half": 1.5, "e15": 1e15, "tiny": 1e-7}
    stored = rl.get_run(rl.trigger(free, sent).id).payload
    assert (stored["big"], type(stored["big"])) == (10**16, int)
    assert (stored["huge"], type(stored["huge"])) == (-15 * 10**299, int)
    assert float(stored["huge"]) == -1.5e300
    assert str(stored["neg_zero"]) == "0.0"  # a float, its sign gone
    assert {k: (stored[k], type(stored[k])) for k in ("half", "e15", "tiny")} == {
        "half": (1.5, float),
        "e15": (1e15, float),
        "tiny": (1e-7, float),
    }


# -- long names in messages ---------------------------------------------------------------

LONG = "n" * 10_000


@pytest.mark.parametrize(
    "case",
    [
        (lambda rl: rl.trigger(LONG, {}), TaskNotFound, "a string of 10,000 characters"),
        (
            lambda rl: rl.trigger(free, {}, queue=LONG),
            ConfigurationError,
            "a string of 10,000 characters starting 'nnnn",
        ),
        (
            lambda rl: rl.trigger(free, {}, idempotency_key=LONG),
            ConfigurationError,
            "idempotency_key must be a non-empty string of at most 1000 characters",
        ),
        (
            lambda rl: rl.trigger(free, {}, idempotency_key="k" * 900 + "\x00"),
            ConfigurationError,
            "must not contain the NUL character",
        ),
        (
            lambda rl: rl.trigger(free, {}, idempotency_key="k" * 900 + "\ud800"),
            ConfigurationError,
            "a lone surrogate",
        ),
        (lambda rl: task(id=LONG)(lambda p, c: None), ConfigurationError, "task id"),
        (lambda rl: queue(LONG), ConfigurationError, "queue name"),
        (lambda rl: rl.list_runs(task=LONG), ConfigurationError, "task must be"),
        (lambda rl: rl.list_runs(status=LONG), ConfigurationError, "is not a run status"),
        (lambda rl: rl.trigger(free, {}, priority=10**5000), ConfigurationError, "priority"),
        (lambda rl: rl.trigger(free, {LONG: 1, 2: 3}), PayloadValidationError, "the int key 2"),
    ],
    ids=[
        "task-id",
        "queue",
        "key-too-long",
        "key-with-nul",
        "key-with-surrogate",
        "task-decorator",
        "queue-factory",
        "list-task",
        "list-status",
        "huge-priority",
        "payload-key",
    ],
)
def test_a_long_value_is_not_repeated_whole(
    rl: Runlane,
    db: Conn,
    schema: str,
    case: tuple[Callable[[Runlane], object], type[RunlaneError], str],
) -> None:
    call, error, needle = case
    _refused(db, schema, lambda: call(rl), error, needle)


def test_cli_does_not_repeat_a_long_app_or_task(cli: Cli, db: Conn, schema: str) -> None:
    _cli_refused(cli, db, schema, ["status", "m" * 10_000 + ":x"], "a string of 10,000 characters")
    _cli_refused(
        cli,
        db,
        schema,
        ["trigger", APP_SPEC, LONG, "--payload", "{}"],
        "a string of 10,000 characters starting 'nnnn",
    )


# -- the caller's statement_timeout ---------------------------------------------------------


def test_a_statement_timeout_on_the_callers_connection_is_not_database_unavailable(
    rl: Runlane, db: Conn, schema: str, database_url: str
) -> None:
    rl.trigger(free, {})  # the schema check is done: what follows is the insert alone
    before = count_runs(db, schema)
    locked = threading.Event()
    release = threading.Event()

    def hold_the_table() -> None:
        with psycopg.connect(database_url) as holder, holder.transaction():
            holder.execute(q("lock table {s}.runs in access exclusive mode", schema))
            locked.set()
            release.wait(30)

    holder = threading.Thread(target=hold_the_table)
    holder.start()
    try:
        assert locked.wait(30)
        with psycopg.connect(database_url) as conn:
            conn.execute("set statement_timeout = '200ms'")
            with pytest.raises(StorageUnavailable) as raised:
                rl.trigger(free, {}, connection=conn)
            conn.rollback()
    finally:
        release.set()
        holder.join()
    message = str(raised.value)
    assert "ran past the connection's statement_timeout" in message
    assert "the database is up" in message
    assert "unavailable" not in message
    assert "SET LOCAL statement_timeout" in message
    assert count_runs(db, schema) == before


# a value of the wrong kind, as an untyped caller passes it
WRONG: Any = LONG


@pytest.mark.parametrize(
    "call",
    [
        lambda rl, url: create_runlane(lane=rl.lane, schedules=[WRONG]),
        lambda rl, url: create_runlane(lane=rl.lane, tasks=[WRONG]),
        lambda rl, url: create_runlane(lane=rl.lane, queues=[WRONG]),
        lambda rl, url: create_runlane(lane=rl.lane, retention=WRONG),
        lambda rl, url: rl.run_maintenance_once(WRONG),
        lambda rl, url: rl.create_delivery_worker(concurrency=1, queues=WRONG),
        lambda rl, url: postgres_polling_lane(connection_string=url, schema=LONG),
        lambda rl, url: postgres_grant_sql(job=WRONG, role="r", schema="s"),
        lambda rl, url: postgres_grant_sql(job="worker", role=LONG, schema="s"),
        lambda rl, url: postgres_polling_lane(connection_string=f"port={LONG}", schema="s"),
    ],
    ids=[
        "schedules",
        "tasks",
        "queues",
        "retention",
        "maintenance-limits",
        "worker-queues",
        "schema",
        "grant-job",
        "grant-role",
        "port",
    ],
)
def test_a_long_value_of_the_wrong_kind_is_not_repeated_whole(
    rl: Runlane, database_url: str, call: Callable[[Runlane, str], object]
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        call(rl, database_url)
    message = str(caught.value)
    assert "a string of 10,000 characters" in message, message
    assert len(message) < 600, message
