"""The Postgres implementation of the storage contract: an executor and the repositories
that take it, composed."""

from __future__ import annotations

from runlane.postgres._attempts import AttemptRepository
from runlane.postgres._audit import AuditRepository
from runlane.postgres._bulk import BulkRepository, RequeueCount
from runlane.postgres._connections import DEFAULT_CONNECT_TIMEOUT, PoolSource, check_conninfo
from runlane.postgres._eager import EagerPublisher
from runlane.postgres._executor import Executor
from runlane.postgres._flow import FlowRepository
from runlane.postgres._inspect import InspectRepository
from runlane.postgres._maintenance import MaintenanceRepository
from runlane.postgres._now import Clock
from runlane.postgres._outbox import OutboxRepository
from runlane.postgres._pooler import Pooling
from runlane.postgres._queues import QueueRepository
from runlane.postgres._runs import RunRepository
from runlane.postgres._schedules import ScheduleRepository
from runlane.postgres._sql import notify_channel, validate_schema_name
from runlane.postgres._stats import StatsRepository
from runlane.postgres._waits import WaitRepository
from runlane.postgres._web_reads import WebReadRepository
from runlane.postgres._workers import WorkerRepository

__all__ = ["PostgresStorage", "notify_channel"]

# what close() gives the transport lane's publisher without a timeout of its caller
_EAGER_CLOSE_SECONDS = 10.0


class PostgresStorage:
    """Storage in one Postgres schema.

    The runtime's instance borrows connections from a psycopg pool; ``dedicated()`` makes a
    view of the same storage bound to one connection of its own, for a thread that must not
    wait on the pool (a worker slot, the lifecycle writer).

    No driver exception leaves a method: a connection that cannot be had or broke (once the
    reconnect retries are spent) raises :class:`~runlane.StorageUnavailable`, any other
    database error a :class:`~runlane.RunlaneError`; a closed storage raises
    :class:`~runlane.RunlaneClosed`.
    """

    def __init__(  # noqa: PLR0915 - a line per method: which repository serves it
        self,
        *,
        connection_string: str,
        schema: str,
        pool_min_size: int = 1,
        pool_max_size: int = 10,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        statement_timeout: float | None = 60.0,
        clock: Clock | None = None,
        pooler: str = "auto",
        _db: Executor | None = None,
        _eager: EagerPublisher | None = None,
        _requeued: RequeueCount | None = None,
    ) -> None:
        self.schema = validate_schema_name(schema)
        check_conninfo(connection_string)
        pooling = Pooling(pooler)  # direct or through a transaction pooler: postgres/_pooler.py
        self._db = _db or Executor(
            conninfo=connection_string,
            schema=schema,
            source=PoolSource(
                connection_string,
                min_size=pool_min_size,
                max_size=pool_max_size,
                name=f"runlane-{schema}",
                timeout=connect_timeout,
                pooling=pooling,
            ),
            connect_timeout=connect_timeout,
            statement_timeout=statement_timeout,
            clock=clock,
            pooling=pooling,
        )
        # a transport lane's publisher: triggers store their items claimed and hand them over
        self._eager = _eager
        self._owns_eager = False  # the storage it was attached to closes it
        # each method of the contract, by the repository that owns its table
        self._runs = runs = RunRepository(self._db, _eager)
        self.run_insert_many = runs.run_insert_many
        self.run_get = runs.run_get
        self.run_get_many = runs.run_get_many
        attempts = AttemptRepository(self._db)
        self.run_claim = attempts.run_claim
        self.run_claim_bounded = attempts.run_claim_bounded
        self.run_claim_or_next_due = attempts.run_claim_or_next_due
        self.run_claim_ids = attempts.run_claim_ids
        self.run_complete_many = attempts.run_complete_many
        self.run_fail_many = attempts.run_fail_many
        self.run_release_many = attempts.run_release_many
        self.run_mark_started = attempts.run_mark_started
        self.run_extend_leases = attempts.run_extend_leases
        self.run_progress_many = attempts.run_progress_many
        self.run_claim_limited = FlowRepository(self._db).run_claim_limited
        waits = WaitRepository(self._db)
        self.step_get = waits.step_get
        self.step_store = waits.step_store
        self.run_suspend = waits.run_suspend
        self.run_release = waits.run_release
        self.run_resume_waiters = waits.run_resume_waiters
        self.wait_token_create = waits.wait_token_create
        self.wait_token_get = waits.wait_token_get
        self.wait_token_complete = waits.wait_token_complete
        self.wait_token_time_out_due = waits.wait_token_time_out_due
        maintenance = MaintenanceRepository(self._db)
        self.database_now = maintenance.database_now
        self.run_deliver_due = maintenance.run_deliver_due
        self.run_list_expired = maintenance.run_list_expired
        self.run_expire_many = maintenance.run_expire_many
        self.run_wake_due_queues = maintenance.run_wake_due_queues
        self.run_prune = maintenance.run_prune
        self.maintenance_lease_acquire = maintenance.maintenance_lease_acquire
        self.maintenance_lease_refresh = maintenance.maintenance_lease_refresh
        self.maintenance_lease_release = maintenance.maintenance_lease_release
        self.maintenance_lease_list = maintenance.maintenance_lease_list
        self.maintenance_missing = maintenance.maintenance_missing
        schedules = ScheduleRepository(self._db)
        self.schedule_state_list = schedules.schedule_state_list
        self.schedule_state_reset = schedules.schedule_state_reset
        self.schedule_define = schedules.schedule_define
        self.schedule_fire = schedules.schedule_fire
        self.schedule_list = schedules.schedule_list
        self.schedule_get = schedules.schedule_get
        self.schedule_pause = schedules.schedule_pause
        self.schedule_resume = schedules.schedule_resume
        self.schedule_run_now = schedules.schedule_run_now
        self.schedule_list_late = schedules.schedule_list_late
        workers = WorkerRepository(self._db)
        self.worker_list = workers.worker_list
        self.worker_prune = workers.worker_prune
        inspect = InspectRepository(self._db)
        self.status_counts = inspect.status_counts
        self.run_list = inspect.run_list
        self.run_list_statement = inspect.run_list_statement
        self.run_history = inspect.run_history
        self.run_retry = inspect.run_retry
        self.run_cancel = inspect.run_cancel
        # shared with the views audited actions run on: a retry walk's count spans them
        self._requeued = _requeued or RequeueCount()
        bulk = BulkRepository(self._db, self._requeued)
        self.run_bulk_count = bulk.run_bulk_count
        self.run_bulk_count_within = bulk.run_bulk_count_within
        self.run_bulk_batch = bulk.run_bulk_batch
        queues = QueueRepository(self._db)
        self.queue_pause = queues.queue_pause
        self.queue_resume = queues.queue_resume
        self.queue_known = queues.queue_known
        self.queue_list = queues.queue_list
        stats = StatsRepository(self._db)
        self.stats_fold = stats.stats_fold
        self.stats_prune = stats.stats_prune
        self.stats_read = stats.stats_read
        web = WebReadRepository(self._db)
        self.web_run_extras = web.web_run_extras
        self.web_runs_estimate = web.web_runs_estimate
        self.web_run_search = web.web_run_search
        self.web_worker_runs = web.web_worker_runs
        outbox = OutboxRepository(self._db)
        self.outbox_enable = outbox.outbox_enable
        self.outbox_claim_page = outbox.outbox_claim_page
        self.outbox_extend = outbox.outbox_extend
        self.outbox_published = outbox.outbox_published
        self.outbox_unclaim = outbox.outbox_unclaim
        self.outbox_failed = outbox.outbox_failed
        self.outbox_next_due = outbox.outbox_next_due
        self.outbox_defer = outbox.outbox_defer
        self.outbox_recover = outbox.outbox_recover
        self.outbox_status = outbox.outbox_status
        self.outbox_failing_queues = outbox.outbox_failing_queues
        self.wal_flush = outbox.wal_flush
        self.run_delivery_state = outbox.run_delivery_state
        audit = AuditRepository(self._db, self._in_transaction)
        self.audit_action = audit.audit_action
        self.audit_write = audit.audit_write
        self.audit_list = audit.audit_list
        self.audit_prune = audit.audit_prune
        self.run_reschedule = audit.run_reschedule
        self.run_delete = audit.run_delete

    def _in_transaction(self, db: Executor) -> PostgresStorage:
        # an operator action's view, on the connection of its record's transaction
        return PostgresStorage(
            connection_string=self._db.conninfo,
            schema=self.schema,
            _db=db,
            _requeued=self._requeued,
        )

    @property
    def connection_string(self) -> str:
        return self._db.conninfo

    def open(self) -> None:
        """Connect (the pool's minimum connections); idempotent. A failed open leaves the
        storage closed but re-openable: the next call tries again from scratch."""
        self._db.open()

    def close(self, timeout: float | None = None) -> None:
        """Close the connections; the transport lane's publisher first, which publishes
        what eager triggers handed over; both within ``timeout`` together (None: the
        publisher's own 10 s, the pool's own 5 s for its threads)."""
        eager = self._eager if self._owns_eager else None
        if eager is None:
            self._db.close(timeout)
            return
        # publishes what eager triggers handed over, first, and records it: the storage
        # refuses new calls but its records (run(..., draining=True))
        self._db.close(
            timeout, lambda left: eager.close(_EAGER_CLOSE_SECONDS if timeout is None else left)
        )

    @property
    def eager_publisher(self) -> EagerPublisher | None:
        """The transport lane's publisher attached to this storage, if any."""
        return self._eager

    def interrupt(self) -> None:
        """Cancel the statement in flight on a dedicated view's connection (called from
        another thread, e.g. by close at its deadline); the blocked call then raises
        :class:`~runlane.StorageUnavailable`. A no-op when idle, and on the pooled storage."""
        self._db.interrupt()

    def dedicated(self, name: str, *, durable_commits: bool = True) -> PostgresStorage:
        """A view of this storage on one connection of its own, for one thread.

        ``durable_commits=False`` (claims only: one a server crash loses only makes its run
        claimable again) turns ``synchronous_commit`` off: commits return before the WAL flush."""
        return PostgresStorage(
            connection_string=self._db.conninfo,
            schema=self.schema,
            _db=self._db.dedicated(name, synchronous_commit=durable_commits),
            _eager=self._eager,
        )

    def attach_eager_publisher(self, publisher: EagerPublisher) -> None:
        """Triggers without ``connection=`` store their outbox items already claimed and
        hand them to ``publisher`` after commit (a transport lane calls this). Closing
        this storage closes the publisher; dedicated views share it."""
        self._eager = publisher
        self._owns_eager = True
        self._runs.attach(publisher)
