-- the rank x step heatmap on a bounded grid: ranks grouped by host (hosts in the order of
-- their first rank), ordered by rank within a host, and cut into
-- $rank_bins bins, steps $first..$last cut into $step_bins bins; a cell holds the worst
-- (highest) rank of its bin, each rank's value being its mean over the bin's steps.
-- columns: rbin, sbin, rank_lo, rank_hi, host_lo, host_hi, step_lo, step_hi,
--          compute_ms, step_ms, comm_ms, exposed_ms, worst_rank
with
hosts as (
    select rank, host, min(rank) over (partition by host) as host_first
    from dash_topology
),
ordered as (
    select rank, host, row_number() over (order by host_first, rank) - 1 as pos,
        count(*) over () as n
    from hosts
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
        avg(s.exposed_comm_ns) / 1e6 as exposed_ms
    from dash_rank_step as s
    inner join ordered as o using (rank)
    where s.step between $first and $last
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
        arg_max(rank, compute_ms) as worst_rank
    from per_rank
    group by rbin, sbin
    order by rbin, sbin
)
select * from final
