-- runlane schema version 8: flow control (docs/flow-control.md).
-- compatibility: additive
--
-- * runs.concurrency_key: the key trigger(concurrency_key=...) gave a run of a queue with a
--   key_concurrency_limit (null otherwise). Two partial indexes, of keyed rows only, so runs
--   without a key pay nothing for them: runs_claimable_by_key lets a claim walk the keys of
--   a queue that have queued runs, one index probe per key, and take each key's next runs
--   (a key with a huge backlog is one step of the walk, never a scan of its backlog);
--   runs_live_by_key counts a key's live leases (running rows are few).
-- * queue_flow: one row per limited queue that has started runs, written only by claims
--   that start some (under the queue's claim lock): the last start stamp (claims stamp
--   their starts with a time that never goes back), the rate limit's theoretical arrival
--   time (burst given) and where the key walk resumes (round robin over keys).
-- * queue_starts: the starts of a rate-limited queue without burst, one row per claim that
--   started runs (its stamp and how many); rows older than the window are deleted by the
--   next claim that starts runs. A claim that starts nothing writes nothing.
--
-- Additive: a runtime of schema version 7 ignores the new column and tables.

alter table {schema}.runs add column concurrency_key text;

create index runs_claimable_by_key
    on {schema}.runs (environment, queue, concurrency_key, priority desc, due_at, id)
    where status = 'queued' and concurrency_key is not null;

create index runs_live_by_key
    on {schema}.runs (environment, queue, concurrency_key, lease_expires_at)
    where status in ('running', 'cancellation_requested') and concurrency_key is not null;

create table {schema}.queue_flow (
    environment  text not null,
    queue        text not null,
    last_start   timestamptz not null,
    -- rate limit with burst: when the next start conforms without burst (GCRA)
    rate_tat     timestamptz,
    -- key_concurrency_limit: the key the last claim took runs from; the next walk starts after it
    key_cursor   text,
    primary key (environment, queue)
);

create table {schema}.queue_starts (
    environment  text not null,
    queue        text not null,
    started_at   timestamptz not null,
    started      integer not null,
    constraint queue_starts_positive check (started > 0)
);

create index queue_starts_by_queue on {schema}.queue_starts (environment, queue, started_at);
