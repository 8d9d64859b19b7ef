"""The RabbitMQ lane's message body: what a publisher writes, a consumer reads back, and
the quick reading of bodies in the publisher's own form answers as decoding them as JSON."""

from __future__ import annotations

import json
import uuid
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from runlane.rabbitmq._amqp import message_body, parse_body


def _as_json(body: bytes) -> uuid.UUID | None:
    """What decoding the body as JSON gives (the reading for any body)."""
    try:
        data: Any = json.loads(body)
        return uuid.UUID(str(data["run_id"]))
    except (ValueError, TypeError, KeyError, RecursionError):
        return None


@given(run_id=st.uuids(), environment=st.text(max_size=40))
def test_a_body_names_its_run_whatever_the_environment(run_id: uuid.UUID, environment: str) -> None:
    assert parse_body(message_body(run_id, environment)) == run_id


_ID_CHARS = st.sampled_from('0123456789abcdefABCDEF-{}"\\ x\u0663\n')


@given(
    run_id=st.text(_ID_CHARS, min_size=30, max_size=40) | st.uuids().map(str),
    environment=st.text(st.characters(max_codepoint=0x7F), max_size=12) | st.text(max_size=6),
    tail=st.sampled_from(['"}', '"} ', '", "run_id": "x"}', '"', "}", '"}}']),
)
def test_the_quick_reading_answers_as_json_does(run_id: str, environment: str, tail: str) -> None:
    """Bodies near the publisher's form, written raw (no escaping): quotes, backslashes,
    control and non-ASCII characters, ids of other lengths and forms, other endings."""
    body = f'{{"run_id": "{run_id}", "environment": "{environment}{tail}'.encode(
        "utf-8", "surrogatepass"
    )
    assert parse_body(body) == _as_json(body)


@given(body=st.binary(max_size=120))
def test_any_bytes_are_read_as_json_reads_them(body: bytes) -> None:
    assert parse_body(body) == _as_json(body)


def test_bodies_that_are_not_ours_name_no_run() -> None:
    run_id = uuid.uuid4()
    for body in (
        b"",
        b"not json",
        b"[]",
        b'{"environment": "default"}',
        b'{"run_id": 7}',
        b'{"run_id": "not-a-uuid", "environment": "default"}',
        b'{"run_id": "' + str(run_id).encode() + b'", "environment": "default"',
        b"[" * 100_000,
    ):
        assert parse_body(body) is None, body
