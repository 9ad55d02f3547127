-- digests rows (docs/spec.md §2, the `digests` table): digest_collectives and digest_spans as
-- one table, as writers store it. Sums are bigint (a rank's step fits), is_send an integer.
-- kind 'collectives': first_ns, last_ns are first_arrival_ns, last_end_ns; kind 'spans':
-- n_done is n_rows - n_open, group, peer and is_send are null.
select
    rank,
    step,
    'collectives' as kind,
    "group",
    peer,
    cast(is_send as integer) as is_send,
    n_rows,
    n_done,
    cast(busy_ns as bigint) as busy_ns,
    first_arrival_ns as first_ns,
    last_end_ns as last_ns,
    cast(null as bigint) as last_ts_ns,
    cast(nbytes as bigint) as nbytes,
    bus_bytes,
    cast(null as bigint) as compute_ns,
    cast(null as bigint) as data_ns,
    cast(null as bigint) as step_span_ns,
    cast(null as bigint) as step_runq_ns
from digest_collectives
union all
select
    rank,
    step,
    'spans' as kind,
    cast(null as varchar) as "group",
    cast(null as integer) as peer,
    cast(null as integer) as is_send,
    n_rows,
    n_rows - n_open as n_done,
    cast(null as bigint) as busy_ns,
    first_ns,
    last_ns,
    last_ts_ns,
    cast(null as bigint) as nbytes,
    cast(null as double) as bus_bytes,
    cast(compute_ns as bigint) as compute_ns,
    cast(data_ns as bigint) as data_ns,
    step_span_ns,
    step_runq_ns
from digest_spans
