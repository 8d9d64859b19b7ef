"""``runlane metrics [APP | --database-url URL] [--bind 127.0.0.1:9464]``: ``/metrics`` alone,
in the Prometheus text format, served by waitress (``pip install 'runlane[metrics]'``).

For a Prometheus that should not reach the console: no page, no action, only the figures
:mod:`runlane.metrics` reads from the database at each scrape. Loopback unless ``--bind``
says otherwise.
"""

from __future__ import annotations

import argparse
from typing import Any

from runlane.cli._target import TARGET_HELP, LoadApp, Target, add_target_options, target_runtime
from runlane.cli._web import parse_bind, serve_app
from runlane.errors import ConfigurationError
from runlane.metrics import MISSING, available, wsgi_app
from runlane.toolkit import as_int

__all__ = ["DEFAULT_METRICS_BIND", "add_metrics_command"]

# OpenTelemetry's Prometheus exporter listens on 9464 too: one port for "the metrics"
DEFAULT_METRICS_BIND = "127.0.0.1:9464"
_MAX_THREADS = 16  # scrapes are few; each holds one of the runtime's connections


def _serve(load_app: LoadApp, args: argparse.Namespace) -> int:
    host, port = parse_bind(args.bind)
    as_int("--threads", args.threads, 1, _MAX_THREADS)
    if not available():
        raise ConfigurationError(MISSING)
    try:
        import waitress.server  # noqa: F401, PLC0415 - only whether the extra is there
    except ImportError:
        raise ConfigurationError(
            "runlane metrics serves with waitress: pip install 'runlane[metrics]'"
        ) from None

    runlane = target_runtime(Target(args.app, args), load_app)
    try:
        serve_app(
            wsgi_app(runlane),
            args,
            (host, port),
            lambda url: f"runlane metrics on {url}/metrics (SIGTERM or Ctrl-C stops it)",
        )
    finally:
        runlane.close()
    return 0


def add_metrics_command(commands: Any, load_app: LoadApp) -> None:
    """Add ``metrics`` to ``commands``, the subparsers of the ``runlane`` parser."""
    metrics = commands.add_parser(
        "metrics",
        help="serve /metrics (Prometheus text format) alone, with waitress",
        description=(
            "Serve /metrics on HOST:PORT (loopback by default): queue depth by status, oldest "
            "queued age, throughput, wait and run time histograms, workers by state and "
            "maintenance bands, read from the database at each scrape. The console "
            "(runlane web, runlane.web) serves the same /metrics beside its pages."
        ),
    )
    metrics.add_argument("app", metavar="APP", nargs="?", default=None, help=TARGET_HELP)
    add_target_options(metrics)
    metrics.add_argument(
        "--bind",
        default=DEFAULT_METRICS_BIND,
        metavar="HOST:PORT",
        help=f"address to listen on (default {DEFAULT_METRICS_BIND}: this machine only)",
    )
    metrics.add_argument("--threads", type=int, default=2, help="request threads (default 2)")
    metrics.set_defaults(handler=lambda args: _serve(load_app, args))
