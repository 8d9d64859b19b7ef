-- runlane schema version 18: the guards close what a final hostile re-check got through.
-- compatibility: additive
--
-- * A role that may not claim ends an attempt only as maintenance's expiry does (failed,
--   retrying or cancelled): the maintenance role could park a lapsed attempt waiting on a
--   token that does not exist, or hand it back.
-- * A cancellation asked for is not undone: a cancellation_requested run ends cancelled, or
--   completed when its handler returned (the maintenance role moved a lapsed one back to
--   queued, and the cancellation was lost).
-- * A role that may not claim writes a run's error only by ending an attempt whose lease
--   lapsed: an error forged on a live run outlived the run's cancellation (and a malformed
--   one broke every read of the run, which runlane now reads as far as it goes).
-- * The guard's refusal names what was refused for writes of a lease, an error or a finish
--   time (it said "write the output" of them).
--
-- Additive for the runtimes of version 17: they make none of the refused writes.

drop trigger runlane_runs_guard_transition on {schema}.runs;

create or replace function {schema}.runlane_guard_runs()
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
    elsif new.output is distinct from old.output then
        what := format('write the output of run %s (%s)', old.id, old.status);
    else
        what := format('write the lease, error or finish time of run %s (%s)', old.id,
                       old.status);
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
        -- an attempt ended by a role that may not claim: failed, retrying or cancelled only
        -- (maintenance's expiry), never parked waiting, handed back or queued
        or (old.status in ('running', 'cancellation_requested')
            and new.status not in ('running', 'cancellation_requested', 'failed', 'retrying',
                                   'cancelled')
            and not has_column_privilege('{schema}.runs'::regclass, 'attempt', 'UPDATE'))
        -- a cancellation asked for is not undone: the run ends cancelled (or completed, when
        -- its handler returned)
        or (old.status = 'cancellation_requested'
            and new.status not in ('cancellation_requested', 'cancelled', 'completed'))
        -- an error written by a role that may not claim: only by ending an attempt whose lease
        -- lapsed (a forged error on a live run outlived the run's cancellation)
        or (new.error is distinct from old.error
            and not (old.status in ('running', 'cancellation_requested')
                     and new.status not in ('running', 'cancellation_requested')
                     and old.lease_expires_at < now())
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
