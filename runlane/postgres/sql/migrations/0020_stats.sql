-- runlane schema version 20: the rollup of what happened to runs over time (Runlane.stats).
-- compatibility: additive
--
-- stats_rollup holds one row per environment, span, minute (UTC, from the epoch: the span's
-- start), queue and task, in spans of 1, 15 and 60 minutes (the longer ones summed from the
-- minutes, so a read of a day or a week sums few rows): runs triggered, attempts started,
-- attempts that ended in a retry, runs completed, failed and cancelled, and two histograms
-- of the runs that completed or failed (the wait from due to the start of their final
-- attempt, and that attempt's run time): counts per fixed log-spaced bucket
-- (runlane.stats.HISTOGRAM_BOUNDS, upper bounds in seconds; the last element counts what is
-- above the last bound) and the sum of the values.
--
-- The maintenance band "stats" writes it (sql/stats.sql): each pass recomputes whole minutes
-- from the runs and attempts of a window ending at the current minute, then the 15- and
-- 60-minute spans those minutes fall in, and records in stats_folds how far it got; nothing
-- on the hot path writes it. attempts_by_start serves the fold's read of the attempts started
-- in the window (a worker's only new cost: one index entry per attempt ended).
--
-- Additive for the runtimes of version 19: new tables and an index they do not use.

create table {schema}.stats_rollup (
    environment text not null,
    span        smallint not null,
    minute      timestamptz not null,
    queue       text not null,
    task_id     text not null,
    triggered   integer not null default 0,
    started     integer not null default 0,
    retried     integer not null default 0,
    completed   integer not null default 0,
    failed      integer not null default 0,
    cancelled   integer not null default 0,
    wait_counts integer[] not null,
    wait_sum    double precision not null default 0,
    run_counts  integer[] not null,
    run_sum     double precision not null default 0,
    primary key (environment, span, minute, queue, task_id),
    constraint stats_rollup_span_known check (span in (1, 15, 60))
);

-- how far each environment's rollup was folded: minutes before folded_until that are also
-- older than the fold's look-back are final
create table {schema}.stats_folds (
    environment  text primary key,
    folded_until timestamptz not null
);

create index attempts_by_start on {schema}.attempts (started_at);
