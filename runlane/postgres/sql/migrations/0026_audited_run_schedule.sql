-- runlane schema version 26: the operator's run of a schedule now commits only with its
-- audit record.
-- compatibility: additive
--
-- Migration 24 tied the operator's retry, cancel, delete and reschedule to their audit
-- records; trigger_schedule_now (migration 6's SECURITY DEFINER runlane_run_schedule, a run
-- of the stored definition, which the operator role may not insert itself) was left:
-- raw SQL calling it committed a run with no record. As there:
--
-- * runlane_run_schedule gets an overload taking the audit action (run_schedule_now). It
--   calls the old function and, when that made a run, owes the record of the action with
--   the schedule as its target (migration 24's audit_owed, checked at commit). A call that
--   made none (the idempotency key's run already existed, or no stored definition) owes
--   nothing, as trigger_schedule_now then records changed = false.
-- * The operator job gets the overload instead of the old function, which `runlane grant`
--   takes back; this migration grants the overload to every role that may execute the old
--   one, so runtimes of version 26 act before the grant is re-run.
--
-- Additive for the runtimes of version 25: the old function is unchanged and still granted
-- until the grant is re-run (then their trigger_schedule_now is refused: upgrade the
-- runtimes that act as the operator before re-granting, docs/security.md).

create function {schema}.runlane_run_schedule(
    p_environment text, p_schedule_id text, p_run_id uuid, p_idempotency_key text,
    p_trace_context jsonb, p_action text)
returns table (run_id uuid, task_id text, queue text, created boolean)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_made boolean := false;
begin
    if p_action is distinct from 'run_schedule_now' then
        raise exception using
            errcode = 'invalid_parameter_value',
            message = format('runlane: this function records the action run_schedule_now in '
                             'the audit trail, got %s', coalesce(quote_literal(p_action), 'null'));
    end if;
    for run_id, task_id, queue, created in
        select r.run_id, r.task_id, r.queue, r.created
        from {schema}.runlane_run_schedule(p_environment, p_schedule_id, p_run_id,
                                           p_idempotency_key, p_trace_context) as r
    loop
        v_made := v_made or coalesce(created, false);
        return next;
    end loop;
    if v_made then
        perform {schema}.runlane_audit_owe(p_environment, p_action, p_schedule_id);
    end if;
end;
$$;

revoke execute on function {schema}.runlane_run_schedule(text, text, uuid, text, jsonb, text)
    from public;

-- The roles that may execute the old function (the operator roles) get the overload now.
do $$
declare
    v_role text;
begin
    for v_role in
        select distinct a.grantee::regrole::text
        from pg_catalog.pg_proc as p
        cross join lateral pg_catalog.aclexplode(p.proacl) as a
        where p.oid = '{schema}.runlane_run_schedule(text, text, uuid, text, jsonb)'::regprocedure
          and a.privilege_type = 'EXECUTE' and a.grantee <> 0 and a.grantee <> p.proowner
    loop
        execute format('grant execute on function %s to %s',
                       '{schema}.runlane_run_schedule(text, text, uuid, text, jsonb, text)'::regprocedure,
                       v_role);
    end loop;
end;
$$;
