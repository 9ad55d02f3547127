-- the dashboard's per-(rank, step) comparison with its peers, for runs of a few hundred ranks
-- (made once per data version, beside dash_rank_step): each compute span's own time (its
-- length minus the time the rank was blocked in collectives inside it: a forward span that
-- encloses tensor-parallel collectives also encloses the waits for a slow peer) over the
-- median own time of the same span (name, microbatch and occurrence in the step) on the
-- rank's peers in that step: the ranks of the same pipeline stage and context shard, as the
-- straggler detector compares them (analyzer/findings/straggler.py; the shard is -1 where no
-- other rank of the stage holds it, so all ranks of a data-parallel-only job) and hardware
-- class (topology's hw_class, '' where none: a slower class is no row of slow ranks). A rank-step's
-- span_ratio is the median over its compute spans: a slow rank is slow in every span, while
-- a rank descheduled on a shared host loses a few spans only (on the demo's 8 ranks on 2
-- cores the sum of own time put the slow rank highest in 47% of the steps, this median in 93%).
-- columns: rank, step, span_ratio, spans
with
compute as (
    select
        s.rank,
        s.step,
        s.name,
        coalesce(s.microbatch, -1) as mb,
        row_number() over (
            partition by s.rank, s.step, s.name, s.microbatch order by s.start_ns
        ) as k,
        s.start_ns,
        s.end_ns
    from spans as s
    where s.kind = 'compute' and s.end_ns is not null and s.step is not null
),
blocked as (
    select
        c.rank,
        c.step,
        c.name,
        c.mb,
        c.k,
        any_value(c.end_ns - c.start_ns) as span_ns,
        -- (least and greatest skip nulls: a span without collectives would count whole)
        coalesce(
            sum(least(r.end_ns, c.end_ns) - greatest(r.arrival_ns, c.start_ns))
                filter (where r.arrival_ns is not null),
            0
        ) as blocked_ns
    from compute as c
    left join collective_rows as r
        on r.rank = c.rank and r.step = c.step and r.end_ns is not null
        and r.arrival_ns < c.end_ns and r.end_ns > c.start_ns
    group by c.rank, c.step, c.name, c.mb, c.k
),
owned as (
    select b.*, greatest(b.span_ns - b.blocked_ns, 0) as own_ns, k.pp, k.shard, k.hw_class
    from blocked as b
    inner join dash_rank_class as k using (rank)
),
relative as (
    select
        rank,
        step,
        own_ns / nullif(
            median(own_ns) over (partition by step, pp, shard, hw_class, name, mb, k), 0
        ) as ratio
    from owned
),
final as (
    select rank, step, median(ratio) as span_ratio, count(ratio) as spans
    from relative
    where ratio is not null
    group by rank, step
)
select * from final
