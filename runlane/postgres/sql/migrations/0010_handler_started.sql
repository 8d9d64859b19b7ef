-- runlane schema version 10: a running run's handler has started, or it is only claimed.
-- compatibility: additive
--
-- runs.started_attempt: the attempt whose handler a worker has started (written by the
-- worker's lifecycle writer, fenced by the attempt's lease, about a tenth of a second to a
-- second after the handler began; handlers that end sooner are never marked). A run is
-- executing when status is running or cancellation_requested and started_attempt =
-- attempt; otherwise it is claimed and not started yet (prefetched by a worker, or between
-- its claim and its start). Each claim takes a new attempt number, so a mark never outlives
-- its attempt and claims need not clear it.
--
-- Additive for the runtimes of version 9: they never write the column (their runs show as
-- claimed and not started), and nothing they read changes.

alter table {schema}.runs add column started_attempt integer;
