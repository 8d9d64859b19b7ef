"""``runlane demo --lane rabbitmq``: the demo's runs go through a RabbitMQ broker to a worker,
on a private node it starts (and removes) itself, or on the broker named by ``--amqp-url``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import runlane.cli._demo
from runlane.cli import EXIT_CONFIGURATION, main
from runlane.cli._rabbit_host import port_open, rabbitmq_available
from tests.conftest import require_rabbitmq

RUN_LINE = re.compile(r"^  [0-9a-f-]{36}  (completed|failed)\s+(.*)$")


def _demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "RUNLANE_AMQP_URL"}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "runlane.cli", "demo", "--lane", "rabbitmq", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=environ,
        check=False,
    )


def _check_output(out: str, runs: int, schema: str) -> None:
    lines = out.splitlines()
    assert f"schema {schema} at version" in out
    assert f"triggered {runs + 1} runs; publishing them to 127.0.0.1:" in out
    assert f"a worker consuming runlane.{schema}.default.demo executed {runs + 1} runs" in out
    results = [m.groups() for m in map(RUN_LINE.match, lines) if m]
    assert [status for status, _ in results] == ["completed"] * runs + ["failed"]
    assert [detail for _, detail in results[:runs]] == [
        str({"n": n, "square": n * n}) for n in range(runs)
    ]
    assert results[-1][1] == "negative numbers are refused"
    assert re.search(r"pending outbox items: 0; broker reachable at 127\.0\.0\.1:\d+", out)


def test_demo_starts_a_private_broker_and_runs_through_it(
    database_url: str, fresh_schema: str, tmp_path: Path
) -> None:
    require_rabbitmq(rabbitmq_available())
    temp = tmp_path / "tmp"  # where the demo's node makes its directory
    temp.mkdir()
    done = _demo(
        "--database-url",
        database_url,
        "--schema",
        fresh_schema,
        "--runs",
        "4",
        env={"TMPDIR": str(temp)},
    )
    assert done.returncode == 0, done.stderr
    assert "starting a private RabbitMQ node (rabbitmq-server) ..." in done.stdout
    _check_output(done.stdout, 4, fresh_schema)
    # the node's cleanup(): the running node is gone (its port closed) and its directory
    # deleted (the node tests check cleanup() of a node never started)
    port = re.search(r"broker reachable at 127\.0\.0\.1:(\d+)", done.stdout)
    assert port is not None
    assert not port_open(int(port.group(1)))
    assert list(temp.iterdir()) == []


def test_demo_uses_the_broker_given_by_amqp_url(
    database_url: str, fresh_schema: str, rabbitmq_url: str
) -> None:
    done = _demo(
        "--database-url",
        database_url,
        "--schema",
        fresh_schema,
        "--runs",
        "3",
        env={"RUNLANE_AMQP_URL": rabbitmq_url},
    )
    assert done.returncode == 0, done.stderr
    assert "starting a private RabbitMQ node" not in done.stdout
    _check_output(done.stdout, 3, fresh_schema)
    # the broker's credentials are never printed
    assert rabbitmq_url not in done.stdout + done.stderr


def test_demo_without_rabbitmq_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("RUNLANE_AMQP_URL", raising=False)
    monkeypatch.setattr(
        runlane.cli._demo,
        "rabbitmq_available",
        lambda: "install it: apt-get install rabbitmq-server",
    )
    # refused before any database is started or touched
    url = "postgresql://nobody@127.0.0.1:1/none"
    assert main(["demo", "--lane", "rabbitmq", "--database-url", url]) == EXIT_CONFIGURATION
    err = capsys.readouterr().err
    assert "cannot start a RabbitMQ node for the demo" in err
    assert "apt-get install rabbitmq-server" in err


def test_demo_rejects_an_unknown_lane(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--lane", "kafka"])
    assert exited.value.code == 2
    assert "invalid choice: 'kafka'" in capsys.readouterr().err
