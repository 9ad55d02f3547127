-- per rank: mean step wall time (ms) over steps $first..$last
-- columns: rank, value
with
picked as (
    select rank, step_ns
    from dash_rank_step
    where step between $first and $last
),
final as (
    select rank, avg(step_ns) / 1e6 as value
    from picked
    group by rank
)
select * from final
