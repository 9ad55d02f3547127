-- plan/collectives: the run's collectives by group kind, op, group size and bytes over steps
-- >= $first, with the mean time a member spends in one: from its start to its end (the
-- transfer and the wait for later members, as a rank of this run meets them; an asynchronous
-- collective from when it was waited for, the time it overlapped work left out). A
-- pipeline transfer (op send_recv) is timed from the later posting of its pair: waiting for
-- the upstream stage is the step graph's dependency, not the transfer's cost.
-- columns: kind, op, size, nbytes, n, transfer_s
with

members as (
    select
        "group" as kind, op, group_size as size, nbytes,
        end_ns - coalesce(start_ns, issue_ns) as ns
    from collectives
    where step >= $first
      and op not in ('send', 'recv')
      and end_ns is not null
      and end_ns >= coalesce(start_ns, issue_ns)
      and nbytes is not null
),

transfers as (
    select "group" as kind, op, size, nbytes, transfer_ns as ns
    from collective_instances
    where step >= $first
      and op = 'send_recv'
      and transfer_ns is not null
      and transfer_ns >= 0
      and nbytes is not null
),

final as (
    select kind, op, size, nbytes, count(*) as n, avg(ns) / 1e9 as transfer_s
    from (select * from members union all select * from transfers)
    group by kind, op, size, nbytes
)

select * from final order by kind, op, size, nbytes
