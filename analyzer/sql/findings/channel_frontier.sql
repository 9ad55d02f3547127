-- channel_frontier: for every channel (a group's (group, gid), or a send/recv direction
-- (group, src, dst)) and every member rank, the last seq the rank entered there, and whether its
-- row at that seq was still unfinished (end_ns null). Members that never entered have null.
-- columns: group, gid, src, dst, rank, last_seq, last_op, last_step, last_unfinished
with

reached as (
    select
        "group",
        gid,
        src,
        dst,
        rank,
        max(seq) as last_seq,
        arg_max(op, seq) as last_op,
        arg_max(step, seq) as last_step,
        arg_max(end_ns is null, seq) as last_unfinished
    from collective_rows
    group by "group", gid, src, dst, rank
),

channels as (
    select distinct "group", gid, src, dst from reached
),

members as (
    select c."group", c.gid, c.src, c.dst, m.rank
    from channels as c
    join group_members as m on m."group" = c."group" and m.gid = c.gid
    where c.src < 0
    union
    select c."group", c.gid, c.src, c.dst, unnest([c.src, c.dst]) as rank
    from channels as c
    where c.src >= 0
    union
    select "group", gid, src, dst, rank from reached
),

final as (
    select
        m."group",
        m.gid,
        m.src,
        m.dst,
        m.rank,
        r.last_seq,
        r.last_op,
        r.last_step,
        coalesce(r.last_unfinished, false) as last_unfinished
    from members as m
    left join reached as r
        on r."group" = m."group" and r.gid = m.gid and r.src = m.src and r.dst = m.dst
        and r.rank = m.rank
)

select * from final
