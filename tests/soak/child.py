"""The soak's processes: ``python -m tests.soak.child ROLE SETTINGS PROC [--url URL]``.

- ``worker``: a delivery worker at the soak's concurrency (``--url``: connect through the
  TCP proxy instead of directly); SIGTERM closes it cleanly.
- ``maintenance``: ``start_services`` (one maintenance replica); it records its owner id so
  the soak can find the replica that owns a band.
- ``producer``: triggers every run (a seed at once, then a trickle over the soak's duration),
  each with an idempotency key so a trigger that raised can be repeated without a second
  run, and records each run id once its trigger returned.

Each process records itself (``procs``: pid, maintenance owner, clock skew against the
database) so the checks can tell what a ``faketime`` clock did.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

from runlane import Runlane, RunlaneError
from runlane.worker import Worker
from tests.soak.app import (
    Job,
    Recorder,
    Settings,
    bounded,
    build_runtime,
    install_recorder,
    is_bounded,
    work,
)

log = logging.getLogger("soak")


def _clock_skew(recorder: Recorder) -> float:
    """This process's clock minus the database's, from the quickest of a few round trips
    (the midpoint of each): a reading taken across a wait (a restart, a busy machine) was off
    by the wait, 7 s once in CI."""
    best: tuple[float, float] | None = None
    for _ in range(10):
        began = time.time()
        database = float(recorder.execute("select extract(epoch from clock_timestamp())", ()))
        ended = time.time()
        if best is None or ended - began < best[0]:
            best = (ended - began, (began + ended) / 2 - database)
        if ended - began < 0.1:
            break
    assert best is not None
    return best[1]


def _register(recorder: Recorder, owner: Any = None) -> None:
    skew = recorder.execute(
        "insert into {side}.procs (proc, pid, owner, skew) "
        "values (%s, %s, %s, %s) "
        "on conflict (proc) do update set pid = excluded.pid returning skew",
        (recorder.proc, os.getpid(), owner, _clock_skew(recorder)),
    )
    log.info(
        "%s: pid %d, clock skew against the database %+.1f s", recorder.proc, os.getpid(), skew
    )


def _supervise(proc: str, what: str, closable: Any, stop: threading.Event) -> int:
    """Watch a worker or the services until SIGTERM: 0, or 4 when it closed on its own,
    3 when it failed (``wait_until_closed`` raises its failure)."""
    while not stop.wait(0.5):
        try:
            if closable.wait_until_closed(timeout=0):
                log.error("%s: %s closed on its own", proc, what)
                return 4
        except RunlaneError:  # WorkerFailed, or the services' failure
            log.exception("%s: %s failed", proc, what)
            return 3
    return 0


def _stop_event() -> threading.Event:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return stop


def run_worker(settings: Settings, proc: str, url: str | None) -> int:
    stop = _stop_event()
    recorder = Recorder(settings.url, settings.side, proc, size=settings.concurrency + 2)
    install_recorder(recorder)
    runtime = build_runtime(settings, url)
    # started during a Postgres restart, it waits for the database (wait_for_database's
    # default, 120 s) and logs a line per retry; it exits (and the soak fails) otherwise.
    # Registered once up: the recorder's own writes wait out an outage, so a registration
    # first would have kept the start out of it
    worker: Worker = runtime.create_delivery_worker(concurrency=settings.concurrency)
    _register(recorder)
    code = _supervise(proc, "the worker", worker, stop)
    log.info("%s: closing", proc)
    worker.close(timeout=20)
    runtime.close(timeout=20)
    recorder.close()
    log.info("%s: closed", proc)
    return code


def run_maintenance(settings: Settings, proc: str) -> int:
    stop = _stop_event()
    recorder = Recorder(settings.url, settings.side, proc, size=2)
    runtime = build_runtime(settings)

    def on_error(error: BaseException, info: Any) -> None:
        log.warning("%s: maintenance %s (%s) failed: %r", proc, info.phase, info.operation, error)

    services = runtime.start_services(  # waits for the database, as the worker's start
        lease_duration=timedelta(seconds=settings.maintenance_lease), on_service_error=on_error
    )
    _register(recorder, services.owner)
    code = _supervise(proc, "the services", services, stop)
    services.close(timeout=20)
    runtime.close(timeout=20)
    recorder.close()
    return code


def _trigger(runtime: Runlane, numbers: list[int]) -> list[tuple[int, Any]]:
    made: list[tuple[int, Any]] = []
    for task_, chosen in (
        (bounded, [i for i in numbers if is_bounded(i)]),
        (work, [i for i in numbers if not is_bounded(i)]),
    ):
        if not chosen:
            continue
        handles = runtime.trigger_many(
            task_, [Job(i) for i in chosen], idempotency_keys=[f"soak:{i}" for i in chosen]
        )
        made.extend((i, handle.id) for i, handle in zip(chosen, handles, strict=True))
    return made


class _Counter:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def add(self, key: str) -> int:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1
            return self.counts[key]


def _api_error(recorder: Recorder, call: str, exc: BaseException) -> None:
    """When (this process's clock is the database's) and how an application call failed."""
    recorder.execute(
        "insert into {side}.api_errors (at, call, error) values (%s, %s, %s) returning 1",
        (datetime.now(UTC), call, f"{type(exc).__name__}: {exc}"[:300]),
    )


def _trigger_patiently(
    runtime: Runlane, numbers: list[int], errors: _Counter, recorder: Recorder
) -> list[tuple[int, Any]]:
    while True:
        try:
            return _trigger(runtime, numbers)
        except RunlaneError as exc:
            # the same keys again: a run the failed call did create is returned, not doubled
            if errors.add("trigger_errors") <= 20:
                log.warning("trigger of %d runs raised %r; repeating it", len(numbers), exc)
            _api_error(recorder, "trigger_many", exc)
            time.sleep(0.2)


def _read_runs(
    runtime: Runlane,
    made: list[Any],
    errors: _Counter,
    stop: threading.Event,
    recorder: Recorder,
) -> None:
    """Point reads of random runs already triggered, as an application would make."""
    rng = random.Random(11)
    while not stop.wait(0.02):
        if not made:
            continue
        run_id = made[rng.randrange(len(made))]
        try:
            runtime.get_run(run_id)
            errors.add("get_run_calls")
        except RunlaneError as exc:
            if errors.add("get_run_errors") <= 20:
                log.warning("get_run(%s) raised %r", run_id, exc)
            _api_error(recorder, "get_run", exc)


def run_producer(settings: Settings, proc: str) -> int:
    """Triggers from four threads (so the runtime's pool holds several connections, as in an
    application) and reads runs back from a fifth."""
    stop = _stop_event()
    recorder = Recorder(settings.url, settings.side, proc, size=2)
    _register(recorder)
    runtime = build_runtime(settings)
    seed = int(settings.runs * settings.seed_fraction)
    errors = _Counter()
    made_ids: list[Any] = []
    reading = threading.Event()
    reader = threading.Thread(
        target=_read_runs, args=(runtime, made_ids, errors, reading, recorder), daemon=True
    )
    reader.start()
    begin = time.monotonic()
    done = 0
    with ThreadPoolExecutor(4, thread_name_prefix=f"{proc}-trigger") as pool:
        while done < settings.runs and not stop.is_set():
            elapsed = time.monotonic() - begin
            target = seed + (settings.runs - seed) * min(1.0, elapsed / settings.duration)
            due = min(int(target) - done, settings.runs - done)
            if due <= 0:
                stop.wait(0.05)
                continue
            numbers = list(range(done, done + min(due, 400)))
            chunks = [numbers[k : k + 50] for k in range(0, len(numbers), 50)]
            made = [
                pair
                for batch in pool.map(
                    lambda chunk: _trigger_patiently(runtime, chunk, errors, recorder), chunks
                )
                for pair in batch
            ]
            recorder.execute(
                "insert into {side}.triggered (i, run_id) "
                "select * from unnest(%s::int[], %s::uuid[]) on conflict (i) do nothing "
                "returning i",
                ([i for i, _ in made], [run_id for _, run_id in made]),
            )
            made_ids.extend(run_id for _, run_id in made)
            done += len(numbers)
    # keep reading until the schedule ends (the last Postgres restart comes near its end)
    stop.wait(max(0.0, settings.duration - (time.monotonic() - begin)))
    reading.set()
    reader.join(10)
    log.info("%s: triggered %d runs; errors %s", proc, done, errors.counts)
    for key in ("trigger_errors", "get_run_errors", "get_run_calls"):
        recorder.execute(
            "insert into {side}.notes (key, value) values (%s, %s) "
            "on conflict (key) do update set value = excluded.value returning value",
            (key, float(errors.counts.get(key, 0))),
        )
    runtime.close(timeout=20)
    recorder.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak.child")
    parser.add_argument("role", choices=["worker", "maintenance", "producer"])
    parser.add_argument("settings")
    parser.add_argument("proc")
    parser.add_argument("--url", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(process)d %(threadName)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("runlane").setLevel(logging.WARNING)
    logging.getLogger("pika").setLevel(logging.WARNING)
    settings = Settings.load(args.settings)
    if args.role == "worker":
        return run_worker(settings, args.proc, args.url)
    if args.role == "maintenance":
        return run_maintenance(settings, args.proc)
    return run_producer(settings, args.proc)


if __name__ == "__main__":
    sys.exit(main())
