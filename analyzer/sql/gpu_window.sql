-- gpu_window: the device time Holistic Trace Analysis (HTA) analyses, per rank, as merged
-- intervals; gpu_breakdown and comm_overlap sum it.
-- output columns: rank, span_set ('all' | 'compute' | 'comm'), start_ns, end_ns
--
-- The window: the device spans (source 'cuda': kernels, memcpys, memsets, other device work)
-- of each rank; like HTA, a rank's last profiler step is left out when it has several (a
-- profiler window may cut it short; the Kineto importer gives a device span the step HTA
-- draws it in). The last step is the host `step` span that starts last; a rank without
-- `step` spans counts the steps of its device spans. Spans launched before the first step
-- (step -1) stay in.
-- The sets, with HTA's names for kernel types:
--   all      every span of the window
--   compute  HTA's computation kernels: not communication (kind 'comm', an NCCL kernel) and
--            not named like a memory or synchronization op (^Memcpy, ^Memset, ^dma, or a name
--            holding Memcpy or Sync, as HTA's name patterns have it)
--   comm     communication (kind 'comm')
-- Overlapping spans (several streams) are merged into islands within each set.
with device as (
    select rank, step, kind, name, start_ns, end_ns
    from spans
    where source = 'cuda' and end_ns is not null
),

host_steps as (
    select rank, count(distinct step) as n_steps, arg_max(step, start_ns) as last_step
    from spans
    where source = 'host' and name = 'step' and step is not null
    group by rank
),

device_steps as (
    select rank, count(distinct step) filter (where step >= 0) as n_steps, max(step) as last_step
    from device
    group by rank
),

step_counts as (
    select
        d.rank,
        coalesce(h.n_steps, d.n_steps) as n_steps,
        coalesce(h.last_step, d.last_step) as last_step
    from device_steps as d
    left join host_steps as h on d.rank = h.rank
),

windowed as (
    select
        d.rank,
        d.kind,
        d.start_ns,
        d.end_ns,
        d.kind <> 'comm'
        and not regexp_matches(d.name, '^nccl.*Kernel|^Memset|^dma|Memcpy|Sync')
            as is_compute
    from device as d
    inner join step_counts as s on d.rank = s.rank
    where s.n_steps < 2 or coalesce(d.step, -1) <> s.last_step
),

sets as (
    select rank, 'all' as span_set, start_ns, end_ns from windowed
    union all
    select rank, 'compute' as span_set, start_ns, end_ns from windowed where is_compute
    union all
    select rank, 'comm' as span_set, start_ns, end_ns from windowed where kind = 'comm'
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

final as (
    select rank, span_set, min(start_ns) as start_ns, max(end_ns) as end_ns
    from islands
    group by rank, span_set, island
)

select * from final
