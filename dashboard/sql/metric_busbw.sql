-- per rank: bus bandwidth (GB/s) of all its collectives over steps $first..$last
-- (bus bytes over time in collectives, nccl-tests factors applied in rank_step.sql)
-- columns: rank, value
with
picked as (
    select rank, bus_bytes, bus_ns
    from dash_rank_step
    where step between $first and $last
),
final as (
    select rank, sum(bus_bytes) / nullif(sum(bus_ns), 0) as value
    from picked
    group by rank
)
select * from final
