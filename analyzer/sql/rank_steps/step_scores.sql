-- per step $first..$last and rank: the rank's straggler score (dash_rank_score's
-- peer_ratio: rank_step_score.sql) and the step's exposed communication (the median over its
-- ranks of the time blocked in collectives not hidden behind compute), for the trackers
-- (analyzer/rank_steps.py step_scores)
-- columns: step, rank, peer_ratio, exposed_comm_ms
with
picked as (
    select step, rank, peer_ratio, exposed_comm_ns
    from dash_rank_score
    where step between $first and $last
),
final as (
    select
        step,
        rank,
        peer_ratio,
        median(exposed_comm_ns) over (partition by step) / 1e6 as exposed_comm_ms
    from picked
    order by step, rank
)
select * from final
