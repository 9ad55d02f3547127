-- rank_collective_counts: per rank, the finished collectives it took part in, steps [$lo, $hi].
-- columns: rank, instances
with

final as (
    select rank, sum(n_done) as instances
    from digest_collectives
    where step between $lo and $hi
    group by rank
)

select * from final
