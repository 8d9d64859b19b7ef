-- Group commit for triggers (postgres/_group.py): the runs of concurrent trigger() calls.
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Names are unique across the files of sql/.

-- name: run_insert_group
-- The runs of concurrent trigger() calls in one statement and one commit (postgres/_group.py):
-- one JSON object a run (each call has its own task and options), read by json_to_recordset.
-- Locks in the order of run_insert_many, task by task: a key repeated in the group goes to
-- the call with the smaller id, the others resolve to its run (as run_insert_many's callers
-- do); a repeated id (the group retried after its answer was lost) is left alone.
{@group_insert}
order by i.e collate "C", i.t collate "C", i.k collate "C", i.id
on conflict do nothing
returning r.id;

-- name: run_insert_group_fresh
-- run_insert_group for a group without idempotency keys (the usual case): nothing can
-- conflict but a statement repeated after its first answer was lost (its client-made ids
-- are then taken, and the storage reads the runs back), so, as run_insert_many_fresh, no
-- conflict handling (a speculative insertion a row), no lock order and no ids returned.
{@group_insert};

-- name: run_insert_group_claimed
-- run_insert_group for the eager triggers of a transport lane (as run_insert_many_claimed):
-- the items of runs due now are stored claimed by %(claim)s, one claim for the group, and
-- the statement returns whether each inserted run is due now.
with claim as materialized (
    select set_config('runlane.outbox_claim', %(claim)s, true)
)
{@group_insert}
cross join claim
order by i.e collate "C", i.t collate "C", i.k collate "C", i.id
on conflict do nothing
returning r.id, r.due_at <= {@now} as due_now;

-- name: run_insert_group_claimed_fresh
-- run_insert_group_claimed for a group without idempotency keys (the usual case): as
-- run_insert_group_fresh, no conflict handling and no lock order (a repeated statement meets
-- its own ids and fails; its runs and claimed items are there). It still returns each run's
-- id and whether it is due now: the publisher is handed the items of those.
with claim as materialized (
    select set_config('runlane.outbox_claim', %(claim)s, true)
)
{@group_insert}
cross join claim
returning r.id, r.due_at <= {@now} as due_now;
