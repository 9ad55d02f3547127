-- digest_collectives (digest/collectives.sql) from stored digests rows (the view
-- digest_source: the run's `digests` table or its cache), added up again per rank, step and
-- channel: a writer's rows of one step may come from several flushes. Same columns and types.
select
    rank,
    "group",
    peer,
    cast(is_send as boolean) as is_send,
    step,
    cast(sum(n_rows) as bigint) as n_rows,
    cast(sum(n_done) as bigint) as n_done,
    sum(busy_ns) as busy_ns,
    min(first_ns) as first_arrival_ns,
    max(last_ns) as last_end_ns,
    sum(nbytes) as nbytes,
    sum(bus_bytes) as bus_bytes
from digest_source
where kind = 'collectives'
group by rank, "group", peer, is_send, step
