-- runlane schema version 22: a worker registers at the time its statements read.
-- compatibility: additive
--
-- A worker's row takes started_at and last_seen_at from their column defaults, now(); every
-- later write and list_workers read the statement's time (the fragment now), so a worker
-- registered on a moved clock (runlane.testing.MovableClock) looked lost until its first
-- heartbeat. The defaults read runlane_now() (schema version 19): now() unless a lane given
-- a clock set runlane.now, as in production nothing does. The worker role's insert names
-- neither column, so no grant changes.

alter table {schema}.workers
    alter column started_at set default {schema}.runlane_now(),
    alter column last_seen_at set default {schema}.runlane_now();
