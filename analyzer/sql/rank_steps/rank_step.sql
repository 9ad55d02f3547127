-- the dashboard's per-(rank, step) cache for runs of a few hundred ranks: the exact split of
-- the `steps` view (interval unions over every span and collective), with the windows and bus
-- bytes of dash_rank_step_sums (rank_step_digest.sql, made first from the digests; past a few
-- hundred ranks that table is the cache itself).
-- columns: rank, step, t0_ns, t1_ns, step_ns, compute_ns, comm_ns, exposed_comm_ns,
--          bus_bytes, bus_ns
with
final as (
    select
        s.rank,
        s.step,
        d.t0_ns,
        d.t1_ns,
        s.step_ns,
        s.compute_ns,
        s.comm_ns,
        s.exposed_comm_ns,
        coalesce(d.bus_bytes, 0) as bus_bytes,
        coalesce(d.bus_ns, 0) as bus_ns
    from steps as s
    left join dash_rank_step_sums as d using (rank, step)
)
select * from final
