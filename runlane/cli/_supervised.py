"""``runlane worker`` and ``runlane maintenance``: a worker (with the maintenance services
beside it, on request) or the services alone, run until SIGTERM/SIGINT and closed within
--shutdown-timeout; a second signal stops them at once (``_signals``)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

from runlane.cli._budget import add_limit_option, limits_of, non_default_limits, with_limits
from runlane.cli._logs import json_lines, logged_parent, one_line, say
from runlane.cli._options import add_wait_option, queue_names, timeout_seconds
from runlane.cli._signals import Stopper
from runlane.cli._target import LoadApp
from runlane.errors import (
    ConfigurationError,
    RunlaneClosed,
    RunlaneError,
    ServiceFailed,
    WorkerFailed,
)
from runlane.maintenance import MaintenanceResult, ServiceErrorInfo, Services
from runlane.runtime import DEFAULT_WAIT_FOR_DATABASE
from runlane.toolkit import Deadline, count_of, wait_in_slices

__all__ = ["add_supervised_commands"]

log = logging.getLogger("runlane.cli")

# how long the main thread gives the closer a stop signal started while the start waited
_WAIT_CLOSE_SECONDS = 10.0


def _supervise(
    stopper: Stopper, wait_until_closed: Callable[[], object], shutdown_timeout: float
) -> int:
    """Observe a worker or services until they close; 0 after a clean close.
    ``wait_until_closed`` waits in slices (``wait_in_slices``), so that a stop signal the
    kernel delivered to another thread is handled."""
    try:
        wait_until_closed()
    except (WorkerFailed, ServiceFailed) as exc:
        if not stopper.requested.is_set():
            raise
        # asked to stop: a failure seen while closing is reported, the close stays clean
        say(f"warning: while closing: {one_line(exc)}", logging.WARNING)
    finally:
        stopper.wait_for_closer(shutdown_timeout)
    if stopper.close_error is not None:
        if isinstance(stopper.close_error, RunlaneError):
            raise stopper.close_error
        raise RuntimeError(f"closing failed: {stopper.close_error!r}") from stopper.close_error
    return 0


def _cmd_worker(load_app: LoadApp, args: argparse.Namespace) -> int:
    if args.limits and not args.with_maintenance:
        raise ConfigurationError(
            "--limit sets the budgets of the maintenance services --with-maintenance runs "
            "beside the worker: add --with-maintenance, or give --limit to `runlane "
            "maintenance APP`"
        )
    runlane = load_app(args.app)
    stopper = Stopper()
    try:
        with stopper.installed():
            # a stop signal while the start waits for the database ends the wait
            stopper.attach("runlane worker", runlane.close)
            try:
                # connects and checks the schema before any thread starts: an unmigrated
                # schema fails here, with the migrate hint
                worker = runlane.create_delivery_worker(
                    concurrency=args.concurrency,
                    queues=queue_names(args.queues),
                    claim_batch=args.claim_batch,
                    wait_for_database=args.wait_for_database,
                )
            except RunlaneClosed:
                if not stopper.requested.is_set():
                    raise
                return _stopped_while_waiting(stopper)
            services: Services | None = None
            limits = limits_of(args)
            try:
                if args.with_maintenance:
                    services = runlane.start_services(
                        on_service_error=_report_service_error,
                        limits=limits,
                        wait_for_database=args.wait_for_database,
                    )

                def close() -> None:
                    # one bound for both: --shutdown-timeout is the whole close's
                    deadline = Deadline(args.shutdown_timeout)
                    worker.close(timeout=deadline.left())
                    if services is not None:
                        services.close(timeout=deadline.left())

                stopper.attach(worker.name, close)
                beside = (
                    f" with maintenance ({services.name}{with_limits(non_default_limits(limits))})"
                    if services is not None
                    else ""
                )
                say(
                    f"{worker.name} running {count_of(args.concurrency, 'slot')}{beside} "
                    f"(environment {runlane.environment!r}); SIGTERM or Ctrl-C stops it",
                    worker=worker.name,
                    concurrency=args.concurrency,
                    environment=runlane.environment,
                )
                code = _supervise(
                    stopper, lambda: _wait_for_both(worker, services), args.shutdown_timeout
                )
                say(f"{worker.name} stopped", worker=worker.name, exit_code=code)
                return code
            finally:
                worker.close(timeout=args.shutdown_timeout)  # idempotent
                if services is not None:
                    services.close(timeout=args.shutdown_timeout)
                runlane.close()
    finally:
        runlane.close()


def _stopped_while_waiting(stopper: Stopper) -> int:
    """A stop signal closed the runtime while the start waited for the database: a clean
    stop (0), nothing had started."""
    stopper.wait_for_closer(_WAIT_CLOSE_SECONDS)
    say("stopped while waiting for the database", exit_code=0)
    return 0


def _report_service_error(error: BaseException, info: ServiceErrorInfo) -> None:
    say(
        f"{info.phase} ({info.operation}): {one_line(error)}",
        logging.WARNING,
        phase=info.phase,
        operation=info.operation,
    )


def _wait_for_both(worker: Any, services: Services | None) -> None:
    """Observe a worker and the services beside it; when either closes (or fails) the
    other is closed too, and a failure propagates. Every wait is sliced (see _signals)."""
    if services is None:
        wait_in_slices(worker.wait_until_closed)
        return
    try:
        wait_in_slices(lambda seconds: worker.wait_until_closed(seconds) or services.closed)
    finally:
        worker.close()
        services.close()
    wait_in_slices(worker.wait_until_closed)
    wait_in_slices(services.wait_until_closed)


def _cmd_maintenance(load_app: LoadApp, args: argparse.Namespace) -> int:
    limits = limits_of(args)
    if args.once and args.wait_for_database is not None:
        raise ConfigurationError(
            "--wait-for-database is for the long-running services: `maintenance --once` is "
            "a one-shot pass and fails at once when the database is unavailable"
        )
    if args.wait_for_database is None:
        args.wait_for_database = DEFAULT_WAIT_FOR_DATABASE
    runlane = load_app(args.app)

    stopper = Stopper()
    try:
        if args.once:
            result = runlane.run_maintenance_once(limits)
            if json_lines():
                log.info("maintenance pass done", extra=result.counts())
            else:
                print(_describe(result))
            return 0
        with stopper.installed():
            # a stop signal while the start waits for the database ends the wait
            stopper.attach("runlane maintenance", runlane.close)
            try:
                # an unmigrated schema fails here, with the migrate hint
                services = runlane.start_services(
                    on_service_error=_report_service_error,
                    limits=limits,
                    wait_for_database=args.wait_for_database,
                )
            except RunlaneClosed:
                if not stopper.requested.is_set():
                    raise
                return _stopped_while_waiting(stopper)
            try:
                stopper.attach(services.name, lambda: services.close(timeout=args.shutdown_timeout))
                changed = non_default_limits(limits)
                say(
                    f"{services.name} maintaining environment {runlane.environment!r}"
                    f"{with_limits(changed)}; SIGTERM or Ctrl-C stops it",
                    services=services.name,
                    environment=runlane.environment,
                    limits=changed,
                )
                code = _supervise(
                    stopper,
                    lambda: wait_in_slices(services.wait_until_closed),
                    args.shutdown_timeout,
                )
                say(f"{services.name} stopped", services=services.name, exit_code=code)
                return code
            finally:
                services.close(timeout=args.shutdown_timeout)  # idempotent
                runlane.close()
    finally:
        runlane.close()


def _describe(result: MaintenanceResult) -> str:
    return "\n".join(f"{name:<24} {value}" for name, value in result.counts().items())


def add_supervised_commands(commands: Any, load_app: LoadApp) -> None:
    worker = commands.add_parser(
        "worker", parents=[logged_parent()], help="execute runs until SIGTERM or SIGINT"
    )
    worker.add_argument("app", metavar="APP", help="module:attribute naming a Runlane")
    worker.add_argument("--concurrency", type=int, default=4, help="handler threads (default 4)")
    worker.add_argument("--queues", default=None, help="comma-separated queue names (default: all)")
    worker.add_argument(
        "--shutdown-timeout",
        type=timeout_seconds("--shutdown-timeout"),
        default=30.0,
        help="seconds handlers get to return after a stop signal, the whole close within it "
        "(default 30; inf: as long as they take)",
    )
    worker.add_argument(
        "--claim-batch",
        type=int,
        default=None,
        metavar="N",
        help="the most runs one claim takes (default twelve times --concurrency, at most 500); "
        "while a backlog of short handlers lasts the worker keeps up to about two claims "
        "ahead of its free slots: --claim-batch equal to --concurrency claims none ahead",
    )
    worker.add_argument(
        "--with-maintenance",
        action="store_true",
        help="also run the maintenance services in this process, closed with the worker",
    )
    add_wait_option(worker, DEFAULT_WAIT_FOR_DATABASE)
    add_limit_option(worker, "for the services of --with-maintenance")
    worker.set_defaults(handler=lambda args: _cmd_worker(load_app, args))

    maintenance = commands.add_parser(
        "maintenance",
        parents=[logged_parent()],
        help="run maintenance services until SIGTERM or SIGINT",
    )
    maintenance.add_argument("app", metavar="APP", help="module:attribute naming a Runlane")
    maintenance.add_argument(
        "--once", action="store_true", help="run one bounded pass, print what it changed, exit"
    )
    maintenance.add_argument(
        "--shutdown-timeout",
        type=timeout_seconds("--shutdown-timeout"),
        default=30.0,
        help="seconds to wait for the bands",
    )
    add_wait_option(maintenance, None)  # None: the default, refused with --once
    add_limit_option(maintenance)
    maintenance.set_defaults(handler=lambda args: _cmd_maintenance(load_app, args))
