-- the collectives of ranks $ranks in step $step, keyed as the analyzer matches them across
-- ranks ((group, gid, seq) for a group collective, (group, src, dst, seq) for send/recv);
-- end_ns is null for one that never completed
-- columns: rank, op, group_name, gid, src, dst, seq, group_size, nbytes, start_ns, end_ns
with
final as (
    select rank, op, "group" as group_name, gid, src, dst, seq, group_size, nbytes,
        arrival_ns as start_ns, end_ns
    from collective_rows
    where step = $step and list_contains($ranks, rank)
    order by rank, arrival_ns
)
select * from final
