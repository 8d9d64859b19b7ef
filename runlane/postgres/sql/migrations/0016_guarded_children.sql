-- runlane schema version 16: only a running parent's worker makes its children.
-- compatibility: additive
--
-- context.trigger_child writes a run with parent_run_id set and, unless the handler gave a
-- key of its own, the key runlane.child:<parent>:<n>; the parent adopts an existing run
-- holding that key when it is its child. Every job that may insert runs may insert those
-- columns, so a producer (or maintenance) role could write a parent's child first, through
-- raw SQL, with a payload of its choosing: the parent adopted it and completed with that
-- child's forged result. A row trigger now refuses, to every role but the table's owner
-- (as migration 14's guards do), a run naming a parent unless the role may claim (the
-- worker job, UPDATE on runs.attempt) and the parent is running in the same environment,
-- and any key in runlane's reserved prefix other than that parent's runlane.child:<parent>:.
-- Runs that name no parent and hold no reserved key (every trigger, schedule and retry)
-- pass the trigger's condition without calling its function.
--
-- Additive for the runtimes of version 15: their children are written by running parents'
-- workers, with the same keys; the Python API refused reserved keys everywhere else.

create function {schema}.runlane_guard_run_insert()
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
    if new.parent_run_id is not null
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
            'runlane: role %s may not write run %s (parent %s, key %s): only a running '
            'parent''s worker writes its children, and keys starting with ''runlane.'' are '
            'runlane''s own',
            current_user, new.id, coalesce(new.parent_run_id::text, 'none'),
            coalesce(new.idempotency_key, 'none'));
end;
$$;

create trigger runlane_runs_guard_insert
    before insert on {schema}.runs
    for each row
    when (new.parent_run_id is not null or starts_with(new.idempotency_key, 'runlane.'))
    execute function {schema}.runlane_guard_run_insert();
