"""Limits that protect the database: payload and output sizes (create_runlane's
max_payload_bytes and max_output_bytes, measured on the JSON text in UTF-8) checked before any
write, and error text from user code cut to a bound instead of stored whole."""

from __future__ import annotations

import uuid
from typing import Any

import attrs
import pytest

from runlane import (
    ConfigurationError,
    PayloadValidationError,
    RetryPolicy,
    RunContext,
    RunStatus,
    WaitTokenStatus,
    _codec,
    create_runlane,
    schedule,
    task,
)
from runlane._codec import encode_payload
from runlane._limits import (
    DEFAULT_MAX_OUTPUT_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_ERROR_MESSAGE_CHARS,
    MAX_TRACEBACK_CHARS,
    truncate_traceback,
)
from runlane.postgres import postgres_polling_lane
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, count_runs, q

THREE_ATTEMPTS = RetryPolicy(max_attempts=3)


@attrs.frozen
class Note:
    text: str


@task(id="limits.free")
def free(payload: Any, context: RunContext) -> None:
    return None


@task(id="limits.note", schema=Note)
def note(payload: Note, context: RunContext) -> str:
    return payload.text


# -- configuration ---------------------------------------------------------------------------


def test_defaults_are_one_mebibyte_each(database_url: str) -> None:
    rl = create_runlane(lane=postgres_polling_lane(connection_string=database_url))
    assert rl.max_payload_bytes == DEFAULT_MAX_PAYLOAD_BYTES == 1_048_576
    assert rl.max_output_bytes == DEFAULT_MAX_OUTPUT_BYTES == 1_048_576


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "1024", 64 * 1_048_576 + 1])
def test_a_limit_outside_one_byte_to_64_mib_is_a_configuration_error(
    database_url: str, bad: object
) -> None:
    lane = postgres_polling_lane(connection_string=database_url)
    options: dict[str, Any]
    for name in ("max_payload_bytes", "max_output_bytes"):
        options = {name: bad}
        with pytest.raises(ConfigurationError, match=name):
            create_runlane(lane=lane, **options)


# -- payloads --------------------------------------------------------------------------------


def test_a_payload_at_the_limit_is_stored_and_one_byte_over_is_refused(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    rl = make_runlane(tasks=[free, note], max_payload_bytes=100)
    # a JSON string: its text plus two quotes
    at_limit = rl.trigger(free, "x" * 98)
    assert rl.get_run(at_limit.id).payload == "x" * 98
    with pytest.raises(PayloadValidationError, match=r"payload is 101 bytes as JSON") as caught:
        rl.trigger(free, "x" * 99)
    assert "over the limit of 100 bytes (max_payload_bytes)" in str(caught.value)
    assert "pass a reference" in str(caught.value)
    # measured in UTF-8 bytes, not characters: "é" is two bytes
    rl.trigger(free, "é" * 49)
    with pytest.raises(PayloadValidationError, match="102 bytes"):
        rl.trigger(free, "é" * 50)
    # a schema instance is measured on its JSON object, keys and all: {"text":"..."}
    rl.trigger(note, Note("x" * 89))
    with pytest.raises(PayloadValidationError, match="max_payload_bytes"):
        rl.trigger(note, Note("x" * 90))
    assert count_runs(db, schema) == 3


def test_trigger_many_with_one_oversized_payload_writes_none_and_names_its_index(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    rl = make_runlane(tasks=[free], max_payload_bytes=64)
    payloads: list[Any] = [{"n": i} for i in range(5)]
    payloads[3] = {"n": "y" * 100}
    with pytest.raises(PayloadValidationError) as caught:
        rl.trigger_many(free, payloads)
    assert caught.value.problems[0].startswith("payloads[3] (nothing was written): payload is")
    assert count_runs(db, schema) == 0
    # the same batch within the limit goes through in one call
    payloads[3] = {"n": 3}
    assert len(rl.trigger_many(free, payloads)) == 5


def test_a_child_trigger_over_the_limit_raises_into_its_parent(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    seen: list[BaseException] = []

    @task(id="limits.parent")
    def parent(payload: Any, context: RunContext) -> str:
        try:
            context.trigger_child(free, "z" * 500)
        except PayloadValidationError as exc:
            seen.append(exc)
        return "done"

    rl = make_runlane(tasks=[parent, free], max_payload_bytes=200)
    handle = rl.trigger(parent, None)
    rl.drain()
    assert rl.get_run(handle.id).status is RunStatus.COMPLETED
    assert len(seen) == 1
    assert "max_payload_bytes" in str(seen[0])
    assert count_runs(db, schema) == 1


def test_a_schedule_payload_over_the_limit_is_refused_when_the_runtime_is_built(
    database_url: str,
) -> None:
    every_minute = schedule(id="limits.s", task=free, cron="* * * * *", payload="p" * 300)
    with pytest.raises(ConfigurationError, match=r"schedule 'limits.s'.*max_payload_bytes"):
        create_runlane(
            lane=postgres_polling_lane(connection_string=database_url),
            tasks=[free],
            schedules=[every_minute],
            max_payload_bytes=256,
        )


def test_the_payload_is_encoded_once_and_that_text_is_what_is_written(
    make_runlane: RunlaneFactory, db: Conn, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The size check reuses the encoding the write needs: trigger() encodes the payload
    once (with the codec's one JSON encoder)."""
    calls: list[object] = []
    real = _codec._encode

    def counting(value: object) -> str:
        calls.append(value)
        return real(value)

    rl = make_runlane(tasks=[note])
    rl.start()
    monkeypatch.setattr(_codec, "_encode", counting)
    handle = rl.trigger(note, Note("ü"))
    monkeypatch.undo()
    assert calls == [{"text": "ü"}]
    row = db.execute(
        q("select payload::text from {s}.runs where id = %s", schema), (handle.id,)
    ).fetchone()
    assert row == ('{"text": "ü"}',)


# -- outputs ---------------------------------------------------------------------------------


def test_a_wait_token_output_over_the_limit_is_refused_and_the_token_stays_pending(
    make_runlane: RunlaneFactory,
) -> None:
    rl = make_runlane(max_output_bytes=50)
    token = rl.create_wait_token()
    with pytest.raises(ConfigurationError) as caught:
        rl.complete_wait_token(token.id, {"blob": "b" * 100})
    message = str(caught.value)
    assert "the wait token's output is 111 bytes as JSON" in message
    assert "over the limit of 50 bytes (max_output_bytes)" in message
    assert "nothing was written" in message
    assert rl.get_wait_token(token.id).status is WaitTokenStatus.PENDING
    done = rl.complete_wait_token(token.id, {"blob": "small"})
    assert done.status is WaitTokenStatus.COMPLETED
    assert done.output == {"blob": "small"}


def test_a_step_output_over_the_limit_raises_into_the_handler_and_stores_nothing(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    errors: list[str] = []
    calls: list[str] = []

    @task(id="limits.steps")
    def steps(payload: Any, context: RunContext) -> str:
        def big() -> str:
            calls.append("big")
            return "s" * 500

        try:
            context.step("big", big)
        except ConfigurationError as exc:
            errors.append(str(exc))
        return str(context.step("small", lambda: "ok"))

    rl = make_runlane(tasks=[steps], max_output_bytes=100)
    handle = rl.trigger(steps, None)
    rl.drain()
    run = rl.get_run(handle.id)
    assert run.status is RunStatus.COMPLETED
    assert run.output == "ok"
    assert calls == ["big"]
    assert errors == [
        "the output of step 'big' is 502 bytes as JSON, over the limit of 100 bytes "
        "(max_output_bytes); store large data elsewhere (object storage, a table of your own) "
        "and pass a reference, or raise create_runlane(max_output_bytes=...); nothing was stored"
    ]
    history = rl.get_run_history(handle.id)
    assert [s.name for s in history.steps] == ["small"]


def test_a_step_over_the_limit_left_uncaught_fails_the_attempt_as_any_error_does(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    @task(id="limits.step.uncaught", retry=RetryPolicy(max_attempts=1))
    def uncaught(payload: Any, context: RunContext) -> None:
        context.step("big", lambda: ["x" * 50] * 10)

    rl = make_runlane(tasks=[uncaught], max_output_bytes=100)
    handle = rl.trigger(uncaught, None)
    rl.drain()
    run = rl.get_run(handle.id)
    assert run.status is RunStatus.FAILED
    assert run.error is not None
    assert run.error.type == "runlane.ConfigurationError"
    assert "max_output_bytes" in run.error.message
    row = db.execute(q("select count(*) from {s}.steps", schema)).fetchone()
    assert row == (0,)


def test_a_return_value_over_the_limit_fails_the_run_without_retrying(
    make_runlane: RunlaneFactory,
) -> None:
    @task(id="limits.big.return", retry=THREE_ATTEMPTS)
    def big_return(payload: Any, context: RunContext) -> dict[str, str]:
        return {"report": "r" * 5000}

    rl = make_runlane(tasks=[big_return], max_output_bytes=1000)
    handle = rl.trigger(big_return, None)
    assert rl.drain().runs_executed == 1
    run = rl.get_run(handle.id)
    assert run.status is RunStatus.FAILED
    assert run.attempt == 1
    assert run.output is None
    assert run.error is not None
    assert run.error.type == "runlane._codec.OutputTooLarge"
    assert run.error.message.startswith(
        "the handler's return value is 5,013 bytes as JSON, over the limit of 1,000 bytes "
        "(max_output_bytes)"
    )
    assert not run.error.retryable


def test_the_default_output_limit_applies_to_return_values(
    make_runlane: RunlaneFactory,
) -> None:
    @task(id="limits.default.return")
    def huge(payload: Any, context: RunContext) -> str:
        return "h" * DEFAULT_MAX_OUTPUT_BYTES

    rl = make_runlane(tasks=[huge])
    handle = rl.trigger(huge, None)
    rl.drain()
    run = rl.get_run(handle.id)
    assert run.status is RunStatus.FAILED
    assert run.error is not None
    assert "1,048,578 bytes" in run.error.message


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (object(), "cannot be stored as JSON"),
        ({1: "int key"}, "object keys must be strings"),
        (float("nan"), "NaN and infinite floats"),
        ("nul \x00", "NUL character"),
    ],
    ids=["object", "int-key", "nan", "nul"],
)
def test_an_unserializable_return_value_fails_its_attempt(
    make_runlane: RunlaneFactory, value: object, needle: str
) -> None:
    @task(id="limits.unserializable", retry=THREE_ATTEMPTS)
    def bad(payload: Any, context: RunContext) -> object:
        return value

    rl = make_runlane(tasks=[bad])
    handle = rl.trigger(bad, None)
    assert rl.drain().runs_executed == 1
    run = rl.get_run(handle.id)
    assert run.status is RunStatus.FAILED
    assert run.error is not None
    assert run.error.type == "runlane._codec.OutputNotSerializable"
    assert "the handler's return value" in run.error.message
    assert needle in run.error.message


# -- error text from user code ---------------------------------------------------------------


def test_a_huge_exception_message_and_traceback_are_cut_not_refused(
    make_runlane: RunlaneFactory,
) -> None:
    def recurse(n: int) -> None:
        if n == 0:
            raise RuntimeError("m" * 200_000)
        recurse(n - 1)

    @task(id="limits.loud", retry=RetryPolicy(max_attempts=1))
    def loud(payload: Any, context: RunContext) -> None:
        recurse(300)  # a traceback of some 300 frames

    rl = make_runlane(tasks=[loud])
    handle = rl.trigger(loud, None)
    rl.drain()
    run = rl.get_run(handle.id)
    assert run.status is RunStatus.FAILED
    assert run.error is not None
    assert run.error.type == "RuntimeError"
    assert run.error.message.startswith("m" * MAX_ERROR_MESSAGE_CHARS + "... [cut by runlane")
    assert "200,000 characters in all" in run.error.message
    assert len(run.error.message) < MAX_ERROR_MESSAGE_CHARS + 100
    assert run.error.traceback is not None
    assert len(run.error.traceback) < MAX_TRACEBACK_CHARS + 200
    assert run.error.traceback.startswith("Traceback (most recent call last):")
    assert "[cut by runlane:" in run.error.traceback
    assert run.error.traceback.rstrip().endswith("m" * 100)  # the exception line's end


def test_truncate_traceback_keeps_both_ends() -> None:
    text = "HEAD" + "-" * 50_000 + "TAIL"
    cut = truncate_traceback(text)
    assert cut.startswith("HEAD")
    assert cut.endswith("TAIL")
    assert len(cut) < MAX_TRACEBACK_CHARS + 100
    assert truncate_traceback("short") == "short"


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no")


@pytest.mark.parametrize(
    ("exc", "stored"),
    [
        (ValueError("lone \ud800 surrogate"), "lone \\ud800 surrogate"),
        (ValueError("nul \x00 char"), "nul \\x00 char"),
        (Unprintable(), "<str() of this Unprintable raised RuntimeError>"),
    ],
    ids=["lone-surrogate", "nul", "failing-str"],
)
def test_an_exception_message_that_cannot_be_stored_as_is_is_stored_escaped(
    make_runlane: RunlaneFactory, exc: Exception, stored: str
) -> None:
    @task(id="limits.odd.error", retry=RetryPolicy(max_attempts=1))
    def odd(payload: Any, context: RunContext) -> None:
        raise exc

    rl = make_runlane(tasks=[odd])
    handle = rl.trigger(odd, None)
    assert rl.drain().runs_executed == 1
    run = rl.get_run(handle.id)
    assert run.status is RunStatus.FAILED
    assert run.error is not None
    assert run.error.message == stored


def test_encode_payload_measures_utf8_bytes_of_the_compact_json() -> None:
    assert encode_payload("t", None, {"a": [1, 2]}, max_bytes=13) == '{"a":[1,2]}'
    with pytest.raises(PayloadValidationError, match="14 bytes"):
        encode_payload("t", None, {"a": "€€"}, max_bytes=11)  # € is three bytes
    assert uuid.UUID(encode_payload("t", None, str(uuid.UUID(int=5)))[1:-1]).int == 5
