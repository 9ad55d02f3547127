-- the dashboard's per-(rank, step) cache for large runs (dash_rank_step_sums): the analyzer's
-- rank_step_sums view, made from the digests alone (no interval union over ~70M rows): sums
-- instead of unions, so nested compute spans count twice, and exposed communication is
-- estimated as the step time outside compute and data loading, at most the time in
-- collectives.
-- columns: rank, step, t0_ns, t1_ns, step_ns, compute_ns, comm_ns, exposed_comm_ns,
--          bus_bytes, bus_ns
with
final as (
    select
        rank,
        step,
        t0_ns,
        t1_ns,
        step_ns::bigint as step_ns,
        compute_ns::bigint as compute_ns,
        comm_ns::bigint as comm_ns,
        least(comm_ns, greatest(step_ns - compute_ns - data_ns, 0))::bigint as exposed_comm_ns,
        bus_bytes,
        bus_ns
    from rank_step_sums
    where step >= 0
)
select * from final
