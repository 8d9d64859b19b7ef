-- runlane schema version 24: the operator's retry, cancel, delete and reschedule commit only
-- with their audit record.
-- compatibility: additive
--
-- (first version: filled in below)

select 1;
