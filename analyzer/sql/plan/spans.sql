-- plan/spans: each rank's mean time per span name over steps >= $first, net of the
-- collectives that ran inside the span (a forward's tensor-parallel all-reduces, the
-- optimizer's gathers), with the rank's pipeline stage.
-- columns: rank, stage, name, n, net_s, span_s
with

timed as (
    select rank, step, microbatch, name, start_ns, end_ns
    from spans
    where end_ns is not null
      and step >= $first
      and name in ('forward', 'backward', 'recompute', 'optimizer', 'data', 'step')
),

comm as (
    select rank, step, start_ns, end_ns
    from collectives
    where end_ns is not null and step >= $first
),

nested as (
    select
        s.rank,
        s.name,
        any_value(s.end_ns - s.start_ns) as span_ns,
        coalesce(sum(c.end_ns - c.start_ns), 0) as comm_ns
    from timed as s
    left join comm as c
        on c.rank = s.rank
        and c.step = s.step
        and c.start_ns >= s.start_ns
        and c.end_ns <= s.end_ns
        and s.name != 'step'
    group by s.rank, s.step, s.microbatch, s.name, s.start_ns
),

final as (
    select
        n.rank,
        r.pp as stage,
        n.name,
        count(*) as n,
        avg(greatest(n.span_ns - n.comm_ns, 0)) / 1e9 as net_s,
        median(n.span_ns) / 1e9 as span_s
    from nested as n
    join rank_coords as r on r.rank = n.rank
    group by n.rank, r.pp, n.name
)

select * from final order by rank, name
