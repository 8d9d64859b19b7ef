"""runlane's worker memory over a long run (issue 12, "memory flat"): the RSS of a worker
process after ``--first`` runs and after ``--total`` runs (target: within 10%).

    python -m benchmarks.memory [--first 100000] [--total 1000000] [--every 100000]
                                [--database-url URL]

One worker process (spawned; a delivery worker at concurrency 8 running a no-op task, on
its own runtime) executes runs that this process keeps triggering with ``trigger_many``
(about 20,000 queued ahead). A thread of the worker process reads its VmRSS from
/proc/self/status every time the count of handled runs passes a multiple of ``--every``,
with the number of objects the garbage collector tracks and the number of threads. Figures
are printed, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import multiprocessing as mp
import os
import sys
import threading
import time
from typing import Any

from benchmarks._common import (
    CONCURRENCY,
    Row,
    add_database_argument,
    fresh_schema,
    log,
    noop,
    print_table,
    rss_kib,
    runtime,
    server_url,
)
from runlane import RunContext, task

BACKLOG = 20_000


def _worker(url: str, schema: str, checkpoints: list[int], done: Any, reports: Any) -> None:
    """The measured process: a worker, and a thread reporting RSS at each checkpoint."""
    handled = itertools.count(1)
    last = [0]

    @task(id="bench.noop")
    def counted(payload: Any, context: RunContext) -> None:
        last[0] = next(handled)

    with runtime(url, schema, tasks=[counted]) as runlane:
        reports.put(("start", 0, rss_kib(), len(gc.get_objects()), threading.active_count()))
        with runlane.create_delivery_worker(concurrency=CONCURRENCY):
            pending = list(checkpoints)
            while pending:
                now = last[0]
                done.value = now
                while pending and now >= pending[0]:
                    reports.put(
                        ("at", now, rss_kib(), len(gc.get_objects()), threading.active_count())
                    )
                    pending.pop(0)
                time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--first", type=int, default=100_000, help="runs at the first figure")
    parser.add_argument("--total", type=int, default=1_000_000, help="runs at the last figure")
    parser.add_argument("--every", type=int, default=100_000, help="runs between RSS samples")
    add_database_argument(parser)
    args = parser.parse_args(argv)
    checkpoints = sorted({args.first, args.total, *range(args.every, args.total + 1, args.every)})
    log(f"memory: {vars(args)}; load average {os.getloadavg()[0]:.2f}")
    began = time.perf_counter()
    samples: list[tuple[str, int, int, int, int]] = []
    with server_url(args.database_url) as url:
        schema = fresh_schema(url)
        ctx = mp.get_context("spawn")
        done = ctx.Value("q", 0)
        reports = ctx.Queue()
        proc = ctx.Process(target=_worker, args=(url, schema, checkpoints, done, reports))
        proc.start()
        samples.append(reports.get(timeout=60))
        log(f"worker started: RSS {samples[0][2]:,} KiB")
        triggered = 0
        with runtime(url, schema) as feeder:
            while len(samples) < len(checkpoints) + 1:
                if triggered < args.total + 1000 and triggered - done.value < BACKLOG:
                    feeder.trigger_many(noop, [None] * 1000)
                    triggered += 1000
                else:
                    time.sleep(0.01)
                while not reports.empty():
                    sample = reports.get()
                    samples.append(sample)
                    elapsed = time.perf_counter() - began
                    log(
                        f"after {sample[1]:,} runs ({elapsed:.0f} s): RSS {sample[2]:,} KiB, "
                        f"{sample[3]:,} gc objects, {sample[4]} threads"
                    )
                if not proc.is_alive():
                    raise RuntimeError(f"the worker process exited ({proc.exitcode})")
        proc.join(60)
    at = dict(zip(checkpoints, samples[1:], strict=True))
    first, last = at[args.first], at[args.total]
    rows = [Row("worker RSS at start (KiB)", samples[0][2])]
    rows += [Row(f"worker RSS after {c:,} runs (KiB)", s[2]) for c, s in at.items()]
    rows.append(
        Row(
            f"worker RSS after {args.total:,} runs / after {args.first:,}",
            last[2] / first[2],
            ",.3f",
            target="<= 1.10",
            met=last[2] / first[2] <= 1.10,
        )
    )
    rows.append(
        Row(
            f"gc-tracked objects after {args.total:,} runs",
            last[3],
            floor_label=f"after {args.first:,}",
            floor=first[3],
            ratio=last[3] / first[3],
        )
    )
    print_table(
        rows,
        [f"took {time.perf_counter() - began:.0f} s; load average after {os.getloadavg()[0]:.2f}"],
        compare="compared with",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
