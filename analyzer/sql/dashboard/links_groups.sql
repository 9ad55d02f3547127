-- bus bandwidth of each process group over steps $first..$last (nccl-tests factors, with n
-- the group's size); groups as the analyzer names them: (group, gid), and the first rank
-- of each for display
-- columns: group_name, gid, first_rank, group_size, gbps, calls
with
coll as (
    select
        "group" as group_name,
        gid,
        rank,
        group_size,
        nbytes * case
            when op = 'all_reduce' then 2.0 * (group_size - 1) / group_size
            when op in ('all_gather', 'reduce_scatter', 'all_to_all')
                then (group_size - 1) * 1.0 / group_size
            else 1.0
        end as bus_bytes,
        end_ns - arrival_ns as ns
    from collective_rows
    where src < 0 and end_ns is not null and end_ns > arrival_ns and nbytes > 0
        and step between $first and $last
),
final as (
    select group_name, gid, min(rank) as first_rank, max(group_size) as group_size,
        sum(bus_bytes) / sum(ns) as gbps, count(*) as calls
    from coll
    group by group_name, gid
    order by group_name, gid
)
select * from final
