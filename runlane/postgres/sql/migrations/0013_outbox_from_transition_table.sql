-- runlane schema version 13: the insert trigger writes its outbox items itself.
-- compatibility: additive
--
-- For an environment with a transport lane (outbox_environments), runlane_runs_inserted
-- passed the statement's queued runs to runlane_outbox_write as one jsonb array
-- (jsonb_agg of jsonb_build_object over the transition table), and that PL/pgSQL function
-- unpacked the array again (jsonb_array_elements, a cast per field), inserted the items
-- and announced the unclaimed due ones through runlane_announce, one nested call per
-- distinct environment and queue. The trigger now inserts the items straight from its
-- transition table (one INSERT ... SELECT from new_rows) and calls pg_notify itself, once
-- per unclaimed due item: Postgres folds repeated payloads of a transaction, so listeners
-- hear the same <environment>|outbox|<queue> payloads, once each, at the same commit.
-- The items are the same rows as before, in the same transaction as their runs (an
-- eager statement's due runs claimed by runlane.outbox_claim, with ids
-- md5(claim || run id); every other item unclaimed and announced). Every path that
-- inserts runs fires this trigger (trigger, group commit, trigger_many, flows' children,
-- schedules). The trigger's time (EXPLAIN ANALYZE, old and new alternated, p50): one
-- eager run 0.30 -> 0.22 ms after 20 ms idle, 0.074 -> 0.053 ms back to back; one unclaimed
-- run 0.34 -> 0.24 ms idle; 16 runs 0.40 -> 0.28 ms; 1,000 runs (trigger_many) 13.7 -> 9.6
-- ms. The RabbitMQ lane's trigger-to-start p50 fell by about 0.1 ms (benchmarks/README.md,
-- issue 23, the RabbitMQ lane's start latency).
--
-- Additive for the runtimes of version 12: the same outbox items and notifications;
-- runlane_outbox_write and runlane_announce stay (the update trigger calls them).

create or replace function {schema}.runlane_runs_inserted()
returns trigger
language plpgsql
as $$
declare
    claim uuid;
    announced bigint;
begin
    perform pg_notify({channel}, n.environment || '|' || n.queue)
    from new_rows as n
    where n.status = 'queued' and n.due_at <= now();
    if exists (select from {schema}.outbox_environments) then
        claim := nullif(current_setting('runlane.outbox_claim', true), '')::uuid;
        with items as (
            insert into {schema}.outbox (
                id, environment, run_id, queue, available_at, claim_token, claim_expires_at)
            select case when claim is not null and n.due_at <= now()
                        then md5(claim::text || n.id::text)::uuid
                        else gen_random_uuid() end,
                   n.environment, n.id, n.queue, greatest(n.due_at, now()),
                   case when claim is not null and n.due_at <= now() then claim end,
                   case when claim is not null and n.due_at <= now()
                        then now() + e.claim_seconds * interval '1 second' end
            from new_rows as n
            join {schema}.outbox_environments as e on e.environment = n.environment
            where n.status = 'queued'
            returning environment, queue, claim_token, available_at
        )
        select count(pg_notify({channel}, i.environment || '|outbox|' || i.queue)::text)
        into announced
        from items as i
        where i.claim_token is null and i.available_at <= now();
    end if;
    return null;
end;
$$;
