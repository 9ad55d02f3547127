-- gpu_breakdown: Holistic Trace Analysis's temporal breakdown of each rank's device time.
-- output columns: rank, kernel_ns, idle_ns, compute_ns, non_compute_ns
--
-- Over the device spans (source 'cuda': kernels, memcpys, memsets) of each rank:
--   kernel_ns      = end of the last span - start of the first
--   idle_ns        = kernel_ns - the union of all spans (gaps with nothing on any stream)
--   compute_ns     = the union of the compute spans (kind 'compute')
--   non_compute_ns = the union of all spans - compute_ns (communication, memory ops)
-- Overlapping spans (several streams) are merged before they are summed. As HTA does, the
-- last step is left out when a rank has several (a profiler window may cut it short); spans
-- launched before the first step (step -1) stay in.
with device as (
    select rank, step, kind, start_ns, end_ns
    from spans
    where source = 'cuda' and end_ns is not null
),

step_counts as (
    select
        rank,
        count(distinct step) filter (where step >= 0) as n_steps,
        max(step) as last_step
    from device
    group by rank
),

windowed as (
    select d.rank, d.kind, d.start_ns, d.end_ns
    from device as d
    inner join step_counts as s on d.rank = s.rank
    where s.n_steps < 2 or d.step < s.last_step
),

sets as (
    select rank, 'all' as span_set, start_ns, end_ns from windowed
    union all
    select rank, 'compute' as span_set, start_ns, end_ns from windowed where kind = 'compute'
),

ordered as (
    select
        rank,
        span_set,
        start_ns,
        end_ns,
        max(end_ns) over (
            partition by rank, span_set order by start_ns, end_ns
            rows between unbounded preceding and 1 preceding
        ) as prev_end_ns
    from sets
),

islands as (
    select
        rank,
        span_set,
        start_ns,
        end_ns,
        sum(case when prev_end_ns is null or start_ns > prev_end_ns then 1 else 0 end) over (
            partition by rank, span_set order by start_ns, end_ns
            rows between unbounded preceding and current row
        ) as island
    from ordered
),

merged as (
    select rank, span_set, island, min(start_ns) as start_ns, max(end_ns) as end_ns
    from islands
    group by rank, span_set, island
),

totals as (
    select
        rank,
        sum(end_ns - start_ns) filter (where span_set = 'all') as busy_ns,
        coalesce(sum(end_ns - start_ns) filter (where span_set = 'compute'), 0) as compute_ns,
        min(start_ns) filter (where span_set = 'all') as first_ns,
        max(end_ns) filter (where span_set = 'all') as last_ns
    from merged
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
