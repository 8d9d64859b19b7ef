-- Cancellation.
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Every write an attempt makes is fenced by
-- run id, attempt number and lease token; every maintenance write re-checks its condition
-- in the statement that changes the row. Names are unique across the files of sql/.

-- name: run_cancel
-- Queued, retrying, released and waiting runs are cancelled at once; a running run is asked
-- to stop (its worker hears it announced by the update trigger, or learns it at its next
-- lease extension) and ends cancelled when its handler returns or its lease lapses. Runs
-- waiting on a run cancelled here are resumed by the update trigger.
-- Keyed by ids: cancel passes one, cancel_runs a batch its run_bulk_pick locked (in the
-- same transaction). One row per run found: its status before, and after (null: not
-- cancellable, left alone).
with target as (
    select id, status
    from {schema}.runs
    where id = any(%(ids)s::uuid[]) and environment = %(environment)s
    for update
), changed as (
    update {schema}.runs as r
    set status = case when t.status = 'running' then 'cancellation_requested'
                      else 'cancelled' end,
        finished_at = case when t.status = 'running' then null else now() end,
        wait_kind = null,
        wait_token_id = null,
        wait_run_id = null,
        updated_at = now()
    from target as t
    where r.id = t.id
      and t.status in ('queued', 'retrying', 'released', 'waiting', 'running')
    returning r.id, r.status
)
select t.id, t.status as previous, c.status as current
from target as t
left join changed as c on c.id = t.id;
