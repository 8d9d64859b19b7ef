"""The chaos soak's CI setting: a few thousand runs through every fault of the schedule.

``python -m tests.soak`` (see docs/soak.md) runs as a child process with its own Postgres
server (and broker for the RabbitMQ lane); it exits 0 only when every invariant held. The
schedule scales with the run count, so this small setting still injects every fault once:
worker SIGKILLs, a SIGSTOPped zombie, three Postgres restarts, terminate storms, a stalled
proxy, a killed maintenance replica, and skewed clocks under ``faketime``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runlane.cli._rabbit_host import rabbitmq_available, rabbitmq_test_verdict
from tests.soak.check import FAULTS

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _faketime_missing() -> str | None:
    if shutil.which("faketime") is None:
        return (
            "faketime is not installed: install it with `sudo apt-get install faketime` "
            "(Debian/Ubuntu); the soak runs a worker and a maintenance replica under it"
        )
    return None


def _require(reason: str | None) -> None:
    """Skip locally, fail under CI=true (where a skip would hide the soak), like the broker
    tests (``rabbitmq_test_verdict``)."""
    if reason is None:
        return
    if os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}:
        pytest.fail(f"CI=true and the soak needs it: {reason}", pytrace=False)
    pytest.skip(reason)


def _soak(tmp_path: Path, *args: str, timeout: float) -> dict[str, object]:
    figures = tmp_path / "figures.json"
    result = subprocess.run(
        [sys.executable, "-m", "tests.soak", *args, "--json", str(figures)],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    report = result.stdout[result.stdout.find("runlane chaos soak") :]
    assert result.returncode == 0, (
        f"the soak exited {result.returncode}\n{report}\n--- stderr (tail) ---\n"
        + "\n".join(result.stderr.splitlines()[-40:])
    )
    data: dict[str, object] = json.loads(figures.read_text())
    return data


def _check_figures(data: dict[str, object], runs: int) -> None:
    figures = data["figures"]
    assert isinstance(figures, dict)
    assert data["violations"] == []
    assert figures["runs lost"] == 0
    assert figures["failed for lack of attempts"] == 0
    assert figures["double completions"] == 0
    assert figures["stale writes applied"] == 0
    assert figures["statuses"] == {"completed": runs}
    assert figures["bounded queue max handlers at once"] <= figures["bounded queue limit"]
    assert set(figures["faults injected"]) == FAULTS, figures["faults injected"]
    assert figures["faults injected"]["postgres-restart"] == 3
    assert len(figures["postgres restarts"]) == 3
    # a worker and a maintenance replica started while Postgres was down: they waited for
    # it (a start that exited would be a violation, "no process exited on its own")
    (down,) = [r for r in figures["postgres restarts"] if r.get("started while down")]
    assert len(down["started while down"]) == 2, figures["postgres restarts"]
    skews = figures["process clocks against the database (s)"]
    # one hour behind and one ahead, as measured against the database (a loaded machine
    # can add a second to the measurement)
    assert len(skews) == 2, skews
    low, high = sorted(skews.values())
    assert abs(low + 3600) <= 5, skews
    assert abs(high - 3600) <= 5, skews
    # the faults met work: each kind of major fault began with runs open at least once (the
    # last of a schedule can begin after the trickle ended and the lane caught up), and the
    # worker kills (every few seconds, at random) cut running handlers short
    majors = figures["runs open when each major fault began"]
    assert len(majors) == 9, majors  # the zombie, three storms, three restarts, stall, failover
    met: dict[str, int] = {}
    for name, open_runs in majors:
        met[name] = max(met.get(name, 0), open_runs)
    assert all(open_runs > 0 for open_runs in met.values()), majors
    kills, meeting = figures["worker kills (all, meeting running handlers)"]
    assert kills >= 5, figures["worker kills (all, meeting running handlers)"]
    assert meeting >= 1, figures["worker kills (all, meeting running handlers)"]


@pytest.mark.timeout(240)
def test_polling_lane_soak(tmp_path: Path) -> None:
    _require(_faketime_missing())
    # 45 s: the major faults, one after another, take about 42 s of their own (the zombie's
    # freeze, the 8 s stall and outage, the failover's band lease); a longer trickle only
    # spread the same runs thinner, to the same faults and more CPU (docs/soak.md)
    data = _soak(tmp_path, "--lane", "polling", "--runs", "3000", "--duration", "45", timeout=220)
    _check_figures(data, 3000)


@pytest.mark.timeout(200)
def test_rabbitmq_lane_soak(tmp_path: Path) -> None:
    verdict, message = rabbitmq_test_verdict(rabbitmq_available())
    if verdict == "skip":
        pytest.skip(message)
    if verdict == "fail":
        pytest.fail(message, pytrace=False)
    _require(_faketime_missing())
    data = _soak(tmp_path, "--lane", "rabbitmq", "--runs", "2000", "--duration", "40", timeout=180)
    _check_figures(data, 2000)
