"""Run ids: increasing UUIDv7s whose random bits come from a read-ahead of the OS source."""

from __future__ import annotations

import os
import uuid

import pytest

from runlane import _ids
from runlane._ids import new_run_id, new_run_ids


def test_ids_are_version_7_increasing_and_distinct() -> None:
    ids = [new_run_id() for _ in range(600)] + new_run_ids(3000) + new_run_ids(1)
    assert all(i.version == 7 and i.variant == uuid.RFC_4122 for i in ids)
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    assert len({i.int & ((1 << 62) - 1) for i in ids}) == len(ids)  # random bits differ


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_reuse_its_parents_random_bits() -> None:
    """The read-ahead is dropped in a child: the child's next id and the parent's next id
    (made from what remained in the parent's read-ahead) share no random bits."""
    new_run_id()  # fills the read-ahead
    assert _ids._noise_at < len(_ids._noise)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, then exit without running pytest's teardown
        try:
            os.write(write, new_run_id().bytes)
        finally:
            os._exit(0)
    os.close(write)
    child = uuid.UUID(bytes=os.read(read, 16))
    os.close(read)
    os.waitpid(pid, 0)
    parent = new_run_id()
    mask = (1 << 62) - 1
    assert child.int & mask != parent.int & mask


def test_an_id_is_an_ordinary_uuid() -> None:
    """Ids are made without UUID.__init__: each must still be a UUID like any other (equal
    to its own text parsed, hashed, pickled, ordered and formatted the same)."""
    import pickle  # noqa: PLC0415 - only here

    for made in [new_run_id(), *new_run_ids(3)]:
        parsed = uuid.UUID(str(made))
        assert made == parsed
        assert hash(made) == hash(parsed)
        assert (made.version, made.variant) == (7, uuid.RFC_4122)
        assert made.is_safe is uuid.SafeUUID.unknown
        assert pickle.loads(pickle.dumps(made)) == made
        assert repr(made) == repr(parsed)
        assert made.bytes == parsed.bytes
