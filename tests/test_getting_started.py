"""docs/getting-started.md, followed word for word: its shell commands, in order, in a fresh
copy of the repository, each in a shell that keeps the previous commands' environment and
directory, with the files it says to create; a worker and a Flask app started where it says
so, in the background, and stopped with Ctrl-C (SIGINT). Nothing may print a traceback.

Four deviations, for running offline, side by side with other tests, and cheaply: ``pip
install`` gets ``--no-index --no-build-isolation`` and the new virtual environment sees this
one's packages through a ``.pth`` line (runlane itself is built and installed from the copy);
the venv is made ``--without-pip`` and its ``pip`` is this environment's pip, seen through the
same line (``ensurepip`` cost 6 CPU-s to install a pip and a setuptools too old to build
runlane, which the test then removed); Flask's port 5000 becomes a free port; ``RUN_ID``
becomes the id the app answered. ``HOME`` is a temporary directory, so
``runlane dev-db`` keeps its data there (as root, whose default is /var/lib/runlane/dev-db,
``RUNLANE_DEV_DB_DIR`` names the same place)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runlane.cli import main
from tests.helpers import poll
from tests.test_packaging import _checkout_copy

# end-to-end: installs, servers and subprocesses; past the suite's 120 s default on a busy
# machine, within their own steps' bounds
pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "getting-started.md"
FILE_HEADER = re.compile(r"# ([\w/]+\.py): ")
BACKGROUND = ("runlane worker ", "flask ")
# not seen by the guide's venv: what it installs itself (runlane) and the editable hook
OFFLINE = "--no-index --no-build-isolation"
SKIPPED = ("runlane", "__editable__", "__pycache__")


def steps() -> list[tuple[str, str]]:
    """The guide's steps in order: ("sh", one command line) and ("file", the python source of
    a block whose first line names the file, ``# name.py: ...``)."""
    text = GUIDE.read_text()
    found: list[tuple[str, str]] = []
    for kind, body in re.findall(r"^```(sh|python)\n(.*?)^```$", text, re.M | re.S):
        if kind == "python":
            if FILE_HEADER.match(body):
                found.append(("file", body))
            continue
        for line in body.splitlines():
            command = line.split("  #", 1)[0].strip()
            if command:
                found.append(("sh", command))
    return found


def test_the_guide_has_the_steps_this_test_follows() -> None:
    commands = [body for kind, body in steps() if kind == "sh"]
    assert commands[:3] == [
        "python3 -m venv .venv",
        ". .venv/bin/activate",
        "pip install '.[binary,embedded,web]'",
    ]
    assert "runlane dev-db start" in commands
    assert any(c.startswith("runlane worker ") for c in commands)
    assert any(c.startswith("flask ") for c in commands)
    assert sum(c.startswith("curl ") for c in commands) == 2
    assert commands[-1] == "runlane dev-db stop"
    files = [FILE_HEADER.match(body) for kind, body in steps() if kind == "file"]
    assert [m.group(1) for m in files if m] == ["jobs.py", "web.py"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Shell:
    """Runs one command at a time in bash, carrying the environment and the directory from
    one command to the next, as one terminal would."""

    def __init__(self, cwd: Path, env: dict[str, str], state: Path) -> None:
        self.cwd = cwd
        self.env = env
        self._state = state
        self.transcript: list[str] = []
        self.background: list[tuple[str, subprocess.Popen[str]]] = []

    def run(self, command: str, timeout: float = 300) -> str:
        script = (
            f"set -e\n{command}\n"
            f"env -0 > {shlex.quote(str(self._state))}.env\n"
            f"pwd > {shlex.quote(str(self._state))}.cwd\n"
        )
        result = subprocess.run(
            ["bash", "-c", script],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        self.transcript.append(f"$ {command}\n{result.stdout}{result.stderr}")
        assert result.returncode == 0, "\n".join(self.transcript[-3:])
        pairs = Path(f"{self._state}.env").read_text().split("\0")
        self.env = dict(p.split("=", 1) for p in pairs if "=" in p)
        self.cwd = Path(Path(f"{self._state}.cwd").read_text().strip())
        return result.stdout

    def start(self, command: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            ["bash", "-c", f"exec {command}"],
            cwd=self.cwd,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.background.append((command, proc))
        return proc

    def stop_background(self) -> None:
        """Ctrl-C for each background process (SIGINT to its process group), then its
        output into the transcript."""
        for command, proc in self.background:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
            try:
                out, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
            self.transcript.append(f"$ {command}  (exit {proc.returncode})\n{out}")
        self.background = []


def _wait_for_line(proc: subprocess.Popen[str], needle: str, seen: list[str]) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return
    raise AssertionError(f"no {needle!r} in:\n{''.join(seen)}")


def _wait_for_port(port: int, proc: subprocess.Popen[str]) -> None:
    def listening() -> bool:
        assert proc.poll() is None, "the app exited"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return False
        return True

    if not poll(listening, timeout=60, interval=0.1):
        raise AssertionError(f"nothing listens on port {port}")


@pytest.fixture
def workspace() -> Iterator[Path]:
    """A directory of its own, not pytest's tmp_path: other pytest sessions on the machine
    may prune it, or reset /tmp/pytest-of-<user> to mode 0700 under the PostgreSQL server
    (which runs as another user when the tests run as root); removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="runlane-guide-"))
    path.chmod(0o755)  # as root: dev-db refuses a data directory its server's user cannot reach
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shell(workspace: Path) -> Iterator[Shell]:
    missing = [tool for tool in ("curl", "bash") if shutil.which(tool) is None]
    if missing:
        message = f"the guide uses {' and '.join(missing)}: apt-get install {' '.join(missing)}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI must follow the guide", pytrace=False)
        pytest.skip(message)
    tmp_path = workspace
    clone = _checkout_copy(tmp_path / "runlane")
    home = tmp_path / "home"
    home.mkdir()
    bin_dir = tmp_path / "bin"  # this machine's python3, the one this venv was made from
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(getattr(sys, "_base_executable", sys.executable))
    here = str(Path(sys.executable).parent)
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != here]
    keep = ("PATH", "LANG", "LC_ALL", "TMPDIR", "CI")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env |= {"HOME": str(home), "PATH": os.pathsep.join([str(bin_dir), *path])}
    data = home / ".local" / "share" / "runlane" / "dev-db"
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env["RUNLANE_DEV_DB_DIR"] = str(data)
    started = Shell(clone, env, tmp_path / "state")
    try:
        yield started
    finally:
        started.stop_background()
        main(["dev-db", "stop", "--dir", str(data)])  # in this process: no interpreter to start


@pytest.mark.slow  # about a minute: a venv, an install, a new PostgreSQL data directory
def test_a_newcomer_follows_the_guide_word_for_word(shell: Shell) -> None:  # noqa: PLR0912
    port = _free_port()
    run_id: str | None = None
    worker_seen: list[str] = []
    for kind, body in steps():
        if kind == "file":
            name = FILE_HEADER.match(body)
            assert name is not None
            (shell.cwd / name.group(1)).write_text(body)
            continue
        command = body.replace("5000", str(port))
        if run_id is not None:
            command = command.replace("RUN_ID", run_id)
        if command == "python3 -m venv .venv":
            command = "python3 -m venv --without-pip .venv"
        if command.startswith("pip install "):
            command = command.replace(
                "pip install ", "pip install --no-index --no-build-isolation "
            )
        if command.startswith(BACKGROUND):
            proc = shell.start(command)
            if command.startswith("runlane worker "):
                _wait_for_line(proc, "SIGTERM or Ctrl-C stops it", worker_seen)
            else:
                _wait_for_port(port, proc)
            continue
        if command.startswith("curl ") and "/runs/" in command:
            # the guide: completed "once the worker has run it (at once, normally)"
            out = ""

            def completed(command: str = command) -> bool:
                nonlocal out
                out = shell.run(command)
                return '"completed"' in out

            assert poll(completed, timeout=30, interval=0.2), out
            answer = json.loads(out)
            assert answer == {"status": "completed", "output": {"sent_to": "ada@example.com"}}
            continue
        if command == "runlane dev-db stop":
            shell.stop_background()  # "stop the worker and the app with Ctrl-C", first
        out = shell.run(command)
        if command == "python3 -m venv --without-pip .venv":
            _offline_venv(shell)
        elif command.startswith("curl ") and "POST" in command:
            run_id = json.loads(out)["run_id"]
        elif command.startswith("runlane runs list"):
            assert re.search(rf"{run_id}\s+email\.send\s+email\s+completed\s+1/5", out), out
        elif command.startswith("runlane runs show"):
            assert "status           completed" in out, out
            assert "attempts         1 of 5 spent (4 left); latest #1" in out, out
        elif command == "runlane migrate":
            assert "schema runlane: applied" in out
    transcript = "\n".join(shell.transcript) + "".join(worker_seen)
    assert run_id is not None
    assert "Traceback" not in transcript, transcript
    assert f"run {run_id} completed" in transcript  # the worker's log line


def _offline_venv(shell: Shell) -> None:
    """The deviation for running offline: the new venv sees this environment's installed
    packages (not runlane: a view of symlinks, after its own packages) through a .pth line,
    and the ``pip`` and ``flask`` commands, which ``ensurepip`` and pip would install, are
    written (each runs its package as the venv's python: pip then installs into the venv)."""
    venv = shell.cwd / ".venv"
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    view = shell.cwd.parent / "dependencies"
    view.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(SKIPPED) and entry.suffix != ".pth":
            (view / entry.name).symlink_to(entry)
    Path(purelib, "zz_dependencies.pth").write_text(f"{view}\n")
    for command, main_of in (("pip", "pip._internal.cli.main"), ("flask", "flask.cli")):
        script = venv / "bin" / command
        script.write_text(f"#!{python}\nimport sys\nfrom {main_of} import main\nsys.exit(main())\n")
        script.chmod(0o755)
