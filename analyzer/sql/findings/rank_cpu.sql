-- rank_cpu: one row per (rank, step) in [$lo, $hi] whose spans counted CPU time: the CPU time
-- the rank's training thread spent in the step (spans.cpu_ns), which no wait for a peer or for
-- a core lengthens, and the time it waited, runnable, for a core (spans.runq_ns). Read only for
-- runs whose spans are host-timed (a CPU device).
-- columns: rank, step, cpu_ns, runq_ns
--   cpu_ns   the `step` span's, else the sum of the step's compute spans'
--   runq_ns  the same span's or spans' run-queue delay; null where the run did not record it
with

per_step as (
    select
        rank,
        step,
        sum(cpu_ns) filter (where name = 'step' and kind = 'host') as step_cpu_ns,
        sum(cpu_ns) filter (where kind = 'compute') as compute_cpu_ns,
        sum(runq_ns) filter (where name = 'step' and kind = 'host') as step_runq_ns,
        sum(runq_ns) filter (where kind = 'compute') as compute_runq_ns
    from spans
    where step between $lo and $hi and cpu_ns is not null
    group by rank, step
),

final as (
    select
        rank,
        step,
        coalesce(step_cpu_ns, compute_cpu_ns)::bigint as cpu_ns,
        coalesce(step_runq_ns, compute_runq_ns)::bigint as runq_ns
    from per_step
    where coalesce(step_cpu_ns, compute_cpu_ns) > 0
)

select * from final
