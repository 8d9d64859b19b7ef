-- runlane schema version 15: the outbox is claimed by environment.
-- compatibility: additive
--
-- A publisher claims only its own environment's items (issue 37: environment A's publisher
-- took environment B's items and published them through A's broker connection, to a broker
-- or virtual host B may not use). outbox_claimable serves the scoped claim, an ordered scan
-- of one environment's publishable items (environment = $1 and available_at <= now()
-- order by available_at, id), and outbox_next_due's two reads. It replaces
-- outbox_publishable (available_at), which nothing reads any more: while it stood, the
-- planner scanned it for the scoped claim and filtered the other environments' items out
-- (EXPLAIN ANALYZE, 2,000 publishable items of one environment behind 200,000 of another:
-- 19 ms a page through outbox_publishable, 0.09 ms through outbox_claimable). It replaces
-- outbox_by_environment (environment, created_at) too, whose one reader, outbox_status,
-- counts an environment's items through the new index's leading column. The outbox keeps
-- as many indexes to write per item as before.
--
-- Additive for the runtimes of version 14: they read the outbox correctly without either
-- index. Their unscoped claim (every environment's items, ordered by available_at) reads
-- the whole outbox and sorts it per page while they run beside this version's runtimes
-- during a rolling upgrade.

create index outbox_claimable on {schema}.outbox (environment, available_at, id);
drop index {schema}.outbox_publishable;
drop index {schema}.outbox_by_environment;
