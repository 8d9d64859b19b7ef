"""Start the soak's processes by forking a process that has already imported them.

A soak restarts its workers a dozen times or more (every SIGKILL is followed by a new
process), and a new Python process spent about 0.6 CPU-s importing runlane, psycopg and the
soak before it did anything. ``python -m tests.soak.forkserver`` imports
``tests.soak.child`` once, then forks one process per request (a line on its stdin); each
fork starts its own session, writes to its own log and runs ``tests.soak.child.main`` as
``python -m tests.soak.child`` would. The server reports each fork's pid and, when it ends,
its exit status (negative: the signal that ended it, as ``Popen.returncode``).

A server started under ``faketime`` (libfaketime preloaded) forks children under the same
skewed clock: the library and its settings are inherited. The server stays single-threaded, so
forking is safe; random generators made at import are reseeded in each fork, as a new
process would seed its own.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]


# -- the server (its own process) -------------------------------------------------------------


def _run_child(settings: str, request: dict[str, Any]) -> int:
    from tests.soak import child  # noqa: PLC0415 - imported (preloaded) before the first fork

    argv = [request["role"], settings, request["proc"]]
    if request.get("url") is not None:
        argv += ["--url", request["url"]]
    return child.main(argv)


def _fork(settings: str, request: dict[str, Any], wakeup: tuple[int, int]) -> int:
    """Fork a child; returns its pid once it leads a session of its own (a signal to its
    group from then on reaches it)."""
    started_r, started_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(started_w)
        os.read(started_r, 1)  # its session exists (or it died trying: the read sees EOF)
        os.close(started_r)
        return pid
    code = 1
    try:
        os.close(started_r)
        os.setsid()  # its own group: the soak signals it alone
        os.write(started_w, b"s")
        os.close(started_w)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in wakeup:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(devnull)
        os.close(log)
        for generator in [o for o in gc.get_objects() if isinstance(o, random.Random)]:
            generator.seed()
        code = _run_child(settings, request)
    except BaseException:  # a fork must never return into the server's loop
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # it exits either way
                stream.flush()
        os._exit(code)


def serve(settings: str) -> int:
    """Fork a child for each request line until stdin closes."""
    import tests.soak.child  # noqa: F401, PLC0415 - the preload: what every fork would import

    if threading.active_count() != 1:
        print("the fork server has threads after its imports: forking is unsafe", flush=True)
        return 2
    # a child's end wakes the loop at once (the soak takes the time of a SIGKILLed worker's
    # death from it): SIGCHLD writes a byte to this pipe
    wakeup = os.pipe()
    for fd in wakeup:
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wakeup[1])
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    stdin = sys.stdin.fileno()
    buffer = b""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([stdin, wakeup[0]], [], [], 1.0)
        if wakeup[0] in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wakeup[0], 4096)
        if stdin in readable:
            chunk = os.read(stdin, 65536)
            if not chunk:
                return 0
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                pid = _fork(settings, json.loads(line), wakeup)
                children.add(pid)
                out.write(f"pid {pid}\n")
                out.flush()
        while children:  # reap whatever ended, and say so
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            out.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")
            out.flush()


# -- the client (in the soak's own process) ---------------------------------------------------


class Forked:
    """A forked child, watched like a ``subprocess.Popen``: ``pid``, ``poll``, ``wait``,
    ``returncode``."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server = server
        self.pid = pid
        self.args = f"fork {pid}"

    @property
    def returncode(self) -> int | None:
        return self.server.exit_status(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.server.wait_exit(self.pid, timeout, self.args)


class ForkServer:
    """A fork server process (started with ``env``, under ``wrapper`` when given, such as
    ``faketime -f +1h``) and its children's exit statuses."""

    def __init__(
        self, settings: Path, log: Path, env: dict[str, str], wrapper: list[str] | None = None
    ) -> None:
        command = [*(wrapper or []), sys.executable, "-m", "tests.soak.forkserver", str(settings)]
        self._cond = threading.Condition()
        self._pids: list[int] = []
        self._exits: dict[int, int] = {}
        self._closed = False
        self._request = threading.Lock()
        with log.open("ab") as err:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                cwd=REPO,
                env=env,
                start_new_session=True,
            )
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self._stdin: IO[bytes] = self.process.stdin
        first = self.process.stdout.readline()
        if first.strip() != b"ready":
            self.process.kill()
            self.process.wait(30)
            raise RuntimeError(f"the fork server did not start ({first!r}): see {log}")
        self._reader = threading.Thread(
            target=self._read, args=(self.process.stdout,), name="soak-forkserver", daemon=True
        )
        self._reader.start()

    def _read(self, stdout: IO[bytes]) -> None:
        for raw in stdout:
            kind, *values = raw.decode().split()
            with self._cond:
                if kind == "pid":
                    self._pids.append(int(values[0]))
                elif kind == "exit":
                    self._exits[int(values[0])] = int(values[1])
                self._cond.notify_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def spawn(self, role: str, proc: str, log: Path, url: str | None = None) -> Forked:
        request = {"role": role, "proc": proc, "log": str(log), "url": url}
        with self._request:  # one request at a time: the next pid line is its answer
            self._stdin.write(json.dumps(request).encode() + b"\n")
            self._stdin.flush()
            with self._cond:
                if not self._cond.wait_for(lambda: self._pids or self._closed, timeout=30):
                    raise RuntimeError(f"the fork server did not fork {proc} within 30 s")
                if not self._pids:
                    raise RuntimeError(f"the fork server exited before forking {proc}")
                return Forked(self, self._pids.pop(0))

    def exit_status(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None, what: str) -> int:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self._closed, timeout=timeout)
            if pid in self._exits:
                return self._exits[pid]
        raise subprocess.TimeoutExpired(what, timeout or 0.0)

    def close(self, timeout: float = 10.0) -> None:
        """Close its stdin (it exits) and wait for it; its children are the soak's to stop."""
        with contextlib.suppress(OSError):
            self._stdin.close()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
        self._reader.join(timeout)


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
