-- runlane schema version 12: the insert trigger announces without a nested function call.
-- compatibility: additive
--
-- runlane_runs_inserted (migrations 2 and 3) announced a statement's due queued runs once
-- per distinct environment and queue: a DISTINCT over its transition table, then
-- runlane_announce, a PL/pgSQL function, called for each pair. It now calls pg_notify
-- itself, once per such run. Postgres delivers one notification per distinct channel and
-- payload of a transaction, so listeners hear the same payloads (<environment>|<queue>) at
-- the same commit, once each, as before. What it saves is paid by every trigger() and
-- every shared statement of concurrent triggers: the trigger's time fell from 0.09-0.10 ms
-- to 0.06-0.07 ms a statement (EXPLAIN ANALYZE, one run and groups of 4 and 16 alternated,
-- benchmarks/README.md, issue 23). Transport lanes' outbox items are written as before.
--
-- Additive for the runtimes of version 11: the same notifications and the same outbox
-- items; runlane_announce stays (the update trigger and runlane_outbox_write call it).

create or replace function {schema}.runlane_runs_inserted()
returns trigger
language plpgsql
as $$
begin
    -- one notification per distinct payload and transaction: Postgres folds the repeats
    perform pg_notify({channel}, n.environment || '|' || n.queue)
    from new_rows as n
    where n.status = 'queued' and n.due_at <= now();
    if exists (select from {schema}.outbox_environments) then
        perform {schema}.runlane_outbox_write(coalesce(jsonb_agg(jsonb_build_object(
            'id', n.id, 'environment', n.environment, 'queue', n.queue,
            'due_at', n.due_at)), '[]'::jsonb))
        from new_rows as n
        where n.status = 'queued';
    end if;
    return null;
end;
$$;
