"""Private RabbitMQ nodes (one, or a cluster) on loopback from the Debian rabbitmq-server
package, for runlane's own tests, benchmarks and ``runlane demo --lane rabbitmq``. Not public:
runlane's users run their own broker."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import itertools
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from runlane.cli._rabbit_host import (
    ERL_CALL,
    RABBITMQ_SERVER,
    RABBITMQ_START_TIMEOUT,
    RABBITMQ_USER,
    RABBITMQCTL,
    erlang_path,
    free_port,
    port_open,
    rabbit_applications,
    rabbitmq_available,
    shared_epmd_port,
)
from runlane.toolkit import Backoff, Deadline

__all__ = ["RabbitNode", "create_rabbitmq_node", "start_rabbitmq_cluster", "start_rabbitmq_node"]

_lock = threading.Lock()
_node_counter = itertools.count(1)
_LISTENER_RETRIES = 4  # starts of a node whose AMQP or distribution port was unavailable
# past a boot's own bound (each node.start keeps to its timeout), what a join waits more
_BOOT_JOIN_ALLOWANCE = 30.0


class RabbitNode:
    """One private RabbitMQ node (see :func:`start_rabbitmq_node`).

    ``stop()`` is graceful, ``terminate()`` sends SIGTERM without waiting, ``kill()`` SIGKILLs
    the broker's whole process group (the Erlang VM and its helper processes); ``start()``
    starts it again on the same data directory and ports. ``cleanup()`` stops it and deletes
    its directory (also run at exit). Not thread-safe: one owner drives it.
    """

    def __init__(
        self,
        base: Path,
        *,
        name: str,
        port: int,
        dist_port: int,
        password: str,
        cookie: str,
    ) -> None:
        self.base = base
        self.nodename = name
        self.port = port
        self.dist_port = dist_port
        self.user = RABBITMQ_USER
        self._password = password
        self.amqp_url = f"amqp://{self.user}:{password}@127.0.0.1:{port}/%2F"
        self.log_file = base / "log" / f"{name}.log"
        self.console_log = base / "console.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._cleaned = False
        (base / "mnesia").mkdir()
        (base / "log").mkdir()
        # An empty env file: /etc/rabbitmq/rabbitmq-env.conf is not read.
        (base / "rabbitmq-env.conf").write_text("")
        (base / "enabled_plugins").write_text("[].\n")
        self._plugins_dir: Path | None = None
        applications = rabbit_applications()
        if applications:  # the broker's own applications, no optional plugin (see above)
            self._plugins_dir = base / "plugins"
            self._plugins_dir.mkdir()
            for application in applications:
                (self._plugins_dir / application.name).symlink_to(application)
        (base / "rabbitmq.conf").write_text(
            "\n".join(
                [
                    f"listeners.tcp.default = {port}",
                    f"default_user = {self.user}",
                    f"default_pass = {password}",
                    "default_vhost = /",
                    "loopback_users = none",
                    "disk_free_limit.absolute = 1MB",
                    "log.console = false",
                    "log.file.level = info",
                    "",
                ]
            )
        )
        cookie_file = base / ".erlang.cookie"
        cookie_file.write_text(cookie)
        cookie_file.chmod(0o400)
        self.env = self._environment()
        atexit.register(self.cleanup)

    def join_at_boot(self, seed: str) -> None:
        """Have the node join ``seed``'s cluster on its first boot (RabbitMQ's classic-config
        peer discovery; ``seed`` must be running by then). A node restarted later rejoins
        from its own data directory, as before."""
        if self._process is not None:
            raise RuntimeError(f"{self.nodename} has started: it joins a cluster at first boot")
        config = self.base / "rabbitmq.conf"
        config.write_text(
            config.read_text()
            + "cluster_formation.peer_discovery_backend = classic_config\n"
            + f"cluster_formation.classic_config.nodes.1 = {seed}\n"
        )

    def __repr__(self) -> str:  # never the password
        return f"RabbitNode({self.nodename!r}, port={self.port}, running={self.running})"

    def _environment(self) -> dict[str, str]:
        base = self.base
        epmd_port = shared_epmd_port()
        env = {
            "PATH": erlang_path(),
            "HOME": str(base),  # the Erlang cookie, for the server and rabbitmqctl alike
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "ERL_EPMD_PORT": str(epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "ERL_CRASH_DUMP": str(base / "erl_crash.dump"),
            "RABBITMQ_NODENAME": self.nodename,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CONF_ENV_FILE": str(base / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(base / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(base / "advanced.config"),  # absent on purpose
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(base / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(base / "log"),
            "RABBITMQ_PID_FILE": str(base / "rabbitmq.pid"),
            # rabbitmqctl's own distribution port: any free one (the default range is shared).
            "RABBITMQ_CTL_DIST_PORT_MIN": "0",
            "RABBITMQ_CTL_DIST_PORT_MAX": "0",
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-start_epmd false",
            "RABBITMQ_CTL_ERL_ARGS": "-start_epmd false",
        }
        if self._plugins_dir is not None:
            env["RABBITMQ_PLUGINS_DIR"] = str(self._plugins_dir)
        return env

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        """The Erlang VM's process id while the node runs (None when it does not)."""
        if not self.running:
            return None
        try:
            return int((self.base / "rabbitmq.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def start(self, timeout: float = RABBITMQ_START_TIMEOUT) -> float:
        """Start the node (again) and wait until it accepts AMQP connections; returns the
        seconds that took."""
        if self._cleaned:
            raise RuntimeError(f"{self.nodename} was cleaned up")
        if self.running:
            return 0.0
        began = time.monotonic()
        backoff = Backoff(first=1.0, cap=2.0)  # about 0.5-1 s, then 1-2 s
        for attempt in range(_LISTENER_RETRIES):
            (self.base / "rabbitmq.pid").unlink(missing_ok=True)
            with self.console_log.open("ab") as console:
                written = console.tell()
                self._process = subprocess.Popen(
                    [str(RABBITMQ_SERVER)],
                    stdin=subprocess.DEVNULL,
                    stdout=console,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    cwd=self.base,
                    start_new_session=True,  # its own process group: kill() reaches every child
                )
            try:
                self.wait_ready(timeout - (time.monotonic() - began))
            except RuntimeError:
                if attempt + 1 == _LISTENER_RETRIES:
                    raise
                if "dist_port_already_used" in self._console_since(written):
                    # the distribution port, free when the node was made, was taken since
                    # (any process's outgoing connection may get it): take another; peers
                    # find a node's distribution port through epmd
                    self.dist_port = free_port()
                    self.env["RABBITMQ_DIST_PORT"] = str(self.dist_port)
                    continue
                # the port of a node just killed can still be held for a moment (or taken
                # by another test's probe): its listener fails and the node exits; retry
                if "TCP listener" not in self.log_tail():
                    raise
                time.sleep(backoff.next())
            else:
                break
        return time.monotonic() - began

    def wait_ready(self, timeout: float = RABBITMQ_START_TIMEOUT) -> None:
        """Wait until the node accepts an AMQP connection (TCP first, then a real login)."""
        pika: Any = importlib.import_module("pika")
        deadline = time.monotonic() + max(timeout, 1.0)
        last_error: Exception | None = None
        while True:
            process = self._process
            if process is None or process.poll() is not None:
                code = None if process is None else process.returncode
                raise RuntimeError(
                    f"RabbitMQ node {self.nodename} exited (status {code}) before accepting "
                    f"connections\n{self.log_tail()}"
                )
            if port_open(self.port):
                try:
                    connection = pika.BlockingConnection(self.connection_parameters())
                except Exception as exc:
                    last_error = exc
                else:
                    connection.close()
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"RabbitMQ node {self.nodename} did not accept AMQP connections on "
                    f"127.0.0.1:{self.port} within {timeout:.0f} s (last error: "
                    f"{type(last_error).__name__ if last_error else 'port closed'})\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.1)

    def connection_parameters(self, **options: Any) -> Any:
        """``pika.ConnectionParameters`` for this node (defaults: short timeouts)."""
        pika: Any = importlib.import_module("pika")
        settings: dict[str, Any] = {
            "socket_timeout": 5,
            "connection_attempts": 1,
            "blocked_connection_timeout": 30,
        }
        settings.update(options)
        return pika.ConnectionParameters(
            host="127.0.0.1",
            port=self.port,
            virtual_host="/",
            credentials=pika.PlainCredentials(self.user, self._password),
            **settings,
        )

    def stop(self, timeout: float = 60.0) -> None:
        """Graceful stop (SIGTERM: the broker shuts down cleanly) and wait until the VM and its
        helper processes are gone; SIGKILL if it outlives ``timeout``."""
        process = self._process
        if process is None:
            return
        members = self._members()
        self.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return
        if not _wait_gone(members, timeout=10):
            self.kill()

    def terminate(self) -> None:
        """SIGTERM to the broker (it shuts down gracefully); does not wait."""
        process = self._process
        if process is not None and process.poll() is None:
            pid = self.pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid if pid is not None else process.pid, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the Erlang VM and every process under it (erl_child_setup, inet_gethost,
        port programs), wait until they are gone."""
        process = self._process
        if process is None:
            return
        members = self._members()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        for pid in members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        process.wait(timeout=30)
        if not _wait_gone(members, timeout=30):
            raise RuntimeError(f"processes of {self.nodename} outlived SIGKILL: {members}")

    def _members(self) -> set[int]:
        """The wrapper script, the VM and their descendants (now)."""
        members: set[int] = set()
        if self._process is not None and self._process.poll() is None:
            members |= _process_tree(self._process.pid)
        pid = self.pid
        if pid is not None:
            members |= _process_tree(pid)
        return members

    def cleanup(self) -> None:
        """Stop the node (SIGKILL: its data is deleted anyway) and delete its directory."""
        if self._cleaned:
            return
        self._cleaned = True
        with contextlib.suppress(Exception):
            self.kill()
        shutil.rmtree(self.base, ignore_errors=True)
        atexit.unregister(self.cleanup)

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """Run ``rabbitmqctl -n <this node> <args>``; returns its output, raises on failure."""
        result = subprocess.run(
            [str(RABBITMQCTL), "-n", self.nodename, *args],
            env=self.env,
            cwd=self.base,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"rabbitmqctl {' '.join(args)} on {self.nodename} failed "
                f"(status {result.returncode}): "
                f"{result.stderr.decode(errors='replace').strip()}"
                f"{result.stdout.decode(errors='replace').strip()}"
            )
        return result.stdout.decode(errors="replace")

    def evaluate(self, expression: str, timeout: float = 30.0) -> Any:
        """Evaluate an Erlang ``expression`` on the running node and return its value, which
        must encode as JSON (``rabbit_json``), decoded. Through ``erl_call``, a small C
        program speaking Erlang distribution (the cookie from HOME, as ``ctl``): a query costs
        milliseconds of CPU, where ``ctl`` starts an Erlang VM (about 0.7 CPU-seconds a
        call). Raises on failure."""
        script = f"binary_to_list(rabbit_json:encode(begin {expression} end)).\n"
        result = subprocess.run(
            [
                ERL_CALL,
                "-sname",
                self.nodename,
                "-timeout",
                str(max(1, round(timeout))),
                "-e",
            ],
            input=script.encode(),
            env=self.env,
            cwd=self.base,
            capture_output=True,
            timeout=timeout + 5.0,
            check=False,
        )
        out = result.stdout.decode(errors="replace").strip()
        if result.returncode != 0 or not (out.startswith('{ok, "') and out.endswith('"}')):
            raise RuntimeError(
                f"erl_call on {self.nodename} failed (status {result.returncode}): "
                f"{result.stderr.decode(errors='replace').strip()}{out}"
            )
        return json.loads(out[len('{ok, "') : -len('"}')])

    def running_nodes(self) -> list[str]:
        """The cluster's running members, as this node counts them (as ``rabbitmqctl
        cluster_status`` lists them under running nodes)."""
        nodes: list[str] = self.evaluate("rabbit_nodes:all_running()")
        return nodes

    def queue_members(self, name: str) -> dict[str, Any] | None:
        """A quorum queue of the default virtual host as this node sees it: its ``leader``,
        ``members`` and ``online`` members (as ``rabbitmqctl list_queues`` lists them);
        None when there is no such queue."""
        found: dict[str, Any] | None = self.evaluate(
            'case rabbit_amqqueue:lookup(rabbit_misc:r(<<"/">>, queue, '
            f"<<{_erlang_string(name)}/utf8>>)) of "
            "{ok, Q} -> maps:from_list(rabbit_amqqueue:info(Q, [leader, members, online])); "
            "_ -> null end"
        )
        return found

    def _console_since(self, offset: int) -> str:
        """The node's console output written after ``offset`` bytes."""
        try:
            with self.console_log.open("rb") as console:
                console.seek(offset)
                return console.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the node's log and console output, for error messages."""
        parts = []
        for path in (self.log_file, self.console_log):
            try:
                text = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            parts.append(f"--- {path} (last {len(text)} lines) ---\n" + "\n".join(text))
        return "\n".join(parts) or "(no log written)"


def _erlang_string(text: str) -> str:
    """``text`` as an Erlang string literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    if not escaped.isprintable():
        raise ValueError(f"not a printable name: {text!r}")
    return f'"{escaped}"'


def _process_tree(root: int) -> set[int]:
    """``root`` and its descendants (Linux /proc), those alive now."""
    found: set[int] = set()
    pending = [root]
    while pending:
        pid = pending.pop()
        if pid in found or _gone(pid):
            continue
        found.add(pid)
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            with contextlib.suppress(OSError, ValueError):
                pending.extend(int(child) for child in task.read_text().split())
    return found


def _gone(pid: int) -> bool:
    """The process has exited: no thread of it is left but a zombie (a SIGKILLed VM's leader
    thread turns zombie while its other threads still hold its sockets)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return True
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        if stat.rpartition(")")[2].split()[0] not in {"Z", "X"}:
            return False
    return True


def _wait_gone(pids: set[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while any(not _gone(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _new_node(
    parent: Path | None, name: str | None, cookie: str | None = None, password: str | None = None
) -> RabbitNode:
    with _lock:
        serial = next(_node_counter)
    nodename = name or f"runlane-{os.getpid()}-{serial}@localhost"
    if "@" not in nodename:
        nodename += "@localhost"
    base = Path(tempfile.mkdtemp(prefix="runlane-rabbitmq-", dir=parent))
    try:
        return RabbitNode(
            base,
            name=nodename,
            port=free_port(),
            dist_port=free_port(),
            password=password or secrets.token_hex(16),
            cookie=cookie or secrets.token_hex(20).upper(),
        )
    except BaseException:
        shutil.rmtree(base, ignore_errors=True)
        raise


def create_rabbitmq_node(parent: Path | None = None, *, name: str | None = None) -> RabbitNode:
    """A private node set up (directory, ports, user, config) but not started: its
    ``amqp_url`` names a broker that is down until ``start()`` (for tests of a broker that is
    unreachable at first). ``cleanup()`` or process exit deletes it."""
    reason = rabbitmq_available()
    if reason is not None:
        raise RuntimeError(reason)
    return _new_node(parent, name)


def start_rabbitmq_node(
    parent: Path | None = None, *, name: str | None = None, timeout: float = RABBITMQ_START_TIMEOUT
) -> tuple[str, RabbitNode]:
    """Start a private RabbitMQ node on 127.0.0.1 in a fresh directory (under ``parent``, or
    the system temp dir); returns its AMQP URL (with a user and password of its own) and the
    node handle, once it accepts AMQP connections. The node is killed and its directory
    deleted by ``cleanup()`` or at process exit. Needs the Debian ``rabbitmq-server`` package
    and pika (:func:`rabbitmq_available` says what is missing)."""
    node = create_rabbitmq_node(parent, name=name)
    try:
        node.start(timeout)
    except BaseException:
        node.cleanup()
        raise
    return node.amqp_url, node


def _start_together(nodes: list[RabbitNode], timeout: float) -> None:
    """Boot nodes in parallel (a boot is mostly waiting); raises the first failure."""
    errors: list[BaseException] = []

    def boot(node: RabbitNode) -> None:
        try:
            node.start(timeout)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(
            target=boot, args=(node,), name=f"runlane-boot-{node.nodename}", daemon=True
        )
        for node in nodes
    ]
    deadline = Deadline(timeout + _BOOT_JOIN_ALLOWANCE)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(deadline.left())
    late = [thread.name for thread in threads if thread.is_alive()]
    if errors:
        raise errors[0]
    if late:  # node.start is bounded by timeout: this is a node stuck past its own bound
        raise RuntimeError(f"RabbitMQ nodes did not boot within {timeout:g}s: {late}")


def start_rabbitmq_cluster(
    size: int = 3, parent: Path | None = None, *, timeout: float = RABBITMQ_START_TIMEOUT
) -> list[RabbitNode]:
    """Start ``size`` private nodes (see :func:`start_rabbitmq_node`) sharing one Erlang
    cookie, and join the others to the first: one cluster on loopback, each node with its own
    AMQP port. Quorum queues need three nodes to survive the loss of one."""
    if size < 1:
        raise ValueError("a cluster needs at least one node")
    reason = rabbitmq_available()
    if reason is not None:
        raise RuntimeError(reason)
    # One cookie (Erlang distribution) and one password (joined nodes share the first one's
    # user database) for every node.
    cookie = secrets.token_hex(20).upper()
    password = secrets.token_hex(16)
    nodes: list[RabbitNode] = []
    try:
        for _ in range(size):
            nodes.append(_new_node(parent, None, cookie, password))
        first = nodes[0]
        # the first node boots alone; the others, together, join it as they boot (rather
        # than by stop_app, join_cluster and start_app: three rabbitmqctl calls each, each
        # an Erlang VM of its own)
        first.start(timeout)
        for node in nodes[1:]:
            node.join_at_boot(first.nodename)
        _start_together(nodes[1:], timeout)
        _wait_joined(first, nodes, timeout)
    except BaseException:
        for node in nodes:
            node.cleanup()
        raise
    return nodes


def _wait_joined(first: RabbitNode, nodes: list[RabbitNode], timeout: float) -> None:
    """Wait until ``first`` counts every one of ``nodes`` as a running member."""
    deadline = time.monotonic() + timeout
    while True:
        running = set(first.running_nodes())
        missing = [node.nodename for node in nodes if node.nodename not in running]
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"RabbitMQ nodes did not join {first.nodename}: {missing}")
        time.sleep(0.5)
