-- collective_instances (view): one row per collective instance (all members' rows of one
-- (group, gid, src, dst, seq)), with arrival skew and transfer time. The step is part of the
-- key so that a filter on it is pushed down to the scan.
-- columns: group, gid, src, dst, seq, op, step, size, entered, unfinished, nbytes,
--          first_ns, last_ns, second_ns, last_rank, blame_ns, end_ns, transfer_ns, busbw_gbps
--   arrival = device start where known, else the host issue time (MegaScale: arrival, not
--   duration); blame_ns = last arrival - second-to-last arrival (what the others waited for
--   the last one alone); end_ns = the receiver's end for send/recv, else the earliest end;
--   transfer_ns = end_ns - last arrival; busbw with nccl-tests factors and the group's size.
with

rows as (
    select * from collective_rows
),

instances as (
    select
        "group",
        gid,
        src,
        dst,
        seq,
        case when src >= 0 then 'send_recv' else any_value(op) end as op,
        step,
        case when src >= 0 then 2 else coalesce(max(group_size), count(*)) end as size,
        count(*) as entered,
        count(*) filter (where end_ns is null) as unfinished,
        max(nbytes) as nbytes,
        min(arrival_ns) as first_ns,
        max(arrival_ns) as last_ns,
        list_sort(list(arrival_ns), 'DESC')[2] as second_ns,
        arg_max(rank, [arrival_ns, rank]) as last_rank,  -- ties: the highest rank
        coalesce(max(end_ns) filter (where op = 'recv'), min(end_ns)) as end_ns
    from rows
    group by "group", gid, src, dst, seq, step
),

final as (
    select
        *,
        coalesce(last_ns - second_ns, 0) as blame_ns,
        end_ns - last_ns as transfer_ns,
        case
            when end_ns is null or end_ns <= last_ns then null
            else nbytes * (
                case
                    when op = 'all_reduce' then 2.0 * (size - 1) / size
                    when op in ('all_gather', 'reduce_scatter', 'all_to_all')
                        then 1.0 * (size - 1) / size
                    else 1.0
                end
            ) / (end_ns - last_ns)
        end as busbw_gbps
    from instances
)

select * from final
