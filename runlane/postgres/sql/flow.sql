-- Flow control: claims of queues with a rate limit or a per-key concurrency limit
-- (docs/flow-control.md; schema in migrations/0008_flow_control.sql).
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Names are unique across the files of sql/.

-- name: run_claim_limited
-- Claim from one limited queue, after queue_claim_lock in the same transaction (every
-- claimer of the queue, on every path, takes that lock first, so each claim counts what
-- the one before it started). Polling (ids null): the queue's next due runs; by id (the
-- RabbitMQ lane, ids given): those of the named runs that are queued and due. It claims at
-- most as many as each limit leaves:
-- * concurrency_limit: live leases of the queue;
-- * key_concurrency_limit: live leases of each key. Polling walks the keys that have
--   queued runs in key order from where the last claim stopped (round robin), one index
--   probe per key, and takes each key's next runs by priority, due time and id; a key at
--   its limit costs one probe however long its backlog. Runs of the queue stored without
--   a key (queued before the queue had the limit) are taken from the head of the queue;
-- * rate_count per rate_per_us: starts. Each claim stamps its starts with the database's
--   clock_timestamp() after the lock, never earlier than the last stamp (queue_flow), so
--   stamps only grow in the order claims commit. Without burst, a sliding window: the
--   starts stamped in (t - per, t] plus this claim's are at most rate_count. With burst,
--   GCRA (emission interval T = per/count, tolerance burst x T): at most burst + 1 at once
--   and never more than count + burst in any window of per.
-- A claim that starts nothing writes nothing (unless its walk looked at visit_limit keys
-- without finding a run it may start: it then records where the next claim goes on). The
-- last row (id null) carries the seconds until the rate limit lets the next run start (0:
-- not rate-bound now; null: no limit) and whether the claim started nothing only because
-- its walk stopped at visit_limit keys (walked_on: keys it did not look at may hold due
-- runs; drain() claims again rather than stop).
with flow as materialized (
    select max(f.last_start) as last_start, max(f.rate_tat) as rate_tat,
           max(f.key_cursor) as key_cursor
    from {schema}.queue_flow as f
    where f.environment = %(environment)s and f.queue = %(queue)s
), stamp as materialized (
    select greatest({@clock_now}, coalesce(flow.last_start, '-infinity')) as t
    from flow
), per as materialized (
    select %(rate_per_us)s::bigint * interval '1 microsecond' as d
), window_starts as materialized (
    select coalesce(sum(s.started), 0)::bigint as n, min(s.started_at) as oldest
    from {schema}.queue_starts as s
    where %(rate_count)s::int is not null and %(rate_burst)s::int is null
      and s.environment = %(environment)s and s.queue = %(queue)s
      and s.started_at > (select t from stamp) - (select d from per)
), rate as materialized (
    select case
        when %(rate_count)s::int is null then null
        when %(rate_burst)s::int is null
            then greatest(0, %(rate_count)s::int - (select n from window_starts))
        else greatest(0, floor(
            (%(rate_count)s::int::numeric
               * (extract(epoch from stamp.t - greatest(stamp.t, flow.rate_tat)) * 1000000)
             + %(rate_burst)s::int::numeric * %(rate_per_us)s::bigint)
            / %(rate_per_us)s::bigint) + 1)
    end::bigint as room
    from flow, stamp
), live as (
    {@queue_live_leases}
), room as materialized (
    select case
        when exists (select from {schema}.queue_states as s
                     where s.environment = %(environment)s and s.queue = %(queue)s
                       and s.paused) then 0
        else greatest(0, least(
            %(limit)s::bigint,
            coalesce(%(concurrency_limit)s::int - (select n from live), %(limit)s::bigint),
            coalesce((select room from rate), %(limit)s::bigint)))
    end as n
), plain as (
    -- neither keys nor ids: the queue's next due runs
    select id, priority, due_at, 0 as i, null::text as k
    from {schema}.runs
    where %(ids)s::uuid[] is null and %(key_limit)s::int is null
      and environment = %(environment)s
      and queue = %(queue)s
      and status = 'queued'
      and due_at <= {@now}
    order by priority desc, due_at, id
    limit (select n from room)
    for update skip locked
), legacy as (
    -- a keyed queue's runs stored without a key, at the head of the queue
    select id, priority, due_at, 0 as i, null::text as k
    from {schema}.runs
    where id = any(array(
        select h.id
        from (select id, concurrency_key
              from {schema}.runs
              where %(ids)s::uuid[] is null and %(key_limit)s::int is not null
                and environment = %(environment)s
                and queue = %(queue)s
                and status = 'queued'
                and due_at <= {@now}
              order by priority desc, due_at, id
              limit (select n from room)) as h
        where h.concurrency_key is null))
      and status = 'queued'
    for update skip locked
), walk (i, k, lap) as (
    -- the keys with queued runs, in key order after the cursor, then from the first key
    -- round to the cursor (lap 1); evaluated only as far as the claim reads it
    with recursive steps (i, k, lap) as (
        select 1, coalesce(s.after, s.first), case when s.after is null then 1 else 0 end
        from (select
                  (select r.concurrency_key from {schema}.runs as r
                   where r.environment = %(environment)s and r.queue = %(queue)s
                     and r.status = 'queued' and r.concurrency_key is not null
                     and r.concurrency_key > flow.key_cursor
                   order by r.concurrency_key limit 1) as after,
                  (select r.concurrency_key from {schema}.runs as r
                   where r.environment = %(environment)s and r.queue = %(queue)s
                     and r.status = 'queued' and r.concurrency_key is not null
                   order by r.concurrency_key limit 1) as first
              from flow
              where %(ids)s::uuid[] is null and %(key_limit)s::int is not null
                and (select n from room) > 0) as s
        union all
        select w.i + 1, n.k, n.lap
        from steps as w
        cross join lateral (
            -- "offset 0" keeps each probe a single evaluation (not inlined into every use)
            select case when a.after is null and w.lap = 0
                        then (select r.concurrency_key from {schema}.runs as r
                              where r.environment = %(environment)s and r.queue = %(queue)s
                                and r.status = 'queued' and r.concurrency_key is not null
                              order by r.concurrency_key limit 1)
                        else a.after end as k,
                   case when a.after is null then 1 else w.lap end as lap
            from (select (select r.concurrency_key from {schema}.runs as r
                          where r.environment = %(environment)s and r.queue = %(queue)s
                            and r.status = 'queued' and r.concurrency_key is not null
                            and r.concurrency_key > w.k
                          order by r.concurrency_key limit 1) as after
                  offset 0) as a
            offset 0) as n
        where w.k is not null and w.i < %(visit_limit)s and n.k is not null
          and (n.lap = 0 or n.k <= (select key_cursor from flow)
               or (select key_cursor from flow) is null)
    )
    select i, k, lap from steps where k is not null
), keyed as (
    -- each key's runs it may start; and, when the walk reached visit_limit keys, a row
    -- without a run naming the last key it looked at (where the next claim goes on)
    select c.id, c.priority, c.due_at, walk.i, walk.k
    from walk
    cross join lateral (
        select count(*) as n
        from {schema}.runs
        where environment = %(environment)s and queue = %(queue)s
          and concurrency_key = walk.k
          and status in ('running', 'cancellation_requested')
          and lease_expires_at > {@now}) as lv
    left join lateral (
        -- the key as a range and the order led by it (one key: the same rows, the same
        -- order) so that only runs_claimable_by_key serves it: with "= walk.k" the generic
        -- plan read the queue's whole range in runs_claimable, filtering on the key
        select id, priority, due_at
        from {schema}.runs
        where environment = %(environment)s and queue = %(queue)s
          and concurrency_key >= walk.k and concurrency_key <= walk.k
          and status = 'queued'
          and due_at <= {@now}
        order by concurrency_key, priority desc, due_at, id
        limit greatest(0, %(key_limit)s::int - lv.n)
        for update skip locked) as c on true
    where c.id is not null or walk.i >= %(visit_limit)s
    limit (select n from room)
), named as (
    -- by id: the named runs that are queued and due, each key within what it has left
    select id, priority, due_at, 0 as i, concurrency_key as k
    from {schema}.runs
    where id = any(array(
        select n.id
        from (select r.id, r.priority, r.due_at, r.concurrency_key,
                     row_number() over (partition by r.concurrency_key
                                        order by r.priority desc, r.due_at, r.id) as rank
              from {schema}.runs as r
              where r.id = any(%(ids)s::uuid[])
                and r.environment = %(environment)s
                and r.queue = %(queue)s
                and r.status = 'queued'
                and r.due_at <= {@now}) as n
        where n.concurrency_key is null or %(key_limit)s::int is null
           or n.rank <= %(key_limit)s::int - (
                select count(*)
                from {schema}.runs as l
                where l.environment = %(environment)s and l.queue = %(queue)s
                  and l.concurrency_key = n.concurrency_key
                  and l.status in ('running', 'cancellation_requested')
                  and l.lease_expires_at > {@now})
        order by n.priority desc, n.due_at, n.id
        limit (select n from room)))
      and status = 'queued'
    for update skip locked
), picked as materialized (
    select id, i, k
    from (select * from legacy
          union all select id, priority, due_at, i, k from keyed where id is not null
          union all select * from plain
          union all select * from named) as u
    order by i, priority desc, due_at, id
    limit (select n from room)
), claimed as (
    update {schema}.runs as r
    set {@claim_set},
        attempt_started_at = (select t from stamp),
        started_at = coalesce(r.started_at, (select t from stamp))
    -- by primary key: a join with picked would be planned for the generic plan's guess of
    -- its size (a hash of the whole table)
    where r.id = any(array(select id from picked))
    returning {@claim_returning}
), counted as materialized (
    select count(*)::int as n,
           coalesce((select p.k from picked as p
                     where p.k is not null and p.id in (select id from claimed)
                     order by p.i desc limit 1),
                    (select k from keyed where id is null)) as last_key
    from claimed
), next_tat as materialized (
    -- GCRA: each start moves the theoretical arrival time on by per/count (rounded up)
    select case when %(rate_burst)s::int is null or %(rate_count)s::int is null then null
                else greatest(stamp.t, coalesce(flow.rate_tat, stamp.t))
                     + ceil(counted.n::numeric * %(rate_per_us)s::bigint
                            / %(rate_count)s::int)::bigint * interval '1 microsecond'
           end as tat
    from flow, stamp, counted
), logged as (
    insert into {schema}.queue_starts (environment, queue, started_at, started)
    select %(environment)s, %(queue)s, stamp.t, counted.n
    from stamp, counted
    where counted.n > 0 and %(rate_count)s::int is not null and %(rate_burst)s::int is null
), pruned as (
    delete from {schema}.queue_starts as s
    where (select n from counted) > 0
      and %(rate_count)s::int is not null and %(rate_burst)s::int is null
      and s.environment = %(environment)s and s.queue = %(queue)s
      and s.started_at <= (select t from stamp) - (select d from per)
), flowed as (
    insert into {schema}.queue_flow as f (environment, queue, last_start, rate_tat, key_cursor)
    -- a claim that started nothing writes only when its walk must go on from elsewhere
    select %(environment)s, %(queue)s,
           case when counted.n > 0 then stamp.t else coalesce(flow.last_start, stamp.t) end,
           case when counted.n > 0 then next_tat.tat else flow.rate_tat end,
           counted.last_key
    from stamp, counted, next_tat, flow
    where counted.n > 0 or counted.last_key is not null
    on conflict (environment, queue) do update
    set last_start = excluded.last_start,
        rate_tat = excluded.rate_tat,
        key_cursor = coalesce(excluded.key_cursor, f.key_cursor)
)
select {@claim_columns}, null::float8 as rate_wait, null::boolean as walked_on
from claimed
union all
select null, null, null, null, null, null, null, null, null, null, null,
       case
           when %(rate_count)s::int is null then null
           -- fewer than the room: nothing more to start now, whatever the rate
           when counted.n < (select n from room) then 0
           when %(rate_burst)s::int is null then
               case when rate.room > counted.n then 0
                    else greatest(0, extract(epoch from
                        coalesce(window_starts.oldest, stamp.t) + per.d - stamp.t))::float8
               end
           else greatest(0, extract(epoch from
                    next_tat.tat - stamp.t)
                    - %(rate_burst)s::int::float8 * %(rate_per_us)s::bigint
                      / %(rate_count)s::int / 1000000)::float8
       end,
       counted.n = 0 and counted.last_key is not null
from rate, counted, window_starts, stamp, per, next_tat;

-- name: queue_claim_lock_flow
-- queue_claim_lock (the same lock: every claimer of the queue serialises on it) for
-- run_claim_limited, which then runs with its generic plan: the statement is prepared on
-- the claim's connection, and planning its many branches anew for each call's values
-- (which only switch branches on and off) cost more than running it.
select set_config('plan_cache_mode', 'force_generic_plan', true),
       pg_advisory_xact_lock(hashtext(%(lock_scope)s), hashtext(%(queue)s));
