-- The monitoring view.
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Every write an attempt makes is fenced by
-- run id, attempt number and lease token; every maintenance write re-checks its condition
-- in the statement that changes the row. Names are unique across the files of sql/.

-- name: status_counts
-- The "monitor progress" view: counts that must keep falling when maintenance is healthy.
select
    (select count(*) from {schema}.runs
      where environment = %(environment)s and status = 'queued' and due_at <= {@now})
        as queued_due,
    (select count(*) from {schema}.runs
      where environment = %(environment)s and status = 'running') as running,
    (select count(*) from {schema}.runs
      where environment = %(environment)s and status = 'running'
        and started_attempt is distinct from attempt) as claimed_not_started,
    (select count(*) from {schema}.runs
      where environment = %(environment)s and status in ('retrying', 'released')
        and due_at < {@now}) as deferred_past_due,
    (select count(*) from {schema}.runs
      where environment = %(environment)s and status in ('running', 'cancellation_requested')
        and lease_expires_at < {@now}) as expired_leases,
    (select count(*) from {schema}.runs
      where environment = %(environment)s and status = 'cancellation_requested'
        and (lease_expires_at is null or lease_expires_at < {@now})) as stuck_cancellations,
    (select count(*) from {schema}.runs
      where environment = %(environment)s and pruned_at is not null
        and remaining_children > 0) as tombstones_with_children,
    (select coalesce(sum(remaining_children), 0)::bigint from {schema}.runs
      where environment = %(environment)s and pruned_at is not null
        and remaining_children > 0) as tombstone_remaining_children,
    (select count(*) from {schema}.runs
      where environment = %(environment)s and status = 'waiting') as waiting,
    (select min(due_at) from {schema}.runs
      where environment = %(environment)s and status in ('retrying', 'released')
        and due_at < {@now}) as oldest_deferred_due_at,
    (select count(*) from {schema}.wait_tokens
      where environment = %(environment)s and status = 'pending'
        and timeout_at < {@now}) as tokens_past_timeout,
    (select count(distinct r.wait_token_id) from {schema}.runs as r
      join {schema}.wait_tokens as t on t.id = r.wait_token_id
      where r.environment = %(environment)s and r.status = 'waiting'
        and r.wait_kind = 'token' and t.status <> 'pending') as resolved_tokens_with_waiting_runs,
    (select count(*) from {schema}.runs as r
      join {schema}.wait_tokens as t on t.id = r.wait_token_id
      where r.environment = %(environment)s and r.status = 'waiting'
        and r.wait_kind = 'token' and t.status <> 'pending') as runs_waiting_on_resolved_tokens;

-- name: status_resolved_tokens
-- The resolved tokens with the most runs still waiting on them (at most 10): a count that
-- does not fall from one look to the next is a stuck resume, one that falls is draining.
select r.wait_token_id as token_id, count(*) as waiting_runs,
       extract(epoch from {@now} - min(t.resolved_at))::float8 as resolved_age_seconds
from {schema}.runs as r
join {schema}.wait_tokens as t on t.id = r.wait_token_id
where r.environment = %(environment)s and r.status = 'waiting'
  and r.wait_kind = 'token' and t.status <> 'pending'
group by r.wait_token_id
order by count(*) desc, r.wait_token_id
limit 10;

-- name: maintenance_missing
-- The worker's watch: retries or releases are past due while no maintenance band of the
-- environment has a live owner.
select exists (
           select 1 from {schema}.runs
           where environment = %(environment)s and status in ('retrying', 'released')
             and due_at < {@now})
       and not exists (
           select 1 from {schema}.maintenance_leases
           where environment = %(environment)s and expires_at > {@clock_now});

-- name: status_late_schedules
-- Schedules whose awaited slot is more than ``late_seconds`` past (database time) and that
-- are not paused: maintenance is not firing them. The primary key serves the environment.
select schedule_id
from {schema}.schedules
where environment = %(environment)s
  and not paused
  and next_slot_at < {@now} - make_interval(secs => %(late_seconds)s)
order by next_slot_at, schedule_id
limit %(limit)s;
