-- the dashboard's per-(rank, step) cache for large runs (dash_rank_step_sums), from the digests alone (no interval
-- union over ~70M rows): sums instead of unions, so nested compute spans count twice, and
-- exposed communication is estimated as the step time outside compute and data loading, at
-- most the time in collectives.
-- columns: rank, step, t0_ns, t1_ns, step_ns, compute_ns, comm_ns, exposed_comm_ns,
--          bus_bytes, bus_ns
with
span_sums as (
    select rank, step, first_ns, last_ns, step_span_ns, compute_ns, data_ns
    from digest_spans
    where step >= 0
),
comm as (
    select
        rank,
        step,
        sum(busy_ns) filter (where not is_send) as comm_ns,
        min(first_arrival_ns) filter (where not is_send) as c0_ns,
        max(last_end_ns) filter (where not is_send) as c1_ns,
        sum(bus_bytes) as bus_bytes,
        sum(busy_ns) filter (where bus_bytes > 0) as bus_ns
    from digest_collectives
    where step >= 0 and n_done > 0
    group by rank, step
),
joined as (
    select
        coalesce(s.rank, c.rank) as rank,
        coalesce(s.step, c.step) as step,
        least(s.first_ns, c.c0_ns) as t0_ns,
        greatest(s.last_ns, c.c1_ns) as t1_ns,
        coalesce(s.step_span_ns, greatest(s.last_ns, c.c1_ns) - least(s.first_ns, c.c0_ns))
            as step_ns,
        coalesce(s.compute_ns, 0) as compute_ns,
        coalesce(s.data_ns, 0) as data_ns,
        coalesce(c.comm_ns, 0) as comm_ns,
        coalesce(c.bus_bytes, 0) as bus_bytes,
        coalesce(c.bus_ns, 0) as bus_ns
    from span_sums as s
    full outer join comm as c on c.rank = s.rank and c.step = s.step
),
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
    from joined
)
select * from final
