-- Claims: due queued runs move to running under fresh leases.
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Every write an attempt makes is fenced by
-- run id, attempt number and lease token; every maintenance write re-checks its condition
-- in the statement that changes the row. Names are unique across the files of sql/.

-- name: run_claim
-- The next due queued runs of the given queues, by priority, then due time, then id.
-- Each served queue's range of runs_claimable (which leads with the queue) is read on its
-- own, so the due backlog of a queue this claim does not serve (a paused queue, one a bulk
-- retry filled) is never walked; each range gives at most the limit of its first unlocked
-- runs, locked, and the merge keeps the limit of them in the same order. Rows locked but
-- not kept (only with several served queues) are skipped by other claimers until this
-- short statement's transaction ends.
-- Paused queues (queue_states) are left out here, in the claim itself, so a pause holds on
-- every worker from the moment it commits; the check is one primary-key probe per queue.
-- With a concurrency_limit (a bounded queue: one queue, after queue_claim_lock in the same
-- transaction) it claims only as many as the limit leaves after the queue's live leases;
-- without one, the live count is skipped by a one-time filter.
with live as (
    select count(*) as n
    from {schema}.runs
    where %(concurrency_limit)s::int is not null
      and environment = %(environment)s
      and queue = any(%(queues)s::text[])
      and status in ('running', 'cancellation_requested')
      and lease_expires_at > {@now}
), served as (
    select distinct q
    from unnest(%(queues)s::text[]) as q
    where not exists (select from {schema}.queue_states as s
                      where s.environment = %(environment)s and s.queue = q and s.paused)
), candidates as materialized (
    select c.id
    from served
    cross join lateral (
        select id, priority, due_at
        from {schema}.runs
        where environment = %(environment)s
          and queue = served.q
          and status = 'queued'
          and due_at <= {@now}
        order by priority desc, due_at, id
        limit greatest(0, least(%(limit)s,
                                coalesce(%(concurrency_limit)s::int - (select n from live),
                                         %(limit)s)))
        for update skip locked
    ) as c
    order by c.priority desc, c.due_at, c.id
    limit greatest(0, least(%(limit)s,
                            coalesce(%(concurrency_limit)s::int - (select n from live),
                                     %(limit)s)))
)
update {schema}.runs as r
set {@claim_set},
    attempt_started_at = {@now},
    started_at = coalesce(r.started_at, {@now})
from candidates as c
where r.id = c.id
returning {@claim_returning};

-- name: queue_claim_lock
-- Serialises claimers of one bounded queue until their transaction ends, so the next
-- claimer's count (a later statement, a later snapshot) sees every lease taken before it.
select pg_advisory_xact_lock(hashtext(%(lock_scope)s), hashtext(%(queue)s));

-- name: run_next_due
-- Seconds from now (the database's) until the earliest queued run of the given queues comes
-- due (NULL: none is waiting for its time): an idle worker wakes no later than then, since
-- nothing announces a delayed run when it comes due. One index descent of runs_claimable per
-- distinct priority of each queue (a loose scan: the priorities of a queue are walked
-- highest first, each giving its first run due after now), so a queue holding many future
-- runs is not walked.
with recursive prios as (
    (select q, r.priority
     from unnest(%(queues)s::text[]) as q
     cross join lateral (
         select priority from {schema}.runs
         where environment = %(environment)s and queue = q and status = 'queued'
         order by priority desc
         limit 1
     ) as r)
    union all
    select p.q, n.priority
    from prios as p
    cross join lateral (
        select priority from {schema}.runs
        where environment = %(environment)s and queue = p.q and status = 'queued'
          and priority < p.priority
        order by priority desc
        limit 1
    ) as n
)
select extract(epoch from min(d.due_at) - {@now})::float8
from prios as p
cross join lateral (
    select due_at from {schema}.runs
    where environment = %(environment)s and queue = p.q and status = 'queued'
      and priority = p.priority and due_at > {@now}
    order by due_at
    limit 1
) as d;
