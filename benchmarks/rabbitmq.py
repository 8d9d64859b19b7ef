"""The RabbitMQ transport lane's part of ``python -m benchmarks.run``: throughput, trigger
rates and trigger-to-start latency, on the same Postgres as the polling lane's figures.

The broker is the one at ``--amqp-url`` (or ``RUNLANE_BENCH_AMQP_URL``), else a private node
on 127.0.0.1 started with ``runlane.cli._rabbit_nodes.start_rabbitmq_node`` and removed afterwards;
when neither is possible (no rabbitmq-server package, no pika) the rows are skipped with a
note saying why.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import attrs

from benchmarks._common import Row, log, pct, ratio_row, wait_until_zero
from benchmarks._statements import (
    PerRun,
    counting_statements,
    server_cpu_seconds,
    wal_position,
)
from runlane import RunContext, Runlane, create_runlane, task
from runlane.cli._rabbit_host import rabbitmq_available
from runlane.cli._rabbit_nodes import start_rabbitmq_node

__all__ = ["RabbitBench", "RabbitBroker", "rabbit_rows"]

IDLE_PAUSE = 0.02  # seconds between a latency sample's end and the next trigger


@attrs.frozen
class RabbitBench:
    """What the RabbitMQ rows share with the rest of ``benchmarks.run``."""

    url: str  # the Postgres the polling lane's rows used
    amqp_url: str
    runs: int
    triggers: int  # one-by-one triggers
    samples: int
    concurrency: int
    noop: Any  # the no-op task
    fresh_schema: Callable[[str], str]
    wait_drained: Callable[[str, str], None]


class RabbitBroker:
    """The broker the benchmark uses: given, started here, or unavailable (``reason``)."""

    def __init__(self, amqp_url: str | None) -> None:
        self.url: str | None = amqp_url
        self.reason: str | None = None
        self.started: float | None = None  # seconds a private node took to start
        self._node: Any = None
        if amqp_url is not None:
            return
        self.reason = rabbitmq_available()
        if self.reason is not None:
            return
        began = time.perf_counter()
        self.url, self._node = start_rabbitmq_node()
        self.started = time.perf_counter() - began

    def close(self) -> None:
        if self._node is not None:
            self._node.cleanup()
            self._node = None


def _runtime(
    url: str,
    schema: str,
    amqp_url: str,
    tasks: list[Any],
    *,
    poll: timedelta = timedelta(seconds=1),
    queue_type: str = "quorum",
) -> Runlane:
    from runlane.rabbitmq import rabbitmq_lane  # noqa: PLC0415 - needs pika (rabbitmq extra)

    lane = rabbitmq_lane(
        connection_string=url,
        schema=schema,
        amqp_url=amqp_url,
        poll_interval=poll,
        queue_type=queue_type,
    )
    return create_runlane(lane=lane, tasks=tasks)


def _wait_published(url: str, schema: str, timeout: float = 600) -> None:
    wait_until_zero(
        url,
        f"select count(*) from {schema}.outbox",
        interval=0.02,
        timeout=timeout,
        what="publishing the outbox items",
    )


def bench_rabbit_one_process(
    bench: RabbitBench, queue_type: str = "quorum"
) -> tuple[float, PerRun]:
    """``runs`` no-op runs triggered and published first (the broker holds them all), then
    one worker at ``concurrency`` consumes them: runs/s from its start to the last one, and
    the statements its threads sent per run."""
    url, noop, runs = bench.url, bench.noop, bench.runs
    schema = bench.fresh_schema(url)
    with _runtime(url, schema, bench.amqp_url, [noop], queue_type=queue_type) as runlane:
        for start in range(0, runs, 1000):
            runlane.trigger_many(noop, [None] * min(1000, runs - start))
        _wait_published(url, schema)
        wal, cpu = wal_position(url), server_cpu_seconds(url)
        started = time.perf_counter()
        with (
            counting_statements(skip_this_thread=True) as statements,
            runlane.create_delivery_worker(concurrency=bench.concurrency),
        ):
            bench.wait_drained(url, schema)
            elapsed = time.perf_counter() - started
            per_run = PerRun.between(url, runs, statements.per(runs), wal, cpu)
    return runs / elapsed, per_run


def bench_rabbit_enqueue(bench: RabbitBench) -> dict[str, float]:
    """``trigger`` one run at a time: the call's rate (it returns after the commit; the eager
    publish happens on the publisher thread), the rate until every item is published, and
    the statements per run of both (the trigger's, the publisher's records)."""
    url, noop = bench.url, bench.noop
    schema = bench.fresh_schema(url)
    with _runtime(url, schema, bench.amqp_url, [noop]) as runlane:
        runlane.trigger(noop, None)  # connect the publisher first, as a running app would
        _wait_published(url, schema)
        single = bench.triggers
        with counting_statements() as calls:  # the triggers' and the publisher's meanwhile
            started = time.perf_counter()
            for _ in range(single):
                runlane.trigger(noop, None)
            returned = time.perf_counter() - started
        with counting_statements(skip_this_thread=True) as rest:  # not the polling's
            _wait_published(url, schema)
            published = time.perf_counter() - started
        sent = (calls.value + rest.value) / single
    return {
        "rabbitmq: trigger one by one, calls return (runs/s)": single / returned,
        "rabbitmq: trigger one by one, all published (runs/s)": single / published,
        "rabbitmq:   statements per run, trigger and publish": sent,
    }


def bench_rabbit_wakeup(bench: RabbitBench, queue_type: str = "quorum") -> list[float]:
    """``trigger`` to handler start (ms) with an idle worker whose poll interval is 30 s, so
    only the eager publish and the broker's delivery explain it."""
    url = bench.url
    schema = bench.fresh_schema(url)
    started_at: dict[uuid.UUID, float] = {}
    arrived = threading.Event()

    @task(id="bench.rabbit_ping")
    def ping(payload: Any, context: RunContext) -> None:
        started_at[context.run_id] = time.perf_counter()
        arrived.set()

    latencies: list[float] = []
    poll = timedelta(seconds=30)
    with _runtime(url, schema, bench.amqp_url, [ping], poll=poll, queue_type=queue_type) as runlane:
        worker = runlane.create_delivery_worker(concurrency=bench.concurrency)
        try:
            runlane.wait_for_run(runlane.trigger(ping, None).id, timeout=30)  # warm up
            for _ in range(bench.samples):
                arrived.clear()
                sent = time.perf_counter()
                handle = runlane.trigger(ping, None)
                if not arrived.wait(10):
                    raise TimeoutError("a delivery never arrived")
                latencies.append((started_at[handle.id] - sent) * 1000)
                # idle again: the run recorded, the consumer waiting for the next delivery
                # (the worker's idle_signal is set once per empty claim, before a wait of the
                # poll interval, so it cannot pace this loop)
                runlane.wait_for_run(handle.id, timeout=10)
                time.sleep(IDLE_PAUSE)
        finally:
            worker.close()
    return latencies


def rabbit_rows(bench: RabbitBench, polling_one_process: float | None) -> list[Row]:
    """The RabbitMQ lane's rows of the table (each figure is logged as it is measured);
    throughput is compared with the polling lane's one process when that was measured."""
    rows: list[Row] = []
    rabbit, sent = bench_rabbit_one_process(bench)
    log(f"rabbitmq: one process {rabbit:,.0f} runs/s, {sent.statements:.3f} statements a run")
    label = "rabbitmq: processing, one process, concurrency 8 (runs/s)"
    rows.append(_processing_row(label, rabbit, polling_one_process))
    rows += [
        attrs.evolve(row, measure=f"rabbitmq: {row.measure}") for row in sent.rows("processing")
    ]
    for label, rate in bench_rabbit_enqueue(bench).items():
        log(f"{label} {rate:,.3f}")
        rows.append(Row(label, rate, ",.3f" if "statements" in label else ",.0f"))
    latencies = bench_rabbit_wakeup(bench)
    for q in (0.50, 0.95, 0.99):
        rows.append(
            Row(
                f"rabbitmq: trigger-to-start p{int(q * 100)}, idle worker (ms)",
                pct(latencies, q),
                ",.2f",
            )
        )
    rows.append(
        Row("rabbitmq: trigger-to-start mean, idle worker (ms)", statistics.mean(latencies), ",.2f")
    )
    return rows + _classic_rows(bench, polling_one_process)


def _processing_row(label: str, rabbit: float, polling_one_process: float | None) -> Row:
    """The processing rate, as a ratio to the polling lane's one process when that was
    measured."""
    if polling_one_process:
        return ratio_row(label, rabbit, "polling lane, one process", polling_one_process, None)
    return Row(label, rabbit)


def _classic_rows(bench: RabbitBench, polling_one_process: float | None) -> list[Row]:
    """The same processing and latency with ``queue_type="classic"``: one node's queue,
    delivered before its disk write (the quorum queue's replicated write is off the path)."""
    rows: list[Row] = []
    rabbit, _ = bench_rabbit_one_process(bench, "classic")
    log(f"rabbitmq, classic queues: one process {rabbit:,.0f} runs/s")
    label = "rabbitmq, classic queues: processing, one process (runs/s)"
    rows.append(_processing_row(label, rabbit, polling_one_process))
    latencies = bench_rabbit_wakeup(bench, "classic")
    for q in (0.50, 0.95):
        rows.append(
            Row(
                f"rabbitmq, classic queues: trigger-to-start p{int(q * 100)} (ms)",
                pct(latencies, q),
                ",.2f",
            )
        )
    return rows
