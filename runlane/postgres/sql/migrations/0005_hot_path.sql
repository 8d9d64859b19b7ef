-- runlane schema version 5: less work for the database on every run's hot path.
--
-- A run changes status on its trigger, its claim and its end, and each of those writes is a
-- new row version with an entry in every index of "runs" (status is indexed, so no update
-- is HOT). Measured on the statements runlane sends (benchmarks/README.md), two of those
-- costs bought little:
--
-- * runs_listing (environment, created_at desc, id desc) served only the unfiltered
--   listing; that listing now walks runs_listing_by_status once per status and merges the
--   walks (run_list in sql/inspect.sql), so every status change writes one index entry
--   fewer.
-- * The foreign key from attempts to runs checked, row by row, that the run of every
--   finished attempt exists. Every statement that writes an attempt row updates that run,
--   fenced, in the same statement, so the run exists by construction; cleanup (run_prune)
--   now deletes a run's attempts in the statement that deletes the run, which the key's
--   "on delete cascade" did before.

drop index {schema}.runs_listing;

alter table {schema}.attempts drop constraint attempts_run_id_fkey;
