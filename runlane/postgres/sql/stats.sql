-- The per-minute rollup (migration 20): the maintenance band's fold and prune, and the
-- reads of Runlane.stats.
--
-- Named statements of the Postgres storage; {schema} is the quoted schema name. Minutes are
-- UTC minutes from the epoch (date_bin), whatever the session's time zone. A histogram's
-- bucket of a value v is the first whose upper bound is >= v (Prometheus' le): with the
-- bounds given negated and ascending (%(negated_bounds)s), n - width_bucket(-v, ...) where n
-- is the number of bounds, n itself above the last bound.

-- name: stats_fold
-- Recomputes whole minutes of one environment from runs and attempts and replaces them:
-- the window starts at the earlier of where the last fold stopped (stats_folds) and
-- %(lookback_seconds)s before the current minute, spans at most %(max_minutes)s minutes, and
-- ends after the current minute (which the next pass recomputes). Minutes older than the
-- look-back are final: a write committed that long after its transaction's start, or an
-- attempt that started before them and ends in a retry after, is not counted. Figures:
-- triggered (runs.created_at), started (attempts by started_at: ended ones in attempts,
-- live ones on their run), retried (those ended as retrying, or expired with their run
-- retried), completed, failed and cancelled (runs.finished_at), and for the runs that
-- completed or failed the wait (due_at to attempt_started_at) and run time (to finished_at)
-- of their final attempt. Rows of the window's minutes nothing happened in are deleted.
-- Returns the window and the rows written.
with win as materialized (
    select w.start_at,
           least(w.start_at + %(max_minutes)s * interval '1 minute',
                 w.now_minute + interval '1 minute') as end_at
    from (
        select c.now_minute,
               least(coalesce(f.folded_until, c.back), c.back) as start_at
        from (select date_bin('1 minute', {@now}, timestamptz 'epoch') as now_minute,
                     date_bin('1 minute', {@now}, timestamptz 'epoch')
                         - %(lookback_seconds)s * interval '1 second' as back) as c
        left join {schema}.stats_folds as f on f.environment = %(environment)s
    ) as w
), created as (
    select r.queue, r.task_id, date_bin('1 minute', r.created_at, timestamptz 'epoch') as minute,
           count(*)::int as n
    from {schema}.runs as r, win
    where r.environment = %(environment)s
      and r.created_at >= win.start_at and r.created_at < win.end_at
    group by 1, 2, 3
), starts as (
    select r.queue, r.task_id, date_bin('1 minute', a.started_at, timestamptz 'epoch') as minute,
           (a.outcome = 'retrying'
            or (a.outcome = 'expired'
                and (r.attempt > a.attempt or r.status = 'retrying'))) as retried
    from {schema}.attempts as a
    join {schema}.runs as r on r.id = a.run_id
    cross join win
    where a.started_at >= win.start_at and a.started_at < win.end_at
      and r.environment = %(environment)s
    union all
    select r.queue, r.task_id, date_bin('1 minute', r.attempt_started_at, timestamptz 'epoch'),
           false
    from {schema}.runs as r, win
    where r.environment = %(environment)s
      and r.status in ('running', 'cancellation_requested')
      and r.lease_token is not null
      and r.attempt_started_at >= win.start_at and r.attempt_started_at < win.end_at
), started as (
    select queue, task_id, minute, count(*)::int as n, (count(*) filter (where retried))::int as r
    from starts
    group by 1, 2, 3
), ended as materialized (
    select r.queue, r.task_id, date_bin('1 minute', r.finished_at, timestamptz 'epoch') as minute,
           r.status,
           case when r.status in ('completed', 'failed') and r.attempt_started_at is not null
                then greatest(0, extract(epoch from r.attempt_started_at - r.due_at))::float8
           end as wait,
           case when r.status in ('completed', 'failed') and r.attempt_started_at is not null
                then greatest(0, extract(epoch from r.finished_at - r.attempt_started_at))::float8
           end as run
    from {schema}.runs as r, win
    where r.environment = %(environment)s
      and r.status in ('completed', 'failed', 'cancelled')
      and r.pruned_at is null
      and r.finished_at >= win.start_at and r.finished_at < win.end_at
), finished as (
    select queue, task_id, minute,
           (count(*) filter (where status = 'completed'))::int as completed,
           (count(*) filter (where status = 'failed'))::int as failed,
           (count(*) filter (where status = 'cancelled'))::int as cancelled,
           coalesce(sum(wait), 0) as wait_sum,
           coalesce(sum(run), 0) as run_sum
    from ended
    group by 1, 2, 3
), buckets as (
    select queue, task_id, minute, 'wait' as kind,
           %(bucket_count)s - width_bucket(-wait, %(negated_bounds)s::float8[]) as idx,
           count(*)::int as n
    from ended where wait is not null
    group by 1, 2, 3, 4, 5
    union all
    select queue, task_id, minute, 'run',
           %(bucket_count)s - width_bucket(-run, %(negated_bounds)s::float8[]),
           count(*)::int
    from ended where run is not null
    group by 1, 2, 3, 4, 5
), keys as (
    select queue, task_id, minute from created
    union select queue, task_id, minute from started
    union select queue, task_id, minute from finished
), rolled as (
    select k.queue, k.task_id, k.minute,
           coalesce(c.n, 0) as triggered, coalesce(s.n, 0) as started, coalesce(s.r, 0) as retried,
           coalesce(f.completed, 0) as completed, coalesce(f.failed, 0) as failed,
           coalesce(f.cancelled, 0) as cancelled,
           array(select coalesce(b.n, 0)
                 from generate_series(0, %(bucket_count)s) as g(i)
                 left join buckets as b
                   on b.kind = 'wait' and b.idx = g.i and b.queue = k.queue
                  and b.task_id = k.task_id and b.minute = k.minute
                 order by g.i) as wait_counts,
           coalesce(f.wait_sum, 0) as wait_sum,
           array(select coalesce(b.n, 0)
                 from generate_series(0, %(bucket_count)s) as g(i)
                 left join buckets as b
                   on b.kind = 'run' and b.idx = g.i and b.queue = k.queue
                  and b.task_id = k.task_id and b.minute = k.minute
                 order by g.i) as run_counts,
           coalesce(f.run_sum, 0) as run_sum
    from keys as k
    left join created as c using (queue, task_id, minute)
    left join started as s using (queue, task_id, minute)
    left join finished as f using (queue, task_id, minute)
), cleared as (
    delete from {schema}.stats_minutes as m
    using win
    where m.environment = %(environment)s
      and m.minute >= win.start_at and m.minute < win.end_at
      and not exists (select from rolled as k
                      where k.queue = m.queue and k.task_id = m.task_id
                        and k.minute = m.minute)
    returning 1
), written as (
    insert into {schema}.stats_minutes as m (
        environment, minute, queue, task_id, triggered, started, retried, completed, failed,
        cancelled, wait_counts, wait_sum, run_counts, run_sum)
    select %(environment)s, minute, queue, task_id, triggered, started, retried, completed,
           failed, cancelled, wait_counts, wait_sum, run_counts, run_sum
    from rolled
    on conflict (environment, minute, queue, task_id) do update
    set triggered = excluded.triggered, started = excluded.started,
        retried = excluded.retried, completed = excluded.completed,
        failed = excluded.failed, cancelled = excluded.cancelled,
        wait_counts = excluded.wait_counts, wait_sum = excluded.wait_sum,
        run_counts = excluded.run_counts, run_sum = excluded.run_sum
    returning 1
), moved as (
    insert into {schema}.stats_folds as f (environment, folded_until)
    select %(environment)s, end_at from win
    on conflict (environment) do update set folded_until = excluded.folded_until
    returning 1
)
select win.start_at, win.end_at,
       (select count(*) from written)::int as written,
       (select count(*) from cleared)::int as cleared,
       (select count(*) from moved)::int as moved
from win;

-- name: stats_prune
-- Retention: the oldest rows of the rollup older than %(keep_seconds)s, at most %(limit)s.
with old as (
    select environment, minute, queue, task_id
    from {schema}.stats_minutes
    where environment = %(environment)s
      and minute < {@now} - %(keep_seconds)s * interval '1 second'
    order by minute
    limit %(limit)s
)
delete from {schema}.stats_minutes as m
using old
where m.environment = old.environment and m.minute = old.minute
  and m.queue = old.queue and m.task_id = old.task_id;

-- name: stats_read
-- Runlane.stats: the rollup's rows of [since, until) (minutes; null queue or task: any)
-- summed per bucket of %(bucket_seconds)s seconds from the epoch, with their histograms
-- summed element by element. Served by the primary key (environment, minute, ...).
with picked as materialized (
    select date_bin(%(bucket_seconds)s * interval '1 second', minute, timestamptz 'epoch')
               as bucket,
           triggered, started, retried, completed, failed, cancelled,
           wait_counts, wait_sum, run_counts, run_sum
    from {schema}.stats_minutes
    where environment = %(environment)s
      and minute >= %(since)s and minute < %(until)s
      and (%(queue)s::text is null or queue = %(queue)s::text)
      and (%(task_id)s::text is null or task_id = %(task_id)s::text)
), sums as (
    select bucket, sum(triggered)::bigint as triggered, sum(started)::bigint as started,
           sum(retried)::bigint as retried, sum(completed)::bigint as completed,
           sum(failed)::bigint as failed, sum(cancelled)::bigint as cancelled,
           sum(wait_sum) as wait_sum, sum(run_sum) as run_sum
    from picked
    group by bucket
), waits as (
    select p.bucket, u.i, sum(u.n)::bigint as n
    from picked as p, unnest(p.wait_counts) with ordinality as u(n, i)
    where u.n <> 0
    group by 1, 2
), runs as (
    select p.bucket, u.i, sum(u.n)::bigint as n
    from picked as p, unnest(p.run_counts) with ordinality as u(n, i)
    where u.n <> 0
    group by 1, 2
)
select s.bucket, s.triggered, s.started, s.retried, s.completed, s.failed, s.cancelled,
       s.wait_sum, s.run_sum,
       (select coalesce(array_agg(array[w.i, w.n] order by w.i), '{{}}')
        from waits as w where w.bucket = s.bucket) as wait_counts,
       (select coalesce(array_agg(array[r.i, r.n] order by r.i), '{{}}')
        from runs as r where r.bucket = s.bucket) as run_counts
from sums as s
order by s.bucket;
