-- pipeline links: bandwidth of each sender -> receiver pair over steps $first..$last,
-- measured on the sending side
-- columns: src, dst, gbps, transfers, nbytes
with
sends as (
    select rank as src, peer as dst, nbytes, end_ns - start_ns as ns
    from collectives
    where op = 'send' and peer >= 0 and end_ns is not null and end_ns > start_ns
        and step between $first and $last
),
final as (
    select src, dst, sum(nbytes) / sum(ns) as gbps, count(*) as transfers,
        sum(nbytes) as nbytes
    from sends
    group by src, dst
    order by gbps
)
select * from final
