-- runlane schema version 17: the guards of versions 14 and 16 close what a second hostile
-- review got through.
-- compatibility: additive
--
-- * A run fails, retries, is released or suspends only from an attempt (the maintenance
--   role failed a queued run, then deleted it as finished through runlane_delete_runs).
-- * A role that may not claim writes no lease and ends only attempts whose lease lapsed
--   (the maintenance role moved a live lease into the past, then failed the attempt as
--   expired); the version-14 condition read the lease time such a role could write.
-- * A finished run's error and finish time are its history (a finish time written back to
--   1970 had cleanup delete the run early).
-- * Every run is written queued: a run inserted cancellation_requested, with no lease, was
--   one nothing could expire, cancel, retry or delete (status and wait_for_run never saw
--   it end).
-- * Wait tokens in runlane's reserved key prefix are refused as runs' are.
--
-- The transition guard now also looks at statements that set error, finish time or lease:
-- lease extensions evaluate its condition too (one has_column_privilege for the worker
-- job's rows) and still never call its function.
--
-- Additive for the runtimes of version 16: they make none of the refused writes.

drop trigger runlane_runs_guard_transition on {schema}.runs;

create trigger runlane_runs_guard_transition
    before update of status, output, error, finished_at, lease_token, lease_expires_at
    on {schema}.runs
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
        -- an attempt's end (failed, retrying, released, suspended): only from an attempt
        or (new.status in ('failed', 'retrying', 'released', 'waiting')
            and new.status <> old.status
            and old.status not in ('running', 'cancellation_requested'))
        -- a lease written by a role that may not claim: only cleared, by ending an attempt
        -- whose lease lapsed (maintenance's expiry)
        or ((new.lease_token is distinct from old.lease_token
             or new.lease_expires_at is distinct from old.lease_expires_at
             or (old.status in ('running', 'cancellation_requested')
                 and new.status not in ('running', 'cancellation_requested')))
            and not (new.lease_token is null and new.lease_expires_at is null
                     and old.lease_expires_at < now()
                     and new.status not in ('running', 'cancellation_requested'))
            and not has_column_privilege('{schema}.runs'::regclass, 'attempt', 'UPDATE'))
        -- a finished run's history rewritten (its error, its finish time)
        or (old.status in ('completed', 'failed', 'cancelled')
            and (new.error is distinct from old.error
                 or new.finished_at is distinct from old.finished_at))
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

drop trigger runlane_runs_guard_insert on {schema}.runs;

create or replace function {schema}.runlane_guard_run_insert()
returns trigger
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    parent_status text;
begin
    if pg_has_role(current_user, (select c.relowner from pg_class as c where c.oid = tg_relid),
                   'MEMBER') then
        return new;
    end if;
    if new.status = 'queued' and new.parent_run_id is not null
       and has_column_privilege(tg_relid, 'attempt', 'UPDATE') then
        select p.status into parent_status
        from {schema}.runs as p
        where p.id = new.parent_run_id and p.environment = new.environment;
        if parent_status in ('running', 'cancellation_requested')
           and (new.idempotency_key is null
                or not starts_with(new.idempotency_key, 'runlane.')
                or starts_with(new.idempotency_key,
                               'runlane.child:' || new.parent_run_id::text || ':')) then
            return new;
        end if;
    end if;
    raise exception using
        errcode = 'insufficient_privilege',
        message = format(
            'runlane: role %s may not write run %s (%s, parent %s, key %s): runs are '
            'written queued, only a running parent''s worker writes its children, and keys '
            'starting with ''runlane.'' are runlane''s own',
            current_user, new.id, new.status, coalesce(new.parent_run_id::text, 'none'),
            coalesce(new.idempotency_key, 'none'));
end;
$$;

create trigger runlane_runs_guard_insert
    before insert on {schema}.runs
    for each row
    when (new.status <> 'queued' or new.parent_run_id is not null
          or starts_with(new.idempotency_key, 'runlane.'))
    execute function {schema}.runlane_guard_run_insert();

-- Wait tokens: runlane derives no token keys today, but the prefix is its own here too
-- (create_wait_token refuses it): no role but the owner writes one.
create function {schema}.runlane_guard_token_insert()
returns trigger
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if pg_has_role(current_user, (select c.relowner from pg_class as c where c.oid = tg_relid),
                   'MEMBER') then
        return new;
    end if;
    raise exception using
        errcode = 'insufficient_privilege',
        message = format(
            'runlane: role %s may not write wait token %s with key %s: keys starting with '
            '''runlane.'' are runlane''s own', current_user, new.id, new.idempotency_key);
end;
$$;

create trigger runlane_wait_tokens_guard_insert
    before insert on {schema}.wait_tokens
    for each row
    when (starts_with(new.idempotency_key, 'runlane.'))
    execute function {schema}.runlane_guard_token_insert();
