-- Delivery workers: the operator's list, and cleanup of rows of workers gone.
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Names are unique across the files of sql/.
-- A worker writes its row with each heartbeat, in run_extend_leases (lifecycle.sql).

-- name: worker_list
-- A running worker unseen for three heartbeat intervals (database time) is lost; a stopping
-- one for two (it beats every interval until it writes stopped, so a process gone while
-- stopping, killed or out of its close timeout, does not stay stopping). One range of
-- workers_by_environment; the table holds only the workers of the retention (cleanup
-- deletes stopped and lost rows).
select id, host, pid, runlane_version, queues, concurrency, started_at, last_seen_at,
       case when state = 'running'
                 and last_seen_at < {@now} - 3 * heartbeat_seconds * interval '1 second'
            then 'lost'
            when state = 'stopping'
                 and last_seen_at < {@now} - 2 * heartbeat_seconds * interval '1 second'
            then 'lost'
            else state end as state,
       stopped_at
from {schema}.workers
where environment = %(environment)s
  and (%(include_stopped)s or state <> 'stopped')
order by started_at, id;

-- name: worker_prune
-- Cleanup: rows of workers stopped, or lost (unseen for three heartbeat intervals), and
-- last seen more than the retention ago, oldest first, at most limit of them. A stopped
-- worker's last heartbeat is its stop. The conditions are repeated on the deleted row, so
-- a worker whose heartbeat landed meanwhile is re-checked and kept.
delete from {schema}.workers as w
where w.id in (
    select id
    from {schema}.workers
    where environment = %(environment)s
      and last_seen_at < {@now} - %(retention_seconds)s * interval '1 second'
      and (state = 'stopped'
           or last_seen_at < {@now} - 3 * heartbeat_seconds * interval '1 second')
    order by last_seen_at
    limit %(limit)s)
  and w.last_seen_at < {@now} - %(retention_seconds)s * interval '1 second'
  and (w.state = 'stopped'
       or w.last_seen_at < {@now} - 3 * w.heartbeat_seconds * interval '1 second');
