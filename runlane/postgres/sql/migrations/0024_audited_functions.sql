-- runlane schema version 24: the operator's retry, cancel, delete and reschedule commit only
-- with their audit record.
-- compatibility: additive
--
-- The operator role changes runs only through the SECURITY DEFINER functions of migrations
-- 14 and 21 (runlane_retry_runs, runlane_cancel_runs, runlane_delete_runs,
-- runlane_reschedule_runs): raw SQL calling them committed with no audit record. A check
-- queued inside such a function cannot tell who called it (it runs, and its deferred
-- triggers fire, as the function's owner), and maintenance's cleanup calls
-- runlane_delete_runs with no record, rightly. So:
--
-- * Each function gets an overload taking one more argument, the audit action it is part
--   of (retry or bulk_retry; cancel or bulk_cancel; delete or bulk_delete; reschedule,
--   which is also "run now"). It checks the action (a single-run action takes one run),
--   calls the old function (whose body stays where it is: migration 25 replaces those of
--   retry, cancel and delete) and, when that changed a run, adds an obligation: a row of
--   audit_owed (the transaction, environment, action, and for a single-run action the run).
--   A deferred constraint trigger checks at commit that the transaction wrote the audit
--   record of that action (an audit_log row with xmin = the transaction's id, at = its
--   start, the same environment and action, and for a single-run action that run as its
--   target), and deletes the obligation: no obligation outlives its transaction. Without
--   the record the commit fails (insufficient_privilege) and nothing the call changed
--   stays. A call that changed nothing (a run not retryable, not cancellable, not
--   finished, not queued) owes nothing.
-- * audit_owed is the owner's alone; the overloads are not executable by PUBLIC.
-- * The operator job (grants.sql) gets the overloads instead of the old functions, and
--   `runlane grant` takes the old retry, cancel and reschedule back from every role, and
--   the old delete from every role that does not hold the maintenance job (cleanup keeps
--   it). This migration grants the overloads to every role that may execute the old
--   runlane_retry_runs (the operator roles) so runtimes of version 24 act at once; the hole
--   closes when `runlane grant ... operator` is re-run after the upgrade.
--
-- Additive for the runtimes of version 23: the old functions are unchanged and still
-- granted until the grant is re-run (then, their operator actions are refused: upgrade the
-- runtimes that act as the operator before re-granting, docs/security.md).

create table {schema}.audit_owed (
    txid        xid8 not null,
    environment text not null,
    action      text not null,
    -- the run of a single-run action; '' for a bulk action (any target)
    target      text not null,
    primary key (txid, environment, action, target)
);

revoke all on {schema}.audit_owed from public;

-- The target an action's record names ('' for a bulk action), or an error for an action
-- the function does not take, or a single-run action on other than one run.
create function {schema}.runlane_audit_target(
    p_action text, p_single text, p_ids uuid[])
returns text
language plpgsql
immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_action = 'bulk_' || p_single then
        return '';
    end if;
    if p_action is distinct from p_single then
        raise exception using
            errcode = 'invalid_parameter_value',
            message = format('runlane: this function records the action %s or bulk_%s in the '
                             'audit trail, got %s', p_single, p_single,
                             coalesce(quote_literal(p_action), 'null'));
    end if;
    if coalesce(cardinality(p_ids), 0) <> 1 or p_ids[1] is null then
        raise exception using
            errcode = 'invalid_parameter_value',
            message = format('runlane: the action %s takes one run, got %s', p_action,
                             coalesce(cardinality(p_ids), 0));
    end if;
    return p_ids[1]::text;
end;
$$;

create function {schema}.runlane_audit_owe(
    p_environment text, p_action text, p_target text)
returns void
language sql
set search_path = pg_catalog, pg_temp
as $$
    insert into {schema}.audit_owed (txid, environment, action, target)
    values (pg_current_xact_id(), p_environment, p_action, p_target)
    on conflict do nothing;
$$;

-- At commit (as the owner: security definer, whoever fired it): the record the obligation
-- asks for, written in this transaction, or the commit fails.
create function {schema}.runlane_audit_owed_check()
returns trigger
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    if exists (
        select 1 from {schema}.audit_log as a
        where a.at = now() and a.xmin = pg_current_xact_id()::xid
          and a.environment = new.environment and a.action = new.action
          and (new.target = '' or a.target = new.target)
    ) then
        delete from {schema}.audit_owed as o
        where o.txid = new.txid and o.environment = new.environment
          and o.action = new.action and o.target = new.target;
        return null;
    end if;
    raise exception using
        errcode = 'insufficient_privilege',
        message = format('runlane: %s%s in environment %s commits only with its audit '
                         'record written in the same transaction', new.action,
                         case when new.target = '' then '' else ' of run ' || new.target end,
                         new.environment),
        hint = 'act through runlane (retry_run, cancel, delete_run, reschedule_run, the bulk '
               'actions, the CLI, the console), which records each action';
end;
$$;

create constraint trigger runlane_audit_owed_check
    after insert on {schema}.audit_owed
    deferrable initially deferred
    for each row
    execute function {schema}.runlane_audit_owed_check();

create function {schema}.runlane_retry_runs(
    p_environment text, p_ids uuid[], p_skip_locked boolean, p_action text)
returns table (id uuid, status text, pruned boolean, retried boolean)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_target text := {schema}.runlane_audit_target(p_action, 'retry', p_ids);
    v_changed boolean := false;
begin
    for id, status, pruned, retried in
        select r.id, r.status, r.pruned, r.retried
        from {schema}.runlane_retry_runs(p_environment, p_ids, p_skip_locked) as r
    loop
        v_changed := v_changed or retried;
        return next;
    end loop;
    if v_changed then
        perform {schema}.runlane_audit_owe(p_environment, p_action, v_target);
    end if;
end;
$$;

create function {schema}.runlane_cancel_runs(
    p_environment text, p_ids uuid[], p_skip_locked boolean, p_action text)
returns table (id uuid, previous text, current text)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_target text := {schema}.runlane_audit_target(p_action, 'cancel', p_ids);
    v_changed boolean := false;
begin
    for id, previous, current in
        select r.id, r.previous, r.current
        from {schema}.runlane_cancel_runs(p_environment, p_ids, p_skip_locked) as r
    loop
        v_changed := v_changed or current is not null;
        return next;
    end loop;
    if v_changed then
        perform {schema}.runlane_audit_owe(p_environment, p_action, v_target);
    end if;
end;
$$;

create function {schema}.runlane_delete_runs(
    p_environment text, p_ids uuid[], p_skip_locked boolean, p_action text)
returns table (deleted bigint, tombstoned bigint, parents_updated bigint)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_target text := {schema}.runlane_audit_target(p_action, 'delete', p_ids);
    v_changed boolean := false;
begin
    for deleted, tombstoned, parents_updated in
        select r.deleted, r.tombstoned, r.parents_updated
        from {schema}.runlane_delete_runs(p_environment, p_ids, p_skip_locked) as r
    loop
        v_changed := v_changed or deleted + tombstoned > 0;
        return next;
    end loop;
    if v_changed then
        perform {schema}.runlane_audit_owe(p_environment, p_action, v_target);
    end if;
end;
$$;

create function {schema}.runlane_reschedule_runs(
    p_environment text, p_ids uuid[], p_due_at timestamptz, p_now timestamptz,
    p_skip_locked boolean, p_action text)
returns table (id uuid, status text, rescheduled boolean)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_target text;
    v_changed boolean := false;
begin
    if p_action is distinct from 'reschedule' then
        raise exception using
            errcode = 'invalid_parameter_value',
            message = format('runlane: this function records the action reschedule in the '
                             'audit trail, got %s', coalesce(quote_literal(p_action), 'null'));
    end if;
    v_target := {schema}.runlane_audit_target(p_action, 'reschedule', p_ids);
    for id, status, rescheduled in
        select r.id, r.status, r.rescheduled
        from {schema}.runlane_reschedule_runs(p_environment, p_ids, p_due_at, p_now,
                                              p_skip_locked) as r
    loop
        v_changed := v_changed or rescheduled;
        return next;
    end loop;
    if v_changed then
        perform {schema}.runlane_audit_owe(p_environment, p_action, v_target);
    end if;
end;
$$;

-- `runlane grant` takes the 3-argument delete back from a role without the maintenance job
-- (cleanup keeps it; a role may hold several jobs, granted in any order). It runs as the
-- granting role (the owner).
create function {schema}.runlane_revoke_unaudited_delete(p_role regrole)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if not has_any_column_privilege(p_role, '{schema}.maintenance_leases', 'INSERT') then
        execute format('revoke execute on function %s from %s',
                       '{schema}.runlane_delete_runs(text, uuid[], boolean)'::regprocedure,
                       p_role);
    end if;
end;
$$;

revoke execute on function {schema}.runlane_audit_target(text, text, uuid[]) from public;
revoke execute on function {schema}.runlane_audit_owe(text, text, text) from public;
revoke execute on function {schema}.runlane_audit_owed_check() from public;
revoke execute on function {schema}.runlane_retry_runs(text, uuid[], boolean, text) from public;
revoke execute on function {schema}.runlane_cancel_runs(text, uuid[], boolean, text)
    from public;
revoke execute on function {schema}.runlane_delete_runs(text, uuid[], boolean, text)
    from public;
revoke execute on function {schema}.runlane_reschedule_runs(
    text, uuid[], timestamptz, timestamptz, boolean, text) from public;
revoke execute on function {schema}.runlane_revoke_unaudited_delete(regrole) from public;

-- The operator roles (those that may execute the old runlane_retry_runs) get the overloads
-- now, so an upgraded runtime acts before the grant is re-run.
do $$
declare
    v_role text;
begin
    for v_role in
        select distinct a.grantee::regrole::text
        from pg_catalog.pg_proc as p
        cross join lateral pg_catalog.aclexplode(p.proacl) as a
        where p.oid = '{schema}.runlane_retry_runs(text, uuid[], boolean)'::regprocedure
          and a.privilege_type = 'EXECUTE' and a.grantee <> 0 and a.grantee <> p.proowner
    loop
        execute format('grant execute on function %s, %s, %s, %s to %s',
                       '{schema}.runlane_retry_runs(text, uuid[], boolean, text)'::regprocedure,
                       '{schema}.runlane_cancel_runs(text, uuid[], boolean, text)'::regprocedure,
                       '{schema}.runlane_delete_runs(text, uuid[], boolean, text)'::regprocedure,
                       '{schema}.runlane_reschedule_runs(text, uuid[], timestamptz, timestamptz, boolean, text)'::regprocedure,
                       v_role);
    end loop;
end;
$$;
