"""The console's pages: overview, runs, a run, queues, workers, schedules. They read through
the operator API and the storage's own web reads (``web_run_extras``, ``web_runs_estimate``).
The overview's chart reads ``Runlane.stats``: the rollup maintenance keeps, not runs."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from typing import Any, cast

import attrs
from flask import render_template, request

from runlane._operator.runs import encode_cursor
from runlane._operator.status import unhealthy
from runlane.errors import RunNotFound
from runlane.models import QueueInfo, RunSnapshot, WorkerInfo
from runlane.tasks import Queue
from runlane.web._console import Console, Route
from runlane.web._filters import FIRST_ID, Position, run_filters, run_id_arg, text_arg
from runlane.web._find import SEARCH_SECONDS, run_search_args
from runlane.web._present import throughput_chart, trace_id

__all__ = ["CHILDREN_SHOWN", "PAGE_SIZE", "WORKER_RUNS_SHOWN", "Pages"]

PAGE_SIZE = 50  # runs per page of the runs list
CHILDREN_SHOWN = 50  # children listed on a run's page
WORKER_RUNS_SHOWN = 20  # runs listed for each worker on the workers page
_DEFAULT = "default"  # the queue create_runlane adds when none is the default


class Pages:
    """The read-only pages."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.runlane = console.runlane

    def routes(self) -> Iterable[Route]:
        return (
            ("/", "overview", ["GET"], self.overview),
            ("/runs", "runs", ["GET"], self.runs),
            ("/runs/<run_id>", "run", ["GET"], self.run),
            ("/queues", "queues", ["GET"], self.queues),
            ("/workers", "workers", ["GET"], self.workers),
            ("/schedules", "schedules", ["GET"], self.schedules),
        )

    def overview(self) -> str:
        report = self.runlane.status()
        reads = self.console.storage()
        # finished runs per minute over the last hour, from the rollup (as /charts reads it)
        throughput = self.runlane.stats(bucket="1m")
        workers = self.runlane.list_workers()
        return render_template(
            "runlane/overview.html",
            page="overview",
            report=report,
            problems=unhealthy(report),
            workers=workers,
            held=self.held_runs(workers),
            held_shown=WORKER_RUNS_SHOWN,
            chart=throughput_chart(throughput),
            runs_estimate=reads.web_runs_estimate(),
        )

    def runs(self) -> str:
        filters = run_filters(request.args)
        cursor = text_arg(request.args, "cursor")
        start = cursor
        if start is None and filters.created_before is not None:
            position = Position(created_at=filters.created_before, id=FIRST_ID)
            start = encode_cursor(cast(RunSnapshot, position))
        search = run_search_args(request.args)
        keywords = search.keywords() if search.any else {}
        if search.any:
            keywords["search_seconds"] = SEARCH_SECONDS
        page = self.runlane.list_runs(
            status=filters.status,
            task=filters.task,
            queue=filters.queue,
            limit=PAGE_SIZE,
            cursor=start,
            **keywords,
        )
        shown = list(page.runs)
        next_cursor = page.next_cursor
        searched_to = page.searched_to
        if filters.created_after is not None:
            after = filters.created_after
            kept = [run for run in shown if run.created_at >= after]
            if len(kept) < len(shown) or (searched_to is not None and searched_to < after):
                # the walk (or the search) went past created_after: no older page
                next_cursor = searched_to = None
            shown = kept
        return render_template(
            "runlane/runs.html",
            page="runs",
            filters=filters,
            search=search,
            link_args={**filters.args(), **search.args()},
            searched_to=searched_to,
            search_seconds=SEARCH_SECONDS,
            runs=shown,
            next_cursor=next_cursor,
            first_page=cursor is None,
            runs_estimate=self.console.storage().web_runs_estimate(),
        )

    def run(self, run_id: str) -> str:
        key = run_id_arg(run_id)
        history = self.runlane.get_run_history(key)
        extras = self.console.storage().web_run_extras(
            self.runlane.environment, key, CHILDREN_SHOWN + 1
        )
        if extras is None:
            raise RunNotFound(f"no run {key} in environment {self.runlane.environment!r}")
        token = None
        if extras["wait_kind"] == "token" and extras["wait_token_id"] is not None:
            token = self.runlane.get_wait_token(extras["wait_token_id"])
        children = extras["children"]
        snapshot = history.run
        worker = None
        if extras["worker_id"] is not None:
            worker_id = str(extras["worker_id"])
            known = self.runlane.list_workers(include_stopped=True)
            worker = next((w for w in known if str(w.worker_id) == worker_id), None)
        return render_template(
            "runlane/run.html",
            page="runs",
            run=snapshot,
            attempts=history.attempts,
            steps=history.steps,
            extras=extras,
            token=token,
            children=children[:CHILDREN_SHOWN],
            more_children=len(children) > CHILDREN_SHOWN,
            trace=trace_id(extras["trace_context"]),
            progress=snapshot.progress if isinstance(snapshot.progress, dict) else None,
            live=not snapshot.is_terminal,
            worker=worker,
        )

    def queues(self) -> str:
        return render_template("runlane/queues.html", page="queues", queues=self.queue_rows())

    def queue_rows(self) -> list[QueueInfo]:
        """``list_queues`` (with the queues of recently finished runs), the default queue
        runlane adds to a runtime whose code sends no task to it (``runlane web
        --database-url``) marked as known only from the database, as every queue this
        runtime's code does not define."""
        implicit = self.implicit_default()
        return [
            attrs.evolve(q, defined=False) if q.name == implicit else q
            for q in self.runlane.list_queues()
        ]

    def implicit_default(self) -> str | None:
        """The name of the default queue runlane added itself when no task of this runtime
        goes to it, else None."""
        defined = self.runlane.queues.get(_DEFAULT)
        if defined != Queue(name=_DEFAULT, default=True):
            return None
        if any(t.queue in (None, _DEFAULT) for t in self.runlane.tasks.values()):
            return None
        return _DEFAULT

    def workers(self) -> str:
        stopped = request.args.get("stopped") == "1"
        workers = self.runlane.list_workers(include_stopped=stopped)
        return render_template(
            "runlane/workers.html",
            page="workers",
            workers=workers,
            held=self.held_runs(workers),
            held_shown=WORKER_RUNS_SHOWN,
            include_stopped=stopped,
        )

    def held_runs(self, workers: Sequence[WorkerInfo]) -> dict[str, list[dict[str, Any]]]:
        """The runs each worker runs now (at most WORKER_RUNS_SHOWN + 1 each)."""
        ids = [str(w.worker_id) for w in workers]
        if not ids:
            return {}
        return self.console.storage().web_worker_runs(
            self.runlane.environment, ids, WORKER_RUNS_SHOWN + 1
        )

    def schedules(self) -> str:
        return render_template(
            "runlane/schedules.html",
            page="schedules",
            schedules=self.runlane.list_schedules(),
            nonce=secrets.token_urlsafe(18),
        )
