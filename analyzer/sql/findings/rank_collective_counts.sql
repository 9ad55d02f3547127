-- rank_collective_counts: per rank, the finished collectives it took part in, steps [$lo, $hi].
-- columns: rank, instances
with

final as (
    select rank, count(*) as instances
    from collective_rows
    where step between $lo and $hi and end_ns is not null
    group by rank
)

select * from final
