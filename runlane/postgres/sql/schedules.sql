-- Schedules: per-schedule state and one run per slot.
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Every write an attempt makes is fenced by
-- run id, attempt number and lease token; every maintenance write re-checks its condition
-- in the statement that changes the row. Names are unique across the files of sql/.

-- name: schedule_state_list
select schedule_id, cron, timezone, next_slot_at
from {schema}.schedules
where environment = %(environment)s and schedule_id = any(%(schedule_ids)s::text[]);

-- name: schedule_state_reset
-- First sighting of a schedule, or its cron/timezone changed: wait for the next slot.
insert into {schema}.schedules as s (environment, schedule_id, cron, timezone, next_slot_at)
values (%(environment)s, %(schedule_id)s, %(cron)s, %(timezone)s, %(next_slot_at)s)
on conflict (environment, schedule_id) do update
set cron = excluded.cron,
    timezone = excluded.timezone,
    next_slot_at = excluded.next_slot_at,
    updated_at = now()
where s.cron is distinct from excluded.cron or s.timezone is distinct from excluded.timezone;

-- name: schedule_fire
-- Records one slot and creates its run in one statement. The slot's primary key makes a
-- second replica firing the same slot create nothing.
with slot as (
    insert into {schema}.schedule_slots (environment, schedule_id, slot_at, run_id)
    values (%(environment)s, %(schedule_id)s, %(slot_at)s, %(run_id)s)
    on conflict do nothing
    returning run_id
), inserted as (
    insert into {schema}.runs (
        id, environment, task_id, queue, status, priority, payload, max_attempts, due_at)
    select slot.run_id, %(environment)s, %(task_id)s, %(queue)s, 'queued', %(priority)s,
           %(payload)s::jsonb, %(max_attempts)s, now()
    from slot
    returning id
)
select id from inserted;

-- name: schedule_advance
update {schema}.schedules
set next_slot_at = %(next_slot_at)s, updated_at = now()
where environment = %(environment)s
  and schedule_id = %(schedule_id)s
  and next_slot_at = %(expected_slot_at)s;
