-- rank_compute: each rank's median compute per step over [$lo, $hi], in seconds.
-- columns: rank, s
with

final as (
    select rank, median(compute_ns) / 1e9 as s
    from steps
    where step between $lo and $hi
    group by rank
)

select * from final
