-- the rank x step heatmap on a bounded grid: ranks grouped by hardware class where the run
-- names classes (topology's hw_class, in the order of their first rank), then by host (hosts
-- in the order of their first rank), ordered by rank within a host, and cut into
-- $rank_bins bins, steps $first..$last cut into $step_bins bins; a cell holds the worst
-- (highest) rank of its bin, each rank's value being its mean over the bin's steps.
--   own_ms      the rank's own time in the step: step time minus time in collectives (its
--               waiting for others and the transfers), i.e. its compute wherever the spans are
--               drawn (a forward span that encloses tensor-parallel collectives also encloses
--               the waits in them, so compute spans alone make a culprit's peers look as slow)
--   peer_ratio  the rank's own time relative to its peers' in the same step (1.0 is typical):
--               the ranks of the same pipeline stage and context shard (the straggler
--               detector's peers, analyzer/findings/straggler.py; the shard is -1 where no
--               other rank of the stage holds it) and hardware class, so all ranks of a
--               data-parallel-only job on one class.
--               Where dash_rank_peer has the rank-step (rank_step_peer.sql: runs of a few
--               hundred ranks, with compute spans), the median over its compute spans of each
--               span's own time over its peers'; else own_ms over its peers' median own_ms
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
classes as (
    select
        rank,
        pp,
        case when count(*) over (partition by pp, cp) >= 2 then cp else -1 end as shard,
        hw_class
    from dash_topology
),
owned as (
    select
        s.*,
        greatest(s.step_ns - s.comm_ns, 0) as own_ns,
        c.pp,
        c.shard,
        c.hw_class
    from dash_rank_step as s
    inner join classes as c using (rank)
    where s.step between $first and $last
),
relative as (
    select
        o.*,
        coalesce(
            p.span_ratio,
            o.own_ns / nullif(
                median(o.own_ns) over (partition by o.step, o.pp, o.shard, o.hw_class), 0
            )
        ) as peer_ratio
    from owned as o
    left join dash_rank_peer as p using (rank, step)
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
