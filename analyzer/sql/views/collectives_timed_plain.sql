-- collectives_timed (view) for a run with no `untimed` rows (or too large to estimate them):
-- the collectives as they are, with a null wait_from_ns (see collectives_timed.sql).
select
    *,
    cast(null as bigint) as wait_from_ns
from collectives
