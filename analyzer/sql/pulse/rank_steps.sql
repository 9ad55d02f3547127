-- pulse/rank_steps: per (rank, step) of the digests on the connection (digest_spans and
-- digest_collectives, one pulse's steps), what a watch follows between its full looks: the
-- step time, the compute spans, and its own work (the step outside collectives and data
-- loading, as findings/rank_steps.sql), with the rank's class of peers: its pipeline stage and
-- context shard, from the mesh (SPEC §2 rank order; $stage_ranks = world / pp, 0 when the
-- mesh does not cover the world: one class).
-- columns: rank, step, cls, step_ns, compute_ns, work_ns, runq_ns (the step's wait for a core,
-- where recorded)
select
    rank,
    step,
    case when $stage_ranks > 0 then (rank // $stage_ranks) * $cp + (rank // $tp) % $cp else 0 end
        as cls,
    step_ns,
    compute_ns,
    greatest(step_ns - comm_ns - data_ns, 0) as work_ns,
    runq_ns
from rank_step_sums
where has_spans and step between $lo and $hi
