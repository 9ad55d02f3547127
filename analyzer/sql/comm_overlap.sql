-- comm_overlap: Holistic Trace Analysis's communication/computation overlap of each rank
-- (its get_comm_comp_overlap): the share of the time a rank's device communicates during
-- which it also computes.
-- output columns: rank, comm_ns, overlap_ns, overlap_pct
--   comm_ns      the union of the communication spans (NCCL kernels) in HTA's window
--   overlap_ns   the part of comm_ns covered by computation spans too
--   overlap_pct  100 * overlap_ns / comm_ns, rounded to 0.01 as HTA prints it; null for a
--                rank that does not communicate on its device
-- The window, the merging and the kernel types are gpu_window's (as for gpu_breakdown).
with ranks as (
    select distinct rank from gpu_window
),

comm as (
    select rank, start_ns, end_ns from gpu_window where span_set = 'comm'
),

compute as (
    select rank, start_ns, end_ns from gpu_window where span_set = 'compute'
),

overlap as (
    select c.rank, sum(least(c.end_ns, k.end_ns) - greatest(c.start_ns, k.start_ns)) as ns
    from comm as c
    inner join compute as k
        on c.rank = k.rank and k.start_ns < c.end_ns and c.start_ns < k.end_ns
    group by c.rank
),

comm_totals as (
    select rank, sum(end_ns - start_ns) as ns from comm group by rank
),

final as (
    select
        r.rank,
        cast(coalesce(t.ns, 0) as bigint) as comm_ns,
        cast(coalesce(o.ns, 0) as bigint) as overlap_ns,
        case
            when coalesce(t.ns, 0) > 0 then round(100.0 * coalesce(o.ns, 0) / t.ns, 2)
        end as overlap_pct
    from ranks as r
    left join comm_totals as t on r.rank = t.rank
    left join overlap as o on r.rank = o.rank
    order by r.rank
)

select * from final
