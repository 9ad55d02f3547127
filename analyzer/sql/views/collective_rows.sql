-- collective_rows (view): the collectives, one row per (rank, group, seq, peer, op)
-- (a row flushed unfinished and again finished counts once, as finished), keyed by the channel
-- that matches it across ranks: (group, gid) for collectives, (group, src, dst) for send/recv.
-- columns: rank, group, gid, src, dst, seq, op, step, group_size, nbytes, arrival_ns, end_ns
--   arrival_ns  when the rank was ready: the device start where known (a kernel starts when
--               the stream reaches it, then waits for peers), else the host call (start_ns of
--               a host-timed async row is when it was waited for); for send/recv the time it
--               was posted (start_ns there is when the transfer began)
--   end_ns      for an `untimed` row, the estimate of views/collectives_timed.sql
with

folded as (
    select
        rank,
        "group",
        seq,
        peer,
        op,
        min(step) as step,
        max(group_size) as group_size,
        max(nbytes) as nbytes,
        min(
            case
                when op in ('send', 'recv') or source = 'host' then issue_ns
                else coalesce(start_ns, issue_ns)
            end
        ) as arrival_ns,
        max(end_ns) as end_ns
    from collectives_timed
    group by rank, "group", seq, peer, op
),

final as (
    select
        f.rank,
        f."group",
        case when f.op in ('send', 'recv') then -1 else coalesce(m.gid, 0) end as gid,
        case
            when f.op = 'send' then f.rank when f.op = 'recv' then f.peer else -1
        end as src,
        case
            when f.op = 'send' then f.peer when f.op = 'recv' then f.rank else -1
        end as dst,
        f.seq,
        f.op,
        f.step,
        f.group_size,
        f.nbytes,
        f.arrival_ns,
        f.end_ns
    from folded as f
    left join group_members as m on m."group" = f."group" and m.rank = f.rank
)

select * from final
