-- rank_step_sums (view): one row per (rank, step), the digests' sums side by side; what the
-- detectors (findings/rank_steps.sql) and the dashboard's cache of large runs
-- (rank_steps/rank_step_digest.sql) compare. Sums of span durations, no interval union.
-- columns: rank, step, has_spans, has_comm, t0_ns, t1_ns, step_ns, compute_ns, data_ns,
--          comm_ns, bus_bytes, bus_ns, runq_ns
--   has_spans   the rank recorded spans in the step; has_comm: collectives other than sends
--   t0_ns, t1_ns  first start and last end of its spans and (non-send) collectives
--   step_ns     the `step` span when there is one, else t1_ns - t0_ns
--   compute_ns  the compute spans (these may enclose collectives, and the waits in them)
--   comm_ns     time blocked in collectives (arrival to end; sends do not block the sender):
--               waiting for peers plus transfer
--   bus_bytes   bytes with the nccl-tests bus factors (sends included); bus_ns the time in
--               the collectives that moved them
--   runq_ns     the `step` span's wait for a core, where recorded (else null)
with

comm as (
    select
        rank,
        step,
        count(*) filter (where not is_send) > 0 as has_comm,
        sum(busy_ns) filter (where not is_send) as comm_ns,
        min(first_arrival_ns) filter (where not is_send) as first_ns,
        max(last_end_ns) filter (where not is_send) as last_ns,
        sum(bus_bytes) as bus_bytes,
        sum(busy_ns) filter (where bus_bytes > 0) as bus_ns
    from digest_collectives
    where n_done > 0
    group by rank, step
),

final as (
    select
        coalesce(s.rank, c.rank) as rank,
        coalesce(s.step, c.step) as step,
        s.rank is not null as has_spans,
        coalesce(c.has_comm, false) as has_comm,
        -- greatest and least skip nulls: either side alone gives its own window
        least(s.first_ns, c.first_ns) as t0_ns,
        greatest(s.last_ns, c.last_ns) as t1_ns,
        coalesce(s.step_span_ns, greatest(s.last_ns, c.last_ns) - least(s.first_ns, c.first_ns))
            as step_ns,
        coalesce(s.compute_ns, 0) as compute_ns,
        coalesce(s.data_ns, 0) as data_ns,
        coalesce(c.comm_ns, 0) as comm_ns,
        coalesce(c.bus_bytes, 0) as bus_bytes,
        coalesce(c.bus_ns, 0) as bus_ns,
        s.step_runq_ns as runq_ns
    from digest_spans as s
    full outer join comm as c on c.rank = s.rank and c.step = s.step
)

select * from final
