"""What a private RabbitMQ node needs of this host (see :mod:`runlane.cli._rabbit_nodes`):
the Debian rabbitmq-server package's programs and applications, free loopback ports outside
the ephemeral range, and this process's one epmd; whether a node can start here at all."""

from __future__ import annotations

import atexit
import functools
import importlib
import os
import re
import secrets
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

__all__ = [
    "ERL_CALL",
    "RABBITMQCTL",
    "RABBITMQ_INSTALL_COMMAND",
    "RABBITMQ_SERVER",
    "RABBITMQ_START_TIMEOUT",
    "RABBITMQ_USER",
    "erlang_path",
    "free_port",
    "port_open",
    "rabbit_applications",
    "rabbitmq_available",
    "rabbitmq_test_verdict",
    "shared_epmd_port",
]

# --- RabbitMQ: private broker nodes on loopback from the Debian ``rabbitmq-server`` package ---
#
# Each node runs ``/usr/lib/rabbitmq/bin/rabbitmq-server`` directly (not the /usr/sbin wrapper,
# which switches to the rabbitmq user, and never the system service) in a fresh directory of its
# own: data, logs, config, Erlang cookie (HOME), plugins file (none enabled). Nodes listen on
# 127.0.0.1 only. Node discovery goes through one private epmd per Python process, on a free
# loopback port, started with the first node and stopped at exit after every node; no node
# starts or uses the machine's shared epmd on port 4369.
#
# A node's plugins directory holds links to the broker's own applications only (``rabbit`` and
# what its .app files name, from the package's plugins directory), not the 40-odd optional
# plugins none of these nodes enables: the VM then searches fewer directories for each of the
# ~1,500 modules it loads at boot, and reads no optional plugin's configuration schema (a
# boot took 4.4-4.9 CPU-seconds of the VM instead of 5.6-5.95, measured alternating).

RABBITMQ_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
RABBITMQCTL = Path("/usr/lib/rabbitmq/bin/rabbitmqctl")
EPMD = "epmd"
ERL_CALL = "erl_call"
RABBITMQ_INSTALL_COMMAND = "apt-get install rabbitmq-server"
RABBITMQ_START_TIMEOUT = 90.0
RABBITMQ_USER = "runlane"

_epmd_lock = threading.Lock()
_epmd: subprocess.Popen[bytes] | None = None
_epmd_port: int | None = None


# an application's directory in the plugins directory (name-version), and the lists of
# applications an .app file names
_APP_DIR = re.compile(r"^([a-z][a-z0-9_]*)-[0-9][^/]*$")
_APP_LISTS = re.compile(r"\{\s*(?:included_)?applications\s*,\s*\[([^\]]*)\]")


@functools.cache
def rabbit_applications() -> tuple[Path, ...]:
    """The entries of the package's plugins directory the broker itself runs: ``rabbit`` and
    every application its .app files name (required or included), found by following them;
    empty when the package is not laid out as expected (the node then uses the whole
    directory)."""
    return tuple(_dependency_closure("rabbit"))


def _dependency_closure(root: str) -> list[Path]:
    try:
        plugins = RABBITMQ_SERVER.resolve().parent.parent / "plugins"
        entries = {
            match.group(1): entry
            for entry in plugins.iterdir()
            if (match := _APP_DIR.match(entry.name)) is not None and entry.is_dir()
        }
    except OSError:
        return []
    found: dict[str, Path] = {}
    pending = [root]
    while pending:
        name = pending.pop()
        if name in found or name not in entries:
            continue  # seen, or an OTP application (on the VM's own code path)
        found[name] = entries[name]
        try:
            app = (entries[name] / "ebin" / f"{name}.app").read_text(errors="replace")
        except OSError:
            return []
        for listed in _APP_LISTS.findall(app):
            pending.extend(part.strip() for part in listed.split(",") if part.strip())
    return sorted(found.values()) if root in found else []


def rabbitmq_available() -> str | None:
    """None when a private RabbitMQ node can be started here, else a one-line reason saying
    what to install."""
    for program in (RABBITMQ_SERVER, RABBITMQCTL):
        if not os.access(program, os.X_OK):
            return (
                f"RabbitMQ is not installed ({program} not found): install it with "
                f"`sudo {RABBITMQ_INSTALL_COMMAND}` (Debian/Ubuntu), "
                "or set RUNLANE_TEST_AMQP_URL to a broker of your own"
            )
    for tool in (EPMD, ERL_CALL):
        if shutil.which(tool, path=erlang_path()) is None:
            return (
                f"Erlang's {tool} is not on PATH: install RabbitMQ with its dependencies: "
                f"`sudo {RABBITMQ_INSTALL_COMMAND}`"
            )
    try:
        importlib.import_module("pika")
    except ImportError:
        return "the pika package is not installed: pip install -e '.[dev]' (or '.[rabbitmq]')"
    return None


def rabbitmq_test_verdict(
    reason: str | None, environ: Mapping[str, str] | None = None
) -> tuple[Literal["run", "skip", "fail"], str]:
    """What a test needing a broker does when ``reason`` (from :func:`rabbitmq_available`)
    says none can be started: run (no reason), skip locally, fail under CI (``CI=true``), where
    a skip would hide tests that were meant to run."""
    if reason is None:
        return "run", ""
    env = os.environ if environ is None else environ
    if env.get("CI", "").strip().lower() in {"true", "1", "yes"}:
        return "fail", f"CI=true and a RabbitMQ broker is required: {reason}"
    return "skip", reason


def erlang_path() -> str:
    return os.environ.get("PATH") or os.defpath


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux; else the usual)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free port on 127.0.0.1 outside the kernel's ephemeral range. A port picked by
    binding port 0 lies inside it, where any outgoing connection may take it before the node
    (re)starts: a client reconnecting to a stopped node on 127.0.0.1 can even be given the
    node's own port and connect to itself, holding it."""
    low, high = ephemeral_ports()
    ranges = [r for r in (range(10_000, low), range(high + 1, 65_536)) if len(r) > 1_000]
    for _ in range(100):
        if not ranges:
            break
        port = secrets.choice(secrets.choice(ranges))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use: try another
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int) -> bool:
    """Whether something accepts TCP connections on this loopback port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def shared_epmd_port() -> int:
    """This process's private epmd (started once, stopped at exit after every node)."""
    global _epmd, _epmd_port  # noqa: PLW0603 - one epmd per process, like the atexit hook
    with _epmd_lock:
        if _epmd is not None and _epmd.poll() is None and _epmd_port is not None:
            return _epmd_port
        port = free_port()
        _epmd = subprocess.Popen(
            [EPMD, "-port", str(port), "-address", "127.0.0.1"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env={"PATH": erlang_path()},
        )
        _epmd_port = port
        atexit.register(_stop_epmd, _epmd)  # registered before any node: runs after them
    deadline = time.monotonic() + 10
    while not port_open(port):
        if _epmd.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"epmd did not start on 127.0.0.1:{port}")
        time.sleep(0.02)
    return port


def _stop_epmd(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(timeout=10)
