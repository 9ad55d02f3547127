-- pipeline links: bandwidth of each sender -> receiver pair over steps $first..$last,
-- measured on the sending side (bytes over the time from the transfer's start to its end)
-- columns: src, dst, gbps, transfers, nbytes
with
sends as (
    select rank as src, peer as dst, nbytes, busy_ns as ns, n_done
    from digest_collectives
    where is_send and peer >= 0 and n_done > 0 and busy_ns > 0
        and step between $first and $last
),
final as (
    select src, dst, sum(nbytes) / sum(ns) as gbps, sum(n_done) as transfers,
        sum(nbytes) as nbytes
    from sends
    group by src, dst
    order by gbps
)
select * from final
