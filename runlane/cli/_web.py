"""``runlane web [APP | --database-url URL] [--bind 127.0.0.1:8080]``: the console served by
waitress, a pure-Python WSGI server with a fixed thread pool (the model runlane's threaded
runtime is built for). It binds to loopback unless told otherwise: the console still shows
payloads and errors.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from runlane.cli._signals import stop_requested
from runlane.cli._target import TARGET_HELP, LoadApp, Target, add_target_options, target_runtime
from runlane.errors import ConfigurationError
from runlane.toolkit import as_int, shown

__all__ = ["DEFAULT_BIND", "add_web_command", "listening", "parse_bind", "serve_app", "serve_until"]

DEFAULT_BIND = "127.0.0.1:8080"

log = logging.getLogger("runlane.web")

T = TypeVar("T")

_MAX_THREADS = 256  # the console's request threads
_TURN_SECONDS = 0.5  # the longest a turn of the server's loop waits for a socket


def parse_bind(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8080`` for IPv6) as (host, port); a ConfigurationError says
    what is wrong."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigurationError(
            f"--bind must be HOST:PORT with a port from 1 to 65535 (e.g. 127.0.0.1:8080, or "
            f"[::1]:8080), got {shown(value, 80)}"
        )
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port_text)


def _serve(load_app: LoadApp, args: argparse.Namespace) -> int:
    host, port = parse_bind(args.bind)
    as_int("--threads", args.threads, 1, _MAX_THREADS)
    try:
        import waitress.server  # noqa: F401, PLC0415 - only whether the extra is there
    except ImportError:
        raise ConfigurationError(
            "the web console needs its extra: pip install 'runlane[web]'"
        ) from None
    from runlane.web import create_app, environment_login  # noqa: PLC0415 - the web extra

    login = environment_login(os.environ)  # a token or basic auth: the console acts
    proxied = args.proxy_headers or _env_flag("RUNLANE_WEB_PROXY_HEADERS")

    runlane = target_runtime(Target(args.app, args), load_app)
    try:
        app = create_app(runlane, authorize=login)
        if proxied:
            from werkzeug.middleware.proxy_fix import ProxyFix  # noqa: PLC0415 - web extra

            # one proxy in front: its X-Forwarded-For/-Proto/-Host/-Prefix are believed
            app.wsgi_app = ProxyFix(  # type: ignore[method-assign]
                app.wsgi_app, x_for=1, x_proto=1, x_host=1, x_prefix=1
            )
        serve_app(
            app,
            args,
            (host, port),
            lambda url: (
                f"runlane web console on {url}/ ({_mode(login)}; SIGTERM or Ctrl-C stops it)"
            ),
            proxied=proxied,
        )
    finally:
        runlane.close()
    return 0


def serve_app(
    app: Any,
    args: argparse.Namespace,
    address: tuple[str, int],
    banner: Callable[[str], str],
    *,
    proxied: bool = False,
) -> None:
    """Serve ``app`` with waitress (``args.threads``) on ``args.bind`` until SIGTERM or Ctrl-C,
    printing ``banner(url)`` once it listens; the caller checked that waitress is there.
    ``proxied``: waitress passes the X-Forwarded-* headers on (it drops them otherwise), for
    the app's ProxyFix to read."""
    from waitress.server import create_server  # noqa: PLC0415 - of an optional extra

    host, port = address
    sockets: dict[int, Any] = {}
    server = listening(
        lambda: create_server(
            app,
            map=sockets,
            host=host,
            port=port,
            threads=args.threads,
            ident="runlane",
            clear_untrusted_proxy_headers=not proxied,
        ),
        args.bind,
        host,
        port,
    )
    print(banner(f"http://{f'[{host}]' if ':' in host else host}:{port}"))
    with stop_requested() as stop:
        serve_until(server, sockets, stop)


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in {"", "0", "false", "no", "off"}:
        return False
    if value in {"1", "true", "yes", "on"}:
        return True
    raise ConfigurationError(f"{name} must be 1 or 0 (true or false), got {shown(value, 40)}")


def _mode(login: Any) -> str:
    if login is None:
        return "read-only: RUNLANE_WEB_TOKEN, or RUNLANE_WEB_USER and _PASSWORD, let it act"
    how = "the token of RUNLANE_WEB_TOKEN" if login.token else "RUNLANE_WEB_USER's password"
    return f"acts for a browser that logs in at /login with {how}"


def listening(create: Callable[[], T], bind: str, host: str, port: int) -> T:
    """``create()``, waitress's server bound to ``bind`` (``host``, ``port``); a
    ConfigurationError (one ``runlane: error:`` line, exit 2, like a malformed ``--bind``)
    when it cannot listen there: a host that does not resolve, an address in use, one this
    machine does not have or may not bind. Each address is tried on a socket of its own
    first (waitress leaves its half-made server's sockets open when its bind fails)."""
    where = f"--bind {shown(bind, 80)}"
    try:
        found = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
        for family, kind, proto, _, address in found:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as waitress
                probe.bind(address)
        return create()
    except (socket.gaierror, UnicodeError, ValueError) as exc:
        # ValueError: waitress's "Invalid host/port specified." for getaddrinfo's error
        cause = exc.__cause__ or exc.__context__ or exc
        raise ConfigurationError(
            f"{where}: the host does not resolve to an address ({cause}); give a name or "
            "address of this machine, e.g. 127.0.0.1:8080, [::1]:8080 or 0.0.0.0:8080"
        ) from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigurationError(
                f"{where}: the address is in use (another process listens on it): stop that "
                "process or choose another port"
            ) from None
        raise ConfigurationError(
            f"{where}: cannot listen there ({exc.strerror or exc}): give an address of this "
            "machine and a port this user may bind (ports below 1024 need privileges)"
        ) from None


def serve_until(
    server: Any, sockets: dict[int, Any], stop: threading.Event, turn: float = _TURN_SECONDS
) -> None:
    """Serve waitress's ``server`` (made with ``map=sockets``) until ``stop`` is set, then
    stop its request threads and close its sockets. Signals only set ``stop``, looked at
    between turns of the loop: ``waitress.serve`` can lose a KeyboardInterrupt that lands
    during a request's hand-over."""
    from waitress import wasyncore  # noqa: PLC0415 - the web extra is optional

    while not stop.is_set():
        wasyncore.loop(timeout=turn, map=sockets, count=1)
    server.task_dispatcher.shutdown()
    wasyncore.close_all(sockets)


def add_web_command(commands: Any, load_app: LoadApp) -> None:
    """Add ``web`` to ``commands``, the subparsers of the ``runlane`` parser."""
    web = commands.add_parser(
        "web",
        help=(
            "serve the web console and /metrics with waitress (read-only; it acts with "
            "RUNLANE_WEB_TOKEN or RUNLANE_WEB_USER/RUNLANE_WEB_PASSWORD set)"
        ),
        description=(
            "Serve the web console on HOST:PORT (loopback by default): its pages (overview, "
            "runs, queues, workers, schedules, charts over time, the audit trail) and "
            "/metrics in the Prometheus text format (with the metrics extra). It is "
            "read-only unless the environment gives it credentials: RUNLANE_WEB_TOKEN (typed "
            "once at /login) or RUNLANE_WEB_USER and RUNLANE_WEB_PASSWORD (HTTP basic auth); "
            "then it acts (retry, cancel, delete, bulk, pause, run now, reschedule), each "
            "action recorded in the audit trail with who did it. For your own authorize "
            "function, mount runlane.web.blueprint(runlane, authorize=...) in your Flask "
            "app (docs/console.md)."
        ),
    )
    web.add_argument("app", metavar="APP", nargs="?", default=None, help=TARGET_HELP)
    add_target_options(web)
    web.add_argument(
        "--bind",
        default=DEFAULT_BIND,
        metavar="HOST:PORT",
        help=f"address to listen on (default {DEFAULT_BIND}: this machine only)",
    )
    web.add_argument("--threads", type=int, default=8, help="request threads (default 8)")
    web.add_argument(
        "--proxy-headers",
        action="store_true",
        help=(
            "believe one proxy's X-Forwarded-For/-Proto/-Host/-Prefix (Werkzeug's ProxyFix): "
            "serve behind a proxy that terminates TLS and sets them, never exposed directly "
            "(also RUNLANE_WEB_PROXY_HEADERS=1)"
        ),
    )
    web.set_defaults(handler=lambda args: _serve(load_app, args))
