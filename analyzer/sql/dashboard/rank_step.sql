-- the dashboard's per-(rank, step) cache, materialized once per data version so that every
-- view aggregates a rank x step table instead of the raw spans: the exact split of the
-- `steps` view (interval unions over every span and collective; for runs of a few hundred
-- ranks, rank_step_digest.sql past that), windows and bus bytes from the digests.
-- columns: rank, step, t0_ns, t1_ns, step_ns, compute_ns, comm_ns, exposed_comm_ns,
--          bus_bytes, bus_ns
with
windows as (
    select rank, step, first_ns as t0_ns, last_ns as t1_ns
    from digest_spans
    where step >= 0
),
bus as (
    select
        rank,
        step,
        sum(bus_bytes) as bus_bytes,
        sum(busy_ns) filter (where bus_bytes > 0) as bus_ns
    from digest_collectives
    where step >= 0 and n_done > 0
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
