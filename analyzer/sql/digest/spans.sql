-- digest_spans (table, made once per run): the spans summed per (rank, step).
-- columns: rank, step, compute_ns, data_ns, step_span_ns, step_runq_ns, first_ns, last_ns,
--          last_ts_ns, n_rows, n_open
--   compute_ns, data_ns  sums of the finished spans of that kind (no interval union: nested
--                        spans count twice; views/steps.sql takes the union; `recompute`
--                        spans are left out: the backward that holds them counts them)
--   step_span_ns         the `step` span's length, when there is one
--   step_runq_ns         its wait for a core (spans.runq_ns), where recorded
--   first_ns, last_ns    first start and last end of the finished spans
--   last_ts_ns           the latest time the rank was seen (an end, else a start)
with

final as (
    select
        rank,
        step,
        sum(end_ns - start_ns) filter (where kind = 'compute' and name <> 'recompute') as compute_ns,
        sum(end_ns - start_ns) filter (where kind = 'data') as data_ns,
        max(end_ns - start_ns) filter (where name = 'step') as step_span_ns,
        max(runq_ns) filter (where name = 'step' and kind = 'host') as step_runq_ns,
        min(start_ns) filter (where end_ns is not null) as first_ns,
        max(end_ns) as last_ns,
        max(coalesce(end_ns, start_ns)) as last_ts_ns,
        count(*) as n_rows,
        count(*) - count(end_ns) as n_open
    from spans
    group by rank, step
)

select * from final
