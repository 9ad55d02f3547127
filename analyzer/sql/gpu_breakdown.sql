-- gpu_breakdown: Holistic Trace Analysis's temporal breakdown of each rank's device time.
-- output columns: rank, kernel_ns, idle_ns, compute_ns, non_compute_ns
--
-- Over the device spans in HTA's window (the view gpu_window: the last profiler step left
-- out when a rank has several; overlapping spans merged):
--   kernel_ns      = end of the last span - start of the first
--   idle_ns        = kernel_ns - the union of all spans (gaps with nothing on any stream)
--   compute_ns     = the union of the computation spans (HTA's kernel types; gpu_window)
--   non_compute_ns = the union of all spans - compute_ns (communication, memory ops, syncs)
with totals as (
    select
        rank,
        sum(end_ns - start_ns) filter (where span_set = 'all') as busy_ns,
        coalesce(sum(end_ns - start_ns) filter (where span_set = 'compute'), 0) as compute_ns,
        min(start_ns) filter (where span_set = 'all') as first_ns,
        max(end_ns) filter (where span_set = 'all') as last_ns
    from gpu_window
    group by rank
),

final as (
    select
        rank,
        cast(last_ns - first_ns as bigint) as kernel_ns,
        cast(last_ns - first_ns - busy_ns as bigint) as idle_ns,
        cast(compute_ns as bigint) as compute_ns,
        cast(busy_ns - compute_ns as bigint) as non_compute_ns
    from totals
    order by rank
)

select * from final
