-- runlane schema version 25: the rollup counts runs retried, cancelled or deleted before
-- their minutes were folded.
-- compatibility: additive
--
-- The rollup (migration 20) computes each minute from runs and attempts when it closes and
-- once more a minute later, and the second pass only adds. What an operator's action took
-- away before the first pass was lost: a run retried (failed, queued again) lost its
-- finish, one deleted (by delete_runs, or cleanup with a short retention) its trigger, its
-- attempts' starts and retries and its finish, a tombstoned parent its finish, and a
-- retrying run cancelled after its attempt's lease lapsed that attempt's retry.
--
-- Now the functions that make those changes (runlane_retry_runs, runlane_cancel_runs,
-- runlane_delete_runs: SECURITY DEFINER, so run as the owner) record, in the same
-- statement, the figures the change removes, in stats_departed: one row per figure, dated
-- when it counts (created, an attempt's start, the finish, with the wait and run time the
-- fold computes), only for figures whose minute the fold has not yet passed twice (not
-- before stats_folds.folded_until less a minute; when nothing was folded yet, the last 10
-- minutes: the first fold looks back 5; never more than a day back, so a rollup left far
-- behind does not make cleanup record all it deletes). Cleanup of old runs and the actions
-- on older runs record nothing. The fold (sql/stats.sql) counts these rows with the runs
-- and attempts of its window, and deletes those of minutes before its window (final). A
-- run and the rows recorded for it are written in one commit: a fold sees one or the other.
-- The hot path (claims, completions, expiry) writes nothing here.
--
-- stats_departed belongs to the owner: the functions write it; the maintenance role reads
-- and prunes it (grants.sql: re-run `runlane grant maintenance ROLE` after this migration).
--
-- Additive for the runtimes of version 24: the functions return what they returned, change
-- runs as they did, and write one more table; those runtimes' folds do not read it (and are
-- as exact as they were).

create table {schema}.stats_departed (
    environment text not null,
    at          timestamptz not null,
    queue       text not null,
    task_id     text not null,
    triggered   smallint not null default 0,
    started     smallint not null default 0,
    retried     smallint not null default 0,
    -- a finish: completed, failed or cancelled, and for the first two the final attempt's
    -- wait (due to start) and run time, in seconds
    status      text,
    wait        double precision,
    run         double precision
);

create index stats_departed_by_minute on {schema}.stats_departed (environment, at);

-- The earliest moment whose figures the rollup may still recompute: see the header.
create function {schema}.runlane_stats_unfolded_since(p_environment text)
returns timestamptz
language sql
stable
set search_path = pg_catalog, pg_temp
as $$
    select greatest(
        coalesce((select f.folded_until - interval '1 minute'
                  from {schema}.stats_folds as f where f.environment = p_environment),
                 now() - interval '10 minutes'),
        now() - interval '1 day')
$$;

revoke execute on function {schema}.runlane_stats_unfolded_since(text) from public;

-- As in version 14; a cancelled run that was retrying after its attempt's lease lapsed
-- records that attempt's retry (the fold counts it from the run's status).
create or replace function {schema}.runlane_cancel_runs(
    p_environment text, p_ids uuid[], p_skip_locked boolean)
returns table (id uuid, previous text, current text)
language sql
security definer
set search_path = pg_catalog, pg_temp
as $$
    with locked as (
        select unnest({schema}.runlane_lock_runs(p_environment, p_ids, p_skip_locked)) as id
    ), target as (
        select r.id, r.status
        from {schema}.runs as r
        where r.id in (select l.id from locked as l) and r.environment = p_environment
    ), changed as (
        -- the row's status as it is once locked (r), not as the statement's snapshot saw
        -- it (t): a claim or a cancel committed while runlane_lock_runs waited is seen
        update {schema}.runs as r
        set status = case when r.status = 'running' then 'cancellation_requested'
                          else 'cancelled' end,
            finished_at = case when r.status = 'running' then null else now() end,
            wait_kind = null,
            wait_token_id = null,
            wait_run_id = null,
            updated_at = now()
        from target as t
        where r.id = t.id
          and r.status in ('queued', 'retrying', 'released', 'waiting', 'running')
        returning r.id, r.status
    ), kept as (
        insert into {schema}.stats_departed (environment, at, queue, task_id, retried)
        select p_environment, a.started_at, r.queue, r.task_id, 1
        from {schema}.runs as r
        join {schema}.attempts as a on a.run_id = r.id
        cross join (select {schema}.runlane_stats_unfolded_since(p_environment) as at) as since
        where r.id in (select t.id from target as t where t.status = 'retrying')
          and r.id in (select c.id from changed as c)
          and a.outcome = 'expired' and a.attempt >= r.attempt
          and a.started_at >= since.at
    )
    select t.id, t.status, c.status
    from target as t
    left join changed as c on c.id = t.id;
$$;

-- As in version 14; a retried run's finish is recorded.
create or replace function {schema}.runlane_retry_runs(
    p_environment text, p_ids uuid[], p_skip_locked boolean)
returns table (id uuid, status text, pruned boolean, retried boolean)
language sql
security definer
set search_path = pg_catalog, pg_temp
as $$
    with locked as (
        select unnest({schema}.runlane_lock_runs(p_environment, p_ids, p_skip_locked)) as id
    ), target as (
        select r.id, r.status, r.pruned_at is not null as pruned
        from {schema}.runs as r
        where r.id in (select l.id from locked as l) and r.environment = p_environment
    ), retried as (
        update {schema}.runs as r
        set status = 'queued',
            due_at = now(),
            releases = r.attempt,
            error = null,
            output = null,
            finished_at = null,
            lease_token = null,
            lease_expires_at = null,
            wait_kind = null,
            wait_token_id = null,
            wait_run_id = null,
            updated_at = now()
        from target as t
        where r.id = t.id
          -- as it is once locked: a retry committed while runlane_lock_runs waited (two
          -- operators, a double click) leaves it queued, not retried again
          and r.status in ('failed', 'cancelled')
          and r.pruned_at is null
        returning r.id
    ), kept as (
        insert into {schema}.stats_departed (environment, at, queue, task_id, status, wait, run)
        select p_environment, r.finished_at, r.queue, r.task_id, r.status,
               case when r.status = 'failed' and r.attempt_started_at is not null
                    then greatest(0, extract(epoch from r.attempt_started_at - r.due_at))::float8
               end,
               case when r.status = 'failed' and r.attempt_started_at is not null
                    then greatest(0, extract(epoch from r.finished_at - r.attempt_started_at))
                             ::float8
               end
        from {schema}.runs as r
        cross join (select {schema}.runlane_stats_unfolded_since(p_environment) as at) as since
        where r.id in (select d.id from retried as d)
          and r.finished_at >= since.at
    )
    select t.id, t.status, t.pruned, t.id in (select id from retried)
    from target as t;
$$;

-- As in version 14; what a deleted run counted (its trigger, its attempts' starts and
-- retries, its finish unless it was a tombstone already) and a tombstoned run's finish
-- are recorded.
create or replace function {schema}.runlane_delete_runs(
    p_environment text, p_ids uuid[], p_skip_locked boolean)
returns table (deleted bigint, tombstoned bigint, parents_updated bigint)
language sql
security definer
set search_path = pg_catalog, pg_temp
as $$
    with locked as (
        select unnest({schema}.runlane_lock_runs(p_environment, p_ids, p_skip_locked)) as id
    ), doomed as materialized (
        select r.id, r.parent_run_id, r.pruned_at is not null as was_tombstone,
               -- what the rollup counts of it (see leaving)
               r.queue, r.task_id, r.status, r.attempt, r.created_at, r.due_at,
               r.attempt_started_at, r.finished_at
        from {schema}.runs as r
        where r.id in (select l.id from locked as l)
          and r.environment = p_environment
          and r.status in ('completed', 'failed', 'cancelled')
    ), child_counts as (
        select c.parent_run_id as id, count(*) as n
        from {schema}.runs as c
        where c.parent_run_id in (select d.id from doomed as d)
        group by c.parent_run_id
    ), surviving as (
        -- children that outlive this statement: not doomed, or doomed but tombstoned
        select c.parent_run_id as id, count(*) as n
        from {schema}.runs as c
        where c.parent_run_id in (select cc.id from child_counts as cc)
          and (c.id not in (select d.id from doomed as d)
               or c.id in (select cc.id from child_counts as cc))
        group by c.parent_run_id
    ), tombstoned as (
        update {schema}.runs as r
        set pruned_at = now(), remaining_children = coalesce(s.n, 0),
            payload = 'null'::jsonb, output = null, updated_at = now()
        from child_counts as cc
        join doomed as d on d.id = cc.id
        left join surviving as s on s.id = cc.id
        where r.id = cc.id and not d.was_tombstone
        returning r.id
    ), gone as (
        delete from {schema}.runs as r
        using doomed as d
        where r.id = d.id and d.id not in (select cc.id from child_counts as cc)
        returning r.id, r.parent_run_id
    ), attempts_gone as (
        delete from {schema}.attempts as a
        using gone as g
        where a.run_id = g.id
    ), parents as (
        update {schema}.runs as p
        set remaining_children = p.remaining_children - g.n, updated_at = now()
        from (select parent_run_id, count(*) as n from gone
              where parent_run_id is not null group by parent_run_id) as g
        where p.id = g.parent_run_id and p.pruned_at is not null
        returning p.id
    ), since as materialized (
        select {schema}.runlane_stats_unfolded_since(p_environment) as at
    ), leaving as materialized (
        -- the runs as they were: gone (every figure) or becoming tombstones (the finish);
        -- only those that finished since: every figure of a run is at or before its finish
        -- (cleanup of old runs reads no further)
        select d.*, d.id not in (select cc.id from child_counts as cc) as gone
        from doomed as d, since
        where (d.id not in (select cc.id from child_counts as cc) or not d.was_tombstone)
          and d.finished_at >= since.at
    ), kept as (
        insert into {schema}.stats_departed (
            environment, at, queue, task_id, triggered, started, retried, status, wait, run)
        select p_environment, r.created_at, r.queue, r.task_id, 1, 0, 0, null::text,
               null::float8, null::float8
        from leaving as r, since
        where r.gone and r.created_at >= since.at
        union all
        select p_environment, a.started_at, r.queue, r.task_id, 0, 1,
               case when a.outcome = 'retrying'
                         or (a.outcome = 'expired' and r.attempt > a.attempt) then 1
                    else 0 end,
               null, null, null
        from leaving as r
        join {schema}.attempts as a on a.run_id = r.id
        cross join since
        where r.gone and a.started_at >= since.at
        union all
        select p_environment, r.finished_at, r.queue, r.task_id, 0, 0, 0, r.status,
               case when r.status in ('completed', 'failed') and r.attempt_started_at is not null
                    then greatest(0, extract(epoch from r.attempt_started_at - r.due_at))::float8
               end,
               case when r.status in ('completed', 'failed') and r.attempt_started_at is not null
                    then greatest(0, extract(epoch from r.finished_at - r.attempt_started_at))
                             ::float8
               end
        from leaving as r, since
        where not r.was_tombstone and r.finished_at >= since.at
    )
    select (select count(*) from gone), (select count(*) from tombstoned),
           (select count(*) from parents);
$$;
