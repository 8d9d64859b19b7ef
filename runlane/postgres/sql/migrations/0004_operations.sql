-- runlane schema version 4: what operators see and do.
--
-- Listing runs newest first is served by an index in every filter the API offers (the
-- environment alone, or with a status); a task or queue filter walks the same index and
-- filters rows, bounded by the page size it must fill. The trace context of the trigger
-- (W3C traceparent/tracestate, as a JSON object) is stored with the run, so each attempt's
-- span continues the triggering trace in whatever process runs it.

alter table {schema}.runs add column trace_context jsonb;

create index runs_listing on {schema}.runs (environment, created_at desc, id desc);
create index runs_listing_by_status
    on {schema}.runs (environment, status, created_at desc, id desc);
