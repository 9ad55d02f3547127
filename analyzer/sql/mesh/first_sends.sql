-- mesh/first_sends: each rank's first send to each peer in each step, which orients a
-- pipeline: a microbatch's activations go forward before its gradients come back (steps $lo
-- to $hi)
-- columns: rank, peer, step, first_ns
with

final as (
    select rank, peer, step, min(issue_ns) as first_ns
    from collectives
    where op = 'send' and step between $lo and $hi and peer >= 0 and issue_ns is not null
    group by all
)

select * from final order by rank, peer, step
