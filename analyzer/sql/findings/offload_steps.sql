-- offload_steps: per (rank, step) in [$lo, $hi] with optimizer-offload spans (kind `offload`,
-- trainer/offload.py; docs/spec.md §2), the time the step waited on them and what they took.
-- columns: rank, step, wait_ns, d2h_ns, update_ns, h2d_ns, d2h_bytes, h2d_bytes
--   wait_ns    `offload_wait`: the training thread waiting for a bucket's parameters to come
--              back before the forward uses them (or for gradients to go down)
--   d2h_ns     the gradients' copies down of the update this step made (they and the
--              update and copies up run beside the next step's forward)
--   update_ns  the host updates of that share
--   h2d_ns     the parameters' copies back up
--   d2h_bytes, h2d_bytes  the bytes those copies moved
with

rows as (
    select rank, step, name, direction, end_ns - start_ns as ns, nbytes
    from spans
    where kind = 'offload' and end_ns is not null and step between $lo and $hi
),

final as (
    select
        rank,
        step,
        coalesce(sum(ns) filter (where name = 'offload_wait'), 0)::bigint as wait_ns,
        coalesce(sum(ns) filter (where direction = 'd2h'), 0)::bigint as d2h_ns,
        coalesce(sum(ns) filter (where direction = 'host_update'), 0)::bigint as update_ns,
        coalesce(sum(ns) filter (where direction = 'h2d'), 0)::bigint as h2d_ns,
        coalesce(sum(nbytes) filter (where direction = 'd2h'), 0)::bigint as d2h_bytes,
        coalesce(sum(nbytes) filter (where direction = 'h2d'), 0)::bigint as h2d_bytes
    from rows
    group by rank, step
)

select * from final order by step, rank
