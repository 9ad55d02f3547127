-- the dashboard's per-(rank, step) cache, materialized once per data version so that every
-- view aggregates a rank x step table instead of the raw spans.
-- columns: rank, step, t0_ns, t1_ns, step_ns, compute_ns, comm_ns, exposed_comm_ns,
--          bus_bytes, bus_ns
with
windows as (
    select rank, step, min(start_ns) as t0_ns, max(end_ns) as t1_ns
    from spans
    where step >= 0
    group by rank, step
),
bus as (
    -- nccl-tests bus bandwidth factors, with n the group's size
    select
        rank,
        step,
        sum(
            nbytes * case
                when op = 'all_reduce' then 2.0 * (group_size - 1) / group_size
                when op in ('all_gather', 'reduce_scatter', 'all_to_all')
                    then (group_size - 1) * 1.0 / group_size
                else 1.0
            end
        ) as bus_bytes,
        sum(end_ns - start_ns) as bus_ns
    from collectives
    where step >= 0 and end_ns is not null and end_ns > start_ns and nbytes > 0
    group by rank, step
),
final as (
    select
        s.rank,
        s.step,
        w.t0_ns,
        w.t1_ns,
        s.step_ns,
        s.compute_ns,
        s.comm_ns,
        s.exposed_comm_ns,
        coalesce(b.bus_bytes, 0) as bus_bytes,
        coalesce(b.bus_ns, 0) as bus_ns
    from steps as s
    left join windows as w using (rank, step)
    left join bus as b using (rank, step)
)
select * from final
