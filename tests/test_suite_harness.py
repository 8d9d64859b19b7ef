"""How the whole suite runs (tests/_suite.py): the order it hands its files out in (longest
first by the seconds tests/durations.json records, random among files of about the same
length), and Ctrl-C for its subprocesses."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from tests._suite import (
    DURATIONS,
    ROOT,
    UNKNOWN_SECONDS,
    DurationRecorder,
    duration_class,
    longest_files_first,
    recorded_durations,
)


def _item(name: str, test: str, *, slow: bool = False) -> pytest.Item:
    path = ROOT / "tests" / name
    return cast(
        pytest.Item,
        SimpleNamespace(
            path=path,
            nodeid=f"tests/{name}::{test}",
            get_closest_marker=lambda marker: object() if slow and marker == "slow" else None,
        ),
    )


def _files(items: list[pytest.Item]) -> list[str]:
    order: list[str] = []
    for item in items:
        name = item.nodeid.split("::")[0]
        if not order or order[-1] != name:
            order.append(name)
    return order


def test_files_go_longest_first_and_keep_their_tests_together_and_in_order() -> None:
    items = [
        _item("test_a.py", "one"),
        _item("test_a.py", "two"),
        _item("test_b.py", "one"),
        _item("test_c.py", "one"),
        _item("test_c.py", "two"),
        _item("test_new.py", "one"),
        _item("test_new_slow.py", "one", slow=True),
    ]
    durations = {"tests/test_a.py": 0.4, "tests/test_b.py": 70.0, "tests/test_c.py": 9.0}
    longest_files_first(items, durations)
    # unknown files count as UNKNOWN_SECONDS, or UNKNOWN_SLOW_SECONDS with a slow test
    assert _files(items) == [
        "tests/test_b.py",
        "tests/test_new_slow.py",
        "tests/test_c.py",
        "tests/test_new.py",
        "tests/test_a.py",
    ]
    assert [item.nodeid for item in items if "test_c" in item.nodeid] == [
        "tests/test_c.py::one",
        "tests/test_c.py::two",
    ]
    assert UNKNOWN_SECONDS < 8.0


def test_files_of_about_the_same_length_keep_the_random_order() -> None:
    names = ["test_x.py", "test_y.py", "test_z.py", "test_w.py"]
    durations = {
        f"tests/{name}": seconds for name, seconds in zip(names, [5.0, 7.9, 4.1, 6.0], strict=True)
    }
    items = [_item(name, "t") for name in names]
    longest_files_first(items, durations)
    assert _files(items) == [f"tests/{name}" for name in names]
    assert {duration_class(seconds) for seconds in durations.values()} == {2}
    assert duration_class(0.0) == duration_class(0.99) == duration_class(1.5) == 0
    assert duration_class(2.0) == 1
    assert duration_class(100.0) == 6


def test_the_recorded_durations_are_read_leniently(tmp_path: Path) -> None:
    path = tmp_path / "durations.json"
    assert recorded_durations(path) == {}  # missing
    path.write_text("{not json", encoding="utf-8")
    assert recorded_durations(path) == {}
    path.write_text("[1, 2]", encoding="utf-8")
    assert recorded_durations(path) == {}
    path.write_text(json.dumps({"tests/a.py": 2, "tests/b.py": "x", "tests/c.py": True}))
    assert recorded_durations(path) == {"tests/a.py": 2.0}
    # the committed file names files that exist
    committed = recorded_durations(DURATIONS)
    assert committed, DURATIONS
    missing = [name for name in committed if not (ROOT / name).is_file()]
    assert not missing, f"tests/durations.json names files that are gone: {missing}"


def test_the_recorder_sums_each_files_reports_and_writes_after_a_passing_run(
    tmp_path: Path,
) -> None:
    path = tmp_path / "durations.json"
    recorder = DurationRecorder(path)
    for nodeid, duration in [
        ("tests/test_a.py::one", 0.25),
        ("tests/test_a.py::one", 1.0),
        ("tests/test_b.py::Class::two[x]", 3.04),
    ]:
        recorder.pytest_runtest_logreport(
            cast(Any, SimpleNamespace(nodeid=nodeid, duration=duration))
        )
    session = cast(pytest.Session, None)
    recorder.pytest_sessionfinish(session, 1)  # a failed run writes nothing
    assert not path.exists()
    recorder.pytest_sessionfinish(session, 0)
    assert json.loads(path.read_text(encoding="utf-8")) == {
        "tests/test_a.py": 1.2,
        "tests/test_b.py": 3.0,
    }


def test_subprocesses_get_ctrl_c_even_when_pytest_was_started_ignoring_it() -> None:
    """restore_interrupts, in a process started with SIGINT ignored (as a background job of
    a non-interactive shell is): the Python it then starts takes Ctrl-C again."""
    script = (
        "import signal, subprocess, sys\n"
        "from tests._suite import restore_interrupts\n"
        "child = [sys.executable, '-c', "
        "'import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)']\n"
        "print(subprocess.run(child, capture_output=True, text=True).stdout.strip())\n"
        "restore_interrupts()\n"
        "print(subprocess.run(child, capture_output=True, text=True).stdout.strip())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        check=True,
        timeout=60,
    )
    assert result.stdout.split() == ["True", "False"], result.stderr
