-- digest_collectives (table, made once per run): the collectives summed per rank, step and
-- channel, so that detectors and the dashboard never aggregate the raw rows again.
-- A channel is a (group, peer, is_send): a process group's collectives (peer -1), or one
-- direction of a rank's send/recv with one peer. Only finished rows are summed, so a row
-- flushed unfinished and again finished counts once. (Where each channel stopped, for hangs
-- and crashes, is in digest/frontier.sql, made only when a run did not finish cleanly.)
-- columns: rank, group, peer, is_send, step, n_rows, n_done, busy_ns, first_arrival_ns,
--          last_end_ns
--   busy_ns     sum over finished rows of end - arrival (arrival as in collective_rows:
--               the device start where known, else the host call; the posting for send/recv)
with

keyed as (
    select
        rank,
        "group",
        peer,
        op = 'send' as is_send,
        step,
        case
            when op in ('send', 'recv') then issue_ns else coalesce(start_ns, issue_ns)
        end as arrival_ns,
        end_ns
    from collectives
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
        sum(end_ns - arrival_ns) as busy_ns,
        min(arrival_ns) as first_arrival_ns,
        max(end_ns) as last_end_ns
    from keyed
    group by rank, "group", peer, is_send, step
)

select * from final
