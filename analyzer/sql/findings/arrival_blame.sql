-- arrival_blame: per (rank, step) in [$lo, $hi], how long the other members of its complete
-- collectives waited for it alone (it arrived last; the gap to the second-to-last arrival).
-- columns: rank, step, blame_ns, last_count
with

complete as (
    select last_rank, step, blame_ns
    from collective_instances
    where step between $lo and $hi and unfinished = 0 and entered >= 2
),

final as (
    select last_rank as rank, step, sum(blame_ns) as blame_ns, count(*) as last_count
    from complete
    group by last_rank, step
)

select * from final
