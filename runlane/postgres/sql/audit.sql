-- The operators' audit trail (migration 21's audit_log) and reschedule.
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created. An
-- audit row is written in the transaction of the action it records (postgres/_audit.py).

-- name: audit_insert
-- One record (one part of a bulk action). at and db_role are the table's defaults (the
-- database's time and current_user), which the operator role cannot write. A record sent
-- again (a statement retried after its answer was lost) leaves the first one.
insert into {schema}.audit_log (
    id, action_id, part, environment, via, actor, os_user, action, target, runs, changed,
    reason, details)
values (%(id)s, %(action_id)s, %(part)s, %(environment)s, %(via)s, %(actor)s, %(os_user)s,
        %(action)s, %(target)s, %(runs)s, %(changed)s, %(reason)s, %(details)s::jsonb)
on conflict do nothing;

-- name: audit_list
-- An environment's actions newest first, from their heading rows (part 0), since a time
-- and below a cursor; a bulk action's runs and changed are summed over its parts: those of
-- the same environment, action and database role only (migration 23 refuses any other part
-- to every role but the owner; rows written before it are left out here).
select h.id, h.action_id, h.at, h.via, h.actor, h.db_role, h.os_user, h.action, h.target,
       h.reason, h.details, p.runs, p.changed, p.parts
from {schema}.audit_log as h
cross join lateral (
    select case when count(a.runs) = 0 then null else sum(a.runs)::bigint end as runs,
           bool_or(a.changed) as changed, count(*) as parts
    from {schema}.audit_log as a
    where a.action_id = h.action_id and a.environment = h.environment
      and a.action = h.action and a.db_role = h.db_role
) as p
where h.environment = %(environment)s
  and h.part = 0
  and h.at >= coalesce(%(since)s::timestamptz, '-infinity')
  and (h.at, h.id) < (%(before_at)s::timestamptz, %(before_id)s::uuid)
order by h.at desc, h.id desc
limit %(limit)s;

-- name: audit_prune
-- Retention (maintenance): the environment's records older than the given age (a day at
-- least), by the server's clock (migration 21's runlane_prune_audit).
select {schema}.runlane_prune_audit(
    %(environment)s, %(keep_seconds)s * interval '1 second', %(limit)s);

-- name: run_reschedule
-- reschedule_run: a queued or retrying run's due time moves (migration 21's
-- runlane_reschedule_runs; the operator role may move it only through that). One row per
-- run found: its status before, whether it moved.
select id, status, rescheduled
from {schema}.runlane_reschedule_runs(
    %(environment)s, %(ids)s::uuid[], coalesce(%(run_at)s::timestamptz, {@now}), {@now},
    false);

-- name: run_reschedule_audited
-- run_reschedule inside reschedule_run's audited transaction: migration 24's overload,
-- which commits only with the action's audit record (action reschedule, target the run).
select id, status, rescheduled
from {schema}.runlane_reschedule_runs(
    %(environment)s, %(ids)s::uuid[], coalesce(%(run_at)s::timestamptz, {@now}), {@now},
    false, %(action)s);

-- name: run_delete
-- The console's delete of one run: a terminal run is deleted (or tombstoned while it has
-- children) through migration 14's runlane_delete_runs, as delete_runs does; its status
-- before, and how many runs went (0: it was not terminal, left alone). No row: no run.
with found as materialized (
    select r.status from {schema}.runs as r
    where r.id = %(id)s and r.environment = %(environment)s
), gone as materialized (
    select d.deleted + d.tombstoned as n
    from {schema}.runlane_delete_runs(%(environment)s, array[%(id)s::uuid], false) as d
)
select f.status, g.n from found as f cross join gone as g;

-- name: run_delete_audited
-- run_delete inside delete_run's audited transaction: migration 24's overload of
-- runlane_delete_runs, which commits only with the action's audit record.
with found as materialized (
    select r.status from {schema}.runs as r
    where r.id = %(id)s and r.environment = %(environment)s
), gone as materialized (
    select d.deleted + d.tombstoned as n
    from {schema}.runlane_delete_runs(%(environment)s, array[%(id)s::uuid], false,
                                      %(action)s) as d
)
select f.status, g.n from found as f cross join gone as g;
