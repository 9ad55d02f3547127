-- per rank: mean communication not hidden behind compute, per step (ms) over steps $first..$last
-- columns: rank, value
with
picked as (
    select rank, exposed_comm_ns
    from dash_rank_step
    where step between $first and $last
),
final as (
    select rank, avg(exposed_comm_ns) / 1e6 as value
    from picked
    group by rank
)
select * from final
