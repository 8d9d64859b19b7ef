-- The outbox of transport lanes (migration 3), and claims of runs named by a delivery.
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Every publisher read and write is scoped to the publisher's environment, and every
-- publisher write is fenced by the item's claim token.

-- name: outbox_enable
-- Runs of the environment becoming queued get outbox items from now on.
insert into {schema}.outbox_environments (environment, claim_seconds)
values (%(environment)s, %(claim_seconds)s)
on conflict (environment) do update set claim_seconds = excluded.claim_seconds;

-- name: run_insert_many_claimed
-- run_insert_many for an eager trigger: the transaction-local setting makes the insert
-- trigger store the items of runs due now already claimed by %(claim)s (their ids are
-- md5(claim || run id)); returns whether each inserted run is due now.
with claim as materialized (
    select set_config('runlane.outbox_claim', %(claim)s, true)
)
insert into {schema}.runs as r (
    id, environment, task_id, queue, status, priority, payload, max_attempts,
    idempotency_key, parent_run_id, due_at, trace_context, concurrency_key)
select i.id, %(environment)s, %(task_id)s, %(queue)s, 'queued', %(priority)s,
       i.payload, %(max_attempts)s, i.idempotency_key, %(parent_run_id)s,
       coalesce(%(run_at)s::timestamptz, {@now} + %(delay_seconds)s * interval '1 second'),
       %(trace_context)s::jsonb, %(concurrency_key)s::text
from rows from (unnest(%(ids)s::uuid[]), jsonb_array_elements(%(payloads)s::jsonb),
                unnest(%(idempotency_keys)s::text[]))
    as i(id, payload, idempotency_key)
cross join claim
order by i.idempotency_key collate "C", i.id
on conflict do nothing
returning r.id, r.due_at <= {@now} as due_now;

-- name: outbox_claim_page
-- One bounded page of publishable items of the publisher's environment (SPEC section 2:
-- an environment never sees another's runs, and another environment's items may belong to
-- a broker or virtual host this publisher may not use), each under a fresh claim token
-- expiring at a database time; items claimed by a live claim or not yet available are
-- skipped. An ordered scan of outbox_claimable (migration 15).
with page as materialized (
    select id
    from {schema}.outbox
    where environment = %(environment)s
      and available_at <= {@now}
      and (claim_token is null or claim_expires_at < {@now})
    order by available_at, id
    limit %(limit)s
    for update skip locked
)
update {schema}.outbox as o
set claim_token = gen_random_uuid(),
    claim_expires_at = {@now} + %(claim_seconds)s * interval '1 second'
from page
where o.id = page.id
returning o.id, o.run_id, o.environment, o.queue, o.claim_token;

-- name: outbox_extend
-- Before publishing a chunk: the items whose claim is still the publisher's and has not
-- expired (database time) get it extended to a full claim from now; the others (expired,
-- taken by another publisher, published, the run gone) are left out of the answer and
-- must not be published under this claim.
update {schema}.outbox as o
set claim_expires_at = {@now} + %(claim_seconds)s * interval '1 second'
from unnest(%(ids)s::uuid[], %(tokens)s::uuid[], %(environments)s::text[])
    as i(id, token, environment)
where {@outbox_claim_fence}
  and o.claim_expires_at > {@now}
returning o.id;

-- name: outbox_published
-- Confirmed by the broker: the items go, if the claim is still the publisher's.
delete from {schema}.outbox as o
using unnest(%(ids)s::uuid[], %(tokens)s::uuid[], %(environments)s::text[])
    as i(id, token, environment)
where {@outbox_claim_fence}
returning o.id;

-- name: outbox_unclaim
-- Items the publisher will not publish under its claim (about to expire): released for a
-- sweep at once, if the claim is still the publisher's. Not a failure: nothing is counted.
update {schema}.outbox as o
set claim_token = null,
    claim_expires_at = null
from unnest(%(ids)s::uuid[], %(tokens)s::uuid[], %(environments)s::text[])
    as i(id, token, environment)
where {@outbox_claim_fence}
returning o.id;

-- name: outbox_failed
-- Not confirmed: the items are released for a later try after a back-off, if the claim is
-- still the publisher's.
update {schema}.outbox as o
set claim_token = null,
    claim_expires_at = null,
    failures = o.failures + 1,
    last_error = i.error,
    available_at = {@now} + i.delay_seconds * interval '1 second'
from unnest(%(ids)s::uuid[], %(tokens)s::uuid[], %(environments)s::text[],
            %(errors)s::text[], %(delay_seconds)s::float8[])
    as i(id, token, environment, error, delay_seconds)
where {@outbox_claim_fence}
returning o.id;

-- name: outbox_defer
-- A delivery that could not start its run (a bounded queue at capacity, a run not due yet):
-- a new item publishes the run again later, while the run is still queued. Announced, so
-- listening publishers learn when to sweep next.
with written as (
    insert into {schema}.outbox (id, environment, run_id, queue, available_at)
    select gen_random_uuid(), r.environment, r.id, r.queue,
           greatest(r.due_at, {@now} + %(delay_seconds)s * interval '1 second')
    from {schema}.runs as r
    where r.id = any(%(ids)s::uuid[])
      and r.environment = %(environment)s
      and r.status = 'queued'
      and not {@queue_paused}
    returning run_id, environment, queue
), {@outbox_announce_written};

-- name: outbox_next_due
-- Seconds until the next item of the environment becomes publishable (negative: one is
-- now; null: none): the first unclaimed item by availability, and the claimed items whose
-- claim expires first (a producer that died after its eager trigger leaves its items
-- claimed: they are taken once that claim expires). A claimed item is publishable already
-- (claims take only those), so the claims are looked for among the environment's first
-- 1,000 publishable items; past that many a sweep is due anyway. Both reads are ordered
-- scans of outbox_claimable (migration 15).
select extract(epoch from least(
    (select available_at
     from {schema}.outbox
     where environment = %(environment)s and claim_token is null
     order by available_at, id
     limit 1),
    (select min(due.claim_expires_at)
     from (select claim_token, claim_expires_at
           from {schema}.outbox
           where environment = %(environment)s and available_at <= {@now}
           order by available_at, id
           limit 1000) as due
     where due.claim_token is not null)
) - {@now})::float8;

-- name: outbox_recover
-- Delivery recovery: runs queued and due for longer than the threshold, untouched for as
-- long, with no outbox item (a purged queue, a dead-lettered message) are announced again.
-- Touching updated_at keeps the next pass from announcing them again before the threshold.
-- Runs of paused queues wait unannounced: resume_queue announces them.
with lost as materialized (
    select r.id
    from {schema}.runs as r
    where r.environment = %(environment)s
      and r.status = 'queued'
      and r.due_at < {@now} - %(threshold_seconds)s * interval '1 second'
      and r.updated_at < {@now} - %(threshold_seconds)s * interval '1 second'
      and not exists (select from {schema}.outbox as o where o.run_id = r.id)
      and not {@queue_paused}
    order by r.due_at, r.id
    limit %(limit)s
    for update of r skip locked
), touched as (
    update {schema}.runs as r
    set updated_at = {@now}
    from lost
    where r.id = lost.id and r.status = 'queued'
    returning r.id, r.environment, r.queue
)
insert into {schema}.outbox (id, environment, run_id, queue, available_at)
select gen_random_uuid(), environment, id, queue, {@now}
from touched
returning run_id;

-- name: outbox_status
select count(*) as outbox_pending,
       extract(epoch from {@now} - min(created_at))::float8 as outbox_oldest_age_seconds
from {schema}.outbox
where environment = %(environment)s;

-- name: outbox_failing_queues
-- The queues whose items failed to publish at least twice (rabbitmq._health.FAILING_AFTER,
-- and the predicate of the outbox_failing index, migration 11): the broker could not serve
-- them (a publisher fails only the timed-out queue's items, so a dead queue does not mark
-- its neighbours). The worst item's error is shown.
select queue,
       count(*) as items,
       max(failures) as failures,
       (array_agg(last_error order by failures desc, created_at))[1] as last_error,
       extract(epoch from {@now} - min(created_at))::float8 as oldest_age_seconds
from {schema}.outbox
where environment = %(environment)s
  and failures >= 2
group by queue
order by queue;

-- name: run_claim_ids
-- Claim runs named by deliveries: the same fenced claim as run_claim, narrowed to ids
-- (runs of paused queues are not claimed either).
-- With a concurrency_limit (one bounded queue, after queue_claim_lock in the same
-- transaction) at most as many as the limit leaves after the queue's live leases.
with live as (
    {@queue_live_leases}
), candidates as materialized (
    select id
    from {schema}.runs as r
    where id = any(%(ids)s::uuid[])
      and environment = %(environment)s
      and status = 'queued'
      and due_at <= {@now}
      and not {@queue_paused}
    order by priority desc, due_at, id
    limit greatest(0, coalesce(%(concurrency_limit)s::int - (select n from live),
                               cardinality(%(ids)s::uuid[])))
    for update skip locked
)
update {schema}.runs as r
set {@claim_set},
    attempt_started_at = {@now},
    started_at = coalesce(r.started_at, {@now})
from candidates as c
where r.id = c.id
returning {@claim_returning};

-- name: run_delivery_state
-- Why named runs were not claimed: their status, queue, whether they are due and whether
-- their queue is paused.
select r.id, r.status, r.queue, r.due_at <= {@now} as due_now,
       {@queue_paused} as paused
from {schema}.runs as r
where r.id = any(%(ids)s::uuid[]) and r.environment = %(environment)s;

-- name: wal_flush
-- Returns once the WAL is flushed past every commit made before this statement was sent,
-- on any connection: a transaction writing a WAL record (a logical decoding message with
-- the prefix 'runlane', which physical replication and recovery ignore) commits, and a
-- synchronous commit flushes the WAL up to its own commit record, after all earlier ones.
-- A transaction that only takes an xid writes nothing before its commit and would commit
-- asynchronously. Callable by any role, with any wal_level.
select pg_logical_emit_message(true, 'runlane', 'flush');
