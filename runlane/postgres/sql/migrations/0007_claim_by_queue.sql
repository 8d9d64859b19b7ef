-- runlane schema version 7: a claim reads only the queues it serves.
-- compatibility: additive
--
-- runs_claimable led with the environment, by priority and due time, the queue carried as an
-- included column: a claim for queue "default" walked, and skipped, every due run of every
-- other queue of its environment that sorted before its own. A paused queue with a backlog,
-- or a queue a bulk retry had just filled, slowed every claim of its neighbours (486 ms for
-- the longest claim while 1,000,000 retried runs became due in a queue nobody served,
-- benchmarks/bulk_stall.py).
--
-- The index now leads with the queue, and run_claim (sql/claims.sql) reads each served
-- queue's range on its own and merges them. Each status change still writes one entry of
-- this index, as before.
--
-- Additive for the runtimes of version 6: their claim reads the new index by environment
-- and queue, as it read the included column before.

drop index {schema}.runs_claimable;

create index runs_claimable
    on {schema}.runs (environment, queue, priority desc, due_at, id)
    where status = 'queued';
