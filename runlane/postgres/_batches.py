"""Splitting a large ``trigger_many`` batch into statements Postgres can take.

A batch travels as one statement whose payloads are one JSON array parameter. Postgres caps
a jsonb value at 256 MiB (and any parameter at 1 GiB), so a batch of payloads each within
``max_payload_bytes`` could still be refused as a whole. A batch above ``STATEMENT_BYTES``
is split into several statements, which the storage runs in one transaction: the batch is
still written entirely or not at all. jsonb can be several times larger than the JSON text
(a small number takes 2 bytes of text and 12 of jsonb), hence the margin.

The pieces are cut from the batch sorted in the insert statements' lock order (idempotency
key in the "C" collation, then id; keyless rows last), so a split batch takes its key locks
in the same global order as every other insert and cannot deadlock with one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import psycopg
from psycopg.rows import tuple_row

from runlane.errors import PayloadValidationError
from runlane.postgres._connections import Conn, own_transaction
from runlane.storage import NewRuns

__all__ = [
    "STATEMENT_BYTES",
    "pipelined",
    "refusing_too_large",
    "split_runs",
    "too_large",
    "too_large_reason",
]

T = TypeVar("T")

#: Payload (and key) bytes in UTF-8 above which a batch goes in more than one statement: at
#: six times this, still well below jsonb's 256 MiB; large enough that a statement's fixed
#: cost is negligible.
STATEMENT_BYTES = 16 * 1024 * 1024

# what a row costs besides its payload and key: its id in the ids array literal, a comma
_ROW_BYTES = 40


def split_runs(runs: NewRuns, max_bytes: int | None = None) -> list[NewRuns]:
    """``runs`` as one piece when it fits in ``max_bytes`` (default ``STATEMENT_BYTES``),
    else as pieces of at most that each (a payload larger than that alone), in lock order."""
    if max_bytes is None:
        max_bytes = STATEMENT_BYTES
    keys = runs.idempotency_keys
    # a UTF-8 character takes at most 4 bytes: most batches need no exact count
    chars = sum(map(len, runs.payloads)) + sum(len(k) for k in keys if k is not None)
    if chars * 4 + _ROW_BYTES * len(keys) <= max_bytes:
        return [runs]
    sizes = [
        _utf8_len(payload) + _utf8_len(key or "") + _ROW_BYTES
        for payload, key in zip(runs.payloads, keys, strict=True)
    ]
    if sum(sizes) <= max_bytes:
        return [runs]
    # str order is code point order, which is UTF-8 byte order: the "C" collation's in a
    # UTF-8 database (in another encoding, byte order may differ: two split batches still
    # agree, but a split batch and a whole one may not)
    order = sorted(range(len(sizes)), key=lambda i: (keys[i] is None, keys[i] or "", runs.ids[i]))
    pieces: list[list[int]] = [[]]
    filled = 0
    for i in order:
        if pieces[-1] and filled + sizes[i] > max_bytes:
            pieces.append([])
            filled = 0
        pieces[-1].append(i)
        filled += sizes[i]
    return [
        attrs.evolve(
            runs,
            ids=[runs.ids[i] for i in piece],
            payloads=[runs.payloads[i] for i in piece],
            idempotency_keys=[keys[i] for i in piece],
        )
        for piece in pieces
    ]


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def pipelined(
    conn: psycopg.Connection[Any], statement: str, params: Sequence[Mapping[str, Any]]
) -> list[tuple[Any, ...]]:
    """The rows ``statement`` returns for each of ``params``: one statement alone, several
    sent in one round trip and committed together (in a transaction of their own on an
    autocommit connection outside one; else in the caller's transaction, which the caller
    ends, or, on a connection already in a pipeline, in the implicit transaction Postgres
    runs up to the pipeline's next sync)."""
    if len(params) == 1:
        with conn.cursor(row_factory=tuple_row) as cursor:
            return cursor.execute(statement, params[0]).fetchall()
    transaction = own_transaction(conn)  # told before the pipeline starts
    with contextlib.ExitStack() as cursors:
        sent = [cursors.enter_context(conn.cursor(row_factory=tuple_row)) for _ in params]
        # through a transaction pooler (nothing prepared: postgres/_pooler.py) the transaction
        # begins before the pipeline and commits after it: PgBouncer before 1.21 hands the
        # server connection on at a sync ending a transaction, under replies still due here
        pooled = conn.prepare_threshold is None
        outer, inner = (transaction, conn.pipeline()) if pooled else (conn.pipeline(), transaction)
        with outer, inner:
            for cursor, p in zip(sent, params, strict=True):
                cursor.execute(statement, p)
        return [row for cursor in sent for row in cursor.fetchall()]


def too_large(exc: psycopg.Error) -> bool:
    """Whether Postgres refused a value as too large to hold as jsonb: over its 256 MiB, or
    (parsing a jsonb of very many values) asking for more than 1 GiB of memory at once. Told
    by the server's source file, not its (translatable) message, and only those: other
    limits (an index row too large, say) are not the value's size."""
    source = exc.diag.source_file or ""
    if isinstance(exc, psycopg.errors.ProgramLimitExceeded):
        return source.startswith("jsonb")
    return isinstance(exc, psycopg.errors.InternalError_) and source == "mcxt.c"


def too_large_reason(exc: psycopg.Error) -> str:
    """What the error says, for the messages of too_large errors."""
    return (
        f"too large for Postgres to store ({exc.diag.message_primary}); nothing was written: "
        "store large data elsewhere and pass a reference"
    )


def refusing_too_large(insert: Callable[[Conn], T], conn: Conn, runs: NewRuns) -> T:
    """``insert(conn)``, with a payload Postgres cannot hold refused as invalid: JSON text
    within ``max_payload_bytes`` can take several times that as jsonb."""
    try:
        return insert(conn)
    except psycopg.Error as exc:
        if not too_large(exc):
            raise
        which = "payload" if len(runs.ids) == 1 else "a payload of the batch"
        raise PayloadValidationError(runs.task_id, [f"{which}: {too_large_reason(exc)}"]) from exc
