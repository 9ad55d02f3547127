-- digest_collectives (table, made once per run): the collectives summed per rank, step and
-- channel, so that detectors and the dashboard never aggregate the raw rows again.
-- A channel is a (group, peer, is_send): a process group's collectives (peer -1), or one
-- direction of a rank's send/recv with one peer. Only finished rows are summed, so a row
-- flushed unfinished and again finished counts once. (Where each channel stopped, for hangs
-- and crashes, is in digest/frontier.sql, made only when a run did not finish cleanly.)
-- columns: rank, group, peer, is_send, step, n_rows, n_done, busy_ns, first_arrival_ns,
--          last_end_ns, nbytes, bus_bytes
--   busy_ns     sum over finished rows of the time the rank was blocked in them: end -
--               arrival (arrival as in collective_rows: the device start where known, else
--               the host call; the posting for a recv); for a host-timed row end - start_ns
--               (the call, or when an async one was waited for); for a send end - transfer
--               start (start_ns, else the posting); for an `untimed` row its estimated wait
--               (views/collectives_timed.sql)
--   nbytes      bytes of the finished rows; bus_bytes the same with the nccl-tests bus
--               factors and the group's size (all-reduce 2(n-1)/n; all-gather,
--               reduce-scatter, all-to-all (n-1)/n; else 1)
with

keyed as (
    select
        rank,
        "group",
        peer,
        op = 'send' as is_send,
        step,
        case
            when op in ('send', 'recv') or source = 'host' then issue_ns
            else coalesce(start_ns, issue_ns)
        end as arrival_ns,
        -- a send does not block its sender: its busy time starts with the transfer
        case when op = 'send' then coalesce(start_ns, issue_ns) end as send_start_ns,
        -- a host-timed row blocks from its start: the call, or the wait() of an async one
        coalesce(wait_from_ns, case when source = 'host' then start_ns end) as wait_from_ns,
        end_ns,
        case when end_ns is not null then nbytes end as done_bytes,
        case
            when op = 'all_reduce' then 2.0 * (group_size - 1) / group_size
            when op in ('all_gather', 'reduce_scatter', 'all_to_all')
                then 1.0 * (group_size - 1) / group_size
            else 1.0
        end as bus_factor
    from collectives_timed
),

final as (
    select
        rank,
        "group",
        peer,
        is_send,
        step,
        count(*) as n_rows,
        count(end_ns) as n_done,
        sum(end_ns - coalesce(send_start_ns, wait_from_ns, arrival_ns)) as busy_ns,
        min(arrival_ns) as first_arrival_ns,
        max(end_ns) as last_end_ns,
        sum(done_bytes) as nbytes,
        sum(done_bytes * bus_factor) as bus_bytes
    from keyed
    group by rank, "group", peer, is_send, step
)

select * from final
