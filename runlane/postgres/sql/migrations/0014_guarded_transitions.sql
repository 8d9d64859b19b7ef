-- runlane schema version 14: the database itself keeps each role to its job's transitions.
-- compatibility: additive
--
-- Column grants said which columns a role may write, not which values: the operator role
-- could mark a queued run completed with an output of its choosing, or delete a live run;
-- the worker role could complete a run it never claimed, cancel or retry any run; the
-- maintenance role could complete runs, delete live ones and rewrite payloads. Now:
--
-- * The operator's actions (retry, cancel, delete) and cleanup's deletes go through
--   SECURITY DEFINER functions holding the same statements the API ran (one source for
--   each rule): runlane_retry_runs, runlane_cancel_runs, runlane_delete_runs. The grants
--   (sql/grants.sql) give the operator no UPDATE or DELETE on runs or attempts and
--   maintenance no DELETE there, nor the payload, output and tombstone columns.
-- * A row trigger refuses, for every role but the table's owner (and so for everyone but
--   those functions, migrations and the owner's own sessions), the transitions no job but
--   the operator's makes and the ones only a claim may make, whatever a role was granted:
--   completing a run is only for a role that may claim (UPDATE on runs.attempt: the worker
--   job), and only from an attempt that runs; a run starts only by a claim of a queued
--   run; an attempt whose lease is live ends only by a role that may claim (maintenance
--   ends attempts whose lease lapsed); no finished run goes back (retry), no run is
--   cancelled or asked to stop unless asked (cancel), no output is written but by the
--   completion; payloads and tombstones change only in runlane_delete_runs; runs and
--   attempts are deleted only there. Stale grants of earlier versions can do none of it.
-- * runlane_run_schedule refuses an idempotency key in runlane's reserved prefix, as every
--   other entrance does (a key such as runlane.child:<parent>:1 taken first would fail
--   that parent's child on every attempt).
--
-- The trigger's condition is evaluated in the executor, with no function call, on the
-- rows of statements that set status or output; the hot path's rows (claims, completions
-- by the worker job, failures, hand-backs, resumes) never call the trigger function.
--
-- Additive for the runtimes of version 13 that connect as the schema's owner (the
-- functions, triggers and transitions they make are theirs to make). An older runtime
-- connecting as a role granted the operator job (or maintenance, for a cleanup that
-- tombstones a parent) can no longer retry, cancel or delete runs by direct statements:
-- upgrade those together with the schema (docs/security.md).

create function {schema}.runlane_guard_runs()
returns trigger
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    what text;
begin
    -- the table's owner (a member of it, a superuser) and its SECURITY DEFINER functions
    if pg_has_role(current_user, (select c.relowner from pg_class as c where c.oid = tg_relid),
                   'MEMBER') then
        return case when tg_op = 'DELETE' then old else new end;
    end if;
    if tg_op = 'DELETE' and tg_table_name = 'attempts' then
        what := format('delete the attempts of run %s', old.run_id);
    elsif tg_op = 'DELETE' then
        what := format('delete run %s (%s)', old.id, old.status);
    elsif tg_argv[0] = 'tombstone' then
        what := format('rewrite the payload or tombstone of run %s', old.id);
    elsif new.status is distinct from old.status then
        what := format('move run %s from %s to %s', old.id, old.status, new.status);
    else
        what := format('write the output of run %s (%s)', old.id, old.status);
    end if;
    raise exception using
        errcode = 'insufficient_privilege',
        message = format('runlane: role %s may not %s', current_user, what),
        hint = 'runlane roles change runs only as their job does: retry, cancel and delete '
               'go through runlane_retry_runs, runlane_cancel_runs and runlane_delete_runs '
               '(runlane grant operator ROLE), completions through a claim (runlane grant '
               'worker ROLE)';
end;
$$;

create trigger runlane_runs_guard_transition
    before update of status, output on {schema}.runs
    for each row
    when (
        -- a completion: by a role that may claim, of an attempt that runs
        (new.status = 'completed' and old.status <> 'completed'
         and (old.status not in ('running', 'cancellation_requested')
              or not has_column_privilege('{schema}.runs'::regclass, 'attempt', 'UPDATE')))
        -- a start: a claim of a queued run
        or (new.status = 'running' and old.status <> 'running'
            and (old.status <> 'queued'
                 or not has_column_privilege('{schema}.runs'::regclass, 'attempt', 'UPDATE')))
        -- an attempt ended while its lease is live: by a role that may claim
        or (old.status in ('running', 'cancellation_requested')
            and new.status not in ('running', 'cancellation_requested')
            and old.lease_expires_at >= now()
            and not has_column_privilege('{schema}.runs'::regclass, 'attempt', 'UPDATE'))
        -- a retry: a finished run goes back
        or (old.status in ('completed', 'failed', 'cancelled') and new.status <> old.status)
        -- a cancellation that nobody asked for, or the asking
        or (new.status = 'cancelled' and old.status not in ('cancellation_requested', 'cancelled'))
        or (new.status = 'cancellation_requested' and old.status <> 'cancellation_requested')
        -- an output written other than by the completion (retry and tombstones clear it)
        or (new.output is distinct from old.output
            and not (new.status = 'completed'
                     and old.status in ('running', 'cancellation_requested')))
    )
    execute function {schema}.runlane_guard_runs('transition');

create trigger runlane_runs_guard_tombstone
    before update of payload, pruned_at, remaining_children on {schema}.runs
    for each row
    execute function {schema}.runlane_guard_runs('tombstone');

create trigger runlane_runs_guard_delete
    before delete on {schema}.runs
    for each row
    execute function {schema}.runlane_guard_runs('delete');

create trigger runlane_attempts_guard_delete
    before delete on {schema}.attempts
    for each row
    execute function {schema}.runlane_guard_runs('delete');

-- Locks the given runs of the environment: waiting for runs another transaction holds
-- (a single run's action), or leaving them out (skip_locked: a bulk batch leaves a run a
-- worker or another action holds to it). The ids it locked.
create function {schema}.runlane_lock_runs(
    p_environment text, p_ids uuid[], p_skip_locked boolean)
returns uuid[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_skip_locked then
        return array(select r.id from {schema}.runs as r
                     where r.id = any(p_ids) and r.environment = p_environment
                     order by r.id
                     for update skip locked);
    end if;
    return array(select r.id from {schema}.runs as r
                 where r.id = any(p_ids) and r.environment = p_environment
                 order by r.id
                 for update);
end;
$$;

-- cancel and cancel_runs. Queued, retrying, released and waiting runs are cancelled at
-- once; a running run is asked to stop (its worker hears it announced by the update
-- trigger, or learns it at its next lease extension) and ends cancelled when its handler
-- returns or its lease lapses. Runs waiting on a run cancelled here are resumed by the
-- update trigger. One row per run found: its status before, and after (null: not
-- cancellable, left alone).
create function {schema}.runlane_cancel_runs(
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
        update {schema}.runs as r
        set status = case when t.status = 'running' then 'cancellation_requested'
                          else 'cancelled' end,
            finished_at = case when t.status = 'running' then null else now() end,
            wait_kind = null,
            wait_token_id = null,
            wait_run_id = null,
            updated_at = now()
        from target as t
        where r.id = t.id
          and t.status in ('queued', 'retrying', 'released', 'waiting', 'running')
        returning r.id, r.status
    )
    select t.id, t.status, c.status
    from target as t
    left join changed as c on c.id = t.id;
$$;

-- retry_run and retry_runs. A failed or cancelled run becomes queued, due now, with a fresh
-- attempt budget: the attempts spent so far are counted as handed back (releases =
-- attempt), so the next claim is attempt number attempt + 1 (numbers only grow: fencing
-- and the attempts history stay intact) and max_attempts more attempts may follow. Its
-- error, output and finish time are cleared; its steps are kept (a retried handler gets
-- their stored outputs). The runs update trigger announces it, and writes its outbox item
-- in outbox environments, as for every transition into queued. Any other run, and a
-- pruned tombstone, is left alone. One row per run found: its status before, whether it
-- is a tombstone, whether it was retried.
create function {schema}.runlane_retry_runs(
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
          and t.status in ('failed', 'cancelled')
          and not t.pruned
        returning r.id
    )
    select t.id, t.status, t.pruned, t.id in (select id from retried)
    from target as t;
$$;

-- cleanup and delete_runs. Deletes finished runs by id (cleanup's pick locked them
-- already; delete_runs gives a batch it picked). One that still has children becomes a
-- tombstone counting them, and each deleted child lowers its tombstoned parent's count. A
-- tombstone given here (cleanup gives those whose count reached zero) is deleted, never
-- tombstoned again. A run that is not finished is left alone. A deleted run's attempts
-- go with it (in this statement: version 5 dropped the key that cascaded); its steps go
-- through their foreign key.
create function {schema}.runlane_delete_runs(
    p_environment text, p_ids uuid[], p_skip_locked boolean)
returns table (deleted bigint, tombstoned bigint, parents_updated bigint)
language sql
security definer
set search_path = pg_catalog, pg_temp
as $$
    with locked as (
        select unnest({schema}.runlane_lock_runs(p_environment, p_ids, p_skip_locked)) as id
    ), doomed as materialized (
        select r.id, r.parent_run_id, r.pruned_at is not null as was_tombstone
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
    )
    select (select count(*) from gone), (select count(*) from tombstoned),
           (select count(*) from parents);
$$;

-- trigger_schedule_now's function, as in version 6, refusing a reserved key.
create or replace function {schema}.runlane_run_schedule(
    p_environment text, p_schedule_id text, p_run_id uuid, p_idempotency_key text,
    p_trace_context jsonb)
returns table (run_id uuid, task_id text, queue text, created boolean)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
#variable_conflict use_column
declare
    d record;
begin
    if starts_with(p_idempotency_key, 'runlane.') then
        raise exception using
            errcode = 'invalid_parameter_value',
            message = 'runlane: idempotency keys starting with ''runlane.'' are reserved';
    end if;
    select s.task_id, s.queue, s.payload, s.priority, s.max_attempts into d
    from {schema}.schedules as s
    where s.environment = p_environment and s.schedule_id = p_schedule_id;
    if not found then
        return;
    end if;
    if d.task_id is null or d.queue is null or d.payload is null or d.priority is null
       or d.max_attempts is null then
        return query select null::uuid, null::text, null::text, null::boolean;
        return;
    end if;
    insert into {schema}.runs (
        id, environment, task_id, queue, status, priority, payload, max_attempts,
        idempotency_key, due_at, trace_context)
    values (p_run_id, p_environment, d.task_id, d.queue, 'queued', d.priority, d.payload,
            d.max_attempts, p_idempotency_key, now(), p_trace_context)
    on conflict do nothing;
    -- an idempotency key already used, or this statement retried after its answer was lost
    return query
        select r.id, r.task_id, r.queue, r.id = p_run_id
        from {schema}.runs as r
        where r.environment = p_environment and r.task_id = d.task_id
          and (r.id = p_run_id or r.idempotency_key = p_idempotency_key);
end;
$$;

revoke execute on function {schema}.runlane_lock_runs(text, uuid[], boolean) from public;
revoke execute on function {schema}.runlane_cancel_runs(text, uuid[], boolean) from public;
revoke execute on function {schema}.runlane_retry_runs(text, uuid[], boolean) from public;
revoke execute on function {schema}.runlane_delete_runs(text, uuid[], boolean) from public;
