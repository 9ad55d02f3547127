-- digest_spans (digest/spans.sql) from stored digests rows (see combine_collectives.sql).
select
    rank,
    step,
    sum(compute_ns) as compute_ns,
    sum(data_ns) as data_ns,
    max(step_span_ns) as step_span_ns,
    max(step_runq_ns) as step_runq_ns,
    min(first_ns) as first_ns,
    max(last_ns) as last_ns,
    max(last_ts_ns) as last_ts_ns,
    cast(sum(n_rows) as bigint) as n_rows,
    cast(sum(n_rows) - sum(n_done) as bigint) as n_open
from digest_source
where kind = 'spans'
group by rank, step
