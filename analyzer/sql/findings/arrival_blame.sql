-- arrival_blame: per (rank, step) in [$lo, $hi], how long the other members of its complete
-- collectives waited for it alone (it arrived last; the gap from the second-to-last arrival to
-- its own). Where such gaps overlap in time (a tensor-parallel collective and a prefetched
-- all-gather of another group, both waiting for the same late rank) the time counts once: the
-- blame is the length of the union of the gaps, never more than the time they span.
-- columns: rank, step, blame_ns, last_count
with

complete as (
    select
        last_rank as rank,
        step,
        second_ns as lo_ns,
        last_ns as hi_ns
    from collective_instances
    where step between $lo and $hi and unfinished = 0 and entered >= 2
),

ordered as (
    select
        *,
        max(hi_ns) over (
            partition by rank, step order by lo_ns, hi_ns
            rows between unbounded preceding and 1 preceding
        ) as reach_ns
    from complete
),

-- each gap counts from where the gaps before it reached (the part before that is counted)
clipped as (
    select
        rank,
        step,
        greatest(0, hi_ns - greatest(lo_ns, coalesce(reach_ns, lo_ns))) as part_ns
    from ordered
),

final as (
    select rank, step, sum(part_ns)::bigint as blame_ns, count(*) as last_count
    from clipped
    group by rank, step
)

select * from final
