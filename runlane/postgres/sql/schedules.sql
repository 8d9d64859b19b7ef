-- Schedules: per-schedule state and definition, one run per slot, and the operator's
-- pause, resume and "run now".
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Every write an attempt makes is fenced by
-- run id, attempt number and lease token; every maintenance write re-checks its condition
-- in the statement that changes the row. Names are unique across the files of sql/.
--
-- A schedule's definition (task_id, queue, payload, priority, max_attempts) is stored with
-- its state so that operators can list, pause and fire it from a database URL alone. The
-- definition digest lets maintenance see that the stored definition is still its own
-- without reading the payload back on every pass.

-- name: schedule_state_list
select schedule_id, cron, timezone, next_slot_at, paused,
       sha256(convert_to(row(task_id, queue, payload, priority, max_attempts)::text, 'UTF8'))
           as definition_digest
from {schema}.schedules
where environment = %(environment)s and schedule_id = any(%(schedule_ids)s::text[]);

-- name: schedule_state_reset
-- First sighting of a schedule, or its cron/timezone changed: wait for the next slot. The
-- definition is written with it (a null keeps the stored one). Paused stays as it was.
insert into {schema}.schedules as s (
    environment, schedule_id, cron, timezone, next_slot_at,
    task_id, queue, payload, priority, max_attempts)
values (%(environment)s, %(schedule_id)s, %(cron)s, %(timezone)s, %(next_slot_at)s,
        %(task_id)s, %(queue)s, %(payload)s::jsonb, %(priority)s, %(max_attempts)s)
on conflict (environment, schedule_id) do update
set cron = excluded.cron,
    timezone = excluded.timezone,
    next_slot_at = excluded.next_slot_at,
    task_id = coalesce(excluded.task_id, s.task_id),
    queue = coalesce(excluded.queue, s.queue),
    payload = coalesce(excluded.payload, s.payload),
    priority = coalesce(excluded.priority, s.priority),
    max_attempts = coalesce(excluded.max_attempts, s.max_attempts),
    updated_at = {@now}
where s.cron is distinct from excluded.cron or s.timezone is distinct from excluded.timezone;

-- name: schedule_define
-- Store the definition maintenance fires the schedule with; a row already holding it is
-- not written. Returns the stored definition's digest when it changed the row.
update {schema}.schedules as s
set task_id = %(task_id)s,
    queue = %(queue)s,
    payload = %(payload)s::jsonb,
    priority = %(priority)s,
    max_attempts = %(max_attempts)s,
    updated_at = {@now}
where environment = %(environment)s
  and schedule_id = %(schedule_id)s
  and (s.task_id, s.queue, s.payload, s.priority, s.max_attempts)
      is distinct from (%(task_id)s::text, %(queue)s::text, %(payload)s::jsonb,
                        %(priority)s::integer, %(max_attempts)s::integer)
returning sha256(convert_to(row(s.task_id, s.queue, s.payload, s.priority,
                                s.max_attempts)::text, 'UTF8'));

-- name: schedule_definition_digest
select sha256(convert_to(row(task_id, queue, payload, priority, max_attempts)::text, 'UTF8'))
from {schema}.schedules
where environment = %(environment)s and schedule_id = %(schedule_id)s;

-- name: schedule_fire
-- Records one slot and creates its run in one statement, only while the schedule is not
-- paused and still awaits ``expected_slot_at`` (its row is locked, so a pause or resume
-- committing meanwhile is seen). The slot's primary key makes a second replica firing the
-- same slot create nothing. The schedule remembers the latest slot that made a run.
with schedule as (
    select schedule_id
    from {schema}.schedules
    where environment = %(environment)s
      and schedule_id = %(schedule_id)s
      and not paused
      and next_slot_at = %(expected_slot_at)s
    for update
), slot as (
    insert into {schema}.schedule_slots (environment, schedule_id, slot_at, run_id)
    select %(environment)s, schedule.schedule_id, %(slot_at)s, %(run_id)s
    from schedule
    on conflict do nothing
    returning run_id
), inserted as (
    insert into {schema}.runs (
        id, environment, task_id, queue, status, priority, payload, max_attempts, due_at)
    select slot.run_id, %(environment)s, %(task_id)s, %(queue)s, 'queued', %(priority)s,
           %(payload)s::jsonb, %(max_attempts)s, {@now}
    from slot
    returning id
), fired as (
    update {schema}.schedules as s
    set last_fired_at = %(slot_at)s, last_run_id = inserted.id
    from inserted
    where s.environment = %(environment)s
      and s.schedule_id = %(schedule_id)s
      and (s.last_fired_at is null or s.last_fired_at < %(slot_at)s)
)
select id from inserted;

-- name: schedule_advance
update {schema}.schedules
set next_slot_at = %(next_slot_at)s, updated_at = {@now}
where environment = %(environment)s
  and schedule_id = %(schedule_id)s
  and next_slot_at = %(expected_slot_at)s
  and next_slot_at is distinct from %(next_slot_at)s
  and not paused;

-- name: schedule_list
-- Every stored schedule of the environment, for operators (the primary key serves it).
select schedule_id, cron, timezone, next_slot_at, paused, task_id, queue,
       last_fired_at, last_run_id
from {schema}.schedules
where environment = %(environment)s
order by schedule_id;

-- name: schedule_get
-- One stored schedule with its definition (the payload as JSON text).
select schedule_id, cron, timezone, next_slot_at, paused, task_id, queue,
       last_fired_at, last_run_id, payload::text, priority, max_attempts
from {schema}.schedules
where environment = %(environment)s and schedule_id = %(schedule_id)s;

-- name: schedule_pause
-- Idempotent: a paused schedule is not written again. Answers whether it was paused before
-- (no row: no such schedule).
with target as (
    select paused
    from {schema}.schedules
    where environment = %(environment)s and schedule_id = %(schedule_id)s
    for update
), changed as (
    update {schema}.schedules
    set paused = true, updated_at = {@now}
    where environment = %(environment)s
      and schedule_id = %(schedule_id)s
      and not paused
)
select paused from target;

-- name: schedule_resume
-- Resumes a paused schedule awaiting the first slot after the time of resume (computed from
-- database time by the caller): missed slots are not caught up. Guarded by the cron and
-- timezone the caller computed with; a schedule not paused is left alone.
update {schema}.schedules
set paused = false, next_slot_at = %(next_slot_at)s, updated_at = {@now}
where environment = %(environment)s
  and schedule_id = %(schedule_id)s
  and paused
  and cron = %(cron)s
  and timezone = %(timezone)s
returning schedule_id;

-- name: schedule_run_now
-- trigger_schedule_now of a stored schedule (see migration 6's runlane_run_schedule).
select run_id, task_id, queue, created
from {schema}.runlane_run_schedule(
    %(environment)s, %(schedule_id)s, %(run_id)s, %(idempotency_key)s,
    %(trace_context)s::jsonb);

-- name: schedule_run_now_audited
-- schedule_run_now inside trigger_schedule_now's audited transaction: migration 26's
-- overload, which commits only with the action's audit record (run_schedule_now, target
-- the schedule).
select run_id, task_id, queue, created
from {schema}.runlane_run_schedule(
    %(environment)s, %(schedule_id)s, %(run_id)s, %(idempotency_key)s,
    %(trace_context)s::jsonb, %(action)s);
