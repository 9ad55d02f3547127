-- rank_steps: one row per (rank, step) in [$lo, $hi]: the cheap per-step sums the detectors
-- compare among peers, from the digests (sums of span durations, no interval union).
-- columns: rank, step, dp, pp, tp, cp, step_ns, compute_ns, data_ns, comm_ns, own_ns, work_ns
--   step_ns     the `step` span when there is one, else the first start to the last end
--   compute_ns  the compute spans (these may enclose collectives, and the waits in them)
--   comm_ns     time blocked in collectives (arrival to end; sends do not block the sender):
--               waiting for peers plus transfer
--   own_ns      step_ns - comm_ns: the rank's own work and stalls, not its waiting for others
--   work_ns     own_ns - data_ns: its own work other than loading data
with

span_sums as (
    select rank, step, compute_ns, data_ns, step_span_ns, first_ns, last_ns
    from digest_spans
    where step between $lo and $hi
),

comm_sums as (
    select
        rank,
        step,
        sum(busy_ns) as comm_ns,
        min(first_arrival_ns) as first_ns,
        max(last_end_ns) as last_ns
    from digest_collectives
    where step between $lo and $hi and not is_send and n_done > 0
    group by rank, step
),

-- a run that records spans, but none for some (rank, step) (a part lost to corruption), leaves
-- that rank-step out: its time split would be wrong, not slow
span_run as (
    select count(*) > 0 as has_spans from digest_spans
),

joined as (
    select
        coalesce(s.rank, c.rank) as rank,
        coalesce(s.step, c.step) as step,
        coalesce(
            s.step_span_ns,
            greatest(s.last_ns, c.last_ns) - least(s.first_ns, c.first_ns),
            s.last_ns - s.first_ns,
            c.last_ns - c.first_ns
        ) as step_ns,
        coalesce(s.compute_ns, 0) as compute_ns,
        coalesce(s.data_ns, 0) as data_ns,
        coalesce(c.comm_ns, 0) as comm_ns
    from span_sums as s
    full outer join comm_sums as c on c.rank = s.rank and c.step = s.step
    where s.rank is not null or not (select has_spans from span_run)
),

final as (
    select
        j.rank,
        j.step,
        coalesce(k.dp, 0) as dp,
        coalesce(k.pp, 0) as pp,
        coalesce(k.tp, 0) as tp,
        coalesce(k.cp, 0) as cp,
        j.step_ns::bigint as step_ns,
        j.compute_ns::bigint as compute_ns,
        j.data_ns::bigint as data_ns,
        j.comm_ns::bigint as comm_ns,
        greatest(j.step_ns - least(j.comm_ns, j.step_ns), 0)::bigint as own_ns,
        greatest(j.step_ns - least(j.comm_ns, j.step_ns) - j.data_ns, 0)::bigint as work_ns
    from joined as j
    left join rank_coords as k on k.rank = j.rank
)

select * from final
