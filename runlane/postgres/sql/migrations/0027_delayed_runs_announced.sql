-- runlane schema version 27: a delayed run is announced when it is triggered.
-- compatibility: additive
--
-- The insert trigger announced (NOTIFY env|queue) only runs due at once. A worker idle for
-- a while spaces its polls out (ten poll intervals, 10 s at most), and an empty claim reads
-- when the earliest delayed run of its queues comes due, waking then (issue 40); a run
-- triggered with a delay while the worker slept between spaced-out polls was found only at
-- its next poll, up to 10 s after it came due. Now a queued run due within 15 s (the
-- longest spacing, 10 s in postgres/_acquirer.py and up to 11 with its jitter, and a
-- margin) is announced too: the worker woken claims nothing yet, learns the run's due time
-- in the same transaction, and wakes when it comes due. A run due later is not announced
-- (no idle worker's empty claim for each delayed trigger): the worker's next spaced-out
-- poll, at most 11 s away, comes before it is due and learns its due time. The window is
-- measured from the trigger's transaction start: a delayed trigger in a transaction held
-- open for L seconds is announced only if due within 15 s of that start. Notifications
-- are one per environment and queue a transaction (PostgreSQL folds identical ones), so a
-- batch of triggers costs one.
--
-- Additive for the runtimes of version 26: the same trigger and payload; a runtime of
-- version 26 woken by a delayed run claims nothing and polls as before.

create or replace function {schema}.runlane_runs_inserted()
returns trigger
language plpgsql
as $$
declare
    claim uuid;
    announced bigint;
    moment timestamptz := {schema}.runlane_now();
begin
    -- and a run due within an idle worker's longest poll spacing (10 s, up to 11 with its
    -- jitter; 15 s here): a worker woken by it claims nothing yet and learns when it is due;
    -- a later one its next poll learns
    perform pg_notify({channel}, n.environment || '|' || n.queue)
    from new_rows as n
    where n.status = 'queued' and n.due_at <= moment + interval '15 seconds';
    if exists (select from {schema}.outbox_environments) then
        claim := nullif(current_setting('runlane.outbox_claim', true), '')::uuid;
        with items as (
            insert into {schema}.outbox (
                id, environment, run_id, queue, available_at, claim_token, claim_expires_at)
            select case when claim is not null and n.due_at <= moment
                        then md5(claim::text || n.id::text)::uuid
                        else gen_random_uuid() end,
                   n.environment, n.id, n.queue, greatest(n.due_at, moment),
                   case when claim is not null and n.due_at <= moment then claim end,
                   case when claim is not null and n.due_at <= moment
                        then moment + e.claim_seconds * interval '1 second' end
            from new_rows as n
            join {schema}.outbox_environments as e on e.environment = n.environment
            where n.status = 'queued'
            returning environment, queue, claim_token, available_at
        )
        select count(pg_notify({channel}, i.environment || '|outbox|' || i.queue)::text)
        into announced
        from items as i
        where i.claim_token is null and i.available_at <= moment;
    end if;
    return null;
end;
$$;
