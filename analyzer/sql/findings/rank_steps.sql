-- rank_steps: one row per (rank, step) in [$lo, $hi]: the cheap per-step sums the detectors
-- compare among peers (views/rank_step_sums.sql, from the digests; no interval union).
-- columns: rank, step, dp, pp, tp, cp, step_ns, compute_ns, data_ns, comm_ns, own_ns, work_ns
--   step_ns     the `step` span when there is one, else the first start to the last end
--   compute_ns  the compute spans (these may enclose collectives, and the waits in them)
--   comm_ns     time blocked in collectives (arrival to end): waiting for peers plus transfer;
--               sends count where they block their caller: on a host-timed run (the DuckDB
--               variable megascope_sends_block, set by the findings' Context from run.json's
--               device), a send's busy time is the caller's wait in it (gloo: until the
--               receiver takes the data; a pipeline stage waits there for the next one),
--               disjoint from the receive waited after it; on a device-timed run a send shares
--               its kernel time with the receive posted beside it, so only receives count
--   own_ns      step_ns - comm_ns: the rank's own work and stalls, not its waiting for others
--   work_ns     own_ns - data_ns: its own work other than loading data
with

-- a run that records spans, but none for some (rank, step) (a part lost to corruption), leaves
-- that rank-step out: its time split would be wrong, not slow
span_run as (
    select count(*) > 0 as has_spans from digest_spans
),

picked as (
    select *
    from rank_step_sums
    where step between $lo and $hi
        and (has_spans or (has_comm and not (select has_spans from span_run)))
),

sends as (
    select rank, step, sum(busy_ns) as send_ns
    from digest_collectives
    where is_send and n_done > 0 and step between $lo and $hi
        and coalesce(getvariable('megascope_sends_block'), false)
    group by rank, step
),

blocked as (
    select p.*, p.comm_ns + coalesce(s.send_ns, 0) as blocked_ns
    from picked as p
    left join sends as s on s.rank = p.rank and s.step = p.step
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
        j.blocked_ns::bigint as comm_ns,
        greatest(j.step_ns - least(j.blocked_ns, j.step_ns), 0)::bigint as own_ns,
        greatest(j.step_ns - least(j.blocked_ns, j.step_ns) - j.data_ns, 0)::bigint as work_ns
    from blocked as j
    left join rank_coords as k on k.rank = j.rank
)

select * from final
