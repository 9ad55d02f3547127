-- digest_spans (digest/spans.sql) from stored digests rows already one per rank and step
-- (see unique_collectives.sql). Same columns and types.
select
    rank,
    step,
    cast(compute_ns as hugeint) as compute_ns,
    cast(data_ns as hugeint) as data_ns,
    step_span_ns,
    step_runq_ns,
    first_ns,
    last_ns,
    last_ts_ns,
    n_rows,
    n_rows - n_done as n_open
from digest_source
where kind = 'spans'
