-- bus bandwidth of each process group over steps $first..$last (nccl-tests factors, with n
-- the group's size, applied in digest/collectives.sql) over the time its members spent in
-- its collectives; groups as the analyzer names them: (group, gid), and the first rank of
-- each for display
-- columns: group_name, gid, first_rank, group_size, gbps, calls
with
coll as (
    select
        d."group" as group_name,
        coalesce(m.gid, 0) as gid,
        d.rank,
        m.size as group_size,
        d.bus_bytes,
        d.busy_ns,
        d.n_done
    from digest_collectives as d
    left join group_members as m on m."group" = d."group" and m.rank = d.rank
    where d.peer < 0 and d.n_done > 0 and d.bus_bytes > 0 and d.busy_ns > 0
        and d.step between $first and $last
),
final as (
    select group_name, gid, min(rank) as first_rank, max(group_size) as group_size,
        sum(bus_bytes) / sum(busy_ns) as gbps, sum(n_done) as calls
    from coll
    group by group_name, gid
    order by group_name, gid
)
select * from final
