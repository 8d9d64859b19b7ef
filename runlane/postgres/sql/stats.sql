-- The rollup (migration 20): the maintenance band's fold and prune, and the reads of
-- Runlane.stats. Rows of span 1 are minutes computed from runs and attempts, each folded
-- twice and never lowered (they count history), with what retry, cancel and delete recorded
-- in stats_departed of the runs they changed in those minutes (migration 25); rows of spans
-- 15 and 60 are those minutes summed (a histogram element by element: sum(a[1]), ...).
--
-- Named statements of the Postgres storage; {schema} is the quoted schema name. Minutes are
-- UTC minutes from the epoch (date_bin), whatever the session's time zone. A histogram's
-- bucket of a value v is the first whose upper bound is >= v (Prometheus' le): with the
-- bounds given negated and ascending (%(negated_bounds)s), n - width_bucket(-v, ...) where n
-- is the number of bounds, n itself above the last bound.

-- name: stats_fold_window
-- The minutes the next fold recomputes, [start_at, end_at): none when no minute closed
-- since the last fold (stats_folds.folded_until), else from a minute before where it
-- stopped (a write committed late in the minute it counts in is counted then; %(first)s
-- minutes back when nothing was folded yet) to the current minute, at most
-- %(max_minutes)s of them (a fold far behind catches up that fast).
select w.start_at, least(w.closed, w.start_at + %(max_minutes)s * interval '1 minute')
from (
    select c.closed, f.folded_until,
           coalesce(f.folded_until, c.closed - %(first)s * interval '1 minute')
               - interval '1 minute' as start_at
    from (select date_bin('1 minute', {@now}, timestamptz 'epoch') as closed) as c
    left join {schema}.stats_folds as f on f.environment = %(environment)s
) as w
where w.folded_until is null or w.folded_until < w.closed;

-- name: stats_fold
-- Computes the whole minutes [%(start_at)s, %(end_at)s) of one environment from runs and
-- attempts, and the figures runlane_retry_runs, runlane_cancel_runs and runlane_delete_runs
-- took from them and recorded in stats_departed (stats_fold_window chose the minutes: each
-- is computed when it has closed and once more a minute later; older minutes are final, and
-- their records are deleted here). Figures: triggered (runs.created_at),
-- started (attempts by started_at: ended ones in attempts, live ones on their run), retried
-- (those ended as retrying, or expired with their run retried), completed, failed and
-- cancelled (runs.finished_at), and for the runs that completed or failed the wait (due_at
-- to attempt_started_at) and run time (to finished_at) of their final attempt.
-- The figures count history, which a scan of runs loses when a run is retried (a failed run
-- queued again), cancelled after its lease lapsed (the retry of that attempt), deleted (with
-- its attempts) or tombstoned: those functions record, in the same commit, what they take
-- away from minutes not yet final, and a fold sees either the run as it was or the record.
-- The second computation of a minute still only adds to the first, never takes away. Each of triggered, started and retried
-- takes the greater of the two (between the passes a count grows only by writes committed
-- late and shrinks only by such changes); the finishes (completed, failed, cancelled and
-- both histograms, which describe the same runs) are replaced as a whole only when the new
-- pass counts at least as many of each of completed, failed and cancelled, else the first
-- pass's stay. Exact for what runlane's own writes and functions do (a write committed
-- more than a minute late aside); changes made by other means (the owner's raw SQL) are
-- not recorded, and count as the first two passes find them. No row of the rollup is
-- deleted; stats_folds records the end. Returns the rows written (stats_fold_span then
-- sums the minutes into the longer spans).
with win as materialized (
    select %(start_at)s::timestamptz as start_at, %(end_at)s::timestamptz as end_at
), departed as materialized (
    -- what retry, cancel and delete took away from the runs of these minutes (migration 25)
    select d.queue, d.task_id, date_bin('1 minute', d.at, timestamptz 'epoch') as minute,
           d.triggered, d.started, d.retried, d.status, d.wait, d.run
    from {schema}.stats_departed as d, win
    where d.environment = %(environment)s and d.at >= win.start_at and d.at < win.end_at
), created as (
    select queue, task_id, minute, sum(n)::int as n
    from (
        select r.queue, r.task_id,
               date_bin('1 minute', r.created_at, timestamptz 'epoch') as minute, 1 as n
        from {schema}.runs as r, win
        where r.environment = %(environment)s
          and r.created_at >= win.start_at and r.created_at < win.end_at
        union all
        select queue, task_id, minute, triggered from departed where triggered > 0
    ) as c
    group by 1, 2, 3
), starts as (
    select r.queue, r.task_id, date_bin('1 minute', a.started_at, timestamptz 'epoch') as minute,
           1 as n,
           (a.outcome = 'retrying'
            or (a.outcome = 'expired'
                and (r.attempt > a.attempt or r.status = 'retrying')))::int as retried
    from {schema}.attempts as a
    join {schema}.runs as r on r.id = a.run_id
    cross join win
    where a.started_at >= win.start_at and a.started_at < win.end_at
      and r.environment = %(environment)s
    union all
    select r.queue, r.task_id, date_bin('1 minute', r.attempt_started_at, timestamptz 'epoch'),
           1, 0
    from {schema}.runs as r, win
    where r.environment = %(environment)s
      and r.status in ('running', 'cancellation_requested')
      and r.lease_token is not null
      and r.attempt_started_at >= win.start_at and r.attempt_started_at < win.end_at
    union all
    select queue, task_id, minute, started, retried
    from departed where started > 0 or retried > 0
), started as (
    select queue, task_id, minute, sum(n)::int as n, sum(retried)::int as r
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
    union all
    select queue, task_id, minute, status, wait, run
    from departed where status is not null
), finished as (
    select queue, task_id, minute,
           (count(*) filter (where status = 'completed'))::int as completed,
           (count(*) filter (where status = 'failed'))::int as failed,
           (count(*) filter (where status = 'cancelled'))::int as cancelled,
           -- summed exactly (the values are whole microseconds), so in any order the same
           coalesce(sum(wait::numeric), 0)::float8 as wait_sum,
           coalesce(sum(run::numeric), 0)::float8 as run_sum
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
), written as (
    insert into {schema}.stats_rollup as m (
        environment, span, minute, queue, task_id, triggered, started, retried, completed,
        failed, cancelled, wait_counts, wait_sum, run_counts, run_sum)
    select %(environment)s, 1, minute, queue, task_id, triggered, started, retried, completed,
           failed, cancelled, wait_counts, wait_sum, run_counts, run_sum
    from rolled
    on conflict (environment, span, minute, queue, task_id) do update
    set triggered = greatest(m.triggered, excluded.triggered),
        started = greatest(m.started, excluded.started),
        retried = greatest(m.retried, excluded.retried),
        -- the finishes as a whole: the new pass's when it counts at least as many of each
        (completed, failed, cancelled, wait_counts, wait_sum, run_counts, run_sum) = (
            select case when c.grown then excluded.completed else m.completed end,
                   case when c.grown then excluded.failed else m.failed end,
                   case when c.grown then excluded.cancelled else m.cancelled end,
                   case when c.grown then excluded.wait_counts else m.wait_counts end,
                   case when c.grown then excluded.wait_sum else m.wait_sum end,
                   case when c.grown then excluded.run_counts else m.run_counts end,
                   case when c.grown then excluded.run_sum else m.run_sum end
            from (select excluded.completed >= m.completed and excluded.failed >= m.failed
                         and excluded.cancelled >= m.cancelled as grown) as c)
    returning 1
), settled as (
    -- the recorded figures of minutes before this window: final, no fold reads them again
    delete from {schema}.stats_departed as d
    using win
    where d.environment = %(environment)s and d.at < win.start_at
), moved as (
    insert into {schema}.stats_folds as f (environment, folded_until)
    select %(environment)s, end_at from win
    on conflict (environment) do update
    set folded_until = greatest(f.folded_until, excluded.folded_until)
    returning 1
)
select (select count(*) from written)::int as written,
       (select count(*) from moved)::int as moved;

-- name: stats_fold_span
-- The rows of span %(span)s (15 or 60 minutes) that the minutes from %(start_at)s to
-- %(end_at)s fall in, summed again from all their minutes' rows; a span none of whose
-- minutes has a row is deleted.
with win as materialized (
    select date_bin(%(span)s * interval '1 minute', %(start_at)s::timestamptz,
                    timestamptz 'epoch') as start_at,
           date_bin(%(span)s * interval '1 minute',
                    %(end_at)s::timestamptz - interval '1 microsecond', timestamptz 'epoch')
               + %(span)s * interval '1 minute' as end_at
), rolled as (
    select date_bin(%(span)s * interval '1 minute', m.minute, timestamptz 'epoch') as minute,
           m.queue, m.task_id,
           sum(m.triggered)::int as triggered, sum(m.started)::int as started,
           sum(m.retried)::int as retried, sum(m.completed)::int as completed,
           sum(m.failed)::int as failed, sum(m.cancelled)::int as cancelled,
           {@stats_wait_counts_summed}::int[] as wait_counts,
           sum(m.wait_sum) as wait_sum,
           {@stats_run_counts_summed}::int[] as run_counts,
           sum(m.run_sum) as run_sum
    from {schema}.stats_rollup as m, win
    where m.environment = %(environment)s and m.span = 1
      and m.minute >= win.start_at and m.minute < win.end_at
    group by 1, 2, 3
), cleared as (
    delete from {schema}.stats_rollup as s
    using win
    where s.environment = %(environment)s and s.span = %(span)s
      and s.minute >= win.start_at and s.minute < win.end_at
      and not exists (select from rolled as k
                      where k.queue = s.queue and k.task_id = s.task_id
                        and k.minute = s.minute)
    returning 1
), written as (
    insert into {schema}.stats_rollup as s (
        environment, span, minute, queue, task_id, triggered, started, retried, completed,
        failed, cancelled, wait_counts, wait_sum, run_counts, run_sum)
    select %(environment)s, %(span)s, minute, queue, task_id, triggered, started, retried,
           completed, failed, cancelled, wait_counts, wait_sum, run_counts, run_sum
    from rolled
    on conflict (environment, span, minute, queue, task_id) do update
    set triggered = excluded.triggered, started = excluded.started,
        retried = excluded.retried, completed = excluded.completed,
        failed = excluded.failed, cancelled = excluded.cancelled,
        wait_counts = excluded.wait_counts, wait_sum = excluded.wait_sum,
        run_counts = excluded.run_counts, run_sum = excluded.run_sum
    returning 1
)
select (select count(*) from written)::int, (select count(*) from cleared)::int;

-- name: stats_prune
-- Retention: the oldest rows of the rollup (every span) older than %(keep_seconds)s, at most
-- %(limit)s.
with old as (
    select environment, span, minute, queue, task_id
    from {schema}.stats_rollup
    where environment = %(environment)s
      and minute < {@now} - %(keep_seconds)s * interval '1 second'
    order by minute
    limit %(limit)s
)
delete from {schema}.stats_rollup as m
using old
where m.environment = old.environment and m.span = old.span and m.minute = old.minute
  and m.queue = old.queue and m.task_id = old.task_id;

-- name: stats_read
-- Runlane.stats: the rollup's rows of span %(span)s in [since, until) (null queue or task:
-- any) summed per bucket of %(bucket_seconds)s seconds from the epoch (a multiple of the
-- span), histograms element by element. Served by the primary key.
select date_bin(%(bucket_seconds)s * interval '1 second', minute, timestamptz 'epoch')
           as bucket,
       sum(triggered)::bigint as triggered, sum(started)::bigint as started,
       sum(retried)::bigint as retried, sum(completed)::bigint as completed,
       sum(failed)::bigint as failed, sum(cancelled)::bigint as cancelled,
       sum(wait_sum) as wait_sum, sum(run_sum) as run_sum,
       {@stats_wait_counts_summed} as wait_counts,
       {@stats_run_counts_summed} as run_counts
from {schema}.stats_rollup as m
where environment = %(environment)s and span = %(span)s
  and minute >= %(since)s and minute < %(until)s
  and {@run_task_queue_filter}
group by 1
order by 1;
