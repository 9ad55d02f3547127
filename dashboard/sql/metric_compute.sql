-- per rank: mean compute time per step (ms) over steps $first..$last
-- columns: rank, value
with
picked as (
    select rank, compute_ns
    from dash_rank_step
    where step between $first and $last
),
final as (
    select rank, avg(compute_ns) / 1e6 as value
    from picked
    group by rank
)
select * from final
