-- runlane schema version 11: the outbox items that failed to publish, indexed for status.
-- compatibility: additive
--
-- status() on the RabbitMQ lane names the queues the broker cannot serve from the outbox
-- items that failed to publish twice or more (outbox_failing_queues). When the broker cannot
-- serve a queue, the outbox fills with that queue's runs; without this index every status
-- call (and every console page showing it) would read all of an environment's pending
-- items. Items that never failed, the usual case, are not in it.
--
-- Additive for the runtimes of version 10: an index they do not need.

create index outbox_failing
    on {schema}.outbox (environment, queue)
    where failures >= 2;
