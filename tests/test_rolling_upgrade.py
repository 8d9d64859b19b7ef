"""Expand/contract in practice: the previous release's code runs on the new schema.

The previous release is the package as it was just before the newest migration was added
(the newest commit that touched sql/migrations, one commit back), taken with ``git archive``
and imported by a child process through ``PYTHONPATH`` (the dependencies are this
environment's). The schema is migrated by the current code. Under load, an old worker and
an old producer run beside a current worker and producer; every run must complete exactly
once, and the old runtime must say that it runs on a newer schema. (Once a breaking
migration has been added since, the old runtime must refuse the schema, naming it.)

Needs the repository's history (a clone with ``fetch-depth: 0`` in CI); without it the test
fails and says so rather than passing untested.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from psycopg import sql

from runlane import RunContext, RunStatus, task
from runlane.postgres._compat import ADDITIVE, marker_of
from runlane.postgres._sql import load_migration_files
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, finish_process, wait_until

REPO = Path(__file__).resolve().parent.parent
MIGRATIONS = "runlane/postgres/sql/migrations"
RUNS_EACH = 150  # per producer (old and current)


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        pytest.fail(
            f"git {' '.join(args)} failed ({done.stderr.strip()}): this test needs the "
            "repository with its history (CI: clone with fetch-depth 0)",
            pytrace=False,
        )
    return done.stdout


def _migration_count(commit: str) -> int:
    names = _git("ls-tree", "--name-only", f"{commit}:{MIGRATIONS}").split()
    return sum(1 for name in names if name.endswith(".sql") and name[:4].isdigit())


def _migration_blobs(commit: str) -> dict[str, str]:
    listing = _git("ls-tree", f"{commit}:{MIGRATIONS}").splitlines()
    return {name: line.split()[2] for line in listing for name in [line.split("\t")[-1]]}


def _released(commit: str) -> bool:
    """False for a commit holding a migration file as no later commit has it (a released
    file never changes, migrations/README.md): a number taken by a first version of the
    file while the migration was written, not a release."""
    current = _migration_blobs("HEAD")
    return all(current.get(name) == blob for name, blob in _migration_blobs(commit).items())


def _has_compat(commit: str) -> bool:
    return bool(_git("ls-tree", "--name-only", commit, "runlane/postgres/_compat.py").strip())


def _compiles(commit: str) -> bool:
    """False for a commit whose package does not compile or whose lanes do not import (a
    half-applied commit in the history, such as one holding a module's new use without the
    name it uses, is no release to test against)."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", commit, "runlane"],
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            source = tar.extractfile(member) if member.name.endswith(".py") else None
            if source is None:
                continue
            try:
                compile(source.read(), member.name, "exec")
            except SyntaxError:
                return False
        with tempfile.TemporaryDirectory(prefix="runlane-release-") as root:
            tar.extractall(root, filter="data")
            imported = subprocess.run(
                [sys.executable, "-c", "import runlane, runlane.postgres"],
                env={**os.environ, "PYTHONPATH": root},
                cwd=root,
                capture_output=True,
                timeout=60,
                check=False,
            )
    return imported.returncode == 0


def _shallow() -> bool:
    done = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.returncode == 0 and done.stdout.strip() == "true"


def previous_release() -> str:
    """The newest commit, just before a migration was added, whose runtime reads the
    migrations' compatibility marks, whose schema is older than the current one and whose
    package compiles. A shallow clone has no such history: the test is skipped, saying so
    (.ci/run deepens a shallow clone first when its remote answers)."""
    if _shallow():
        pytest.skip("a shallow clone: the previous release is not in this history")
    current = len(load_migration_files())
    for commit in _git("rev-list", "HEAD", "--", MIGRATIONS).split():
        parents = _git("rev-list", "--parents", "-n", "1", commit).split()[1:]
        if not parents:
            continue
        before = parents[0]
        if (
            _has_compat(before)
            and _migration_count(before) < current
            and _released(before)
            and _compiles(before)
        ):
            return before
    pytest.fail(
        f"no commit in this history has a runtime that reads compatibility marks, compiles, "
        f"and a schema older than the current one ({current}): the history is shallow, or no "
        "migration was added since expand/contract support",
        pytrace=False,
    )


@pytest.fixture(scope="module")
def old_package(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    commit = previous_release()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", commit, "runlane"],
        capture_output=True,
        check=True,
    ).stdout
    root = tmp_path_factory.mktemp("previous-release")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    return commit, root


OLD_PROCESS = """
import logging, sys, threading
import runlane
from runlane import create_runlane, task
from runlane.postgres import postgres_polling_lane

assert runlane.__file__.startswith(sys.argv[3]), runlane.__file__
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
logging.getLogger("runlane.postgres").setLevel(logging.INFO)

go_on = threading.Event()

@task(id="upgrade.echo")
def echo(payload, context):
    go_on.wait(60)  # held until the current runtime ran one too: both take a share
    return {"n": payload["n"], "by": "old"}

app = create_runlane(
    lane=postgres_polling_lane(connection_string=sys.argv[1], schema=sys.argv[2]),
    tasks=[echo],
)
worker = app.create_delivery_worker(concurrency=4)
print("ready", flush=True)
sys.stdin.readline()  # "go": produce
app.trigger_many(echo, [{"n": 1000 + i} for i in range(int(sys.argv[4]))])
print("produced", flush=True)
sys.stdin.readline()  # "go on": the current runtime ran one
go_on.set()
sys.stdin.readline()  # closed: finish
worker.close(timeout=10)
app.close()
"""


current_ran = threading.Event()


@task(id="upgrade.echo")
def echo(payload: Any, context: RunContext) -> dict[str, Any]:
    current_ran.set()
    return {"n": payload["n"], "by": "new"}


def test_the_previous_release_runs_beside_the_current_one_on_the_new_schema(
    old_package: tuple[str, Path],
    make_runlane: RunlaneFactory,
    database_url: str,
    schema: str,
    db: Conn,
) -> None:
    current_ran.clear()
    commit, root = old_package
    old_version = _migration_count(commit)
    assert old_version < len(load_migration_files())
    env = {**os.environ, "PYTHONPATH": str(root)}
    breaking = [
        (version, name)
        for version, name, text in load_migration_files()
        if version > old_version and marker_of(text) != ADDITIVE
    ]
    if breaking:
        # a contract step since the previous release: its runtime must refuse, naming it
        done = subprocess.run(
            [sys.executable, "-c", OLD_PROCESS, database_url, schema, str(root), "1"],
            input="go\n",
            capture_output=True,
            text=True,
            env=env,
            cwd=root,
            timeout=120,
            check=False,
        )
        assert done.returncode != 0
        version, name = breaking[0]
        assert f"migration {version} ({name}) is marked breaking" in done.stderr
        return
    proc = subprocess.Popen(
        [sys.executable, "-c", OLD_PROCESS, database_url, schema, str(root), str(RUNS_EACH)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=root,
    )
    stderr: list[str] = []
    reader: threading.Thread | None = None
    try:
        assert proc.stdin is not None
        assert proc.stdout is not None
        assert proc.stderr is not None
        ready = proc.stdout.readline().strip()
        assert ready == "ready", proc.stderr.read()
        reader = threading.Thread(
            target=lambda: stderr.append(proc.stderr.read() if proc.stderr else ""),
            name="test-old-release-stderr",
        )
        reader.start()
        current = make_runlane(tasks=[echo])
        worker = current.create_delivery_worker(concurrency=4)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        handles = current.trigger_many(echo, [{"n": i} for i in range(RUNS_EACH)])
        assert proc.stdout.readline().strip() == "produced"
        assert current_ran.wait(30), "the current runtime ran none of the runs"
        proc.stdin.write("go on\n")
        proc.stdin.flush()
        total = 2 * RUNS_EACH
        query = sql.SQL("select count(*) from {}.runs where status = 'completed'").format(
            sql.Identifier(schema)
        )

        def completed() -> bool:
            row = db.execute(query).fetchone()
            return row is not None and row[0] == total

        wait_until(completed, timeout=60, what=f"{total} runs completed")
        worker.close(timeout=10)
    finally:
        finish_process(proc)
        if reader is not None:
            reader.join(10)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    assert proc.returncode == 0, "".join(stderr)
    rows = db.execute(
        sql.SQL(
            "select r.status, r.output ->> 'by', r.output ->> 'n', "
            "(select count(*) from {s}.attempts as a where a.run_id = r.id) "
            "from {s}.runs as r"
        ).format(s=sql.Identifier(schema))
    ).fetchall()
    assert len(rows) == total
    assert {status for status, _, _, _ in rows} == {"completed"}
    # each run executed once: one attempt, and every payload's number came back once
    assert {attempts for _, _, _, attempts in rows} == {1}
    numbers = sorted(int(n) for _, _, n, _ in rows)
    assert numbers == sorted([*range(RUNS_EACH), *range(1000, 1000 + RUNS_EACH)])
    by = {who for _, who, _, _ in rows}
    assert by == {"old", "new"}, f"only {by} executed runs: no load shared"
    assert current.get_run(handles[0].id).status is RunStatus.COMPLETED
    # the old runtime said it runs on a newer, additive schema
    log = "".join(stderr)
    assert f"newer than this runlane's {old_version}" in log, log
    assert "are additive, so this runtime runs on it" in log
