-- checkpoint_steps: per (rank, step) in [$lo, $hi] in which the rank saved a checkpoint, the
-- time of each stage (trainer/checkpoint.py; docs/spec.md §2).
-- columns: rank, step, snapshot_ns, persist_ns, wait_ns, background_ns
--   snapshot_ns    `checkpoint_snapshot`: the copy of the state to host memory (in the step)
--   persist_ns     `checkpoint_persist` of kind host: the write, inside the step (sync mode)
--   wait_ns        `checkpoint_wait`: a snapshot waiting for the previous background write
--   background_ns  `checkpoint_persist` of kind background: the write beside training (async)
with

rows as (
    select rank, step, name, kind, end_ns - start_ns as ns
    from spans
    where name in ('checkpoint_snapshot', 'checkpoint_persist', 'checkpoint_wait')
        and end_ns is not null and step between $lo and $hi
),

final as (
    select
        rank,
        step,
        coalesce(sum(ns) filter (where name = 'checkpoint_snapshot'), 0) as snapshot_ns,
        coalesce(sum(ns) filter (where name = 'checkpoint_persist' and kind <> 'background'), 0)
            as persist_ns,
        coalesce(sum(ns) filter (where name = 'checkpoint_wait'), 0) as wait_ns,
        coalesce(sum(ns) filter (where name = 'checkpoint_persist' and kind = 'background'), 0)
            as background_ns
    from rows
    group by rank, step
)

select * from final order by step, rank
