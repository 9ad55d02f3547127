-- channel_frontier: for every channel (a group's (group, gid), or a send/recv direction
-- (group, src, dst)) and every member rank, how far the rank got there: the last seq it
-- entered, the last it finished, the first it recorded, and its unfinished rows.
-- Members that never used the channel have nulls. Read from digest_frontier
-- (analyzer/sql/digest/frontier.sql).
-- columns: group, gid, src, dst, rank, last_seq, done_seq, min_seq, last_op, last_step,
--          last_issue_ns, open_rows
with

reached as (
    select
        c."group",
        case when c.peer >= 0 then -1 else coalesce(m.gid, 0) end as gid,
        case when c.is_send then c.rank when c.peer >= 0 then c.peer else -1 end as src,
        case when c.is_send then c.peer when c.peer >= 0 then c.rank else -1 end as dst,
        c.rank,
        c.last_seq,
        c.done_seq,
        c.min_seq,
        c.last_op,
        c.last_step,
        c.last_issue_ns,
        c.open_rows
    from digest_frontier as c
    left join group_members as m
        on m."group" = c."group" and m.rank = c.rank and c.peer < 0
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
        r.done_seq,
        r.min_seq,
        r.last_op,
        r.last_step,
        r.last_issue_ns,
        r.open_rows
    from members as m
    left join reached as r
        on r."group" = m."group" and r.gid = m.gid and r.src = m.src and r.dst = m.dst
        and r.rank = m.rank
)

select * from final
