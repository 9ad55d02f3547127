-- the rank x step heatmap on a bounded grid: ranks grouped by hardware class where the run
-- names classes (topology's hw_class, in the order of their first rank), then by host (hosts
-- in the order of their first rank), ordered by rank within a host, and cut into
-- $rank_bins bins, steps $first..$last cut into $step_bins bins; a cell holds the worst
-- (highest) rank of its bin, each rank's value being its mean over the bin's steps.
--   own_ms      the rank's own time in the step (dash_rank_score: rank_step_score.sql)
--   peer_ratio  the rank's own time relative to its stage peers' in the same step (1.0 is
--               typical; dash_rank_score: rank_step_score.sql, the straggler score)
--   worst_rank  the rank of the bin with the highest peer_ratio
-- columns: rbin, sbin, rank_lo, rank_hi, host_lo, host_hi, step_lo, step_hi,
--          compute_ms, step_ms, comm_ms, exposed_ms, own_ms, peer_ratio, worst_rank
with
hosts as (
    select rank, host, min(rank) over (partition by host) as host_first,
        min(rank) over (partition by hw_class) as class_first
    from dash_topology
),
ordered as (
    select rank, host,
        row_number() over (order by class_first, host_first, rank) - 1 as pos,
        count(*) over () as n
    from hosts
),
relative as (
    select *
    from dash_rank_score
    where step between $first and $last
),
per_rank as (
    select
        o.pos * $rank_bins // o.n as rbin,
        (s.step - $first) * $step_bins // ($last - $first + 1) as sbin,
        s.rank,
        o.host,
        o.pos,
        min(s.step) as step_lo,
        max(s.step) as step_hi,
        avg(s.compute_ns) / 1e6 as compute_ms,
        avg(s.step_ns) / 1e6 as step_ms,
        avg(s.comm_ns) / 1e6 as comm_ms,
        avg(s.exposed_comm_ns) / 1e6 as exposed_ms,
        avg(s.own_ns) / 1e6 as own_ms,
        avg(s.peer_ratio) as peer_ratio
    from relative as s
    inner join ordered as o using (rank)
    group by all
),
final as (
    select
        rbin,
        sbin,
        min(rank) as rank_lo,
        max(rank) as rank_hi,
        arg_min(host, pos) as host_lo,
        arg_max(host, pos) as host_hi,
        min(step_lo) as step_lo,
        max(step_hi) as step_hi,
        max(compute_ms) as compute_ms,
        max(step_ms) as step_ms,
        max(comm_ms) as comm_ms,
        max(exposed_ms) as exposed_ms,
        max(own_ms) as own_ms,
        max(peer_ratio) as peer_ratio,
        arg_max(rank, coalesce(peer_ratio, 0)) as worst_rank
    from per_rank
    group by rbin, sbin
    order by rbin, sbin
)
select * from final
