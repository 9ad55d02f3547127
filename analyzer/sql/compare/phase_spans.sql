-- compare/phase_spans: one row per (rank, step) in [$lo, $hi]: the step and the summed length
-- of the spans of each phase, before the time blocked in collectives inside them is taken out
-- (compare/blocked.sql; analyzer/compare.py does it).
-- columns: rank, step, step_ns, data_ns, forward_ns, backward_ns, optimizer_ns
--   step_ns  the `step` span when there is one, else the first start to the last end
--            (views/rank_step_sums.sql, from the digests, as analyze's median step)
--   data_ns  the `data` spans; forward_ns, backward_ns, optimizer_ns: the spans of those names
--            (a `recompute` lies inside the backward that holds its time)
with

steps as (
    select rank, step, step_ns
    from rank_step_sums
    where step between $lo and $hi and has_spans
),

phases as (
    select
        rank,
        step,
        sum(end_ns - start_ns) filter (where kind = 'data') as data_ns,
        sum(end_ns - start_ns) filter (where name = 'forward') as forward_ns,
        sum(end_ns - start_ns) filter (where name = 'backward') as backward_ns,
        sum(end_ns - start_ns) filter (where name = 'optimizer') as optimizer_ns
    from spans
    where step between $lo and $hi and end_ns is not null and kind <> 'background'
    group by rank, step
),

final as (
    select
        s.rank,
        s.step,
        s.step_ns::bigint as step_ns,
        coalesce(p.data_ns, 0)::bigint as data_ns,
        coalesce(p.forward_ns, 0)::bigint as forward_ns,
        coalesce(p.backward_ns, 0)::bigint as backward_ns,
        coalesce(p.optimizer_ns, 0)::bigint as optimizer_ns
    from steps as s
    left join phases as p on p.rank = s.rank and p.step = s.step
)

select * from final
