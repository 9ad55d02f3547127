-- collective_instances: the collective instances of steps [$lo, $hi] (see the view's file,
-- views/collective_instances.sql, for the columns and their meaning).
-- columns: group, gid, src, dst, seq, op, step, size, entered, unfinished, nbytes,
--          first_ns, last_ns, second_ns, last_rank, end_ns, blame_ns, transfer_ns, busbw_gbps
with

final as (
    select * from collective_instances where step between $lo and $hi
)

select * from final
