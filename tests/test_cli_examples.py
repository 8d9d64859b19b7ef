"""The runnable examples in examples/: the README shows them verbatim, and they behave as the
README says (a worker process handles SIGTERM, the bounded maintenance entry point can be
invoked again and again on one runtime, the quick start completes its run)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from runlane import RunContext, RunStatus, create_runlane, queue, task
from runlane.postgres import postgres_polling_lane
from tests.helpers import Conn, process, q, wait_for_status, wait_until

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
README = ROOT / "README.md"


def readme_blocks() -> dict[str, str]:
    """The README's python code blocks that start with ``# examples/NAME.py``, by NAME."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    found: dict[str, str] = {}
    for block in blocks:
        first = block.splitlines()[0]
        match = re.match(r"# examples/(\w+\.py)\b", first)
        if match:
            assert match.group(1) not in found, f"{match.group(1)} is shown twice"
            found[match.group(1)] = block
    return found


def test_readme_shows_every_example_verbatim() -> None:
    shown = readme_blocks()
    files = {path.name: path.read_text() for path in EXAMPLES.glob("*.py")}
    assert {"quickstart.py", "worker.py", "maintenance_cron.py"} <= set(files)
    assert set(shown) == set(files), "every example appears in the README, and only those"
    for name, text in files.items():
        assert shown[name] == text, f"README's copy of examples/{name} differs from the file"


def example(
    database_url: str, schema: str, *argv: str
) -> AbstractContextManager[subprocess.Popen[str]]:
    env = {**os.environ, "DATABASE_URL": database_url, "RUNLANE_SCHEMA": schema}
    return process([sys.executable, *argv], cwd=EXAMPLES, env=env, stdout=subprocess.PIPE)


def test_quickstart_completes_its_run(database_url: str, schema: str) -> None:
    with example(database_url, schema, "quickstart.py") as proc:
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "executed 1" in out
    assert "completed {'attempt': '1', 'sent_to': 'ada@example.com'}" in out


def test_worker_example_hands_its_run_back_on_sigterm(
    database_url: str, schema: str, db: Conn
) -> None:
    """SIGTERM while a handler is running: the process exits 0 and the run is queued again,
    its attempt not spent (the README's worker.py used to die and lose an attempt)."""

    @task(id="reports.build", queue="reports")
    def build_report(payload: Any, context: RunContext) -> None:  # the example's task
        return None

    producer = create_runlane(
        lane=postgres_polling_lane(connection_string=database_url, schema=schema),
        queues=[queue("email", default=True), queue("reports")],
        tasks=[build_report],
    )
    try:
        handle = producer.trigger(build_report, {"chunks": 120})  # about a minute of work
        with example(database_url, schema, "worker.py") as proc:
            assert proc.stdout is not None
            assert "SIGTERM or Ctrl-C stops it" in proc.stdout.readline()
            wait_for_status(producer, handle.id, RunStatus.RUNNING, timeout=30)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
            assert proc.returncode == 0, err
            assert "Traceback" not in err
        snap = producer.get_run(handle.id)
        assert snap.status is RunStatus.QUEUED, snap
        assert snap.error is None
        consumed = db.execute(
            q("select attempt - releases from {s}.runs where id = %s", schema), (handle.id,)
        ).fetchone()
        assert consumed == (0,), "the handed-back attempt was counted"
    finally:
        producer.close()


def test_bounded_maintenance_entry_point_runs_on_every_invocation(
    database_url: str, schema: str
) -> None:
    code = (
        "from quickstart import runlane\n"
        "from maintenance_cron import run_maintenance_pass\n"
        "for _ in range(3):\n"
        "    print(type(run_maintenance_pass(runlane)).__name__)\n"
    )
    with example(database_url, schema, "-c", code) as proc:
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.split() == ["MaintenanceResult"] * 3


def test_maintenance_example_closes_on_sigterm(database_url: str, schema: str, db: Conn) -> None:
    def live_leases() -> int:
        row = db.execute(
            q("select count(*) from {s}.maintenance_leases where expires_at > now()", schema)
        ).fetchone()
        return 0 if row is None else int(row[0])

    with example(database_url, schema, "maintenance.py") as proc:
        wait_until(lambda: live_leases() > 0, timeout=30, what="a band owned")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert live_leases() == 0  # released on the way out


# runs the example named by argv[1] with a thread that, once the file argv[2] exists, sends
# SIGTERM to itself: the kernel hands a signal sent to the process to any of its threads
_SIGNAL_FROM_A_THREAD = """
import os, runpy, signal, sys, threading

def signal_from_this_thread(path):
    while not os.path.exists(path):
        threading.Event().wait(0.02)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

threading.Thread(target=signal_from_this_thread, args=(sys.argv[2],), daemon=True).start()
sys.argv = sys.argv[1:2]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("name", ["worker.py", "maintenance.py"])
def test_an_example_closes_on_a_sigterm_handed_to_another_thread(
    database_url: str, schema: str, db: Conn, tmp_path: Path, name: str
) -> None:
    """Python runs a signal's handler on the main thread once that thread runs Python code:
    the examples' main thread waited in wait_until_closed() without a timeout, which only a
    signal delivered to that thread itself interrupts (CI: the maintenance example was still
    running 30 s after SIGTERM). On the main thread it waits in slices now."""
    go = tmp_path / "signal-now"
    live = q("select count(*) from {s}.maintenance_leases where expires_at > now()", schema)
    with example(database_url, schema, "-c", _SIGNAL_FROM_A_THREAD, name, str(go)) as proc:
        if name == "worker.py":
            assert proc.stdout is not None
            assert "SIGTERM or Ctrl-C stops it" in proc.stdout.readline()
        else:  # its handlers are installed before the services start
            wait_until(lambda: db.execute(live).fetchone() != (0,), timeout=30, what="a band owned")
        go.touch()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
