-- each rank's straggler score in each step (the view dash_rank_score, over dash_rank_step,
-- dash_topology and dash_rank_peer: analyzer/rank_steps.py): the rank x step heatmap's
-- default measure (rank_step_grid.sql) and the score a tracker logs per step
-- (analyzer/trackers/).
--   own_ns      the rank's own time in the step: step time minus time in collectives (its
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
--               span's own time over its peers'; else own_ns over its peers' median own_ns
-- columns: rank, step, t0_ns, t1_ns, step_ns, compute_ns, comm_ns, exposed_comm_ns,
--          bus_bytes, bus_ns, own_ns, pp, shard, hw_class, peer_ratio
with
owned as (
    select
        s.*,
        greatest(s.step_ns - s.comm_ns, 0) as own_ns,
        c.pp,
        c.shard,
        c.hw_class
    from dash_rank_step as s
    inner join dash_rank_class as c using (rank)
),
final as (
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
)
select * from final
