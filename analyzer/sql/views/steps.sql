-- steps: one row per (rank, step), the step's time split by what the rank was doing.
-- columns: rank, step, step_ns, compute_ns, comm_ns, exposed_comm_ns, idle_ns
--   step_ns          the rank's `step` span when it has one, else first start to last end
--   compute_ns       union of the rank's compute spans (nested spans count once)
--   comm_ns          union of its collectives and comm spans
--   exposed_comm_ns  communication not hidden under compute: |compute ∪ comm| - |compute|
--   idle_ns          step time covered by no span and no collective
-- intervals are clipped to the step span; unfinished rows (end_ns null), `background` spans
-- (beside the training loop: an asynchronous checkpoint's write) and `offload` spans (copies
-- and host updates beside it; a wait for them lies inside a forward, which holds it) are left
-- out.
with

step_spans as (
    select rank, step, min(start_ns) as s0, max(end_ns) as s1
    from spans
    where name = 'step' and end_ns is not null
    group by rank, step
),

raw_intervals as (
    select rank, step, kind as cat, start_ns as s, end_ns as e
    from spans
    where name <> 'step' and kind not in ('background', 'offload') and end_ns is not null
        and step is not null
    union all
    select rank, step, 'comm' as cat, arrival_ns as s, end_ns as e
    from collective_rows
    where end_ns is not null and step is not null
),

bounds as (
    select
        r.rank,
        r.step,
        coalesce(any_value(ss.s0), min(r.s)) as s0,
        coalesce(any_value(ss.s1), max(r.e)) as s1
    from raw_intervals as r
    left join step_spans as ss on ss.rank = r.rank and ss.step = r.step
    group by r.rank, r.step
    union all
    select ss.rank, ss.step, ss.s0, ss.s1
    from step_spans as ss
    anti join raw_intervals as r on r.rank = ss.rank and r.step = ss.step
),

clipped as (
    select r.rank, r.step, r.cat, greatest(r.s, b.s0) as s, least(r.e, b.s1) as e
    from raw_intervals as r
    join bounds as b on b.rank = r.rank and b.step = r.step
),

layered as (
    select rank, step, 'compute' as layer, s, e from clipped where cat = 'compute' and e > s
    union all
    select rank, step, 'busy_cc' as layer, s, e
    from clipped where cat in ('compute', 'comm') and e > s
    union all
    select rank, step, 'comm' as layer, s, e from clipped where cat = 'comm' and e > s
    union all
    select rank, step, 'busy_all' as layer, s, e from clipped where e > s
),

ordered as (
    select
        *,
        max(e) over (
            partition by rank, step, layer order by s, e
            rows between unbounded preceding and 1 preceding
        ) as prev_end
    from layered
),

islands as (
    select
        *,
        sum(case when prev_end is null or s > prev_end then 1 else 0 end) over (
            partition by rank, step, layer order by s, e rows unbounded preceding
        ) as island
    from ordered
),

merged as (
    select rank, step, layer, min(s) as s, max(e) as e
    from islands
    group by rank, step, layer, island
),

lengths as (
    select
        rank,
        step,
        sum(case when layer = 'compute' then e - s else 0 end) as compute_ns,
        sum(case when layer = 'comm' then e - s else 0 end) as comm_ns,
        sum(case when layer = 'busy_cc' then e - s else 0 end) as busy_cc_ns,
        sum(case when layer = 'busy_all' then e - s else 0 end) as busy_all_ns
    from merged
    group by rank, step
),

final as (
    select
        b.rank,
        b.step,
        (b.s1 - b.s0)::bigint as step_ns,
        coalesce(l.compute_ns, 0)::bigint as compute_ns,
        coalesce(l.comm_ns, 0)::bigint as comm_ns,
        coalesce(l.busy_cc_ns - l.compute_ns, 0)::bigint as exposed_comm_ns,
        greatest(b.s1 - b.s0 - coalesce(l.busy_all_ns, 0), 0)::bigint as idle_ns
    from bounds as b
    left join lengths as l on l.rank = b.rank and l.step = b.step
)

select * from final
