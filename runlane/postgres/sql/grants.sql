-- Least-privilege grants: what each job of an application role needs in one runlane schema.
--
-- Rendered by runlane.postgres.postgres_grant_sql and applied by grant_postgres_role (and
-- `runlane grant JOB ROLE`): {schema} and {role} are replaced by quoted identifiers. A role
-- gets grant_common, its job's block, and grant_publisher on the RabbitMQ lane. Nothing
-- here lets a role create, alter, drop or truncate anything, nor migrate: that stays with
-- the schema's owner. Re-run the grant after a migration that adds tables or columns.
--
-- Column lists matter: the statement-level triggers of migrations 2 and 3 run with the
-- privileges of whoever ran the statement that fired them. An UPDATE that ends a run makes
-- the trigger resume the runs waiting on it (it updates their status, due_at, wait_kind,
-- wait_run_id, updated_at); any statement that makes runs queued, in a schema where some
-- environment delivers through the outbox, makes it insert outbox items (and read their
-- environment, queue, claim_token and available_at back). runlane's tables use client-made
-- uuids and no sequences, so no sequence grants are needed. The functions the triggers call
-- are granted EXECUTE explicitly, in case EXECUTE was revoked from PUBLIC.

-- name: grant_common
-- Every job: find the schema, pass the runtime's start-up check of the migration ledger,
-- and let the triggers write outbox items of runs becoming queued (and announce them).
grant usage on schema {schema} to {role};
grant select on {schema}.runlane_migrations to {role};
grant select on {schema}.outbox_environments to {role};
grant select on {schema}.outbox to {role};
grant insert (id, environment, run_id, queue, available_at, claim_token, claim_expires_at)
    on {schema}.outbox to {role};
grant execute on function {schema}.runlane_announce(text, text, text) to {role};
grant execute on function {schema}.runlane_outbox_write(jsonb) to {role};
grant execute on function {schema}.runlane_now() to {role};
-- whether a queue is paused: every claim statement (delivery workers, drain, the RabbitMQ
-- lane's claim by id), maintenance's recovery, the publisher's outbox reads and status()
-- leave paused queues out or show them
grant select on {schema}.queue_states to {role};

-- name: grant_producer
-- trigger, trigger_many, trigger(connection=...), idempotency keys; get_run, wait_for_run;
-- create_wait_token, get_wait_token, complete_wait_token and the resume pass that follows a
-- completion (waiting runs become queued: status, due_at, wait_* and updated_at only; a
-- producer cannot claim, complete, fail, lease, prune or delete a run).
grant select on {schema}.runs to {role};
grant insert (id, environment, task_id, queue, status, priority, payload, max_attempts,
              idempotency_key, parent_run_id, due_at, trace_context, concurrency_key)
    on {schema}.runs to {role};
grant update (status, due_at, wait_kind, wait_token_id, wait_run_id, updated_at)
    on {schema}.runs to {role};
grant select on {schema}.wait_tokens to {role};
grant insert (id, environment, status, idempotency_key, timeout_at)
    on {schema}.wait_tokens to {role};
grant update (status, output, resolved_at) on {schema}.wait_tokens to {role};

-- name: grant_worker
-- Claim (polling, and by id on the RabbitMQ lane), complete, fail, extend leases, hand back,
-- release, steps, waits (tokens, sleeps, child runs: context.trigger_child inserts runs),
-- cancellation observed through lease extensions, the consumer's outbox defer, and the
-- worker's watch for missing maintenance. Not: payloads, priorities, queues, pruning,
-- deleting runs, schedules, maintenance leases.
grant select on {schema}.runs to {role};
grant insert (id, environment, task_id, queue, status, priority, payload, max_attempts,
              idempotency_key, parent_run_id, due_at, trace_context, concurrency_key)
    on {schema}.runs to {role};
grant update (status, attempt, releases, output, error, due_at, lease_token,
              lease_expires_at, attempt_started_at, started_at, finished_at, updated_at,
              wait_kind, wait_token_id, wait_run_id)
    on {schema}.runs to {role};
-- context.report_progress (fenced like the other attempt writes)
grant update (progress) on {schema}.runs to {role};
-- a handler started (run_mark_started, fenced like the other attempt writes)
grant update (started_attempt) on {schema}.runs to {role};
grant insert (run_id, attempt, lease_token, outcome, error, started_at)
    on {schema}.attempts to {role};
grant select on {schema}.steps to {role};
grant insert (run_id, name, output, attempt) on {schema}.steps to {role};
grant select on {schema}.wait_tokens to {role};
grant insert (id, environment, status, idempotency_key, timeout_at)
    on {schema}.wait_tokens to {role};
-- completing tokens, and the row lock a suspension takes on the awaited token
grant update (status, output, resolved_at) on {schema}.wait_tokens to {role};
grant select on {schema}.maintenance_leases to {role};
-- status(), which `runlane worker` reads before starting, lists the late schedules
grant select on {schema}.schedules to {role};
-- a delivery worker's row: registered and kept fresh by its heartbeat (an upsert that reads
-- the row's state), the worker_id its claims set and its attempts record
grant select on {schema}.workers to {role};
grant insert (id, environment, host, pid, runlane_version, queues, concurrency,
              heartbeat_seconds, state, stopped_at)
    on {schema}.workers to {role};
grant update (last_seen_at, state, stopped_at) on {schema}.workers to {role};
grant update (worker_id) on {schema}.runs to {role};
-- flow control (rate limits, per-key limits): the claim's stamps, rate state, key cursor
-- and the starts of a sliding rate window
grant select, insert, update on {schema}.queue_flow to {role};
grant select, insert, delete on {schema}.queue_starts to {role};
grant insert (worker_id) on {schema}.attempts to {role};

-- name: grant_maintenance
-- run_maintenance_once and start_services: maintenance leases (bands and fences),
-- schedules and their runs, due delivery, wait token timeouts and resumes, attempt expiry,
-- delivery recovery, cleanup (runlane_delete_runs deletes runs past retention with their
-- attempts, and their steps through the foreign key, and tombstones parents). Attempts
-- end here only when their lease lapsed, and never completed (the update trigger).
grant select on {schema}.runs to {role};
grant insert (id, environment, task_id, queue, status, priority, payload, max_attempts,
              idempotency_key, parent_run_id, due_at, trace_context, concurrency_key)
    on {schema}.runs to {role};
grant update (status, due_at, error, lease_token, lease_expires_at, finished_at, updated_at,
              wait_kind, wait_token_id, wait_run_id)
    on {schema}.runs to {role};
grant execute on function {schema}.runlane_delete_runs(text, uuid[], boolean) to {role};
grant select on {schema}.attempts to {role};
grant insert (run_id, attempt, lease_token, outcome, error, started_at)
    on {schema}.attempts to {role};
grant select on {schema}.wait_tokens to {role};
grant update (status, resolved_at) on {schema}.wait_tokens to {role};
grant select on {schema}.schedules to {role};
grant insert (environment, schedule_id, cron, timezone, next_slot_at, task_id, queue, payload,
              priority, max_attempts)
    on {schema}.schedules to {role};
grant update (cron, timezone, next_slot_at, updated_at, task_id, queue, payload, priority,
              max_attempts, last_fired_at, last_run_id)
    on {schema}.schedules to {role};
grant select on {schema}.schedule_slots to {role};
grant insert (environment, schedule_id, slot_at, run_id) on {schema}.schedule_slots to {role};
grant select on {schema}.maintenance_leases to {role};
grant insert (environment, band, owner, fencing, expires_at, acquired_at)
    on {schema}.maintenance_leases to {role};
grant update (owner, fencing, expires_at, acquired_at)
    on {schema}.maintenance_leases to {role};
-- expired attempts record their worker; cleanup deletes stopped and lost workers' rows
grant insert (worker_id) on {schema}.attempts to {role};
grant select, delete on {schema}.workers to {role};
-- retention of the audit trail: old rows only, through runlane_prune_audit
grant execute on function {schema}.runlane_prune_audit(text, interval, integer) to {role};
-- the stats band folds recent minutes into the rollup (an upsert of whole minutes, and a
-- delete of those nothing happened in), records how far it got, and prunes past retention
grant select, insert, update, delete on {schema}.stats_rollup to {role};
grant select, insert, update on {schema}.stats_folds to {role};
-- and counts what retry, cancel and delete recorded of runs its minutes had (migration 25:
-- only those functions write it), deleting the records of minutes it has made final
grant select, delete on {schema}.stats_departed to {role};

-- name: grant_operator
-- list_runs, get_run, get_run_history, status (and `runlane status`, `runlane runs ...`),
-- retry_run, cancel, and the bulk retry_runs, cancel_runs and delete_runs (deleting
-- terminal runs with their attempts, and their steps through the foreign key, and
-- tombstoning parents, as cleanup does): no UPDATE or DELETE on runs or attempts, only the
-- SECURITY DEFINER functions that apply the API's rules: their overloads of schema
-- version 24 that name the audit action, and commit only with its record (the 3-argument
-- ones are revoke_stale's). Not: triggering, claiming, completing, deleting live runs.
grant select on {schema}.runs to {role};
grant execute on function {schema}.runlane_retry_runs(text, uuid[], boolean, text) to {role};
grant execute on function {schema}.runlane_cancel_runs(text, uuid[], boolean, text) to {role};
grant execute on function {schema}.runlane_delete_runs(text, uuid[], boolean, text) to {role};
grant select on {schema}.attempts to {role};
grant select on {schema}.steps to {role};
grant select on {schema}.wait_tokens to {role};
grant select on {schema}.maintenance_leases to {role};
-- list_workers, and the host of each attempt in get_run_history
grant select on {schema}.workers to {role};
-- stats (and `runlane stats`, the console's charts, /metrics): reads of the rollup only
grant select on {schema}.stats_rollup to {role};
-- pause_queue (an upsert of the queue's row) and resume_queue; resuming a queue of a
-- transport lane writes outbox items of its queued runs (grant_common's outbox insert)
grant insert (environment, queue, paused, paused_reason, paused_at, updated_at)
    on {schema}.queue_states to {role};
grant update (paused, paused_reason, paused_at, updated_at) on {schema}.queue_states to {role};
-- list_schedules, pause_schedule, resume_schedule, the late schedules of status, and
-- trigger_schedule_now: a run made from the stored definition by a SECURITY DEFINER
-- function, so the role runs schedules as defined without inserting runs of its own (since
-- version 26 its overload naming the action, which commits only with the record)
grant select on {schema}.schedules to {role};
grant update (paused, next_slot_at, updated_at) on {schema}.schedules to {role};
grant execute on function {schema}.runlane_run_schedule(text, text, uuid, text, jsonb, text)
    to {role};
-- reschedule_run (runlane_reschedule_runs moves a queued or retrying run's due time), and
-- the audit trail: every action above taken through runlane writes its record in its own
-- transaction, and none commits without it (migration 23: a pause or resume; migration
-- 24: a retry, cancel, delete or reschedule through the functions; migration 26: a run of
-- a schedule); the record's time and
-- database role are defaults the role cannot write, a later part follows its action's part
-- before it by the same role (migration 23); rows are never updated or deleted but by the
-- owner (and retention's runlane_prune_audit)
grant execute on function {schema}.runlane_reschedule_runs(
    text, uuid[], timestamptz, timestamptz, boolean, text) to {role};
grant select on {schema}.audit_log to {role};
grant insert (id, action_id, part, environment, via, actor, os_user, action, target, runs,
              changed, reason, details)
    on {schema}.audit_log to {role};

-- name: grant_publisher
-- The RabbitMQ lane, whatever the job: every runtime enables the outbox of its environment
-- when it starts and runs a publisher, which claims pending items, deletes those the broker
-- confirmed and releases the others with a back-off.
grant insert (environment, claim_seconds) on {schema}.outbox_environments to {role};
grant update (claim_seconds) on {schema}.outbox_environments to {role};
grant update (claim_token, claim_expires_at, failures, last_error, available_at)
    on {schema}.outbox to {role};
grant delete on {schema}.outbox to {role};

-- name: revoke_stale
-- Last, for every job: what no job holds since version 14, taken back from a role granted
-- by an earlier release. Runs and attempts are deleted, and payloads and tombstones
-- written, only by runlane_delete_runs (the triggers of migration 14 refuse them to every
-- other role anyway).
revoke delete on {schema}.runs from {role};
revoke delete on {schema}.attempts from {role};
revoke update (payload, pruned_at, remaining_children) on {schema}.runs from {role};
-- The operator's functions of versions 6, 14 and 21 commit without an audit record: since
-- versions 24 and 26 the operator job holds their overloads that name the action instead.
-- No job holds the old retry, cancel, reschedule and run of a schedule; the old delete
-- stays with a role holding the maintenance job (cleanup), whichever of its jobs is granted
-- last.
revoke execute on function {schema}.runlane_run_schedule(text, text, uuid, text, jsonb)
    from {role};
revoke execute on function {schema}.runlane_retry_runs(text, uuid[], boolean) from {role};
revoke execute on function {schema}.runlane_cancel_runs(text, uuid[], boolean) from {role};
revoke execute on function {schema}.runlane_reschedule_runs(
    text, uuid[], timestamptz, timestamptz, boolean) from {role};
select {schema}.runlane_revoke_unaudited_delete('{role}'::regrole);
-- audit_owed (migration 24: the obligations its functions add, checked at commit) is the
-- owner's alone: no job holds anything on it.
revoke all on {schema}.audit_owed from {role};
