-- runlane schema version 23: due times the database bounds, and audit parts it ties to
-- their action.
-- compatibility: additive
--
-- * runlane_reschedule_runs refuses a due time outside 1970 to 101 years past the
--   server's clock (the API allows 1970 to 100 years past the client's; a year's slack for
--   the clients' clocks): the operator role moved a run to '-infinity' with raw SQL, and
--   every claim, drain, list_runs, get_run and the console's runs page failed on it.
-- * A guard (row triggers on insert and on an update of due_at, off the hot path by their
--   WHEN clauses, as migrations 14-18 keep their guards) refuses the same out-of-range due
--   times to every role but the owner, and refuses a role that may not write a lease (the
--   producer job) any due time it writes on an update but that of its resume pass (a
--   waiting run becoming queued, after a completed wait token): a producer moved any
--   queued run's due time, an unaudited reschedule.
-- * An audit record's later parts (part > 0, a bulk action's next batches) may be written,
--   by any role but the owner, only after the part before it of the same action, by the
--   same database role, in the same environment, for the same action, via, actor and OS
--   user: an operator role added a part 7 of another environment to another's action and
--   the listing summed it. (Whoever writes records as the operator role can still write
--   any record of its own: at and db_role are the database's, the rest the client's.)
-- * A pause or resume of a queue or a schedule written by the operator role commits only
--   with its audit record (checked at commit): a raw SQL pause left no record. The
--   SECURITY DEFINER functions (retry, cancel, delete, reschedule) are not checked.
--
-- Additive for the runtimes of version 22: their due times are within the bounds, their
-- producers write due_at only in the resume pass, and their bulk actions write parts
-- 0, 1, 2, ... in order as one role.

create or replace function {schema}.runlane_reschedule_runs(
    p_environment text, p_ids uuid[], p_due_at timestamptz, p_now timestamptz,
    p_skip_locked boolean)
returns table (id uuid, status text, rescheduled boolean)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
#variable_conflict use_column
begin
    if p_due_at is null or p_due_at < timestamptz '1970-01-01 00:00:00+00'
       or p_due_at > now() + interval '101 years' then
        raise exception using
            errcode = 'invalid_parameter_value',
            message = format('runlane: a run''s due time must be from 1970 to 100 years from '
                             'now, got %s', coalesce(p_due_at::text, 'null'));
    end if;
    return query
    with locked as (
        select unnest({schema}.runlane_lock_runs(p_environment, p_ids, p_skip_locked)) as id
    ), target as (
        select r.id, r.status
        from {schema}.runs as r
        where r.id in (select l.id from locked as l) and r.environment = p_environment
    ), moved as (
        update {schema}.runs as r
        set due_at = p_due_at,
            status = case when t.status = 'retrying' and p_due_at <= p_now then 'queued'
                          else t.status end,
            updated_at = now()
        from target as t
        where r.id = t.id and t.status in ('queued', 'retrying')
        returning r.id, r.status
    ), outbox_moved as (
        update {schema}.outbox as o
        set available_at = p_due_at
        from moved as m
        where o.run_id = m.id and m.status = 'queued' and o.claim_token is null
          and o.environment = p_environment
        returning o.id
    )
    select t.id, t.status, t.id in (select m.id from moved as m)
    from target as t;
end;
$$;

create function {schema}.runlane_guard_run_due()
returns trigger
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if pg_has_role(current_user, (select c.relowner from pg_class as c where c.oid = tg_relid),
                   'MEMBER') then
        return new;
    end if;
    if new.due_at < timestamptz '1970-01-01 00:00:00+00'
       or new.due_at > now() + interval '101 years' then
        raise exception using
            errcode = 'insufficient_privilege',
            message = format('runlane: role %s may not make run %s due at %s: a due time is '
                             'from 1970 to 100 years from now', current_user, new.id,
                             new.due_at);
    end if;
    raise exception using
        errcode = 'insufficient_privilege',
        message = format('runlane: role %s may not move the due time of run %s (%s): only '
                         'a waiting run it resumes', current_user, old.id, old.status),
        hint = 'an operator moves a due time through runlane_reschedule_runs (reschedule_run, '
               'recorded in the audit trail)';
end;
$$;

create trigger runlane_runs_guard_due_insert
    before insert on {schema}.runs
    for each row
    when (new.due_at < timestamptz '1970-01-01 00:00:00+00'
          or new.due_at > now() + interval '101 years')
    execute function {schema}.runlane_guard_run_due();

create trigger runlane_runs_guard_due
    before update of due_at on {schema}.runs
    for each row
    when (new.due_at is distinct from old.due_at
          and (new.due_at < timestamptz '1970-01-01 00:00:00+00'
               or new.due_at > now() + interval '101 years'
               -- a role that may not write a lease (the producer job): only its resume pass
               or (not (old.status = 'waiting' and new.status = 'queued')
                   and not has_column_privilege('{schema}.runs'::regclass, 'lease_token',
                                                'UPDATE'))))
    execute function {schema}.runlane_guard_run_due();

create function {schema}.runlane_guard_audit_part()
returns trigger
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if pg_has_role(current_user, (select c.relowner from pg_class as c where c.oid = tg_relid),
                   'MEMBER') then
        return new;
    end if;
    if exists (
        select 1 from {schema}.audit_log as h
        where h.action_id = new.action_id and h.part = new.part - 1
          and h.environment = new.environment and h.db_role = new.db_role
          and h.action = new.action and h.via = new.via
          and h.actor is not distinct from new.actor
          and h.os_user is not distinct from new.os_user
    ) then
        return new;
    end if;
    raise exception using
        errcode = 'insufficient_privilege',
        message = format('runlane: role %s may not write part %s of action %s: a part follows '
                         'the part before it, written by the same role for the same action '
                         'in the same environment', current_user, new.part, new.action_id);
end;
$$;

create trigger runlane_audit_log_guard_part
    before insert on {schema}.audit_log
    for each row
    when (new.part > 0)
    execute function {schema}.runlane_guard_audit_part();

-- Pausing and resuming a queue or a schedule is a write of the operator role's own
-- (queue_states, schedules.paused and next_slot_at), not a function's: at its commit it
-- needs the audit record the transaction wrote (at is the transaction's start, xmin its
-- id) for that action of that queue or schedule, so no pause or resume commits without its
-- record, through runlane or raw SQL. Deferred: runlane inserts the record after the
-- action, in the same transaction, as runtimes of version 21 and 22 do. Maintenance's
-- writes of schedules (a role that may write last_fired_at) and the owner's are not asked.
create function {schema}.runlane_guard_audited()
returns trigger
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_kind text := tg_argv[0];
    v_target text;
begin
    if pg_has_role(current_user, (select c.relowner from pg_class as c where c.oid = tg_relid),
                   'MEMBER') then
        return null;
    end if;
    if v_kind = 'queue' then
        v_target := new.queue;
    else
        v_target := new.schedule_id;
    end if;
    if exists (
        select 1 from {schema}.audit_log as a
        where a.at = now() and a.xmin = pg_current_xact_id()::xid
          and a.environment = new.environment and a.target = v_target
          and a.action in ('pause_' || v_kind, 'resume_' || v_kind)
    ) then
        return null;
    end if;
    raise exception using
        errcode = 'insufficient_privilege',
        message = format('runlane: role %s may not pause or resume %s %s without its audit '
                         'record in the same transaction', current_user, v_kind, v_target),
        hint = 'pause and resume through runlane (pause_queue, resume_queue, pause_schedule, '
               'resume_schedule, runlane queues/schedules, the console), which record them';
end;
$$;

create constraint trigger runlane_queue_states_audited
    after insert or update on {schema}.queue_states
    deferrable initially deferred
    for each row
    execute function {schema}.runlane_guard_audited('queue');

create constraint trigger runlane_schedules_audited
    after update of paused, next_slot_at on {schema}.schedules
    deferrable initially deferred
    for each row
    when (not has_column_privilege('{schema}.schedules'::regclass, 'last_fired_at', 'UPDATE'))
    execute function {schema}.runlane_guard_audited('schedule');
