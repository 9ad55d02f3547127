-- rank_compute_digest: per rank, its median compute time (seconds) over steps [$lo, $hi],
-- from the digests (views/rank_step_sums.sql: sums of compute spans, no interval union):
-- findings/rank_compute.sql for runs past Context.exact_max_ranks, whose exact `steps` view
-- would read every raw row.
with

final as (
    select rank, median(compute_ns) / 1e9 as s
    from rank_step_sums
    where step between $lo and $hi
    group by rank
)

select * from final
